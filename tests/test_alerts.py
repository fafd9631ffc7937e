"""Issue 26: the alert rules shipped in ``deploy/prometheus/``. ``promtool`` checks them and runs their unit tests
(``georep-alerts.test.yml``); a real Prometheus server scrapes a running site and its link-down alert goes active
after ``georep link cut`` (pending, then firing once its ``for`` has passed: that timing is what the unit tests
cover, on Prometheus's own rule engine)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.ports import free_ports
from tests.support.sites import Sites, wait_until

PROMETHEUS_DIR = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "georep-alerts.yml"
INSTALL = "apt-get install -y prometheus (make test does where it can)"


def tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed, so the alert rules are not checked: {INSTALL}")
    return found


def test_the_rules_and_the_example_configuration_pass_promtool_check() -> None:
    promtool = tool("promtool")
    for args in (["check", "rules", str(RULES)], ["check", "config", str(PROMETHEUS_DIR / "prometheus.yml")]):
        done = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_has_a_unit_test_and_they_pass() -> None:
    promtool = tool("promtool")
    tests = PROMETHEUS_DIR / "georep-alerts.test.yml"
    named = {line.split(":", 1)[1].strip() for line in RULES.read_text().splitlines() if "- alert:" in line}
    tested = {line.split(":", 1)[1].strip() for line in tests.read_text().splitlines() if "alertname:" in line}
    assert named == tested, f"alerts without a unit test: {sorted(named - tested)}"
    done = subprocess.run([promtool, "test", "rules", str(tests)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def prometheus_config(targets: dict[str, str]) -> str:
    """Prometheus scraping each site's node (``site: metrics address``) every second, with the shipped rules."""
    groups = "".join(
        f'      - targets: ["{address}"]\n        labels: {{site: {site}}}\n' for site, address in targets.items()
    )
    return (
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"rule_files:\n  - {RULES}\n"
        f"scrape_configs:\n  - job_name: georep\n    static_configs:\n{groups}"
    )


def api(port: int, path: str) -> dict:  # type: ignore[type-arg]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/{path}", timeout=5) as response:
        return json.loads(response.read())["data"]  # type: ignore[no-any-return]


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[dict[str, str]], int]]:
    """Starts a Prometheus server on the targets given; returns its port. Stopped at teardown."""
    binary = tool("prometheus")
    started: list[subprocess.Popen[bytes]] = []
    log = (tmp_path / "prometheus.log").open("wb")

    def start(targets: dict[str, str]) -> int:
        config = tmp_path / "prometheus.yml"
        config.write_text(prometheus_config(targets))
        (port,) = free_ports(1)
        started.append(
            subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        )
        wait_until("Prometheus answers", lambda: _answers(port), 60)
        return port

    yield start
    for process in started:
        process.terminate()
        process.wait(timeout=30)
    log.close()


def _answers(port: int) -> bool:
    try:
        api(port, "status/buildinfo")
    except OSError:
        return False
    return True


def active_alerts(port: int, name: str) -> list[dict[str, object]]:
    return [a for a in api(port, "alerts")["alerts"] if a["labels"]["alertname"] == name]


def up_targets(port: int) -> set[str]:
    return {t["labels"]["site"] for t in api(port, "targets")["activeTargets"] if t["health"] == "up"}


@pytest.mark.slow  # two sites and a Prometheus server (about 15 s)
def test_a_real_prometheus_sees_the_link_down_alert_after_georep_link_cut(
    make_sites: Callable[..., Sites], prometheus: Callable[[dict[str, str]], int]
) -> None:
    sites = make_sites(["a", "b"], [("a", "b"), ("b", "a")])
    sites.start()
    port = prometheus({s: n.metrics_address for s, n in sites.nodes.items()})
    wait_until("Prometheus scrapes both nodes", lambda: up_targets(port) == {"a", "b"}, 60)
    streaming = urllib.parse.quote('georep_link_state{src="a",dst="b",state="streaming"}')
    wait_until(
        "a -> b streams", lambda: [r["value"][1] for r in api(port, f"query?query={streaming}")["result"]] == ["1"], 60
    )
    assert active_alerts(port, "GeorepLinkDown") == []

    cut = subprocess.run(
        [sys.executable, "-m", "georep.cli", "link", "cut", "a", "b", "--topology", str(sites.topology)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cut.returncode == 0, cut.stderr
    wait_until("GeorepLinkDown is active", lambda: active_alerts(port, "GeorepLinkDown"), 60)
    (alert,) = active_alerts(port, "GeorepLinkDown")
    labels = alert["labels"]
    assert isinstance(labels, dict)
    assert (labels["src"], labels["dst"], labels["site"], labels["state"]) == ("a", "b", "b", "down")
    assert alert["state"] in ("pending", "firing")
