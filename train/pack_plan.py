"""The pack plan: which samples form each pack, in training order, decided offline.

The planner reads only per-sample token and patch counts (`ShardSet.sample_stats()`, list
offsets; never a token or pixel value) and returns a few numpy arrays. The loader later
slices the memory-mapped shards by these indices; no data is copied or rewritten. A source
may also be a WebDataset export of a shard directory (`open_source`): the same counts come
from its tar headers, and it packs exactly like the directory it was exported from.

Rules (each one is what a reproducible, resumable training run needs):

* Mixing. Source k of n_k samples with weight w_k contributes round(w_k / sum(w) * N)
  samples per epoch, N = sum(n_k) (round half up). Weights default to n_k for every source
  when none is given (each sample exactly once per epoch); when some are given, a missing
  weight is 1.0. Downsampled (count < n_k): a seeded draw without replacement, a different
  subset every epoch. Upsampled: every sample count // n_k times, plus count % n_k drawn
  without replacement — sampling with replacement, but with the least variance (each sample
  appears floor or ceil of its expected count times).
* Packing. Samples are shuffled (seeded), cut into blocks of `block_size` (4096), and each
  block is packed best-fit-decreasing: sorted by length, each sample goes into the open pack
  whose free room is the smallest that fits it (a bisect over a sorted list of free rooms).
  A sample's length counts rounded up to `pad_to_multiple`; a pack holds at most `seq_len`
  such tokens and, with `max_visual_tokens`, at most that many visual tokens
  (patches / merge_size^2); then image samples are placed first (best fit over both
  budgets) and text-only samples fill the gaps (`best_fit_decreasing`). Text-only and image
  samples share packs. A sample longer than `seq_len` (or with more visual tokens than the budget) is an
  error naming its directory, index, uid and length.
* Order and DP. Packs are shuffled (seeded) and stored in training order. They form global
  batches of `global_batch_packs` = G consecutive packs (G defaults to dp_size); when the
  number of packs is not a multiple of G, the P mod G packs with the fewest tokens are
  dropped (reported as `dropped_packs` / `dropped_samples`; which samples differs every
  epoch). The plan itself does not depend on dp_size: `rank_packs(rank, dp_size)` splits each
  global batch over the ranks at read time (G / dp_size packs each, greedy: packs by
  descending visual tokens, then tokens, onto the least-loaded rank). So the sequence of
  global batches is the same for any dp_size dividing G, which is what lets a run resume on
  a different number of GPUs.
* Epochs. Epoch e is planned with the seed sequence (seed, e): a new mix draw, new packs,
  a new order (not seed + e, which would make seed 1 epoch 0 equal seed 0 epoch 1).
* Cache. `build_pack_plan(..., cache_dir=D)` keys a plan by sha256 of (each source's
  manifest fingerprint: profile id, schema version, shard sha256 list; its weight; seq_len,
  seed, epoch, max_visual_tokens, G, pad_to_multiple, block size, planner version) and
  saves it atomically (temporary directory + rename), so ranks planning at once never read
  a half-written plan. dp_size is not in the key: the plan does not depend on it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import time
from bisect import bisect_left, insort
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from shards_schema import MANIFEST_NAME, ShardFormatError, ShardSet, load_manifest, open_shards
from shards_schema.webdataset import (
    ARRAY_MEMBERS,
    INDEX_NAME,
    KEY_DIGITS,
    KEY_PREFIX,
    MEMBER_NAMES,
    WebDatasetFormatError,
    WebDatasetShards,
    load_index,
)

PLANNER_VERSION = 1
DEFAULT_BLOCK_SIZE = 4096
PLAN_META = "plan.json"
ARRAY_NAMES = ("pack_offsets", "sample_source", "sample_index", "pack_tokens", "pack_padded_tokens", "pack_visual_tokens")


class PackingError(ValueError):
    """The samples cannot be packed under the given settings (the message names the fix)."""


# --------------------------------------------------------------------------- sources


@dataclass
class SourceStats:
    """What the planner knows about one source: per-sample sizes and an identity."""

    name: str  # the shard directory (or a label for synthetic stats)
    num_tokens: np.ndarray  # int64 [n]
    visual_tokens: np.ndarray  # int64 [n] (patches / merge_size^2)
    fingerprint: dict  # identity of the data (manifest profile id + shard checksums)
    describe: Callable[[int], str] | None = None  # sample index -> "uid ..." for error messages

    def __len__(self) -> int:
        return len(self.num_tokens)


def source_fingerprint(manifest: dict) -> dict:
    """The parts of a manifest that identify the data (cheap: no shard is read)."""
    return {
        "profile_id": manifest["profile"]["id"],
        "schema_version": manifest["schema_version"],
        "patch_row_width": manifest["patch_row_width"],
        "shards_sha256": [s["sha256"] for s in manifest["shards"]],
    }


# A source is a shard directory (manifest.json) or a WebDataset export of one (index.json,
# `vlmpack export --format webdataset`). An export keeps its source's manifest in index.json,
# so both have the same fingerprint: plans, plan caches and loader states carry over between
# a directory and its export (same data, same packs, bit for bit).


def is_webdataset_export(directory: str | Path) -> bool:
    directory = Path(directory)
    return not (directory / MANIFEST_NAME).is_file() and (directory / INDEX_NAME).is_file()


def source_manifest(directory: str | Path) -> dict:
    """The shard manifest of a source (for an export: the one recorded in its index.json)."""
    directory = Path(directory)
    if is_webdataset_export(directory):
        return load_index(directory)["manifest"]
    if directory.is_dir() and not (directory / MANIFEST_NAME).exists():
        raise ShardFormatError(
            f"{directory}: neither {MANIFEST_NAME} nor {INDEX_NAME}; a training source is a shard directory written by "
            "`vlmpack preprocess` (one whose job has not finished, or whose partitions are not merged yet, has no "
            f"{MANIFEST_NAME}) or its WebDataset export (`vlmpack export --format webdataset`)"
        )
    return load_manifest(directory)


def open_source(directory: str | Path) -> "ShardSet | WebDatasetSource":
    """A source as an indexable dataset: `len`, `[i]` (the reader's sample dict), `.manifest`,
    `.directory`, `.sample_stats()`; both kinds pickle by path (DataLoader workers)."""
    return WebDatasetSource(directory) if is_webdataset_export(directory) else open_shards(directory)


_WDS_STATS_CACHE: dict[tuple, dict[str, np.ndarray]] = {}  # (tardir, index.json mtime_ns, size) -> sizes
_STATS_CHUNK = 1 << 16  # samples per vectorised step (bounds the gather temporaries to a few MB)


class WebDatasetSource(WebDatasetShards):
    """`WebDatasetShards` with what the planner needs: `directory` and `sample_stats()`.

    Per-sample sizes are not in index.json, and reading every sample's meta.json would be a
    tar walk in Python per sample. Instead they come from the tar headers themselves: index.json
    gives each sample's first header offset, members follow in the documented sorted order, each
    USTAR header holds the member's size, each `.npy` payload starts with its header length.
    So one numpy gather per member over all samples of a tar (memory-mapped) yields every
    size, touching only header pages, never a pixel. Each walk is checked: names must be
    `<key>.<member>` for the expected key and the walk must land exactly on the next sample.
    The result is cached per process, keyed by index.json's identity (ranks plan every epoch).
    """

    def __init__(self, tardir: str | Path):
        super().__init__(tardir)
        self.directory = self.tardir

    def sample_stats(self) -> dict[str, np.ndarray]:
        """num_tokens, num_patches, num_images (int64 [n]); like `ShardSet.sample_stats` minus
        num_target_tokens (which lives only in meta.json)."""
        index_stat = (self.tardir / INDEX_NAME).stat()
        key = (str(self.tardir.resolve()), index_stat.st_mtime_ns, index_stat.st_size)
        cached = _WDS_STATS_CACHE.get(key)
        if cached is None:
            parts = [self._tar_stats(k) for k in range(len(self.tars))]
            names = ("num_tokens", "num_patches", "num_images")
            cached = {n: np.concatenate([p[n] for p in parts]) if parts else np.zeros(0, np.int64) for n in names}
            _WDS_STATS_CACHE[key] = cached
        return {n: v.copy() for n, v in cached.items()}

    def _tar_stats(self, k: int) -> dict[str, np.ndarray]:
        path, entry = self._tar_path(k), self.tars[k]
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise WebDatasetFormatError(f"{path}: {size} bytes, {INDEX_NAME} says {entry['bytes']} (truncated or replaced?)")
        n = int(entry["samples"])
        if n == 0:
            return {"num_tokens": np.zeros(0, np.int64), "num_patches": np.zeros(0, np.int64), "num_images": np.zeros(0, np.int64)}
        starts = np.asarray(entry["sample_offsets"], dtype=np.int64)
        ends = np.append(starts[1:], int(entry["end_offset"]))
        tar = np.memmap(path, dtype=np.uint8, mode="r")
        out = []
        for lo in range(0, n, _STATS_CHUNK):
            hi = min(n, lo + _STATS_CHUNK)
            out.append(_walk_sample_headers(tar, starts[lo:hi], ends[lo:hi], int(entry["first_index"]) + lo,
                                            path, self.patch_row_width))
        del tar
        return {name: np.concatenate([o[name] for o in out]) for name in out[0]}


_TAR_BLOCK = tarfile.BLOCKSIZE  # 512: one header; payloads are padded to whole blocks
_OCTAL_WEIGHTS = 8 ** np.arange(10, -1, -1, dtype=np.int64)  # USTAR size field: 11 octal digits + NUL
_DECIMAL_WEIGHTS = 10 ** np.arange(KEY_DIGITS - 1, -1, -1, dtype=np.int64)
_NPY_MAGIC = np.frombuffer(b"\x93NUMPY", dtype=np.uint8)


def _walk_sample_headers(tar: np.ndarray, starts: np.ndarray, ends: np.ndarray, first_index: int, path: Path,
                         width: int) -> dict[str, np.ndarray]:
    """Payload sizes of every member of samples starting at `starts` (see `WebDatasetSource`)."""
    n = len(starts)
    pos = starts.copy()
    payload: dict[str, np.ndarray] = {}

    def fail(rows: np.ndarray, what: str):
        j = int(np.flatnonzero(rows)[0])
        key = f"{KEY_PREFIX}{first_index + j:0{KEY_DIGITS}d}"
        raise WebDatasetFormatError(
            f"{path}: sample {key} (byte {int(starts[j])}): {what}; the tar does not match {INDEX_NAME} "
            "(re-export it, or check it with WebDatasetShards(...).verify())"
        )

    digits = ((first_index + np.arange(n, dtype=np.int64))[:, None] // _DECIMAL_WEIGHTS) % 10 + ord("0")
    try:
        for member in MEMBER_NAMES:
            expected_name = np.concatenate([
                np.full((n, 1), ord(KEY_PREFIX), np.int64), digits,
                np.broadcast_to(np.frombuffer(f".{member}\0".encode(), np.uint8).astype(np.int64), (n, len(member) + 2)),
            ], axis=1)
            name = tar[pos[:, None] + np.arange(expected_name.shape[1])]
            bad = (name != expected_name).any(axis=1)
            if bad.any():
                fail(bad, f"expected member {member} here")
            field = tar[pos[:, None] + 124 + np.arange(11)].astype(np.int64) - ord("0")
            bad = ((field < 0) | (field > 7)).any(axis=1)
            if bad.any():
                fail(bad, f"member {member} has an unreadable size field")
            size = field @ _OCTAL_WEIGHTS
            data = pos + _TAR_BLOCK
            if member.endswith(".npy"):
                head = tar[data[:, None] + np.arange(12)].astype(np.int64)
                version = head[:, 6]
                bad = (head[:, :6] != _NPY_MAGIC).any(axis=1) | ((version != 1) & (version != 2))
                if bad.any():
                    fail(bad, f"member {member} is not an NPY 1.0/2.0 array")
                header_len = np.where(version == 1, 10 + head[:, 8] + (head[:, 9] << 8),
                                      12 + head[:, 8] + (head[:, 9] << 8) + (head[:, 10] << 16) + (head[:, 11] << 24))
                payload[member] = size - header_len
            pos = data + -(-size // _TAR_BLOCK) * _TAR_BLOCK
    except IndexError:
        fail(np.ones(n, bool), "a member header lies beyond the end of the tar")
    bad = pos != ends
    if bad.any():
        fail(bad, "its members do not end where the next sample starts")

    tokens = payload["loss_mask.npy"]  # uint8 [L]: the byte count is the token count
    checks = {
        "input_ids.npy": payload["input_ids.npy"] != tokens * ARRAY_MEMBERS["input_ids.npy"][1].itemsize,
        "position_ids.npy": payload["position_ids.npy"] != 3 * tokens * ARRAY_MEMBERS["position_ids.npy"][1].itemsize,
        "image_grid_thw.npy": payload["image_grid_thw.npy"] % (3 * ARRAY_MEMBERS["image_grid_thw.npy"][1].itemsize) != 0,
        "pixel_patches.npy": payload["pixel_patches.npy"] % width != 0,
    }
    for member, bad in checks.items():
        if bad.any():
            fail(bad, f"member {member} has a size that does not fit its shape")
    return {
        "num_tokens": tokens,
        "num_patches": payload["pixel_patches.npy"] // width,
        "num_images": payload["image_grid_thw.npy"] // (3 * ARRAY_MEMBERS["image_grid_thw.npy"][1].itemsize),
    }


def load_source_stats(directory: str | Path) -> SourceStats:
    """Per-sample token and visual-token counts of a source, from Arrow offsets or tar headers."""
    shards = open_source(directory)
    stats = shards.sample_stats()
    merge = int(shards.manifest["profile"]["vision"]["merge_size"])

    def describe(i: int) -> str:
        return f"uid {shards[i]['sample_uid']!r}"

    return SourceStats(
        name=str(Path(directory).resolve()),
        num_tokens=stats["num_tokens"].astype(np.int64),
        visual_tokens=stats["num_patches"].astype(np.int64) // (merge * merge),
        fingerprint=source_fingerprint(shards.manifest),
        describe=describe,
    )


def parse_source(spec) -> tuple[str, float | None]:
    """'DIR', 'DIR:0.7', Path or (DIR, weight) -> (DIR, weight or None).

    A ':' suffix is a weight only when it parses as a number and DIR itself does not exist
    (so directories whose names contain ':' still work)."""
    if isinstance(spec, (tuple, list)):
        directory, weight = spec
        return str(directory), None if weight is None else float(weight)
    text = str(spec)
    if ":" in text and not Path(text).exists():
        head, tail = text.rsplit(":", 1)
        try:
            return head, float(tail)
        except ValueError:
            pass
    return text, None


def resolve_weights(sizes: Sequence[int], weights: Sequence[float | None]) -> np.ndarray:
    """The mixing rule's weights: the source sizes when none is given, else missing = 1.0."""
    if all(w is None for w in weights):
        return np.asarray(sizes, dtype=np.float64)
    w = np.array([1.0 if x is None else float(x) for x in weights], dtype=np.float64)
    if (w < 0).any() or not np.isfinite(w).all() or w.sum() <= 0:
        raise PackingError(f"mixing weights must be finite, >= 0 and not all 0, got {list(weights)}")
    return w


def mix_counts(sizes: Sequence[int], weights: np.ndarray) -> np.ndarray:
    """Samples drawn from each source per epoch: round(w / sum(w) * total), half up."""
    sizes = np.asarray(sizes, dtype=np.int64)
    return np.floor(weights / weights.sum() * sizes.sum() + 0.5).astype(np.int64)


def draw_samples(sizes: Sequence[int], counts: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(source int32 [S], index int64 [S]) per the mixing rule (module docstring)."""
    sources, indices = [], []
    for k, (size, count) in enumerate(zip(sizes, counts)):
        if count == 0:
            continue
        if size == 0:
            raise PackingError(f"source {k} has no samples but a non-zero mixing weight")
        repeats, rest = divmod(int(count), int(size))
        parts = [np.tile(np.arange(size, dtype=np.int64), repeats)] if repeats else []
        if rest:
            parts.append(np.sort(rng.permutation(size)[:rest]))
        idx = np.concatenate(parts)
        sources.append(np.full(len(idx), k, dtype=np.int32))
        indices.append(idx)
    if not sources:
        return np.zeros(0, np.int32), np.zeros(0, np.int64)
    return np.concatenate(sources), np.concatenate(indices)


# --------------------------------------------------------------------------- best fit


_SHIFT = 21  # keys are room * 2^21 + pack number (a block has < 2^21 packs)
_MASK = (1 << _SHIFT) - 1


def best_fit_decreasing(
    lengths: np.ndarray,
    visual: np.ndarray | None,
    block_starts: np.ndarray,
    *,
    seq_len: int,
    max_visual_tokens: int | None,
) -> np.ndarray:
    """Pack id (int64) of each item. Blocks are [block_starts[b], block_starts[b+1]); packs
    never span blocks; inside a block the items are expected sorted by length descending.

    Tokens only: the free rooms of a block's open packs live in one sorted Python list of
    keys room * 2^21 + pack, so "the smallest room >= length" is one bisect; a pack taken out
    goes back with its new room by an insort (a memmove of a few thousand ints). One Python
    iteration per sample, no scan over packs.

    With a visual budget, a pack that fits a sample's tokens may lack visual room, and a
    bisect on one budget cannot skip those (they pile up and a bounded scan opens needless
    packs). So each block is packed in two phases: image samples first, in descending order
    of their larger share of either budget, each to the open pack that leaves the least
    normalised room (token room / seq_len + visual room / budget) over all packs where both
    fit — a numpy scan over the block's open packs (hundreds); then the text-only samples,
    which need no visual room, by the token bisect above, filling the gaps the images left.
    """
    out = [0] * len(lengths)
    lengths_list = lengths.tolist()
    bounds = block_starts.tolist()
    two_budgets = max_visual_tokens is not None and visual is not None
    base = 0
    for b in range(len(bounds) - 1):
        lo, hi = bounds[b], bounds[b + 1]
        keys: list[int] = []
        room: list[int] = []
        if two_budgets:
            vis = np.asarray(visual[lo:hi], dtype=np.int64)
            images = np.flatnonzero(vis > 0)
            room = _pack_images(np.asarray(lengths[lo:hi], dtype=np.int64), vis, images, seq_len, int(max_visual_tokens),
                                out, lo, base)
            keys = sorted((r << _SHIFT) | p for p, r in enumerate(room) if r > 0)
            items = (np.flatnonzero(vis == 0) + lo).tolist()
        else:
            items = range(lo, hi)
        for i in items:
            length = lengths_list[i]
            j = bisect_left(keys, length << _SHIFT)
            if j < len(keys):
                p = keys[j] & _MASK
                del keys[j]
                room[p] -= length
            else:
                p = len(room)
                room.append(seq_len - length)
            if room[p] > 0:
                insort(keys, (room[p] << _SHIFT) | p)
            out[i] = p + base
        base += len(room)
    return np.asarray(out, dtype=np.int64)


def _pack_images(lengths: np.ndarray, visual: np.ndarray, images: np.ndarray, seq_len: int, vis_cap: int,
                 out: list[int], lo: int, base: int) -> list[int]:
    """Phase 1 of `best_fit_decreasing` for one block; returns the packs' free token rooms.

    The normalised room left after placing item x in pack p is norm[p] - (x's own share), so
    the best pack is the argmin of norm over the feasible packs: five numpy calls per item."""
    share = np.maximum(lengths[images] / seq_len, visual[images] / vis_cap)
    order = images[np.argsort(-share, kind="stable")].tolist()
    room = np.empty(len(order), dtype=np.int64)
    vroom = np.empty(len(order), dtype=np.int64)
    norm = np.empty(len(order), dtype=np.float64)
    inv_t, inv_v = 1.0 / seq_len, 1.0 / vis_cap
    inf = np.inf
    n = 0
    lengths_list, visual_list = lengths.tolist(), visual.tolist()
    for i in order:
        length, v = lengths_list[i], visual_list[i]
        p = -1
        if n:
            fits = room[:n] >= length
            fits &= vroom[:n] >= v
            p = int(np.where(fits, norm[:n], inf).argmin())
            if not fits[p]:
                p = -1
        if p < 0:
            p = n
            n += 1
            room[p], vroom[p] = seq_len, vis_cap
        room[p] -= length
        vroom[p] -= v
        norm[p] = room[p] * inv_t + vroom[p] * inv_v
        out[lo + i] = p + base
    return room[:n].tolist()


# --------------------------------------------------------------------------- DP ranks


def assign_ranks(pack_visual: np.ndarray, pack_tokens: np.ndarray, global_batch_packs: int, dp_size: int) -> np.ndarray:
    """Rank (int32 [P]) of each pack: within each global batch of G consecutive packs, G/dp
    packs per rank, greedy by descending (visual tokens, tokens) onto the least-loaded rank
    (by visual tokens, then tokens; ties to the lowest rank). Vectorised over global batches:
    one numpy step per position within a batch."""
    G, P = int(global_batch_packs), len(pack_visual)
    if dp_size < 1 or G % dp_size:
        raise PackingError(f"global_batch_packs {G} is not a multiple of dp_size {dp_size}")
    if P % G:
        raise PackingError(f"{P} packs do not form whole global batches of {G}")
    if dp_size == 1 or P == 0:
        return np.zeros(P, dtype=np.int32)
    B, per = P // G, G // dp_size
    vis = np.asarray(pack_visual, dtype=np.int64).reshape(B, G)
    tok = np.asarray(pack_tokens, dtype=np.int64).reshape(B, G)
    order = np.lexsort((-tok, -vis), axis=-1)  # per batch: descending visual, then tokens
    scale = int(tok.sum(axis=1).max()) + 1
    load = np.zeros((B, dp_size), dtype=np.int64)  # visual * scale + tokens
    count = np.zeros((B, dp_size), dtype=np.int64)
    ranks = np.empty((B, G), dtype=np.int32)
    rows = np.arange(B)
    full = np.iinfo(np.int64).max
    for j in range(G):
        col = order[:, j]
        r = np.argmin(np.where(count >= per, full, load), axis=1)
        ranks[rows, col] = r
        load[rows, r] += vis[rows, col] * scale + tok[rows, col]
        count[rows, r] += 1
    return ranks.reshape(P)


# --------------------------------------------------------------------------- the plan


class PackPlan:
    """Packs in training order. Arrays (numpy; memory-mapped when loaded from disk):

    pack_offsets int64 [P+1]: pack p holds plan samples pack_offsets[p]:pack_offsets[p+1];
    sample_source int16 [S] / sample_index int64 [S]: source number and row in its ShardSet;
    pack_tokens int32 [P] real tokens, pack_padded_tokens int32 [P] (each sample rounded up
    to pad_to_multiple), pack_visual_tokens int32 [P]. `meta` holds settings, sources, stats.
    """

    def __init__(self, arrays: dict, meta: dict, path: Path | None = None):
        for name in ARRAY_NAMES:
            if name not in arrays:
                raise ShardFormatError(f"pack plan {path or ''}: array {name!r} missing")
        self.arrays = arrays
        self.meta = meta
        self.path = path
        self._ranks: dict[int, np.ndarray] = {}

    def __getattr__(self, name):
        arrays = self.__dict__.get("arrays")
        if arrays is not None and name in arrays:
            return arrays[name]
        raise AttributeError(name)

    # pickles by path when saved (DataLoader workers re-map instead of copying the arrays)
    def __getstate__(self):
        if self.path is not None:
            return {"path": str(self.path)}
        return {"arrays": {k: np.asarray(v) for k, v in self.arrays.items()}, "meta": self.meta}

    def __setstate__(self, state):
        if "path" in state:
            other = PackPlan.load(state["path"])
            self.__init__(other.arrays, other.meta, other.path)
        else:
            self.__init__(state["arrays"], state["meta"])

    @property
    def num_packs(self) -> int:
        return len(self.arrays["pack_offsets"]) - 1

    @property
    def num_samples(self) -> int:
        return int(self.arrays["pack_offsets"][-1])

    @property
    def settings(self) -> dict:
        return self.meta["settings"]

    @property
    def seq_len(self) -> int:
        return int(self.settings["seq_len"])

    @property
    def global_batch_packs(self) -> int:
        return int(self.settings["global_batch_packs"])

    @property
    def num_global_batches(self) -> int:
        return self.num_packs // self.global_batch_packs

    @property
    def stats(self) -> dict:
        return self.meta["stats"]

    @property
    def key(self) -> str:
        return self.meta["key"]

    @property
    def data_fingerprint(self) -> str:
        """Identity of the data and packing settings, without seed and epoch (resume checks)."""
        return self.meta["data_fingerprint"]

    @property
    def source_dirs(self) -> list[str]:
        return [s["dir"] for s in self.meta["sources"]]

    def pack_samples(self, p: int) -> tuple[np.ndarray, np.ndarray]:
        """(source numbers, row indices) of the samples of pack p."""
        lo, hi = int(self.arrays["pack_offsets"][p]), int(self.arrays["pack_offsets"][p + 1])
        return self.arrays["sample_source"][lo:hi], self.arrays["sample_index"][lo:hi]

    def pack_ranks(self, dp_size: int) -> np.ndarray:
        """Rank of every pack for `dp_size` (int32 [P]; computed once per dp_size)."""
        ranks = self._ranks.get(dp_size)
        if ranks is None:
            ranks = assign_ranks(self.arrays["pack_visual_tokens"], self.arrays["pack_tokens"], self.global_batch_packs, dp_size)
            self._ranks[dp_size] = ranks
        return ranks

    def rank_packs(self, rank: int, dp_size: int) -> np.ndarray:
        """Pack indices rank `rank` consumes, in order: its G/dp_size packs of global batch 0
        (ascending), then of global batch 1, ... (int64 [P / dp_size])."""
        if not 0 <= rank < dp_size:
            raise ValueError(f"rank {rank} out of range for dp_size {dp_size}")
        return np.flatnonzero(self.pack_ranks(dp_size) == rank)

    def balance(self, dp_size: int) -> dict:
        """Per global batch, the busiest rank's visual tokens / the mean rank's (1.0 = perfect)."""
        G = self.global_batch_packs
        if self.num_packs == 0:
            return {"dp_size": dp_size, "visual_max_over_mean": 1.0, "visual_max_over_mean_worst": 1.0,
                    "tokens_max_over_mean": 1.0}
        ranks = self.pack_ranks(dp_size).reshape(-1, G)
        out = {"dp_size": dp_size}
        for label, name in (("visual", "pack_visual_tokens"), ("tokens", "pack_tokens")):
            values = np.asarray(self.arrays[name], dtype=np.int64).reshape(-1, G)
            loads = np.zeros((len(values), dp_size), dtype=np.int64)
            np.add.at(loads, (np.arange(len(values))[:, None], ranks), values)
            mean = loads.mean(axis=1)
            ratio = np.where(mean > 0, loads.max(axis=1) / np.maximum(mean, 1e-9), 1.0)
            out[f"{label}_max_over_mean"] = float(ratio.mean())
            out[f"{label}_max_over_mean_worst"] = float(ratio.max())
        return out

    # ---------------------------------------------------------------- persistence

    def save(self, path: str | Path) -> Path:
        """Write the plan as a directory (one .npy per array + plan.json), atomically: written
        into a temporary sibling, then renamed; an existing plan at `path` is replaced."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        try:
            self._write(tmp)
            if path.exists():
                if not (path / PLAN_META).is_file():
                    raise FileExistsError(f"{path} exists and is not a pack plan; refusing to replace it")
                old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
                os.rename(path, old / "plan")
                os.rename(tmp, path)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, path)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        self.path = path
        return path

    def _write(self, directory: Path) -> None:
        for name in ARRAY_NAMES:
            with open(directory / f"{name}.npy", "wb") as f:
                np.save(f, np.asarray(self.arrays[name]))
                f.flush()
                os.fsync(f.fileno())
        (directory / PLAN_META).write_text(json.dumps(self.meta, indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path, *, mmap: bool = True) -> "PackPlan":
        path = Path(path)
        meta_path = path / PLAN_META
        if not meta_path.is_file():
            raise ShardFormatError(f"{path}: not a pack plan (no {PLAN_META}); build one with `vlmpack pack`")
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta.get("planner_version") != PLANNER_VERSION:
            raise ShardFormatError(
                f"{path}: pack plan version {meta.get('planner_version')}, this vlmpack reads {PLANNER_VERSION}; rebuild it"
            )
        arrays = {name: np.load(path / f"{name}.npy", mmap_mode="r" if mmap else None) for name in ARRAY_NAMES}
        return cls(arrays, meta, path)


# --------------------------------------------------------------------------- building


def _sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _settings(seq_len, seed, epoch, max_visual_tokens, global_batch_packs, pad_to_multiple, block_size) -> dict:
    return {
        "seq_len": int(seq_len),
        "seed": int(seed),
        "epoch": int(epoch),
        "max_visual_tokens": None if max_visual_tokens is None else int(max_visual_tokens),
        "global_batch_packs": int(global_batch_packs),
        "pad_to_multiple": int(pad_to_multiple),
        "block_size": int(block_size),
    }


def plan_keys(fingerprints: list[dict], weights: list[float | None], settings: dict) -> tuple[str, str]:
    """(data_fingerprint, key): the first excludes seed and epoch (what a resume must match)."""
    data = {
        "planner_version": PLANNER_VERSION,
        "sources": [{"fingerprint": f, "weight": w} for f, w in zip(fingerprints, weights)],
        "settings": {k: v for k, v in settings.items() if k not in ("seed", "epoch")},
    }
    data_fingerprint = _sha256_json(data)
    key = _sha256_json({"data": data_fingerprint, "seed": settings["seed"], "epoch": settings["epoch"]})
    return data_fingerprint, key


def _check_sizes(source: SourceStats, padded: np.ndarray, seq_len: int, pad_to_multiple: int,
                 max_visual_tokens: int | None) -> None:
    def who(i: int) -> str:
        extra = ""
        if source.describe is not None:
            try:
                extra = f" ({source.describe(i)})"
            except Exception:  # the description is a courtesy; never hide the real error
                extra = ""
        return f"sample {i}{extra}"

    too_long = np.flatnonzero(padded > seq_len)
    if len(too_long):
        i = int(too_long[0])
        pad_note = f" (rounded up to a multiple of {pad_to_multiple})" if pad_to_multiple > 1 else ""
        longest = int(padded.max())
        raise PackingError(
            f"{source.name}: {len(too_long)} sample(s) longer than seq_len {seq_len}; first: {who(i)} "
            f"has {int(source.num_tokens[i])} tokens{pad_note}; the longest has {longest}. "
            f"Use seq_len >= {longest}, or re-run `vlmpack preprocess` with --max-seq-len <= {seq_len}"
        )
    if max_visual_tokens is not None:
        too_many = np.flatnonzero(source.visual_tokens > max_visual_tokens)
        if len(too_many):
            i = int(too_many[0])
            raise PackingError(
                f"{source.name}: {len(too_many)} sample(s) have more than max_visual_tokens {max_visual_tokens} "
                f"visual tokens; first: {who(i)} has {int(source.visual_tokens[i])}; the largest has "
                f"{int(source.visual_tokens.max())}. Raise max_visual_tokens, or lower the image budget "
                "(max_pixels) when preprocessing"
            )


def plan_from_stats(
    sources: list[SourceStats],
    weights: Sequence[float | None] | None = None,
    *,
    seq_len: int,
    seed: int = 0,
    epoch: int = 0,
    max_visual_tokens: int | None = None,
    global_batch_packs: int = 1,
    pad_to_multiple: int = 1,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> PackPlan:
    """The planner proper, on per-sample sizes (synthetic stats in tests, shards otherwise)."""
    t0 = time.perf_counter()
    weights = list(weights) if weights is not None else [None] * len(sources)
    if len(weights) != len(sources):
        raise PackingError(f"{len(weights)} weights for {len(sources)} sources")
    if not sources:
        raise PackingError("no sources to pack")
    if seq_len < 1 or pad_to_multiple < 1 or block_size < 1 or global_batch_packs < 1:
        raise PackingError("seq_len, pad_to_multiple, block_size and global_batch_packs must be >= 1")
    settings = _settings(seq_len, seed, epoch, max_visual_tokens, global_batch_packs, pad_to_multiple, block_size)
    m = int(pad_to_multiple)

    sizes = [len(s) for s in sources]
    padded_per_source = []
    for source in sources:
        padded = -(-np.asarray(source.num_tokens, dtype=np.int64) // m) * m
        _check_sizes(source, padded, seq_len, m, max_visual_tokens)
        padded_per_source.append(padded)
    resolved = resolve_weights(sizes, weights)
    counts = mix_counts(sizes, resolved)

    rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(epoch)]))
    src, idx = draw_samples(sizes, counts, rng)
    base = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    flat = base[src] + idx
    real = np.concatenate([np.asarray(s.num_tokens, np.int64) for s in sources])[flat]
    padded = np.concatenate(padded_per_source)[flat]
    visual = np.concatenate([np.asarray(s.visual_tokens, np.int64) for s in sources])[flat]

    # shuffle, then sort by length (descending) inside blocks of block_size
    perm = rng.permutation(len(src))
    block = np.arange(len(src)) // block_size
    order = perm[np.lexsort((-padded[perm], block))]
    block_starts = np.arange(0, len(src) + block_size, block_size).clip(max=len(src))
    block_starts = np.unique(np.append(block_starts, len(src)))
    pack_of = best_fit_decreasing(padded[order], visual[order], block_starts, seq_len=seq_len,
                                  max_visual_tokens=max_visual_tokens)
    num_packs = int(pack_of.max()) + 1 if len(pack_of) else 0

    # group the samples by pack (stable: within a pack, descending length)
    by_pack = order[np.argsort(pack_of, kind="stable")]
    pack_counts = np.bincount(pack_of, minlength=num_packs)
    pack_real = np.bincount(pack_of, weights=real[order], minlength=num_packs).astype(np.int64)
    pack_padded = np.bincount(pack_of, weights=padded[order], minlength=num_packs).astype(np.int64)
    pack_visual = np.bincount(pack_of, weights=visual[order], minlength=num_packs).astype(np.int64)

    # training order: shuffled; then drop the P mod G emptiest packs so global batches are whole
    pack_order = rng.permutation(num_packs)
    drop = num_packs % global_batch_packs
    keep = np.ones(num_packs, dtype=bool)
    if drop:
        keep[np.argsort(pack_padded, kind="stable")[:drop]] = False
    pack_order = pack_order[keep[pack_order]]

    starts = np.concatenate([[0], np.cumsum(pack_counts)])[:-1]
    new_counts = pack_counts[pack_order]
    offsets = np.concatenate([[0], np.cumsum(new_counts)]).astype(np.int64)
    gather = np.repeat(starts[pack_order] - offsets[:-1], new_counts) + np.arange(int(offsets[-1]), dtype=np.int64)
    chosen = by_pack[gather]
    arrays = {
        "pack_offsets": offsets,
        "sample_source": src[chosen].astype(np.int16 if len(sources) < 2**15 else np.int32),
        "sample_index": idx[chosen].astype(np.int64),
        "pack_tokens": pack_real[pack_order].astype(np.int32),
        "pack_padded_tokens": pack_padded[pack_order].astype(np.int32),
        "pack_visual_tokens": pack_visual[pack_order].astype(np.int32),
    }

    kept_packs = len(pack_order)
    kept_real = int(arrays["pack_tokens"].sum(dtype=np.int64))
    kept_padded = int(arrays["pack_padded_tokens"].sum(dtype=np.int64))
    per_pack = np.diff(offsets)
    data_fingerprint, key = plan_keys([s.fingerprint for s in sources], weights, settings)
    drawn_per_source = np.bincount(arrays["sample_source"].astype(np.int64), minlength=len(sources))
    stats = {
        "samples": int(offsets[-1]),
        "packs": kept_packs,
        "global_batches": kept_packs // global_batch_packs,
        "tokens": kept_real,
        "fill_efficiency": kept_real / (kept_packs * seq_len) if kept_packs else 0.0,
        "padding_tokens": kept_padded - kept_real,  # from pad_to_multiple; the rest of seq_len is trailing padding
        "trailing_padding_tokens": kept_packs * seq_len - kept_padded,
        "dropped_packs": int(drop),
        "dropped_samples": int(pack_counts[~keep].sum()),
        "samples_per_pack_mean": float(per_pack.mean()) if kept_packs else 0.0,
        "samples_per_pack_max": int(per_pack.max()) if kept_packs else 0,
        "visual_tokens": int(arrays["pack_visual_tokens"].sum(dtype=np.int64)),
        "visual_tokens_per_pack_mean": float(arrays["pack_visual_tokens"].mean()) if kept_packs else 0.0,
        "visual_tokens_per_pack_max": int(arrays["pack_visual_tokens"].max()) if kept_packs else 0,
        "plan_seconds": 0.0,
    }
    meta = {
        "planner_version": PLANNER_VERSION,
        "key": key,
        "data_fingerprint": data_fingerprint,
        "settings": settings,
        "sources": [
            {"dir": s.name, "weight": w, "resolved_weight": float(rw), "fingerprint": s.fingerprint,
             "samples": len(s), "drawn": int(c), "in_plan": int(d)}
            for s, w, rw, c, d in zip(sources, weights, resolved, counts, drawn_per_source)
        ],
        "stats": stats,
    }
    stats["plan_seconds"] = round(time.perf_counter() - t0, 4)
    return PackPlan(arrays, meta)


def _normalize_sources(sources) -> list[tuple[str, float | None]]:
    if isinstance(sources, (str, Path)):
        sources = [sources]
    return [parse_source(s) for s in sources]


def _effective_global_batch(global_batch_packs: int | None, dp_size: int) -> int:
    if dp_size < 1:
        raise PackingError(f"dp_size must be >= 1, got {dp_size}")
    G = int(global_batch_packs) if global_batch_packs is not None else int(dp_size)
    if G < 1 or G % dp_size:
        raise PackingError(
            f"global_batch_packs {G} must be a positive multiple of dp_size {dp_size} (every rank gets the same number of packs)"
        )
    return G


@dataclass
class PlanRequest:
    """Sources and settings of a plan, resolved from manifests alone (no shard is opened)."""

    specs: list[tuple[str, float | None]]
    manifests: list[dict]
    settings: dict
    data_fingerprint: str
    key: str


def plan_request(
    sources,
    *,
    seq_len: int,
    seed: int = 0,
    epoch: int = 0,
    max_visual_tokens: int | None = None,
    dp_size: int = 1,
    global_batch_packs: int | None = None,
    pad_to_multiple: int = 1,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> PlanRequest:
    """Check the sources and settings and compute the plan's key (cheap: manifests only)."""
    specs = _normalize_sources(sources)
    if not specs:
        raise PackingError("no sources to pack")
    G = _effective_global_batch(global_batch_packs, dp_size)
    manifests = []
    for directory, _ in specs:
        if not Path(directory).is_dir():
            raise ShardFormatError(f"{directory}: no such directory")
        manifests.append(source_manifest(directory))
    profiles = {m["profile"]["id"] for m in manifests}
    if len(profiles) > 1:
        listing = ", ".join(f"{d} -> {m['profile']['id']} ({m['profile'].get('family')})" for (d, _), m in zip(specs, manifests))
        raise PackingError(f"sources were preprocessed with different profiles and cannot share packs: {listing}")
    settings = _settings(seq_len, seed, epoch, max_visual_tokens, G, pad_to_multiple, block_size)
    data_fingerprint, key = plan_keys([source_fingerprint(m) for m in manifests], [w for _, w in specs], settings)
    return PlanRequest(specs, manifests, settings, data_fingerprint, key)


def build_pack_plan(
    sources,
    *,
    seq_len: int,
    seed: int = 0,
    epoch: int = 0,
    max_visual_tokens: int | None = None,
    dp_size: int = 1,
    global_batch_packs: int | None = None,
    pad_to_multiple: int = 1,
    cache_dir: str | Path | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> PackPlan:
    """Plan one epoch of packs over shard directories.

    `sources`: shard directories, each a path, 'DIR:weight', or (DIR, weight); see the
    module docstring for the mixing, packing, ordering and caching rules. `dp_size` only
    checks that it divides `global_batch_packs` (default: dp_size) — the plan is the same
    for every dp_size. With `cache_dir`, a plan with the same key is loaded (memory-mapped)
    instead of rebuilt, and a new one is saved there atomically. Raises PackingError for
    samples that cannot be packed, ShardFormatError for missing or unreadable directories.
    """
    request = plan_request(sources, seq_len=seq_len, seed=seed, epoch=epoch, max_visual_tokens=max_visual_tokens,
                           dp_size=dp_size, global_batch_packs=global_batch_packs, pad_to_multiple=pad_to_multiple,
                           block_size=block_size)
    cached = Path(cache_dir) / f"plan-{request.key[:32]}" if cache_dir is not None else None
    if cached is not None and (cached / PLAN_META).is_file():
        plan = PackPlan.load(cached)
        if plan.key == request.key:
            return plan

    t0 = time.perf_counter()
    stats = [load_source_stats(d) for d, _ in request.specs]
    read_seconds = time.perf_counter() - t0
    s = request.settings
    plan = plan_from_stats(stats, [w for _, w in request.specs], seq_len=s["seq_len"], seed=s["seed"], epoch=s["epoch"],
                           max_visual_tokens=s["max_visual_tokens"], global_batch_packs=s["global_batch_packs"],
                           pad_to_multiple=s["pad_to_multiple"], block_size=s["block_size"])
    plan.stats["read_stats_seconds"] = round(read_seconds, 4)
    if cached is not None:
        _save_to_cache(plan, cached)
    return plan


def _save_to_cache(plan: PackPlan, target: Path) -> None:
    """Write into a private temporary directory and rename it into place; if another rank won
    the race, keep theirs (same key => same arrays) and map it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        plan._write(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / PLAN_META).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    loaded = PackPlan.load(target)
    plan.arrays, plan.path = loaded.arrays, target
