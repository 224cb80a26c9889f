"""``mstar-store migrate``, driven in-process through ``store.cli.main``.

Against fakeredis, ``store.cli.main.make_client`` is replaced so that the command runs on the
test's server; one test goes through ``--redis-url`` to the real Redis.
"""

from __future__ import annotations

from typing import Any

import fakeredis
import pytest
import redis

from store.cli import main as cli
from store.cli.migrate import ProgressBar
from store.schema import SCHEMA_VERSION
from tests import fixtures
from tests.conftest import redis_url_for_tests
from tests.fixtures import record_keys, snapshot, store_fixture, versions_held

pytestmark = pytest.mark.usefixtures("_no_env_defaults")

CURRENT = [str(SCHEMA_VERSION).encode()] * 4
MIXED = {f"r{i:02d}": fixtures.VERSIONS[i % len(fixtures.VERSIONS)] for i in range(12)}
OLD_RECORDS = 4 * sum(v < SCHEMA_VERSION for v in MIXED.values())
CURRENT_RECORDS = 48 - OLD_RECORDS


@pytest.fixture
def _no_env_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MSTAR_REDIS_URL", raising=False)
    monkeypatch.delenv("MSTAR_NAMESPACE", raising=False)


@pytest.fixture
def fake(fake_server: fakeredis.FakeServer, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fakeredis client on the server the command will be given."""
    monkeypatch.setattr(cli, "make_client", lambda args: fakeredis.FakeRedis(server=fake_server))
    return fakeredis.FakeRedis(server=fake_server)


@pytest.mark.fake
def test_migrate_upgrades_the_namespace_and_prints_the_counts(
    fake: Any, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    store_fixture(fake, namespace, MIXED)

    code = cli.main(["migrate", "--namespace", namespace, "--batch", "5"])

    out, err = capsys.readouterr()
    assert code == 0
    assert (
        f"namespace {namespace!r}, schema version {SCHEMA_VERSION}: 12 requests, "
        f"48 records seen, {OLD_RECORDS} upgraded, {CURRENT_RECORDS} already current, 0 failed"
    ) in out
    assert "failed:" not in out
    # stderr is no terminal here: plain progress lines (the first and the last), no frames
    last = f"12/12 requests  {OLD_RECORDS} upgraded  {CURRENT_RECORDS} current  0 failed\n"
    assert "\r" not in err and err.endswith(last)
    assert all(versions_held(fake, namespace, rid) == CURRENT for rid in MIXED)

    assert cli.main(["migrate", "--namespace", namespace]) == 0
    assert "0 upgraded, 48 already current" in capsys.readouterr().out


@pytest.mark.fake
def test_dry_run_changes_nothing(
    fake: Any, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    store_fixture(fake, namespace, MIXED)
    before = snapshot(fake, namespace)

    code = cli.main(["migrate", "--dry-run", "--namespace", namespace])

    out, _ = capsys.readouterr()
    assert code == 0
    assert out.startswith("dry run: ")
    assert (
        f"48 records seen, {OLD_RECORDS} would upgrade, {CURRENT_RECORDS} already current, 0 failed"
    ) in out
    assert snapshot(fake, namespace) == before


@pytest.mark.fake
def test_a_bad_record_is_named_the_others_upgraded_and_the_exit_code_is_1(
    fake: Any, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    store_fixture(fake, namespace, MIXED)
    assert MIXED["r05"] == 1
    bad = record_keys(namespace, "r05")[2]  # a v1 partition
    fake.hset(bad, "per_label_seq_info", b"\xc1")

    code = cli.main(["migrate", "--namespace", namespace, "--batch", "2"])

    out, _ = capsys.readouterr()
    assert code == 1
    assert f"{OLD_RECORDS - 1} upgraded, {CURRENT_RECORDS} already current, 1 failed" in out
    failures = [line for line in out.splitlines() if line.startswith("failed: ")]
    assert len(failures) == 1 and failures[0].startswith(f"failed: {bad}: ")
    assert "per_label_seq_info does not decode" in failures[0]
    now = CURRENT[0]
    assert versions_held(fake, namespace, "r05") == [now, now, b"1", now]
    assert all(versions_held(fake, namespace, rid) == CURRENT for rid in MIXED if rid != "r05")


@pytest.mark.fake
def test_an_interrupted_run_says_so_and_the_next_run_finishes(
    fake: Any, namespace: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    store_fixture(fake, namespace, MIXED)
    draw = ProgressBar.update

    def interrupt(self: ProgressBar, *args: Any) -> None:
        draw(self, *args)
        raise KeyboardInterrupt

    monkeypatch.setattr(ProgressBar, "update", interrupt)
    assert cli.main(["migrate", "--namespace", namespace, "--batch", "4"]) == 130
    assert "interrupted" in capsys.readouterr().out
    monkeypatch.setattr(ProgressBar, "update", draw)

    assert cli.main(["migrate", "--namespace", namespace, "--batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "48 records seen" in out and "0 failed" in out
    assert all(versions_held(fake, namespace, rid) == CURRENT for rid in MIXED)


@pytest.mark.fake
@pytest.mark.parametrize("batch", ["0", "-3", "many"])
def test_batch_must_be_a_positive_number(batch: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["migrate", "--batch", batch])
    assert exited.value.code == 2
    assert "--batch" in capsys.readouterr().err


@pytest.mark.real
def test_migrate_on_the_real_redis_by_url(
    real_client: redis.Redis, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    store_fixture(real_client, namespace, MIXED)

    code = cli.main(["migrate", "--redis-url", redis_url_for_tests(), "--namespace", namespace])

    assert code == 0
    out = capsys.readouterr().out
    assert f"{OLD_RECORDS} upgraded, {CURRENT_RECORDS} already current, 0 failed" in out
    assert all(versions_held(real_client, namespace, rid) == CURRENT for rid in MIXED)
