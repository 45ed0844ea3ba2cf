"""The vision tower alone, forward + backward, compiled two ways, side by side in one process.

    python3 benchmarks/vision_speed.py --arch qwen3-vl-2b --attention fa4 \
        --json-out benchmarks/results/vision_speed_fa4_<device>_<yyyymmdd>.json

What the trainer runs for the vision part of a step: the real architecture's tower (random
weights, bf16), micro-batches of images drawn like the synthetic training mix (`--image-tokens`
merged tokens per image, images added until `--visual-tokens` per micro-batch), activation
recompute of every block as `--recompute full` does (`--no-recompute`: none), unit output
gradients. Compile modes:

- `blocks`: each block compiled on its own (24 graphs called from Python, each block's
  checkpoint re-entered from Python in backward), as the trainer does;
- `tower`: `VisionTower.encode` (all blocks, recompute and mergers) compiled as one graph
  (`--modes` with no mode: `blocks` alone).

Per mode and micro-batch: wall seconds (forward + backward, synchronised), the host's own
seconds to queue that work (until `backward()` returns), and, from one profiled repetition,
the GPU's kernel seconds. Wall well above kernel time with the host's queueing time near the
wall means the GPU waits for Python. Modes run interleaved, `--reps` times; medians reported,
ratios against `blocks`. Outputs and gradients of each mode are compared with `blocks`'s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch
from common import machine_info, parser, write_json
from synthetic_shards import _image_grid  # the training mix's image sizes

from train.model.arch import builtin_arch
from train.model.attention import select_attention_kernel
from train.model.vision import VisionTower

MODES = ("blocks", "tower")


def micro_batch_grids(rng: np.random.Generator, visual_tokens: int, image_tokens: tuple[int, int], merge: int) -> torch.Tensor:
    """image_grid_thw [K, 3] of images drawn until their merged tokens reach `visual_tokens`."""
    grids, total = [], 0
    while total < visual_tokens:
        h, w = _image_grid(rng, image_tokens[0], image_tokens[1], merge)
        grids.append((1, h, w))
        total += h * w // merge ** 2
    return torch.tensor(grids, dtype=torch.long)


def build_tower(arch, mode: str, device, seed: int, recompute: bool) -> VisionTower:
    torch.manual_seed(seed)
    tower = VisionTower(arch.vision, params_dtype=torch.bfloat16, device=device)
    for p in tower.parameters():
        torch.nn.init.normal_(p, std=0.02)
    tower.recompute_blocks = len(tower.blocks) if recompute else 0
    if mode == "blocks":
        for block in tower.blocks:
            block.compile(dynamic=True)
    else:
        tower.encode = torch.compile(tower.encode, dynamic=True)
    return tower


def fwd_bwd(tower: VisionTower, pixels: torch.Tensor, grid: torch.Tensor) -> float:
    """Forward + backward with unit output gradients; returns the host's queueing seconds."""
    t0 = time.perf_counter()
    out, deepstack = tower(pixels, grid)
    outs = [out, *deepstack]
    torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    return time.perf_counter() - t0


def kernel_seconds(tower, work) -> list[float]:
    """GPU kernel seconds per micro-batch from one profiled pass (the sum of kernel durations)."""
    from torch.profiler import ProfilerActivity, profile

    out = []
    for pixels, grid in work:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fwd_bwd(tower, pixels, grid)
            torch.cuda.synchronize()
        out.append(sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser(__doc__)
    ap.add_argument("--arch", default="qwen3-vl-2b", help="built-in architecture whose tower runs")
    ap.add_argument("--attention", default="fa2", choices=("fa2", "fa4"), help="CUDA attention kernel")
    ap.add_argument("--modes", nargs="*", default=["tower"], choices=MODES[1:],
                    help="modes measured against `blocks` (default: tower; none: `blocks` alone)")
    ap.add_argument("--micro-batches", type=int, default=4, help="distinct micro-batches (image mixes)")
    ap.add_argument("--visual-tokens", type=int, default=5700,
                    help="merged visual tokens per micro-batch (35 %% of a 16k pack in the training mix)")
    ap.add_argument("--image-tokens", type=int, nargs=2, default=(64, 1300), metavar=("MIN", "MAX"),
                    help="merged tokens per image")
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions of both modes (medians reported)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the image mix and the weights")
    ap.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=True,
                    help="redo each block's forward in backward, as the trainer's --recompute full does (default on)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("vision_speed.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    arch = builtin_arch(args.arch)
    select_attention_kernel(args.attention, {"vision tower": arch.vision.head_dim})
    v = arch.vision
    rng = np.random.default_rng(args.seed)
    width = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    work = []
    for _ in range(args.micro_batches):
        grid = micro_batch_grids(rng, args.visual_tokens, tuple(args.image_tokens), v.spatial_merge_size)
        pixels = torch.randn(int(grid.prod(1).sum()), width, device=device, dtype=torch.bfloat16)
        work.append((pixels, grid))
    modes = ("blocks", *dict.fromkeys(args.modes))
    towers = {mode: build_tower(arch, mode, device, args.seed, args.recompute) for mode in modes}

    compile_s = {}
    for mode, tower in towers.items():  # the first pass compiles (dynamic shapes: once per mode)
        t0 = time.perf_counter()
        for pixels, grid in work:
            fwd_bwd(tower, pixels, grid)
        torch.cuda.synchronize()
        compile_s[mode] = time.perf_counter() - t0

    # Same weights, same inputs: the two modes must agree (output and weight gradients).
    outs, grads = {}, {}
    for mode, tower in towers.items():
        tower.zero_grad(set_to_none=True)
        pixels, grid = work[0]
        out, deepstack = tower(pixels, grid)
        outs[mode] = [t.detach().float() for t in (out, *deepstack)]
        torch.autograd.backward([out, *deepstack], [torch.ones_like(t) for t in (out, *deepstack)])
        grads[mode] = {n: p.grad.float() for n, p in tower.named_parameters()}
    out_diff = {m: max((a - b).abs().max().item() for a, b in zip(outs["blocks"], outs[m])) for m in modes[1:]}
    grad_rel = {m: max(((grads["blocks"][n] - grads[m][n]).norm() / grads["blocks"][n].norm().clamp(min=1e-30)).item()
                       for n in grads["blocks"]) for m in modes[1:]}

    wall = {m: [[] for _ in work] for m in modes}
    host = {m: [[] for _ in work] for m in modes}
    peak = {}
    for rep in range(args.reps):
        for mode in (modes if rep % 2 == 0 else modes[::-1]):
            tower = towers[mode]
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            for i, (pixels, grid) in enumerate(work):
                tower.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                host[mode][i].append(fwd_bwd(tower, pixels, grid))
                torch.cuda.synchronize()
                wall[mode][i].append(time.perf_counter() - t0)
            peak[mode] = max(peak.get(mode, 0.0), (torch.cuda.max_memory_allocated() - base) / 2**30)
    kernels = {mode: kernel_seconds(towers[mode], work) for mode in modes}

    rows = []
    for i, (pixels, grid) in enumerate(work):
        row = {"patches": int(pixels.shape[0]), "images": int(grid.shape[0])}
        for mode in modes:
            row[mode] = {"wall_s": statistics.median(wall[mode][i]), "host_s": statistics.median(host[mode][i]),
                         "kernel_s": kernels[mode][i], "wall_s_reps": wall[mode][i]}
        rows.append(row)
    total = {mode: {k: sum(r[mode][k] for r in rows) for k in ("wall_s", "host_s", "kernel_s")} for mode in modes}
    result = {
        "machine": machine_info(device), "args": vars(args), "compile_s": compile_s, "max_abs_output_diff": out_diff, "max_rel_grad_diff": grad_rel,
        "peak_above_inputs_gib": peak, "micro_batches": rows, "total": total,
        **{f"{m}_over_blocks_wall": total[m]["wall_s"] / total["blocks"]["wall_s"] for m in modes[1:]},
    }
    print(f"{args.arch} vision tower, {args.attention}, recompute {'on' if args.recompute else 'off'}, {len(work)} micro-batches "
          f"({sum(r['patches'] for r in rows):,} patches), medians of {args.reps} reps, {result['machine']['device']}")
    print(f"{'patches':>8} {'imgs':>4} | " + " | ".join(f"{m + ' wall/host/kernel ms':>28}" for m in modes))
    for r in rows:
        print(f"{r['patches']:>8} {r['images']:>4} | " + " | ".join(
            f"{r[m]['wall_s'] * 1e3:>9.1f}/{r[m]['host_s'] * 1e3:>8.1f}/{r[m]['kernel_s'] * 1e3:>8.1f}" for m in modes))
    print("total    " + "      | " + " | ".join(
        f"{total[m]['wall_s'] * 1e3:>9.1f}/{total[m]['host_s'] * 1e3:>8.1f}/{total[m]['kernel_s'] * 1e3:>8.1f}" for m in modes))
    for m in modes[1:]:
        print(f"{m} / blocks wall: {result[f'{m}_over_blocks_wall']:.3f}x; max |out diff| {out_diff[m]:.3g}, "
              f"max rel grad diff {grad_rel[m]:.3g}")
    print("compile s: " + ", ".join(f"{m} {s:.1f}" for m, s in compile_s.items())
          + "; peak above inputs GiB: " + ", ".join(f"{m} {g:.2f}" for m, g in peak.items()))
    if args.json_out:
        write_json(args.json_out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
