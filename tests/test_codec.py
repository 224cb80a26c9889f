"""The codec round-trips every stored type exactly, and the domain types merge as documented.

The domain semantics live here too because the codec's promise is only worth something if
what comes back still behaves: a decoded ``PublishedKVInfo`` must merge like the original.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given

from store import Codec, ConfigurationError, KindRegistry, default_registry, register_kind
from store.types import (
    CurrentForwardConductorMetadata,
    CurrentForwardPassInfo,
    KVSequenceInfo,
    NestedLoopIndices,
    PartitionDefinition,
    PartitionState,
    PublishedInfo,
    PublishedKVInfo,
    PublishedPositionInfo,
    ResourceReqConfig,
    SamplingReqConfig,
    StreamingConnectionState,
    merge_publish_info,
)
from tests import strategies as s
from tests.strategies import (
    CODEC_SETTINGS,
    BeamConfig,
    BundleInfo,
    ScoreInfo,
    SumInfo,
    user_registry,
)

DEFAULT = Codec()
USER = Codec(user_registry())


def roundtrip(codec: Codec, value: Any, type_: Any = None) -> Any:
    return codec.decode(codec.encode(value, type_), type(value) if type_ is None else type_)


def kind_roundtrip(codec: Codec, value: Any, base: type) -> Any:
    return codec.decode_kind(codec.encode_kind(value), base)


# -- round trips ----------------------------------------------------------------------------


@CODEC_SETTINGS
@given(s.metadata)
def test_metadata_roundtrip(value: CurrentForwardConductorMetadata) -> None:
    assert roundtrip(DEFAULT, value) == value


@CODEC_SETTINGS
@given(s.forward_pass_infos())
def test_forward_pass_info_roundtrip(value: CurrentForwardPassInfo) -> None:
    back = roundtrip(DEFAULT, value)
    assert back == value
    for label, info in value.resource_publish_info.items():
        assert type(back.resource_publish_info[label]) is type(info)


@CODEC_SETTINGS
@given(s.forward_pass_infos(s.user_infos, s.user_configs))
def test_forward_pass_info_with_user_kinds_roundtrip(value: CurrentForwardPassInfo) -> None:
    back = roundtrip(USER, value)
    assert back == value
    for label, config in value.resource_configs.items():
        assert type(back.resource_configs[label]) is type(config)


@CODEC_SETTINGS
@given(s.partition_definitions)
def test_partition_definition_roundtrip(value: PartitionDefinition) -> None:
    back = roundtrip(DEFAULT, value)
    assert back == value
    assert isinstance(back.graph_walks, set)


@CODEC_SETTINGS
@given(s.partition_states(infos=s.user_infos))
def test_partition_state_roundtrip(value: PartitionState) -> None:
    assert roundtrip(USER, value) == value


@CODEC_SETTINGS
@given(s.connection_states())
def test_connection_state_roundtrip(value: StreamingConnectionState) -> None:
    assert roundtrip(DEFAULT, value) == value


@CODEC_SETTINGS
@given(s.kv_info)
def test_kv_info_roundtrip(value: PublishedKVInfo) -> None:
    assert roundtrip(DEFAULT, value) == value
    assert kind_roundtrip(DEFAULT, value, PublishedInfo) == value


@CODEC_SETTINGS
@given(s.kv_sequence)
def test_kv_sequence_roundtrip(value: KVSequenceInfo) -> None:
    assert roundtrip(DEFAULT, value) == value


@CODEC_SETTINGS
@given(s.position_info)
def test_position_info_roundtrip(value: PublishedPositionInfo) -> None:
    assert roundtrip(DEFAULT, value) == value
    assert kind_roundtrip(DEFAULT, value, PublishedInfo) == value


@CODEC_SETTINGS
@given(s.sampling_config)
def test_sampling_config_roundtrip(value: SamplingReqConfig) -> None:
    assert roundtrip(DEFAULT, value) == value
    assert kind_roundtrip(DEFAULT, value, ResourceReqConfig) == value


@CODEC_SETTINGS
@given(s.loop_indices)
def test_loop_indices_roundtrip(value: NestedLoopIndices) -> None:
    assert roundtrip(DEFAULT, value) == value


@CODEC_SETTINGS
@given(s.user_infos)
def test_user_kind_roundtrip(value: PublishedInfo) -> None:
    back = kind_roundtrip(USER, value, PublishedInfo)
    assert back == value
    assert type(back) is type(value)
    # Declared as the abstract base, a value travels in its envelope all the same.
    assert roundtrip(USER, value, PublishedInfo) == value


@CODEC_SETTINGS
@given(s.beam_config)
def test_user_config_roundtrip(value: BeamConfig) -> None:
    assert kind_roundtrip(USER, value, ResourceReqConfig) == value


@CODEC_SETTINGS
@given(s.bundle_info)
def test_nested_kinds_keep_their_kind(value: BundleInfo) -> None:
    back = kind_roundtrip(USER, value, PublishedInfo)
    assert type(back.primary) is type(value.primary)
    assert [type(x) for x in back.history] == [type(x) for x in value.history]
    assert {k: type(v) for k, v in back.extras.items()} == {
        k: type(v) for k, v in value.extras.items()
    }
    assert back == value


def test_sets_stay_sets_and_int_keys_stay_ints() -> None:
    kv = PublishedKVInfo({0: {"a": KVSequenceInfo(1, None)}, 3: {}, 2**62: {}}, world_size=4)
    back = kind_roundtrip(DEFAULT, kv, PublishedInfo)
    assert list(back.info) == [0, 3, 2**62]
    assert all(type(rank) is int for rank in back.info)
    score = kind_roundtrip(USER, ScoreInfo(tags={"x", "y"}), PublishedInfo)
    assert score.tags == {"x", "y"}
    assert isinstance(score.tags, set)
    beam = kind_roundtrip(USER, BeamConfig(lengths={5: 0.5}), ResourceReqConfig)
    assert beam.lengths == {5: 0.5}


def test_envelope_names_the_kind_not_an_import_path() -> None:
    data = DEFAULT.encode_kind(PublishedPositionInfo({"a": 1}))
    assert b"position" in data
    assert b"mstar" not in data


def test_default_registry_holds_only_builtin_kinds() -> None:
    assert set(default_registry.names()) == {"kv", "position", "sampling", "kv_request"}
    assert default_registry.name_of(ScoreInfo) is None
    assert default_registry.name_of(BundleInfo) is None


# -- the kind registry ------------------------------------------------------------------------


def test_register_kind_as_decorator_into_a_given_registry() -> None:
    registry = KindRegistry()

    @register_kind(name="decorated", registry=registry)
    class Decorated(SumInfo):
        pass

    assert registry.type_of("decorated") is Decorated
    assert registry.name_of(Decorated) == "decorated"
    assert default_registry.name_of(Decorated) is None


def test_register_kind_default_name_is_the_qualified_class_name() -> None:
    registry = KindRegistry()
    register_kind(SumInfo, registry=registry)
    assert registry.name_of(SumInfo) == "tests.strategies.SumInfo"


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        (int, "not a PublishedInfo or ResourceReqConfig"),
        (PublishedInfo, "abstract"),
    ],
)
def test_register_rejects_what_cannot_be_a_kind(cls: type, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        KindRegistry().register(cls, "x")


def test_register_rejects_a_taken_name() -> None:
    registry = KindRegistry()
    registry.register(SumInfo, "taken")
    registry.register(SumInfo, "taken")  # the same class again is fine
    with pytest.raises(ConfigurationError, match=r"'taken' is taken by tests\.strategies\.SumInfo"):
        registry.register(ScoreInfo, "taken")


def test_register_rejects_a_kind_msgspec_cannot_decode() -> None:
    class Opaque(PublishedInfo):
        def __init__(self, handle: object) -> None:
            self.handle = handle

        def update(self, other: PublishedInfo) -> None:
            pass

    with pytest.raises(ConfigurationError, match="cannot be encoded with msgspec"):
        KindRegistry().register(Opaque, "opaque")


def test_codec_rejects_a_non_positive_limit() -> None:
    with pytest.raises(ConfigurationError, match="max_payload_bytes"):
        Codec(max_payload_bytes=0)


# -- domain semantics -------------------------------------------------------------------------


def seq(n: int) -> KVSequenceInfo:
    return KVSequenceInfo(seq_len=n, latest_kv_transfer_info=None, page_indices=[n])


def test_kv_update_overlays_ranks_and_other_wins_per_label() -> None:
    held = PublishedKVInfo({0: {"a": seq(1), "b": seq(2)}, 1: {"a": seq(3)}}, world_size=2)
    other = PublishedKVInfo({0: {"b": seq(20), "c": seq(30)}, 2: {"a": seq(40)}}, world_size=1)
    held.update(other)
    assert held.info == {
        0: {"a": seq(1), "b": seq(20), "c": seq(30)},
        1: {"a": seq(3)},
        2: {"a": seq(40)},
    }
    assert held.world_size == 2  # the wider group is kept


def test_kv_update_keeps_its_world_size() -> None:
    """As mstar-ai's: the world size a KV info was built with never changes."""
    held = PublishedKVInfo({}, world_size=2)
    held.update(PublishedKVInfo({}, world_size=4))
    assert held.world_size == 2


def test_position_update_keeps_the_larger_per_label() -> None:
    """As mstar-ai's: a label not held counts as 0, so a new one at 0 or below is not added."""
    held = PublishedPositionInfo({"a": 5, "b": 1})
    held.update(PublishedPositionInfo({"a": 3, "b": 7, "c": 0, "d": 2}))
    assert held.counters == {"a": 5, "b": 7, "d": 2}


def test_update_assumes_its_own_kind() -> None:
    """As mstar-ai's: update reads the other's fields unchecked (the store checks the kind
    before it merges: test_store's test_merge_of_another_kind_under_a_label_is_refused)."""
    with pytest.raises(AttributeError):
        PublishedKVInfo().update(PublishedPositionInfo())  # type: ignore[arg-type]


def test_merge_publish_info_updates_held_and_takes_new_labels() -> None:
    held_kv = PublishedKVInfo({0: {"a": seq(1)}})
    into: dict[str, PublishedInfo] = {"kv": held_kv, "pos": PublishedPositionInfo({"x": 9})}
    new_pos = PublishedPositionInfo({"y": 1})
    merge_publish_info(
        into,
        {"kv": PublishedKVInfo({1: {"a": seq(2)}}, world_size=2), "pos2": new_pos},
    )
    assert into["kv"] is held_kv  # updated in place, not replaced
    assert held_kv == PublishedKVInfo({0: {"a": seq(1)}, 1: {"a": seq(2)}}, world_size=1)
    assert into["pos"] == PublishedPositionInfo({"x": 9})
    assert into["pos2"] is new_pos


def test_forward_pass_info_update_and_clear() -> None:
    info = CurrentForwardPassInfo(
        "r",
        "walk",
        0,
        0,
        10,
        resource_publish_info={"pos": PublishedPositionInfo({"a": 1})},
        loop_stop_times={"loop": NestedLoopIndices(["loop"], {"loop": 1}, 0)},
        dynamic_loop_iter_counts={"loop": 3},
        step_metadata={"keep": True},
    )
    info.update_publish_info({"pos": PublishedPositionInfo({"a": 4}), "sum": SumInfo(2)})
    assert info.resource_publish_info == {
        "pos": PublishedPositionInfo({"a": 4}),
        "sum": SumInfo(2),
    }
    info.clear_loop_stop_info()
    assert info.loop_stop_times == {}
    assert info.dynamic_loop_iter_counts == {}
    assert info.step_metadata == {"keep": True}


def nli(order: list[str], indices: dict[str, int], fwd: int = 0) -> NestedLoopIndices:
    return NestedLoopIndices(order, indices, fwd)


@pytest.mark.parametrize(
    ("mine", "theirs", "target", "expected"),
    [
        (nli([], {}, 2), nli([], {}, 1), None, True),  # forward pass decides first
        (nli(["o"], {"o": 0}, 1), nli(["o"], {"o": 9}, 2), None, False),
        (nli(["o", "i"], {"o": 1, "i": 0}), nli(["o", "i"], {"o": 0, "i": 9}), None, True),
        (nli(["o", "i"], {"o": 1, "i": 0}), nli(["o", "i"], {"o": 1, "i": 1}), None, False),
        (nli(["o", "i"], {"o": 1, "i": 2}), nli(["o", "i"], {"o": 1, "i": 1}), None, True),
        (nli(["o", "i"], {"o": 1, "i": 1}), nli(["o", "i"], {"o": 1, "i": 1}), None, False),
        # stops before the target loop: only the outer loops count
        (nli(["o", "i"], {"o": 1, "i": 5}), nli(["o", "i"], {"o": 1, "i": 1}), "i", False),
        (nli(["o", "i"], {"o": 2, "i": 0}), nli(["o", "i"], {"o": 1, "i": 1}), "i", True),
        # a missing index counts as 0
        (nli(["o"], {}), nli(["o"], {"o": 0}), None, False),
        (nli(["o"], {"o": 1}), nli(["o"], {}), None, True),
        (nli(["o"], {}), nli(["o"], {"o": 1}), None, False),
        (nli(["o"], {"o": -1}), nli(["o"], {}), None, False),
    ],
)
def test_label_context_gt(
    mine: NestedLoopIndices, theirs: NestedLoopIndices, target: str | None, expected: bool
) -> None:
    assert mine.label_context_gt(theirs, target) is expected


def test_label_context_gt_none_is_earliest() -> None:
    assert nli([], {}, 0).label_context_gt(None) is True


def test_loop_indices_max() -> None:
    early, late = nli(["o"], {"o": 1}), nli(["o"], {"o": 2})
    assert early.max(late) is late
    assert late.max(early) is late
    assert early.max(None) is early
    twin = nli(["o"], {"o": 1})
    assert early.max(twin) is early  # self on a tie


@CODEC_SETTINGS
@given(s.loop_indices, s.loop_indices)
def test_label_context_gt_is_asymmetric(a: NestedLoopIndices, b: NestedLoopIndices) -> None:
    b = NestedLoopIndices(a.loop_name_order, b.loop_indices, b.wg_fwd_pass_idx)  # same loops
    assert not (a.label_context_gt(b) and b.label_context_gt(a))
    assert a.max(b) is (b if b.label_context_gt(a) else a)


def test_sampling_takes_only_the_conductor_seed() -> None:
    config = SamplingReqConfig(temperature=0.1)
    config.apply_conductor_config(seed=42, temperature=9.0)
    assert config == SamplingReqConfig(temperature=0.1, _seed=42)
    config.apply_conductor_config(other=1)  # as mstar-ai's: no seed given sets 0
    assert config.seed == 0


def test_base_config_ignores_conductor_settings() -> None:
    config = BeamConfig(width=3)
    config.apply_conductor_config(seed=1)
    assert config == BeamConfig(width=3)
