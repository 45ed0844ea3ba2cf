"""Where a saved step trace's time went (`train_speed.py --profile --trace FILE.json.gz` saves
one): the GPU's idle gaps by what the host was doing, and the GPU time of each kernel kind by
where the host launched it (model part, aten op, forward or backward node).

    python benchmarks/trace_summary.py TRACE.json.gz [--top N] [--json-out FILE]
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from common import log, machine_info, parser, write_json
from train_speed import gpu_idle_summary, kernel_sources, log_kernel_sources


def main(argv=None) -> int:
    ap = parser(__doc__, json_out="both summaries as JSON")
    ap.add_argument("trace", help="a chrome trace from torch.profiler (.json or .json.gz)")
    ap.add_argument("--top", type=int, default=40, help="rows kept per table (default 40)")
    args = ap.parse_args(argv)
    path = Path(args.trace)
    if not path.is_file():
        ap.error(f"{path}: no such trace file")
    try:
        with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
            trace = json.load(f)
        idle, sources = gpu_idle_summary(trace), kernel_sources(trace)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        ap.error(f"{path}: not a torch.profiler chrome trace ({type(exc).__name__}: {exc})")
    if idle:
        log(f"GPU busy {idle['gpu_busy_ms']:.1f} of {idle['span_ms']:.1f} ms, idle {idle['idle_ms']:.1f} ms")
    for row in sources["by_kind_and_part"][:args.top]:
        log(f"  {row['ms']:8.1f} ms {row['kernels']:6d}x  {' | '.join(row['key'])}")
    log_kernel_sources(sources, top=args.top)
    if args.json_out:
        write_json(args.json_out, {"machine": machine_info(), "trace": path.name, "gpu_idle": idle,
                                   "kernel_sources": sources})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
