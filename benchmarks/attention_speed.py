"""`packed_attention` forward + backward with each CUDA kernel (`--attention fa2 | fa4`), and
cuDNN's fused attention as a candidate, side by side in one process, at the Qwen3-VL-2B shapes
the trainer runs:

- LM: 16 query / 8 key-value heads of 128, causal, 16k-token packs of samples drawn like the
  training mix (100-3000 text tokens plus 0-3 images of 64-1300 visual tokens each);
- vision: 16 heads of 64, bidirectional, 4-10 images of 4 x (64-1300) patches each.

The same random packs go through every kernel. First each kernel's outputs and q/k/v gradients
on one pack of each shape are compared with FA2's (bf16 against bf16); then fwd+bwd is timed
per pack, TFLOP/s counting causal attention as half the square. Two passes over the packs:
the first meets each pack's shape for the first time (its first 4 calls are printed, since
FA4 compiles its kernels on first use, and not counted), the second meets them again.

- fa2, fa4: `packed_attention` as the trainer runs it. Needs the flash-attn-4 package for fa4.
- cudnn: cuDNN's fused flash attention on packed (THD, ragged-offset) tensors, through the
  `nvidia-cudnn-frontend` package's `cudnn::sdpa_fwd` op and its backward. cuDNN builds an
  execution plan per (sequences, longest sequence, and in the backward total tokens), so the
  candidate pads the sequence count to a multiple of 16 with empty sequences and the longest
  sequence to a multiple of 1024: the first pass counts the plan builds a new shape costs.

    python benchmarks/attention_speed.py --kernels fa2,fa4,cudnn --json-out benchmarks/results/attention_speed_h100_<yyyymmdd>.json
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


KERNELS = ("fa2", "fa4", "cudnn")
CUDNN_SEQUENCE_MULTIPLE, CUDNN_LENGTH_MULTIPLE = 16, 1024


def cudnn_attention(q, k, v, cu, max_seqlen, causal):
    """cuDNN's fused attention on THD tensors (the `nvidia-cudnn-frontend` package), with the
    sequence count and the longest sequence padded so that packs share execution plans."""
    from cudnn.sdpa.fwd import torch_op

    sequences = cu.numel() - 1
    padded = -(-sequences // CUDNN_SEQUENCE_MULTIPLE) * CUDNN_SEQUENCE_MULTIPLE
    cu = torch.cat([cu, cu[-1:].expand(padded - sequences)])  # empty sequences
    max_seqlen = -(-max_seqlen // CUDNN_LENGTH_MULTIPLE) * CUDNN_LENGTH_MULTIPLE
    return torch_op.sdpa(q, k, v, scale=q.shape[-1] ** -0.5, is_causal=causal, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                         max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen, return_lse=True)[0]  # its backward needs the LSE


def fwd_bwd(kernel, q, k, v, cu, max_seqlen, causal, grad_out):
    if kernel == "cudnn":
        out = cudnn_attention(q, k, v, cu, max_seqlen, causal)
    else:
        out = packed_attention(q, k, v, cu, max_seqlen, causal=causal)
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out))


def flops(lens: list[int], hq: int, d: int, causal: bool) -> float:
    f = sum(4 * n * n * hq * d for n in lens) * 3.5  # forward 4 n^2 h d; backward 2.5x forward
    return f / 2 if causal else f


def timed(kernel: str, shape: str, packs: list[list[int]], first_pass: bool) -> dict:
    hq, hkv, d, causal = SHAPES[shape]
    seconds, work = 0.0, 0.0
    untimed = UNTIMED if first_pass else 0
    for i, lens in enumerate(packs):
        q, k, v, cu, mx = make(lens, hq, hkv, d)
        grad_out = torch.randn_like(q)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fwd_bwd(kernel, q, k, v, cu, mx, causal, grad_out)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if i < untimed:
            print(f"  {kernel} {shape} call {i} max_seqlen {mx}: {dt * 1e3:.1f} ms", flush=True)
        else:
            seconds += dt
            work += flops(lens, hq, d, causal)
    return {"seconds": seconds, "packs": len(packs) - untimed, "tflop_per_s": work / seconds / 1e12}


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--packs", type=int, default=16, help=f"packs per shape (the first {UNTIMED} untimed in the first pass)")
    ap.add_argument("--seq-len", type=int, default=16384, help="LM pack length")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random packs and inputs")
    ap.add_argument("--kernels", default="fa2,fa4", help=f"comma-separated, from {', '.join(KERNELS)}; fa2 first "
                    "(the others are compared with it)")
    args = ap.parse_args(argv)
    kernels = args.kernels.split(",")
    if kernels[0] != "fa2" or not set(kernels) <= set(KERNELS):
        raise SystemExit(f"--kernels {args.kernels!r}: fa2 first, then any of {', '.join(KERNELS[1:])}")
    if not torch.cuda.is_available():
        raise SystemExit("attention_speed.py needs a CUDA GPU")
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    packs = {"lm": [lm_pack(rng, args.seq_len) for _ in range(args.packs)],
             "vision": [vision_pack(rng) for _ in range(args.packs)]}
    machine = machine_info("cuda")
    log(f"{machine['device']}, torch {machine['torch']}")
    if "cudnn" in kernels:
        import cudnn

        machine["cudnn_backend"] = cudnn.backend_version_string()
        log(f"cuDNN {machine['cudnn_backend']}")

    results, outputs = {}, {}
    for kernel in kernels:
        select_attention_kernel("fa4" if kernel == "fa4" else "fa2")
        for shape in SHAPES:
            hq, hkv, d, causal = SHAPES[shape]
            torch.manual_seed(args.seed)  # the same inputs for every kernel
            q, k, v, cu, mx = make(packs[shape][0], hq, hkv, d)
            outputs[kernel, shape] = fwd_bwd(kernel, q, k, v, cu, mx, causal, torch.randn_like(q))
            for first_pass in (True, False):
                results[f"{kernel}_{shape}_{'first' if first_pass else 'second'}"] = timed(kernel, shape, packs[shape],
                                                                                           first_pass)
    select_attention_kernel("fa2")

    agreement = {}
    for kernel in kernels[1:]:
        for shape in SHAPES:
            for name, a, b in zip(("out", "dq", "dk", "dv"), outputs[kernel, shape], outputs["fa2", shape]):
                diff = (a.float() - b.float()).abs()
                agreement[f"{kernel}_{shape}_{name}"] = {"max": diff.max().item(), "mean": diff.mean().item(),
                                                         "ref_abs_mean": b.float().abs().mean().item()}
                print(f"{kernel} vs fa2 {shape} {name}: max {diff.max().item():.3e} mean {diff.mean().item():.3e} "
                      f"(|fa2| mean {b.float().abs().mean().item():.3e})")
    print("\n| kernel | shape | pass | fwd+bwd s | packs | TFLOP/s |\n|---|---|---|---|---|---|")
    for key, r in results.items():
        kernel, shape, which = key.split("_")
        print(f"| {kernel} | {shape} | {which} | {r['seconds']:.3f} | {r['packs']} | {r['tflop_per_s']:.0f} |")
    speedup = {f"{kernel}_{shape}_{which}": results[f"{kernel}_{shape}_{which}"]["tflop_per_s"]
               / results[f"fa2_{shape}_{which}"]["tflop_per_s"]
               for kernel in kernels[1:] for shape in SHAPES for which in ("first", "second")}
    print("speed against fa2 (TFLOP/s ratio): " + ", ".join(f"{s} {x:.2f}x" for s, x in speedup.items()))
    if args.json_out:
        write_json(args.json_out, {"machine": machine, "args": vars(args), "results": results, "speedup": speedup,
                                   "agreement_with_fa2": agreement})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
