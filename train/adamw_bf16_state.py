"""`AdamWBf16State`: AdamW on fp32 master weights with its two moments stored in bf16 (or on
the bf16 weights themselves, with no fp32 master copy).

torch.optim.AdamW keeps `exp_avg` / `exp_avg_sq` in the parameter's dtype: 8 bytes per fp32
parameter, 16 GiB for Qwen3-VL-2B. Here they take 4 bytes. The update itself is torch's
AdamW formula computed in fp32; only the stored moments are rounded, and stochastically
(`stochastic_round_bf16`), so increments below half a bf16 step still add up on average.
megatron-core offers bf16 moments only through Transformer Engine's FusedAdam
(`use_precision_aware_optimizer`), which cannot be installed on our GPU hosts.

On CUDA one Triton kernel updates every tensor of a parameter group in two launches (full
blocks, then each tensor's partial last block; the block -> tensor tables are built once), so
the step is bound by memory bandwidth, not by one launch per tensor. On CPU (tests, smoke
runs) `adamw_update` does the same per tensor in eager torch; it is also the oracle the GPU
kernel is tested against.

Gradients may be bf16 and may come from `param.decoupled_grad` instead of `param.grad` (torch
wants `.grad` in the parameter's dtype; megatron uses the same attribute name for this): the
kernel then reads megatron's bf16 gradient buffer where it lies, upcasting in registers,
instead of an fp32 copy of every gradient (`train.optim.use_fast_step`). `grad_scale`
multiplies the next step's gradients (gradient clipping folded into the update).

bf16 parameters (`--master-weights bf16`: no fp32 master weights at all): the update reads the
bf16 parameter, computes in fp32 and writes the parameter back stochastically rounded, as the
moments are, so an update below half a bf16 step of the weight (2^-9 of it: most updates at
fine-tuning learning rates) still moves it on average instead of being lost. A CPU run, which
computes in fp32, keeps fp32 parameters at bf16 values the same way (`bf16_values`).
`state_dtype` fp32 keeps the moments in fp32 (`--adam-state-dtype fp32` with bf16 parameters).
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor

BLOCK = 2048  # values per Triton program


def stochastic_round_bf16(x: Tensor) -> Tensor:
    """fp32 -> bf16, rounded up or down at random: up with probability equal to how far x lies
    from the bf16 value below it, so the expected result is x. Round-to-nearest would drop
    every Adam increment smaller than half a bf16 step (2^-9 of the value): with beta2 = 0.999
    the second moment moves by 1e-3 of itself per step and would stop moving.
    Bit trick: add 16 random bits below the bf16 mantissa, then cut them off."""
    noise = torch.randint_like(x, 1 << 16, dtype=torch.int32)
    return ((x.view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)


def adamw_scalars(lr: float, betas: tuple[float, float], eps: float, weight_decay: float, step: float) -> list[float]:
    """The step's scalars, computed in double on the host as torch's AdamW does (`1 - beta2`
    taken in fp32 from an fp32 beta2 would be off by ~1e-5 of itself):
    [beta1, 1 - beta1, beta2, 1 - beta2, eps, 1 - lr * wd, -lr / bias_correction1, sqrt(bias_correction2)]."""
    beta1, beta2 = betas
    return [beta1, 1 - beta1, beta2, 1 - beta2, eps, 1 - lr * weight_decay, -lr / (1 - beta1 ** step),
            (1 - beta2 ** step) ** 0.5]


def _store(dst: Tensor, value: Tensor, rounded: bool) -> None:
    """fp32 `value` into `dst`: stochastically rounded to bf16 where `rounded`, else as it is."""
    dst.copy_(stochastic_round_bf16(value) if rounded else value)


def adamw_update(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, scalars: list[float],
                 grad_scale: float = 1.0, bf16_value: bool = False) -> None:
    """One AdamW step of one tensor, in place (eager torch), computed in fp32; the gradient
    (fp32 or bf16) is multiplied by `grad_scale` in fp32 first, as megatron's clipping scales
    fp32 gradients. bf16 moments are stored stochastically rounded, fp32 ones as computed. The
    parameter is stored stochastically rounded to bf16 when it is a bf16 tensor or `bf16_value`
    (an fp32 tensor kept at bf16 values: `--master-weights bf16` on a CPU run)."""
    beta1, one_minus_beta1, beta2, one_minus_beta2, eps, decay, step_size, correction2_sqrt = scalars
    grad = grad.float() if grad_scale == 1.0 else grad.float() * grad_scale
    m = torch.lerp(exp_avg.float(), grad, one_minus_beta1)
    v = exp_avg_sq.float().mul_(beta2).addcmul_(grad, grad, value=one_minus_beta2)
    denominator = v.sqrt().div_(correction2_sqrt).add_(eps)
    _store(exp_avg, m, exp_avg.dtype == torch.bfloat16)
    _store(exp_avg_sq, v, exp_avg_sq.dtype == torch.bfloat16)
    if bf16_value or param.dtype != torch.float32:
        _store(param, param.float().mul(decay).addcdiv_(m, denominator, value=step_size), True)
    else:
        param.mul_(decay)
        param.addcdiv_(m, denominator, value=step_size)


@functools.cache
def _triton_kernel():
    """Compiled on first use: triton ships with CUDA builds of torch, not with CPU ones."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["seed"])  # a new seed each step must not mean a new compile
    def adamw_bf16_state_kernel(block_tensor, block_start, param_ptrs, grad_ptrs, exp_avg_ptrs, exp_avg_sq_ptrs,
                                numels, scalars, seed, BLOCK: tl.constexpr, TAIL: tl.constexpr,
                                GRAD_BF16: tl.constexpr, PARAM_BF16: tl.constexpr, STATE_BF16: tl.constexpr):
        # program -> (tensor t, first value of its block); the tensors' addresses come from tables.
        # Full blocks (TAIL False) load without a mask, from 16-byte aligned addresses (checked on
        # the host), so the loads are vectorised; each tensor's last partial block is a tail block.
        # PARAM_BF16: bf16 parameters (no fp32 master weights), stored stochastically rounded;
        # STATE_BF16: bf16 moments (else fp32, stored as computed).
        pid = tl.program_id(0)
        t = tl.load(block_tensor + pid)
        offsets = tl.multiple_of(tl.load(block_start + pid), BLOCK) + tl.arange(0, BLOCK)
        if PARAM_BF16:
            param_ptr = tl.multiple_of(tl.load(param_ptrs + t).to(tl.pointer_type(tl.bfloat16)), 16)
        else:
            param_ptr = tl.multiple_of(tl.load(param_ptrs + t).to(tl.pointer_type(tl.float32)), 16)
        if GRAD_BF16:
            grad_ptr = tl.multiple_of(tl.load(grad_ptrs + t).to(tl.pointer_type(tl.bfloat16)), 16)
        else:
            grad_ptr = tl.multiple_of(tl.load(grad_ptrs + t).to(tl.pointer_type(tl.float32)), 16)
        if STATE_BF16:
            exp_avg_ptr = tl.multiple_of(tl.load(exp_avg_ptrs + t).to(tl.pointer_type(tl.bfloat16)), 16)
            exp_avg_sq_ptr = tl.multiple_of(tl.load(exp_avg_sq_ptrs + t).to(tl.pointer_type(tl.bfloat16)), 16)
        else:
            exp_avg_ptr = tl.multiple_of(tl.load(exp_avg_ptrs + t).to(tl.pointer_type(tl.float32)), 16)
            exp_avg_sq_ptr = tl.multiple_of(tl.load(exp_avg_sq_ptrs + t).to(tl.pointer_type(tl.float32)), 16)
        one_minus_beta1 = tl.load(scalars + 1)  # scalars[0], beta1, is the eager path's
        beta2 = tl.load(scalars + 2)
        one_minus_beta2 = tl.load(scalars + 3)
        eps = tl.load(scalars + 4)
        decay = tl.load(scalars + 5)
        step_size = tl.load(scalars + 6)
        correction2_sqrt = tl.load(scalars + 7)
        grad_scale = tl.load(scalars + 8)

        if TAIL:
            mask = offsets < tl.load(numels + t)
            grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            m = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            v = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            param = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        else:
            grad = tl.load(grad_ptr + offsets).to(tl.float32)
            m = tl.load(exp_avg_ptr + offsets).to(tl.float32)
            v = tl.load(exp_avg_sq_ptr + offsets).to(tl.float32)
            param = tl.load(param_ptr + offsets).to(tl.float32)
        grad = grad * grad_scale  # exact when 1 (no clipping)
        m = m + one_minus_beta1 * (grad - m)  # lerp
        v = v * beta2 + grad * grad * one_minus_beta2
        param = param * decay + step_size * (m / (tl.sqrt_rn(v) / correction2_sqrt + eps))
        # stochastic rounding: 16 random bits each (one philox call gives four 32-bit draws: the
        # moments share the first, the parameter takes the second), added below the bf16 mantissa
        bits, param_bits, _, _ = tl.randint4x(seed + t, offsets)
        if STATE_BF16:
            bits = bits.to(tl.int32, bitcast=True)
            m_bits = (m.to(tl.int32, bitcast=True) + (bits & 0xFFFF)) & -65536
            v_bits = (v.to(tl.int32, bitcast=True) + ((bits >> 16) & 0xFFFF)) & -65536
            m = m_bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
            v = v_bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
        if PARAM_BF16:
            param_bits = (param.to(tl.int32, bitcast=True) + (param_bits.to(tl.int32, bitcast=True) & 0xFFFF)) & -65536
            param = param_bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
        if TAIL:
            tl.store(param_ptr + offsets, param, mask=mask)
            tl.store(exp_avg_ptr + offsets, m, mask=mask)
            tl.store(exp_avg_sq_ptr + offsets, v, mask=mask)
        else:
            tl.store(param_ptr + offsets, param)
            tl.store(exp_avg_ptr + offsets, m)
            tl.store(exp_avg_sq_ptr + offsets, v)

    return adamw_bf16_state_kernel


class _BlockTable:
    """For tensors of these sizes: which tensor and which first value each program handles,
    the full blocks and the tails (each tensor's last, partial block) apart."""

    def __init__(self, numels: list[int], device: torch.device):
        if max(numels) >= 2**31 - BLOCK:
            raise ValueError(f"AdamWBf16State(fused=True): a tensor of {max(numels):,} values is over the "
                             f"kernel's int32 offsets; split it (or use tensor parallelism)")
        numels_t = torch.tensor(numels, dtype=torch.int64)
        full = numels_t // BLOCK
        tensor = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), full)
        start = (torch.arange(int(full.sum())) - (torch.cumsum(full, 0) - full)[tensor.long()]) * BLOCK
        tails = torch.nonzero(numels_t % BLOCK).flatten()
        self.full = (tensor.to(device), start.to(torch.int32).to(device))
        self.tail = (tails.to(torch.int32).to(device), (full[tails] * BLOCK).to(torch.int32).to(device))
        self.numels = numels_t.to(device)


class AdamWBf16State(torch.optim.Optimizer):
    """AdamW on fp32 (or bf16) parameters whose moments `exp_avg` / `exp_avg_sq` are bf16 (or fp32).

    State keys and the CPU `step` tensor are torch.optim.AdamW's, so megatron's distributed
    optimizer saves, gathers and restores them as it does torch's (it copies values, which
    casts). `fused`: the multi-tensor Triton kernel (CUDA tensors); otherwise eager torch.
    Gradients: see `gradient` and `grad_scale`.

    bf16 parameters (the model's own weights, no fp32 master copy) are written back
    stochastically rounded. `bf16_values`: so are fp32 parameters, kept at bf16 values (a CPU
    run's `--master-weights bf16`; eager path). `state_dtype`: the moments' dtype, bf16
    (default) or fp32."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, fused: bool = False, bf16_values: bool = False,
                 state_dtype: torch.dtype = torch.bfloat16):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        if state_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"AdamWBf16State: state_dtype {state_dtype}: bf16 or fp32 moments only")
        self.fused = fused
        self.bf16_values = bf16_values
        self.state_dtype = state_dtype
        self._tables: dict[tuple, _BlockTable] = {}
        self._warned_unaligned = False
        self.grad_scale = 1.0  # multiplies the next step's gradients only (clipping sets it)

    def init_state(self) -> None:
        """Moments for every parameter (megatron's `init_state_fn` hook calls this)."""
        for group in self.param_groups:
            for p in group["params"]:
                self._state_of(p)

    def _state_of(self, p: Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        # torch casts floating state to the parameter's dtype, which would round fp32 moments of
        # bf16 parameters: the saved moments again, cast to the moments' dtype. megatron's
        # distributed optimizer hands every parameter the same `step` tensor: one each, or the
        # in-place increment would count one step per parameter.
        params = {saved_id: p for saved, group in zip(state_dict["param_groups"], self.param_groups)
                  for saved_id, p in zip(saved["params"], group["params"])}
        for saved_id, saved in state_dict["state"].items():
            state = self.state[params[saved_id]]
            for key in ("exp_avg", "exp_avg_sq"):
                if key in saved:
                    state[key] = saved[key].to(device=state[key].device, dtype=self.state_dtype)
            if "step" in state:
                state["step"] = torch.tensor(float(state["step"]))

    @staticmethod
    def gradient(p: Tensor) -> Tensor | None:
        """The gradient the step reads: `p.decoupled_grad` (any float dtype) when set, else `p.grad`."""
        grad = getattr(p, "decoupled_grad", None)
        return p.grad if grad is None else grad

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "AdamWBf16State takes no closure"
        grad_scale, self.grad_scale = self.grad_scale, 1.0
        for group in self.param_groups:
            # tensors that share a device, a step count, a parameter dtype and a gradient dtype
            batches: dict[tuple, list] = {}
            for p in group["params"]:
                grad = self.gradient(p)
                if grad is None:
                    continue
                state = self._state_of(p)
                state["step"] += 1
                batches.setdefault((p.device, float(state["step"]), p.dtype, grad.dtype), []).append((p, grad, state))
            for (device, step, param_dtype, _), items in batches.items():
                scalars = adamw_scalars(group["lr"], group["betas"], group["eps"], group["weight_decay"], step)
                if self.fused and device.type == "cuda" and not (self.bf16_values and param_dtype == torch.float32):
                    self._fused_step(items, scalars, grad_scale, device)
                else:
                    for p, grad, state in items:
                        adamw_update(p, grad, state["exp_avg"], state["exp_avg_sq"], scalars, grad_scale,
                                     self.bf16_values)

    def _fused_step(self, items: list, scalars: list[float], grad_scale: float, device: torch.device) -> None:
        param_dtype, grad_dtype = items[0][0].dtype, items[0][1].dtype  # one of each per batch
        for p, grad, _ in items:
            if not (p.dtype in (torch.float32, torch.bfloat16) and grad.dtype in (torch.float32, torch.bfloat16)
                    and p.is_contiguous() and grad.is_contiguous()):
                raise TypeError(f"AdamWBf16State(fused=True) updates contiguous fp32 or bf16 parameters with fp32 or "
                                f"bf16 gradients, got {p.dtype} {tuple(p.shape)} with a {grad.dtype} gradient")
        pointers = torch.tensor([[t.data_ptr() for t in (p, g, s["exp_avg"], s["exp_avg_sq"])] for p, g, s in items],
                                dtype=torch.int64)
        aligned = (pointers % 16 == 0).all(dim=1)  # the kernel's vector loads need 16-byte aligned starts
        if not bool(aligned.all()):
            if not self._warned_unaligned:
                warnings.warn(f"AdamWBf16State: {int((~aligned).sum())} tensors do not start on a 16-byte boundary; "
                              f"they are updated by the slower per-tensor path")
                self._warned_unaligned = True
            for (p, grad, state), ok in zip(items, aligned.tolist()):
                if not ok:
                    adamw_update(p, grad, state["exp_avg"], state["exp_avg_sq"], scalars, grad_scale)
            items, pointers = [item for item, ok in zip(items, aligned.tolist()) if ok], pointers[aligned]
            if not items:
                return
        numels = [p.numel() for p, _, _ in items]
        key = (device, tuple(numels))
        if key not in self._tables:
            self._tables[key] = _BlockTable(numels, device)
        table = self._tables[key]
        pointers = pointers.T.contiguous().to(device, non_blocking=True)
        scalars_t = torch.tensor([*scalars, grad_scale], dtype=torch.float32).to(device, non_blocking=True)
        # the rounding's random stream: drawn from torch's CPU generator (saved in checkpoints)
        seed = int(torch.randint(0, 2**31 - len(items), ()))
        kernel = _triton_kernel()
        for (block_tensor, block_start), tail in ((table.full, False), (table.tail, True)):
            if block_tensor.numel():
                kernel[(block_tensor.numel(),)](block_tensor, block_start, *pointers, table.numels, scalars_t, seed,
                                                BLOCK=BLOCK, TAIL=tail, GRAD_BF16=grad_dtype == torch.bfloat16,
                                                PARAM_BF16=param_dtype == torch.bfloat16,
                                                STATE_BF16=self.state_dtype == torch.bfloat16)
