#!/usr/bin/env bash
# `make demo`: sets everything up on the embedded defaults (SQLite file, local Redis, the built-in
# simulator as the model server), starts the web server, a Celery worker for the chunks, a control worker
# (ops actions, weight updates, watchdog: controlplane/lanes.py) and beat, loads the demo
# math dataset, launches a demo job and follows it. Services keep running; `make stop` stops them.
# Ports: WEB_PORT (default 8000, the dashboard) and SIM_PORT (default 8100, the simulator).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$ROOT"

RUN_DIR="$ROOT/var/run"; LOG_DIR="$ROOT/var/log"
mkdir -p "$RUN_DIR" "$LOG_DIR"
WEB_PORT="${WEB_PORT:-8000}"
SIM_PORT="${SIM_PORT:-8100}"

stop_all() {
  for name in web worker control beat simulator; do
    local pidf="$RUN_DIR/$name.pid"
    if [ -f "$pidf" ] && kill -0 "$(cat "$pidf")" 2>/dev/null; then
      kill -TERM -- "-$(cat "$pidf")" 2>/dev/null || kill -TERM "$(cat "$pidf")" 2>/dev/null || true
      log "stopped $name"
    fi
    rm -f "$pidf"
  done
}

if [ "${1:-}" = "stop" ]; then stop_all; exit 0; fi

running() { local pidf="$RUN_DIR/$1.pid"; [ -f "$pidf" ] && kill -0 "$(cat "$pidf")" 2>/dev/null; }
port_taken() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Ports first, before anything starts: a port another program holds is one line naming it and the variable
# to change, and nothing of the demo is left running (ours, from an earlier `make demo`, are fine).
if ! running web && port_taken "$WEB_PORT"; then
  die "port $WEB_PORT is already in use on 127.0.0.1 (the web server's port): set WEB_PORT to a free port, e.g. WEB_PORT=$((WEB_PORT + 1)) make demo"
fi
if ! running simulator && port_taken "$SIM_PORT"; then
  die "port $SIM_PORT is already in use on 127.0.0.1 (the simulator's port): set SIM_PORT to a free port, e.g. SIM_PORT=$((SIM_PORT + 1)) make demo"
fi

STARTED=()
cleanup() {  # a demo that fails half-way stops what this run started: nothing is left running
  local rc=$?
  if [ "$rc" != 0 ] && [ "${#STARTED[@]}" -gt 0 ]; then
    for name in "${STARTED[@]}"; do
      local pidf="$RUN_DIR/$name.pid"
      if [ -f "$pidf" ]; then kill -TERM -- "-$(cat "$pidf")" 2>/dev/null || kill -TERM "$(cat "$pidf")" 2>/dev/null || true; fi
      rm -f "$pidf"
    done
    printf 'stopped what this run started: %s\n' "${STARTED[*]}" >&2
  fi
}
trap cleanup EXIT

start() {  # start NAME CMD... : runs CMD in its own process group, logs to var/log/NAME.log
  local name="$1"; shift
  local pidf="$RUN_DIR/$name.pid"
  if [ -f "$pidf" ] && kill -0 "$(cat "$pidf")" 2>/dev/null; then return 0; fi
  setsid "$@" >"$LOG_DIR/$name.log" 2>&1 < /dev/null &
  echo $! > "$pidf"
  STARTED+=("$name")
}

wait_http() {  # wait_http URL SECONDS NAME
  for _ in $(seq 1 $(( $2 * 5 ))); do
    "$PY" -c "import sys,urllib.request; urllib.request.urlopen(sys.argv[1], timeout=1)" "$1" 2>/dev/null && return 0
    sleep 0.2
  done
  local why; why=$(grep -m1 -io "address already in use\|error.*" "$LOG_DIR/$3.log" 2>/dev/null || true)
  die "$3 did not answer at $1${why:+ ($why)}; see $LOG_DIR/$3.log"
}

log "setting up (Python packages, Redis)"
bash scripts/bootstrap.sh requirements.txt
[ -f scripts/frontend.sh ] && { command -v npm >/dev/null || apt_install nodejs npm; bash scripts/frontend.sh; }
# the code-execution verifier's sandbox (it falls back to rlimits only, and says so, without it)
command -v bwrap >/dev/null || apt_install bubblewrap || log "bubblewrap not installed: code runs under rlimits only"

export REDIS_URL="$(redis_url)"

# The control plane's own metrics (/metrics): every process writes its counters under this directory. It
# starts empty with the services, never under running ones (their counts would vanish).
export PROMETHEUS_MULTIPROC_DIR="${PROMETHEUS_MULTIPROC_DIR:-$ROOT/var/prometheus}"
services_running=0
for name in web worker control beat; do
  pidf="$RUN_DIR/$name.pid"
  if [ -f "$pidf" ] && kill -0 "$(cat "$pidf")" 2>/dev/null; then services_running=1; fi
done
if [ "$services_running" = 0 ]; then rm -rf "$PROMETHEUS_MULTIPROC_DIR"; fi
mkdir -p "$PROMETHEUS_MULTIPROC_DIR"
log "database: ${DATABASE_URL:-SQLite file var/controlplane.sqlite3}"
"$PY" manage.py migrate --noinput -v 0

log "starting the simulator (vLLM-compatible) on 127.0.0.1:$SIM_PORT"
start simulator "$PY" -m workers.simulator --host 127.0.0.1 --port "$SIM_PORT" --seed 7 --model sim \
  --max-num-seqs 32 --ttft-ms 120 --itl-ms 8 --math-accuracy 0.7
wait_http "http://127.0.0.1:$SIM_PORT/health" 20 simulator

log "starting a Celery worker (chunks), a control worker (control lane) and beat"
WORK_QUEUE="${CELERY_TASK_DEFAULT_QUEUE:-celery}"
CONTROL_QUEUE="${CELERY_CONTROL_QUEUE-control}"
start worker "$VENV/bin/celery" -A controlplane worker -P threads -c 4 -Q "$WORK_QUEUE" -l info -n "demo@%h"
# the control lane: weight updates, health, the watchdog... never wait behind a chunk (2 slots, no chunk ever)
if [ -n "$CONTROL_QUEUE" ]; then
  start control "$VENV/bin/celery" -A controlplane worker -P threads -c 2 -Q "$CONTROL_QUEUE" -l info -n "control@%h"
fi
start beat "$VENV/bin/celery" -A controlplane beat -l info -s "$ROOT/var/celerybeat-schedule"

log "starting the web server (ASGI, uvicorn) on 127.0.0.1:$WEB_PORT"
# uvicorn streams request bodies to the app, so the size limit holds before anything is parsed.
start web "$VENV/bin/uvicorn" controlplane.asgi:application --host 127.0.0.1 --port "$WEB_PORT" --ws websockets
wait_http "http://127.0.0.1:$WEB_PORT/accounts/login/" 30 web

"$PY" scripts/demo_seed.py --simulator-url "http://127.0.0.1:$SIM_PORT" --web-url "http://127.0.0.1:$WEB_PORT"
