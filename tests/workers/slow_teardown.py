"""Preloaded by a test into the verifier pool's fork server: its teardown at exit takes seconds (an atexit sleep),
as a fork server holding math-verify and sympy takes a fraction of one; a process stopped without teardown does
not run it."""
import atexit
import time

atexit.register(time.sleep, 3.0)
