"""Start and stop throw-away ``redis-server`` processes for tests.

No pytest dependency: these helpers can be used from scripts as well.  Every
server runs in its own working directory, on a free port, bound to 127.0.0.1,
and logs to ``<workdir>/redis-<port>.log``.

As a command, for CI steps that run the suite against a private topology::

    python -m tests.servers cluster --dir DIR [--masters 3]

prints the store URL (``redis+cluster://...``) on one line and keeps the servers
running until it gets SIGTERM or SIGINT (or its parent exits), then stops them.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Self
from urllib.parse import quote

import redis
import redis.asyncio.retry
import redis.cluster
import redis.sentinel
from redis.backoff import NoBackoff
from redis.retry import Retry

START_TIMEOUT = 10.0
STOP_TIMEOUT = 10.0
CLUSTER_TIMEOUT = 30.0
HOST = "127.0.0.1"

REDIS_SERVER = os.environ.get("REDIS_SERVER_BIN") or shutil.which("redis-server") or "redis-server"
REDIS_CLI = os.environ.get("REDIS_CLI_BIN") or shutil.which("redis-cli") or "redis-cli"


def redis_binaries_available() -> bool:
    """True if both ``redis-server`` and ``redis-cli`` can be found."""
    return all(shutil.which(b) for b in (REDIS_SERVER, REDIS_CLI))


def no_retry() -> Retry:
    """A redis-py retry policy that never retries (redis-py >= 6 retries by default)."""
    return Retry(NoBackoff(), 0)


def no_async_retry() -> redis.asyncio.retry.Retry:
    """``no_retry`` for a ``redis.asyncio`` client (redis-py 8.2 warns at a sync one)."""
    return redis.asyncio.retry.Retry(NoBackoff(), 0)


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free right now (OS-assigned)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
    return port


def free_cluster_port() -> int:
    """Return a free port P whose cluster bus port P + 10000 is free as well.

    OS-assigned ephemeral ports are usually > 55535, which would push the bus
    port beyond 65535, so pick from 20000..45000 instead.
    """
    for _ in range(1000):
        port = random.randint(20000, 45000)
        if _port_is_free(port) and _port_is_free(port + 10000):
            return port
    raise RuntimeError("could not find a free port pair for a cluster node")


def _probe(host: str, port: int, **options: Any) -> redis.Redis:
    """A client that answers or fails within half a second, for polling a starting server."""
    return redis.Redis(
        host=host,
        port=port,
        socket_timeout=0.5,
        socket_connect_timeout=0.5,
        retry=no_retry(),
        **options,
    )


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"<no log: {e}>"


class _Started:
    """``with`` starts the processes and stops them after."""

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class RedisServer(_Started):
    """One ``redis-server`` process.

    ``args`` are appended to ``--port P --dir D --save "" --appendonly no``;
    later options win, so ``"--appendonly", "yes"`` turns AOF on.
    """

    def __init__(self, workdir: Path, port: int | None = None, *args: str) -> None:
        self.workdir = Path(workdir)
        self._auto_port = port is None
        self.port: int = free_port() if port is None else port
        self.args: tuple[str, ...] = args
        self.host = HOST
        self.proc: subprocess.Popen[bytes] | None = None
        self._paused = False

    # -- properties ---------------------------------------------------------
    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def logfile(self) -> Path:
        return self.workdir / f"redis-{self.port}.log"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def command(self) -> list[str]:
        return [
            REDIS_SERVER,
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--dir",
            str(self.workdir),
            "--save",
            "",
            "--appendonly",
            "no",
            *self.args,
        ]

    def connection_options(self) -> dict[str, Any]:
        """What a redis-py client needs besides host and port (TLS, for a subclass)."""
        return {}

    def client(self, **kwargs: Any) -> redis.Redis:
        """A new (bytes-returning) client for this server; the caller closes it."""
        kwargs.setdefault("socket_timeout", 5)
        return redis.Redis(host=self.host, port=self.port, **self.connection_options(), **kwargs)

    # -- lifecycle ----------------------------------------------------------
    def start(self) -> Self:
        if self.running:
            raise RuntimeError(f"redis-server on port {self.port} is already running")
        self.workdir.mkdir(parents=True, exist_ok=True)
        attempts = 5 if self._auto_port else 1
        for attempt in range(attempts):
            try:
                self._spawn_and_wait()
                return self
            except _PortInUseError:
                if attempt == attempts - 1:
                    raise
                self.port = free_port()
        raise AssertionError("unreachable")

    def _spawn_and_wait(self) -> None:
        with open(self.logfile, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
            )
        self._paused = False
        deadline = time.monotonic() + START_TIMEOUT
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                tail = _tail(self.logfile)
                if "Address already in use" in tail:
                    raise _PortInUseError(tail)
                raise RuntimeError(
                    f"redis-server on port {self.port} exited during startup; log tail:\n{tail}"
                )
            try:
                with _probe(self.host, self.port, **self.connection_options()) as c:
                    if c.ping():
                        return
            except redis.RedisError as e:
                # LOADING (AOF being replayed) and connection refused land here.
                last_error = e
            time.sleep(0.05)
        self._terminate(signal.SIGKILL)
        raise RuntimeError(
            f"redis-server on port {self.port} did not answer PING within {START_TIMEOUT}s "
            f"(last error: {last_error!r}); log tail:\n{_tail(self.logfile)}"
        )

    def _terminate(self, sig: signal.Signals) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            if self._paused and sig != signal.SIGKILL:
                proc.send_signal(signal.SIGCONT)
            proc.send_signal(sig)
            try:
                proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        else:
            proc.wait()
        self.proc = None
        self._paused = False

    def stop(self) -> None:
        """Graceful shutdown (SIGTERM; SIGKILL after 10 s). Idempotent."""
        self._terminate(signal.SIGTERM)

    def kill(self) -> None:
        """Hard crash: SIGKILL, no shutdown work at all."""
        self._terminate(signal.SIGKILL)

    def restart(self) -> Self:
        """Stop (if running) and start again on the same port and dir.

        With ``--appendonly yes`` the AOF files in the dir are reloaded.
        """
        self.stop()
        self._auto_port = False  # keep the port: clients hold the URL
        return self.start()

    def pause(self) -> None:
        """SIGSTOP: the server stops answering but keeps its sockets open."""
        if self.proc is None:
            raise RuntimeError("server is not running")
        self.proc.send_signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self.proc is None:
            raise RuntimeError("server is not running")
        self.proc.send_signal(signal.SIGCONT)
        self._paused = False

    def __enter__(self) -> Self:
        return self if self.running else self.start()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<RedisServer {self.host}:{self.port} {state} dir={self.workdir}>"


class _PortInUseError(RuntimeError):
    pass


class PasswordRedisServer(RedisServer):
    """A ``redis-server`` that asks every client for ``password`` (``requirepass``)."""

    def __init__(self, workdir: Path, password: str, port: int | None = None, *args: str):
        super().__init__(workdir, port, "--requirepass", password, *args)
        self.password = password

    @property
    def url(self) -> str:
        return f"redis://:{quote(self.password)}@{self.host}:{self.port}/0"

    def connection_options(self) -> dict[str, Any]:
        return {"password": self.password}


OPENSSL = os.environ.get("OPENSSL_BIN") or shutil.which("openssl") or "openssl"


@dataclass(frozen=True)
class TlsFiles:
    """A throw-away CA and a server certificate it signed, for 127.0.0.1 and localhost."""

    ca_cert: Path
    cert: Path
    key: Path

    @classmethod
    def create(cls, workdir: Path) -> TlsFiles:
        """Generate them with the ``openssl`` CLI (EC P-256 keys: instant, unlike RSA)."""
        workdir.mkdir(parents=True, exist_ok=True)
        ca_key, ca_cert = workdir / "ca.key", workdir / "ca.crt"
        key, csr, cert = workdir / "server.key", workdir / "server.csr", workdir / "server.crt"
        ext = workdir / "server.ext"
        # Extensions a strict verifier (VERIFY_X509_STRICT) asks for, so no client rejects it.
        ext.write_text(
            "basicConstraints = critical, CA:FALSE\n"
            "keyUsage = critical, digitalSignature\n"
            "extendedKeyUsage = serverAuth\n"
            "subjectAltName = IP:127.0.0.1, DNS:localhost\n"
            "authorityKeyIdentifier = keyid\n"
        )
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        _openssl("req", "-x509", *ec, "-keyout", ca_key, "-out", ca_cert, "-days", "2",
                 "-subj", "/CN=mstar-store test CA",
                 "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
        _openssl("req", "-new", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1")
        _openssl("x509", "-req", "-in", csr, "-CA", ca_cert, "-CAkey", ca_key,
                 "-CAcreateserial", "-out", cert, "-days", "2", "-extfile", ext)  # fmt: skip
        return cls(ca_cert, cert, key)


def _openssl(*args: str | Path) -> None:
    res = subprocess.run(
        [OPENSSL, *map(str, args)], stdin=subprocess.DEVNULL, capture_output=True, check=False
    )
    if res.returncode != 0:
        raise RuntimeError(
            f"openssl {args[0]} failed ({res.returncode}): {res.stderr.decode(errors='replace')}"
        )


class TlsRedisServer(RedisServer):
    """A ``redis-server`` that speaks TLS only, on ``port``; clients need not show a cert.

    A ``redis-server`` built without TLS refuses the options: ``start`` then raises
    ``TlsUnsupportedError`` with the server's own words.
    """

    def __init__(self, workdir: Path, tls: TlsFiles, port: int | None = None, *args: str):
        super().__init__(workdir, port, *args)
        self.tls = tls

    @property
    def url(self) -> str:
        """A ``rediss://`` URL that trusts this server's CA (redis-py reads the query)."""
        return f"rediss://{self.host}:{self.port}/0?ssl_ca_certs={quote(str(self.tls.ca_cert))}"

    def command(self) -> list[str]:
        # Later options win: the plain port is closed, TLS listens on ours.
        return [
            *super().command(),
            "--port", "0",
            "--tls-port", str(self.port),
            "--tls-cert-file", str(self.tls.cert),
            "--tls-key-file", str(self.tls.key),
            "--tls-ca-cert-file", str(self.tls.ca_cert),
            "--tls-auth-clients", "no",
        ]  # fmt: skip

    def connection_options(self) -> dict[str, Any]:
        return {"ssl": True, "ssl_ca_certs": str(self.tls.ca_cert)}

    def start(self) -> Self:
        try:
            return super().start()
        except RuntimeError as e:
            said = [m.group(0).strip() for m in _TLS_REFUSED.finditer(str(e))]
            if said:
                raise TlsUnsupportedError(
                    f"{REDIS_SERVER} refuses TLS (built without it?): {' '.join(said)}"
                ) from e
            raise


# How redis-server refuses a TLS option it was not built with: the line it names, and why.
_TLS_REFUSED = re.compile(
    r"^>>> 'tls-.*$|^.*(Bad directive|TLS.*not (supported|available)|unsupported).*$",
    re.MULTILINE | re.IGNORECASE,
)


class TlsUnsupportedError(RuntimeError):
    pass


class RedisCluster(_Started):
    """A Redis Cluster of ``masters`` masters, each with ``replicas`` replicas; every node in
    its own subdir. A master whose node is down for ``node_timeout_ms`` is failed over to
    one of its replicas (``wait_promoted``)."""

    def __init__(
        self,
        workdir: Path,
        masters: int = 3,
        *args: str,
        replicas: int = 0,
        node_timeout_ms: int = 5000,
    ) -> None:
        if masters < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 masters")
        self.workdir = Path(workdir)
        self.masters = masters
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.args = args
        self.nodes: list[RedisServer] = []

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    @property
    def startup_nodes(self) -> list[redis.cluster.ClusterNode]:
        return [redis.cluster.ClusterNode(HOST, p) for p in self.ports]

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.ports[0]}"

    @property
    def store_url(self) -> str:
        """Every node, in the form ``store.io.connect`` (and ``REDIS_URL``) accepts."""
        return "redis+cluster://" + ",".join(f"{HOST}:{p}" for p in self.ports)

    def client(self, **kwargs: Any) -> redis.cluster.RedisCluster:
        """A new cluster client; the caller closes it."""
        kwargs.setdefault("socket_timeout", 5)
        return redis.cluster.RedisCluster(startup_nodes=self.startup_nodes, **kwargs)

    def start(self) -> Self:
        try:
            for _ in range(self.masters * (1 + self.replicas)):
                port = free_cluster_port()
                node = RedisServer(
                    self.workdir / f"node-{port}",
                    port,
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    f"nodes-{port}.conf",
                    "--cluster-node-timeout",
                    str(self.node_timeout_ms),
                    # A replica's full sync starts at once, not after the default 5 s wait.
                    "--repl-diskless-sync-delay",
                    "0",
                    *self.args,
                )
                self.nodes.append(node)
                node.start()
            self._create()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _create(self) -> None:
        cmd = [
            REDIS_CLI,
            "--cluster",
            "create",
            *(f"{HOST}:{p}" for p in self.ports),
            "--cluster-replicas",
            str(self.replicas),
            "--cluster-yes",
        ]
        res = subprocess.run(
            cmd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=CLUSTER_TIMEOUT,
            check=False,
        )
        (self.workdir / "cluster-create.log").write_bytes(res.stdout + res.stderr)
        if res.returncode != 0:
            raise RuntimeError(
                f"redis-cli --cluster create failed ({res.returncode}):\n"
                f"{(res.stdout + res.stderr).decode(errors='replace')}"
            )

    def _wait_ok(self) -> None:
        deadline = time.monotonic() + CLUSTER_TIMEOUT
        pending = list(self.nodes)
        while pending and time.monotonic() < deadline:
            node = pending[0]
            try:
                with node.client(socket_timeout=1) as c:
                    if cluster_state(c) == "ok":
                        pending.pop(0)
                        continue
            except redis.RedisError:
                pass
            time.sleep(0.1)
        if pending:
            raise RuntimeError(
                f"cluster not ok within {CLUSTER_TIMEOUT}s on ports {[n.port for n in pending]}"
            )

    def wait_ready(self) -> None:
        """Until every node says the cluster is ok and every replica's link to its master is
        up (a failover needs it); after ``start``, or after a killed node was restarted (it
        rejoins as a replica of the node promoted in its place)."""
        self._wait_ok()
        deadline = time.monotonic() + CLUSTER_TIMEOUT
        # Right after `--cluster create` a replica may still call itself a master, and the
        # nodes learn who replicates whom by gossip: wait until the map says it.
        while self.replicas and not self._replicated():
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster's replicas did not show in its map")
            time.sleep(0.05)
        for node in self.nodes:
            while True:
                with node.client(socket_timeout=1) as c:
                    info = c.info("replication")
                if info.get("role") != "slave" or info.get("master_link_status") == "up":
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"replica on port {node.port} did not sync with its master")
                time.sleep(0.05)

    def _replicated(self) -> bool:
        """Every master has its replicas, as every running node sees the map."""
        for node in self.nodes:
            if not node.running:
                continue
            try:
                with node.client(socket_timeout=1) as c:
                    nodes = parse_cluster_nodes(c.execute_command("CLUSTER", "NODES"))
            except redis.RedisError:
                return False
            masters = [n for n in nodes if "master" in n.flags and "fail" not in n.flags]
            for master in masters:
                if sum(n.master_id == master.id for n in nodes) < self.replicas:
                    return False
        return True

    def owner_of(self, slot: int) -> RedisServer:
        """The master that serves ``slot`` now, as the first running node sees it."""
        for node in self.nodes:
            if not node.running:
                continue
            with node.client() as c:
                for start, end, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
                    if start <= slot <= end:
                        return self.node(int(master[1]))
            break
        raise AssertionError(f"slot {slot} is not served")

    def migrate_slot(self, slot: int, source: RedisServer, target: RedisServer) -> int:
        """Move ``slot`` with its keys from ``source`` to ``target``, as a resharding would;
        returns how many keys moved."""
        with source.client() as src, target.client() as dst:
            src_id = src.execute_command("CLUSTER MYID")
            dst_id = dst.execute_command("CLUSTER MYID")
            dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
            src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
            moved = 0
            while keys := src.execute_command("CLUSTER GETKEYSINSLOT", slot, 100):
                src.execute_command("MIGRATE", target.host, target.port, "", 0, 5000, "KEYS", *keys)
                moved += len(keys)
            others = [n for n in self.nodes if n.running and n not in (source, target)]
            for node in (target, source, *others):
                with node.client() as c:
                    c.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
        return moved

    def node(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def topology(self) -> list[ClusterNodeInfo]:
        """Every node as a live node sees them (``CLUSTER NODES``)."""
        for node in self.nodes:
            if not node.running:
                continue
            try:
                with node.client(socket_timeout=1) as c:
                    raw = c.execute_command("CLUSTER", "NODES")
            except redis.RedisError:
                continue
            return parse_cluster_nodes(raw)
        raise RuntimeError("no cluster node answers")

    def replicas_of(self, master_port: int) -> list[int]:
        """The ports of the replicas of the master on ``master_port``."""
        nodes = self.topology()
        master = next(n for n in nodes if n.port == master_port)
        return [n.port for n in nodes if n.master_id == master.id]

    def wait_replicated(self, master_port: int, timeout: float = CLUSTER_TIMEOUT) -> None:
        """Until every replica of the master on ``master_port`` has what it has written."""
        deadline = time.monotonic() + timeout
        with self.node(master_port).client(socket_timeout=1) as c:
            target = int(c.info("replication")["master_repl_offset"])
        for port in self.replicas_of(master_port):
            with self.node(port).client(socket_timeout=1) as c:
                while int(c.info("replication").get("slave_repl_offset", -1)) < target:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"replica {port} did not catch up with {master_port}")
                    time.sleep(0.02)

    def wait_promoted(self, port: int, timeout: float = CLUSTER_TIMEOUT) -> float:
        """Wait until the node on ``port`` is a master and the cluster is ok again, as seen
        by every node still running; returns when (``time.monotonic()``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                promoted = any(n.port == port and "master" in n.flags for n in self.topology())
                if promoted and all(_cluster_ok(n) for n in self.nodes if n.running):
                    return time.monotonic()
            except redis.RedisError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"node {port} was not promoted within {timeout}s")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@dataclass(frozen=True)
class ClusterNodeInfo:
    """One line of ``CLUSTER NODES``."""

    id: str
    port: int
    flags: frozenset[str]
    master_id: str | None  # the master of a replica


def parse_cluster_nodes(raw: object) -> list[ClusterNodeInfo]:
    text = raw if isinstance(raw, str) else _s(raw)
    out = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        address = fields[1].split("@", 1)[0]
        out.append(
            ClusterNodeInfo(
                id=fields[0],
                port=int(address.rpartition(":")[2]),
                flags=frozenset(fields[2].split(",")),
                master_id=None if fields[3] == "-" else fields[3],
            )
        )
    return out


class RedisSentinel(_Started):
    """One Sentinel process monitoring ``master`` (an already running RedisServer), or
    nothing at all when ``master`` is None (a Sentinel that knows no service).

    Quorum 1, down-after 1 s, failover-timeout 5 s, service name ``mymaster``.
    """

    service_name = "mymaster"

    def __init__(self, master: RedisServer | None, workdir: Path, port: int | None = None) -> None:
        self.master = master
        self.workdir = Path(workdir)
        self.port = free_port() if port is None else port
        self.host = HOST
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def sentinels(self) -> list[tuple[str, int]]:
        return [(self.host, self.port)]

    @property
    def conf_path(self) -> Path:
        return self.workdir / f"sentinel-{self.port}.conf"

    @property
    def logfile(self) -> Path:
        return self.workdir / f"sentinel-{self.port}.log"

    def sentinel(self, **kwargs: Any) -> redis.sentinel.Sentinel:
        """A ``redis.sentinel.Sentinel`` for this sentinel (bytes responses)."""
        kwargs.setdefault("socket_timeout", 5)
        return redis.sentinel.Sentinel(self.sentinels, **kwargs)

    def start(self) -> Self:
        master = self.master
        if master is not None and not master.running:
            raise RuntimeError("the master must be running before the sentinel starts")
        self.workdir.mkdir(parents=True, exist_ok=True)
        name = self.service_name
        # Sentinel rewrites this file at runtime, so it must live in a writable dir.
        conf = f'port {self.port}\nbind {self.host}\ndir "{self.workdir}"\n'
        if master is not None:
            conf += (
                f"sentinel monitor {name} {master.host} {master.port} 1\n"
                f"sentinel down-after-milliseconds {name} 1000\n"
                f"sentinel failover-timeout {name} 5000\n"
            )
        self.conf_path.write_text(conf)
        with open(self.logfile, "ab") as log:
            self.proc = subprocess.Popen(
                [REDIS_SERVER, str(self.conf_path), "--sentinel"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
            )
        deadline = time.monotonic() + START_TIMEOUT
        last: object = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                raise RuntimeError(
                    f"sentinel on port {self.port} exited during startup; log tail:\n"
                    f"{_tail(self.logfile)}"
                )
            try:
                with _probe(self.host, self.port) as c:
                    if master is None:
                        if c.ping():
                            return self
                        continue
                    addr = c.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", name)
                    master = c.execute_command("SENTINEL", "MASTER", name)
                    last = (addr, master)
                    flags = _flags(master)
                    # Connected to the master and sees it as healthy.
                    if addr and flags == {"master"}:
                        return self
            except redis.RedisError as e:
                last = e
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(
            f"sentinel on port {self.port} did not resolve {name} within {START_TIMEOUT}s "
            f"(last: {last!r}); log tail:\n{_tail(self.logfile)}"
        )

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        else:
            proc.wait()


def _cluster_ok(node: RedisServer) -> bool:
    with node.client(socket_timeout=1) as c:
        return cluster_state(c) == "ok"


def cluster_state(client: redis.Redis) -> str:
    """The ``cluster_state`` field of ``CLUSTER INFO`` (``"ok"`` or ``"fail"``)."""
    info = client.execute_command("CLUSTER", "INFO")
    if isinstance(info, dict):  # parsed by a redis-py response callback
        return _s(info.get("cluster_state", info.get(b"cluster_state", "")))
    for line in _s(info).splitlines():
        key, _, value = line.partition(":")
        if key == "cluster_state":
            return value.strip()
    return ""


def _flags(master_reply: object) -> set[str]:
    """Extract the ``flags`` field of a ``SENTINEL MASTER`` reply (flat list or dict)."""
    fields: dict[str, object] = {}
    if isinstance(master_reply, dict):
        fields = {_s(k): v for k, v in master_reply.items()}
    elif isinstance(master_reply, list | tuple):
        it = iter(master_reply)
        fields = {_s(k): v for k, v in zip(it, it, strict=False)}
    raw = fields.get("flags")
    return set(_s(raw).split(",")) if raw is not None else set()


def _s(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


# -- command line ---------------------------------------------------------------------------


def _stop_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)  # unwinds the ``with`` below, which stops every server


def _wait_until_stopped(parent: int) -> None:
    """Sleep until a signal arrives or the parent exits (so a killed CI job leaks nothing)."""
    while os.getppid() == parent:
        time.sleep(0.5)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.servers", description="Run a private Redis topology until killed."
    )
    sub = parser.add_subparsers(dest="topology", required=True)
    cluster = sub.add_parser("cluster", help="a Redis Cluster of master-only nodes")
    cluster.add_argument("--dir", type=Path, required=True, help="working directory (logs, data)")
    cluster.add_argument("--masters", type=int, default=3)
    args = parser.parse_args(argv)
    parent = os.getppid()
    signal.signal(signal.SIGTERM, _stop_on_signal)
    signal.signal(signal.SIGINT, _stop_on_signal)
    with RedisCluster(args.dir, args.masters) as topology:
        print(topology.store_url, flush=True)
        _wait_until_stopped(parent)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
