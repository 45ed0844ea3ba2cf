"""FlashAttention-4 for packed rows (`--attention fa4`): the `flash-attn-4` package's CuTe DSL
kernels for Hopper and Blackwell, as a torch custom op.

A custom op (forward and backward registered with torch.library) is opaque to torch.compile,
so the compiled vision blocks keep one graph around it, as they do around `varlen_attn`.
torch's own route to FA4 (`torch.nn.attention.activate_flash_attention_impl("FA4")`) is not
used: in torch 2.11 it refuses the backward of causal attention written as a window, which is
how `varlen_attn` writes it, and it unpacks two values from the kernel's forward where the 4.0
betas return five. Imported when `--attention fa4` is chosen, or `auto` looks for it.
"""

from __future__ import annotations

import torch
from flash_attn.cute import interface as _fa4
from torch import Tensor


@torch.library.custom_op("vlmpack::fa4_varlen_fwd", mutates_args=())
def _fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float,
         causal: bool) -> tuple[Tensor, Tensor]:
    out, lse = _fa4._flash_attn_fwd(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                    max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, softmax_scale=scale,
                                    causal=causal, return_lse=True)[:2]
    return out, lse


@_fwd.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale, causal):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("vlmpack::fa4_varlen_bwd", mutates_args=())
def _bwd(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor,
         max_seqlen: int, scale: float, causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = _fa4._flash_attn_bwd(q, k, v, out, grad_out, lse, scale, causal, cu_seqlens_q=cu_seqlens,
                                      cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
                                      max_seqlen_k=max_seqlen)[:3]
    return dq, dk, dv


@_bwd.register_fake
def _(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, scale, causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, scale, causal = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_seqlens)
    ctx.max_seqlen, ctx.scale, ctx.causal = max_seqlen, scale, causal


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = _bwd(grad_out.contiguous(), q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.scale, ctx.causal)
    return dq, dk, dv, None, None, None, None


_fwd.register_autograd(_backward, setup_context=_setup_context)


def fa4_varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, causal: bool,
                         scale: float) -> Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] (GQA native), cu_seqlens int32 -> [T, Hq, D]."""
    return _fwd(q, k, v, cu_seqlens, max_seqlen, scale, causal)[0]
