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
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    # The checks shuffle one row per batch, not per record: a few partitions, and no adaptive re-planning
    # (whose extra jobs cost more than they save at this size), keep each stage short.
    "spark.sql.shuffle.partitions": "8",
    "spark.sql.adaptive.enabled": "false",
    "spark.sql.session.timeZone": "UTC",
    "spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile={LOG4J_CONFIG}",
}


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
    given = SparkConf()
    for key, value in {**DEFAULTS, **(conf or {})}.items():
        if key in (conf or {}) or not given.contains(key):
            builder = builder.config(key, value)
    spark = builder.getOrCreate()
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
