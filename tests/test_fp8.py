"""`--fp8`: the decoder's linears compute what torchao's own float8 `nn.Linear` computes, the
model stays close to its bf16/fp32 self, and the trainer takes the flag (CPU: torchao's
emulated float8; the GPU test runs `torch._scaled_mm`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import nn
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from tests.helpers.model_pairs import loss_and_grads, models, random_pack
from tests.helpers.models import tiny_qwen3_vl, tiny_qwen3_vl_moe
from tests.helpers.train import BASE, metrics, ok, run_train
from train.config import FP8_RECIPES
from train.model.arch import ModelArch
from train.model import fp8_cast
from train.model.fp8 import float8_gemm
from train.model.linear import DecoderLinear, fp8_weight_scales_once, use_fp8, use_grad_buffers
from train.model.qwen_vl import compile_model, transformer_config
from train.parallel import build_model, destroy_parallel, init_parallel


def torchao_linear(weight: torch.Tensor, recipe: str, emulate: bool) -> nn.Module:
    """torchao's float8 training `nn.Linear` (its public module swap) holding `weight`."""
    from torchao.float8 import convert_to_float8_training

    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    linear.weight.data.copy_(weight)
    return convert_to_float8_training(nn.Sequential(linear), config=float8_gemm(recipe, emulate).config)[0]


def output_and_grads(fn, weight: torch.Tensor, x: torch.Tensor, out_grad: torch.Tensor):
    """`fn(x)` and, after backward of `out_grad`, the input's and `weight`'s gradients."""
    x = x.clone().requires_grad_()
    weight.grad = None
    out = fn(x)
    out.backward(out_grad)
    return out.detach(), x.grad, weight.grad.clone()


def check_against_torchao(model, recipe: str, emulate: bool, seeds=range(4)):
    """Every float8 linear of `model` against torchao's own on random inputs: outputs, input
    and weight gradients bitwise equal."""
    layers = [m for m in model.modules() if isinstance(m, DecoderLinear)]
    for seed, layer in zip(seeds, layers * len(seeds)):
        g = torch.Generator(device=layer.weight.device).manual_seed(seed)
        rows = int(torch.randint(17, 300, (1,)))  # not a multiple of 16: the padded inner dim
        x = torch.randn(rows, 1, layer.weight.shape[1], generator=g, device=layer.weight.device,
                        dtype=layer.weight.dtype) * (seed + 1)
        out_grad = torch.randn(rows, 1, layer.weight.shape[0], generator=g, device=x.device, dtype=x.dtype)
        reference = torchao_linear(layer.weight.detach(), recipe, emulate)
        results = [output_and_grads(fn, weight, x, out_grad)
                   for fn, weight in ((lambda t: layer(t)[0], layer.weight), (reference, reference.weight))]
        for what, ours, theirs in zip(("output", "input grad", "weight grad"), *results):
            assert torch.equal(ours, theirs), (recipe, seed, what, (ours - theirs).abs().max())


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_fp8_linears_compute_what_torchaos_float8_linear_computes(info, recipe):
    arch = ModelArch.from_hf_config(tiny_qwen3_vl().config.to_dict())
    model = build_model(arch, transformer_config(arch, cpu=True), info)
    assert use_fp8(model, recipe, emulate=True) == 4 * arch.lm.num_layers  # qkv, proj, fc1, fc2
    check_against_torchao(model, recipe, emulate=True)


def test_tensorwise_amax_taken_rows_first_equals_one_reduction_over_the_tensor():
    """The rows-first amax that `float8_gemm` installs in torchao gives exactly torchao's
    whole-tensor amax (infinities, NaNs and zeros included); axiswise amaxes pass through."""
    from torchao.float8 import float8_utils

    float8_gemm("tensorwise", emulate=True)
    patched = float8_utils.tensor_to_amax
    assert getattr(patched, "rows_first", False)
    float8_gemm("rowwise", emulate=True)
    assert float8_utils.tensor_to_amax is patched  # installed once
    g = torch.Generator().manual_seed(0)
    for case in range(40):
        rows, width = (int(n) for n in torch.randint(1, 70, (2,), generator=g))
        shape = [(rows,), (rows, 1, width), (rows, width)][case % 3]  # megatron's linears take [s, b, h]
        x = torch.randn(shape, generator=g) * float(torch.rand((), generator=g) * 1e3)
        x = x.to([torch.float32, torch.bfloat16][case % 2])
        special = case % 5
        if special and x.numel() > 1:
            flat = x.view(-1)
            flat[int(torch.randint(0, flat.numel(), (1,), generator=g))] = [0, float("inf"), -float("inf"), float("nan"),
                                                                           -1e30][special]
        if case % 7 == 0:
            x.zero_()
        ours, theirs = patched(x), torch.max(torch.abs(x))
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (case, shape)
        assert torch.equal(ours, theirs) or (ours.isnan() and theirs.isnan()), (case, shape, ours, theirs)
        if x.dim() >= 2:
            axiswise = patched(x, scaling_granularity=float8_utils.ScalingGranularity.AXISWISE, axiswise_dim=0)
            assert torch.equal(axiswise.nan_to_num(), torch.amax(torch.abs(x), dim=0, keepdim=True).nan_to_num())


def check_cast_transposed_against_torchao(device: str, cases: int = 24):
    """`train.model.fp8_cast`'s ops give torchao's tensorwise cast bit for bit, transposed (and
    row-major): random shapes off the kernel's tile, both formats, scales that saturate, and
    zeros, infinities and NaNs among the values."""
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import tensor_to_scale

    g = torch.Generator().manual_seed(11)
    edges = [(1, 37), (37, 1), (1, 1)]  # one row or column: the transposed bits are laid out as the input's
    for case in range(cases + len(edges)):
        rows, cols = edges[case - cases] if case >= cases else (int(n) for n in torch.randint(1, 300, (2,), generator=g))
        dtype = (torch.float8_e4m3fn, torch.float8_e5m2)[case % 2]
        x = (torch.randn(rows, cols, generator=g) * float(torch.rand((), generator=g) * 100)).to(torch.bfloat16)
        if case % 3 == 1:
            x.view(-1)[torch.randint(0, x.numel(), (3,), generator=g)] = torch.tensor([0.0, float("inf"), float("nan")],
                                                                                      dtype=x.dtype)
        x = x.to(device)
        scale = tensor_to_scale(x.float().nan_to_num(0, 0, 0), dtype) * (1 if case % 4 else 8)  # x8: some saturate
        want = hp_tensor_and_scale_to_float8(x, scale, dtype)._data
        transposed = fp8_cast.cast_transposed(x, scale, dtype)
        row_bits, both_transposed = fp8_cast.cast_rows_and_transposed(x, scale, dtype)
        for got, reference in ((transposed, want.t()), (both_transposed, want.t()), (row_bits, want)):
            assert got.dtype == dtype and got.is_contiguous() and got.shape == reference.shape, case
            same_bits = torch.equal(got.view(torch.uint8), reference.contiguous().view(torch.uint8))
            assert same_bits, (case, rows, cols, dtype)


def test_cast_transposed_gives_torchaos_cast_bits_transposed():
    check_cast_transposed_against_torchao("cpu")


def check_aligned_linears_skip_the_pad(model, recipe: str, emulate: bool):
    """`use_fp8(rows=...)`: packs of one row count. A linear whose rows and features are all
    multiples of 16 runs without torchao's inner-dim pad (under `tensorwise` through our own
    matmul, whose backward casts run through `train.model.fp8_cast`), and gives bitwise the
    padded path's output and gradients (torchao's matmul); one with a feature or the row count
    off that multiple keeps the pad."""
    layers = [m for m in model.modules() if isinstance(m, DecoderLinear)]
    device, dtype = layers[0].weight.device, layers[0].weight.dtype
    g = torch.Generator().manual_seed(3)
    for rows in (16 * int(torch.randint(1, 20, (1,), generator=g)) for _ in range(3)):
        use_fp8(model, recipe, emulate=emulate, rows=rows)
        aligned = [layer for layer in layers if not layer.fp8.config.pad_inner_dim]
        assert all(layer.fp8.transposes_by_tile == (recipe == "tensorwise") for layer in aligned)
        assert {id(layer) for layer in aligned} == {id(layer) for layer in layers
                                                   if layer.weight.shape[0] % 16 == layer.weight.shape[1] % 16 == 0}
        assert 0 < len(aligned) < len(layers)
        padded = float8_gemm(recipe, emulate=emulate)
        for seed, layer in enumerate(aligned):
            x = (torch.randn(rows, 1, layer.weight.shape[1], generator=g) * (seed + 1)).to(device, dtype)
            out_grad = torch.randn(rows, 1, layer.weight.shape[0], generator=g).to(device, dtype)
            results = []
            for gemm in (layer.fp8, padded):
                layer.fp8 = gemm
                results.append(output_and_grads(lambda t: layer(t)[0], layer.weight, x, out_grad))
            for what, a, b in zip(("output", "input grad", "weight grad"), *results):
                assert torch.equal(a, b), (recipe, rows, seed, what)
    use_fp8(model, recipe, emulate=emulate, rows=16 * 7 + 5)
    assert all(layer.fp8.config.pad_inner_dim for layer in layers)


@pytest.mark.parametrize("grad_buffers", [False, True], ids=["autograd", "grad-buffers"])
def test_weight_scales_taken_once_per_block_give_the_gemms_of_scales_taken_at_each_cast(info, grad_buffers):
    """`fp8_weight_scales_once`: inside the block each aligned tensorwise linear casts its weight
    with a scale taken once, and the loss and every gradient are bitwise those of taking it at
    each cast, compiled too (one decoder-layer graph for every layer); weights changed between
    two blocks get new scales, and after a block no scale is kept."""
    torch._dynamo.reset()
    arch, (per_cast, once) = models(info, "qwen3-vl", "fp8-tensorwise", fp8_rows=96)
    _, (compiled, _) = models(info, "qwen3-vl", "fp8-tensorwise", fp8_rows=96)  # the same weights again
    compile_model(compiled, backend="aot_eager", static_rows=True)
    every = (per_cast, once, compiled)
    if grad_buffers:
        for model in every:
            for param in model.parameters():
                param.main_grad = torch.zeros_like(param)
            assert use_grad_buffers(model) == 4 * arch.lm.num_layers + 1  # and the output layer
    layers = [m for m in once.modules() if isinstance(m, DecoderLinear)]
    assert all(layer.fp8.transposes_by_tile for layer in layers)
    for seed in range(3):
        pack = random_pack(seed, total=96)
        want = loss_and_grads(per_cast, pack)
        for model in (once, compiled):
            with fp8_weight_scales_once(model):
                assert all(m.fp8_weight_scale is not None for m in model.modules() if isinstance(m, DecoderLinear))
                got = loss_and_grads(model, pack)
            assert torch.equal(got[0], want[0]), seed
            assert got[1].keys() == want[1].keys()
            assert all(torch.equal(got[1][name], grad) for name, grad in want[1].items()), seed
        assert all(layer.fp8_weight_scale is None for layer in layers)
        with fp8_weight_scales_once(once):  # the GEMMs read the scales the block took
            for layer in layers:
                layer.fp8_weight_scale = layer.fp8_weight_scale / 64
            assert not torch.equal(loss_and_grads(once, pack)[0], want[0])
        with torch.no_grad():  # an optimizer step between blocks: every scale changes
            for model in every:
                for param in model.parameters():
                    param.mul_(1.0 + 0.25 * (seed + 1))
    assert len(_debug_get_cache_entry_list(TransformerLayer.forward.__code__)) == 1


def test_weight_scales_are_torchaos_tensorwise_scales():
    """`weight_scales`: one amax launch over many weights gives torchao's scale of each, for
    both formats and with power-of-two rounding, zero weights and huge ones included."""
    from torchao.float8.float8_utils import tensor_to_scale

    from train.model.fp8 import weight_scales

    g = torch.Generator().manual_seed(3)
    for case in range(12):
        gemm = float8_gemm("tensorwise", emulate=True, pad_inner_dim=False)
        if case % 2:
            gemm = dataclasses.replace(gemm, config=dataclasses.replace(gemm.config, round_scales_to_power_of_2=True))
        weights = [(torch.randn(*(int(n) for n in torch.randint(1, 90, (2,), generator=g)), generator=g)
                    * float(torch.rand((), generator=g)) * 10.0 ** int(torch.randint(-3, 30, (1,), generator=g)))
                   .to(torch.bfloat16) for _ in range(5)]
        weights[case % 5].zero_()
        dtype = gemm.config.cast_config_weight.target_dtype
        want = [tensor_to_scale(w, dtype, round_scales_to_power_of_2=gemm.config.round_scales_to_power_of_2)
                for w in weights]
        got = weight_scales(weights, gemm)
        assert got.dtype == torch.float32 and got.shape == (5,)
        assert all(torch.equal(scale, ref) for scale, ref in zip(got, want)), (case, got, want)


def unaligned_arch() -> ModelArch:
    """The tiny Qwen3-VL with an MLP width of 72: fc1 (144 out) and fc2 (72 in) keep the pad."""
    arch = ModelArch.from_hf_config(tiny_qwen3_vl().config.to_dict())
    return dataclasses.replace(arch, lm=dataclasses.replace(arch.lm, intermediate_size=72))


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_linears_with_every_inner_dim_aligned_skip_torchaos_pad_and_compute_what_padded_ones_do(info, recipe):
    arch = unaligned_arch()
    check_aligned_linears_skip_the_pad(build_model(arch, transformer_config(arch, cpu=True), info), recipe,
                                       emulate=True)


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_fp8_model_stays_close_to_full_precision(info, recipe):
    """Whole model, several packs: the loss within 0.5 % and every gradient within 30 % (relative
    norm) of the fp32 model, but not equal to it (the GEMMs did run in float8)."""
    arch = ModelArch.from_hf_config(tiny_qwen3_vl().config.to_dict())
    config = transformer_config(arch, cpu=True)
    torch.manual_seed(0)
    full = build_model(arch, config, info)
    fp8 = build_model(arch, config, info)
    fp8.load_state_dict(full.state_dict())
    use_fp8(fp8, recipe, emulate=True)
    for seed in range(3):
        pack = random_pack(seed)
        (want, want_grads), (got, got_grads) = loss_and_grads(full, pack), loss_and_grads(fp8, pack)
        assert got != want
        assert abs(got - want) <= 5e-3 * abs(want), (seed, got, want)
        for name, grad in want_grads.items():
            rel = ((got_grads[name] - grad).norm() / grad.norm().clamp_min(1e-12)).item()
            assert rel < 0.3, (seed, name, rel)


def test_mixture_of_experts_layers_run_attention_in_fp8_and_experts_in_bf16(info):
    arch = ModelArch.from_hf_config(tiny_qwen3_vl_moe().config.to_dict())
    model = build_model(arch, transformer_config(arch, cpu=True), info)
    assert use_fp8(model, "tensorwise", emulate=True) == 2 * arch.lm.num_layers


@pytest.fixture(scope="module")
def fp8_run(shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8")
    ok(run_train([*BASE, "--data", str(shards), "--out", str(out), "--train-steps", "3", "--fp8", "rowwise"]))
    return out


def test_train_with_fp8_trains_and_bad_recipes_exit_2(shards, fp8_run, tmp_path):
    losses = [m["loss"] for m in metrics(fp8_run)]
    assert len(losses) == 3 and np.isfinite(losses).all()
    proc = run_train([*BASE, "--data", str(shards), "--out", str(tmp_path / "bad"), "--train-steps", "2",
                      "--fp8", "e4m3"])
    assert proc.returncode == 2 and "--fp8 'e4m3': choose from" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("sequence_parallel", ["false", "true"])
def test_fp8_under_tensor_parallelism_stays_with_one_process(shards, fp8_run, tmp_path, sequence_parallel):
    """TP=2 (gloo): megatron's communication around the FP8 GEMMs (the input gathered under
    sequence parallelism, else its gradient all-reduced). Not bitwise: a row-parallel layer's
    rowwise scales come from its half of the input columns. The tolerances sit well inside
    the FP8 run's own distance from the fp32 one (3 % in gradient norm by the third step)."""
    out = tmp_path / "tp2"
    ok(run_train([*BASE, "--data", str(shards), "--out", str(out), "--train-steps", "3", "--fp8", "rowwise",
                  "--tp", "2", "--sequence-parallel", sequence_parallel], nproc=2))
    for key, rtol in (("loss", 1e-4), ("grad_norm", 5e-3)):
        np.testing.assert_allclose([m[key] for m in metrics(out)], [m[key] for m in metrics(fp8_run)],
                                   rtol=rtol, err_msg=key)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                    reason="needs an FP8 GPU (sm89+)")
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_gpu_fp8_linears_compute_what_torchaos_float8_linear_computes(recipe):
    info = init_parallel(1, 1, device="cuda")
    try:
        arch = ModelArch.from_hf_config(tiny_qwen3_vl().config.to_dict())
        model = build_model(arch, transformer_config(arch, params_dtype=torch.bfloat16, bf16=True), info)
        use_fp8(model, recipe)
        check_against_torchao(model, recipe, emulate=False)
        arch = unaligned_arch()
        model = build_model(arch, transformer_config(arch, params_dtype=torch.bfloat16, bf16=True), info)
        check_aligned_linears_skip_the_pad(model, recipe, emulate=False)
    finally:
        destroy_parallel()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the Triton kernel)")
def test_gpu_cast_transposed_gives_torchaos_cast_bits_transposed():
    check_cast_transposed_against_torchao("cuda", cases=60)
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)  # a pack's activations: many tiles
    scale = torch.tensor(37.5, device="cuda")
    assert torch.equal(fp8_cast.cast_transposed(x, scale, torch.float8_e4m3fn).view(torch.uint8),
                       fp8_cast.cast_reference(x, scale, torch.float8_e4m3fn).t().contiguous().view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                    reason="needs an FP8 GPU (sm89+)")
def test_gpu_compiled_decoder_with_tile_cast_linears_stays_as_close_to_bf16_as_eager():
    """Inductor compiles the decoder layers around our tensorwise matmul and its Triton casts
    (packs of one length, every linear aligned). Inductor rounds the fused norms and SwiGLU a
    little differently from eager, and a value that crosses an FP8 rounding boundary moves by
    a whole FP8 step, so compiled and eager FP8 are not bitwise equal; each parameter's
    gradient of the compiled FP8 model must be as close to the bf16 model's as the eager FP8
    model's is (relative norm of the difference)."""
    from train.model.qwen_vl import compile_model

    info = init_parallel(1, 1, device="cuda")
    try:
        arch = ModelArch.from_hf_config(tiny_qwen3_vl().config.to_dict())
        config = transformer_config(arch, params_dtype=torch.bfloat16, bf16=True)
        torch.manual_seed(0)
        bf16, eager, compiled = (build_model(arch, config, info) for _ in range(3))
        for model in (eager, compiled):
            model.load_state_dict(bf16.state_dict())
            use_fp8(model, "tensorwise", rows=96)
        assert any(m.fp8.transposes_by_tile for m in compiled.modules() if isinstance(m, DecoderLinear))
        compile_model(compiled, static_rows=True)
        for seed in range(3):
            ids, positions, cu, max_len, labels = random_pack(seed, total=96)
            pack = (ids.cuda(), positions.cuda(), cu.int().cuda(), max_len, labels.cuda())
            (want_loss, want), *fp8 = (loss_and_grads(model, pack) for model in (bf16, eager, compiled))
            errors = [{name: ((grads[name].float() - ref.float()).norm() / ref.float().norm()).item()
                       for name, ref in want.items()} for _, grads in fp8]
            for (loss, _), error in zip(fp8, errors):
                assert abs(loss.item() - want_loss.item()) <= 1e-2 * abs(want_loss.item()), seed
                assert max(error.values()) < 0.5, (seed, error)
            for name in want:
                assert errors[1][name] <= 1.25 * errors[0][name] + 0.02, (seed, name, errors[0][name], errors[1][name])
    finally:
        destroy_parallel()


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                    reason="needs an FP8 GPU (sm89+)")
def test_gpu_weight_scales_taken_once_give_the_gemms_of_scales_taken_at_each_cast():
    """`fp8_weight_scales_once` on the GPU (`torch._scaled_mm`, the Triton casts, CUDA's
    `_foreach_norm`): eager, loss and every gradient bitwise those of scales taken at each
    cast. With compiled decoder layers the graph changes (the scales come in instead of being
    taken), and Inductor may fuse and round the activations around the casts differently
    (`test_gpu_compiled_decoder_with_tile_cast_linears_stays_as_close_to_bf16_as_eager`): each
    gradient must stay as close to the eager model's as without the scales."""
    info = init_parallel(1, 1, device="cuda")
    try:
        arch = ModelArch.from_hf_config(tiny_qwen3_vl().config.to_dict())
        config = transformer_config(arch, params_dtype=torch.bfloat16, bf16=True)
        torch.manual_seed(0)
        eager, compiled = (build_model(arch, config, info) for _ in range(2))
        compiled.load_state_dict(eager.state_dict())
        for model in (eager, compiled):
            use_fp8(model, "tensorwise", rows=96)
        compile_model(compiled, static_rows=True)
        for seed in range(3):
            ids, positions, cu, max_len, labels = random_pack(seed, total=96)
            pack = (ids.cuda(), positions.cuda(), cu.int().cuda(), max_len, labels.cuda())
            results = {}
            for name, model in (("eager", eager), ("compiled", compiled)):
                results[name] = loss_and_grads(model, pack)
                with fp8_weight_scales_once(model):
                    results[name, "scales"] = loss_and_grads(model, pack)
            (want_loss, want), (loss, grads) = results["eager"], results["eager", "scales"]
            assert torch.equal(loss, want_loss), seed
            assert grads.keys() == want.keys() and all(torch.equal(grads[n], g) for n, g in want.items()), seed
            errors = [{name: ((got[1][name].float() - ref.float()).norm() / ref.float().norm()).item()
                       for name, ref in want.items()} for got in (results["compiled"], results["compiled", "scales"])]
            assert abs(results["compiled", "scales"][0].item() - want_loss.item()) <= 1e-3 * abs(want_loss.item())
            for name in want:
                assert errors[1][name] <= 1.25 * errors[0][name] + 0.02, (seed, name, errors[0][name], errors[1][name])
    finally:
        destroy_parallel()
