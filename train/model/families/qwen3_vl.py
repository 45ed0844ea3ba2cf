"""Qwen3-VL (`Qwen3VLForConditionalGeneration`) and its Mixture-of-Experts variant
(`Qwen3VLMoeForConditionalGeneration`): the family on the training side, in one module.

- Language model: the Qwen decoder (`train.model.qwen_vl.layer_spec`) with q/k norms, no
  attention biases, M-RoPE sections [24, 20, 20] interleaved over the frequencies, theta 5e6.
- Mixture-of-Experts: every decoder layer's MLP is `num_experts` SwiGLU experts
  (`train.model.moe`); the checkpoints hold each layer's experts as two stacks
  (`mlp.experts.gate_up_proj` [E, H, 2F], `mlp.experts.down_proj` [E, F, H]), which are megatron's
  GroupedMLP weights as they are (`TRANSFORMS`); transformers' in-memory layout is read too
  (`expert_layout`).
- Vision tower (`Qwen3VLTower`): a learned position table resampled bilinearly to each image's
  grid, LayerNorm blocks with a GELU MLP, a merger that normalises before concatenating the 2x2
  patches, and DeepStack: after the `deepstack_visual_indexes` blocks a merger of its own
  (normalising after concatenating) gives features that the decoder adds to the image tokens'
  hidden states of its first layers.
- Built-in architectures (`builtin_archs`): the published sizes with random weights, and `tiny` /
  `tiny-moe` for tests.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch.nn.functional as F
from torch import Tensor, nn

from train.model import families
from train.model.activation import RecomputedActivation
from train.model.arch import LMArch, ModelArch, hf_config, lm_from_hf_config, token_ids
from train.model.vision import (ACTIVATIONS, TowerVariant, VisionArch, VisionTower, host_to, patch_coords,
                                pos_embed_taps)

FAMILY = "qwen3-vl"
MODEL_TYPES = {"qwen3_vl": False, "qwen3_vl_moe": True}
ARCHITECTURES = {False: "Qwen3VLForConditionalGeneration", True: "Qwen3VLMoeForConditionalGeneration"}


# --- config.json <-> ModelArch ------------------------------------------------------------------


def arch_from_hf_config(config: dict) -> ModelArch:
    moe = MODEL_TYPES[config["model_type"]]
    lm = lm_from_hf_config(config, moe, mrope_section=(24, 20, 20), rope_theta=5e6, mrope_interleaved=True,
                           qkv_bias=False, qk_norm=True)
    return ModelArch(family=FAMILY, lm=lm, vision=VisionArch.from_hf_config(FAMILY, config["vision_config"]),
                     **token_ids(config))


# --- the vision tower ---------------------------------------------------------------------------


class VisionMLP(RecomputedActivation, nn.Module):
    """A block's MLP: fc1 -> act -> fc2, the activation's output recomputed in backward when compiled."""

    def __init__(self, arch: VisionArch, **dd):
        super().__init__()
        self.act = ACTIVATIONS[arch.hidden_act]
        self.linear_fc1 = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=True, **dd)
        self.linear_fc2 = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=True, **dd)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_fc2(self.activation(self.act, self.linear_fc1(x)))


class PatchMerger(nn.Module):
    """2x2 patches -> one LM token. The final merger normalises each patch (LayerNorm(hidden))
    before concatenating; DeepStack mergers normalise after."""

    def __init__(self, arch: VisionArch, postshuffle_norm: bool, **dd):
        super().__init__()
        self.merged = arch.hidden_size * arch.spatial_merge_size ** 2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged if postshuffle_norm else arch.hidden_size, eps=1e-6, **dd)
        self.linear_fc1 = nn.Linear(self.merged, self.merged, **dd)
        self.linear_fc2 = nn.Linear(self.merged, arch.out_hidden_size, **dd)

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm(x.view(-1, self.merged)) if self.postshuffle_norm else self.norm(x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VLTower(TowerVariant):
    """HF's `Qwen3VLVisionModel`: the learned position table and DeepStack; full attention in every block."""

    hf_model_type = "qwen3_vl_vision"
    default_hidden_act = "gelu_pytorch_tanh"
    patch_bias = True
    learned_position_table = True

    def check(self, arch: VisionArch) -> None:
        if math.isqrt(arch.num_position_embeddings) ** 2 != arch.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {arch.num_position_embeddings} is not a square")

    def fields_from_hf_config(self, vision_config: dict) -> dict:
        return {"num_position_embeddings": vision_config.get("num_position_embeddings", 2304),
                "deepstack_visual_indexes": tuple(vision_config.get("deepstack_visual_indexes", ()))}

    def hf_config_fields(self, arch: VisionArch) -> dict:
        return {"num_position_embeddings": arch.num_position_embeddings,
                "deepstack_visual_indexes": list(arch.deepstack_visual_indexes)}

    def norm(self, arch: VisionArch, **dd) -> nn.Module:
        return nn.LayerNorm(arch.hidden_size, eps=1e-6, **dd)

    def mlp(self, arch: VisionArch, **dd) -> nn.Module:
        return VisionMLP(arch, **dd)

    def merger(self, arch: VisionArch, **dd) -> nn.Module:
        return PatchMerger(arch, postshuffle_norm=False, **dd)

    def deepstack_merger(self, arch: VisionArch, **dd) -> nn.Module:
        return PatchMerger(arch, postshuffle_norm=True, **dd)

    def arrange(self, tower: VisionTower, x: Tensor, grid: Tensor, patches: int):
        """The position table resampled to each image's grid, added to its patches (the per-patch
        tables built on the device: see train.model.vision)."""
        arch = tower.arch
        row, col, h, w = patch_coords(host_to(grid, x.device), arch.spatial_merge_size, patches)
        index, weight = pos_embed_taps(row, col, h, w, math.isqrt(arch.num_position_embeddings))
        pos = (tower.pos_embed(index) * weight[:, :, None]).sum(1)
        return x + pos.to(x.dtype), row, col, None, None


# --- built-in architectures ---------------------------------------------------------------------


def _vision(**kw) -> VisionArch:
    return VisionArch(family=FAMILY, hidden_act="gelu_pytorch_tanh", **kw)


def _lm(hidden: int, layers: int, heads: int, intermediate: int, tie: bool, kv_heads: int = 8, **moe) -> LMArch:
    return LMArch(vocab_size=151936, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                  head_dim=128, intermediate_size=intermediate, rms_norm_eps=1e-6, rope_theta=5e6,
                  mrope_section=(24, 20, 20), mrope_interleaved=True, qkv_bias=False, qk_norm=True,
                  tie_word_embeddings=tie, **moe)


def _moe_lm(hidden: int, layers: int, expert_width: int) -> LMArch:
    return _lm(hidden, layers, heads=hidden // 64, intermediate=3 * hidden, tie=False, kv_heads=4,
               num_experts=128, num_experts_per_tok=8, moe_intermediate_size=expert_width, router_aux_loss_coef=0.001)


def _vision_large(out: int) -> VisionArch:
    """The 27-block tower of Qwen3-VL 8B and larger."""
    return _vision(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=out,
                   deepstack_visual_indexes=(8, 16, 24))


def _vision_small(out: int) -> VisionArch:
    """The 24-block tower of Qwen3-VL 2B and 4B."""
    return _vision(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=out,
                   deepstack_visual_indexes=(5, 11, 17))


@functools.lru_cache(maxsize=1)
def builtin_archs() -> dict[str, ModelArch]:
    """The published architectures (the Instruct and Thinking checkpoints of a size share one),
    and `tiny` / `tiny-moe`: tiny shapes with every structural feature (GQA, DeepStack on 2 of 3
    layers, experts) for CPU tests and smoke runs."""
    tiny = ModelArch(FAMILY, LMArch(
        vocab_size=151936, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, rms_norm_eps=1e-6, rope_theta=5e6, mrope_section=(4, 2, 2),
        mrope_interleaved=True, qkv_bias=False, qk_norm=True, tie_word_embeddings=True),
        _vision(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                deepstack_visual_indexes=(0, 1)))
    return {
        "qwen3-vl-2b": ModelArch(FAMILY, _lm(2048, 28, 16, 6144, tie=True), _vision_small(2048)),
        "qwen3-vl-4b": ModelArch(FAMILY, _lm(2560, 36, 32, 9728, tie=True), _vision_small(2560)),
        "qwen3-vl-8b": ModelArch(FAMILY, _lm(4096, 36, 32, 12288, tie=False), _vision_large(4096)),
        "qwen3-vl-32b": ModelArch(FAMILY, _lm(5120, 64, 64, 25600, tie=False), _vision_large(5120)),
        "qwen3-vl-30b-a3b": ModelArch(FAMILY, _moe_lm(2048, 48, 768), _vision_large(2048)),
        "qwen3-vl-235b-a22b": ModelArch(FAMILY, _moe_lm(4096, 94, 1536), _vision_large(4096)),
        "tiny": tiny,
        "tiny-moe": dataclasses.replace(tiny, lm=dataclasses.replace(
            tiny.lm, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, router_aux_loss_coef=0.001)),
    }


# --- weights ------------------------------------------------------------------------------------


def _convert():
    from train.model import weight_names  # the name table the converter reads too

    return weight_names


# The published checkpoints' expert stacks [E, H, 2F] / [E, F, H] are megatron GroupedMLP's
# weight1 / weight2 memory as they are (see train.model.moe): only the 2-D shape differs.
TRANSFORMS = {
    "experts_fc1": (lambda tensors, lm: tensors[0].reshape(lm.hidden_size, -1),
                    lambda tensor, lm: (tensor.reshape(lm.num_experts, lm.hidden_size, -1),)),
    "experts_fc2": (lambda tensors, lm: tensors[0].reshape(-1, lm.hidden_size),
                    lambda tensor, lm: (tensor.reshape(lm.num_experts, -1, lm.hidden_size),)),
}


@functools.lru_cache(maxsize=1)
def weight_mappings() -> tuple:
    """HF (transformers 5.x names) <-> Megatron names of `QwenVLModel`: the Qwen decoder's rows,
    and the Mixture-of-Experts layers' (experts whole on every TP rank, expert TP 1, and divided
    over the expert-parallel ranks: `train.convert._ep_split`)."""
    convert = _convert()
    W, HF_LAYER, LAYER = convert.WeightMapping, convert.HF_LM + "layers.{layer}.", convert.LM + "decoder.layers.{layer}."
    return convert.COMMON_MAPPINGS + convert.DECODER_LAYER_MAPPINGS + (
        W((HF_LAYER + "mlp.gate.weight",), LAYER + "mlp.router.weight", only_if="is_moe"),
        W((HF_LAYER + "mlp.experts.gate_up_proj",), LAYER + "mlp.experts.weight1", "experts_fc1", only_if="is_moe",
          ep_dim=1),
        W((HF_LAYER + "mlp.experts.down_proj",), LAYER + "mlp.experts.weight2", "experts_fc2", only_if="is_moe",
          ep_dim=0),
    )


@functools.lru_cache(maxsize=16)
def hf_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint (transformers 5.x names) and its shape: the Qwen decoder
    (q/k norms, qkv biases as `arch` has them; a dense MLP or the expert stacks) and the tower."""
    convert, lm = _convert(), arch.lm
    h, d, f, v = lm.hidden_size, lm.head_dim, lm.intermediate_size, lm.vocab_size
    q, kv = lm.num_heads * d, lm.num_kv_heads * d
    layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
             "self_attn.o_proj.weight": (h, q)}
    if lm.is_moe:
        e, fe = lm.num_experts, lm.moe_intermediate_size
        layer.update({"mlp.gate.weight": (e, h), "mlp.experts.gate_up_proj": (e, h, 2 * fe),
                      "mlp.experts.down_proj": (e, fe, h)})
    else:
        layer.update({"mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)})
    if lm.qk_norm:
        layer.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    if lm.qkv_bias:
        layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    shapes = {convert.HF_LM + "embed_tokens.weight": (v, h), convert.HF_LM + "norm.weight": (h,)}
    if not lm.tie_word_embeddings:
        shapes[convert.HF_LM_HEAD] = (v, h)
    for i in range(lm.num_layers):
        shapes.update({f"{convert.HF_LM}layers.{i}.{k}": s for k, s in layer.items()})
    # Our VisionTower has HF's parameter names, so a meta-device instance lists them.
    tower = VisionTower(arch.vision, device="meta")
    shapes.update({convert.HF_VISION + k: tuple(t.shape) for k, t in tower.state_dict().items()})
    return shapes


# The expert stacks come in two layouts: the published checkpoints' [E, H, 2F] / [E, F, H]
# (what our weights are, see TRANSFORMS) and transformers 5.x's in-memory [E, 2F, H] / [E, H, F],
# which its `save_pretrained` writes. transformers tells them apart by shape (a tensor shaped
# like its parameter is taken as is); so do we, and a square stack (H == 2F, or H == F) is read
# as transformers reads it.
_EXPERT_STACKS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _transformers_layout_shapes(lm: LMArch) -> dict[str, tuple[int, ...]]:
    e, h, f = lm.num_experts, lm.hidden_size, lm.moe_intermediate_size
    return {"mlp.experts.gate_up_proj": (e, 2 * f, h), "mlp.experts.down_proj": (e, h, f)}


def expert_layout(hf: dict, lm: LMArch) -> dict:
    """Expert stacks shaped like transformers' in-memory layout, transposed. Reading, that
    gives the published layout; writing (from the published layout), it changes only a
    square stack, which transformers would otherwise take as its own layout."""
    if not lm.is_moe:
        return hf
    memory = _transformers_layout_shapes(lm)
    out = {}
    for key, value in hf.items():
        stack = next((s for s in _EXPERT_STACKS if key.endswith(s)), None)
        if stack is not None and tuple(value.shape) == memory[stack]:
            value = value.transpose(1, 2).contiguous()
        out[key] = value
    return out


# --- the decoder ---------------------------------------------------------------------------------


def block_spec(arch: ModelArch, config, vp_stage=None):
    from train.model.qwen_vl import uniform_block_spec

    return uniform_block_spec(arch, config, vp_stage)


# --- the family ---------------------------------------------------------------------------------


class Qwen3VLFamily(families.ModelFamily):
    name = FAMILY
    model_types = MODEL_TYPES
    vision_family = FAMILY
    vision_tower = Qwen3VLTower()
    hf_processor_class = "Qwen3VLProcessor"
    hf_video_processor_class = "Qwen3VLVideoProcessor"
    processor_defaults_family = FAMILY
    transforms = TRANSFORMS

    def arch_from_hf_config(self, config: dict) -> ModelArch:
        return arch_from_hf_config(config)

    def to_hf_config(self, arch: ModelArch) -> dict:
        return hf_config(arch)

    def hf_architecture(self, arch: ModelArch) -> str:
        return ARCHITECTURES[arch.lm.is_moe]

    def builtin_archs(self) -> dict[str, ModelArch]:
        return builtin_archs()

    def weight_mappings(self) -> tuple:
        return weight_mappings()

    def hf_shapes(self, arch: ModelArch) -> dict[str, tuple[int, ...]]:
        return hf_shapes(arch)

    def hf_checkpoint_layout(self, state: dict, arch: ModelArch) -> dict:
        return expert_layout(state, arch.lm)

    def hf_export_layout(self, state: dict, arch: ModelArch) -> dict:
        return expert_layout(state, arch.lm)

    def block_spec(self, arch: ModelArch, config, vp_stage=None):
        return block_spec(arch, config, vp_stage)


families.register(Qwen3VLFamily())
