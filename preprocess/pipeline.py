"""One input row -> one training sample (or a RejectError saying why not).

render (chat template rules + loss spans) -> read image headers and open videos (format,
size, frame count and rate: each one's token count) -> tokenize -> expand each `<|image_pad|>`
to its visual-token count and each `<|video_pad|>` to the video's tokens (on Qwen3-VL one
`<t seconds><|vision_start|>...<|vision_end|>` block per temporal patch, as HF's processor
writes them) -> length policy -> decode, resize, patchify the images and the sampled video
frames -> M-RoPE positions. Every check that needs no pixels runs before anything is decoded,
so bad and over-long rows cost little; a text too long for --max-seq-len by its length alone is
rejected (or under --truncate cut to a head) before it is tokenized (text_budget.py).
"""

from __future__ import annotations

import dataclasses

from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np

from shards_schema.positions import mrope_position_ids
from shards_schema.schema import Sample
from shards_schema.flags import Flag, integer_from, nested, positive_bytes, positive_seconds, setting
from shards_schema.storage import MAX_FETCH_RETRIES, FetchPolicy

from .errors import RejectError
from .images import DEFAULT_MAX_MEDIA_BYTES, decode_opened, header_grid, image_to_patches, open_image_source
from .inputs import DEFAULT_MAX_ROW_BYTES
from .profiles import Profile
from .render import (IMAGE_PLACEHOLDER, LOSS_POLICIES, REASONING_LOSSES, VIDEO_PLACEHOLDER, Rendered, lone_surrogate,
                     render_conversation, surrogate_message, tokenize_rendered)
from .text_budget import might_exceed, utf8_length
from .video import DEFAULT_MAX_VIDEO_BYTES, VideoOptions, VideoPlan, open_video_source, plan_video, timestamps_for
from .video.patches import frames_to_patches

DEFAULT_MAX_SEQ_LEN = 16384
DEFAULT_MAX_IMAGE_PIXELS = 178_956_970  # PIL's own decompression-bomb threshold


@dataclass(frozen=True)
class SampleOptions:
    """Per-row settings that decide a sample's bytes (all recorded in the manifest, but for
    `remote_fetch`)."""

    # Fields in the order of their flags in `vlmpack preprocess --help` (shards_schema.flags).
    max_seq_len: int = setting(DEFAULT_MAX_SEQ_LEN, group="samples", type=int,
                               help="longer conversations are rejected (default %(default)s)")
    truncate: bool = setting(False, group="samples", action="store_true",
                             help="cut over-long conversations instead (never through an image)")
    loss_policy: str = setting("all_assistant", group="samples", choices=LOSS_POLICIES,
                               help="which assistant turns are targets: every one (default) or only the last")
    # Thinking template: "train" the reasoning too, or "mask" it (context only)
    reasoning_loss: str = setting("train", group="samples", choices=REASONING_LOSSES,
                                  help="Thinking templates (qwen3-vl-thinking, qwen3.5, qwen3.6): train the reasoning "
                                       "inside <think> too (default), or mask it (context only; the answer after "
                                       "</think> is still a target)")
    # the official templates' variables of these names (apply_chat_template's keyword arguments)
    add_vision_id: bool = setting(False, group="samples", action="store_true",
                                  help="write 'Picture n: ' / 'Video n: ' before each image and video, numbered "
                                       "through the conversation, as the template's add_vision_id does")
    preserve_thinking: bool = setting(
        False, group="samples", action="store_true",
        help="Qwen3.6's template: keep the <think> block of every assistant turn, not only those after the last "
             "user message, so multi-turn rows with reasoning in earlier turns train instead of being rejected "
             "as dropped_by_template (refused for templates without this variable)")
    media_root: str | None = setting(None, group="samples",
                                     help="directory that image file paths resolve under (never outside it)")
    # fetch s3://, gs://, hf://, https:// media (off: batch jobs do not fetch)
    allow_remote_media: bool = setting(
        False, group="samples", action="store_true",
        help="fetch media given as s3://, gs://, hf:// or https:// URLs (through fsspec, credentials from "
             "each store's environment; off by default: a URL is rejected as remote_url)")
    max_image_pixels: int = setting(DEFAULT_MAX_IMAGE_PIXELS, group="samples", type=int,
                                    help="reject images with more pixels (decompression bombs)")
    max_media_bytes: int = setting(
        DEFAULT_MAX_MEDIA_BYTES, group="samples", type=positive_bytes,
        help="reject an image file, data URI or base64 image holding more bytes, checked before it is "
             "read or decoded (default %(default)s = 128 MiB); there is no 'unlimited': a mislabelled "
             "multi-gigabyte file would be read whole, so raise it instead")
    # an input row holding more is rejected unread (preprocess.inputs)
    max_row_bytes: int = setting(
        DEFAULT_MAX_ROW_BYTES, group="samples", type=positive_bytes,
        help="reject an input row holding more bytes (a JSONL line, a JSON array element, a Parquet or "
             "datasets row) without reading the rest of it into memory (default %(default)s = 256 MiB, "
             "room for a --max-media-bytes image in base64); raise it together with --max-media-bytes")
    # how long a fetch waits and how often it is retried: decides no sample's bytes, so it is left
    # out of the job's identity (a job resumed with more patience is the same job)
    remote_fetch: FetchPolicy = nested(FetchPolicy(), prefix="remote_", flags={
        # the command line's default None tells a flag left out from one given: given without
        # --allow-remote-media it would act on nothing, and is refused (`flags_acting_only_with`)
        "timeout": Flag(group="samples", argparse={"type": positive_seconds, "metavar": "SECONDS", "default": None},
                        help=f"with --allow-remote-media: seconds a fetch waits to connect, and for each piece of "
                             f"data, before it gives up (default {FetchPolicy.timeout}; http(s):// and s3://); a row "
                             f"whose media never comes is rejected as remote_unreachable and the job goes on"),
        "retries": Flag(group="samples", argparse={"type": integer_from(0, MAX_FETCH_RETRIES), "metavar": "N",
                                                   "default": None},
                        help=f"with --allow-remote-media: further attempts after a fetch times out, is refused or "
                             f"gets a server error, {FetchPolicy.backoff:g} s after the first failure and twice as "
                             f"long after each further one (default {FetchPolicy.retries}, at most {MAX_FETCH_RETRIES})"),
    })
    video: VideoOptions = nested(VideoOptions(), prefix="video_")
    # a video too long for max_seq_len alone is sampled with fewer frames
    video_fit: bool = setting(False, group="videos", action="store_true",
                              help="a video that alone needs more than --max-seq-len tokens is sampled with fewer "
                                   "frames until it fits (default: rejected as video_too_long)")
    max_video_bytes: int = setting(DEFAULT_MAX_VIDEO_BYTES, group="videos", type=positive_bytes,
                                   help="reject a video file or inline video holding more bytes (default "
                                        "%(default)s = 4 GiB); files are streamed by the decoder, never read whole")

    @property
    def template_variables(self) -> dict[str, bool]:
        """The chat template's variables this job sets (`apply_chat_template`'s keywords)."""
        return {name: True for name in ("add_vision_id", "preserve_thinking") if getattr(self, name)}

    @property
    def remote(self) -> FetchPolicy | None:
        """How media URLs are fetched; None when they are rejected (`remote_url`)."""
        return self.remote_fetch if self.allow_remote_media else None


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


def _group_seconds(plan: VideoPlan, profile: Profile):
    """Each temporal group's time, for layouts that write it (computed only when asked)."""
    return lambda: timestamps_for(plan.indices, plan.fps, profile.vision.temporal_patch_size)


def _encode(profile: Profile):
    return lambda text: profile.tokenizer.encode(text, add_special_tokens=False).ids


def video_tokens(plan: VideoPlan, profile: Profile) -> np.ndarray:
    """The tokens that stand for one video in the text, in place of its single `<|video_pad|>`,
    in the family's layout (`video_tokens` of its shard rules: on Qwen2.5-VL the pad repeated
    t*h*w/m^2 times; on Qwen3-VL per temporal patch its timestamp `<{t:.1f} seconds>` as text,
    then `<|vision_start|>`, h*w/m^2 pads, `<|vision_end|>`); the template's own vision_start/end
    stay around it.
    """
    return profile.family_rules.shard_rules.video_tokens(
        plan.grid, merge_size=profile.vision.merge_size, special=dataclasses.asdict(profile.special),
        group_seconds=_group_seconds(plan, profile), encode=_encode(profile))


def expand_video_pads(input_ids: np.ndarray, loss_mask: np.ndarray, expansions: list[np.ndarray],
                      video_pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Replace the k-th `<|video_pad|>` by expansions[k] (never targets)."""
    at = np.flatnonzero(input_ids == video_pad_id)
    if len(at) != len(expansions):
        raise RejectError("image_count_mismatch", f"text holds {len(at)} <|video_pad|> tokens but the conversation "
                          f"has {len(expansions)} videos")
    ids, mask, prev = [], [], 0
    for k, pos in enumerate(at.tolist()):
        ids += [input_ids[prev:pos], expansions[k]]
        mask += [loss_mask[prev:pos], np.zeros(len(expansions[k]), dtype=loss_mask.dtype)]
        prev = pos + 1
    ids.append(input_ids[prev:])
    mask.append(loss_mask[prev:])
    return np.concatenate(ids), np.concatenate(mask)


def _apply_length_policy(input_ids, loss_mask, profile: Profile, options: SampleOptions):
    length = len(input_ids)
    if length <= options.max_seq_len:
        return input_ids, loss_mask
    if not options.truncate:
        raise RejectError(
            "too_long",
            f"{length} tokens > --max-seq-len {options.max_seq_len}; raise --max-seq-len, or pass --truncate "
            "to cut the tail (never through an image or a video)",
        )
    vision_ends = np.flatnonzero(input_ids == profile.special.vision_end)
    if len(vision_ends) and vision_ends[-1] >= options.max_seq_len:
        raise RejectError(
            "too_long",
            f"{length} tokens > --max-seq-len {options.max_seq_len} and the cut would fall inside or before "
            f"an image or a video (the last one ends at token {int(vision_ends[-1])})",
        )
    input_ids, loss_mask = input_ids[: options.max_seq_len], loss_mask[: options.max_seq_len]
    if not loss_mask.any():
        raise RejectError("no_targets", f"after truncation to {options.max_seq_len} tokens no target token is left")
    return input_ids, loss_mask


def _within_reach(rendered: Rendered, profile: Profile, options: SampleOptions) -> Rendered:
    """`rendered`, or under --truncate the head of it worth tokenizing. Tokenizing costs about
    140 bytes of memory per byte of text, so a text that makes more than --max-seq-len tokens by
    its length alone (`TextBudget`) is rejected before it reaches the tokenizer, and under
    --truncate only a head of it that makes the same first tokens is tokenized."""
    text, limit, tokenizer = rendered.text, options.max_seq_len, profile.tokenizer
    if not might_exceed(text, limit, tokenizer):
        return rendered
    budget = profile.text_budget
    fewest = budget.fewest_tokens(text, tokenizer)
    if fewest <= limit:
        return rendered
    length = (f"{utf8_length(text):,} bytes of text make at least {fewest:,} tokens (no token is longer than "
              f"{budget.longest_token_bytes} bytes) > --max-seq-len {limit}")
    if not options.truncate:
        raise RejectError("too_long", f"{length}; raise --max-seq-len, or pass --truncate to cut the tail")
    end = budget.head_end(text, limit, tokenizer)
    if end is None:
        raise RejectError("too_long", f"{length}, and --truncate finds no place to cut it where the tokenizer would "
                          "split it anyway (a word's end); shorten the text")
    if (text.count(IMAGE_PLACEHOLDER, 0, end) != len(rendered.image_sources)
            or text.count(VIDEO_PLACEHOLDER, 0, end) != len(rendered.videos)):
        raise RejectError("too_long", f"{length} and the cut would fall inside or before an image or a video")
    spans = [(start, min(stop, end)) for start, stop in rendered.target_spans if start < end]
    return dataclasses.replace(rendered, text=text[:end], target_spans=spans)


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


def _check_visual_tokens(counts: list[int], options: SampleOptions) -> None:
    """Images and videos that alone take more than --max-seq-len tokens make a row too long
    whatever its text, with --truncate too (a cut never goes through one): refused before their
    pads are expanded, so a huge count never becomes an array."""
    total = sum(counts)
    if total > options.max_seq_len:
        raise RejectError("too_long", f"the row's images and videos alone take {total} tokens, more than "
                          f"--max-seq-len {options.max_seq_len}; raise --max-seq-len or shrink them (max_pixels)")


@contextmanager
def _named_rejects(what: str):
    """Name the image or video in its reject message."""
    try:
        yield
    except RejectError as exc:
        raise RejectError(exc.code, f"{what}: {exc.message}") from None


def video_token_count(plan: VideoPlan, profile: Profile, limit: int) -> int:
    """The length of `video_tokens(plan, profile)`, counted without building it: exact when the
    video has at most `limit` temporal patches, else a lower bound (each of Qwen3-VL's
    timestamps takes at least one token), which is then over `limit` too."""
    return profile.family_rules.shard_rules.video_token_count(
        plan.grid, merge_size=profile.vision.merge_size, group_seconds=_group_seconds(plan, profile),
        encode=_encode(profile), limit=limit)


def _check_frame_count(part, profile: Profile, options: SampleOptions):
    """Before a video is opened: a part whose frames (`nframes`, or a list of frames) alone need
    more tokens than --max-seq-len, each temporal patch taking at least one, is `video_too_long`
    at once; with --video-fit an `nframes` is lowered to what could fit. The request to plan."""
    temporal, budget = profile.vision.temporal_patch_size, options.max_seq_len
    frame_list = isinstance(part.source, list)
    asked = len(part.source) if frame_list else part.request.nframes
    if asked is None or asked // temporal <= budget:
        return part.request
    if options.video_fit and not frame_list:
        return replace(part.request, nframes=budget * temporal)
    what, fix = (("frames are given", "give fewer frames") if frame_list
                 else ("frames are asked for (`nframes`)", "lower nframes, pass --video-fit"))
    raise RejectError("video_too_long", f"{asked} {what}: at least {asked // temporal} tokens (one per {temporal} "
                      f"frames), more than --max-seq-len {budget} alone; {fix} or raise --max-seq-len")


def _plan_fitting(info, part, request, profile: Profile, options: SampleOptions) -> tuple[VideoPlan, np.ndarray]:
    """The video's plan; one that alone needs more than --max-seq-len tokens is `video_too_long`,
    or with --video-fit is planned again with fewer frames (`nframes`, as the HF processor
    takes it) until it fits. Tokens are counted before they are built, so a plan asking for
    millions of them costs nothing."""
    vision, frame_list = profile.vision, isinstance(part.source, list)

    def plan_for(request):
        plan = plan_video(info.total_frames, info.fps, info.height, info.width, request=request, options=options.video,
                          family=profile.family_rules, defaults=profile.video, patch_size=vision.patch_size,
                          merge_size=vision.merge_size, temporal_patch_size=vision.temporal_patch_size,
                          all_frames=frame_list)
        return plan, video_token_count(plan, profile, options.max_seq_len)

    plan, count = plan_for(request)
    first = (len(plan.indices), plan.height, plan.width, count)
    step = vision.temporal_patch_size
    while count > options.max_seq_len and options.video_fit and not frame_list and len(plan.indices) > step:
        frames = len(plan.indices)
        fewer = max(step, min(frames - step, frames * options.max_seq_len // count) // step * step)
        plan, count = plan_for(replace(request, fps=None, nframes=fewer))
    if count > options.max_seq_len:
        frames, height, width, need = first
        raise RejectError(
            "video_too_long",
            f"{frames} frames at {height}x{width} make {need} tokens, more than --max-seq-len {options.max_seq_len} "
            "alone; lower the video's fps, max_frames or max_pixels, raise --max-seq-len, or pass --video-fit"
            + (f" (with --video-fit, {len(plan.indices)} frames still make {count})" if options.video_fit else ""))
    return plan, video_tokens(plan, profile)


def _open_videos(rendered, profile: Profile, options: SampleOptions) -> tuple[list, list[tuple[VideoPlan, np.ndarray]]]:
    """Open each video (no frame decoded) and plan its frames: the readers, and each plan with its tokens."""
    readers, plans = [], []
    try:
        for k, part in enumerate(rendered.videos):
            with _named_rejects(f"video {k}"):
                request = _check_frame_count(part, profile, options)
                reader = open_video_source(
                    part.source, request=part.request, media_root=options.media_root,
                    max_video_bytes=options.max_video_bytes, remote=options.remote,
                    max_frame_pixels=options.max_image_pixels,
                    open_image=lambda source: open_image_source(source, options.media_root, options.max_image_pixels,
                                                                options.max_media_bytes, options.remote),
                    decode_image=decode_opened)
                readers.append(reader)
                plans.append(_plan_fitting(reader.info, part, request, profile, options))  # (plan, its tokens)
    except BaseException:
        for reader in readers:
            reader.close()
        raise
    return readers, plans


def _video_patches(readers: list, plans: list[VideoPlan], vision) -> tuple[list[np.ndarray], list[tuple]]:
    rows, grids = [], []
    for k, (reader, plan) in enumerate(zip(readers, plans)):
        with _named_rejects(f"video {k}"):
            try:
                frames = (frame for _, frame in reader.frames(plan.indices))
                video_rows, grid = frames_to_patches(frames, len(plan.indices), plan.height, plan.width,
                                                     patch_size=vision.patch_size, merge_size=vision.merge_size,
                                                     temporal_patch_size=vision.temporal_patch_size)
            finally:
                reader.close()
        rows.append(video_rows)
        grids.append(grid)
    return rows, grids


def process_row(row, *, sample_uid: str, source: str, profile: Profile, options: SampleOptions) -> Sample:
    if not isinstance(row, dict):
        raise RejectError("bad_row", f"a row must be a JSON object with `messages`, got {type(row).__name__}")
    sample_uid = row_sample_uid(row.get("id"), sample_uid)
    rendered = render_conversation(
        row.get("messages"),
        family=profile.family_rules,
        tools=row.get("tools"),
        loss_policy=options.loss_policy,
        special_tokens=profile.text_special_tokens,
        template=profile.template,
        reasoning_loss=options.reasoning_loss,
        **options.template_variables,
    )
    rendered = _within_reach(rendered, profile, options)
    vision = profile.vision
    images, header_grids, image_visions = [], [], []
    for k, image_source in enumerate(rendered.image_sources):
        with _named_rejects(f"image {k}"):
            image_visions.append(rendered.image_requests[k].vision(vision))  # the part's own bounds, if any
            image = open_image_source(image_source, options.media_root, options.max_image_pixels,
                                      options.max_media_bytes, options.remote)
            header_grids.append(header_grid(image, image_visions[k]))
        images.append(image)
    tokens_per_image = [t * h * w // vision.merge_size**2 for t, h, w in header_grids]
    _check_visual_tokens(tokens_per_image, options)

    readers, planned = _open_videos(rendered, profile, options)
    plans = [plan for plan, _ in planned]
    try:
        _check_visual_tokens(tokens_per_image + [len(tokens) for _, tokens in planned], options)
        input_ids, loss_mask = tokenize_rendered(rendered, profile.tokenizer)
        input_ids, loss_mask = expand_image_pads(input_ids, loss_mask, tokens_per_image, profile.special.image_pad)
        input_ids, loss_mask = expand_video_pads(input_ids, loss_mask, [tokens for _, tokens in planned],
                                                 profile.special.video_pad)
        input_ids, loss_mask = _apply_length_policy(input_ids, loss_mask, profile, options)
    except BaseException:
        for reader in readers:
            reader.close()
        raise
    input_ids = np.ascontiguousarray(input_ids, dtype=np.int32)
    video_rows, video_grids = _video_patches(readers, plans, vision)

    patches, grids = [], []
    for k in range(len(images)):
        image, images[k] = images[k], None  # each decoded image is freed before the next is decoded
        with _named_rejects(f"image {k}"):
            image_patches, grid = image_to_patches(decode_opened(image), image_visions[k])
            if sorted(grid) != sorted(header_grids[k]):  # EXIF orientation may only swap the sides
                raise RejectError("bad_image", f"decodes to grid {grid}, its header promised {header_grids[k]}")
        patches.append(image_patches)
        grids.append(grid)
    image_grid_thw = np.asarray(grids, dtype=np.int32).reshape(-1, 3)
    video_grid_thw = np.asarray(video_grids, dtype=np.int32).reshape(-1, 3)
    second_per_grid_ts = np.asarray([p.second_per_grid_t for p in plans], dtype=np.float32)
    videos = None
    if plans:
        videos = profile.family_rules.shard_rules.video_positions(
            video_pad_id=profile.special.video_pad, video_grid_thw=video_grid_thw,
            second_per_grid_ts=second_per_grid_ts, tokens_per_second=profile.tokens_per_second)
    position_ids = mrope_position_ids(
        input_ids, image_grid_thw, image_pad_id=profile.special.image_pad, merge_size=vision.merge_size, video=videos
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
        video_patches=(np.concatenate(video_rows) if video_rows
                       else np.zeros((0, vision.pixel_values_row_width), dtype=np.uint8)),
        video_grid_thw=video_grid_thw,
        second_per_grid_ts=second_per_grid_ts,
    )
