"""With the engine installed, the CLI still starts without it: no torch for any command.

It reads records with the bundled copy of the engine's types, which decode every stored
value as the engine's classes would (the reference-copy tests hold them equal).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import redis

from store import RequestStore
from store.types import engine_importable
from tests import backends
from tests.test_engine_types import create_engine_request

if not engine_importable():
    pytest.skip("mstar-ai is not installed (the engine job runs these)", allow_module_level=True)

PROBE = """
import sys
from store.__main__ import main
sys.argv = ["mstar-store", *sys.argv[1:]]
code = main()
import store.types
print("types", store.types.SOURCE, "torch" in sys.modules, "mstar" in sys.modules, code)
"""


@pytest.mark.real
@pytest.mark.parametrize("command", [["ls"], ["show", "r1"], ["show", "r1", "--json"]])
def test_a_command_imports_neither_the_engine_nor_torch(
    real_client: redis.Redis, namespace: str, command: list[str]
) -> None:
    create_engine_request(RequestStore(real_client, namespace=namespace), "r1")
    url = backends.redis_url_for_tests()
    args = [*command[:1], "--redis-url", url, "--namespace", namespace, *command[1:]]
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "types bundled False False 0", done.stdout
    assert "r1" in done.stdout
