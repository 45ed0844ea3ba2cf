"""The shard contract: one Arrow row per conversation, every array flattened into a list column.

Multi-dimensional fields are stored row-major and flattened, with their shapes implied:
`position_ids` holds 3*L values ([3, L]), `image_grid_thw` 3*K ([K, 3]) and `pixel_patches`
N*W bytes ([N, W], W = C*P*P recorded in the schema metadata). `num_target_tokens` is the
one summary column: it lets inspection and planning skip the per-token mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

SCHEMA_VERSION = 1
FORMAT_NAME = "vlmpack-shards"

# List columns whose values the reader exposes as numpy views.
ARRAY_COLUMNS = ("input_ids", "loss_mask", "position_ids", "image_grid_thw", "pixel_patches")


def shard_schema(patch_row_width: int) -> pa.Schema:
    return pa.schema(
        [
            pa.field("sample_uid", pa.string(), nullable=False),
            pa.field("source", pa.string(), nullable=False),
            pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
            pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),
            pa.field("position_ids", pa.list_(pa.int32()), nullable=False),
            pa.field("image_grid_thw", pa.list_(pa.int32()), nullable=False),
            # 64-bit offsets: a record batch of images easily passes 2^31 bytes of patches.
            pa.field("pixel_patches", pa.large_list(pa.uint8()), nullable=False),
            pa.field("num_target_tokens", pa.int32(), nullable=False),
        ],
        metadata={
            "vlmpack.format": FORMAT_NAME,
            "vlmpack.schema_version": str(SCHEMA_VERSION),
            "vlmpack.patch_row_width": str(patch_row_width),
        },
    )


@dataclass
class Sample:
    """One training sample as the preprocessing stage produces it (the shard row, unflattened)."""

    sample_uid: str
    source: str
    input_ids: np.ndarray  # int32 [L]
    loss_mask: np.ndarray  # uint8 [L]
    position_ids: np.ndarray  # int32 [3, L]
    pixel_patches: np.ndarray  # uint8 [N, C*P*P]
    image_grid_thw: np.ndarray  # int32 [K, 3]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_target_tokens(self) -> int:
        return int(np.count_nonzero(self.loss_mask))

    @property
    def num_patches(self) -> int:
        return int(self.pixel_patches.shape[0])

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])
