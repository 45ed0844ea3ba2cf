"""MLP activations whose outputs compiled graphs recompute in backward instead of keeping.

An MLP's backward needs fc1's output (for the activation's gradient) and the activation's
output (for fc2's weight gradient). torch.compile's partitioner keeps both: it never recomputes a
value that the backward must materialise anyway, since that costs a write. Recomputing the
activation's output from fc1's saves at least 2 bytes per unit of the MLP's width per token and
layer for one pointwise pass in backward. Measured on Qwen3-VL-2B, one H200, 2 x 16k packs, no
recompute: the peak 103.4 against 91.8 GiB, tokens/s 1.6 % lower (docs/performance.md).

Eager layers (no torch.compile, CPU runs) compute the activation as before and keep both, as do
compiled ones under `--recompute-mlp-activations false`.
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


class RecomputedActivation:
    """An MLP whose activation's output compiled graphs recompute in backward, unless
    `recompute_output` is set false (`--recompute-mlp-activations false`; `compile_model` sets it)."""

    recompute_output = True

    @property
    def recomputes_output(self) -> bool:
        """Whether this call's activation is recomputed: a compiled graph that builds a backward."""
        return self.recompute_output and torch.compiler.is_compiling() and torch.is_grad_enabled()

    def activation(self, fn: Callable[..., Tensor], *inputs: Tensor) -> Tensor:
        """fn(*inputs); where `recomputes_output`, a selective-checkpoint region, so that only
        `inputs` are saved and the backward recomputes the rest."""
        if self.recomputes_output:
            return torch.utils.checkpoint.checkpoint(fn, *inputs, use_reentrant=False)
        return fn(*inputs)
