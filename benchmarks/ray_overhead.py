"""Rows/s of `vlmpack preprocess` on one machine: the local executor (worker processes) against
`--executor ray` (Ray tasks on a local Ray instance with the same CPUs), same data, same run,
interleaved rounds; the outputs are checked byte for byte equal.

Each Ray round starts a fresh Ray instance before its clock starts (on a cluster Ray is already
up) and shuts it down after, so neither executor reuses warm workers from an earlier round; the
start-up time is reported apart. Data: `preprocess.examples.example_rows` (the quickstart's
conversations, images of 48-640 px), written once as JSONL.

    python benchmarks/ray_overhead.py --rows 4000 --rounds 3 --json-out benchmarks/results/ray_overhead_<device>_<yyyymmdd>.json
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from common import REPO, log, machine_info, parser, write_json

from preprocess.examples import example_rows, write_jsonl
from preprocess.job import PreprocessConfig, run_preprocess


def outputs(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file() and p.name != ".vlmpack.lock"}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rows", type=int, default=4000, help="rows to preprocess (default %(default)s)")
    ap.add_argument("--rows-per-shard", type=int, default=100, help="rows per work unit (default %(default)s)")
    ap.add_argument("--workers", type=int, default=os.cpu_count(), help="CPUs for both executors (default: all, %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default %(default)s)")
    args = ap.parse_args()
    import ray

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = write_jsonl(tmp / "rows.jsonl", example_rows(args.rows, seed=0))
        log(f"{args.rows} rows, {data.stat().st_size / 2**20:.0f} MiB; {args.workers} CPUs")
        seconds = {"local": [], "ray": []}
        ray_start_s = []
        reference = None
        for r in range(args.rounds):
            for executor in (("local", "ray") if r % 2 == 0 else ("ray", "local")):
                out = tmp / f"{executor}-{r}"
                if executor == "ray":
                    t0 = time.perf_counter()
                    # the workers import this checkout's code, as the driver does
                    ray.init(num_cpus=args.workers, log_to_driver=False, include_dashboard=False,
                             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
                    ray_start_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                run_preprocess(PreprocessConfig(inputs=[str(data)], out=str(out), workers=args.workers,
                                                rows_per_shard=args.rows_per_shard, progress=False, executor=executor))
                seconds[executor].append(time.perf_counter() - t0)
                if executor == "ray":
                    ray.shutdown()
                got = outputs(out)
                reference = reference or got
                assert got == reference, f"{executor} round {r}: output differs"
                shutil.rmtree(out)
                log(f"round {r} {executor}: {seconds[executor][-1]:.2f} s ({args.rows / seconds[executor][-1]:.0f} rows/s)")
    median = {k: statistics.median(v) for k, v in seconds.items()}
    result = {"rows": args.rows, "workers": args.workers, "rows_per_shard": args.rows_per_shard,
              "seconds": seconds, "rows_per_s": {k: args.rows / v for k, v in median.items()},
              "ray_over_local_time": median["ray"] / median["local"], "ray_start_s": ray_start_s,
              "outputs_identical": True}
    print(f"\nlocal {result['rows_per_s']['local']:.0f} rows/s, ray {result['rows_per_s']['ray']:.0f} rows/s: "
          f"ray takes {100 * (result['ray_over_local_time'] - 1):+.1f} % time (median of {args.rounds}); "
          f"Ray start-up {statistics.median(ray_start_s):.1f} s apart; outputs byte-identical")
    if args.json_out:
        write_json(args.json_out, {"machine": machine_info("cpu"), **result})
        log(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
