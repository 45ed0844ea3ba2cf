"""Synthetic OpenAI-format conversations with embedded images and videos: the quickstart's
dataset, and the input of tests and benchmarks. Deterministic for a seed; no download.

Images are drawn with PIL (gradients, shapes, noise, sometimes alpha or odd modes) at varied
sizes and encoded as base64 data URIs (JPEG or PNG), like real scraped VLM data. Videos are
moving gradients and edges encoded with PyAV (FFmpeg's encoders) in the codecs and
containers real data comes in.
"""

from __future__ import annotations

import base64
import io
import itertools
import json
import random
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from .families import BUILTIN_PROFILES, FAMILIES

WORDS = (
    "the a image shows cat dog street map chart table red blue green small large left right "
    "above below count how many what where why describe person car tree sign text number "
    "graph bar line value price total".split()
)
UNICODE_SNIPPETS = ("图像中有什么？", "это пример", "café ☕", "🚀 launch", "مرحبا")


def synthetic_image(rng: np.random.Generator, width: int, height: int, mode: str = "RGB") -> Image.Image:
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack(
        [(xx * 255 // max(width - 1, 1)), (yy * 255 // max(height - 1, 1)), ((xx + yy) * 127 // max(width + height, 1))],
        axis=-1,
    ).astype(np.int16)
    noise = rng.integers(-25, 26, size=base.shape, dtype=np.int16)
    img = Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(1, 5))):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        x1, y1 = x0 + int(rng.integers(1, max(2, width // 2))), y0 + int(rng.integers(1, max(2, height // 2)))
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x0, y0, x1, y1], fill=color)
    if mode == "RGBA":
        alpha = Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8), "L")
        img.putalpha(alpha)
    elif mode != "RGB":
        img = img.convert(mode)
    return img


def synthetic_video_frames(rng: np.random.Generator, num_frames: int, width: int, height: int):
    """`num_frames` RGB uint8 frames [H, W, 3]: a gradient that drifts, a bar that sweeps across
    and a little noise, so every frame differs from the one before it."""
    yy, xx = np.mgrid[0:height, 0:width]
    phase = rng.uniform(0, 2 * np.pi, 3)
    for k in range(num_frames):
        t = k / max(num_frames - 1, 1)
        frame = np.stack([
            127 + 120 * np.sin(2 * np.pi * xx / max(width, 1) + phase[0] + 4 * t),
            127 + 120 * np.sin(2 * np.pi * yy / max(height, 1) + phase[1] - 3 * t),
            127 + 120 * np.sin(2 * np.pi * (xx + yy) / max(width + height, 1) + phase[2] + 2 * t),
        ], axis=-1)
        bar = int(t * max(width - 1, 0))
        frame[:, max(bar - 2, 0):bar + 3] = 255
        frame += rng.normal(0, 6, frame.shape)
        yield np.clip(frame, 0, 255).astype(np.uint8)


VIDEO_CODECS = {  # container -> codec PyAV writes into it
    "mp4": "libx264",
    "mkv": "mpeg4",
    "webm": "libvpx-vp9",
    "avi": "mjpeg",
}


def write_video(path: str | Path, frames, fps: float, *, codec: str = "libx264", gop: int | None = None,
                rotate: int | None = None, pts_step=None) -> Path:
    """Encode RGB frames into `path` (the container from its suffix). `gop` is the keyframe
    interval; `pts_step(k)` gives frame k's duration in milliseconds (variable frame rate);
    `rotate` writes a display matrix that turns the picture `rotate` degrees counter-clockwise
    for display (as phones record portrait video; PyAV >= 18)."""
    import fractions

    import av

    path = Path(path)
    frames = iter(frames)
    first = next(frames)
    height, width = first.shape[:2]
    # bitexact: no random segment id or encoder string, so the same frames give the same bytes
    with av.open(str(path), mode="w", options={"fflags": "+bitexact"}) as container:
        rate = fractions.Fraction(fps).limit_denominator(1001)
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height = width - width % 2, height - height % 2
        stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "18", "preset": "ultrafast"}
        if gop is not None:
            stream.codec_context.gop_size = gop
        if rotate is not None:
            stream.set_display_rotation(rotate)
        pts = 0
        for k, rgb in enumerate(itertools.chain([first], frames)):
            frame = av.VideoFrame.from_ndarray(rgb[: stream.height, : stream.width], format="rgb24")
            if pts_step is not None:
                stream.codec_context.time_base = fractions.Fraction(1, 1000)
                frame.time_base = fractions.Fraction(1, 1000)
                frame.pts = pts
                pts += pts_step(k)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def encode_data_uri(img: Image.Image, fmt: str) -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
    if rng.random() < 0.15:
        words.append(rng.choice(UNICODE_SNIPPETS))
    return " ".join(words).capitalize() + rng.choice([".", "?", "!", ""])


def encode_video_data_uri(frames, fps: float, container: str = "mp4") -> str:
    """A short video as a `data:video/...;base64,` URI (encoded through a temporary file)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = write_video(Path(tmp) / f"clip.{container}", frames, fps, codec=VIDEO_CODECS[container])
        data = path.read_bytes()
    return f"data:video/{container};base64," + base64.b64encode(data).decode()


def example_rows(n: int, seed: int = 0, *, family: str = "qwen3-vl", size_range=(48, 640), include_bad_rows: bool = False,
                 video_rows: float = 0.0) -> list[dict]:
    """`n` conversations: single/multi-image, text-only, multi-turn, system prompts, tool calls
    (the family's share of them, `example_tool_call_share`; `family` may also be a built-in
    profile's name; none for another name); a `video_rows` fraction of them opens with a short
    generated video (2-5 s at 4-8 fps)."""
    rng, nprng = random.Random(seed), np.random.default_rng(seed)
    family = BUILTIN_PROFILES[family][0] if family in BUILTIN_PROFILES else family
    tool_call_share = FAMILIES[family].example_tool_call_share if family in FAMILIES else 0.0

    def image_part() -> dict:
        w, h = (int(v) for v in nprng.integers(size_range[0], size_range[1] + 1, 2))
        mode = rng.choice(["RGB"] * 6 + ["RGBA", "L"])
        fmt = "PNG" if mode == "RGBA" or rng.random() < 0.3 else "JPEG"
        img = synthetic_image(nprng, w, h, "RGB" if (fmt == "JPEG" and mode == "RGBA") else mode)
        return {"type": "image_url", "image_url": {"url": encode_data_uri(img, fmt)}}

    rows = []
    for i in range(n):
        messages: list[dict] = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": _sentence(rng, 4, 12)})
        for turn in range(rng.choice([1, 1, 1, 2, 3])):
            n_images = rng.choice([0, 1, 1, 1, 2, 3]) if turn == 0 else rng.choice([0, 0, 1])
            parts = [image_part() for _ in range(n_images)]
            if turn == 0 and video_rows and rng.random() < video_rows:
                fps = rng.choice([4.0, 6.0, 8.0])
                w, h = (int(v) for v in nprng.integers(48, 160, 2))
                frames = synthetic_video_frames(nprng, int(fps * rng.uniform(2, 5)), w, h)
                parts.insert(0, {"type": "video", "video": encode_video_data_uri(frames, fps, rng.choice(["mp4", "webm"]))})
            parts.append({"type": "text", "text": _sentence(rng, 3, 20)})
            if rng.random() < 0.5:
                rng.shuffle(parts)
            visual = len(parts) > 1
            messages.append({"role": "user", "content": parts if visual or rng.random() < 0.5 else parts[0]["text"]})
            if tool_call_share and rng.random() < tool_call_share:
                args = {"query": _sentence(rng, 1, 4), "top_k": rng.randint(1, 9)}
                messages.append({"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": args}}]})
                messages.append({"role": "tool", "content": json.dumps({"results": [_sentence(rng, 2, 6)]})})
            messages.append({"role": "assistant", "content": " ".join(_sentence(rng, 5, 30) for _ in range(rng.randint(1, 4)))})
        rows.append({"id": f"example-{i:05d}", "messages": messages})
    if include_bad_rows:
        rows.append({"id": "bad-base64", "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@not-base64@@"}}, {"type": "text", "text": "what is this?"}]},
            {"role": "assistant", "content": "A broken image."}]})
        rows.append({"id": "unknown-role", "messages": [{"role": "narrator", "content": "Once upon a time"}, {"role": "assistant", "content": "..."}]})
    return rows


def video_example_rows(n: int, seed: int = 0) -> list[dict]:
    """`n` conversations around short generated videos (2-4 s, 64-160 px, 4-8 fps): a video
    with a question, a video beside an image, two videos in one turn, a video given as a list
    of frame images, in turn; MP4 (H.264) and WebM (VP9) as data URIs. Needs PyAV."""
    rng, nprng = random.Random(seed), np.random.default_rng([seed, 1])

    def clip() -> tuple[list[np.ndarray], float]:
        fps = rng.choice([4.0, 6.0, 8.0])
        w, h = (int(v) for v in nprng.integers(64, 161, 2))
        return list(synthetic_video_frames(nprng, int(fps * rng.uniform(2, 4)), w, h)), fps

    def video_part() -> dict:
        frames, fps = clip()
        container = rng.choice(["mp4", "webm"])
        return {"type": "video_url", "video_url": {"url": encode_video_data_uri(frames, fps, container)}}

    rows = []
    for i in range(n):
        kind = i % 4
        if kind == 3:
            frames, _ = clip()
            parts = [{"type": "video", "video": [encode_data_uri(Image.fromarray(f), "JPEG") for f in frames[::2]]}]
        else:
            parts = [video_part() for _ in range(2 if kind == 2 else 1)]
        if kind == 1:
            w, h = (int(v) for v in nprng.integers(64, 257, 2))
            parts.append({"type": "image_url", "image_url": {"url": encode_data_uri(synthetic_image(nprng, w, h, "RGB"), "JPEG")}})
        parts.append({"type": "text", "text": _sentence(rng, 3, 12)})
        answer = " ".join(_sentence(rng, 5, 20) for _ in range(rng.randint(1, 3)))
        rows.append({"id": f"video-{i:05d}", "messages": [{"role": "user", "content": parts},
                                                         {"role": "assistant", "content": answer}]})
    return rows


def jsonl_bytes(rows: list[dict]) -> bytes:
    """The rows as a JSONL file's bytes: one JSON row per line."""
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")


def write_jsonl(path: str | Path, rows: list[dict]) -> Path:
    """One JSON row per line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(jsonl_bytes(rows))
    return path
