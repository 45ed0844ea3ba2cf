"""`train.model.linear`: the decoder linears add their weight gradient straight into megatron's
gradient buffer (`main_grad`). Oracle: megatron's own linear path plus its DDP hook's add
(`main_grad += weight.grad`), which is what runs without the fused accumulation; on CPU both
compute the same product and add, so they must agree bit for bit."""

from __future__ import annotations

import pytest
import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

from tests.helpers.models import tiny_qwen3_vl
from train.model.arch import ModelArch
from train.model.batch import PackedBatch
from train.model.grad_buffer import accumulate_float8_weight_grad, accumulate_weight_grad, zeros_flag
from train.model.linear import (DecoderLinear, GradBufferLinear, OutputLinear, grad_buffers_zeroed, use_fp8,
                                use_grad_buffers)
from train.model.qwen_vl import compile_model, transformer_config
from train.parallel import build_model


def tiny_model(info, tied: bool | None = None):
    config = tiny_qwen3_vl().config.to_dict()
    if tied is not None:
        config["tie_word_embeddings"] = config["text_config"]["tie_word_embeddings"] = tied
    arch = ModelArch.from_hf_config(config)
    torch.manual_seed(0)
    return arch, build_model(arch, transformer_config(arch, cpu=True), info)


def megatrons_path(layer, weight, x, out_grad, main_grad):
    """Output, input gradient and buffer after megatron's linear (no buffer handed to the
    layer, so `DecoderLinear` hands over to it) and its DDP hook's add."""
    x = x.clone().requires_grad_()
    out = layer(x)[0]
    out.backward(out_grad)
    main_grad.add_(weight.grad)
    weight.grad = None
    return out.detach(), x.grad


def test_decoder_linears_add_the_weight_gradient_into_the_buffer_as_megatrons_hook_does(info):
    """Every decoder linear (column- and row-parallel), random row counts, two micro-batches
    into buffers that already hold a gradient and are views of one flat buffer, as megatron's
    DDP lays them out: the same outputs, input gradients and buffers as megatron's path,
    bitwise; autograd gets no weight gradient."""
    _, model = tiny_model(info)
    layers = [m for m in model.modules() if isinstance(m, DecoderLinear)]
    assert {type(m).__name__ for m in layers} == {"ColumnParallelLinear", "RowParallelLinear"}
    g = torch.Generator().manual_seed(3)
    flat = torch.randn(sum(m.weight.numel() for m in layers), generator=g)
    offsets = torch.tensor([0] + [m.weight.numel() for m in layers]).cumsum(0).tolist()
    for layer, start in zip(layers, offsets):
        layer.weight.main_grad = flat[start:start + layer.weight.numel()].view(layer.weight.shape)
    reference = flat.clone()
    assert use_grad_buffers(model) == len(layers)
    for micro_batch in range(2):
        for case, (layer, start) in enumerate(zip(layers, offsets)):
            weight = layer.weight
            rows = int(torch.randint(1, 200, (1,), generator=g))
            x = torch.randn(rows, 1, weight.shape[1], generator=g) * (case + 1)
            out_grad = torch.randn(rows, 1, weight.shape[0], generator=g)
            buffer, layer.grad_buffer = layer.grad_buffer, None
            want = megatrons_path(layer, weight, x, out_grad, reference[start:start + weight.numel()].view(weight.shape))
            layer.grad_buffer = buffer
            xg = x.clone().requires_grad_()
            out = layer(xg)[0]
            out.backward(out_grad)
            assert weight.grad is None, case
            assert torch.equal(out.detach(), want[0]) and torch.equal(xg.grad, want[1]), (case, micro_batch)
            assert torch.equal(flat, reference), (case, micro_batch, (flat - reference).abs().max())


def test_frozen_decoder_linears_leave_the_buffer_alone(info):
    """A frozen weight (LoRA's base, `--freeze llm`) takes megatron's frozen path even with a
    buffer: no weight gradient anywhere, the input gradient still flows."""
    arch, model = tiny_model(info)
    for param in model.parameters():
        param.main_grad = torch.zeros_like(param)
    layer = next(m for m in model.modules() if isinstance(m, DecoderLinear))
    layer.weight.requires_grad_(False)
    layer.weight.main_grad = torch.zeros(layer.weight.shape)
    assert use_grad_buffers(model) == 4 * arch.lm.num_layers  # and the output layer
    layer.grad_buffer = layer.weight.main_grad  # even handed one, a frozen layer leaves it alone
    x = torch.randn(7, 1, layer.weight.shape[1], requires_grad=True)
    layer(x)[0].sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert layer.weight.grad is None and not layer.weight.main_grad.any()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "own-weight"])
def test_output_layer_adds_every_loss_chunks_weight_gradient_into_the_buffer(info, tied, monkeypatch):
    """The chunked loss over chunks of a few rows (many chunks a pack) under megatron's DDP,
    the output weight tied to the embedding or its own: after two micro-batches its buffer
    equals the plain model's gradient up to the order of the fp32 sums (tied: the embedding's
    gradient too, added by DDP's hook), and autograd never holds a gradient for it, so no [vocabulary,
    hidden] gradient waits beside the next chunk's."""
    from tests.helpers.model_pairs import random_pack

    arch, plain = tiny_model(info, tied)
    _, wrapped = tiny_model(info, tied)
    wrapped.load_state_dict(plain.state_dict())
    output = wrapped.language_model.output_layer
    assert isinstance(output, OutputLinear) and (output.weight is None) == tied
    weight = output.trained_weight()
    assert (weight is wrapped.language_model.embedding.word_embeddings.weight) == tied
    monkeypatch.setattr("train.model.loss.loss_chunk_rows", lambda vocab: 5)
    ddp = DistributedDataParallel(transformer_config(arch, cpu=True),
                                  DistributedDataParallelConfig(grad_reduce_in_fp32=True), wrapped)
    assert use_grad_buffers(ddp) == 4 * arch.lm.num_layers + 1
    seen = []
    weight.register_hook(lambda grad: seen.append(grad is not None))
    for model in (plain, ddp):
        for ids, positions, cu, _, labels in [random_pack(seed) for seed in (6, 7)]:
            model(PackedBatch.from_segments(ids, positions, cu, labels)).sum().backward()
    reference = dict(plain.named_parameters())
    name = next(n for n, p in wrapped.named_parameters() if p is weight)
    # autograd sums a micro-batch's chunk gradients before adding them; the buffer takes them one by one
    want = reference[name].grad
    torch.testing.assert_close(weight.main_grad, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    assert weight.grad is None
    assert sum(seen) == (2 if tied else 0)  # tied: the embedding's own gradient alone, once a micro-batch


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("gemms, zeroed", [("bf16", False), ("fp8-tensorwise", False), ("fp8-tensorwise", True)],
                         ids=["bf16", "fp8-tensorwise", "fp8-tensorwise-written-then-added"])
def test_gradient_buffers_under_megatrons_ddp_hold_the_models_gradients(info, compiled, gemms, zeroed):
    """The tiny model under megatron's DDP, eager or with its decoder layers compiled (dynamo
    and AOTAutograd, as on the GPU), bf16 GEMMs or FP8 tensorwise ones (packs of one aligned
    length, so through `_TensorwiseFloat8Matmul`): after two micro-batches, every parameter's
    buffer equals the sum of its two gradients from the same model without DDP (the decoder
    linears' added inside their backward, the rest through DDP's hook), bitwise. `zeroed`: the
    FP8 linears' buffers are flagged as holding zeros (`grad_buffers_zeroed`) but hold garbage,
    which the first micro-batch's weight gradient must overwrite and the second's add to."""
    from tests.helpers.model_pairs import random_pack

    arch, plain = tiny_model(info)
    _, wrapped = tiny_model(info)
    wrapped.load_state_dict(plain.state_dict())
    fp8 = gemms == "fp8-tensorwise"
    if fp8:
        for model in (plain, wrapped):
            use_fp8(model, "tensorwise", emulate=True, rows=96)
        assert all(m.fp8.transposes_by_tile for m in wrapped.modules() if isinstance(m, DecoderLinear))
    if compiled:
        torch._dynamo.reset()
        compile_model(wrapped, backend="aot_eager")
    ddp = DistributedDataParallel(transformer_config(arch, cpu=True),
                                  DistributedDataParallelConfig(grad_reduce_in_fp32=True), wrapped)
    assert use_grad_buffers(ddp) == 4 * arch.lm.num_layers + 1  # and the output layer
    if zeroed:
        for layer in wrapped.modules():
            if isinstance(layer, DecoderLinear):
                layer.grad_buffer.normal_()
        grad_buffers_zeroed(ddp)
    packs = [random_pack(seed, total=96 if fp8 else None) for seed in (4, 5)]
    for model in (plain, ddp):
        for ids, positions, cu, _, labels in packs:
            model(PackedBatch.from_segments(ids, positions, cu, labels)).sum().backward()
    fused = [m.trained_weight() for m in wrapped.modules() if isinstance(m, GradBufferLinear)]
    assert fused and all(w.grad is None for w in fused)
    names = dict(wrapped.named_parameters())
    output_weight = wrapped.language_model.output_layer.trained_weight()
    for name, param in plain.named_parameters():
        if param.grad is None:
            continue
        if names[name] is output_weight:  # its chunks' gradients summed in another order (test above)
            torch.testing.assert_close(output_weight.main_grad, param.grad, rtol=1e-5,
                                       atol=1e-6 * float(param.grad.abs().max()))
        else:
            assert torch.equal(names[name].main_grad, param.grad), (name, (names[name].main_grad - param.grad).abs().max())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_chunked_loss_backward_holds_no_vocabulary_sized_weight_gradient():
    """bf16 on CUDA, three loss chunks through the output layer: through megatron's path
    autograd keeps the first chunk's [vocabulary, hidden] weight gradient while the next chunk's
    logits and their gradient are made; added into the buffer inside the GEMM, it never exists.
    The backward's peak must be lower by at least nine tenths of one such gradient."""
    from train.model.loss import chunked_cross_entropy, token_loss
    from train.parallel import destroy_parallel, init_parallel

    init_parallel(1, 1, device="cuda")
    try:
        arch = ModelArch.from_hf_config(tiny_qwen3_vl().config.to_dict())
        config = transformer_config(arch, params_dtype=torch.bfloat16, bf16=True)
        vocab, hidden, chunk = 65536, 2048, 1024
        layer = OutputLinear(hidden, vocab, config=config, init_method=config.init_method, bias=False,
                             gather_output=False).cuda()
        layer.weight.main_grad = torch.zeros_like(layer.weight)
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(3 * chunk, 1, hidden, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        labels = torch.randint(0, vocab, (3 * chunk,), device="cuda", generator=g)
        peaks, grads = {}, {}
        for path in ("megatron", "buffer"):
            layer.grad_buffer = None if path == "megatron" else layer.weight.main_grad
            layer.weight.grad = x.grad = None
            layer.weight.main_grad.zero_()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            chunked_cross_entropy(x, labels, layer, None, token_loss, chunk=chunk).sum().backward()
            torch.cuda.synchronize()
            peaks[path] = torch.cuda.max_memory_allocated() - start
            grads[path] = (layer.weight.grad if path == "megatron" else layer.weight.main_grad).float()
        assert layer.weight.grad is None
        assert peaks["megatron"] - peaks["buffer"] >= 0.9 * vocab * hidden * 2, peaks
        error = (grads["buffer"] - grads["megatron"]).norm() / grads["megatron"].norm()
        assert error < 1e-2, error  # bf16 buffer: one rounding a chunk, where autograd sums bf16 products
    finally:
        destroy_parallel()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("buffer_dtype", [torch.float32, torch.bfloat16])
def test_gpu_weight_grad_accumulation_is_as_close_to_exact_as_megatrons_hook(buffer_dtype):
    """On CUDA the accumulation is one GEMM with beta = 1 on the buffer. Against the exact sum
    (fp64) over three micro-batches of bf16 operands, its error is at most the hook's (bf16
    product, then the add), for random shapes of the 2B and 8B decoders' linears."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for out_features, in_features in ((6144, 2048), (2048, 2048), (4096, 12288), (12288, 4096), (24, 40)):
        start = torch.randn(out_features, in_features, device="cuda", generator=g).to(buffer_dtype)
        fused, hook, exact = start.clone(), start.clone(), start.double()
        for _ in range(3):
            rows = int(torch.randint(1, 4096, (1,), generator=g, device="cuda"))
            grad = torch.randn(rows, out_features, device="cuda", generator=g, dtype=torch.bfloat16)
            x = torch.randn(rows, in_features, device="cuda", generator=g, dtype=torch.bfloat16)
            accumulate_weight_grad(fused, grad, x)
            hook.add_(grad.t() @ x)
            exact += grad.double().t() @ x.double()
        errors = [((buffer.double() - exact).norm() / exact.norm()).item() for buffer in (fused, hook)]
        assert errors[0] <= errors[1] * 1.01 + 1e-7, (out_features, in_features, buffer_dtype, errors)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                    reason="needs an FP8 GPU (sm89+)")
def test_gpu_float8_weight_grad_is_torchaos_scaled_gemm_written_or_added():
    """`accumulate_float8_weight_grad` against torchao's scaled GEMM (`addmm_float8_unwrapped`):
    into a bf16 buffer flagged as holding zeros (holding garbage here), the product bit for bit;
    into one that holds a gradient, that gradient plus the product, bit for bit; into an fp32
    buffer, the bf16 product, written or added."""
    from torchao.float8.float8_ops import addmm_float8_unwrapped

    g = torch.Generator(device="cuda").manual_seed(1)
    for out_features, in_features, rows in ((6144, 2048, 16384), (4096, 12288, 8192), (32, 48, 96)):
        for buffer_dtype in (torch.bfloat16, torch.float32):
            grad_bits_t = torch.randn(out_features, rows, device="cuda", generator=g).to(torch.float8_e5m2)
            input_bits = torch.randn(in_features, rows, device="cuda", generator=g).to(torch.float8_e4m3fn).t()
            grad_scale, input_scale = (torch.rand((), device="cuda", generator=g) * 100 + 1 for _ in range(2))
            product = addmm_float8_unwrapped(grad_bits_t, grad_scale, input_bits, input_scale, torch.bfloat16)
            start = torch.randn(out_features, in_features, device="cuda", generator=g).to(buffer_dtype)
            for zeroed in (True, False):
                buffer, holds_zeros = start.clone(), zeros_flag()
                holds_zeros.fill_(zeroed)
                accumulate_float8_weight_grad(buffer, holds_zeros, grad_bits_t, grad_scale, input_bits, input_scale,
                                              torch.bfloat16, False, False)
                want = product.to(buffer_dtype) if zeroed else start + product
                assert not holds_zeros and torch.equal(buffer, want), (out_features, buffer_dtype, zeroed)
