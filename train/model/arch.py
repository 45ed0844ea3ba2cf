"""Architectures: what the model is, independent of how it is parallelised.

`ModelArch` = language model shape (`LMArch`) + vision tower shape (`VisionArch`) + the
image token id. Built in (`qwen3-vl-2b`, `qwen2.5-vl-3b`, and `tiny` / `tiny-qwen2.5` for
tests), or read from a Hugging Face `config.json` (both the nested `text_config` layout of
transformers 5.x and the flat Qwen2.5-VL layout with `rope_scaling`). `to_hf_config` writes
the config that `transformers` loads for an exported checkpoint. Families with a module of
their own (`train.model.families`: Qwen3.5 / Qwen3.6) translate their configs and hold their
built-in architectures there; `builtin_arch` and `from_hf_config` reach them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from train.model import families
from train.model.vision import VisionArch

FAMILIES = ("qwen3-vl", "qwen2.5-vl")
# (family, Mixture-of-Experts language model) -> Hugging Face model_type / architecture. The
# MoE checkpoints share the dense family's vision tower, chat template and processor: for the
# data they are the same family.
HF_MODEL_TYPE = {("qwen3-vl", False): "qwen3_vl", ("qwen2.5-vl", False): "qwen2_5_vl",
                 ("qwen3-vl", True): "qwen3_vl_moe"}
HF_ARCHITECTURE = {("qwen3-vl", False): "Qwen3VLForConditionalGeneration",
                   ("qwen2.5-vl", False): "Qwen2_5_VLForConditionalGeneration",
                   ("qwen3-vl", True): "Qwen3VLMoeForConditionalGeneration"}
SPECIAL_TOKEN_IDS = dict(image_token_id=151655, video_token_id=151656,
                         vision_start_token_id=151652, vision_end_token_id=151653)


@dataclass(frozen=True)
class LMArch:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    mrope_interleaved: bool  # Qwen3-VL: T/H/W interleaved over frequencies; Qwen2.5-VL: chunked
    qkv_bias: bool  # Qwen2.5-VL
    qk_norm: bool  # Qwen3-VL
    tie_word_embeddings: bool
    # Mixture-of-Experts (Qwen3-VL MoE): every decoder layer's MLP is `num_experts` SwiGLU
    # experts of width `moe_intermediate_size`, `num_experts_per_tok` of them per token
    # (softmax over the experts, top-k, renormalised). 0 experts: a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    router_aux_loss_coef: float = 0.0
    # A SwiGLU expert of this width that every token passes through beside its routed experts,
    # its output scaled by sigmoid(a learned linear of the token) (Qwen3.5 MoE); 0: none.
    shared_expert_intermediate_size: int = 0
    # Hybrid decoders (Qwen3.5): each layer's token mixer, "full_attention" (softmax attention) or
    # "linear_attention" (Gated DeltaNet, `train.model.gated_delta_net`); () means every layer is
    # full attention. The linear_* fields are the Gated DeltaNet's shape (HF's names).
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # M-RoPE rotates the first head_dim * partial_rotary_factor dims of each q/k head; the rest pass.
    partial_rotary_factor: float = 1.0
    # q_proj also gives a gate per head dim: the attention output is multiplied by sigmoid(gate).
    attn_output_gate: bool = False
    # RMSNorm gains stored zero-centred, applied as (1 + w): the decoder layers' norms, the q/k
    # norms and the final norm (Qwen3.5; a Gated DeltaNet's own gated norm is a plain gain).
    zero_centered_norms: bool = False
    # Multi-token-prediction layers of the checkpoint: not built or trained, their tensors carried
    # from import to export as they are (`convert.carried_tensors`).
    mtp_num_hidden_layers: int = 0
    mtp_use_dedicated_embeddings: bool = False

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        """The rotated dims of each q/k head (HF: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_type(self, layer: int) -> str:
        """The token mixer of decoder layer `layer` (0-based, global)."""
        return self.layer_types[layer] if self.layer_types else "full_attention"

    @property
    def has_linear_attention(self) -> bool:
        return "linear_attention" in self.layer_types

    def _mixer_params(self, layer: int) -> int:
        h = self.hidden_size
        if self.layer_type(layer) == "linear_attention":
            keys, values = self.linear_num_key_heads * self.linear_key_head_dim, \
                self.linear_num_value_heads * self.linear_value_head_dim
            conv = 2 * keys + values
            # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a; the depthwise conv; A_log, dt_bias; the
            # gated norm; out_proj
            return (h * (conv + values + 2 * self.linear_num_value_heads) + conv * self.linear_conv_kernel_dim
                    + 2 * self.linear_num_value_heads + self.linear_value_head_dim + values * h)
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * q * (3 if self.attn_output_gate else 2) + h * kv * 2  # q (and its gate), o; k, v

    def _mlp_params(self, experts: int) -> int:
        h = self.hidden_size
        if not self.is_moe:
            return 3 * h * self.intermediate_size
        shared = 3 * h * self.shared_expert_intermediate_size + h if self.shared_expert_intermediate_size else 0
        return experts * 3 * h * self.moe_intermediate_size + self.num_experts * h + shared  # + router

    def _layers_params(self, experts: int) -> int:
        return sum(self._mixer_params(i) for i in range(self.num_layers)) + self.num_layers * self._mlp_params(experts)

    def num_params(self) -> int:
        """Parameters of the language model (embeddings counted once when tied; norms not counted)."""
        emb = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self._layers_params(self.num_experts) + emb

    def num_non_embedding_params(self) -> int:
        """N for the 6*N flops-per-token rule, with the output projection counted (it is a
        GEMM). For MoE, the parameters one token passes through (its top-k experts)."""
        return self._layers_params(self.num_experts_per_tok) + self.vocab_size * self.hidden_size


@dataclass(frozen=True)
class ModelArch:
    family: str
    lm: LMArch
    vision: VisionArch
    image_token_id: int = SPECIAL_TOKEN_IDS["image_token_id"]
    video_token_id: int = SPECIAL_TOKEN_IDS["video_token_id"]

    @property
    def num_deepstack(self) -> int:
        return len(self.vision.deepstack_visual_indexes)

    @property
    def hf_model_type(self) -> str:
        family = families.by_name(self.family)
        return family.hf_model_type(self) if family else HF_MODEL_TYPE[(self.family, self.lm.is_moe)]

    @property
    def hf_architecture(self) -> str:
        """The transformers class of this architecture."""
        family = families.by_name(self.family)
        return family.hf_architecture(self) if family else HF_ARCHITECTURE[(self.family, self.lm.is_moe)]

    @classmethod
    def from_hf_config(cls, config: dict) -> ModelArch:
        model_type = config.get("model_type")
        family = families.by_model_type(model_type) if isinstance(model_type, str) else None
        if family is not None:
            return family.arch_from_hf_config(config)
        kind = {v: k for k, v in HF_MODEL_TYPE.items()}.get(model_type)
        if kind is None:
            known = sorted([*HF_MODEL_TYPE.values(), *(t for f in families.all_families() for t in f.model_types)])
            raise ValueError(f"unsupported model_type {model_type!r} in config.json: expected one of {known}")
        family, moe = kind
        text = config.get("text_config") or config
        _check_representable(text, moe)
        rope = text.get("rope_parameters") or text.get("rope_scaling") or config.get("rope_scaling") or {}
        theta = rope.get("rope_theta", text.get("rope_theta"))
        qwen3 = family == "qwen3-vl"
        section = tuple(rope.get("mrope_section") or ((24, 20, 20) if qwen3 else (16, 24, 24)))
        head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
        if sum(section) != head_dim // 2:
            raise ValueError(f"mrope_section {list(section)} must sum to head_dim/2 = {head_dim // 2}")
        tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        lm = LMArch(
            vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
            num_layers=text["num_hidden_layers"], num_heads=text["num_attention_heads"],
            num_kv_heads=text.get("num_key_value_heads", text["num_attention_heads"]), head_dim=head_dim,
            intermediate_size=text["intermediate_size"], rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta if theta is not None else (5e6 if qwen3 else 1e6)),
            mrope_section=section, mrope_interleaved=qwen3, qkv_bias=not qwen3, qk_norm=qwen3,
            tie_word_embeddings=bool(tie),
            # transformers >= 5.2x saves num_experts as num_local_experts
            **(dict(num_experts=text.get("num_experts", text.get("num_local_experts")), num_experts_per_tok=text["num_experts_per_tok"],
                    moe_intermediate_size=text["moe_intermediate_size"],
                    router_aux_loss_coef=float(text.get("router_aux_loss_coef", 0.001))) if moe else {}))
        vision = VisionArch.from_hf_config(family, config["vision_config"])
        return cls(family=family, lm=lm, vision=vision,
                   image_token_id=config.get("image_token_id", SPECIAL_TOKEN_IDS["image_token_id"]),
                   video_token_id=config.get("video_token_id", SPECIAL_TOKEN_IDS["video_token_id"]))

    @classmethod
    def from_hf_dir(cls, model_dir: str | Path) -> ModelArch:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: --hf-model must be a Hugging Face model directory")
        return cls.from_hf_config(json.loads(path.read_text()))

    def to_hf_config(self) -> dict:
        family = families.by_name(self.family)
        if family is not None:
            return family.to_hf_config(self)
        lm = self.lm
        rope = {"rope_type": "default", "rope_theta": lm.rope_theta, "mrope_section": list(lm.mrope_section)}
        if lm.mrope_interleaved:
            rope["mrope_interleaved"] = True
        text = dict(
            vocab_size=lm.vocab_size, hidden_size=lm.hidden_size, intermediate_size=lm.intermediate_size,
            num_hidden_layers=lm.num_layers, num_attention_heads=lm.num_heads,
            num_key_value_heads=lm.num_kv_heads, head_dim=lm.head_dim, hidden_act="silu",
            rms_norm_eps=lm.rms_norm_eps, max_position_embeddings=128000, attention_bias=lm.qkv_bias,
            rope_parameters=rope, tie_word_embeddings=lm.tie_word_embeddings,
            model_type=self.hf_model_type + "_text")
        if lm.is_moe:
            text.update(num_experts=lm.num_experts, num_experts_per_tok=lm.num_experts_per_tok,
                        moe_intermediate_size=lm.moe_intermediate_size, decoder_sparse_step=1, mlp_only_layers=[],
                        router_aux_loss_coef=lm.router_aux_loss_coef)
        return dict(architectures=[self.hf_architecture], model_type=self.hf_model_type,
                    text_config=text, vision_config=self.vision.to_hf_config(),
                    tie_word_embeddings=lm.tie_word_embeddings,
                    **{**SPECIAL_TOKEN_IDS, "image_token_id": self.image_token_id,
                       "video_token_id": self.video_token_id})


def _check_representable(text: dict, moe: bool) -> None:
    """Refuse, by field, a language-model config this model cannot build."""
    act = text.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json text hidden_act {act!r}: this model builds SwiGLU (silu) MLPs only")
    if moe:
        sparse_step, dense_layers = text.get("decoder_sparse_step", 1), text.get("mlp_only_layers") or []
        if sparse_step != 1 or dense_layers:
            raise ValueError(f"config.json decoder_sparse_step {sparse_step} / mlp_only_layers {dense_layers}: "
                             "this model builds every decoder layer as a Mixture-of-Experts layer "
                             "(decoder_sparse_step 1, mlp_only_layers [])")
        if text.get("norm_topk_prob") is False:
            raise ValueError("config.json norm_topk_prob false: the router renormalises its top-k weights")


def _qwen3_vision(**kw) -> VisionArch:
    return VisionArch(family="qwen3-vl", hidden_act="gelu_pytorch_tanh", **kw)


def _qwen3_lm(hidden: int, layers: int, heads: int, intermediate: int, tie: bool, kv_heads: int = 8,
              **moe) -> LMArch:
    return LMArch(vocab_size=151936, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                  head_dim=128, intermediate_size=intermediate, rms_norm_eps=1e-6, rope_theta=5e6,
                  mrope_section=(24, 20, 20), mrope_interleaved=True, qkv_bias=False, qk_norm=True,
                  tie_word_embeddings=tie, **moe)


def _qwen3_moe(hidden: int, layers: int, expert_width: int) -> LMArch:
    return _qwen3_lm(hidden, layers, heads=hidden // 64, intermediate=3 * hidden, tie=False, kv_heads=4,
                     num_experts=128, num_experts_per_tok=8, moe_intermediate_size=expert_width,
                     router_aux_loss_coef=0.001)


def _qwen3_vision_large(out: int) -> VisionArch:
    """The 27-block tower of Qwen3-VL 8B and larger."""
    return _qwen3_vision(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=out,
                         deepstack_visual_indexes=(8, 16, 24))


def _qwen3_vision_small(out: int) -> VisionArch:
    """The 24-block tower of Qwen3-VL 2B and 4B."""
    return _qwen3_vision(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=out,
                         deepstack_visual_indexes=(5, 11, 17))


def _qwen2_5_lm(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                tie: bool) -> LMArch:
    return LMArch(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                  head_dim=128, intermediate_size=intermediate, rms_norm_eps=1e-6, rope_theta=1e6,
                  mrope_section=(16, 24, 24), mrope_interleaved=False, qkv_bias=True, qk_norm=False,
                  tie_word_embeddings=tie)


def _qwen2_5_vision(out: int, intermediate: int) -> VisionArch:
    return VisionArch(family="qwen2.5-vl", depth=32, hidden_size=1280, intermediate_size=intermediate, num_heads=16,
                      out_hidden_size=out, patch_size=14, window_size=112, fullatt_block_indexes=(7, 15, 23, 31),
                      hidden_act="silu")


# The published architectures (the Instruct and Thinking checkpoints of a size share one), with
# random weights: benchmarks, memory plans and GPU tests run them without a download.
BUILTIN_ARCHS: dict[str, ModelArch] = {
    "qwen3-vl-2b": ModelArch("qwen3-vl", _qwen3_lm(2048, 28, 16, 6144, tie=True), _qwen3_vision_small(2048)),
    "qwen3-vl-4b": ModelArch("qwen3-vl", _qwen3_lm(2560, 36, 32, 9728, tie=True), _qwen3_vision_small(2560)),
    "qwen3-vl-8b": ModelArch("qwen3-vl", _qwen3_lm(4096, 36, 32, 12288, tie=False), _qwen3_vision_large(4096)),
    "qwen3-vl-32b": ModelArch("qwen3-vl", _qwen3_lm(5120, 64, 64, 25600, tie=False), _qwen3_vision_large(5120)),
    "qwen3-vl-30b-a3b": ModelArch("qwen3-vl", _qwen3_moe(2048, 48, 768), _qwen3_vision_large(2048)),
    "qwen3-vl-235b-a22b": ModelArch("qwen3-vl", _qwen3_moe(4096, 94, 1536), _qwen3_vision_large(4096)),
    "qwen2.5-vl-3b": ModelArch("qwen2.5-vl", _qwen2_5_lm(151936, 2048, 36, 16, 2, 11008, tie=True),
                               _qwen2_5_vision(2048, 3420)),
    "qwen2.5-vl-7b": ModelArch("qwen2.5-vl", _qwen2_5_lm(152064, 3584, 28, 28, 4, 18944, tie=False),
                               _qwen2_5_vision(3584, 3420)),
    "qwen2.5-vl-32b": ModelArch("qwen2.5-vl", _qwen2_5_lm(152064, 5120, 64, 40, 8, 27648, tie=False),
                                _qwen2_5_vision(5120, 3456)),
    "qwen2.5-vl-72b": ModelArch("qwen2.5-vl", _qwen2_5_lm(152064, 8192, 80, 64, 8, 29568, tie=False),
                                _qwen2_5_vision(8192, 3456)),
    # Tiny shapes with every structural feature (GQA, DeepStack on 2 of 3 layers, windows,
    # experts): CPU tests and smoke runs.
    "tiny": ModelArch("qwen3-vl", LMArch(
        vocab_size=151936, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, rms_norm_eps=1e-6, rope_theta=5e6, mrope_section=(4, 2, 2),
        mrope_interleaved=True, qkv_bias=False, qk_norm=True, tie_word_embeddings=True),
        _qwen3_vision(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      deepstack_visual_indexes=(0, 1))),
    "tiny-qwen2.5": ModelArch("qwen2.5-vl", LMArch(
        vocab_size=151936, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, rms_norm_eps=1e-6, rope_theta=1e6, mrope_section=(2, 3, 3),
        mrope_interleaved=False, qkv_bias=True, qk_norm=False, tie_word_embeddings=True),
        VisionArch(family="qwen2.5-vl", depth=4, hidden_size=32, intermediate_size=64, num_heads=2,
                   out_hidden_size=64, patch_size=14, window_size=56, fullatt_block_indexes=(1, 3),
                   hidden_act="silu")),
}
BUILTIN_ARCHS["tiny-moe"] = dataclasses.replace(BUILTIN_ARCHS["tiny"], lm=dataclasses.replace(
    BUILTIN_ARCHS["tiny"].lm, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
    router_aux_loss_coef=0.001))


def builtin_arch_names() -> list[str]:
    """Every built-in --arch: `BUILTIN_ARCHS` and the family modules' (`train.model.families`)."""
    return sorted({*BUILTIN_ARCHS, *(name for f in families.all_families() for name in f.builtin_archs())})


def builtin_arch(name: str) -> ModelArch:
    if name in BUILTIN_ARCHS:
        return BUILTIN_ARCHS[name]
    for family in families.all_families():
        if name in family.builtin_archs():
            return family.builtin_archs()[name]
    raise ValueError(f"unknown --arch {name!r}: choose one of {builtin_arch_names()}")


def arch_dict(arch: ModelArch) -> dict:
    return dataclasses.asdict(arch)
