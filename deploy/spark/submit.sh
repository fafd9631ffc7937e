#!/usr/bin/env bash
# Run the georep audit (or the delay analytics) on a Spark cluster with spark-submit.
#
#   deploy/spark/submit.sh [--job audit|delays] [SPARK-SUBMIT OPTIONS] -- JOB OPTIONS
#
#   deploy/spark/submit.sh --master spark://spark-master:7077 -- \
#       --live --topology /etc/georep/topology.toml --tls-dir /etc/georep/certs --principal client:auditor \
#       --report /var/lib/georep-audit/$(date +%F)
#   PYSPARK_PYTHON=./env/bin/python deploy/spark/submit.sh --master yarn --archives georep-env.tar.gz#env -- --live ...
#   deploy/spark/submit.sh --job delays --master yarn --deploy-mode client -- --data-root /mnt/georep --report /tmp/d
#   deploy/spark/submit.sh --master 'local[2]' -- --live --report /tmp/audit          # try it here
#
# Options before "--" go to spark-submit, options after it to the job (docs/audit.md). georep's own packages are
# zipped and shipped with --py-files for every submission: nothing of georep need be installed on the Spark nodes,
# only its third-party packages, in the Python that PYSPARK_PYTHON names (README.md here). The live audit needs
# nothing shared on disk; the file audit needs the segment files at the same paths on the driver and executors.
# SPARK_SUBMIT: the spark-submit to use (default: on PATH, else .venv/bin/spark-submit).
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
job=audit
if [[ ${1:-} == --job ]]; then
    job=${2:-}
    shift 2
fi
if [[ $job != audit && $job != delays ]]; then
    echo "submit.sh: --job must be audit or delays, not '$job'" >&2
    exit 2
fi
submit_args=()
while [[ $# -gt 0 && $1 != -- ]]; do
    submit_args+=("$1")
    shift
done
if [[ ${1:-} != -- ]]; then
    echo "submit.sh: put '--' between the spark-submit options and the job's, e.g. --master URL -- --report DIR" >&2
    exit 2
fi
shift

submit=${SPARK_SUBMIT:-$(command -v spark-submit || echo "$repo/.venv/bin/spark-submit")}
if [[ $submit == "$repo/.venv/bin/spark-submit" ]]; then
    # pip's PySpark, run without the virtualenv activated: tell it where Spark and its Python are.
    export SPARK_HOME=${SPARK_HOME:-$("$repo/.venv/bin/python" -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')}
    export PYSPARK_PYTHON=${PYSPARK_PYTHON:-$repo/.venv/bin/python}
fi
if [[ ! -x $submit ]]; then
    echo "submit.sh: no spark-submit at '$submit': install Spark 4 or set SPARK_SUBMIT" >&2
    exit 2
fi

# georep's own packages (pure Python), shipped to the driver and executors with --py-files: the executors import
# georep from this zip (the report's runtime.executors says so), never from a copy on the nodes.
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
"$repo/deploy/spark/georep-zip.sh" "$build/georep.zip"

# The driver's quiet log configuration comes first, so that a --conf spark.driver.extraJavaOptions of the
# user's, later on the command line, wins (add -Dlog4j2.configurationFile=... to it to keep the quiet logs).
"$submit" --conf "spark.driver.extraJavaOptions=-Dlog4j2.configurationFile=$repo/spark_jobs/log4j2.properties" \
    "${submit_args[@]}" \
    --py-files "$build/georep.zip" \
    "$repo/spark_jobs/$job.py" "$@"
