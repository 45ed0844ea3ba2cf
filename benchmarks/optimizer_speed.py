"""One AdamW step over the Qwen3-VL-2B parameters, side by side in one process.

Part 1, the inner optimizer alone: torch's fused AdamW with fp32 moments (the trainer's
default) against `AdamWBf16State` (`--adam-state-dtype bf16`: bf16 moments, stochastic
rounding, one Triton launch for all tensors), on what megatron's distributed optimizer hands
its inner optimizer on one GPU: one flat fp32 main-parameter shard per model tensor (541 of
them, 2.13 B values; `train.convert.shard_shapes`), with fp32 gradients. Reported: milliseconds
per step (median of the timed steps, CUDA-synchronised), the host time to issue a step, and the
bytes of optimizer state; then our/torch ratios.

Part 2 (`--megatron`), the whole `optimizer.step()` the trainer calls: the real model (bf16)
under megatron DDP and its DistributedOptimizer, random gradients in its buffers, in three
settings: the default (fp32 gradients, torch fused AdamW) and bf16 gradients + bf16 moments, each
through megatron's own step (its norm and clipping; with bf16 gradients an fp32 copy of every
gradient first) and through `use_fast_step` (what the trainer runs). Reported: step time,
memory held before the step and the step's own peak above it.

    python benchmarks/optimizer_speed.py --megatron --json-out benchmarks/results/optimizer_speed_h100_<yyyymmdd>.json
"""

from __future__ import annotations

import gc
import math
import statistics
import sys
import time

import torch
from common import machine_info, parser, write_json

from train.adamw_bf16_state import AdamWBf16State
from train.convert import shard_shapes
from train.model.arch import builtin_arch


def make_optimizer(kind: str, params: list[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    if kind == "torch-fused-fp32":
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    return AdamWBf16State(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for k, t in s.items() if k != "step")


def measure(kind: str, numels: list[int], warmup: int, steps: int, lr: float) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(n, device="cuda", generator=gen).requires_grad_() for n in numels]
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", generator=gen) * 1e-3
    optimizer = make_optimizer(kind, params, lr)
    times, host = [], []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.step()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
            host.append(issued - start)
    result = {"step_ms": statistics.median(times) * 1e3, "host_ms": statistics.median(host) * 1e3,
              "state_gib": state_bytes(optimizer) / 2**30,
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    print(f"{kind:18s} step {result['step_ms']:7.1f} ms (host {result['host_ms']:6.1f} ms), "
          f"state {result['state_gib']:5.2f} GiB, peak {result['peak_gib']:5.1f} GiB", flush=True)
    del optimizer, params
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return result


MEGATRON_SETTINGS = {  # name: (gradient buffer dtype, Adam state dtype, `use_fast_step`)
    "fp32 grads + fp32 state, megatron's step": ("fp32", "fp32", False),
    "fp32 grads + fp32 state, fast step": ("fp32", "fp32", True),
    "bf16 grads + bf16 state, megatron's step": ("bf16", "bf16", False),
    "bf16 grads + bf16 state, fast step": ("bf16", "bf16", True),
}


def measure_megatron(setting: str, arch_name: str, warmup: int, steps: int, info) -> dict:
    """`optimizer.step()` of the trainer's optimizer over the real model's gradient buffers."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from train.model.qwen_vl import transformer_config
    from train.optim import build_optimizer
    from train.parallel import build_model

    grad_dtype, state_dtype, fast = MEGATRON_SETTINGS[setting]
    baseline = torch.cuda.memory_allocated()  # what earlier settings left (megatron keeps a few globals)
    arch = builtin_arch(arch_name)
    config = transformer_config(arch, params_dtype=torch.bfloat16, bf16=True)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_dtype == "fp32", use_distributed_optimizer=True), build_model(arch, config, info))
    optimizer = build_optimizer(model, OptimizerConfig(
        optimizer="adam", lr=1e-5, weight_decay=0.1, clip_grad=1.0, bf16=True, params_dtype=torch.bfloat16,
        use_distributed_optimizer=True), cuda=True, adam_state_dtype=state_dtype, fast_step=fast)
    gen = torch.Generator(device="cuda").manual_seed(0)
    times, held, above = [], [], []
    for i in range(warmup + steps):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        for buffer in model.buffers:
            buffer.grad_data.normal_(0.0, 1e-3, generator=gen)
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated() - baseline)
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        optimizer.step()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
            above.append(torch.cuda.max_memory_allocated() - baseline - held[-1])
    result = {"step_ms": statistics.median(times) * 1e3, "held_before_step_gib": held[-1] / 2**30,
              "step_peak_above_gib": max(above) / 2**30, "peak_gib": (held[-1] + max(above)) / 2**30}
    print(f"{setting:42s} step {result['step_ms']:6.1f} ms, held {result['held_before_step_gib']:5.1f} GiB "
          f"+ step peak {result['step_peak_above_gib']:5.2f} GiB = {result['peak_gib']:5.1f} GiB", flush=True)
    del optimizer, model
    gc.collect()  # use_fast_step's closures make a reference cycle
    torch.cuda.empty_cache()
    return result


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--arch", default="qwen3-vl-2b", help="built-in architecture whose parameters are updated")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps (the first compiles our kernel)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per measurement")
    ap.add_argument("--rounds", type=int, default=2, help="each optimizer is measured this many times, interleaved")
    ap.add_argument("--megatron", action="store_true", help="also part 2: megatron's whole optimizer step")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    numels = [math.prod(s) for s in shard_shapes(builtin_arch(args.arch), 1, 0, 1, 0).values()]
    print(f"{args.arch}: {len(numels)} tensors, {sum(numels) / 1e9:.3f} B values, on {torch.cuda.get_device_name()}")
    kinds = ("torch-fused-fp32", "ours-bf16-state")
    runs = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            runs[kind].append(measure(kind, numels, args.warmup, args.steps, lr=1e-5))
    best = {k: min(r, key=lambda x: x["step_ms"]) for k, r in runs.items()}
    ratio = {key: best["ours-bf16-state"][key] / best["torch-fused-fp32"][key] for key in ("step_ms", "state_gib")}
    print(f"ours / torch fused: step time {ratio['step_ms']:.2f}x, state {ratio['state_gib']:.2f}x "
          f"({best['torch-fused-fp32']['state_gib'] - best['ours-bf16-state']['state_gib']:.2f} GiB less)")
    report = {"machine": machine_info("cuda"), "tensors": len(numels),
              "values": sum(numels), "runs": runs, "best": best, "ours_over_torch": ratio}
    if args.megatron:
        from train.parallel import init_parallel

        info = init_parallel(1, 1, device="cuda")
        megatron = {name: [] for name in MEGATRON_SETTINGS}
        for _ in range(args.rounds):
            for name in MEGATRON_SETTINGS:
                megatron[name].append(measure_megatron(name, args.arch, args.warmup, args.steps, info))
        report["megatron"] = {name: min(r, key=lambda x: x["step_ms"]) for name, r in megatron.items()}
        report["megatron_runs"] = megatron
        by_setting = {MEGATRON_SETTINGS[name]: result for name, result in report["megatron"].items()}
        report["fast_over_megatron"] = {}
        for dtype in ("fp32", "bf16"):
            base, fast = by_setting[(dtype, dtype, False)], by_setting[(dtype, dtype, True)]
            ratio = {key: fast[key] / base[key] for key in ("step_ms", "peak_gib")}
            report["fast_over_megatron"][dtype] = ratio
            print(f"{dtype} grads + state, fast / megatron's step: step time {ratio['step_ms']:.2f}x, "
                  f"peak {ratio['peak_gib']:.2f}x")
    if args.json_out:
        write_json(args.json_out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
