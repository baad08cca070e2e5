"""Fixtures that build and start real vLLM on CPU (scripts/vllm_cpu.sh)."""
