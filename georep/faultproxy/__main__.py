"""``python -m georep.faultproxy --listen 127.0.0.1:8474``: serve the Toxiproxy API until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from georep.faultproxy.proxy import FaultProxy

DEFAULT_LISTEN = "127.0.0.1:8474"  # Toxiproxy's default API port


async def serve(host: str, port: int, seed: int | None) -> None:
    proxy = FaultProxy(seed)
    address = await proxy.start(host, port)
    print(f"georep fault proxy: Toxiproxy API on http://{address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await proxy.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m georep.faultproxy", description=__doc__)
    parser.add_argument("--listen", default=DEFAULT_LISTEN, help=f"API address HOST:PORT (default {DEFAULT_LISTEN})")
    parser.add_argument("--seed", type=int, default=None, help="seed of the toxics' random draws (jitter, toxicity)")
    args = parser.parse_args(argv)
    host, sep, port = args.listen.rpartition(":")
    if not sep or not host or not port.isdigit():
        parser.error(f"--listen {args.listen!r}: expected HOST:PORT, for example {DEFAULT_LISTEN}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(host, int(port), args.seed))
    except OSError as exc:
        print(
            f"georep fault proxy: cannot listen on {args.listen}: {exc.strerror or exc}; choose another port",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
