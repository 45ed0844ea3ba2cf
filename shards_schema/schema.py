"""The shard contract: one Arrow row per conversation, every array flattened into a list column.

Multi-dimensional fields are stored row-major and flattened, with their shapes implied:
`position_ids` holds 3*L values ([3, L]), `image_grid_thw` 3*K ([K, 3]) and `pixel_patches`
N*W bytes ([N, W], W = C*P*P recorded in the schema metadata). `num_target_tokens` is the
one summary column: it lets inspection and planning skip the per-token mask.

Version 2 adds videos: `video_grid_thw` 3*V ([V, 3]), `second_per_grid_ts` V float32 (the
seconds one temporal patch spans: Qwen2.5-VL's temporal positions) and `video_patches` M*W2
bytes ([M, W2], W2 = C*T*P*P: both frames of each temporal patch). Version 1 directories (no
video columns) still open: their rows read as having no video.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)
FORMAT_NAME = "vlmpack-shards"

# List columns whose values the reader exposes as numpy views, per schema version.
IMAGE_COLUMNS = ("input_ids", "loss_mask", "position_ids", "image_grid_thw", "pixel_patches")
VIDEO_COLUMNS = ("video_grid_thw", "second_per_grid_ts", "video_patches")
ARRAY_COLUMNS = IMAGE_COLUMNS + VIDEO_COLUMNS
COLUMN_DTYPES = {
    "input_ids": np.int32,
    "loss_mask": np.uint8,
    "position_ids": np.int32,
    "image_grid_thw": np.int32,
    "pixel_patches": np.uint8,
    "video_grid_thw": np.int32,
    "second_per_grid_ts": np.float32,
    "video_patches": np.uint8,
}


def array_columns(version: int) -> tuple[str, ...]:
    return ARRAY_COLUMNS if version >= 2 else IMAGE_COLUMNS


def shard_schema(patch_row_width: int, version: int = SCHEMA_VERSION, temporal_patch_size: int = 2) -> pa.Schema:
    fields = [
        pa.field("sample_uid", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),
        pa.field("position_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("image_grid_thw", pa.list_(pa.int32()), nullable=False),
        # 64-bit offsets: a record batch of images easily passes 2^31 bytes of patches.
        pa.field("pixel_patches", pa.large_list(pa.uint8()), nullable=False),
        pa.field("num_target_tokens", pa.int32(), nullable=False),
    ]
    metadata = {
        "vlmpack.format": FORMAT_NAME,
        "vlmpack.schema_version": str(version),
        "vlmpack.patch_row_width": str(patch_row_width),
    }
    if version >= 2:
        fields += [
            pa.field("video_grid_thw", pa.list_(pa.int32()), nullable=False),
            pa.field("second_per_grid_ts", pa.list_(pa.float32()), nullable=False),
            pa.field("video_patches", pa.large_list(pa.uint8()), nullable=False),
        ]
        metadata["vlmpack.video_patch_row_width"] = str(patch_row_width * temporal_patch_size)
    return pa.schema(fields, metadata=metadata)


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
    video_patches: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.uint8))  # uint8 [M, C*T*P*P]
    video_grid_thw: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int32))  # int32 [V, 3]
    second_per_grid_ts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # float32 [V]

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

    @property
    def num_videos(self) -> int:
        return int(self.video_grid_thw.shape[0])

    @property
    def num_video_patches(self) -> int:
        return int(self.video_patches.shape[0])
