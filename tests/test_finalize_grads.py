"""`train.parallel.finalize_grads`: megatron's `finalize_model_grads` with the division by the
global batch's target-token count done with a host float. Oracle: megatron's own function,
from the same gradient buffers. (Multi-process runs of the trainer, in tests/test_train.py,
reduce the count over the data-parallel ranks through it.)"""

from __future__ import annotations

import pytest
import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

from train.model.arch import builtin_arch
from train.model.qwen_vl import transformer_config
from train.parallel import build_model, destroy_parallel, finalize_grads, init_parallel


def finalized(model, fn, grads: list[torch.Tensor], tokens: int) -> list[torch.Tensor]:
    for buffer, values in zip(model.buffers, grads):
        buffer.grad_data.copy_(values)
    fn([model], num_tokens=torch.tensor(tokens, dtype=torch.int, device=grads[0].device))
    return [buffer.grad_data.clone() for buffer in model.buffers]


def ddp_model(device: str, grad_reduce_in_fp32: bool, distributed: bool):
    """The tiny model under megatron DDP: fp32 weights on CPU, bf16 on a GPU (the trainer's)."""
    arch = builtin_arch("tiny")
    config = transformer_config(arch, cpu=True) if device == "cpu" else transformer_config(
        arch, params_dtype=torch.bfloat16, bf16=True)
    info = init_parallel(1, 1, device=device)
    return DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32, use_distributed_optimizer=distributed), build_model(arch, config, info))


def test_finalize_grads_divides_by_the_token_count_as_megatron_does():
    """fp32 gradients (CPU): the same values as megatron's to within one rounding of the
    reciprocal, for many counts; a count of zero leaves the gradients as they were."""
    model = ddp_model("cpu", grad_reduce_in_fp32=True, distributed=False)
    try:
        g = torch.Generator().manual_seed(0)
        for case in range(12):
            grads = [torch.randn(b.grad_data.shape, generator=g) * 10.0 ** int(torch.randint(-6, 3, (1,), generator=g))
                     for b in model.buffers]
            tokens = 0 if case == 0 else int(torch.randint(1, 1 << 20, (1,), generator=g))
            ours = finalized(model, finalize_grads, grads, tokens)
            theirs = finalized(model, finalize_model_grads, grads, tokens)
            for a, b, before in zip(ours, theirs, grads):
                torch.testing.assert_close(a, b, rtol=2 ** -23, atol=0, msg=f"{tokens} tokens")
                if tokens == 0:
                    assert torch.equal(a, before)
                else:
                    assert not torch.equal(a, before)
    finally:
        destroy_parallel()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("grad_dtype", ["bf16", "fp32"])
def test_gpu_finalize_grads_matches_megatron_on_the_gradient_buffer(grad_dtype):
    """The trainer's GPU setting (bf16 weights, the distributed optimizer's buffers): fp32
    gradients as megatron's to within one rounding of the reciprocal; bf16 ones within one
    bf16 rounding step of megatron's (its kernel rounds differently), and within one of the
    exact quotient."""
    model = ddp_model("cuda", grad_reduce_in_fp32=grad_dtype == "fp32", distributed=True)
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        for tokens in (1, 3, 16303, 999_983):
            grads = [torch.randn(b.grad_data.shape, generator=g, device="cuda").to(b.grad_data.dtype)
                     for b in model.buffers]
            ours = finalized(model, finalize_grads, grads, tokens)
            theirs = finalized(model, finalize_model_grads, grads, tokens)
            exact = [(values.double() / tokens) for values in grads]
            for a, b, want in zip(ours, theirs, exact):
                eps = torch.finfo(a.dtype).eps
                torch.testing.assert_close(a.double(), b.double(), rtol=2 * eps if grad_dtype == "bf16" else 2 ** -23,
                                           atol=0, msg=f"{tokens} tokens")
                # ours is one rounding of the exact quotient
                assert ((a.double() - want).abs() <= want.abs() * 2 * eps).all(), tokens
    finally:
        destroy_parallel()
