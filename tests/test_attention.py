"""`packed_attention` against attention run on each segment alone (the definition of packed
attention), on CPU (masked path) and, on Hopper GPUs, FA2 (`varlen_attn`) against FA4."""

import math

import pytest
import torch

from shards_schema.errors import UserError
from train.config import TrainConfig
from train.model import attention as A


def _segments(rng: torch.Generator, total: int, pieces: int) -> list[int]:
    cuts = torch.randperm(total - 1, generator=rng)[: pieces - 1].add(1).sort().values.tolist()
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


def _per_segment(q, k, v, lens, causal):
    """Reference: each segment through plain SDPA in fp32, GQA by repeating k/v heads."""
    out, start = [], 0
    rep = q.shape[1] // k.shape[1]
    for n in lens:
        s = slice(start, start + n)
        qs, ks, vs = (x[s].float().transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        out.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal).transpose(0, 1))
        start += n
    return torch.cat(out)


def _inputs(lens, hq, hkv, d, device, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, generator=g).to(device, dtype).requires_grad_() for h in (hq, hkv, hkv))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return q, k, v, cu


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("causal,hq,hkv", [(True, 4, 2), (True, 4, 4), (False, 2, 2)])
def test_masked_path_equals_per_segment(seed, causal, hq, hkv):
    g = torch.Generator().manual_seed(seed)
    lens = _segments(g, int(torch.randint(20, 90, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g)))
    q, k, v, cu = _inputs(lens, hq, hkv, 8, "cpu", torch.float32, seed)
    got = A.packed_attention(q, k, v, cu, max(lens), causal=causal)
    torch.testing.assert_close(got, _per_segment(q, k, v, lens, causal), atol=1e-5, rtol=1e-5)


def test_attention_choice_is_checked():
    with pytest.raises(ValueError, match="--attention 'fa3'"):
        TrainConfig.from_flat({"data": ["d"], "arch": "tiny", "attention": "fa3"}).validate()
    with pytest.raises(ValueError, match="choose one of auto, fa2, fa4"):
        A.select_attention_kernel("flash")
    assert A.select_attention_kernel("fa2", {"vision tower": 80}) == ("fa2", [])
    assert A._fa4_attention is None
    assert TrainConfig.from_flat({"data": ["d"], "arch": "tiny"}).model.attention == "auto"


@pytest.mark.parametrize("gpu,capability,fa4_installed,kernel,why", [
    (False, None, True, "fa2", "no CUDA GPU"),
    (True, (8, 0), True, "fa2", "the GPU is sm8x"),
    (True, (9, 0), False, "fa2", "flash-attn-4 is not importable"),
    (True, (9, 0), True, "fa4", None),
    (True, (10, 0), True, "fa4", None),
    (True, (12, 0), True, "fa2", "the GPU is sm12x"),
])
def test_auto_attention_is_fa4_where_it_runs(monkeypatch, gpu, capability, fa4_installed, kernel, why):
    """auto takes FA4 on a Hopper or Blackwell GPU with flash-attn-4 importable, FA2 elsewhere,
    and says why; an explicit fa4 where it cannot run is refused with that reason."""
    import sys
    import types

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    fake = types.ModuleType("train.model.flash_attn4")
    fake.fa4_varlen_attention = lambda *args: None
    # None in sys.modules makes the import fail, as a missing flash_attn.cute does
    monkeypatch.setitem(sys.modules, "train.model.flash_attn4", fake if fa4_installed else None)
    assert A.resolve_attention_kernel("auto") == kernel
    assert A.resolve_attention_kernel("fa2") == "fa2" and A.resolve_attention_kernel("fa4") == "fa4"
    why_now = A.fa4_unavailable()
    assert (why_now is None) if why is None else why_now.startswith(why)
    try:
        assert A.select_attention_kernel("auto", {"language model": 256, "vision tower": 64}) == \
            (kernel, ["language model (head dim 256)"] if kernel == "fa4" else [])
        assert A._fa4_attention is (fake.fa4_varlen_attention if kernel == "fa4" else None)
        if why:
            with pytest.raises(UserError, match=f"--attention fa4 cannot run: {why}"):
                A.select_attention_kernel("fa4")
    finally:
        A.select_attention_kernel("fa2")


def _fa4_available() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10):
        return False
    try:
        import flash_attn.cute  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.gpu
@pytest.mark.skipif(not _fa4_available(), reason="needs a Hopper/Blackwell GPU and the flash-attn-4 package")
@pytest.mark.parametrize("shape", ["qwen3-lm", "qwen3-vision", "qwen2.5-lm", "qwen2.5-vision"])
def test_gpu_fa4_equals_fa2_and_reference(shape):
    """The built-in models' shapes: Qwen3-VL-2B LM (16 q / 8 kv heads of 128, causal) and
    vision (16 heads of 64, bidirectional); Qwen2.5-VL-3B LM (16 / 2 heads of 128) and vision
    (16 heads of 80). FA4 and FA2 are each as close to the fp32 per-segment reference as bf16
    allows (outputs and q/k/v gradients), also inside torch.compile (the custom op's fake).
    Head dim 80 is outside FA4_HEAD_DIMS (FA4's backward is wrong there): under fa4 it must
    still take FA2 and give FA2's results."""
    hq, hkv, d, causal = {"qwen3-lm": (16, 8, 128, True), "qwen3-vision": (16, 16, 64, False),
                          "qwen2.5-lm": (16, 2, 128, True), "qwen2.5-vision": (16, 16, 80, False)}[shape]
    g = torch.Generator().manual_seed(1)
    lens = _segments(g, 6000, 5)
    grad_out = torch.randn(sum(lens), hq, d, generator=g).cuda().bfloat16()
    results, fa4_calls = {}, []
    try:
        for kernel in ("fa2", "fa4", "fa4-compiled"):
            A.select_attention_kernel(kernel.split("-")[0])
            if kernel == "fa4":  # count the calls that reach FA4
                fa4 = A._fa4_attention
                A._fa4_attention = lambda *args: fa4_calls.append(1) or fa4(*args)
            fn = A.packed_attention
            if kernel.endswith("compiled"):
                fn = torch.compile(A.packed_attention, dynamic=True, fullgraph=True)
            q, k, v, cu = _inputs(lens, hq, hkv, d, "cuda", torch.bfloat16, 0)
            out = fn(q, k, v, cu, max(lens), causal=causal, scale=1 / math.sqrt(d))
            out.backward(grad_out)
            results[kernel] = (out.float(), q.grad.float(), k.grad.float(), v.grad.float())
    finally:
        A.select_attention_kernel("fa2")
    q, k, v, cu = _inputs(lens, hq, hkv, d, "cuda", torch.float32, 0)
    ref = _per_segment(q, k, v, lens, causal)
    ref.backward(grad_out.float())
    want = (ref, q.grad, k.grad, v.grad)
    assert len(fa4_calls) == (1 if d in A.FA4_HEAD_DIMS else 0)
    if d not in A.FA4_HEAD_DIMS:  # FA2 under both names (its forward is deterministic)
        assert torch.equal(results["fa4"][0], results["fa2"][0])
    for kernel, got in results.items():
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            err = (a - b).abs().max().item()
            assert err <= 0.02 * b.abs().max().item() + 2e-3, f"{kernel} {shape} {name}: max diff {err:.3e}"
