"""Gated DeltaNet linear attention (the "linear_attention" layers of Qwen3.5 / Qwen3.6) on packed rows.

Per token t of one sequence, as transformers' `Qwen3_5GatedDeltaNet` computes it:

    q, k, v = silu(causal depthwise conv1d over the last `conv_kernel` tokens of in_proj_qkv(x))
    beta = sigmoid(in_proj_b(x)),  g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)
    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T    (per head; S: key x value head dim)
    o_t = S_t^T q_t / sqrt(key_head_dim)                                  (q, k l2-normalised)
    out = out_proj(RMSNorm(o) * silu(in_proj_z(x)))                      (the norm per value head)

Value heads outnumber key heads (GVA): value head j reads key/query head j // (value heads / key heads).

`GatedDeltaNet` is a megatron-core `self_attention` submodule for a layer spec. It takes the
pack's rows as megatron hands them ([T, 1, H], or each TP rank's slice of them under sequence
parallelism) with the sample boundaries in `packed_seq_params.cu_seqlens_q` (`PackedRows`, as
`PackedCoreAttention` gets them), and restarts both the conv window and the recurrent state at
every sample's first row: each sample's rows get exactly what the HF module gives that sample
alone. Rows past the last boundary (trailing padding) are run as one more sequence of their own,
so they stay finite and touch no sample. megatron-core 0.16.1's own `GatedDeltaNet` refuses
packed input and its conv runs across sample boundaries.

Kernels: on CUDA, flash-linear-attention's varlen Triton kernels (package `fla-core`, extra
`qwen3.5`): `causal_conv1d` and `chunk_gated_delta_rule` with `cu_seqlens`. Elsewhere (CPU, or
no fla installed) an exact PyTorch path in fp32: HF's chunked form of the rule, with every
sample's rows cut into chunks of their own and the state zeroed at each sample's first chunk.

Tensor parallelism: the input projection is one column-parallel GEMM whose rank-r rows are
[q_r, k_r, v_r, z_r, b_r, a_r] (rank r's share of the key heads, then of the value heads; the
layout of megatron-core's GatedDeltaNet); conv channels, A_log and dt_bias follow their heads;
out_proj is row-parallel; the gated norm's weight (one per head dim) is on every rank, and its
gradient is summed over the TP ranks, each of which normalises only its own heads.
`WEIGHTS` maps the HF tensors to these parameters (`hf_to_rank`, `rank_to_hf`).
"""

from __future__ import annotations

import importlib.util

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from train.model.linear import ColumnParallelLinear, RowParallelLinear

CHUNK = 64  # the PyTorch path's chunk length: HF's, so that each sample runs through HF's own arithmetic


@dataclass(frozen=True)
class GatedDeltaNetDims:
    """The layer's shape (megatron's `linear_*` TransformerConfig fields; HF's config has the
    same names)."""

    hidden_size: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @classmethod
    def from_config(cls, config: TransformerConfig) -> GatedDeltaNetDims:
        return cls(hidden_size=config.hidden_size, num_key_heads=config.linear_num_key_heads,
                   num_value_heads=config.linear_num_value_heads, key_head_dim=config.linear_key_head_dim,
                   value_head_dim=config.linear_value_head_dim, conv_kernel=config.linear_conv_kernel_dim)

    @classmethod
    def from_lm(cls, lm) -> GatedDeltaNetDims:
        """The linear-attention layers' shape of a language model (`train.model.arch.LMArch`)."""
        return cls(hidden_size=lm.hidden_size, num_key_heads=lm.linear_num_key_heads,
                   num_value_heads=lm.linear_num_value_heads, key_head_dim=lm.linear_key_head_dim,
                   value_head_dim=lm.linear_value_head_dim, conv_kernel=lm.linear_conv_kernel_dim)

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def check(self, tp: int) -> None:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"linear_num_value_heads {self.num_value_heads} must be a multiple of "
                             f"linear_num_key_heads {self.num_key_heads}")
        if self.num_key_heads % tp:
            raise ValueError(f"linear_num_key_heads {self.num_key_heads} (and value heads {self.num_value_heads}) "
                             f"must divide over tensor-parallel size {tp}")

    def block_rows(self) -> dict[str, int]:
        """Rows (dim 0) of each head-divided block of the weights, for the whole layer."""
        return {"query": self.key_dim, "key": self.key_dim, "value": self.value_dim, "z": self.value_dim,
                "beta": self.num_value_heads, "alpha": self.num_value_heads, "value_heads": self.num_value_heads}


# --- weights: HF <-> this module, per TP rank -------------------------------------------------

HF_PREFIX = "linear_attn."  # the HF module's name inside a decoder layer
IN_PROJ_BLOCKS = ("query", "key", "value", "z", "beta", "alpha")  # in_proj's rows, of each TP rank
CONV_BLOCKS = IN_PROJ_BLOCKS[:3]  # the conv's channels: q, k, v


@dataclass(frozen=True)
class GatedDeltaNetWeight:
    """One parameter of `GatedDeltaNet` and the HF tensors it holds.

    `hf`: (HF name, its blocks) in order; the parameter is the HF tensors concatenated along
    dim 0. `tp_split`: "heads" — every block is divided into TP equal runs of whole heads and
    rank r holds its run of each block, concatenated in block order; "row" — dim 1 is divided
    (out_proj's input features); "replicated" — every rank holds all of it."""

    param: str
    hf: tuple[tuple[str, tuple[str, ...]], ...]
    tp_split: str


# The module's parameters <- HF's tensors (one decoder layer's, under `HF_PREFIX`), and their TP split.
WEIGHTS = (
    GatedDeltaNetWeight("in_proj.weight", ((HF_PREFIX + "in_proj_qkv.weight", CONV_BLOCKS),
                                           (HF_PREFIX + "in_proj_z.weight", ("z",)),
                                           (HF_PREFIX + "in_proj_b.weight", ("beta",)),
                                           (HF_PREFIX + "in_proj_a.weight", ("alpha",))), "heads"),
    GatedDeltaNetWeight("conv1d.weight", ((HF_PREFIX + "conv1d.weight", CONV_BLOCKS),), "heads"),
    GatedDeltaNetWeight("A_log", ((HF_PREFIX + "A_log", ("value_heads",)),), "heads"),
    GatedDeltaNetWeight("dt_bias", ((HF_PREFIX + "dt_bias", ("value_heads",)),), "heads"),
    GatedDeltaNetWeight("out_norm.weight", ((HF_PREFIX + "norm.weight", ()),), "replicated"),
    GatedDeltaNetWeight("out_proj.weight", ((HF_PREFIX + "out_proj.weight", ()),), "row"),
)


def _blocks(weight: GatedDeltaNetWeight, dims: GatedDeltaNetDims) -> list[int]:
    rows = dims.block_rows()
    return [rows[block] for _, blocks in weight.hf for block in blocks]


def split_for_tp(tensor: Tensor, weight: GatedDeltaNetWeight, dims: GatedDeltaNetDims, tp: int) -> list[Tensor]:
    """The whole layer's parameter `weight.param` -> the TP ranks' parts, in rank order."""
    if weight.tp_split == "replicated":
        return [tensor] * tp
    if weight.tp_split == "row":
        return list(tensor.chunk(tp, dim=1))
    runs = [block.chunk(tp) for block in tensor.split(_blocks(weight, dims))]
    return [torch.cat([block_runs[rank] for block_runs in runs]) for rank in range(tp)]


def merge_tp(parts: list[Tensor], weight: GatedDeltaNetWeight, dims: GatedDeltaNetDims) -> Tensor:
    """Inverse of `split_for_tp`."""
    if weight.tp_split == "replicated":
        return parts[0]
    if weight.tp_split == "row":
        return torch.cat(parts, dim=1)
    tp = len(parts)
    local = [rows // tp for rows in _blocks(weight, dims)]
    per_rank = [part.split(local) for part in parts]
    return torch.cat([torch.cat([rank[i] for rank in per_rank]) for i in range(len(local))])


def hf_to_rank(hf: dict[str, Tensor], dims: GatedDeltaNetDims, tp: int = 1, tp_rank: int = 0) -> dict[str, Tensor]:
    """One layer's HF tensors (names as in `WEIGHTS`, e.g. `linear_attn.in_proj_qkv.weight`)
    -> the state dict of TP rank `tp_rank`'s `GatedDeltaNet`."""
    dims.check(tp)
    out = {}
    for weight in WEIGHTS:
        whole = torch.cat([hf[name] for name, _ in weight.hf]) if len(weight.hf) > 1 else hf[weight.hf[0][0]]
        out[weight.param] = split_for_tp(whole, weight, dims, tp)[tp_rank]
    return out


def rank_to_hf(ranks: list[dict[str, Tensor]], dims: GatedDeltaNetDims) -> dict[str, Tensor]:
    """Every TP rank's `GatedDeltaNet` state dict (in rank order) -> the layer's HF tensors."""
    dims.check(len(ranks))
    rows = dims.block_rows()
    out = {}
    for weight in WEIGHTS:
        whole = merge_tp([rank[weight.param] for rank in ranks], weight, dims)
        if len(weight.hf) == 1:
            out[weight.hf[0][0]] = whole
            continue
        sizes = [sum(rows[block] for block in blocks) for _, blocks in weight.hf]
        out.update(zip((name for name, _ in weight.hf), whole.split(sizes)))
    return out


# --- sample boundaries ------------------------------------------------------------------------


class Segments:
    """The sequences of the rows, from the pack's cu_seqlens, in the forms each path needs.

    `bounds` (host): 0 = b0 < b1 < ... < bn = total rows; empty segments dropped and rows past
    the pack's last boundary (padding) made one more segment. Tensors are built on first use."""

    def __init__(self, bounds: list[int], device: torch.device):
        self.bounds, self.device = bounds, device
        self._cu = self._position = self._chunks = None

    @property
    def total(self) -> int:
        return self.bounds[-1]

    def cu_seqlens(self) -> tuple[Tensor, Tensor]:
        """(device, host) int64 boundaries, as flash-linear-attention takes them."""
        if self._cu is None:
            host = torch.tensor(self.bounds, dtype=torch.long)
            self._cu = (host.to(self.device), host)
        return self._cu

    def position(self) -> Tensor:
        """[T] each row's index within its segment."""
        if self._position is None:
            bounds = torch.tensor(self.bounds)
            starts = torch.repeat_interleave(bounds[:-1], bounds.diff())
            self._position = (torch.arange(self.total) - starts).to(self.device)
        return self._position

    def chunks(self, chunk: int) -> tuple[Tensor, Tensor, list[bool]]:
        """Each segment cut into runs of `chunk` rows from its first row: (rows [C, chunk], row
        index, `total` where a segment's last chunk runs past its end; valid [C, chunk]; whether
        chunk c is its segment's first)."""
        if self._chunks is None or self._chunks[0].shape[1] != chunk:
            starts, ends, first = [], [], []
            for start, end in zip(self.bounds, self.bounds[1:]):
                for c in range(start, end, chunk):
                    starts.append(c)
                    ends.append(end)
                    first.append(c == start)
            rows = torch.tensor(starts)[:, None] + torch.arange(chunk)
            valid = rows < torch.tensor(ends)[:, None]
            rows = torch.where(valid, rows, self.total)
            self._chunks = (rows.to(self.device), valid.to(self.device), first)
        return self._chunks


# (cu_seqlens, its version counter, rows, device, Segments) of the last pack seen
_last_segments: tuple | None = None


def segments_of(cu_seqlens: Tensor | None, total: int, sequence_length: int | None, device: torch.device) -> Segments:
    """The segments of `total` rows: from `cu_seqlens` (a pack), or, without it, runs of
    `sequence_length` rows (an unpacked batch). A pack's boundaries come to the host once per
    micro-batch: every layer is handed the same cu_seqlens tensor, and the last one's segments
    are kept, keyed by the tensor itself (held, so its identity is not reused) and its version
    counter (a buffer rewritten in place for the next pack is not taken for the same one)."""
    global _last_segments
    if cu_seqlens is None:
        return Segments(list(range(0, total + 1, sequence_length)), device)
    key = (cu_seqlens, cu_seqlens._version, total, device)
    last = _last_segments
    if last is not None and last[0] is key[0] and last[1:4] == key[1:]:
        return last[4]
    host = [int(b) for b in cu_seqlens.tolist()]
    if host[0] != 0 or any(later < earlier for earlier, later in zip(host, host[1:])) or host[-1] > total:
        raise ValueError(f"cu_seqlens {host} must rise from 0 to at most the {total} rows of the pack")
    bounds = [0] + [b for a, b in zip(host, host[1:]) if b > a]
    if bounds[-1] < total:
        bounds.append(total)
    segments = Segments(bounds, device)
    _last_segments = (*key, segments)
    return segments


# --- the PyTorch path -------------------------------------------------------------------------


def torch_causal_conv1d(x: Tensor, weight: Tensor, segments: Segments) -> Tensor:
    """silu(causal depthwise conv) within each segment: x [T, D], weight [D, K] -> [T, D] in
    x's dtype; row t sees rows t-K+1..t of its own segment (zeros before the segment's start)."""
    width = weight.shape[-1]
    xf, wf = x.float(), weight.float()
    position = segments.position()
    out = xf * wf[:, width - 1]
    for shift in range(1, width):
        earlier = F.pad(xf, (0, 0, shift, 0))[: xf.shape[0]]
        earlier = torch.where((position >= shift)[:, None], earlier, torch.zeros_like(earlier))
        out = out + earlier * wf[:, width - 1 - shift]
    return F.silu(out).to(x.dtype)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def torch_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, segments: Segments,
                           chunk: int = CHUNK) -> Tensor:
    """The chunked gated delta rule (HF's `torch_chunk_gated_delta_rule`, q/k l2-normalised) on
    every segment, state zeroed at each segment's start. q, k [T, Hk, dk]; v [T, Hv, dv]; g
    (log decay), beta [T, Hv] -> [T, Hv, dv] in q's dtype. fp32 inside. All chunks of all
    segments go through the within-chunk algebra at once; only the state is carried from chunk
    to chunk, in a loop over them."""
    dtype = q.dtype
    repeat = v.shape[1] // k.shape[1]
    q, k = (l2norm(x.float().repeat_interleave(repeat, dim=1)) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    rows, valid, first = segments.chunks(chunk)

    def chunked(x: Tensor) -> Tensor:  # [T, H, ...] -> [H, C, chunk, ...], zeros where a chunk runs past its segment
        x = torch.cat([x.float(), x.new_zeros(1, *x.shape[1:], dtype=torch.float32)])[rows]
        return x.movedim(2, 0)

    q, k, v, g, beta = (chunked(x) for x in (q, k, v, g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    decay = g.cumsum(dim=-1)  # [H, C, chunk]: log of the decay from the chunk's start
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    within = (q @ k.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False,
                                              unitriangular=True)
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]

    heads, dk, dv = q.shape[0], q.shape[-1], v.shape[-1]
    outs, state = [], None
    # unbind, not index, per chunk: the backward of C slices would write C full-size zero gradients
    per_chunk = (x.unbind(1) for x in (new_values, k_decayed, q, within, k, chunk_decay))
    for starts_segment, v_c, kd_c, q_c, within_c, k_c, decay_c in zip(first, *per_chunk):
        if starts_segment:
            state = q.new_zeros(heads, dk, dv)
        v_new = v_c - kd_c @ state
        outs.append(q_c @ state + within_c @ v_new)
        state = state * decay_c + k_c.transpose(-1, -2) @ v_new
    out = torch.stack(outs, dim=1).movedim(0, 2)  # [C, chunk, H, dv]
    return out[valid].to(dtype)


# --- flash-linear-attention -------------------------------------------------------------------

_fla = None


def fla_kernels():
    """(causal_conv1d, chunk_gated_delta_rule) of flash-linear-attention, or None when the
    package is not installed. Imported on first use: it compiles nothing until called, but
    imports Triton."""
    global _fla
    if _fla is None:
        try:
            from fla.modules.causal_conv1d import causal_conv1d
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
            _fla = (causal_conv1d, chunk_gated_delta_rule)
        except ImportError:
            _fla = False
    return _fla or None


def fla_backward_refusal() -> str | None:
    """Why flash-linear-attention would refuse this GPU's backward of the gated delta rule, or
    None. fla-core 0.6 raises mid-step on Hopper GPUs with a Triton from 3.4.0 to before 3.7.1,
    which computes that kernel wrongly, unless tilelang (its other backend) is installed: found
    before the first step, it is a setup error with its fix, not a failure an hour in."""
    if fla_kernels() is None or not torch.cuda.is_available():
        return None
    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:  # another fla release: it decides for itself
        return None
    if IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1 \
            and importlib.util.find_spec("tilelang") is None:
        import triton

        return (f"flash-linear-attention refuses the Gated DeltaNet's backward on Hopper GPUs with Triton "
                f"{triton.__version__} (3.4.0 to before 3.7.1 computes it wrongly): pip install tilelang, which it "
                f"then runs that kernel on, or a torch whose Triton is 3.7.1 or newer")
    return None


# --- the module -------------------------------------------------------------------------------


class GatedRMSNorm(torch.nn.Module):
    """HF's `Qwen3_5RMSNormGated` over each head's `hidden_size` values: RMS-normalised in fp32,
    cast back, times the weight, times silu(gate) in fp32, cast back."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))

    def forward(self, x: Tensor, gate: Tensor, weight: Tensor | None = None) -> Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (self.weight if weight is None else weight) * xf.to(dtype)
        return (out * F.silu(gate.float())).to(dtype)


@dataclass
class GatedDeltaNetSubmodules:
    """The layer spec's linears (a LoRA or FP8 spec may swap them)."""

    in_proj: type = ColumnParallelLinear
    out_proj: type = RowParallelLinear


class GatedDeltaNet(MegatronModule):
    """megatron-core `self_attention` submodule: Gated DeltaNet on packed rows (module docstring).

    forward(hidden [S, B, H] (S: this rank's rows under sequence parallelism), packed_seq_params)
    -> (output [S, B, H], None). With `packed_seq_params` (B = 1) the rows are the pack and
    `cu_seqlens_q` its sample boundaries; without, each of the B columns is one sequence.

    `kernels`: "auto" (flash-linear-attention on CUDA when installed, else PyTorch), "torch", or
    "fla" (refuse to run without it)."""

    kernels = "auto"

    def __init__(self, config: TransformerConfig, layer_number: int | None = None,
                 submodules: GatedDeltaNetSubmodules | None = None, pg_collection=None, **_):
        super().__init__(config=config)
        submodules = submodules or GatedDeltaNetSubmodules()
        self.layer_number = layer_number
        self.tp_group = (pg_collection.tp if pg_collection is not None
                         else parallel_state.get_tensor_model_parallel_group())
        self.tp = self.tp_group.size() if self.tp_group is not None else 1
        self.dims = dims = GatedDeltaNetDims.from_config(config)
        dims.check(self.tp)
        self.local_key_heads, self.local_value_heads = dims.num_key_heads // self.tp, dims.num_value_heads // self.tp
        rows = dims.block_rows()
        self.in_proj_split = [rows[block] // self.tp for block in IN_PROJ_BLOCKS]
        self.conv_split = [rows[block] // self.tp for block in CONV_BLOCKS]

        self.in_proj = submodules.in_proj(
            dims.hidden_size, sum(rows[block] for block in IN_PROJ_BLOCKS),
            config=config, init_method=config.init_method, gather_output=False, bias=False, skip_bias_add=False,
            is_expert=False, tp_comm_buffer_name="fc1", tp_group=self.tp_group)
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        dtype = config.params_dtype
        # nn.Conv1d for its parameter's name and shape ([channels, 1, kernel], as HF and megatron
        # hold it); the varlen conv runs on the weight, never through the module.
        self.conv1d = torch.nn.Conv1d(sum(self.conv_split), sum(self.conv_split), dims.conv_kernel, bias=False,
                                      groups=sum(self.conv_split), device=device, dtype=dtype)
        self.A_log = torch.nn.Parameter(torch.empty(self.local_value_heads, device=device, dtype=dtype))
        self.dt_bias = torch.nn.Parameter(torch.empty(self.local_value_heads, device=device, dtype=dtype))
        for param in (self.conv1d.weight, self.A_log, self.dt_bias):
            tensor_parallel.set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)
        self.out_norm = GatedRMSNorm(dims.value_head_dim, config.layernorm_epsilon, dtype, device)
        self.out_proj = submodules.out_proj(
            dims.value_dim, dims.hidden_size, config=config, init_method=config.output_layer_init_method,
            bias=False, input_is_parallel=True, skip_bias_add=True, is_expert=False, tp_comm_buffer_name="fc2",
            tp_group=self.tp_group)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """HF's initialisation of the conv, A_log and dt_bias (conv as torch's Conv1d, dt_bias 1,
        A = exp(A_log) ~ U(0.01, 16)), drawn for the whole layer on the CPU generator, which is
        seeded alike on every TP rank, and cut to this rank's heads: the same values at any TP
        size. The linears are megatron's (config.init_method)."""
        if not self.config.perform_initialization:
            return
        dims, rank = self.dims, self.tp_group.rank() if self.tp_group is not None else 0
        bound = 1.0 / dims.conv_kernel ** 0.5
        whole = {"conv1d.weight": torch.empty(dims.conv_dim, 1, dims.conv_kernel).uniform_(-bound, bound),
                 "A_log": torch.empty(dims.num_value_heads).uniform_(0.01, 16).log_(),
                 "dt_bias": torch.ones(dims.num_value_heads)}
        params = dict(self.named_parameters())
        with torch.no_grad():
            for weight in WEIGHTS:
                if weight.param in whole:
                    params[weight.param].copy_(split_for_tp(whole[weight.param], weight, dims, self.tp)[rank])

    def _use_fla(self, x: Tensor) -> bool:
        if self.kernels == "torch":
            return False
        available = x.is_cuda and fla_kernels() is not None
        if self.kernels == "fla" and not available:
            raise RuntimeError("GatedDeltaNet.kernels 'fla' needs CUDA tensors and the fla-core package: "
                               "pip install -e '.[qwen3.5]'")
        if x.is_cuda and not available:
            warnings.warn("fla-core is not installed: Gated DeltaNet layers run their PyTorch path on the GPU "
                          "(exact, much slower). pip install -e '.[qwen3.5]'", stacklevel=3)
        return available

    def forward(self, hidden_states: Tensor, attention_mask=None, inference_context=None, packed_seq_params=None,
                **_):
        if inference_context is not None:
            raise NotImplementedError("GatedDeltaNet runs training forwards only (no inference cache)")
        projected, _ = self.in_proj(hidden_states)  # [S, B, local in_proj rows]; all rows under SP
        length, batch = projected.shape[:2]
        if packed_seq_params is not None:
            if batch != 1:
                raise ValueError(f"packed rows have batch dimension 1, got {batch}")
            rows, cu_seqlens = projected.squeeze(1), packed_seq_params.cu_seqlens_q
        else:
            rows, cu_seqlens = projected.transpose(0, 1).reshape(length * batch, -1), None
        qkv, z, b, a = rows.split([sum(self.conv_split), *self.in_proj_split[3:]], dim=-1)
        total, dims = rows.shape[0], self.dims
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # fp32, as HF (A may be -inf in fp16)
        core = self._mix(qkv, g, beta, cu_seqlens, None if cu_seqlens is not None else length)
        weight = self.out_norm.weight
        if self.tp > 1:  # each rank normalises its own heads: the weight's gradient is the sum over ranks
            weight = tensor_parallel.copy_to_tensor_model_parallel_region(weight, group=self.tp_group)
        normed = self.out_norm(core, z.reshape(total, self.local_value_heads, dims.value_head_dim), weight)
        normed = normed.reshape(total, -1)
        if packed_seq_params is not None:
            normed = normed[:, None]
        else:
            normed = normed.reshape(batch, length, -1).transpose(0, 1)
        return self.out_proj(normed)

    # A compiled decoder layer (`compile_model`) runs the mixer alone eagerly, between graphs
    # that hold the projections, the gated norm and the rest of the layer: the pack's
    # boundaries come to the host here (`segments_of`), and fla's kernels are their own.
    @torch.compiler.disable
    def _mix(self, qkv: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor | None,
             sequence_length: int | None, conv_weight: Tensor | None = None) -> Tensor:
        """The causal conv and the gated delta rule of rows [T, conv channels] within each
        sample (a pack's `cu_seqlens`, or runs of `sequence_length` rows): [T, value heads, dim].
        `conv_weight` [channels, kernel]: another conv weight than the layer's."""
        total, dims = qkv.shape[0], self.dims
        segments = segments_of(cu_seqlens, total, sequence_length, qkv.device)
        weight = self.conv1d.weight.squeeze(1) if conv_weight is None else conv_weight
        fla = self._use_fla(qkv)
        if fla:
            mixed = self._fla_conv(qkv, weight, segments)
        else:
            mixed = torch_causal_conv1d(qkv, weight, segments)
        q, k, v = mixed.split(self.conv_split, dim=-1)
        q = q.reshape(total, self.local_key_heads, dims.key_head_dim)
        k = k.reshape(total, self.local_key_heads, dims.key_head_dim)
        v = v.reshape(total, self.local_value_heads, dims.value_head_dim)
        if fla:
            return self._fla_rule(q, k, v, g, beta, segments)
        return torch_gated_delta_rule(q, k, v, g, beta, segments)

    def _fla_conv(self, x: Tensor, weight: Tensor, segments: Segments) -> Tensor:
        causal_conv1d, _ = fla_kernels()
        cu, cu_host = segments.cu_seqlens()
        out, _ = causal_conv1d(x=x[None], weight=weight, activation="silu", cu_seqlens=cu, cu_seqlens_cpu=cu_host)
        return out.squeeze(0)  # a view both ways: select's backward would zero-fill and copy

    def _fla_rule(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, segments: Segments) -> Tensor:
        _, chunk_gated_delta_rule = fla_kernels()
        cu, cu_host = segments.cu_seqlens()
        out, _ = chunk_gated_delta_rule(q[None], k[None], v[None], g=g[None], beta=beta[None],
                                        use_qk_l2norm_in_kernel=True, cu_seqlens=cu, cu_seqlens_cpu=cu_host)
        return out.squeeze(0)

    def warm_up_kernels(self) -> None:
        """Compile, before the first step, every variant of fla's kernels that the packs' row
        counts select. Triton compiles a kernel once per kind of integer argument (a multiple of
        16 or not) and fla's causal conv passes the pack's row count unmarked, so the first pack
        of the other kind (say one of exactly 16,384 rows) stalled its step to compile them
        (docs/performance.md, Qwen3.5-2B at HF's memory). Runs the conv and the rule forward and
        backward on small random packs of both kinds; no parameter is touched. Only where fla runs."""
        weight = self.conv1d.weight
        if not self._use_fla(weight):
            return
        channels = sum(self.conv_split)
        with torch.enable_grad():
            for rows in WARM_UP_ROWS:
                qkv = torch.randn(rows, channels, device=weight.device, dtype=weight.dtype, requires_grad=True)
                conv = torch.randn(channels, self.dims.conv_kernel, device=weight.device, dtype=weight.dtype,
                                   requires_grad=True)
                g = -F.softplus(torch.randn(rows, self.local_value_heads, device=weight.device))
                beta = torch.rand(rows, self.local_value_heads, device=weight.device, dtype=weight.dtype)
                cu_seqlens = torch.tensor([0, rows // 2, rows], dtype=torch.int32, device=weight.device)
                self._mix(qkv, g, beta, cu_seqlens, None, conv_weight=conv).float().sum().backward()


# row counts of the warm-up packs: one a multiple of 16, one not (`GatedDeltaNet.warm_up_kernels`)
WARM_UP_ROWS = (128, 131)


def warm_up_linear_attention(model: torch.nn.Module) -> None:
    """`GatedDeltaNet.warm_up_kernels` once per layer shape of `model`."""
    seen = set()
    for module in model.modules():
        if isinstance(module, GatedDeltaNet):
            shape = (tuple(module.conv_split), module.local_value_heads, module.conv1d.weight.dtype)
            if shape not in seen:
                seen.add(shape)
                module.warm_up_kernels()
