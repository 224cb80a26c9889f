"""The store-backed conductor killed under load: every request answered once, as the engine's.

Stand-in workers and an API-server stand-in (``tests.engine.standin``) speak the engine's own
messages over its own pyzmq communicator to a conductor process; the model is
``tests.engine.kill_model`` (a producer partition on two TP ranks streaming to a consumer on
a third). The same requests go

* to the engine's unmodified in-memory conductor (the oracle run), and
* to the store-backed conductor (``python -m store.integrations.mstar ... --url``), SIGKILLed
  at random moments while requests are in flight and replaced each time by a successor
  started with ``--attach``; once SIGSTOPped instead, a successor started, and the stopped
  one resumed: it must find itself fenced out and exit on its own, non-zero.

Every request must then be answered exactly once; a completed one exactly as the oracle
completed it (its ``final_outputs``, the passes its workers ran, none twice, and the ref
counts of every unpersisted tensor), a failed one with a reason naming the conductor.

Needs the engine (the Python 3.12 engine job) and a Redis at ``REDIS_URL``; writes only under
a fresh namespace and deletes its keys at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from store import types as store_types

if not store_types.engine_importable():
    pytest.skip("mstar-ai is not installed (the engine job runs these)", allow_module_level=True)

from tests.engine import kill_model
from tests.engine.standin import DEFAULT_MODEL, ApiStandIn, read_log

pytestmark = [pytest.mark.real, pytest.mark.exclusive]

ROOT = Path(__file__).resolve().parents[2]
N_REQUESTS = int(os.environ.get("KILL_TEST_REQUESTS", "100"))
N_KILLS = int(os.environ.get("KILL_TEST_KILLS", "5"))
ANSWER_TIMEOUT_S = float(os.environ.get("KILL_TEST_TIMEOUT", "120"))
STARTUP_TIMEOUT_S = 60.0
FENCED_EXIT_TIMEOUT_S = 10.0
# Slows the stand-in workers in the store run so requests stay in flight across the kills.
PASS_DELAY_S = float(os.environ.get("KILL_TEST_PASS_DELAY", "0.04"))
# How long each conductor runs before it is killed (after it attached), in seconds: long
# enough for reports to move requests, short enough that they are still in flight.
KILL_AFTER_S = tuple(
    float(x) for x in os.environ.get("KILL_TEST_KILL_AFTER", "0.3,1.5").split(",", 1)
)
STALL_TIMEOUT_S = float(os.environ.get("KILL_TEST_STALL_TIMEOUT", "5"))
REQUEST_IDS = [f"kill-{i:03d}" for i in range(N_REQUESTS)]
ATTACHED = re.compile(r"attached: (\d+) requests in ([0-9.]+) ?s")


def _entry_point_available() -> bool:
    """Whether this checkout has the store's conductor entry point (an editable install of
    another checkout may resolve ``store.integrations`` elsewhere: not that one)."""
    try:
        spec = importlib.util.find_spec("store.integrations.mstar")
    except ModuleNotFoundError:
        return False
    origin = spec.origin if spec is not None else None
    return origin is not None and Path(origin).resolve().is_relative_to(ROOT)


HAVE_ENTRY_POINT = _entry_point_available()


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["MSTAR_RUST_ZMQ"] = "0"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def _signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


# ---------------------------------------------------------------------------------------------
# One mesh: a socket directory, the stand-ins, the conductor processes
# ---------------------------------------------------------------------------------------------


@dataclass
class ConductorProc:
    proc: subprocess.Popen[Any]
    stderr_path: Path
    started: float

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def attached(self) -> tuple[int, float] | None:
        m = ATTACHED.search(self.stderr())
        return (int(m.group(1)), float(m.group(2))) if m else None


class Mesh:
    def __init__(self, base: Path, name: str, pass_delay_s: float = 0.0):
        self.dir = base / name
        self.dir.mkdir(parents=True, exist_ok=True)
        # IPC paths are limited to ~107 bytes: a short directory of its own
        self.sockets = tempfile.mkdtemp(prefix=f"kill-{name}-", dir="/tmp")
        self.config = kill_model.write_config(self.dir / "model.yaml")
        self.pass_delay_s = pass_delay_s
        self.workers: list[subprocess.Popen[Any]] = []
        self.conductors: list[ConductorProc] = []
        self.api = ApiStandIn(self.sockets, str(self.dir / "api.jsonl"))

    def worker_log(self, rank: int) -> Path:
        return self.dir / f"worker_{rank}.jsonl"

    def start(self) -> None:
        for rank in sorted(kill_model.SHAPE.workers()):
            cmd = [sys.executable, "-m", "tests.engine.standin", "worker", "--rank", str(rank)]
            cmd += ["--sockets", self.sockets, "--log", str(self.worker_log(rank))]
            cmd += ["--model", DEFAULT_MODEL, "--pass-delay", str(self.pass_delay_s)]
            err = open(self.dir / f"worker_{rank}.err", "wb")  # noqa: SIM115
            self.workers.append(
                subprocess.Popen(
                    cmd, cwd=ROOT, env=_env(), stdout=err, stderr=err, start_new_session=True
                )
            )
            err.close()
        self.api.start()

    def conductor_cmd(self, store_args: list[str] | None) -> list[str]:
        if store_args is None and not HAVE_ENTRY_POINT:
            # until the store's entry point exists: the engine's conductor, no workers launched
            return [
                sys.executable,
                *("-m", "tests.engine.standin", "conductor", "--model", DEFAULT_MODEL),
                *("--config", self.config, "--sockets", self.sockets),
            ]
        mode = ["--in-memory"] if store_args is None else store_args
        return [
            sys.executable,
            *("-m", "store.integrations.mstar", *mode, "--no-launch"),
            *("--model", DEFAULT_MODEL, "--config", self.config, "--sockets", self.sockets),
        ]

    def start_conductor(self, store_args: list[str] | None = None) -> ConductorProc:
        i = len(self.conductors)
        path = self.dir / f"conductor_{i}.err"
        err = open(path, "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            self.conductor_cmd(store_args),
            cwd=ROOT,
            env=_env(),
            stdout=err,
            stderr=err,
            start_new_session=True,
        )
        err.close()
        c = ConductorProc(proc=proc, stderr_path=path, started=time.time())
        self.conductors.append(c)
        return c

    def close(self) -> None:
        for c in self.conductors:
            if c.proc.poll() is None:
                _signal_group(c.proc, signal.SIGKILL)
        for w in self.workers:
            if w.poll() is None:
                _signal_group(w, signal.SIGTERM)
        deadline = time.monotonic() + 3
        for p in [*self.workers, *(c.proc for c in self.conductors)]:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait(5)
        self.api.stop()
        shutil.rmtree(self.sockets, ignore_errors=True)

    def worker_records(self) -> list[dict[str, Any]]:
        return [
            r
            for rank in sorted(kill_model.SHAPE.workers())
            for r in read_log(self.worker_log(rank))
        ]


def _wait_setup_done(mesh: Mesh, conductor: ConductorProc, after: int = 0) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while len(mesh.api.setup_done) <= after:
        if conductor.proc.poll() is not None:
            pytest.fail(f"conductor exited with {conductor.proc.returncode}:\n{conductor.stderr()}")
        if time.monotonic() > deadline:
            pytest.fail(f"no setup_done from the conductor:\n{conductor.stderr()}")
        time.sleep(0.02)


# ---------------------------------------------------------------------------------------------
# What a run produced
# ---------------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@dataclass
class RunResult:
    answers: dict[str, list[tuple[str, Any]]]
    passes: dict[str, Counter[tuple[str, int, str]]]  # rid -> (partition, fwd, worker) -> runs
    unpersists: dict[str, dict[tuple[str, str], list[int]]]  # rid -> (entity, uuid) -> counts
    records: list[dict[str, Any]]
    seconds: float
    notes: dict[str, Any] = field(default_factory=dict)

    def final_outputs(self, rid: str) -> Any:
        (kind, body) = self.answers[rid][0]
        assert kind == "request_complete"
        return _plain(body.final_outputs)


def _collect(mesh: Mesh, seconds: float) -> RunResult:
    records = mesh.worker_records()
    passes: dict[str, Counter[tuple[str, int, str]]] = defaultdict(Counter)
    unpersists: dict[str, dict[tuple[str, str], list[int]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        if r.get("ev") == "pass":
            passes[r["rid"]][(r["partition"], r["fwd"], r["worker"])] += 1
        elif r.get("ev") == "unpersist":
            # the stand-in worker's uuids name their rank; the entity is the tensor's source
            unpersists[r["rid"]][("worker", r["uuid"])].append(r["count"])
    for rid, u, count in mesh.api.unpersists:
        unpersists[rid][("preprocess", u)].append(count)
    with mesh.api._lock:
        answers = {rid: list(a) for rid, a in mesh.api.answers.items()}
    return RunResult(
        answers=answers,
        passes=dict(passes),
        unpersists={rid: dict(v) for rid, v in unpersists.items()},
        records=records,
        seconds=seconds,
    )


def _expected_passes() -> Counter[tuple[str, int, str]]:
    expected: Counter[tuple[str, int, str]] = Counter()
    for partition, (n, ranks) in kill_model.expected_passes().items():
        for fwd in range(n):
            for rank in ranks:
                expected[(partition, fwd, f"worker_{rank}")] = 1
    return expected


# ---------------------------------------------------------------------------------------------
# The runs
# ---------------------------------------------------------------------------------------------


def oracle_run(base: Path) -> RunResult:
    """The engine's in-memory conductor, never interrupted."""
    mesh = Mesh(base, "oracle")
    try:
        mesh.start()
        conductor = mesh.start_conductor()
        _wait_setup_done(mesh, conductor)
        t0 = time.monotonic()
        for rid in REQUEST_IDS:
            mesh.api.submit(rid)
        missing = mesh.api.wait_all(ANSWER_TIMEOUT_S)
        if missing:
            pytest.fail(
                f"oracle run: {len(missing)} requests unanswered: {missing[:20]}\n"
                f"{conductor.stderr()[-4000:]}"
            )
        seconds = time.monotonic() - t0
        time.sleep(0.3)  # the final unpersists and removes
    finally:
        mesh.close()
    return _collect(mesh, seconds)


@dataclass
class Takeover:
    kind: str  # "kill" or "stop"
    at: float  # when the predecessor was killed (stopped)
    in_flight: int  # requests unanswered then
    attached: tuple[int, float] | None = None  # the successor's own report (requests, s)
    attached_seen: float | None = None  # when its "attached:" line was first seen
    # the first message a stand-in received after that: the successor's (its predecessor is
    # dead or stopped), give or take a stand-in's backlog of older messages
    first_message: float | None = None
    fenced_returncode: int | None = None


def _wait_successor(successor: ConductorProc, takeover: Takeover) -> None:
    """Until the successor reports itself attached."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if successor.proc.poll() is not None:
            pytest.fail(
                f"successor exited with {successor.proc.returncode}:\n{successor.stderr()[-4000:]}"
            )
        attached = successor.attached()
        if attached is not None:
            takeover.attached, takeover.attached_seen = attached, time.time()
            return
        time.sleep(0.01)
    pytest.fail(f"successor never attached:\n{successor.stderr()[-4000:]}")


def store_run(base: Path, url: str, namespace: str, rng: random.Random) -> RunResult:
    """The store-backed conductor, killed and replaced while requests are in flight."""
    mesh = Mesh(base, "store", pass_delay_s=PASS_DELAY_S)
    store_args = ["--url", url, "--namespace", namespace, "--deployment", "d1"]
    # a recovered request no report moves is failed after this (the default, 60 s, is longer
    # than the test)
    store_args += ["--stall-timeout", str(STALL_TIMEOUT_S)]
    takeovers: list[Takeover] = []
    try:
        mesh.start()
        conductor = mesh.start_conductor(store_args)
        _wait_setup_done(mesh, conductor)
        t0 = time.monotonic()
        for rid in REQUEST_IDS:
            mesh.api.submit(rid)
        # N_KILLS SIGKILLs and, at a random place after the first, one SIGSTOP: the successor
        # takes over, then the stopped one resumes and must go. (The workers' connections to
        # the stopped one stay with it - a successor binding the same IPC path gets only new
        # ones - so the reports it swallows before it exits are lost: most requests in
        # flight then fail, cleanly.)
        kinds = ["kill"] * N_KILLS
        stop_at = os.environ.get("KILL_TEST_STOP_AT")  # 0..N_KILLS: a fixed place
        kinds.insert(int(stop_at) if stop_at else rng.randrange(1, N_KILLS + 1), "stop")
        for kind in kinds:
            time.sleep(rng.uniform(*KILL_AFTER_S))
            predecessor = conductor
            t = Takeover(kind, time.time(), len(mesh.api.unanswered()))
            if kind == "kill":
                _signal_group(predecessor.proc, signal.SIGKILL)
                predecessor.proc.wait(10)
            else:
                _signal_group(predecessor.proc, signal.SIGSTOP)
            conductor = mesh.start_conductor([*store_args, "--attach"])
            _wait_successor(conductor, t)
            if kind == "stop":
                _signal_group(predecessor.proc, signal.SIGCONT)
                try:
                    t.fenced_returncode = predecessor.proc.wait(FENCED_EXIT_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    t.fenced_returncode = None
            takeovers.append(t)

        missing = mesh.api.wait_all(ANSWER_TIMEOUT_S)
        seconds = time.monotonic() - t0
        time.sleep(0.3)
    finally:
        mesh.close()
    result = _collect(mesh, seconds)
    # the first message a stand-in received after each takeover began
    received = sorted([r["t"] for r in result.records if r.get("ev") == "recv"] + mesh.api.received)
    for t in takeovers:
        since = t.attached_seen or t.at
        t.first_message = next((x for x in received if x > since), None)
    result.notes = {
        "takeovers": takeovers,
        "missing": missing,
        "stderr": {c.stderr_path.name: c.stderr()[-3000:] for c in mesh.conductors},
    }
    return result


# ---------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    return oracle_run(tmp_path_factory.mktemp("kill"))


def test_oracle_run(oracle: RunResult) -> None:
    """The harness itself: the engine's conductor completes every request, each with the
    passes the model scripts, every tensor unpersisted once."""
    assert set(oracle.answers) == set(REQUEST_IDS)
    expected = _expected_passes()
    finals = {p: n - 1 for p, (n, _) in kill_model.expected_passes().items()}
    first_shape = None
    for rid in REQUEST_IDS:
        assert [kind for kind, _ in oracle.answers[rid]] == ["request_complete"], rid
        assert oracle.passes[rid] == expected, rid
        outputs = oracle.final_outputs(rid)
        assert {k: v["wg_fwd_pass_idx"] for k, v in outputs.items()} == {
            f"{p}_out": n for p, n in finals.items()
        }, rid
        unpersisted = oracle.unpersists[rid]
        assert all(len(counts) == 1 for counts in unpersisted.values()), rid
        # The same tensors, with the same counts, for every request: the model's decisions do
        # not depend on timing. (A tensor never fed to a pass has no ref count and the engine
        # never unpersists it, so not every persisted tensor is here.)
        shape = {(e, u.removeprefix(rid)): c for (e, u), c in unpersisted.items()}
        if first_shape is None:
            first_shape = shape
        assert shape == first_shape, rid
    print(
        f"\noracle run: {N_REQUESTS} requests in {oracle.seconds:.2f} s; "
        f"unpersisted per request: {first_shape}"
    )


@pytest.fixture
def redis_url() -> str:
    import redis

    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    try:
        redis.Redis.from_url(url).ping()
    except redis.RedisError as exc:
        pytest.skip(f"no Redis at {url}: {exc}")
    return url


def _delete_namespace(url: str, namespace: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    pattern = re.sub(r"([*?\[\]\\])", r"\\\1", namespace) + ":*"
    batch = []
    for key in client.scan_iter(match=pattern, count=500):
        batch.append(key)
        if len(batch) >= 500:
            client.delete(*batch)
            batch = []
    if batch:
        client.delete(*batch)
    client.close()


@pytest.mark.skipif(
    not HAVE_ENTRY_POINT, reason="store.integrations.mstar (the store-backed conductor) missing"
)
def test_kill(oracle: RunResult, redis_url: str, tmp_path: Path) -> None:
    namespace = f"kill-{uuid.uuid4().hex[:12]}"
    seed = int(os.environ.get("KILL_TEST_SEED", random.randrange(2**32)))
    print(f"\nkill test: namespace {namespace}, seed {seed}")
    try:
        run = store_run(tmp_path, redis_url, namespace, random.Random(seed))
    finally:
        _delete_namespace(redis_url, namespace)

    takeovers: list[Takeover] = run.notes["takeovers"]
    completed = [r for r in REQUEST_IDS if _first_kind(run, r) == "request_complete"]
    failed = [r for r in REQUEST_IDS if _first_kind(run, r) == "request_failed"]
    print(f"store run: {len(completed)} completed, {len(failed)} failed, in {run.seconds:.2f} s")
    print(f"  completions sent again by a successor: {len(_answered_again(run))}")
    for t in takeovers:
        print(f"  {_describe(t)}")

    problems = _problems(run, oracle)
    for t in takeovers:
        if t.kind != "stop":
            continue
        if t.fenced_returncode is None:
            problems["fencing"].append(
                f"the resumed conductor did not exit within {FENCED_EXIT_TIMEOUT_S} s"
            )
        elif t.fenced_returncode == 0:
            problems["fencing"].append("the resumed (fenced) conductor exited with 0")
    if problems:
        lines = []
        for what, items in problems.items():
            lines.append(f"== {what}: {len(items)}")
            lines += [f"   {x}" for x in items[:8]]
        tails = "\n".join(f"--- {k}\n{v[-600:]}" for k, v in run.notes["stderr"].items())
        pytest.fail("\n".join(lines) + "\n" + tails)


def _first_kind(run: RunResult, rid: str) -> str | None:
    answers = run.answers.get(rid)
    return answers[0][0] if answers else None


def _describe(t: Takeover) -> str:
    def since(x: float | None, start: float | None) -> str:
        return f"{x - start:.2f} s" if x is not None and start is not None else "never"

    text = (
        f"{t.kind}: {t.in_flight} in flight; attached {t.attached} seen after "
        f"{since(t.attached_seen, t.at)}; first message to a stand-in after "
        f"{since(t.first_message, t.at)} ({since(t.first_message, t.attached_seen)} after attach)"
    )
    if t.kind == "stop":
        text += f"; the resumed one exited with {t.fenced_returncode}"
    return text


def _diff(got: dict[Any, Any] | None, want: dict[Any, Any]) -> str:
    got = got or {}
    missing = {k: want[k] for k in want if k not in got}
    extra = {k: got[k] for k in got if k not in want}
    changed = {k: (got[k], want[k]) for k in got if k in want and got[k] != want[k]}
    return f"missing {missing}, extra {extra}, changed (got, oracle) {changed}"


ANSWERED_AGAIN = re.compile(r"answered again: (\S+)")


def _answered_again(run: RunResult) -> set[str]:
    """Requests a successor found complete but maybe unanswered (the conductor died between
    storing the completion and marking it sent) and so answered again."""
    return {m for text in run.notes["stderr"].values() for m in ANSWERED_AGAIN.findall(text)}


def _problems(run: RunResult, oracle: RunResult) -> dict[str, list[str]]:
    problems: dict[str, list[str]] = defaultdict(list)
    again = _answered_again(run)
    if run.notes["missing"]:
        problems["unanswered"] = list(run.notes["missing"])
    problems["answers for unknown requests"] = sorted(set(run.answers) - set(REQUEST_IDS))
    for rid in REQUEST_IDS:
        answers = run.answers.get(rid, [])
        if rid in again and len(answers) == 2:  # the one window of a second answer: equal
            assert [k for k, _ in answers] == ["request_complete"] * 2, (rid, answers)
            assert _plain(answers[0][1].final_outputs) == _plain(answers[1][1].final_outputs)
        elif len(answers) > 1:
            same = all(_plain(b) == _plain(answers[0][1]) for _, b in answers)
            problems["answered more than once"].append(
                f"{rid}: {[k for k, _ in answers]} ({'equal' if same else 'different'})"
            )
        twice = {k: n for k, n in run.passes.get(rid, Counter()).items() if n > 1}
        if twice:
            problems["a pass run more than once"].append(f"{rid}: {twice}")
        if not answers:
            continue
        kind, body = answers[0]
        if kind == "request_complete":
            if _plain(body.final_outputs) != oracle.final_outputs(rid):
                problems["final_outputs differ from the oracle's"].append(
                    f"{rid}: {_diff(_plain(body.final_outputs), oracle.final_outputs(rid))}"
                )
            if run.passes.get(rid) != oracle.passes[rid]:
                problems["passes differ from the oracle's"].append(
                    f"{rid}: {_diff(run.passes.get(rid), oracle.passes[rid])}"
                )
            # A completion sent again lost the UnpersistTensors of the turn that completed it
            # (RemoveRequest frees those tensors): compared only where nothing was re-sent.
            if rid not in again and run.unpersists.get(rid) != oracle.unpersists[rid]:
                problems["unpersisted ref counts differ from the oracle's"].append(
                    f"{rid}: {_diff(run.unpersists.get(rid), oracle.unpersists[rid])}"
                )
        elif "conductor" not in body.error_message.lower():
            problems["failed without naming the conductor"].append(f"{rid}: {body.error_message!r}")
    return {k: v for k, v in problems.items() if v}
