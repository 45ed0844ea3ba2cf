"""Pairs of our model with the same weights (eager and a variant of it: compiled, with gradient
buffers, adapters or FP8 linears), random packs to run them on, and a pack's loss and gradients,
for comparing the two bitwise."""

from __future__ import annotations

import torch

from tests.helpers.models import TINY_MODELS, tiny_qwen3_5
from train.model import lora
from train.model.arch import ModelArch
from train.model.batch import PackedBatch
from train.model.linear import use_fp8, use_grad_buffers
from train.model.qwen_vl import transformer_config
from train.parallel import build_model


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
    arch = ModelArch.from_hf_config({**TINY_MODELS, "qwen3.5": tiny_qwen3_5}[kind]().config.to_dict())
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
            assert use_grad_buffers(model) == 4 * arch.lm.num_layers + 1  # and the output layer
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

