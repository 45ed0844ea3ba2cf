"""WebDataset interop: a shard directory <-> tar shards that stream from object stores.

`format` defines the layout (member names, tar headers, `.npy` bytes, index.json), `reader`
reads an export directory (`WebDatasetShards`), `convert` writes one from a shard directory
and back (`export_webdataset`, `import_webdataset`), `command` is `vlmpack export` / `import`.
A round trip reproduces the Arrow shards and the manifest byte for byte.

This package imports only the standard library, numpy and the contract: not `preprocess`, and
not the `webdataset` package (which imports torch); the tars it writes need no special reader.
"""

from .convert import export_webdataset, import_webdataset
from .format import (
    ARRAY_MEMBERS,
    DEFAULT_MAX_TAR_BYTES,
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_NAME,
    KEY_DIGITS,
    KEY_PREFIX,
    MEMBER_NAMES,
    META_MEMBER,
    TAR_PREFIX,
    WebDatasetFormatError,
    sample_key,
    tar_name,
)
from .reader import STATS_NAMES, WebDatasetShards, iter_webdataset_samples, load_index

__all__ = [
    "ARRAY_MEMBERS",
    "DEFAULT_MAX_TAR_BYTES",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "INDEX_NAME",
    "KEY_DIGITS",
    "KEY_PREFIX",
    "MEMBER_NAMES",
    "META_MEMBER",
    "STATS_NAMES",
    "TAR_PREFIX",
    "WebDatasetFormatError",
    "WebDatasetShards",
    "export_webdataset",
    "import_webdataset",
    "iter_webdataset_samples",
    "load_index",
    "sample_key",
    "tar_name",
]
