"""The version of the stored format, and its history.

Every hash record (meta, partition, connection) holds its version in ``VERSION_FIELD``.
Envelopes ``[version, kind, payload]`` of a ``PublishedInfo`` or ``ResourceReqConfig`` carry
a version too, and it follows the record's: an envelope holds the version of the record it
belongs to (the codec stamps ``SCHEMA_VERSION``; a migration step re-stamps the top-level envelopes
of the record it upgrades, without decoding their payloads). A reader accepts any envelope
version up to its own, so an envelope nested inside another value may keep an older one.

    v1  partition hash held ``per_label_seq_info`` (msgpack: resource label -> rank ->
        sequence info); worker-graph ids were ints in msgpack-encoded whole fields
    v2  published state in the publish-info hash, label -> envelope   (store/migrations/m0002_*)
    v3  worker-graph ids are str, one hash field per id               (store/migrations/m0003_*)
    v4  kv and position infos in parts "<label>[<part>]" under a header
        ``[4, kind, nil]``, so one script merges them with no WATCH  (store/migrations/m0004_*)
    v5  a KV sequence is the array ``[seq_len, transfer info, page indices]``, not a map
        of its field names; readers decode page indices when read  (store/migrations/m0005_*)

Rules for evolving the types (see README): a new field needs a default; a rename or type
change needs a numbered step in ``store/migrations/``, a bump here, and frozen fixtures of the old
version under ``tests/fixtures/``.
"""

from __future__ import annotations

SCHEMA_VERSION = 5
VERSION_FIELD = "_v"
