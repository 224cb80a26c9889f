"""The ``exclusive`` marker: under pytest-xdist, such a test runs with no other test beside it.

An autouse fixture, imported by ``tests/conftest.py`` (and by the probe run of
``tests/test_exclusive.py``).
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def share_the_machine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Under pytest-xdist, a test marked ``exclusive`` runs with no other test beside it.

    Those are the tests that check a guarantee "at default settings" under heavy contention
    (64 merges into one partition must all commit within the default patience): with the
    other workers' tests on the same 2 cores, one of them ran out of time in one CI run of
    about ten. Every test holds a shared lock on a file of the run for as long as it runs;
    an exclusive one waits for the running tests to end and keeps new ones from starting
    (the turnstile) until it is done.
    """
    if not hasattr(request.config, "workerinput"):  # not an xdist worker (nor its child)
        yield
        return
    shared = tmp_path_factory.getbasetemp().parent  # the same for every worker of a run
    exclusive = request.node.get_closest_marker("exclusive") is not None
    with (
        open(shared / "turnstile.lock", "a") as turnstile,
        open(shared / "tests.lock", "a") as running,
    ):
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if exclusive:
            fcntl.flock(running, fcntl.LOCK_EX)
        else:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
            fcntl.flock(running, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(running, fcntl.LOCK_UN)
            fcntl.flock(turnstile, fcntl.LOCK_UN)
