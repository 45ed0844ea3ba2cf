"""Packs from memory-mapped shards to the GPU, with exact resume.

`PackedDataset` is map-style: item k is the k-th pack this rank consumes in one epoch's
plan (`PackPlan.rank_packs`). It slices the shards zero-copy (`ShardSet[i]` returns views
into the mapped files), lays the pack out with `assemble_pack` (one copy, into the pack's
own arrays; the pixel patches straight into shared memory in a worker, pinned memory in a
pinning main process) and returns torch tensors. It pickles cheaply (shards and saved plans pickle by
path), so it works in `DataLoader(num_workers > 0, batch_size=None, pin_memory=True)`.

Sources are shard directories or their WebDataset exports (`vlmpack export --format
webdataset`: tars + index.json), mixed freely (`pack_plan.open_source`). An export reads each
sample with one `pread` (`WebDatasetShards[i]`) instead of memory-mapped views, and has the
fingerprint of the directory it came from, so the same plan gives the same packs, tensor for
tensor, and a loader state saved on one resumes on the other.

`PackedLoader` runs epochs: epoch e uses the plan built with seed sequence (seed, e)
(`build_pack_plan` with `packing.for_epoch(e)`: new mix draw, new packs, new order), so every
epoch is reshuffled and reproducible. Its state is `LoaderState(fingerprint, seed, epoch,
packs_consumed, dp_size)`, where `packs_consumed` counts packs of the epoch consumed by *all*
ranks together (global batches * G + the within-batch packs * dp_size). Because the
sequence of global batches does not depend on dp_size, a state saved at a global-batch
boundary resumes exactly on any dp_size that divides G; inside a global batch it resumes
exactly with the same dp_size.

The GPU side (`pixel_values_on_device`) turns uint8 patches into the model's pixel values
with a lookup table; no image library runs anywhere in training.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from shards_schema import ShardFault, ShardFormatError, ShardSet
from shards_schema.pixels import pixel_values_from_patches

from .pack_plan import PackPlan, PackSettings, build_pack_plan, open_source, plan_request, source_fingerprint
from .model.batch import PackedBatch
from .packed_batch import DEFAULT_PAD_TOKEN_ID, PATCH_FIELDS, assemble_pack, patch_rows
from .preemption import ignore_stop_signals, stop_signals_blocked


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_madvise = None
if sys.platform.startswith("linux"):
    try:
        _madvise = ctypes.CDLL(None, use_errno=True).madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        _madvise = None


def shared_uint8(rows: int, width: int, prefault: bool = True) -> torch.Tensor:
    """A new uint8 [rows, width] tensor allocated in shared memory (no copy into it, unlike
    `share_memory_()` on an existing tensor). `prefault`: map all of its pages with one
    `madvise(MADV_POPULATE_WRITE)` instead of one page fault per 4 KiB page during the copy
    into it: 1.2x less CPU for a worker's hand-off of a pack (benchmarks/loader_speed.py (d)).
    Where the call is not available (other systems, Linux before 5.14) the pages fault in as
    they are written."""
    try:
        storage = torch.UntypedStorage._new_shared(rows * width)
    except RuntimeError as err:
        if "No space left" not in str(err):
            raise
        raise RuntimeError(f"shared memory is full: a DataLoader worker could not get {rows * width / 2**20:.1f} MiB "
                           f"in /dev/shm for a pack's pixel patches. Give the container more (docker --shm-size, "
                           f"e.g. 16g) or use fewer loader workers (--num-workers 0 assembles packs in the "
                           f"training process). torch said: {err}") from err
    if prefault and _madvise is not None and storage.nbytes():
        # A failure (EINVAL: kernel before 5.14 or a runtime without the call) only costs the faults.
        _madvise(storage.data_ptr(), storage.nbytes(), _MADV_POPULATE_WRITE)
    return torch.empty(0, dtype=torch.uint8).set_(storage).view(rows, width)


@dataclass(frozen=True)
class DataFault:
    """A damaged row a DataLoader worker met, handed to the training process in a pack's place
    and raised there as the ShardFormatError it was (`PackedLoader.__iter__`)."""

    message: str


class PackedDataset(Dataset):
    """This rank's packs of one epoch's plan, as `PackedBatch`es of torch tensors, with
    `pack_index` (position in the plan) and `epoch` set.

    `sources` defaults to the directories recorded in the plan; pass others (same data,
    moved, or exported to WebDataset) and their manifests must match the plan's fingerprints. `pad_to_seq_len` pads every
    pack to exactly `plan.seq_len` tokens (static shapes); otherwise a pack is as long as
    its samples (rounded up to the plan's pad_to_multiple). With `vocab_size` (the model's), a
    sample holding a token id outside 0..vocab_size - 1 is named as a damaged row before its
    pack reaches the embedding, which would index past its table.
    """

    def __init__(self, plan: PackPlan, sources=None, *, rank: int = 0, dp_size: int = 1, pad_to_seq_len: bool = False,
                 row_multiple: int = 1, pad_token_id: int | None = None, pin_memory: bool = False,
                 vocab_size: int | None = None):
        dirs = list(sources) if sources is not None else plan.source_dirs
        if len(dirs) != len(plan.meta["sources"]):
            raise ValueError(f"the plan has {len(plan.meta['sources'])} sources, got {len(dirs)} directories")
        # every shard opened (so checked) now: a damaged one stops the setup, naming it, not a later step
        self.shards = [source.open_all() if isinstance(source, ShardSet) else source for source in map(open_source, dirs)]
        for shards, recorded in zip(self.shards, plan.meta["sources"]):
            if source_fingerprint(shards.manifest) != recorded["fingerprint"]:
                raise ShardFormatError(
                    f"{shards.directory}: its manifest does not match the data the pack plan was built on "
                    f"({recorded['dir']}); rebuild the plan"
                )
        self.plan = plan
        self.rank, self.dp_size = int(rank), int(dp_size)
        self.packs = plan.rank_packs(self.rank, self.dp_size)
        self.seq_len = plan.seq_len if pad_to_seq_len else None
        self.pad_to_multiple = int(plan.settings["pad_to_multiple"])
        self.row_multiple = int(row_multiple)
        if pad_token_id is None:
            pad_token_id = int(self.shards[0].manifest["profile"].get("special_tokens", {}).get("endoftext", DEFAULT_PAD_TOKEN_ID))
        self.pad_token_id = int(pad_token_id)
        self.vocab_size = vocab_size
        self.pin_memory = pin_memory  # the DataLoader pins: write patches straight into pinned memory

    def __len__(self) -> int:
        return len(self.packs)

    def samples(self, k: int) -> list[dict]:
        """The zero-copy sample dicts of this rank's k-th pack."""
        sources, indices = self.plan.pack_samples(int(self.packs[k]))
        samples = [self.shards[s][i] for s, i in zip(sources.tolist(), indices.tolist())]
        if self.vocab_size is not None:
            for sample, s, i in zip(samples, sources.tolist(), indices.tolist()):
                self._check_token_ids(sample, self.shards[s], i)
        return samples

    def _check_token_ids(self, sample: dict, source, i: int) -> None:
        """ShardFault (a ShardFormatError for an export's tar) naming the row whose token ids
        leave the model's vocabulary: one min and max a sample."""
        ids = sample["input_ids"]
        if not ids.size or (int(ids.min()) >= 0 and int(ids.max()) < self.vocab_size):
            return
        bad = np.flatnonzero((ids < 0) | (ids >= self.vocab_size))
        detail = (f"token {int(bad[0])} has id {int(ids[bad[0]])}, outside the model's vocabulary "
                  f"0..{self.vocab_size - 1} ({bad.size} such)")
        if isinstance(source, ShardSet):
            shard, row = source.locate(i)
            raise ShardFault(source.directory / source.manifest["shards"][shard]["file"], "token_id", detail, row=row)
        raise ShardFormatError(f"{source.directory}: sample {i} ({sample['sample_uid']}): [token_id] {detail}; export "
                               f"the shard directory again and check it with `vlmpack verify`")

    def _patch_buffer(self, samples: list[dict], name: str) -> torch.Tensor | None:
        """Where the pack's image or video patches (most of its bytes) are written. In a
        DataLoader worker: a new shared-memory block, as torch's default_collate allocates its
        batches there, which the worker hands to the training process as is (a plain array
        would first be copied into shared memory: 1.7x the CPU for this hand-off,
        benchmarks/loader_speed.py). In the training process with `pin_memory`: pinned memory
        from CUDA's caching host allocator, which the DataLoader does not copy again and whose
        pages are reused, not faulted in anew for every pack."""
        rows, width = patch_rows(samples, name)
        if rows == 0:
            return None
        if torch.utils.data.get_worker_info() is not None:
            return shared_uint8(rows, width)
        if self.pin_memory and torch.cuda.is_available():
            return torch.empty((rows, width), dtype=torch.uint8, pin_memory=True)
        return None

    def __getitem__(self, k: int) -> PackedBatch | DataFault:
        if not 0 <= k < len(self.packs):
            raise IndexError(f"pack {k} out of range: rank {self.rank} has {len(self.packs)} packs this epoch")
        try:
            samples = self.samples(k)
        except ShardFormatError as exc:
            if torch.utils.data.get_worker_info() is None:
                raise
            return DataFault(str(exc))  # the DataLoader would re-raise it as a RuntimeError holding the traceback
        buffers = {name: buf for name in PATCH_FIELDS if (buf := self._patch_buffer(samples, name)) is not None}
        batch = assemble_pack(samples, seq_len=self.seq_len, pad_to_multiple=self.pad_to_multiple,
                              row_multiple=self.row_multiple, pad_token_id=self.pad_token_id,
                              patch_out={n: b.numpy() for n, b in buffers.items()})
        # the buffers themselves, not tensors made from their numpy views: their storage is the shared / pinned one
        return batch.replace(pack_index=int(self.packs[k]), epoch=int(self.plan.settings["epoch"])).as_tensors() \
            .replace(**buffers)


def pixel_values_on_device(pixel_patches: torch.Tensor, vision: dict, dtype: torch.dtype | None = None) -> torch.Tensor:
    """uint8 patches [N, C*P*P] (already on the GPU) -> the vision tower's pixel values
    [N, C*T*P*P], bit-identical to HF's float32 `pixel_values` (cast to `dtype` afterwards).
    `vision` is the manifest's `profile.vision`."""
    return pixel_values_from_patches(
        pixel_patches, vision["image_mean"], vision["image_std"], int(vision["patch_size"]),
        int(vision["temporal_patch_size"]), int(vision.get("channels", 3)), dtype=dtype,
    )


@dataclass
class LoaderState:
    """Where a run is in the data: exact and small (a checkpoint stores `to_dict()`)."""

    fingerprint: str  # data + packing settings, without seed/epoch (PackPlan.data_fingerprint)
    seed: int
    epoch: int
    packs_consumed: int  # packs of this epoch consumed by all ranks together
    dp_size: int = 1  # the dp_size that consumed them (resume inside a global batch needs the same)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict) -> "LoaderState":
        return cls(**{k: state[k] for k in ("fingerprint", "seed", "epoch", "packs_consumed")},
                   dp_size=int(state.get("dp_size", 1)))


class PackedLoader:
    """Epochs of this rank's packs through a torch DataLoader, with `state_dict()`.

    `for batch in loader:` yields the rest of the current epoch, then moves to the next one
    (so `for epoch in ...: for batch in loader:` works, and so does resuming mid-epoch).
    `sources` and `packing` are those of `build_pack_plan` (shard directories or WebDataset
    exports, each optionally weighted; `packing.epoch` is where the loader starts, and
    `packing.dp_size` the ranks it is one of); `cache_dir` shares plans between ranks and
    restarts. DataLoader settings: num_workers, pin_memory, prefetch_factor. `vocab_size`: the
    model's, against which each sample's token ids are checked (`PackedDataset`).
    """

    def __init__(self, sources, packing: PackSettings, *, rank: int = 0, pad_to_seq_len: bool = False,
                 row_multiple: int = 1, cache_dir: str | Path | None = None,
                 num_workers: int = 0, pin_memory: bool = False, prefetch_factor: int | None = None,
                 vocab_size: int | None = None):
        self.sources = sources
        self.vocab_size = vocab_size
        self.packing = packing
        request = plan_request(sources, packing)  # checks the sources' manifests, no shard read
        self.fingerprint = request.data_fingerprint
        self.source_dirs = [directory for directory, _ in request.specs]
        self.global_batch_packs = packing.global_batch
        self.seed, self.rank, self.dp_size = int(packing.seed), int(rank), int(packing.dp_size)
        if not 0 <= self.rank < self.dp_size:
            raise ValueError(f"rank {rank} out of range for dp_size {self.dp_size}")
        self.pad_to_seq_len, self.row_multiple = pad_to_seq_len, int(row_multiple)
        self.cache_dir = cache_dir
        self.loader_kwargs = dict(num_workers=num_workers, pin_memory=pin_memory)
        if num_workers > 0:
            self.loader_kwargs["worker_init_fn"] = ignore_stop_signals  # a preemption notice is the trainer's
            if prefetch_factor is not None:
                self.loader_kwargs["prefetch_factor"] = prefetch_factor
        self.epoch = int(packing.epoch)
        self.position = 0  # packs of this epoch consumed by this rank
        self._dataset: PackedDataset | None = None

    @property
    def packs_per_rank_per_global_batch(self) -> int:
        return self.global_batch_packs // self.dp_size

    def plan(self, epoch: int | None = None) -> PackPlan:
        epoch = self.epoch if epoch is None else epoch
        return build_pack_plan(self.sources, self.packing.for_epoch(epoch), cache_dir=self.cache_dir)

    def dataset(self) -> PackedDataset:
        """The current epoch's dataset (built on first use)."""
        if self._dataset is None or self._dataset.plan.settings["epoch"] != self.epoch:
            # read from this loader's own sources, not the plan's recorded ones: a cached plan may
            # have been built on the same data elsewhere (moved, or the Arrow twin of an export)
            self._dataset = PackedDataset(self.plan(), self.source_dirs, rank=self.rank, dp_size=self.dp_size,
                                          pad_to_seq_len=self.pad_to_seq_len, row_multiple=self.row_multiple,
                                          pin_memory=self.loader_kwargs["pin_memory"], vocab_size=self.vocab_size)
        return self._dataset

    def __len__(self) -> int:
        """Packs this rank consumes in the current epoch (all of them, consumed or not)."""
        return len(self.dataset())

    def __iter__(self):
        dataset = self.dataset()
        if self.position >= len(dataset):  # stopped exactly at an epoch's end: go on with the next
            self._next_epoch()
            dataset = self.dataset()
        loader = DataLoader(dataset, batch_size=None, sampler=range(self.position, len(dataset)), **self.loader_kwargs)
        threads = torch.get_num_threads()
        pin_thread = self.loader_kwargs["pin_memory"] and self.loader_kwargs["num_workers"] > 0
        with stop_signals_blocked():  # the workers start here, blocking them until their init takes them over
            batches = iter(loader)
        for n, batch in enumerate(batches):
            if isinstance(batch, DataFault):
                raise ShardFormatError(batch.message)
            if n == 0 and pin_thread:
                # The pin-memory thread sets torch's process-wide intra-op thread count to 1 when
                # it starts (it has, by the first batch). Threads started after it take that
                # count: autograd's device threads, at the first backward. torch.compile guards
                # on the count, so a graph that runs both in this thread and in autograd's (a
                # recomputed forward) would compile once more for each, toward dynamo's
                # recompile limit. Restoring it keeps one count in both.
                torch.set_num_threads(threads)
            self.position += 1
            yield batch
        self._next_epoch()

    def _next_epoch(self) -> None:
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict:
        per = self.packs_per_rank_per_global_batch
        batches, within = divmod(self.position, per)
        consumed = batches * self.global_batch_packs + within * self.dp_size
        return LoaderState(self.fingerprint, self.seed, self.epoch, consumed, self.dp_size).to_dict()

    def load_state_dict(self, state: dict) -> None:
        state = LoaderState.from_dict(state)
        if state.fingerprint != self.fingerprint:
            raise ValueError(
                "loader state was saved for other data or packing settings (--data and its weights, --seq-len, "
                "--max-visual-tokens, --global-batch-packs, the packs' padding): its fingerprint "
                f"{state.fingerprint[:16]} != {self.fingerprint[:16]}; resume with the same data and settings"
            )
        if state.seed != self.seed:
            raise ValueError(f"loader state was saved with seed {state.seed}, this loader has seed {self.seed}")
        G = self.global_batch_packs
        batches, rest = divmod(int(state.packs_consumed), G)
        if rest and state.dp_size != self.dp_size:
            raise ValueError(
                f"loader state stops inside a global batch ({rest} of {G} packs consumed with dp_size {state.dp_size}); "
                f"it can only resume with that dp_size, not {self.dp_size} (save at a global-batch boundary to change it)"
            )
        self.epoch = int(state.epoch)
        self.position = batches * self.packs_per_rank_per_global_batch + rest // self.dp_size
