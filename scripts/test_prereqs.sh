#!/usr/bin/env bash
# What the test suite needs beyond the Python packages, installed idempotently.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$ROOT"
# Headless Chromium from Debian's packages for the browser tests (no browser download).
apt_install chromium chromium-driver fonts-dejavu-core
# Debian's bubblewrap: the sandbox the code-execution verifier runs programs in.
apt_install bubblewrap
# graphviz's dot: ng_run's profiler (nemo_gym.profiling) renders with it, for the +profiling_enabled test.
apt_install graphviz
# Front-end packages (chart library) from npm.
[ -f scripts/frontend.sh ] && bash scripts/frontend.sh
# Real vLLM on CPU with a tiny locally built model, for the `vllm` tests.
[ -f scripts/vllm_cpu.sh ] && bash scripts/vllm_cpu.sh setup
# Real NeMo Gym (nemo-gym 0.4.0 needs Python >= 3.12) for the `nemo_gym` tests; skipped where there is none.
if bash scripts/nemo_gym.sh python >/dev/null 2>&1; then bash scripts/nemo_gym.sh setup; fi
true
