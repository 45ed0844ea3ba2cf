"""`packed_attention` forward + backward with each CUDA kernel (`--attention fa2 | fa4`), side by
side in one process, at the Qwen3-VL-2B shapes the trainer runs:

- LM: 16 query / 8 key-value heads of 128, causal, 16k-token packs of samples drawn like the
  training mix (100-3000 text tokens plus 0-3 images of 64-1300 visual tokens each);
- vision: 16 heads of 64, bidirectional, 4-10 images of 4 x (64-1300) patches each.

The same random packs go through both kernels. First the two kernels' outputs and q/k/v
gradients on one pack of each shape are compared (bf16 against bf16); then fwd+bwd is timed
per pack (the first 4 calls are printed, since FA4 compiles its kernels on first use, and
not counted), TFLOP/s counting causal attention as half the square. Needs CUDA, and the
flash-attn-4 package for fa4.

    python benchmarks/attention_speed.py --json-out benchmarks/results/attention_speed_h100_<yyyymmdd>.json
"""

from __future__ import annotations

import random
import time

import torch
from common import log, machine_info, parser, write_json

from train.model.attention import packed_attention, select_attention_kernel

SHAPES = {"lm": (16, 8, 128, True), "vision": (16, 16, 64, False)}  # q heads, kv heads, head dim, causal
UNTIMED = 4


def lm_pack(rng: random.Random, total: int) -> list[int]:
    lens = []
    while sum(lens) < total:
        n = rng.randint(100, 3000) + sum(rng.randint(64, 1300) for _ in range(rng.randint(0, 3)))
        lens.append(min(n, total - sum(lens)))
    return lens


def vision_pack(rng: random.Random) -> list[int]:
    return [4 * rng.randint(64, 1300) for _ in range(rng.randint(4, 10))]


def make(lens: list[int], hq: int, hkv: int, d: int):
    t = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (hq, hkv, hkv))
    return q, k, v, cu, max(lens)


def fwd_bwd(q, k, v, cu, max_seqlen, causal, grad_out):
    out = packed_attention(q, k, v, cu, max_seqlen, causal=causal)
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out))


def flops(lens: list[int], hq: int, d: int, causal: bool) -> float:
    f = sum(4 * n * n * hq * d for n in lens) * 3.5  # forward 4 n^2 h d; backward 2.5x forward
    return f / 2 if causal else f


def timed(kernel: str, shape: str, packs: list[list[int]]) -> dict:
    hq, hkv, d, causal = SHAPES[shape]
    seconds, work = 0.0, 0.0
    for i, lens in enumerate(packs):
        q, k, v, cu, mx = make(lens, hq, hkv, d)
        grad_out = torch.randn_like(q)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fwd_bwd(q, k, v, cu, mx, causal, grad_out)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if i < UNTIMED:
            print(f"  {kernel} {shape} call {i} max_seqlen {mx}: {dt * 1e3:.1f} ms", flush=True)
        else:
            seconds += dt
            work += flops(lens, hq, d, causal)
    return {"seconds": seconds, "packs": len(packs) - UNTIMED, "tflop_per_s": work / seconds / 1e12}


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--packs", type=int, default=16, help=f"packs per shape (the first {UNTIMED} untimed)")
    ap.add_argument("--seq-len", type=int, default=16384, help="LM pack length")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random packs and inputs")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("attention_speed.py needs a CUDA GPU")
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    packs = {"lm": [lm_pack(rng, args.seq_len) for _ in range(args.packs)],
             "vision": [vision_pack(rng) for _ in range(args.packs)]}
    machine = machine_info("cuda")
    log(f"{machine['device']}, torch {machine['torch']}")

    results, outputs = {}, {}
    for kernel in ("fa2", "fa4"):
        select_attention_kernel(kernel)
        for shape in SHAPES:
            hq, hkv, d, causal = SHAPES[shape]
            torch.manual_seed(args.seed)  # the same inputs for both kernels
            q, k, v, cu, mx = make(packs[shape][0], hq, hkv, d)
            outputs[kernel, shape] = fwd_bwd(q, k, v, cu, mx, causal, torch.randn_like(q))
            results[f"{kernel}_{shape}"] = timed(kernel, shape, packs[shape])
    select_attention_kernel("fa2")

    agreement = {}
    for shape in SHAPES:
        for name, a, b in zip(("out", "dq", "dk", "dv"), outputs["fa4", shape], outputs["fa2", shape]):
            diff = (a.float() - b.float()).abs()
            agreement[f"{shape}_{name}"] = {"max": diff.max().item(), "mean": diff.mean().item(),
                                            "ref_abs_mean": b.float().abs().mean().item()}
            print(f"fa4 vs fa2 {shape} {name}: max {diff.max().item():.3e} mean {diff.mean().item():.3e} "
                  f"(|fa2| mean {b.float().abs().mean().item():.3e})")
    print(f"\n| kernel | shape | fwd+bwd s ({args.packs - UNTIMED} packs) | TFLOP/s |\n|---|---|---|---|")
    for key, r in results.items():
        print(f"| {key.split('_')[0]} | {key.split('_')[1]} | {r['seconds']:.3f} | {r['tflop_per_s']:.0f} |")
    speedup = {shape: results[f"fa2_{shape}"]["seconds"] / results[f"fa4_{shape}"]["seconds"] for shape in SHAPES}
    print("fa4 / fa2 speed: " + ", ".join(f"{s} {x:.2f}x" for s, x in speedup.items()))
    if args.json_out:
        write_json(args.json_out, {"machine": machine, "args": vars(args), "results": results, "speedup": speedup,
                                   "fa4_vs_fa2": agreement})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
