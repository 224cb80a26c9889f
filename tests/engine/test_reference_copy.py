"""The bundled copy (store._mstar) against the installed engine, side by side.

Field for field (names, declared types, defaults, what default factories make), method for
method (the same public names), and behaviour for behaviour: the same random inputs through
each class's methods give equal results. Run where mstar-ai is installed (``.ci/engine``).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import importlib
import inspect
import re
import typing
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store import types as store_types

if not store_types.engine_importable():
    pytest.skip("mstar-ai is not installed (the engine job runs these)", allow_module_level=True)

NAMES = sorted(store_types._MODULES)  # every name store.types gives


def engine(name: str) -> Any:
    return getattr(importlib.import_module(f"mstar.{store_types._MODULES[name]}"), name)


def bundled(name: str) -> Any:
    return getattr(importlib.import_module(f"store._mstar.{store_types._MODULES[name]}"), name)


def test_the_store_holds_the_engines_own_classes() -> None:
    """In this job the store (and every test that imports store.types) runs on the engine."""
    assert store_types.SOURCE == "engine"
    for name in NAMES:
        assert getattr(store_types, name) is engine(name), name


def _type_text(tp: Any) -> str:
    """A declared type without the module that defines its classes."""
    text = tp if isinstance(tp, str) else repr(tp)
    text = re.sub(r"<class '([\w.]+)'>", lambda m: m.group(1).rsplit(".", 1)[-1], text)
    text = re.sub(r"\b(?:store\._mstar|mstar)\.[\w.]*\.(\w+)", r"\1", text)
    return text.replace("typing.", "").replace(" ", "")


def _fields(cls: type) -> list[tuple[str, str, Any]]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default: Any = ("value", f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = ("factory", f.default_factory())
        else:
            default = ("required",)
        out.append((f.name, _type_text(hints[f.name]), default))
    return out


def _public(cls: type) -> set[str]:
    return {n for n, _ in inspect.getmembers(cls) if not n.startswith("__")}


@pytest.mark.parametrize("name", NAMES)
def test_the_same_shape(name: str) -> None:
    real, ours = engine(name), bundled(name)
    if isinstance(real, str):
        assert ours == real
        return
    if inspect.isfunction(real):
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(real).parameters)
        return
    assert ours.__name__ == real.__name__
    assert [b.__name__ for b in ours.__mro__] == [b.__name__ for b in real.__mro__]
    if issubclass(real, enum.Enum):
        assert [(m.name, m.value) for m in ours] == [(m.name, m.value) for m in real]
        return
    assert dataclasses.is_dataclass(ours) == dataclasses.is_dataclass(real)
    if dataclasses.is_dataclass(real):
        assert _fields(ours) == _fields(real)
        assert ours.__dataclass_params__.frozen == real.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert _public(ours) == _public(real)
    for method in _public(real):
        theirs, mine = getattr(real, method), getattr(ours, method)
        if callable(theirs):
            assert list(inspect.signature(mine).parameters) == list(
                inspect.signature(theirs).parameters
            ), method


# -- behaviour: the same inputs through both -------------------------------------------------


def _convert(value: Any, to: Any) -> Any:
    """``value`` (built from one set of classes) rebuilt from the other set, ``to``."""
    if isinstance(value, enum.Enum):
        return to(type(value).__name__)[value.name]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = to(type(value).__name__)
        made = cls.__new__(cls)
        for f in dataclasses.fields(value):
            object.__setattr__(made, f.name, _convert(getattr(value, f.name), to))
        return made
    if isinstance(value, dict):
        return {_convert(k, to): _convert(v, to) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return type(value)(_convert(v, to) for v in value)
    return value


def _same(real: Any, ours: Any) -> bool:
    return _convert(real, bundled) == ours


labels = st.sampled_from(["main", "draft", "a", ""])
sequences = st.builds(
    lambda n, t, p: ("KVSequenceInfo", n, t, p),
    st.integers(0, 100),
    st.none() | st.sampled_from(["mooncake", "ipc"]),
    st.lists(st.integers(0, 50), max_size=3),
)
kv_infos = st.tuples(
    st.dictionaries(st.integers(0, 3), st.dictionaries(labels, sequences, max_size=2), max_size=3),
    st.integers(1, 4),
)
positions = st.dictionaries(labels, st.integers(-3, 20), max_size=3)


def _kv(classes: Any, spec: tuple[Any, int]) -> Any:
    info, world_size = spec
    made = {}
    for rank, by_label in info.items():
        made[rank] = {}
        for label, (_, seq_len, transfer, pages) in by_label.items():
            if transfer == "mooncake":
                transfer = classes("MooncakeKVTransferInfo")(
                    "e", "s", seq_len, classes("KVLayout").NHD
                )
            elif transfer == "ipc":
                transfer = classes("CudaIpcKVTransferInfo")(
                    (0, b"h"), (1,), (1,), 0, "bf16", False, classes("KVLayout").NHD
                )
            made[rank][label] = classes("KVSequenceInfo")(seq_len, transfer, list(pages))
    return classes("PublishedKVInfo")(made, world_size)


@settings(max_examples=300, deadline=None)
@given(held=kv_infos, other=kv_infos, rank=st.integers(0, 4))
def test_kv_update_build_and_get(held: Any, other: Any, rank: int) -> None:
    results = []
    for classes in (engine, bundled):
        info = _kv(classes, held)
        info.update(_kv(classes, other))
        shard = classes("PublishedKVInfo").build_for_rank(rank, 3, info.get(rank))
        results.append((info, shard, info.get(rank)))
    assert _same(results[0], results[1])


@settings(max_examples=300, deadline=None)
@given(held=positions, other=positions)
def test_position_update(held: dict[str, int], other: dict[str, int]) -> None:
    real = engine("PublishedPositionInfo")(dict(held))
    real.update(engine("PublishedPositionInfo")(dict(other)))
    ours = bundled("PublishedPositionInfo")(dict(held))
    ours.update(bundled("PublishedPositionInfo")(dict(other)))
    assert real.counters == ours.counters


@settings(max_examples=300, deadline=None)
@given(
    seeds=st.lists(st.integers(-5, 2**40), max_size=3),
    temperature=st.floats(0, 2),
    node=st.sampled_from(["llm", "codec", "x"]),
    walk=st.sampled_from(["prefill", "decode"]),
    needed=st.none() | st.lists(labels, max_size=2),
    per_node=st.dictionaries(st.sampled_from(["llm", "codec"]), st.lists(labels, max_size=2)),
    per_walk=st.dictionaries(
        st.tuples(st.sampled_from(["llm", "codec"]), st.sampled_from(["prefill", "decode"])),
        st.lists(labels, max_size=2),
    ),
)
def test_configs(
    seeds: list[int],
    temperature: float,
    node: str,
    walk: str,
    needed: list[str] | None,
    per_node: dict[str, list[str]],
    per_walk: dict[tuple[str, str], list[str]],
) -> None:
    results = []
    for classes in (engine, bundled):
        sampling = classes("SamplingReqConfig")(temperature=temperature)
        seen = [sampling.seed]
        for seed in seeds:
            sampling.apply_conductor_config(seed=seed, other="ignored")
            seen.append(sampling.seed)
        sampling.apply_conductor_config()
        seen.append(sampling.seed)
        kv = classes("KVReqConfig")(needed, dict(per_node), dict(per_walk))
        results.append((sampling, seen, kv.get_labels(node, walk)))
    assert _same(results[0], results[1])


loop_indices = st.builds(
    lambda order, idx, n: (list(order), idx, n),
    st.lists(st.sampled_from(["a", "b", "c"]), unique=True, max_size=3),
    st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(0, 3), max_size=3),
    st.integers(0, 3),
)


@settings(max_examples=300, deadline=None)
@given(a=loop_indices, b=st.none() | loop_indices, target=st.none() | st.sampled_from("abc"))
def test_loop_indices(a: Any, b: Any, target: str | None) -> None:
    results = []
    for classes in (engine, bundled):
        cls = classes("NestedLoopIndices")
        mine = cls(*copy.deepcopy(a))
        other = None if b is None else cls(*copy.deepcopy(b))
        results.append((mine.label_context_gt(other, target), mine.max(other)))
    assert _same(results[0], results[1])


@settings(max_examples=200, deadline=None)
@given(
    sequence=st.lists(
        st.tuples(st.sampled_from(["kv", "kv2", "pos"]), kv_infos, positions),
        min_size=1,
        max_size=6,
    )
)
def test_merge_publish_info(sequence: list[Any]) -> None:
    """The engine's merge_publish_info against the copy's, over random merges of both kinds."""
    results = []
    for classes in (engine, bundled):
        held: dict[str, Any] = {}
        for label, kv_spec, counters in sequence:
            info = (
                classes("PublishedPositionInfo")(dict(counters))
                if label == "pos"
                else _kv(classes, kv_spec)
            )
            classes("merge_publish_info")(held, {label: info})
        results.append(held)
    assert _same(results[0], results[1])


def test_tensor_pointer_clone() -> None:
    args = ([2, 3], "f16", 12, 7, [3, 1], "u", "s", "w", 4, 2, 1, "seg", 8, "node", "walk")
    real, ours = engine("TensorPointerInfo")(*args), bundled("TensorPointerInfo")(*args)
    assert _same(real.clone(), ours.clone())
    assert real.clone().dims is not real.dims and ours.clone().dims is not ours.dims
