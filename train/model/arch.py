"""Architectures: what the model is, independent of how it is parallelised.

`ModelArch` = language model shape (`LMArch`) + vision tower shape (`VisionArch`) + the
image token id. Built in (`BUILTIN_ARCHS`: `qwen3-vl-2b`, `qwen2.5-vl-3b`, `tiny` for tests,
...), or read from a Hugging Face `config.json`; `to_hf_config` writes the config that
`transformers` loads for an exported checkpoint. Each model family's module
(`train.model.families`) holds its built-in architectures and translates its configs;
`builtin_arch`, `from_hf_config` and `to_hf_config` reach them. The config reader and writer
that Qwen3-VL and Qwen2.5-VL share are here (`lm_from_hf_config`, `hf_config`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

from shards_schema.errors import UserError
from shards_schema.json_object import NotAJSONObject, parse_json_object
from train.model import families
from train.model.hf_config import TOP_LEVEL, ConfigSection, MissingConfigField, json_kind, text_section
from train.model.vision import VisionArch

SPECIAL_TOKEN_IDS = dict(image_token_id=151655, video_token_id=151656,
                         vision_start_token_id=151652, vision_end_token_id=151653)
LAYER_TYPES = ("linear_attention", "full_attention")  # the token mixers `LMArch.layer_types` names


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
        return families.of(self).hf_model_type(self)

    @property
    def hf_architecture(self) -> str:
        """The transformers class of this architecture."""
        return families.of(self).hf_architecture(self)

    @classmethod
    def from_hf_config(cls, config: dict, source: str = "config.json") -> ModelArch:
        """The architecture of a Hugging Face config (`source`: the file it was read from, for errors)."""
        for key in ("text_config", "vision_config"):
            if key in config and not isinstance(config[key], dict):
                raise ModelFileError(f"{source}: {key} is {json_kind(config[key])}, not a JSON object of settings",
                                     HF_CONFIG_FIX)
        model_type = config.get("model_type")
        family = families.by_model_type(model_type) if isinstance(model_type, str) else None
        if family is None:
            what = f"unsupported model_type {model_type!r} in" if "model_type" in config else "no model_type in"
            raise ModelFileError(f"{what} {source}", f"vlmpack reads {families.model_types()}; pass a checkpoint of "
                                 "one of them, with the config.json it was saved with")
        return family.arch_from_hf_config(config)

    @classmethod
    def from_hf_dir(cls, model_dir: str | Path) -> ModelArch:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: --hf-model must be a Hugging Face model directory")
        config = read_json_object(path, HF_CONFIG_FIX)
        check_hf_value_kinds(config, path)
        try:
            arch = cls.from_hf_config(ConfigSection(config, TOP_LEVEL), str(path))
        except MissingConfigField as exc:
            where = "" if exc.section == TOP_LEVEL else f" in its {exc.section}"
            raise ModelFileError(f"{path} has no {exc.key!r}{where}, which a {config['model_type']} config sets",
                                 HF_CONFIG_FIX) from None
        check_field_kinds(arch, path)
        check_buildable(arch, path)
        return arch

    def to_hf_config(self) -> dict:
        return families.of(self).to_hf_config(self)


HF_CONFIG_FIX = "use the config.json the checkpoint was saved with (transformers' save_pretrained writes it)"


class ModelFileError(UserError, ValueError):
    """A file of a model, checkpoint or Hugging Face directory that cannot be read as what it
    should be (damaged, cut short, of another format): `problem` names the file, `fix` says what
    to do (a caller that knows the directory better may give another)."""

    def __init__(self, problem: str, fix: str):
        super().__init__(f"{problem}: {fix}")
        self.problem, self.fix = problem, fix

    def __reduce__(self):
        return type(self), (self.problem, self.fix)


def read_json_object(path: str | Path, fix: str) -> dict:
    """The JSON object a metadata file of a model or checkpoint directory holds; ModelFileError
    naming the file and `fix` when it is not UTF-8 JSON or holds no object."""
    try:
        return parse_json_object(Path(path).read_bytes(), path)
    except NotAJSONObject as exc:
        raise ModelFileError(str(exc), fix) from None


# Fields a model needs at least one of; every other integer may be 0 (no experts, no Gated DeltaNet,
# no dense MLP in a Mixture-of-Experts model)
POSITIVE_FIELDS = frozenset({"vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                             "depth", "out_hidden_size", "patch_size", "temporal_patch_size",
                             "in_channels", "spatial_merge_size", "rms_norm_eps", "rope_theta"})
# the config.json names of the fields whose vlmpack names differ
HF_FIELD_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                  "num_kv_heads": "num_key_value_heads"}


# config.json settings the families compute with while they read a config (a head count divides,
# a list is summed), before `check_field_kinds` sees the result: each, where given and not null,
# of its kind, so that "16" or 5 for a list is refused naming its field, not met as a traceback
HF_INTEGERS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "moe_intermediate_size", "num_experts", "num_local_experts",
               "num_experts_per_tok", "decoder_sparse_step", "shared_expert_intermediate_size",
               "full_attention_interval", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
               "linear_value_head_dim", "linear_conv_kernel_dim", "mtp_num_hidden_layers", "depth", "num_heads",
               "patch_size", "spatial_merge_size", "temporal_patch_size", "in_channels", "out_hidden_size",
               "num_position_embeddings", "window_size", "image_token_id", "video_token_id")
HF_NUMBERS = ("rms_norm_eps", "rope_theta", "partial_rotary_factor", "router_aux_loss_coef", "tokens_per_second")
HF_INTEGER_LISTS = ("mrope_section", "deepstack_visual_indexes", "fullatt_block_indexes", "mlp_only_layers")


def check_hf_value_kinds(config: dict, source: str | Path) -> None:
    """The settings of config.json `config` (read from `source`) that `HF_INTEGERS`, `HF_NUMBERS`
    and `HF_INTEGER_LISTS` name, of those kinds in every section that holds them; ModelFileError
    naming the first that is not, as `check_field_kinds` names a field."""
    text_nested = isinstance(config.get("text_config"), dict)
    sections = [("the language model's " if not text_nested else "", "", config),
                ("the language model's ", "", config["text_config"] if text_nested else {}),
                ("the vision tower's ", "", config["vision_config"] if isinstance(config.get("vision_config"), dict)
                 else {})]
    for part, where, section in list(sections):
        for key in ("rope_parameters", "rope_scaling"):
            value = section.get(key)
            if value is not None and not isinstance(value, dict):
                raise ModelFileError(f"{source}: {part}{key} is {json_kind(value)}, not a JSON object of settings",
                                     HF_CONFIG_FIX)
            if value:
                sections.append((part, f"{key}.", value))
    vlmpack_names = {hf: name for name, hf in HF_FIELD_NAMES.items()}

    def integer(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    for part, where, section in sections:
        for key, value in section.items():
            low = 1 if vlmpack_names.get(key, key) in POSITIVE_FIELDS else 0
            if value is None:
                continue
            if key in HF_INTEGERS and not integer(value):
                want = f"an integer >= {low}"
            elif key in HF_NUMBERS and not (integer(value) or isinstance(value, float)):
                want = "a finite number " + ("above 0" if low else ">= 0")
            elif key in HF_INTEGER_LISTS and not (isinstance(value, list) and all(map(integer, value))):
                want = "a list of integers >= 0"
            else:
                continue
            raise ModelFileError(f"{source}: {part}{where}{key} must be {want}, got {repr(value)[:60]}", HF_CONFIG_FIX)


def check_field_kinds(arch: ModelArch, source: str | Path, fix: str = HF_CONFIG_FIX, hf_names: bool = True) -> None:
    """Every number of `arch` read from `source` (a config.json, or with `hf_names` false a
    model directory's metadata, which names the fields as vlmpack does) of the kind and sign its
    model needs, so that a damaged value ("64", null, -1) is refused naming its field, not met
    as a traceback where the model is built."""
    for part, section in ((arch.lm, "the language model's"), (arch.vision, "the vision tower's")):
        for field in dataclasses.fields(part):
            value, kind = getattr(part, field.name), str(field.type)
            name = HF_FIELD_NAMES.get(field.name, field.name) if part is arch.lm and hf_names else field.name
            low = 1 if field.name in POSITIVE_FIELDS else 0
            if kind == "int":
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
                want = f"an integer >= {low}"
            elif kind == "float":
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and \
                    (value > 0 if low else value >= 0)
                want = "a finite number " + ("above 0" if low else ">= 0")
            elif kind.startswith("tuple[int"):
                ok = isinstance(value, tuple) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                      for v in value)
                want = "a list of integers >= 0"
            else:
                continue
            if not ok:
                shown = repr(list(value) if isinstance(value, tuple) else value)
                raise ModelFileError(f"{source}: {section} {name} must be {want}, got {shown[:60]}", fix)


def check_buildable(arch: ModelArch, source: str | Path, fix: str = HF_CONFIG_FIX, hf_names: bool = True) -> None:
    """The relations between `arch`'s numbers (read from `source`) that a model needs to be built:
    heads in whole query groups, three M-RoPE sections that cover the rotated part of each head, no
    more experts per token than experts, one known token mixer per layer and Gated DeltaNet value
    heads in whole groups per key head. ModelFileError naming the fields, so that such a config is
    refused where it is read, not met as a traceback in a dry run's shapes or a training step."""
    lm = arch.lm

    def name(field: str) -> str:
        return HF_FIELD_NAMES.get(field, field) if hf_names else field

    problem = None
    if lm.num_heads % lm.num_kv_heads:
        problem = (f"{name('num_heads')} {lm.num_heads} must be a multiple of {name('num_kv_heads')} "
                   f"{lm.num_kv_heads} (each key/value head serves a whole group of query heads)")
    elif len(lm.mrope_section) != 3:
        problem = (f"mrope_section {list(lm.mrope_section)} must list 3 sections (temporal, height, width), "
                   f"got {len(lm.mrope_section)}")
    elif not 0 < lm.partial_rotary_factor <= 1 or lm.rotary_dim < 2 or lm.rotary_dim % 2:
        problem = (f"partial_rotary_factor {lm.partial_rotary_factor} must be in (0, 1] and rotate an even number "
                   f"of each head's {lm.head_dim} dims (it rotates {lm.rotary_dim})")
    elif sum(lm.mrope_section) != lm.rotary_dim // 2:  # one M-RoPE frequency per pair of rotated dims
        problem = (f"mrope_section {list(lm.mrope_section)} must sum to the rotated dims / 2 = {lm.rotary_dim // 2} "
                   f"({name('head_dim')} {lm.head_dim} x partial_rotary_factor {lm.partial_rotary_factor})")
    elif lm.is_moe and not 1 <= lm.num_experts_per_tok <= lm.num_experts:
        problem = (f"num_experts_per_tok {lm.num_experts_per_tok} must be between 1 and num_experts "
                   f"{lm.num_experts}")
    else:
        problem = _layer_types_problem(lm, name)
    if problem:
        raise ModelFileError(f"{source}: the language model's {problem}", fix)


def _layer_types_problem(lm: LMArch, name) -> str | None:
    """What keeps `lm`'s layer types from building a decoder (each layer's token mixer picks its
    tensors, so a list of another length or an unknown type has no model), or None."""
    types = lm.layer_types
    if not isinstance(types, tuple) or not all(isinstance(t, str) for t in types):
        return f"layer_types must be a list of one type per layer, got {repr(types)[:60]}"
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        return f"layer_types has {unknown}: the decoder builds {list(LAYER_TYPES)} layers only"
    if types and len(types) != lm.num_layers:
        return f"layer_types lists {len(types)} layers, {name('num_layers')} is {lm.num_layers}"
    if lm.has_linear_attention and (not lm.linear_num_key_heads or
                                    lm.linear_num_value_heads % lm.linear_num_key_heads):
        # each Gated DeltaNet key head serves a whole group of value heads
        return (f"linear_num_value_heads {lm.linear_num_value_heads} must be a multiple of linear_num_key_heads "
                f"{lm.linear_num_key_heads} (>= 1)")
    return None


def lm_from_hf_config(config: dict, moe: bool, *, mrope_section: tuple[int, int, int], rope_theta: float,
                      mrope_interleaved: bool, qkv_bias: bool, qk_norm: bool) -> LMArch:
    """The language model of a Qwen3-VL or Qwen2.5-VL config.json (the nested `text_config`
    layout of transformers 5.x, or the flat Qwen2.5-VL layout with `rope_scaling`); the family
    gives the M-RoPE sections and theta its configs may leave out and its fixed features."""
    text = text_section(config)
    _check_representable(text, moe)
    # transformers >= 5.2x saves num_experts as num_local_experts
    experts = text.get("num_experts", text.get("num_local_experts"))
    if moe:
        check_expert_count(experts, "text_config.")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or config.get("rope_scaling") or {}
    theta = rope.get("rope_theta", text.get("rope_theta"))
    section = tuple(rope.get("mrope_section") or mrope_section)
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    if sum(section) != head_dim // 2:
        raise ValueError(f"mrope_section {list(section)} must sum to head_dim/2 = {head_dim // 2}")
    tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return LMArch(
        vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
        num_layers=text["num_hidden_layers"], num_heads=text["num_attention_heads"],
        num_kv_heads=text.get("num_key_value_heads", text["num_attention_heads"]), head_dim=head_dim,
        intermediate_size=text["intermediate_size"], rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta if theta is not None else rope_theta),
        mrope_section=section, mrope_interleaved=mrope_interleaved, qkv_bias=qkv_bias, qk_norm=qk_norm,
        tie_word_embeddings=bool(tie),
        **(dict(num_experts=experts, num_experts_per_tok=text["num_experts_per_tok"],
                moe_intermediate_size=text["moe_intermediate_size"],
                router_aux_loss_coef=float(text.get("router_aux_loss_coef", 0.001))) if moe else {}))


def check_expert_count(value, where: str) -> None:
    """A Mixture-of-Experts config's expert count (at `where` in config.json): its model type
    builds every decoder layer's MLP from experts, so 0 would be a dense model of another type."""
    if isinstance(value, int) and not isinstance(value, bool) and value < 1:
        raise ValueError(f"config.json {where}num_experts must be an integer >= 1 for a Mixture-of-Experts model "
                         f"type, got {value}: use the config.json the checkpoint was saved with")


def token_ids(config: dict) -> dict:
    """The image and video token ids a config.json sets (ModelArch's defaults where it sets none)."""
    return {"image_token_id": config.get("image_token_id", SPECIAL_TOKEN_IDS["image_token_id"]),
            "video_token_id": config.get("video_token_id", SPECIAL_TOKEN_IDS["video_token_id"])}


def hf_config(arch: ModelArch) -> dict:
    """The config.json of a Qwen3-VL or Qwen2.5-VL checkpoint of `arch` (transformers 5.x layout)."""
    lm = arch.lm
    rope = {"rope_type": "default", "rope_theta": lm.rope_theta, "mrope_section": list(lm.mrope_section)}
    if lm.mrope_interleaved:
        rope["mrope_interleaved"] = True
    text = dict(
        vocab_size=lm.vocab_size, hidden_size=lm.hidden_size, intermediate_size=lm.intermediate_size,
        num_hidden_layers=lm.num_layers, num_attention_heads=lm.num_heads,
        num_key_value_heads=lm.num_kv_heads, head_dim=lm.head_dim, hidden_act="silu",
        rms_norm_eps=lm.rms_norm_eps, max_position_embeddings=128000, attention_bias=lm.qkv_bias,
        rope_parameters=rope, tie_word_embeddings=lm.tie_word_embeddings,
        model_type=arch.hf_model_type + "_text")
    if lm.is_moe:
        text.update(num_experts=lm.num_experts, num_experts_per_tok=lm.num_experts_per_tok,
                    moe_intermediate_size=lm.moe_intermediate_size, decoder_sparse_step=1, mlp_only_layers=[],
                    router_aux_loss_coef=lm.router_aux_loss_coef)
    return dict(architectures=[arch.hf_architecture], model_type=arch.hf_model_type,
                text_config=text, vision_config=arch.vision.to_hf_config(),
                tie_word_embeddings=lm.tie_word_embeddings,
                **{**SPECIAL_TOKEN_IDS, "image_token_id": arch.image_token_id,
                   "video_token_id": arch.video_token_id})


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


class _BuiltinArchs(MutableMapping):
    """--arch name -> ModelArch: every family module's `builtin_archs` (read on first use, when
    the family modules are imported), and any added at run time (the benchmarks' shortened ones)."""

    def __init__(self):
        self._added: dict[str, ModelArch] = {}

    def _all(self) -> dict[str, ModelArch]:
        return {**{name: arch for family in families.all_families() for name, arch in family.builtin_archs().items()},
                **self._added}

    def __getitem__(self, name: str) -> ModelArch:
        return self._all()[name]

    def __setitem__(self, name: str, arch: ModelArch) -> None:
        self._added[name] = arch

    def __delitem__(self, name: str) -> None:
        del self._added[name]

    def __iter__(self):
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


# The published architectures (the Instruct and Thinking checkpoints of a size share one), with
# random weights: benchmarks, memory plans and GPU tests run them without a download; and tiny
# ones with every structural feature for CPU tests and smoke runs.
BUILTIN_ARCHS: MutableMapping[str, ModelArch] = _BuiltinArchs()


def builtin_arch_names() -> list[str]:
    """Every built-in --arch (`BUILTIN_ARCHS`)."""
    return sorted(BUILTIN_ARCHS)


def builtin_arch(name: str) -> ModelArch:
    archs = dict(BUILTIN_ARCHS)
    if name not in archs:
        raise ValueError(f"unknown --arch {name!r}: choose one of {sorted(archs)}")
    return archs[name]


def arch_dict(arch: ModelArch) -> dict:
    return dataclasses.asdict(arch)
