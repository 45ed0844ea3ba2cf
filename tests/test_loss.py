"""The language model's loss paths (`train.model.loss`) against torch's own cross-entropy of
the full logits: per-token values, input and weight gradients, on random shapes, targets and
chunkings; the fused path's gradients with and without megatron's gradient buffer, and its
check that the loss is summed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from train.model import loss as loss_module
from train.model.loss import (IGNORE_INDEX, LOSS_CHUNK_LOGITS, chunked_cross_entropy, fused_cross_entropy,
                              loss_chunk_rows, token_loss, token_loss_and_grad)


def _case(seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    rows, hidden = int(torch.randint(1, 60, (1,), generator=g)), int(torch.randint(2, 24, (1,), generator=g))
    vocab, chunk = int(torch.randint(2, 400, (1,), generator=g)), int(torch.randint(1, 20, (1,), generator=g))
    h = torch.randn(rows, 1, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[torch.rand(rows, generator=g) < 0.4] = IGNORE_INDEX
    return h, w, labels, chunk


def _reference(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor):
    """Per-token loss and summed-loss gradients from the full fp64 logits."""
    h, w = h.double().requires_grad_(), w.double().requires_grad_()
    loss = F.cross_entropy(h[:, 0] @ w.t(), labels, reduction="none", ignore_index=IGNORE_INDEX)
    loss.sum().backward()
    return loss.detach(), h.grad, w.grad


def _run(path: str, h, w, labels, chunk, rows, main_grad: torch.Tensor | None = None, grad_scale: float = 1.0):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    if main_grad is not None:
        w.main_grad = main_grad
    if path == "fused":
        loss = fused_cross_entropy(h, labels, w, chunk=chunk, rows=rows)
    else:
        loss = chunked_cross_entropy(h, labels, lambda x, weight: (x @ weight.t(), None), w, token_loss,
                                     chunk=chunk, rows=rows)
    (loss.sum() * grad_scale).backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("with_rows", [False, True])
def test_fused_and_chunked_losses_are_cross_entropy_with_its_gradients(seed, with_rows):
    h, w, labels, chunk = _case(seed, torch.float32)
    rows = (labels >= 0).nonzero()[:, 0] if with_rows else None
    want = _reference(h, w, labels)
    for path in ("fused", "chunked"):
        for got, expected, name in zip(_run(path, h, w, labels, chunk, rows), want, ("loss", "hidden grad", "weight grad")):
            torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5, msg=f"{path}: {name}")


@pytest.mark.parametrize("seed", range(4))
def test_fused_weight_gradient_goes_into_the_grad_buffer_and_nowhere_else(seed):
    h, w, labels, chunk = _case(seed, torch.float32)
    before = torch.randn(w.shape, generator=torch.Generator().manual_seed(seed))
    buffer = before.clone()
    loss, grad_h, grad_w = _run("fused", h, w, labels, chunk, None, main_grad=buffer)
    want_loss, want_h, want_w = _reference(h, w, labels)
    assert grad_w is None
    torch.testing.assert_close((buffer - before).double(), want_w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_h.double(), want_h, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_fused_bf16_gradients_are_as_close_to_fp64_as_the_chunked_ones(seed):
    """bf16 logits and gradients: the fused path rounds the weight gradient once (fp32
    accumulation over the chunks), the chunked one once per chunk."""
    h, w, labels, chunk = _case(seed, torch.bfloat16)
    want = _reference(h, w, labels)
    fused, chunked = (_run(path, h, w, labels, chunk, None) for path in ("fused", "chunked"))
    torch.testing.assert_close(fused[0], chunked[0], rtol=0, atol=0)  # the same fp32 loss of the same bf16 logits
    for i, name in ((1, "hidden grad"), (2, "weight grad")):
        error = lambda got: float((got.double() - want[i]).abs().max())  # noqa: E731
        assert error(fused[i]) <= error(chunked[i]) * 1.5 + 1e-3, name


def test_fused_gradients_scale_with_a_uniform_loss_scale():
    h, w, labels, chunk = _case(0, torch.float32)
    _, want_h, want_w = _reference(h, w, labels)
    _, grad_h, grad_w = _run("fused", h, w, labels, chunk, None, grad_scale=4.0)
    torch.testing.assert_close(grad_h.double(), 4 * want_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_w.double(), 4 * want_w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("buffer", [False, True])
def test_fused_loss_refuses_gradients_it_cannot_give(buffer):
    """Its weight gradient is made for a summed loss: target rows weighted unequally, or a
    loss scale other than 1 once the gradient is already in the buffer, stop the backward."""
    h, w, labels, chunk = _case(1, torch.float32)
    labels[:2] = 3
    hw = [h.clone().requires_grad_(), w.clone().requires_grad_()]
    if buffer:
        hw[1].main_grad = torch.zeros(w.shape)
    with pytest.raises(RuntimeError, match="unequal gradients"):
        loss = fused_cross_entropy(*hw[:1], labels, hw[1], chunk=chunk)
        loss.backward(torch.arange(loss.shape[0], dtype=loss.dtype))
    if buffer:
        with pytest.raises(RuntimeError, match="another than 1"):
            (fused_cross_entropy(*hw[:1], labels, hw[1], chunk=chunk).sum() * 2).backward()


@pytest.mark.parametrize("seed", range(2))
def test_token_loss_and_grad_compiled_equals_eager(seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(int(torch.randint(1, 30, (1,), generator=g)), 500, generator=g) * 4).bfloat16()
    target = torch.randint(-1, 500, (logits.shape[0],), generator=g)
    compiled = torch.compile(token_loss_and_grad, dynamic=True, backend="aot_eager")
    for got, want in zip(compiled(logits, target), token_loss_and_grad(logits, target)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("rows", ["none picked", "all ignored"])
@pytest.mark.parametrize("buffer", [False, True])
def test_fused_loss_of_a_pack_without_targets_is_zero_with_zero_gradients(rows, buffer):
    h, w, labels, chunk = _case(2, torch.float32)
    labels[:] = IGNORE_INDEX
    picked = torch.zeros(0, dtype=torch.long) if rows == "none picked" else None
    loss, grad_h, grad_w = _run("fused", h, w, labels, chunk, picked, main_grad=torch.zeros(w.shape) if buffer else None)
    assert torch.equal(loss, torch.zeros(h.shape[0])) and torch.equal(grad_h, torch.zeros_like(h))
    assert grad_w is None if buffer else torch.equal(grad_w, torch.zeros_like(w))


def test_fused_loss_under_a_frozen_output_layer_gives_the_input_gradient_alone():
    """LoRA freezes the output layer: its buffer is left as it was, the input gradient is made."""
    h, w, labels, chunk = _case(3, torch.float32)
    _, want_h, _ = _reference(h, w, labels)
    hidden, weight = h.clone().requires_grad_(), w.clone()
    weight.main_grad = torch.zeros(w.shape)
    fused_cross_entropy(hidden, labels, weight, chunk=chunk).sum().backward()
    assert weight.grad is None and not weight.main_grad.any()
    torch.testing.assert_close(hidden.grad.double(), want_h, rtol=1e-5, atol=1e-5)


def test_the_loss_benchmark_runs_each_path_on_cpu_and_they_agree(tmp_path):
    """`benchmarks/loss_speed.py` on CPU (no timing): the chunked and the fused paths on the same
    rows, several chunks and ignored rows, give the same loss and gradients."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import loss_speed

    report = loss_speed.main(["--device", "cpu", "--rows", "9000", "--hidden", "8", "--vocab", "300", "--ignored",
                              "0.3", "--warmup", "0", "--calls", "1", "--json-out", str(tmp_path / "r.json")])
    assert json.loads((tmp_path / "r.json").read_text())["paths"].keys() == report["paths"].keys() == {"chunked", "fused"}
    for name, row in report["paths"].items():
        assert row["ms"] is None and row["loss"] > 0, name
        for key in ("loss_difference", "grad_hidden_difference", "grad_weight_difference"):
            assert row[key] < 1e-6, (name, key, row[key])


@pytest.mark.parametrize("vocab", [1, 2, 1000, 65_536, 75_968, 151_936, 248_320, 1_048_576, 10_000_000])
def test_loss_chunks_hold_as_many_rows_as_fit_their_bound(vocab):
    """A chunk's rows: a multiple of 256 from 256 to 4096, the most whose logits stay within
    LOSS_CHUNK_LOGITS values (all 4096 for small vocabularies, 256 for huge ones)."""
    rows = loss_chunk_rows(vocab)
    assert rows % 256 == 0 and 256 <= rows <= 4096
    assert rows == 256 or rows * vocab <= LOSS_CHUNK_LOGITS
    assert rows == 4096 or (rows + 256) * vocab > LOSS_CHUNK_LOGITS


def test_loss_chunks_of_the_published_vocabularies():
    assert loss_chunk_rows(151_936) == 1536  # Qwen3-VL, Qwen2.5-VL
    assert loss_chunk_rows(248_320) == 1024  # Qwen3.5, Qwen3.6
    assert loss_chunk_rows(248_320 // 2) == 2048  # its shard at TP = 2


@pytest.mark.parametrize("path", ["fused", "chunked"])
def test_loss_chunks_default_to_the_rows_of_the_output_layers_vocabulary(path, monkeypatch):
    """Without `chunk`, both paths make the logits `loss_chunk_rows(vocabulary)` rows at a time
    (a bound of 256 x 7 logits over a vocabulary of 7: chunks of 256 rows), with the same loss."""
    monkeypatch.setattr(loss_module, "LOSS_CHUNK_LOGITS", 256 * 7)
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(700, 1, 5, generator=g), torch.randn(7, 5, generator=g)
    labels = torch.randint(0, 7, (700,), generator=g)
    made = []
    if path == "fused":
        def loss_and_grad(logits, target):
            made.append(logits.shape[0])
            return token_loss_and_grad(logits, target)
        loss = fused_cross_entropy(h.requires_grad_(), labels, w.requires_grad_(), loss_and_grad)
    else:
        def output_layer(x, weight):
            made.append(x.shape[0])
            return x @ w.t(), None
        output_layer.weight = w
        loss = chunked_cross_entropy(h, labels, output_layer, None, token_loss)
    assert made == [256, 256, 188]
    want = F.cross_entropy(h[:, 0].detach() @ w.detach().t(), labels, reduction="none")
    torch.testing.assert_close(loss.detach(), want)
