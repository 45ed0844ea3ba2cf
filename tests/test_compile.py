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
import torch.nn.functional as F
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._functorch.aot_autograd import aot_module_simplified

from tests.helpers.model_pairs import loss_and_grads, models, random_pack
from train.model.arch import ModelArch
from train.model.linear import DecoderLinear
from train.model.qwen_vl import compile_model, transformer_config
from train.parallel import build_model


# every run compiles LoRA and tensorwise FP8; DoRA and rowwise FP8, their close kin, in the sweep
@pytest.mark.parametrize("kind, variant", [("qwen3-vl", "plain"), ("qwen2.5-vl", "plain"), ("qwen3-vl", "main-grad"),
                                           ("qwen3-vl", "lora"), pytest.param("qwen3-vl", "dora", marks=pytest.mark.sweep),
                                           pytest.param("qwen3-vl", "fp8", marks=pytest.mark.sweep),
                                           ("qwen3-vl", "fp8-tensorwise")])
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


@pytest.mark.parametrize("kind, variant", [("qwen3-vl", "lora"), ("qwen3-vl", "dora"), ("qwen3.5", "lora")])
def test_a_grad_free_decoder_layer_runs_its_adapters_as_plain_gemms(info, kind, variant):
    """A recomputed layer's first forward runs without gradients, a graph of its own. There the
    adapters' rank-r GEMMs on [s, 1, r] views must stay plain GEMMs: traced as batched ones,
    cuBLAS ran them 25x slower on an H200 (0.5 s of a 3.6 s 8B LoRA step)."""
    torch._dynamo.reset()
    arch, (_, compiled) = models(info, kind, variant)
    graphs = []

    def capture(gm, inputs):
        return aot_module_simplified(gm, inputs, fw_compiler=lambda graph, _: graphs.append(graph) or graph)

    compile_model(compiled, backend=capture)
    layer = next(layer for layer in compiled.language_model.decoder.layers if layer.compiled_forward is not None)
    with torch.no_grad():
        layer(hidden_states=torch.randn(48, 1, arch.lm.hidden_size), attention_mask=None,
              packed_seq_params=layer_rows(compiled, 48))
    ops = {str(node.target) for graph in graphs for node in graph.graph.nodes if node.op == "call_function"}
    assert "aten.mm.default" in ops, sorted(ops)
    assert "aten.bmm.default" not in ops, sorted(ops)


VIEWS = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.t.default",
         "aten.transpose.int", "aten.unsqueeze.default", "aten.squeeze.dim", "aten.expand.default"}


def saved_for_backward(module, *inputs) -> list[str]:
    """What a compiled module's forward graphs keep for their backward: the op that made each saved
    tensor, looking through views (fw_compiler sees the partitioned graphs)."""
    graphs = []

    def capture(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=lambda graph, _: graphs.append(graph) or graph)

    torch._dynamo.reset()
    out = torch.compile(module, dynamic=True, backend=capture)(*inputs)
    (out[0] if isinstance(out, tuple) else out).sum().backward()
    makers = []
    for node in (node for graph in graphs for node in graph.graph.output_node().args[0]):
        while isinstance(node, torch.fx.Node) and str(node.target) in VIEWS:
            node = node.args[0]
        if isinstance(node, torch.fx.Node) and node.op == "call_function":
            gated = node.target == torch.ops.aten.mul.Tensor and any(
                isinstance(a, torch.fx.Node) and a.target == torch.ops.aten.silu.default for a in node.args)
            makers.append("silu * up" if gated else str(node.target))
    return makers


@pytest.mark.parametrize("kind, recompute", [("qwen3-vl", True), ("qwen2.5-vl", True), ("qwen3.5", True),
                                             ("qwen3-vl", False), ("qwen2.5-vl", False)])
def test_compiled_mlps_keep_their_input_not_the_activations_output(info, kind, recompute):
    """A compiled dense decoder layer keeps fc1's output for backward and recomputes the SwiGLU
    from it; a compiled vision block keeps its MLP's pre-activation (GELU, or Qwen2.5-VL's gate and
    up) and recomputes the activation. Kept, the activation's output costs 2 bytes per unit of
    the MLP's width per token and layer; `compile_model(recompute_mlp_activations=False)`
    (--recompute-mlp-activations false) keeps it."""
    arch, (_, model) = models(info, kind, "plain")
    compile_model(model, backend="aot_eager", recompute_mlp_activations=recompute)
    layer = next(layer for layer in model.language_model.decoder.layers  # (a Gated DeltaNet gates with silu too)
                 if type(layer.self_attention).__name__ != "GatedDeltaNet")
    hidden = torch.randn(48, 1, arch.lm.hidden_size, requires_grad=True)
    kept = saved_for_backward(lambda h: TransformerLayer.forward(layer, hidden_states=h, attention_mask=None,
                                                                 packed_seq_params=layer_rows(model, 48)), hidden)
    assert ("silu * up" not in kept) == recompute and "aten.mm.default" in kept, kept
    block, width = model.vision.blocks[0], arch.vision.hidden_size
    patches = torch.randn(32, width, requires_grad=True)
    cos, sin = model.vision._rotary(torch.arange(32) % 4, torch.arange(32) // 4)
    kept = saved_for_backward(lambda x: block(x, torch.tensor([0, 12, 32], dtype=torch.int32), 20, cos, sin), patches)
    assert (not {"silu * up", "aten.gelu.default"} & set(kept)) == recompute, kept
    assert "aten.addmm.default" in kept, kept


def test_gated_delta_net_layers_compile_around_their_eager_mixer(info):
    """Qwen3.5's Gated DeltaNet layers are compiled too, their conv and delta rule run eagerly
    between the graphs (the sample boundaries come to the host): the layer breaks only there,
    the projections, gates, gated norm, MLP and residual adds are compiled, and the model computes what eager computes (the same
    loss bitwise; gradients up to fp32 rounding, the graph break reorders a residual's sum)."""
    torch._dynamo.reset()
    arch, (eager, compiled) = models(info, "qwen3.5", "plain")
    compile_model(compiled, backend="aot_eager")
    layers = compiled.language_model.decoder.layers
    kinds = [type(layer.self_attention).__name__ for layer in layers]
    assert "GatedDeltaNet" in kinds and all(layer.compiled_forward is not None for layer in layers), kinds
    gdn = layers[kinds.index("GatedDeltaNet")]
    explained = torch._dynamo.explain(TransformerLayer.forward)(
        gdn, hidden_states=torch.randn(48, 1, arch.lm.hidden_size), attention_mask=None,
        packed_seq_params=layer_rows(compiled, 48))
    assert explained.graph_break_count >= 1 and explained.op_count > 10
    assert all("torch.compiler.disable" in str(b.reason) for b in explained.break_reasons), explained.break_reasons
    # the graphs hold all but the conv and the delta rule: the gates and the gated RMSNorm too
    compiled_code = "\n".join(graph.code for graph in explained.graphs)
    for op in ("softplus", "sigmoid", "rsqrt", "silu"):
        assert op in compiled_code, op
    torch._dynamo.reset()
    for seed in range(3):
        pack = random_pack(seed)
        want, got = loss_and_grads(eager, pack), loss_and_grads(compiled, pack)
        assert torch.equal(got[0], want[0]), seed
        assert got[1].keys() == want[1].keys()
        for name, grad in want[1].items():
            torch.testing.assert_close(got[1][name], grad, rtol=1e-5, atol=1e-6, msg=f"{seed} {name}")


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
    from tests.helpers.models import tiny_qwen3_vl_moe

    arch = ModelArch.from_hf_config(tiny_qwen3_vl_moe().config.to_dict())
    model = build_model(arch, transformer_config(arch, cpu=True), info)
    compile_model(model, backend="aot_eager")
    assert all(layer.compiled_forward is None for layer in model.language_model.decoder.layers)
    assert all(block._compiled_call_impl is not None for block in model.vision.blocks)


@pytest.mark.parametrize("seed", range(3))
def test_token_loss_is_cross_entropy_eager_and_compiled(seed):
    """`token_loss` (the TP = 1 loss `compile_model` compiles) is torch's cross-entropy of each
    row, value and gradient, on bf16 logits of random rows, vocabulary and targets."""
    from train.model.loss import token_loss

    g = torch.Generator().manual_seed(seed)
    rows, vocab = int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(2, 3000, (1,), generator=g))
    logits = (torch.randn(rows, 1, vocab, generator=g) * 4).bfloat16()
    target = torch.randint(0, vocab, (rows,), generator=g)
    grad_out = torch.randn(rows, generator=g)
    compiled = torch.compile(token_loss, dynamic=True, backend="aot_eager")
    results = []
    for fn in (token_loss, compiled,
               lambda x, y: F.cross_entropy(x[:, 0].float(), y, reduction="none")):
        x = logits.clone().requires_grad_()
        loss = fn(x, target)
        loss.backward(grad_out)
        results.append((loss, x.grad))
    (loss, grad), (compiled_loss, compiled_grad), (want, want_grad) = results
    assert torch.equal(compiled_loss, loss) and torch.equal(compiled_grad, grad)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.float(), want_grad.float(), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("recompute_vision, blocks, expected", [(None, None, 0), (False, None, 0), (True, None, 3),
                                                                (True, 1, 1), (True, 2, 2)])
def test_the_model_recomputes_the_vision_blocks_it_is_given(info, recompute_vision, blocks, expected):
    """`--recompute-vision` and `--recompute-vision-blocks` reach the tower: the first N of its
    3 blocks (all of them without N; none without vision recompute)."""
    from tests.helpers.models import tiny_qwen3_vl

    arch = ModelArch.from_hf_config(tiny_qwen3_vl().config.to_dict())
    model = build_model(arch, transformer_config(arch, cpu=True), info, recompute_vision=recompute_vision,
                        recompute_vision_blocks=blocks)
    assert len(model.vision.blocks) == 3 and model.vision.recompute_blocks == expected
