"""Packed (THD) attention without Transformer Engine or Apex.

One function, `packed_attention`, serves the language model (causal, GQA) and the vision
towers (bidirectional, per image or per window). On CUDA it is PyTorch's FlashAttention
varlen kernel (`torch.nn.attention.varlen.varlen_attn`, FA2), or FlashAttention-4 with
`--attention fa4`, or `auto` where it runs (`select_attention_kernel`); elsewhere an exact masked
`scaled_dot_product_attention` over the whole row with a block-diagonal mask built from
`cu_seqlens` (O(T^2) memory: for tests and CPU smoke runs, not for long packs).

`PackedCoreAttention` plugs that function into a megatron-core layer spec in place of
`DotProductAttention`, which cannot take THD packed params, and applies the pack's M-RoPE
(cos/sin carried in `PackedRows`) to q and k first.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from shards_schema.errors import UserError
from train.model.settings import ATTENTION_KERNELS
from train.model.rope import apply_rotary

try:
    from torch.nn.attention.varlen import varlen_attn
    _VARLEN_PARAMS = set(inspect.signature(varlen_attn).parameters)
except ImportError:  # torch without the varlen API: masked path everywhere
    varlen_attn = None
    _VARLEN_PARAMS = set()


# The CUDA kernel behind `packed_attention`: torch's varlen_attn (FA2), or the FA4 function.
_fa4_attention = None
# Head dims FA4 runs; others stay on FA2. Each is checked against FA2 and an fp32 reference on
# a Hopper GPU (tests/test_attention.py). flash-attn-4 4.0.0b36's sm90 backward gives wrong dq at
# head dim 80 (Qwen2.5-VL's vision tower): max error the size of the gradient itself.
FA4_HEAD_DIMS = (64, 128)


def fa4_unavailable() -> str | None:
    """Why FA4 cannot run here (no Hopper or Blackwell GPU, no flash-attn-4), or None."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    major, _ = torch.cuda.get_device_capability()
    if major not in (9, 10):
        return f"the GPU is sm{major}x, FA4 runs on sm90 and sm100"
    try:
        import train.model.flash_attn4  # noqa: F401
    except ImportError as err:
        return f"flash-attn-4 is not importable ({err})"
    return None


def resolve_attention_kernel(kernel: str) -> str:
    """The kernel `kernel` names on this machine: fa2 and fa4 as they are; auto is fa4 where
    it runs (`fa4_unavailable`), else fa2."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"--attention {kernel!r}: choose one of {', '.join(ATTENTION_KERNELS)}")
    if kernel != "auto":
        return kernel
    return "fa2" if fa4_unavailable() else "fa4"


def select_attention_kernel(kernel: str, head_dims: dict[str, int] | None = None) -> tuple[str, list[str]]:
    """auto (`resolve_attention_kernel`): fa4 where it runs, else fa2.
    fa2: torch's built-in FlashAttention-2 `varlen_attn` (nothing to install).
    fa4: FlashAttention-4 (package `flash-attn-4`, CuTe DSL kernels for Hopper and Blackwell),
    through `train.model.flash_attn4`, for head dims in FA4_HEAD_DIMS. Process-wide: call once,
    before the model first runs. Returns the kernel chosen and the parts of `head_dims`
    ({part: head dim}) that keep FA2 under fa4, for the caller to report."""
    global _fa4_attention
    kernel = resolve_attention_kernel(kernel)
    if kernel == "fa2":
        _fa4_attention = None
        return kernel, []
    why = fa4_unavailable()
    if why:
        raise UserError(f"--attention fa4 cannot run: {why}. Use --attention fa2 (or auto), or run on a Hopper "
                        f"or Blackwell GPU with pip install -e '.[fa4]' (with a CUDA 13 torch also "
                        f"'nvidia-cutlass-dsl[cu13]')")
    from train.model.flash_attn4 import fa4_varlen_attention
    _fa4_attention = fa4_varlen_attention
    return kernel, [f"{part} (head dim {dim})" for part, dim in (head_dims or {}).items() if dim not in FA4_HEAD_DIMS]


def _segment_ids(cu_seqlens: Tensor, total: int) -> Tensor:
    """Row r belongs to segment `searchsorted(cu_seqlens, r, right) - 1`; rows at or past the
    last boundary get -1 (they attend to nothing and are never read)."""
    rows = torch.arange(total, device=cu_seqlens.device)
    seg = torch.searchsorted(cu_seqlens.to(rows.dtype), rows, right=True) - 1
    return torch.where(rows < cu_seqlens[-1], seg, torch.full_like(seg, -1))


def _masked_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, causal: bool, scale: float) -> Tensor:
    total, heads, _ = q.shape
    seg = _segment_ids(cu_seqlens, total)
    mask = (seg[:, None] == seg[None, :]) & (seg[:, None] >= 0)
    if causal:
        mask = mask & torch.ones(total, total, dtype=torch.bool, device=q.device).tril()
    # A row that sees nothing (trailing rows past cu_seqlens[-1]) would give NaN: let it see itself.
    mask = mask | torch.eye(total, dtype=torch.bool, device=q.device)
    if k.shape[1] != heads:
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def _varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, causal: bool, scale: float) -> Tensor:
    cu = cu_seqlens.to(torch.int32)
    if _fa4_attention is not None and q.shape[-1] in FA4_HEAD_DIMS:
        return _fa4_attention(q, k, v, cu, max_seqlen, causal, scale)
    kwargs = {"scale": scale}
    if "window_size" in _VARLEN_PARAMS:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        kwargs["is_causal"] = causal
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in _VARLEN_PARAMS:
            kwargs["enable_gqa"] = True
        else:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)


def packed_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, *,
                     causal: bool, scale: float | None = None) -> Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] (Hq divisible by Hkv) -> [T, Hq, D]; each segment
    [cu_seqlens[j], cu_seqlens[j+1]) attends only within itself."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if q.is_cuda and varlen_attn is not None and q.dtype in (torch.float16, torch.bfloat16):
        return _varlen(q, k, v, cu_seqlens, int(max_seqlen), causal, scale)
    return _masked_attention(q, k, v, cu_seqlens, causal, scale)


@dataclass
class PackedRows(PackedSeqParams):
    """megatron's PackedSeqParams plus the pack's rotary table (cos, sin [T, 1, head_dim]):
    megatron hands packed_seq_params to every layer's core attention, through activation
    recompute and on every pipeline stage, so the table is built once per micro-batch."""

    rope_cos: Tensor | None = None
    rope_sin: Tensor | None = None


class PackedCoreAttention(torch.nn.Module):
    """megatron-core `core_attention` submodule for packed rows.

    Megatron's SelfAttention hands over q [T, 1, Hq, D], k/v [T, 1, Hkv, D] (per TP rank)
    and expects [T, 1, Hq*D]. The segment boundaries come in `packed_seq_params`. The model
    passes them with `qkv_format="sbhd"` on purpose (megatron's THD path would re-layout
    q/k/v), and no `rotary_pos_emb`: megatron's rotary path recomputes cos/sin in every layer
    and runs unfused, and its THD variant assumes positions restarting at 0 per segment. The
    pack's M-RoPE table rides in `PackedRows` instead and is applied here to q and k.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type="self", cp_comm_type=None,
                 softmax_scale=None, pg_collection=None, **_):
        super().__init__()
        self.config = config
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.rotary = apply_rotary  # `compile_model` swaps in the fused (compiled) kernel

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_):
        if packed_seq_params is None:
            raise ValueError("PackedCoreAttention needs packed_seq_params (cu_seqlens) for every call")
        t, b = query.shape[:2]
        if b != 1:
            raise ValueError(f"packed rows have batch dimension 1, got {b}")
        q, k = query[:, 0], key[:, 0]
        if getattr(packed_seq_params, "rope_cos", None) is not None:
            q = self.rotary(q, packed_seq_params.rope_cos, packed_seq_params.rope_sin)
            k = self.rotary(k, packed_seq_params.rope_cos, packed_seq_params.rope_sin)
        out = packed_attention(q, k, value[:, 0], packed_seq_params.cu_seqlens_q,
                               packed_seq_params.max_seqlen_q, causal=True, scale=self.softmax_scale)
        return out.reshape(t, 1, -1)
