#!/usr/bin/env bash
# Real NeMo Gym (nemo-gym 0.4.0) for the `nemo_gym` tests and the NeMo Gym benchmark.
#
#   bash scripts/nemo_gym.sh python              # prints a Python >= 3.12 (pyenv), or exits 3 with the reason
#   bash scripts/nemo_gym.sh setup               # venv .venv-nemo-gym with nemo-gym, uv, math-verify (idempotent)
#   bash scripts/nemo_gym.sh start POLICY_URL    # ng_run: math_with_judge + vllm_model against POLICY_URL (/v1)
#   bash scripts/nemo_gym.sh stop                # SIGINT to ng_run (it stops its servers and Ray), then waits
#   bash scripts/nemo_gym.sh status
#
# Environment: NEMO_GYM_RUN_DIR (pid and log files, default var/nemo-gym), NEMO_GYM_HEAD_PORT (default 11000),
# NEMO_GYM_START_TIMEOUT (seconds, default 300), NEMO_GYM_MODEL (policy model name, default "sim"),
# NEMO_GYM_EXTRA_CONFIGS (more config files for ng_run, comma-separated absolute paths),
# NEMO_GYM_PROFILING_DIR (ng_run's +profiling_enabled=true +profiling_results_dirpath=DIR; needs graphviz).
# nemo-gym 0.4.0 needs Python >= 3.12 (later releases need >= 3.13.14); its servers' venvs are built by
# `uv` from that same Python, never downloaded (UV_PYTHON_DOWNLOADS=never).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$ROOT"

NG_PIN="nemo-gym==0.4.0"
NVENV="$ROOT/.venv-nemo-gym"
NPY="$NVENV/bin/python"
RUN_DIR="${NEMO_GYM_RUN_DIR:-$ROOT/var/nemo-gym}"
# ng_run's working directory: it builds each server's venv under it (kept between starts, so later starts
# skip the install with +skip_venv_if_present=true) and NeMo Gym writes its outputs there.
HOME_DIR="$ROOT/var/nemo-gym-home"
PID_FILE="$RUN_DIR/ng_run.pid"
LOG_FILE="$RUN_DIR/ng_run.log"
VENV_STAMP="$NVENV/.installed-nemo-gym-0.4.0-r1"

find_python() {  # a CPython >= 3.12: NEMO_GYM_PYTHON, else pyenv 3.12.x (newest first, the version it is known to work on), then 3.13.x, else python3.12 on PATH
  if [ -n "${NEMO_GYM_PYTHON:-}" ]; then echo "$NEMO_GYM_PYTHON"; return 0; fi
  local root cand
  if command -v pyenv >/dev/null 2>&1; then root=$(pyenv root 2>/dev/null || true); fi
  root="${root:-$HOME/.pyenv}"
  for cand in $(ls -d "$root"/versions/3.12.* 2>/dev/null | sort -V -r) $(ls -d "$root"/versions/3.13.* 2>/dev/null | sort -V -r); do
    [ -x "$cand/bin/python" ] && { echo "$cand/bin/python"; return 0; }
  done
  for cand in python3.13 python3.12; do
    command -v "$cand" >/dev/null 2>&1 && { command -v "$cand"; return 0; }
  done
  return 1
}

base_python() {
  local p; p=$(find_python) || { echo "no Python >= 3.12 found (pyenv versions/3.12.*, python3.12); nemo-gym 0.4.0 needs one" >&2; exit 3; }
  echo "$p"
}

# uv (used by ng_run to build each server's venv) must find the same Python and must not download one.
uv_env() {
  local bp; bp=$(base_python)
  # (never UV_PYTHON: `uv pip install` would then install the servers' packages into that interpreter itself)
  export PATH="$NVENV/bin:$(dirname "$bp"):$PATH" UV_PYTHON_DOWNLOADS=never
  unset UV_PYTHON
}

cmd_setup() {
  local bp; bp=$(base_python)
  if [ -f "$VENV_STAMP" ] && [ -x "$NPY" ]; then return 0; fi
  local t0=$SECONDS
  mkdir -p "$RUN_DIR"
  [ -x "$NPY" ] || { log "nemo-gym: creating $NVENV from $bp"; "$bp" -m venv "$NVENV" || die "could not create $NVENV"; }
  log "nemo-gym: installing $NG_PIN uv math-verify into .venv-nemo-gym (about 3 min)"
  local piplog="$RUN_DIR/setup-pip.log"
  if ! "$NVENV/bin/pip" install --disable-pip-version-check "$NG_PIN" uv math-verify >"$piplog" 2>&1; then
    tail -n 40 "$piplog" >&2
    die "pip install $NG_PIN failed; full log: $piplog"
  fi
  "$NVENV/bin/ng_run" --help >/dev/null 2>&1 || [ -x "$NVENV/bin/ng_run" ] || die "ng_run is missing from $NVENV"
  touch "$VENV_STAMP"
  log "nemo-gym: venv ready in $((SECONDS - t0)) s"
}

is_running() {
  local pid; pid=$(cat "$PID_FILE" 2>/dev/null) || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

head_ok() { curl -fsS -m 2 "http://127.0.0.1:$1/server_instances" >/dev/null 2>&1; }

# All servers listed by the head server answer (ng_run's own readiness line is "All ... servers ready").
all_ready() { tail -c +"$((${LOG_OFFSET:-0} + 1))" "$LOG_FILE" 2>/dev/null | grep -qE "All [0-9]+ / [0-9]+ servers ready"; }

cmd_start() {
  local policy="${1:?usage: nemo_gym.sh start POLICY_BASE_URL (…/v1)}"
  local port="${NEMO_GYM_HEAD_PORT:-11000}" timeout="${NEMO_GYM_START_TIMEOUT:-300}" pid
  [ -f "$VENV_STAMP" ] || die "nemo-gym is not set up: run bash scripts/nemo_gym.sh setup"
  mkdir -p "$RUN_DIR"
  if pid=$(is_running); then die "ng_run already running (pid $pid); stop it first"; fi
  uv_env
  local site; site=$("$NPY" -c 'import nemo_gym, os; print(os.path.dirname(os.path.dirname(nemo_gym.__file__)))')
  local cfgs="$site/resources_servers/math_with_judge/configs/math_with_judge.yaml,$site/responses_api_models/vllm_model/configs/vllm_model.yaml"
  [ -n "${NEMO_GYM_EXTRA_CONFIGS:-}" ] && cfgs="$cfgs,$NEMO_GYM_EXTRA_CONFIGS"
  log "nemo-gym: starting ng_run (head :$port, policy $policy; log: ${LOG_FILE#$ROOT/})"
  # Own session (setsid) with SIGINT left at its default: `kill -INT` stops ng_run, its servers and Ray.
  mkdir -p "$HOME_DIR"
  LOG_OFFSET=$(stat -c %s "$LOG_FILE" 2>/dev/null || echo 0)  # the log is appended to: earlier starts stay readable
  # NEMO_GYM_PROFILING_DIR: ng_run's own +profiling_enabled=true +profiling_results_dirpath=DIR (seed 003; its
  # servers need graphviz's `dot`)
  local prof=()
  [ -n "${NEMO_GYM_PROFILING_DIR:-}" ] && prof=("+profiling_enabled=true" "+profiling_results_dirpath=$NEMO_GYM_PROFILING_DIR")
  (cd "$HOME_DIR" && exec setsid "$NVENV/bin/ng_run" "+config_paths=[$cfgs]" "${prof[@]}" \
      "+head_server.host=127.0.0.1" "+head_server.port=$port" \
      "+skip_venv_if_present=true" "+policy_base_url=$policy" "+policy_api_key=${NEMO_GYM_POLICY_API_KEY:-dummy-key}" \
      "+policy_model_name=${NEMO_GYM_MODEL:-sim}" >>"$LOG_FILE" 2>&1 </dev/null) &
  pid=$!
  echo "$pid" > "$PID_FILE"
  local t0=$SECONDS
  until head_ok "$port" && all_ready; do
    if ! kill -0 "$pid" 2>/dev/null; then
      tail -n 30 "$LOG_FILE" >&2 || true; rm -f "$PID_FILE"
      die "ng_run exited during startup; log: $LOG_FILE"
    fi
    if [ $((SECONDS - t0)) -ge "$timeout" ]; then
      tail -n 30 "$LOG_FILE" >&2 || true; cmd_stop >/dev/null 2>&1 || true
      die "ng_run was not ready within ${timeout}s; log: $LOG_FILE"
    fi
    sleep 1
  done
  log "nemo-gym: ready in $((SECONDS - t0)) s (pid $pid, head http://127.0.0.1:$port)"
}

cmd_stop() {
  local pid
  if ! pid=$(is_running); then rm -f "$PID_FILE"; log "nemo-gym: not running"; return 0; fi
  log "nemo-gym: stopping ng_run (pid $pid)"
  kill -INT "$pid" 2>/dev/null || true
  for _ in $(seq 1 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    log "nemo-gym: still running after 30 s, killing its session"
    kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$PID_FILE"
}

cmd_status() {
  local pid
  if pid=$(is_running); then echo "running: pid $pid"; else echo "stopped"; return 3; fi
}

case "${1:-}" in
  python) base_python ;;
  setup) cmd_setup ;;
  start) shift; cmd_start "$@" ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  *) echo "usage: $0 {python|setup|start POLICY_BASE_URL|stop|status}" >&2; exit 2 ;;
esac
