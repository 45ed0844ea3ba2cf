"""Architectures: what the model is, independent of how it is parallelised.

`ModelArch` = language model shape (`LMArch`) + vision tower shape (`VisionArch`) + the
image token id. Built in (`qwen3-vl-2b`, `qwen2.5-vl-3b`, and `tiny` / `tiny-qwen2.5` for
tests), or read from a Hugging Face `config.json` (both the nested `text_config` layout of
transformers 5.x and the flat Qwen2.5-VL layout with `rope_scaling`). `to_hf_config` writes
the config that `transformers` loads for an exported checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from train.model.vision import VisionArch

FAMILIES = ("qwen3-vl", "qwen2.5-vl")
HF_MODEL_TYPE = {"qwen3-vl": "qwen3_vl", "qwen2.5-vl": "qwen2_5_vl"}
HF_ARCHITECTURE = {"qwen3-vl": "Qwen3VLForConditionalGeneration",
                   "qwen2.5-vl": "Qwen2_5_VLForConditionalGeneration"}
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

    def num_params(self) -> int:
        """Parameters of the language model (embeddings counted once when tied)."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = h * (self.num_heads * self.head_dim) * 2 + h * kv * 2
        mlp = 3 * h * self.intermediate_size
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp) + emb

    def num_non_embedding_params(self) -> int:
        """N for the 6*N flops-per-token rule, with the output projection counted (it is a GEMM)."""
        return self.num_params() - self.vocab_size * self.hidden_size * (0 if self.tie_word_embeddings else 1)


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

    @classmethod
    def from_hf_config(cls, config: dict) -> ModelArch:
        model_type = config.get("model_type")
        family = {v: k for k, v in HF_MODEL_TYPE.items()}.get(model_type)
        if family is None:
            raise ValueError(f"unsupported model_type {model_type!r} in config.json: expected one of "
                             f"{sorted(HF_MODEL_TYPE.values())}")
        text = config.get("text_config") or config
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
            tie_word_embeddings=bool(tie))
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
            model_type=HF_MODEL_TYPE[self.family] + "_text")
        return dict(architectures=[HF_ARCHITECTURE[self.family]], model_type=HF_MODEL_TYPE[self.family],
                    text_config=text, vision_config=self.vision.to_hf_config(),
                    tie_word_embeddings=lm.tie_word_embeddings,
                    **{**SPECIAL_TOKEN_IDS, "image_token_id": self.image_token_id,
                       "video_token_id": self.video_token_id})


def _qwen3_vision(**kw) -> VisionArch:
    return VisionArch(family="qwen3-vl", hidden_act="gelu_pytorch_tanh", **kw)


BUILTIN_ARCHS: dict[str, ModelArch] = {
    "qwen3-vl-2b": ModelArch("qwen3-vl", LMArch(
        vocab_size=151936, hidden_size=2048, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
        intermediate_size=6144, rms_norm_eps=1e-6, rope_theta=5e6, mrope_section=(24, 20, 20),
        mrope_interleaved=True, qkv_bias=False, qk_norm=True, tie_word_embeddings=True),
        _qwen3_vision(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
                      deepstack_visual_indexes=(5, 11, 17))),
    "qwen2.5-vl-3b": ModelArch("qwen2.5-vl", LMArch(
        vocab_size=151936, hidden_size=2048, num_layers=36, num_heads=16, num_kv_heads=2, head_dim=128,
        intermediate_size=11008, rms_norm_eps=1e-6, rope_theta=1e6, mrope_section=(16, 24, 24),
        mrope_interleaved=False, qkv_bias=True, qk_norm=False, tie_word_embeddings=True),
        VisionArch(family="qwen2.5-vl", depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                   out_hidden_size=2048, patch_size=14, window_size=112, fullatt_block_indexes=(7, 15, 23, 31),
                   hidden_act="silu")),
    # Tiny shapes with every structural feature (GQA, DeepStack on 2 of 3 layers, windows):
    # CPU tests and smoke runs.
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


def builtin_arch(name: str) -> ModelArch:
    if name not in BUILTIN_ARCHS:
        raise ValueError(f"unknown --arch {name!r}: choose one of {sorted(BUILTIN_ARCHS)}")
    return BUILTIN_ARCHS[name]


def arch_dict(arch: ModelArch) -> dict:
    return dataclasses.asdict(arch)
