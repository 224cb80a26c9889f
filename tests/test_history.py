"""``mstar-store history``: a request's timeline from entries written in the scripts' format."""

from __future__ import annotations

import json

import pytest

from store.cli import history
from store.store import RequestStore
from tests.conftest import Run
from tests.conftest import create_small_request as create

T0 = 1714564800123  # 2024-05-01 12:00:00.123 UTC, in ms: stream ids carry the time


def write_timeline(store: RequestStore, rid: str) -> None:
    """A timeline with fixed times (the reader's format), in place of what the store wrote."""
    key = store.keys.history(rid)
    store.client.delete(key)
    entries: list[dict[str, str | bytes]] = [
        {"op": "create", "replica": "replica-a", "outcome": "applied"},
        {"op": "report", "partition": "llm", "pass": "0", "rank": "1", "wg": "wg",
         "replica": "replica-b", "outcome": "applied"},
        {"op": "report", "partition": "llm", "pass": "0", "rank": "1", "wg": "wg",
         "replica": "replica-a", "outcome": "duplicate"},
        {"op": "advance", "partition": "llm", "pass": "0", "replica": "replica-b",
         "outcome": "fenced", "detail": "token 3 < 4", "token": "3"},
    ]  # fmt: skip
    for i, fields in enumerate(entries):
        store.client.xadd(key, fields, id=f"{T0 + i * 1500}-0")  # type: ignore[arg-type]


def test_history_prints_one_line_per_entry_oldest_first(run: Run, store: RequestStore) -> None:
    create(store, "r-1")
    write_timeline(store, "r-1")

    result = run("history", "r-1")

    assert result.code == 0, result.err
    header, columns, *lines = result.out.splitlines()
    assert header.startswith("history of request 'r-1' in namespace")
    assert header.endswith(": 4 entries, oldest first")
    assert columns.split() == ["TIME", "(UTC)", "OP", "PARTITION", "PASS", "RANK", "WG",
                               "REPLICA", "OUTCOME", "DETAIL"]  # fmt: skip
    assert [line.split() for line in lines] == [
        ["2024-05-01", "12:00:00.123", "create", "-", "-", "-", "-", "replica-a", "applied"],
        ["2024-05-01", "12:00:01.623", "report", "llm", "0", "1", "wg", "replica-b", "applied"],
        ["2024-05-01", "12:00:03.123", "report", "llm", "0", "1", "wg", "replica-a",
         "duplicate"],
        ["2024-05-01", "12:00:04.623", "advance", "llm", "0", "-", "-", "replica-b", "fenced",
         "token", "3", "<", "4", "token=3"],
    ]  # fmt: skip
    # Columns line up: every cell starts where its header does.
    assert lines[3].index("fenced") == columns.index("OUTCOME")


def test_history_json_is_a_list_of_entries(run: Run, store: RequestStore) -> None:
    create(store, "r-1")
    write_timeline(store, "r-1")

    result = run("history", "r-1", "--json")

    assert result.code == 0, result.err
    entries = json.loads(result.out)
    assert [e["op"] for e in entries] == ["create", "report", "report", "advance"]
    assert entries[0] == {
        "id": f"{T0}-0", "time": "2024-05-01T12:00:00.123Z", "op": "create",
        "replica": "replica-a", "outcome": "applied",
    }  # fmt: skip
    assert entries[1]["pass"] == 0 and entries[1]["rank"] == 1 and entries[1]["wg"] == "wg"
    assert entries[3]["token"] == 3
    assert entries[3]["detail"] == "token 3 < 4"


def test_a_damaged_entry_is_shown_not_a_traceback(run: Run, store: RequestStore) -> None:
    create(store, "r-1")
    store.client.delete(store.keys.history("r-1"))  # in place of what the store wrote
    store.client.xadd(
        store.keys.history("r-1"),
        {"op": "report", "pass": "three", "colour": "blue", "replica": b"\xffbad"},
        id=f"{T0}-0",
    )

    text = run("history", "r-1")
    data = run("history", "r-1", "--json")

    assert text.code == data.code == 0
    (line,) = text.out.splitlines()[2:]
    assert line.split() == ["2024-05-01", "12:00:00.123", "report", "-", "three", "-", "-",
                            "\\xffbad", "-", "colour=blue"]  # fmt: skip
    (entry,) = json.loads(data.out)
    assert entry["pass"] == "three"  # not a number: kept as stored
    assert entry["replica"] == "\\xffbad"
    assert entry["other"] == {"colour": "blue"}


def test_no_history_says_whether_the_request_exists(run: Run, store: RequestStore) -> None:
    quiet = RequestStore(store.client, namespace=store.keys.namespace, history_cap=0)
    create(quiet, "r-1")  # a store with its history turned off

    held = run("history", "r-1")
    missing = run("history", "r-9")
    missing_json = run("history", "r-9", "--json")

    assert held.code == 0
    assert held.out.startswith("no history of request 'r-1'")
    assert held.out.rstrip().endswith("(the request is held)")
    assert missing.code == 1
    # then, on a server where other namespaces hold requests, which (test_cli_guidance)
    assert "(and no such request is held)" in missing.out
    assert (missing_json.code, missing_json.out.strip()) == (1, "[]")
    assert "no request 'r-9' and no history of it" in missing_json.err


def test_history_outlives_the_request(run: Run, store: RequestStore) -> None:
    write_timeline(store, "gone")

    result = run("history", "gone")

    assert result.code == 0
    assert result.out.splitlines()[0].endswith("(the request is no longer held)")


def test_a_long_history_is_read_page_by_page(
    run: Run, store: RequestStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(history, "PAGE", 3)
    for i in range(7):
        store.client.xadd(store.keys.history("r-1"), {"op": "renew", "pass": str(i)})

    entries = json.loads(run("history", "r-1", "--json").out)

    assert [e["pass"] for e in entries] == list(range(7))


def test_a_bad_request_id_is_an_error(run: Run) -> None:
    result = run("history", "bad id")
    assert result.code == 1
    assert result.err.startswith("error: request id may hold only printable ASCII")


def test_show_points_to_the_history(run: Run, store: RequestStore, namespace: str) -> None:
    create(store, "r-1")
    lines = run("show", "r-1").out.splitlines()
    # With the options that reach the same namespace (and server, if not the default).
    assert lines[-1].startswith(f"history: mstar-store history r-1 --namespace {namespace}")
