"""MLP activations whose outputs compiled graphs recompute in backward instead of keeping.

An MLP's backward needs fc1's output (for the activation's gradient) and the activation's
output (for fc2's weight gradient). torch.compile's partitioner keeps both: it never recomputes a
value that the backward must materialise anyway, since that costs a write. Recomputing the
activation's output from fc1's saves 2 bytes per unit of the MLP's width per token and layer
(Qwen3-VL-2B: 5.25 GiB in the language model per 16k-token pack, about 4 GiB in a trained vision
tower) for one pointwise pass in backward, fused into the kernels that read it there.

Eager layers (no torch.compile, CPU runs) compute the activation as before and keep both.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor


def swiglu(x: Tensor) -> Tensor:
    """silu(gate) * up for fc1's output [..., 2F] holding [gate; up] (megatron's layout, also per TP rank)."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * up


def recomputed_in_backward(fn: Callable[..., Tensor], *inputs: Tensor) -> Tensor:
    """fn(*inputs), marked inside a compiled graph for its backward to recompute rather than keep
    (a selective-checkpoint region: only `inputs` are saved). Elsewhere fn(*inputs) as it is."""
    if torch.compiler.is_compiling() and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(fn, *inputs, use_reentrant=False)
    return fn(*inputs)
