"""Loss curves of one training job in several parallel layouts: same architecture, random init
from the same seed, same data, same global batch; only the layout changes.

Data: a synthetic Qwen3-VL mix (`benchmarks/synthetic_shards.py`; --samples samples, none
longer than --max-sample-tokens, default --seq-len) written once into OUT_DIR/data.

Layouts (--layouts, comma separated): `1gpu` (one process; on GPUs CUDA_VISIBLE_DEVICES is the
first of --gpus) or any product of `dpN`, `tpN`, `ppN`, `epN` (e.g. `dp2`, `tp2`, `pp2`, `tp2pp2`,
`dp2ep2`, `tp2ep2`): nproc = dp * tp * pp processes, `--tp N --pp N --ep N` passed to the
trainer (expert parallelism splits a MoE model's experts over the tp x dp ranks of a stage: ep
divides tp * dp). Each layout
is its own launch, one after the other:

    python -m torch.distributed.run --standalone --nproc-per-node K -m train.trainer --data DIR \\
        --out OUT_DIR/<layout> --arch ARCH --seq-len S --global-batch-packs G --train-steps N ...

Its OUT_DIR/<layout>/metrics.jsonl (written by rank 0) gives per step the loss of the whole
global batch, the real and target token counts, tokens/s and rank 0's peak allocated memory.
A layout that fails or times out is recorded (return code, last lines of its output) and the
next one runs. Pipeline parallelism needs CUDA (megatron's PP schedule allocates on "cuda"):
with --device cpu, layouts with pp > 1 are skipped with a note. --layers N cuts the
architecture to N decoder layers (the launch goes through `benchmarks/trainer_fewer_layers.py`),
e.g. to compare a MoE model's layouts within one GPU's memory.

--hf-fsdp N adds the baseline: Hugging Face transformers under torch FSDP2 on N GPUs, on the
strongest HF recipe (`benchmarks/hf_fsdp_worker.py`: the trainer's packs of the same shard
directory, padding-free, in its order; varlen attention, Liger, bf16, fused AdamW). It runs
--hf-steps steps, with transformers' gradient checkpointing only if it runs out of memory
without (or always, with --hf-gradient-checkpointing), and each layout of N GPUs gets its tokens/s
ratio to it. Its losses are not compared: its init is its own.

Reported: a step x layout loss table; per layout max / mean |loss - reference| (reference:
`1gpu` when run, else the first layout), whether every step saw the same real and target token
counts as the reference (same packs), and the medians over steps after the first
--skip-steps (default 2) of tokens/s (global and per GPU), step seconds, and rank 0's peak
memory; on GPUs also the peak `nvidia-smi` memory.used per GPU (reserved memory plus the CUDA
context, every rank, polled every second). On CPU the trainer runs fp32, on GPUs bf16.
--json-out: all of it, with every curve and the commands. It is rewritten after each layout,
so a run cut short still leaves what it measured.

    # 2 GPUs, Qwen3-VL-2B architecture
    python benchmarks/loss_curves.py --json-out benchmarks/results/loss_curves_h200x2_<yyyymmdd>.json
    # 2 GPUs, Qwen3-VL-8B at 16k packs: TP=2 against HF + FSDP2 on the same 2 GPUs
    python benchmarks/loss_curves.py --arch qwen3-vl-8b --seq-len 16384 --layouts tp2 --recompute full \\
        --hf-fsdp 2
    # CPU smoke (tiny architecture, fp32)
    python benchmarks/loss_curves.py --arch tiny --seq-len 2048 --steps 3 --layouts 1gpu,dp2,tp2 --device cpu
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import REPO, T0, log, machine_info, parser, write_json

TAIL_LINES = 40
QUIET = ("UserWarning", "warnings.warn(", "FutureWarning", "DeprecationWarning")


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser(__doc__, json_out="every curve, the layouts' results and the machine (default: OUT_DIR/loss_curves.json)")
    ap.add_argument("--arch", default="qwen3-vl-2b", help="builtin architecture (random init)")
    ap.add_argument("--layers", type=int, default=None, help="cut the architecture to this many decoder layers")
    ap.add_argument("--layouts", default="1gpu,dp2,tp2,pp2", help="comma separated: 1gpu, dpN, tpN, ppN, epN or products")
    ap.add_argument("--steps", type=int, default=12, help="training steps per layout")
    ap.add_argument("--seq-len", type=int, default=8192, help="tokens per pack")
    ap.add_argument("--global-batch-packs", type=int, default=4, help="packs per step")
    ap.add_argument("--lr", type=float, default=1e-4, help="peak learning rate")
    ap.add_argument("--warmup-steps", type=int, default=2, help="learning-rate warmup steps")
    ap.add_argument("--seed", type=int, default=0, help="model init and data seed")
    ap.add_argument("--num-workers", type=int, default=2, help="trainer loader workers")
    ap.add_argument("--recompute", default="none", choices=("none", "selective", "full"), help="activation recompute")
    ap.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default: cuda when available")
    ap.add_argument("--gpus", default=None,
                    help="GPU ids to use (default: $CUDA_VISIBLE_DEVICES or 0,1,...); 1gpu uses the first")
    ap.add_argument("--samples", type=int, default=200, help="synthetic samples")
    ap.add_argument("--max-sample-tokens", type=int, default=None, help="longest synthetic sample (default: --seq-len)")
    ap.add_argument("--text-tokens", type=int, nargs=2, default=(100, 3000), metavar=("MIN", "MAX"),
                    help="text tokens per synthetic sample")
    ap.add_argument("--image-tokens", type=int, nargs=2, default=(64, 1300), metavar=("MIN", "MAX"),
                    help="visual tokens per synthetic image")
    ap.add_argument("--video-prob", type=float, default=0.0, help="share of synthetic samples that hold one video")
    ap.add_argument("--video-seconds", type=float, nargs=2, default=(4.0, 60.0), metavar=("MIN", "MAX"),
                    help="length of each synthetic video")
    ap.add_argument("--video-tokens", type=int, nargs=2, default=(256, 4096), metavar=("MIN", "MAX"),
                    help="visual tokens per synthetic video")
    ap.add_argument("--data-dir", default=None, help="use this existing shard directory instead of writing one")
    ap.add_argument("--skip-steps", type=int, default=2, help="first steps left out of the speed/memory medians")
    ap.add_argument("--run-timeout", type=float, default=240.0, help="seconds per layout before it is killed")
    ap.add_argument("--time-budget", type=float, default=510.0,
                    help="seconds for the whole script: a layout gets at most what is left (minus 15 s), and is "
                         "skipped when under --min-run-seconds remain")
    ap.add_argument("--min-run-seconds", type=float, default=60.0, help="a layout needs at least this much of the budget")
    ap.add_argument("--hf-fsdp", type=int, default=0, metavar="N",
                    help="also run HF transformers under FSDP2 on N GPUs (0: not run)")
    ap.add_argument("--hf-steps", type=int, default=None, help="HF training steps (default: --steps)")
    ap.add_argument("--hf-gradient-checkpointing", action="store_true",
                    help="HF with transformers' per-layer recompute from the start (default: only after running out "
                         "of memory without)")
    ap.add_argument("--trainer-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for every trainer launch (repeat; e.g. --trainer-arg=--micro-batch-packs=2)")
    ap.add_argument("--out-dir", default=str(Path(tempfile.gettempdir()) / "vlmpack_loss_curves"),
                    help="data and per-layout training output (default: under the temp dir)")
    args = ap.parse_args(argv)
    if args.device is None:
        import torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


# ------------------------------------------------------------------------------------------ layouts


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def nproc(self) -> int:
        return self.dp * self.tp * self.pp


def parse_layout(name: str) -> Layout:
    name = name.strip()
    if name == "1gpu":
        return Layout(name)
    parts = re.findall(r"(dp|tp|pp|ep)(\d+)", name)
    if not parts or "".join(k + n for k, n in parts) != name or len({k for k, _ in parts}) != len(parts):
        raise SystemExit(f"--layouts: cannot read {name!r} (use 1gpu, dpN, tpN, ppN, epN or products like tp2pp2)")
    sizes = {k: int(n) for k, n in parts}
    if min(sizes.values()) < 1:
        raise SystemExit(f"--layouts: {name!r} has a size below 1")
    if sizes.get("dp", 1) * sizes.get("tp", 1) % sizes.get("ep", 1):
        raise SystemExit(f"--layouts: {name!r}: ep must divide tp * dp (experts are split over the ranks of a stage)")
    return Layout(name, **sizes)


def hf_command(args, checkpointing: bool, data_dir: Path, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.hf_fsdp),
           "benchmarks/hf_fsdp_worker.py", "--data", str(data_dir), "--out", str(out), "--arch", args.arch,
           "--seq-len", str(args.seq_len), "--global-batch-packs", str(args.global_batch_packs),
           "--steps", str(args.hf_steps or args.steps), "--train-steps", str(args.steps),
           "--warmup-steps", str(args.warmup_steps), "--seed", str(args.seed), "--lr", str(args.lr),
           "--device", args.device]
    if args.layers:
        cmd += ["--layers", str(args.layers)]
    if checkpointing:
        cmd.append("--gradient-checkpointing")
    return cmd


def trainer_command(args, layout: Layout, data_dir: Path, out: Path) -> list[str]:
    launch = ["benchmarks/trainer_fewer_layers.py", "--layers", str(args.layers)] if args.layers else ["-m", "train.trainer"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(layout.nproc),
           *launch, "--data", str(data_dir), "--out", str(out), "--arch", args.arch,
           "--seq-len", str(args.seq_len), "--global-batch-packs", str(args.global_batch_packs),
           "--train-steps", str(args.steps), "--lr", str(args.lr), "--warmup-steps", str(args.warmup_steps),
           "--num-workers", str(args.num_workers), "--tensorboard", "false", "--save-final", "false",
           "--log-every", "1", "--seed", str(args.seed), "--recompute", args.recompute, "--device", args.device,
           "--bf16", "true"]
    if layout.tp > 1:
        cmd += ["--tp", str(layout.tp)]
    if layout.pp > 1:
        cmd += ["--pp", str(layout.pp)]
    if layout.ep > 1:
        cmd += ["--ep", str(layout.ep)]
    return cmd + list(args.trainer_arg)


# ------------------------------------------------------------------------------------------ running


class GpuMemoryPoller:
    """Peak `nvidia-smi` memory.used (MiB) per GPU index while a run is going."""

    def __init__(self, interval: float = 1.0):
        self.interval, self.peak, self._stop = interval, {}, threading.Event()
        self.available = shutil.which("nvidia-smi") is not None
        self._thread = threading.Thread(target=self._loop, daemon=True) if self.available else None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                text = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                      capture_output=True, text=True, timeout=10).stdout
                for line in text.strip().splitlines():
                    index, used = (int(x.strip()) for x in line.split(","))
                    self.peak[index] = max(self.peak.get(index, 0), used)
            except (OSError, ValueError, subprocess.SubprocessError):
                pass
            self._stop.wait(self.interval)

    def __enter__(self):
        if self._thread:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=15)


def run_layout(cmd: list[str], env: dict, log_path: Path, timeout: float, tag: str) -> dict:
    """Runs one launch in its own process group, echoing its output (minus warnings) with a tag."""
    started = time.perf_counter()
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1, start_new_session=True)

        def pump():
            skip_next = False
            for line in proc.stdout:
                log_file.write(line)
                line = line.rstrip("\n")
                tail.append(line)
                if skip_next or any(q in line for q in QUIET):
                    skip_next = "UserWarning" in line or "FutureWarning" in line or "DeprecationWarning" in line
                    continue
                print(f"  [{tag}] {line}", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)  # the launcher's own process group (start_new_session)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            rc = proc.returncode
        reader.join(timeout=10)
    return {"rc": rc, "timed_out": timed_out, "wall_s": time.perf_counter() - started, "tail": list(tail)}


def read_metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by a kill
    return records


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(records: list[dict], skip: int) -> dict:
    measured = [r for r in records if r["step"] > skip] or records
    return {
        "steps_done": len(records),
        "median_over_steps": [r["step"] for r in measured],
        "tokens_per_s": median(r.get("tokens_per_s") for r in measured),
        "tokens_per_s_per_gpu": median(r.get("tokens_per_s_per_gpu") for r in measured),
        "step_seconds": median(r.get("step_seconds") for r in measured),
        "mfu": median(r.get("mfu") for r in measured),
        "peak_memory_gib_rank0": median(r.get("peak_memory_gib") for r in measured),
        "peak_memory_gib_rank0_max": max((r["peak_memory_gib"] for r in records if r.get("peak_memory_gib") is not None),
                                         default=None),
    }


def compare(records: list[dict], ref: list[dict]) -> dict:
    a = {r["step"]: r for r in records}
    b = {r["step"]: r for r in ref}
    steps = sorted(set(a) & set(b))
    if not steps:
        return {"compared_steps": 0}
    diffs = [abs(a[s]["loss"] - b[s]["loss"]) for s in steps]
    worst = max(range(len(steps)), key=lambda i: diffs[i])
    gn = [abs(a[s]["grad_norm"] - b[s]["grad_norm"]) for s in steps
          if a[s].get("grad_norm") is not None and b[s].get("grad_norm") is not None]
    return {
        "compared_steps": len(steps),
        "max_abs_loss_diff": max(diffs), "max_abs_loss_diff_step": steps[worst],
        "mean_abs_loss_diff": sum(diffs) / len(diffs),
        "max_rel_loss_diff": max(d / abs(b[s]["loss"]) for d, s in zip(diffs, steps) if b[s]["loss"]),
        "loss_diff_per_step": diffs,
        "max_abs_grad_norm_diff": max(gn) if gn else None,
        "same_tokens": all(a[s].get("tokens") == b[s].get("tokens") and a[s].get("target_tokens") == b[s].get("target_tokens")
                           for s in steps),
    }


# ------------------------------------------------------------------------------------------ report


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(res: dict) -> None:
    runs = res["layouts"]
    names = list(runs)
    ref = res["reference"]
    width = max(12, *(len(n) + 2 for n in names))
    arch = res["args"]["arch"] + (f" cut to {res['args']['layers']} layers" if res["args"].get("layers") else "")
    print(f"\n{arch} on {res['machine'].get('gpus', ['cpu'])[0]}: loss per step "
          f"({res['args']['global_batch_packs']} packs x {res['args']['seq_len']} tokens per step, "
          f"{'bf16' if res['args']['device'] == 'cuda' else 'fp32'}; reference {ref})", flush=True)
    print("step".ljust(6) + "".join(n.rjust(width) for n in names))
    print("-" * (6 + width * len(names)))
    for step in range(1, res["args"]["steps"] + 1):
        cells = []
        for n in names:
            loss = {r["step"]: r["loss"] for r in runs[n].get("steps", [])}.get(step)
            cells.append(fmt(loss, ".5f").rjust(width))
        print(str(step).ljust(6) + "".join(cells))
    print("-" * (6 + width * len(names)))

    def row(label, fn):
        print(label.ljust(24) + "".join((" " + fn(runs[n])).rjust(width) for n in names), flush=True)

    width_label = 24
    print("".ljust(width_label) + "".join(n.rjust(width) for n in names))
    row("status", lambda r: r["status"])
    row(f"max |diff| vs {ref}", lambda r: fmt(r.get("vs_reference", {}).get("max_abs_loss_diff"), ".2e"))
    row(f"mean |diff| vs {ref}", lambda r: fmt(r.get("vs_reference", {}).get("mean_abs_loss_diff"), ".2e"))
    row("max |grad-norm diff|", lambda r: fmt(r.get("vs_reference", {}).get("max_abs_grad_norm_diff"), ".2e"))
    row("same tokens/step", lambda r: {True: "yes", False: "NO", None: "-"}[r.get("vs_reference", {}).get("same_tokens")])
    row("tokens/s (median)", lambda r: fmt(r.get("summary", {}).get("tokens_per_s"), ",.0f"))
    row("tokens/s/GPU (median)", lambda r: fmt(r.get("summary", {}).get("tokens_per_s_per_gpu"), ",.0f"))
    row("step s (median)", lambda r: fmt(r.get("summary", {}).get("step_seconds"), ".3f"))
    row("peak mem rank0 GiB", lambda r: fmt(r.get("summary", {}).get("peak_memory_gib_rank0"), ".1f"))
    if any(runs[n].get("nvidia_smi_peak_mib") for n in names):
        row("nvidia-smi peak GiB", lambda r: "/".join(f"{v / 1024:.1f}" for v in (r.get("nvidia_smi_peak_mib") or {}).values())
            or "-")
    row("wall s", lambda r: fmt(r.get("wall_s"), ".0f"))
    hf = res.get("hf_fsdp")
    if hf:
        row(f"ours / HF FSDP2 ({hf['nproc']} GPUs)", lambda r: fmt(r.get("speedup_vs_hf_fsdp"), ".2f"))
    for n in names:
        tail = runs[n].get("error_tail") or [None]
        note = runs[n].get("note") or next((t for t in tail if t and "error:" in t), tail[-1])
        if runs[n]["status"] != "ok" and note:
            print(f"{n}: {runs[n]['status']}: {note}", flush=True)
    if hf:
        s = hf.get("summary", {})
        print(f"HF + FSDP2 on {hf['nproc']} GPUs: {hf['status']}, gradient checkpointing {hf['gradient_checkpointing']}, "
              f"{fmt(s.get('tokens_per_s'), ',.0f')} tok/s, step {fmt(s.get('step_seconds'), '.3f')} s, "
              f"rank0 peak {fmt(s.get('peak_memory_gib_rank0'), '.1f')} GiB"
              + (f", experts {hf['experts_implementation']}" if hf.get("experts_implementation") else ""), flush=True)


# ------------------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    args = parse_args(argv)
    layouts = [parse_layout(n) for n in args.layouts.split(",") if n.strip()]
    if len({lay.name for lay in layouts}) != len(layouts):
        raise SystemExit("--layouts: a layout is listed twice")
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    json_out = Path(args.json_out).resolve() if args.json_out else out_dir / "loss_curves.json"
    gpus = (args.gpus or os.environ.get("CUDA_VISIBLE_DEVICES") or
            ",".join(str(i) for i in range(max(args.hf_fsdp, *(lay.nproc for lay in layouts))))).split(",")
    res = {"args": vars(args), "machine": machine_info(args.device),
           "started": time.strftime("%Y-%m-%d %H:%M:%S"), "layouts": {}, "curves": {}}
    ref_name = "1gpu" if any(lay.name == "1gpu" for lay in layouts) else layouts[0].name
    res["reference"] = ref_name
    log(f"{args.arch}" + (f" cut to {args.layers} layers" if args.layers else "") + f", {args.steps} steps x {args.global_batch_packs} packs x {args.seq_len} tokens, "
        f"device {args.device}, layouts {[lay.name for lay in layouts]}, out {out_dir}")

    def write_result():
        res["total_s"] = time.perf_counter() - T0
        write_json(json_out, res)

    # --- data, once
    if args.data_dir:
        data_dir = Path(args.data_dir).resolve()
        res["data"] = {"dir": str(data_dir), "generated": False}
    else:
        from synthetic_shards import SyntheticSpec, write_synthetic_shards

        data_dir = out_dir / "data"
        spec = SyntheticSpec(num_samples=args.samples, seed=args.seed, text_tokens=tuple(args.text_tokens),
                             image_tokens=tuple(args.image_tokens), max_tokens=args.max_sample_tokens or args.seq_len,
                             video_prob=args.video_prob, video_seconds=tuple(args.video_seconds),
                             video_tokens=tuple(args.video_tokens))
        t0 = time.perf_counter()
        manifest = write_synthetic_shards(data_dir, spec, log=log)
        res["data"] = {"dir": str(data_dir), "generated": True, "spec": dataclasses.asdict(spec),
                       "totals": manifest["totals"], "seconds": time.perf_counter() - t0}
        packs_needed = args.steps * args.global_batch_packs
        approx_packs = manifest["totals"]["tokens"] / args.seq_len
        if approx_packs < packs_needed:
            log(f"note: ~{approx_packs:.0f} packs of data for {packs_needed} packs of training: later steps re-use "
                f"data from a new epoch (all layouts alike)")
    write_result()

    # --- the layouts, one launch each
    env_base = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])])}
    env_base.setdefault("OMP_NUM_THREADS", "1" if args.device == "cuda" else str(max(1, (os.cpu_count() or 1) // 2)))

    def launch(name: str, cmd: list[str], nproc: int, out: Path, steps: int, tag: str) -> dict:
        """One launch of `cmd` writing out/metrics.jsonl; its record, or a skip note."""
        remaining = args.time_budget - (time.perf_counter() - T0)
        if args.device == "cuda" and nproc > len(gpus):
            return {"status": "skipped", "note": f"needs {nproc} GPUs, --gpus has {len(gpus)}"}
        if remaining - 15 < args.min_run_seconds:
            return {"status": "skipped", "note": f"time budget: {remaining:.0f} s of --time-budget left"}
        if out.exists():
            shutil.rmtree(out)  # metrics.jsonl is appended to: start clean
        out.mkdir(parents=True)
        env = dict(env_base)
        if args.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[:nproc])
        timeout = min(args.run_timeout, remaining - 15)
        run = {"command": " ".join(cmd), "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"), "timeout_s": timeout}
        log(f"{tag}: nproc {nproc}" + (f", CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}" if args.device == "cuda" else "")
            + f", timeout {timeout:.0f} s\n    {run['command']}")
        log_path = out_dir / f"{out.name}.log"
        poller = GpuMemoryPoller() if args.device == "cuda" else None
        if poller:
            with poller:
                result = run_layout(cmd, env, log_path, timeout, name)
            visible = {int(g) for g in gpus[:nproc] if g.strip().isdigit()}
            run["nvidia_smi_peak_mib"] = {k: v for k, v in sorted(poller.peak.items()) if not visible or k in visible}
        else:
            result = run_layout(cmd, env, log_path, timeout, name)
        records = read_metrics(out)
        keep = ("step", "loss", "target_tokens", "tokens", "padded_tokens", "lr", "grad_norm", "skipped",
                "step_seconds", "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "peak_memory_gib", "experts_implementation")
        run["steps"] = [{k: r[k] for k in keep if k in r} for r in records]
        run["losses"] = [r["loss"] for r in records]
        run.update(rc=result["rc"], timed_out=result["timed_out"], wall_s=result["wall_s"], log=str(log_path))
        ok = result["rc"] == 0 and len(records) == steps
        run["status"] = "ok" if ok else ("timeout" if result["timed_out"] else "failed")
        if not ok:
            run["error_tail"] = result["tail"]
            # the cause may sit far above the launcher's own tail: read the whole log
            log_text = log_path.read_text(errors="replace").lower() if log_path.exists() else ""
            run["out_of_memory"] = "outofmemoryerror" in log_text or "out of memory" in log_text \
                or "out of gpu memory" in log_text
            if result["rc"] == 0:
                run["note"] = f"exited 0 with {len(records)} of {steps} steps in metrics.jsonl"
        if records:
            run["summary"] = summarize(records, args.skip_steps)
        s = run.get("summary", {})
        log(f"{name}: {run['status']} (rc {result['rc']}) in {result['wall_s']:.0f} s, {len(records)} steps"
            + (f", median {s['tokens_per_s']:,.0f} tok/s" if s.get("tokens_per_s") else "")
            + (f", rank0 peak {s['peak_memory_gib_rank0']:.1f} GiB" if s.get("peak_memory_gib_rank0") else ""))
        if not ok:
            print("\n".join(f"    | {line}" for line in result["tail"][-15:]), flush=True)
        return run

    for i, layout in enumerate(layouts):
        tag = f"[{i + 1}/{len(layouts)}] {layout.name}"
        if args.device == "cpu" and layout.pp > 1:
            run = {"status": "skipped", "note": "pipeline parallelism needs CUDA (megatron's PP schedule allocates "
                                                "on 'cuda'); not run with --device cpu"}
        else:
            run = launch(layout.name, trainer_command(args, layout, data_dir, out_dir / layout.name), layout.nproc,
                         out_dir / layout.name, args.steps, tag)
        res["layouts"][layout.name] = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "ep": layout.ep,
                                       "nproc": layout.nproc, **run}
        if run["status"] == "skipped":
            log(f"{tag}: skipped: {run['note']}")
        else:
            res["curves"][layout.name] = run["losses"]
        write_result()

    # --- the HF + FSDP2 baseline on --hf-fsdp GPUs, with gradient checkpointing only if it must
    if args.hf_fsdp:
        hf = res["hf_fsdp"] = {"nproc": args.hf_fsdp, "tries": []}
        for checkpointing in ([True] if args.hf_gradient_checkpointing else [False, True]):
            name = "hf_fsdp2" + ("_checkpointing" if checkpointing else "")
            run = launch(name.replace("_", "-"), hf_command(args, checkpointing, data_dir, out_dir / name),
                         args.hf_fsdp, out_dir / name, args.hf_steps or args.steps,
                         f"HF + FSDP2, gradient checkpointing {checkpointing}")
            run["gradient_checkpointing"] = checkpointing
            hf["tries"].append(run)
            write_result()
            if run["status"] == "ok" or not run.get("out_of_memory"):
                break
        best = hf["tries"][-1]
        hf.update(status=best["status"], gradient_checkpointing=best["gradient_checkpointing"], summary=best.get("summary", {}),
                  experts_implementation=next((r["experts_implementation"] for r in best.get("steps", [])
                                               if r.get("experts_implementation")), None))
        hf_tps = hf["summary"].get("tokens_per_s") if best["status"] == "ok" else None
        for run in res["layouts"].values():
            ours = run.get("summary", {}).get("tokens_per_s")
            if hf_tps and ours and run["nproc"] == args.hf_fsdp:
                run["speedup_vs_hf_fsdp"] = ours / hf_tps
        write_result()
    ref = res["layouts"].get(ref_name, {}).get("steps") or []
    for name, run in res["layouts"].items():
        if run.get("steps") and ref:
            run["vs_reference"] = compare(run["steps"], ref)
    write_result()
    log(f"wrote {json_out}")
    print_table(res)
    statuses = [r["status"] for r in res["layouts"].values()] + ([res["hf_fsdp"]["status"]] if args.hf_fsdp else [])
    return 0 if all(s in ("ok", "skipped") for s in statuses) else 1


if __name__ == "__main__":
    sys.exit(main())
