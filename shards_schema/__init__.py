"""The shard contract shared by preprocessing (writer) and training (reader).

Imports neither `preprocess` nor `train`.
"""

from .manifest import MANIFEST_NAME, REJECTS_NAME, ShardFormatError, load_manifest
from .reader import ShardFile, ShardSet, open_shards
from .schema import SCHEMA_VERSION, Sample

__all__ = [
    "MANIFEST_NAME",
    "REJECTS_NAME",
    "SCHEMA_VERSION",
    "Sample",
    "ShardFile",
    "ShardFormatError",
    "ShardSet",
    "load_manifest",
    "open_shards",
]
