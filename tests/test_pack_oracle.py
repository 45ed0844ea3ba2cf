"""End-to-end oracle of packing: one Hugging Face forward over a whole THD pack built by
`assemble_pack` from real shards gives, at every target token, the same loss as Hugging
Face's own processing of each conversation alone, for both families.

Packed path (ours): shard samples -> `assemble_pack` -> one forward of a tiny random HF model
on the pack (input_ids [1, T]; position_ids [4, 1, T] = 1-D text positions restarting per
packed segment + our M-RoPE rows; pixel_values from our uint8 patches; grids and
mm_token_type_ids concatenated; attention_mask=None, use_cache=False) -> per-token CE of
the logits at each row against our *shifted* `labels` (no further shift).

Per-sample path (HF's, independent of our shards): the row's messages -> official template
-> `Qwen2VLImageProcessorPil` on the decoded images -> pad expansion -> tokenize -> forward
with no position ids (the model runs its own `get_rope_index`) and HF's *unshifted* labels
(HF shifts inside; its own `out.loss` must equal our mean over its shifted per-token CE).

Transformers detects packed sequences from row 0 of 4-row position ids (a step != +1 starts a
new segment, `masking_utils.find_packed_sequence_indices`) and builds a block-causal mask;
with 3 rows it sees one long causal sequence, which the negative control shows leaks.
"""

from __future__ import annotations

import base64
import copy
import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from preprocess.examples import example_rows, write_jsonl
from preprocess.job import PreprocessConfig, run_preprocess
from shards_schema import open_shards
from shards_schema.pixels import pixel_values_from_patches
from tests.helpers.hf_reference import hf_packed_inputs, hf_packed_position_ids, hf_sample
from tests.helpers.models import TINY_MODELS
from train.model.batch import PackedBatch
from train.packed_batch import IGNORE_INDEX, assemble_pack

ROWS = 24
SEED = 7  # 4 text-only conversations for both families
TOLERANCE = 1e-4  # fp32, max |packed - per-sample| per target token
LEAK_MIN_DIFF = 1e-2  # the negative control must differ by at least this much
MAX_DIFFS: dict[str, float] = {}  # family -> largest packed vs per-sample diff seen (reported at the end)


# ---------------------------------------------------------------------------------------------
# Data and the HF per-sample reference
# ---------------------------------------------------------------------------------------------


def decoded_images(messages: list) -> list[Image.Image]:
    """What HF's processor is given: each data-URI image part decoded, in conversation order."""
    images = []
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            if part.get("type") == "image_url":
                data = base64.b64decode(part["image_url"]["url"].split(",", 1)[1])
                images.append(ImageOps.exif_transpose(Image.open(io.BytesIO(data))))
    return images


class Case:
    """One family: real shards, the tiny model, and lazily computed HF per-sample references."""

    def __init__(self, family, directory, tokenizer, template, image_processor):
        self.family = family
        rows = example_rows(ROWS, seed=SEED, family=family, size_range=(32, 160))
        path = write_jsonl(directory / "chats.jsonl", rows)
        self.manifest = run_preprocess(
            PreprocessConfig(inputs=[str(path)], out=str(directory / "shards"), profile=family,
                             workers=1, rows_per_shard=8, progress=False)
        )
        shards = open_shards(str(directory / "shards"))
        self.samples = [shards[i] for i in range(len(shards))]
        # the shard's own num_target_tokens column (the reader's rows leave it out)
        self.shard_targets = dict(zip((str(s["sample_uid"]) for s in self.samples),
                                      shards.sample_stats()["num_target_tokens"].tolist()))
        self.rows = {row["id"]: row for row in rows}
        self.text_only = [s for s in self.samples if len(s["image_grid_thw"]) == 0]
        self.with_images = [s for s in self.samples if len(s["image_grid_thw"]) > 0]
        assert len(self.text_only) >= 3 and len(self.with_images) >= 6, "seed gives too few of a kind"
        self.vision = self.manifest["profile"]["vision"]
        self.special = self.manifest["profile"]["special_tokens"]
        self.model = TINY_MODELS[family]()
        self.tokenizer, self.template, self.image_processor = tokenizer, template, image_processor
        self._references: dict[str, dict] = {}

    def reference(self, sample: dict) -> dict:
        uid = str(sample["sample_uid"])
        if uid not in self._references:
            self._references[uid] = self._hf_reference(sample)
        return self._references[uid]

    def _hf_reference(self, sample: dict) -> dict:
        """HF's processing of the row alone, forward with HF's unshifted labels."""
        messages = copy.deepcopy(self.rows[str(sample["sample_uid"])]["messages"])
        images = decoded_images(messages)
        ids, positions, pixel_values, grid = hf_sample(
            self.family, messages, None, images, self.tokenizer, self.template, self.image_processor, self.model
        )
        assert np.asarray(sample["input_ids"]).tolist() == ids, f"{sample['sample_uid']}: shard ids != HF ids"
        ids = torch.tensor(ids, dtype=torch.long)[None]
        mask = torch.from_numpy(np.asarray(sample["loss_mask"]).astype(bool))[None]
        labels = torch.where(mask, ids, torch.full_like(ids, IGNORE_INDEX))
        kwargs = {}
        if len(grid):
            kwargs = dict(pixel_values=torch.from_numpy(pixel_values), image_grid_thw=torch.from_numpy(grid).long())
        self.model.model.rope_deltas = None  # no state carried over from the previous forward
        with torch.no_grad():
            out = self.model(
                input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, use_cache=False,
                mm_token_type_ids=(ids == self.special["image_pad"]).long(), **kwargs,
            )
        # HF's convention: the model shifts, logits[:-1] predict labels[1:]
        shifted = labels[0, 1:]
        keep = shifted != IGNORE_INDEX
        losses = F.cross_entropy(out.logits[0, :-1][keep], shifted[keep], reduction="none")
        assert abs(losses.mean().item() - out.loss.item()) < 1e-5, "per-token CE does not reproduce HF's own loss"
        return {
            "predicting_rows": torch.nonzero(keep)[:, 0].numpy(),  # row i predicts token i+1
            "targets": shifted[keep].numpy(),
            "losses": losses.double().numpy(),
            "hf_loss": float(out.loss),
            "positions": positions,  # the model's own get_rope_index, [3, L]
            "pixel_values": pixel_values,  # HF's image processor, float32 [N, C*T*P*P]
        }


@pytest.fixture(scope="module")
def case(family, hf_tokenizers, official_template, hf_image_processors, tmp_path_factory):
    return Case(family, tmp_path_factory.mktemp(f"pack-{family}"), hf_tokenizers[family],
                official_template[family], hf_image_processors[family])


# ---------------------------------------------------------------------------------------------
# The packed path
# ---------------------------------------------------------------------------------------------


def hf_text_positions(pack: PackedBatch) -> np.ndarray:
    """Row 0 of HF's packed position ids for an assembled pack: 0, 1, ... within every segment of
    `cu_seqlens_padded` (a sample plus its own padding; the trailing padding is a segment)."""
    cu = pack.cu_seqlens_padded.astype(np.int64)
    total = len(pack.input_ids)
    return np.arange(total) - np.repeat(cu[:-1], np.diff(cu))


def packed_pixel_values(case: Case, pack: PackedBatch) -> torch.Tensor:
    """What the trainer feeds the vision tower: our uint8 patches through the exact LUT (torch path)."""
    v = case.vision
    return pixel_values_from_patches(torch.from_numpy(pack.pixel_patches), v["image_mean"], v["image_std"],
                                     v["patch_size"], v["temporal_patch_size"])


def packed_forward(case: Case, pack: PackedBatch, *, rows: int = 4) -> np.ndarray:
    """One HF forward over the whole pack -> per-row CE against the pack's shifted labels
    (float64 [T], NaN where labels == -100). `rows=3` drops row 0 (the negative control)."""
    mrope = torch.from_numpy(pack.position_ids.astype(np.int64))[:, None, :]
    text = torch.from_numpy(hf_text_positions(pack))[None, None, :]
    position_ids = torch.cat([text, mrope]) if rows == 4 else mrope
    input_ids = torch.from_numpy(pack.input_ids)[None]
    labels = torch.from_numpy(pack.labels)
    is_target = labels != IGNORE_INDEX
    kwargs = {}
    if len(pack.image_grid_thw):
        kwargs = dict(pixel_values=packed_pixel_values(case, pack),
                      image_grid_thw=torch.from_numpy(pack.image_grid_thw).long())
    case.model.model.rope_deltas = None
    with torch.no_grad():
        out = case.model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=None, use_cache=False,
            mm_token_type_ids=(input_ids == case.special["image_pad"]).long(),
            logits_to_keep=is_target[None],  # boolean mask: logits of the target rows only, [n, V]
            **kwargs,
        )
    losses = np.full(len(labels), np.nan)
    losses[is_target.numpy()] = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), labels[is_target],
                                                reduction="none").double().numpy()
    return losses


def sample_rows(pack: PackedBatch, j: int) -> np.ndarray:
    start = int(pack.cu_seqlens_padded[j])
    return np.arange(start, start + int(pack.sample_lengths[j]))


def compare_with_per_sample(case: Case, samples: list[dict], **pack_kwargs) -> float:
    """Assemble, run once packed, compare with each sample's HF reference; returns the max diff."""
    pack = assemble_pack(samples, pad_token_id=case.special["endoftext"], **pack_kwargs)
    losses = packed_forward(case, pack)
    is_target = pack.labels != IGNORE_INDEX
    max_diff, weighted = 0.0, []
    for j, sample in enumerate(samples):
        ref, rows = case.reference(sample), sample_rows(pack, j)
        start = rows[0]
        local = np.flatnonzero(is_target[rows])
        # our shifted labels are exactly HF's shift: same predicting rows, same target ids
        np.testing.assert_array_equal(local, ref["predicting_rows"], err_msg=f"sample {j}: target rows")
        np.testing.assert_array_equal(pack.labels[start + local], ref["targets"], err_msg=f"sample {j}: labels")
        diff = np.abs(losses[start + local] - ref["losses"])
        max_diff = max(max_diff, float(diff.max()))
        assert diff.max() < TOLERANCE, f"sample {j} ({sample['sample_uid']}): packed vs alone differ by {diff.max():.3g}"
        weighted.append((len(local), ref["hf_loss"]))
        # exact inputs too: the loss alone is only weakly sensitive to some of them in a tiny
        # random model (e.g. an h/w swap of Qwen2.5-VL's low-frequency M-RoPE rows moves it ~1e-4)
        np.testing.assert_array_equal(pack.position_ids[:, rows], ref["positions"], err_msg=f"sample {j}: M-RoPE")
    hf_pixels = [case.reference(s)["pixel_values"] for s in samples if len(s["image_grid_thw"])]
    if hf_pixels:
        assert torch.equal(packed_pixel_values(case, pack), torch.from_numpy(np.concatenate(hf_pixels)))
    counts = np.array([n for n, _ in weighted])
    # nothing outside the samples (padding) is a target, and the counts add up
    real = np.zeros(len(is_target), bool)
    real[np.concatenate([sample_rows(pack, j) for j in range(len(samples))])] = True
    assert not is_target[~real].any(), "a padding row carries a target"
    assert pack.num_target_tokens == counts.sum() == sum(case.shard_targets[str(s["sample_uid"])] for s in samples)
    pack_mean = np.nansum(losses) / pack.num_target_tokens  # sum(CE * loss_mask) / num_target_tokens
    per_sample_mean = float(np.dot(counts, [loss for _, loss in weighted]) / counts.sum())
    assert abs(pack_mean - per_sample_mean) < TOLERANCE, (pack_mean, per_sample_mean)
    MAX_DIFFS[case.family] = max(MAX_DIFFS.get(case.family, 0.0), max_diff)
    return max_diff


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


def mixed(case: Case, n: int = 6) -> list[dict]:
    """Alternating image / text-only samples, an image sample first."""
    out = []
    for img, txt in zip(case.with_images, case.text_only):
        out += [img, txt]
    return out[:n]


def test_text_only_pack(case):
    compare_with_per_sample(case, case.text_only[:4])


def test_image_only_pack(case):
    compare_with_per_sample(case, case.with_images[:4])


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_mixed_pack(case, attention):
    """Both HF attention paths build the block-causal mask from row 0 (references stay sdpa)."""
    case.model.set_attn_implementation(attention)
    try:
        compare_with_per_sample(case, mixed(case))
    finally:
        case.model.set_attn_implementation("sdpa")


def test_padded_pack(case):
    """pad_to_multiple > 1 and trailing padding to seq_len change no real token's loss."""
    samples = mixed(case, 5)
    lengths = np.array([len(s["input_ids"]) for s in samples])
    m = 16
    assert (lengths % m).any(), "no sample needs padding: the test would prove nothing"
    seq_len = int((-(-lengths // m) * m).sum()) + 40
    compare_with_per_sample(case, samples, pad_to_multiple=m, seq_len=seq_len)


def test_pack_conventions_match_hf_helpers(case):
    """`assemble_pack` (unpadded) and `hf_packed_inputs` describe the same batch: equal ids, the
    4-row positions used here equal `hf_packed_position_ids`, and our shifted labels are HF's
    unshifted labels moved one row up within each sample."""
    samples = mixed(case)
    pack = assemble_pack(samples, pad_token_id=case.special["endoftext"])
    hf = hf_packed_inputs(samples, image_pad_id=case.special["image_pad"])
    np.testing.assert_array_equal(pack.input_ids, hf["input_ids"][0])
    four = np.concatenate([hf_text_positions(pack)[None], pack.position_ids.astype(np.int64)])[:, None, :]
    np.testing.assert_array_equal(four, hf_packed_position_ids(samples))
    np.testing.assert_array_equal(four, hf["position_ids"])
    np.testing.assert_array_equal(pack.image_grid_thw, hf["image_grid_thw"])
    np.testing.assert_array_equal(pack.pixel_patches, hf["pixel_patches"])
    shifted = np.full_like(pack.labels, IGNORE_INDEX)
    shifted[:-1] = hf["labels"][0, 1:]
    shifted[pack.cu_seqlens[1:] - 1] = IGNORE_INDEX
    np.testing.assert_array_equal(pack.labels, shifted)


def test_three_row_positions_leak_between_samples(case):
    """Negative control: without row 0 HF sees one causal sequence, so every sample after the first
    attends to the ones before it and its losses move; the first sample is unaffected."""
    samples = mixed(case, 4)
    pack = assemble_pack(samples, pad_token_id=case.special["endoftext"])
    leaky = packed_forward(case, pack, rows=3)
    first = sample_rows(pack, 0)
    is_target = pack.labels != IGNORE_INDEX
    ref0 = case.reference(samples[0])["losses"]
    assert np.abs(leaky[first][is_target[first]] - ref0).max() < TOLERANCE
    for j in range(1, len(samples)):
        rows = sample_rows(pack, j)
        diff = np.abs(leaky[rows][is_target[rows]] - case.reference(samples[j])["losses"]).max()
        assert diff > LEAK_MIN_DIFF, f"sample {j}: 3-row positions changed its losses by only {diff:.3g}"


def test_report_max_diffs():
    """Not a check: print the largest packed-vs-alone difference per family (pytest -s)."""
    print("\nmax |packed - per-sample| per target token:", {k: f"{v:.3g}" for k, v in MAX_DIFFS.items()})
