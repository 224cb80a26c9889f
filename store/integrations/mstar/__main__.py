"""Run an M* conductor: store-backed (``--url``), or the engine's own in memory.

    python -m store.integrations.mstar --model PKG.MOD:FACTORY --config MODEL.yaml \\
        --url redis://localhost:6379/0 --deployment d1            # start, launching workers
    python -m store.integrations.mstar ... --deployment d1 --attach  # restart after a crash

``--attach`` takes over the deployment's requests and its live workers (launches none).
``--no-launch`` starts without launching workers (they are started apart). ``--in-memory``
runs mstar-ai's unmodified ``Conductor`` (no store), for comparison.
"""

from __future__ import annotations

import argparse
import importlib
import logging
from typing import Any


def _factory(spec: str) -> Any:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name or "make_model")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m store.integrations.mstar")
    parser.add_argument("--model", required=True, help="MODULE:FACTORY returning the Model")
    parser.add_argument("--config", required=True, help="the model's config YAML")
    parser.add_argument("--sockets", default="/tmp/mstar", help="IPC socket folder")
    parser.add_argument("--url", help="the store's Redis URL (without: --in-memory)")
    parser.add_argument("--namespace", default="mstar")
    parser.add_argument("--deployment", default="default")
    parser.add_argument("--attach", action="store_true", help="take over a crashed conductor")
    parser.add_argument("--no-launch", action="store_true", help="workers are started apart")
    parser.add_argument("--in-memory", action="store_true", help="the engine's own Conductor")
    parser.add_argument("--stall-timeout", type=float, default=60.0)
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level)
    model = _factory(args.model)()
    options = {"socket_path_prefix": args.sockets, "log_level": args.log_level}
    if args.in_memory:
        from mstar.conductor.conductor import Conductor

        class InMemory(Conductor):  # type: ignore[misc]
            def _launch_workers(self) -> None:
                if not args.no_launch:
                    super()._launch_workers()

        InMemory(model, args.config, **options).run()
        return
    if not args.url:
        parser.error("--url is required unless --in-memory")
    from store import RequestStore
    from store.integrations.mstar import StoreConductor

    store = RequestStore.from_url(args.url, namespace=args.namespace)
    conductor = StoreConductor(
        model,
        args.config,
        store=store,
        deployment=args.deployment,
        attach=args.attach,
        launch=not args.no_launch,
        stall_timeout=args.stall_timeout,
        **options,
    )
    conductor.run()


if __name__ == "__main__":
    main()
