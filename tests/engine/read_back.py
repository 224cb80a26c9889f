"""Read one request back in a process of its own and print its canonical shape.

``python -m tests.engine.read_back URL NAMESPACE REQUEST_ID`` prints the source of this
process's types (``MSTAR_STORE_TYPES`` chooses it) and ``canonical(load_request(...))``: a
parent that wrote the request with the other set of types compares it with its own read.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import sys
from typing import Any


def canonical(value: Any) -> str:
    """``value`` as JSON that names every class in it: equal for equal values of classes of
    the same names, whichever module defines them, and independent of set order."""
    return json.dumps(_shape(value), sort_keys=True)


def _shape(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, bytes):
        return ["bytes", value.hex()]
    if isinstance(value, enum.Enum):
        return [type(value).__qualname__, _shape(value.value)]
    if isinstance(value, tuple):
        return ["tuple", [_shape(v) for v in value]]
    if isinstance(value, list):
        return [_shape(v) for v in value]
    if isinstance(value, set | frozenset):
        return ["set", sorted(json.dumps(_shape(v), sort_keys=True) for v in value)]
    if isinstance(value, dict):
        return [
            "dict",
            sorted([json.dumps(_shape(k), sort_keys=True), _shape(v)] for k, v in value.items()),
        ]
    if dataclasses.is_dataclass(value):
        fields = {f.name: _shape(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return [type(value).__qualname__, fields]
    raise TypeError(f"no canonical shape for {type(value).__qualname__}")


def main() -> None:
    from store import RequestStore
    from store.types import SOURCE

    url, namespace, request_id = sys.argv[1:4]
    store = RequestStore.from_url(url, namespace=namespace)
    print(SOURCE)
    print(canonical(store.load_request(request_id)))


if __name__ == "__main__":
    main()
