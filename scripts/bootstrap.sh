#!/usr/bin/env bash
# Idempotent setup: Python venv with the pinned packages, Redis, the database schema.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
REQ="${1:-requirements.txt}"
command -v python3 >/dev/null || apt_install python3 python3-venv
python3 -c 'import venv, ensurepip' 2>/dev/null || apt_install python3-venv
ensure_venv "$REQ"
ensure_redis
