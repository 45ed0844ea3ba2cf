"""One Mixture-of-Experts layer's MLP on a GPU, forward + backward, by part.

The layer is the trainer's (megatron-core's MoELayer: TopKRouter, all-to-all token
dispatcher, `TorchGroupedMLP` experts) at a built-in architecture's shape (default
Qwen3-VL-30B-A3B: 128 experts, top-8, hidden 2048, expert width 768), random init, bf16, on
one pack of `--tokens` random hidden states. Timed, median of interleaved rounds:

- `layer`: the whole MLP (route, dispatch, experts, combine);
- `router`: the router alone (gating GEMM, top-k, softmax);
- `experts`: the experts alone on the rows the dispatcher handed them, as one grouped GEMM
  per projection (the trainer's CUDA path) and as one GEMM per expert (the structure of
  megatron-core's SequentialMLP, the TE-free alternative); both give the same outputs;
- `dispatch` = layer - router - experts: permutation, exchange and un-permutation.

Under torchrun with N processes the layer is expert-parallel over the N GPUs (EP=N, as the
trainer's `--ep N`): each rank routes its own pack of `--tokens` tokens, holds num_experts / N
experts, and the dispatch includes the all-to-all exchange of the routed rows. Each part is
reported for the slowest rank (the one every other rank waits for) beside every rank's times.

    python benchmarks/moe_experts_speed.py --json-out benchmarks/results/moe_experts_speed_h100_<yyyymmdd>.json
    python -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/moe_experts_speed.py --tokens 8192
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
from common import log, machine_info, parser, write_json
from megatron.core.transformer.spec_utils import build_module

from train.model.arch import builtin_arch
from train.model.qwen_vl import layer_spec, transformer_config
from train.parallel import destroy_parallel, init_parallel


def timed(fn, warmup: int, steps: int) -> list[float]:
    """Seconds of each of `steps` calls of fn (forward + backward), after `warmup` calls."""
    times = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--arch", default="qwen3-vl-30b-a3b", help="built-in MoE architecture whose layer shape is used")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens in the pack (default %(default)s)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per part and round (default %(default)s)")
    ap.add_argument("--steps", type=int, default=10, help="timed calls per part, over 2 rounds (default %(default)s)")
    args = ap.parse_args()
    arch = builtin_arch(args.arch)
    lm = arch.lm
    if not lm.is_moe:
        raise SystemExit(f"--arch {args.arch} is not a Mixture-of-Experts architecture")
    ep = int(os.environ.get("WORLD_SIZE", "1"))
    if lm.num_experts % ep:
        raise SystemExit(f"{lm.num_experts} experts cannot be split over {ep} ranks")
    info = init_parallel(1, 1, ep=ep, device="cuda")
    rank = dist.get_rank()
    config = transformer_config(arch, params_dtype=torch.bfloat16, bf16=True)
    layer = build_module(layer_spec(arch).submodules.mlp, config=config, layer_number=1).cuda().train()
    gen = torch.Generator(device="cuda").manual_seed(rank)  # each rank routes its own tokens
    hidden = torch.randn(args.tokens, 1, lm.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
    grad = torch.randn_like(hidden)

    captured = {}
    hook = layer.experts.register_forward_hook(lambda m, a, out: captured.update(inputs=a))
    layer(hidden)
    hook.remove()
    rows, counts, probs = (t.detach() for t in captured["inputs"])
    counts = counts.cpu()
    rows_grad = torch.randn_like(rows)

    def run_layer():
        layer.zero_grad(set_to_none=True)
        out, _ = layer(hidden.detach().requires_grad_())
        out.backward(grad)

    def run_router():
        layer.zero_grad(set_to_none=True)
        routed_probs, _ = layer.router(hidden.detach().requires_grad_())
        routed_probs.sum().backward()

    def run_experts(per_expert: bool):
        def run():
            layer.experts.per_expert = per_expert
            layer.zero_grad(set_to_none=True)
            out, _ = layer.experts(rows.detach().requires_grad_(), counts, probs)
            out.backward(rows_grad)
        return run

    outputs = {}
    for per_expert in (False, True):
        layer.experts.per_expert = per_expert
        with torch.no_grad():
            outputs[per_expert] = layer.experts(rows, counts, probs)[0].float()
    layer.experts.per_expert = False
    rel = float((outputs[True] - outputs[False]).norm() / outputs[True].norm())

    parts = {"layer": run_layer, "router": run_router, "experts": run_experts(False),
             "experts, one GEMM per expert": run_experts(True)}
    times = {name: [] for name in parts}
    for _ in range(2):  # interleaved rounds
        for name, fn in parts.items():
            times[name] += timed(fn, args.warmup, args.steps // 2)
    rank_ms = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    rank_ms["dispatch"] = rank_ms["layer"] - rank_ms["router"] - rank_ms["experts"]
    every_rank = [None] * ep
    dist.all_gather_object(every_rank, rank_ms)
    ms = {name: max(r[name] for r in every_rank) for name in rank_ms}  # the slowest rank sets the pace
    local = lm.num_experts // ep
    flops = 3 * 2 * rows.shape[0] * 3 * lm.hidden_size * lm.moe_intermediate_size  # fwd + 2 bwd GEMMs, 3 projections
    if rank:
        destroy_parallel()
        return
    log(f"{args.arch} MoE MLP: {lm.num_experts} experts (hidden {lm.hidden_size}, width {lm.moe_intermediate_size}), "
        f"top-{lm.num_experts_per_tok}, {args.tokens} tokens per rank, EP={ep} ({local} experts per rank); "
        f"rank 0's rows per expert {int(counts.min())}..{int(counts.max())}; times of the slowest rank")
    for name in ("layer", "router", "dispatch", "experts", "experts, one GEMM per expert"):
        share = f"{ms[name] / ms['layer']:6.1%} of the layer" if name in ("router", "dispatch", "experts") else ""
        log(f"  {name:30s} {ms[name]:8.2f} ms  {share}")
    log(f"experts: grouped GEMM {flops / rank_ms['experts'] / 1e9:.0f} TFLOP/s (rank 0), "
        f"{ms['experts, one GEMM per expert'] / ms['experts']:.2f}x faster than one GEMM per expert; "
        f"outputs differ by {rel:.1e} (relative)")
    result = {"args": vars(args), "machine": machine_info(info.device), "expert_parallel": ep, "ms": ms,
              "ms_per_rank": every_rank,
              "experts_tflops_rank0": flops / rank_ms["experts"] / 1e9, "relative_output_difference": rel,
              "rows_per_expert": {"min": int(counts.min()), "max": int(counts.max())},
              "per_expert_over_grouped": ms["experts, one GEMM per expert"] / ms["experts"]}
    if args.json_out:
        write_json(args.json_out, result)
    destroy_parallel()


if __name__ == "__main__":
    main()
