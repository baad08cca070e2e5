"""FieldFit folds rows by the fields they lack: the same report as a pass over every verifier for every row."""
import random

from workers.verifiers.registry import FieldFit, has_field


def _reference(required, rows, keep):
    """Per row, per verifier: the straightforward count FieldFit must equal."""
    out = {}
    for name, fields in sorted(required.items()):
        lacking, lines, missing = 0, [], {}
        for line, row in rows:
            absent = [f for f in fields if not has_field(row, f)]
            if absent:
                lacking += 1
                if len(lines) < keep:
                    lines.append(line)
                for f in absent:
                    missing[f] = missing.get(f, 0) + 1
        out[name] = {"required": list(fields), "fits": lacking == 0, "lacking_rows": lacking, "lines": lines,
                     "missing": missing}
    return out


def test_the_report_equals_a_pass_over_every_verifier():
    rng = random.Random(3)
    required = {"math": ("expected_answer",), "code": ("verifier_metadata.unit_tests",),
                "both": ("expected_answer", "verifier_metadata.unit_tests", "question"), "none": ()}
    rows = []
    for line in range(1, 3001):
        row = {}
        if rng.random() < 0.9:
            row["expected_answer"] = "1"
        if rng.random() < 0.3:
            row["verifier_metadata"] = {"unit_tests": ["t"]} if rng.random() < 0.7 else {"unit_tests": None}
        if rng.random() < 0.5:
            row["question"] = "q"
        rows.append((line, row))
    for keep in (1, 20, 5000):
        fit = FieldFit(required, keep=keep)
        for line, row in rows:
            fit.add(line, row)
        got, want = fit.result(), _reference(required, rows, keep)
        assert got == want
        assert got["none"]["fits"] and not got["math"]["fits"] and got["math"]["lacking_rows"] > 200
