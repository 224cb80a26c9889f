"""Is this Redis fit for the store? ``check_server`` (``mstar-store doctor``), the eviction
check a replica makes before it runs, and the warning a store logs at its first call.

Everything is read, never written: INFO, CONFIG GET (refused on managed services, where
INFO memory still names the policy), CLUSTER SLOTS, SCRIPT LOAD (which only caches), the
ACL probe script and the namespace's counts. On a cluster every master is asked, since
each holds its own settings and script cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from store import acl, health, stats
from store import scripts as script_files
from store.errors import StoreConnectionError, StoreError
from store.health import Finding, ServerSettings
from store.ops.calls import hash_reply
from store.ops.core import Core
from store.ops.effects import Command, Disconnected, ErrorReply, Op, Send
from store.ops.scan import Node, parse_info, read_many, send_to_node

log = logging.getLogger(__name__)

_INFO: list[Command] = [("INFO", "server"), ("INFO", "memory"), ("INFO", "persistence")]
# One CONFIG GET per setting: several in one call needs Redis 7.
_CONFIG = ("maxmemory-policy", "appendonly", "appendfsync", "save")


def check_server(core: Core) -> Op[list[Finding]]:
    """Every check of the server and the namespace, one ``Finding`` each (per master on
    a cluster): eviction policy, persistence, version and mode, cluster slots, scripts,
    the ACL user's rights on ``<ns>:*``, and the namespace's requests and replicas.
    Raises ``StoreConnectionError`` if the server cannot be reached."""
    findings: list[Finding] = []
    nodes = yield from _masters(core, findings)
    for node in nodes:
        settings = yield from node_settings(core, node)
        findings.append(health.version(settings, core.deployment))
        if settings.mode == "cluster" and core.deployment != "cluster":
            findings.append(
                Finding(
                    "server",
                    "fatal",
                    f"{settings.node} is a Redis Cluster node but the store was not opened as a "
                    "cluster client: use a redis+cluster:// URL",
                )
            )
        findings.append(health.eviction(settings))
        findings.append(health.persistence(settings))
        findings.append((yield from _scripts(core, node, settings.node, probe=node == nodes[0])))
    findings.append((yield from _acl(core)))
    findings.append((yield from _namespace(core)))
    return findings


def check_eviction(core: Core) -> Op[list[Finding]]:
    """The eviction finding of every master (what a replica checks before it runs)."""
    found: list[Finding] = []
    nodes = yield from _masters(core, [])  # slot coverage is doctor's to say
    for node in nodes:
        found.append(health.eviction((yield from node_settings(core, node))))
    return found


def warn_if_evicting(core: Core) -> Op[None]:
    """Log a warning if the server evicts keys: one round trip, one try, never an error
    (a store must open on a server that refuses CONFIG and INFO, or is down for now)."""
    commands: list[Command] = [("CONFIG", "GET", "maxmemory-policy"), ("INFO", "memory")]
    try:
        replies = yield Send(core.keys.index, commands)
    except Disconnected as e:
        log.debug("eviction check skipped: %s", e)
        return
    settings = ServerSettings.parse(core.server_name, parse_info(replies[1:]), _config(replies))
    finding = health.eviction(settings)
    if finding.level == "fatal":
        log.warning("%s; or see `mstar-store doctor`", finding.message)


def node_settings(core: Core, node: Node) -> Op[ServerSettings]:
    """What one server says of its version, mode, eviction policy and persistence."""
    commands = [*_INFO, *(("CONFIG", "GET", name) for name in _CONFIG)]
    replies = yield from send_to_node(core, node, commands, {}, refused=True)
    name = core.server_name if node is None else f"{node[0]}:{node[1]}"
    info = parse_info(replies[: len(_INFO)])
    return ServerSettings.parse(name, info, _config(replies[len(_INFO) :]))


def _config(replies: Sequence[Any]) -> dict[str, str]:
    """CONFIG GET replies (flat pairs in RESP2, a map in RESP3) as one dict; a refused
    one adds nothing."""
    out: dict[str, str] = {}
    for reply in replies:
        if isinstance(reply, (list, dict)):
            for name, value in hash_reply(reply).items():
                out[_text(name)] = _text(value)
    return out


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _masters(core: Core, findings: list[Finding]) -> Op[list[Node]]:
    """The servers to ask: a cluster's masters (with a finding on its slot coverage), or
    the one server (None)."""
    if core.deployment != "cluster":
        return [None]
    key = core.keys.index
    (reply,) = yield from core.send(key, [("CLUSTER", "SLOTS")], {})
    if isinstance(reply, ErrorReply):
        findings.append(Finding("cluster", "fatal", f"CLUSTER SLOTS refused: {reply.message}"))
        return [None]
    ranges = [(int(entry[0]), int(entry[1])) for entry in reply]
    masters = list(dict.fromkeys((_text(e[2][0]), int(e[2][1])) for e in reply))
    findings.append(health.slot_coverage(ranges, len(masters)))
    return list(masters)


def _scripts(core: Core, node: Node, name: str, *, probe: bool) -> Op[Finding]:
    """SCRIPT LOAD of every store script (the server compiles it and must answer its SHA);
    with ``probe``, then one EVALSHA of a read-only one, as every store call does (routed
    by its key: once is enough on a cluster)."""
    scripts = core.scripts
    for _ in range(2):  # again without the flag lines, on a server that cannot read them
        loads: list[Command] = [("SCRIPT", "LOAD", src) for src in scripts.sources.values()]
        replies = yield from send_to_node(core, node, loads, {}, refused=True)
        if any(scripts.lacks_flags(reply) for reply in replies):
            continue
        for (script, sha), reply in zip(scripts.shas.items(), replies, strict=True):
            if isinstance(reply, ErrorReply):
                return Finding(
                    "scripts", "fatal", f"{name}: SCRIPT LOAD {script} refused: {reply.message}"
                )
            if _text(reply) != sha:
                return Finding(
                    "scripts",
                    "fatal",
                    f"{name}: SCRIPT LOAD {script} answered {_text(reply)}, not its SHA1 {sha}",
                )
        key = core.keys.replicas
        call: Command = ("EVALSHA", scripts.shas["replicas"], 1, key, "live", stats.LIVE_WITHIN)
        if probe:
            (reply,) = yield from core.send(key, [call], {})
            if scripts.lacks_flags(reply):
                continue
            if isinstance(reply, ErrorReply):
                return Finding("scripts", "fatal", f"{name}: EVALSHA refused: {reply.message}")
        break
    note = (
        ""
        if scripts.flagged
        else " (without their flag lines, which this server cannot read: at maxmemory a "
        "write script is refused only at its first write that may grow memory)"
    )
    return Finding("scripts", "ok", f"{name}: {len(loads)} scripts load and run by SHA{note}")


def _acl(core: Core) -> Op[Finding]:
    """Whether the connected user may run every command of ``store.acl`` on ``<ns>:*``."""
    key = f"{core.keys.namespace}:{{doctor}}:probe"
    groups = [acl.probe_args(command, key) for command in acl.COMMANDS]
    args: list[Any] = []
    for words in groups:
        args += [len(words), *words]
    commands: list[Command] = [
        ("ACL", "WHOAMI"),
        ("EVAL", script_files.source("acl_probe"), 0, *args),
    ]
    whoami, probed = yield from core.send(key, commands, {})
    if isinstance(whoami, ErrorReply) and whoami.kind != "NOPERM":
        return Finding(
            "acl", "ok", "the server has no ACLs (Redis < 6): every client may run every command"
        )
    user = "the connected user" if isinstance(whoami, ErrorReply) else f"user {_text(whoami)}"
    if isinstance(probed, ErrorReply):
        return Finding(
            "acl",
            "fatal",
            f"{user} may not run the store's scripts: {probed.message}; grant +eval +evalsha",
        )
    if probed == [b"UNSUPPORTED"]:
        return (yield from _acl_by_getuser(core, key, whoami, user))
    refused = [acl.COMMANDS[i - 1] for i in probed[0]]
    if not core.durability.replicated:  # only replicated durability sends WAIT
        refused = [c for c in refused if c != "WAIT"]
    if not refused:
        return Finding(
            "acl", "ok", f"{user} may run every command the store needs on {core.keys.namespace}:*"
        )
    keyed = [c for c in refused if c in acl.KEYED]
    if len(keyed) == len(acl.KEYED):
        return Finding(
            "acl",
            "fatal",
            f"{user} may not touch keys {core.keys.namespace}:*: grant ~{core.keys.namespace}:*",
        )
    needed = [c for c in refused if c not in acl.OPTIONAL]
    grant = " ".join(f"+{c.lower()}" for c in refused)
    if not needed:
        return Finding(
            "acl",
            "warning",
            f"{user} may not run {', '.join(refused)} (doctor "
            f"reads INFO instead; appendfsync unknown): grant {grant}",
        )
    return Finding(
        "acl",
        "fatal",
        f"{user} may not run {', '.join(refused)} on {core.keys.namespace}:*: grant {grant}",
    )


def _acl_by_getuser(core: Core, key: str, whoami: Any, user: str) -> Op[Finding]:
    """Before Redis 7 no script can ask; ACL GETUSER can, if the user may run it."""
    if isinstance(whoami, ErrorReply):
        return Finding("acl", "warning", "cannot check the ACL user (ACL WHOAMI refused)")
    (reply,) = yield from core.send(key, [("ACL", "GETUSER", whoami)], {})
    if isinstance(reply, ErrorReply) or not reply:
        return Finding(
            "acl",
            "warning",
            f"cannot check what {user} may run (Redis < 7, ACL "
            f"GETUSER refused); it needs: {acl.acl_rules(core.keys.namespace)}",
        )
    described = {_text(k): v for k, v in hash_reply(reply).items()}
    commands = _text(described.get("commands", b""))
    flags = [_text(f) for f in described.get("flags", [])]
    keys = _text(described.get("keys", b""))
    if (
        commands.startswith("+@all")
        and "-" not in commands
        and ("allkeys" in flags or "~*" in keys.split())
    ):
        return Finding("acl", "ok", f"{user} may run every command on every key")
    return Finding(
        "acl",
        "warning",
        f"{user} has commands {commands!r} on keys {keys!r}: "
        f"check it allows {acl.acl_rules(core.keys.namespace)}",
    )


def _namespace(core: Core) -> Op[Finding]:
    """Requests, due steps and live replicas, read as ``mstar-store top`` reads them."""
    at = time.time()
    keys = core.keys
    try:
        replies = yield from read_many(core, stats.overview_reads(keys, at, stats.LIVE_WITHIN), {})
    except StoreConnectionError:
        raise
    except StoreError as e:  # a refusal (NOPERM, say): the other findings still count
        return Finding("namespace", "fatal", f"{keys.namespace!r} cannot be read: {e.reason}")
    seen = stats.parse_overview(replies, at)
    due = f"{seen.steps_due} steps due"
    if seen.oldest_due is not None:
        due += f" (the oldest for {at - seen.oldest_due:.0f} s)"
    live = f"{len(seen.live)} live replicas"
    if seen.registered > len(seen.live):
        live += f" ({seen.registered - len(seen.live)} silent)"
    message = f"{keys.namespace!r}: {seen.in_flight} requests, {due}, {live}"
    if seen.steps_due and not seen.live:
        return Finding("namespace", "warning", message + ": nothing recovers the due steps")
    return Finding("namespace", "ok", message)
