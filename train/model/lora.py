"""LoRA adapters on the model's linear layers, named and laid out as Hugging Face PEFT has them.

Every adapter belongs to one Hugging Face module (`model.language_model.layers.3.self_attn.q_proj`,
`model.visual.blocks.0.attn.qkv`) and holds PEFT's two tensors, `lora_A` [r, in] and `lora_B`
[out, r]; the output gains `scaling * lora_B(lora_A(dropout(x)))`, scaling = alpha / r. The
full adapter state is a dict in PEFT's file names (`base_model.model.<module>.lora_A.weight`),
so export and import are renames at most.

DoRA (`dora`, PEFT's `use_dora`) adds a trained magnitude per output row,
`lora_magnitude_vector` [out]: the layer computes `m / ||W + scaling * B @ A||_row * (W x + scaling
* B A x) + bias`, the row norm recomputed every forward and kept out of the gradient, as PEFT does
(its cost is one B @ A and one pass over W per layer, small next to the layer's GEMM on a pack).
A fresh run starts the magnitude at the rows' norm, so the model starts as the base.

Where the adapters sit:
- language model: megatron fuses HF's modules, so one megatron linear carries several adapters:
  `linear_qkv` those of q/k/v_proj (each output placed into megatron's per-GQA-group [q, k, v]
  rows), `linear_fc1` those of gate/up_proj ([gate; up] halves), `linear_proj` o_proj's,
  `linear_fc2` down_proj's. Under tensor parallelism an adapter is split the way its base weight
  is: a column-parallel base (qkv, fc1) gets a whole `lora_A` and a `lora_B` split by output
  rows (its input gradient all-reduced over TP, as megatron does for the base); a row-parallel
  base (proj, fc2) a `lora_A` split by input columns (its output all-reduced) and a whole
  `lora_B`. Under sequence parallelism the rank-r hidden is gathered over the TP ranks or
  reduce-scattered to them instead, as the base's rows are. Mixture-of-Experts layers adapt
  attention and a shared expert (Qwen3.5) only: the routed experts are stacked tensors.
  Gated attention (Qwen3.5): q_proj's adapter gives each head's query and gate rows, placed
  into the group's queries and gates. Gated DeltaNet layers (Qwen3.5's linear attention):
  `in_proj` carries those of in_proj_qkv/z/b/a (each TP rank's [qkv, z, b, a] rows; in_proj_qkv's
  lora_B split as its q, k and v heads are), `out_proj` out_proj's (row-parallel).
- vision tower and mergers: plain `nn.Linear` with HF's names, adapted as PEFT does.

The adapters run as forward hooks of their base layers, so parameter names of the base model
(and with them checkpoints and conversion) stay as they are, and activation recompute redoes
them with their layer.
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from torch import Tensor, nn

from train.model.arch import ModelArch
from train.model.vision import VisionTower
from train.model.weight_names import HF_LM, HF_VISION

PEFT_PREFIX = "base_model.model."
LM_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
LM_MLP = ("gate_proj", "up_proj", "down_proj")
LM_LINEAR_ATTENTION = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
ALL_LINEAR = "all-linear"
ADAPTER_PARTS = ("llm", "vision", "merger")
MAGNITUDE = "lora_magnitude_vector"  # DoRA's trained magnitude per output row (PEFT's name)
# megatron linear (within a decoder layer) -> (HF module under the layer, its slot in the linear)
_MEGATRON_HOSTS = {
    "self_attention.linear_qkv": (("self_attn.q_proj", "q"), ("self_attn.k_proj", "k"), ("self_attn.v_proj", "v")),
    "self_attention.linear_proj": (("self_attn.o_proj", "row"),),
    "mlp.linear_fc1": (("mlp.gate_proj", "gate"), ("mlp.up_proj", "up")),
    "mlp.linear_fc2": (("mlp.down_proj", "row"),),
    # a Gated DeltaNet's (linear-attention layers): in_proj is [qkv, z, b, a] of each TP rank
    "self_attention.in_proj": (("linear_attn.in_proj_qkv", "qkv"), ("linear_attn.in_proj_z", "z"),
                               ("linear_attn.in_proj_b", "b"), ("linear_attn.in_proj_a", "a")),
    "self_attention.out_proj": (("linear_attn.out_proj", "row"),),
    # a Mixture-of-Experts layer's shared expert
    "mlp.shared_experts.linear_fc1": (("mlp.shared_expert.gate_proj", "gate"), ("mlp.shared_expert.up_proj", "up")),
    "mlp.shared_experts.linear_fc2": (("mlp.shared_expert.down_proj", "row"),),
}
_ROW_PARALLEL = {"self_attn.o_proj", "mlp.down_proj", "linear_attn.out_proj", "mlp.shared_expert.down_proj"}
_LM_MODULE = re.compile(r"^model\.language_model\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class LoraSpec:
    """What is adapted and how. `targets`: PEFT-style module names (a module matches a name
    that equals its own last components, as PEFT's `target_modules` list does) or `all-linear`,
    within the model parts `parts`; `modules_to_save`: parts trained fully and saved with the
    adapter (PEFT's modules_to_save)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = (ALL_LINEAR,)
    parts: tuple[str, ...] = ("llm",)
    modules_to_save: tuple[str, ...] = ()
    rslora: bool = False  # rank-stabilized: alpha / sqrt(rank) (PEFT's use_rslora)
    dora: bool = False  # a trained magnitude per output row (PEFT's use_dora)

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.rank) if self.rslora else self.alpha / self.rank

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets),
                "parts": list(self.parts), "modules_to_save": list(self.modules_to_save), "rslora": self.rslora,
                "dora": self.dora}

    @classmethod
    def from_dict(cls, d: dict) -> LoraSpec:
        return cls(rank=int(d["rank"]), alpha=float(d["alpha"]), dropout=float(d["dropout"]),
                   targets=tuple(d["targets"]), parts=tuple(d["parts"]), modules_to_save=tuple(d["modules_to_save"]),
                   rslora=bool(d.get("rslora", False)), dora=bool(d.get("dora", False)))


@dataclass(frozen=True)
class Site:
    """One adaptable HF linear module: its name, model part, shape and how TP splits it."""

    module: str  # HF name, e.g. model.language_model.layers.0.self_attn.q_proj
    part: str  # llm | vision | merger
    in_features: int
    out_features: int
    split: str  # column (lora_B split by rows) | row (lora_A split by columns) | none (vision: no TP)
    # column sites whose output rows are blocks a TP rank holds a run of each of (a Gated
    # DeltaNet's in_proj_qkv: its q, k and v heads); () is one block
    blocks: tuple[int, ...] = ()

    def key(self, tensor: str) -> str:
        """PEFT's file name of this module's `lora_A` / `lora_B` / DoRA magnitude."""
        return f"{PEFT_PREFIX}{self.module}.{tensor}" + ("" if tensor == MAGNITUDE else ".weight")


def vision_part(name: str) -> str:
    """`merger` for the mergers (DeepStack's included) that project into the language model,
    else `vision`; `name` is a vision-tower module or parameter name (ours, HF's without prefix)."""
    return "merger" if name.startswith(("merger", "deepstack_merger_list")) else "vision"


def _layer_shapes(lm, layer: int) -> dict[str, tuple[int, int, tuple[int, ...]]]:
    """The adaptable linears of decoder layer `layer`: HF name under the layer -> (in, out, blocks)."""
    h = lm.hidden_size
    if lm.layer_type(layer) == "linear_attention":
        keys = lm.linear_num_key_heads * lm.linear_key_head_dim
        values, heads = lm.linear_num_value_heads * lm.linear_value_head_dim, lm.linear_num_value_heads
        shapes = {"linear_attn.in_proj_qkv": (h, 2 * keys + values, (keys, keys, values)),
                  "linear_attn.in_proj_z": (h, values, ()), "linear_attn.in_proj_b": (h, heads, ()),
                  "linear_attn.in_proj_a": (h, heads, ()), "linear_attn.out_proj": (values, h, ())}
    else:
        q_out, kv_out = lm.num_heads * lm.head_dim, lm.num_kv_heads * lm.head_dim
        shapes = {"self_attn.q_proj": (h, 2 * q_out if lm.attn_output_gate else q_out, ()),
                  "self_attn.k_proj": (h, kv_out, ()), "self_attn.v_proj": (h, kv_out, ()),
                  "self_attn.o_proj": (q_out, h, ())}
    mlp = "mlp.shared_expert." if lm.is_moe else "mlp."
    width = lm.shared_expert_intermediate_size if lm.is_moe else lm.intermediate_size
    if width:
        shapes |= {mlp + "gate_proj": (h, width, ()), mlp + "up_proj": (h, width, ()), mlp + "down_proj": (width, h, ())}
    return shapes


def all_sites(arch: ModelArch) -> list[Site]:
    """Every linear module of the model that can carry an adapter, in model order."""
    lm = arch.lm
    with torch.device("meta"):
        tower = VisionTower(arch.vision)
    sites = [Site(HF_VISION + name, vision_part(name), module.in_features, module.out_features, "none")
             for name, module in tower.named_modules() if isinstance(module, nn.Linear)]
    for layer in range(lm.num_layers):
        sites += [Site(f"{HF_LM}layers.{layer}.{name}", "llm", fan_in, fan_out,
                       "row" if name in _ROW_PARALLEL else "column", blocks)
                  for name, (fan_in, fan_out, blocks) in _layer_shapes(lm, layer).items()]
    return sites


def _matches(module: str, target: str) -> bool:
    return module == target or module.endswith("." + target)


def resolve_sites(arch: ModelArch, spec: LoraSpec) -> list[Site]:
    """The sites `spec` adapts; ValueError naming a target that matches no module of the parts."""
    candidates = [s for s in all_sites(arch) if s.part in spec.parts]
    if ALL_LINEAR in spec.targets:
        return candidates
    unmatched = [t for t in spec.targets if not any(_matches(s.module, t) for s in candidates)]
    if unmatched:
        names = sorted({".".join(s.module.split(".")[-1 if s.part == "llm" else -2:]) for s in candidates})
        moe = (" (a Mixture-of-Experts model: its experts are stacked tensors, not linear modules; adapt attention"
               + (" and the shared expert)" if arch.lm.shared_expert_intermediate_size else ")")
               if arch.lm.is_moe and any(t in LM_MLP for t in unmatched) else "")
        raise ValueError(f"--lora-targets {','.join(unmatched)}: no such linear module in the {'/'.join(spec.parts)} "
                         f"part(s) of this model{moe}; choose from {','.join(names)} or {ALL_LINEAR}")
    return [s for s in candidates if any(_matches(s.module, t) for t in spec.targets)]


def peft_target_regex(sites: list[Site]) -> str:
    """PEFT `target_modules` (a regex PEFT matches against whole module names) that selects
    exactly `sites`, layer numbers folded into one pattern."""
    names = sorted({re.sub(r"\\\.\d+\\\.", lambda _: r"\.\d+\.", re.escape(s.module)) for s in sites})
    return "^(" + "|".join(names) + ")$"


# --- full adapter states (PEFT names, whole tensors) and their per-rank parts -------------------


def adapter_shapes(sites: list[Site], rank: int, dora: bool = False) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for s in sites:
        shapes[s.key("lora_A")] = (rank, s.in_features)
        shapes[s.key("lora_B")] = (s.out_features, rank)
        if dora:
            shapes[s.key(MAGNITUDE)] = (s.out_features,)
    return shapes


def init_adapters(sites: list[Site], rank: int, seed: int) -> dict[str, Tensor]:
    """PEFT's default init, drawn per module from its own generator (so it does not depend on the
    TP/PP layout): lora_A kaiming-uniform (a = sqrt 5, i.e. U(-1/sqrt(in), 1/sqrt(in))), lora_B 0."""
    state = {}
    for s in sites:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + _crc(s.module))
        bound = 1.0 / math.sqrt(s.in_features)
        state[s.key("lora_A")] = (torch.rand(rank, s.in_features, generator=generator) * 2 - 1) * bound
        state[s.key("lora_B")] = torch.zeros(s.out_features, rank)
    return state


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def _tp_dim(site: Site, tensor: str) -> int | None:
    """The dim of `lora_A` / `lora_B` / the magnitude split over TP ranks, or None (whole on every rank)."""
    if site.split == "column" and tensor in ("lora_B", MAGNITUDE):
        return 0
    if site.split == "row" and tensor == "lora_A":
        return 1
    return None


def _layer(site: Site) -> int | None:
    match = _LM_MODULE.match(site.module)
    return int(match.group(1)) if match else None


def on_stage(site: Site, layers: range, first_stage: bool) -> bool:
    layer = _layer(site)
    return first_stage if layer is None else layer in layers


def _tp_part(value: Tensor, site: Site, dim: int, tp: int, tp_rank: int) -> Tensor:
    if not site.blocks or dim != 0:
        return value.chunk(tp, dim)[tp_rank]
    return torch.cat([block.chunk(tp)[tp_rank] for block in value.split(list(site.blocks))])


def _tp_merge(parts: list[Tensor], site: Site, dim: int) -> Tensor:
    if not site.blocks or dim != 0:
        return torch.cat(parts, dim)
    local = [rows // len(parts) for rows in site.blocks]
    per_rank = [part.split(local) for part in parts]
    return torch.cat([torch.cat([rank[i] for rank in per_rank]) for i in range(len(local))])


def shard_adapters(full: dict[str, Tensor], sites: list[Site], tp: int, tp_rank: int, layers: range,
                   first_stage: bool) -> dict[str, Tensor]:
    """The part of the full adapter state that rank (tp_rank, stage) holds, PEFT names kept."""
    local = {}
    for s in sites:
        if not on_stage(s, layers, first_stage):
            continue
        for tensor in ("lora_A", "lora_B", MAGNITUDE):
            if s.key(tensor) not in full:  # no magnitude: LoRA, or a DoRA run's fresh start (from the base)
                continue
            value, dim = full[s.key(tensor)], _tp_dim(s, tensor)
            local[s.key(tensor)] = value if dim is None else _tp_part(value, s, dim, tp, tp_rank).clone()
    return local


def unshard_adapters(states: dict[int, dict[str, Tensor]], sites: list[Site]) -> dict[str, Tensor]:
    """Per-TP-rank states (each holding its stages' keys, merged over PP) -> the full state."""
    full = {}
    for s in sites:
        for tensor in ("lora_A", "lora_B", MAGNITUDE):
            dim, key = _tp_dim(s, tensor), s.key(tensor)
            if key not in states[0]:
                continue
            full[key] = states[0][key] if dim is None else _tp_merge([states[r][key] for r in sorted(states)], s, dim)
    return full


# --- the modules --------------------------------------------------------------------------------


class LoraBranch(nn.Module):
    """One HF module's adapter on this rank: `lora_A` [r, in/TP?], `lora_B` [out/TP?, r], and
    with DoRA the magnitude [out/TP?] (split as lora_B)."""

    def __init__(self, a_shape: tuple[int, int], b_shape: tuple[int, int], dtype: torch.dtype, device,
                 a_split: int | None, b_split: int | None, dora: bool = False):
        super().__init__()
        self.lora_A = nn.Parameter(torch.zeros(a_shape, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(b_shape, dtype=dtype, device=device))
        self.magnitude = nn.Parameter(torch.zeros(b_shape[0], dtype=dtype, device=device)) if dora else None
        for param, dim in ((self.lora_A, a_split), (self.lora_B, b_split), (self.magnitude, b_split)):
            if param is not None:
                # megatron's TP attributes: the grad norm counts a split tensor on every rank, a whole one once
                tensor_parallel.set_tensor_model_parallel_attributes(param, dim is not None, 0 if dim is None else dim, 1)

    @torch.no_grad()
    def row_norms(self, weight: Tensor, scaling: float, all_reduce: bool = False) -> Tensor:
        """||W + scaling * B @ A|| per output row of this rank's `weight` rows (fp32, no gradient);
        `all_reduce`: the rank holds some input columns only (row-parallel), so the squares are
        summed over TP."""
        merged = merged_weight(weight, self.lora_A, self.lora_B, scaling)
        if not (all_reduce and parallel_state.get_tensor_model_parallel_world_size() > 1):
            return torch.linalg.vector_norm(merged, dim=1)
        squares = merged.square().sum(1)
        torch.distributed.all_reduce(squares, group=parallel_state.get_tensor_model_parallel_group())
        return squares.sqrt()


def merged_weight(weight: Tensor, lora_A: Tensor, lora_B: Tensor, scaling: float) -> Tensor:
    """W + scaling * B @ A in fp32: what a merge writes, and whose row norms DoRA divides by."""
    return torch.addmm(weight.float(), lora_B.float(), lora_A.float(), alpha=scaling)


def _dora_output(host: nn.Module, y: Tensor, lora_out: Tensor, scale: Tensor) -> Tensor:
    """DoRA's output from the base layer's output `y`, the scaled adapter output and the per-row
    scale m / ||W + scaling * B @ A||: scale * (W x + lora_out), plus the bias the layer added
    (a megatron linear with skip_bias_add returns its bias apart). Two passes over the
    activations, the fewest this form allows."""
    scale = scale.to(y.dtype)
    bias = getattr(host, "bias", None)
    if bias is None or getattr(host, "skip_bias_add", False):
        return scale * (y + lora_out)
    return torch.addcmul(bias, scale, y - bias + lora_out)


class LinearAdapter(nn.Module):
    """The adapter of a plain `nn.Linear` (vision tower, mergers): no tensor parallelism."""

    def __init__(self, branch: LoraBranch, scaling: float, dropout: float):
        super().__init__()
        self.branch, self.scaling, self.dropout = branch, scaling, dropout

    def forward(self, x: Tensor) -> Tensor:
        """The adapter's output for `x` [..., in] as rows [tokens, out] (see `MegatronLinearAdapter`)."""
        x = x.reshape(-1, x.shape[-1])
        x = F.dropout(x, self.dropout, self.training) if self.dropout else x
        return F.linear(F.linear(x, self.branch.lora_A), self.branch.lora_B * self.scaling)

    def apply_to(self, host: nn.Linear, x: Tensor, y: Tensor) -> Tensor:
        lora_out = self(x).to(y.dtype).view(y.shape)
        if self.branch.magnitude is None:
            return y + lora_out
        scale = self.branch.magnitude / self.branch.row_norms(host.weight, self.scaling)
        return _dora_output(host, y, lora_out, scale)

    @torch.no_grad()
    def init_magnitudes(self, host: nn.Linear) -> None:
        self.branch.magnitude.copy_(self.branch.row_norms(host.weight, self.scaling))


class MegatronLinearAdapter(nn.Module):
    """The adapters of one megatron linear layer, its output in the layer's own layout.

    `slots`: slot name (q, k, v | gate, up | qkv, z, b, a | row) -> branch; a fused layer's
    slots that are not adapted contribute zeros. `qkv_sizes` (linear_qkv): the q, k and v rows
    per query group, of which this rank holds `groups`; with `gate_head_dim` (gated attention)
    q_proj's rows are per head [query; gate] of that head dim, and megatron's per group [its
    queries, their gates]. `slot_widths`: another fused layer's slots (a Gated DeltaNet's
    in_proj), this rank's rows of each, laid end to end in this order; neither: linear_fc1's
    [gate; up]."""

    def __init__(self, slots: dict[str, LoraBranch], scaling: float, dropout: float,
                 qkv_sizes: dict[str, int] | None = None, groups: int = 0, sequence_parallel: bool = False,
                 gate_head_dim: int = 0, slot_widths: dict[str, int] | None = None):
        """`sequence_parallel`: the host takes (column-parallel) or gives (row-parallel) this TP
        rank's slice of the rows, so the rank-r hidden is gathered or scattered like the host's
        own activations; the adapter tensors every rank holds whole then see only the rank's
        rows, and are marked for `finalize_model_grads` to sum their gradients over TP."""
        super().__init__()
        self.slots = nn.ModuleDict(slots)
        self.scaling, self.dropout, self.qkv_sizes, self.groups = scaling, dropout, qkv_sizes, groups
        self.gate_head_dim, self.slot_widths = gate_head_dim, slot_widths
        self.sequence_parallel = sequence_parallel
        self._rows: dict = {}  # device -> DoRA's slot rows (`_slot_rows`)
        some = next(iter(slots.values()))
        if some.magnitude is not None and "row" not in slots:  # found here, not in a (compiled) forward: finding them is data-dependent
            self._slot_rows(some.magnitude.device)
        if sequence_parallel:
            for branch in slots.values():
                whole = [branch.lora_B, branch.magnitude] if "row" in slots else [branch.lora_A]
                for param in whole:
                    if param is not None:
                        param.sequence_parallel = True

    def forward(self, x: Tensor) -> Tensor:
        """The adapters' output for `x` [..., in], as rows [tokens, out] of the host's layout
        (`apply_to` gives it the host output's shape)."""
        # rows, not [s, b, in]: a grad-free graph (a recomputed layer's first forward) would
        # otherwise run the rank-r GEMMs as batched GEMMs, which cuBLAS gives a 25x slower kernel
        x = x.reshape(-1, x.shape[-1])
        x = F.dropout(x, self.dropout, self.training) if self.dropout else x
        # the group named: megatron's mappings warn at every call without one, which would
        # split a compiled decoder layer (`compile_model`) into several graphs
        group = parallel_state.get_tensor_model_parallel_group()
        if "row" in self.slots:  # x holds this rank's input columns: sum the partial products over TP
            branch = self.slots["row"]
            partial = F.linear(x, branch.lora_A)
            hidden = (tensor_parallel.reduce_scatter_to_sequence_parallel_region(partial, group=group)
                      if self.sequence_parallel else tensor_parallel.reduce_from_tensor_model_parallel_region(partial, group))
            return F.linear(hidden, branch.lora_B * self.scaling)
        names = list(self.slots)
        # one GEMM for the slots' lora_A (all see the same input); the TP ranks' lora_B parts then
        # each give part of the output, so the input gradient is summed over TP
        hidden = F.linear(x, torch.cat([self.slots[n].lora_A for n in names]))
        hidden = (tensor_parallel.gather_from_sequence_parallel_region(hidden, group=group) if self.sequence_parallel
                  else tensor_parallel.copy_to_tensor_model_parallel_region(hidden, group=group))
        pieces = hidden.split([self.slots[n].lora_A.shape[0] for n in names], -1)
        # the scaling applied to each small lora_B, not to the activations (one pass fewer)
        outs = {n: F.linear(h, self.slots[n].lora_B * self.scaling) for n, h in zip(names, pieces)}
        return self._layout(outs)

    def apply_to(self, host: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        lora_out = self(x).to(y.dtype).view(y.shape)
        if next(iter(self.slots.values())).magnitude is None:
            return y + lora_out
        return _dora_output(host, y, lora_out, self._dora_scale(host))

    def _slot_rows(self, device) -> dict[str, Tensor]:
        """Each adapted slot's rows in this rank's fused output (megatron's layout, as `_layout`
        builds it), in the slot's own row order (gated attention's q_proj rows are not in fused
        order), found once per device (finding them syncs with the GPU)."""
        if device not in self._rows:
            widths = self._widths()
            ids = {n: torch.arange(w, dtype=torch.float64) + sum(list(widths.values())[:i]) + 1
                   for i, (n, w) in enumerate(widths.items())}
            fused = self._layout({n: v[None] for n, v in ids.items()})[0]
            rows = {}
            for n in self.slots:
                found = torch.nonzero((fused >= ids[n][0]) & (fused <= ids[n][-1])).flatten()
                rows[n] = found[torch.argsort(fused[found])].to(device)
            self._rows[device] = rows
        return self._rows[device]

    def _widths(self) -> dict[str, int]:
        """Every slot's output rows on this rank, adapted or not, in slot order."""
        if self.slot_widths is not None:
            return dict(self.slot_widths)
        if self.qkv_sizes is None:
            width = next(iter(self.slots.values())).lora_B.shape[0]
            return {"gate": width, "up": width}
        return {n: self.groups * self.qkv_sizes[n] for n in ("q", "k", "v")}

    def _dora_scale(self, host: nn.Module) -> Tensor:
        """m / ||W + scaling * B @ A|| per output row of this rank (1 on the rows of slots without
        an adapter): gradient to the magnitudes only."""
        weight = host.weight
        if "row" in self.slots:
            branch = self.slots["row"]
            return branch.magnitude / branch.row_norms(weight, self.scaling, all_reduce=True)
        scale = torch.ones(weight.shape[0], dtype=torch.float32, device=weight.device)
        for name, rows in self._slot_rows(weight.device).items():
            branch = self.slots[name]
            scale = scale.index_copy(0, rows, branch.magnitude.float() / branch.row_norms(weight[rows], self.scaling))
        return scale

    @torch.no_grad()
    def init_magnitudes(self, host: nn.Module) -> None:
        weight = host.weight
        if "row" in self.slots:
            branch = self.slots["row"]
            branch.magnitude.copy_(branch.row_norms(weight, self.scaling, all_reduce=True))
            return
        for name, rows in self._slot_rows(weight.device).items():
            branch = self.slots[name]
            branch.magnitude.copy_(branch.row_norms(weight[rows], self.scaling))

    def _layout(self, outs: dict[str, Tensor]) -> Tensor:
        some = next(iter(outs.values()))
        lead = some.shape[:-1]
        if self.slot_widths is not None:
            return torch.cat([outs[n] if n in outs else some.new_zeros(*lead, w) for n, w in self.slot_widths.items()], -1)
        if self.qkv_sizes is None:  # linear_fc1: [gate; up], both halves of one width
            width = some.shape[-1]
            return torch.cat([outs[n] if n in outs else some.new_zeros(*lead, width) for n in ("gate", "up")], -1)
        if "q" in outs and self.gate_head_dim:  # per head [query; gate] -> per group [queries; gates]
            d = self.gate_head_dim
            outs = {**outs, "q": outs["q"].unflatten(-1, (self.groups, -1, 2, d)).transpose(-3, -2).flatten(-4)}
        # megatron's QKV rows: per query group [its q heads (and their gates), its k head, its v head]
        parts = [outs[n].unflatten(-1, (self.groups, -1)) if n in outs
                 else some.new_zeros(*lead, self.groups, self.qkv_sizes[n]) for n in ("q", "k", "v")]
        return torch.cat(parts, -1).flatten(-2)


def _add_adapter_output(module, args, kwargs, output):
    """Forward hook of an adapted megatron linear: output (y, bias) -> (y + adapter(x), bias)."""
    x = args[0] if args else kwargs["input_"]
    y, bias = output
    return module.lora.apply_to(module, x, y), bias


def _add_linear_adapter_output(module, args, output):
    return module.lora.apply_to(module, args[0], output)


class Adapters:
    """The adapters attached to one rank's model stage: PEFT key -> this rank's parameter."""

    def __init__(self, spec: LoraSpec, sites: list[Site], params: dict[str, nn.Parameter],
                 saved_modules: dict[str, nn.Parameter], hosts: list[nn.Module] = ()):
        self.spec, self.sites, self.params = spec, sites, params
        self.saved_modules = saved_modules  # modules_to_save: PEFT key -> the model's own parameter
        self.hosts = list(hosts)  # the adapted layers (each with its adapters as `.lora`)
        self.base: dict = {}  # the model the adapters belong to (train.model_setup.base_reference)

    def state_dict(self) -> dict[str, Tensor]:
        return {k: p.detach() for k, p in (self.params | self.saved_modules).items()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Tensor], magnitudes_from_base: bool = False) -> None:
        """`magnitudes_from_base`: `state` holds no DoRA magnitudes; each starts as its rows' norm
        of W + scaling * B @ A (with lora_B at zero, the base layer unchanged), as PEFT starts them."""
        expected = self.params | self.saved_modules
        if magnitudes_from_base:
            expected = {k: p for k, p in expected.items() if not k.endswith(MAGNITUDE)}
        missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(f"adapter state does not fit this model's adapters: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
        for key, param in expected.items():
            if tuple(state[key].shape) != tuple(param.shape):
                raise ValueError(f"adapter tensor {key}: shape {tuple(state[key].shape)}, this model's adapter has "
                                 f"{tuple(param.shape)}")
            param.copy_(state[key])
        if magnitudes_from_base:
            for host in self.hosts:
                host.lora.init_magnitudes(host)


def saved_module_params(model, parts: tuple[str, ...]) -> dict[str, nn.Parameter]:
    """modules_to_save: the vision tower's parameters of `parts`, under PEFT's names."""
    if model.vision is None:
        return {}
    return {f"{PEFT_PREFIX}{HF_VISION}{name}": p for name, p in model.vision.named_parameters()
            if vision_part(name) in parts}


def attach(model, arch: ModelArch, spec: LoraSpec, tp: int, layers: range) -> Adapters:
    """Freeze this rank's stage `model` (a `QwenVLModel`) and give it `spec`'s adapters (zeros:
    load a state next); the modules_to_save parts stay trainable."""
    for param in model.parameters():
        param.requires_grad_(False)
    first = model.pre_process
    sites = [s for s in resolve_sites(arch, spec) if on_stage(s, layers, first)]
    dtype = model.config.params_dtype
    params: dict[str, nn.Parameter] = {}

    def branch(site: Site) -> LoraBranch:
        a_dim, b_dim = _tp_dim(site, "lora_A"), _tp_dim(site, "lora_B")
        a = (spec.rank, site.in_features // (tp if a_dim is not None else 1))
        b = (site.out_features // (tp if b_dim is not None else 1), spec.rank)
        device = next(model.parameters()).device
        made = LoraBranch(a, b, dtype, device, a_dim, b_dim, spec.dora)
        params[site.key("lora_A")], params[site.key("lora_B")] = made.lora_A, made.lora_B
        if spec.dora:
            params[site.key(MAGNITUDE)] = made.magnitude
        return made

    by_module = {s.module: s for s in sites}
    hosts = []
    if model.vision is not None:
        for name, module in model.vision.named_modules():
            site = by_module.get(HF_VISION + name)
            if site is not None:
                module.lora = LinearAdapter(branch(site), spec.scaling, spec.dropout)
                module.register_forward_hook(_add_linear_adapter_output)
                hosts.append(module)
    lm = arch.lm
    for local, layer in enumerate(model.language_model.decoder.layers):
        number = layers[local]
        for host_name, slots in _MEGATRON_HOSTS.items():
            adapted = {slot: branch(by_module[f"{HF_LM}layers.{number}.{hf}"]) for hf, slot in slots
                       if f"{HF_LM}layers.{number}.{hf}" in by_module}
            if not adapted:
                continue
            host = layer.get_submodule(host_name)
            gated = lm.attn_output_gate and host_name.endswith("linear_qkv")
            qkv = ({"q": lm.num_heads // lm.num_kv_heads * lm.head_dim * (2 if gated else 1), "k": lm.head_dim,
                    "v": lm.head_dim} if host_name.endswith("linear_qkv") else None)
            widths = None
            if host_name == "self_attention.in_proj":  # this rank's part of each of the Gated DeltaNet's blocks
                widths = {slot: _layer_shapes(lm, number)[hf][1] // tp for hf, slot in slots}
            host.lora = MegatronLinearAdapter(adapted, spec.scaling, spec.dropout, qkv, lm.num_kv_heads // tp,
                                              sequence_parallel=model.config.sequence_parallel,
                                              gate_head_dim=lm.head_dim if gated else 0, slot_widths=widths)
            host.register_forward_hook(_add_adapter_output, with_kwargs=True)
            hosts.append(host)
    saved = saved_module_params(model, spec.modules_to_save)
    for param in saved.values():
        param.requires_grad_(True)
    return Adapters(spec, sites, params, saved, hosts)
