"""A preamble for a test's ``python -c`` script: from it on, every name lookup and connection
is recorded in ``attempts`` and refused (the script prints ``attempts`` at its end)."""

REFUSE_NETWORK = """
import socket

attempts = []


def refuse(*args, **kwargs):
    attempts.append(args[:2])
    raise OSError("network disabled by the test")


socket.getaddrinfo = refuse
socket.socket.connect = lambda self, *a: refuse(*a)
"""
