"""Qwen3.5 / Qwen3.6 (`Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`): the
whole family on the training side, in one module.

How the family differs from Qwen3-VL, and where each difference is built:

- Hybrid decoder: `layer_types` makes three of every four layers Gated DeltaNet linear attention
  (`train.model.gated_delta_net.GatedDeltaNet`, exact on packed rows) and the fourth softmax
  attention; `layer_spec` gives each layer its token mixer.
- Gated attention: q_proj gives each head a query and a gate (HF rows per head: [query; gate]);
  the attention output is multiplied by sigmoid(gate) before o_proj. megatron-core's
  `attention_output_gate` lays the fused QKV out per query group as [queries, gates, key, value]
  (`fuse_gated_qkv`); `GatedSelfAttention` applies the gate with HF's rounding.
- Zero-centred norms: the decoder layers' norms, the q/k norms and the final norm hold w and
  scale by (1 + w) in fp32 (`ZeroCenteredRMSNorm`, HF's `Qwen3_5RMSNorm`); the Gated DeltaNet's
  own gated norm is a plain gain.
- Positions: M-RoPE on the first quarter of each head (`partial_rotary_factor` 0.25: 64 of 256
  dims), sections [11, 11, 10] interleaved as Qwen3-VL's, theta 1e7 (`LMArch.rotary_dim`; the
  rotary itself is the shared `train.model.rope`).
- Vision: the Qwen3-VL tower without DeepStack (the same blocks, merger, learned position table
  and 2-D rotary), so `VisionTower` builds it as a "qwen3-vl" tower with no DeepStack indexes.
- MoE: megatron-core's MoE layer as `train.model.moe` runs it, plus its shared expert with a
  sigmoid gate (`moe_shared_expert_gate`: sigmoid(x @ gate_weight^T) times the shared SwiGLU,
  HF's `shared_expert_gate`). The checkpoints hold every routed expert as its own tensors
  (`mlp.experts.{e}.gate_proj`), transformers' in-memory stacks are read too.
- Multi-token prediction: the checkpoints' `mtp.*` tensors are not built or trained; import-hf
  keeps them as they are and export-hf writes them back (`carried_prefixes`).

Built-in architectures (`builtin_archs`): one per published config.json under
configs/qwen3_5/ (`Qwen3.5-0.8B.json` is --arch qwen3.5-0.8b), and `tiny-qwen3.5` /
`tiny-qwen3.5-moe` for tests.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import zlib
from pathlib import Path

import torch
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (TransformerBlock, TransformerBlockSubmodules,
                                                         get_num_layers_to_build)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from torch import Tensor

from train.model import families
from train.model import gated_delta_net as gdn
from train.model.arch import LAYER_TYPES, LMArch, ModelArch, check_expert_count
from train.model.hf_config import text_section
from train.model.qwen_vl import RMSNorm, layer_spec as base_layer_spec
from train.model.vision import VisionArch

FAMILY = "qwen3.5"
MODEL_TYPES = {"qwen3_5": False, "qwen3_5_moe": True}
ARCHITECTURES = {False: "Qwen3_5ForConditionalGeneration", True: "Qwen3_5MoeForConditionalGeneration"}
SPECIAL_TOKEN_IDS = dict(image_token_id=248056, video_token_id=248057, vision_start_token_id=248053,
                         vision_end_token_id=248054)
CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs" / "qwen3_5"
# transformers' defaults where a config leaves a field out (Qwen3_5TextConfig, its rotary embedding)
DEFAULT_ROPE_THETA = 10000.0
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25
DEFAULT_MROPE_SECTION = (11, 11, 10)
DEFAULT_FULL_ATTENTION_INTERVAL = 4
LINEAR_ATTENTION_DEFAULTS = dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                                 linear_value_head_dim=128, linear_conv_kernel_dim=4)
MTP_PREFIX = "mtp."


# --- config.json <-> ModelArch ------------------------------------------------------------------


def _required(section: dict, key: str, where: str):
    if key not in section:
        raise ValueError(f"config.json {where}{key} is missing: a Qwen3.5 config needs it")
    return section[key]


def _layer_types(text: dict) -> tuple[str, ...]:
    layers = _required(text, "num_hidden_layers", "text_config.")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"config.json text_config.num_hidden_layers must be an integer >= 1, got {layers!r}: use the "
                         "config.json the checkpoint was saved with")
    types = text.get("layer_types")
    if types is None:  # transformers derives them so
        interval = text.get("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"config.json text_config.full_attention_interval must be an integer >= 1, got "
                             f"{interval!r}: use the config.json the checkpoint was saved with")
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if not isinstance(types, list):
        raise ValueError(f"config.json text_config.layer_types must be a list of one type per layer, got "
                         f"{str(types)[:60]!r}: use the config.json the checkpoint was saved with")
    unknown = sorted({str(t) for t in types} - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"config.json text_config.layer_types has {unknown}: this model builds {list(LAYER_TYPES)} "
                         "layers only")
    if len(types) != layers:
        raise ValueError(f"config.json text_config.layer_types lists {len(types)} layers, num_hidden_layers is {layers}")
    return tuple(types)


def _check_representable(text: dict, moe: bool) -> None:
    """Refuse, by field, a language-model config this model cannot build."""
    act = text.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json text_config.hidden_act {act!r}: this model builds SwiGLU (silu) MLPs only")
    if text.get("attention_bias"):
        raise ValueError("config.json text_config.attention_bias true: this model builds attention without biases")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"config.json text_config.rope_parameters.rope_type {rope['rope_type']!r}: this model builds "
                         "the default (unscaled) M-RoPE only")
    if moe and text.get("mlp_only_layers"):
        raise ValueError(f"config.json text_config.mlp_only_layers {text['mlp_only_layers']}: this model builds every "
                         "decoder layer as a Mixture-of-Experts layer (mlp_only_layers [])")
    gate = text.get("output_gate_type", "swish")
    if gate != "swish":
        raise ValueError(f"config.json text_config.output_gate_type {gate!r}: this model gates the Gated DeltaNet "
                         "output norm with swish (silu) only")
    for key, default in LINEAR_ATTENTION_DEFAULTS.items():  # each divides or sizes a Gated DeltaNet tensor
        value = text.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config.json text_config.{key} must be an integer >= 1, got {value!r}: use the "
                             "config.json the checkpoint was saved with")
    keys, values = text.get("linear_num_key_heads", 16), text.get("linear_num_value_heads", 32)
    if values % keys:
        raise ValueError(f"config.json text_config.linear_num_value_heads {values} must be a multiple of "
                         f"linear_num_key_heads {keys}")


def arch_from_hf_config(config: dict) -> ModelArch:
    """ModelArch of a Qwen3.5 / Qwen3.6 config.json (dense or MoE). HF's Qwen3.5 model gates its
    attention, zero-centres its norms and interleaves its M-RoPE whatever `attn_output_gate` and
    `mrope_interleaved` say, and its vision tower has no DeepStack whatever
    `deepstack_visual_indexes` lists: so do we."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}: expected one of {sorted(MODEL_TYPES)}")
    moe = MODEL_TYPES[model_type]
    _required(config, "text_config", "")  # a Qwen3.5 config nests its language model's settings there
    text = text_section(config)
    _check_representable(text, moe)
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    head_dim = text.get("head_dim", 256)
    partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR))
    for key, value in (("head_dim", head_dim), ("partial_rotary_factor", partial)):
        if value is None:  # transformers' Qwen3.5 model computes its rotary dims from both
            raise ValueError(f"config.json text_config.{key} is null: a Qwen3.5 config sets it; use the config.json "
                             "the checkpoint was saved with")
    partial = float(partial)
    if not 0 < partial <= 1:  # named before the sections, whose sum it would make look wrong
        raise ValueError(f"config.json partial_rotary_factor {partial} must be in (0, 1]: the share of each "
                         "attention head's dims M-RoPE rotates (Qwen3.5 configs: 0.25)")
    section = tuple(rope.get("mrope_section") or DEFAULT_MROPE_SECTION)
    rotary = int(head_dim * partial)
    if sum(section) != rotary // 2:
        raise ValueError(f"config.json mrope_section {list(section)} must sum to the rotary dims / 2 = {rotary // 2} "
                         f"(head_dim {head_dim} x partial_rotary_factor {partial})")
    tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    experts = {}
    if moe:
        count = _required(text, "num_experts", "text_config.")
        check_expert_count(count, "text_config.")
        experts = dict(num_experts=count,
                       num_experts_per_tok=_required(text, "num_experts_per_tok", "text_config."),
                       moe_intermediate_size=_required(text, "moe_intermediate_size", "text_config."),
                       shared_expert_intermediate_size=text.get("shared_expert_intermediate_size", 0),
                       router_aux_loss_coef=float(text.get("router_aux_loss_coef", 0.001)))
    lm = LMArch(
        vocab_size=_required(text, "vocab_size", "text_config."),
        hidden_size=_required(text, "hidden_size", "text_config."),
        num_layers=_required(text, "num_hidden_layers", "text_config."),
        num_heads=_required(text, "num_attention_heads", "text_config."),
        num_kv_heads=text.get("num_key_value_heads", text["num_attention_heads"]), head_dim=head_dim,
        intermediate_size=0 if moe else _required(text, "intermediate_size", "text_config."),
        rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", text.get("rope_theta", DEFAULT_ROPE_THETA))),
        mrope_section=section, mrope_interleaved=True, qkv_bias=False, qk_norm=True, tie_word_embeddings=bool(tie),
        layer_types=_layer_types(text),
        **{key: text.get(key, default) for key, default in LINEAR_ATTENTION_DEFAULTS.items()},
        partial_rotary_factor=partial, attn_output_gate=True, zero_centered_norms=True,
        mtp_num_hidden_layers=text.get("mtp_num_hidden_layers", 0),
        mtp_use_dedicated_embeddings=bool(text.get("mtp_use_dedicated_embeddings", False)),
        **experts)
    vision = dataclasses.replace(VisionArch.from_hf_config(FAMILY, _required(config, "vision_config", "")),
                                 deepstack_visual_indexes=())
    return ModelArch(family=FAMILY, lm=lm, vision=vision,
                     image_token_id=config.get("image_token_id", SPECIAL_TOKEN_IDS["image_token_id"]),
                     video_token_id=config.get("video_token_id", SPECIAL_TOKEN_IDS["video_token_id"]))


def to_hf_config(arch: ModelArch) -> dict:
    """The config.json of an exported checkpoint, in the published files' layout."""
    lm, model_type = arch.lm, hf_model_type(arch)
    text = dict(
        attention_bias=False, attn_output_gate=lm.attn_output_gate, head_dim=lm.head_dim, hidden_act="silu",
        hidden_size=lm.hidden_size, layer_types=list(lm.layer_types),
        linear_conv_kernel_dim=lm.linear_conv_kernel_dim, linear_key_head_dim=lm.linear_key_head_dim,
        linear_num_key_heads=lm.linear_num_key_heads, linear_num_value_heads=lm.linear_num_value_heads,
        linear_value_head_dim=lm.linear_value_head_dim, max_position_embeddings=262144, mlp_only_layers=[],
        model_type=model_type + "_text", mtp_num_hidden_layers=lm.mtp_num_hidden_layers,
        mtp_use_dedicated_embeddings=lm.mtp_use_dedicated_embeddings, num_attention_heads=lm.num_heads,
        num_hidden_layers=lm.num_layers, num_key_value_heads=lm.num_kv_heads, rms_norm_eps=lm.rms_norm_eps,
        tie_word_embeddings=lm.tie_word_embeddings, vocab_size=lm.vocab_size,
        rope_parameters={"mrope_interleaved": True, "mrope_section": list(lm.mrope_section), "rope_type": "default",
                         "rope_theta": lm.rope_theta, "partial_rotary_factor": lm.partial_rotary_factor})
    interval = DEFAULT_FULL_ATTENTION_INTERVAL
    if list(lm.layer_types) == ["linear_attention" if (i + 1) % interval else "full_attention"
                                for i in range(lm.num_layers)]:
        text["full_attention_interval"] = interval
    if lm.is_moe:
        text.update(moe_intermediate_size=lm.moe_intermediate_size, num_experts=lm.num_experts,
                    num_experts_per_tok=lm.num_experts_per_tok, router_aux_loss_coef=lm.router_aux_loss_coef,
                    shared_expert_intermediate_size=lm.shared_expert_intermediate_size)
    else:
        text["intermediate_size"] = lm.intermediate_size
    vision = {**arch.vision.to_hf_config(), "model_type": model_type + "_vision", "deepstack_visual_indexes": []}
    return dict(architectures=[hf_architecture(arch)], model_type=model_type, text_config=text, vision_config=vision,
                tie_word_embeddings=lm.tie_word_embeddings,
                **{**SPECIAL_TOKEN_IDS, "image_token_id": arch.image_token_id, "video_token_id": arch.video_token_id})


def hf_model_type(arch: ModelArch) -> str:
    return next(t for t, moe in MODEL_TYPES.items() if moe == arch.lm.is_moe)


def hf_architecture(arch: ModelArch) -> str:
    return ARCHITECTURES[arch.lm.is_moe]


# --- built-in architectures ---------------------------------------------------------------------


def _tiny_lm(**moe) -> LMArch:
    """Every structural feature at CPU-test size: 3 linear-attention layers then a full one (PP=2
    puts two on each stage), GQA, gated attention with a 8-dim rotary (4 frequencies: T, H, W,
    T) of 32-dim heads, Gated DeltaNet with 2 key heads serving 4 value heads of unequal head
    dims (TP=2 splits both), the real vocabulary (real token ids work)."""
    return LMArch(vocab_size=248320, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                  intermediate_size=0 if moe else 128, rms_norm_eps=1e-6, rope_theta=1e7, mrope_section=(2, 1, 1),
                  mrope_interleaved=True, qkv_bias=False, qk_norm=True, tie_word_embeddings=not moe,
                  layer_types=("linear_attention",) * 3 + ("full_attention",), linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
                  partial_rotary_factor=0.25, attn_output_gate=True, zero_centered_norms=True, **moe)


def _tiny_archs() -> dict[str, ModelArch]:
    vision = VisionArch(family="qwen3-vl", depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                        out_hidden_size=64, hidden_act="gelu_pytorch_tanh")
    ids = {k: SPECIAL_TOKEN_IDS[k] for k in ("image_token_id", "video_token_id")}
    return {
        "tiny-qwen3.5": ModelArch(FAMILY, _tiny_lm(), vision, **ids),
        "tiny-qwen3.5-moe": ModelArch(FAMILY, _tiny_lm(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                                                       shared_expert_intermediate_size=40, router_aux_loss_coef=0.001),
                                      vision, **ids),
    }


def preset_name(config_file: Path) -> str:
    """The --arch name of a vendored config.json: its file name, lower case (Qwen3.5-0.8B.json: qwen3.5-0.8b)."""
    return config_file.stem.lower()


@functools.lru_cache(maxsize=1)
def builtin_archs() -> dict[str, ModelArch]:
    """The published architectures, each read from its config.json in CONFIGS_DIR (the random-init
    weights of `--arch`), and the tiny test architectures."""
    published = {preset_name(path): arch_from_hf_config(json.loads(path.read_text()))
                 for path in sorted(CONFIGS_DIR.glob("*.json"))}
    return {**published, **_tiny_archs()}


# --- the decoder ---------------------------------------------------------------------------------


class ZeroCenteredRMSNorm(RMSNorm):
    """HF's `Qwen3_5RMSNorm`: normalised in fp32 and scaled by (1 + w) in fp32, then cast back
    (Qwen3-VL's norm casts before scaling). The gain starts at 0, i.e. a scale of 1."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **kwargs):
        super().__init__(config, hidden_size, eps=eps, **kwargs)
        torch.nn.init.zeros_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GatedSelfAttention(SelfAttention):
    """megatron's self-attention with `attention_output_gate`, the gate applied as HF does it:
    sigmoid in the activations' dtype (megatron's own is a torch.compile'd fp32 product)."""

    def _apply_output_gate(self, x: Tensor, gate: Tensor) -> Tensor:
        return x * torch.sigmoid(gate.reshape(x.shape))


def _norm(arch: ModelArch) -> type:
    return ZeroCenteredRMSNorm if arch.lm.zero_centered_norms else RMSNorm


def layer_spec(arch: ModelArch, layer: int, cpu: bool = False) -> ModuleSpec:
    """Decoder layer `layer` (global, 0-based): the shared Qwen-VL layer spec (packed attention,
    the decoder linears, MoE with its shared expert) with this family's norms, and as token mixer
    the Gated DeltaNet or gated softmax attention, as `layer_types` says."""
    spec = base_layer_spec(arch, cpu)
    layer_modules, norm = spec.submodules, _norm(arch)
    layer_modules.input_layernorm = layer_modules.pre_mlp_layernorm = norm
    if arch.lm.layer_type(layer) == "linear_attention":
        layer_modules.self_attention = ModuleSpec(module=gdn.GatedDeltaNet, submodules=gdn.GatedDeltaNetSubmodules())
    else:
        attention = layer_modules.self_attention
        if arch.lm.attn_output_gate:
            attention.module = GatedSelfAttention
        attention.submodules.q_layernorm = attention.submodules.k_layernorm = norm
    return spec


def block_spec(arch: ModelArch, config, vp_stage=None) -> ModuleSpec:
    """This pipeline stage's decoder block: each of its layers by its global number, and the final norm."""
    first = get_transformer_layer_offset(config, vp_stage)
    layers = get_num_layers_to_build(config, vp_stage)
    return ModuleSpec(module=TransformerBlock, submodules=TransformerBlockSubmodules(
        layer_specs=[layer_spec(arch, first + i, cpu=config.use_cpu_initialization) for i in range(layers)],
        layer_norm=_norm(arch)))


# --- weights ------------------------------------------------------------------------------------


def _convert():
    from train.model import weight_names  # the name table the converter reads too

    return weight_names


def fuse_gated_qkv(q: Tensor, k: Tensor, v: Tensor, lm: LMArch) -> Tensor:
    """HF q_proj (per head [query; gate] rows), k_proj, v_proj -> megatron's gated QKV rows: per
    query group [its queries, their gates, its key, its value] (`get_query_key_value_tensors`
    with `output_gate`)."""
    groups, d, rest = lm.num_kv_heads, lm.head_dim, q.shape[1:]
    per_group = lm.num_heads // groups
    query_gate = q.reshape(groups, per_group, 2, d, *rest).transpose(1, 2).reshape(groups, 2 * per_group * d, *rest)
    return torch.cat([query_gate, k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)], dim=1).reshape(-1, *rest)


def split_gated_qkv(qkv: Tensor, lm: LMArch) -> tuple[Tensor, Tensor, Tensor]:
    groups, d, rest = lm.num_kv_heads, lm.head_dim, qkv.shape[1:]
    per_group = lm.num_heads // groups
    query_gate, k, v = qkv.reshape(groups, 2 * per_group * d + 2 * d, *rest).split([2 * per_group * d, d, d], dim=1)
    q = query_gate.reshape(groups, 2, per_group, d, *rest).transpose(1, 2).reshape(-1, *rest)
    return q.contiguous(), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _in_proj_sizes(lm: LMArch) -> list[int]:
    """The rows of in_proj_qkv, in_proj_z, in_proj_b, in_proj_a."""
    rows = gdn.GatedDeltaNetDims.from_lm(lm).block_rows()
    return [sum(rows[block] for block in blocks) for _, blocks in gdn.WEIGHTS[0].hf]


def _experts_fc1(tensors: list[Tensor], lm: LMArch) -> Tensor:
    """Each expert's gate_proj, up_proj [F, H] (in expert order) -> GroupedMLP's weight1 [H, E*2F],
    whose memory is [E, H, 2F]: each expert's [gate | up] columns (`train.model.moe`)."""
    if tensors[0].is_meta:  # shapes only (`convert.megatron_shapes`): no per-expert work
        return torch.empty(lm.hidden_size, len(tensors) * tensors[0].shape[0], device="meta")
    pairs = zip(tensors[0::2], tensors[1::2])
    return torch.stack([torch.cat([gate.t(), up.t()], dim=1) for gate, up in pairs]).reshape(lm.hidden_size, -1)


def _experts_fc1_back(tensor: Tensor, lm: LMArch) -> tuple[Tensor, ...]:
    stack = tensor.reshape(lm.num_experts, lm.hidden_size, -1)
    width = lm.moe_intermediate_size
    return tuple(t.t().contiguous() for e in range(lm.num_experts) for t in (stack[e, :, :width], stack[e, :, width:]))


def _experts_fc2(tensors: list[Tensor], lm: LMArch) -> Tensor:
    """Each expert's down_proj [H, F] -> GroupedMLP's weight2 [E*F, H] (memory [E, F, H])."""
    if tensors[0].is_meta:
        return torch.empty(len(tensors) * tensors[0].shape[1], lm.hidden_size, device="meta")
    return torch.stack([down.t() for down in tensors]).reshape(-1, lm.hidden_size)


def _experts_fc2_back(tensor: Tensor, lm: LMArch) -> tuple[Tensor, ...]:
    stack = tensor.reshape(lm.num_experts, -1, lm.hidden_size)
    return tuple(stack[e].t().contiguous() for e in range(lm.num_experts))


TRANSFORMS = {
    "gated_qkv": (lambda tensors, lm: fuse_gated_qkv(*tensors, lm), split_gated_qkv),
    "linear_in_proj": (lambda tensors, lm: torch.cat(tensors), lambda tensor, lm: tuple(tensor.split(_in_proj_sizes(lm)))),
    "experts_fc1_each": (_experts_fc1, _experts_fc1_back),
    "experts_fc2_each": (_experts_fc2, _experts_fc2_back),
}


@functools.lru_cache(maxsize=1)
def weight_mappings() -> tuple:
    """HF (the published checkpoints' names) <-> Megatron names of `QwenVLModel` for this family.
    `layers` rows apply to the decoder layers of that kind only; `{expert}` rows list every expert."""
    convert = _convert()
    W, HF_LAYER, LAYER = convert.WeightMapping, convert.HF_LM + "layers.{layer}.", convert.LM + "decoder.layers.{layer}."
    common = convert.COMMON_MAPPINGS  # vision, embeddings, head, final norm
    linear_splits = {"heads": convert.LINEAR_ATTENTION_SPLIT, "row": "row", "replicated": "replicated"}
    linear = tuple(
        W(tuple(HF_LAYER + name for name, _ in weight.hf), LAYER + "self_attention." + weight.param,
          "linear_in_proj" if len(weight.hf) > 1 else "copy", linear_splits[weight.tp_split], layers="linear_attention")
        for weight in gdn.WEIGHTS)
    expert = HF_LAYER + "mlp.experts.{expert}."
    return common + linear + (
        W((HF_LAYER + "input_layernorm.weight",), LAYER + "input_layernorm.weight"),
        W((HF_LAYER + "post_attention_layernorm.weight",), LAYER + "pre_mlp_layernorm.weight"),
        W((HF_LAYER + "self_attn.q_norm.weight",), LAYER + "self_attention.q_layernorm.weight", layers="full_attention"),
        W((HF_LAYER + "self_attn.k_norm.weight",), LAYER + "self_attention.k_layernorm.weight", layers="full_attention"),
        W(tuple(f"{HF_LAYER}self_attn.{x}_proj.weight" for x in "qkv"), LAYER + "self_attention.linear_qkv.weight",
          "gated_qkv", "column", layers="full_attention"),
        W((HF_LAYER + "self_attn.o_proj.weight",), LAYER + "self_attention.linear_proj.weight", tp_split="row",
          layers="full_attention"),
        W((HF_LAYER + "mlp.gate_proj.weight", HF_LAYER + "mlp.up_proj.weight"), LAYER + "mlp.linear_fc1.weight",
          "gate_up", "gated", only_if="not is_moe"),
        W((HF_LAYER + "mlp.down_proj.weight",), LAYER + "mlp.linear_fc2.weight", tp_split="row", only_if="not is_moe"),
        # Mixture-of-Experts: routed experts whole on every TP rank and divided over the
        # expert-parallel ranks; the shared expert split over TP as a dense MLP
        W((HF_LAYER + "mlp.gate.weight",), LAYER + "mlp.router.weight", only_if="is_moe"),
        W((expert + "gate_proj.weight", expert + "up_proj.weight"), LAYER + "mlp.experts.weight1", "experts_fc1_each",
          only_if="is_moe", ep_dim=1),
        W((expert + "down_proj.weight",), LAYER + "mlp.experts.weight2", "experts_fc2_each", only_if="is_moe",
          ep_dim=0),
        W((HF_LAYER + "mlp.shared_expert.gate_proj.weight", HF_LAYER + "mlp.shared_expert.up_proj.weight"),
          LAYER + "mlp.shared_experts.linear_fc1.weight", "gate_up", "gated", only_if="shared_expert_intermediate_size"),
        W((HF_LAYER + "mlp.shared_expert.down_proj.weight",), LAYER + "mlp.shared_experts.linear_fc2.weight",
          tp_split="row", only_if="shared_expert_intermediate_size"),
        W((HF_LAYER + "mlp.shared_expert_gate.weight",), LAYER + "mlp.shared_experts.gate_weight",
          only_if="shared_expert_intermediate_size"),
    )


@functools.lru_cache(maxsize=16)
def hf_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint (published names; experts one by one) and its shape."""
    from train.model.vision import VisionTower

    convert, lm = _convert(), arch.lm
    h, d, v = lm.hidden_size, lm.head_dim, lm.vocab_size
    q, kv = lm.num_heads * d, lm.num_kv_heads * d
    dims = gdn.GatedDeltaNetDims.from_lm(lm)
    full = {"self_attn.q_proj.weight": (2 * q if lm.attn_output_gate else q, h), "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q), "self_attn.q_norm.weight": (d,),
            "self_attn.k_norm.weight": (d,)}
    linear = {"linear_attn.in_proj_qkv.weight": (dims.conv_dim, h), "linear_attn.in_proj_z.weight": (dims.value_dim, h),
              "linear_attn.in_proj_b.weight": (dims.num_value_heads, h),
              "linear_attn.in_proj_a.weight": (dims.num_value_heads, h),
              "linear_attn.conv1d.weight": (dims.conv_dim, 1, dims.conv_kernel),
              "linear_attn.A_log": (dims.num_value_heads,), "linear_attn.dt_bias": (dims.num_value_heads,),
              "linear_attn.norm.weight": (dims.value_head_dim,), "linear_attn.out_proj.weight": (h, dims.value_dim)}
    mlp = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    if lm.is_moe:
        f = lm.moe_intermediate_size
        mlp["mlp.gate.weight"] = (lm.num_experts, h)
        for e in range(lm.num_experts):
            mlp.update({f"mlp.experts.{e}.gate_proj.weight": (f, h), f"mlp.experts.{e}.up_proj.weight": (f, h),
                        f"mlp.experts.{e}.down_proj.weight": (h, f)})
        if lm.shared_expert_intermediate_size:
            s = lm.shared_expert_intermediate_size
            mlp.update({"mlp.shared_expert.gate_proj.weight": (s, h), "mlp.shared_expert.up_proj.weight": (s, h),
                        "mlp.shared_expert.down_proj.weight": (h, s), "mlp.shared_expert_gate.weight": (1, h)})
    else:
        f = lm.intermediate_size
        mlp.update({"mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)})
    shapes = {convert.HF_LM + "embed_tokens.weight": (v, h), convert.HF_LM + "norm.weight": (h,)}
    if not lm.tie_word_embeddings:
        shapes[convert.HF_LM_HEAD] = (v, h)
    for i in range(lm.num_layers):
        mixer = linear if lm.layer_type(i) == "linear_attention" else full
        shapes.update({f"{convert.HF_LM}layers.{i}.{k}": s for k, s in (mixer | mlp).items()})
    tower = VisionTower(arch.vision, device="meta")
    shapes.update({convert.HF_VISION + k: tuple(t.shape) for k, t in tower.state_dict().items()})
    return shapes


_EXPERT_STACKS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def hf_checkpoint_layout(state: dict, arch: ModelArch) -> dict:
    """transformers' in-memory expert stacks (`mlp.experts.gate_up_proj` [E, 2F, H],
    `mlp.experts.down_proj` [E, H, F], what a model's state_dict holds) -> the checkpoints' one
    tensor per expert; everything else as it is."""
    if not arch.lm.is_moe:
        return state
    out = {}
    for key, value in state.items():
        stack = next((s for s in _EXPERT_STACKS if key.endswith(s)), None)
        if stack is None:
            out[key] = value
            continue
        if not isinstance(value, torch.Tensor):  # a tensor read lazily from a checkpoint file
            value = value.load()
        prefix = key.removesuffix("gate_up_proj").removesuffix("down_proj")
        for e in range(value.shape[0]):
            if stack.endswith("gate_up_proj"):
                gate, up = value[e].chunk(2, dim=0)
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = gate, up
            else:
                out[f"{prefix}{e}.down_proj.weight"] = value[e]
    return out


def _init_tensor(name: str, shape: tuple[int, ...], seed: int) -> Tensor | None:
    """Random-init values that differ from the default draw: zero-centred norms start at 0 (a
    scale of 1), and the Gated DeltaNet's conv, A_log and dt_bias start as HF initialises them
    (each drawn from its own generator, seeded by (seed, name))."""
    norms = ("input_layernorm.weight", "pre_mlp_layernorm.weight", "q_layernorm.weight", "k_layernorm.weight",
             "final_layernorm.weight")
    if name.startswith("language_model.") and name.endswith(norms):
        return torch.zeros(shape)
    if not name.startswith("language_model.decoder.layers."):
        return None
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if name.endswith("self_attention.dt_bias"):
        return torch.ones(shape)
    if name.endswith("self_attention.A_log"):
        return torch.empty(shape).uniform_(0.01, 16, generator=generator).log_()
    if name.endswith("self_attention.conv1d.weight"):
        bound = 1.0 / math.sqrt(shape[-1])
        return torch.empty(shape).uniform_(-bound, bound, generator=generator)
    return None


# --- the family ---------------------------------------------------------------------------------


class Qwen3_5Family(families.ModelFamily):
    name = FAMILY
    model_types = MODEL_TYPES
    vision_family = "qwen3-vl"
    hf_processor_class = "Qwen3VLProcessor"
    hf_video_processor_class = "Qwen3VLVideoProcessor"
    processor_defaults_family = "qwen3-vl"  # preprocess/families/qwen3_5_constants.py: the same values as Qwen3-VL's
    carried_prefixes = (MTP_PREFIX,)
    transforms = TRANSFORMS

    def arch_from_hf_config(self, config: dict) -> ModelArch:
        return arch_from_hf_config(config)

    def to_hf_config(self, arch: ModelArch) -> dict:
        return to_hf_config(arch)

    def hf_model_type(self, arch: ModelArch) -> str:
        return hf_model_type(arch)

    def hf_architecture(self, arch: ModelArch) -> str:
        return hf_architecture(arch)

    def builtin_archs(self) -> dict[str, ModelArch]:
        return builtin_archs()

    def weight_mappings(self) -> tuple:
        return weight_mappings()

    def hf_shapes(self, arch: ModelArch) -> dict[str, tuple[int, ...]]:
        return hf_shapes(arch)

    def hf_checkpoint_layout(self, state: dict, arch: ModelArch) -> dict:
        return hf_checkpoint_layout(state, arch)

    def block_spec(self, arch: ModelArch, config, vp_stage=None) -> ModuleSpec:
        return block_spec(arch, config, vp_stage)

    def init_tensor(self, name: str, shape: tuple[int, ...], seed: int) -> Tensor | None:
        return _init_tensor(name, shape, seed)


families.register(Qwen3_5Family())
