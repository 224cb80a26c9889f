"""docker-compose.yml: the default single server, and the ``cluster`` profile's three masters.

No Docker engine runs here, so the file is checked three ways: by ``docker compose config``
(or the older ``docker-compose``) when a client that has it is installed; by reading it as
YAML; and by starting the cluster nodes' own redis-server options on local processes, to see
that a client outside the cluster is sent to the announced hostname and can use it.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from redis.cluster import ClusterNode, RedisCluster

from tests.servers import RedisCluster as LocalCluster
from tests.servers import redis_binaries_available

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
NODES = {"redis-cluster-0": 7000, "redis-cluster-1": 7001, "redis-cluster-2": 7002}
CLUSTER_URL = "redis+cluster://localhost:7000,localhost:7001,localhost:7002"

pytestmark = pytest.mark.fake  # needs no shared server


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    services: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())["services"]
    return services


def node_command(service: dict[str, Any]) -> str:
    """The shell command a cluster node runs, with its NODE_PORT put in as sh would."""
    assert service["entrypoint"] == ["sh", "-c"]
    (command,) = service["command"]
    # "$$" is compose's escape for "$"; sh then expands $NODE_PORT from the environment.
    return str(command).replace("$$NODE_PORT", service["environment"]["NODE_PORT"])


def _compose_clients() -> list[list[str]]:
    clients = []
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True,
                                 check=False).returncode == 0:  # fmt: skip
        clients.append([docker, "compose"])
    if shutil.which("docker-compose"):
        clients.append(["docker-compose"])
    return clients


@pytest.mark.parametrize("profile", [[], ["--profile", "cluster"]], ids=["default", "cluster"])
def test_docker_compose_accepts_the_file(profile: list[str]) -> None:
    clients = _compose_clients()
    if not clients:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")
    for client in clients:
        result = subprocess.run(
            [*client, "-f", str(COMPOSE), *profile, "config", "-q"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr


def test_the_single_server_stays_the_default(services: dict[str, Any]) -> None:
    redis_service = services["redis"]
    assert "profiles" not in redis_service
    assert redis_service["ports"] == ["6379:6379"]
    assert {name for name, s in services.items() if "profiles" not in s} == {"redis"}


def test_the_cluster_profile_is_three_masters_published_on_their_own_ports(
    services: dict[str, Any],
) -> None:
    for name, port in NODES.items():
        node = services[name]
        assert node["profiles"] == ["cluster"]
        assert node["ports"] == [f"{port}:{port}"]  # announced port == published port
        args = shlex.split(node_command(node))
        assert args[:4] == ["exec", "redis-server", "--port", str(port)]
        options = dict(zip(args[2::2], args[3::2], strict=True))
        assert options["--cluster-enabled"] == "yes"
        assert options["--cluster-announce-hostname"] == "localhost"
        assert options["--cluster-preferred-endpoint-type"] == "hostname"
        assert "--cluster-announce-ip" not in options  # the nodes gossip by container IP
        assert node["healthcheck"]["test"] == ["CMD-SHELL", "redis-cli -p $$NODE_PORT ping"]

    init = services["redis-cluster-init"]
    assert init["profiles"] == ["cluster"]
    assert init["depends_on"] == {n: {"condition": "service_healthy"} for n in NODES}
    (script,) = init["command"]
    created = re.findall(r"getent hosts (\S+) \| cut -d' ' -f1\):(\d+)", script)
    assert {name: int(port) for name, port in created} == NODES
    assert "--cluster-replicas 0 --cluster-yes" in script
    assert "cluster_state:ok ||" in script  # a second `up` leaves the cluster as it is


def test_the_docs_name_the_cluster_url() -> None:
    readme = (ROOT / "docs" / "deploying-redis.md").read_text()
    assert "docker compose --profile cluster up -d" in readme
    assert CLUSTER_URL in readme


@pytest.mark.cluster
def test_the_node_options_send_outside_clients_to_localhost(
    services: dict[str, Any], tmp_path: Path
) -> None:
    if not redis_binaries_available():
        pytest.skip("redis-server / redis-cli not found on PATH")
    args = shlex.split(node_command(services["redis-cluster-0"]))[4:]  # after --port P
    with LocalCluster(tmp_path, 3, *args) as cluster:
        with cluster.nodes[0].client() as node:
            slots = node.execute_command("CLUSTER SLOTS")
        assert {entry[2][0] for entry in slots} == {b"localhost"}
        client = RedisCluster(
            startup_nodes=[ClusterNode("localhost", p) for p in cluster.ports],
            socket_timeout=5,
        )
        try:
            keys = [f"compose-check:{i}" for i in range(30)]  # spread over the three masters
            for key in keys:
                client.set(key, key)
            assert [client.get(key) for key in keys] == [k.encode() for k in keys]
            assert len({client.keyslot(k) * 3 // 16384 for k in keys}) == 3
        except redis.RedisError as e:
            pytest.fail(f"a client following the announced endpoints failed: {e}")
        finally:
            client.close()
