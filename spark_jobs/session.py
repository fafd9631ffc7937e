"""The SparkSession the audit jobs run in: quiet, Arrow on, the georep source registered."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pyspark.sql import SparkSession

from spark_jobs.datasource import register

DEFAULT_MASTER = "local[*]"
LOG4J_CONFIG = Path(__file__).with_name("log4j2.properties")


def spark_session(master: str = DEFAULT_MASTER, app_name: str = "georep-audit",
                  conf: dict[str, str] | None = None) -> SparkSession:  # fmt: skip
    # Executors run the data source's Python; on a local master they must use this interpreter.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # no lookup of, or warning about, the host name
    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "8")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile={LOG4J_CONFIG}")
    )
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


def start_spark(master: str, app_name: str = "georep-audit") -> SparkSession | None:
    """A session for a command; None, after saying what to do, when Spark cannot start here."""
    try:
        return spark_session(master, app_name)
    except Exception as exc:  # noqa: BLE001 - Java missing, bad master URL, ...: all end the same way
        print(f"georep: error: cannot start Spark with master {master!r}: {str(exc).strip().splitlines()[0]}; "
              "check --master and that Java 17+ is installed (JAVA_HOME)", file=sys.stderr)
        return None
