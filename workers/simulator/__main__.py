"""CLI: `python -m workers.simulator [--port 8000] [--ttft-ms 50] ...`; `--help` lists every knob.

Once bound it prints one line to stdout: `simulator listening on http://HOST:PORT (pid N)`
(with `--port 0` the OS picks a free port; read it from that line).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import sys

from .config import ConfigError, SimConfig, parse_fault_rates

DESCRIPTION = """\
A vLLM-compatible model-server simulator (no GPU). It serves /v1/chat/completions, /v1/completions,
/v1/responses (plain and stream=true), /v1/models, /health, /ping, /version, /load, /metrics (vLLM
metric names), /tokenize, and the RL/admin routes /pause?mode=abort|wait|keep, /resume, /is_paused,
/update_weights, /weight_version, /reset_prefix_cache, /sleep?level=1|2, /wake_up, /is_sleeping, plus
GET/POST /admin/config to read or change any knob below at runtime (JSON keys = the knob names with
underscores, e.g. {"ttft_ms": 0, "fault_rates": {"429": 0.1}}).

Text: a token is roughly a word (\\w+ run or one punctuation mark); outputs are synthetic words.
Math: when the last user message (or the prompt) asks an integer arithmetic question,
'What is A + B?', 'Compute A * B', 'Calculate A - B' (ops: + - * x), the answer ends with
'The answer is \\boxed{N}'; N is right with probability --math-accuracy, else off by 1..10.
Output length = max_tokens / max_completion_tokens / max_output_tokens when given (finish_reason
'stop'), else sampled from [--output-len-min, --output-len-max].
Per-request fault header: 'X-Sim-Fault: 429|500|503|400|stall|drop' (+ 'X-Sim-Retry-After: S').
Responses carry the weight version: header X-Weight-Version and body field "weight_version"
(Responses API: also metadata.weight_version).
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m workers.simulator", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to bind; 0 = any free port (default: %(default)s)")
    for f in dataclasses.fields(SimConfig):
        md = f.metadata
        flag = "--" + f.name.replace("_", "-")
        unit = f" [{md['unit']}]" if md.get("unit") else ""
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = "none" if default in (None, {}) else default
        help_ = f"{md['help']}{unit} (default: {shown})".replace("%", "%%")
        names = [flag]
        if f.name == "model":
            names.append("--served-model-name")
        if f.name == "fault_rates":
            names = ["--fault-rate", "--fault-rates"]
        if f.type == "bool":
            p.add_argument(*names, dest=f.name, action="store_true", default=default, help=help_)
        elif f.type == "int" or f.name == "seed":
            p.add_argument(*names, dest=f.name, type=int, default=default, metavar="N", help=help_)
        elif f.type == "float":
            p.add_argument(*names, dest=f.name, type=float, default=default, metavar="X", help=help_)
        elif f.name == "fault_rates":
            p.add_argument(*names, dest=f.name, default="", metavar="TYPE=RATE,...", help=help_)
        elif f.name == "admin_faults":
            p.add_argument(*names, dest=f.name, default="", metavar="ROUTE=FAULT,...", help=help_)
        else:
            p.add_argument(*names, dest=f.name, default=default, help=help_)
    return p


def config_from_args(argv=None) -> tuple[SimConfig, str, int]:
    parser = build_parser()
    args = parser.parse_args(argv)
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(SimConfig)}
    try:
        kw["fault_rates"] = parse_fault_rates(kw["fault_rates"])
        kw["admin_faults"] = dict(p.split("=", 1) for p in kw["admin_faults"].split(",") if "=" in p) \
            if isinstance(kw["admin_faults"], str) else kw["admin_faults"]
        cfg = SimConfig(**kw).validate()
    except ConfigError as e:
        parser.error(str(e))  # exit status 2, message on stderr
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be between 0 and 65535, got {args.port}")
    return cfg, args.host, args.port


def main(argv=None) -> int:
    cfg, host, port = config_from_args(argv)
    from .server import create_app, serve

    async def run():
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await serve(create_app(cfg), host, port)
        except asyncio.CancelledError:
            pass

    try:
        from workers.engine.loop import run as run_on_loop

        run_on_loop(run(), os.environ.get("SIM_EVENT_LOOP", "asyncio"))  # SIM_EVENT_LOOP=uvloop: less CPU per request
    except OSError as e:
        print(f"simulator: cannot listen on {host}:{port}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
