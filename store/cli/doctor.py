"""``mstar-store doctor``: is this Redis fit for the store? One line per check.

Exit status 1 when any check is fatal (an evicting server, missing permissions, unserved
cluster slots), else 0, so a deployment script can refuse to go on.
"""

from __future__ import annotations

import argparse
from typing import Any

import msgspec

from store.cli.main import add_command, add_common_options, open_store
from store.health import worst


def add_parser(subparsers: Any) -> None:
    parser = add_command(
        subparsers,
        "doctor",
        summary="check the server: eviction, persistence, mode, scripts, ACL, namespace",
        description="""Check whether a Redis is fit for the store, one line per check: the
        eviction policy (anything but noeviction loses requests), persistence (AOF), the
        version and mode (single server, Sentinel or Cluster, and every slot served), Lua
        scripts, the ACL user's permissions and the namespace. Exits 1 if any check is fatal,
        so a deployment script can stop there; --json for a machine.""",
        examples=[
            "mstar-store doctor --redis-url redis://10.0.0.5:6379/0",
            "mstar-store doctor --json --redis-url redis+sentinel://s1:26379,s2:26379/mymaster",
        ],
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    add_common_options(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        findings = store.check_server()
    if args.json:
        data = {"namespace": args.namespace, "worst": worst(findings), "findings": findings}
        print(msgspec.json.format(msgspec.json.encode(data), indent=2).decode())
    else:
        for finding in findings:
            print(finding.line())
    return 1 if worst(findings) == "fatal" else 0
