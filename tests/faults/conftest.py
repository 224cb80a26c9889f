"""A private Redis behind a fault proxy, shared by the tests of a module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import require_binaries
from tests.proxy import FaultProxy
from tests.servers import RedisServer


@pytest.fixture(scope="module")
def fault_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    require_binaries()
    with RedisServer(Path(tmp_path_factory.mktemp("faults")) / "redis") as server:
        yield server


@pytest.fixture(scope="module")
def module_proxy(fault_server: RedisServer) -> Iterator[FaultProxy]:
    with FaultProxy((fault_server.host, fault_server.port)) as proxy:
        yield proxy


@pytest.fixture
def proxy(module_proxy: FaultProxy) -> Iterator[FaultProxy]:
    """The module's proxy with no rule armed; rules left by the test are disarmed after."""
    module_proxy.clear()
    yield module_proxy
    module_proxy.clear()
