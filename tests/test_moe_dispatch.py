"""`LocalTokenDispatcher` (every expert on one rank) against megatron's own token routing: the
permutation of `expert_order` equals megatron's `permute` / `unpermute` on random routings,
forward and backward, and a whole Mixture-of-Experts model (Qwen3-VL MoE; Qwen3.5 MoE with
its shared expert) computes with it the losses and gradients it computes with megatron's
all-to-all dispatcher (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import permute, unpermute

from tests.helpers.model_pairs import loss_and_grads, random_pack
from tests.helpers.models import tiny_qwen3_5_moe, tiny_qwen3_vl_moe
from train.model.arch import ModelArch
from train.model.moe import (DecoderMoELayer, HostAlltoAllTokenDispatcher, LocalTokenDispatcher, _PermuteToExperts,
                             _UnpermuteFromExperts, expert_order)
from train.model.qwen_vl import transformer_config
from train.parallel import build_model


def _routing(seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens, experts = int(torch.randint(1, 80, (1,), generator=g)), int(torch.randint(2, 20, (1,), generator=g))
    topk, hidden = int(torch.randint(1, experts + 1, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g))
    logits = torch.randn(tokens, experts, generator=g)
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, logits.topk(topk, dim=1).indices, True)
    probs = torch.softmax(logits, dim=1) * routing_map
    return routing_map, probs, topk, torch.randn(tokens, hidden, generator=g), g


@pytest.mark.parametrize("seed", range(8))
def test_expert_order_is_megatrons_permutation_forward_and_backward(seed):
    routing_map, probs, topk, hidden, g = _routing(seed)
    token_of_row, row_of_slot, tokens_per_expert, row_probs = expert_order(routing_map, probs, topk)
    x = hidden.clone().requires_grad_()
    ours = _PermuteToExperts.apply(x, token_of_row, row_of_slot, topk)
    theirs, their_probs, mapping = permute(x, routing_map, probs=probs, num_out_tokens=routing_map.shape[0] * topk)
    assert torch.equal(ours, theirs) and torch.equal(row_probs, their_probs)
    assert torch.equal(tokens_per_expert, routing_map.sum(0))
    grad_rows = torch.randn(ours.shape, generator=g)
    (ours_grad,), (their_grad,) = (torch.autograd.grad(out, x, grad_rows) for out in (ours, theirs))
    torch.testing.assert_close(ours_grad, their_grad, rtol=1e-6, atol=1e-6)

    rows = grad_rows.clone().requires_grad_()
    ours = _UnpermuteFromExperts.apply(rows, token_of_row, row_of_slot, topk)
    theirs = unpermute(rows, mapping, restore_shape=hidden.shape, routing_map=routing_map)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    grad_tokens = torch.randn(hidden.shape, generator=g)
    (ours_grad,), (their_grad,) = (torch.autograd.grad(out, rows, grad_tokens) for out in (ours, theirs))
    assert torch.equal(ours_grad, their_grad)


@pytest.mark.parametrize("family", ["qwen3-vl-moe", "qwen3.5-moe"])
def test_moe_model_computes_with_the_local_dispatcher_what_it_computes_with_megatrons(info, family):
    hf = {"qwen3-vl-moe": tiny_qwen3_vl_moe, "qwen3.5-moe": tiny_qwen3_5_moe}[family]()
    arch = ModelArch.from_hf_config(hf.config.to_dict())
    config = transformer_config(arch, cpu=True)
    torch.manual_seed(0)
    local, all_to_all = (build_model(arch, config, info) for _ in range(2))
    all_to_all.load_state_dict(local.state_dict())
    layers = [m for m in all_to_all.modules() if isinstance(m, DecoderMoELayer)]
    assert layers and all(isinstance(m.token_dispatcher, LocalTokenDispatcher) for m in layers)
    for layer in layers:
        layer.token_dispatcher = HostAlltoAllTokenDispatcher(layer.num_local_experts, layer.local_expert_indices,
                                                             config=config, pg_collection=layer.pg_collection)
    for seed in range(2):
        pack = random_pack(seed, vocab=arch.lm.vocab_size)
        (loss, grads), (want_loss, want_grads) = loss_and_grads(local, pack), loss_and_grads(all_to_all, pack)
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
        assert grads.keys() == want_grads.keys()
        for name, grad in want_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
