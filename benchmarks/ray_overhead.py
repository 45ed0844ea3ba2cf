"""Rows/s of `vlmpack preprocess` on one machine: the local executor (worker processes) against
`--executor ray` (Ray tasks on a local Ray instance with the same CPUs), same data, same run,
interleaved rounds; the outputs are checked byte for byte equal.

Each Ray round starts a fresh Ray instance before its clock starts (on a cluster Ray is already
up) and shuts it down after, so neither executor reuses warm workers from an earlier round; the
start-up time is reported apart. The Ray instance inherits the driver's environment
(PYTHONPATH included), as a cluster's nodes hold the same install, so its workers need no
runtime environment of their own.

Data: `preprocess.examples.example_rows` (the quickstart's conversations, images of 48-640 px).
Their images are written once as files under a media root, as a dataset on shared storage
holds them, and the JSONL refers to them by path; `--distinct-rows` of them are cycled to make
`--rows`, so a job long enough to show throughput rather than start-up costs no more to set up.

    python benchmarks/ray_overhead.py --rows 40000 --distinct-rows 2000 --rounds 3 --json-out benchmarks/results/ray_overhead_<device>_<yyyymmdd>.json
"""

from __future__ import annotations

import base64
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from common import REPO, log, machine_info, parser, write_json

from preprocess.examples import example_rows, write_jsonl
from preprocess.job import PreprocessConfig, run_preprocess
from preprocess.pipeline import SampleOptions


def rows_with_media_files(n: int, distinct: int, media: Path) -> list[dict]:
    """`n` rows cycling `distinct` example rows whose data-URI images are written to files
    under `media` and referred to by their path relative to it."""
    media.mkdir(parents=True, exist_ok=True)
    rows = example_rows(min(n, distinct), seed=0)
    for i, row in enumerate(rows):
        for j, part in enumerate(p for m in row["messages"] if isinstance(m.get("content"), list) for p in m["content"]):
            url = part.get("image_url", {}).get("url", "")
            if url.startswith("data:image/"):
                fmt, data = url.removeprefix("data:image/").split(";base64,", 1)
                name = f"{i:06d}_{j}.{fmt}"
                (media / name).write_bytes(base64.b64decode(data))
                part["image_url"]["url"] = name
    return [rows[i % len(rows)] for i in range(n)]


def outputs(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file() and p.name != ".vlmpack.lock"}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rows", type=int, default=4000, help="rows to preprocess (default %(default)s)")
    ap.add_argument("--distinct-rows", type=int, default=2000,
                    help="distinct rows (and their images) generated and cycled to make --rows (default %(default)s)")
    ap.add_argument("--rows-per-shard", type=int, default=100, help="rows per work unit (default %(default)s)")
    ap.add_argument("--workers", type=int, default=os.cpu_count(), help="CPUs for both executors (default: all, %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default %(default)s)")
    args = ap.parse_args()
    import ray

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = write_jsonl(tmp / "rows.jsonl", rows_with_media_files(args.rows, args.distinct_rows, tmp / "media"))
        media_mib = sum(f.stat().st_size for f in (tmp / "media").iterdir()) / 2**20
        log(f"{args.rows} rows ({min(args.rows, args.distinct_rows)} distinct, their images {media_mib:.0f} MiB as files); "
            f"{args.workers} CPUs")
        # the local Ray instance inherits this environment: its workers import this checkout's code
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        seconds = {"local": [], "ray": []}
        ray_start_s = []
        reference = None
        for r in range(args.rounds):
            for executor in (("local", "ray") if r % 2 == 0 else ("ray", "local")):
                out = tmp / f"{executor}-{r}"
                if executor == "ray":
                    t0 = time.perf_counter()
                    ray.init(num_cpus=args.workers, log_to_driver=False, include_dashboard=False)
                    ray_start_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                run_preprocess(PreprocessConfig(inputs=[str(data)], out=str(out), workers=args.workers,
                                                rows_per_shard=args.rows_per_shard, progress=False, executor=executor,
                                                sample=SampleOptions(media_root=str(tmp / "media"))))
                seconds[executor].append(time.perf_counter() - t0)
                if executor == "ray":
                    ray.shutdown()
                got = outputs(out)
                reference = reference or got
                assert got == reference, f"{executor} round {r}: output differs"
                shutil.rmtree(out)
                log(f"round {r} {executor}: {seconds[executor][-1]:.2f} s ({args.rows / seconds[executor][-1]:.0f} rows/s)")
    median = {k: statistics.median(v) for k, v in seconds.items()}
    result = {"rows": args.rows, "distinct_rows": min(args.rows, args.distinct_rows), "workers": args.workers,
              "rows_per_shard": args.rows_per_shard,
              "seconds": seconds, "rows_per_s": {k: args.rows / v for k, v in median.items()},
              "ray_over_local_time": median["ray"] / median["local"], "ray_start_s": ray_start_s,
              "outputs_identical": True}
    print(f"\nlocal {result['rows_per_s']['local']:.0f} rows/s, ray {result['rows_per_s']['ray']:.0f} rows/s: "
          f"ray takes {100 * (result['ray_over_local_time'] - 1):+.1f} % time (median of {args.rounds}); "
          f"Ray start-up {statistics.median(ray_start_s):.1f} s apart; outputs byte-identical")
    if args.json_out:
        write_json(args.json_out, {"machine": {**machine_info("cpu"), "ray": ray.__version__}, **result})
        log(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
