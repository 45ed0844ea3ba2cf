"""Videos for tests: every frame of a file as HF's reference decoder reads it, and random rows
with videos (files and data URIs), sometimes images, over several turns."""

from __future__ import annotations

import numpy as np
from transformers.video_utils import VideoMetadata, load_video

from preprocess.examples import VIDEO_CODECS, synthetic_video_frames, write_video


def reference_frames(path):
    """Every frame and HF's metadata: `load_video(backend="pyav")` where the container records
    its frame count; Matroska/WebM record none (HF's reader then reports 0 frames and fails),
    so there the same full decode from the start is done here, with the real frame count."""
    import av

    with av.open(str(path)) as container:
        recorded = container.streams.video[0].frames
    if recorded:
        return load_video(str(path), backend="pyav",
                          sample_indices_fn=lambda metadata, **kw: np.arange(metadata.total_num_frames))
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
        meta = VideoMetadata(total_num_frames=len(frames), fps=float(stream.average_rate), height=stream.height,
                             width=stream.width, video_backend="pyav")
    meta.frames_indices = np.arange(len(frames))
    return frames, meta


def random_video_row(rng, nprng, media_root, family):
    """A conversation with 1-2 videos (files, data URIs), sometimes images and several turns;
    returns (row, hf messages, hf videos, hf metadata, hf images)."""
    import base64
    import io

    from preprocess.examples import synthetic_image

    messages, hf_videos, hf_meta, hf_images = [], [], [], []
    for turn in range(rng.randint(1, 2)):
        parts = []  # (part, what HF is given for it)
        for _ in range(rng.randint(1 if turn == 0 else 0, 2)):
            container = rng.choice(list(VIDEO_CODECS))
            n, fps = rng.randint(2, 60), rng.choice([2.0, 8.0, 24.0, 30.0])
            w, h = rng.randint(40, 160), rng.randint(40, 160)
            path = write_video(media_root / f"v{len(list(media_root.iterdir()))}.{container}",
                               synthetic_video_frames(nprng, n, w, h), fps, codec=VIDEO_CODECS[container],
                               gop=rng.choice([None, 8]))
            if rng.random() < 0.3:
                source = f"data:video/{container};base64," + base64.b64encode(path.read_bytes()).decode()
            else:
                source = path.name
            part = rng.choice([{"type": "video", "video": source}, {"type": "video_url", "video_url": {"url": source}}])
            parts.append((part, ("video", reference_frames(path))))
        if rng.random() < 0.4:
            img = synthetic_image(nprng, rng.randint(30, 200), rng.randint(30, 200))
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
            parts.append(({"type": "image_url", "image_url": {"url": uri}}, ("image", img)))
        parts.append(({"type": "text", "text": rng.choice(["What happens?", "Describe it.", "图中是什么？"])}, None))
        rng.shuffle(parts)
        for _, given in parts:  # HF pairs videos and images with the text's placeholders in order
            if given and given[0] == "video":
                hf_videos.append(given[1][0])
                hf_meta.append(given[1][1])
            elif given:
                hf_images.append(given[1])
        messages.append({"role": "user", "content": [part for part, _ in parts]})
        messages.append({"role": "assistant", "content": rng.choice(["A bar sweeps.", "Colours drift left."])})
    return {"messages": messages}, messages, hf_videos, hf_meta, hf_images

