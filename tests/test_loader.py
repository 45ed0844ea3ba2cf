"""Packed (THD) batches and the loader: labels never cross samples, cu_seqlens / positions /
pixels line up, padding variants, HF packed inputs; DataLoader workers, exact resume,
dp-size independence, epochs; WebDataset exports pack exactly like their directories; and
the training side never imports the preprocessing stack."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from preprocess.examples import example_rows, write_jsonl
from preprocess.job import PreprocessConfig, run_preprocess
from shards_schema import ShardFormatError, open_shards
from shards_schema.pixels import pixel_values_from_patches_np
from shards_schema.webdataset import WebDatasetFormatError, WebDatasetShards, export_webdataset
from tests.helpers.hf_reference import hf_packed_inputs, hf_packed_position_ids, to_padded_batch
from train.loader import LoaderState, PackedDataset, PackedLoader, pixel_values_on_device, shared_uint8
from train.pack_plan import PackingError, PackSettings, build_pack_plan, open_source
from train.packed_batch import IGNORE_INDEX, assemble_pack

REPO_ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN = 1024


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    data = write_jsonl(tmp_path_factory.mktemp("data") / "chats.jsonl", example_rows(40, seed=31, size_range=(32, 128)))
    out = tmp_path_factory.mktemp("shards")
    run_preprocess(PreprocessConfig(inputs=[str(data)], out=str(out), workers=1, rows_per_shard=8, progress=False))
    return out


@pytest.fixture(scope="module")
def video_shard_dir(tmp_path_factory):
    rows = example_rows(10, seed=7, size_range=(32, 96), video_rows=0.6)
    data = write_jsonl(tmp_path_factory.mktemp("video-data") / "chats.jsonl", rows)
    out = tmp_path_factory.mktemp("video-shards")
    run_preprocess(PreprocessConfig(inputs=[str(data)], out=str(out), workers=1, rows_per_shard=4, progress=False))
    return out


@pytest.fixture(scope="module")
def shards(shard_dir):
    return open_shards(shard_dir)


@pytest.fixture(scope="module")
def some_samples(shards):
    """A text-only sample between image samples, and a multi-image one if there is one."""
    stats = shards.sample_stats()
    text = int(np.flatnonzero(stats["num_images"] == 0)[0])
    images = np.flatnonzero(stats["num_images"] > 0)
    multi = np.flatnonzero(stats["num_images"] > 1)
    picks = [int(images[0]), text, int(multi[0]) if len(multi) else int(images[1]), int(images[2])]
    return [shards[i] for i in picks]


# --------------------------------------------------------------------------- packed batch


def check_pack(pack: dict, samples: list[dict], pad_to_multiple: int = 1, seq_len: int | None = None) -> None:
    lengths = np.array([len(s["input_ids"]) for s in samples])
    padded = -(-lengths // pad_to_multiple) * pad_to_multiple
    starts = np.concatenate([[0], np.cumsum(padded)])[:-1]
    T = int(padded.sum()) if seq_len is None else seq_len
    assert pack.input_ids.shape == (T,) and pack.labels.shape == (T,) and pack.position_ids.shape == (3, T)
    assert pack.sample_lengths.tolist() == lengths.tolist() and pack.num_samples == len(samples)
    assert pack.cu_seqlens[: len(samples) + 1].tolist() == [0, *np.cumsum(lengths).tolist()]
    assert pack.cu_seqlens_padded[: len(samples) + 1].tolist() == [0, *np.cumsum(padded).tolist()]
    assert pack.cu_seqlens_padded[-1] == T and pack.max_seqlen == int(np.diff(pack.cu_seqlens_padded).max())
    covered = np.zeros(T, bool)
    for s, start in zip(samples, starts):
        L = len(s["input_ids"])
        rows = slice(start, start + L)
        covered[start:start + L] = True
        ids, mask = s["input_ids"].astype(np.int64), s["loss_mask"].astype(bool)
        assert (pack.input_ids[rows] == ids).all()
        # labels of a sample = its own ids shifted by one where the next token is a target
        expected = np.full(L, IGNORE_INDEX)
        expected[:-1] = np.where(mask[1:], ids[1:], IGNORE_INDEX)
        assert (pack.labels[rows] == expected).all()
        assert pack.labels[start + L - 1] == IGNORE_INDEX  # the last token predicts nothing
        assert not mask[0]  # a sample's first token is never a target (it is <|im_start|>)
        assert (pack.position_ids[:, rows] == s["position_ids"]).all()  # restart per sample
        assert pack.position_ids[0, start] == 0
    assert (pack.labels[~covered] == IGNORE_INDEX).all()  # padding has no targets
    assert (pack.loss_mask == (pack.labels != IGNORE_INDEX)).all() and pack.loss_mask.dtype == np.float32
    assert pack.num_target_tokens == int(pack.loss_mask.sum()) == sum(int(s["loss_mask"].sum()) for s in samples)
    # pixels and grids concatenated in sample order; one patch row per t*h*w
    assert np.array_equal(pack.pixel_patches, np.concatenate([s["pixel_patches"] for s in samples]))
    assert np.array_equal(pack.image_grid_thw, np.concatenate([s["image_grid_thw"].reshape(-1, 3) for s in samples]))
    assert int(np.prod(pack.image_grid_thw, axis=1).sum()) == len(pack.pixel_patches)


def test_assemble_pack_no_padding(some_samples):
    pack = assemble_pack(some_samples)
    check_pack(pack, some_samples)
    assert np.array_equal(pack.cu_seqlens, pack.cu_seqlens_padded)
    assert pack.input_ids.dtype == np.int64 and pack.position_ids.dtype == np.int32


@pytest.mark.parametrize("pad_to_multiple,seq_len", [(64, None), (1, 4096), (128, 4096)])
def test_assemble_pack_padding(some_samples, pad_to_multiple, seq_len):
    pack = assemble_pack(some_samples, pad_to_multiple=pad_to_multiple, seq_len=seq_len, pad_token_id=7)
    check_pack(pack, some_samples, pad_to_multiple, seq_len)
    n = len(some_samples)
    cu = pack.cu_seqlens_padded
    assert len(pack.cu_seqlens) == n + 1 + (seq_len is not None)  # trailing padding is one extra segment
    for j, s in enumerate(some_samples):  # per-sample padding: pad id, positions continue the sample's last
        L = len(s["input_ids"])
        pad = slice(cu[j] + L, cu[j + 1])
        assert (pack.input_ids[pad] == 7).all()
        k = np.arange(cu[j + 1] - cu[j] - L)
        assert (pack.position_ids[:, pad] == s["position_ids"][:, -1:] + 1 + k).all()
    if seq_len is not None:
        tail = slice(cu[n], seq_len)
        assert (pack.position_ids[:, tail] == np.arange(seq_len - cu[n])).all()
        assert pack.cu_seqlens[-1] - pack.cu_seqlens[-2] == seq_len - cu[n]
    with pytest.raises(ValueError, match="more than seq_len"):
        assemble_pack(some_samples, seq_len=100)


def test_first_token_target_is_rejected(some_samples):
    bad = dict(some_samples[1])
    bad["loss_mask"] = bad["loss_mask"].copy()
    bad["loss_mask"][0] = 1
    with pytest.raises(ValueError, match="first token"):
        assemble_pack([some_samples[0], bad])


def test_hf_packed_inputs_and_padded_batch(some_samples):
    lengths = [len(s["input_ids"]) for s in some_samples]
    pos = hf_packed_position_ids(some_samples)
    assert pos.shape == (4, 1, sum(lengths))
    assert pos[0, 0].tolist() == [i for L in lengths for i in range(L)]  # text positions restart per sample
    assert np.array_equal(pos[1:, 0], np.concatenate([s["position_ids"] for s in some_samples], axis=1))
    hf = hf_packed_inputs(some_samples)
    pack = assemble_pack(some_samples)
    # HF's unshifted labels, shifted the way HF's loss does, are exactly our pack labels
    assert np.array_equal(np.append(hf["labels"][0, 1:], IGNORE_INDEX), pack.labels)
    assert hf["mm_token_type_ids"].sum() == sum(int(np.prod(s["image_grid_thw"], axis=1).sum()) // 4 for s in some_samples)
    batch = to_padded_batch(some_samples)
    assert batch["input_ids"].shape == (len(some_samples), max(lengths))
    assert batch["position_ids"].shape == (3, len(some_samples), max(lengths))
    for b, s in enumerate(some_samples):
        L = lengths[b]
        assert batch["attention_mask"][b].sum() == L
        assert (batch["labels"][b, L:] == IGNORE_INDEX).all() and (batch["position_ids"][:, b, L:] == 1).all()
        row = np.append(batch["labels"][b, 1:L], IGNORE_INDEX)
        start = sum(lengths[:b])
        assert np.array_equal(row, pack.labels[start:start + L])


# --------------------------------------------------------------------------- dataset / loader


def pack_ids(batches) -> list[int]:
    return [b.pack_index for b in batches]


def test_dataset_returns_plan_packs_as_tensors(shard_dir, shards):
    plan = build_pack_plan([shard_dir], PackSettings(seq_len=SEQ_LEN))
    dataset = PackedDataset(plan)
    assert len(dataset) == plan.num_packs
    seen = []
    for k in range(len(dataset)):
        batch = dataset[k]
        assert isinstance(batch.input_ids, torch.Tensor) and batch.input_ids.dtype == torch.int64
        src, idx = plan.pack_samples(batch.pack_index)
        samples = [shards[i] for i in idx.tolist()]
        check_pack(batch.as_numpy(), samples)
        seen += idx.tolist()
    assert sorted(seen) == list(range(len(shards)))
    aligned = PackedDataset(build_pack_plan([shard_dir], PackSettings(seq_len=SEQ_LEN, pad_to_multiple=64)))[0]
    assert (aligned.cu_seqlens_padded % 64 == 0).all() and len(aligned.input_ids) % 64 == 0
    padded = PackedDataset(plan, pad_to_seq_len=True)[0]
    assert padded.input_ids.shape == (SEQ_LEN,)
    assert padded.input_ids[-1] == shards.manifest["profile"]["special_tokens"]["endoftext"]


def test_workers_give_the_same_packs(shard_dir):
    plan = build_pack_plan([shard_dir], PackSettings(seq_len=SEQ_LEN))
    dataset = PackedDataset(plan)
    serial = list(torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=0))
    parallel = list(torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2))
    assert pack_ids(serial) == pack_ids(parallel) == list(range(plan.num_packs))
    for a, b in zip(serial, parallel):
        for key in ("input_ids", "labels", "position_ids", "pixel_patches", "cu_seqlens"):
            assert torch.equal(getattr(a, key), getattr(b, key))


PATCH_GRIDS = {"pixel_patches": "image_grid_thw", "video_patches": "video_grid_thw"}


@pytest.mark.parametrize("field", list(PATCH_GRIDS))
def test_worker_writes_patches_into_shared_memory(field, shard_dir, video_shard_dir, monkeypatch):
    """In a DataLoader worker the pack's image and video patches are written straight into
    shared memory (the result queue then passes them without another copy); the values are the
    plain path's, which are the samples' rows end to end."""
    plan = build_pack_plan([video_shard_dir if field == "video_patches" else shard_dir], PackSettings(seq_len=SEQ_LEN))
    dataset = PackedDataset(plan)
    with_patches = next(k for k in range(len(dataset)) if len(getattr(dataset[k], PATCH_GRIDS[field])))
    plain = getattr(dataset[with_patches], field)
    assert not plain.is_shared() and len(plain)
    assert np.array_equal(plain.numpy(), np.concatenate([np.asarray(s[field]) for s in dataset.samples(with_patches)]))
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: object())
    shared = getattr(dataset[with_patches], field)
    assert shared.is_shared() and torch.equal(shared, plain) and shared.dtype == torch.uint8


def _resident_pages(t: torch.Tensor) -> int:
    """Pages of t's (page-aligned) memory that are mapped in, by mincore(2)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages = -(-t.numel() // 4096)
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(t.data_ptr(), t.numel(), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_POPULATE_WRITE) and mincore are Linux calls")
def test_shared_uint8_maps_its_pages_up_front():
    """A worker's shared block has all its pages mapped before the copy (one madvise, not a
    fault per page), and both kinds of block are zeroed shared memory of the asked shape."""
    import platform
    lazy = shared_uint8(64, 4096, prefault=False)
    eager = shared_uint8(64, 4096)
    assert _resident_pages(lazy) <= 1  # at most the page torch's allocator itself touches
    if tuple(int(x) for x in platform.release().split(".")[:2] if x.isdigit()) >= (5, 14):
        assert _resident_pages(eager) == 64
    for t in (lazy, eager):
        assert t.is_shared() and t.shape == (64, 4096) and t.dtype == torch.uint8 and not t.any()


def test_shared_memory_full_is_a_clear_error(monkeypatch):
    """When /dev/shm cannot hold a pack (docker's 64 MB default), the worker's error says what
    ran out and how to fix it. torch's own message, seen with a 1 MB tmpfs on /dev/shm, is
    passed on inside it."""
    def full(nbytes):
        raise RuntimeError("unable to allocate shared memory(shm) for file </torch_1_2_0>: No space left on device (28)")

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared", staticmethod(full))
    with pytest.raises(RuntimeError, match=r"shared memory is full.*--shm-size.*--num-workers 0.*No space left"):
        shared_uint8(16, 4096)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
@pytest.mark.parametrize("field", list(PATCH_GRIDS))
def test_gpu_pinning_dataset_writes_patches_into_pinned_memory(field, shard_dir, video_shard_dir):
    """With pin_memory in the training process, image and video patches go straight into pinned
    memory, which the DataLoader's pinning step then passes through untouched (same tensor, no
    second copy)."""
    from torch.utils.data._utils.pin_memory import pin_memory

    plan = build_pack_plan([video_shard_dir if field == "video_patches" else shard_dir], PackSettings(seq_len=SEQ_LEN))
    pinned = PackedDataset(plan, pin_memory=True)
    with_patches = next(k for k in range(len(pinned)) if len(getattr(pinned[k], PATCH_GRIDS[field])))
    batch = pinned[with_patches]
    assert getattr(batch, field).is_pinned()
    assert torch.equal(getattr(batch, field), getattr(PackedDataset(plan)[with_patches], field))
    assert getattr(pin_memory(batch), field).data_ptr() == getattr(batch, field).data_ptr()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the DataLoader pins on a thread only with CUDA")
def test_gpu_pin_memory_thread_leaves_one_intra_op_thread_count(shard_dir, tmp_path):
    """The DataLoader's pin-memory thread sets torch's process-wide intra-op thread count to 1,
    and threads started later (autograd's, at the first backward) take the process-wide count:
    torch.compile guards on it, so a graph run in both threads compiled twice. After the
    loader's first batch, a new thread sees this thread's count."""
    import threading

    torch.set_num_threads(max(2, torch.get_num_threads()))
    threads = torch.get_num_threads()
    loader = make_loader(shard_dir, cache_dir=tmp_path, pin_memory=True, num_workers=1)
    assert len(take(loader, 2)) == 2
    seen = []
    probe = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    probe.start()
    probe.join()
    assert seen == [threads]


PACK_SETTING_NAMES = {field.name for field in dataclasses.fields(PackSettings)}


def make_loader(shard_dir, **kw) -> PackedLoader:
    """A loader of `shard_dir`: keyword arguments of PackSettings (seq_len SEQ_LEN and seed 3
    unless given) or of the loader."""
    planning = {"seq_len": SEQ_LEN, "seed": 3} | {k: kw.pop(k) for k in list(kw) if k in PACK_SETTING_NAMES}
    return PackedLoader([shard_dir], PackSettings(**planning), **kw)


def take(loader: PackedLoader, n: int) -> list[dict]:
    out = []
    if n == 0:
        return out
    for batch in loader:
        out.append(batch)
        if len(out) == n:
            break
    return out


def test_resume_mid_epoch_gives_the_next_pack(shard_dir, tmp_path):
    full = make_loader(shard_dir, cache_dir=tmp_path)
    epoch0 = pack_ids(list(full))
    epoch1 = pack_ids(list(full))
    assert full.epoch == 2 and sorted(epoch0) == sorted(epoch1) and len(epoch0) >= 6
    first = make_loader(shard_dir, cache_dir=tmp_path, num_workers=2)
    head = pack_ids(take(first, 3))
    state = first.state_dict()
    assert state == LoaderState(full.fingerprint, 3, 0, 3, 1).to_dict()
    resumed = make_loader(shard_dir, cache_dir=tmp_path)
    resumed.load_state_dict(state)
    assert head + pack_ids(list(resumed)) == epoch0
    assert pack_ids(list(resumed)) == epoch1  # and on into the next epoch
    # epochs reshuffle: the same packs are not replayed in the same order
    plans = [full.plan(e) for e in (0, 1)]
    assert not np.array_equal(plans[0].sample_index, plans[1].sample_index)
    # stopping exactly at an epoch's end resumes at the next epoch's start
    end = make_loader(shard_dir, cache_dir=tmp_path)
    take(end, len(epoch0))
    again = make_loader(shard_dir, cache_dir=tmp_path)
    again.load_state_dict(end.state_dict())
    assert pack_ids(take(again, 2)) == epoch1[:2] and again.epoch == 1


def test_dp_size_does_not_change_the_global_order(shard_dir, tmp_path):
    G = 4
    single = make_loader(shard_dir, global_batch_packs=G, cache_dir=tmp_path)
    order = pack_ids(list(single))
    assert len(order) % G == 0 and len(order) >= 2 * G
    ranks = [make_loader(shard_dir, global_batch_packs=G, rank=r, dp_size=2, cache_dir=tmp_path) for r in range(2)]
    per_rank = [pack_ids(list(loader)) for loader in ranks]
    assert len(per_rank[0]) == len(per_rank[1]) == len(order) // 2
    for g in range(len(order) // G):
        together = sorted(per_rank[0][2 * g:2 * g + 2] + per_rank[1][2 * g:2 * g + 2])
        assert together == sorted(order[g * G:(g + 1) * G])
    # resume a dp=1 run on 2 ranks at a global-batch boundary: the same next global batch
    first = make_loader(shard_dir, global_batch_packs=G, cache_dir=tmp_path)
    take(first, G)
    state = first.state_dict()
    assert state["packs_consumed"] == G
    nxt = []
    for r in range(2):
        loader = make_loader(shard_dir, global_batch_packs=G, rank=r, dp_size=2, cache_dir=tmp_path)
        loader.load_state_dict(state)
        nxt += pack_ids(take(loader, 2))
        assert loader.state_dict()["packs_consumed"] == 2 * G
    assert sorted(nxt) == sorted(order[G:2 * G])
    # inside a global batch only the same dp_size can resume exactly
    mid = make_loader(shard_dir, global_batch_packs=G, cache_dir=tmp_path)
    take(mid, G + 1)
    two = make_loader(shard_dir, global_batch_packs=G, rank=0, dp_size=2, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="inside a global batch"):
        two.load_state_dict(mid.state_dict())


def test_state_from_other_data_or_seed_is_refused(shard_dir, tmp_path):
    state = make_loader(shard_dir, cache_dir=tmp_path).state_dict()
    with pytest.raises(ValueError, match="other data or packing settings"):
        make_loader(shard_dir, seq_len=2048, cache_dir=tmp_path).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        make_loader(shard_dir, seed=4, cache_dir=tmp_path).load_state_dict(state)


def test_fewer_packs_than_one_global_batch_is_refused_not_an_empty_epoch(shard_dir, tmp_path):
    """An epoch without a whole global batch used to be empty: `for batch in loader` ended at
    once and a loop over epochs planned (and cached) one empty epoch after another."""
    cache = tmp_path / "plans"
    loader = PackedLoader([shard_dir], PackSettings(seq_len=16384, dp_size=8, global_batch_packs=64), rank=0,
                          cache_dir=cache)
    for consume in (len, lambda loader: next(iter(loader))):
        with pytest.raises(PackingError, match="fewer than one global batch of 64 packs"):
            consume(loader)
    assert loader.epoch == 0
    assert not cache.exists() or not list(cache.iterdir())


def test_pin_memory(shard_dir, tmp_path):
    loader = make_loader(shard_dir, cache_dir=tmp_path, pin_memory=True, num_workers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU-only torch warns that pinning needs an accelerator
        batches = take(loader, 4)
    assert isinstance(batches[0].input_ids, torch.Tensor) and loader.position == 4
    if not torch.cuda.is_available():
        pytest.skip("pinned memory needs CUDA (the loader ran, unpinned)")
    assert any(len(b.pixel_patches) for b in batches)
    # a zero-size tensor (a pack without images has no patches) has no memory to pin
    unpinned = [(i, k) for i, b in enumerate(batches) for k in ("input_ids", "labels", "position_ids", "pixel_patches",
                                                                 "cu_seqlens") if getattr(b, k).numel() and not getattr(b, k).is_pinned()]
    assert not unpinned, f"not pinned: {unpinned}"


def test_pixel_values_on_device(shards, some_samples):
    vision = shards.manifest["profile"]["vision"]
    patches = assemble_pack(some_samples).pixel_patches
    got = pixel_values_on_device(torch.from_numpy(patches), vision)
    expected = pixel_values_from_patches_np(patches, vision["image_mean"], vision["image_std"], vision["patch_size"],
                                            vision["temporal_patch_size"])
    assert torch.equal(got, torch.from_numpy(expected))
    assert pixel_values_on_device(torch.from_numpy(patches), vision, torch.bfloat16).dtype == torch.bfloat16


def test_training_side_imports_no_preprocessing_stack():
    code = (
        "import sys, tempfile, pathlib, train.pack_plan, train.packed_batch, train.loader, train.cli\n"
        "from train.checkpoint_format import write_side_files\n"
        "write_side_files(pathlib.Path(tempfile.mkdtemp()), 'qwen3-vl', None)  # export of a random-init model\n"
        "bad = [m for m in ('preprocess', 'PIL', 'tokenizers', 'transformers') if m in sys.modules]\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------- WebDataset sources


@pytest.fixture(scope="module")
def webdataset_dir(shard_dir, tmp_path_factory):
    """The shard directory exported to WebDataset, in several tars of uneven size."""
    out = tmp_path_factory.mktemp("wds") / "tars"
    export_webdataset(shard_dir, out, samples_per_tar=7)
    return out


def assert_same_packs(a, b) -> None:
    """Every field of two pack sequences equal: tensors in value, dtype and shape."""
    a, b = list(a), list(b)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        for field in dataclasses.fields(x):
            one, other = getattr(x, field.name), getattr(y, field.name)
            if isinstance(one, torch.Tensor):
                assert one.dtype == other.dtype and torch.equal(one, other), field.name
            else:
                assert one == other, field.name


def test_webdataset_export_packs_exactly_like_its_directory(shard_dir, shards, webdataset_dir, video_shard_dir):
    wds = open_source(webdataset_dir)
    assert isinstance(wds, WebDatasetShards) and len(wds.tars) > 2
    stats = shards.sample_stats()
    for name, values in wds.sample_stats().items():  # from tar headers alone
        assert np.array_equal(values, stats[name]), name
    for settings in ({"seq_len": SEQ_LEN}, {"seq_len": SEQ_LEN, "pad_to_multiple": 64, "seed": 5, "epoch": 1}):
        arrow, tars = (build_pack_plan([source], PackSettings(**settings)) for source in (shard_dir, webdataset_dir))
        assert arrow.key == tars.key and tars.source_dirs == [str(webdataset_dir.resolve())]
        for name in arrow.arrays:
            assert np.array_equal(arrow.arrays[name], tars.arrays[name]), name
        assert_same_packs(PackedDataset(arrow), PackedDataset(tars))
        assert_same_packs(PackedDataset(arrow, pad_to_seq_len=True), PackedDataset(tars, pad_to_seq_len=True))
    # an export mixes with other sources as its directory does; beside its own directory it is
    # refused (the same samples twice per epoch)
    mixed = build_pack_plan([webdataset_dir, video_shard_dir], PackSettings(seq_len=SEQ_LEN))
    assert_same_packs(PackedDataset(mixed), PackedDataset(mixed, [shard_dir, video_shard_dir]))
    assert set(np.unique(mixed.sample_source).tolist()) == {0, 1}
    with pytest.raises(PackingError, match="holds the same shards as"):
        build_pack_plan([shard_dir, webdataset_dir], PackSettings(seq_len=SEQ_LEN))


def test_webdataset_loader_with_workers_and_resume_across_formats(shard_dir, webdataset_dir, tmp_path):
    arrow = make_loader(shard_dir, cache_dir=tmp_path)
    tars = make_loader(webdataset_dir, cache_dir=tmp_path, num_workers=2)  # the export pickles by path
    assert arrow.fingerprint == tars.fingerprint
    head = take(arrow, 3)
    assert_same_packs(head, take(tars, 3))
    resumed = make_loader(webdataset_dir, cache_dir=tmp_path)  # the cached plan was built on the directory
    resumed.load_state_dict(arrow.state_dict())
    assert_same_packs(list(arrow), list(resumed))
    assert resumed.dataset().shards[0].directory == webdataset_dir  # reads its own source, not the plan's


def test_unknown_or_damaged_webdataset_sources_are_refused(webdataset_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ShardFormatError, match="neither manifest.json nor index.json"):
        build_pack_plan([tmp_path / "empty"], PackSettings(seq_len=SEQ_LEN))
    damaged = tmp_path / "damaged"
    shutil.copytree(webdataset_dir, damaged)
    index = json.loads((damaged / "index.json").read_text())
    tar = damaged / index["tars"][1]["file"]
    data = bytearray(tar.read_bytes())
    at = index["tars"][1]["sample_offsets"][2]
    data[at + 11:at + 14] = b"xxx"  # the first member's name
    tar.write_bytes(bytes(data))
    key = f"s{index['tars'][1]['first_index'] + 2:09d}"
    with pytest.raises(WebDatasetFormatError, match=f"{tar.name}: sample {key} .*expected member image_grid_thw.npy"):
        build_pack_plan([damaged], PackSettings(seq_len=SEQ_LEN))
    tar.write_bytes(bytes(data[:-20000]))
    with pytest.raises(WebDatasetFormatError, match="truncated"):
        build_pack_plan([damaged], PackSettings(seq_len=SEQ_LEN))
