"""Code execution: the model's Python program runs against the row's unit tests in the sandbox
(sandbox.py). Row fields (NeMo Gym code generation):

    "verifier_metadata": {"unit_tests": {"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}}   stdin/stdout pairs
    "verifier_metadata": {"unit_tests": {"asserts": ["assert add(1, 2) == 3", ...]}}            assertion style

The program is the last ```python``` (or ```) block of the response, else the whole response. Each test
is one sandboxed run; outputs compare line by line ignoring trailing whitespace. Reward 1.0 when every
test passes (or the fraction passed with `partial_credit`). A program that breaks a limit, opens a socket
or reads outside its directory simply fails its test, with the reason in `failure_reason`. The limits a job
asks for are bounded by the operator's (`option_max`, VERIFIER_OPTION_MAX). Where there is no namespace
sandbox (and the operator did not opt into rlimits) every verification fails with SandboxUnavailable.
"""
from __future__ import annotations

import re

from . import sandbox
from .base import Verifier, VerifyResult, register

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)


def extract_program(text: str) -> str:
    blocks = _FENCE.findall(text or "")
    python = [body for lang, body in blocks if lang.lower() in ("python", "python3", "py")]
    if python:
        return python[-1]
    if blocks:
        return blocks[-1][1]
    return text or ""


def _same_output(got: str, want: str) -> bool:
    def lines(s):
        return [ln.rstrip() for ln in str(s).replace("\r\n", "\n").rstrip().split("\n")]
    return lines(got) == lines(want)


def unit_tests(row: dict) -> dict:
    tests = ((row.get("verifier_metadata") or {}).get("unit_tests")) or {}
    if not isinstance(tests, dict):
        raise ValueError("verifier_metadata.unit_tests must be an object")
    inputs, outputs, asserts = tests.get("inputs"), tests.get("outputs"), tests.get("asserts")
    if asserts is None and (inputs is None or outputs is None):
        raise ValueError("verifier_metadata.unit_tests needs inputs + outputs, or asserts")
    if inputs is not None and (not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs)):
        raise ValueError("verifier_metadata.unit_tests.inputs and .outputs must be lists of the same length")
    if isinstance(asserts, str):
        asserts = [asserts]
    return {"pairs": list(zip(inputs or [], outputs or [])), "asserts": list(asserts or [])}


@register
class CodeExecution(Verifier):
    """Runs the program against the row's unit tests in a sandbox (bubblewrap + rlimits)."""

    name = "code"
    kind = "io"  # waits on a subprocess: runs in a thread, many at once
    required_fields = ("verifier_metadata.unit_tests",)
    options = {
        "cpu_s": ((int, float), 2.0), "wall_s": ((int, float), 5.0), "memory_mb": (int, 256),
        "processes": (int, 16), "output_bytes": (int, 1_000_000), "partial_credit": (bool, False),
        "stop_on_failure": (bool, True),
    }
    option_max = {"cpu_s": 30.0, "wall_s": 60.0, "memory_mb": 2048, "processes": 64, "output_bytes": 16_000_000}

    def runtime_info(self) -> dict:
        """For the job page: which sandbox this worker's runs get."""
        return {"sandbox": sandbox.describe(*sandbox.mode())}

    def verify(self, row, response_text, options):
        mode, why = sandbox.mode()
        if mode == "unavailable":
            raise sandbox.SandboxUnavailable(sandbox.refusal(why))
        tests = unit_tests(row)
        program = extract_program(response_text)
        options = self.clamp_options(options)
        o = {k: options.get(k, d) for k, (_, d) in self.options.items()}
        limits = sandbox.Limits(cpu_s=float(o["cpu_s"]), wall_s=float(o["wall_s"]), memory_mb=int(o["memory_mb"]),
                                processes=int(o["processes"]), output_bytes=int(o["output_bytes"]))
        runs = [(stdin, want, None) for stdin, want in tests["pairs"]] + [("", None, a) for a in tests["asserts"]]
        passed, failure = 0, ""
        for i, (stdin, want, test_code) in enumerate(runs):
            code = program if test_code is None else f"{program}\n\n{test_code}\n"
            res = sandbox.run_python(code, str(stdin) if stdin is not None else "", limits)
            if res.status == "ok" and (want is None or _same_output(res.stdout, want)):
                passed += 1
                continue
            if not failure:
                failure = f"test {i + 1}: " + (res.reason if res.status != "ok" else "wrong output")
            if o["stop_on_failure"]:
                break
        total = len(runs)
        reward = (passed / total if o["partial_credit"] else float(passed == total)) if total else 0.0
        return VerifyResult(reward=reward, fields={
            "tests_passed": passed, "tests_total": total, "failure_reason": failure,
            "sandbox": sandbox.describe(mode, why)})
