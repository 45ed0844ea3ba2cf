"""How far apart loss curves lie, within and between groups of `loss_curves.py` runs.

    python3 benchmarks/curve_spread.py --group eager E1.json E2.json --group compiled C1.json C2.json

Each run is one `loss_curves.py` result (one layout of it, `--layout`); every run must have
trained on the same tokens step by step, or the comparison is refused. For each group, and for
each pair of groups, every pair of runs is compared step by step: reported are the least,
median and largest over pairs of the largest and of the mean |loss difference|. Within a group that is the run-to-run
spread; between groups, how far one setting's curve lies from another's. Per run: tokens/s,
the first step's loss (same weights, same batch: any difference there is the forward's
rounding) and the last.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
from pathlib import Path

from common import machine_info, parser, write_json
from loss_curves import compare


def parse_args(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--group", nargs="+", action="append", required=True, metavar=("NAME", "RUN.json"),
                    help="a group's name, then its loss_curves.py results; repeat per group")
    ap.add_argument("--layout", default="1gpu", help="the layout of each result to compare (default %(default)s)")
    return ap.parse_args(argv)


def load_run(path: str, layout: str) -> dict:
    result = json.loads(Path(path).read_text())
    run = result.get("layouts", {}).get(layout)
    if run is None or not run.get("steps"):
        raise SystemExit(f"error: {path} has no steps for layout {layout!r} (layouts: "
                         f"{', '.join(result.get('layouts', {})) or 'none'}); pass --layout")
    return {"file": Path(path).name, "steps": run["steps"], "tokens_per_s": run["summary"]["tokens_per_s"]}


def pair_stats(a: dict, b: dict) -> tuple[float, float]:
    diff = compare(a["steps"], b["steps"])
    return diff["max_abs_loss_diff"], diff["mean_abs_loss_diff"]


def spread(pairs: list[tuple[dict, dict]]) -> dict:
    """[least, median, largest] over pairs of the largest and of the mean |loss difference|."""
    stats = [pair_stats(a, b) for a, b in pairs]
    return {"pairs": len(stats), **{key: [min(col), statistics.median(col), max(col)]
                                     for key, col in zip(("max_diff", "mean_diff"), zip(*stats))}}


def main(argv=None) -> int:
    args = parse_args(argv)
    groups = {}
    for name, *paths in args.group:
        if not paths:
            raise SystemExit(f"error: --group {name} names no result files")
        groups[name] = [load_run(p, args.layout) for p in paths]
    runs = [run for group in groups.values() for run in group]
    steps = min(len(r["steps"]) for r in runs)  # compare() takes the steps two runs share
    for run in runs:
        if not compare(run["steps"], runs[0]["steps"])["same_tokens"]:
            raise SystemExit(f"error: {run['file']} trained on other tokens than {runs[0]['file']}: "
                             "compare only runs of one shard directory and seed")

    result = {"machine": machine_info("cpu"), "args": vars(args), "steps": steps, "runs": {}, "spread": {}}
    print(f"{len(runs)} runs, {steps} steps each")
    for name, group in groups.items():
        for run in group:
            first, last = run["steps"][0]["loss"], run["steps"][steps - 1]["loss"]
            result["runs"][run["file"]] = {"group": name, "tokens_per_s": run["tokens_per_s"],
                                           "first_loss": first, "last_loss": last}
            print(f"  {name:>12} {run['file']}: {run['tokens_per_s']:,.0f} tok/s, loss {first:.5f} -> {last:.5f}")
    comparisons = [(a, a, list(itertools.combinations(groups[a], 2))) for a in groups]
    comparisons += [(a, b, list(itertools.product(groups[a], groups[b]))) for a, b in itertools.combinations(groups, 2)]
    print("max / mean |loss difference| per step over pairs: least-largest (median)")
    for a, b, pairs in comparisons:
        if not pairs:
            continue
        key = a if a == b else f"{a} vs {b}"
        s = result["spread"][key] = spread(pairs)
        print(f"  {key:>31} ({s['pairs']:>2} pairs): max {s['max_diff'][0]:.1e}-{s['max_diff'][2]:.1e} "
              f"({s['max_diff'][1]:.1e}), mean {s['mean_diff'][0]:.1e}-{s['mean_diff'][2]:.1e} ({s['mean_diff'][1]:.1e})")
    if args.json_out:
        write_json(args.json_out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
