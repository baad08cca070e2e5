#!/usr/bin/env bash
# `make bench`: every benchmark, one after another; each prints its own side-by-side table.
# Run one alone with: .venv/bin/python -m bench.<name> --help
set -uo pipefail
source "$(dirname "$0")/lib.sh"
cd "$ROOT"
bash scripts/bootstrap.sh requirements-dev.txt
ensure_postgres
rc=0
for b in bench/bench_*.py; do
  name=$(basename "$b" .py)
  log "$name"
  "$PY" -m "bench.$name" || { echo "$name failed" >&2; rc=1; }
done
exit $rc
