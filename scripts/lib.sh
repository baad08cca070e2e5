# Shared helpers for the setup scripts. Source it; it changes nothing by itself.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"

log() { printf '\033[1;34m==>\033[0m %s\n' "$*" >&2; }
die() { printf '\033[1;31merror:\033[0m %s\n' "$*" >&2; exit 1; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else die "need root for: $*"; fi; }

APT_UPDATED=""
apt_install() {  # apt_install PKG... : installs the Debian packages that are missing
  local missing=()
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get to install them"
  log "installing Debian packages: ${missing[*]}"
  if [ -z "$APT_UPDATED" ]; then as_root apt-get update -qq >/dev/null; APT_UPDATED=1; fi
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

redis_url() { echo "${REDIS_URL:-redis://127.0.0.1:6379/0}"; }

redis_up() { "$PY" - "$(redis_url)" <<'PY' 2>/dev/null
import sys, redis
redis.Redis.from_url(sys.argv[1], socket_connect_timeout=1).ping()
PY
}

ensure_redis() {
  redis_up && return 0
  command -v redis-server >/dev/null || apt_install redis-server
  log "starting redis-server on 127.0.0.1:6379"
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no >/dev/null
  for _ in $(seq 1 50); do redis_up && return 0; sleep 0.1; done
  die "Redis did not come up on $(redis_url)"
}

pg_up() { pg_isready -h 127.0.0.1 -p 5432 -t 1 >/dev/null 2>&1; }

ensure_postgres() {
  command -v pg_isready >/dev/null || apt_install postgresql
  pg_up && return 0
  log "starting PostgreSQL"
  local ver; ver=$(ls /etc/postgresql | sort -V | tail -1)
  as_root pg_ctlcluster --skip-systemctl-redirect "$ver" main start || true
  for _ in $(seq 1 100); do pg_up && return 0; sleep 0.2; done
  die "PostgreSQL did not come up on 127.0.0.1:5432"
}

ensure_venv() {  # ensure_venv requirements-file : a venv with those pins, reinstalled only when they change
  local req="$1" stamp="$VENV/.installed-$(basename "$1")"
  [ -x "$PY" ] || { log "creating $VENV"; python3 -m venv "$VENV"; }
  local want; want=$(cat "$ROOT/requirements.txt" "$ROOT/$req" | sha256sum | cut -c1-16)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    log "installing Python packages from $req (log: var/log/pip-install.log)"
    mkdir -p "$ROOT/var/log"
    if ! "$VENV/bin/pip" install -q --disable-pip-version-check -r "$ROOT/$req" >"$ROOT/var/log/pip-install.log" 2>&1; then
      grep -v "is ignored: it is neither a file nor a directory" "$ROOT/var/log/pip-install.log" | tail -40 >&2
      die "pip install -r $req failed; full log: var/log/pip-install.log"
    fi
    echo "$want" > "$stamp"
  fi
}
