"""The reference trainer's reward (examples/train_reinforce.py): a verifier the tiny random model can move.

The job names it by dotted path, `examples.train_reward:digit_fraction`; the operator lets users name it with
`VERIFIER_PATH_MODULES=examples.train_reward` in the web server's and the workers' environment.
"""
from workers.verifiers import verifier


@verifier(required_fields=(), kind="cpu", version="1")
def digit_fraction(row, response_text, options):
    """Reward: the fraction of the response's non-space characters that are digits (0 for an empty one)."""
    chars = [c for c in (response_text or "") if not c.isspace()]
    digits = sum(c.isdigit() for c in chars)
    return (digits / len(chars) if chars else 0.0), {"chars": len(chars), "digits": digits}
