"""`train.model.vision` == HF's vision towers (the oracle) on tiny random configs.

Qwen3-VL: `Qwen3VLVisionModel` (eager attention), an 8x8 learned pos table so grids both
larger and smaller than it are resampled, DeepStack after blocks 0 and 2. Qwen2.5-VL:
`Qwen2_5_VisionTransformerPretrainedModel` (sdpa), window_size 64 px = 2x2 merged tokens
(so windows really split the images, edge windows are partial, and a merged side divisible
by the window takes HF's extra-padding path), full attention at block 1.

All weights are re-drawn (biases and norm weights too, so a dropped bias or a swapped norm
shows) with a 1/sqrt(fan_in) scale that keeps activations O(1).
"""

import dataclasses
import math

import pytest
import torch

from train.model.vision import (
    VisionArch,
    VisionTower,
    frame_cu_seqlens,
    patch_coords,
    pos_embed_taps,
    window_order,
)

TOL = 1e-5
BATCHES = [  # image_grid_thw rows (t, h, w) in patches; h, w even (2x2 merge)
    [(1, 4, 6)],
    [(1, 2, 2), (1, 10, 4)],
    [(1, 6, 14), (2, 8, 8), (1, 20, 12)],
    [(1, 12, 8), (1, 4, 4), (1, 6, 10), (1, 16, 16)],
]
SMALL = {"depth": 4, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "out_hidden_size": 96,
         "patch_size": 16}


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name or "ln_q" in name:
                p.copy_(1 + 0.2 * noise if name.endswith("weight") else 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif name == "pos_embed.weight":
                p.copy_(noise)
            else:
                p.copy_(noise / math.sqrt(p[0].numel()))
    return model.eval()


def hf_vision(family: str, seed: int = 0):
    if family == "qwen3-vl":
        from transformers.models.qwen3_vl.configuration_qwen3_vl import (
            Qwen3VLVisionConfig,
        )
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        cfg = Qwen3VLVisionConfig(**SMALL, deepstack_visual_indexes=[0, 2], num_position_embeddings=64)
        model = Qwen3VLVisionModel._from_config(cfg, attn_implementation="eager")
    else:
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import (
            Qwen2_5_VLVisionConfig,
        )
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )

        cfg = Qwen2_5_VLVisionConfig(**SMALL, window_size=64, fullatt_block_indexes=[1])
        model = Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg, attn_implementation="sdpa")
    return _randomize(model, seed)


@pytest.fixture(scope="module")
def pair(family):
    """(HF model, our tower loaded from its state_dict with strict=True)."""
    hf = hf_vision(family)
    ours = VisionTower(VisionArch.from_hf_config(family, hf.config.to_dict()))
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours.eval()


def _inputs(grids, seed=0):
    grid = torch.tensor(grids, dtype=torch.long)
    pixels = torch.randn(int(grid.prod(1).sum()), 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(seed))
    return pixels, grid


def _max_diff(a, b) -> float:
    return (a - b).abs().max().item()


def test_parameter_names_and_shapes_equal_hf(pair):
    hf, ours = pair
    theirs = {k: v.shape for k, v in hf.state_dict().items()}
    assert {k: v.shape for k, v in ours.state_dict().items()} == theirs
    assert theirs["patch_embed.proj.weight"] == (64, 3, 2, 16, 16)


@pytest.mark.parametrize("grids", BATCHES, ids=lambda g: "x".join(f"{t}.{h}.{w}" for t, h, w in g))
def test_outputs_equal_hf(pair, grids):
    hf, ours = pair
    pixels, grid = _inputs(grids)
    with torch.no_grad():
        ref = hf(pixels, grid_thw=grid)
        embeds, deepstack = ours(pixels, grid)
    assert embeds.shape == (pixels.shape[0] // 4, 96)
    assert _max_diff(embeds, ref.pooler_output) < TOL
    ref_deepstack = getattr(ref, "deepstack_features", None) or []
    assert len(deepstack) == len(ours.arch.deepstack_visual_indexes) == len(ref_deepstack)
    for mine, theirs in zip(deepstack, ref_deepstack):
        assert _max_diff(mine, theirs) < TOL


def test_gradients_equal_hf(pair):
    """The backward pass too (training goes through it): d(loss)/d(every parameter)."""
    hf, ours = pair
    pixels, grid = _inputs(BATCHES[2], seed=1)
    for model in (hf, ours):
        model.zero_grad()
        if model is hf:
            out = hf(pixels, grid_thw=grid)
            feats = [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]
        else:
            embeds, deepstack = ours(pixels, grid)
            feats = [embeds, *deepstack]
        sum(f.square().mean() for f in feats).backward()
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert _max_diff(p.grad, theirs[name].grad) < TOL * max(1.0, theirs[name].grad.abs().max().item()), name


@pytest.mark.parametrize("blocks", [1, 3, 4])
def test_recomputing_the_first_blocks_gives_the_same_gradients(pair, blocks, monkeypatch):
    """`recompute_blocks` N (`--recompute-vision-blocks`): exactly the first N blocks run under
    activation checkpointing, and every gradient equals the run that keeps all activations."""
    _, ours = pair
    pixels, grid = _inputs(BATCHES[2], seed=2)
    checkpointed = []
    checkpoint = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint",
                        lambda fn, *a, **k: checkpointed.append(fn) or checkpoint(fn, *a, **k))
    grads = []
    for recompute_blocks in (0, blocks):
        ours.recompute_blocks = recompute_blocks
        ours.zero_grad()
        embeds, deepstack = ours(pixels, grid)
        sum(f.square().mean() for f in [embeds, *deepstack]).backward()
        grads.append({name: p.grad.clone() for name, p in ours.named_parameters()})
    ours.recompute_blocks = 0
    assert checkpointed == list(ours.blocks[:blocks])
    for name, grad in grads[0].items():
        assert torch.equal(grads[1][name], grad), name


def test_grid_order_matters(pair):
    """Negative control: the same pixels with the images' grids listed in another order."""
    _, ours = pair
    pixels, grid = _inputs([(1, 4, 8), (1, 8, 4)])
    with torch.no_grad():
        a, _ = ours(pixels, grid)
        b, _ = ours(pixels, grid.flip(0))
    assert _max_diff(a, b) > 1e-2


def test_qwen25_windows_split_images():
    """Negative control: full attention in every block gives another result, so the windows
    of the test config really cut the images."""
    hf = hf_vision("qwen2.5-vl")
    arch = VisionArch.from_hf_config("qwen2.5-vl", hf.config.to_dict())
    windowed, full = VisionTower(arch), VisionTower(dataclasses.replace(arch, fullatt_block_indexes=(0, 1, 2, 3)))
    windowed.load_state_dict(hf.state_dict())
    full.load_state_dict(hf.state_dict())
    pixels, grid = _inputs([(1, 6, 10)])
    with torch.no_grad():
        assert _max_diff(windowed(pixels, grid)[0], full(pixels, grid)[0]) > 1e-2


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(6))
def test_index_helpers_equal_hf_vision_utils(seed, device):
    """Bit-exact against transformers.vision_utils on random grids, video frames included. The
    per-patch tables are built on `device` from the patch count (as the Qwen3 tower builds
    them on its GPU), and on the CPU without it."""
    from transformers import vision_utils as vu

    gen = torch.Generator().manual_seed(seed)
    k = int(torch.randint(1, 6, (1,), generator=gen))
    grid = torch.cat([torch.randint(1, 3, (k, 1), generator=gen), 2 * torch.randint(1, 16, (k, 2), generator=gen)], 1)
    ref_coords = vu.get_vision_position_ids(grid, 2)
    assert torch.equal(torch.stack(patch_coords(grid, 2)[:2], 1), ref_coords)
    row, col, h, w = patch_coords(grid.to(device), 2, int(grid.prod(1).sum()))
    assert row.device.type == device
    assert torch.equal(torch.stack([row, col], 1).cpu(), ref_coords)
    assert torch.equal(frame_cu_seqlens(grid), vu.get_vision_cu_seqlens(grid))
    for side in (3, 8, 48):
        index, weight = pos_embed_taps(row, col, h, w, side)
        ref_index, ref_weight = vu.get_vision_interpolation_indices_and_weights(
            grid, side, mode="bilinear", align_corners=True, spatial_merge_size=2)
        assert torch.equal(index.cpu(), ref_index) and torch.equal(weight.cpu(), ref_weight)
    for window_px in (32, 64, 96, 112):  # 1, 2, 3, 3 merged tokens with patch 16
        ours = window_order(grid, 2, window_px // 2 // 16)
        ref = vu.get_vision_window_index(grid, spatial_merge_size=2, window_size=window_px, patch_size=16)
        assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])


def test_config_round_trip(pair, family):
    hf, _ = pair
    arch = VisionArch.from_hf_config(family, hf.config.to_dict())
    exported = arch.to_hf_config()
    assert VisionArch.from_hf_config(family, exported) == arch
    # transformers reads the exported dict back into the same config
    reread = type(hf.config)(**exported).to_dict()
    assert {k: reread[k] for k in exported} == exported
    hf_dict = hf.config.to_dict()
    assert {k: hf_dict[k] for k in exported} == exported


def test_builtin_archs_round_trip():
    from train.model.arch import BUILTIN_ARCHS

    for model in BUILTIN_ARCHS.values():
        assert VisionArch.from_hf_config(model.family, model.vision.to_hf_config()) == model.vision


def test_hub_qwen25_config_keys():
    """The Qwen2.5-VL hub config.json says `in_chans` and carries no rope keys."""
    hub = {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
           "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2,
           "spatial_patch_size": 14, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
           "tokens_per_second": 2, "temporal_patch_size": 2}
    arch = VisionArch.from_hf_config("qwen2.5-vl", hub)
    assert (arch.in_channels, arch.rope_theta, arch.window_tokens) == (3, 10000.0, 4)
    assert arch.fullatt_block_indexes == (7, 15, 23, 31)


def test_bf16_close_to_fp32(pair):
    _, ours = pair
    low = VisionTower(ours.arch, params_dtype=torch.bfloat16)
    low.load_state_dict(ours.state_dict())
    pixels, grid = _inputs(BATCHES[1])
    with torch.no_grad():
        ref, ref_ds = ours(pixels, grid)
        out, out_ds = low(pixels.bfloat16(), grid)
    assert out.dtype == torch.bfloat16
    for a, b in zip([out, *out_ds], [ref, *ref_ds]):
        assert ((a.float() - b).norm() / b.norm()).item() < 3e-2


def test_pixel_count_mismatch_raises(pair):
    _, ours = pair
    pixels, grid = _inputs([(1, 4, 4)])
    with pytest.raises(ValueError, match="patches"):
        ours(pixels[:-4], grid)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_equals_cpu(pair):
    """CUDA fp32 (masked sdpa) matches the CPU result; CUDA bf16 (FlashAttention varlen) stays
    close to it."""
    _, ours = pair
    pixels, grid = _inputs(BATCHES[3])
    with torch.no_grad():
        ref, _ = ours(pixels, grid)
        gpu = VisionTower(ours.arch, device="cuda")
        gpu.load_state_dict(ours.state_dict())
        out, _ = gpu(pixels.cuda(), grid.cuda())
        assert _max_diff(out.cpu(), ref) < 1e-4
        low = VisionTower(ours.arch, params_dtype=torch.bfloat16, device="cuda")
        low.load_state_dict(ours.state_dict())
        out, _ = low(pixels.cuda().bfloat16(), grid)
    assert ((out.float().cpu() - ref).norm() / ref.norm()).item() < 3e-2
