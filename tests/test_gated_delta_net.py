"""`train.model.gated_delta_net.GatedDeltaNet` against transformers' `Qwen3_5GatedDeltaNet` (fp32,
CPU, tiny dims): one sample, a pack of samples (each against HF on that sample alone), gradients,
TP=2 (two gloo processes, with and without sequence parallelism) against TP=1, and the HF <->
TP-rank weight table. On a GPU: flash-linear-attention's kernels against the PyTorch path (bf16)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from train.model import gated_delta_net as G
from train.model.arch import builtin_arch
from train.model.qwen_vl import transformer_config
from train.parallel import destroy_parallel, init_parallel

# Two key heads serving four value heads (GVA), key and value head dims unequal: a transposed or
# mis-grouped head shows. The hidden size is the `tiny` arch's.
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
              linear_conv_kernel_dim=4)
HIDDEN = builtin_arch("tiny").lm.hidden_size
# Samples longer than a chunk (64) and not starting on a chunk boundary, shorter than the conv
# kernel, of one row; an empty segment (a repeated boundary); trailing padding rows.
PACK = [70, 3, 1, 0, 130, 2, 1]
PAD = 5


def hf_layer(seed: int = 0):
    """A tiny HF Gated DeltaNet with every parameter moved off its initial value (the norm's ones,
    dt_bias' ones)."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config = Qwen3_5TextConfig(hidden_size=HIDDEN, num_hidden_layers=4, rms_norm_eps=1e-6, hidden_act="silu", **LINEAR)
    torch.manual_seed(seed)
    layer = Qwen3_5GatedDeltaNet(config, layer_idx=0)
    with torch.no_grad():
        for param in layer.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return layer


def hf_state(layer) -> dict[str, torch.Tensor]:
    return {G.HF_PREFIX + name: tensor.detach().clone() for name, tensor in layer.state_dict().items()}


def our_config(tp: int = 1, sequence_parallel: bool = False):
    return transformer_config(builtin_arch("tiny"), tp=tp, cpu=True, sequence_parallel=sequence_parallel, **LINEAR)


def our_layer(hf: dict, tp: int = 1, tp_rank: int = 0, sequence_parallel: bool = False) -> G.GatedDeltaNet:
    config = our_config(tp, sequence_parallel)
    layer = G.GatedDeltaNet(config, layer_number=1)
    layer.load_state_dict(G.hf_to_rank(hf, G.GatedDeltaNetDims.from_config(config), tp, tp_rank))
    return layer


def packed(lengths: list[int]) -> PackedSeqParams:
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                           max_seqlen_kv=max(lengths))


@pytest.fixture(scope="module")
def one_process():
    init_parallel(1, 1, device="cpu")
    yield
    destroy_parallel()


def test_one_sample_equals_hf(one_process):
    """A 150-row sample (three chunks), as a pack of one and as an unpacked batch of two
    sequences (each column its own sequence, as HF's batch)."""
    hf = hf_layer()
    ours = our_layer(hf_state(hf))
    x = torch.randn(2, 150, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(x)
        one, bias = ours(x[0][:, None], packed_seq_params=packed([150]))
        batch, _ = ours(x.transpose(0, 1))
    assert bias is None  # fp32 on CPU: the chunked rule's sums round by the CPU's kernels (up to 1.4e-5 seen)
    torch.testing.assert_close(one[:, 0], want[0], atol=3e-5, rtol=0)
    torch.testing.assert_close(batch.transpose(0, 1), want, atol=3e-5, rtol=0)


def test_runs_as_the_attention_of_a_megatron_decoder_layer(one_process):
    """In a megatron `TransformerLayer` built from the project's layer spec with the module as its
    `self_attention`: the layer gives x + GDN(norm(x)), then its MLP block, on a pack."""
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from train.model.qwen_vl import layer_spec

    spec = layer_spec(builtin_arch("tiny"), cpu=True)
    spec.module = TransformerLayer
    spec.submodules.self_attention = ModuleSpec(module=G.GatedDeltaNet, submodules=G.GatedDeltaNetSubmodules())
    layer = build_module(spec, config=our_config(), layer_number=1)
    assert isinstance(layer.self_attention, G.GatedDeltaNet)
    x = torch.randn(sum(PACK) + PAD, 1, HIDDEN, generator=torch.Generator().manual_seed(6))
    pack = packed(PACK)
    with torch.no_grad():
        out, _ = layer(hidden_states=x, attention_mask=None, packed_seq_params=pack)
        mixed = x + layer.self_attention(layer.input_layernorm(x), packed_seq_params=pack)[0]
        mlp, _ = layer.mlp(layer.pre_mlp_layernorm(mixed))
    torch.testing.assert_close(out, mixed + mlp, atol=1e-6, rtol=0)


def test_packing_is_exact(one_process):
    """Each sample's rows of a pack equal HF's module run on that sample alone: conv window and
    state restart at every sample. The padding rows after the last boundary come out finite and
    change no sample's rows."""
    hf = hf_layer()
    ours = our_layer(hf_state(hf))
    total = sum(PACK) + PAD
    x = torch.randn(total, 1, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, _ = ours(x, packed_seq_params=packed(PACK))
        start = 0
        for n in PACK:
            if n:
                torch.testing.assert_close(got[start:start + n, 0], hf(x[None, start:start + n, 0])[0], atol=1e-5,
                                           rtol=0, msg=f"sample at row {start} ({n} rows)")
            start += n
        assert torch.isfinite(got[start:]).all()
        x[start:] = 1e4 * torch.randn(PAD, 1, HIDDEN)
        again, _ = ours(x, packed_seq_params=packed(PACK))
        # negative control: the same rows as one sequence carry state and conv window across samples
        leaky, _ = ours(x, packed_seq_params=packed([total]))
    torch.testing.assert_close(again[:start], got[:start], atol=0, rtol=0)
    assert (leaky[PACK[0]:start] - got[PACK[0]:start]).abs().max() > 1e-2


def test_boundaries_rewritten_in_place_are_read_again(one_process):
    """The boundaries are brought to the host once per cu_seqlens tensor: a tensor rewritten in
    place for another pack must not be taken for the one before."""
    ours = our_layer(hf_state(hf_layer()))
    x = torch.randn(10, 1, HIDDEN, generator=torch.Generator().manual_seed(5))
    pack = packed([4, 6])
    with torch.no_grad():
        ours(x, packed_seq_params=pack)
        pack.cu_seqlens_q.copy_(torch.tensor([0, 7, 10]))
        torch.testing.assert_close(ours(x, packed_seq_params=pack)[0], ours(x, packed_seq_params=packed([7, 3]))[0],
                                   atol=0, rtol=0)


def test_gradients_equal_hf(one_process):
    """The gradients of a per-token loss averaged over the rows (mean over rows of out . r_row),
    one 100-row sample, with respect to the input and every weight, against HF's autograd; our
    fused weights' gradients are mapped back to HF's tensors by the weight table."""
    hf = hf_layer()
    ours = our_layer(hf_state(hf))
    g = torch.Generator().manual_seed(3)
    x, r = torch.randn(100, HIDDEN, generator=g), torch.randn(100, HIDDEN, generator=g)
    x_hf, x_ours = x[None].clone().requires_grad_(), x[:, None].clone().requires_grad_()
    (hf(x_hf)[0] * r).sum(-1).mean().backward()
    out, _ = ours(x_ours, packed_seq_params=packed([100]))
    (out[:, 0] * r).sum(-1).mean().backward()
    torch.testing.assert_close(x_ours.grad[:, 0], x_hf.grad[0], atol=1e-4, rtol=0)
    dims = G.GatedDeltaNetDims.from_config(ours.config)
    got = G.rank_to_hf([{name: p.grad for name, p in ours.named_parameters()}], dims)
    want = {G.HF_PREFIX + name: p.grad for name, p in hf.named_parameters()}
    assert got.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, atol=1e-4, rtol=0, msg=name)


def _tp_worker(rank: int, world: int, port: int, hf: dict, x: torch.Tensor, r: torch.Tensor, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_parallel(world, 1, device="cpu")
    results = {}
    for sequence_parallel in (False, True):
        layer = our_layer(hf, world, rank, sequence_parallel)
        rows = x.chunk(world)[rank] if sequence_parallel else x  # each rank holds its slice of the rows
        rows = rows.clone().requires_grad_()
        output, _ = layer(rows, packed_seq_params=packed(PACK))
        (output * (r.chunk(world)[rank] if sequence_parallel else r)).sum().backward()
        results[sequence_parallel] = dict(output=output.detach(), input_grad=rows.grad,
                                          grads={name: p.grad for name, p in layer.named_parameters()})
    torch.save(results, f"{out}.{rank}")
    destroy_parallel()


def test_tp2_equals_tp1(one_process, tmp_path):
    """Two gloo processes at TP=2 (heads split; with sequence parallelism also the rows) give
    TP=1's output, input gradient and, merged by the weight table, weight gradients."""
    import torch.multiprocessing as mp

    hf = hf_state(hf_layer())
    total = sum(PACK) + PAD
    assert total % 2 == 0  # the rows divide over the 2 ranks under sequence parallelism
    g = torch.Generator().manual_seed(4)
    # loss sum(out * r): with r / rows, a per-token loss averaged over the rows (gradients of order 1)
    x, r = torch.randn(total, 1, HIDDEN, generator=g), torch.randn(total, 1, HIDDEN, generator=g) / total
    one = our_layer(hf)
    rows = x.clone().requires_grad_()
    want_out, _ = one(rows, packed_seq_params=packed(PACK))
    (want_out * r).sum().backward()
    dims = G.GatedDeltaNetDims.from_config(one.config)
    want_grads = G.rank_to_hf([{name: p.grad for name, p in one.named_parameters()}], dims)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_tp_worker, args=(2, port, hf, x, r, str(tmp_path / "tp2")), nprocs=2)
    ranks = [torch.load(tmp_path / f"tp2.{rank}") for rank in range(2)]
    for sequence_parallel in (False, True):
        got = [rank[sequence_parallel] for rank in ranks]
        if sequence_parallel:
            output = torch.cat([rank["output"] for rank in got])
            input_grad = torch.cat([rank["input_grad"] for rank in got])
        else:
            output, input_grad = got[0]["output"], got[0]["input_grad"]
            torch.testing.assert_close(got[1]["output"], output, atol=0, rtol=0)
        torch.testing.assert_close(output, want_out.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(input_grad, rows.grad, atol=1e-5, rtol=0)
        merged = G.rank_to_hf([rank["grads"] for rank in got], dims)
        for name, grad in want_grads.items():
            torch.testing.assert_close(merged[name], grad, atol=1e-5, rtol=0, msg=f"{name} sp={sequence_parallel}")
        # the norm's weight is on both ranks, each with the whole (summed) gradient
        torch.testing.assert_close(got[1]["grads"]["out_norm.weight"], got[0]["grads"]["out_norm.weight"])


@pytest.mark.parametrize("tp", [1, 2])
def test_weight_table_round_trips_and_puts_each_head_on_its_rank(tp):
    hf = hf_state(hf_layer())
    dims = G.GatedDeltaNetDims(hidden_size=HIDDEN, num_key_heads=2, num_value_heads=4, key_head_dim=8,
                               value_head_dim=12, conv_kernel=4)
    ranks = [G.hf_to_rank(hf, dims, tp, rank) for rank in range(tp)]
    back = G.rank_to_hf(ranks, dims)
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    # rank r: its key heads' q and k rows, its value heads' v, z, b, a rows, conv channels likewise
    kd, vd, nv = dims.key_dim // tp, dims.value_dim // tp, dims.num_value_heads // tp
    qkv, conv = hf["linear_attn.in_proj_qkv.weight"], hf["linear_attn.conv1d.weight"]
    for rank, state in enumerate(ranks):
        q, k = slice(rank * kd, (rank + 1) * kd), slice(dims.key_dim + rank * kd, dims.key_dim + (rank + 1) * kd)
        v = slice(2 * dims.key_dim + rank * vd, 2 * dims.key_dim + (rank + 1) * vd)
        heads, values = slice(rank * nv, (rank + 1) * nv), slice(rank * vd, (rank + 1) * vd)
        want = torch.cat([qkv[q], qkv[k], qkv[v], hf["linear_attn.in_proj_z.weight"][values],
                          hf["linear_attn.in_proj_b.weight"][heads], hf["linear_attn.in_proj_a.weight"][heads]])
        assert torch.equal(state["in_proj.weight"], want)
        assert torch.equal(state["conv1d.weight"], torch.cat([conv[q], conv[k], conv[v]]))
        assert torch.equal(state["A_log"], hf["linear_attn.A_log"][heads])
        assert torch.equal(state["out_proj.weight"], hf["linear_attn.out_proj.weight"][:, values])
        assert torch.equal(state["out_norm.weight"], hf["linear_attn.norm.weight"])


def test_bad_shapes_and_boundaries_are_refused(one_process):
    dims = G.GatedDeltaNetDims(hidden_size=HIDDEN, num_key_heads=2, num_value_heads=4, key_head_dim=8,
                               value_head_dim=12, conv_kernel=4)
    with pytest.raises(ValueError, match="linear_num_key_heads 2 .* must divide over tensor-parallel size 4"):
        dims.check(4)
    with pytest.raises(ValueError, match="linear_num_value_heads 6 must be a multiple of linear_num_key_heads 4"):
        G.GatedDeltaNetDims(HIDDEN, 4, 6, 8, 8, 4).check(1)
    layer = our_layer(hf_state(hf_layer()))
    x = torch.randn(10, 1, HIDDEN)
    for lengths in ([4, 7], [6, -2]):
        with pytest.raises(ValueError, match=r"cu_seqlens \[.*\] must rise from 0 to at most the 10 rows"):
            layer(x, packed_seq_params=packed(lengths))
    layer.kernels = "fla"
    with pytest.raises(RuntimeError, match="needs CUDA tensors and the fla-core package"):
        layer(x, packed_seq_params=packed([10]))


def test_warm_up_runs_the_kernels_forward_and_backward_on_both_kinds_of_row_count(one_process, monkeypatch):
    """The warm-up before the first step hands fla's conv and chunked rule a pack whose row
    count is a multiple of 16 and one whose is not (Triton compiles a kernel once per kind),
    forward and backward, on random values: no parameter of the model gets a gradient, and a
    layer that runs the PyTorch path does nothing. fla is stood in for by the PyTorch path."""
    calls, backward = [], []

    def conv(x, weight, activation, cu_seqlens, cu_seqlens_cpu):
        calls.append(("conv", x.shape[1], weight.requires_grad))
        x.register_hook(lambda grad: backward.append(grad.shape[1]))
        return G.torch_causal_conv1d(x[0], weight, G.Segments(cu_seqlens_cpu.tolist(), x.device))[None], None

    def rule(q, k, v, g, beta, use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu):
        calls.append(("rule", q.shape[1], q.requires_grad))
        out = G.torch_gated_delta_rule(q[0], k[0], v[0], g[0], beta[0], G.Segments(cu_seqlens_cpu.tolist(), q.device))
        return out[None], None

    first, second = (our_layer(hf_state(hf_layer())) for _ in range(2))
    model = torch.nn.ModuleList([first, torch.nn.ModuleList([second])])
    G.warm_up_linear_attention(model)
    assert calls == []  # the PyTorch path compiles nothing
    monkeypatch.setattr(G, "fla_kernels", lambda: (conv, rule))
    monkeypatch.setattr(G.GatedDeltaNet, "_use_fla", lambda self, x: True)
    G.warm_up_linear_attention(model)  # two layers of one shape: warmed once
    assert [rows % 16 == 0 for _, rows, _ in calls[::2]] == [True, False], calls
    assert [name for name, _, _ in calls] == ["conv", "rule"] * len(G.WARM_UP_ROWS)
    assert all(needs_grad for _, _, needs_grad in calls)
    assert backward == list(G.WARM_UP_ROWS)  # the backward kernels ran too
    assert all(p.grad is None for p in model.parameters())


def _fla_available() -> bool:
    return torch.cuda.is_available() and G.fla_kernels() is not None


@pytest.mark.gpu
@pytest.mark.skipif(not _fla_available(), reason="needs a CUDA GPU and the fla-core package (extra qwen3.5)")
def test_gpu_fla_kernels_equal_the_torch_path():
    """Qwen3.5's linear-attention shape (16 key heads, 32 value heads, head dims 128; hidden
    2048), bf16, on a 4k pack with samples of 1 and 3 rows, one longer than 2k, and padding
    rows: against the PyTorch path in fp32 (exact per sample, as the CPU tests show), the fla
    path's output and input and weight gradients are within twice the bf16 PyTorch path's error
    or 1 % of the largest value, whichever is larger."""
    init_parallel(1, 1, device="cuda")
    try:
        linear = dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                      linear_value_head_dim=128, linear_conv_kernel_dim=4)
        arch = builtin_arch("qwen3-vl-2b")
        reference = G.GatedDeltaNet(transformer_config(arch, **linear), layer_number=1)
        reference.kernels = "torch"
        layers = {}
        for kernels in ("fla", "torch"):
            layer = G.GatedDeltaNet(transformer_config(arch, params_dtype=torch.bfloat16, bf16=True, **linear), 1)
            layer.load_state_dict({k: v.to(torch.bfloat16) if torch.is_tensor(v) else v
                                   for k, v in reference.state_dict().items()})
            layer.kernels = kernels
            layers[kernels] = layer
        lengths = [1, 3, 700, 2100, 61, 1, 1200]
        total = sum(lengths) + 30
        g = torch.Generator().manual_seed(0)
        x = torch.randn(total, 1, arch.lm.hidden_size, generator=g).cuda()
        r = torch.randn(total, 1, arch.lm.hidden_size, generator=g).cuda()
        pack = packed(lengths)
        pack.cu_seqlens_q = pack.cu_seqlens_kv = pack.cu_seqlens_q.cuda()

        def run(layer, dtype) -> dict[str, torch.Tensor]:
            rows = x.to(dtype, copy=True).requires_grad_()
            out, _ = layer(rows, packed_seq_params=pack)
            (out.float() * r).sum().backward()
            return {"output": out.float(), "input grad": rows.grad.float(),
                    **{name: p.grad.float() for name, p in layer.named_parameters()}}

        want = run(reference, torch.float32)
        errors = {}
        for kernels in ("torch", "fla"):
            got = run(layers[kernels], torch.bfloat16)
            assert torch.isfinite(got["output"]).all()
            errors[kernels] = {name: ((got[name] - ref).abs().max() / ref.abs().max()).item()
                               for name, ref in want.items()}
        for name, error in errors["fla"].items():
            bf16 = errors["torch"][name]
            assert error <= max(2 * bf16, 1e-2), f"{name}: fla {error:.3g}, PyTorch path in bf16 {bf16:.3g}"
    finally:
        destroy_parallel()


@pytest.mark.parametrize("hopper,buggy_triton,tilelang,refused", [
    (True, True, False, True), (True, True, True, False), (True, False, False, False), (False, True, False, False)])
def test_a_backward_fla_would_refuse_is_named_before_training(monkeypatch, hopper, buggy_triton, tilelang, refused):
    """flash-linear-attention 0.6 raises in the middle of a step on Hopper with a Triton from 3.4.0
    to before 3.7.1 unless tilelang is installed; the trainer asks first and stops with the fix."""
    import importlib.util
    import sys
    import types

    flags = types.ModuleType("fla.utils")
    flags.IS_NVIDIA_HOPPER, flags.TRITON_ABOVE_3_4_0, flags.TRITON_ABOVE_3_7_1 = hopper, True, not buggy_triton
    monkeypatch.setitem(sys.modules, "fla.utils", flags)
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.6.0"))
    monkeypatch.setattr(G, "fla_kernels", lambda: (None, None))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "tilelang" and tilelang else
                        (None if name == "tilelang" else find_spec(name, *a)))
    message = G.fla_backward_refusal()
    assert (message is not None) == refused
    if refused:
        assert "pip install tilelang" in message and "3.6.0" in message
