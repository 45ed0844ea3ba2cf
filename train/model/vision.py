"""The vision towers (Qwen3-VL's, Qwen2.5-VL's) in plain torch (no transformers at train time).

Numerically the same as HF's `Qwen3VLVisionModel` and `Qwen2_5_VisionTransformerPretrainedModel`
(transformers 5.x), with identical parameter names, so a checkpoint's `model.visual.*` tensors
load as they are. What differs is only how the work is laid out:

- the patch embedding is one GEMM (`Conv3d` with kernel == stride over a pre-flattened patch);
- every block runs ONE packed attention call over all images (Qwen2.5: all windows), where
  HF's eager/sdpa paths loop over images;
- the per-image index tensors (rotary positions, pos-embed taps, window order, cu_seqlens)
  are vectorised over `image_grid_thw`. cu_seqlens and Qwen2.5's window order are built on
  the CPU, so no GPU sync is needed for the `max_seqlen` ints; Qwen3's per-patch tables are
  built on the device, where the host only queues a few small kernels instead of computing
  tables of every patch while the GPU waits. Either way the bits are those of HF's own
  (CPU-built) tables: integer ops, and float ops that IEEE rounds the same everywhere.

What differs between the towers is a `TowerVariant` in the family module that defines the
tower (`train.model.families`: Qwen3-VL's learned position table and DeepStack mergers, Qwen2.5-VL's
window attention, their blocks' norms and MLPs, their mergers); this module holds what they share.

Token order (both families, as HF): patches of each image come in 2x2 spatial-merge-block
order (the image processor emits them so), so merged token j is patches 4j..4j+3.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from train.model import families
from train.model.attention import packed_attention
from train.model.hf_config import ConfigSection
from train.model.rope import apply_rotary

ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
}


@dataclass(frozen=True)
class VisionArch:
    family: str  # the tower kind: the family that defines it (`families.vision_tower`)
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304  # qwen3-vl learned pos table (48x48)
    deepstack_visual_indexes: tuple[int, ...] = ()  # qwen3-vl
    window_size: int = 112  # qwen2.5-vl, in pixels
    fullatt_block_indexes: tuple[int, ...] = ()  # qwen2.5-vl
    hidden_act: str = "gelu_pytorch_tanh"  # qwen3-vl MLP act; qwen2.5-vl uses "silu" SwiGLU
    rope_theta: float = 10000.0

    def __post_init__(self):
        variant = self.variant
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}: expected one of {sorted(ACTIVATIONS)}")
        variant.check(self)

    @property
    def variant(self) -> TowerVariant:
        """What this tower kind builds differently (its family module's `TowerVariant`)."""
        return families.vision_tower(self.family)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def window_tokens(self) -> int:
        """Qwen2.5-VL window side in merged tokens (HF's `vit_merger_window_size`)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @classmethod
    def from_hf_config(cls, family: str, vision_config: dict) -> VisionArch:
        """From a config.json's `vision_config` (the Qwen2.5-VL hub files say `in_chans`) of a
        checkpoint of model family `family`, whose tower kind its family module names."""
        kind = families.by_name(family).vision_family
        variant = families.vision_tower(kind)
        vc = ConfigSection(vision_config, "vision_config")
        rope = vc.get("rope_parameters") or {}
        kw = {
            "family": kind, "depth": vc["depth"], "hidden_size": vc["hidden_size"],
            "intermediate_size": vc["intermediate_size"], "num_heads": vc["num_heads"],
            "out_hidden_size": vc["out_hidden_size"], "patch_size": vc["patch_size"],
            "temporal_patch_size": vc.get("temporal_patch_size", 2),
            "in_channels": vc.get("in_channels", vc.get("in_chans", 3)),
            "spatial_merge_size": vc.get("spatial_merge_size", 2),
            "hidden_act": vc.get("hidden_act", variant.default_hidden_act),
            "rope_theta": float(rope.get("rope_theta", vc.get("rope_theta", 10000.0))),
            **variant.fields_from_hf_config(vc)}
        return cls(**kw)

    def to_hf_config(self) -> dict:
        """The `vision_config` dict for an exported config.json (transformers 5.x key names)."""
        variant = self.variant
        out = {
            "model_type": variant.hf_model_type,
            "depth": self.depth, "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_heads": self.num_heads, "out_hidden_size": self.out_hidden_size, "hidden_act": self.hidden_act,
            "patch_size": self.patch_size, "temporal_patch_size": self.temporal_patch_size,
            "in_channels": self.in_channels, "spatial_merge_size": self.spatial_merge_size,
            "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta},
            **variant.hf_config_fields(self)}
        return out


class TowerVariant:
    """What one vision tower kind builds differently; a family module that defines a tower
    subclasses it (`ModelFamily.vision_tower`). The blocks' attention, the patch embedding, the
    2-D rotary and the packed attention over frames or windows are shared (`VisionTower`)."""

    hf_model_type: str  # the exported vision_config's model_type
    default_hidden_act: str  # where a vision_config names none
    patch_bias: bool  # whether the patch embedding has a bias
    learned_position_table: bool = False  # a `pos_embed` table (`VisionArch.num_position_embeddings`)

    def check(self, arch: VisionArch) -> None:
        """ValueError naming a field of `arch` this tower cannot build."""

    def fields_from_hf_config(self, vision_config: dict) -> dict:
        """The `VisionArch` fields of this kind, read from a config.json's `vision_config`."""
        raise NotImplementedError

    def hf_config_fields(self, arch: VisionArch) -> dict:
        """The `vision_config` keys of this kind for an exported config.json."""
        raise NotImplementedError

    def norm(self, arch: VisionArch, **dd) -> nn.Module:
        """A block's norm (norm1, norm2)."""
        raise NotImplementedError

    def mlp(self, arch: VisionArch, **dd) -> nn.Module:
        """A block's MLP."""
        raise NotImplementedError

    def merger(self, arch: VisionArch, **dd) -> nn.Module:
        """The final patch merger (merge^2 patches -> one LM token)."""
        raise NotImplementedError

    def deepstack_merger(self, arch: VisionArch, **dd) -> nn.Module:
        """The merger of one `deepstack_visual_indexes` block."""
        raise ValueError(f"the {arch.family} vision tower has no DeepStack mergers: "
                         f"deepstack_visual_indexes must be empty, got {list(arch.deepstack_visual_indexes)}")

    def arrange(self, tower: VisionTower, x: Tensor, grid: Tensor, patches: int,
                ) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, int] | None, Tensor | None]:
        """Embedded patches `x` (input order) -> (the blocks' input, each row's patch row and col
        on x's device, the windowed blocks' (cu_seqlens, max_seqlen) or None for whole frames,
        the order that puts the merged output back into the input's order or None). `grid`:
        image_grid_thw on the CPU; `patches`: its number of patches."""
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------
# Index tensors from image_grid_thw (long; on its device). Each is HF's vision_utils result, vectorised.


def _ragged_arange(counts: Tensor, total: int | None = None) -> tuple[Tensor, Tensor]:
    """For segments of `counts` rows: (segment id, index within the segment) of every row.
    `total` (the sum of `counts`, when the caller knows it) spares a device a sync."""
    seg = torch.repeat_interleave(counts, output_size=total)  # (repeating arange(len) reads a 1-long `counts` to the host)
    starts = counts.cumsum(0) - counts
    return seg, torch.arange(seg.numel(), device=counts.device) - starts[seg]


def patch_coords(grid: Tensor, merge: int, total: int | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(row, col, grid h, grid w) of every patch, patches in spatial-merge-block order
    (block row, block col, row in block, col in block), frames repeating the same positions.
    On `grid`'s device; `total`: the number of patches, which spares a GPU a sync."""
    seg, local = _ragged_arange(grid.prod(1), total)
    h, w = grid[seg, 1], grid[seg, 2]
    within = local % (h * w)
    blocks_w = w // merge
    row = within // (merge * merge * blocks_w) * merge + within // merge % merge
    col = within // (merge * merge) % blocks_w * merge + within % merge
    return row, col, h, w


def frame_cu_seqlens(grid: Tensor) -> Tensor:
    """Full-attention segments: one per frame (HF's `get_vision_cu_seqlens`), int32, on the
    CPU. Summed in Python from the grid's few values: as a CPU `repeat_interleave` over them it
    took 9.6 ms of host time at a micro-batch's start in a traced Qwen3.5-2B step, the GPU idle
    meanwhile (docs/performance.md)."""
    bounds = [0]
    for frames, height, width in grid.tolist():
        for _ in range(frames):
            bounds.append(bounds[-1] + height * width)
    return torch.tensor(bounds, dtype=torch.int32)


def _bilinear_axis(index: Tensor, size: Tensor, side: int) -> tuple[Tensor, Tensor]:
    """Taps [N, 2] into a `side`-long table and their weights for position `index` of an axis of
    `size`, as `F.interpolate(bilinear, align_corners=True)` (the same float ops as HF)."""
    src = index.to(torch.float32) * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def pos_embed_taps(row: Tensor, col: Tensor, h: Tensor, w: Tensor, side: int) -> tuple[Tensor, Tensor]:
    """Indices [N, 4] into the flattened side x side pos table and weights [N, 4] that resample
    it bilinearly to each image's h x w grid."""
    h_taps, h_weights = _bilinear_axis(row, h, side)
    w_taps, w_weights = _bilinear_axis(col, w, side)
    index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weight = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return index, weight


def window_order(grid: Tensor, merge: int, window: int) -> tuple[Tensor, Tensor]:
    """Qwen2.5-VL window attention (HF's `get_vision_window_index`, vectorised).

    Returns `window_index` (merged tokens in window order: image, frame, window row, window
    col, row in window, col in window) and `cu_window_seqlens` in patches (int32). Windows
    are `window` merged tokens square, cut from the top-left; edge windows are smaller.
    """
    t, hm, wm = grid[:, 0], grid[:, 1] // merge, grid[:, 2] // merge
    nwh, nww = -(-hm // window), -(-wm // window)
    # A sort key per merged token: its slot in the image's frames x padded-window grid. Slots are
    # unique, in HF's order, and window k of the whole batch owns slots [k*window^2, (k+1)*window^2).
    slots = t * nwh * nww * window * window
    seg, local = _ragged_arange(t * hm * wm)
    frame, r, c = local // (hm * wm)[seg], local // wm[seg] % hm[seg], local % wm[seg]
    win = (frame * nwh[seg] + r // window) * nww[seg] + c // window
    key = (slots.cumsum(0) - slots)[seg] + win * window * window + r % window * window + c % window
    sorted_key, window_index = torch.sort(key)
    counts = torch.unique_consecutive(sorted_key // (window * window), return_counts=True)[1]
    cu = F.pad((counts * merge * merge).cumsum(0), (1, 0)).to(torch.int32)
    return window_index, cu


def max_len(cu: Tensor) -> int:
    return int((cu[1:] - cu[:-1]).max())


def host_to(t: Tensor, device: torch.device) -> Tensor:
    """A CPU-built index tensor to `device`. On CUDA through pinned memory and asynchronously:
    a copy from pageable memory would make the host wait for the GPU to drain, and the host
    could no longer queue the next layers' kernels ahead of it."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


# ---------------------------------------------------------------------------------------------
# Modules. Names and shapes follow HF's, so `state_dict()` keys equal `model.visual.*` minus the prefix.


class _PatchEmbed(nn.Module):
    def __init__(self, arch: VisionArch, bias: bool, **dd):
        super().__init__()
        kernel = (arch.temporal_patch_size, arch.patch_size, arch.patch_size)
        # The Conv3d only holds the checkpoint's [hidden, C, T, P, P] weight: with kernel ==
        # stride over one pre-cut patch it is a plain GEMM on the flattened (C, T, P, P) pixels.
        self.proj = nn.Conv3d(arch.in_channels, arch.hidden_size, kernel, stride=kernel, bias=bias, **dd)

    def forward(self, pixels: Tensor) -> Tensor:
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.view(weight.shape[0], -1), self.proj.bias)


class _Attention(nn.Module):
    def __init__(self, arch: VisionArch, **dd):
        super().__init__()
        self.num_heads = arch.num_heads
        self.scale = arch.head_dim ** -0.5  # HF's constant exactly (1/sqrt may differ by an ulp)
        self.qkv = nn.Linear(arch.hidden_size, 3 * arch.hidden_size, bias=True, **dd)
        self.proj = nn.Linear(arch.hidden_size, arch.hidden_size, bias=True, **dd)

    def forward(self, x: Tensor, cu_seqlens: Tensor, max_seqlen: int, cos: Tensor, sin: Tensor) -> Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, -1)).unbind(1)
        # Rotary in fp32 whatever the compute dtype, as HF's apply_rotary_pos_emb_vision.
        q = apply_rotary(q.float(), cos, sin).to(v.dtype)
        k = apply_rotary(k.float(), cos, sin).to(v.dtype)
        out = packed_attention(q, k, v, cu_seqlens, max_seqlen, causal=False, scale=self.scale)
        return self.proj(out.flatten(1))


class _Block(nn.Module):
    def __init__(self, arch: VisionArch, **dd):
        super().__init__()
        variant = arch.variant
        self.norm1 = variant.norm(arch, **dd)
        self.norm2 = variant.norm(arch, **dd)
        self.attn = _Attention(arch, **dd)
        self.mlp = variant.mlp(arch, **dd)

    def forward(self, x: Tensor, cu_seqlens: Tensor, max_seqlen: int, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, max_seqlen, cos, sin)
        return x + self.mlp(self.norm2(x))


class VisionTower(nn.Module):
    """The vision encoder of one family; `state_dict()` keys == HF's `model.visual.*` keys."""

    def __init__(self, arch: VisionArch, params_dtype=torch.float32, device=None):
        super().__init__()
        self.arch = arch
        variant = arch.variant
        dd = {"device": device, "dtype": params_dtype}
        self.patch_embed = _PatchEmbed(arch, bias=variant.patch_bias, **dd)
        if variant.learned_position_table:
            self.pos_embed = nn.Embedding(arch.num_position_embeddings, arch.hidden_size, **dd)
        self.blocks = nn.ModuleList(_Block(arch, **dd) for _ in range(arch.depth))
        self.merger = variant.merger(arch, **dd)
        self.deepstack_merger_list = nn.ModuleList(variant.deepstack_merger(arch, **dd)
                                                   for _ in arch.deepstack_visual_indexes)
        # inv_freq is not a buffer: Float16Module-style `.bfloat16()` would round it. HF builds it
        # in fp32 on the CPU; so do we (pow on the GPU may differ by an ulp).
        spatial = arch.head_dim // 2
        self.recompute_blocks = 0  # the first blocks whose activations are recomputed in backward (set by the model)
        self._inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))

    def _rotary(self, row: Tensor, col: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [N, 1, head_dim] fp32: h angles then w angles, the pair repeated (HF's layout)."""
        inv_freq = host_to(self._inv_freq, row.device)
        angles = torch.cat([row[:, None].float() * inv_freq, col[:, None].float() * inv_freq], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)[:, None, :]
        return angles.cos(), angles.sin()

    def forward(self, pixel_values: Tensor, image_grid_thw: Tensor) -> tuple[Tensor, list[Tensor]]:
        """pixel_values [N, C*T*P*P] (HF's flattened patches, merge-block order), image_grid_thw
        [K, 3] (t, h, w in patches; h and w divisible by the merge size) with N = sum t*h*w.

        Returns image embeddings [N / merge^2, out_hidden_size] in the input's token order and
        the DeepStack features (same shape, one per `deepstack_visual_indexes`; [] for Qwen2.5).
        K = 0 is not supported: the caller skips the tower when a batch has no images.
        Passing image_grid_thw on the CPU saves a device-to-host copy.
        """
        arch, dev = self.arch, pixel_values.device
        grid = image_grid_thw.to("cpu", torch.long)
        patches = int(grid.prod(1).sum())
        if patches != pixel_values.shape[0]:
            raise ValueError(f"image_grid_thw {grid.tolist()} gives {patches} patches, "
                             f"pixel_values has {pixel_values.shape[0]}")
        cu_full = frame_cu_seqlens(grid)
        full = (host_to(cu_full, dev), max_len(cu_full))  # (cu_seqlens, max_seqlen) per block kind
        x, row, col, windowed, restore = arch.variant.arrange(self, self.patch_embed(pixel_values), grid, patches)
        cos, sin = self._rotary(row, col)
        out, deepstack = self.encode(x, *full, *(windowed or full), cos, sin)
        if restore is not None:
            out = out[restore]  # back to the input's token order
        return out, deepstack

    def encode(self, x: Tensor, cu_full: Tensor, max_full: int, cu_windowed: Tensor, max_windowed: int,
               cos: Tensor, sin: Tensor) -> tuple[Tensor, list[Tensor]]:
        """The blocks and mergers on embedded patches: everything of the tower that runs on the
        GPU alone, with no host work (`benchmarks/vision_speed.py` compiles it as one graph)."""
        arch = self.arch
        deepstack_slot = {layer: i for i, layer in enumerate(arch.deepstack_visual_indexes)}
        deepstack = []
        for layer, block in enumerate(self.blocks):
            cu_seqlens, max_seqlen = ((cu_full, max_full) if layer in arch.fullatt_block_indexes
                                      else (cu_windowed, max_windowed))
            if layer < self.recompute_blocks and torch.is_grad_enabled():  # keep the block's input; redo it in backward
                x = torch.utils.checkpoint.checkpoint(block, x, cu_seqlens, max_seqlen, cos, sin, use_reentrant=False)
            else:
                x = block(x, cu_seqlens, max_seqlen, cos, sin)
            if layer in deepstack_slot:
                deepstack.append(self.deepstack_merger_list[deepstack_slot[layer]](x))
        return self.merger(x), deepstack
