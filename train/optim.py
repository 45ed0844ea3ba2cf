"""Optimizer construction: megatron's on GPUs, the same AdamW update on CPU.

megatron-core's optimizers (FP32Optimizer, DistributedOptimizer, grad-norm clipping) place
small state tensors on "cuda" unconditionally, so on a machine without CUDA (tests, smoke
runs) `CpuAdamW` does the same thing with torch.optim.AdamW: gradients from megatron DDP's
`main_grad` buffers, megatron's weight-decay rule (no decay on biases and norm weights),
global-norm clipping with the norm summed over the model-parallel group and each
TP-replicated parameter counted once. Same interface as the part of MegatronOptimizer the
trainer uses.

`--adam-state-dtype bf16` swaps the inner torch AdamW (megatron's or `CpuAdamW`'s) for
`train.adamw_bf16_state.AdamWBf16State`: the same update on the same fp32 master weights,
with the two Adam moments stored in bf16 (4 bytes per parameter instead of 8). Under megatron's
DistributedOptimizer `use_fast_step` replaces its step's norm and clipping (and, with
AdamWBf16State, its fp32 copy of every gradient).

`--master-weights bf16` drops the fp32 master weights (4 bytes per parameter): AdamWBf16State
updates the model's bf16 weights themselves, stochastically rounded, its moments in the
`--adam-state-dtype` (on GPUs under megatron's distributed optimizer:
`distributed_optimizer_without_master_weights`). On CPU runs (fp32 compute) the weights stay
fp32 tensors kept at bf16 values (`bf16_values`).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from train.adamw_bf16_state import AdamWBf16State

# keys of torch.optim.AdamW's param groups that mean nothing to AdamWBf16State
_TORCH_ADAM_ONLY = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused",
                    "decoupled_weight_decay")


def _decays(name: str, param: torch.nn.Parameter) -> bool:
    return param.ndim > 1 and not name.endswith(".bias")


def _adamw_options(adam_state_dtype: str, master_weights: str, cuda: bool) -> dict | None:
    """AdamWBf16State's options for these settings; None where torch's AdamW makes the same
    update (fp32 master weights and moments; on bf16 weights it would round to nearest). On GPUs
    bf16 weights are bf16 tensors, rounded as such; a CPU run's are fp32 tensors at bf16 values."""
    if master_weights == "fp32" and adam_state_dtype == "fp32":
        return None
    return dict(bf16_values=master_weights == "bf16" and not cuda,
                state_dtype=torch.bfloat16 if adam_state_dtype == "bf16" else torch.float32)


class CpuAdamW:
    def __init__(self, model, config: OptimizerConfig, adam_state_dtype: str = "fp32", master_weights: str = "fp32"):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        groups = [{"params": [p for n, p in named if _decays(n, p)], "weight_decay": config.weight_decay},
                  {"params": [p for n, p in named if not _decays(n, p)], "weight_decay": 0.0, "wd_mult": 0.0}]
        options = _adamw_options(adam_state_dtype, master_weights, cuda=False)
        self.optimizer = (torch.optim.AdamW if options is None else functools.partial(AdamWBf16State, **options))(
            [g for g in groups if g["params"]], lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps)
        self.clip_grad = config.clip_grad

    @property
    def param_groups(self) -> list[dict]:
        # a property: torch's load_state_dict replaces the optimizer's list, and the LR
        # scheduler must set the learning rate in the live one
        return self.optimizer.param_groups

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def grad_norm(self) -> float:
        """Over every parameter once: a TP-split one summed over the model-parallel group, and
        an expert split over expert-parallel ranks (megatron marks those `allreduce=False`)
        summed over the expert and pipeline ranks that hold the other experts."""
        dense, experts = torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
        for p in self.params:
            if not getattr(p, "allreduce", True):
                experts += p.grad.double().pow(2).sum()
            elif param_is_not_tensor_parallel_duplicate(p):
                dense += p.grad.double().pow(2).sum()
        dist.all_reduce(dense, group=mpu.get_model_parallel_group())
        if mpu.get_expert_model_parallel_world_size() > 1:
            dist.all_reduce(experts, group=mpu.get_expert_tensor_model_pipeline_parallel_group())
        return float((dense + experts).sqrt())

    def step(self):
        for p in self.params:
            p.grad = p.main_grad
        norm = self.grad_norm()
        if self.clip_grad > 0 and norm > self.clip_grad:
            for p in self.params:
                p.grad.mul_(self.clip_grad / (norm + 1e-6))
        self.optimizer.step()
        return True, norm, None

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


def use_fused_adamw(optimizer) -> None:
    """Switch megatron's fallback torch AdamW (foreach: a few dozen kernels per parameter group
    and step) to torch's fused CUDA kernel (one pass over each tensor list). Without Transformer
    Engine or Apex megatron builds the torch optimizer with its defaults, which on CUDA means
    foreach; the update is the same. Set on the live groups, so the flag is saved with the
    optimizer state. Called again after a resume: a checkpoint written with bf16 moments
    (`AdamWBf16State`) carries no such flag and keeps its `step` counts on the host, where the
    fused kernel cannot read them."""
    for megatron_opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        opt = getattr(megatron_opt, "optimizer", None)
        if isinstance(opt, torch.optim.AdamW):
            opt.defaults.update(fused=True, foreach=False)
            for group in opt.param_groups:
                group.update(fused=True, foreach=False)
                for p in group["params"]:
                    state = opt.state.get(p)
                    if state and "step" in state:
                        state["step"] = state["step"].to(device=p.device, dtype=torch.float32)


def use_bf16_adam_state(optimizer, **options) -> None:
    """Replace megatron's inner torch AdamW (still without state) by `AdamWBf16State` (with
    `options`, see there) on the same parameter groups: megatron's wrappers (distributed
    optimizer, clipping, checkpoint gathering) read `.optimizer.param_groups` /
    `.optimizer.state` and work unchanged."""
    for megatron_opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = megatron_opt.optimizer
        assert isinstance(inner, torch.optim.AdamW) and not inner.state, type(inner)
        groups = [{k: v for k, v in g.items() if k not in _TORCH_ADAM_ONLY} for g in inner.param_groups]
        megatron_opt.optimizer = AdamWBf16State(groups, fused=True, **options)
        megatron_opt.init_state_fn = lambda opt, config=None: opt.init_state()


def distributed_optimizer_without_master_weights(model, config: OptimizerConfig):
    """megatron's DistributedOptimizer whose inner optimizer holds shards of the model's own
    bf16 weights instead of fp32 copies of them (`--master-weights bf16`); its inner torch
    AdamW is still to be replaced by `AdamWBf16State` (`use_bf16_adam_state`), which rounds
    bf16 weights stochastically.

    megatron builds this layout for its precision-aware optimizer (Transformer Engine's
    FusedAdam, which keeps the master weights itself): `use_precision_aware_optimizer_no_fp8_or_ds_fp8`
    makes `_build_model_and_main_param_groups` allocate no fp32 main shards and give the inner
    optimizer the bf16 shards, views of DDP's parameter buffer, which the step's all-gather then
    sends to the other data-parallel ranks. The flag is set only while the optimizer is built
    (its only reader there); everywhere else it would call FusedAdam's methods. Megatron's
    fp32-main groups are then pointed at those same bf16 shards, so its copies between main and
    model params copy a shard onto itself, `zero_grad` finds them, and its checkpoint code saves
    and restores them as each parameter's "param" state (values, cast to fp32 in the file and
    back exactly). The Adam moments stay sharded over the data-parallel ranks."""
    if not config.use_distributed_optimizer:
        raise ValueError("bf16 master weights on GPUs are built on megatron's distributed optimizer")
    config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
    try:
        optimizer = get_megatron_optimizer(config, [model])
    finally:
        config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = False
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(sub, DistributedOptimizer) and not sub.is_stub_optimizer:
            sub.shard_fp32_from_float16_groups = sub.shard_float16_groups
    return optimizer


def global_grad_norm(grads: list[torch.Tensor], group) -> float:
    """L2 norm of all `grads` (any float dtype, accumulated in fp32) over the process `group`:
    one multi-tensor norm, one all-reduce and one host sync (megatron's fallback without Apex
    or Transformer Engine syncs once per tensor)."""
    if grads:
        squares = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum()
    else:
        squares = torch.zeros((), dtype=torch.float32, device=torch.cuda.current_device())
    dist.all_reduce(squares, group=group)
    return float(squares.sqrt())


def use_fast_step(optimizer) -> None:
    """megatron's DistributedOptimizer step, without what its fallbacks for missing Apex /
    Transformer Engine cost: the gradient norm there syncs the host once per tensor, and
    clipping allocates a scaled copy of each gradient. Here the norm is one multi-tensor pass
    and one sync (`global_grad_norm`, the same quantity: each parameter counted once across
    tensor-parallel ranks and shared copies), and clipping is one in-place foreach multiply (the
    same fp32 multiply megatron does), so the update is unchanged.

    With `AdamWBf16State` inside, the update also reads each fp32 master shard's gradient
    straight from megatron's (bf16 or fp32) gradient buffer, as `decoupled_grad`, instead of
    from the fp32 copy megatron makes of every gradient before the step (4 bytes per parameter,
    all alive at once: 8 GiB at 2B parameters); clipping is then folded into the update
    (`AdamWBf16State.grad_scale`), so the gradients are not written either. Megatron's own route
    to this is its precision-aware optimizer, which needs Transformer Engine's FusedAdam.

    Two methods of the live objects are replaced: the (chained) optimizer's `step`, and for
    AdamWBf16State each distributed optimizer's gradient copy (`read_grads_in_place`)."""
    # stub optimizers hold no parameters on this rank; megatron's prepare/step skip them
    subs = [sub for sub in getattr(optimizer, "chained_optimizers", [optimizer]) if not sub.is_stub_optimizer]
    if not all(isinstance(sub, DistributedOptimizer) and sub.grad_scaler is None for sub in subs):
        raise TypeError("use_fast_step: needs megatron DistributedOptimizer(s) without a loss scaler "
                        "(bf16 or fp32 training)")

    def grads(sub: DistributedOptimizer, for_norm: bool) -> list[torch.Tensor]:
        tp_group = getattr(sub, "tp_group", None)
        return [g for p in sub.get_parameters() if (g := AdamWBf16State.gradient(p)) is not None
                and (not for_norm or (param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p, tp_group)))]

    @torch.no_grad()
    def step():
        for sub in subs:
            sub.prepare_grads()  # no loss scaler, so no inf check to act on
        norm = global_grad_norm([g for sub in subs for g in grads(sub, for_norm=True)],
                                subs[0].get_grad_stats_parallel_group())
        for sub in subs:
            clip = sub.config.clip_grad
            coefficient = clip / (norm + 1.0e-6) if clip > 0 else 1.0  # megatron's rule
            if isinstance(sub.optimizer, AdamWBf16State):
                sub.optimizer.grad_scale = min(coefficient, 1.0)
            elif coefficient < 1.0:
                torch._foreach_mul_(grads(sub, for_norm=False), coefficient)
        return optimizer.step_with_ready_grads(), norm, None

    for sub in subs:
        if isinstance(sub.optimizer, AdamWBf16State):
            read_grads_in_place(sub)
    optimizer.step = step


def read_grads_in_place(sub: DistributedOptimizer) -> None:
    """Make `sub`'s gradient copy point each main shard's `decoupled_grad` at its span of
    megatron's gradient buffer (read by AdamWBf16State in the buffer's dtype) instead of
    writing an fp32 `.grad` copy."""
    def point_at_grad_buffer() -> None:
        for model_groups, shard_groups in ((sub.model_float16_groups, sub.shard_fp32_from_float16_groups),
                                           (sub.model_fp32_groups, sub.shard_fp32_groups)):
            for model_group, shard_group in zip(model_groups, shard_groups):
                for model_param, shard_param in zip(model_group, shard_group):
                    span = sub._get_model_param_range_map(model_param)["param"]
                    shard_param.decoupled_grad = model_param.main_grad.view(-1)[span.start:span.end]

    sub._copy_model_grads_to_main_grads = point_at_grad_buffer


def build_optimizer(model, config: OptimizerConfig, cuda: bool, adam_state_dtype: str = "fp32",
                    fast_step: bool = True, master_weights: str = "fp32"):
    """`adam_state_dtype`: fp32 (torch's AdamW) | bf16 (`AdamWBf16State`). `master_weights`:
    fp32 (megatron's fp32 copy of every bf16 weight) | bf16 (none: `AdamWBf16State` updates the
    bf16 weights; on GPUs megatron's distributed optimizer, always with `use_fast_step`, whose
    gradient norm reads the gradients in place). `fast_step`: with megatron's distributed
    optimizer, `use_fast_step` (False: megatron's own step, for A/B)."""
    if not cuda:
        return CpuAdamW(model, config, adam_state_dtype, master_weights)
    options = _adamw_options(adam_state_dtype, master_weights, cuda=True)
    if master_weights == "bf16":
        optimizer = distributed_optimizer_without_master_weights(model, config)
        fast_step = True  # megatron's own step copies each gradient to an fp32 `.grad`, which a bf16 shard cannot hold
    else:
        optimizer = get_megatron_optimizer(config, [model])
    if options is None:
        use_fused_adamw(optimizer)
    else:
        use_bf16_adam_state(optimizer, **options)
    if fast_step and config.use_distributed_optimizer:
        use_fast_step(optimizer)
    return optimizer
