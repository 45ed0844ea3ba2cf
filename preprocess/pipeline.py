"""One input row -> one training sample (or a RejectError saying why not).

render (chat template rules + loss spans) -> read image headers (format, size: each image's
token count) -> tokenize -> expand each `<|image_pad|>` to its visual-token count -> length
policy -> decode, resize, patchify the images -> M-RoPE positions. Every check that needs no
pixels runs before any image is decoded, so bad and over-long rows cost little.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from shards_schema.positions import mrope_position_ids
from shards_schema.schema import Sample

from .errors import RejectError
from .images import DEFAULT_MAX_MEDIA_BYTES, decode_opened, header_grid, image_to_patches, open_image_source
from .profiles import Profile
from .render import lone_surrogate, render_conversation, surrogate_message, tokenize_rendered

DEFAULT_MAX_SEQ_LEN = 16384
DEFAULT_MAX_IMAGE_PIXELS = 178_956_970  # PIL's own decompression-bomb threshold


@dataclass(frozen=True)
class SampleOptions:
    """Per-row settings that decide a sample's bytes (all recorded in the manifest)."""

    max_seq_len: int = DEFAULT_MAX_SEQ_LEN
    truncate: bool = False
    loss_policy: str = "all_assistant"
    media_root: str | None = None
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES


def expand_image_pads(
    input_ids: np.ndarray, loss_mask: np.ndarray, tokens_per_image: np.ndarray, image_pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Repeat the k-th `<|image_pad|>` tokens_per_image[k] times (what the HF processor does to the text)."""
    is_pad = input_ids == image_pad_id
    n_pads = int(np.count_nonzero(is_pad))
    if n_pads != len(tokens_per_image):
        raise RejectError(
            "image_count_mismatch",
            f"text holds {n_pads} <|image_pad|> tokens but the conversation has {len(tokens_per_image)} images "
            "(does a text part contain the literal string <|image_pad|>?)",
        )
    repeats = np.ones(len(input_ids), dtype=np.int64)
    repeats[is_pad] = tokens_per_image
    return np.repeat(input_ids, repeats), np.repeat(loss_mask, repeats)


def _apply_length_policy(input_ids, loss_mask, profile: Profile, options: SampleOptions):
    length = len(input_ids)
    if length <= options.max_seq_len:
        return input_ids, loss_mask
    if not options.truncate:
        raise RejectError(
            "too_long",
            f"{length} tokens > --max-seq-len {options.max_seq_len}; raise --max-seq-len, or pass --truncate "
            "to cut the tail (never through an image)",
        )
    vision_ends = np.flatnonzero(input_ids == profile.special.vision_end)
    if len(vision_ends) and vision_ends[-1] >= options.max_seq_len:
        raise RejectError(
            "too_long",
            f"{length} tokens > --max-seq-len {options.max_seq_len} and the cut would fall inside or before "
            f"an image (last image ends at token {int(vision_ends[-1])})",
        )
    input_ids, loss_mask = input_ids[: options.max_seq_len], loss_mask[: options.max_seq_len]
    if not loss_mask.any():
        raise RejectError("no_targets", f"after truncation to {options.max_seq_len} tokens no target token is left")
    return input_ids, loss_mask


def row_sample_uid(row_id, default: str) -> str:
    """The row's `id` as its sample uid: a string or an integer; absent, null or "" -> `default`."""
    if row_id is None or row_id == "":
        return default
    if isinstance(row_id, bool) or not isinstance(row_id, (str, int)):
        raise RejectError(
            "bad_id",
            f"`id` must be a string or an integer, got {type(row_id).__name__} {ascii(row_id):.80}; "
            "fix the id, or leave it out to use input:row",
        )
    uid = str(row_id)
    at = lone_surrogate(uid)
    if at is not None:
        raise RejectError("bad_id", surrogate_message(uid[at], "`id`", at))
    return uid


@contextmanager
def _image_rejects(k: int):
    """Name the image in its reject message."""
    try:
        yield
    except RejectError as exc:
        raise RejectError(exc.code, f"image {k}: {exc.message}") from None


def process_row(row, *, sample_uid: str, source: str, profile: Profile, options: SampleOptions) -> Sample:
    if not isinstance(row, dict):
        raise RejectError("bad_row", f"a row must be a JSON object with `messages`, got {type(row).__name__}")
    sample_uid = row_sample_uid(row.get("id"), sample_uid)
    rendered = render_conversation(
        row.get("messages"),
        family=profile.family,
        tools=row.get("tools"),
        loss_policy=options.loss_policy,
        special_tokens=profile.text_special_tokens,
    )
    if rendered.videos:
        raise RejectError("unsupported_video", "video parts are not written into shards by this version")
    vision = profile.vision
    images, header_grids = [], []
    for k, image_source in enumerate(rendered.image_sources):
        with _image_rejects(k):
            image = open_image_source(
                image_source, options.media_root, options.max_image_pixels, options.max_media_bytes
            )
            header_grids.append(header_grid(image, vision))
        images.append(image)
    tokens_per_image = np.asarray(header_grids, dtype=np.int64).reshape(-1, 3).prod(axis=1) // vision.merge_size**2

    input_ids, loss_mask = tokenize_rendered(rendered, profile.tokenizer)
    input_ids, loss_mask = expand_image_pads(input_ids, loss_mask, tokens_per_image, profile.special.image_pad)
    input_ids, loss_mask = _apply_length_policy(input_ids, loss_mask, profile, options)
    input_ids = np.ascontiguousarray(input_ids, dtype=np.int32)

    patches, grids = [], []
    for k in range(len(images)):
        image, images[k] = images[k], None  # each decoded image is freed before the next is decoded
        with _image_rejects(k):
            image_patches, grid = image_to_patches(decode_opened(image), vision)
            if sorted(grid) != sorted(header_grids[k]):  # EXIF orientation may only swap the sides
                raise RejectError("bad_image", f"decodes to grid {grid}, its header promised {header_grids[k]}")
        patches.append(image_patches)
        grids.append(grid)
    image_grid_thw = np.asarray(grids, dtype=np.int32).reshape(-1, 3)
    position_ids = mrope_position_ids(
        input_ids, image_grid_thw, image_pad_id=profile.special.image_pad, merge_size=vision.merge_size
    )
    pixel_patches = (
        np.concatenate(patches) if patches else np.zeros((0, vision.patch_row_width), dtype=np.uint8)
    )
    return Sample(
        sample_uid=sample_uid,
        source=source,
        input_ids=input_ids,
        loss_mask=np.ascontiguousarray(loss_mask, dtype=np.uint8),
        position_ids=position_ids,
        pixel_patches=pixel_patches,
        image_grid_thw=image_grid_thw,
    )
