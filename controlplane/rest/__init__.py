"""The REST API's conventions every app's API follows (core: no app imported here)."""
