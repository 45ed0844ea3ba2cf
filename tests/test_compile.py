"""`compile_model` compiles each dense decoder layer as one graph that every layer shares, and
the compiled model computes what the eager one computes (CPU, fp32).

The GPU runs inductor; here dynamo and AOTAutograd trace the same graphs (`aot_eager`), so
what is checked is the part that can break on a megatron-core upgrade or a model change: no
graph breaks, no graph per layer, and the same losses and gradients, bitwise. The GPU test
`test_gpu_compiled_model_equals_eager` (tests/test_train.py) covers the generated kernels.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from tests.hf_models import tiny_qwen2_5_vl, tiny_qwen3_vl
from train.model import lora
from train.model.arch import ModelArch
from train.model.batch import PackedBatch
from train.model.linear import DecoderLinear, use_fp8, use_grad_buffers
from train.model.qwen_vl import compile_model, transformer_config
from train.parallel import build_model, destroy_parallel, init_parallel

HF_MODELS = {"qwen3-vl": tiny_qwen3_vl, "qwen2.5-vl": tiny_qwen2_5_vl}


@pytest.fixture(scope="module")
def info():
    info = init_parallel(1, 1, device="cpu")
    yield info
    destroy_parallel()


def random_pack(seed: int, vocab: int = 1000, total: int | None = None):
    """A pack of 2-4 segments, `total` rows (default: 40-160), random tokens and targets."""
    g = torch.Generator().manual_seed(seed)
    total = total or int(torch.randint(40, 160, (1,), generator=g))
    cuts = torch.randint(1, total, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).unique().tolist()
    cu = torch.tensor([0, *cuts, total])
    ids = torch.randint(0, vocab, (total,), generator=g)
    labels = torch.where(torch.rand(total, generator=g) < 0.3, torch.full_like(ids, -100), ids)
    positions = (torch.arange(total) - torch.repeat_interleave(cu[:-1], cu.diff()))[None].expand(3, total).contiguous()
    return ids, positions, cu, int(cu.diff().max()), labels


def models(info, kind: str, variant: str, fp8_rows: int | None = None):
    """The eager model and a copy of it, same weights; `variant`: plain, main-grad (every weight
    with a gradient buffer, as megatron's DDP gives it: the decoder linears add into it), lora,
    dora, fp8 (rowwise) or fp8-tensorwise; `fp8_rows`: `use_fp8`'s pack length (aligned linears
    skip the pad)."""
    arch = ModelArch.from_hf_config(HF_MODELS[kind]().config.to_dict())
    config = transformer_config(arch, cpu=True)
    torch.manual_seed(0)
    pair = [build_model(arch, config, info) for _ in range(2)]
    pair[1].load_state_dict(pair[0].state_dict())
    for model in pair:
        if variant in ("lora", "dora"):
            lora.attach(model, arch, lora.LoraSpec(rank=4, alpha=8, dora=variant == "dora"), 1,
                        range(arch.lm.num_layers))
            torch.manual_seed(1)  # adapters start at zero: give them values that show in the output
            for param in (p for p in model.parameters() if p.requires_grad):
                param.data.normal_(0, 0.2).add_(1 if param.ndim == 1 else 0)
        if variant.startswith("fp8"):
            use_fp8(model, "tensorwise" if variant == "fp8-tensorwise" else "rowwise", emulate=True, rows=fp8_rows)
        if variant == "main-grad":
            for param in model.parameters():
                param.main_grad = torch.zeros_like(param)
            assert use_grad_buffers(model) == 4 * arch.lm.num_layers
    return arch, pair


def loss_and_grads(model, pack):
    ids, positions, cu, max_len, labels = pack
    model.zero_grad(set_to_none=True)
    for param in model.parameters():
        if hasattr(param, "main_grad"):
            param.main_grad.zero_()
    loss = model(PackedBatch.from_segments(ids, positions, cu, labels)).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    added = {n: p.main_grad.clone() for n, p in model.named_parameters() if p.grad is None and hasattr(p, "main_grad")}
    return loss.detach(), grads | {n: g for n, g in added.items() if g.any()}


@pytest.mark.parametrize("kind, variant", [("qwen3-vl", "plain"), ("qwen2.5-vl", "plain"), ("qwen3-vl", "main-grad"),
                                           ("qwen3-vl", "lora"),
                                           ("qwen3-vl", "dora"), ("qwen3-vl", "fp8"), ("qwen3-vl", "fp8-tensorwise")])
def test_compiled_decoder_layers_share_one_graph_and_compute_what_eager_computes(info, kind, variant):
    torch._dynamo.reset()
    arch, (eager, compiled) = models(info, kind, variant)
    compile_model(compiled, backend="aot_eager")
    layers = compiled.language_model.decoder.layers
    assert all(layer.compiled_forward is not None for layer in layers)

    explained = torch._dynamo.explain(TransformerLayer.forward)(
        layers[0], hidden_states=torch.randn(48, 1, arch.lm.hidden_size), attention_mask=None,
        packed_seq_params=layer_rows(compiled, 48))
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]

    torch._dynamo.reset()
    for seed in range(3):  # packs of other lengths and segment counts: dynamic shapes, no recompile
        pack = random_pack(seed)
        want, got = loss_and_grads(eager, pack), loss_and_grads(compiled, pack)
        assert torch.equal(got[0], want[0]), (seed, got[0], want[0])
        assert got[1].keys() == want[1].keys()
        if variant == "main-grad":  # the decoder linears' gradients were added into their buffers
            linears = [m.weight for m in compiled.modules() if isinstance(m, DecoderLinear)]
            assert linears and all(w.grad is None and w.main_grad.any() for w in linears)
        for name, grad in want[1].items():
            assert torch.equal(got[1][name], grad), (seed, name, (got[1][name] - grad).abs().max())
    if arch.num_deepstack:  # image rows: DeepStack features added after the first layers
        g = torch.Generator().manual_seed(7)
        hidden = torch.randn(60, 1, arch.lm.hidden_size, generator=g).requires_grad_()
        features = torch.randn(arch.num_deepstack, 9, arch.lm.hidden_size, generator=g)
        rows = torch.randperm(60, generator=g)[:9]
        want, got = (model.language_model.decoder(hidden_states=hidden, attention_mask=None, context=features,
                                                  context_mask=rows, packed_seq_params=layer_rows(model, 60))
                     for model in (eager, compiled))
        assert torch.equal(got, want)
    # one graph for every layer and every pack, not one per layer; under adapters the first
    # layer's input (the frozen embedding's output) needs no gradient, which takes a second
    graphs = len(_debug_get_cache_entry_list(TransformerLayer.forward.__code__))
    assert graphs == (2 if variant in ("lora", "dora") else 1), graphs


def test_static_rows_compile_each_decoder_layer_for_the_pack_length(info):
    """`static_rows` (packs padded to one length): packs of that length, whatever their segments,
    share one graph and compute what eager computes; a pack of another length needs a graph of
    its own, so the row count is compiled in, not symbolic. The FP8 linears are aligned to the
    pack length, so their backward casts run through `train.model.fp8_cast`'s op."""
    torch._dynamo.reset()
    arch, (eager, compiled) = models(info, "qwen3-vl", "fp8-tensorwise", fp8_rows=96)
    fp8_layers = [layer for layer in compiled.modules() if getattr(layer, "fp8", None)]
    assert fp8_layers and all(layer.fp8.transposes_by_tile for layer in fp8_layers)
    compile_model(compiled, backend="aot_eager", static_rows=True)
    for seed in range(3):
        pack = random_pack(seed, total=96)
        want, got = loss_and_grads(eager, pack), loss_and_grads(compiled, pack)
        assert torch.equal(got[0], want[0]), seed
        assert all(torch.equal(got[1][name], grad) for name, grad in want[1].items()), seed
    assert len(_debug_get_cache_entry_list(TransformerLayer.forward.__code__)) == 1
    loss_and_grads(compiled, random_pack(0, total=80))
    assert len(_debug_get_cache_entry_list(TransformerLayer.forward.__code__)) == 2


def layer_rows(model, total: int):
    """The `PackedRows` a decoder layer takes: two segments of a `total`-row pack."""
    from train.model.attention import PackedRows

    cos, sin = model.rope(torch.arange(total)[None].expand(3, total), torch.float32)
    cu = torch.tensor([0, total // 3, total])
    return PackedRows(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=total - total // 3,
                      max_seqlen_kv=total - total // 3, rope_cos=cos, rope_sin=sin)


def test_mixture_of_experts_layers_stay_eager(info):
    from tests.hf_models import tiny_qwen3_vl_moe

    arch = ModelArch.from_hf_config(tiny_qwen3_vl_moe().config.to_dict())
    model = build_model(arch, transformer_config(arch, cpu=True), info)
    compile_model(model, backend="aot_eager")
    assert all(layer.compiled_forward is None for layer in model.language_model.decoder.layers)
    assert all(block._compiled_call_impl is not None for block in model.vision.blocks)
