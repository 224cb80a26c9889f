"""What the store needs a Redis ACL user to be allowed: commands, and keys ``<ns>:*``.

One list, read by ``mstar-store doctor`` to check the connected user and by the README's
ACL line (``acl_rules``), so the two cannot drift apart. It holds what the store's Python
sends, what its Lua scripts call (a script's ``redis.call`` is checked against the user's
ACL too), what the tools send (``migrate``'s SCAN, ``top``'s INFO, ``history``'s XRANGE),
and what redis-py sends for the store: a cluster client's CLUSTER SLOTS, COMMAND and
ASKING. ``tests/test_acl.py`` derives the scripts' commands from the Lua sources and checks
they are all here.
"""

from __future__ import annotations

# Commands that name a key: the user needs them on keys matching ``<ns>:*``.
KEYED = (
    "DEL", "UNLINK", "EXISTS", "EXPIRE", "PEXPIRE", "PTTL", "GET", "SET",
    "HGET", "HMGET", "HGETALL", "HKEYS", "HSET", "HDEL", "HINCRBY",
    "ZADD", "ZCARD", "ZCOUNT", "ZRANGE", "ZRANGEBYSCORE", "ZREVRANGE", "ZREVRANGEBYSCORE",
    "ZREM", "ZREMRANGEBYSCORE", "ZSCORE", "ZSCAN",
    "XADD", "XTRIM", "XRANGE",
    "WATCH",
)  # fmt: skip
# Commands without a key (a subcommand as ``NAME|SUB``, as ACL rules spell it).
UNKEYED = (
    "EVAL", "EVALSHA", "SCRIPT|LOAD", "MULTI", "EXEC", "UNWATCH", "TIME", "PING", "SCAN",
    "INFO", "CONFIG|GET", "ACL|WHOAMI", "CLUSTER|SLOTS", "COMMAND", "ASKING", "READONLY",
)  # fmt: skip
# CONFIG GET is only for doctor and the eviction check at open (which fall back to INFO
# without it): drop it where reading the server's configuration is not wanted, since
# CONFIG GET also reads secrets such as ``requirepass``.
OPTIONAL = ("CONFIG|GET",)


def acl_rules(namespace: str) -> str:
    """The rules of ``ACL SETUSER <user> on ><password> <rules>`` granting exactly what
    the store needs in ``namespace``."""
    commands = " ".join(f"+{name.lower()}" for name in (*KEYED, *UNKEYED))
    return f"resetkeys ~{namespace}:* resetchannels -@all {commands}"


def probe_args(command: str, key: str) -> list[str]:
    """``command`` (``NAME`` or ``NAME|SUB``) as the arguments of ``redis.acl_check_cmd``,
    naming ``key`` where it takes one (the arity is not checked, only the key)."""
    words = command.split("|")
    return [*words, key] if command in KEYED else words
