#!/usr/bin/env bash
# The test command: installs what the suite needs (packages, Redis, PostgreSQL, Chromium, real vLLM
# on CPU with a tiny local model), starts what is down, and runs the whole suite.
#   --quick (first argument, `make quick`): the unit and API tests only, without the slow tiers (markers
#   vllm, browser, e2e, nemo_gym, slow in pytest.ini) and without setting up Chromium, vLLM or NeMo Gym.
# The whole suite runs on TEST_WORKERS pytest-xdist workers (default 3: ~13 min on 2 idle cores, ~30 in one
# process; TEST_WORKERS=0: in this one process), each with its own test database, Redis db (TEST_REDIS_URL's db minus
# the worker's number), queues and metrics directory (tests/parallel.py); one worker runs all of a heavy tier (NeMo
# Gym, Chromium, vLLM) so its servers start once. `--quick` runs in one process unless TEST_WORKERS is set.
# --tb=native on workers: pytest's own traceback format calls ast.parse, which CPython 3.11.7 can fail in an xdist
# worker ("AST constructor recursion depth mismatch", python/cpython#106905), an internal error hiding the failure.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$ROOT"
QUICK=()
if [ "${1:-}" = "--quick" ]; then shift; QUICK=(-m "not (vllm or browser or e2e or nemo_gym or slow)"); fi
bash scripts/bootstrap.sh requirements-dev.txt
ensure_postgres
if [ ${#QUICK[@]} = 0 ]; then [ -f scripts/test_prereqs.sh ] && bash scripts/test_prereqs.sh
else apt_install bubblewrap; [ -f scripts/frontend.sh ] && bash scripts/frontend.sh; fi  # the sandbox, the pages' JS
export DATABASE_URL="${TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/controlplane}"
# A Redis database and a Celery queue of their own, so tests never trade tasks with a running demo.
export REDIS_URL="${TEST_REDIS_URL:-redis://127.0.0.1:6379/15}"
export CELERY_TASK_DEFAULT_QUEUE="${CELERY_TASK_DEFAULT_QUEUE:-tests-$$}"
export CELERY_CONTROL_QUEUE="${CELERY_CONTROL_QUEUE-tests-$$-control}"
export CHANNELS_PREFIX="${CHANNELS_PREFIX:-tests-$$}"
# The metrics directory of the test run's processes (prometheus-client multi-process mode), emptied first.
export PROMETHEUS_MULTIPROC_DIR="${PROMETHEUS_MULTIPROC_DIR:-$ROOT/var/prometheus-tests}"
rm -rf "$PROMETHEUS_MULTIPROC_DIR" && mkdir -p "$PROMETHEUS_MULTIPROC_DIR"
if [ ${#QUICK[@]} = 0 ]; then WORKERS="${TEST_WORKERS:-3}"; else WORKERS="${TEST_WORKERS:-0}"; fi
XDIST=()
if [ "$WORKERS" != 0 ]; then XDIST=(-n "$WORKERS" --dist loadgroup --no-loadscope-reorder --tb=native); fi
# The whole suite ends with its 25 slowest tests (what to look at when it nears its 20-minute budget).
DURATIONS=()
if [ ${#QUICK[@]} = 0 ]; then DURATIONS=(--durations=25); fi
exec "$PY" -m pytest "${XDIST[@]}" "${QUICK[@]}" "${DURATIONS[@]}" "$@"
