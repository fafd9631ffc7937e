"""A real Spark standalone cluster on 127.0.0.1: one master and its workers, started with pyspark's own
``bin/spark-class``, for the tests that submit jobs to ``spark://`` as a user's cluster would run them.

Each daemon runs in its own process group (its executors and their Python workers are its children, so in it
too), with its work and log dirs under the test's dir, and is killed with its whole group on :meth:`close`,
whatever state the test left it in. Workers are small (1 core, 1 GiB each by default): two of them and a driver
fit a 2-core machine.

:func:`python_without_checkout` makes the Python that executors run in the tests: the virtualenv's
third-party packages without georep's editable install, so that an executor imports georep only from what
``spark-submit`` shipped (``deploy/spark/submit.sh``), as on a cluster whose nodes never saw the checkout.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.ports import free_ports

MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
DAEMON_MEMORY = "256m"  # the master's and workers' own JVM heaps; executors get the workers' --memory
# The daemons and spark-class's launcher do little work but start cold: the quick compiler alone and one GC thread
# take about half the CPU off their start (C2 and parallel GC threads compile and collect for nothing here).
QUICK_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
PR_SET_PDEATHSIG = 1  # prctl(2)
START_TIMEOUT_S = 90.0  # a cold JVM start on a loaded 2-core machine takes 5-10 s; give it room
LOG_TAIL_CHARS = 3000
# The daemons log INFO to their stdout/stderr files: the logs say where each one bound and who registered.
DAEMON_LOG4J = """\
rootLogger.level = info
rootLogger.appenderRef.stdout.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss.SSS} %p %c{1}: %m%n
logger.hadoop.name = org.apache.hadoop.util.NativeCodeLoader
logger.hadoop.level = error
"""


class ClusterStartError(RuntimeError):
    """A daemon exited or did not come up in time; the message carries its log's tail."""


def _die_with_parent() -> None:
    """In the child before it runs spark-class: SIGKILL it when the test process dies without a teardown (killed
    itself), so that no daemon outlives the run. The signal survives the exec of the JVM."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def spark_home() -> Path:
    """The Spark that pip's pyspark carries (its jars and bin/), as spark-submit from the virtualenv uses."""
    import pyspark

    return Path(pyspark.__file__).parent


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    except OSError:
        return "(no log)"


@dataclass
class Daemon:
    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL to the daemon's whole process group: its JVM, the executors it launched and their Pythons."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILL is not refused; never hang a teardown
            self.process.wait(timeout=10)


@dataclass
class SparkCluster:
    """A master and ``workers`` workers; ``master_url`` is what ``spark-submit --master`` takes."""

    root: Path
    workers: int = 2
    cores: int = 1
    memory: str = "1g"
    daemons: list[Daemon] = field(default_factory=list)
    master_url: str = ""
    ui_url: str = ""

    def start(self, timeout_s: float = START_TIMEOUT_S) -> SparkCluster:
        """Start the master, then the workers, and return when every worker has registered with the master."""
        deadline = time.monotonic() + timeout_s
        try:
            port, ui_port = free_ports(2)
            self._spawn(
                "master", [MASTER_CLASS, "--host", "127.0.0.1", "--port", str(port), "--webui-port", str(ui_port)]
            )
            self.master_url, self.ui_url = self._master_addresses(deadline)
            # The workers start once the master has bound its port, not once it answers: their own cold start
            # (spark-class's launcher JVM, then theirs) outlasts the second the master takes to become leader.
            for i in range(self.workers):
                work = self.root / f"worker-{i + 1}" / "work"
                work.mkdir(parents=True)
                # Port 0: the worker's RPC and web UI ports are the kernel's pick; only the master's must be known.
                args = ["--host", "127.0.0.1", "--port", "0", "--webui-port", "0", "--cores", str(self.cores)]
                scratch = self.root / f"worker-{i + 1}" / "local"  # its executors' shuffle and block files
                scratch.mkdir()
                self._spawn(
                    f"worker-{i + 1}",
                    [WORKER_CLASS, *args, "--memory", self.memory, "--work-dir", str(work), self.master_url],
                    {"SPARK_LOCAL_DIRS": str(scratch)},
                )
            self._wait(f"{self.workers} workers registered with the master", self._all_registered, deadline)
        except BaseException:
            self.close()
            raise
        return self

    def _env(self) -> dict[str, str]:
        conf = self.root / "conf"
        conf.mkdir(parents=True, exist_ok=True)
        (conf / "log4j2.properties").write_text(DAEMON_LOG4J)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_", "SPARK_")) and k != "PYTHONPATH"}
        env.update(
            SPARK_HOME=str(spark_home()),
            SPARK_CONF_DIR=str(conf),
            SPARK_LOCAL_IP="127.0.0.1",
            SPARK_DAEMON_MEMORY=DAEMON_MEMORY,
            SPARK_DAEMON_JAVA_OPTS=QUICK_JVM,
            SPARK_LAUNCHER_OPTS=QUICK_JVM,
            # No REST submission server (it would take port 6066, shared by every cluster on the machine).
            SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false",
        )
        return env

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        logs = self.root / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = logs / f"{name}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [str(spark_home() / "bin" / "spark-class"), *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                env={**self._env(), **(env or {})},
                start_new_session=True,  # its own process group, killed whole by close()
                preexec_fn=_die_with_parent,
            )
        self.daemons.append(Daemon(name, process, log))

    def _master_addresses(self, deadline: float) -> tuple[str, str]:
        """The master's URL and web UI as its log says it bound them (Spark moves to the next port if one is taken)."""
        master = self.daemons[0]
        found: dict[str, str] = {}

        def bound() -> bool:
            text = master.log.read_text(errors="replace")
            url = re.search(r"Starting Spark master at (spark://\S+)", text)
            ui = re.search(r"MasterWebUI: .*started at http://[^:/]+:(\d+)", text)
            if url and ui:
                found.update(url=url.group(1), ui=f"http://127.0.0.1:{ui.group(1)}")
            return bool(found)

        self._wait("the master binds its ports", bound, deadline)
        return found["url"], found["ui"]

    def _wait(self, what: str, cond: Any, deadline: float) -> None:
        while True:
            dead = [d for d in self.daemons if not d.alive()]
            if dead:
                d = dead[0]
                raise ClusterStartError(
                    f"Spark {d.name} exited ({d.process.returncode}) before {what}:\n{_tail(d.log)}"
                )
            if cond():
                return
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {d.name}\n{_tail(d.log)}" for d in self.daemons)
                raise ClusterStartError(f"timed out waiting until {what}:\n{tails}")
            time.sleep(0.1)

    def state(self) -> dict[str, Any] | None:
        """The master's state (its web UI's ``/json/``: workers, applications), or None if it does not answer."""
        try:
            with urllib.request.urlopen(f"{self.ui_url}/json/", timeout=2) as answer:
                state: dict[str, Any] = json.load(answer)
                return state
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def _all_registered(self) -> bool:
        state = self.state()
        return state is not None and state.get("aliveworkers", 0) >= self.workers

    def applications(self) -> list[dict[str, Any]]:
        """Every application the master ran or runs (``/json/``'s completed and active apps)."""
        state = self.state() or {}
        return [*state.get("completedapps", []), *state.get("activeapps", [])]

    def close(self) -> None:
        for d in reversed(self.daemons):
            d.kill()

    def pids(self) -> list[int]:
        return [d.process.pid for d in self.daemons]


def python_without_checkout(where: Path) -> Path:
    """A Python with the third-party packages of this virtualenv but not georep: a virtualenv whose one
    ``.pth`` line names this one's site-packages. Python processes ``.pth`` files only in site dirs, not in a
    directory a ``.pth`` adds, so the editable install's finder (a ``.pth`` there) never runs in it, and an
    ``import georep`` finds only what ``PYTHONPATH`` gives it (what spark-submit shipped)."""
    site_packages = sysconfig.get_paths(vars={"base": sys.prefix, "platbase": sys.prefix})["purelib"]
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(where)], check=True)  # type: ignore[attr-defined]
    ours = sysconfig.get_paths(vars={"base": str(where), "platbase": str(where)})["purelib"]
    Path(ours, "base-packages.pth").write_text(site_packages + "\n")
    return where / "bin" / "python"
