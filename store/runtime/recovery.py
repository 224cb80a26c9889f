"""Recovery: take over the steps whose driver died, and redo safely what it may have left.

``recover_once`` asks the store for the steps due (``due_steps``), claims each
(``claim_step``: a fenced lease) and ``redo``es it: takes the step if the pass completed,
finishes a request whose partitions are all done, else sends the pass again once its last
send (by any replica, as the store recorded it) is no longer fresh, and releases the lease
with the next check time. Programs as in ``store.runtime.decisions``.
"""

from __future__ import annotations

import logging

from store.errors import (
    FencedError,
    NotFoundError,
    StalePassError,
    StoreConnectionError,
    StoreError,
)
from store.records import Lease, RequestState
from store.runtime.books import Books
from store.runtime.decisions import (
    Failpoint,
    Program,
    ReportStatus,
    current_step,
    dispatch,
    finish_if_done,
    nudge_consumers,
    pass_complete,
    planner,
    store,
    took_step,
)
from store.types import PartitionState

log = logging.getLogger(__name__)


def recover_once(books: Books) -> Program[tuple[int, int]]:
    """Claim the steps that are due and redo each; returns (steps looked at, claimed).

    An error of one request (a damaged record) does not stop the others: its lease runs
    out and it is looked at again. Redis unreachable stops the look (``run`` pauses).
    """
    asked = books.clock()
    pairs = yield store("due_steps", limit=books.timing.recovery_batch)
    claimed = 0
    for rid, name in pairs:
        if books.clock() - asked > books.timing.lease_ttl / 2:
            # This replica was paused (or Redis was slow) since it asked: what was due
            # then may be finished now. Look again rather than claim from a stale list.
            break
        try:
            lease = yield store("claim_step", rid, name, books.replica_id)
            if lease is None:
                continue
            claimed += 1
            yield from redo(books, lease)
        except StoreConnectionError:
            raise
        except StoreError as e:  # its lease runs out; it is looked at again
            books.count("recovery_errors")
            log.warning("recovery of %s %s failed: %s", rid, name, e)
    return len(pairs), claimed


def redo(books: Books, lease: Lease) -> Program[None]:
    """Redo whatever the step's last driver may not have done (see the module docstring)."""
    rid, name = lease.request_id, lease.partition
    if not books.hold(lease):
        return  # a report of this replica won the step: that drive goes on
    books.count("takeovers")
    yield Failpoint("after_claim")
    try:
        state: RequestState = yield store("load_request", rid)
        part = state.partitions[name]
        if state.record.finished_at:
            pass  # finished since it was found due (kept for inspection): nothing to redo
        elif part.is_done:
            _, finished = yield from finish_if_done(books, lease, state)
            yield from nudge_consumers(books, rid, name, state)
            if not finished:
                yield store("release_lease", lease, check_in=None, sent=False)
        elif pass_complete(part):
            step = yield planner("next_step", rid, name, part)
            new_pass = yield store("take_step", lease, step, check_in=books.deadlines.check_in(1))
            yield from took_step(books, lease, step, new_pass, ReportStatus.APPLIED)
        else:
            yield from nudge_consumers(books, rid, name, state)
            check_in, sent = yield from resend(books, lease, part, state)
            yield Failpoint("before_release")
            yield store("release_lease", lease, check_in=check_in, sent=sent)
    except (FencedError, StalePassError):
        books.count("fenced")  # claimed again by another replica meanwhile: it drives
    except NotFoundError:
        pass
    books.drop(lease)


def resend(
    books: Books, lease: Lease, part: PartitionState, state: RequestState
) -> Program[tuple[float, bool]]:
    """Send the claimed step's current pass again, unless it cannot run yet or its last
    send is still fresh; returns when recovery should look again, and whether it sent."""
    rid, name = lease.request_id, lease.partition
    if not (yield planner("runnable", rid, name, state)):
        books.count("waiting")  # a consumer waiting for tokens: its producer nudges it
        return books.deadlines.check_in(lease.sends + 1), False
    # The store lets a step be claimed only once its check time came, and every send set
    # that to its deadline; but the deadline may have grown since (slower passes seen).
    wait = books.deadlines.wait(lease.sends)
    since = last_sent(books, lease, part.fwd_pass_number)
    if since is not None and since < wait:
        books.count("fresh")  # sent lately (by this replica or the last holder): not lost yet
        return wait - since, False
    yield from dispatch(books, rid, name, part.fwd_pass_number, current_step(part))
    books.count("resends")
    yield Failpoint("after_dispatch")
    return books.deadlines.check_in(lease.sends + 1), True


def last_sent(books: Books, lease: Lease, fwd_pass: int) -> float | None:
    """Seconds since the pass was last sent, as far as anyone knows: this replica's own
    sends, or the store's record of the last send by any replica (``Lease.sent_at``, by
    the server's clock, as the claim time ``expires_at - lease_ttl`` is)."""
    since = books.since_sent(lease.request_id, lease.partition, fwd_pass)
    if lease.sent_at > 0:
        recorded = max(0.0, lease.expires_at - books.timing.lease_ttl - lease.sent_at)
        since = recorded if since is None else min(since, recorded)
    return since
