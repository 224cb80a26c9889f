"""The version of the stored format.

Every hash record holds its version in ``VERSION_FIELD`` and every encoded ``PublishedInfo`` or
``ResourceReqConfig`` carries it in its envelope. Rules for evolving the types (see README):
a new field needs a default; a rename or type change needs a migration step in
``migrations/`` and a version bump here.
"""

from __future__ import annotations

SCHEMA_VERSION = 1
VERSION_FIELD = "_v"
