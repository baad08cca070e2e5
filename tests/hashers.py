"""The tests' password hasher (tests/conftest.py installs it): PBKDF2 with 1000 rounds instead of Django's 1M.

Every user a test makes hashes its password (0.45 s of CPU each at 1M rounds). Same algorithm name, and the
rounds are stored in each hash, so the suite's real servers (default settings) still check these passwords."""
from django.contrib.auth.hashers import PBKDF2PasswordHasher


class FastPBKDF2PasswordHasher(PBKDF2PasswordHasher):
    iterations = 1000
