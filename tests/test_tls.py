"""``mstar-store`` over TLS, on a private TLS-only ``redis-server`` with a throw-away CA.

The CA file travels in the URL (``rediss://host:port/0?ssl_ca_certs=FILE``: redis-py passes
URL query parameters to its SSL connection), so every command and ``RequestStore.from_url``
take it with no option of their own. Skipped, saying why, if ``redis-server`` was built
without TLS or ``openssl`` is missing.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from store.cli import main as cli
from store.store import RequestStore
from tests.servers import (
    OPENSSL,
    TlsFiles,
    TlsRedisServer,
    TlsUnsupportedError,
    redis_binaries_available,
)

pytestmark = pytest.mark.servers


def _require_redis() -> None:
    if not redis_binaries_available():
        pytest.skip("redis-server / redis-cli not found on PATH")


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    if shutil.which(OPENSSL) is None:
        pytest.skip(f"no {OPENSSL} to make certificates with")
    return TlsFiles.create(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_redis(
    tmp_path_factory: pytest.TempPathFactory, tls_files: TlsFiles
) -> Iterator[TlsRedisServer]:
    _require_redis()
    server = TlsRedisServer(tmp_path_factory.mktemp("tls-redis"), tls_files)
    try:
        server.start()
    except TlsUnsupportedError as e:
        pytest.skip(str(e))
    try:
        yield server
    finally:
        server.stop()


def test_demo_runs_over_tls(tls_redis: TlsRedisServer, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["demo", "--requests", "2", "--keep", "--redis-url", tls_redis.url])

    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"2 requests on {tls_redis.url}" in out
    # The requests are on that server, read back over a TLS client of our own.
    with tls_redis.client() as client:
        assert client.connection_pool.connection_class.__name__ == "SSLConnection"
        assert len(RequestStore(client, namespace="mstar-demo").list_requests()) == 2


def test_a_server_the_client_cannot_verify_is_one_error_line(
    tls_redis: TlsRedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    # Without the CA the server's certificate is not trusted: the client must refuse it.
    url = f"rediss://{tls_redis.host}:{tls_redis.port}/0"
    code = cli.main(["demo", "--requests", "1", "--redis-url", url])

    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "certificate verify failed" in err


def test_a_server_without_tls_is_told_apart(tmp_path: Path, tls_files: TlsFiles) -> None:
    # The refusal redis-server gives for a TLS option it does not know, as a non-TLS build does.
    _require_redis()
    server = TlsRedisServer(tmp_path, tls_files, None, "--tls-no-such-option", "yes")
    with pytest.raises(TlsUnsupportedError, match=r"tls-no-such-option.*Bad directive"):
        server.start()
    assert not server.running
