"""Weight gradients added into megatron's gradient buffers (`main_grad`) from inside a
linear's backward, so that autograd never holds them and megatron's DDP hook, one Python call
and one add kernel per weight, never runs for them (`train.model.linear.use_grad_buffers`).

Custom ops that mutate the buffer: opaque to torch.compile, which keeps them, in order, in
the backward graph of a compiled decoder layer.

FP8's scaled GEMM cannot accumulate into the buffer, so its product is added after it, unless
the buffer holds zeros: then the GEMM writes it and no add follows. The FP8 op takes the
buffer's `holds_zeros` flag, a one-element CPU tensor that the trainer sets after megatron's
`zero_grad_buffer` (`train.model.linear.grad_buffers_zeroed`) and the op clears, so the first
micro-batch's weight gradients are written. The flag is an argument the op mutates, not state
beside it, so it stays right where AOTAutograd runs the op on a copy of its arguments and
copies them back.
"""

from __future__ import annotations

import torch
from torch import Tensor


def zeros_flag() -> Tensor:
    """A buffer's `holds_zeros` flag, unset."""
    return torch.zeros((), dtype=torch.bool)


def _take(holds_zeros: Tensor) -> bool:
    """Whether the buffer still holds zeros; the caller is about to write it, so from now on
    it does not."""
    zeros = bool(holds_zeros)
    holds_zeros.fill_(False)
    return zeros


@torch.library.custom_op("vlmpack::accumulate_weight_grad", mutates_args=("main_grad",))
def accumulate_weight_grad(main_grad: Tensor, grad_output: Tensor, input: Tensor) -> None:
    """main_grad [out, in] += grad_output [T, out]^T @ input [T, in], in place. On CUDA one GEMM
    with beta = 1 (fp32 accumulation, rounded once to the buffer's dtype); elsewhere the
    product, then the add, as megatron's DDP hook does it. (Writing a buffer of zeros with
    beta = 0 instead was measured no faster on the 8B model: docs/benchmarks.md.)"""
    if main_grad.is_cuda:
        torch.addmm(main_grad, grad_output.t(), input, out_dtype=main_grad.dtype, out=main_grad)
    else:
        main_grad.add_(torch.mm(grad_output.t(), input))


@torch.library.custom_op("vlmpack::accumulate_float8_weight_grad", mutates_args=("main_grad", "holds_zeros"))
def accumulate_float8_weight_grad(main_grad: Tensor, holds_zeros: Tensor, grad_output_t: Tensor, grad_scale: Tensor,
                                  input: Tensor, input_scale: Tensor, product_dtype: torch.dtype,
                                  use_fast_accum: bool, emulate: bool) -> None:
    """main_grad [out, in] += grad_output_t [out, T] @ input [T, in], float8 bits with their
    tensorwise scales (`input` column-major), as torchao computes it: its scaled GEMM (emulated
    on CPU) gives the product in `product_dtype`, then megatron's add. FP8's scaled GEMM cannot
    accumulate, but it can write the product into a buffer of zeros, which then needs no add."""
    if emulate:  # torchao's emulated float8 mm
        product = torch.mm(grad_output_t.float() / grad_scale, input.float() / input_scale).to(product_dtype)
    else:  # torchao's `addmm_float8_unwrapped` for tensorwise scales
        gemm = dict(scale_a=grad_scale.reciprocal(), scale_b=input_scale.reciprocal(), out_dtype=product_dtype,
                    use_fast_accum=use_fast_accum)
        if main_grad.dtype == product_dtype and _take(holds_zeros):
            torch._scaled_mm(grad_output_t, input, **gemm, out=main_grad)
            return
        product = torch._scaled_mm(grad_output_t, input, **gemm)
    main_grad.copy_(product) if _take(holds_zeros) else main_grad.add_(product)
