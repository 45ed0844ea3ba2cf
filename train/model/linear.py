"""The language model's decoder linears (qkv and attention output; fc1 and fc2 in dense
layers) and its output layer: megatron's column- and row-parallel layers, with their GEMMs
chosen here.

- `--fp8`: forward, input-gradient and weight-gradient GEMMs in float8 (`train.model.fp8`).
- bf16: megatron's GEMMs, computed here.

Once megatron's DDP has given a trained weight its gradient buffer (`main_grad`) and
`use_grad_buffers` has handed the buffer to the layer, the layer's backward adds the weight
gradient into it and autograd gets none (`train.model.grad_buffer`). In bf16 the
weight-gradient GEMM does the add itself (cuBLAS with beta = 1: fp32 accumulation into an
fp32 buffer, one rounding into a bf16 one), as megatron does with Apex's or Transformer
Engine's fused kernel (`gradient_accumulation_fusion`); FP8's scaled GEMM cannot, so its
product is added after it (tensorwise recipes; the rowwise ones go through torchao's matmul
and megatron's hook). Without this, megatron's DDP hook adds each weight gradient into the
buffer: a Python call and an add kernel per weight and micro-batch, and in bf16 the product
rounded before it is added.

Otherwise megatron's own path runs: frozen weights (LoRA's base, `--freeze llm`), and models
without gradient buffers (conversion, tests that call the model directly).

The tensor-parallel communication around the GEMMs is megatron's: a column-parallel layer
under sequence parallelism gathers its input first (its gradient is reduce-scattered),
otherwise its input gradient is all-reduced; a row-parallel layer's GEMM needs neither (the
reduction follows it). megatron's DDP runs without overlapping the gradient reduction with the
backward (`overlap_grad_reduce=False`), so a weight whose gradient never reaches autograd
misses nothing: its hook only adds the gradient into the buffer.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import tensor_parallel
from torch import Tensor

from train.model.fp8 import INNER_DIM_MULTIPLE, Float8Gemm, float8_gemm, float8_matmul, weight_scales
from train.model.grad_buffer import accumulate_weight_grad, zeros_flag


@torch._dynamo.allow_in_graph
class _MatmulIntoGradBuffer(torch.autograd.Function):
    """input [..., in] @ weight [out, in]^T whose backward adds the weight gradient into
    `grad_buffer` and returns none for the weight."""

    @staticmethod
    def forward(ctx, input: Tensor, weight: Tensor, grad_buffer: Tensor):
        ctx.save_for_backward(input, weight, grad_buffer)
        return torch.matmul(input, weight.t())

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        input, weight, grad_buffer = ctx.saved_tensors
        grad_input = torch.matmul(grad_output, weight)
        accumulate_weight_grad(grad_buffer, grad_output.reshape(-1, grad_output.shape[-1]),
                               input.reshape(-1, input.shape[-1]))
        return grad_input, None, None


class GradBufferLinear:
    """Mixin for megatron's column- and row-parallel linears: runs the GEMMs as the module
    docstring says, and hands megatron's own path the layer's TP group (megatron's
    row-parallel layer passes none and warns at every call, which would split a compiled
    decoder layer into several graphs)."""

    fp8: Float8Gemm | None = None  # set by `use_fp8`
    grad_buffer: Tensor | None = None  # the weight's gradient buffer, set by `use_grad_buffers`
    grad_buffer_holds_zeros: Tensor | None = None  # its flag under tensorwise FP8 (`train.model.grad_buffer`)
    fp8_weight_scale: Tensor | None = None  # set inside `fp8_weight_scales_once`

    def trained_weight(self) -> Tensor | None:
        """The weight whose gradient the layer makes."""
        return self.weight

    def _forward_impl(self, input, weight, bias=None, *, allreduce_dgrad=False, sequence_parallel=False, **kwargs):
        if not weight.requires_grad or (self.fp8 is None and self.grad_buffer is None):
            kwargs["tp_group"] = self.tp_group
            return super()._forward_impl(input, weight, bias, allreduce_dgrad=allreduce_dgrad,
                                         sequence_parallel=sequence_parallel, **kwargs)
        if sequence_parallel:
            input = tensor_parallel.gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True,
                                                                         group=self.tp_group)
        elif allreduce_dgrad:
            input = tensor_parallel.copy_to_tensor_model_parallel_region(input, group=self.tp_group)
        if self.fp8 is not None:
            output = float8_matmul(self.fp8, input, weight, self.grad_buffer, self.grad_buffer_holds_zeros,
                                   self.fp8_weight_scale)
        else:
            output = _MatmulIntoGradBuffer.apply(input, weight, self.grad_buffer)
        return output if bias is None else output + bias


class DecoderLinear(GradBufferLinear):
    """The decoder's linears: those `--fp8` runs in float8."""


class ColumnParallelLinear(DecoderLinear, tensor_parallel.ColumnParallelLinear):
    """megatron's column-parallel linear (qkv, fc1) with `DecoderLinear`'s GEMMs."""


class RowParallelLinear(DecoderLinear, tensor_parallel.RowParallelLinear):
    """megatron's row-parallel linear (attention output, fc2) with `DecoderLinear`'s GEMMs."""


class OutputLinear(GradBufferLinear, tensor_parallel.ColumnParallelLinear):
    """The language model's output layer with `GradBufferLinear`'s bf16 GEMMs (never FP8: it is
    no `DecoderLinear`). megatron's GPTModel builds a plain column-parallel linear;
    `QwenVLModel` gives it this class. Through megatron's path, each chunk of the chunked loss
    hands autograd a [vocabulary, hidden] weight gradient, and autograd holds the first beside
    the next until the DDP hook adds them: 3.8 GiB at once for Qwen3.5-9B's 248,320 x 4,096,
    at the start of the backward, where the step's memory peaks. Added into the buffer inside
    the GEMM, they never exist. `shared_weight`: where the weight is the embedding's (tied),
    the callable that gives it, since the layer then holds none."""

    shared_weight = None

    def trained_weight(self) -> Tensor | None:
        return self.weight if self.shared_weight is None else self.shared_weight()


def use_fp8(model: torch.nn.Module, recipe: str, emulate: bool = False, rows: int | None = None) -> int:
    """Run every `DecoderLinear` of the model with torchao's `recipe`; returns how many.
    `rows`: every input of the linears has this many rows (packs padded to one length). Then
    a linear whose in and out features are multiples of 16 too runs without torchao's pad
    (`float8_gemm`): every inner dim of its three GEMMs is aligned."""
    padded = float8_gemm(recipe, emulate)
    aligned = float8_gemm(recipe, emulate, pad_inner_dim=False) if rows and rows % INNER_DIM_MULTIPLE == 0 else None
    layers = [m for m in model.modules() if isinstance(m, DecoderLinear)]
    for layer in layers:
        fits = aligned is not None and all(d % INNER_DIM_MULTIPLE == 0 for d in layer.weight.shape)
        layer.fp8 = aligned if fits else padded
    return len(layers)


@contextlib.contextmanager
def fp8_weight_scales_once(model: torch.nn.Module):
    """Take the FP8 scale of every tensorwise `DecoderLinear`'s weight once for the forwards and
    backwards inside the block (`train.model.fp8.weight_scales`); torchao takes it at each cast:
    in the forward, again in a recomputed forward, and for the input gradient, at every
    micro-batch. The scales are torchao's, so the casts and GEMMs are too. The weights must not
    change inside the block (the optimizer steps outside it); the scales are dropped when it
    ends, so nothing can read them stale."""
    layers = [m for m in model.modules() if isinstance(m, DecoderLinear) and m.fp8 is not None
              and m.fp8.transposes_by_tile and m.weight.requires_grad]
    by_gemm: dict[int, list[DecoderLinear]] = {}
    for layer in layers:
        by_gemm.setdefault(id(layer.fp8), []).append(layer)
    try:
        with torch.no_grad():
            for group in by_gemm.values():
                for layer, scale in zip(group, weight_scales([layer.weight for layer in group], group[0].fp8)):
                    layer.fp8_weight_scale = scale
        yield
    finally:
        for layer in layers:
            layer.fp8_weight_scale = None


def use_grad_buffers(model: torch.nn.Module) -> int:
    """Let every trained `GradBufferLinear` (the decoder linears and the output layer) add its
    weight gradient into the buffer megatron's DDP gave the weight (`main_grad`); call once,
    after wrapping the model in DDP, and after `use_fp8`. Returns how many.

    The layer gets the buffer as a tensor of its own over the same memory, not DDP's view:
    every view of DDP's flat buffer shares one version counter, which each other parameter's
    add moves on between a layer's forward and its backward, and autograd checks the counter
    of each tensor a compiled layer saves for its backward. The layer's own add moves its
    buffer's counter on too, so a layer must run its backward before its next forward: true
    of one pipeline stage (megatron's schedule without pipelining runs each micro-batch's
    forward, then its backward), not of pipeline schedules, which keep several micro-batches'
    forwards in flight; the trainer calls this only without pipeline parallelism."""
    weights = {m: m.trained_weight() for m in model.modules() if isinstance(m, GradBufferLinear)}
    layers = [m for m, weight in weights.items()
              if weight is not None and weight.requires_grad and hasattr(weight, "main_grad")]
    for layer in layers:
        view = weights[layer].main_grad
        layer.grad_buffer = torch.empty(0, dtype=view.dtype, device=view.device).set_(
            view.untyped_storage(), view.storage_offset(), view.shape, view.stride())
        if layer.fp8 is not None and layer.fp8.transposes_by_tile:
            layer.grad_buffer_holds_zeros = zeros_flag()
    return len(layers)


def grad_buffers_zeroed(model: torch.nn.Module) -> None:
    """Call after megatron's `zero_grad_buffer`: the tensorwise FP8 linears' buffers hold zeros,
    so their next weight gradients are written into them, with no add (`train.model.grad_buffer`)."""
    for layer in model.modules():
        if isinstance(layer, DecoderLinear) and layer.grad_buffer_holds_zeros is not None:
            layer.grad_buffer_holds_zeros.fill_(True)
