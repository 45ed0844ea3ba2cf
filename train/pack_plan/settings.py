"""`PackSettings`: how samples become packs, the one set of settings that `vlmpack pack`, the
planner and the loader share (and that a plan records and its key covers)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import PackingError

DEFAULT_BLOCK_SIZE = 4096
MAX_PACK_SETTING = 2**31 - 1  # the plan's arrays hold int32 token counts


@dataclass(frozen=True)
class PackSettings:
    """Checked when made: a bad value is a PackingError naming its `vlmpack pack` flag."""

    seq_len: int  # tokens per pack (the training sequence length)
    seed: int = 0  # the mixing draw's and shuffles' seed
    epoch: int = 0  # the epoch planned: epoch e draws and shuffles with the seed sequence (seed, e)
    max_visual_tokens: int | None = None  # visual tokens per pack at most (None: no budget)
    dp_size: int = 1  # data-parallel ranks: the global batch must split evenly over them (not part of the plan)
    global_batch_packs: int | None = None  # packs per global batch, a multiple of dp_size (None: dp_size)
    pad_to_multiple: int = 1  # each sample rounded up to a multiple of this many tokens (TP sequence parallel / CP)
    block_size: int = DEFAULT_BLOCK_SIZE  # samples sorted and packed best-fit-decreasing per block of this many

    def __post_init__(self):
        for flag, value, least in (("--seq-len", self.seq_len, 1), ("--seed", self.seed, 0),
                                   ("--epoch", self.epoch, 0), ("--max-visual-tokens", self.max_visual_tokens, 1),
                                   ("--pad-to-multiple", self.pad_to_multiple, 1), ("--block-size", self.block_size, 1)):
            if value is not None and value < least:
                raise PackingError(f"{flag} must be an integer >= {least}, got {value}")
        for flag, value in (("--seq-len", self.seq_len), ("--max-visual-tokens", self.max_visual_tokens),
                            ("--pad-to-multiple", self.pad_to_multiple), ("--block-size", self.block_size),
                            ("--dp-size", self.dp_size), ("--global-batch-packs", self.global_batch_packs)):
            if value is not None and value > MAX_PACK_SETTING:
                raise PackingError(f"{flag} must be at most {MAX_PACK_SETTING:,}, got {value}")
        if self.dp_size < 1:
            raise PackingError(f"--dp-size must be an integer >= 1, got {self.dp_size}")
        G = self.global_batch
        if G < 1 or G % self.dp_size:
            raise PackingError(f"--global-batch-packs {G} must be a positive multiple of --dp-size {self.dp_size} "
                               "(every rank gets the same number of packs)")

    @property
    def global_batch(self) -> int:
        """Packs per global batch: `global_batch_packs`, or dp_size when not given."""
        return int(self.global_batch_packs) if self.global_batch_packs is not None else int(self.dp_size)

    def for_epoch(self, epoch: int) -> "PackSettings":
        return dataclasses.replace(self, epoch=epoch)

    def recorded(self) -> dict:
        """What a plan records and its key covers (`PackPlan.settings`): dp_size is not in it,
        the plan does not depend on it."""
        return {
            "seq_len": int(self.seq_len),
            "seed": int(self.seed),
            "epoch": int(self.epoch),
            "max_visual_tokens": None if self.max_visual_tokens is None else int(self.max_visual_tokens),
            "global_batch_packs": self.global_batch,
            "pad_to_multiple": int(self.pad_to_multiple),
            "block_size": int(self.block_size),
        }
