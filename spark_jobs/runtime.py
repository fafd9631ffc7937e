"""Where a job ran: the Spark master, the application, and, on a cluster, where each executor's Python took georep
from. The audit's report carries it (``runtime``), so that a run on a cluster shows that its executors ran the code
that ``spark-submit`` shipped (``deploy/spark/submit.sh``), not some copy installed on the nodes.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

PROBE_TASKS_PER_CORE = 2  # enough tasks that every executor, one core each or more, likely runs one


def executor_origin(_: int) -> tuple[str, str, str, str]:
    """On an executor: (host, the executor's work dir, its Python, the file georep was imported from).

    A standalone worker starts each executor in ``WORK_DIR/<app id>/<executor id>/`` and its Python workers
    there, so the work dir names the executor."""
    import georep

    return socket.gethostname(), os.getcwd(), sys.executable, os.path.abspath(str(georep.__file__))


def describe(spark: Any) -> dict[str, Any]:
    """The master, application id and UI of ``spark``'s application; on a master other than ``local``, one entry
    per executor Python that ran a probe task: its host, work dir, interpreter and georep's file."""
    sc = spark.sparkContext
    out: dict[str, Any] = {
        "master": sc.master,
        "app_id": sc.applicationId,
        "spark_version": sc.version,
        "ui": sc.uiWebUrl,
        "executors": [],
    }
    if not sc.master.startswith("local"):
        tasks = max(1, sc.defaultParallelism * PROBE_TASKS_PER_CORE)
        rows = sc.parallelize(range(tasks), tasks).map(executor_origin).distinct().collect()
        out["executors"] = [{"host": h, "work_dir": w, "python": p, "georep": g} for h, w, p, g in sorted(set(rows))]
    return out
