"""The experts of one Mixture-of-Experts layer, forward + backward: grouped GEMM vs one GEMM per expert.

Both run the trainer's `TorchGroupedMLP` (megatron's GroupedMLP parameters) on the same
weights, tokens and routing: `grouped` is its CUDA path (one `torch._grouped_mm` per
projection), `per-expert` its loop of one GEMM per expert (the structure of megatron's
SequentialMLP, the TE-free alternative). Default shapes are a Qwen3-VL-30B-A3B layer (128
experts, top-8, hidden 2048, expert width 768) on a 16k-token pack; tokens are routed by
softmax top-k of random logits with a per-expert skew, so experts get unequal counts.
Reported: median milliseconds per forward + backward, achieved TFLOP/s, and the ratio.

    python benchmarks/moe_experts_speed.py --json-out benchmarks/results/moe_experts_speed_h100_<yyyymmdd>.json
"""

from __future__ import annotations

import statistics
import time

import torch
from common import log, machine_info, parser, write_json

from train.model.arch import builtin_arch
from train.model.moe import TorchGroupedMLP
from train.model.qwen_vl import transformer_config
from train.parallel import destroy_parallel, init_parallel


def routed_inputs(tokens: int, hidden: int, experts: int, topk: int, seed: int):
    """Rows sorted by expert (what the token dispatcher hands the experts), their counts and probs."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    skew = torch.randn(experts, device="cuda", generator=gen)
    logits = torch.randn(tokens, experts, device="cuda", generator=gen) + skew
    probs, chosen = logits.softmax(-1).topk(topk, dim=-1)
    probs = probs / probs.sum(-1, keepdim=True)
    order = chosen.flatten().argsort(stable=True)
    counts = torch.bincount(chosen.flatten(), minlength=experts)
    x = torch.randn(tokens * topk, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    return x, counts.cpu(), probs.flatten()[order].float()


def time_path(experts: TorchGroupedMLP, x, counts, probs, warmup: int, steps: int) -> list[float]:
    grad = torch.randn_like(x)
    times = []
    for i in range(warmup + steps):
        experts.zero_grad(set_to_none=True)
        inp = x.detach().requires_grad_()
        torch.cuda.synchronize()
        start = time.perf_counter()
        out, _ = experts(inp, counts, probs)
        out.backward(grad)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--arch", default="qwen3-vl-30b-a3b", help="built-in MoE architecture whose layer shape is used")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens in the pack (default %(default)s)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per path (default %(default)s)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per path, interleaved rounds (default %(default)s)")
    args = ap.parse_args()
    lm = builtin_arch(args.arch).lm
    if not lm.is_moe:
        raise SystemExit(f"--arch {args.arch} is not a Mixture-of-Experts architecture")
    info = init_parallel(1, 1, device="cuda")
    config = transformer_config(builtin_arch(args.arch), params_dtype=torch.bfloat16, bf16=True)
    experts = TorchGroupedMLP(lm.num_experts, config).cuda()
    x, counts, probs = routed_inputs(args.tokens, lm.hidden_size, lm.num_experts, lm.num_experts_per_tok, seed=0)
    flops = 3 * 2 * x.shape[0] * 3 * lm.hidden_size * lm.moe_intermediate_size  # fwd + 2 bwd GEMMs, 3 projections
    log(f"{args.arch} experts: {lm.num_experts} x (hidden {lm.hidden_size}, width {lm.moe_intermediate_size}), "
        f"top-{lm.num_experts_per_tok}, {args.tokens} tokens; rows per expert {int(counts.min())}..{int(counts.max())}")
    outputs, times = {}, {"grouped": [], "per-expert": []}
    for per_expert in (False, True):  # the same outputs first
        experts.per_expert = per_expert
        outputs[per_expert] = experts(x, counts, probs)[0].float()
    rel = float((outputs[True] - outputs[False]).norm() / outputs[True].norm())
    for _ in range(2):  # two interleaved rounds
        for name in times:
            experts.per_expert = name == "per-expert"
            times[name] += time_path(experts, x, counts, probs, args.warmup, args.steps // 2)
    result = {"args": vars(args), "machine": machine_info(info.device), "relative_output_difference": rel,
              "rows_per_expert": {"min": int(counts.min()), "max": int(counts.max())}}
    for name, values in times.items():
        ms = statistics.median(values) * 1e3
        result[name] = {"ms": ms, "tflops": flops / (ms / 1e3) / 1e12}
        log(f"{name:10s} {ms:8.2f} ms  {result[name]['tflops']:6.1f} TFLOP/s")
    result["per_expert_over_grouped"] = result["per-expert"]["ms"] / result["grouped"]["ms"]
    log(f"grouped GEMM is {result['per_expert_over_grouped']:.2f}x faster; outputs differ by {rel:.1e} (relative)")
    if args.json_out:
        write_json(args.json_out, result)
    destroy_parallel()


if __name__ == "__main__":
    main()
