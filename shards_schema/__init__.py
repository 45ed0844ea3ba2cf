"""The shard contract shared by preprocessing (writer) and training (reader).

Imports neither `preprocess` nor `train`.
"""

from .manifest import MANIFEST_NAME, REJECTS_NAME, ShardFormatError, load_manifest
from .reader import ShardFault, ShardFile, ShardSet, open_shards
from .schema import SCHEMA_VERSION, Sample
from .verify import VerifyReport, verify_shards
from .webdataset import WebDatasetShards, iter_webdataset_samples

__all__ = [
    "MANIFEST_NAME",
    "REJECTS_NAME",
    "SCHEMA_VERSION",
    "Sample",
    "ShardFault",
    "ShardFile",
    "ShardFormatError",
    "ShardSet",
    "load_manifest",
    "iter_webdataset_samples",
    "open_shards",
    "verify_shards",
    "VerifyReport",
    "WebDatasetShards",
]
