"""The language model's loss: per-token cross-entropy of the target rows through the output
layer, never a full fp32 logit matrix.

Two ways through the output layer (`--loss`):

- `chunked` (`chunked_cross_entropy`, every layout): logits `loss_chunk_rows` rows at a
  time, each chunk checkpointed, so its backward recomputes the logits GEMM and the softmax.
- `fused` (`fused_cross_entropy`, TP = 1): each chunk's loss and its gradient with respect to
  the logits in one pass of the forward, then the input and weight gradients at once, as
  Liger's fused linear cross-entropy does; the backward only scales what the forward kept.
  It saves the recomputed logits GEMM and one pass over the chunk's logits, and holds the
  input gradient [rows, hidden] from the forward to the backward. The weight gradient goes
  straight into megatron's gradient buffer (`main_grad`) where the weight has one, so no
  vocab x hidden gradient is ever held beside it.
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from train.model.grad_buffer import accumulate_weight_grad

IGNORE_INDEX = -100
LOSS_CHUNK_LOGITS = 2**28  # logit values of one chunk (rows x vocabulary / TP), bf16; fp32 only inside CE
LOSS_CHUNK_MAX_ROWS = 4096
LOSS_CHUNK_ROW_MULTIPLE = 256


def loss_chunk_rows(vocab: int) -> int:
    """Rows of logits made at once over a vocabulary (or its TP shard) of `vocab` entries: as
    many as keep a chunk within LOSS_CHUNK_LOGITS values, a multiple of 256, at most 4096. A
    chunk's backward holds its logits and their gradient, both bf16: 1 GiB at the bound, where
    4096 rows of Qwen3.5's 248,320 entries would hold 3.8 GiB. Qwen3-VL's 151,936 take 1,536
    rows, Qwen3.5's 1,024; rows of 1,024 x 248,320 logits still make GEMMs of 0.5-2 TFLOP."""
    rows = LOSS_CHUNK_LOGITS // max(vocab, 1) // LOSS_CHUNK_ROW_MULTIPLE * LOSS_CHUNK_ROW_MULTIPLE
    return max(LOSS_CHUNK_ROW_MULTIPLE, min(LOSS_CHUNK_MAX_ROWS, rows))


def vocab_parallel_token_loss(logits: Tensor, target: Tensor) -> Tensor:
    """Per-token CE [N] (fp32) from logits [N, 1, V/TP] whose vocabulary is split over the TP ranks."""
    return tensor_parallel.vocab_parallel_cross_entropy(logits.float(), target[:, None])[:, 0]


def token_loss(logits: Tensor, target: Tensor) -> Tensor:
    """Per-token CE [N] (fp32) from logits [N, 1, V] holding the whole vocabulary (TP = 1):
    logsumexp minus the target's logit. Plain torch: `compile_model` fuses the upcast,
    max, exp-sum and the target's pick into a few passes over the bf16 logits, and the backward
    into one (eager, megatron's vocab-parallel CE makes a dozen fp32 passes over 4k x 151,936
    values). The target's logit is picked by a mask, not `gather`: the mask's backward is
    pointwise, where gather's scatters into a zeroed fp32 [N, V] buffer and reads it back."""
    logits = logits[:, 0].float()
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    picked = torch.where(vocab == target[:, None], logits, 0.0).sum(-1)
    return torch.logsumexp(logits, dim=-1) - picked


def token_loss_and_grad(logits: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token CE [N] (fp32) from logits [N, V] (TP = 1), and its gradient with respect to
    the logits (softmax minus the target's one-hot, in the logits' dtype); both 0 in rows
    whose target is negative. `compile_model` fuses it into two passes over the logits."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    onehot = torch.arange(x.shape[-1], device=x.device) == target[:, None]
    kept = target >= 0
    loss = torch.where(kept, lse - torch.where(onehot, x, 0.0).sum(-1), 0.0)
    grad = torch.where(kept[:, None], torch.exp(x - lse[:, None]) - onehot.float(), 0.0)
    return loss, grad.to(logits.dtype)


def chunked_cross_entropy(hidden: Tensor, labels: Tensor, output_layer, weight: Tensor | None,
                          loss_fn=vocab_parallel_token_loss, chunk: int | None = None,
                          rows: Tensor | None = None) -> Tensor:
    """Per-token CE [T] (0 where labels == -100) from final hidden states [T, 1, H].

    Logits are made `chunk` rows at a time (default `loss_chunk_rows` of the output layer's
    vocabulary) in the model dtype, upcast to fp32 inside `loss_fn`, and recomputed in
    backward (checkpoint), so at most one chunk of logits exists at a time instead of
    T x vocabulary fp32 values. `rows` (the rows with a target, found on the
    host): only those go through the output layer. In SFT data most rows are prompt, image or
    padding rows, whose logits would be computed only to be multiplied by zero."""
    def chunk_loss(h: Tensor, y: Tensor) -> Tensor:
        logits, _ = output_layer(h, weight=weight)
        loss = loss_fn(logits, y.clamp(min=0))
        return torch.where(y >= 0, loss, torch.zeros_like(loss))

    total = hidden.shape[0]
    if rows is not None:
        hidden, labels = hidden[rows], labels[rows]
    chunk = chunk or loss_chunk_rows((output_layer.weight if weight is None else weight).shape[0])
    pieces = []
    for start in range(0, hidden.shape[0], chunk):
        h, y = hidden[start:start + chunk], labels[start:start + chunk]
        pieces.append(checkpoint(chunk_loss, h, y, use_reentrant=False) if torch.is_grad_enabled()
                      else chunk_loss(h, y))
    loss = torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)
    return _scattered(loss, total, rows)


def _scattered(loss: Tensor, total: int, rows: Tensor | None) -> Tensor:
    """The per-row losses of the picked `rows` as a per-token loss [total], 0 elsewhere."""
    return loss if rows is None else loss.new_zeros(total).index_copy(0, rows, loss)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Per-token CE [N] of hidden [N, H] through `weight` [V, H], its gradients made in the
    forward. The weight gradient assumes every target row's loss gets the same gradient, as
    a summed loss gives it (the trainer's, scaled by megatron's loss scale): the backward
    checks that on the device. Added into `grad_buffer` in the forward, it must be 1 there."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, target: Tensor, grad_buffer: Tensor | None,
                loss_and_grad, chunk: int):
        wants_hidden, wants_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if wants_hidden else None
        grad_weight = None
        if wants_weight and grad_buffer is None:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        pieces = []
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start:start + chunk], target[start:start + chunk]
            loss, grad_logits = loss_and_grad(torch.matmul(h, weight.t()), y)
            pieces.append(loss)
            if grad_hidden is not None:
                torch.matmul(grad_logits, weight, out=grad_hidden[start:start + chunk])
            if wants_weight:
                accumulate_weight_grad(grad_buffer if grad_buffer is not None else grad_weight, grad_logits, h)
        ctx.save_for_backward(grad_hidden, grad_weight, target)
        ctx.weight_dtype, ctx.into_buffer = weight.dtype, wants_weight and grad_buffer is not None
        return torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        grad_hidden, grad_weight, target = ctx.saved_tensors
        if target.numel() and (grad_weight is not None or ctx.into_buffer):
            targets = target >= 0
            scale = grad_loss[targets.int().argmax()]  # the first target row's (any row's, if none)
            same = torch.where(targets, grad_loss == scale, True).all()
            if ctx.into_buffer:
                same &= (scale == 1) | ~targets.any()
            torch._assert_async(same, "fused cross-entropy: the target rows' losses got unequal gradients, or "
                                      "another than 1 where their weight gradient went into its buffer")
            grad_weight = None if grad_weight is None else grad_weight * scale
        if grad_weight is not None:
            grad_weight = grad_weight.to(ctx.weight_dtype)
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_loss[:, None].to(grad_hidden.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def fused_cross_entropy(hidden: Tensor, labels: Tensor, weight: Tensor, loss_and_grad=token_loss_and_grad,
                        chunk: int | None = None, rows: Tensor | None = None) -> Tensor:
    """`chunked_cross_entropy`'s per-token CE [T] with its gradients made in the forward
    (module docstring), for an output layer that holds the whole vocabulary (TP = 1):
    hidden [T, 1, H] through `weight` [V, H]. For training: without gradients to make, the
    chunked loss alone is cheaper."""
    assert torch.is_grad_enabled(), "fused_cross_entropy makes gradients: use chunked_cross_entropy without them"
    total = hidden.shape[0]
    hidden = hidden[:, 0]
    if rows is not None:
        hidden, labels = hidden[rows], labels[rows]
    chunk = chunk or loss_chunk_rows(weight.shape[0])
    grad_buffer = getattr(weight, "main_grad", None) if weight.requires_grad else None
    return _scattered(_FusedLinearCrossEntropy.apply(hidden, weight, labels, grad_buffer, loss_and_grad, chunk),
                      total, rows)
