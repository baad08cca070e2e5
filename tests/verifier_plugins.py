"""A user's own verifiers, named by dotted path in tests (as a user would name theirs)."""
from workers.verifiers import Verifier, VerifyResult, verifier


@verifier(required_fields=("expected_answer",), options={"suffix": (str, "")}, kind="cpu")
def last_word(row, response_text, options):
    """Reward 1 when the response's last word (minus `suffix`) equals expected_answer."""
    words = (response_text or "").split()
    got = words[-1].removesuffix(options["suffix"]) if words else ""
    return (1.0 if got == str(row["expected_answer"]) else 0.0), {"last_word": got}


class Length(Verifier):
    """Reward: 1 when the response has at least `min_words` words."""

    kind = "cpu"
    required_fields = ()
    options = {"min_words": (int, 3)}

    def verify(self, row, response_text, options):
        n = len((response_text or "").split())
        return VerifyResult(reward=1.0 if n >= options.get("min_words", 3) else 0.0, fields={"words": n})


def not_marked(row, response_text, options):
    return 1.0


@verifier(required_fields=(), kind="cpu")
def crash_when_flagged(row, response_text, options):
    """Kills its own process (as a segfaulting C extension would) for rows with "crash_verifier": true."""
    import os

    if row.get("crash_verifier"):
        os._exit(3)
    return 1.0


@verifier(required_fields=("expected_answer",), options={"counter_url": (str, ""), "counter": (str, ""),
                                                         "sleep_s": (float, 0.0)}, kind="cpu")
def counted(row, response_text, options):
    """math's reward, and one INCR of Redis key `counter` per computation (the tests count real work)."""
    import time

    import redis

    from workers.verifiers import verify_row

    if options["sleep_s"]:
        time.sleep(options["sleep_s"])  # widens the window in which two workers could do the same work
    r = redis.Redis.from_url(options["counter_url"], socket_timeout=5)
    r.incr(options["counter"])
    r.close()
    return verify_row("math", row, response_text)


@verifier(required_fields=("expected_answer",), options={"counter_url": (str, ""), "counter": (str, ""),
                                                         "sleep_s": (float, 0.0)}, kind="io")
def counted_io(row, response_text, options):
    """The same in a thread (io kind)."""
    return counted(row, response_text, options)


@verifier(required_fields=(), options={"sleep_s": (float, 0.0)}, kind="io")
def slow_io(row, response_text, options):
    """Reward 1 after `sleep_s` (a verifier that waits on something else: a judge, a sandbox)."""
    import time

    time.sleep(options["sleep_s"])
    return 1.0
