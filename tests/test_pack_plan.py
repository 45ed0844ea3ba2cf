"""The pack planner: every sample once, budgets respected, deterministic, mixing counts, DP
balance and dp-independence, fill efficiency, errors that name the sample, the cache, and
`vlmpack pack`. Planner logic runs on synthetic size arrays; I/O on small real shards."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from preprocess.examples import example_rows, write_jsonl
from preprocess.job import PreprocessConfig, run_preprocess
from shards_schema import ShardFormatError, open_shards
from tests.helpers.cli import vlmpack_exit_code
from train.pack_plan.plan import _save_to_cache
from train.pack_plan import (
    PackingError,
    PackPlan,
    PackSettings,
    SourceStats,
    build_pack_plan,
    mix_counts,
    parse_source,
    plan_from_stats,
    plan_request,
    resolve_weights,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def synthetic_source(n: int, seed: int = 0, name: str = "synthetic") -> SourceStats:
    """A realistic SFT mix: text lognormal in 100..3000 tokens plus 0-3 images of 64..1300
    visual tokens each (+2 tokens per image for vision_start/vision_end)."""
    rng = np.random.default_rng(seed)
    text = np.clip(np.exp(rng.normal(np.log(500), 0.8, n)), 100, 3000).astype(np.int64)
    images = rng.integers(0, 4, n)
    visual = np.zeros(n, np.int64)
    for k in range(3):
        visual += np.where(images > k, rng.integers(64, 1301, n), 0)
    return SourceStats(name, text + visual + 2 * images, visual, {"synthetic": name, "n": n, "seed": seed},
                       describe=lambda i: f"uid {name}-{i}")


def plan_samples(plan: PackPlan) -> list[tuple[int, int]]:
    return list(zip(np.asarray(plan.sample_source).tolist(), np.asarray(plan.sample_index).tolist()))


def pack_sums(plan: PackPlan, per_sample: list[np.ndarray]) -> np.ndarray:
    """Per-pack sum of a per-sample quantity, recomputed from the plan's indices."""
    values = np.array([per_sample[s][i] for s, i in plan_samples(plan)], dtype=np.int64)
    return np.add.reduceat(values, np.asarray(plan.pack_offsets[:-1])) if len(values) else values


# --------------------------------------------------------------------------- synthetic stats


def test_every_sample_once_within_budgets():
    a, b = synthetic_source(5000, 1, "a"), synthetic_source(3000, 2, "b")
    plan = plan_from_stats([a, b], PackSettings(seq_len=8192, pad_to_multiple=8, max_visual_tokens=4096,
                                                block_size=1024))
    assert sorted(plan_samples(plan)) == [(0, i) for i in range(5000)] + [(1, i) for i in range(3000)]
    padded = [-(-s.num_tokens // 8) * 8 for s in (a, b)]
    assert (pack_sums(plan, padded) == plan.pack_padded_tokens).all()
    assert (pack_sums(plan, [a.num_tokens, b.num_tokens]) == plan.pack_tokens).all()
    assert (pack_sums(plan, [a.visual_tokens, b.visual_tokens]) == plan.pack_visual_tokens).all()
    assert plan.pack_padded_tokens.max() <= 8192 and plan.pack_visual_tokens.max() <= 4096
    assert plan.stats["padding_tokens"] == int((padded[0] - a.num_tokens).sum() + (padded[1] - b.num_tokens).sum())
    # text-only and image samples share packs
    visual_per_sample = np.array([(a, b)[s].visual_tokens[i] for s, i in plan_samples(plan)])
    mixed = [(visual_per_sample[lo:hi] == 0).any() and (visual_per_sample[lo:hi] > 0).any()
             for lo, hi in zip(plan.pack_offsets[:-1], plan.pack_offsets[1:])]
    assert np.mean(mixed) > 0.25
    assert plan.stats["fill_efficiency"] == pytest.approx(plan.pack_tokens.sum() / (plan.num_packs * 8192))


def test_deterministic_per_seed_and_epoch():
    src = synthetic_source(4000, 3)
    one = plan_from_stats([src], PackSettings(seq_len=8192, seed=5))
    two = plan_from_stats([src], PackSettings(seq_len=8192, seed=5))
    for name, array in one.arrays.items():
        assert np.array_equal(array, two.arrays[name]), name
    assert one.key == two.key
    other_seed = plan_from_stats([src], PackSettings(seq_len=8192, seed=6))
    other_epoch = plan_from_stats([src], PackSettings(seq_len=8192, seed=5, epoch=1))
    for other in (other_seed, other_epoch):
        assert not np.array_equal(one.sample_index, other.sample_index)
        assert other.key != one.key and other.data_fingerprint == one.data_fingerprint
        assert sorted(plan_samples(other)) == sorted(plan_samples(one))  # same samples, new packs and order


@pytest.mark.parametrize("seq_len", [8192, 16384, 32768])
def test_fill_efficiency_on_realistic_mix(seq_len):
    plan = plan_from_stats([synthetic_source(100_000, 11)], PackSettings(seq_len=seq_len, global_batch_packs=32))
    print(f"seq_len {seq_len}: fill {plan.stats['fill_efficiency']:.4f}, {plan.stats['samples_per_pack_mean']:.1f} "
          f"samples/pack, {plan.timings['plan_seconds']:.2f} s for 100k samples")
    assert plan.stats["fill_efficiency"] >= 0.95


def test_visual_budget_fill_is_near_the_lower_bound():
    """With a binding visual budget the packs needed are at least total visual / budget; the
    two-phase best fit stays within 2% of that bound."""
    src = synthetic_source(30_000, 12)
    for budget in (4096, 8192):
        plan = plan_from_stats([src], PackSettings(seq_len=16384, max_visual_tokens=budget))
        bound = max(src.num_tokens.sum() / 16384, src.visual_tokens.sum() / budget)
        assert plan.num_packs <= 1.02 * bound, (budget, plan.num_packs, bound)
        assert plan.pack_visual_tokens.max() <= budget and plan.pack_padded_tokens.max() <= 16384


def test_too_long_sample_names_source_index_uid_and_length():
    src = synthetic_source(100, 4, name="/data/chats")
    src.num_tokens[37] = 9000
    with pytest.raises(PackingError) as err:
        plan_from_stats([src], PackSettings(seq_len=8192))
    message = str(err.value)
    for part in ("/data/chats", "sample 37", "uid /data/chats-37", "9000 tokens", "--seq-len 8192", "--max-seq-len"):
        assert part in message, (part, message)
    # rounding to pad_to_multiple counts against seq_len
    src.num_tokens[37] = 8190
    plan_from_stats([src], PackSettings(seq_len=8191))
    with pytest.raises(PackingError, match="multiple of 64"):
        plan_from_stats([src], PackSettings(seq_len=8191, pad_to_multiple=64))  # 8190 -> 8192 > 8191
    with pytest.raises(PackingError, match="--max-visual-tokens 100"):
        plan_from_stats([src], PackSettings(seq_len=8191, max_visual_tokens=100))


def test_mixing_weights_give_the_right_counts():
    a, b = synthetic_source(1000, 5, "a"), synthetic_source(3000, 6, "b")
    plan = plan_from_stats([a, b], PackSettings(seq_len=8192), [0.75, 0.25])
    counts = Counter(plan_samples(plan))
    per_source = np.bincount(np.asarray(plan.sample_source), minlength=2)
    assert per_source.tolist() == [3000, 1000]  # round(w / sum(w) * 4000)
    # upsampled 3x: every sample of a exactly 3 times; downsampled: 1000 distinct samples of b
    assert all(counts[(0, i)] == 3 for i in range(1000))
    assert sum(1 for (s, _), c in counts.items() if s == 1 and c == 1) == 1000
    assert [m["drawn"] for m in plan.meta["sources"]] == [3000, 1000]
    # another epoch draws another subset of b
    again = plan_from_stats([a, b], PackSettings(seq_len=8192, epoch=1), [0.75, 0.25])
    subset = lambda p: {i for s, i in plan_samples(p) if s == 1}  # noqa: E731
    assert subset(again) != subset(plan)
    # the rule, directly: natural weights by default, a missing weight is 1, round half up
    assert resolve_weights([10, 30], [None, None]).tolist() == [10, 30]
    assert resolve_weights([10, 30], [3.0, None]).tolist() == [3.0, 1.0]
    assert mix_counts([10, 30], np.array([3.0, 1.0])).tolist() == [30, 10]
    assert mix_counts([1, 2], np.array([1.0, 1.0])).tolist() == [2, 2]  # 1.5 -> 2
    with pytest.raises(PackingError, match="weights"):
        resolve_weights([1, 2], [-1.0, 1.0])
    # finite weights whose sum overflows still mix by their ratio, without a numpy warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        huge = resolve_weights([10, 30], [1e308, 1e308])
        assert mix_counts([10, 30], huge).tolist() == [20, 20]
        assert mix_counts([10, 30], resolve_weights([10, 30], [1.5e308, 5e307])).tolist() == [30, 10]


def test_an_empty_source_with_a_weight_is_refused_naming_it():
    empty = SourceStats("empty-dir", np.zeros(0, np.int64), np.zeros(0, np.int64), {"synthetic": "empty"})
    with pytest.raises(PackingError, match=r"^empty-dir holds no samples, but its mixing weight draws 100 from it per "
                                           r"epoch: drop the source, or give it weight 0$"):
        plan_from_stats([empty, synthetic_source(200)], PackSettings(seq_len=8192), [1.0, 1.0])
    # without weights (or with weight 0) it adds nothing and is no fault
    assert plan_from_stats([empty, synthetic_source(200)], PackSettings(seq_len=8192)).num_samples == 200
    assert plan_from_stats([empty, synthetic_source(200)], PackSettings(seq_len=8192), [0.0, 1.0]).num_samples == 200


def test_global_batches_and_dp_balance():
    src = synthetic_source(20_000, 7)
    G = 16
    plan = plan_from_stats([src], PackSettings(seq_len=8192, global_batch_packs=G))
    assert plan.num_packs % G == 0 and plan.stats["dropped_packs"] < G
    assert plan.num_samples + plan.stats["dropped_samples"] == 20_000
    for dp in (1, 2, 4, 8, 16):
        parts = [plan.rank_packs(r, dp) for r in range(dp)]
        assert {len(p) for p in parts} == {plan.num_packs // dp}  # equal packs per rank
        # each global batch is split over the ranks: same batches whatever dp is
        for g in range(plan.num_global_batches):
            got = np.sort(np.concatenate([p[g * (G // dp):(g + 1) * (G // dp)] for p in parts]))
            assert (got == np.arange(g * G, (g + 1) * G)).all()
    balance = plan.balance(4)
    print("balance dp=4:", balance)
    assert balance["visual_max_over_mean"] < 1.05 and balance["visual_max_over_mean_worst"] < 1.2
    # versus a naive split (consecutive packs per rank), the greedy split is better
    naive = np.asarray(plan.pack_visual_tokens, np.int64).reshape(-1, 4, G // 4).sum(axis=2)
    naive_ratio = float((naive.max(axis=1) / naive.mean(axis=1)).mean())
    assert balance["visual_max_over_mean"] < naive_ratio
    with pytest.raises(PackingError, match="multiple of --dp-size"):
        plan.rank_packs(0, 3)


def test_plan_speed_one_million_samples():
    """Measured, not asserted (timings are for benchmarks/pack_plan_speed.py)."""
    src = synthetic_source(1_000_000, 8)
    t0 = time.perf_counter()
    plan = plan_from_stats([src], PackSettings(seq_len=16384, global_batch_packs=64))
    seconds = time.perf_counter() - t0
    print(f"planned 1M samples into {plan.num_packs} packs in {seconds:.2f} s, fill {plan.stats['fill_efficiency']:.4f}")
    assert plan.num_samples + plan.stats["dropped_samples"] == 1_000_000


def test_parse_source(tmp_path):
    assert parse_source("/d/x:0.7") == ("/d/x", 0.7)
    assert parse_source("/d/x") == ("/d/x", None)
    assert parse_source(("/d/x", 2)) == ("/d/x", 2.0)
    for weight in ("1", "0.5", ".5", "5.", "1e-3", "2E+2", "+3"):
        assert parse_source(f"/d/x:{weight}") == ("/d/x", float(weight))
    odd = tmp_path / "a:b"
    odd.mkdir()
    assert parse_source(str(odd)) == (str(odd), None)  # an existing dir with ':' is a dir


def test_fewer_packs_than_one_global_batch_is_an_error_naming_the_numbers_and_the_fix():
    src = synthetic_source(40, 9, name="/data/small")
    packs = plan_from_stats([src], PackSettings(seq_len=16384)).num_packs
    assert 0 < packs < 64
    with pytest.raises(PackingError) as err:
        plan_from_stats([src], PackSettings(seq_len=16384, global_batch_packs=64, dp_size=8))
    message = str(err.value)
    for part in ("/data/small", f"make {packs} pack(s) of 16384 tokens", "fewer than one global batch of 64 packs",
                 "--global-batch-packs 64, data-parallel size 8", "lower --global-batch-packs or --seq-len", "add data"):
        assert part in message, (part, message)
    one_batch = PackSettings(seq_len=16384, global_batch_packs=packs)
    assert plan_from_stats([src], one_batch).num_packs == packs  # exactly one batch is fine
    # a source without samples is the same error, not a division by zero
    with pytest.raises(PackingError, match=r"make 0 pack\(s\)"):
        plan_from_stats([synthetic_source(0)], PackSettings(seq_len=8192))


# --------------------------------------------------------------------------- real shards


@pytest.fixture(scope="module")
def shard_dirs(tmp_path_factory):
    """Two small real shard directories (same profile), the second with videos in half its rows."""
    dirs = []
    for seed, rows, videos in ((21, 24, 0.0), (22, 12, 0.5)):
        data = write_jsonl(tmp_path_factory.mktemp("data") / "chats.jsonl",
                           example_rows(rows, seed=seed, size_range=(32, 160), video_rows=videos))
        out = tmp_path_factory.mktemp(f"shards{seed}")
        run_preprocess(PreprocessConfig(inputs=[str(data)], out=str(out), workers=1, rows_per_shard=8, progress=False))
        dirs.append(out)
    return dirs


def test_real_shards_plan_and_visual_tokens(shard_dirs):
    """A pack's visual tokens count its images' and its videos' merged patches, and
    --max-visual-tokens caps both together."""
    a, b = shard_dirs
    sets = [open_shards(a), open_shards(b)]
    merge = sets[0].manifest["profile"]["vision"]["merge_size"]

    def visual(x) -> int:
        return sum(int(np.prod(x[k], axis=1).sum()) for k in ("image_grid_thw", "video_grid_thw")) // merge**2

    per_sample = [[visual(s[i]) for i in range(len(s))] for s in sets]
    assert sum(len(s["video_grid_thw"]) for s in (sets[1][i] for i in range(len(sets[1])))) >= 3
    cap = max(max(v) for v in per_sample)
    packs = {}
    for max_visual in (None, cap):
        plan = build_pack_plan([a, b], PackSettings(seq_len=2048, max_visual_tokens=max_visual))
        packs[max_visual] = plan.num_packs
        assert sorted(plan_samples(plan)) == [(0, i) for i in range(len(sets[0]))] + [(1, i) for i in range(len(sets[1]))]
        for p in range(plan.num_packs):
            src, idx = plan.pack_samples(p)
            samples = [sets[s][i] for s, i in zip(src.tolist(), idx.tolist())]
            assert sum(len(x["input_ids"]) for x in samples) == plan.pack_tokens[p] <= 2048
            assert sum(visual(x) for x in samples) == plan.pack_visual_tokens[p] <= (max_visual or 2048)
    assert packs[cap] > packs[None]  # the cap binds


def test_save_load_pickle_and_cache(shard_dirs, tmp_path):
    import pickle

    a, b = shard_dirs
    cache = tmp_path / "cache"
    two_ranks = PackSettings(seq_len=2048, dp_size=2, global_batch_packs=2)
    first = build_pack_plan([(a, 1.0), (b, 1.0)], two_ranks, cache_dir=cache)
    assert first.path is not None and first.path.parent == cache
    assert isinstance(first.sample_index, np.memmap)
    again = build_pack_plan([(a, 1.0), (b, 1.0)], two_ranks, cache_dir=cache)
    assert again.path == first.path
    for name in first.arrays:
        assert np.array_equal(first.arrays[name], again.arrays[name])
    # dp_size is not in the key (the plan does not depend on it); seq_len, seed, weights are
    one_rank = PackSettings(seq_len=2048, dp_size=1, global_batch_packs=2)
    assert build_pack_plan([(a, 1.0), (b, 1.0)], one_rank, cache_dir=cache).path == first.path
    other = build_pack_plan([(a, 1.0), (b, 1.0)], PackSettings(seq_len=4096, global_batch_packs=2), cache_dir=cache)
    assert other.path != first.path and other.seq_len == 4096
    reweighted = build_pack_plan([(a, 2.0), (b, 1.0)], PackSettings(seq_len=2048, global_batch_packs=2),
                                 cache_dir=cache)
    assert reweighted.path not in (first.path, other.path)
    assert len([p for p in cache.iterdir() if not p.name.startswith(".")]) == 3
    # a second writer losing the rename race keeps the first plan and leaves no temporary
    _save_to_cache(plan_from_stats([synthetic_source(50)], PackSettings(seq_len=8192)), first.path)
    assert np.array_equal(PackPlan.load(first.path).sample_index, first.sample_index)
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]
    # pickles by path; explicit save/load round trip
    clone = pickle.loads(pickle.dumps(first))
    assert clone.path == first.path and np.array_equal(clone.pack_offsets, first.pack_offsets)
    saved = first.save(tmp_path / "plan")
    loaded = PackPlan.load(saved)
    assert loaded.meta == first.meta and np.array_equal(loaded.sample_source, first.sample_source)
    with pytest.raises(ShardFormatError, match="not a pack plan"):
        PackPlan.load(tmp_path)


def test_missing_directory_and_mixed_profiles(shard_dirs, tmp_path):
    with pytest.raises(ShardFormatError, match="no such directory"):
        build_pack_plan([tmp_path / "nope"], PackSettings(seq_len=2048))
    # a copy of a manifest claiming another profile cannot share packs
    other = tmp_path / "other"
    other.mkdir()
    manifest = json.loads((shard_dirs[1] / "manifest.json").read_text())
    manifest["profile"]["id"] = "something-else"
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PackingError, match="different profiles"):
        build_pack_plan([shard_dirs[0], other], PackSettings(seq_len=2048))


# --------------------------------------------------------------------------- CLI


def _vlmpack_pack(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shards_schema.cli", "pack", *map(str, args)], capture_output=True,
                          text=True, cwd=REPO_ROOT, timeout=120)


def test_cli_report_and_saved_plan(shard_dirs, tmp_path):
    a, b = shard_dirs
    out = tmp_path / "plan"
    result = _vlmpack_pack(a, "--data", f"{b}:0.5", "--seq-len", 2048, "--dp-size", 2, "--global-batch-packs", 2,
                           "--out", out)
    assert result.returncode == 0, result.stderr
    for line in ("samples", "fill", "padding added", "samples/pack", "visual tokens", "DP balance", "time", "saved"):
        assert any(row.startswith(line) for row in result.stdout.splitlines()), (line, result.stdout)
    plan = PackPlan.load(out)
    assert [s["weight"] for s in plan.meta["sources"]] == [None, 0.5]
    result = _vlmpack_pack(a, "--seq-len", 2048, "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["stats"]["samples"] == len(open_shards(a))


def test_cli_errors_exit_2(shard_dirs, tmp_path):
    result = _vlmpack_pack(shard_dirs[0], "--seq-len", 64)
    assert result.returncode == 2
    assert "longer than --seq-len 64" in result.stderr and str(shard_dirs[0]) in result.stderr and "uid" in result.stderr
    result = _vlmpack_pack(tmp_path / "missing", "--seq-len", 2048)
    assert result.returncode == 2 and "no such directory" in result.stderr
    result = _vlmpack_pack(shard_dirs[0], "--seq-len", 2048, "--dp-size", 3, "--global-batch-packs", 4)
    assert result.returncode == 2 and "multiple of --dp-size" in result.stderr
    assert result.stdout == ""


# Each bad `vlmpack pack` command line (paths: {d} a shard directory, {f} a file, {t} a fresh
# temporary directory) and a part of its one-line error.
BAD_PACK_ARGUMENTS = [
    (["--seq-len", "2048"], "give at least one shard directory"),
    (["{d}", "--seq-len", "0"], "--seq-len must be an integer >= 1, got 0"),
    (["{d}", "--seq-len", "long"], "argument --seq-len: invalid int value: 'long'"),
    (["{d}", "--seq-len", "-5"], "--seq-len must be an integer >= 1, got -5"),
    (["{d}", "--seq-len", "2048", "--dp-size", "0"], "--dp-size must be an integer >= 1, got 0"),
    (["{d}", "--seq-len", "2048", "--global-batch-packs", "-2"], "--global-batch-packs -2 must be a positive multiple"),
    (["{d}", "--seq-len", "2048", "--max-visual-tokens", "0"], "--max-visual-tokens must be an integer >= 1, got 0"),
    (["{d}", "--seq-len", "2048", "--pad-to-multiple", "0"], "--pad-to-multiple must be an integer >= 1, got 0"),
    (["{d}", "--seq-len", "2048", "--pad-to-multiple", "4096"], "(rounded up to a multiple of 4096); the longest has "
                                                                "4096. Use --seq-len >= 4096, or a --pad-to-multiple "
                                                                "that divides --seq-len"),
    (["{d}", "--seq-len", "2048", "--epoch", "-1"], "--epoch must be an integer >= 0, got -1"),
    (["{d}", "--seq-len", "2048", "--seed", "-3"], "--seed must be an integer >= 0, got -3"),
    (["{t}/missing", "--seq-len", "2048"], "{t}/missing: no such directory"),
    (["--data", "{d}:abc", "--seq-len", "2048"], "{d}:abc: the weight 'abc' is not a number: write DIR:WEIGHT"),
    (["--data", "{d}:1_0", "--seq-len", "2048"], "{d}:1_0: the weight '1_0' is not a number: write DIR:WEIGHT"),
    (["--data", "{d}: 1", "--seq-len", "2048"], "{d}: 1: the weight ' 1' is not a number: write DIR:WEIGHT"),
    (["--data", "{d}:-1", "--seq-len", "2048"], "must be a finite number >= 0, got -1"),
    (["{d}:inf", "--seq-len", "2048"], "must be a finite number >= 0, got inf"),
    (["{d}", "--seq-len", "2048", "--out", "{f}"], "--out {f} is a file, not a directory"),
    (["{d}", "--seq-len", "2048", "--out", "{f}/plan"], "--out {f}/plan: {f} is a file, not a directory"),
    (["{d}", "--seq-len", "2048", "--out", "{d}"], "--out {d} is the input directory: choose another directory"),
    # one directory named twice, however spelled, would draw its samples twice per epoch
    (["{d}", "{d}", "--seq-len", "2048"], "source {d} is named twice: its samples would be drawn twice per epoch"),
    (["{d}", "--data", "{d}/.:0.5", "--seq-len", "2048"], "source {d}/. is the same directory as {d}: its samples "
                                                          "would be drawn twice"),
]


@pytest.mark.parametrize("argv, message", BAD_PACK_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_PACK_ARGUMENTS])
def test_cli_bad_arguments_exit_2_with_one_line_naming_them(shard_dirs, tmp_path, capsys, argv, message):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    paths = {"d": str(shard_dirs[0]), "f": str(a_file), "t": str(tmp_path)}
    before = sorted(p.name for p in tmp_path.iterdir())
    assert vlmpack_exit_code(["pack", *(arg.format(**paths) for arg in argv)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vlmpack pack: error: "), captured.err
    assert message.format(**paths) in lines[0]
    assert captured.out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_a_copy_or_an_export_of_a_source_is_refused_as_its_samples_twice(shard_dirs, tmp_path, capsys):
    import shutil

    d = shard_dirs[0]
    shutil.copytree(d, tmp_path / "copy")
    assert vlmpack_exit_code(["export", str(d), "--out", str(tmp_path / "export")]) == 0
    for other in ("copy", "export"):
        capsys.readouterr()
        assert vlmpack_exit_code(["pack", str(d), str(tmp_path / other), "--seq-len", "2048"]) == 2
        assert f"source {tmp_path / other} holds the same shards as {d}" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["pack", "import-hf", "export-hf"])
def test_help_has_one_line_per_option_in_named_groups(command):
    import argparse
    import importlib

    from shards_schema.cli import COMMANDS

    module, attr = COMMANDS[command][0].split(":")
    parser = argparse.ArgumentParser(prog=f"vlmpack {command}")
    getattr(importlib.import_module(module), attr).add_arguments(parser)
    shown = [a for a in parser._actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
    assert shown and all(a.help for a in shown)
    default_groups = {parser._positionals.title, parser._optionals.title}
    for group in parser._action_groups:
        assert group.title not in default_groups or all(isinstance(a, argparse._HelpAction) for a in group._group_actions)
    options = parser.format_help().split("\n\n", 1)[1]  # below the usage block
    wrapped = [line for line in options.splitlines() if line.startswith(" " * 8)]
    assert not wrapped, wrapped  # a help text wrapped, or pushed below a long option name


def test_a_plan_out_that_cannot_be_written_is_named_not_its_temporary_sibling(monkeypatch, tmp_path):
    plan = plan_from_stats([synthetic_source(50, 3, name="/data/a")], PackSettings(seq_len=16384))

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkdtemp", refused)
    with pytest.raises(PackingError, match=rf"^{re.escape(str(tmp_path / 'plan'))}: cannot write the plan there "
                                           r"\(Permission denied\): choose a directory"):
        plan.save(tmp_path / "plan")


def test_cli_out_may_be_an_empty_directory_or_a_plan_it_replaces(shard_dirs, tmp_path):
    out = tmp_path / "plan"
    out.mkdir()
    assert _vlmpack_pack(shard_dirs[0], "--seq-len", 2048, "--out", out).returncode == 0
    first = PackPlan.load(out).key
    result = _vlmpack_pack(shard_dirs[0], "--seq-len", 2048, "--seed", 1, "--out", out)
    assert result.returncode == 0, result.stderr
    second = PackPlan.load(out).key
    assert second != first
    (tmp_path / "plain").mkdir()  # the mode of the user's own directories, not a temporary one's 0700
    assert out.stat().st_mode & 0o777 == (tmp_path / "plain").stat().st_mode & 0o777
    # a link to such a directory: the plan lands where it points, the link stays
    (tmp_path / "link").symlink_to(out)
    result = _vlmpack_pack(shard_dirs[0], "--seq-len", 2048, "--seed", 2, "--out", tmp_path / "link")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "link").is_symlink() and PackPlan.load(out).key not in (first, second)


def test_cli_saves_the_same_plan_byte_for_byte_every_run(shard_dirs, tmp_path):
    """The same sources and settings write the same files: nothing that varies run to run (the
    planning time) is saved; the report still shows it."""
    files = []
    for name in ("one", "two"):
        result = _vlmpack_pack(shard_dirs[0], "--data", f"{shard_dirs[1]}:0.5", "--seq-len", 2048,
                               "--global-batch-packs", 2, "--out", tmp_path / name, "--json")
        assert result.returncode == 0, result.stderr
        assert "plan_seconds" in json.loads(result.stdout)["stats"]
        files.append({p.name: p.read_bytes() for p in sorted((tmp_path / name).iterdir())})
    assert files[0] == files[1] and "plan.json" in files[0]


# --------------------------------------------------------------------------- too little data for one global batch


def test_too_little_data_for_a_global_batch_caches_no_plan_and_refuses_a_cached_one(shard_dirs, tmp_path):
    a = shard_dirs[0]
    cache = tmp_path / "cache"
    settings = PackSettings(seq_len=16384, dp_size=8, global_batch_packs=64)
    with pytest.raises(PackingError, match="fewer than one global batch of 64 packs"):
        build_pack_plan([a], settings, cache_dir=cache)
    assert not cache.exists() or not list(cache.iterdir())
    # a plan without a global batch already in the cache (written before this check) is refused, not used
    request = plan_request([a], settings)
    whole = build_pack_plan([a], PackSettings(seq_len=16384))
    empty = {name: np.asarray(array)[:0] for name, array in whole.arrays.items()}
    empty["pack_offsets"] = np.zeros(1, np.int64)
    PackPlan(empty, {**whole.meta, "key": request.key, "settings": request.settings}).save(cache / f"plan-{request.key[:32]}")
    with pytest.raises(PackingError, match="make 0 pack"):
        build_pack_plan([a], settings, cache_dir=cache)


def test_cli_too_little_data_for_a_global_batch_exits_2_with_one_line(shard_dirs, tmp_path):
    result = _vlmpack_pack(shard_dirs[0], "--seq-len", 16384, "--dp-size", 8, "--global-batch-packs", 64,
                           "--out", tmp_path / "plan")
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vlmpack pack: error: "), result.stderr
    assert "fewer than one global batch of 64 packs (--global-batch-packs 64, data-parallel size 8)" in lines[0]
    assert not (tmp_path / "plan").exists()


def _vlmpack_train(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shards_schema.cli", "train", "--arch", "tiny", "--num-workers", "0",
                           "--tensorboard", "false", *map(str, args)], capture_output=True, text=True, cwd=REPO_ROOT,
                          timeout=300)


def _one_train_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("vlmpack train: error: ")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def test_train_with_too_little_data_for_a_global_batch_exits_2_at_once_writing_no_plan(shard_dirs, tmp_path):
    """Before the check, every epoch's plan was empty and the training loop planned epoch after
    epoch forever, one new cached plan each."""
    out = tmp_path / "run"
    t0 = time.perf_counter()
    error = _one_train_error(_vlmpack_train("--data", shard_dirs[0], "--seq-len", 16384, "--global-batch-packs", 64,
                                            "--train-steps", 2, "--out", out))
    assert "fewer than one global batch of 64 packs" in error
    assert time.perf_counter() - t0 < 120
    assert not (out / "plans").exists() or not list((out / "plans").iterdir())


def test_train_with_too_little_eval_data_for_a_global_batch_exits_2_before_the_first_step(shard_dirs, tmp_path):
    a, b = shard_dirs
    G = build_pack_plan([b], PackSettings(seq_len=1024)).num_packs + 1
    enough = build_pack_plan([a], PackSettings(seq_len=1024, global_batch_packs=G))
    assert enough.num_packs >= G  # the training data are enough
    out = tmp_path / "run"
    # before the eval data were planned up front, step 1 ran and step 2's evaluation failed
    error = _one_train_error(_vlmpack_train("--data", a, "--eval-data", b, "--eval-every", 2, "--log-every", 1,
                                            "--seq-len", 1024, "--global-batch-packs", G, "--train-steps", 2,
                                            "--out", out))
    assert f"{b}: the data make {G - 1} pack(s)" in error and f"fewer than one global batch of {G} packs" in error
    metrics = out / "metrics.jsonl"
    assert not metrics.exists() or metrics.read_text() == ""  # no step ran


@pytest.mark.parametrize("changes, message", [
    ({"seq_len": 0}, "--seq-len must be an integer >= 1, got 0"),
    ({"seq_len": 2**31}, "--seq-len must be at most 2,147,483,647, got 2147483648"),
    ({"seed": -1}, "--seed must be an integer >= 0, got -1"),
    ({"max_visual_tokens": 0}, "--max-visual-tokens must be an integer >= 1, got 0"),
    ({"block_size": 0}, "--block-size must be an integer >= 1, got 0"),
    ({"dp_size": 0}, "--dp-size must be an integer >= 1, got 0"),
    ({"dp_size": 3, "global_batch_packs": 4}, "--global-batch-packs 4 must be a positive multiple of --dp-size 3"),
])
def test_pack_settings_refuse_a_bad_value_when_made_naming_its_flag(changes, message):
    """The settings `vlmpack pack`, the planner and the loader share check themselves, with the
    messages `vlmpack pack` gives."""
    with pytest.raises(PackingError, match=re.escape(message)):
        PackSettings(**{"seq_len": 2048, **changes})


def test_pack_settings_record_the_global_batch_and_not_dp_size():
    settings = PackSettings(seq_len=2048, dp_size=4, epoch=1)
    assert settings.global_batch == 4 and settings.for_epoch(2).epoch == 2
    assert settings.recorded() == {"seq_len": 2048, "seed": 0, "epoch": 1, "max_visual_tokens": None,
                                   "global_batch_packs": 4, "pad_to_multiple": 1, "block_size": 4096}
