#!/usr/bin/env bash
# Zip georep's own packages (pure Python) for spark-submit --py-files: deploy/spark/georep-zip.sh OUT.zip
#
# Directories get entries of their own: Python imports a namespace package (a directory without __init__.py,
# such as georep/kafka) from a zip only when the zip lists the directory.
set -euo pipefail

out=$(realpath -m "${1:?usage: georep-zip.sh OUT.zip}")
repo=$(cd "$(dirname "$0")/../.." && pwd)
list=$(mktemp)
trap 'rm -f "$list"' EXIT
rm -f "$out"
cd "$repo"
find georep spark_jobs topology offsets dedup cluster \( -name '*.py' -o -type d \) -not -path '*/__pycache__*' |
    sort > "$list"
if command -v zip > /dev/null; then
    zip -q -@ "$out" < "$list"
else  # no zip(1) here: Python's zipfile makes the same archive
    python3 -c 'import sys, zipfile
with zipfile.ZipFile(sys.argv[1], "w", zipfile.ZIP_DEFLATED) as z:
    for name in open(sys.argv[2]).read().split():
        z.write(name)' "$out" "$list"
fi
