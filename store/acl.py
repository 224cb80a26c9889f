"""What the store needs a Redis ACL user to be allowed: commands, and keys ``<ns>:*``.

One list, read by ``mstar-store doctor`` to check the connected user and by the README's
ACL line (``acl_rules``), so the two cannot drift apart. It holds what the store's Python
sends, what its Lua scripts call (a script's ``redis.call`` is checked against the user's
ACL too), what the tools send (``migrate``'s SCAN, ``top``'s INFO, ``history``'s XRANGE),
the TYPE the store asks of a script's keys when the script stopped on damage, and what
redis-py sends for the store: a cluster client's CLUSTER SLOTS, COMMAND and ASKING.
``tests/test_acl.py`` derives the scripts' commands from the Lua sources and checks they
are all here.
"""

from __future__ import annotations

# Each command (a subcommand as ``NAME|SUB``, as ACL rules spell it) with arguments of a
# valid form, ``{key}`` standing for a key of the namespace: ``redis.acl_check_cmd`` finds
# the keys by the command's key specs, and Redis 7.0 reads past the end of arguments that
# are too few (it crashed on a bare EVAL), so every probe is a whole command.
PROBES: dict[str, tuple[str, ...]] = {
    "DEL": ("{key}",), "UNLINK": ("{key}",), "EXISTS": ("{key}",), "EXPIRE": ("{key}", "1"),
    "PEXPIRE": ("{key}", "1"), "PERSIST": ("{key}",), "PTTL": ("{key}",), "GET": ("{key}",),
    "SET": ("{key}", "v"),
    "HGET": ("{key}", "f"), "HMGET": ("{key}", "f"), "HGETALL": ("{key}",),
    "HKEYS": ("{key}",), "HSET": ("{key}", "f", "v"), "HDEL": ("{key}", "f"),
    "HINCRBY": ("{key}", "f", "1"), "ZADD": ("{key}", "1", "m"), "ZCARD": ("{key}",),
    "ZCOUNT": ("{key}", "0", "1"), "ZRANGE": ("{key}", "0", "1"),
    "ZRANGEBYSCORE": ("{key}", "0", "1"), "ZREVRANGE": ("{key}", "0", "1"),
    "ZREVRANGEBYSCORE": ("{key}", "1", "0"), "ZREM": ("{key}", "m"),
    "ZREMRANGEBYSCORE": ("{key}", "0", "1"), "ZSCORE": ("{key}", "m"),
    "ZSCAN": ("{key}", "0"), "XADD": ("{key}", "*", "f", "v"), "TYPE": ("{key}",),
    "XTRIM": ("{key}", "MAXLEN", "1"), "XRANGE": ("{key}", "-", "+"), "WATCH": ("{key}",),
    "EVAL": ("return 1", "1", "{key}"), "EVALSHA": ("e0e1f9fabfc9d4800c877a703b823ac0578ff8db",
                                                    "1", "{key}"),
    "SCRIPT|LOAD": ("return 1",), "MULTI": (), "EXEC": (), "UNWATCH": (), "TIME": (),
    "PING": (), "SCAN": ("0",), "INFO": (), "CONFIG|GET": ("maxmemory-policy",),
    "ACL|WHOAMI": (), "CLUSTER|SLOTS": (), "COMMAND": (), "ASKING": (), "WAIT": ("0", "0"),
}  # fmt: skip
COMMANDS = tuple(PROBES)
KEYED = tuple(name for name, args in PROBES.items() if "{key}" in args)
# WAIT is sent only with durability="replicated" (store/durability.py): doctor asks for it
# only from such a store.
# CONFIG GET is only for doctor and the eviction check at open (which fall back to INFO
# without it): drop it where reading the server's configuration is not wanted, since
# CONFIG GET also reads secrets such as ``requirepass``.
OPTIONAL = ("CONFIG|GET",)


def acl_rules(namespace: str) -> str:
    """The rules of ``ACL SETUSER <user> on ><password> <rules>`` granting exactly what
    the store needs in ``namespace``."""
    commands = " ".join(f"+{name.lower()}" for name in COMMANDS)
    return f"resetkeys ~{namespace}:* resetchannels -@all {commands}"


def probe_args(command: str, key: str) -> list[str]:
    """``command`` as the arguments of ``redis.acl_check_cmd``, naming ``key``."""
    return [*command.split("|"), *(key if arg == "{key}" else arg for arg in PROBES[command])]
