"""Training speed, side by side on the same packs: the vlmpack trainer against the strongest
Hugging Face recipe (`hf_baseline.py`: the same packs padding-free, varlen FlashAttention for the
language model and the vision tower, Liger kernels, fused AdamW), both starting from the same
weights, alternating runs in fresh processes on one machine.

Data: a synthetic mix in the arch's chat layout, written directly as a vlmpack shard directory
(`benchmarks/synthetic_shards.py`: 100-3000 text tokens and 0-3 images of 64-1300 merged
tokens per sample, chat structure, assistant targets, M-RoPE positions, random uint8 patches;
no sample longer than --seq-len; with --video-prob, videos too, which both sides feed to the
vision tower as `pixel_values_videos`), checked with `verify_shards` (what `vlmpack verify` runs).

Weights: random weights of --arch are written once as an HF checkpoint (bf16 on GPUs, fp32 on
CPU); vlmpack starts from it with `--hf-model` (converted on load) and HF loads it. So both
sides' first steps see the same weights and the same packs: their step-1 losses must agree
within the precision's noise (`loss_check`; fp32 on CPU: 1e-4, bf16: 5e-3 relative). A
baseline that computes something else is no baseline.

Protocol: --repeats times (default 2) vlmpack then HF, alternating, each in a fresh process on
an empty GPU. Each run: --warmup unmeasured steps, then --steps measured ones; a run's figure
is its median step (real tokens of the step / its wall time). Peak memory is
`torch.cuda.max_memory_allocated` over the run. The ratio is the mean of vlmpack's runs over
the mean of HF's; its spread is the least and largest ratio of any vlmpack run to any HF run.
Step by step (`per_step_ratios`): both sides train the same packs in the same order, so the
median over measured steps of HF's step time over vlmpack's is a second figure, one that a
stall of one side alone in a measured step (a Triton autotune, a recompile) cannot move.

(a) vlmpack: `train.trainer.train(TrainConfig.from_flat({hf_model: INIT, seq_len: ..., ...}))`,
    bf16 on GPUs (fp32 on CPU, as the trainer does). tokens/s, MFU and peak memory come from the
    trainer's own OUT/metrics.jsonl (tokens = real tokens, padding excluded; MFU = 6 * N_lm per
    token over the GPU's bf16 peak, `train.metrics`). step_seconds is the whole loop iteration
    (next global batch from the loader, forward+backward, optimizer step, loss all-reduce, sync).
    The trainer's metrics time each step's phases with CUDA events on the compute stream:
      fwd+bwd   = `run_global_batch` (all micro-batches' forward and backward, grad finalize);
      optimizer = `optimizer.step()` (megatron mixed-precision Adam: unscale, clip, step, copy);
    and a `Trainer` subclass adds hooks on the model (CUDA events too):
      vision    = the vision tower inside the step: forward from its forward pre-hook to its
                  forward hook; backward from the gradient hook on its output (image
                  embeddings) to the gradient accumulation of its first layer (patch embed /
                  pos embed weights).
    As a cross-check, the last step's micro-batches are re-run through the vision tower alone
    after training. The trainer's final checkpoint save is turned off (`--save-final false`: not
    part of any timed step) unless --keep-checkpoint.
(b) HF: `hf_baseline.HFPackedTrainer` on exactly the packs (a) trained on, in its order, one
    optimizer step per global batch of packs; gradient checkpointing only when a step does not
    fit without it (--hf-gradient-checkpointing auto: the run is retried with it, and the
    result says so). With --lora-rank R both sides train LoRA adapters (rank R, alpha 2R) on
    every linear of the language model, the base frozen: vlmpack `--lora-rank R`, HF through
    PEFT's `get_peft_model` on the same modules. --attention picks the kernel of both sides.

Printed last: a table with the runs and the ratio. --json-out: everything, with command and machine.

--combine R1.json R2.json ... joins results of separate invocations (each `--repeats 1` where one
call cannot hold all runs) into one comparison: ratios and loss curves over all their runs. The
results must be of the same command on the same packs, or they are refused.

    # one H200, Qwen3-VL-2B architecture, 16k packs
    python benchmarks/train_speed.py --arch qwen3-vl-2b --seq-len 16384 --samples 400 --recompute auto \\
        --json-out benchmarks/results/train_speed_2b_h200_<yyyymmdd>.json
    # Qwen3-VL-8B, LoRA rank 64 on every language-model linear
    python benchmarks/train_speed.py --arch qwen3-vl-8b --seq-len 16384 --lora-rank 64 --recompute auto
    # CPU smoke (fp32: the loss check is tight)
    python benchmarks/train_speed.py --arch tiny --seq-len 2048 --samples 24 --device cpu
    # two invocations joined: the second reuses the first's shards
    python benchmarks/train_speed.py ... --repeats 1 --out-dir A --json-out r1.json
    python benchmarks/train_speed.py ... --repeats 1 --data-dir A/data --out-dir B --json-out r2.json
    python benchmarks/train_speed.py --combine r1.json r2.json --json-out both.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import multiprocessing as mp
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from queue import Empty

import numpy as np
import torch
from common import T0, log, machine_info, parser, register_fewer_layers, write_json
import hf_baseline
from memory_peak import peak_report, read_snapshot
from synthetic_shards import SyntheticSpec, write_synthetic_shards

from shards_schema import open_shards, verify_shards
from shards_schema.flags import parse_bool
from train.config import ATTENTION_KERNELS, FP8_RECIPES, LOSS_PATHS, RECOMPUTE, STATE_DTYPES
from train.metrics import lm_flops_per_token, peak_tflops
from train.model.arch import builtin_arch
from train.model.attention import resolve_attention_kernel


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser(__doc__, json_out="everything, with the machine and the command (default: OUT_DIR/train_speed.json)")
    ap.add_argument("--arch", default="qwen3-vl-2b", help="builtin architecture (train.model.arch.BUILTIN_ARCHS)")
    ap.add_argument("--layers", type=int, default=None,
                    help="keep only this many decoder layers of --arch (a large model's layers on one GPU)")
    ap.add_argument("--seq-len", type=int, default=16384, help="pack length; also the longest synthetic sample")
    ap.add_argument("--samples", type=int, default=400, help="synthetic samples to write")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic data, the init and the plans")
    ap.add_argument("--steps", type=int, default=6, help="measured training steps of each run (default 6)")
    ap.add_argument("--warmup", type=int, default=None, help="unmeasured first steps of each run; default 3 (CPU: 1)")
    ap.add_argument("--global-batch-packs", type=int, default=None, help="packs per step; default 2 (CPU: 1)")
    ap.add_argument("--recompute", default="none", choices=RECOMPUTE,
                    help="trainer activation recompute (language model; auto: the trainer's choice from its "
                         "memory plan, recorded as the choice); on out-of-memory the run is retried once with "
                         "full unless --no-recompute-fallback")
    ap.add_argument("--gpu-memory-gib", type=float, default=None,
                    help="with --recompute auto: the GPU memory the plan fits the run in (95 %% of it; default: "
                         "this GPU's); HF's peak / 0.95 keeps vlmpack's planned peak at or under HF's")
    ap.add_argument("--no-recompute-fallback", action="store_true",
                    help="on out-of-memory, fail instead of retrying with --recompute full")
    ap.add_argument("--recompute-layers", type=int, default=None,
                    help="with --recompute full: recompute only the first N decoder layers (trainer's flag)")
    ap.add_argument("--recompute-vision", type=parse_bool, default=None,
                    help="redo the vision blocks in backward (trainer's flag; default: with full)")
    ap.add_argument("--recompute-vision-blocks", type=int, default=None,
                    help="with the vision blocks recomputed: only the first N (default all; auto picks it)")
    ap.add_argument("--profile", action="store_true",
                    help="torch.profiler over the last warmup step (the trainer's --profile-start): GPU time by "
                         "kernel kind and the top kernels")
    ap.add_argument("--trace", default=None, metavar="FILE.json.gz",
                    help="with --profile: label the model's parts, save the step's chrome trace here and "
                         "report where the GPU waits for the host (gaps between kernels, by what the host was doing)")
    ap.add_argument("--memory-snapshot", default=None, metavar="FILE.pickle",
                    help="record vlmpack's CUDA allocations through its run (host time per allocation: "
                         "not a speed run) and save the snapshot here; the peak and what held it are "
                         "logged and kept under ours.memory_peak (benchmarks/memory_peak.py)")
    ap.add_argument("--memory-snapshot-stacks", default="python", choices=("python", "none"),
                    help="with --memory-snapshot: record each allocation's Python stack (python: the peak's "
                         "holders named by line), or only its size and order (none: blocks summed by size; "
                         "with torch 2.11, recording stacks fails when compiled layers are recomputed). "
                         "Default python")
    ap.add_argument("--num-workers", type=int, default=2, help="trainer loader workers")
    ap.add_argument("--attention", default="fa2", choices=ATTENTION_KERNELS,
                    help="CUDA attention kernel of both sides (the trainer's flag; auto: fa4 where it runs, else "
                         "fa2, resolved once and recorded; default fa2)")
    ap.add_argument("--loss", default="chunked", choices=LOSS_PATHS, help="trainer's --loss path (default chunked)")
    ap.add_argument("--fp8", default=None, choices=FP8_RECIPES, help="trainer's --fp8 recipe (default: bf16 GEMMs)")
    ap.add_argument("--pad-packs", type=parse_bool, default=None,
                    help="trainer's --pad-packs: pad every pack to --seq-len rows (true/false; default: the "
                         "trainer's, on with --fp8)")
    ap.add_argument("--compile-decoder", type=parse_bool, default=True,
                    help="trainer's --compile-decoder: compile each dense decoder layer (true/false; default true)")
    ap.add_argument("--grad-dtype", default="fp32", choices=STATE_DTYPES, help="trainer's gradient buffers")
    ap.add_argument("--adam-state-dtype", default="fp32", choices=STATE_DTYPES, help="trainer's Adam moments")
    ap.add_argument("--master-weights", default="fp32", choices=STATE_DTYPES,
                    help="trainer's --master-weights: fp32 copy of the bf16 weights, or none (bf16)")
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
                    help="repetitions of the isolated vision cross-check (0: none); default 3 (CPU: 1)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="runs per side, alternating vlmpack and HF, each in a fresh process; default 2 (CPU: 1)")
    ap.add_argument("--skip-hf", action="store_true", help="measure vlmpack only")
    ap.add_argument("--hf-liger", type=parse_bool, default=True,
                    help="HF side: apply every Liger kernel that supports the model (CUDA; default true)")
    ap.add_argument("--hf-master-weights", default="bf16", choices=("bf16", "fp32"),
                    help="HF side: gradients summed and AdamW applied on the bf16 parameters in place (bf16, default), "
                         "or both on fp32 copies of them, as vlmpack's default fp32 master weights and gradient "
                         "buffers (for loss curves that compare like with like)")
    ap.add_argument("--hf-gradient-checkpointing", default="auto", choices=("auto", "true", "false"),
                    help="HF side: transformers' per-layer recompute; auto: only when a step does not fit without "
                         "it (the run is retried with it and the result says so; default auto)")
    ap.add_argument("--out-dir", default=str(Path(tempfile.gettempdir()) / "vlmpack_train_speed"),
                    help="data and training output (default: under the temp dir)")
    ap.add_argument("--combine", nargs="+", default=None, metavar="RESULT.json",
                    help="run nothing: join these results of the same command on the same packs into one "
                         "comparison (ratios and loss curves over all their runs), written to --json-out")
    args = ap.parse_args(argv)
    if args.combine:
        return args
    args.base_arch = args.arch
    if args.layers:
        args.arch = register_fewer_layers(args.arch, args.layers)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cpu = args.device == "cpu"  # smoke runs: the tiny model's 151,936-way loss is slow on a few cores
    for name, gpu_default, cpu_default in (("warmup", 3, 1), ("global_batch_packs", 2, 1), ("vision_reps", 3, 1),
                                           ("repeats", 2, 1)):
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
    """One instrumented training run: a subclass of the trainer that keeps its model and data
    for the cross-check, notes the packs each step consumes and times the vision tower with
    hooks on the model; the step's phases come from the trainer's own metrics and the profile
    from its --profile-start option."""

    def __init__(self, device: torch.device):
        self.clock = Clock(device)
        self.steps: list[dict] = []  # the vision tower's marks, one dict per step
        self.packs: list[tuple[int, int]] = []  # (epoch, pack_index) in consumption order
        self.model = self.data = self.last_batches = None
        self.active = True  # hooks record only while the trainer runs
        self.kernels = None
        self.trace_path: Path | None = None  # with --trace: the profiled step's chrome trace + GPU idle analysis
        self.labels: set[str] = set()  # label_modules' range names (not kernels)
        self.idle = None

    def _cur(self) -> dict:
        return self.steps[-1]

    def train(self, config) -> dict:
        """`train.trainer.train(config)` through a `Trainer` subclass that records what the probe needs."""
        from train.trainer import Trainer

        probe = self

        class ProbedTrainer(Trainer):
            def setup(self):
                super().setup()
                probe.model, probe.data = self.model, self.data
                module = self.model.module
                if module.vision is not None:
                    probe._hook_vision(module.vision)
                if probe.trace_path is not None:
                    probe.labels = label_modules(module)

            def step(self, micro_batches, started):
                probe.steps.append({"vf": [], "ve": [], "vb": [], "vw": [], "vp": []})
                probe.packs += [(int(b.epoch), int(b.pack_index)) for b in micro_batches]  # one pack per micro-batch
                probe.last_batches = micro_batches
                return super().step(micro_batches, started)

        with ProbedTrainer(config) as trainer:
            result = trainer.train()
        if trainer.profiling.profiler is not None:
            self.kernels = kernel_summary(trainer.profiling.profiler, skip=self.labels)
            if self.trace_path is not None:
                self.idle = save_trace(trainer.profiling.traces[-1], self.trace_path)
        return result

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
        """The vision tower's seconds per step (marks of all micro-batches summed); vision_bwd_s
        None when unmeasured."""
        self.clock.sync()
        sec = self.clock.seconds
        out = []
        for s in self.steps:
            vis_f = sum(sec(a, b) for a, b in zip(s["vf"], s["ve"]))
            vis_b = 0.0 if not s["vf"] else None
            ends = [[s[k][i] for k in ("vw", "vp") if len(s[k]) > i] for i in range(len(s["vb"]))]
            if s["vb"] and all(ends):
                vis_b = sum(max(sec(start, end) for end in e) for start, e in zip(s["vb"], ends))
            out.append({"vision_fwd_s": vis_f, "vision_bwd_s": vis_b, "vision_calls": len(s["vf"])})
        return out


KERNEL_KINDS = (  # first match wins; FlashAttention kernel names mention cutlass types, so they go first
    # flash-linear-attention's Gated DeltaNet kernels (its chunked delta rule, gates, conv)
    ("linear attention", ("gated_delta", "gdn_", "chunk_", "solve_tril", "wy_", "kkt", "l2norm", "causal_conv1d",
                          "fused_recurrent", "cumsum_", "recompute_w_u")),
    ("experts (grouped GEMM, dispatch)", ("grouped", "groupproblem", "moe", "permute")),
    ("attention", ("flash", "fmha", "attn")),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "sm80_xmma", "wgmma")),
    ("norm", ("norm",)),
    ("softmax/cross-entropy", ("softmax", "log_softmax", "logsumexp", "nll", "cross_entropy")),
    # Inductor's fused kernels name the ops they fuse: a "cat" or "_to_copy" among them is no copy
    ("fused by Inductor", ("triton_poi_", "triton_red_", "triton_per_")),
    ("copy/cast", ("copy", "memcpy", "memset", "cat", "fill", "index")),
    ("reduce", ("reduce",)),
    ("elementwise", ("elementwise", "vectorized", "triton")),
)


def kernel_kind(name: str) -> str:
    """The KERNEL_KINDS kind of a kernel name (first match), or "other"."""
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(x in low for x in keys)), "other")


def model_flops(arch, lengths: list[int], grids: np.ndarray) -> dict:
    """Training FLOPs (forward + backward = 3 x forward, no recompute) of one step's samples,
    by part: what the model must compute, so FLOPs / (time x peak) is the utilisation of ALL
    of it, where LM MFU counts only the language model's 6 N per token.
    lm_dense: 6 N_lm per token; lm_attention: causal, 2 L^2 (Hq d) per full-attention layer
    forward; lm_linear_attention (Gated DeltaNet layers): per token and layer forward, the state's
    update and readout, 6 Hv dk dv, and the chunk of 64's intra-chunk products, 2 x 64 Hv (dk + dv);
    vision_dense: patch embedding + blocks per patch, mergers (final + DeepStack) per merged
    token; vision_attention: bidirectional 4 S^2 hidden per layer forward, S = the patches of
    a frame (a windowed tower, Qwen2.5-VL's: of a window, on its windowed layers)."""
    from train.model.vision import frame_cu_seqlens, window_order

    lm, v = arch.lm, arch.vision
    lengths = np.asarray(lengths, dtype=np.float64)
    kinds = [lm.layer_type(layer) for layer in range(lm.num_layers)]
    linear = kinds.count("linear_attention")
    state = 6.0 * lm.linear_num_value_heads * lm.linear_key_head_dim * lm.linear_value_head_dim
    chunk = 2.0 * 64 * lm.linear_num_value_heads * (lm.linear_key_head_dim + lm.linear_value_head_dim)
    out = {"lm_dense": 6.0 * arch.lm.num_non_embedding_params() * lengths.sum(),
           "lm_attention": 3.0 * 2.0 * (lengths ** 2).sum() * lm.num_heads * lm.head_dim * kinds.count("full_attention"),
           "lm_linear_attention": 3.0 * (state + chunk) * lengths.sum() * linear,
           "vision_dense": 0.0, "vision_attention": 0.0}
    if len(grids):
        grid = torch.as_tensor(np.asarray(grids), dtype=torch.long).reshape(-1, 3)
        patches = float(grid.prod(1).sum())
        h = v.hidden_size
        with torch.device("meta"):  # a block MLP's multiply-adds per patch: its weight matrices' sizes
            mlp = sum(p.numel() for p in v.variant.mlp(v).parameters() if p.dim() == 2)
        block = 4 * h * h + mlp
        embed = v.in_channels * v.temporal_patch_size * v.patch_size ** 2 * h
        merged = h * v.spatial_merge_size ** 2
        merger = merged * merged + merged * v.out_hidden_size
        out["vision_dense"] = 6.0 * ((v.depth * block + embed) * patches
                                     + (1 + len(v.deepstack_visual_indexes)) * merger * patches / v.spatial_merge_size ** 2)
        full = np.diff(frame_cu_seqlens(grid).numpy()).astype(np.float64)
        per_layer = {"full": (full ** 2).sum()}
        full_layers = v.depth
        if v.fullatt_block_indexes:  # a windowed tower: the other blocks attend within windows
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


def save_trace(trace_file: Path, path: Path) -> dict:
    """The trainer's chrome trace (`trace_file`) saved at `path` (gzip for .gz); its
    `gpu_idle_summary`, with the `kernel_sources` of its kernel time under "kernel_sources"."""
    import gzip

    path.parent.mkdir(parents=True, exist_ok=True)
    trace = json.loads(Path(trace_file).read_text())
    if path.suffix == ".gz":
        with open(trace_file, "rb") as src, gzip.open(path, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
    else:
        shutil.copyfile(trace_file, path)
    return dict(gpu_idle_summary(trace), kernel_sources=kernel_sources(trace))


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


BACKWARD_NODE = "autograd::engine::evaluate_function: "


def kernel_sources(trace: dict, top: int = 100) -> dict:
    """Where a chrome trace's GPU time was launched from: each kernel (memcpy, memset) joined to
    the host ranges open at its launch (the runtime call of the same correlation id), as
    (kind, part, host op, phase). part: the innermost `label_modules` range, its index made
    `*` ("lm.layer* (Gated DeltaNet)", by the kernels the layer runs); a backward kernel runs on
    the autograd thread outside any range and takes the part of the forward op whose autograd
    node it runs: the same sequence number on the thread that made the node (each thread counts
    its own, and a layer recomputed in backward makes its nodes on the autograd thread, so one
    number can name two ops). host op: the outermost aten op open at the launch,
    the one model code called. phase: forward, "backward: <node>", or outside the model. The
    `top` biggest rows of each table."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    ranges: dict = {}
    launches = {}
    kernels = []
    for e in events:
        cat = e.get("cat")
        if cat in ("cpu_op", "user_annotation"):
            ranges.setdefault(e["tid"], []).append(e)
        elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e
        elif cat in GPU_CATS:
            kernels.append(e)

    def is_part(e) -> bool:
        return e.get("cat") == "user_annotation" and re.match(r"(vision|lm)(\.|$)", e["name"]) is not None

    open_at: dict = {}  # correlation id -> the host ranges open at its launch, outermost first
    part_of_node: dict = {}  # (thread, sequence number) -> the part of the forward op that made the node
    for tid, spans in ranges.items():
        points = [(float(e["ts"]), 1, 0.0, c) for c, e in launches.items() if e["tid"] == tid]
        items = sorted([(float(e["ts"]), 0, -float(e["dur"]), i) for i, e in enumerate(spans)] + points)
        stack: list = []
        for ts, is_launch, _, ref in items:
            while stack and float(stack[-1]["ts"]) + float(stack[-1]["dur"]) <= ts:
                stack.pop()
            if is_launch:
                open_at[ref] = tuple(stack)
                continue
            span = spans[ref]
            stack.append(span)
            args = span.get("args", {})
            # a forward op (a recomputed one too) has no forward thread; a node run in backward names its maker's
            if args.get("Sequence number") is not None and not args.get("Fwd thread id") \
                    and (tid, args["Sequence number"]) not in part_of_node:
                parts = [e["name"] for e in stack if is_part(e)]
                part_of_node[(tid, args["Sequence number"])] = parts[-1] if parts else None
    node_part = _node_parts(part_of_node, [e for spans in ranges.values() for e in spans
                                           if e["name"].startswith(BACKWARD_NODE)])

    rows = []
    for k in kernels:
        stack = open_at.get(k.get("args", {}).get("correlation"), ())
        parts = [e["name"] for e in stack if is_part(e)]
        nodes = [e for e in stack if e["name"].startswith(BACKWARD_NODE)]
        ops = [e["name"] for e in stack if e.get("cat") == "cpu_op" and e["name"].startswith("aten::")]
        part = parts[-1] if parts else None
        if nodes:
            phase = "backward: " + nodes[-1]["name"][len(BACKWARD_NODE):].replace("torch::autograd::", "")
            part = part or node_part(nodes[-1])
        else:
            phase = "forward" if part else "outside the model"
        rows.append((kernel_kind(k["name"]), part or "(none)", ops[0] if ops else "(no aten op)", phase,
                     float(k["dur"])))
    layer_kind = {}
    for kind, part, *_ in rows:
        if part.startswith("lm.layer") and kind in ("linear attention", "attention"):
            layer_kind[part] = "Gated DeltaNet" if kind == "linear attention" or layer_kind.get(part) == \
                "Gated DeltaNet" else "attention"

    def grouped(part: str) -> str:
        base = re.sub(r"\d+$", "*", part)
        return f"{base} ({layer_kind[part]})" if part in layer_kind else base

    def ranked(keyed) -> list[dict]:
        table: dict = {}
        for key, us in keyed:
            slot = table.setdefault(key, [0, 0.0])
            slot[0] += 1
            slot[1] += us
        return [{"key": list(key), "kernels": n, "ms": round(us / 1e3, 3)}
                for key, (n, us) in sorted(table.items(), key=lambda kv: -kv[1][1])[:top]]

    rows = [(kind, grouped(part), op, phase, us) for kind, part, op, phase, us in rows]
    return {"gpu_ms": sum(r[-1] for r in rows) / 1e3,
            "by_kind_and_part": ranked(((kind, part), us) for kind, part, _, _, us in rows),
            "by_source": ranked(((kind, part, op, phase), us) for kind, part, op, phase, us in rows)}


def _node_parts(part_of_node: dict, nodes: list[dict]):
    """A function from a backward node's event to the part of the forward op that made it.
    The node names its maker's thread by the profiler's own thread number, not the trace's:
    each number is matched to the trace thread that holds the most of its nodes' sequence
    numbers, which decides the numbers two threads share."""
    threads_of: dict = {}
    for tid, seq in part_of_node:
        threads_of.setdefault(seq, []).append(tid)
    votes: dict = {}
    for node in nodes:
        args = node.get("args", {})
        for tid in threads_of.get(args.get("Sequence number"), ()):
            key = (args.get("Fwd thread id"), tid)
            votes[key] = votes.get(key, 0) + 1
    thread = {}
    for (number, tid), count in sorted(votes.items(), key=lambda kv: -kv[1]):
        thread.setdefault(number, tid)

    def part(node: dict) -> str | None:
        args = node.get("args", {})
        seq = args.get("Sequence number")
        tids = threads_of.get(seq, [])
        tid = tids[0] if len(tids) == 1 else thread.get(args.get("Fwd thread id"))
        return part_of_node.get((tid, seq))

    return part


def log_kernel_sources(sources: dict, top: int = 15) -> None:
    """`kernel_sources`' biggest sources outside the GEMMs and the attention kernels: the time a
    step spends beyond its floor."""
    log(f"  kernel time by source (outside GEMMs and attention), of {sources['gpu_ms']:.1f} ms:")
    floor = ("gemm", "attention", "linear attention")
    for row in [r for r in sources["by_source"] if r["key"][0] not in floor][:top]:
        log(f"    {row['ms']:8.1f} ms {row['kernels']:6d}x  {' | '.join(row['key'])}")


def kernel_summary(prof, top: int = 60, skip: set[str] = frozenset()) -> dict:
    """GPU self time per kernel kind and the top kernels of one profiled step. `skip`: names of
    user ranges (`label_modules`), which the profiler also lists as device-side annotations
    spanning their kernels: counted, they doubled the GPU time of `--trace` runs."""
    kernels = [(e.key, e.self_device_time_total / 1e6, e.count) for e in prof.key_averages()
               if e.self_device_time_total > 0 and e.device_type == torch.autograd.DeviceType.CUDA
               and e.key not in skip]
    by_kind: dict[str, float] = {}
    for name, seconds, _ in kernels:
        kind = kernel_kind(name)
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


# allocations a --memory-snapshot keeps, newest last: more than one step of the largest models makes
MEMORY_SNAPSHOT_ENTRIES = 400_000
# the trainer's recompute settings, which --recompute auto resolves and the arguments then record
RECOMPUTE_KEYS = ("recompute", "recompute_layers", "recompute_vision", "recompute_vision_blocks")


def resolve_auto_recompute(args, data_dir: Path, device: torch.device) -> None:
    """`--recompute auto` resolved as the trainer resolves it, into this process's args: the
    recompute, layers and vision recompute it chose, and its line as `recompute_auto`."""
    from train.config import TrainConfig
    from train.trainer import resolve_arch, resolve_recompute

    config = TrainConfig.from_flat(dict(
        data=[str(data_dir)], arch=args.arch, seq_len=args.seq_len, dry_run=True,
        global_batch_packs=args.global_batch_packs, recompute="auto", recompute_vision=args.recompute_vision,
        grad_dtype=args.grad_dtype, adam_state_dtype=args.adam_state_dtype, master_weights=args.master_weights,
        lora_rank=args.lora_rank, gpu_memory_gib=args.gpu_memory_gib))
    config, args.recompute_auto = resolve_recompute(config, resolve_arch(config.model), cuda=device.type == "cuda")
    memory = config.memory
    for key in RECOMPUTE_KEYS:
        setattr(args, key, getattr(memory, key))
    log(f"ours: {args.recompute_auto}")


def _train_once(args, data_dir: Path, run_dir: Path, recompute: str, device: torch.device):
    """One instrumented `train()`; returns (probe, config, result, wall seconds) or raises."""
    from train.config import TrainConfig

    shutil.rmtree(run_dir, ignore_errors=True)
    config = TrainConfig.from_flat(dict(
        data=[str(data_dir)], out=str(run_dir), hf_model=str(args.init_dir), seq_len=args.seq_len,
        global_batch_packs=args.global_batch_packs, train_steps=args.warmup + args.steps, lr=args.lr,
        recompute=recompute, recompute_layers=args.recompute_layers if recompute == "full" else None,
        recompute_vision=args.recompute_vision, recompute_vision_blocks=args.recompute_vision_blocks,
        device=args.device, num_workers=args.num_workers, tensorboard=False,
        save_every=0, save_final=args.keep_checkpoint, seed=args.seed, log_every=1, attention=args.attention, grad_dtype=args.grad_dtype,
        adam_state_dtype=args.adam_state_dtype, master_weights=args.master_weights, lora_rank=args.lora_rank,
        compile_decoder=args.compile_decoder, loss=args.loss,
        fp8=args.fp8, pad_packs=args.pad_packs,
        # the last unmeasured step: profiling overhead stays out of the figures
        profile_start=args.warmup if args.profile and device.type == "cuda" else 0))
    config.validate()
    probe = TrainerProbe(device)
    memory, model = config.memory, config.model
    if config.profiling.profile_start:
        probe.trace_path = Path(args.trace) if args.trace else None
    log(f"ours: train({args.arch}, seq_len {args.seq_len}, {args.global_batch_packs} packs/step, "
        f"{args.warmup}+{args.steps} steps, recompute {recompute}, layers {memory.recompute_layers}, "
        f"vision {memory.recompute_vision} (blocks {memory.recompute_vision_blocks or 'all'}), attention {model.attention}, "
        f"compiled decoder {model.compile_decoder}, fp8 {model.fp8 or 'off'}, "
        f"packs padded {config.packs_padded()}, grads {memory.grad_dtype}, "
        f"Adam state {memory.adam_state_dtype}, master weights {memory.master_weights}, "
        f"LoRA rank {config.lora.lora_rank}) -> {run_dir}")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    recording = bool(args.memory_snapshot) and device.type == "cuda"
    # the newest allocations: the last steps' at least (a step makes tens of thousands). Python
    # frames only: they name the allocating line, at less host time per allocation than C++ stacks.
    if recording:
        torch.cuda.memory._record_memory_history(
            context="all" if args.memory_snapshot_stacks == "python" else None, stacks="python",
            max_entries=MEMORY_SNAPSHOT_ENTRIES)
    started = time.perf_counter()
    try:
        result = probe.train(config)
    except BaseException:
        probe.active = False
        _release(probe, device)
        raise
    finally:
        if recording:
            torch.cuda.memory._dump_snapshot(args.memory_snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
    return probe, config, result, time.perf_counter() - started


def run_ours(args, data_dir: Path, run_dir: Path) -> dict:
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
        recompute, args.recompute_vision_blocks = "full", None  # every layer and vision block
    timings = probe.step_timings()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]

    probe.active = False
    vision_check = isolated_vision(probe, args, device, timings[-1] if timings else {})
    plans = {}
    pack_samples: list[list[int]] = []  # the shard rows of each pack, in the order they were trained on
    for epoch, pack in probe.packs:
        if epoch not in plans:
            plans[epoch] = probe.data.loader.plan(epoch)
        sources, indices = plans[epoch].pack_samples(pack)
        pack_samples.append([int(i) for s, i in zip(sources.tolist(), indices.tolist()) if s == 0])
    step_samples = [sum(pack_samples[k:k + args.global_batch_packs], [])
                    for k in range(0, len(pack_samples), args.global_batch_packs)]
    shards = open_shards(data_dir)
    arch = builtin_arch(args.arch)
    step_flops = []
    for chosen in step_samples:
        rows = [shards[i] for i in chosen]
        grids = np.concatenate([r[k] for r in rows for k in ("image_grid_thw", "video_grid_thw")]) if rows else np.zeros((0, 3))
        step_flops.append(model_flops(arch, [len(r["input_ids"]) for r in rows], grids))
    skipped = 0 if args.keep_checkpoint else 1  # the final save, turned off (--save-final false)
    _release(probe, device)

    n_lm = lm_flops_per_token(arch)
    peak = peak_tflops(device) * 1e12
    measured = [dict(r, **t) for r, t in zip(records, timings)][args.warmup:]
    flops = {k: sum(f[k] for f in step_flops[args.warmup:]) for k in step_flops[0]}
    total_tokens = sum(r["tokens"] for r in measured)
    total_s = sum(r["step_seconds"] for r in measured)
    tps = float(np.median([r["tokens"] / r["step_seconds"] for r in measured]))  # the median step

    def total(key):
        values = [r[key] for r in measured]
        return None if any(v is None for v in values) else sum(values)

    fb, opt, vf, vb = total("fwd_bwd_s"), total("optimizer_s"), total("vision_fwd_s"), total("vision_bwd_s")
    summary = {
        "steps_measured": len(measured),
        "tokens_per_step_mean": total_tokens / len(measured),
        "target_tokens_per_step_mean": sum(r["target_tokens"] for r in measured) / len(measured),
        "tokens_per_s": tps,
        "tokens_per_s_method": "median over the measured steps of the step's real tokens / its wall time",
        "tokens_per_s_mean": total_tokens / total_s,
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
        "data_wait_s_mean": sum(r["data_wait_s"] for r in measured) / len(measured),
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
        "packs_consumed": len(pack_samples),
        "recompute_layers": config.memory.recompute_layers,
        "recompute_vision": config.memory.recompute_vision,
        "recompute_vision_blocks": config.memory.recompute_vision_blocks,
        "attention": config.model.attention,
        "grad_dtype": config.memory.grad_dtype,
        "adam_state_dtype": config.memory.adam_state_dtype,
        "master_weights": config.memory.master_weights,
        "kernels": probe.kernels,
        "gpu_idle": probe.idle,
        "memory_peak": peak_report(read_snapshot(args.memory_snapshot)) if args.memory_snapshot and device.type == "cuda" else None,
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
        log_kernel_sources(idle["kernel_sources"])
    if summary["memory_peak"]:
        held = summary["memory_peak"]
        log(f"ours: recorded allocation peak {held['peak_gib']:.2f} GiB; held by:")
        for row in held["rows"][:25]:
            log(f"    {row['gib']:8.3f} GiB  {row['site']}")
    log("ours: model FLOPs per step " + ", ".join(f"{k} {v:.1f} TFLOP" for k, v in summary["model_tflop_per_step"].items())
        + f"; all-parts utilisation {fmt_pct(summary['model_flops_utilization'])}")
    log(f"ours: {tps:,.0f} tok/s, MFU {fmt_pct(summary['lm_mfu'])}, step {summary['step_s_mean']:.3f} s "
        f"(fwd+bwd {fmt_s(summary['fwd_bwd_s_mean'])}, optimizer {fmt_s(summary['optimizer_s_mean'])}), "
        f"vision {fmt_pct(summary['vision_share_of_step'])} of the step, peak {fmt_gib(summary['peak_memory_gib'])}, "
        f"allocator retries {summary['alloc_retries_measured']}")
    return {"summary": summary, "steps": [dict(r, **t) for r, t in zip(records, timings)],
            "trainer_result": result, "config": config.to_flat(),
            "recompute_auto": getattr(args, "recompute_auto", None), "packs": pack_samples}


def isolated_vision(probe: TrainerProbe, args, device: torch.device, in_step: dict) -> dict | None:
    """The last step's micro-batches through the vision tower alone, forward + backward."""
    model, data, batches = probe.model, probe.data, probe.last_batches
    if model is None or not batches or args.vision_reps < 1:
        return None
    tower = model.module.vision if hasattr(model, "module") else model.vision
    if not any(p.requires_grad for p in tower.parameters()):  # frozen (LoRA on the language model): no backward
        return None
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    clock = probe.clock
    work = []
    for b in batches:  # images and videos in one tower call, as the model makes it
        parts = [(values, grid) for values, grid in ((data.pixel_values(b, dtype), b.image_grid_thw),
                                                     (data.pixel_values_videos(b, dtype), b.video_grid_thw))
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


def make_init_checkpoint(args, arch, out: Path) -> dict:
    """The random weights both sides start from, as an HF checkpoint directory."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    hf_baseline.write_init_checkpoint(arch, out, args.seed, dtype, device)
    log(f"init: random {arch.hf_architecture} weights ({dtype}) -> {out} in {time.perf_counter() - t0:.1f} s")
    return {"dir": str(out), "dtype": str(dtype), "seconds": time.perf_counter() - t0}


def run_hf(args, arch, data_dir: Path, packs: list[list[int]], gradient_checkpointing: bool) -> dict:
    """`hf_baseline.HFPackedTrainer` on `packs` (shard rows per pack, the trainer's order), as
    --warmup + --steps global batches of --global-batch-packs packs."""
    from train.model.attention import select_attention_kernel
    from train.trainer import is_out_of_memory

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        select_attention_kernel(args.attention)  # the same kernel as vlmpack's side
        torch.cuda.reset_peak_memory_stats()
    shards = open_shards(data_dir)
    collated = [hf_baseline.collate_pack([shards[i] for i in pack]) for pack in packs]  # before any clock
    n = args.global_batch_packs
    steps = [collated[k:k + n] for k in range(0, len(collated), n)][:args.warmup + args.steps]
    recipe = hf_baseline.Recipe(lr=args.lr, liger=args.hf_liger, gradient_checkpointing=gradient_checkpointing,
                                lora_rank=args.lora_rank, master_weights=args.hf_master_weights,
                                train_steps=args.warmup + args.steps)  # vlmpack's schedule: cosine to 0, no warm-up
    trainer = hf_baseline.HFPackedTrainer(arch, Path(args.init_dir), shards.manifest["profile"], recipe, device)
    log(f"HF: {arch.hf_architecture}, {trainer.num_params:,} trained parameters, attention "
        f"{hf_baseline.ATTENTION} ({args.attention if cuda else 'masked, CPU'}), gradient checkpointing "
        f"{gradient_checkpointing}, Liger: {trainer.liger.function or trainer.liger.reason} {trainer.liger.modules} "
        f"{trainer.liger.functions}")
    result = {"recipe": dataclasses.asdict(recipe), "liger": dataclasses.asdict(trainer.liger),
              "attention": args.attention if cuda else "masked (CPU)", "trained_params": trainer.num_params,
              "gradient_checkpointing": gradient_checkpointing,
              "experts_implementation": getattr(trainer.model.config.get_text_config(), "_experts_implementation", None)}
    try:
        records = hf_baseline.timed_steps(trainer, steps, args.warmup, log)
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if not is_out_of_memory(exc):
            raise
        return {**result, "error": f"out of memory: {str(exc).splitlines()[0][:200]}"}
    measured = [r for r in records if not r["warmup"]]
    tps = float(np.median([r["tokens_per_s"] for r in measured]))
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    peak_flops = peak_tflops(device) * 1e12
    result.update({
        "steps": records, "steps_measured": len(measured), "tokens_per_s": tps,
        "tokens_per_s_mean": sum(r["tokens"] for r in measured) / sum(r["step_seconds"] for r in measured),
        "lm_mfu": tps * lm_flops_per_token(arch) / peak_flops if peak_flops else None,
        "step_s_median": float(np.median([r["step_seconds"] for r in measured])),
        "peak_memory_gib": peak, "loss_first": records[0]["loss"], "loss_last": records[-1]["loss"],
    })
    log(f"HF: {tps:,.0f} tok/s (median step), MFU {fmt_pct(result['lm_mfu'])}, peak {fmt_gib(peak)}")
    return result


def run_hf_fitting(args, arch, data_dir: Path, packs: list[list[int]]) -> dict:
    """run_hf in a fresh process; with --hf-gradient-checkpointing auto, once more with
    checkpointing if it ran out of memory without."""
    first = args.hf_gradient_checkpointing == "true"
    result = isolated(run_hf, args, arch, data_dir, packs, first)
    if "error" in result and args.hf_gradient_checkpointing == "auto" and not first:
        log(f"HF: {result['error']}; again with gradient checkpointing")
        result = {**isolated(run_hf, args, arch, data_dir, packs, True), "without_checkpointing": result["error"]}
    return result


TOLERANCE = {"cpu": ("absolute", 1e-4), "cuda": ("relative", 5e-3)}


def loss_check(ours: dict, hf: dict, device: str) -> dict:
    """Both sides' step-1 loss (same weights, same packs): equal within the precision's noise."""
    a, b = ours["summary"]["loss_first"], hf["loss_first"]
    kind, limit = TOLERANCE[device]
    diff = abs(a - b) if kind == "absolute" else abs(a - b) / abs(a)
    return {"vlmpack": a, "hf": b, kind + "_difference": diff, "limit": limit, "ok": diff <= limit}


# ------------------------------------------------------------------------------------------ report


def curve_check(repeats: list[dict]) -> dict | None:
    """Step-by-step loss curves of every run (warm-up steps included: all start from the same
    weights on the same packs): how far vlmpack's curves lie from HF's, against how far HF's
    own runs lie from each other (its run-to-run spread: atomics in the attention and GDN
    backward make no two runs equal).

    Every |loss difference| of every pair of runs at every step is pooled, and their median
    compared: two runs per side give four vlmpack-HF pairs but one HF-HF pair, so a per-step
    largest over pairs would judge four draws against one and call equal curves apart. The
    largest over the pool is reported too; it grows with the pool's size. `per_step` is each
    step's mean over pairs, for reading."""
    ours = [[s["loss"] for s in r["ours"]["steps"]] for r in repeats]
    hf = [[s["loss"] for s in r["hf"]["steps"]] for r in repeats if "hf" in r and "error" not in r["hf"]]
    if len(hf) < 2:
        return None
    steps = min(len(c) for c in ours + hf)

    def spread(pairs) -> dict:
        diffs = np.array([[abs(a[s] - b[s]) for s in range(steps)] for a, b in pairs])
        return {"pairs": len(pairs), "median": float(np.median(diffs)), "max": float(diffs.max()),
                "per_step": diffs.mean(axis=0).tolist()}

    across = spread([(a, b) for a in ours for b in hf])
    within_hf = spread(list(itertools.combinations(hf, 2)))
    within_ours = spread(list(itertools.combinations(ours, 2)))
    return {"steps": steps, "vlmpack_vs_hf": across, "hf_vs_hf": within_hf, "vlmpack_vs_vlmpack": within_ours,
            "within_hf_spread": across["median"] <= within_hf["median"],
            "method": "median and largest |loss difference| over every step of every pair of runs"}


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


def side_summary(runs: list[dict], key: str = "tokens_per_s") -> dict:
    values = [r[key] for r in runs]
    return {"runs": values, "mean": float(np.mean(values)), "min": min(values), "max": max(values)}


def compare(repeats: list[dict]) -> dict:
    """vlmpack against HF over the alternating runs: the mean ratio and its spread (the least and
    largest ratio of any vlmpack run to any HF run), and the same for peak memory."""
    ours = [r["ours"]["summary"] for r in repeats]
    hf = [r["hf"] for r in repeats if "hf" in r and "error" not in r["hf"]]
    if not hf:
        return {}
    out = {}
    for key in ("tokens_per_s", "peak_memory_gib"):
        if any(r[key] is None for r in ours + hf):  # peak memory on CPU
            continue
        a, b = side_summary(ours, key), side_summary(hf, key)
        if a["mean"] and b["mean"]:
            out[key] = {"vlmpack": a, "hf": b, "ratio": a["mean"] / b["mean"],
                        "ratio_spread": [a["min"] / b["max"], a["max"] / b["min"]]}
    step_by_step = per_step_ratios(repeats)
    if step_by_step:
        out["per_step"] = step_by_step
    return out


def per_step_ratios(repeats: list[dict]) -> dict | None:
    """vlmpack against HF step by step. Both sides train the same packs in the same order, so a
    measured step's HF time over vlmpack's compares like with like; the median over every
    step of every pair of runs stands up to steps where one side alone stalls (a Triton
    autotune or a recompile inside a measured step: with two such steps of six, the median
    step of a run is itself a stalled one's neighbour). `pair_medians`: each pair's median."""
    ours = [r["ours"]["steps"] for r in repeats]
    hf = [r["hf"]["steps"] for r in repeats if "hf" in r and "error" not in r["hf"]]
    if not hf:
        return None
    pairs = []
    for a in ours:
        mine = {s["step"]: s["step_seconds"] for s in a}
        for b in hf:
            ratios = [s["step_seconds"] / mine[s["step"]] for s in b if not s.get("warmup") and mine.get(s["step"])]
            if ratios:
                pairs.append(ratios)
    if not pairs:
        return None
    return {"median": float(np.median(np.concatenate(pairs))), "pairs": len(pairs), "steps": len(pairs[0]),
            "pair_medians": [float(np.median(r)) for r in pairs],
            "largest_step_ratio": float(max(max(r) for r in pairs)),
            "method": "HF's step time / vlmpack's on the same packs, every measured step of every pair of runs; "
                      "the median of them all"}


def print_table(res: dict) -> None:
    arch = res["args"]["arch"]
    device = res["machine"].get("device") or "cpu"
    first_hf = next((r["hf"] for r in res["repeats"] if "hf" in r), None)
    print(f"\n{arch} on {device}, {res['args']['global_batch_packs']} x {res['args']['seq_len']} packs per step, "
          f"attention {res['args']['attention']}", flush=True)
    if first_hf:
        liger = first_hf["liger"]
        print(f"HF recipe: packed (padding-free), varlen attention, gradient checkpointing "
              f"{first_hf['gradient_checkpointing']}, Liger {liger['function'] or '-'} "
              f"({', '.join(f'{k} x{v}' for k, v in liger['modules'].items()) or liger['reason']}; "
              f"{', '.join(liger['functions'])}"
              f"{'; ' + liger['implementation'] + ' kernels' if liger.get('implementation') else ''})")
    widths = [10, 16, 12, 12, 12]
    print("".join(h.ljust(w) for h, w in zip(("run", "side", "tokens/s", "peak GiB", "step 1 loss"), widths)))
    for i, rep in enumerate(res["repeats"], 1):
        ours = rep["ours"]["summary"]
        print("".join(str(c).ljust(w) for c, w in zip(
            (i, "vlmpack", f"{ours['tokens_per_s']:,.0f}", fmt_gib(ours["peak_memory_gib"]), f"{ours['loss_first']:.5f}"),
            widths)))
        hf = rep.get("hf")
        if hf and "error" in hf:
            print("".join(str(c).ljust(w) for c, w in zip((i, "HF", hf["error"][:60]), widths)))
        elif hf:
            print("".join(str(c).ljust(w) for c, w in zip(
                (i, "HF", f"{hf['tokens_per_s']:,.0f}", fmt_gib(hf["peak_memory_gib"]), f"{hf['loss_first']:.5f}"),
                widths)))
    ratios = res.get("ratios") or {}
    for key, label in (("tokens_per_s", "tokens/s"), ("peak_memory_gib", "peak memory")):
        if key in ratios:
            r = ratios[key]
            print(f"vlmpack / HF {label}: {r['ratio']:.2f}x ({r['ratio_spread'][0]:.2f}-{r['ratio_spread'][1]:.2f}x)")
    if "per_step" in ratios:
        r = ratios["per_step"]
        print(f"vlmpack / HF step by step on the same packs: median {r['median']:.2f}x over {r['steps']} steps x "
              f"{r['pairs']} pairs (pairs {min(r['pair_medians']):.2f}-{max(r['pair_medians']):.2f}x, largest step "
              f"{r['largest_step_ratio']:.2f}x)")
    if res.get("curves"):
        c = res["curves"]
        print(f"loss curves over {c['steps']} steps, median (largest) |difference| over steps and pairs: vlmpack vs HF "
              f"{c['vlmpack_vs_hf']['median']:.4f} ({c['vlmpack_vs_hf']['max']:.4f}), HF vs HF "
              f"{c['hf_vs_hf']['median']:.4f} ({c['hf_vs_hf']['max']:.4f}), vlmpack vs vlmpack "
              f"{c['vlmpack_vs_vlmpack']['median']:.4f} ({c['vlmpack_vs_vlmpack']['max']:.4f})", flush=True)
    if res.get("loss_check"):
        c = res["loss_check"]
        print(f"step-1 loss check: {'ok' if c['ok'] else 'FAILED'} ({c})", flush=True)


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
    while True:  # a child killed outright (the host's out-of-memory killer) sends nothing: never wait on it
        try:
            status, value = queue.get(timeout=5)
            break
        except Empty:
            if not proc.is_alive():
                code = proc.exitcode
                why = f"killed by signal {-code}" + (" (SIGKILL: out of host memory?)" if code == -9 else "") \
                    if code < 0 else f"exit code {code}"
                raise SystemExit(f"{fn.__name__} failed: its process ended without a result ({why})") from None
    proc.join()
    if status != "ok":
        raise SystemExit(f"{fn.__name__} failed: {value}")
    return value


# what may differ between invocations that are joined: where they wrote, and how many runs each made
COMBINE_FREE_ARGS = {"json_out", "out_dir", "data_dir", "repeats", "init_dir", "combine"}


def combine(paths: list[str]) -> dict:
    """Results of separate invocations as one comparison. Refused unless every result ran the
    same command (up to COMBINE_FREE_ARGS) on the same packs in the same order. An option that
    a result's version did not have yet counts as its default there."""
    results = [json.loads(Path(p).read_text()) for p in paths]
    first = results[0]
    defaults = vars(parse_args([]))
    for path, res in zip(paths[1:], results[1:]):
        differ = sorted(k for k in set(first["args"]) | set(res["args"])
                        if k not in COMBINE_FREE_ARGS
                        and first["args"].get(k, defaults.get(k)) != res["args"].get(k, defaults.get(k)))
        if differ:
            raise SystemExit(f"error: {path} ran another command than {paths[0]} (differs in: {', '.join(differ)})")
        packs = [r["ours"]["packs"] for r in first["repeats"] + res["repeats"]]
        if any(p != packs[0] for p in packs):
            raise SystemExit(f"error: {path} trained on other packs than {paths[0]}: pass the first run's "
                             "shards with --data-dir")
    repeats = [r for res in results for r in res["repeats"]]
    return {"runs": results, "ratios": compare(repeats), "curves": curve_check(repeats)}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.combine:
        res = combine(args.combine)
        json_out = Path(args.json_out or "train_speed_combined.json")
        write_json(json_out, res)
        log(f"wrote {json_out}")
        print_table({**res["runs"][0], "repeats": [r for run in res["runs"] for r in run["repeats"]],
                     "ratios": res["ratios"], "curves": res["curves"]})
        return 0
    # what `train()` sets for itself; here the child touches CUDA before calling it
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    device = torch.device(args.device)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_out = Path(args.json_out) if args.json_out else out_dir / "train_speed.json"
    arch = builtin_arch(args.arch)
    if device.type == "cuda":  # both sides run, and the result names, the kernel auto picks on this machine
        args.attention = resolve_attention_kernel(args.attention)
    res = {"args": vars(args), "machine": machine(device), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
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

    # Each run in a process of its own: none inherits another's allocator cache or megatron's
    # global state, so every peak starts from an empty GPU.
    args.init_dir = str(out_dir / "init")
    shutil.rmtree(args.init_dir, ignore_errors=True)
    res["init"] = isolated(make_init_checkpoint, args, arch, Path(args.init_dir))
    res["repeats"] = []
    for repeat in range(args.repeats):
        ours = isolated(run_ours, args, data_dir, out_dir / "ours")
        if ours["recompute_auto"]:  # the arguments record what auto chose (the line says it was auto)
            for key in RECOMPUTE_KEYS:
                setattr(args, key, ours["config"][key])
            args.recompute_auto = ours["recompute_auto"]
        args.profile = False  # the profile is of the first run only
        run = {"ours": ours}
        if not args.skip_hf:
            run["hf"] = run_hf_fitting(args, arch, data_dir, ours["packs"])
            if "without_checkpointing" in run["hf"]:  # found once: later repeats start with checkpointing
                args.hf_gradient_checkpointing = "true"
            if repeat == 0 and "error" not in run["hf"]:
                res["loss_check"] = loss_check(ours, run["hf"], device.type)
        res["repeats"].append(run)
        write_json(json_out, res)  # what is measured so far survives a later failure
    res["ratios"] = compare(res["repeats"])
    res["curves"] = curve_check(res["repeats"])
    res["total_s"] = time.perf_counter() - T0
    write_json(json_out, res)
    log(f"wrote {json_out}")
    print_table(res)
    return 0 if res.get("loss_check", {"ok": True})["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
