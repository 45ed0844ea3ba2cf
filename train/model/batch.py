"""`PackedBatch`: one packed row of samples, the one type between the loader, the trainer
and the model.

`train.packed_batch.assemble_pack` lays samples out as a PackedBatch of numpy arrays (its
docstring has the label-shift and padding conventions); the loader turns it into torch
tensors (`as_tensors`), the trainer finds the rows the forward needs on the host
(`with_rows`), lays a micro-batch's packs end to end (`concat`) and moves it to the device
(`to`); `QwenVLModel.forward` reads it.

torch is imported only where tensors are made: assembling packs needs numpy alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import numpy as np

if TYPE_CHECKING:
    import torch

Array = Union[np.ndarray, "torch.Tensor"]  # numpy out of `assemble_pack`, torch tensors from the loader on

IGNORE_INDEX = -100  # torch CrossEntropyLoss / HF default ignore_index
HOST_FIELDS = ("image_grid_thw", "video_grid_thw")  # stay on the host: the vision tower builds its index tensors there
ROW_FIELDS = ("image_rows", "video_rows", "loss_rows")  # row indices, shifted when packs are laid end to end


@dataclass
class PackedBatch:
    """One packed row: T rows holding `num_samples` samples (plus padding), n segments.

    A pack straight from `assemble_pack`; after `concat`, several packs end to end in one
    row (segments kept), which is what a micro-batch is."""

    input_ids: Array  # int64 [T]
    labels: Array  # int64 [T]: shifted targets, labels[i] is what row i predicts; -100 = no target
    loss_mask: Array  # float32 [T]: labels != -100
    position_ids: Array  # int32 [3, T]: M-RoPE (temporal, height, width) positions
    # bool [T]: True on padding rows, which MoE routers leave out of the load-balancing loss (None: no row left out)
    padding_mask: Array | None
    cu_seqlens: Array  # int32 [n+1]: cumulative real lengths of the segments (Transformer Engine's cu_seqlens_q)
    cu_seqlens_padded: Array  # int32 [n+1]: row offsets of the padded segments (what varlen attention takes)
    max_seqlen: int  # longest segment of cu_seqlens_padded
    sample_lengths: Array  # int32 [num_samples]: real tokens of each sample
    num_samples: int  # real samples (the trailing padding segment is not one)
    num_target_tokens: int  # rows with a target: loss_mask.sum()
    pixel_patches: Array  # uint8 [N, C*P*P]: image patches, in sample order
    image_grid_thw: Array  # int32 [K, 3]: (t, h, w) patch grid of each image
    video_patches: Array  # uint8 [M, C*T*P*P]: video patches, both frames of a temporal patch
    video_grid_thw: Array  # int32 [V, 3]: (t, h, w) patch grid of each video
    sample_uids: list[str]  # each sample's uid, in order
    pack_index: int | None = None  # position in the epoch's plan (the loader sets it; None after concat)
    epoch: int | None = None  # the plan's epoch (the loader sets it; None after concat)
    # Found on the host copy (`with_rows`) so the forward never waits for the GPU; None: the
    # model finds them itself.
    image_rows: Array | None = None  # int64 [image tokens]: the <|image_pad|> rows
    video_rows: Array | None = None  # int64 [video tokens]: the <|video_pad|> rows
    loss_rows: Array | None = None  # int64 [targets]: the rows with a target (the only ones the loss computes)

    @classmethod
    def from_segments(cls, input_ids, position_ids, cu_seqlens, labels=None) -> "PackedBatch":
        """A text-only row (torch tensors) of the segments at row offsets `cu_seqlens`, no
        padding: what a test or benchmark builds by hand. `labels` (shifted, -100 = no target)
        default to no targets."""
        import torch

        labels = torch.full_like(input_ids, IGNORE_INDEX) if labels is None else labels
        lengths = cu_seqlens.diff()
        host = torch.device("cpu")
        return cls(input_ids=input_ids, labels=labels, loss_mask=(labels != IGNORE_INDEX).float(),
                   position_ids=position_ids, padding_mask=torch.zeros_like(input_ids, dtype=torch.bool),
                   cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens, max_seqlen=int(lengths.max()),
                   sample_lengths=lengths, num_samples=len(lengths),
                   num_target_tokens=int((labels != IGNORE_INDEX).sum()),
                   pixel_patches=torch.zeros(0, 0, dtype=torch.uint8, device=input_ids.device),
                   image_grid_thw=torch.zeros(0, 3, dtype=torch.int32, device=host),
                   video_patches=torch.zeros(0, 0, dtype=torch.uint8, device=input_ids.device),
                   video_grid_thw=torch.zeros(0, 3, dtype=torch.int32, device=host),
                   sample_uids=[""] * len(lengths))

    @property
    def num_rows(self) -> int:
        """T, the row count."""
        return int(self.input_ids.shape[0])

    def replace(self, **changes) -> "PackedBatch":
        return dataclasses.replace(self, **changes)

    def as_tensors(self) -> "PackedBatch":
        """numpy arrays as torch tensors (sharing their memory); tensors and scalars unchanged."""
        import torch

        return self.replace(**{f.name: torch.from_numpy(value) for f in dataclasses.fields(self)
                               if isinstance(value := getattr(self, f.name), np.ndarray)})

    def as_numpy(self) -> "PackedBatch":
        """Host tensors as numpy arrays (sharing their memory): `assemble_pack`'s form."""
        import torch

        return self.replace(**{f.name: value.numpy() for f in dataclasses.fields(self)
                               if isinstance(value := getattr(self, f.name), torch.Tensor)})

    def pin_memory(self) -> "PackedBatch":
        """Tensors in pinned memory (the DataLoader's pin-memory thread calls this; a tensor
        already pinned is kept as is)."""
        import torch

        return self.replace(**{f.name: value.pin_memory() for f in dataclasses.fields(self)
                               if isinstance(value := getattr(self, f.name), torch.Tensor)})

    def with_rows(self, image_token_id: int, video_token_id: int, pin_memory: bool = False) -> "PackedBatch":
        """`image_rows`, `video_rows` and `loss_rows` found on this (host) batch, pinned for an
        asynchronous copy with `pin_memory`."""
        import torch

        rows = {"image_rows": torch.nonzero(self.input_ids == image_token_id)[:, 0],
                "video_rows": torch.nonzero(self.input_ids == video_token_id)[:, 0],
                "loss_rows": torch.nonzero(self.labels != IGNORE_INDEX)[:, 0]}
        if pin_memory:
            rows = {k: v.pin_memory() for k, v in rows.items()}
        return self.replace(**rows)

    def to(self, device, non_blocking: bool = True) -> "PackedBatch":
        """Tensors on `device` (asynchronous from pinned memory), but for the image and video
        grids, which stay where they are (the host, for the forward to read without waiting)."""
        import torch

        return self.replace(**{f.name: value.to(device, non_blocking=non_blocking) for f in dataclasses.fields(self)
                               if f.name not in HOST_FIELDS and isinstance(value := getattr(self, f.name), torch.Tensor)})

    @classmethod
    def concat(cls, packs: list["PackedBatch"]) -> "PackedBatch":
        """Packs (torch tensors) laid end to end in one row: segment boundaries and row indices
        shifted, segments kept."""
        import torch

        if len(packs) == 1:
            return packs[0]
        first = packs[0]
        rows = [0] + torch.cumsum(torch.tensor([p.num_rows for p in packs[:-1]]), 0).tolist()
        # the real lengths' offsets stay tensors: reading them from a pack on the GPU would wait for it
        real = [0, *torch.cumsum(torch.stack([p.cu_seqlens[-1] for p in packs[:-1]]), 0)]

        def cat(name: str, dim: int = 0):
            return torch.cat([getattr(p, name) for p in packs], dim=dim)

        def shifted_bounds(name: str, offsets: list[int]):
            return torch.cat([getattr(first, name)[:1]] + [getattr(p, name)[1:] + o for p, o in zip(packs, offsets)])

        return cls(
            input_ids=cat("input_ids"), labels=cat("labels"), loss_mask=cat("loss_mask"),
            position_ids=cat("position_ids", dim=-1), padding_mask=cat("padding_mask"),
            cu_seqlens=shifted_bounds("cu_seqlens", real), cu_seqlens_padded=shifted_bounds("cu_seqlens_padded", rows),
            max_seqlen=max(int(p.max_seqlen) for p in packs), sample_lengths=cat("sample_lengths"),
            num_samples=sum(int(p.num_samples) for p in packs),
            num_target_tokens=sum(int(p.num_target_tokens) for p in packs),
            pixel_patches=cat("pixel_patches"), image_grid_thw=cat("image_grid_thw"),
            video_patches=cat("video_patches"), video_grid_thw=cat("video_grid_thw"),
            sample_uids=[uid for p in packs for uid in p.sample_uids],
            **{name: torch.cat([getattr(p, name) + o for p, o in zip(packs, rows)])
               for name in ROW_FIELDS if getattr(first, name) is not None},
        )
