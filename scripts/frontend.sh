#!/usr/bin/env bash
# Front-end packages for the dashboard: npm install (idempotent) into node_modules, then copy the
# dist files the pages load into static/vendor/ (gitignored; third-party code is never committed).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
log() { printf '\033[1;34m==>\033[0m %s\n' "$*" >&2; }

if ! command -v npm >/dev/null; then
  log "installing nodejs and npm from Debian"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
fi

fingerprint() { (cat package.json; cat package-lock.json 2>/dev/null || true) | sha256sum | cut -c1-16; }
want=$(fingerprint)
stamp=node_modules/.frontend-stamp
if [ ! -f node_modules/uplot/dist/uPlot.iife.min.js ] || [ ! -f node_modules/d3-flame-graph/dist/d3-flamegraph.min.js ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "npm install (dashboard front-end packages)"
  if [ -f package-lock.json ]; then
    npm ci --no-audit --no-fund --loglevel=error
  else
    npm install --no-audit --no-fund --loglevel=error
  fi
  fingerprint > "$stamp"
fi

mkdir -p static/vendor/uplot
for f in uPlot.iife.min.js uPlot.min.css; do
  cmp -s "node_modules/uplot/dist/$f" "static/vendor/uplot/$f" || cp "node_modules/uplot/dist/$f" "static/vendor/uplot/$f"
done
cp node_modules/uplot/LICENSE static/vendor/uplot/LICENSE 2>/dev/null || true

# the profiling panel's flame graph (self-contained UMD build: window.flamegraph)
mkdir -p static/vendor/d3-flame-graph
for f in d3-flamegraph.min.js d3-flamegraph.css; do
  cmp -s "node_modules/d3-flame-graph/dist/$f" "static/vendor/d3-flame-graph/$f" || cp "node_modules/d3-flame-graph/dist/$f" "static/vendor/d3-flame-graph/$f"
done
cp node_modules/d3-flame-graph/LICENSE static/vendor/d3-flame-graph/LICENSE 2>/dev/null || true
