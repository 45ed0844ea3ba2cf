"""The plan itself (`PackPlan`), its key and cache, and `build_pack_plan`."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from shards_schema import ShardFormatError
from shards_schema.errors import UserError
from shards_schema.manifest import SHARD_DIRECTORY, require_directory

from .bin_packing import assign_ranks, best_fit_decreasing, check_sizes
from .errors import PackingError
from .mixing import draw_samples, mix_counts, resolve_weights
from .settings import PackSettings
from .sources import SourceStats, load_source_stats, normalize_sources, source_fingerprint, source_manifest

PLANNER_VERSION = 1
PLAN_META = "plan.json"
ARRAY_NAMES = ("pack_offsets", "sample_source", "sample_index", "pack_tokens", "pack_padded_tokens", "pack_visual_tokens")


def check_plan_out(path: str | Path) -> None:
    """UserError unless a plan can be saved at `path`: new, an empty directory, or a saved plan
    (which is replaced). Cheap: the pack command runs it before planning."""
    path = Path(path)
    if path.is_dir():
        if any(path.iterdir()) and not (path / PLAN_META).is_file():
            raise UserError(f"--out {path} holds files and is not a pack plan: choose a new or empty directory")
        return
    if path.exists():
        raise UserError(f"--out {path} is a file, not a directory: pass a directory path")
    if path.is_symlink():  # the plan is renamed into place, which would not follow a link to nothing
        raise UserError(f"--out {path} is a link to {os.readlink(path)}, which does not exist: pass a directory "
                        "path, or make the directory the link points to")
    parent = next(p for p in path.absolute().parents if p.exists())
    if not parent.is_dir():
        raise UserError(f"--out {path}: {parent} is a file, not a directory: pass a directory path")


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
        # seconds spent reading sizes and planning: reported, never saved (they vary run to run,
        # and a plan's files are the same for the same sources and settings)
        self.timings: dict[str, float] = {}

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
        into a temporary sibling, then renamed; an existing plan or empty directory at `path`
        is replaced (`check_plan_out`)."""
        path = Path(path)
        check_plan_out(path)
        if path.is_symlink():  # a link to a directory: the plan replaces that directory, the link stays
            path = path.resolve()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        except OSError as exc:  # named by the plan's path, not by the temporary sibling it is written as first
            raise PackingError(f"{path}: cannot write the plan there ({exc.strerror or exc}): choose a directory "
                               "this user can write") from None
        try:
            self._write(tmp)
            if (path / PLAN_META).is_file():
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
        """The plan's files into `directory`, a temporary one made private by mkdtemp: given
        the mode a plain mkdir gives, so the plan reads for whoever may read its parent."""
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(directory, 0o777 & ~umask)
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


def _sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


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


def check_whole_global_batch(num_packs: int, seq_len: int, global_batch_packs: int, dp_size: int | None,
                             source_names: list[str]) -> None:
    """PackingError when the packs do not fill one global batch: every pack would be dropped
    and an epoch would have no training step (a training loop would re-plan forever)."""
    if num_packs >= global_batch_packs:
        return
    dp = f", data-parallel size {dp_size}" if dp_size is not None else ""
    raise PackingError(
        f"{', '.join(source_names)}: the data make {num_packs} pack(s) of {seq_len} tokens, fewer than one global "
        f"batch of {global_batch_packs} packs (--global-batch-packs {global_batch_packs}{dp}), so an epoch would "
        "have no step: lower --global-batch-packs or --seq-len, or add data"
    )


def plan_from_stats(sources: list[SourceStats], packing: PackSettings,
                    weights: Sequence[float | None] | None = None) -> PackPlan:
    """The planner proper, on per-sample sizes (synthetic stats in tests, shards otherwise), each
    source optionally weighted. `packing.dp_size` only appears in the error for data that fill no
    global batch."""
    t0 = time.perf_counter()
    weights = list(weights) if weights is not None else [None] * len(sources)
    if len(weights) != len(sources):
        raise PackingError(f"{len(weights)} weights for {len(sources)} sources")
    if not sources:
        raise PackingError("no sources to pack")
    settings = packing.recorded()
    seq_len, max_visual_tokens, block_size = settings["seq_len"], settings["max_visual_tokens"], settings["block_size"]
    global_batch_packs, m = settings["global_batch_packs"], settings["pad_to_multiple"]

    sizes = [len(s) for s in sources]
    padded_per_source = []
    for source in sources:
        padded = -(-np.asarray(source.num_tokens, dtype=np.int64) // m) * m
        check_sizes(source, padded, seq_len, m, max_visual_tokens)
        padded_per_source.append(padded)
    resolved = resolve_weights(sizes, weights)
    counts = mix_counts(sizes, resolved)
    for source, size, count in zip(sources, sizes, counts):
        if size == 0 and count:
            raise PackingError(f"{source.name} holds no samples, but its mixing weight draws {int(count)} from it per "
                               "epoch: drop the source, or give it weight 0")

    rng = np.random.default_rng(np.random.SeedSequence([settings["seed"], settings["epoch"]]))
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
    check_whole_global_batch(num_packs, seq_len, global_batch_packs, packing.dp_size, [s.name for s in sources])

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
        "fill_efficiency": kept_real / (kept_packs * seq_len),
        "padding_tokens": kept_padded - kept_real,  # from pad_to_multiple; the rest of seq_len is trailing padding
        "trailing_padding_tokens": kept_packs * seq_len - kept_padded,
        "dropped_packs": int(drop),
        "dropped_samples": int(pack_counts[~keep].sum()),
        "samples_per_pack_mean": float(per_pack.mean()),
        "samples_per_pack_max": int(per_pack.max()),
        "visual_tokens": int(arrays["pack_visual_tokens"].sum(dtype=np.int64)),
        "visual_tokens_per_pack_mean": float(arrays["pack_visual_tokens"].mean()),
        "visual_tokens_per_pack_max": int(arrays["pack_visual_tokens"].max()),
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
    plan = PackPlan(arrays, meta)
    plan.timings["plan_seconds"] = round(time.perf_counter() - t0, 4)
    return plan


@dataclass
class PlanRequest:
    """Sources and settings of a plan, resolved from manifests alone (no shard is opened)."""

    specs: list[tuple[str, float | None]]
    manifests: list[dict]
    settings: dict
    data_fingerprint: str
    key: str


def distinct_source_manifests(specs: list[tuple[str, float | None]]) -> tuple[list[dict], list[dict]]:
    """The manifest and fingerprint of each source directory; PackingError where one is named
    twice (another spelling, a link) or holds the same shards as another (a copy, or a
    WebDataset export of it): its samples would be drawn twice per epoch."""
    manifests, named = [], {}
    for directory, _ in specs:
        require_directory(Path(directory), SHARD_DIRECTORY)
        st = os.stat(directory)
        first = named.setdefault((st.st_dev, st.st_ino), len(manifests))
        if first != len(manifests):
            first = specs[first][0]
            same = "named twice" if directory == first else f"the same directory as {first}"
            raise PackingError(f"source {directory} is {same}: its samples would be drawn twice per epoch; name each "
                               "source once (a weight, DIR:WEIGHT, draws one source more often than another)")
        manifests.append(source_manifest(directory))
    fingerprints = [source_fingerprint(m) for m in manifests]
    for k, fingerprint in enumerate(fingerprints):
        first = fingerprints.index(fingerprint)
        if first != k and fingerprint["shards_sha256"]:
            raise PackingError(f"source {specs[k][0]} holds the same shards as {specs[first][0]} (a copy, or a "
                               "WebDataset export of it): its samples would be drawn twice per epoch; name it once (a "
                               "weight, DIR:WEIGHT, draws one source more often than another)")
    return manifests, fingerprints


def plan_request(sources, packing: PackSettings) -> PlanRequest:
    """Check the sources and compute the plan's key (cheap: manifests only; `packing` checked itself)."""
    specs = normalize_sources(sources)
    if not specs:
        raise PackingError("no sources to pack")
    manifests, fingerprints = distinct_source_manifests(specs)
    profiles = {m["profile"]["id"] for m in manifests}
    if len(profiles) > 1:
        listing = ", ".join(f"{d} -> {m['profile']['id']} ({m['profile'].get('family')})" for (d, _), m in zip(specs, manifests))
        raise PackingError(f"sources were preprocessed with different profiles and cannot share packs: {listing}; "
                           "preprocess them again with one --profile (or --model), the one of the model you "
                           "train, or pack and train them apart")
    settings = packing.recorded()
    data_fingerprint, key = plan_keys(fingerprints, [w for _, w in specs], settings)
    return PlanRequest(specs, manifests, settings, data_fingerprint, key)


def build_pack_plan(sources, packing: PackSettings, *, cache_dir: str | Path | None = None) -> PackPlan:
    """Plan epoch `packing.epoch` of packs over shard directories.

    `sources`: shard directories, each a path, 'DIR:weight', or (DIR, weight); see the
    module docstring for the mixing, packing, ordering and caching rules. `packing.dp_size` only
    checks that it divides `global_batch_packs` (default: dp_size) — the plan is the same
    for every dp_size. With `cache_dir`, a plan with the same key is loaded (memory-mapped)
    instead of rebuilt, and a new one is saved there atomically. Raises PackingError for
    samples that cannot be packed or data that fill no global batch, ShardFormatError for
    missing or unreadable directories. A plan with no global batch is never cached.
    """
    request = plan_request(sources, packing)
    cached = Path(cache_dir) / f"plan-{request.key[:32]}" if cache_dir is not None else None
    if cached is not None and (cached / PLAN_META).is_file():
        plan = PackPlan.load(cached)
        if plan.key == request.key:
            check_whole_global_batch(plan.num_packs, plan.seq_len, plan.global_batch_packs, packing.dp_size,
                                     plan.source_dirs)
            return plan

    t0 = time.perf_counter()
    stats = [load_source_stats(d) for d, _ in request.specs]
    read_seconds = time.perf_counter() - t0
    plan = plan_from_stats(stats, packing, [w for _, w in request.specs])
    plan.timings["read_stats_seconds"] = round(read_seconds, 4)
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
