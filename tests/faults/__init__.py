"""Faults end to end: lost replies, reset connections, a paused, killed or failed-over Redis.

Every test starts its own servers (``tests/servers.py``) and, where it needs to break a
connection at an exact command, puts ``tests/proxy.py`` between the store and Redis. Every
test asserts on what is stored afterwards, not only on the absence of exceptions.
"""
