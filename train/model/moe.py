"""Mixture-of-Experts decoder MLPs on megatron-core, without Transformer Engine.

The layer is megatron-core's own `MoELayer`: its `TopKRouter` (top-k of the logits, softmax
over those k: the same weights as HF's softmax over all experts, top-k, renormalised), its
token dispatcher (all-to-all over the expert-parallel group; `HostMoELayer` runs it on CPU)
and its load-balancing loss. With every expert on one rank, tokens reach the experts through
`LocalTokenDispatcher` instead, which never waits for the GPU.
The experts are megatron's `GroupedMLP` (its parameters, their grouped layout, EP/ETP
sharding and initialisation) with the grouped GEMM done by torch (`grouped_mm`): megatron's
own kernel comes from the separately built `grouped_gemm` package, and the TE variant needs
Transformer Engine.

`GroupedMLP` holds each rank's local experts as two matrices: `weight1` [H, E_local * 2F]
(viewed [E_local, H, 2F]: each expert's [gate | up] columns) and `weight2` [E_local * F, H]
(viewed [E_local, F, H]). That is the layout of the Hugging Face Qwen3-VL MoE checkpoints'
`experts.gate_up_proj` / `experts.down_proj` tensors, so conversion is a reshape.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe import grouped_gemm_util, moe_utils
from megatron.core.transformer.moe.experts import GroupedMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher, MoETokenDispatcher
from megatron.core.utils import get_pg_size
from torch import Tensor

from train.model.linear import ColumnParallelLinear, RowParallelLinear

# megatron's router uses TE's GEMM whenever the name is bound, and 0.16.1 leaves it unbound
# without TE (NameError); None selects its torch.mm path.
if not getattr(moe_utils, "HAVE_TE", False):
    moe_utils.te_general_gemm = None


def grouped_mm(x: Tensor, weight: Tensor, tokens_per_expert: Tensor, per_expert: bool = False) -> Tensor:
    """[N, K] rows grouped by expert (counts `tokens_per_expert` [E]) times weight [E, K, M] -> [N, M].

    One `torch._grouped_mm` on CUDA in bf16 (Hopper and newer); elsewhere, or with
    `per_expert`, one GEMM per expert, as megatron's SequentialMLP runs them (an expert with no
    rows still gets its zero gradient)."""
    if not per_expert and x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        offsets = tokens_per_expert.to(device=x.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return torch._grouped_mm(x, weight, offs=offsets)
    counts = tokens_per_expert.tolist()
    return torch.cat([part @ w for part, w in zip(x.split(counts), weight)])


@contextmanager
def _torch_grouped_gemm():
    """`GroupedMLP.__init__` asserts that the `grouped_gemm` package is importable; the GEMMs
    of `TorchGroupedMLP` are torch's, so the check is answered for the constructor only."""
    saved = grouped_gemm_util.grouped_gemm
    grouped_gemm_util.grouped_gemm = grouped_gemm_util.grouped_gemm or True
    try:
        yield
    finally:
        grouped_gemm_util.grouped_gemm = saved


class TorchGroupedMLP(GroupedMLP):
    """megatron's `GroupedMLP` whose forward runs `grouped_mm`, in any dtype (megatron's
    forward asserts bf16). The routing weight multiplies the SwiGLU output, before the second
    GEMM, as megatron does (HF multiplies after it: the same value up to rounding)."""

    def __init__(self, num_local_experts: int, config, pg_collection=None):
        with _torch_grouped_gemm():  # outside a MoELayer (tests, benchmarks): megatron's default groups
            super().__init__(num_local_experts, config,
                             pg_collection=pg_collection or moe_utils.get_default_pg_collection())
        self.per_expert = False  # one GEMM per expert even where the grouped GEMM runs (tests, benchmarks)
        if config.sequence_parallel and not self.expert_parallel:
            # Each TP rank routes only its own rows to these experts, which every TP rank holds
            # whole; with one expert-parallel rank megatron's DDP reduces them over the
            # data-parallel ranks alone. Marked like the norms, `finalize_model_grads` also sums
            # their gradients over the TP ranks, and the gradient norm counts them once, not
            # once per TP rank. (With --ep > 1 megatron reduces experts over the ranks that hold
            # the same ones, the TP ranks among them.)
            for weight in (self.weight1, self.weight2):
                weight.sequence_parallel, weight.tensor_model_parallel = True, False

    def forward(self, hidden: Tensor, tokens_per_expert: Tensor, probs: Tensor):
        hidden_size = self.config.hidden_size
        w1 = self.weight1.view(self.num_local_experts, hidden_size, -1)
        w2 = self.weight2.view(self.num_local_experts, -1, hidden_size)
        gate, up = grouped_mm(hidden, w1, tokens_per_expert, self.per_expert).chunk(2, dim=-1)
        inner = (F.silu(gate) * up * probs.unsqueeze(-1)).to(hidden.dtype)
        return grouped_mm(inner, w2, tokens_per_expert, self.per_expert), None


@contextmanager
def _no_dtoh_stream():
    """megatron's all-to-all dispatcher creates a CUDA stream (for its device-to-host copies of
    the routing counts) when the first one is built; on the host a placeholder stands in while
    one is built, never used (`HostAlltoAllTokenDispatcher`)."""
    saved = MoEAlltoAllTokenDispatcher.cuda_dtoh_stream
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = saved or object()
    try:
        yield
    finally:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = saved


class HostAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """megatron's all-to-all token dispatcher for CPU runs (gloo): the routing counts are on the
    host already, so the device-to-host copies and their stream are left out; the split sizes
    become numpy arrays as megatron's copies make them."""

    def __init__(self, *args, **kwargs):
        with _no_dtoh_stream():
            super().__init__(*args, **kwargs)

    def _maybe_dtoh_and_synchronize(self, point: str, tokens_per_expert: Tensor | None = None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name, None)
                if torch.is_tensor(value):
                    setattr(self, name, value.numpy())
        return tokens_per_expert


class _PermuteToExperts(torch.autograd.Function):
    """Token rows [T, H] -> one row per (token, chosen expert) [T*k, H], grouped by expert:
    row r is token `token_of_row[r]`. The backward gathers each token's k row gradients
    (`row_of_slot`: the row of slot t*k + j) and sums them: gathers only, no atomic adds."""

    @staticmethod
    def forward(ctx, hidden: Tensor, token_of_row: Tensor, row_of_slot: Tensor, topk: int):
        ctx.save_for_backward(row_of_slot)
        ctx.topk = topk
        return hidden.index_select(0, token_of_row)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (row_of_slot,) = ctx.saved_tensors
        return _sum_slots(grad, row_of_slot, ctx.topk), None, None, None


class _UnpermuteFromExperts(torch.autograd.Function):
    """`_PermuteToExperts`' inverse: each token's sum of its k expert rows [T*k, H] -> [T, H]."""

    @staticmethod
    def forward(ctx, rows: Tensor, token_of_row: Tensor, row_of_slot: Tensor, topk: int):
        ctx.save_for_backward(token_of_row)
        return _sum_slots(rows, row_of_slot, topk)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (token_of_row,) = ctx.saved_tensors
        return grad.index_select(0, token_of_row), None, None, None


def _sum_slots(rows: Tensor, row_of_slot: Tensor, topk: int) -> Tensor:
    """[T*k, H] rows -> [T, H]: token t's sum over its slots t*k .. t*k + k-1, each slot's row
    `row_of_slot` (bf16 summed in fp32, rounded once)."""
    return rows.index_select(0, row_of_slot).view(-1, topk, rows.shape[-1]).sum(1)


def expert_order(routing_map: Tensor, probs: Tensor, topk: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Where each token's rows go for the experts, from the router's `routing_map` [T, E]
    (exactly `topk` experts per token: dropless routing) and `probs` [T, E]:
    (token_of_row [T*k], row_of_slot [T*k], tokens_per_expert [E], probs of the rows [T*k]).
    Rows are grouped by expert, tokens ascending within each: megatron's permutation order, so
    each expert gets the rows megatron's dispatcher gives it. No value goes to the host."""
    experts = torch.sort(routing_map.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :topk]
    slot_of_row = torch.sort(experts.reshape(-1), stable=True).indices  # slot t*k + j of each row
    row_of_slot = torch.empty_like(slot_of_row).index_copy_(
        0, slot_of_row, torch.arange(slot_of_row.numel(), device=slot_of_row.device))
    row_probs = probs.gather(1, experts).reshape(-1).index_select(0, slot_of_row)
    return slot_of_row // topk, row_of_slot, routing_map.sum(0), row_probs


class LocalTokenDispatcher(MoETokenDispatcher):
    """megatron's token-dispatcher interface for one expert-parallel and one expert-TP rank,
    where every expert is local and nothing is exchanged. megatron's all-to-all dispatcher
    there still copies the routing counts to the host (a sync per layer and pass), finds the
    rows by `masked_select` (another) and sums the experts' outputs back with `scatter_add`
    (atomic adds; bf16 ones in bf16 runs). Here the rows are found by two sorts on the device
    (`expert_order`), the counts stay there for the grouped GEMM's offsets, and both directions
    are gathers (`_PermuteToExperts`, `_UnpermuteFromExperts`)."""

    def dispatch_preprocess(self, hidden_states: Tensor, routing_map: Tensor, probs: Tensor):
        self.hidden_shape = hidden_states.shape
        hidden = hidden_states.view(-1, hidden_states.shape[-1])
        topk = self.config.moe_router_topk
        self.token_of_row, self.row_of_slot, self.tokens_per_expert, row_probs = expert_order(routing_map, probs, topk)
        return _PermuteToExperts.apply(hidden, self.token_of_row, self.row_of_slot, topk), row_probs

    def token_dispatch(self, hidden_states: Tensor, probs: Tensor):
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: Tensor, probs: Tensor):
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return hidden_states, tokens_per_expert, probs

    def combine_preprocess(self, hidden_states: Tensor) -> Tensor:
        return hidden_states

    def token_combine(self, hidden_states: Tensor) -> Tensor:
        return hidden_states

    def combine_postprocess(self, hidden_states: Tensor) -> Tensor:
        output = _UnpermuteFromExperts.apply(hidden_states, self.token_of_row, self.row_of_slot,
                                             self.config.moe_router_topk)
        self.token_of_row = self.row_of_slot = None
        return output.view(self.hidden_shape)


def _one_expert_rank(pg_collection) -> bool:
    return get_pg_size(pg_collection.ep) == 1 and get_pg_size(pg_collection.expt_tp) == 1


class DecoderMoELayer(MoELayer):
    """megatron's `MoELayer`. With one expert-parallel and one expert-TP rank its tokens reach
    the experts through `LocalTokenDispatcher`; otherwise through megatron's all-to-all
    dispatcher, on CPU runs (`host`) `HostAlltoAllTokenDispatcher` over gloo. (megatron's
    all-gather dispatcher, which needs no CUDA, requires every expert-parallel rank to hold
    the same number of tokens; packs differ.)"""

    host = False

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None):
        pg_collection = pg_collection or moe_utils.get_default_pg_collection()
        local = _one_expert_rank(pg_collection)
        with _no_dtoh_stream() if local or self.host else nullcontext():
            super().__init__(config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection)
        self.pg_collection = pg_collection
        if local:  # its rows assume every token routed to exactly top-k experts: no drops, no padding
            assert config.moe_expert_capacity_factor is None and not config.moe_router_padding_for_quantization
            self.token_dispatcher = LocalTokenDispatcher(config=config, pg_collection=pg_collection)
        elif self.host:
            self.token_dispatcher = HostAlltoAllTokenDispatcher(self.num_local_experts, self.local_expert_indices,
                                                                config=config, pg_collection=pg_collection)


class HostMoELayer(DecoderMoELayer):
    """`DecoderMoELayer` of a CPU run."""

    host = True


def moe_layer_spec(base_spec, cpu: bool):
    """`base_spec` (megatron's local layer spec built with num_experts) with its experts
    replaced by `TorchGroupedMLP`, and its layer by `DecoderMoELayer` (CPU runs: `HostMoELayer`). A shared expert
    (built when the config sets `moe_shared_expert_intermediate_size`) is megatron's
    `SharedExpertMLP` on the decoder's linears (`train.model.linear`)."""
    experts = base_spec.submodules.mlp.submodules.experts
    experts.module, experts.submodules = TorchGroupedMLP, None
    shared = base_spec.submodules.mlp.submodules.shared_experts
    if shared is not None:
        shared.submodules.linear_fc1, shared.submodules.linear_fc2 = ColumnParallelLinear, RowParallelLinear
    base_spec.submodules.mlp.module = HostMoELayer if cpu else DecoderMoELayer
    return base_spec


def moe_config(lm, ep: int, aux_loss_coef: float) -> dict:
    """TransformerConfig fields of the MoE layers for language model `lm` (an `LMArch`), with
    the router's load-balancing loss weighted `aux_loss_coef` (HF's router_aux_loss_coef; 0: none)."""
    return dict(
        num_moe_experts=lm.num_experts, moe_router_topk=lm.num_experts_per_tok,
        moe_ffn_hidden_size=lm.moe_intermediate_size, expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
        moe_router_pre_softmax=False, moe_router_score_function="softmax", moe_router_dtype="fp32",
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False, moe_permute_fusion=False,
        moe_router_fusion=False, moe_router_load_balancing_type="aux_loss" if aux_loss_coef else "none",
        # megatron's per-layer switch loss is coeff * E/k * sum(f * P) with f summing to k; HF's
        # is coef * E * sum(f * P): the same value per layer with coeff = coef * k. HF pools
        # the layers before the product; megatron sums per layer, so each layer gets 1/L.
        moe_aux_loss_coeff=aux_loss_coef * lm.num_experts_per_tok / lm.num_layers,
        # the shared expert: a SwiGLU of this width on every token, scaled by sigmoid(x @ gate^T)
        # (HF's `shared_expert` and `shared_expert_gate`), added to the routed experts' output
        moe_shared_expert_intermediate_size=lm.shared_expert_intermediate_size or None,
        moe_shared_expert_gate=bool(lm.shared_expert_intermediate_size),
    )


def load_balancing_loss(num_micro_batches: int, topk: int) -> float | None:
    """The step's load-balancing loss in HF's units (`load_balancing_loss_func` of one layer),
    averaged over MoE layers and micro-batches, from megatron's tracker (which holds each
    layer's switch loss / coeff, summed over micro-batches); None when no layer recorded one.
    Reduced over pipeline stages and data-parallel ranks; the tracker is cleared for the next step."""
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    if "load_balancing_loss" not in tracker:
        return None
    moe_utils.reduce_aux_losses_tracker_across_ranks(["load_balancing_loss"])
    values = tracker["load_balancing_loss"]["values"]
    value = float(values.mean()) * topk / max(num_micro_batches, 1)
    moe_utils.clear_aux_losses_tracker()
    return value
