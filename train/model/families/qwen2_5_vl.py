"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): the family on the training side, in one module.

- Language model: the Qwen decoder (`train.model.qwen_vl.layer_spec`) with q/k/v biases, no q/k
  norms, M-RoPE sections [16, 24, 24] in chunks (not interleaved), theta 1e6. Its weight table
  and checkpoint shapes are Qwen3-VL's dense ones (the rows and shapes follow the `LMArch` flags).
- Checkpoints: the hub files (and transformers' `save_pretrained`) use the pre-5.x names
  (`visual.*`, `model.layers.*`), read and written as the hub has them (`hub_name_prefixes`).
- Vision tower (`Qwen25VLTower`): window attention (blocks other than `fullatt_block_indexes`
  attend within `window_size`-pixel windows: the merged tokens are reordered so that each window
  is contiguous, and the output put back in order), RMSNorm blocks with a SwiGLU MLP, a merger
  that normalises each patch (`ln_q`) and an MLP (`mlp.0`, `mlp.2`); no position table, no
  DeepStack, no patch-embedding bias.
- Built-in architectures (`builtin_archs`): the published sizes with random weights, and
  `tiny-qwen2.5` for tests.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from train.model import families, weight_names
from train.model.activation import RecomputedActivation
from train.model.arch import LMArch, ModelArch, hf_config, lm_from_hf_config, token_ids
from train.model.families import qwen3_vl
from train.model.vision import ACTIVATIONS, TowerVariant, VisionArch, VisionTower, host_to, max_len, patch_coords, \
    window_order

FAMILY = "qwen2.5-vl"
MODEL_TYPES = {"qwen2_5_vl": False}
ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"


# --- config.json <-> ModelArch ------------------------------------------------------------------


def arch_from_hf_config(config: dict) -> ModelArch:
    lm = lm_from_hf_config(config, False, mrope_section=(16, 24, 24), rope_theta=1e6, mrope_interleaved=False,
                           qkv_bias=True, qk_norm=False)
    return ModelArch(family=FAMILY, lm=lm, vision=VisionArch.from_hf_config(FAMILY, config["vision_config"]),
                     **token_ids(config))


# --- the vision tower ---------------------------------------------------------------------------


class VisionRMSNorm(nn.Module):
    """Normalise in fp32, scale in the input dtype (HF's rounding)."""

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class VisionSwiGLU(RecomputedActivation, nn.Module):
    """A block's MLP: down(act(gate(x)) * up(x)), with biases; the product recomputed in backward when compiled."""

    def __init__(self, arch: VisionArch, **dd):
        super().__init__()
        self.act = ACTIVATIONS[arch.hidden_act]
        self.gate_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=True, **dd)
        self.up_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=True, **dd)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=True, **dd)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.activation(self._gated, self.gate_proj(x), self.up_proj(x)))

    def _gated(self, gate: Tensor, up: Tensor) -> Tensor:
        return self.act(gate) * up


class PatchMerger(nn.Module):
    """RMSNorm per patch, concatenate 2x2, MLP (`mlp.0`, `mlp.2`)."""

    def __init__(self, arch: VisionArch, **dd):
        super().__init__()
        self.merged = arch.hidden_size * arch.spatial_merge_size ** 2
        self.ln_q = VisionRMSNorm(arch.hidden_size, eps=1e-6, **dd)
        self.mlp = nn.Sequential(nn.Linear(self.merged, self.merged, **dd), nn.GELU(),
                                 nn.Linear(self.merged, arch.out_hidden_size, **dd))

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged))


class Qwen25VLTower(TowerVariant):
    """HF's `Qwen2_5_VisionTransformerPretrainedModel`: window attention."""

    hf_model_type = "qwen2_5_vl_vision"
    default_hidden_act = "silu"
    patch_bias = False

    def check(self, arch: VisionArch) -> None:
        if arch.window_size < arch.patch_size * arch.spatial_merge_size:
            raise ValueError(f"window_size {arch.window_size} px is smaller than one merged token "
                             f"({arch.patch_size * arch.spatial_merge_size} px)")

    def fields_from_hf_config(self, vision_config: dict) -> dict:
        return {"window_size": vision_config.get("window_size", 112),
                "fullatt_block_indexes": tuple(vision_config.get("fullatt_block_indexes", ()))}

    def hf_config_fields(self, arch: VisionArch) -> dict:
        return {"window_size": arch.window_size, "fullatt_block_indexes": list(arch.fullatt_block_indexes)}

    def norm(self, arch: VisionArch, **dd) -> nn.Module:
        return VisionRMSNorm(arch.hidden_size, eps=1e-6, **dd)

    def mlp(self, arch: VisionArch, **dd) -> nn.Module:
        return VisionSwiGLU(arch, **dd)

    def merger(self, arch: VisionArch, **dd) -> nn.Module:
        return PatchMerger(arch, **dd)

    def arrange(self, tower: VisionTower, x: Tensor, grid: Tensor, patches: int):
        """Windows are contiguous after reordering merged tokens (and their 4 patches); full
        attention still sees whole frames since no window crosses a frame. The order is built on
        the CPU (see train.model.vision)."""
        arch, dev = tower.arch, x.device
        unit = arch.spatial_merge_size ** 2
        row, col, _, _ = patch_coords(grid, arch.spatial_merge_size)
        window_index, cu_window = window_order(grid, arch.spatial_merge_size, arch.window_tokens)
        perm = (window_index[:, None] * unit + torch.arange(unit)).flatten()
        return (x[host_to(perm, dev)], host_to(row[perm], dev), host_to(col[perm], dev),
                (host_to(cu_window, dev), max_len(cu_window)), host_to(torch.argsort(window_index), dev))


# --- built-in architectures ---------------------------------------------------------------------


def _lm(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, tie: bool) -> LMArch:
    return LMArch(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                  head_dim=128, intermediate_size=intermediate, rms_norm_eps=1e-6, rope_theta=1e6,
                  mrope_section=(16, 24, 24), mrope_interleaved=False, qkv_bias=True, qk_norm=False,
                  tie_word_embeddings=tie)


def _vision(out: int, intermediate: int) -> VisionArch:
    return VisionArch(family=FAMILY, depth=32, hidden_size=1280, intermediate_size=intermediate, num_heads=16,
                      out_hidden_size=out, patch_size=14, window_size=112, fullatt_block_indexes=(7, 15, 23, 31),
                      hidden_act="silu")


@functools.lru_cache(maxsize=1)
def builtin_archs() -> dict[str, ModelArch]:
    """The published architectures, and `tiny-qwen2.5` (windows, full-attention blocks) for CPU tests."""
    return {
        "qwen2.5-vl-3b": ModelArch(FAMILY, _lm(151936, 2048, 36, 16, 2, 11008, tie=True), _vision(2048, 3420)),
        "qwen2.5-vl-7b": ModelArch(FAMILY, _lm(152064, 3584, 28, 28, 4, 18944, tie=False), _vision(3584, 3420)),
        "qwen2.5-vl-32b": ModelArch(FAMILY, _lm(152064, 5120, 64, 40, 8, 27648, tie=False), _vision(5120, 3456)),
        "qwen2.5-vl-72b": ModelArch(FAMILY, _lm(152064, 8192, 80, 64, 8, 29568, tie=False), _vision(8192, 3456)),
        "tiny-qwen2.5": ModelArch(FAMILY, LMArch(
            vocab_size=151936, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
            intermediate_size=128, rms_norm_eps=1e-6, rope_theta=1e6, mrope_section=(2, 3, 3),
            mrope_interleaved=False, qkv_bias=True, qk_norm=False, tie_word_embeddings=True),
            VisionArch(family=FAMILY, depth=4, hidden_size=32, intermediate_size=64, num_heads=2,
                       out_hidden_size=64, patch_size=14, window_size=56, fullatt_block_indexes=(1, 3),
                       hidden_act="silu")),
    }


# --- the family ---------------------------------------------------------------------------------


class Qwen25VLFamily(families.ModelFamily):
    name = FAMILY
    model_types = MODEL_TYPES
    vision_family = FAMILY
    vision_tower = Qwen25VLTower()
    hf_processor_class = "Qwen2_5_VLProcessor"
    hf_video_processor_class = "Qwen2VLVideoProcessor"
    processor_defaults_family = FAMILY

    @property
    def hub_name_prefixes(self) -> tuple[tuple[str, str], ...]:
        return (weight_names.HF_VISION, "visual."), (weight_names.HF_LM, "model.")

    def arch_from_hf_config(self, config: dict) -> ModelArch:
        return arch_from_hf_config(config)

    def to_hf_config(self, arch: ModelArch) -> dict:
        return hf_config(arch)

    def hf_architecture(self, arch: ModelArch) -> str:
        return ARCHITECTURE

    def builtin_archs(self) -> dict[str, ModelArch]:
        return builtin_archs()

    def weight_mappings(self) -> tuple:
        return weight_names.COMMON_MAPPINGS + weight_names.DECODER_LAYER_MAPPINGS

    def hf_shapes(self, arch: ModelArch) -> dict[str, tuple[int, ...]]:
        return qwen3_vl.hf_shapes(arch)

    def hf_export_layout(self, state: dict, arch: ModelArch) -> dict:
        return weight_names.renamed(state, self.hub_name_prefixes)

    def block_spec(self, arch: ModelArch, config, vp_stage=None):
        return qwen3_vl.block_spec(arch, config, vp_stage)


families.register(Qwen25VLFamily())
