"""One pack = several samples laid end to end in one flat token row (THD layout).

Conventions (the loss code and the HF oracle test rely on them):

Label shift. Everything in a pack is aligned to the *predicting* row: `labels[i]` is the
token that the model's output at row i must predict, i.e. `labels[i] = input_ids[i + 1]`
when row i+1 is a target of the same sample, else -100; `loss_mask[i] = labels[i] != -100`.
(The shards store `loss_mask` aligned to the *target* token, "token i is a target";
`assemble_pack` shifts it by one.) The last token of every sample predicts nothing, so no
target ever crosses a sample boundary. A sample's first token can never be a target (it
has no previous row); in our data it is always `<|im_start|>`, and a sample that marks it
is rejected with ValueError. Hence `num_target_tokens = loss_mask.sum()` equals the sum of
the samples' `num_target_tokens`, which is what per-token loss normalisation over the
global batch needs. The loss is `sum(CE(logits[i], labels[i]) * loss_mask[i])`; no further
shift. (Hugging Face models shift internally and take *unshifted* labels; the test and
benchmark references in `tests/helpers/hf_reference.py` produce that convention.)

Padding. With `pad_to_multiple = m > 1` (TP sequence parallel / context parallel), sample j
occupies rows [cu_seqlens_padded[j], cu_seqlens_padded[j] + sample_lengths[j]) and is
followed by its own padding up to the next multiple of m; `cu_seqlens_padded` are the
boundaries of these padded segments (row offsets: what `varlen_attn` takes), and
`cu_seqlens` the cumulative *real* lengths (Transformer Engine's `cu_seqlens_q`, which is
not a row offset once padding exists). With m == 1 the two are equal. Padding rows hold
`pad_token_id`, no target, and positions that continue the sample's last position
(+1, +2, ... on all three rows), so a position-derived segmentation agrees with
`cu_seqlens_padded`. With `seq_len`, the row is filled up to `seq_len` by one extra
padding segment (positions 0, 1, ... like a fresh sample, no targets) appended to both
`cu_seqlens` and `cu_seqlens_padded`; `num_samples` counts only the real samples.

Only numpy; no per-token or per-pixel Python loops (one `np.concatenate` per field over the
pack's samples).
"""

from __future__ import annotations

import numpy as np

from train.model.batch import IGNORE_INDEX, PackedBatch

DEFAULT_PAD_TOKEN_ID = 151643  # <|endoftext|> for Qwen2.5-VL / Qwen3-VL; prefer the manifest's


def concat_field(samples: list[dict], name: str, dtype, width: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """Field `name` of every sample end to end (rows of `width` when given), into `out` if given."""
    parts = [np.asarray(s[name]) for s in samples]
    if width is not None:
        parts = [p.reshape(-1, width) for p in parts]
    if out is not None:
        return np.concatenate(parts, out=out) if parts else out
    if not parts:
        return np.zeros((0,) if width is None else (0, width), dtype)
    return np.concatenate(parts).astype(dtype, copy=False)


def segment_offsets(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, within) for segments of `lengths` laid end to end: row r of segment j has
    within[r] = r - starts[j]."""
    ends = np.cumsum(lengths)
    starts = ends - lengths
    total = int(ends[-1]) if len(ends) else 0
    within = np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)
    return starts, within


def sample_lengths(samples: list[dict]) -> np.ndarray:
    """Tokens of each sample (int64 [n])."""
    return np.array([len(s["input_ids"]) for s in samples], dtype=np.int64)


def shifted_targets(input_ids: np.ndarray, target_mask: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Shifted labels for samples concatenated without gaps: label[i] = ids[i+1] if token i+1
    is a target and belongs to the same sample, else IGNORE_INDEX (int64 [sum lengths])."""
    total = len(input_ids)
    labels = np.full(total, IGNORE_INDEX, dtype=np.int64)
    if total < 2:
        return labels
    is_target = target_mask[1:].astype(bool)
    labels[:-1] = np.where(is_target, input_ids[1:], IGNORE_INDEX)
    labels[np.cumsum(lengths) - 1] = IGNORE_INDEX  # a sample's last token predicts nothing
    return labels


def check_first_tokens(loss_mask: np.ndarray, lengths: np.ndarray, samples: list[dict]) -> None:
    starts = np.cumsum(lengths) - lengths
    bad = np.flatnonzero(loss_mask[starts[lengths > 0]] != 0)
    if len(bad):
        j = int(np.flatnonzero(lengths > 0)[bad[0]])
        uid = samples[j].get("sample_uid", f"#{j}")
        raise ValueError(
            f"sample {uid}: its first token is marked as a training target, but nothing precedes "
            "it to predict it from (samples start with <|im_start|>); the shard is corrupt or was "
            "not written by `vlmpack preprocess` — re-run it or check with `vlmpack verify`"
        )


def assemble_pack(
    samples: list[dict],
    *,
    seq_len: int | None = None,
    pad_to_multiple: int = 1,
    row_multiple: int = 1,
    pad_token_id: int = DEFAULT_PAD_TOKEN_ID,
    patch_out: dict[str, np.ndarray] | None = None,
) -> PackedBatch:
    """Lay `samples` (dicts as returned by `open_shards(DIR)[i]`) out as one THD pack.

    `patch_out` ({"pixel_patches" or "video_patches": uint8 array of `patch_rows(samples, name)`
    shape}): where to write a patch field, instead of a new array. The loader passes shared or
    pinned memory, so this one copy out of the mapped shards is the last the patches see on
    the host.

    Returns a `PackedBatch` of numpy arrays (see the module docstring for the label and padding
    conventions, `PackedBatch` for the fields): cu_seqlens and cu_seqlens_padded have n+1
    entries, n+2 with trailing padding; pixel_patches [sum N, W] and video_patches [sum M, W2]
    are in sample order.
    T = sum of the samples' lengths rounded up to `pad_to_multiple`, or `seq_len` if given;
    without `seq_len`, a trailing padding segment rounds T up to a multiple of `row_multiple`
    (sequence parallelism splits the rows evenly over the TP ranks).
    """
    if not samples:
        raise ValueError("assemble_pack needs at least one sample")
    m = int(pad_to_multiple)
    if m < 1:
        raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    lengths = sample_lengths(samples)
    padded = -(-lengths // m) * m
    real_total, packed_total = int(lengths.sum()), int(padded.sum())
    trailing = 0
    if seq_len is not None:
        if packed_total > seq_len:
            raise ValueError(
                f"pack of {len(samples)} samples needs {packed_total} tokens (padded to multiples of {m}), "
                f"more than seq_len {seq_len}; the pack plan and the loader disagree on seq_len/pad_to_multiple"
            )
        trailing = int(seq_len) - packed_total
    else:
        trailing = -packed_total % int(row_multiple)
    total = packed_total + trailing

    ids = concat_field(samples, "input_ids", np.int64)
    mask = concat_field(samples, "loss_mask", np.uint8)
    positions = np.concatenate([np.asarray(s["position_ids"]).reshape(3, -1) for s in samples], axis=1).astype(np.int32, copy=False)
    check_first_tokens(mask, lengths, samples)
    labels_real = shifted_targets(ids, mask, lengths)

    real_starts = np.cumsum(lengths) - lengths
    row_starts = np.cumsum(padded) - padded
    padding_mask = np.zeros(total, dtype=bool)
    if total == real_total:  # no padding anywhere: the concatenation is the pack
        input_ids, labels, position_ids = ids, labels_real, positions
    else:
        dest = np.repeat(row_starts - real_starts, lengths) + np.arange(real_total, dtype=np.int64)
        input_ids = np.full(total, pad_token_id, dtype=np.int64)
        input_ids[dest] = ids
        labels = np.full(total, IGNORE_INDEX, dtype=np.int64)
        labels[dest] = labels_real
        position_ids = np.zeros((3, total), dtype=np.int32)
        position_ids[:, dest] = positions
        padding_mask[:] = True
        padding_mask[dest] = False
        gaps = padded - lengths
        if gaps.any():  # per-sample padding continues the sample's last position
            _, k = segment_offsets(gaps)
            last = positions[:, np.cumsum(lengths) - 1]  # [3, n]
            pad_rows = np.repeat(row_starts + lengths, gaps) + k
            position_ids[:, pad_rows] = np.repeat(last, gaps, axis=1) + 1 + k.astype(np.int32)
        if trailing:  # trailing padding: a fresh segment, positions 0..trailing-1
            position_ids[:, packed_total:] = np.arange(trailing, dtype=np.int32)

    cu_real = np.concatenate([[0], np.cumsum(lengths)])
    cu_padded = np.concatenate([[0], np.cumsum(padded)])
    if trailing:
        cu_real = np.append(cu_real, cu_real[-1] + trailing)
        cu_padded = np.append(cu_padded, total)
    loss_mask = (labels != IGNORE_INDEX).astype(np.float32)
    patch_out = patch_out or {}
    patches = {name: concat_field(samples, name, np.uint8, patch_rows(samples, name)[1], patch_out.get(name))
               for name in PATCH_FIELDS}
    return PackedBatch(
        input_ids=input_ids,
        labels=labels,
        loss_mask=loss_mask,
        position_ids=position_ids,
        padding_mask=padding_mask,
        cu_seqlens=cu_real.astype(np.int32),
        cu_seqlens_padded=cu_padded.astype(np.int32),
        max_seqlen=int(np.diff(cu_padded).max()),
        sample_lengths=lengths.astype(np.int32),
        num_samples=len(samples),
        num_target_tokens=int(np.count_nonzero(labels != IGNORE_INDEX)),
        pixel_patches=patches["pixel_patches"],
        image_grid_thw=concat_field(samples, "image_grid_thw", np.int32, 3),
        video_patches=patches["video_patches"],
        video_grid_thw=concat_field(samples, "video_grid_thw", np.int32, 3),
        sample_uids=[str(s.get("sample_uid", "")) for s in samples],
    )


PATCH_FIELDS = ("pixel_patches", "video_patches")  # the uint8 fields that hold most of a pack's bytes


def patch_rows(samples: list[dict], name: str = "pixel_patches") -> tuple[int, int]:
    """(rows, width) of the pack's `name` field: image patches are [N, C*P*P] as the reader
    returns them, video patches [M, C*T*P*P] with both frames of a temporal patch, T = 2."""
    width = np.asarray(samples[0]["pixel_patches"]).shape[-1] * (2 if name == "video_patches" else 1)
    return sum(np.asarray(s[name]).reshape(-1, width).shape[0] for s in samples), width
