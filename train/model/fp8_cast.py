"""A tensor cast to FP8 with one scale and written transposed, for the weight-gradient GEMM.

Hopper's FP8 GEMM (`torch._scaled_mm`) reads its first operand row-major and its second
column-major, so the weight gradient dW = dY^T X needs dY and X transposed, and the input
gradient needs the weight transposed. torchao casts, then copies the bits transposed; in a
compiled decoder layer Inductor fuses that copy into the kernels around it (the recomputed
norm, SwiGLU and their backward), which then read row-major and write transposed, and were the
slowest of the FP8 step's casts. As a custom op the transposed cast stays a kernel of its own:
one Triton program loads a tile, casts it and stores it transposed (Triton stages the tile
through shared memory, so both sides are coalesced). `cast_rows_and_transposed` also stores the
row-major bits from the same load, for the output gradient, which both backward GEMMs read.
The A/B on the 8B model is in docs/benchmarks.md.

The cast is torchao's (`hp_tensor_and_scale_to_float8`): fp32 multiply by the scale, clamp to
the format's largest finite value, round to nearest even. On CPU (tests, emulated FP8) the op
runs those torch ops; its GPU kernel is tested bit for bit against them.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

BLOCK_ROWS, BLOCK_COLS, WARPS = 64, 64, 4  # the tile of the 8B A/B in docs/benchmarks.md


def cast_reference(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    """torchao's tensorwise cast of `x` (fp32 multiply, saturating clamp, round to nearest)."""
    limit = torch.finfo(fp8_dtype).max
    return (x.to(torch.float32) * scale).clamp(-limit, limit).to(fp8_dtype)


@functools.cache
def _triton_kernel():
    """Compiled on first use: triton ships with CUDA builds of torch, not with CPU ones."""
    import triton
    import triton.language as tl

    @triton.jit
    def fp8_cast_transpose_kernel(x_ptr, scale_ptr, rows_ptr, cols_ptr, M, N, limit,
                                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
        m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        mask = (m[:, None] < M) & (n[None, :] < N)
        x = tl.load(x_ptr + m[:, None] * N + n[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.clamp(x * tl.load(scale_ptr), -limit, limit, propagate_nan=tl.PropagateNan.ALL)
        y = y.to(cols_ptr.dtype.element_ty)
        if ROWS:
            tl.store(rows_ptr + m[:, None] * N + n[None, :], y, mask=mask)
        tl.store(cols_ptr + n[None, :] * M + m[:, None], y, mask=mask)

    return fp8_cast_transpose_kernel


def _cast(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, rows: bool) -> tuple[Tensor | None, Tensor]:
    """The row-major bits (if `rows`) and the transposed ones."""
    if x.dim() != 2:
        raise ValueError(f"fp8 cast-transpose takes a matrix, got shape {tuple(x.shape)}")
    if x.device.type != "cuda" or x.numel() == 0:  # CPU, or nothing to launch a kernel for
        bits = cast_reference(x, scale, fp8_dtype)
        # clone: with one row or column, .t() is already contiguous and would alias `bits`
        return (bits if rows else None), bits.t().clone(memory_format=torch.contiguous_format)
    x = x.contiguous()
    M, N = x.shape
    cols = torch.empty(N, M, device=x.device, dtype=fp8_dtype)
    row_bits = torch.empty_like(x, dtype=fp8_dtype) if rows else cols
    grid = (-(-M // BLOCK_ROWS), -(-N // BLOCK_COLS))
    _triton_kernel()[grid](x, scale, row_bits, cols, M, N, torch.finfo(fp8_dtype).max,
                           BLOCK_M=BLOCK_ROWS, BLOCK_N=BLOCK_COLS, ROWS=rows, num_warps=WARPS)
    return (row_bits if rows else None), cols


@torch.library.custom_op("vlmpack::fp8_cast_transposed", mutates_args=())
def cast_transposed(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    """`x` [M, N] cast to `fp8_dtype` with the one-element fp32 `scale`, as [N, M] contiguous
    bits (x^T row-major, which is x column-major)."""
    return _cast(x, scale, fp8_dtype, rows=False)[1]


@cast_transposed.register_fake
def _(x, scale, fp8_dtype):
    return x.new_empty((x.shape[1], x.shape[0]), dtype=fp8_dtype)


@torch.library.custom_op("vlmpack::fp8_cast_rows_and_transposed", mutates_args=())
def cast_rows_and_transposed(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """`cast_transposed`, and the same bits row-major [M, N], from one read of `x`."""
    return _cast(x, scale, fp8_dtype, rows=True)


@cast_rows_and_transposed.register_fake
def _(x, scale, fp8_dtype):
    return x.new_empty(x.shape, dtype=fp8_dtype), x.new_empty((x.shape[1], x.shape[0]), dtype=fp8_dtype)
