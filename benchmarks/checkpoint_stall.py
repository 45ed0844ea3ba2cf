"""How long a checkpoint save blocks the training loop: written on the training thread
(--async-save false) vs snapshotted and written in the background (--async-save true).

One invocation trains the same model on the same synthetic shards twice, once per setting,
saving every --save-every steps, and reads the trainer's own per-step record from
metrics.jsonl: `checkpoint_stall_s` (the loop blocked: snapshot, waiting for the save before,
completing one) on the save steps, `checkpoint_write_s` (the files' writing, on whichever
thread). The last step's save always waits for its files (the run ends there), so it is
reported apart from the intermediate saves, whose stalls are the comparison. Also reported:
the mean step time while a background write runs vs without one (the write competes with
the step for CPU and memory bandwidth).

    python benchmarks/checkpoint_stall.py                       # CPU, --arch tiny
    python benchmarks/checkpoint_stall.py --arch qwen3-vl-2b --seq-len 8192 --device cuda \\
        --json-out benchmarks/results/checkpoint_stall_h100_<yyyymmdd>.json
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from common import log, machine_info, parser, write_json
from synthetic_shards import SyntheticSpec, write_synthetic_shards

from train.config import TrainConfig
from train.model.arch import builtin_arch
from train.parallel import destroy_parallel
from train.trainer import train


def run(setting_async: bool, args, data_dir: Path, out: Path) -> dict:
    config = TrainConfig.from_flat(dict(
        data=[str(data_dir)], out=str(out), arch=args.arch, seq_len=args.seq_len, train_steps=args.steps,
        save_every=args.save_every, async_save=setting_async, keep_last=2, device=args.device,
        num_workers=args.num_workers, tensorboard=False, lr=1e-4, compile=args.device == "cuda"))
    try:
        train(config)
    finally:
        destroy_parallel()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    saves = [r for r in records if "checkpoint_snapshot_s" in r]
    intermediate, final = saves[:-1], saves[-1]
    # steps that ran while a background write was in flight: after a save step, up to the step
    # whose record reports that save completed
    writing, in_flight = set(), False
    for r in records:
        if in_flight:
            writing.add(r["step"])
        if "checkpoint_completed_step" in r:
            in_flight = False
        if "checkpoint_snapshot_s" in r and r.get("checkpoint_completed_step") != r["step"]:
            in_flight = True
    steady = [r for r in records if r["step"] > 1]  # the first step warms up
    return {
        "async_save": setting_async,
        "stall_s_per_save": [round(r["checkpoint_stall_s"], 4) for r in intermediate],
        "stall_s_mean": statistics.mean(r["checkpoint_stall_s"] for r in intermediate),
        "snapshot_s_mean": statistics.mean(r["checkpoint_snapshot_s"] for r in intermediate),
        "write_s_mean": statistics.mean(r["checkpoint_write_s"] for r in records if "checkpoint_write_s" in r),
        "final_save_stall_s": final["checkpoint_stall_s"],
        "step_s_while_writing": statistics.mean([r["step_seconds"] for r in steady if r["step"] in writing] or [0.0]),
        "step_s_otherwise": statistics.mean(r["step_seconds"] for r in steady if r["step"] not in writing),
        "checkpoint_bytes": sum(p.stat().st_size for p in (out / "checkpoints" / "step_"
                                f"{args.steps:08d}").rglob("*") if p.is_file()),
    }


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--arch", default="tiny", help="built-in architecture (default tiny)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="default cpu")
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens per pack (default 1024)")
    ap.add_argument("--steps", type=int, default=12, help="training steps per setting (default 12)")
    ap.add_argument("--save-every", type=int, default=3, help="save every N steps (default 3)")
    ap.add_argument("--samples", type=int, default=64, help="synthetic samples (default 64)")
    ap.add_argument("--num-workers", type=int, default=0, help="loader workers (default 0)")
    ap.add_argument("--work-dir", default=None, help="where shards and runs go (default: a temporary directory)")
    args = ap.parse_args()
    arch = builtin_arch(args.arch)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        tmp = Path(tmp)
        spec = SyntheticSpec(num_samples=args.samples, seed=0, text_tokens=(100, args.seq_len // 2),
                             image_tokens=(16, args.seq_len // 4), max_tokens=args.seq_len)
        write_synthetic_shards(tmp / "shards", spec, profile_name=arch.family, log=log)
        results = {}
        for setting in (False, True):
            name = "async" if setting else "sync"
            log(f"training {args.steps} steps, --async-save {str(setting).lower()}")
            results[name] = run(setting, args, tmp / "shards", tmp / name)
    sync, async_ = results["sync"], results["async"]
    ratio = sync["stall_s_mean"] / async_["stall_s_mean"]
    for name, r in results.items():
        log(f"{name:>5}: stall per save {r['stall_s_per_save']} s (mean {r['stall_s_mean']:.3f} s; snapshot "
            f"{r['snapshot_s_mean']:.3f} s, write {r['write_s_mean']:.3f} s); final save {r['final_save_stall_s']:.3f} s; "
            f"step {r['step_s_otherwise']:.3f} s, {r['step_s_while_writing']:.3f} s while a write runs")
    log(f"checkpoint {sync['checkpoint_bytes'] / 2**20:.0f} MiB; stall sync / async = {ratio:.1f}x")
    if args.json_out:
        report = {"benchmark": "checkpoint_stall", "machine": machine_info(args.device),
                  "settings": {k: v for k, v in vars(args).items() if k != "json_out"},
                  "sync": sync, "async": async_, "stall_ratio_sync_over_async": ratio}
        log(f"wrote {write_json(args.json_out, report)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
