"""The SparkSession the audit jobs run in: quiet, the georep source registered.

Under ``spark-submit`` the master and any ``--conf`` come from it; the
defaults below fill in only what it left unset. Run from ``georep audit``,
the master is ``--master`` (default ``local[*]``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pyspark import SparkConf
from pyspark.sql import SparkSession

from spark_jobs import live_source
from spark_jobs.datasource import register

DEFAULT_MASTER = "local[*]"
LOG4J_CONFIG = Path(__file__).with_name("log4j2.properties")
DEFAULTS = {
    # The audit draws its own progress line (spark_jobs/progress.py) instead of Spark's console bar.
    "spark.ui.showConsoleProgress": "false",
    # The checks shuffle one row per batch, not per record: no adaptive re-planning (whose extra jobs cost more
    # than they save at this size), and one shuffle partition per core (SHUFFLE_PARTITIONS) keep each stage short.
    "spark.sql.adaptive.enabled": "false",
    "spark.sql.session.timeZone": "UTC",
    "spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile={LOG4J_CONFIG}",
}


# Run in-process on a local master (``georep audit``, ``make demo``, the tests), Spark's web UI is off: it would
# cost its start and a port per session (4040, 4041, ... with a warning for each one taken) for a job that the
# progress line already follows. Under spark-submit, or on a cluster master, it stays on (Spark's default) unless
# the user turns it off (--conf spark.ui.enabled=false).
LOCAL_IN_PROCESS = {"spark.ui.enabled": "false"}
# Unless given, a shuffle makes as many partitions as the session has cores: a stage's every task costs its
# scheduling whatever it holds, and 8 partitions on 2 cores cost an incremental audit 1.5 s of its 10 s.
SHUFFLE_PARTITIONS = "spark.sql.shuffle.partitions"


def under_spark_submit() -> bool:
    return "PYSPARK_GATEWAY_PORT" in os.environ


def spark_session(
    master: str | None = None, app_name: str = "georep-audit", conf: dict[str, str] | None = None
) -> SparkSession:
    # Executors run the data source's Python; on a local master they must use this interpreter.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    if master or not under_spark_submit():
        master = master or DEFAULT_MASTER
        builder = builder.master(master)
        if master.startswith("local"):
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # no host name lookup, and no warning about it
    local_in_process = not under_spark_submit() and (master or DEFAULT_MASTER).startswith("local")
    defaults = {**DEFAULTS, **(LOCAL_IN_PROCESS if local_in_process else {})}
    given = SparkConf()
    for key, value in {**defaults, **(conf or {})}.items():
        if key in (conf or {}) or not given.contains(key):
            builder = builder.config(key, value)
    spark = builder.getOrCreate()
    if SHUFFLE_PARTITIONS not in (conf or {}) and not given.contains(SHUFFLE_PARTITIONS):
        spark.conf.set(SHUFFLE_PARTITIONS, str(spark.sparkContext.defaultParallelism))
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    live_source.register(spark)
    return spark


def start_spark(master: str | None, app_name: str = "georep-audit") -> SparkSession | None:
    """A session for a command; None, after saying what to do, when Spark cannot start here."""
    try:
        return spark_session(master, app_name)
    except Exception as exc:  # Java missing, bad master URL, ...: all end the same way
        print(
            f"georep: error: cannot start Spark with master {master or DEFAULT_MASTER!r}: "
            f"{str(exc).strip().splitlines()[0]}; check --master and that Java 17+ is installed (JAVA_HOME)",
            file=sys.stderr,
        )
        return None
