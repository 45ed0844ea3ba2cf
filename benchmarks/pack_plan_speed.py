"""How fast the pack planner is, and how full its packs are, on a realistic length mix.

Synthetic per-sample sizes (no shards: the planner reads only sizes): text tokens lognormal
(median 500) clipped to 100..3000, plus 0-3 images (uniform) of 64..1300 visual tokens each
(+2 tokens per image for vision_start/vision_end); mean ~1700 tokens, ~60% visual. For each
seq_len (and each --max-visual-tokens, if given) it times `plan_from_stats` (best of
--repeat) and prints samples, packs, fill efficiency (real tokens / (packs * seq_len)),
samples per pack, DP balance at --dp-size, and for a visual budget the ratio of packs to the
lower bound max(tokens / seq_len, visual tokens / budget).

    python benchmarks/pack_plan_speed.py --samples 1000000 --json-out benchmarks/results/pack_plan_speed_<device>_<yyyymmdd>.json
    python benchmarks/pack_plan_speed.py --samples 1000000 --seq-len 16384 --max-visual-tokens 8192
"""

from __future__ import annotations

import json
import time

import numpy as np
from common import machine_info, parser, write_json

from train.pack_plan import PackSettings, SourceStats, plan_from_stats


def synthetic_source(n: int, seed: int) -> SourceStats:
    rng = np.random.default_rng(seed)
    text = np.clip(np.exp(rng.normal(np.log(500), 0.8, n)), 100, 3000).astype(np.int64)
    images = rng.integers(0, 4, n)
    visual = np.zeros(n, np.int64)
    for k in range(3):
        visual += np.where(images > k, rng.integers(64, 1301, n), 0)
    return SourceStats("synthetic", text + visual + 2 * images, visual, {"synthetic": n, "seed": seed})


def main() -> None:
    ap = parser(__doc__, json_out="every row and the machine as one JSON object")
    ap.add_argument("--samples", type=int, default=1_000_000, help="synthetic samples")
    ap.add_argument("--seq-len", type=int, nargs="+", default=[8192, 16384, 32768], help="pack lengths to plan")
    ap.add_argument("--max-visual-tokens", type=int, nargs="*", default=[], help="visual-token budgets per pack to plan")
    ap.add_argument("--global-batch-packs", type=int, default=64, help="packs per global batch")
    ap.add_argument("--dp-size", type=int, default=8, help="data-parallel ranks for the balance figure")
    ap.add_argument("--repeat", type=int, default=3, help="plans per setting (the best time is kept)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sizes and of the planner")
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    args = ap.parse_args()

    source = synthetic_source(args.samples, args.seed)
    print(f"{args.samples:,} samples, mean {source.num_tokens.mean():.0f} tokens, "
          f"{source.visual_tokens.sum() / source.num_tokens.sum():.0%} visual")
    rows = []
    for seq_len in args.seq_len:
        for budget in [None, *args.max_visual_tokens]:
            if budget is not None and budget >= seq_len:
                continue
            best, plan = float("inf"), None
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                plan = plan_from_stats([source], PackSettings(seq_len=seq_len, seed=args.seed, max_visual_tokens=budget,
                                                              global_batch_packs=args.global_batch_packs))
                best = min(best, time.perf_counter() - t0)
            st = plan.stats
            bound = max(source.num_tokens.sum() / seq_len, source.visual_tokens.sum() / budget if budget else 0)
            row = {"seq_len": seq_len, "max_visual_tokens": budget, "seconds": round(best, 3), "packs": st["packs"],
                   "fill_efficiency": round(st["fill_efficiency"], 5), "packs_over_lower_bound": round(st["packs"] / bound, 4),
                   "samples_per_pack": round(st["samples_per_pack_mean"], 2), "dropped_samples": st["dropped_samples"],
                   "dp_visual_max_over_mean": round(plan.balance(args.dp_size)["visual_max_over_mean"], 4)}
            rows.append(row)
            if args.json:
                print(json.dumps(row))
            else:
                print(f"seq_len {seq_len:>6}  visual budget {str(budget):>5}: {best:6.2f} s  {st['packs']:>8,} packs  "
                      f"fill {st['fill_efficiency']:.2%}  packs/bound {row['packs_over_lower_bound']:.4f}  "
                      f"{row['samples_per_pack']:5.2f} samples/pack  dp{args.dp_size} visual max/mean "
                      f"{row['dp_visual_max_over_mean']:.3f}")
    if args.json_out:
        write_json(args.json_out, {"machine": machine_info("cpu"), "args": vars(args),
                                   "mean_tokens": float(source.num_tokens.mean()),
                                   "visual_share": float(source.visual_tokens.sum() / source.num_tokens.sum()),
                                   "rows": rows})


if __name__ == "__main__":
    main()
