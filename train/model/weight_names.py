"""The HF <-> Megatron name table of `QwenVLModel`'s weights (`WeightMapping` rows): what the
converter (`train.convert`) reads in both directions, and what a family module
(`train.model.qwen3_5`) builds its own table from. Part of the model, so the model package
needs nothing of the converter."""

from __future__ import annotations

from dataclasses import dataclass

from train.model.arch import LMArch

LINEAR_ATTENTION_SPLIT = "linear_attention_heads"  # tp_split of a Gated DeltaNet parameter: its own head blocks

HF_LM = "model.language_model."
HF_VISION = "model.visual."
HF_LM_HEAD = "lm_head.weight"
LM = "language_model."
VISION = "vision."
EMBED = LM + "embedding.word_embeddings.weight"
OUTPUT = LM + "output_layer.weight"


@dataclass(frozen=True)
class WeightMapping:
    """HF tensor(s) <-> one Megatron tensor, read in both directions.

    Names are patterns: `{layer}` is a decoder layer number (the row holds for every layer, or
    with `layers` for the layers of that `LMArch.layer_type`), `{expert}` in an HF name an
    expert number (the row's HF names repeat for every expert, in expert order), a trailing `*`
    is any rest of the name, kept as it is. `transform` turns the HF tensors into the Megatron
    one and back (`train.convert.TRANSFORMS`, and a family's own); `tp_split` is how megatron
    divides the Megatron tensor over TP ranks (`train.convert._split`); `only_if` names the
    `LMArch` field the row needs ("not FLAG": needs it false); `ep_dim`, for expert stacks, the
    dim divided over the expert-parallel ranks.
    """

    hf: tuple[str, ...]
    megatron: str
    transform: str = "copy"
    tp_split: str = "replicated"
    only_if: str | None = None
    ep_dim: int | None = None  # expert stacks: the dim that holds the experts (`train.convert._ep_split`)
    layers: str | None = None  # "{layer}" rows: the layer type they belong to (None: every layer)

    def applies(self, lm: LMArch) -> bool:
        if self.only_if is None:
            return True
        flag = self.only_if.removeprefix("not ")
        return bool(getattr(lm, flag)) == (flag == self.only_if)


_HF_LAYER = HF_LM + "layers.{layer}."
_LAYER = LM + "decoder.layers.{layer}."

# Transformers 5.x names -> Megatron names of our `QwenVLModel`: the rows of every family's table,
COMMON_MAPPINGS = (
    WeightMapping((HF_VISION + "*",), VISION + "*"),  # our VisionTower keeps HF's parameter names
    WeightMapping((HF_LM + "embed_tokens.weight",), EMBED, tp_split="column"),
    WeightMapping((HF_LM + "norm.weight",), LM + "decoder.final_layernorm.weight"),
    WeightMapping((HF_LM_HEAD,), OUTPUT, tp_split="column", only_if="not tie_word_embeddings"),
)
# and the Qwen decoder layer's (softmax attention, a dense SwiGLU MLP) of Qwen3-VL's and Qwen2.5-VL's.
DECODER_LAYER_MAPPINGS = (
    WeightMapping((_HF_LAYER + "input_layernorm.weight",), _LAYER + "input_layernorm.weight"),
    WeightMapping((_HF_LAYER + "post_attention_layernorm.weight",), _LAYER + "pre_mlp_layernorm.weight"),
    WeightMapping((_HF_LAYER + "self_attn.q_norm.weight",), _LAYER + "self_attention.q_layernorm.weight", only_if="qk_norm"),
    WeightMapping((_HF_LAYER + "self_attn.k_norm.weight",), _LAYER + "self_attention.k_layernorm.weight", only_if="qk_norm"),
    WeightMapping(tuple(f"{_HF_LAYER}self_attn.{x}_proj.weight" for x in "qkv"), _LAYER + "self_attention.linear_qkv.weight",
                  "qkv", "column"),
    WeightMapping(tuple(f"{_HF_LAYER}self_attn.{x}_proj.bias" for x in "qkv"), _LAYER + "self_attention.linear_qkv.bias",
                  "qkv", "column", only_if="qkv_bias"),
    WeightMapping((_HF_LAYER + "self_attn.o_proj.weight",), _LAYER + "self_attention.linear_proj.weight", tp_split="row"),
    WeightMapping((_HF_LAYER + "mlp.gate_proj.weight", _HF_LAYER + "mlp.up_proj.weight"), _LAYER + "mlp.linear_fc1.weight",
                  "gate_up", "gated", only_if="not is_moe"),
    WeightMapping((_HF_LAYER + "mlp.down_proj.weight",), _LAYER + "mlp.linear_fc2.weight", tp_split="row",
                  only_if="not is_moe"),
)


def renamed(state: dict, prefixes: tuple[tuple[str, str], ...]) -> dict:
    """`state` with each name starting with the first of a (prefix, replacement) pair renamed to
    start with the second."""
    out = {}
    for key, value in state.items():
        for new, old in prefixes:
            if key.startswith(new):
                key = old + key.removeprefix(new)
                break
        out[key] = value
    return out
