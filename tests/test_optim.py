"""`AdamWBf16State` (`--adam-state-dtype bf16`): AdamW on fp32 weights with bf16 moments.

Oracles: torch.optim.AdamW (the same step from the same state, in fp32), torch.nextafter for
the two bf16 neighbours of a value (independent of the bit trick that rounds), and the closed
form of Adam's second-moment average under a constant gradient.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.helpers.cli import process_env
from train.adamw_bf16_state import AdamWBf16State, stochastic_round_bf16


def bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below or equal to x and just above or equal to it, as fp32."""
    nearest = x.to(torch.bfloat16)
    up = torch.nextafter(nearest, torch.full_like(nearest, float("inf")))
    down = torch.nextafter(nearest, torch.full_like(nearest, float("-inf")))
    below = torch.where(nearest.float() <= x, nearest, down).float()
    above = torch.where(nearest.float() >= x, nearest, up).float()
    return below, above


def assert_same_step(ours: torch.Tensor, ref: torch.Tensor, before: torch.Tensor, what: str = "") -> None:
    """Two AdamW steps of one tensor agree up to the order of the same fp32 operations: a few
    ulps of the result plus 1e-5 of the update (m / sqrt(v) grows large where v is tiny)."""
    ours, ref, before = ours.detach(), ref.detach(), before.detach()
    eps = torch.finfo(torch.float32).eps
    tolerance = 4 * eps * torch.maximum(ref.abs(), before.abs()) + 1e-5 * (ref - before).abs()
    excess = ((ours - ref).abs() - tolerance).max().item()
    assert excess <= 0, f"{what}: the update differs by up to {excess:.3e} beyond the tolerance"


def random_values(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return sign * torch.exp(torch.empty(n).uniform_(-30, 30, generator=g))  # magnitudes 1e-13 .. 1e13


@pytest.mark.parametrize("seed", range(3))
def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased(seed):
    x = random_values(512, seed)
    x[:16] = x[:16].to(torch.bfloat16).float()  # already bf16: must stay exactly as they are
    below, above = bf16_neighbours(x)
    torch.manual_seed(seed)
    draws = torch.stack([stochastic_round_bf16(x).float() for _ in range(4000)])
    assert ((draws == below) | (draws == above)).all()
    assert (draws[:, :16] == x[:16]).all()
    # each draw is `above` with probability p = (x - below) / (above - below): mean x, std <= step/2
    step = (above - below).clamp(min=torch.finfo(torch.float32).tiny)
    error = (draws.mean(0) - x).abs() / step
    assert error.max() < 5 * 0.5 / 4000 ** 0.5, error.max()


@pytest.mark.parametrize("seed", range(6))
def test_one_step_is_torch_adamw_with_moments_stored_as_a_neighbour(seed):
    """From the same (bf16-representable) moments and step count, the parameter moves exactly
    as torch.optim.AdamW moves it, and each stored moment is one of the two bf16 values around
    torch's fp32 moment."""
    g = torch.Generator().manual_seed(seed)
    shape = [(7,), (33, 17), (4, 5, 6)][seed % 3]
    lr, wd, step = [3e-4, 1e-2, 1.0][seed % 3], [0.0, 0.1][seed % 2], [1, 2, 50][seed % 3]
    betas = [(0.9, 0.95), (0.9, 0.999), (0.8, 0.99)][seed % 3]
    param = torch.randn(shape, generator=g)
    grad = torch.randn(shape, generator=g) * 10 ** torch.empty(shape).uniform_(-4, 1, generator=g)
    m = (torch.randn(shape, generator=g) * 0.1).to(torch.bfloat16)
    v = (torch.rand(shape, generator=g) * 0.1).to(torch.bfloat16)

    ref = param.clone().requires_grad_()
    torch_adam = torch.optim.AdamW([ref], lr=lr, betas=betas, weight_decay=wd, eps=1e-8)
    torch_adam.state[ref] = {"step": torch.tensor(float(step - 1)), "exp_avg": m.float(), "exp_avg_sq": v.float()}
    ours = param.clone().requires_grad_()
    adam = AdamWBf16State([ours], lr=lr, betas=betas, weight_decay=wd, eps=1e-8)
    adam.state[ours] = {"step": torch.tensor(float(step - 1)), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    ref.grad, ours.grad = grad.clone(), grad.clone()
    torch_adam.step()
    adam.step()

    assert_same_step(ours, ref, param)
    assert float(adam.state[ours]["step"]) == step
    for key in ("exp_avg", "exp_avg_sq"):
        stored = adam.state[ours][key]
        assert stored.dtype == torch.bfloat16
        below, above = bf16_neighbours(torch_adam.state[ref][key])
        assert ((stored.float() == below) | (stored.float() == above)).all(), key


def test_second_moment_keeps_moving_where_round_to_nearest_stalls():
    """beta2 = 0.999 under a constant gradient 1: v_t = 1 - 0.999^t. Past v ~ 0.25 an increment
    (1e-3 of the gap) is below half a bf16 step, so round-to-nearest stops there; the stored
    stochastic moments follow the closed form."""
    n, steps, beta2 = 4096, 2000, 0.999
    param = torch.zeros(n, requires_grad=True)
    adam = AdamWBf16State([param], lr=0.0, betas=(0.9, beta2))
    torch.manual_seed(0)
    nearest = torch.zeros(n, dtype=torch.bfloat16)
    for _ in range(steps):
        param.grad = torch.ones(n)
        adam.step()
        nearest = (nearest.float() * beta2 + (1 - beta2)).to(torch.bfloat16)
    exact = 1 - beta2 ** steps
    v = adam.state[param]["exp_avg_sq"].float()
    assert abs(v.mean().item() - exact) < 0.01 * exact, (v.mean().item(), exact)
    assert nearest.float().max().item() < 0.5 * exact  # the contrast: nearest rounding stalled


def test_state_dict_round_trip_keeps_bf16_moments_and_one_step_count_each():
    """torch's load_state_dict casts floating state to the parameter's dtype (fp32): the moments
    come back as the same bf16 values. megatron's distributed optimizer loads one `step` tensor
    shared by every parameter; the next step must still count once per step, not per parameter."""
    params = [torch.randn(64, requires_grad=True), torch.randn(8, 3, requires_grad=True)]
    adam = AdamWBf16State(params, lr=1e-3)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape)
        adam.step()
    saved = adam.state_dict()
    shared = torch.tensor(3.0)
    for state in saved["state"].values():
        state["step"] = shared
    fresh = AdamWBf16State(params, lr=1e-3)
    fresh.load_state_dict(saved)
    for p in params:
        for key in ("exp_avg", "exp_avg_sq"):
            assert fresh.state[p][key].dtype == torch.bfloat16
            assert torch.equal(fresh.state[p][key], adam.state[p][key])
    fresh.step()
    assert [float(fresh.state[p]["step"]) for p in params] == [4.0, 4.0]


@pytest.mark.parametrize("seed,grad_scale", [(0, 1.0), (1, 0.37), (2, 1.0), (3, 2.0 ** -7)])
def test_bf16_gradient_in_place_with_scale_equals_the_scaled_fp32_copy(seed, grad_scale):
    """Megatron's step copies each bf16 gradient to fp32 and clips it by one fp32 multiply; the
    in-place route reads the bf16 gradient as `decoupled_grad` and scales inside the update.
    From the same state and random stream both store the same parameters and moments bitwise,
    and the scale applies to one step only."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(31,), (16, 9), (3, 4, 5)]
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [[(torch.randn(s, generator=g) * 10 ** (i - 2)).bfloat16() for i, s in enumerate(shapes)] for _ in range(2)]

    def run(in_place: bool) -> tuple[list[torch.Tensor], AdamWBf16State]:
        tensors = [p.clone().requires_grad_() for p in params]
        adam = AdamWBf16State(tensors, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        torch.manual_seed(seed)
        for step, step_grads in enumerate(grads):
            scale = grad_scale if step == 0 else 1.0  # clipping in the first step only
            for t, grad in zip(tensors, step_grads):
                if in_place:
                    t.decoupled_grad = grad
                else:
                    t.grad = grad.float() * scale if scale != 1.0 else grad.float()
            if in_place:
                adam.grad_scale = scale
            adam.step()
            assert adam.grad_scale == 1.0
        return tensors, adam

    (copied, ref), (in_place, ours) = run(False), run(True)
    assert all(t.grad is None for t in in_place)
    for a, b in zip(in_place, copied):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ours.state[a][key], ref.state[b][key]), key


def test_bf16_parameter_update_is_unbiased_where_round_to_nearest_never_moves():
    """bf16 parameters (`--master-weights bf16`): with lr 1e-3 every AdamW step
    moves a weight of about 1 by 1e-3, below half its bf16 step (2^-8 = 3.9e-3), so a
    round-to-nearest update never moves it. Stochastically rounded, each stored weight is one of
    the two bf16 values around torch's fp32 result, and the mean over many copies follows the
    fp32 trajectory over 20 steps within a tolerance far below the 0.02 it travels."""
    values, copies, steps, lr = 64, 4000, 20, 1e-3
    start = (1 + torch.rand(values, generator=torch.Generator().manual_seed(0))).bfloat16().repeat(copies)
    grad = torch.linspace(-1, 1, values).add_(0.01).repeat(copies)  # no zeros: each weight moves lr a step
    ours = start.clone().requires_grad_()
    ref = start.float().requires_grad_()
    adam = AdamWBf16State([ours], lr=lr, betas=(0.9, 0.95))
    torch_adam = torch.optim.AdamW([ref], lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    nearest = start.clone()
    torch.manual_seed(0)
    for step in range(steps):
        before = ref.detach().clone()
        ours.grad, ref.grad = grad.bfloat16(), grad.clone()
        adam.step()
        torch_adam.step()
        nearest = (nearest.float() + (ref.detach() - before)).bfloat16()  # the same update, rounded to nearest
        if step == 0:
            below, above = bf16_neighbours(ref.detach())
            assert ((ours.float() == below) | (ours.float() == above)).all()
    assert ours.dtype == torch.bfloat16 and adam.state[ours]["exp_avg"].dtype == torch.bfloat16
    mean = ours.detach().float().view(copies, values).mean(0)
    exact = ref.detach()[:values]
    bf16_step = 2.0 ** -7  # of values in [1, 2)
    tolerance = 5 * steps ** 0.5 * bf16_step / 2 / copies ** 0.5  # 5 sigma of the mean of 20 roundings
    assert (exact - start[:values].float()).abs().min() > 10 * tolerance  # the weights really travel
    assert (mean - exact).abs().max() < tolerance, ((mean - exact).abs().max(), tolerance)
    assert torch.equal(nearest, start)  # the contrast: round-to-nearest never moved a weight


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_fp32_tensors_holding_bf16_values_take_the_same_bf16_step(state_dtype):
    """A CPU run computes in fp32, so `--master-weights bf16` keeps its weights as fp32 tensors at
    bf16 values: from the same random stream they take bitwise the step that bf16 tensors take.
    Moments are stored in `state_dtype` (fp32 moments: `--adam-state-dtype fp32`): fp32 ones are
    torch's AdamW moments, and they survive a state-dict round trip in their dtype."""
    g = torch.Generator().manual_seed(3)
    start = [torch.randn(s, generator=g).bfloat16() for s in [(17,), (8, 9)]]
    grads = [torch.randn(t.shape, generator=g).bfloat16().float() for t in start]  # the same in either dtype
    runs = []
    for dtype in (torch.bfloat16, torch.float32):
        tensors = [t.detach().to(dtype, copy=True).requires_grad_() for t in start]
        adam = AdamWBf16State(tensors, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
                              bf16_values=dtype == torch.float32, state_dtype=state_dtype)
        torch.manual_seed(0)
        for _ in range(3):
            for t, grad in zip(tensors, grads):
                t.grad = grad.to(dtype)
            adam.step()
        runs.append((tensors, adam))
    (bf16, ours), (fp32, emulated) = runs
    for a, b in zip(bf16, fp32):
        assert a.dtype == torch.bfloat16 and b.dtype == torch.float32
        assert torch.equal(a.float(), b)
        for key in ("exp_avg", "exp_avg_sq"):
            assert ours.state[a][key].dtype == state_dtype
            assert torch.equal(ours.state[a][key], emulated.state[b][key])
    if state_dtype == torch.float32:  # fp32 moments: torch's, from the same gradients
        ref = [t.detach().float().requires_grad_() for t in start]
        torch_adam = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        for _ in range(3):
            for t, grad in zip(ref, grads):
                t.grad = grad.clone()
            torch_adam.step()
        for a, r in zip(bf16, ref):
            torch.testing.assert_close(ours.state[a]["exp_avg"], torch_adam.state[r]["exp_avg"], rtol=1e-6, atol=1e-7)
    fresh = AdamWBf16State(bf16, lr=1e-2, state_dtype=state_dtype)
    fresh.load_state_dict(ours.state_dict())
    for a in bf16:
        assert all(torch.equal(fresh.state[a][k], ours.state[a][k]) for k in ("exp_avg", "exp_avg_sq"))
        assert fresh.state[a]["exp_avg"].dtype == state_dtype


def fused_step(adam: AdamWBf16State, device: torch.device) -> None:
    """`adam.step()` through the Triton kernel on `device` (a CPU one: the kernel in Triton's
    interpreter), every tensor one group, no closure."""
    from train.adamw_bf16_state import adamw_scalars

    (group,) = adam.param_groups
    items = []
    for p in group["params"]:
        state = adam._state_of(p)
        state["step"] += 1
        items.append((p, adam.gradient(p), state))
    scalars = adamw_scalars(group["lr"], group["betas"], group["eps"], group["weight_decay"], float(items[0][2]["step"]))
    adam._fused_step(items, scalars, 1.0, device)


def check_fused_bf16_parameter_step(device: torch.device, state_dtype: torch.dtype) -> None:
    """The Triton kernel with bf16 parameters (PARAM_BF16) and bf16 or fp32 moments
    (STATE_BF16), on tensors around and across its block: each stored weight is one of the
    two bf16 values around the eager update's exact fp32 result (give or take a few fp32 ulps
    of operation order), fp32 moments are the eager ones, bf16 moments their neighbours, and
    over 500 copies of the same values the stored weights average to the fp32 result."""
    from train.adamw_bf16_state import BLOCK

    copies = 500
    gen = torch.Generator().manual_seed(4)
    sizes = [7, BLOCK, BLOCK + 1, 64 * copies]
    start = [torch.randn(n, generator=gen).bfloat16() for n in sizes]
    start[-1] = start[-1][:64].repeat(copies)
    grads = [torch.randn(n, generator=gen) * 10 ** (i % 3 - 2) for i, n in enumerate(sizes)]
    grads[-1] = grads[-1][:64].repeat(copies)
    options = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    exact = [t.float().requires_grad_() for t in start]  # fp32 weights and moments: nothing rounded
    oracle = AdamWBf16State(exact, state_dtype=torch.float32, **options)
    ours = [t.to(device).requires_grad_() for t in start]
    adam = AdamWBf16State(ours, fused=True, state_dtype=state_dtype, **options)
    for t, e, g in zip(ours, exact, grads):
        t.decoupled_grad, e.grad = g.bfloat16().to(device), g.bfloat16().float()
    oracle.step()
    torch.manual_seed(0)
    fused_step(adam, device)
    for i, (t, e) in enumerate(zip(ours, exact)):
        stored, fp32 = t.detach().float().cpu(), e.detach()
        slack = 8 * torch.finfo(torch.float32).eps * fp32.abs()
        below, _ = bf16_neighbours(fp32 - slack)
        _, above = bf16_neighbours(fp32 + slack)
        assert t.dtype == torch.bfloat16 and ((stored >= below) & (stored <= above)).all(), i
        for key in ("exp_avg", "exp_avg_sq"):
            moment, ref = adam.state[t][key].cpu(), oracle.state[e][key]
            assert moment.dtype == state_dtype
            if state_dtype == torch.float32:
                torch.testing.assert_close(moment, ref, rtol=1e-6, atol=1e-12)
            else:
                low, _ = bf16_neighbours(ref - 4 * torch.finfo(torch.float32).eps * ref.abs())
                _, high = bf16_neighbours(ref + 4 * torch.finfo(torch.float32).eps * ref.abs())
                assert ((moment.float() >= low) & (moment.float() <= high)).all(), (i, key)
    mean = ours[-1].detach().float().cpu().view(copies, 64).mean(0)
    below, above = bf16_neighbours(exact[-1].detach()[:64])
    error = (mean - exact[-1].detach()[:64]).abs() / (above - below).clamp(min=torch.finfo(torch.float32).tiny)
    assert error.max() < 5 * 0.5 / copies ** 0.5, error.max()
    moved = exact[-1].detach()[:64] != start[-1][:64].float()
    assert moved.all() and (exact[-1].detach()[:64].bfloat16() == start[-1][:64]).any()  # some only stochastically


def test_fused_bf16_parameter_step_in_tritons_interpreter_equals_the_eager_oracle():
    """`check_fused_bf16_parameter_step` on the CPU: the kernel run by Triton's interpreter,
    which is chosen before Triton is imported, so in a process of its own."""
    pytest.importorskip("triton")
    code = ("import torch; from tests.test_optim import check_fused_bf16_parameter_step as check; "
            "[check(torch.device('cpu'), dtype) for dtype in (torch.bfloat16, torch.float32)]")
    proc = subprocess.run([sys.executable, "-c", code], env={**process_env(), "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
def test_gpu_fused_bf16_parameter_step_equals_the_eager_oracle(state_dtype):
    check_fused_bf16_parameter_step(torch.device("cuda"), state_dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fused_step_equals_torch_adamw():
    """The CUDA path (one Triton launch per parameter group): every tensor, of sizes around and
    across the kernel's block, moves as torch's fused AdamW moves it from the same state, and
    each stored moment is a bf16 neighbour of torch's fp32 moment, give or take the fp32
    rounding of its inputs (the two kernels may contract the same operations differently, which
    matters where 0.9 m + 0.1 g nearly cancels)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    sizes = [1, 7, 2047, 2048, 2049, 100_000, 3 * 2048 + 5, 1_000_003]
    groups = [dict(lr=1e-3, weight_decay=0.1), dict(lr=3e-2, weight_decay=0.0)]
    params = [torch.randn(n, device="cuda", generator=gen) for n in sizes]
    grads = [torch.randn(n, device="cuda", generator=gen) * 10 ** (i % 5 - 3) for i, n in enumerate(sizes)]
    states = [((torch.randn(n, device="cuda", generator=gen) * 0.1).bfloat16(),
               (torch.rand(n, device="cuda", generator=gen) * 0.1).bfloat16()) for n in sizes]
    split = len(sizes) // 2

    def build(cls, **kw):
        tensors = [p.clone().requires_grad_() for p in params]
        opt = cls([{"params": tensors[:split], **groups[0]}, {"params": tensors[split:], **groups[1]}],
                  betas=(0.9, 0.95), eps=1e-8, **kw)
        for t, g, (m, v) in zip(tensors, grads, states):
            t.grad = g.clone()
            step = torch.tensor(4.0, device="cuda") if cls is torch.optim.AdamW else torch.tensor(4.0)
            moments = (m.float(), v.float()) if cls is torch.optim.AdamW else (m.clone(), v.clone())
            opt.state[t] = {"step": step, "exp_avg": moments[0], "exp_avg_sq": moments[1]}
        return tensors, opt

    ref, torch_adam = build(torch.optim.AdamW, fused=True)
    ours, adam = build(AdamWBf16State, fused=True)
    torch_adam.step()
    adam.step()
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert_same_step(a, b, params[i], f"tensor {i} ({sizes[i]} values)")
        m0, v0, g = states[i][0].float(), states[i][1].float(), grads[i]
        for key, inputs in (("exp_avg", m0.abs() + g.abs()), ("exp_avg_sq", v0 + g * g)):
            stored, exact = adam.state[a][key].float(), torch_adam.state[b][key]
            slack = inputs * 2.0 ** -22
            below, _ = bf16_neighbours(exact - slack)
            _, above = bf16_neighbours(exact + slack)
            assert adam.state[a][key].dtype == torch.bfloat16
            assert ((stored >= below) & (stored <= above)).all(), (i, key)
        assert float(adam.state[a]["step"]) == 5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fused_rounding_is_unbiased():
    """The Triton kernel's stochastic rounding: from m = 0 and lr = 0, a step stores
    (1 - beta1) * grad; over many copies of the same values the stored mean is that value and
    every stored value is one of its two bf16 neighbours."""
    values = random_values(256, 0).clamp(-1e30, 1e30).cuda()
    copies = 4000
    beta1 = 0.5
    grad = (values / (1 - beta1)).repeat(copies)
    param = torch.zeros_like(grad, requires_grad=True)
    adam = AdamWBf16State([param], lr=0.0, betas=(beta1, 0.999), fused=True)
    param.grad = grad
    adam.step()
    exact = (grad * (1 - beta1))[:256]  # the kernel's m: 0 + (1 - beta1) * (grad - 0)
    stored = adam.state[param]["exp_avg"].float().view(copies, 256)
    below, above = bf16_neighbours(exact)
    assert ((stored == below) | (stored == above)).all()
    step = (above - below).clamp(min=torch.finfo(torch.float32).tiny)
    error = (stored.mean(0) - exact).abs() / step
    assert error.max() < 5 * 0.5 / copies ** 0.5, error.max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fused_step_updates_unaligned_tensors_per_tensor():
    """A parameter that does not start on a 16-byte boundary (a view one value into a buffer)
    cannot take the kernel's vector loads: it is updated by the per-tensor path, with a
    warning, and moves as torch's AdamW moves it; the aligned one beside it still runs fused."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    buffer = torch.randn(5001, device="cuda", generator=gen)
    before = [buffer[1:].clone(), torch.randn(3000, device="cuda", generator=gen)]
    grads = [torch.randn(p.shape, device="cuda", generator=gen) for p in before]
    ours = [torch.nn.Parameter(buffer[1:]), torch.nn.Parameter(before[1].clone())]
    assert ours[0].data_ptr() % 16 and not ours[1].data_ptr() % 16
    refs = [p.clone().requires_grad_() for p in before]
    adam = AdamWBf16State(ours, lr=1e-2, betas=(0.9, 0.95), fused=True)
    torch_adam = torch.optim.AdamW(refs, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    for p, r, g in zip(ours, refs, grads):
        p.grad, r.grad = g.clone(), g.clone()
    with pytest.warns(UserWarning, match="16-byte boundary"):
        adam.step()
    torch_adam.step()
    for i in range(2):
        assert_same_step(ours[i], refs[i], before[i], f"tensor {i}")


def test_block_table_covers_every_value_once():
    """The Triton step's programs: full blocks plus one tail per tensor whose size is not a
    multiple of the block cover each tensor's values exactly once, in bounds."""
    from train.adamw_bf16_state import BLOCK, _BlockTable

    numels = [1, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK, 7 * BLOCK + 3, 12345]
    table = _BlockTable(numels, torch.device("cpu"))
    covered = [torch.zeros(n, dtype=torch.int32) for n in numels]
    for (tensors, starts), tail in ((table.full, False), (table.tail, True)):
        for t, start in zip(tensors.tolist(), starts.tolist()):
            stop = min(start + BLOCK, numels[t])
            assert start % BLOCK == 0 and (tail or start + BLOCK <= numels[t])
            covered[t][start:stop] += 1
    assert all(bool((c == 1).all()) for c in covered)
    assert table.tail[0].tolist() == [i for i, n in enumerate(numels) if n % BLOCK]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("grad_scale", [1.0, 0.37])
def test_gpu_fused_step_reads_bf16_gradients_in_place(grad_scale):
    """The Triton kernel on bf16 `decoupled_grad`s with a `grad_scale` moves parameters and
    moments as it does on their fp32 copies scaled by torch (bitwise without a scale; with one
    the kernel may contract the multiply into the next operation: same-step tolerance)."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    sizes = [5, 2048, 2049, 100_003, 3 * 2048]
    params = [torch.randn(n, device="cuda", generator=gen) for n in sizes]
    grads = [(torch.randn(n, device="cuda", generator=gen) * 10 ** (i % 4 - 2)).bfloat16() for i, n in enumerate(sizes)]
    runs = []
    for in_place in (False, True):
        tensors = [p.clone().requires_grad_() for p in params]
        adam = AdamWBf16State(tensors, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        for t, g in zip(tensors, grads):
            if in_place:
                t.decoupled_grad = g
            else:
                t.grad = g.float() * grad_scale if grad_scale != 1.0 else g.float()
        adam.grad_scale = grad_scale if in_place else 1.0
        torch.manual_seed(0)
        adam.step()
        runs.append((tensors, adam))
    (copied, ref), (in_place, ours) = runs
    for i, (a, b) in enumerate(zip(in_place, copied)):
        if grad_scale == 1.0:
            assert torch.equal(a, b), i
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(ours.state[a][key], ref.state[b][key]), (i, key)
        else:
            assert_same_step(a, b, params[i], f"tensor {i}")


def _tiny_bf16_ddp_models(info, grad_reduce_in_fp32: bool):
    """A function building the tiny model in bf16 on the GPU, each time from the same weights,
    under megatron's DDP laid out for its distributed optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from train.model.arch import builtin_arch
    from train.model.qwen_vl import transformer_config
    from train.parallel import build_model

    arch = builtin_arch("tiny")
    config = transformer_config(arch, params_dtype=torch.bfloat16, bf16=True)
    torch.manual_seed(0)
    weights = build_model(arch, config, info).state_dict()

    def fresh_model():
        model = build_model(arch, config, info)
        model.load_state_dict(weights)
        return DistributedDataParallel(config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=grad_reduce_in_fp32, use_distributed_optimizer=True), model)

    return fresh_model


def _distributed_adam_config(clip_grad: float):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1, clip_grad=clip_grad, bf16=True,
                           params_dtype=torch.bfloat16, use_distributed_optimizer=True)


def _inner_params(optimizer) -> list:
    """The parameters the (chained) megatron optimizer's inner torch optimizers update."""
    return [p for sub in getattr(optimizer, "chained_optimizers", [optimizer])
            for group in sub.optimizer.param_groups for p in group["params"]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("clip_grad", [1e9, 0.05])
def test_gpu_fast_step_equals_megatrons_step(state_dtype, clip_grad):
    """megatron's DistributedOptimizer over bf16 gradient buffers (`--grad-dtype bf16`), its
    own step against `use_fast_step`, from the same weights and gradients over three steps:
    the same grad norms and master weights (bitwise when clipping is off; the clip coefficient
    may differ by an ulp otherwise). With AdamWBf16State (`--adam-state-dtype bf16`) the fast
    step reads the gradients in place: it allocates a small fraction of the 4 bytes per
    parameter megatron's fp32 copy takes."""
    from train.optim import build_optimizer
    from train.parallel import destroy_parallel, init_parallel

    info = init_parallel(1, 1, device="cuda")
    try:
        fresh_model = _tiny_bf16_ddp_models(info, grad_reduce_in_fp32=False)
        gen = torch.Generator(device="cuda").manual_seed(1)
        runs = []
        for fast in (False, True):
            model = fresh_model()
            opt_config = _distributed_adam_config(clip_grad=clip_grad)
            optimizer = build_optimizer(model, opt_config, cuda=True, adam_state_dtype=state_dtype, fast_step=fast)
            gen.manual_seed(1)
            torch.manual_seed(0)
            norms, step_bytes = [], []
            for step in range(3):
                model.zero_grad_buffer()
                optimizer.zero_grad()
                for p in model.parameters():  # growing gradients: clipped steps differ from unclipped ones
                    p.main_grad.copy_(torch.randn(p.shape, device="cuda", generator=gen) * 0.01 * 10 ** step)
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                ok, norm, _ = optimizer.step()
                assert ok
                step_bytes.append(torch.cuda.max_memory_allocated() - before)
                norms.append(norm)
            masters = [p.detach().clone() for p in _inner_params(optimizer)]
            runs.append((norms, masters, max(step_bytes[1:])))  # step 1 also allocates the moments
        (norms_megatron, masters_megatron, bytes_megatron), (norms_fast, masters_fast, bytes_fast) = runs
        numel = sum(p.numel() for p in masters_megatron)
        assert masters_megatron[0].dtype == torch.float32 and bytes_megatron >= 4 * numel, (bytes_megatron, numel)
        if state_dtype == "bf16":
            assert bytes_fast < 0.1 * bytes_megatron, (bytes_fast, bytes_megatron)
        np.testing.assert_allclose(norms_fast, norms_megatron, rtol=1e-5)
        if clip_grad > 1e6:
            assert all(torch.equal(a, b) for a, b in zip(masters_fast, masters_megatron))
        else:
            assert min(norms_megatron) > 10 * clip_grad  # every step clipped
            # an ulp in the coefficient, and then a bf16 moment that rarely rounds the other way:
            # far below the 1e-3-sized updates an unclipped step would change
            for a, b in zip(masters_fast, masters_megatron):
                torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
    finally:
        destroy_parallel()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_gpu_distributed_optimizer_without_master_weights_updates_the_bf16_weights(state_dtype):
    """`--master-weights bf16` under megatron's DistributedOptimizer: building it allocates no
    fp32 copy of the weights (4 bytes a parameter with fp32 master weights), the inner
    optimizer's parameters are the model's own bf16 weights (their memory in DDP's parameter
    buffer), and from the same weights and gradients three steps give the fp32-master run's
    first grad norm and weights within a few bf16 steps of its weights."""
    from train.optim import build_optimizer
    from train.parallel import destroy_parallel, init_parallel

    info = init_parallel(1, 1, device="cuda")
    try:
        fresh_model = _tiny_bf16_ddp_models(info, grad_reduce_in_fp32=True)
        gen = torch.Generator(device="cuda").manual_seed(1)
        runs = []
        for master_weights in ("fp32", "bf16"):
            model = fresh_model()
            opt_config = _distributed_adam_config(clip_grad=1.0)
            params = [p for p in model.parameters() if p.requires_grad]
            numel = sum(p.numel() for p in params)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            optimizer = build_optimizer(model, opt_config, cuda=True, adam_state_dtype=state_dtype,
                                        master_weights=master_weights)
            built = torch.cuda.max_memory_allocated() - before
            inner = _inner_params(optimizer)
            if master_weights == "bf16":
                assert built < 0.5 * numel, (built, numel)
                assert all(p.dtype == torch.bfloat16 for p in inner)
                assert sorted(p.data_ptr() for p in inner) == sorted(p.data_ptr() for p in params)  # dp 1: whole
            else:
                assert built >= 4 * numel and all(p.dtype == torch.float32 for p in inner)
            initial = [p.detach().float().clone() for p in params]
            gen.manual_seed(1)
            torch.manual_seed(0)
            norms = []
            for step in range(3):
                model.zero_grad_buffer()
                optimizer.zero_grad()
                for p in params:
                    p.main_grad.copy_(torch.randn(p.shape, device="cuda", generator=gen) * 0.01)
                ok, norm, _ = optimizer.step()
                assert ok
                norms.append(norm)
            runs.append((norms, initial, [p.detach().float().clone() for p in params]))
        (norms_fp32, _, weights_fp32), (norms_bf16, initial, weights_bf16) = runs
        assert abs(norms_bf16[0] - norms_fp32[0]) <= 1e-5 * norms_fp32[0]
        numel = sum(t.numel() for t in initial)
        assert sum(int((a != b).sum()) for a, b in zip(weights_bf16, initial)) > numel / 2  # updated in place
        # each step rounds to a bf16 neighbour of the weight it lands on, one spacing at most; a
        # weight moves at most about lr a step, so along the way it stays within the larger of its
        # first and last magnitudes plus 3 lr (a bound taken at the last weight alone fails where
        # a weight crosses zero)
        for a, b, w0 in zip(weights_bf16, weights_fp32, initial):
            spacing = torch.finfo(torch.bfloat16).eps * (torch.maximum(w0.abs(), b.abs()) + 3 * opt_config.lr)
            assert ((a - b).abs() <= 4 * spacing).all(), float(((a - b).abs() / spacing).max())
    finally:
        destroy_parallel()
