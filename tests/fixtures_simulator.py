"""Fixtures that start the built-in simulator on loopback."""
