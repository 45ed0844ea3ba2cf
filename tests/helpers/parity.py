"""Our megatron model against the Hugging Face model on the same packed batch: a pack's inputs
for each, our forward pass, samples picked by their visuals, our model with PEFT adapters, and
the tolerance the two must agree to (CPU, fp32)."""

from __future__ import annotations

import numpy as np
import torch

from shards_schema.pixels import pixel_values_from_patches, video_pixel_values_from_patches
from train import convert
from train.model import lora
from train.model.qwen_vl import transformer_config
from train.parallel import build_model

TOLERANCE = 1e-4


def pixel_values(shards, pack):
    v = shards.manifest["profile"]["vision"]
    return pixel_values_from_patches(torch.from_numpy(pack.pixel_patches), v["image_mean"], v["image_std"],
                                     v["patch_size"], v["temporal_patch_size"])


def pixel_values_videos(shards, pack):
    video = shards.manifest["profile"]["video"]
    return video_pixel_values_from_patches(torch.from_numpy(pack.video_patches), video["image_mean"], video["image_std"])


def hf_inputs(hf, shards, pack) -> dict:
    """The HF model's arguments for a pack: its tokens, 4-row packed position ids and visuals."""
    cu = pack.cu_seqlens_padded.astype(np.int64)
    text = torch.from_numpy(np.arange(cu[-1]) - np.repeat(cu[:-1], np.diff(cu)))[None, None]
    position_ids = torch.cat([text, torch.from_numpy(pack.position_ids.astype(np.int64))[:, None]])
    ids = torch.from_numpy(pack.input_ids)[None]
    kwargs = {}
    if len(pack.image_grid_thw):
        kwargs = dict(pixel_values=pixel_values(shards, pack), image_grid_thw=torch.from_numpy(pack.image_grid_thw).long())
    if len(pack.video_grid_thw):
        kwargs |= dict(pixel_values_videos=pixel_values_videos(shards, pack),
                       video_grid_thw=torch.from_numpy(pack.video_grid_thw).long())
    hf.model.rope_deltas = None
    return dict(input_ids=ids, position_ids=position_ids, attention_mask=None, use_cache=False,
                mm_token_type_ids=(ids == 151655).long() + 2 * (ids == 151656).long(), **kwargs)


def our_forward(model, shards, pack, logits: bool = False):
    """Our model on one pack: per-token losses, or the logits."""
    visual = dict(pixel_values=pixel_values(shards, pack) if len(pack.image_grid_thw) else None,
                  pixel_values_videos=pixel_values_videos(shards, pack) if len(pack.video_grid_thw) else None)
    return model(pack.as_tensors(), return_logits=logits, **visual)


def pick(shards, images: str, n: int = 5) -> list[dict]:
    stats = shards.sample_stats()
    counts, videos = stats["num_images"], stats["num_videos"]
    text = np.flatnonzero((counts == 0) & (videos == 0))
    image = np.flatnonzero((counts > 0) & (videos == 0))
    video = np.flatnonzero(videos > 0)
    idx = {"none": text[:n], "some": image[:n],
           "mixed": np.concatenate([image[:2], text[:1], image[2:3], text[1:2]]),
           "videos": np.concatenate([video[:2], image[:1], text[:1], video[2:3]])}[images]
    assert len(idx), f"no samples with images={images}"
    return [shards[int(i)] for i in idx]


def our_model(base: dict, arch, spec, adapters: dict, info, tp: int = 1, sequence_parallel: bool = False):
    """Our model on the HF weights `base` with the PEFT adapter state `adapters` (split for `tp`)."""
    model = build_model(arch, transformer_config(arch, tp=tp, cpu=True, sequence_parallel=sequence_parallel), info)
    full = convert.hf_to_megatron(base, arch)
    convert.load_into_model(model, convert.shard(full, arch, tp, info.tp_rank, 1, 0))
    attached = lora.attach(model, arch, spec, tp, range(arch.lm.num_layers))
    sites = lora.resolve_sites(arch, spec)
    local = lora.shard_adapters(adapters, sites, tp, info.tp_rank, range(arch.lm.num_layers), True)
    attached.load_state_dict(local | {k: adapters[k] for k in attached.saved_modules})
    return model, attached


def real_rows(pack) -> np.ndarray:
    return np.concatenate([np.arange(s, s + n) for s, n in zip(pack.cu_seqlens_padded[:-1], pack.sample_lengths)])

