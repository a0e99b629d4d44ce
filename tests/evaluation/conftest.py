"""The shared fixtures of tests/fakes.py, for the tests in this directory."""

from fakes import api_server, hf_backend, server

__all__ = ["api_server", "hf_backend", "server"]
