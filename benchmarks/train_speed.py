"""Training speed, side by side in one process on the same data: the vlmpack trainer on packed
rows vs Hugging Face `Qwen3VLForConditionalGeneration` (or `Qwen2_5_VL...` for a Qwen2.5-VL
--arch) on padded batches.

Data: a synthetic mix in the arch's chat layout, written directly as a vlmpack shard directory
(`benchmarks/synthetic_shards.py`: 100-3000 text tokens and 0-3 images of 64-1300 merged
tokens per sample, chat structure, assistant targets, M-RoPE positions, random uint8 patches;
no sample longer than --seq-len; with --video-prob, videos too, which both sides feed to the
vision tower as `pixel_values_videos`), checked with `verify_shards` (what `vlmpack verify` runs).

(a) ours: `train.trainer.train(TrainConfig(arch=..., seq_len=..., global_batch_packs=...))`,
    random init, bf16 on GPUs (fp32 on CPU, as the trainer does), --warmup + --steps steps.
    tokens/s, MFU and peak memory come from the trainer's own OUT/metrics.jsonl over the
    measured steps (tokens = real tokens, padding excluded; MFU = 6 * N_lm per token over
    989 TFLOP/s on an H100, `train.metrics`). step_seconds is the whole loop iteration (next
    global batch from the loader, forward+backward, optimizer step, loss all-reduce, sync).
    The same run is instrumented from outside (the trainer's module-level names are wrapped
    for the run, the trainer's files are not changed), with CUDA events recorded on the
    compute stream, no extra synchronisation:
      fwd+bwd   = `run_global_batch` (all micro-batches' forward and backward, grad finalize);
      optimizer = `optimizer.step()` (megatron mixed-precision Adam: unscale, clip, step, copy);
      vision    = the vision tower inside the step: forward from its forward pre-hook to its
                  forward hook; backward from the gradient hook on its output (image
                  embeddings) to the gradient accumulation of its first layer (patch embed /
                  pos embed weights), i.e. the vision share is measured IN the real step.
    As a cross-check, the last step's micro-batches are re-run through the vision tower alone
    (forward + backward with unit output gradients, same pixels and grids) after training.
    The trainer saves a checkpoint at its last step; that save is skipped here (the
    benchmark swaps `train.checkpoint.save` for a no-op unless --keep-checkpoint), it is not
    part of any timed step.
(b) HF: `Qwen3VLForConditionalGeneration(Qwen3VLConfig(**arch.to_hf_config()))` (Qwen2.5-VL: its
    classes), random init,
    sdpa attention, bf16 parameters (--hf-precision amp: fp32 parameters + bf16 autocast),
    torch AdamW (betas 0.9/0.95 as ours), grad clipping 1.0 as ours, no activation
    checkpointing (as ours; --hf-gradient-checkpointing: transformers' per-layer recompute, for a
    model whose batch of 1 does not fit without it). Samples: exactly those in the packs ours trained on, shuffled
    (seeded), in right-padded batches (`tests.hf_reference.to_padded_batch`: attention_mask,
    labels -100 on non-targets and padding, mm_token_type_ids so HF computes its own M-RoPE
    positions in forward). Batch size: the largest that survives the WORST batch of these
    samples (the B longest, padded to the longest): B = 1, 2, 4, ... until out of memory or
    --hf-max-batch, then bisection; each try is one full training step (optimizer state
    included), out-of-memory is caught and the cache emptied. Then --hf-warmup + --hf-steps
    steps on random batches of that size; batches are collated on the CPU before timing
    (HF is not charged for collation; ours is charged for its loader).
    Real tokens/s (attention_mask ones), LM MFU on real tokens, peak memory.

With --lora-rank R both sides train LoRA adapters (rank R, alpha 2R) on every linear of the
language model, the base frozen: ours `vlmpack train --lora-rank R`, HF through PEFT's
`get_peft_model` on the same modules. MFU stays 6 * N_lm per token, as for full fine-tuning
(a frozen weight needs no weight gradient, so LoRA does about 4 * N of real work per token).

Printed last: a table with ours/HF ratios. --json-out: everything, with command and machine.

    # H100, Qwen3-VL-2B architecture, 16k packs
    python benchmarks/train_speed.py --arch qwen3-vl-2b --seq-len 16384 --samples 400 \\
        --warmup 3 --steps 10 --global-batch-packs 2 --json-out benchmarks/results/train_speed_h100_<yyyymmdd>.json
    # ... with videos in 30 % of the samples
    python benchmarks/train_speed.py --arch qwen3-vl-2b --seq-len 16384 --samples 400 --video-prob 0.3 \
        --json-out benchmarks/results/train_speed_video_h100_<yyyymmdd>.json
    # H100, Qwen3-VL-8B architecture, LoRA rank 64 on every language-model linear, 16k packs
    python benchmarks/train_speed.py --arch qwen3-vl-8b --seq-len 16384 --lora-rank 64 --recompute full \
        --hf-gradient-checkpointing --json-out benchmarks/results/train_speed_lora_8b_h100_<yyyymmdd>.json
    # CPU smoke
    python benchmarks/train_speed.py --arch tiny --seq-len 2048 --samples 40 --steps 2 --device cpu
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import inspect
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import T0, log, machine_info, parser, register_fewer_layers, write_json
from synthetic_shards import SyntheticSpec, write_synthetic_shards

from shards_schema import open_shards, verify_shards
from shards_schema.pixels import pixel_values_from_patches, video_pixel_values_from_patches
from tests.hf_reference import to_padded_batch
from train.config import ATTENTION_KERNELS, FP8_RECIPES, RECOMPUTE, STATE_DTYPES, parse_bool
from train.metrics import lm_flops_per_token, peak_tflops
from train.model.arch import builtin_arch


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser(__doc__, json_out="everything, with the machine and the command (default: OUT_DIR/train_speed.json)")
    ap.add_argument("--arch", default="qwen3-vl-2b", help="builtin architecture (train.model.arch.BUILTIN_ARCHS)")
    ap.add_argument("--layers", type=int, default=None,
                    help="keep only this many decoder layers of --arch (a large model's layers on one GPU)")
    ap.add_argument("--seq-len", type=int, default=16384, help="pack length; also the longest synthetic sample")
    ap.add_argument("--samples", type=int, default=400, help="synthetic samples to write")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic data, the init and the plans")
    ap.add_argument("--steps", type=int, default=10, help="measured training steps (ours)")
    ap.add_argument("--warmup", type=int, default=None, help="unmeasured first steps (ours); default 3 (CPU: 1)")
    ap.add_argument("--global-batch-packs", type=int, default=None, help="packs per step (ours); default 2 (CPU: 1)")
    ap.add_argument("--recompute", default="none", choices=RECOMPUTE,
                    help="trainer activation recompute (language model; auto: the trainer's choice from its "
                         "memory plan, recorded as the choice); on out-of-memory the run is retried once with "
                         "full unless --no-recompute-fallback")
    ap.add_argument("--no-recompute-fallback", action="store_true",
                    help="on out-of-memory, fail instead of retrying with --recompute full")
    ap.add_argument("--recompute-layers", type=int, default=None,
                    help="with --recompute full: recompute only the first N decoder layers (trainer's flag)")
    ap.add_argument("--recompute-vision", type=parse_bool, default=None,
                    help="redo the vision blocks in backward (trainer's flag; default: with full)")
    ap.add_argument("--profile", action="store_true",
                    help="torch.profiler over the last warmup step: GPU time by kernel kind and the top kernels")
    ap.add_argument("--trace", default=None, metavar="FILE.json.gz",
                    help="with --profile: also record host activity, save the step's chrome trace here and "
                         "report where the GPU waits for the host (gaps between kernels, by what the host was doing)")
    ap.add_argument("--num-workers", type=int, default=2, help="trainer loader workers")
    ap.add_argument("--attention", default="fa2", choices=ATTENTION_KERNELS, help="trainer's CUDA attention kernel")
    ap.add_argument("--fp8", default=None, choices=FP8_RECIPES, help="trainer's --fp8 recipe (default: bf16 GEMMs)")
    ap.add_argument("--pad-packs", type=parse_bool, default=None,
                    help="trainer's --pad-packs: pad every pack to --seq-len rows (true/false; default: the "
                         "trainer's, on with --fp8)")
    ap.add_argument("--compile-decoder", type=parse_bool, default=True,
                    help="trainer's --compile-decoder: compile each dense decoder layer (true/false; default true)")
    ap.add_argument("--grad-dtype", default="fp32", choices=STATE_DTYPES, help="trainer's gradient buffers")
    ap.add_argument("--adam-state-dtype", default="fp32", choices=STATE_DTYPES, help="trainer's Adam moments")
    ap.add_argument("--lr", type=float, default=1e-5, help="learning rate of both sides")
    ap.add_argument("--lora-rank", type=int, default=0,
                    help="both sides train LoRA adapters of this rank (alpha 2 x rank) on every language-model linear, "
                         "the base frozen (HF: PEFT); 0: full fine-tuning")
    ap.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default: cuda when available")
    ap.add_argument("--text-tokens", type=int, nargs=2, default=(100, 3000), metavar=("MIN", "MAX"),
                    help="non-image tokens per synthetic sample")
    ap.add_argument("--image-tokens", type=int, nargs=2, default=(64, 1300), metavar=("MIN", "MAX"),
                    help="merged tokens per synthetic image")
    ap.add_argument("--video-prob", type=float, default=0.0,
                    help="probability that a synthetic sample holds one video (synthetic_shards.py)")
    ap.add_argument("--video-seconds", type=float, nargs=2, default=(4.0, 60.0), metavar=("MIN", "MAX"),
                    help="synthetic video length in seconds (sampled at 2 fps)")
    ap.add_argument("--video-tokens", type=int, nargs=2, default=(256, 4096), metavar=("MIN", "MAX"),
                    help="merged tokens per synthetic video")
    ap.add_argument("--data-dir", default=None, help="use this existing shard directory instead of writing one")
    ap.add_argument("--no-verify", action="store_true", help="skip the full verify of the synthetic shards")
    ap.add_argument("--keep-checkpoint", action="store_true", help="let the trainer save its final checkpoint")
    ap.add_argument("--vision-reps", type=int, default=None,
                    help="repetitions of the isolated vision cross-check; default 3 (CPU: 1)")
    ap.add_argument("--skip-hf", action="store_true", help="measure ours only")
    ap.add_argument("--hf-max-batch", type=int, default=None, help="largest HF batch size tried; default 32 (CPU: 2)")
    ap.add_argument("--hf-steps", type=int, default=None, help="measured HF steps at the chosen batch size; default 5 (CPU: 2)")
    ap.add_argument("--hf-warmup", type=int, default=1, help="unmeasured HF steps at the chosen batch size")
    ap.add_argument("--hf-precision", default="bf16", choices=("bf16", "amp"),
                    help="bf16: bf16 parameters and AdamW states; amp: fp32 parameters + bf16 autocast (GPU only)")
    ap.add_argument("--hf-gradient-checkpointing", action="store_true",
                    help="HF recomputes every decoder layer in backward (for models whose batch of 1 does not fit "
                         "without it; default off, as ours with --recompute none)")
    ap.add_argument("--hf-search-budget", type=float, default=150.0, help="seconds for the HF batch-size search")
    ap.add_argument("--out-dir", default=str(Path(tempfile.gettempdir()) / "vlmpack_train_speed"),
                    help="data and training output (default: under the temp dir)")
    args = ap.parse_args(argv)
    args.base_arch = args.arch
    if args.layers:
        args.arch = register_fewer_layers(args.arch, args.layers)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cpu = args.device == "cpu"  # smoke runs: the tiny model's 151,936-way loss is slow on a few cores
    for name, gpu_default, cpu_default in (("warmup", 3, 1), ("global_batch_packs", 2, 1), ("vision_reps", 3, 1),
                                           ("hf_max_batch", 32, 2), ("hf_steps", 5, 2)):
        if getattr(args, name) is None:
            setattr(args, name, cpu_default if cpu else gpu_default)
    return args


# ------------------------------------------------------------------------------------------ timing


class Clock:
    """CUDA events on the current stream (GPU) or perf_counter (CPU); seconds between marks."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1000.0 if self.cuda else b - a

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class TrainerProbe:
    """Wraps the trainer's module-level names for one `train()` call (restored afterwards) to
    record per-step marks, the packs consumed, and the model/data for the cross-check."""

    def __init__(self, device: torch.device, keep_checkpoint: bool):
        self.clock = Clock(device)
        self.keep_checkpoint = keep_checkpoint
        self.steps: list[dict] = []
        self.packs: list[tuple[int, int]] = []  # (epoch, pack_index) in consumption order
        self.model = self.data = self.last_batches = None
        self.checkpoint_saves_skipped = 0
        self.active = True  # hooks record only while the trainer runs
        self.profile_step = None  # 1-based step whose forward+backward runs under torch.profiler
        self.kernels = None
        self.trace_path: Path | None = None  # with host activity: chrome trace + GPU idle analysis
        self.labels: set[str] = set()  # label_modules' range names (not kernels)
        self.idle = None

    def _cur(self) -> dict:
        return self.steps[-1]

    @contextlib.contextmanager
    def patched(self):
        import train.checkpoint as ckpt
        import train.trainer as tr

        probe, clock = self, self.clock
        saved = {name: getattr(tr, name) for name in ("TrainData", "run_global_batch", "build_optimizer", "build_model")}
        saved_save = ckpt.save

        class ProbedData(saved["TrainData"]):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                probe.data = self

            def next_global_batch(self):
                probe.steps.append({"fb": None, "opt": None, "vf": [], "ve": [], "vb": [], "vw": [], "vp": []})
                t0 = time.perf_counter()
                batches = super().next_global_batch()
                probe._cur()["data_s"] = time.perf_counter() - t0
                return batches

            def _micro_batches(self, packs_iter, count):
                def record(it):
                    for pack in it:
                        probe.packs.append((int(pack["epoch"]), int(pack["pack_index"])))
                        yield pack
                return super()._micro_batches(record(packs_iter), count)

        def run_global_batch(model, micro_batches, *a, **k):
            probe.model, probe.last_batches = model, micro_batches
            profiling = len(probe.steps) == probe.profile_step
            activities = [torch.profiler.ProfilerActivity.CUDA]
            if probe.trace_path is not None:
                activities.append(torch.profiler.ProfilerActivity.CPU)
            prof = torch.profiler.profile(activities=activities) if profiling else None
            with prof or contextlib.nullcontext():
                start = clock.mark()
                out = saved["run_global_batch"](model, micro_batches, *a, **k)
                probe._cur()["fb"] = (start, clock.mark())
            if prof is not None:
                probe.kernels = kernel_summary(prof, skip=probe.labels)
                if probe.trace_path is not None:
                    probe.idle = save_trace(prof, probe.trace_path)
            return out

        def build_optimizer(*a, **k):
            optimizer, scheduler = saved["build_optimizer"](*a, **k)
            step = optimizer.step

            def timed_step(*sa, **sk):
                start = clock.mark()
                out = step(*sa, **sk)
                probe._cur()["opt"] = (start, clock.mark())
                return out

            optimizer.step = timed_step
            return optimizer, scheduler

        def build_model(*a, **k):
            model = saved["build_model"](*a, **k)
            if model.vision is not None:
                probe._hook_vision(model.vision)
            if probe.trace_path is not None:
                probe.labels = label_modules(model)
            return model

        def save(*a, **k):
            if probe.keep_checkpoint:
                return saved_save(*a, **k)
            probe.checkpoint_saves_skipped += 1
            return None

        tr.TrainData, tr.run_global_batch, tr.build_optimizer, tr.build_model = (
            ProbedData, run_global_batch, build_optimizer, build_model)
        ckpt.save = save
        try:
            yield self
        finally:
            for name, value in saved.items():
                setattr(tr, name, value)
            ckpt.save = saved_save

    def _hook_vision(self, vision) -> None:
        clock = self.clock

        def pre(module, args):
            if self.active and self.steps:
                self._cur()["vf"].append(clock.mark())

        def post(module, args, output):
            if not (self.active and self.steps):
                return
            self._cur()["ve"].append(clock.mark())
            embeds = output[0]
            if embeds.requires_grad:
                step = self._cur()
                embeds.register_hook(lambda grad: step["vb"].append(clock.mark()))

        vision.register_forward_pre_hook(pre)
        vision.register_forward_hook(post)
        # The tower's first ops (patch embedding, learned pos embedding) get their weight
        # gradients last in its backward: their accumulation marks the end of it.
        firsts = [("vw", vision.patch_embed.proj.weight)]
        if hasattr(vision, "pos_embed"):
            firsts.append(("vp", vision.pos_embed.weight))
        for key, param in firsts:
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(
                    lambda p, key=key: self._cur()[key].append(clock.mark()) if self.active and self.steps else None)

    def step_timings(self) -> list[dict]:
        """Seconds per step (marks of all micro-batches summed); vision_bwd_s None when unmeasured."""
        self.clock.sync()
        sec = self.clock.seconds
        out = []
        for s in self.steps:
            vis_f = sum(sec(a, b) for a, b in zip(s["vf"], s["ve"]))
            vis_b = 0.0 if not s["vf"] else None
            ends = [[s[k][i] for k in ("vw", "vp") if len(s[k]) > i] for i in range(len(s["vb"]))]
            if s["vb"] and all(ends):
                vis_b = sum(max(sec(start, end) for end in e) for start, e in zip(s["vb"], ends))
            out.append({
                "data_s": s.get("data_s"),
                "fwd_bwd_s": sec(*s["fb"]) if s["fb"] else None,
                "optimizer_s": sec(*s["opt"]) if s["opt"] else None,
                "vision_fwd_s": vis_f,
                "vision_bwd_s": vis_b,
                "vision_calls": len(s["vf"]),
            })
        return out


KERNEL_KINDS = (  # first match wins; FlashAttention kernel names mention cutlass types, so they go first
    ("attention", ("flash", "fmha", "attn")),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "sm80_xmma", "wgmma")),
    ("norm", ("norm",)),
    ("softmax/cross-entropy", ("softmax", "log_softmax", "logsumexp", "nll", "cross_entropy")),
    ("copy/cast", ("copy", "memcpy", "memset", "cat", "fill", "index")),
    ("reduce", ("reduce",)),
    ("elementwise", ("elementwise", "vectorized", "triton")),
)


def model_flops(arch, lengths: list[int], grids: np.ndarray) -> dict:
    """Training FLOPs (forward + backward = 3 x forward, no recompute) of one step's samples,
    by part: what the model must compute, so FLOPs / (time x peak) is the utilisation of ALL
    of it, where LM MFU counts only the language model's 6 N per token.
    lm_dense: 6 N_lm per token; lm_attention: causal, 2 L^2 (Hq d) per layer forward;
    vision_dense: patch embedding + blocks per patch, mergers (final + DeepStack) per merged
    token; vision_attention: bidirectional 4 S^2 hidden per layer forward, S = the patches of
    a frame (Qwen2.5-VL: of a window, on its windowed layers)."""
    from train.model.vision import frame_cu_seqlens, window_order

    lm, v = arch.lm, arch.vision
    lengths = np.asarray(lengths, dtype=np.float64)
    out = {"lm_dense": 6.0 * arch.lm.num_non_embedding_params() * lengths.sum(),
           "lm_attention": 3.0 * 2.0 * (lengths ** 2).sum() * lm.num_heads * lm.head_dim * lm.num_layers,
           "vision_dense": 0.0, "vision_attention": 0.0}
    if len(grids):
        grid = torch.as_tensor(np.asarray(grids), dtype=torch.long).reshape(-1, 3)
        patches = float(grid.prod(1).sum())
        h, i = v.hidden_size, v.intermediate_size
        mlp = (3 if v.family == "qwen2.5-vl" else 2) * h * i
        block = 4 * h * h + mlp
        embed = v.in_channels * v.temporal_patch_size * v.patch_size ** 2 * h
        merged = h * v.spatial_merge_size ** 2
        merger = merged * merged + merged * v.out_hidden_size
        out["vision_dense"] = 6.0 * ((v.depth * block + embed) * patches
                                     + (1 + len(v.deepstack_visual_indexes)) * merger * patches / v.spatial_merge_size ** 2)
        full = np.diff(frame_cu_seqlens(grid).numpy()).astype(np.float64)
        per_layer = {"full": (full ** 2).sum()}
        full_layers = v.depth
        if v.family == "qwen2.5-vl":
            windows = np.diff(window_order(grid, v.spatial_merge_size, v.window_tokens)[1].numpy()).astype(np.float64)
            full_layers = len(v.fullatt_block_indexes)
            per_layer["windowed"] = (windows ** 2).sum() * (v.depth - full_layers)
        out["vision_attention"] = 3.0 * 4.0 * h * (per_layer["full"] * full_layers + per_layer.get("windowed", 0.0))
    out["total"] = sum(out.values())
    return out


def label_modules(model) -> set[str]:
    """Name the model's parts in the profiler's host timeline (record_function around each
    forward; recomputed forwards in backward show up under the same names). Returns the names:
    the profiler also lists each range as a GPU-side annotation, which is not a kernel."""
    lm = model.language_model
    parts = [("vision", model.vision), ("lm.embedding", getattr(lm, "embedding", None)),
             ("lm.output_layer", getattr(lm, "output_layer", None))]
    parts += [(f"lm.layer{i:02d}", layer) for i, layer in enumerate(lm.decoder.layers)]
    if model.vision is not None:
        parts += [(f"vision.block{i:02d}", block) for i, block in enumerate(model.vision.blocks)]
    for name, module in parts:
        if module is None:
            continue

        # dynamo leaves the hooks alone: traced inside a compiled block, they break its graph
        # and recompile at every new range-stack depth until dynamo's recompile limit
        @torch.compiler.disable
        def pre(m, args, name=name):
            m._vlmpack_ranges = getattr(m, "_vlmpack_ranges", []) + [torch.profiler.record_function(name)]
            m._vlmpack_ranges[-1].__enter__()

        @torch.compiler.disable
        def post(m, args, output):
            m._vlmpack_ranges.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
    return {name for name, module in parts if module is not None}


def save_trace(prof, path: Path) -> dict:
    """Write the chrome trace (gzip) and return `gpu_idle_summary` of it."""
    import gzip

    raw = path.with_suffix("") if path.suffix == ".gz" else path
    raw.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(raw))
    trace = json.loads(raw.read_text())
    if path.suffix == ".gz":
        with open(raw, "rb") as src, gzip.open(path, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
    return gpu_idle_summary(trace)


GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_idle_summary(trace: dict, big_gap_us: float = 20.0, top: int = 15) -> dict:
    """Where the GPU waits for the host in a chrome trace: the gaps between (merged) GPU
    activity, and for each gap of at least `big_gap_us` what the host was doing at its middle:
    the outermost labelled range (`label_modules`; backward ops run on the autograd thread
    without labels), the innermost host op and the CUDA runtime call, if any."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    gpu = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events if e.get("cat") in GPU_CATS)
    if not gpu:
        return {}
    merged = [list(gpu[0])]
    for a, b in gpu[1:]:
        if a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    gaps = [(merged[i][1], merged[i + 1][0]) for i in range(len(merged) - 1)]
    span = merged[-1][1] - merged[0][0]
    busy = sum(b - a for a, b in merged)
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime")]
    ts = np.array([float(e["ts"]) for e in host])
    end = ts + np.array([float(e["dur"]) for e in host])
    by: dict[str, dict[str, list]] = {"label": {}, "op": {}, "runtime": {}}
    small = [0, 0.0]
    for a, b in gaps:
        width = b - a
        if width < big_gap_us:
            small[0] += 1
            small[1] += width
            continue
        mid = (a + b) / 2
        live = [host[i] for i in np.flatnonzero((ts <= mid) & (end >= mid))]
        labels = [e for e in live if e.get("cat") == "user_annotation" and not e["name"].startswith("ProfilerStep")]
        ops = [e for e in live if e.get("cat") == "cpu_op"]
        runtime = [e for e in live if e.get("cat") == "cuda_runtime"]
        keys = {"label": max(labels, key=lambda e: e["dur"])["name"] if labels else "(none)",
                "op": min(ops, key=lambda e: e["dur"])["name"] if ops else "(no host op: python)",
                "runtime": runtime[0]["name"] if runtime else "(none)"}
        for kind, key in keys.items():
            slot = by[kind].setdefault(key, [0, 0.0])
            slot[0] += 1
            slot[1] += width

    def ranked(table):
        rows = sorted(table.items(), key=lambda kv: -kv[1][1])[:top]
        return [{"name": k[:120], "gaps": n, "ms": round(us / 1e3, 3)} for k, (n, us) in rows]

    return {"span_ms": span / 1e3, "gpu_busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3,
            "gaps_below_%gus" % big_gap_us: {"count": small[0], "ms": small[1] / 1e3},
            "big_gaps": {"count": sum(n for n, _ in by["label"].values()),
                         "ms": sum(us for _, us in by["label"].values()) / 1e3},
            "by_label": ranked(by["label"]), "by_host_op": ranked(by["op"]), "by_runtime_call": ranked(by["runtime"])}


def kernel_summary(prof, top: int = 25, skip: set[str] = frozenset()) -> dict:
    """GPU self time per kernel kind and the top kernels of one profiled step. `skip`: names of
    user ranges (`label_modules`), which the profiler also lists as device-side annotations
    spanning their kernels: counted, they doubled the GPU time of `--trace` runs."""
    kernels = [(e.key, e.self_device_time_total / 1e6, e.count) for e in prof.key_averages()
               if e.self_device_time_total > 0 and e.device_type == torch.autograd.DeviceType.CUDA
               and e.key not in skip]
    by_kind: dict[str, float] = {}
    for name, seconds, _ in kernels:
        low = name.lower()
        kind = next((k for k, keys in KERNEL_KINDS if any(x in low for x in keys)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + seconds
    kernels.sort(key=lambda k: -k[1])
    total = sum(by_kind.values())
    return {"gpu_s": total, "by_kind_s": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "top": [{"name": n[:160], "s": s, "calls": c} for n, s, c in kernels[:top]]}


# ------------------------------------------------------------------------------------------ ours


def _release(probe: TrainerProbe, device: torch.device) -> None:
    """Drop what the probe kept (model, batches, the loader's workers) and the process groups."""
    from train.parallel import destroy_parallel

    gen = getattr(probe.data, "_packs", None)
    if gen is not None:
        gen.close()
    probe.model = probe.data = probe.last_batches = None
    gc.collect()
    destroy_parallel()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def resolve_auto_recompute(args, data_dir: Path, device: torch.device) -> None:
    """`--recompute auto` resolved as the trainer resolves it, into this process's args: the
    recompute and layers it chose, and its line as `recompute_auto`."""
    from train.config import TrainConfig
    from train.trainer import resolve_arch, resolve_recompute

    config = TrainConfig(data=[str(data_dir)], arch=args.arch, seq_len=args.seq_len, dry_run=True,
                         global_batch_packs=args.global_batch_packs, recompute="auto",
                         recompute_vision=args.recompute_vision, grad_dtype=args.grad_dtype,
                         adam_state_dtype=args.adam_state_dtype, lora_rank=args.lora_rank)
    config, args.recompute_auto = resolve_recompute(config, resolve_arch(config), cuda=device.type == "cuda")
    args.recompute, args.recompute_layers = config.recompute, config.recompute_layers
    log(f"ours: {args.recompute_auto}")


def _train_once(args, data_dir: Path, run_dir: Path, recompute: str, device: torch.device):
    """One instrumented `train()`; returns (probe, config, result, wall seconds) or raises."""
    from train.config import TrainConfig
    from train.trainer import train

    shutil.rmtree(run_dir, ignore_errors=True)
    config = TrainConfig(
        data=[str(data_dir)], out=str(run_dir), arch=args.arch, seq_len=args.seq_len,
        global_batch_packs=args.global_batch_packs, train_steps=args.warmup + args.steps, lr=args.lr,
        recompute=recompute, recompute_layers=args.recompute_layers if recompute == "full" else None,
        recompute_vision=args.recompute_vision, device=args.device, num_workers=args.num_workers, tensorboard=False,
        save_every=0, seed=args.seed, log_every=1, attention=args.attention, grad_dtype=args.grad_dtype,
        adam_state_dtype=args.adam_state_dtype, lora_rank=args.lora_rank, compile_decoder=args.compile_decoder,
        fp8=args.fp8, pad_packs=args.pad_packs)
    config.validate()
    probe = TrainerProbe(device, args.keep_checkpoint)
    if args.profile and device.type == "cuda":
        probe.profile_step = args.warmup  # the last unmeasured step: profiling overhead stays out of the figures
        probe.trace_path = Path(args.trace) if args.trace else None
    log(f"ours: train({args.arch}, seq_len {args.seq_len}, {args.global_batch_packs} packs/step, "
        f"{args.warmup}+{args.steps} steps, recompute {recompute}, layers {config.recompute_layers}, "
        f"vision {config.recompute_vision}, attention {config.attention}, "
        f"compiled decoder {config.compile_decoder}, fp8 {config.fp8 or 'off'}, "
        f"packs padded {config.packs_padded()}, grads {config.grad_dtype}, "
        f"Adam state {config.adam_state_dtype}, LoRA rank {config.lora_rank}) -> {run_dir}")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    try:
        with probe.patched():
            result = train(config)
    except BaseException:
        probe.active = False
        _release(probe, device)
        raise
    return probe, config, result, time.perf_counter() - started


def run_ours(args, data_dir: Path, run_dir: Path) -> tuple[dict, list[int]]:
    from train.trainer import is_out_of_memory

    device = torch.device(args.device)
    if args.recompute == "auto":
        resolve_auto_recompute(args, data_dir, device)
    attempts = []
    recompute = args.recompute
    while True:
        oom = None
        try:
            probe, config, result, wall = _train_once(args, data_dir, run_dir, recompute, device)
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not is_out_of_memory(exc):
                raise
            oom = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        if oom is None:
            break
        # outside the except block, so the failed run's frames (and tensors) are gone
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        attempts.append({"recompute": recompute, "error": oom})
        log(f"ours: out of memory with recompute {recompute} ({oom[:120]})")
        if recompute == "full" or args.no_recompute_fallback:
            raise SystemExit("ours ran out of memory; try --recompute full or a smaller --seq-len")
        recompute = "full"
    timings = probe.step_timings()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]

    probe.active = False
    vision_check = isolated_vision(probe, args, device, timings[-1] if timings else {})
    packs = list(probe.packs)
    plans = {}
    pool_index: list[int] = []
    step_samples: list[list[int]] = []  # pool indices of each step's samples (packs are consumed in step order)
    for n, (epoch, pack) in enumerate(packs):
        if epoch not in plans:
            plans[epoch] = probe.data.loader.plan(epoch)
        sources, indices = plans[epoch].pack_samples(pack)
        chosen = [int(i) for s, i in zip(sources.tolist(), indices.tolist()) if s == 0]
        pool_index += chosen
        if n % args.global_batch_packs == 0:
            step_samples.append([])
        step_samples[-1] += chosen
    shards = open_shards(data_dir)
    arch = builtin_arch(args.arch)
    step_flops = []
    for chosen in step_samples:
        rows = [shards[i] for i in chosen]
        grids = np.concatenate([r[k] for r in rows for k in ("image_grid_thw", "video_grid_thw")]) if rows else np.zeros((0, 3))
        step_flops.append(model_flops(arch, [len(r["input_ids"]) for r in rows], grids))
    skipped = probe.checkpoint_saves_skipped
    _release(probe, device)

    n_lm = lm_flops_per_token(arch)
    peak = peak_tflops(device) * 1e12
    measured = [dict(r, **t) for r, t in zip(records, timings)][args.warmup:]
    flops = {k: sum(f[k] for f in step_flops[args.warmup:]) for k in step_flops[0]}
    total_tokens = sum(r["tokens"] for r in measured)
    total_s = sum(r["step_seconds"] for r in measured)
    tps = total_tokens / total_s

    def total(key):
        values = [r[key] for r in measured]
        return None if any(v is None for v in values) else sum(values)

    fb, opt, vf, vb = total("fwd_bwd_s"), total("optimizer_s"), total("vision_fwd_s"), total("vision_bwd_s")
    summary = {
        "steps_measured": len(measured),
        "tokens_per_step_mean": total_tokens / len(measured),
        "target_tokens_per_step_mean": sum(r["target_tokens"] for r in measured) / len(measured),
        "tokens_per_s": tps,
        "tokens_per_s_trainer_mean": float(np.mean([r["tokens_per_s"] for r in measured])),
        "lm_mfu": tps * n_lm / peak if peak else None,
        "model_tflop_per_step": {k: v / len(measured) / 1e12 for k, v in flops.items()},
        "model_flops_share": {k: v / flops["total"] for k, v in flops.items() if k != "total"},
        "model_flops_utilization": flops["total"] / total_s / peak if peak else None,
        "model_flops_method": "model_flops(): all parts (LM and vision GEMMs, LM and vision attention), "
                              "forward + backward, recompute not counted, over the measured steps' wall time",
        "step_s_mean": total_s / len(measured),
        "step_s_median": float(np.median([r["step_seconds"] for r in measured])),
        "fwd_bwd_s_mean": fb / len(measured) if fb is not None else None,
        "optimizer_s_mean": opt / len(measured) if opt is not None else None,
        "data_wait_s_mean": sum(r["data_s"] for r in measured) / len(measured),
        "vision_fwd_s_mean": vf / len(measured) if vf is not None else None,
        "vision_bwd_s_mean": vb / len(measured) if vb is not None else None,
        "vision_share_of_step": (vf + vb) / total_s if vb is not None else None,
        "vision_share_of_fwd_bwd": (vf + vb) / fb if vb is not None and fb else None,
        "vision_share_method": "CUDA events in the real step: vision forward (pre/post hooks) + vision backward "
                               "(grad hook on the image embeddings -> first-layer weight grad accumulation), "
                               "summed over micro-batches, over the whole step time",
        "peak_memory_gib": max((r["peak_memory_gib"] for r in measured if r["peak_memory_gib"] is not None), default=None),
        # CUDA caching-allocator "free everything and retry" events inside the measured steps (each a stall)
        "alloc_retries_measured": (measured[-1].get("alloc_retries") or 0) - (records[args.warmup - 1].get("alloc_retries") or 0)
        if args.warmup and measured[-1].get("alloc_retries") is not None else None,
        "loss_first": records[0]["loss"], "loss_last": records[-1]["loss"],
        "wall_s": wall,
        "checkpoint_saves_skipped": skipped,
        "recompute": recompute,
        "out_of_memory_attempts": attempts,
        "pack_fill": total_tokens / (len(measured) * args.global_batch_packs * args.seq_len),
        "isolated_vision": vision_check,
        "packs_consumed": len(packs),
        "recompute_layers": config.recompute_layers,
        "recompute_vision": config.recompute_vision,
        "attention": config.attention,
        "grad_dtype": config.grad_dtype,
        "adam_state_dtype": config.adam_state_dtype,
        "kernels": probe.kernels,
        "gpu_idle": probe.idle,
    }
    if probe.kernels:
        k = probe.kernels
        log("ours: profiled step GPU time " + f"{k['gpu_s']:.3f} s: " +
            ", ".join(f"{kind} {sec:.3f}" for kind, sec in k["by_kind_s"].items()))
        for item in k["top"]:
            log(f"    {item['s'] * 1e3:8.1f} ms {item['calls']:6d}x  {item['name'][:110]}")
    if probe.idle:
        idle = probe.idle
        log(f"ours: traced step {idle['span_ms']:.1f} ms, GPU busy {idle['gpu_busy_ms']:.1f} ms, idle {idle['idle_ms']:.1f} ms "
            f"({idle['big_gaps']['count']} gaps >= 20 us: {idle['big_gaps']['ms']:.1f} ms)")
        for kind in ("by_label", "by_host_op", "by_runtime_call"):
            log(f"  idle {kind}: " + "; ".join(f"{r['name']} {r['ms']:.1f} ms/{r['gaps']}" for r in idle[kind][:8]))
    log("ours: model FLOPs per step " + ", ".join(f"{k} {v:.1f} TFLOP" for k, v in summary["model_tflop_per_step"].items())
        + f"; all-parts utilisation {fmt_pct(summary['model_flops_utilization'])}")
    log(f"ours: {tps:,.0f} tok/s, MFU {fmt_pct(summary['lm_mfu'])}, step {summary['step_s_mean']:.3f} s "
        f"(fwd+bwd {fmt_s(summary['fwd_bwd_s_mean'])}, optimizer {fmt_s(summary['optimizer_s_mean'])}), "
        f"vision {fmt_pct(summary['vision_share_of_step'])} of the step, peak {fmt_gib(summary['peak_memory_gib'])}, "
        f"allocator retries {summary['alloc_retries_measured']}")
    return {"summary": summary, "steps": [dict(r, **t) for r, t in zip(records, timings)],
            "trainer_result": result, "config": config.to_dict(),
            "recompute_auto": getattr(args, "recompute_auto", None)}, sorted(set(pool_index))


def isolated_vision(probe: TrainerProbe, args, device: torch.device, in_step: dict) -> dict | None:
    """The last step's micro-batches through the vision tower alone, forward + backward."""
    model, data, batches = probe.model, probe.data, probe.last_batches
    if model is None or not batches:
        return None
    tower = model.module.vision if hasattr(model, "module") else model.vision
    if not any(p.requires_grad for p in tower.parameters()):  # frozen (LoRA on the language model): no backward
        return None
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    clock = probe.clock
    work = []
    for b in batches:  # images and videos in one tower call, as the model makes it
        parts = [(values, grid) for values, grid in ((data.pixel_values(b, dtype), b["image_grid_thw"]),
                                                     (data.pixel_values_videos(b, dtype), b["video_grid_thw"]))
                 if values is not None]
        if parts:
            work.append((torch.cat([v for v, _ in parts]), torch.cat([torch.as_tensor(g) for _, g in parts])))
    if not work:
        return None
    fwd, bwd = [], []
    for rep in range(args.vision_reps + 1):
        f = b = 0.0
        for pixels, grid in work:
            a = clock.mark()
            out, deepstack = tower(pixels, grid)
            m = clock.mark()
            outs = [out, *deepstack]
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
            e = clock.mark()
            clock.sync()
            f, b = f + clock.seconds(a, m), b + clock.seconds(m, e)
            del out, deepstack, outs
        if rep:  # the first repetition warms up
            fwd.append(f)
            bwd.append(b)
    if hasattr(model, "zero_grad_buffer"):
        model.zero_grad_buffer()
    return {"micro_batches": len(work), "patches": int(sum(p.shape[0] for p, _ in work)),
            "fwd_s": float(np.median(fwd)), "bwd_s": float(np.median(bwd)),
            "in_step_fwd_s": in_step.get("vision_fwd_s"), "in_step_bwd_s": in_step.get("vision_bwd_s"),
            "note": "last step's micro-batches re-run through the tower alone after training (unit output "
                    "gradients); compare with the in-step marks of that step"}


# ------------------------------------------------------------------------------------------ HF


def hf_model_class(arch):
    """transformers' class for the arch's family (Qwen3VL... or Qwen2_5_VL...ForConditionalGeneration)."""
    import transformers

    return getattr(transformers, arch.hf_architecture)


class HFTrainer:
    def __init__(self, args, arch, profile: dict, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"
        self.vision, self.video = profile["vision"], profile.get("video")
        special = profile["special_tokens"]
        self.pad_id, self.image_pad_id = int(special["endoftext"]), int(special["image_pad"])
        self.video_pad_id = int(special.get("video_pad", 151656))
        self.amp = self.cuda and args.hf_precision == "amp"
        self.param_dtype = torch.bfloat16 if self.cuda and args.hf_precision == "bf16" else torch.float32
        self.pixel_dtype = torch.bfloat16 if self.cuda else torch.float32
        model_class = hf_model_class(arch)
        config = model_class.config_class(**arch.to_hf_config())
        torch.manual_seed(args.seed)
        with torch.device(device):
            self.model = model_class._from_config(config, attn_implementation="sdpa", dtype=self.param_dtype)
        self.model.train()
        self.model.config.use_cache = False
        forward_params = inspect.signature(self.model.forward).parameters
        if args.hf_gradient_checkpointing:  # transformers' own per-layer recompute (non-reentrant)
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if args.lora_rank:  # PEFT's adapters on the same modules as ours, the base frozen
            from peft import LoraConfig, get_peft_model

            from train.model.lora import LoraSpec, peft_target_regex, resolve_sites

            spec = LoraSpec(rank=args.lora_rank, alpha=2.0 * args.lora_rank)
            self.model = get_peft_model(self.model, LoraConfig(
                r=spec.rank, lora_alpha=spec.alpha, target_modules=peft_target_regex(resolve_sites(arch, spec))))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
        self.takes_mm_types = "mm_token_type_ids" in forward_params
        self.takes_second_per_grid_ts = "second_per_grid_ts" in forward_params
        self.num_params = sum(p.numel() for p in self.params)

    def collate(self, samples: list[dict]) -> dict:
        b = to_padded_batch(samples, pad_token_id=self.pad_id, image_pad_id=self.image_pad_id,
                            video_pad_id=self.video_pad_id)
        b["real_tokens"] = int(b["attention_mask"].sum())
        b["padded_tokens"] = int(b["attention_mask"].size)
        return b

    def step(self, batch: dict) -> float:
        dev = self.device
        inputs = {k: torch.from_numpy(batch[k]).to(dev, non_blocking=True)
                  for k in ("input_ids", "attention_mask", "labels")}
        if self.takes_mm_types:
            inputs["mm_token_type_ids"] = torch.from_numpy(batch["mm_token_type_ids"]).to(dev)
        else:  # a transformers without mm_token_type_ids: hand it the shards' positions
            inputs["position_ids"] = torch.from_numpy(batch["position_ids"]).to(dev)
        if batch["pixel_patches"].shape[0]:
            v = self.vision
            patches = torch.from_numpy(batch["pixel_patches"]).to(dev, non_blocking=True)
            inputs["pixel_values"] = pixel_values_from_patches(
                patches, v["image_mean"], v["image_std"], int(v["patch_size"]), int(v["temporal_patch_size"]),
                int(v.get("channels", 3)), dtype=self.pixel_dtype)
            inputs["image_grid_thw"] = torch.from_numpy(batch["image_grid_thw"]).to(dev)
        if batch["video_patches"].shape[0]:
            patches = torch.from_numpy(batch["video_patches"]).to(dev, non_blocking=True)
            inputs["pixel_values_videos"] = video_pixel_values_from_patches(
                patches, self.video["image_mean"], self.video["image_std"], dtype=self.pixel_dtype)
            inputs["video_grid_thw"] = torch.from_numpy(batch["video_grid_thw"]).to(dev)
            if self.takes_second_per_grid_ts:
                inputs["second_per_grid_ts"] = torch.from_numpy(batch["second_per_grid_ts"]).to(dev)
        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if self.amp else contextlib.nullcontext()
        with ctx:
            loss = self.model(**inputs, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def try_step(self, batch: dict) -> tuple[bool, float | None, float]:
        """(fits, loss, seconds); out-of-memory is caught and the allocator cache emptied."""
        from train.trainer import is_out_of_memory

        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            loss = self.step(batch)
            if self.cuda:
                torch.cuda.synchronize()
            return True, loss, time.perf_counter() - t0
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not is_out_of_memory(exc):
                raise
        # outside the except block: the traceback (and the tensors its frames hold) is gone
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return False, None, time.perf_counter() - t0


def run_hf(args, arch, data_dir: Path, pool_index: list[int], device: torch.device) -> dict:
    shards = open_shards(data_dir)
    profile = shards.manifest["profile"]
    samples = [shards[i] for i in pool_index]
    lengths = np.array([len(s["input_ids"]) for s in samples])
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    leftover = torch.cuda.memory_allocated() / 2**30 if cuda else None
    log(f"HF: {len(samples)} samples (those of ours' packs), {int(lengths.sum()):,} tokens, longest {lengths.max()}; "
        f"building {arch.hf_architecture} ({args.hf_precision if cuda else 'fp32'}, sdpa)"
        + (f"; {leftover:.2f} GiB still allocated from ours" if cuda else ""))
    hf = HFTrainer(args, arch, profile, device)
    model_gib = torch.cuda.memory_allocated() / 2**30 if cuda else None
    by_length = np.argsort(-lengths, kind="stable")

    def worst_batch(b: int) -> dict:
        return hf.collate([samples[i] for i in by_length[:b]])

    # --- batch-size search on the worst batch
    tries, fits = [], {}
    started = time.perf_counter()
    limit = min(args.hf_max_batch, len(samples))

    def attempt(b: int) -> bool:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        ok, loss, seconds = hf.try_step(worst_batch(b))
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        tries.append({"batch": b, "fits": ok, "seconds": seconds, "loss": loss, "peak_memory_gib": peak,
                      "padded_tokens": b * int(lengths[by_length[0]])})
        fits[b] = ok
        log(f"HF: batch {b} (worst case {b} x {int(lengths[by_length[0]])} tokens): "
            f"{'fits' if ok else 'out of memory'} in {seconds:.1f} s" + (f", peak {peak:.1f} GiB" if ok and cuda else ""))
        return ok

    good, bad, b = 0, None, 1
    while b <= limit:
        if time.perf_counter() - started > args.hf_search_budget and good:
            break
        if attempt(b):
            good = b
            if b == limit:
                break
            b = min(b * 2, limit)
        else:
            bad = b
            break
    while bad is not None and bad - good > 1 and time.perf_counter() - started < args.hf_search_budget:
        mid = (good + bad) // 2
        if attempt(mid):
            good = mid
        else:
            bad = mid
    search_s = time.perf_counter() - started
    result = {"model_params": hf.num_params, "model_memory_gib": model_gib, "leftover_from_ours_gib": leftover,
              "precision": args.hf_precision if cuda else "fp32", "passes_mm_token_type_ids": hf.takes_mm_types,
              "search": tries, "search_s": search_s}
    if not good:
        log("HF: batch size 1 does not fit")
        result["error"] = "out of memory at batch size 1"
        return result

    # --- measurement on random batches of the chosen size
    rng = np.random.default_rng(args.seed)
    batch = good
    while batch >= 1:
        order = rng.permutation(len(samples))
        need = (args.hf_warmup + args.hf_steps) * batch
        order = np.resize(order, need) if need > len(order) else order[:need]
        batches = [hf.collate([samples[i] for i in order[k * batch:(k + 1) * batch]])
                   for k in range(args.hf_warmup + args.hf_steps)]
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        steps, oom = [], False
        for k, bt in enumerate(batches):
            ok, loss, seconds = hf.try_step(bt)
            if not ok:
                oom = True
                break
            steps.append({"seconds": seconds, "loss": loss, "real_tokens": bt["real_tokens"],
                          "padded_tokens": bt["padded_tokens"], "warmup": k < args.hf_warmup})
            log(f"HF: step {k + 1}/{len(batches)} batch {batch}: {bt['real_tokens']:,} real / {bt['padded_tokens']:,} "
                f"padded tokens in {seconds:.2f} s ({bt['real_tokens'] / seconds:,.0f} tok/s), loss {loss:.3f}")
        if not oom:
            break
        log(f"HF: batch {batch} ran out of memory on a random batch; retrying with {batch - 1}")
        batch -= 1
    if batch < 1:
        result["error"] = "out of memory on random batches at every size"
        return result
    measured = [s for s in steps if not s["warmup"]]
    real = sum(s["real_tokens"] for s in measured)
    padded = sum(s["padded_tokens"] for s in measured)
    seconds = sum(s["seconds"] for s in measured)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    tps = real / seconds
    n_lm = lm_flops_per_token(arch)
    peak_flops = peak_tflops(device) * 1e12
    result.update({
        "batch_size": batch, "largest_fitting_worst_case": good, "first_oom": bad,
        "steps": steps, "steps_measured": len(measured), "tokens_per_s": tps,
        "lm_mfu": tps * n_lm / peak_flops if peak_flops else None,
        "step_s_mean": seconds / len(measured), "real_tokens_per_step_mean": real / len(measured),
        "padding_efficiency": real / padded, "peak_memory_gib": peak,
    })
    log(f"HF: batch {batch}: {tps:,.0f} real tok/s, MFU {fmt_pct(result['lm_mfu'])}, padding efficiency "
        f"{100 * real / padded:.0f}%, peak {fmt_gib(peak)}")
    return result


# ------------------------------------------------------------------------------------------ report


def fmt_pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def fmt_s(x) -> str:
    return "-" if x is None else f"{x:.3f} s"


def fmt_gib(x) -> str:
    return "-" if x is None else f"{x:.1f} GiB"


def machine(device: torch.device) -> dict:
    """common.machine_info plus what the MFU figures rest on: SM count and the bf16 peak."""
    info = machine_info(device)
    if device.type == "cuda":
        info.update(gpu_sms=torch.cuda.get_device_properties(device).multi_processor_count,
                    peak_bf16_tflops=peak_tflops(device))
    return info


def print_table(res: dict) -> None:
    ours = res["ours"]["summary"]
    hf = res.get("hf") or {}
    hf_ok = bool(hf) and "error" not in hf

    def ratio(a, b):
        return f"{a / b:.2f}x" if a is not None and b else "-"

    rows = [
        ("real tokens/s", f"{ours['tokens_per_s']:,.0f}", f"{hf['tokens_per_s']:,.0f}" if hf_ok else "-",
         ratio(ours["tokens_per_s"], hf.get("tokens_per_s") if hf_ok else None)),
        ("LM MFU", fmt_pct(ours["lm_mfu"]), fmt_pct(hf.get("lm_mfu")) if hf_ok else "-", ""),
        ("all-parts FLOPs util.", fmt_pct(ours.get("model_flops_utilization")), "", ""),
        ("peak memory", fmt_gib(ours["peak_memory_gib"]), fmt_gib(hf.get("peak_memory_gib")) if hf_ok else "-",
         ratio(ours["peak_memory_gib"], hf.get("peak_memory_gib") if hf_ok else None)),
        ("batch", f"{res['args']['global_batch_packs']} x {res['args']['seq_len']} packed",
         f"{hf['batch_size']} padded" if hf_ok else "-", ""),
        ("pack fill", fmt_pct(ours["pack_fill"]), "", ""),
        ("real tokens/step", f"{ours['tokens_per_step_mean']:,.0f}",
         f"{hf['real_tokens_per_step_mean']:,.0f}" if hf_ok else "-", ""),
        ("step time", fmt_s(ours["step_s_mean"]), fmt_s(hf.get("step_s_mean")) if hf_ok else "-", ""),
        ("  fwd+bwd", fmt_s(ours["fwd_bwd_s_mean"]), "", ""),
        ("  optimizer", fmt_s(ours["optimizer_s_mean"]), "", ""),
        ("  vision fwd+bwd", fmt_s(None if ours["vision_bwd_s_mean"] is None
                                   else ours["vision_fwd_s_mean"] + ours["vision_bwd_s_mean"]), "", ""),
        ("vision share of step", fmt_pct(ours["vision_share_of_step"]), "", ""),
        ("padding efficiency", "", fmt_pct(hf.get("padding_efficiency")) if hf_ok else "-", ""),
    ]
    device = res["machine"].get("device") or "cpu"
    print(f"\n{res['args']['arch']} on {device}: ours = vlmpack trainer (megatron-core, packed), "
          f"(recompute {ours['recompute']}, grads {ours['grad_dtype']}, Adam state {ours['adam_state_dtype']}), "
          f"HF = {builtin_arch(res['args']['arch']).hf_architecture} (sdpa, "
          f"{hf.get('precision', res['args']['hf_precision'])}, padded)", flush=True)
    widths = [22, 20, 20, 9]
    print("".join(h.ljust(w) for h, w in zip(("", "ours", "HF", "ours/HF"), widths)))
    print("-" * sum(widths))
    for row in rows:
        print("".join(str(c).ljust(w) for c, w in zip(row, widths)), flush=True)
    if hf and not hf_ok:
        print(f"HF: {hf['error']}")


def _child(queue, fn, args) -> None:
    try:
        for arg in args:  # a spawned process starts with the built-in table as the code has it
            if isinstance(arg, argparse.Namespace) and arg.layers:
                register_fewer_layers(arg.base_arch, arg.layers)
        queue.put(("ok", fn(*args)))
    except BaseException as exc:  # report, never hang the parent
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


def isolated(fn, *args):
    """fn(*args) in a fresh spawned process (its own CUDA context); its result back by pickle."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue, fn, args))
    proc.start()
    status, value = queue.get()
    proc.join()
    if status != "ok":
        raise SystemExit(f"{fn.__name__} failed: {value}")
    return value


def main(argv=None) -> int:
    args = parse_args(argv)
    # what `train()` sets for itself; here the child touches CUDA before calling it
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    device = torch.device(args.device)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_out = Path(args.json_out) if args.json_out else out_dir / "train_speed.json"
    arch = builtin_arch(args.arch)
    res = {"args": vars(args), "machine": machine(device),
           "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    log(f"machine: {res['machine']['device']}, torch {torch.__version__}, "
        f"transformers {res['machine']['transformers']}, megatron-core {res['machine']['megatron_core']}")

    if args.data_dir:
        data_dir = Path(args.data_dir)
        res["data"] = {"dir": str(data_dir), "generated": False}
    else:
        data_dir = out_dir / "data"
        spec = SyntheticSpec(num_samples=args.samples, seed=args.seed, text_tokens=tuple(args.text_tokens),
                             image_tokens=tuple(args.image_tokens), max_tokens=args.seq_len,
                             video_prob=args.video_prob, video_seconds=tuple(args.video_seconds),
                             video_tokens=tuple(args.video_tokens))
        t0 = time.perf_counter()
        manifest = write_synthetic_shards(data_dir, spec, profile_name=arch.family, log=log)
        res["data"] = {"dir": str(data_dir), "generated": True, "spec": dataclasses.asdict(spec),
                       "totals": manifest["totals"], "seconds": time.perf_counter() - t0}
    if not args.no_verify:
        report = verify_shards(data_dir)
        log(report.format_text().splitlines()[-1])
        res["data"]["verify"] = {"ok": report.ok, "fault_counts": dict(report.fault_counts), "seconds": report.seconds}
        if not report.ok:
            print(report.format_text(), flush=True)
            return 1

    # Each side in a process of its own: neither inherits the other's allocator cache or
    # megatron's global state, so both peaks and both batch-size searches start from an empty GPU.
    res["ours"], pool_index = isolated(run_ours, args, data_dir, out_dir / "ours")
    if res["ours"]["recompute_auto"]:  # the arguments record what auto chose (the line says it was auto)
        for key in ("recompute", "recompute_layers"):
            setattr(args, key, res["ours"]["config"][key])
        args.recompute_auto = res["ours"]["recompute_auto"]
    if not args.skip_hf:
        res["hf"] = isolated(run_hf, args, arch, data_dir, pool_index, device)
        gc.collect()
    ours, hf = res["ours"]["summary"], res.get("hf") or {}
    if hf and "error" not in hf:
        res["ratios"] = {"tokens_per_s": ours["tokens_per_s"] / hf["tokens_per_s"],
                         "peak_memory": (ours["peak_memory_gib"] / hf["peak_memory_gib"]
                                         if ours["peak_memory_gib"] and hf["peak_memory_gib"] else None)}
    res["total_s"] = time.perf_counter() - T0
    write_json(json_out, res)
    log(f"wrote {json_out}")
    print_table(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
