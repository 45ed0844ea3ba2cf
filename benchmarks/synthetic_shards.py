"""A realistic synthetic Qwen-VL training mix, written directly as a vlmpack shard directory.

No image is decoded and no text is tokenized per sample: token ids and uint8 patches are
drawn at random, so a GPU host writes a few GB of shards in seconds. Everything else is what
`vlmpack preprocess --profile qwen3-vl|qwen2.5-vl` writes (`preprocess/job/`): the chat
structure of a rendered conversation (Qwen2.5-VL's template adds its default system turn
when a conversation has none), `<|image_pad|>` runs matching each image grid, assistant-only loss
masks, M-RoPE positions from `shards_schema.positions.mrope_position_ids` (the function
oracle-tested against HF `get_rope_index`), `ShardWriter` shards, per-unit records in
`_parts/`, `rejects.jsonl` and the manifest from `preprocess.job.write_final_outputs`, whose
`profile` is the real built-in profile's fingerprint. `vlmpack verify DIR` passes on it.

Per sample (seeded per sample index, so a sample does not depend on the sample count):
* 0-3 images (weights --image-count-weights), each of U(--image-tokens) merged tokens:
  grid (1, 2*hm, 2*wm) with hm*wm in range and an aspect ratio in [1/2, 2]; pixel_patches
  are random uint8 [4*hm*wm, patch row width] (one temporal frame, merge-block order is
  irrelevant for random bytes);
* with probability --video-prob, one video in the first user turn: U(--video-seconds) of a
  30 fps source sampled at the profile's 2 fps (an even frame count, as the processor pads),
  U(--video-tokens) merged tokens spread over its temporal groups, each group's grid drawn like
  an image's; its tokens are what `vlmpack preprocess` writes for such a video (Qwen3-VL's
  `<t seconds>` + `<|vision_start|>` + pads + `<|vision_end|>` per group, Qwen2.5-VL's one pad
  run and `second_per_grid_ts`), its video_patches random uint8 rows of both frames; a video
  draws from its own seeded stream, so --video-prob 0 leaves every other draw as it was;
* U(--text-tokens) non-image tokens (structure included): an optional system turn (20 %),
  1-3 user/assistant turns; each user turn is `<|im_start|>user\\n` + its images
  (`<|vision_start|>` + N x `<|image_pad|>` + `<|vision_end|>`) + text + `<|im_end|>\\n`, each
  assistant turn `<|im_start|>assistant\\n` + text + `<|im_end|>\\n`; text ids are uniform in
  [0, 151643) (no special tokens);
* loss_mask 1 on assistant content and its `<|im_end|>` (preprocess's `all_assistant` policy);
* a sample never exceeds --max-tokens (the training seq_len): images are dropped, then text
  shortened, until it fits.

    python benchmarks/synthetic_shards.py OUT_DIR --samples 400 --seed 0 --max-tokens 16384 [--profile qwen2.5-vl] [--video-prob 0.3]
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from common import parser

from preprocess.job import JOB_FILE, shard_name, unit_record_path, write_final_outputs
from preprocess.pipeline import SampleOptions, video_tokens
from preprocess.video import VideoPlan
from preprocess.profiles import resolve_profile
from preprocess.render import IM_END, IM_START, render_conversation
from shards_schema.atomic import write_json_atomic
from shards_schema.manifest import PARTS_DIR
from shards_schema.positions import mrope_position_ids
from shards_schema.schema import Sample
from shards_schema.writer import ShardWriter

FIRST_SPECIAL_ID = 151643  # ids below are ordinary BPE tokens
MIN_TEXT_TOKENS = 40  # a sample keeps at least this many non-image tokens when shortened


@dataclass(frozen=True)
class SyntheticSpec:
    num_samples: int
    seed: int = 0
    text_tokens: tuple[int, int] = (100, 3000)  # non-image tokens per sample (structure included)
    image_tokens: tuple[int, int] = (64, 1300)  # merged (LLM) tokens per image
    image_count_weights: tuple[float, ...] = (0.2, 0.45, 0.25, 0.1)  # P(0, 1, 2, 3 images)
    max_tokens: int = 16384  # no sample is longer (the training seq_len)
    max_turns: int = 3
    system_prob: float = 0.2
    rows_per_shard: int = 256
    video_prob: float = 0.0  # P(a sample holds one video)
    video_seconds: tuple[float, float] = (4.0, 60.0)
    video_tokens: tuple[int, int] = (256, 4096)  # merged (LLM) tokens per video, all groups


class _Tokens:
    """The structural token ids, from the profile's own tokenizer (not hard-coded)."""

    def __init__(self, profile):
        enc = lambda text: profile.tokenizer.encode(text, add_special_tokens=False).ids
        sp = profile.special
        self.user_header = enc("<|im_start|>user\n")
        self.assistant_header = enc("<|im_start|>assistant\n")
        self.system_header = enc("<|im_start|>system\n")
        self.turn_end = enc("<|im_end|>\n")  # [im_end, "\n"]
        self.vision_start, self.vision_end, self.image_pad = sp.vision_start, sp.vision_end, sp.image_pad
        self.im_end = sp.im_end
        # the system turn the profile's template writes when a conversation has none: what it
        # renders before the first user turn of a conversation without one
        written = render_conversation([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                                      family=profile.family_rules,
                                      template=profile.template).text.split(IM_START + "user\n")[0]
        system_turn = IM_START + "system\n"
        self.default_system = enc(written.removeprefix(system_turn).removesuffix(IM_END + "\n")) if written else []
        if self.turn_end[0] != sp.im_end or self.assistant_header[1] != sp.assistant:
            raise RuntimeError(f"unexpected chat token ids {self.turn_end}, {self.assistant_header}")


def _image_grid(rng: np.random.Generator, lo: int, hi: int, merge: int) -> tuple[int, int]:
    """(h, w) in patches, both multiples of `merge`, with lo <= (h/m)*(w/m) <= hi."""
    n = int(rng.integers(lo, hi + 1))
    aspect = float(np.exp(rng.uniform(np.log(0.5), np.log(2.0))))
    hm = max(1, round(float(np.sqrt(n * aspect))))
    wm = max(1, round(n / hm))
    while hm * wm > hi:
        wm -= 1
    while hm * wm < lo:
        wm += 1
    return hm * merge, wm * merge


def _split(rng: np.random.Generator, total: int, weights: np.ndarray) -> list[int]:
    """`total` tokens over segments (>= 1 each), proportional to random draws scaled by weights."""
    share = rng.gamma(2.0, 1.0, size=len(weights)) * weights
    raw = np.floor(share / share.sum() * max(total - len(weights), 0)).astype(int) + 1
    raw[int(np.argmax(weights * share))] += total - int(raw.sum())  # the rounding remainder
    return [max(1, int(x)) for x in raw]


SOURCE_FPS, SAMPLE_FPS = 30.0, 2.0


def _video_plan(rng: np.random.Generator, spec: SyntheticSpec, vision) -> VideoPlan:
    merge, temporal, patch = vision.merge_size, vision.temporal_patch_size, vision.patch_size
    seconds = float(rng.uniform(*spec.video_seconds))
    frames = max(temporal, int(seconds * SAMPLE_FPS) // temporal * temporal)
    groups = frames // temporal
    budget = int(rng.integers(spec.video_tokens[0], spec.video_tokens[1] + 1))
    per_group = max(1, budget // groups)
    gh, gw = _image_grid(rng, per_group, per_group, merge)
    step = SOURCE_FPS / SAMPLE_FPS
    return VideoPlan(indices=(np.arange(frames) * step).astype(np.int64), fps=SOURCE_FPS, height=gh * patch,
                     width=gw * patch, grid=(groups, gh, gw), second_per_grid_t=temporal / SAMPLE_FPS)


def make_sample(index: int, spec: SyntheticSpec, tokens: _Tokens, profile, source: str) -> Sample:
    vision = profile.vision
    patch_row_width, merge = vision.patch_row_width, vision.merge_size
    rng = np.random.default_rng([spec.seed, index])
    video_rng = np.random.default_rng([spec.seed, index, 1])
    video = None
    if spec.video_prob and video_rng.random() < spec.video_prob:
        video = _video_plan(video_rng, spec, vision)
        video_ids = np.concatenate([[tokens.vision_start], video_tokens(video, profile), [tokens.vision_end]])
    weights = np.asarray(spec.image_count_weights, dtype=np.float64)
    n_images = int(rng.choice(len(weights), p=weights / weights.sum()))
    grids = [_image_grid(rng, spec.image_tokens[0], spec.image_tokens[1], merge) for _ in range(n_images)]
    text_total = int(rng.integers(spec.text_tokens[0], spec.text_tokens[1] + 1))
    n_turns = int(rng.integers(1, spec.max_turns + 1))
    system = bool(rng.random() < spec.system_prob)

    def image_cost(gs):
        return sum(h * w // merge // merge + 2 for h, w in gs) + (len(video_ids) if video is not None else 0)

    # Structure: system turn 5 tokens + content; user/assistant turns 5 tokens each + content.
    header = len(tokens.system_header) + len(tokens.turn_end)
    default_system = [] if system else tokens.default_system
    fixed = header + len(default_system) if default_system else 0
    while grids and image_cost(grids) + MIN_TEXT_TOKENS + fixed > spec.max_tokens:
        grids.pop()
    if video is not None and image_cost(grids) + MIN_TEXT_TOKENS + fixed > spec.max_tokens:
        video = None  # too long for the budget even alone, as preprocess rejects video_too_long
    text_total = max(min(text_total, spec.max_tokens - image_cost(grids)), 1)
    structure = fixed + (header if system else 0) + n_turns * 2 * header
    while n_turns > 1 and structure + 2 * n_turns + int(system) > text_total:
        n_turns -= 1
        structure -= 2 * header
    segments = (["system"] if system else []) + ["user", "assistant"] * n_turns
    seg_weights = np.array([{"system": 0.4, "user": 1.0, "assistant": 1.6}[s] for s in segments])
    content = _split(rng, max(text_total - structure, len(segments)), seg_weights)
    image_turn = np.sort(rng.integers(0, n_turns, size=len(grids))) if grids else np.zeros(0, int)

    ids: list[np.ndarray] = []
    mask: list[np.ndarray] = []

    def add(values, target: bool = False):
        arr = np.asarray(values, dtype=np.int32)
        ids.append(arr)
        mask.append(np.full(arr.shape[0], int(target), dtype=np.uint8))

    def text(n: int):
        return rng.integers(0, FIRST_SPECIAL_ID, size=n, dtype=np.int32)

    if default_system:
        add(tokens.system_header)
        add(default_system)
        add(tokens.turn_end)
    turn = 0
    for kind, n in zip(segments, content):
        if kind == "system":
            add(tokens.system_header)
            add(text(n))
            add(tokens.turn_end)
        elif kind == "user":
            add(tokens.user_header)
            if turn == 0 and video is not None:
                add(video_ids)
            for k in np.flatnonzero(image_turn == turn).tolist():
                h, w = grids[k]
                add([tokens.vision_start] + [tokens.image_pad] * (h * w // merge // merge) + [tokens.vision_end])
            add(text(n))
            add(tokens.turn_end)
        else:
            add(tokens.assistant_header)
            add(text(n), target=True)
            add(tokens.turn_end[:1], target=True)  # <|im_end|> is a target, the "\n" after it is not
            add(tokens.turn_end[1:])
            turn += 1

    input_ids = np.concatenate(ids)
    loss_mask = np.concatenate(mask)
    grid_thw = np.asarray([(1, h, w) for h, w in grids], dtype=np.int32).reshape(-1, 3)
    n_patches = int(grid_thw.prod(axis=1).sum()) if len(grids) else 0
    pixels = np.frombuffer(rng.bytes(n_patches * patch_row_width), dtype=np.uint8).reshape(n_patches, patch_row_width)
    videos, video_fields = None, {}
    if video is not None:
        video_grid = np.asarray([video.grid], dtype=np.int32)
        spg = np.asarray([video.second_per_grid_t], dtype=np.float32)
        rows = int(np.prod(video.grid))
        video_fields = dict(
            video_patches=np.frombuffer(video_rng.bytes(rows * vision.pixel_values_row_width), dtype=np.uint8).reshape(
                rows, vision.pixel_values_row_width),
            video_grid_thw=video_grid, second_per_grid_ts=spg)
        videos = profile.family_rules.shard_rules.video_positions(
            video_pad_id=profile.special.video_pad, video_grid_thw=video_grid, second_per_grid_ts=spg,
            tokens_per_second=profile.tokens_per_second)
    else:
        video_fields = dict(video_patches=np.zeros((0, vision.pixel_values_row_width), dtype=np.uint8))
    positions = mrope_position_ids(input_ids, grid_thw, image_pad_id=tokens.image_pad, merge_size=merge, video=videos)
    return Sample(sample_uid=source, source=source, input_ids=input_ids, loss_mask=loss_mask,
                  position_ids=positions, pixel_patches=pixels, image_grid_thw=grid_thw, **video_fields)


def write_synthetic_shards(out: str | Path, spec: SyntheticSpec, *, profile_name: str = "qwen3-vl",
                           overwrite: bool = True, log=print) -> dict:
    """Write `spec.num_samples` samples into shard directory `out`; returns the manifest.

    The directory mirrors a finished `vlmpack preprocess` job: `_parts/job.json`, one unit
    record per shard, the shards, `rejects.jsonl` (empty) and `manifest.json` (written last)."""
    out = Path(out)
    if out.exists():
        if not overwrite:
            raise FileExistsError(f"{out} exists")
        shutil.rmtree(out)
    started = time.perf_counter()
    profile = resolve_profile(profile_name)
    tokens = _Tokens(profile)
    vision = profile.vision
    options = SampleOptions(max_seq_len=spec.max_tokens)
    input_path = f"synthetic:seed={spec.seed}"
    inputs = [{"path": input_path, "format": "synthetic", "rows": spec.num_samples, "bytes": 0}]
    identity = json.loads(json.dumps({
        "profile": profile.fingerprint,
        "settings": {**dataclasses.asdict(options), "rows_per_shard": spec.rows_per_shard},
        "inputs": inputs,
        "num_partitions": 1,
    }))
    (out / PARTS_DIR).mkdir(parents=True)
    write_json_atomic(out / PARTS_DIR / JOB_FILE, identity)
    records = []
    for unit, start in enumerate(range(0, spec.num_samples, spec.rows_per_shard)):
        stop = min(start + spec.rows_per_shard, spec.num_samples)
        unit_started = time.perf_counter()
        writer = ShardWriter(out / shard_name(unit), vision.patch_row_width)
        try:
            for i in range(start, stop):
                writer.add(make_sample(i, spec, tokens, profile, f"{input_path}:{i}"))
        except BaseException:
            writer.abort()
            raise
        shard = writer.close().to_json()
        record = {"unit": unit, "input": input_path, "start": start, "stop": stop, "rows_read": stop - start,
                  "rows_written": shard["rows"], "rows_rejected": 0, "shard": shard, "rejects": [],
                  "seconds": round(time.perf_counter() - unit_started, 3)}
        write_json_atomic(unit_record_path(out, unit), record)
        records.append(record)
    manifest = write_final_outputs(out, identity, records, vision.patch_row_width)
    t = manifest["totals"]
    if log:
        log(f"synthetic shards: {t['rows']} samples, {t['tokens']:,} tokens ({t['target_tokens']:,} targets), "
            f"{t['images']} images, {t['patches']:,} patches, {t.get('videos', 0)} videos, "
            f"{t.get('video_patches', 0):,} video patches, {t['bytes'] / 2**20:,.1f} MiB in {t['shards']} shards "
            f"-> {out} ({time.perf_counter() - started:.1f} s)")
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, json_out=None)
    ap.add_argument("out", help="shard directory to write")
    ap.add_argument("--samples", type=int, default=400, help="samples to write")
    ap.add_argument("--seed", type=int, default=0, help="seed (each sample is seeded by its index from it)")
    ap.add_argument("--max-tokens", type=int, default=16384, help="longest sample (the training seq_len)")
    ap.add_argument("--text-tokens", type=int, nargs=2, default=(100, 3000), metavar=("MIN", "MAX"),
                    help="non-image tokens per sample")
    ap.add_argument("--image-tokens", type=int, nargs=2, default=(64, 1300), metavar=("MIN", "MAX"),
                    help="merged tokens per image")
    ap.add_argument("--image-count-weights", type=float, nargs="+", default=(0.2, 0.45, 0.25, 0.1),
                    help="weights of 0, 1, 2, 3 images per sample")
    ap.add_argument("--video-prob", type=float, default=0.0, help="probability that a sample holds one video")
    ap.add_argument("--video-seconds", type=float, nargs=2, default=(4.0, 60.0), metavar=("MIN", "MAX"),
                    help="length of a video in seconds (sampled at 2 fps)")
    ap.add_argument("--video-tokens", type=int, nargs=2, default=(256, 4096), metavar=("MIN", "MAX"),
                    help="merged tokens per video, over all its temporal groups")
    ap.add_argument("--rows-per-shard", type=int, default=256, help="samples per shard file")
    ap.add_argument("--profile", default="qwen3-vl", help="built-in preprocessing profile (qwen3-vl | qwen2.5-vl)")
    args = ap.parse_args(argv)
    spec = SyntheticSpec(num_samples=args.samples, seed=args.seed, text_tokens=tuple(args.text_tokens),
                         image_tokens=tuple(args.image_tokens), image_count_weights=tuple(args.image_count_weights),
                         max_tokens=args.max_tokens, rows_per_shard=args.rows_per_shard, video_prob=args.video_prob,
                         video_seconds=tuple(args.video_seconds), video_tokens=tuple(args.video_tokens))
    write_synthetic_shards(args.out, spec, profile_name=args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
