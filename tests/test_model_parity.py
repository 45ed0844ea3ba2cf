"""Megatron model == Hugging Face model, same weights, same packed batch (CPU, fp32).

Ours: HF weights -> `train.convert` -> `QwenVLModel` (megatron-core GPTModel, packed
attention, our M-RoPE and vision tower) on a THD pack from real shards.
Reference: the HF model on the same pack with its 4-row packed position ids (shown equal to
per-sample HF processing by test_pack_oracle). Logits at every real row and per-token losses
must agree to 1e-4; a wrong M-RoPE layout or a missing DeepStack injection must not.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_layer import TransformerLayer

from preprocess.examples import example_rows, write_jsonl
from preprocess.job import PreprocessConfig, run_preprocess
from shards_schema import open_shards
from tests.helpers.models import tiny_qwen2_5_vl, tiny_qwen3_vl, tiny_qwen3_vl_moe
from tests.helpers.parity import TOLERANCE, hf_inputs, our_forward, pick, pixel_values
from train import convert
from train.model.arch import ModelArch
from train.model.qwen_vl import transformer_config
from train.packed_batch import IGNORE_INDEX, assemble_pack
from train.parallel import build_model

# Model kinds; the MoE model reads Qwen3-VL data (the same processor and template).
HF_MODELS = {"qwen3-vl": tiny_qwen3_vl, "qwen2.5-vl": tiny_qwen2_5_vl, "qwen3-vl-moe": tiny_qwen3_vl_moe}


@pytest.fixture(scope="module", params=sorted(HF_MODELS))
def case(request, info, tmp_path_factory):
    kind = request.param
    family = kind.removesuffix("-moe")
    tmp = tmp_path_factory.mktemp(f"parity-{kind}")
    rows = example_rows(16, seed=11, family=family, size_range=(32, 112), video_rows=0.3)
    run_preprocess(PreprocessConfig(inputs=[str(write_jsonl(tmp / "rows.jsonl", rows))], out=str(tmp / "shards"),
                                    profile=family, workers=1, progress=False))
    shards = open_shards(tmp / "shards")
    hf = HF_MODELS[kind]()
    arch = ModelArch.from_hf_config(hf.config.to_dict())
    return kind, shards, hf, arch, megatron_model(hf, arch, info)


def megatron_model(hf, arch, info):
    model = build_model(arch, transformer_config(arch, cpu=True), info).eval()
    full = convert.hf_to_megatron(hf.state_dict(), arch)
    convert.load_into_model(model, convert.shard(full, arch, 1, 0, 1, 0))
    return model


def hf_logits(hf, shards, pack) -> torch.Tensor:
    with torch.no_grad():
        return hf(**hf_inputs(hf, shards, pack)).logits[0]


def our_outputs(model, shards, pack):
    with torch.no_grad():
        return our_forward(model, shards, pack, logits=True), our_forward(model, shards, pack)


@pytest.mark.parametrize("images", ["mixed", "some", "none", "videos"])
def test_logits_and_losses_match_hf(case, images):
    family, shards, hf, _, model = case
    pack = assemble_pack(pick(shards, images), pad_to_multiple=8, seq_len=None)
    ref = hf_logits(hf, shards, pack)
    logits, losses = our_outputs(model, shards, pack)
    real = np.concatenate([np.arange(s, s + n) for s, n in zip(pack.cu_seqlens_padded[:-1], pack.sample_lengths)])
    diff = (logits[real] - ref[real]).abs().max().item()
    assert diff < TOLERANCE, f"{family}: max |logit diff| {diff:.2e}"
    labels = torch.from_numpy(pack.labels)
    keep = labels != IGNORE_INDEX
    ref_losses = F.cross_entropy(ref[keep], labels[keep], reduction="none")
    assert (losses[keep] - ref_losses).abs().max().item() < TOLERANCE
    assert torch.all(losses[~keep] == 0)
    print(f"\n{family} {images}: max |logit diff| {diff:.2e} over {len(real)} rows")


def test_loss_on_target_rows_only(case):
    """`loss_rows` (the trainer passes the rows with a target, found on the host): the output
    layer sees only those rows, and the per-token losses and every gradient are the same as
    with logits for all rows."""
    _, shards, _, _, model = case
    pack = assemble_pack(pick(shards, "mixed"), pad_to_multiple=8)
    batch = pack.as_tensors()
    rows = torch.nonzero(batch.labels != IGNORE_INDEX)[:, 0]
    assert 0 < len(rows) < len(batch.labels)  # prompts, images and padding rows have no target
    seen = []
    hook = model.language_model.output_layer.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[0]))
    results = []
    try:
        for loss_rows in (None, rows):
            seen.clear()
            model.zero_grad(set_to_none=True)
            losses = model(batch.replace(loss_rows=loss_rows), pixel_values=pixel_values(shards, pack))
            (losses * torch.linspace(0.5, 1.5, len(losses))).sum().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            results.append((losses.detach(), grads, max(seen)))  # (called again in backward: recompute)
    finally:
        hook.remove()
        model.zero_grad(set_to_none=True)
    (full, full_grads, full_rows), (sel, sel_grads, sel_rows) = results
    assert full_rows == len(batch.labels) and sel_rows == len(rows)
    torch.testing.assert_close(sel, full, rtol=0, atol=1e-6)
    assert torch.all(sel[batch.labels == IGNORE_INDEX] == 0)
    assert full_grads.keys() == sel_grads.keys()
    for name, grad in full_grads.items():  # fp32; only the summation order of the GEMMs differs
        diff = (sel_grads[name] - grad).abs().max().item()
        assert diff <= 1e-5 * grad.abs().max().item() + 1e-12, f"{name}: max |grad diff| {diff:.2e}"


@pytest.mark.parametrize("images", ["mixed", "videos"])
def test_moe_routes_every_token_to_the_same_experts(case, images):
    """Router choices: megatron's TopKRouter picks HF's top-k experts on every row of the pack,
    in every layer, and gives them HF's weights (softmax, top-k, renormalised)."""
    kind, shards, hf, arch, model = case
    if not arch.lm.is_moe:
        pytest.skip("dense model: no router")
    pack = assemble_pack(pick(shards, images), pad_to_multiple=8, seq_len=None)
    theirs, ours = [], []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out: theirs.append(out[1:]))
             for layer in hf.model.language_model.layers]
    hooks += [layer.mlp.router.register_forward_hook(lambda m, a, out: ours.append(out))
              for layer in model.language_model.decoder.layers]
    try:
        hf_logits(hf, shards, pack)
        our_outputs(model, shards, pack)
    finally:
        for hook in hooks:
            hook.remove()
    layers = arch.lm.num_layers
    assert len(theirs) == layers and len(ours) == 2 * layers  # our_outputs runs the model twice
    for layer, ((hf_weights, hf_experts), (probs, routing_map)) in enumerate(zip(theirs, ours[:layers])):
        k = arch.lm.num_experts_per_tok
        assert torch.all(routing_map.sum(-1) == k)
        experts = torch.nonzero(routing_map)[:, 1].reshape(-1, k)  # ascending per row
        assert torch.equal(experts, hf_experts.sort(-1).values), f"layer {layer}: experts differ"
        weights = probs.gather(1, experts)
        want = hf_weights.gather(1, hf_experts.sort(-1).indices)
        torch.testing.assert_close(weights, want, rtol=0, atol=1e-6)
        assert len(experts) == len(pack.input_ids)


def test_moe_load_balancing_loss_is_hfs(case, info):
    """The reported load-balancing loss is HF's `load_balancing_loss_func` per layer (on the
    router logits of the same pack), averaged over layers; with a coefficient it reaches the
    routers' gradients, without one it does not exist."""
    from megatron.core.transformer.moe import moe_utils
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import load_balancing_loss_func

    from train.model.moe import load_balancing_loss

    kind, shards, hf, arch, _ = case
    if not arch.lm.is_moe:
        pytest.skip("dense model: no router")
    pack = assemble_pack(pick(shards, "mixed"), pad_to_multiple=8, seq_len=None)
    logits = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out: logits.append(out[0]))
             for layer in hf.model.language_model.layers]
    try:
        hf_logits(hf, shards, pack)
    finally:
        for hook in hooks:
            hook.remove()
    k, experts = arch.lm.num_experts_per_tok, arch.lm.num_experts
    moe_utils.get_moe_layer_wise_logging_tracker().clear()  # megatron's tracker is process-wide
    want = np.mean([float(load_balancing_loss_func((layer,), experts, k)) for layer in logits])
    router_grads = {}
    for coef in (0.0, 0.5):
        model = build_model(arch, transformer_config(arch, cpu=True, moe_aux_loss_coef=coef,
                                                     calculate_per_token_loss=True), info).train()
        convert.load_into_model(model, convert.shard(convert.hf_to_megatron(hf.state_dict(), arch), arch, 1, 0, 1, 0))
        # no padding mask: HF's balancing loss counts every row, the padding ones too
        losses = model(pack.as_tensors().replace(padding_mask=None), pixel_values=pixel_values(shards, pack))
        losses.sum().backward()
        got = load_balancing_loss(1, k)
        if coef:
            assert got == pytest.approx(want, rel=1e-5)
        else:
            assert got is None
        router_grads[coef] = model.language_model.decoder.layers[0].mlp.router.weight.grad.clone()
    assert (router_grads[0.5] - router_grads[0.0]).abs().max() > 1e-6


def test_wrong_mrope_layout_is_detected(case, info):
    """Negative control: the other family's frequency layout changes the logits of image samples."""
    _, shards, hf, arch, _ = case
    lm = dataclasses.replace(arch.lm, mrope_interleaved=not arch.lm.mrope_interleaved)
    wrong = megatron_model(hf, dataclasses.replace(arch, lm=lm), info)
    pack = assemble_pack(pick(shards, "some"))
    diff = (our_outputs(wrong, shards, pack)[0] - hf_logits(hf, shards, pack)).abs().max().item()
    assert diff > 1e-3


def test_deepstack_changes_the_output(case):
    _, shards, _, arch, model = case
    layer = model.language_model.decoder.layers[0]
    if not arch.num_deepstack:  # Qwen2.5-VL: megatron's layer and nothing added
        assert type(layer).__mro__[1] is TransformerLayer
        return
    pack = assemble_pack(pick(shards, "some"))
    logits, _ = our_outputs(model, shards, pack)
    original = type(layer).forward
    try:  # run the same layers without the injection
        type(layer).forward = type(layer).__mro__[1].forward
        plain, _ = our_outputs(model, shards, pack)
    finally:
        type(layer).forward = original
    assert (logits - plain).abs().max().item() > 1e-3


def test_image_count_mismatch_is_a_clear_error(case):
    _, shards, _, arch, model = case
    pack = assemble_pack(pick(shards, "some", 1))
    batch = pack.as_tensors().replace(image_grid_thw=torch.tensor([[1, 2, 2]]))
    pv = torch.zeros(4, 3 * 2 * arch.vision.patch_size ** 2)
    with pytest.raises(ValueError, match="image_pad"):
        model(batch, pixel_values=pv, return_logits=True)


def test_bf16_model_holds_every_parameter_in_bf16(case, info):
    """megatron's local spec builds torch.nn.RMSNorm in fp32 whatever params_dtype says; with an
    fp32 gain next to bf16 activations torch.rms_norm silently falls back to a slow, memory-hungry
    fp32 composite. The model casts its norms, so a bf16 model is bf16 throughout and its norms
    take the fused path (which warns on a dtype mismatch: turned into an error here)."""
    _, shards, _, arch, _ = case
    model = build_model(arch, transformer_config(arch, cpu=True, params_dtype=torch.bfloat16, bf16=True), info)
    norms = [m for m in model.language_model.modules() if isinstance(m, torch.nn.RMSNorm)]
    assert len(norms) >= 2 * arch.lm.num_layers + 1  # input + pre-MLP per layer, and the final norm
    dtypes = {name: p.dtype for name, p in model.named_parameters() if p.dtype != torch.bfloat16}
    assert not dtypes, f"parameters not in bf16: {dtypes}"
    pack = assemble_pack(pick(shards, "mixed"))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*Mismatch dtype.*")
        logits, losses = our_outputs(model, shards, pack)
    assert torch.isfinite(logits).all() and torch.isfinite(losses).all()


@pytest.mark.parametrize("layers, method, count", [(None, "uniform", 1), (1, "block", 1), (99, "uniform", 1)])
def test_recompute_layers_maps_to_megatron_block_recompute(case, layers, method, count):
    """--recompute full --recompute-layers N: the first N decoder layers of a stage are recomputed
    (megatron's block method); N at or above the stage's layers, or unset, is every layer."""
    arch = case[3]
    config = transformer_config(arch, cpu=True, recompute="full", recompute_layers=layers)
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", method, count)
    assert transformer_config(arch, cpu=True).recompute_granularity is None
    with pytest.raises(ValueError, match="recompute_layers 0"):
        transformer_config(arch, cpu=True, recompute="full", recompute_layers=0)
