"""Weight gradients added into megatron's gradient buffers (`main_grad`) from inside a
linear's backward, so that autograd never holds them and megatron's DDP hook, one Python call
and one add kernel per weight, never runs for them (`train.model.linear.use_grad_buffers`).

Custom ops that mutate the buffer: opaque to torch.compile, which keeps them, in order, in
the backward graph of a compiled decoder layer."""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("vlmpack::accumulate_weight_grad", mutates_args=("main_grad",))
def accumulate_weight_grad(main_grad: Tensor, grad_output: Tensor, input: Tensor) -> None:
    """main_grad [out, in] += grad_output [T, out]^T @ input [T, in], in place. On CUDA one GEMM
    with beta = 1 (fp32 accumulation, rounded once to the buffer's dtype); elsewhere the
    product, then the add, as megatron's DDP hook does it."""
    if main_grad.is_cuda:
        torch.addmm(main_grad, grad_output.t(), input, out_dtype=main_grad.dtype, out=main_grad)
    else:
        main_grad.add_(torch.mm(grad_output.t(), input))


@torch.library.custom_op("vlmpack::add_weight_grad", mutates_args=("main_grad",))
def add_weight_grad(main_grad: Tensor, grad_weight: Tensor) -> None:
    """main_grad += grad_weight, in place: the add megatron's DDP hook makes, for a weight
    gradient that a GEMM cannot accumulate itself (FP8's scaled GEMM)."""
    main_grad.add_(grad_weight)
