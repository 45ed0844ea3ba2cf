"""Weights between Hugging Face Qwen-VL checkpoints and our megatron-core model, at any TP / PP.

Three forms of the same weights:

- HF: `model.visual.*`, `model.language_model.*`, `lm_head.weight` (transformers 5.x names;
  Qwen2.5-VL hub files use the older `visual.*` / `model.layers.*` names, read and written as
  the hub has them);
- full Megatron: one unsharded state dict of the whole model in `QwenVLModel` names
  (`vision.*` = HF's vision keys as they are, `language_model.*` = megatron's GPTModel);
- sharded: one state dict per (tp_rank, pp_rank), exactly what `build_model` creates on that
  rank (layers numbered from 0 within each pipeline stage).

Megatron's layout differs from HF's in three tensors per layer: QKV is one matrix grouped by
GQA group ([the group's q heads, its k head, its v head] per group) so that a TP rank holds
whole groups; fc1 is [gate; up], each half split across TP ranks separately; the norms of
the local (non-TE) layer spec stay separate tensors.

Each model family's module (`train.model.families`) gives its name table (built on the rows
shared here), its transforms, its checkpoint shapes and its checkpoints' names and layouts; the
tables' rows may hold for one layer type only and list every expert. Tensors of a checkpoint that its model does not build
(Qwen3.5's multi-token-prediction layers) are carried: import-hf keeps them in CARRIED_FILE and
export-hf writes them back as they are (`carried_tensors`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from contextlib import contextmanager
from functools import lru_cache, reduce
from itertools import product
from pathlib import Path

import torch
from tqdm import tqdm

from shards_schema.atomic import TMP_SUFFIX, fsync_dir
from shards_schema.errors import UserError, first_few
from shards_schema.outdir import (exclusive_output_dir, recorded_command, refuse_input_as_output, shown_command,
                                   user_entries)
from train.checkpoint_format import (
    CARRIED_FILE,
    HF_DIR_FIX,
    HF_INDEX_FILE,
    HF_SIDE_FILES,
    HF_SUBDIR,
    META_FILE,
    MODEL_DIR_FIX,
    CheckpointError,
    LazyTensor,
    SideFiles,
    arch_differences,
    meta_arch,
    atomic_dir,
    check_hf_side_files,
    check_kept_side_files,
    copy_hf_side_files,
    dtype_name,
    expert_file,
    fsync_tree,
    lazy_file_tensors,
    lazy_hf_state,
    load_tensors,
    materialize,
    rank_file,
    read_meta,
    save_tensors,
    save_tensors_streaming,
    v1_expert_rank_file,
    weights_fingerprint,
    write_hf_state,
    write_meta,
    write_side_files,
)
from train.model import families
from train.model.arch import LMArch, ModelArch, ModelFileError

from train.model.weight_names import (  # noqa: F401 (the name table is also the converter's)
    EMBED, HF_LM, HF_LM_HEAD, HF_VISION, LINEAR_ATTENTION_SPLIT, LM, OUTPUT,
    VISION, WeightMapping, renamed,
)

_LAYER_KEY = re.compile(r"^language_model\.decoder\.layers\.(\d+)\.(.+)$")




def model_part(name: str) -> str:
    """The --freeze part of a Megatron parameter name: llm = the language model; merger = the
    mergers (incl. DeepStack mergers) that project into the LM; vision = the vision blocks and
    patch embedding."""
    if name.startswith("language_model."):
        return "llm"
    return "merger" if name.startswith(("vision.merger", "vision.deepstack_merger_list")) else "vision"


def _mapping_pattern(name: str) -> re.Pattern:
    return re.compile("^" + re.escape(name).replace(re.escape("{layer}"), r"(?P<layer>\d+)").replace(
        re.escape("*"), r"(?P<rest>.*)") + "$")


def weight_mappings(arch: ModelArch) -> tuple[WeightMapping, ...]:
    """The name table of `arch`'s family (`train.model.families`)."""
    return families.of(arch).weight_mappings()


def _transforms(arch: ModelArch) -> dict:
    return {**TRANSFORMS, **families.of(arch).transforms}


@lru_cache(maxsize=8)
def _megatron_patterns(mappings: tuple[WeightMapping, ...]) -> tuple[tuple[re.Pattern, WeightMapping], ...]:
    return tuple((_mapping_pattern(m.megatron), m) for m in mappings)


def _hf_names(m: WeightMapping, lm: LMArch, layer: int) -> tuple[str, ...]:
    names = tuple(h.replace("{layer}", str(layer)) for h in m.hf)
    if not any("{expert}" in h for h in names):
        return names
    return tuple(h.replace("{expert}", str(e)) for e in range(lm.num_experts) for h in names)


def _name_pairs(arch: ModelArch, source_names) -> list[tuple[WeightMapping, tuple[str, ...], str]]:
    """(row, HF names, Megatron name) of every tensor of the model, layer by layer; a `*` row
    lists the names of `source_names` that it matches (either side's names)."""
    lm, mappings = arch.lm, weight_mappings(arch)
    pairs = []
    for m in mappings:
        if not m.applies(lm) or "{layer}" in m.megatron:
            continue
        if m.megatron.endswith("*"):
            hf_prefix, mg_prefix = m.hf[0][:-1], m.megatron[:-1]
            for name in source_names:
                for prefix in (hf_prefix, mg_prefix):
                    if name.startswith(prefix):
                        rest = name.removeprefix(prefix)
                        pairs.append((m, (hf_prefix + rest,), mg_prefix + rest))
        else:
            pairs.append((m, m.hf, m.megatron))
    layer_rows = [m for m in mappings if m.applies(lm) and "{layer}" in m.megatron]
    for i in range(lm.num_layers):
        pairs += [(m, _hf_names(m, lm, i), m.megatron.format(layer=i)) for m in layer_rows
                  if m.layers is None or m.layers == lm.layer_type(i)]
    return pairs


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lm: LMArch) -> torch.Tensor:
    """HF q/k/v projections (weights or biases) -> megatron's per-GQA-group [q..., k, v] rows.
    HF's repeat_kv gives kv head g the q heads g*n..(g+1)*n-1, the same grouping megatron uses."""
    groups, rest = lm.num_kv_heads, q.shape[1:]
    parts = [q.reshape(groups, -1, *rest), k.reshape(groups, lm.head_dim, *rest), v.reshape(groups, lm.head_dim, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, lm: LMArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, d, rest = lm.num_kv_heads, lm.head_dim, qkv.shape[1:]
    q_rows = lm.num_heads // groups * d
    parts = qkv.reshape(groups, q_rows + 2 * d, *rest).split([q_rows, d, d], dim=1)
    return tuple(p.reshape(-1, *rest) for p in parts)


# transform -> (HF tensors -> Megatron tensor, Megatron tensor -> HF tensors); "copy" shares the tensor.
TRANSFORMS = {
    "copy": (lambda tensors, lm: tensors[0], lambda tensor, lm: (tensor,)),
    "qkv": (lambda tensors, lm: fuse_qkv(*tensors, lm), split_qkv),
    "gate_up": (lambda tensors, lm: torch.cat(tensors), lambda tensor, lm: tuple(tensor.chunk(2))),
}


# --- HF names -------------------------------------------------------------------------------


def _hub_name_prefixes() -> tuple[tuple[str, str], ...]:
    """Every family's (transformers 5.x prefix, its hub checkpoints' prefix) pairs."""
    return tuple(pair for family in families.all_families() for pair in family.hub_name_prefixes)


def canonical_hf_names(state: dict) -> dict:
    """Hub names of any family (`visual.*`, `model.layers.*`) -> transformers 5.x names."""
    pairs = _hub_name_prefixes()
    current = tuple(new for new, _ in pairs)
    out = {}
    for key, value in state.items():
        if not key.startswith(current):
            for new, old in pairs:
                if key.startswith(old):
                    key = new + key.removeprefix(old)
                    break
        if key in out:
            raise CheckpointError(f"{key} appears under both the old and the new Hugging Face names")
        out[key] = value
    return out


def hub_hf_names(state: dict, family: str) -> dict:
    """transformers 5.x names -> the names the family's hub checkpoints use."""
    return renamed(state, families.by_name(family).hub_name_prefixes)


# --- expected shapes ------------------------------------------------------------------------


@lru_cache(maxsize=16)
def hf_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint, in the names of its family's table, and its shape."""
    return families.of(arch).hf_shapes(arch)


def _meta_state(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    return {k: torch.empty(s, device="meta") for k, s in shapes.items()}


@lru_cache(maxsize=16)
def megatron_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every tensor of the full (unsharded) Megatron state dict and its shape."""
    return {k: tuple(t.shape) for k, t in hf_to_megatron(_meta_state(hf_shapes(arch)), arch).items()}


@lru_cache(maxsize=64)
def shard_shapes(arch: ModelArch, tp: int, tp_rank: int, pp: int, pp_rank: int, ep: int = 1,
                 ep_rank: int = 0) -> dict[str, tuple[int, ...]]:
    """Keys and shapes of one rank's stage model: what `build_model(...).state_dict()` holds."""
    full = _meta_state(megatron_shapes(arch))
    return {k: tuple(t.shape) for k, t in shard(full, arch, tp, tp_rank, pp, pp_rank, ep, ep_rank).items()}


def check_state(state: dict, expected: dict[str, tuple[int, ...]], source: str) -> None:
    """Raise naming the missing, unexpected or wrongly shaped tensors (the first three, on one
    line: errors reach the user as one line)."""
    problems = [f"missing tensor {k} (shape {s} expected from {source})" for k, s in expected.items() if k not in state]
    problems += [f"unexpected tensor {k}: {source} has no such tensor" for k in state if k not in expected]
    problems += [f"{k}: shape {tuple(t.shape)} expected {expected[k]} from {source}"
                 for k, t in state.items() if k in expected and tuple(t.shape) != expected[k]]
    problems += [f"{k}: dtype {str(t.dtype).removeprefix('torch.')}, where every weight is a floating-point tensor"
                 for k, t in state.items() if k in expected and not t.dtype.is_floating_point]
    if problems:
        raise CheckpointError(problems[0] if len(problems) == 1 else
                              f"{len(problems)} problems: " + first_few(problems, "; "))


# --- HF <-> full Megatron -------------------------------------------------------------------


def _drop_tied_lm_head(hf: dict, arch: ModelArch) -> dict:
    """A tied checkpoint may still store lm_head; transformers ignores it, so must it be a copy."""
    if not arch.lm.tie_word_embeddings or HF_LM_HEAD not in hf:
        return hf
    head, embed = hf[HF_LM_HEAD], hf.get(HF_LM + "embed_tokens.weight")
    if embed is not None and not (head.shape == embed.shape and torch.equal(materialize(head), materialize(embed))):
        raise CheckpointError(f"{HF_LM_HEAD} differs from {HF_LM}embed_tokens.weight but config.json ties them "
                              "(tie_word_embeddings: true), so transformers would discard it: fix the config")
    return {k: v for k, v in hf.items() if k != HF_LM_HEAD}


def carried_tensors(hf_state: dict, arch: ModelArch) -> dict:
    """The tensors of an HF checkpoint that the model does not build but a checkpoint of it
    keeps as they are (the family's `carried_prefixes`: Qwen3.5's multi-token-prediction
    layers): import-hf stores them in CARRIED_FILE, export-hf writes them back."""
    prefixes = families.of(arch).carried_prefixes
    return {k: v for k, v in hf_state.items() if prefixes and k.startswith(prefixes)}


def _checkpoint_layout(hf: dict, arch: ModelArch) -> dict:
    return families.of(arch).hf_checkpoint_layout(hf, arch)


def hf_to_megatron(hf_state: dict, arch: ModelArch) -> dict:
    """A whole HF checkpoint -> the full Megatron state dict (tensors shared where unchanged).
    Given `LazyTensor`s (`lazy_hf_state`), it returns `LazyTensor`s: each Megatron tensor is
    made from its HF tensors only when loaded, so a conversion holds one at a time. Carried
    tensors (`carried_tensors`) are left out."""
    carried = carried_tensors(hf_state, arch)
    hf = {k: v for k, v in hf_state.items() if k not in carried}
    hf = _checkpoint_layout(_drop_tied_lm_head(canonical_hf_names(hf), arch), arch)
    check_state(hf, hf_shapes(arch), "config.json")
    transforms = _transforms(arch)

    def convert(m: WeightMapping, names: tuple[str, ...], megatron: str):
        sources = [hf[n] for n in names]
        if not any(isinstance(t, LazyTensor) for t in sources):
            return transforms[m.transform][0](sources, arch.lm)
        # a fused tensor of sources saved in different dtypes is made in their common one, as torch.cat makes it
        dtype = reduce(torch.promote_types, (t.dtype for t in sources))
        return LazyTensor(megatron_shapes(arch)[megatron], dtype,
                          lambda: transforms[m.transform][0]([materialize(t) for t in sources], arch.lm), names)

    return {megatron: convert(m, names, megatron) for m, names, megatron in _name_pairs(arch, hf)}


def megatron_to_hf(full_state: dict[str, torch.Tensor], arch: ModelArch) -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_megatron`, in the names the family's hub checkpoints use."""
    check_state(full_state, megatron_shapes(arch), "the checkpoint's architecture")
    transforms = _transforms(arch)
    out = {}
    for m, names, megatron in _name_pairs(arch, full_state):
        out.update(zip(names, transforms[m.transform][1](full_state[megatron], arch.lm)))
    return families.of(arch).hf_export_layout(out, arch)


# --- full Megatron <-> per-rank shards ------------------------------------------------------


def check_parallel(arch: ModelArch, tp: int, pp: int, ep: int = 1) -> None:
    lm = arch.lm
    if tp < 1 or pp < 1 or ep < 1:
        raise CheckpointError(f"tp, pp and ep must be >= 1, got tp={tp} pp={pp} ep={ep}")
    if ep > 1:
        if not lm.is_moe:
            raise CheckpointError(f"ep={ep}: expert parallelism needs a Mixture-of-Experts model; this one is dense")
        if lm.num_experts % ep:
            raise CheckpointError(f"ep={ep} does not divide the {lm.num_experts} experts")
    widths = [("num_attention_heads", lm.num_heads), ("num_key_value_heads", lm.num_kv_heads),
              ("intermediate_size", lm.intermediate_size), ("vocab_size", lm.vocab_size)]
    if lm.has_linear_attention:  # a Gated DeltaNet's heads (and their conv channels) are split over TP
        widths += [("linear_num_key_heads", lm.linear_num_key_heads), ("linear_num_value_heads", lm.linear_num_value_heads)]
    if lm.shared_expert_intermediate_size:
        widths.append(("shared_expert_intermediate_size", lm.shared_expert_intermediate_size))
    for field, n in widths:
        if n % tp:
            raise CheckpointError(f"tp={tp} does not divide {field} = {n}: megatron gives every TP rank an equal part")


@lru_cache(maxsize=16)
def stage_layers(arch: ModelArch, pp: int) -> tuple[range, ...]:
    """Global decoder layers of each pipeline stage, as megatron assigns them for the
    TransformerConfig our model is built with (so uneven splits set there are followed)."""
    stages = _megatron_stage_layers(arch, pp) if pp > 1 else (range(arch.lm.num_layers),)
    if len(stages[0]) < arch.num_deepstack:
        raise CheckpointError(f"pp={pp} puts {len(stages[0])} layers on the first stage, but DeepStack adds vision "
                              f"features after layers 0..{arch.num_deepstack - 1}, which must all be there")
    return stages


def _megatron_stage_layers(arch: ModelArch, pp: int) -> tuple[range, ...]:
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from train.model.qwen_vl import transformer_config

    config = transformer_config(arch, pp=pp, cpu=True)
    try:
        stages = []
        for rank in range(pp):
            start = get_transformer_layer_offset(config, pp_rank=rank)
            stages.append(range(start, start + get_num_layers_to_build(config, pp_rank=rank)))
    except AssertionError as exc:
        raise CheckpointError(f"megatron cannot split {arch.lm.num_layers} layers over pp={pp} stages ({exc})") from exc
    return tuple(stages)


def _row(name: str, arch: ModelArch) -> WeightMapping | None:
    return next((m for pattern, m in _megatron_patterns(weight_mappings(arch)) if pattern.match(name)), None)


def _split_rule(name: str, arch: ModelArch) -> str:
    """How megatron divides the full-model tensor `name` over TP ranks (the table's `tp_split`)."""
    row = _row(name, arch)
    if row is None:
        return "replicated"
    if row.tp_split == LINEAR_ATTENTION_SPLIT:  # the Gated DeltaNet parameter's own head blocks
        return f"{LINEAR_ATTENTION_SPLIT}:{name.rsplit('self_attention.', 1)[1]}"
    return row.tp_split


def _ep_dim(name: str, arch: ModelArch) -> int | None:
    row = _row(name, arch)
    return row.ep_dim if row is not None else None


def _ep_split(tensor: torch.Tensor, dim: int, ep: int) -> list[torch.Tensor]:
    """megatron GroupedMLP's weight1 [H, E*2F] / weight2 [E*F, H] hold each expert as one
    contiguous block of memory (see train.model.moe): expert-parallel rank r holds blocks
    r*E/ep ..., i.e. the r-th contiguous 1/ep of the memory, shaped with `dim` divided."""
    shape = list(tensor.shape)
    shape[dim] //= ep
    return [block.reshape(shape) for block in tensor.reshape(-1).chunk(ep)]


def _ep_merge(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    shape = list(parts[0].shape)
    shape[dim] *= len(parts)
    return torch.cat([p.reshape(-1) for p in parts]).reshape(shape)


def rank_keys(tp: int, pp: int, ep: int = 1) -> list[tuple[int, ...]]:
    """The ranks of a layout, as the keys of per-rank state dicts: (tp_rank, pp_rank), and
    the expert-parallel rank third when ep > 1."""
    return [(t, p) if ep == 1 else (t, p, e) for t, p, e in product(range(tp), range(pp), range(ep))]


def model_files(tp: int, pp: int, ep: int = 1) -> list[tuple[str, tuple[int, ...], bool | None]]:
    """The weight files of a model directory saved at tp / pp / ep (`checkpoint_format`): (file
    name, the rank key whose stage state holds its tensors, which of them: None every one,
    False all but the experts, True the experts)."""
    if ep == 1:
        return [(rank_file(t, p), (t, p), None) for t, p in product(range(tp), range(pp))]
    return ([(rank_file(t, p), (t, p, 0), False) for t, p in product(range(tp), range(pp))]
            + [(expert_file(p, e), (0, p, e), True) for p, e in product(range(pp), range(ep))])


def is_expert(local: str, arch: ModelArch, pp: int, pp_rank: int) -> bool:
    """Whether the stage tensor `local` of pipeline rank `pp_rank` is a stack of experts."""
    return _ep_dim(_global_name(local, stage_layers(arch, pp)[pp_rank]), arch) is not None


def file_part(state: dict, arch: ModelArch, pp: int, pp_rank: int, experts: bool | None) -> dict:
    """The tensors of a stage state dict that one file holds (`model_files`' third field)."""
    if experts is None:
        return state
    return {k: t for k, t in state.items() if is_expert(k, arch, pp, pp_rank) == experts}


def _rank_text(key: tuple[int, ...]) -> str:
    return " ".join(f"{n} {r}" for n, r in zip(("tp", "pp", "ep"), key))


# A Gated DeltaNet parameter's TP split (`train.model.gated_delta_net.split_for_tp`): every block
# of its rows (q, k, v, z, beta, alpha heads) divided into TP runs of whole heads.


def _linear_attention_weight(rule: str, lm: LMArch):
    from train.model import gated_delta_net as gdn

    param = rule.split(":", 1)[1]
    return next(w for w in gdn.WEIGHTS if w.param == param), gdn.GatedDeltaNetDims.from_lm(lm)


def _split(tensor: torch.Tensor, rule: str, tp: int, lm: LMArch | None = None) -> list[torch.Tensor]:
    if rule.startswith(LINEAR_ATTENTION_SPLIT):
        from train.model import gated_delta_net as gdn

        return gdn.split_for_tp(tensor, *_linear_attention_weight(rule, lm), tp)
    if rule == "column":  # output features: QKV (whole GQA groups), vocabulary rows
        return list(tensor.chunk(tp, dim=0))
    if rule == "row":  # input features
        return list(tensor.chunk(tp, dim=1))
    if rule == "gated":  # [gate; up]: each rank holds [its gate rows; its up rows]
        cols = tensor.shape[1]
        return [part.reshape(-1, cols) for part in tensor.reshape(2, -1, cols).chunk(tp, dim=1)]
    return [tensor] * tp


def _merge(parts: list[torch.Tensor], rule: str, lm: LMArch | None = None) -> torch.Tensor:
    if rule.startswith(LINEAR_ATTENTION_SPLIT):
        from train.model import gated_delta_net as gdn

        return gdn.merge_tp(parts, *_linear_attention_weight(rule, lm))
    if rule == "column":
        return torch.cat(parts, dim=0)
    if rule == "row":
        return torch.cat(parts, dim=1)
    if rule == "gated":
        cols = parts[0].shape[1]
        return torch.cat([p.reshape(2, -1, cols) for p in parts], dim=1).reshape(-1, cols)
    return parts[0]


def _local_name(name: str, layers: range, first: bool, last: bool) -> str | None:
    """`name` as the stage holding `layers` calls it, or None when that stage lacks it."""
    match = _LAYER_KEY.match(name)
    if match:
        index = int(match[1])
        return f"{LM}decoder.layers.{index - layers.start}.{match[2]}" if index in layers else None
    if name.startswith(VISION) or name == EMBED:
        return name if first else None
    return name if last else None  # final norm, output layer


def _global_name(local: str, layers: range) -> str:
    match = _LAYER_KEY.match(local)
    return f"{LM}decoder.layers.{layers.start + int(match[1])}.{match[2]}" if match else local


def _check_rank(tp: int, tp_rank: int, pp: int, pp_rank: int, ep: int = 1, ep_rank: int = 0) -> None:
    if not (0 <= tp_rank < tp and 0 <= pp_rank < pp and 0 <= ep_rank < ep):
        raise CheckpointError(f"rank tp {tp_rank} pp {pp_rank} ep {ep_rank} is outside tp={tp} pp={pp} ep={ep}")


def _rank_part(tensor: torch.Tensor, rule: str, tp: int, tp_rank: int, ep_dim: int | None, ep: int,
               ep_rank: int, lm: LMArch | None = None) -> torch.Tensor:
    part = _split(tensor, rule, tp, lm)[tp_rank]
    return part if ep_dim is None else _ep_split(part, ep_dim, ep)[ep_rank]


def _rank_plan(names, arch: ModelArch, tp: int, tp_rank: int, pp: int, pp_rank: int, ep: int,
               ep_rank: int) -> list[tuple[str, str, object]]:
    """(local name, full-model name, full tensor -> this rank's part) of every tensor that rank
    (tp_rank, pp_rank, ep_rank)'s stage model holds, from the full model's `names`."""
    layers = stage_layers(arch, pp)[pp_rank]
    first, last = pp_rank == 0, pp_rank == pp - 1
    plan = []
    for name in names:
        local = _local_name(name, layers, first, last)
        if local is not None:
            ep_dim = _ep_dim(name, arch) if ep > 1 else None
            plan.append((local, name, lambda t, rule=_split_rule(name, arch), ep_dim=ep_dim:
                         _rank_part(t, rule, tp, tp_rank, ep_dim, ep, ep_rank, arch.lm)))
    if arch.lm.tie_word_embeddings and last and not first:
        # megatron gives the last stage its own copy of the tied embeddings as the output
        # layer, kept equal to the first stage's by an all-reduce at init and every step.
        plan.append((OUTPUT, EMBED, lambda t: _split(t, "column", tp)[tp_rank]))
    return plan


def shard(full_state: dict, arch: ModelArch, tp: int, tp_rank: int, pp: int,
          pp_rank: int, ep: int = 1, ep_rank: int = 0) -> dict[str, torch.Tensor]:
    """The state dict of rank (tp_rank, pp_rank, ep_rank)'s stage model: views of
    `full_state`, or, of `LazyTensor`s, only this rank's tensors loaded (and its parts copied
    out, so the rest of a split tensor is not kept)."""
    check_parallel(arch, tp, pp, ep)
    _check_rank(tp, tp_rank, pp, pp_rank, ep, ep_rank)
    check_state(full_state, megatron_shapes(arch), "the architecture")
    out = {}
    for local, name, part in _rank_plan(full_state, arch, tp, tp_rank, pp, pp_rank, ep, ep_rank):
        tensor = full_state[name]
        out[local] = part(materialize(tensor))
        if isinstance(tensor, LazyTensor) and tp * ep > 1:
            out[local] = out[local].clone()
    return out


def _merge_expert_ranks(states: dict, arch: ModelArch, tp: int, pp: int, ep: int) -> dict:
    """{(tp_rank, pp_rank, ep_rank): state} -> {(tp_rank, pp_rank): state with every expert}.
    The other tensors are the same on every expert-parallel rank; a difference is an error."""
    merged = {}
    for tp_rank, pp_rank in product(range(tp), range(pp)):
        ranks = [states[(tp_rank, pp_rank, e)] for e in range(ep)]
        layers = stage_layers(arch, pp)[pp_rank]
        out = {}
        for local, tensor in ranks[0].items():
            dim = _ep_dim(_global_name(local, layers), arch)
            if dim is not None:
                out[local] = _ep_merge([r[local] for r in ranks], dim)
                continue
            for e, r in enumerate(ranks[1:], 1):
                if not torch.equal(r[local], tensor):
                    raise CheckpointError(f"{local} differs between expert-parallel ranks 0 and {e} "
                                          f"(tp {tp_rank} pp {pp_rank}); it must be the same on every rank")
            out[local] = tensor
        merged[(tp_rank, pp_rank)] = out
    return merged


def unshard(states: dict[tuple[int, ...], dict[str, torch.Tensor]], arch: ModelArch, tp: int,
            pp: int, ep: int = 1) -> dict[str, torch.Tensor]:
    """{rank key (`rank_keys`): stage state dict} -> the full Megatron state dict."""
    _check_rank_states(states, arch, tp, pp, ep)
    if ep > 1:
        states = _merge_expert_ranks(states, arch, tp, pp, ep)
    full = {}
    for pp_rank, layers in enumerate(stage_layers(arch, pp)):
        ranks = [states[(tp_rank, pp_rank)] for tp_rank in range(tp)]
        for local in ranks[0]:
            if local == OUTPUT and arch.lm.tie_word_embeddings:
                continue  # the last stage's copy of the embeddings (see `shard`)
            name = _global_name(local, layers)
            full[name] = _merge([r[local] for r in ranks], _split_rule(name, arch), arch.lm)
    return full


def load_into_model(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """`model.load_state_dict(state)`, strict except for megatron's tensor-less `_extra_state`."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("._extra_state")]
    if missing or unexpected:
        raise CheckpointError(f"state dict does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


# --- model directories ----------------------------------------------------------------------


def _cast(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    if dtype is None:
        return state
    return {k: t.to(dtype) if t.is_floating_point() else t for k, t in state.items()}


def _check_rank_states(states: dict[tuple[int, ...], dict[str, torch.Tensor]], arch: ModelArch, tp: int,
                       pp: int, ep: int = 1) -> None:
    check_parallel(arch, tp, pp, ep)
    for key in rank_keys(tp, pp, ep):
        if key not in states:
            raise CheckpointError(f"no state dict for rank {_rank_text(key)} of tp={tp} pp={pp} ep={ep}")
        check_state(states[key], shard_shapes(arch, tp, key[0], pp, key[1], ep, key[2] if ep > 1 else 0),
                    f"the architecture at tp={tp} pp={pp} ep={ep} (rank {_rank_text(key)})")


def _write_model_files(directory: Path, states: dict[tuple[int, ...], dict[str, torch.Tensor]], arch: ModelArch,
                       tp: int, pp: int, hf_files_from: str | Path | None, ep: int = 1) -> None:
    for name, key, experts in model_files(tp, pp, ep):
        save_tensors(directory / name, file_part(states[key], arch, pp, key[1], experts))
    write_meta(directory, arch, tp, pp, dtype_name(t for s in states.values() for t in s.values()), ep)
    if hf_files_from is not None:
        copy_hf_side_files(hf_files_from, directory / HF_SUBDIR)


def save_model_dir(directory: str | Path, states: dict[tuple[int, ...], dict[str, torch.Tensor]], arch: ModelArch,
                   tp: int, pp: int, hf_files_from: str | Path | None = None, ep: int = 1) -> Path:
    """Write a new model directory (see `checkpoint_format`) from every rank's state dict."""
    _check_rank_states(states, arch, tp, pp, ep)
    with atomic_dir(directory) as tmp:
        _write_model_files(tmp, states, arch, tp, pp, hf_files_from, ep)
    return Path(directory)


def _saved_layout(meta: dict) -> tuple[int, int, int]:
    return meta["tp"], meta["pp"], meta.get("ep", 1)


def _rank_files(meta: dict, key: tuple[int, ...]) -> list[str]:
    """The files that hold rank `key`'s stage state in a directory with metadata `meta`."""
    if len(key) == 2:
        return [rank_file(*key)]
    tp_rank, pp_rank, ep_rank = key
    if meta["format_version"] == 1:  # ep > 1 was saved at tp 1 only, one whole file per rank
        return [v1_expert_rank_file(pp_rank, ep_rank)]
    return [rank_file(tp_rank, pp_rank), expert_file(pp_rank, ep_rank)]


def _read_rank_states(directory: str | Path, meta: dict, keys: list[tuple[int, ...]],
                      progress: bool = False) -> dict[tuple[int, ...], dict[str, torch.Tensor]]:
    """{key: stage state dict} of ranks `keys`, each file read once (under --ep the ranks of a
    stage share the tensors of their TP rank's file)."""
    names = sorted({name for key in keys for name in _rank_files(meta, key)})
    with tqdm(names, desc="reading shards", unit="file", disable=not progress) as bar:  # closed before an error's line
        files = {name: load_tensors(Path(directory) / name, MODEL_DIR_FIX) for name in bar}
    return {key: {k: t for name in _rank_files(meta, key) for k, t in files[name].items()} for key in keys}


def load_full_state(directory: str | Path, progress: bool = False) -> tuple[ModelArch, dict[str, torch.Tensor]]:
    """The architecture and full Megatron state dict of a model directory."""
    meta = read_meta(directory)
    arch, (tp, pp, ep) = meta_arch(meta, directory), _saved_layout(meta)
    return arch, unshard(_read_rank_states(directory, meta, rank_keys(tp, pp, ep), progress), arch, tp, pp, ep)


def load_model_state(directory: str | Path, arch: ModelArch, tp: int = 1, tp_rank: int = 0, pp: int = 1,
                     pp_rank: int = 0, ep: int = 1, ep_rank: int = 0) -> dict[str, torch.Tensor]:
    """Rank (tp_rank, pp_rank, ep_rank)'s stage state dict, resharded when the directory was
    saved with another tp / pp / ep (that reads every rank file: the whole model passes through
    memory)."""
    meta = read_meta(directory)
    differences = arch_differences(meta_arch(meta, directory), arch)
    if differences:
        raise CheckpointError(f"{directory} holds another architecture (saved != requested): " + "; ".join(differences))
    _check_rank(tp, tp_rank, pp, pp_rank, ep, ep_rank)
    if _saved_layout(meta) != (tp, pp, ep):
        _, full = load_full_state(directory)
        return shard(full, arch, tp, tp_rank, pp, pp_rank, ep, ep_rank)
    key = (tp_rank, pp_rank) if ep == 1 else (tp_rank, pp_rank, ep_rank)
    state = _read_rank_states(directory, meta, [key])[key]
    check_state(state, shard_shapes(arch, tp, tp_rank, pp, pp_rank, ep, ep_rank), f"{directory}'s architecture")
    return state


# --- import-hf / export-hf output directories -----------------------------------------------

# What each command writes into its --out (names matched whole), and the file written last: a
# directory without it is an unfinished run's.
_OUTPUTS = {
    # (model_tp{t}_pp{p}_ep{e}: format version 1's expert-parallel files)
    "import-hf": (re.compile(rf"{re.escape(META_FILE)}|model_tp\d+_pp\d+(_ep\d+)?\.safetensors|"
                             rf"experts_pp\d+_ep\d+\.safetensors|{re.escape(HF_SUBDIR)}|{re.escape(CARRIED_FILE)}"),
                  META_FILE),
    "export-hf": (re.compile("|".join([r"model(-\d{5}-of-\d{5})?\.safetensors",
                                       *map(re.escape, ("config.json", HF_INDEX_FILE, *HF_SIDE_FILES))])),
                  "config.json"),
    "export-peft": (re.compile(r"adapter_model\.safetensors|adapter_config\.json"), "adapter_config.json"),
}


def check_output_dir(out: str | Path, command: str, *, overwrite: bool = False, last_writer: str | None = None) -> None:
    """UserError unless `command` ("import-hf" / "export-hf") may write `out`: new or empty, or
    holding only a previous output of the same command (an unfinished one is replaced; a
    finished one only with `overwrite`). Cheap: run it before gigabytes are read.
    `last_writer`: the lock file's command read before this job took the lock."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a directory: pass a directory path")
    if not out.is_dir():
        return
    staging = f".{command}{TMP_SUFFIX}"
    entries = [name for name in user_entries(out) if name != staging]
    if not entries:
        return
    owned, completion = _OUTPUTS[command]
    writer = recorded_command(out) if last_writer is None else last_writer
    foreign = [name for name in entries if not owned.fullmatch(name)]
    if foreign or writer != command:
        names = foreign or entries
        shown = first_few(names)
        raise UserError(f"--out {out} is not empty ({shown}) and is not the output of "
                        f"`vlmpack {shown_command(command)}`: choose an empty or new directory")
    if completion in entries and not overwrite:
        raise UserError(f"--out {out} holds a finished `vlmpack {shown_command(command)}` output: pass --overwrite to "
                        "replace it, or choose a new directory")


@contextmanager
def staged_output_dir(out: str | Path, command: str, overwrite: bool):
    """Hold `out` for this job (`exclusive_output_dir`) and yield an empty staging directory
    inside it; when the block succeeds, the previous output (if any) goes, completion file
    first, and the staged files move into `out`, completion file last. So `out` holds a whole
    output or one without its completion file (which a re-run replaces), never a mix."""
    last_writer = recorded_command(Path(out))
    with exclusive_output_dir(out, command) as path:
        check_output_dir(path, command, overwrite=overwrite, last_writer=last_writer)
        staging = path / f".{command}{TMP_SUFFIX}"
        shutil.rmtree(staging, ignore_errors=True)  # an interrupted run's
        staging.mkdir()
        try:
            yield staging
            fsync_tree(staging)
            _, completion = _OUTPUTS[command]
            old = sorted((name for name in user_entries(path) if name != staging.name), key=lambda n: n != completion)
            for name in old:
                if (path / name).is_dir():
                    shutil.rmtree(path / name)
                else:
                    (path / name).unlink()
            for name in sorted(os.listdir(staging), key=lambda n: n == completion):
                os.rename(staging / name, path / name)
            staging.rmdir()
            fsync_dir(path)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


def import_hf(hf_dir: str | Path, out: str | Path, tp: int = 1, pp: int = 1, dtype: torch.dtype | None = None,
              progress: bool = False, overwrite: bool = False, ep: int = 1) -> ModelArch:
    """HF model directory -> model directory sharded for tp / pp / ep (see `check_output_dir`
    for which `out` it writes)."""
    refuse_input_as_output(out, hf_dir)
    arch = ModelArch.from_hf_dir(hf_dir)
    check_hf_side_files(hf_dir)
    check_output_dir(out, "import-hf", overwrite=overwrite)  # these fail before gigabytes are read
    check_parallel(arch, tp, pp, ep)
    stage_layers(arch, pp)
    read_carried(hf_dir, arch)  # written last: a tensor of the wrong kind is named before the weights are
    full = hf_to_megatron(lazy_hf_state(hf_dir), arch)
    with staged_output_dir(out, "import-hf", overwrite) as staging:
        for name, key, experts in tqdm(model_files(tp, pp, ep), desc="writing shards", unit="file",
                                       disable=not progress):
            _write_file_streaming(staging / name, full, arch, tp, pp, ep, key, experts, dtype, hf_dir)
        # the source's fingerprint: a LoRA base recorded as the HF directory is known in this one
        write_meta(staging, arch, tp, pp, dtype_name(_cast_lazy(t, dtype) for t in full.values()), ep,
                   hf_fingerprint=weights_fingerprint(hf_dir))
        copy_hf_side_files(hf_dir, staging / HF_SUBDIR)
        write_carried(staging, hf_dir, arch, dtype)
    return arch


def write_carried(directory: Path, source: str | Path, arch: ModelArch, dtype: torch.dtype | None = None) -> None:
    """CARRIED_FILE in `directory` from `source`: a Hugging Face directory (its `carried_tensors`,
    read one at a time) or a model directory (its CARRIED_FILE); nothing where there are none.
    Cast to `dtype` as the model's weights are, else bit for bit."""
    carried = read_carried(source, arch)
    if carried:
        entries = [(name, tuple(t.shape), _cast_lazy(t, dtype).dtype) for name, t in carried.items()]
        save_tensors_streaming(directory / CARRIED_FILE, entries,
                               (_cast_lazy(t, dtype).load() for t in carried.values()))


def read_carried(source: str | Path, arch: ModelArch) -> dict[str, LazyTensor]:
    """The carried tensors (`carried_tensors`) of a model directory or a Hugging Face directory, lazily."""
    source = Path(source)
    if (source / META_FILE).is_file():
        path = source / CARRIED_FILE
        return lazy_file_tensors(path, MODEL_DIR_FIX) if path.is_file() else {}
    if not families.of(arch).carried_prefixes or not (source / "config.json").is_file():
        return {}
    carried = carried_tensors(lazy_hf_state(source), arch)
    integer = next((name for name, t in carried.items() if not t.is_floating_point()), None)
    if integer is not None:  # each is a weight of a layer, as the model's are (`check_state`)
        raise ModelFileError(f"{source}: {integer} is {str(carried[integer].dtype).removeprefix('torch.')}, where every "
                             "weight is a floating-point tensor", HF_DIR_FIX)
    return carried


def _cast_lazy(tensor: LazyTensor, dtype: torch.dtype | None) -> LazyTensor:
    if dtype is None or not tensor.is_floating_point():
        return tensor
    return LazyTensor(tensor.shape, dtype, lambda: tensor.load().to(dtype), tensor.origin)


def _write_file_streaming(path: Path, full: dict[str, LazyTensor], arch: ModelArch, tp: int, pp: int, ep: int,
                          key: tuple[int, ...], experts: bool | None, dtype: torch.dtype | None,
                          source: str | Path) -> None:
    """One model file (`model_files`), made and written one tensor at a time (peak memory:
    about one full-model tensor, whatever the model's size); each checked finite (`_finite`)
    as it is written."""
    ep_rank = key[2] if ep > 1 else 0
    plan = [entry for entry in _rank_plan(full, arch, tp, key[0], pp, key[1], ep, ep_rank)
            if experts is None or (_ep_dim(entry[1], arch) is not None) == experts]
    shapes = shard_shapes(arch, tp, key[0], pp, key[1], ep, ep_rank)
    entries = [(local, shapes[local], _cast_lazy(full[name], dtype).dtype) for local, name, _ in plan]
    save_tensors_streaming(path, entries, (_finite(part(_cast_lazy(full[name], dtype).load()),
                                                   " + ".join(full[name].origin) or name, source, dtype)
                                           for _, name, part in plan))


def _finite(tensor: torch.Tensor, name: str, source: str | Path, dtype: torch.dtype | None) -> torch.Tensor:
    """`tensor` (weight `name` of the checkpoint `source`), refused where it holds a NaN or an
    infinity: such a weight makes every loss NaN from the first step, long after the import."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        cast = f" once cast to {dtype_name([tensor])}" if dtype is not None else ""
        raise ModelFileError(f"{source}: weight {name} holds NaN or infinite values{cast}",
                             "import a checkpoint whose weights are finite" + (" (or keep its dtype)" if cast else ""))
    return tensor


def export_hf(model_dir: str | Path, out: str | Path, dtype: torch.dtype | None = None,
              progress: bool = False, overwrite: bool = False,
              chat_template: str | None = None) -> tuple[ModelArch, SideFiles]:
    """Model directory -> HF directory; returns the architecture and the side files written
    (see `check_output_dir` for which `out` it writes, `write_side_files` for the side files;
    `chat_template`: a template's text, over the one recorded with the model)."""
    refuse_input_as_output(out, model_dir)
    check_output_dir(out, "export-hf", overwrite=overwrite)
    check_kept_side_files(Path(model_dir))  # a damaged one is named now, not after the weights are written
    arch, full = load_full_state(model_dir, progress)
    hf = megatron_to_hf(full, arch) | {k: materialize(v) for k, v in read_carried(model_dir, arch).items()}
    return arch, write_hf_dir(out, hf, arch, Path(model_dir), dtype, progress, overwrite, chat_template)


def write_hf_dir(out: str | Path, hf: dict[str, torch.Tensor], arch: ModelArch, kept: Path | None,
                 dtype: torch.dtype | None = None, progress: bool = False, overwrite: bool = False,
                 chat_template: str | None = None) -> SideFiles:
    """A HF model directory from its weights (hub names): weights, config.json and the side
    files from `kept`, the model or adapter directory exported (`write_side_files`)."""
    hf = _cast(hf, dtype)
    config = arch.to_hf_config()
    stored = dtype_name(hf.values())
    if stored != "mixed":
        config["dtype"] = stored
    notes = []
    if arch.lm.mtp_num_hidden_layers and not carried_tensors(hf, arch):
        # a random init, or a source without them: the config promises no layers it lacks
        config["text_config"]["mtp_num_hidden_layers"] = 0
        notes.append(f"the checkpoint has no multi-token-prediction weights (its architecture has "
                     f"{arch.lm.mtp_num_hidden_layers} MTP layer(s), which vlmpack does not train): config.json says 0")
    with staged_output_dir(out, "export-hf", overwrite) as tmp:
        write_hf_state(tmp, hf, progress)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        side_files = write_side_files(tmp, arch.family, kept, chat_template)
    side_files.notes[:0] = notes
    return side_files
