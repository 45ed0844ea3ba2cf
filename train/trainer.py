"""`vlmpack train`: the training job, top to bottom (`Trainer`).

    setup:  process groups -> lock --out -> packed loader -> model (HF import / Megatron dir /
            random arch, `train.model_setup`) -> freeze (LoRA: adapters on the frozen model) ->
            megatron DDP -> optimizer + LR schedule -> resume
    loop:   global batch of packs -> megatron forward/backward schedule (PP-aware) ->
            per-token loss over the whole global batch -> clip -> step -> save (snapshot here,
            files written in the background, see train.checkpoint.CheckpointSaver) -> log;
            profiled steps and memory snapshots as the profiling settings ask (`train.profiling`)

Launch with `torchrun --nproc-per-node N -m train.trainer ...` or `vlmpack train ...` (one
process per GPU). The loop reads only shards (token ids, positions, uint8 patches): no
tokenizer, chat template, PIL or image processor is imported in this process.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.pipeline_parallel import get_forward_backward_func

from shards_schema.errors import (EXIT_FAULT, EXIT_INTERRUPTED, EXIT_OK, EXIT_OUT_OF_GPU_MEMORY, EXIT_USER_ERROR,
                                  UserError)
from shards_schema.outdir import exclusive_output_dir, outermost_missing, remove_made_parents
from shards_schema.reader import ShardFault, file_fault
from shards_schema.storage import is_url
from shards_schema.webdataset.reader import WebDatasetShards
from train import adapter_format, checkpoint, convert, memory_plan, model_setup
from train.config import (AdamWConfig, ConfigError, DataConfig, MemoryConfig, ParallelismConfig, ScheduleConfig,
                          TrainConfig)
from train.data import TrainData, check_sources
from train.lr_schedule import RunSchedule
from train.metrics import METRICS_FILE, MetricsLogger, StepTimer, lm_flops_per_token, peak_tflops
from train.model.arch import ModelArch
from train.model.linear import fp8_weight_scales_once, grad_buffers_zeroed, use_fp8, use_grad_buffers
from train.optim import build_optimizer as make_optimizer, use_fused_adamw
from train.model import gated_delta_net, lora
from train.model.moe import load_balancing_loss
from train.model_setup import resolve_arch
from train.pack_plan import is_webdataset_export, parse_source, resolve_weights, source_manifest
from train.pack_plan.plan import distinct_source_manifests
from train.parallel import ParallelInfo, destroy_parallel, finalize_grads, init_parallel
from train.preemption import StopRequest
from train.profiling import Profiling
from train.remote_data import localize_sources


def check_layout(arch: ModelArch, config: TrainConfig) -> None:
    """The run's settings against the architecture: the layout, recompute, LoRA, packs."""
    lm = arch.lm
    tp, pp, ep = config.parallelism.tp, config.parallelism.pp, config.parallelism.ep
    if lm.num_heads % tp or lm.num_kv_heads % tp:
        raise ConfigError(f"--tp {tp} must divide the attention heads ({lm.num_heads}) and the KV heads "
                          f"({lm.num_kv_heads}) of {arch.family}")
    if lm.num_layers % pp:
        raise ConfigError(f"--pp {pp} must divide the {lm.num_layers} decoder layers")
    if arch.num_deepstack > lm.num_layers // pp:
        raise ConfigError(f"DeepStack adds vision features after decoder layers 0..{arch.num_deepstack - 1}, which must "
                          f"all be on pipeline stage 0, but --pp {pp} puts only {lm.num_layers // pp} "
                          f"layers there; use --pp <= {lm.num_layers // arch.num_deepstack}")
    if config.model.loss == "fused" and tp > 1:
        raise ConfigError(f"--loss fused makes the loss over the whole vocabulary on one GPU; with --tp {tp} each "
                          "rank holds a part of it: drop --loss fused (chunked is the default)")
    if ep > 1 and not lm.is_moe:
        raise ConfigError(f"--ep {ep}: expert parallelism needs a Mixture-of-Experts model; {arch.family} "
                          "here is dense")
    if config.model.moe_aux_loss_coef and not lm.is_moe:
        raise ConfigError(f"--moe-aux-loss-coef {config.model.moe_aux_loss_coef:g} weighs a Mixture-of-Experts router's "
                          f"load-balancing loss; {arch.family} here is dense and has no router: drop the flag")
    if ep > 1 and lm.num_experts % ep:
        raise ConfigError(f"--ep {ep} must divide the {lm.num_experts} experts")
    try:  # the widths every TP rank holds an equal part of (`convert.shard`)
        convert.check_parallel(arch, tp, pp, ep)
    except ValueError as exc:
        raise ConfigError(f"--tp {tp} cannot split {arch.family}: {exc}") from None
    per_stage, recompute_layers = lm.num_layers // pp, config.memory.recompute_layers
    if recompute_layers is not None and recompute_layers > per_stage:
        raise ConfigError(f"--recompute-layers {recompute_layers}: each pipeline stage has {per_stage} decoder "
                          f"layers; give at most {per_stage}, or drop the flag to recompute all of them")
    vision_blocks = config.memory.recompute_vision_blocks
    if vision_blocks is not None and vision_blocks > arch.vision.depth:
        raise ConfigError(f"--recompute-vision-blocks {vision_blocks}: {arch.family}'s vision tower has "
                          f"{arch.vision.depth} blocks; give at most {arch.vision.depth}, or drop the flag to recompute "
                          "all of them")
    spec = config.lora.spec()
    if spec is not None:
        try:
            sites = lora.resolve_sites(arch, spec)
            if config.lora.init_lora:
                adapter_format.check_peft_config(config.lora.init_lora, spec)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        widest = max(min(s.in_features, s.out_features) for s in sites)
        if spec.rank > widest:
            raise ConfigError(f"--lora-rank {spec.rank}: an adapter B @ A has rank at most min(in, out) of its layer, "
                              f"{widest} at most among the adapted ones; give --lora-rank <= {widest}")
    if lm.is_moe and tp > 1 and config.parallelism.sequence_parallel is False:
        raise ConfigError(f"--tp {tp} with a Mixture-of-Experts model needs sequence parallelism (megatron-core's "
                          "MoE layers train under tensor parallelism only with it); drop --sequence-parallel false")
    if sequence_parallel(arch, config.parallelism) and config.packs_padded() and config.data.seq_len % tp:
        raise ConfigError(f"--seq-len {config.data.seq_len} must be a multiple of --tp {tp} with sequence parallelism "
                          "and packs padded to --seq-len (--pp > 1, --fp8 or --pad-packs), which the TP ranks split "
                          "evenly")


def sequence_parallel(arch: ModelArch, config: ParallelismConfig) -> bool:
    """Whether the run splits the rows over the TP ranks (`--sequence-parallel` of the
    parallelism section `config`; default: MoE models)."""
    if config.tp == 1:
        return False
    return arch.lm.is_moe if config.sequence_parallel is None else config.sequence_parallel


def build_optimizer(config: AdamWConfig, memory: MemoryConfig, model, cuda: bool, use_distributed: bool, bf16: bool):
    """The optimizer of the optimizer section `config`, its Adam moments and master weights as
    the memory section's --adam-state-dtype and --master-weights say."""
    opt_config = OptimizerConfig(
        optimizer="adam", lr=config.lr, min_lr=config.min_lr, weight_decay=config.weight_decay,
        adam_beta1=config.adam_beta1, adam_beta2=config.adam_beta2, adam_eps=config.adam_eps,
        clip_grad=config.clip_grad, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=use_distributed)
    return make_optimizer(model, opt_config, cuda, memory.adam_state_dtype, master_weights=memory.master_weights)


def build_scheduler(optimizer, config: AdamWConfig, schedule: ScheduleConfig) -> RunSchedule:
    """The learning-rate and weight-decay schedule: the optimizer section's rates over the
    schedule section's steps (linear warm-up, then cosine decay)."""
    return RunSchedule(
        optimizer, init_lr=0.0 if schedule.warmup_steps else config.lr, max_lr=config.lr, min_lr=config.min_lr,
        lr_warmup_steps=schedule.warmup_steps, lr_decay_steps=schedule.train_steps, lr_decay_style="cosine",
        start_wd=config.weight_decay, end_wd=config.weight_decay, wd_incr_steps=schedule.train_steps,
        wd_incr_style="constant")


def make_forward_step(data: TrainData, dtype: torch.dtype):
    """megatron schedule callback: one micro-batch (one packed row) through this stage."""

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        pixel_values = data.pixel_values(batch, dtype)
        per_token = model(batch, pixel_values=pixel_values, pixel_values_videos=data.pixel_values_videos(batch, dtype))

        def loss_func(output):
            # Sum, not mean: megatron divides all gradients by the global batch's target-token
            # count (calculate_per_token_loss), so every target token weighs the same.
            loss_sum = output.sum()
            num_tokens = batch.loss_mask.sum().to(torch.int)
            return loss_sum, num_tokens, {"loss": torch.stack([loss_sum.detach().float(), num_tokens.float()])}

        return per_token, loss_func

    return forward_step


def reduce_loss(losses: list[dict], info: ParallelInfo, stop: StopRequest | None = None,
                save_progress: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> tuple[float, int, str | None, tuple]:
    """(mean loss per target token, target tokens, the stop any rank was asked for, the ranks'
    checkpoint-writing progress summed) of the global batch, on every rank: the stop request
    (None, "preempt", or "interrupt" where any rank got Ctrl-C) and the background save's
    progress ride the loss's all-reduce (one collective a step)."""
    total = torch.zeros(7, dtype=torch.float64, device=info.device)
    if info.last_stage and info.tp_rank == 0:
        for item in losses:
            total[:2] += item["loss"].to(torch.float64)
    if stop is not None:
        total[2], total[3] = float(stop.requested), float(stop.interrupted)
    total[4:] = torch.tensor(save_progress, dtype=torch.float64)
    dist.all_reduce(total)
    loss, target_tokens, stops, interrupts, *progress = total.tolist()
    kind = "interrupt" if interrupts else "preempt" if stops else None
    return loss / max(target_tokens, 1.0), int(target_tokens), kind, tuple(progress)


def run_global_batch(model, micro_batches: list[dict], forward_step, seq_length: int, pp: int,
                     forward_only: bool) -> list[dict]:
    """Forward (and backward) of this rank's micro-batches; gradients end up summed over the
    data-parallel group and divided by the global batch's target-token count.

    Without pipeline parallelism this is a plain loop (it runs on CPU too; megatron's
    schedules allocate on "cuda"); with it, megatron's 1F1B schedule."""
    if pp > 1:
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=model,
            num_microbatches=len(micro_batches), seq_length=seq_length, micro_batch_size=1,
            forward_only=forward_only)
    reports, num_tokens = [], 0
    for batch in micro_batches:
        output, loss_func = forward_step(iter([batch]), model)
        loss_sum, tokens, report = loss_func(output)
        if not forward_only:
            loss_sum.backward()
        reports.append(report)
        num_tokens += tokens
    if not forward_only:
        finalize_grads([model], num_tokens=torch.as_tensor(num_tokens, device=loss_sum.device))
    return reports


def evaluate(model, data: TrainData, forward_step, seq_length: int, info: ParallelInfo) -> tuple[float, int]:
    model.eval()
    losses = []
    with torch.no_grad(), fp8_weight_scales_once(model):  # the weights stay as they are for the whole evaluation
        for micro_batches in data.eval_batches():
            losses += run_global_batch(model, micro_batches, forward_step, seq_length, info.pp, forward_only=True)
    model.train()
    loss, target_tokens, _, _ = reduce_loss(losses, info)
    return loss, target_tokens


@contextmanager
def inputs_checked():
    """Setup reads the user's inputs (shard directories, model directories, checkpoints): a
    ValueError or missing file there is a fault of those inputs, reported as one line."""
    try:
        yield
    except (ValueError, FileNotFoundError, NotADirectoryError) as exc:
        if isinstance(exc, UserError):
            raise
        raise UserError(str(exc)) from None


def lock_output_dir(stack: ExitStack, out: Path, info: ParallelInfo) -> None:
    """The main rank holds --out for the whole run (a second job on it fails naming this one);
    every rank fails alike when it cannot."""
    error = None
    if info.is_main:
        try:
            stack.enter_context(exclusive_output_dir(out, "train"))
        except UserError as exc:
            error = str(exc)
    message = [error]
    dist.broadcast_object_list(message, src=0)
    if message[0] is not None:
        raise UserError(message[0])


def remove_refused_run(out: Path, top: Path | None) -> None:
    """What a refused run wrote into its new (or empty) --out, but the shards it fetched from a
    store (data_cache/): a second try finds them checked and fetches nothing. An empty directory
    the user gave stays; one the run made goes once empty, with the parents it made for it
    (`top`: the outermost directory of --out that did not exist, `outdir.outermost_missing`)."""
    if not out.is_dir():
        return
    for entry in out.iterdir():
        if entry.name == "data_cache":
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    if top is not None and not any(out.iterdir()):
        out.rmdir()
        remove_made_parents(out, top)


def only_setup_written(out: Path) -> bool:
    """Whether --out holds nothing a run writes once it has trained: no metrics record, no
    checkpoint (not even one being written), no profiler trace."""
    metrics = out / METRICS_FILE
    if metrics.is_file() and metrics.stat().st_size:
        return False
    return not any(any((out / name).iterdir()) for name in (checkpoint.CHECKPOINTS, "profile")
                   if (out / name).is_dir())


def check_device(config: ParallelismConfig) -> None:
    """The parallelism section's --device exists on this machine."""
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available on this machine (torch.cuda.is_available() "
                          "is false): run with --device cpu, or on a machine with a GPU")


def check_data_manifests(config: DataConfig, arch: ModelArch) -> None:
    """What a run refuses of the data section's local --data / --eval-data sources before it
    builds anything, found from their manifests and a stat of each shard file (`--dry-run`;
    object-store sources are checked once fetched): a missing directory, a shard file (an
    export's tar) missing or of another size than its manifest (index.json) says, a source of
    no samples or of another model (`check_sources`, the run's own check), and a --seq-len that
    some sample certainly exceeds, which the run refuses when it plans the packs. A manifest
    records each shard's tokens and rows, not each sample's length: a shard whose samples
    average more than --seq-len tokens holds one that fits no pack; a longer sample elsewhere is
    found by the run (or `vlmpack pack`); a training source named twice or holding another's
    shards (`distinct_source_manifests`, as the run's plan refuses it)."""
    if config.data:  # the mixing weights, as the loader takes them
        resolve_weights([0] * len(config.data), [weight for _, weight in map(parse_source, config.data)])
    directories = [d for d, _ in map(parse_source, (*config.data, *config.eval_data)) if not is_url(d)]
    check_sources(directories, arch)
    distinct_source_manifests([spec for spec in map(parse_source, config.data) if not is_url(spec[0])])
    for directory in directories:
        manifest = source_manifest(directory)
        if is_webdataset_export(directory):
            WebDatasetShards(directory).check_files()  # its tars, as index.json lists them
        else:
            for shard in manifest["shards"]:
                path = Path(directory) / shard["file"]
                fault = file_fault(path, shard.get("bytes"))  # a stat, as the run's first read of the shard does
                if fault is not None:
                    raise ShardFault(path, *fault)
        for shard in manifest["shards"]:
            rows, tokens = int(shard.get("rows", 0)), int(shard.get("tokens", 0))
            mean = -(-tokens // rows) if rows else 0  # rounded up: the longest sample has at least as many
            if mean > config.seq_len:
                limit = manifest.get("settings", {}).get("max_seq_len")
                longer = f"--seq-len >= {limit} (the --max-seq-len it was preprocessed with)" if limit else \
                    "a longer --seq-len"
                raise ConfigError(f"{directory}: shard {shard.get('file')} holds {rows} samples of {tokens} tokens, "
                                  f"{mean} on average, so at least one is longer than --seq-len {config.seq_len} and "
                                  f"fits no pack: use {longer}, or re-run `vlmpack preprocess` with --max-seq-len <= "
                                  f"{config.seq_len}")


def dry_run(config: TrainConfig) -> tuple[str, bool]:
    """`--dry-run`: the memory plan of this run (`train.memory_plan`) and the smallest layout
    that fits, and whether any layout fits (this run's or one of those searched); nothing is
    built."""
    config.validate()
    with inputs_checked():
        checkpoint.check_run_directory(config)  # --out and --export-hf as the run takes them
        arch = resolve_arch(config.model)
        if config.checkpoints.resume:
            checkpoint.check_resume_arch(config, arch)
    check_layout(arch, config)
    with inputs_checked():
        check_data_manifests(config.data, arch)
    share = data_visual_share(config.data, arch)
    resolved, chosen = resolve_recompute(config, arch, cuda=True, visual_share=share)  # the plan is of GPUs
    name = config.model.arch or arch.hf_architecture
    settings, layout, gpu_gib = _plan_inputs(resolved, arch, share)
    lines = [memory_plan.report(name, arch, settings, layout, gpu_gib)]
    if chosen:
        lines.append(chosen)
    best = smallest_layout_that_fits(config, arch, share)  # from the run's own --recompute: auto is chosen per layout
    if best:
        lines.append(f"smallest layout that fits: {best.layout.gpus} GPU(s) as "
                     f"{memory_plan.describe(arch, best.settings, best.layout)} ({best.peak_gib:.1f} GiB); "
                     f"launch on {best.layout.gpus} GPU(s) with {best.flags(arch)}")
        return "\n".join(lines), True
    if memory_plan.peak_gib(arch, settings, layout) <= memory_plan.FIT_FRACTION * gpu_gib:
        lines.append(f"no other layout fits ({SEARCHED})")  # the run's own: more GPUs than searched, or TP wider
        return "\n".join(lines), True
    lines.append(nothing_fits_advice(config))
    return "\n".join(lines), False


# The layouts `--dry-run` searches: GPU counts in powers of two up to SUGGESTED_MAX_GPUS, TP
# within a node of NODE_GPUS (its all-reduces in every layer need NVLink).
SUGGESTED_MAX_GPUS = 512
NODE_GPUS = 8
SEARCHED = f"of those searched: powers of two up to {SUGGESTED_MAX_GPUS} GPUs, TP within {NODE_GPUS}"


@dataclasses.dataclass(frozen=True)
class LayoutFit:
    """A layout the trainer accepts whose memory plan fits: the run's config there (--recompute
    auto resolved) and its largest stage's plan."""

    config: TrainConfig
    settings: memory_plan.Settings
    layout: memory_plan.Layout
    peak_gib: float

    def flags(self, arch: ModelArch) -> str:
        """The flags that launch this layout."""
        return f"--tp {self.layout.tp} --pp {self.layout.pp}" + (f" --ep {self.layout.ep}" if arch.lm.is_moe else "")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def smallest_layout_that_fits(config: TrainConfig, arch: ModelArch, visual_share: float) -> LayoutFit | None:
    """The fewest GPUs (powers of two up to SUGGESTED_MAX_GPUS) with a layout whose largest
    stage's plan fits FIT_FRACTION of the GPU; among those layouts the one with the least model
    parallelism (tp x pp), then the least memory.

    A layout is tried as the trainer would run it: `config` with its --gpus, --tp, --pp and
    --ep set, accepted only if the trainer accepts that config (`TrainConfig.validate`,
    `check_layout`, `_plan_inputs`: heads, layers, DeepStack, experts, sequence parallelism,
    the global batch), planned with the settings the trainer takes there (sequence
    parallelism, padded packs, the optimizer sharded over its dp, --recompute auto chosen for
    it). The search depends on the run's other settings only, so the layout it finds, planned
    directly, gives the same plan and finds itself again."""
    gpus = 1
    while gpus <= SUGGESTED_MAX_GPUS:
        fits = []
        for tp in (t for t in _divisors(gpus) if t <= NODE_GPUS):
            for pp in _divisors(gpus // tp):
                for ep in _divisors(gpus // pp) if arch.lm.is_moe else (1,):
                    candidate = dataclasses.replace(
                        config, memory=dataclasses.replace(config.memory, gpus=gpus),
                        parallelism=dataclasses.replace(config.parallelism, tp=tp, pp=pp, ep=ep))
                    try:
                        candidate.validate()
                        check_layout(arch, candidate)
                        candidate, _ = resolve_recompute(candidate, arch, cuda=True, visual_share=visual_share)
                        settings, layout, gpu_gib = _plan_inputs(candidate, arch, visual_share)
                    except ConfigError:
                        continue  # a layout the trainer refuses
                    peak = memory_plan.peak_gib(arch, settings, layout)
                    if peak <= memory_plan.FIT_FRACTION * gpu_gib:
                        fits.append(LayoutFit(candidate, settings, layout, peak))
        if fits:
            return min(fits, key=lambda fit: (fit.layout.tp * fit.layout.pp, fit.peak_gib))
        gpus *= 2
    return None


def nothing_fits_advice(config: TrainConfig) -> str:
    """The line `--dry-run` ends with when no layout fits: what lowers the plan."""
    if config.memory.recompute == "auto":  # auto ended at every layer recomputed
        config = dataclasses.replace(config, memory=dataclasses.replace(config.memory, recompute="full"))
    resumable, new_run = memory_savings(config)
    changes = resumable + new_run
    if config.model.loss == "fused":
        changes.insert(0, "--loss chunked (--loss fused keeps the whole vocabulary on each GPU, so no --tp splits it)")
    if not config.parallelism.distributed_optimizer:
        changes.append("--distributed-optimizer true (the optimizer state sharded over the data-parallel ranks)")
    if not config.lora.lora_rank:
        changes.append("--lora-rank 16 (adapters on a frozen model)"
                       + ("" if "vision" in config.model.freeze else " or --freeze vision"))
    if config.data.global_batch_packs or config.data.global_batch_tokens:
        changes.append("a global batch that more data-parallel ranks divide (--global-batch-packs)")
    changes.append(f"more than {SUGGESTED_MAX_GPUS} GPUs")
    return f"no layout fits ({SEARCHED}); to fit, try: " + "; ".join(changes)


def resolve_recompute(config: TrainConfig, arch: ModelArch, cuda: bool,
                      visual_share: float | None = None) -> tuple[TrainConfig, str | None]:
    """`--recompute auto` made concrete from the memory plan, the least recompute that fits
    FIT_FRACTION of the GPU: none, the MLP activations' outputs kept (unless
    --recompute-mlp-activations is set); else none with them recomputed; else the fewest first
    vision blocks, up to the whole tower (unless --recompute-vision is set); else full recompute
    of the fewest first decoder layers per stage, with the vision tower (all of them if nothing
    fits); none on CPU. Returns the config and a line saying what was chosen (None for any other
    --recompute). `visual_share`: the data's, when already read (`data_visual_share`)."""
    memory = config.memory
    if memory.recompute in ("selective", "full") and not cuda:
        raise ConfigError(f"--recompute {memory.recompute} needs CUDA (megatron-core's recompute saves and restores "
                          "the CUDA RNG state); a CPU run keeps every activation: drop the flag")
    if memory.recompute != "auto":
        return config, None
    if not cuda:
        return dataclasses.replace(config, memory=dataclasses.replace(memory, recompute="none")), \
            "--recompute auto: no recompute (a CPU run)"
    layers = max(len(r) for r in convert.stage_layers(arch, config.parallelism.pp))
    settings, layout, gpu_gib = _plan_inputs(config, arch, visual_share)
    vision, depth = memory.recompute_vision, arch.vision.depth
    # each candidate recomputes all that the one before it does and more (a frozen tower keeps
    # nothing): the vision tower first, block by block, as its activations cost the least
    # recompute per byte; then decoder layers, with the whole tower
    tower = [("none", None, True, n) for n in range(1, depth)] + [("none", None, True, None)] \
        if vision is None and settings.vision_trained else []
    candidates = [("none", None, vision, None)] + tower \
        + [("full", n, vision, None) for n in range(1, layers)] + [("full", None, vision, None)]
    kept = settings.activation_outputs_kept  # the MLP activations' outputs: recomputed unless told or eager
    candidates = [(*c, kept) for c in candidates]
    if memory.recompute_mlp_activations is None and not kept:
        candidates.insert(0, ("none", None, vision, None, True))  # the fastest step: nothing recomputed
    budget = memory_plan.FIT_FRACTION * gpu_gib
    for recompute, recompute_layers, recompute_vision, vision_blocks, outputs_kept in candidates:
        tried = dataclasses.replace(settings, recompute=recompute, recompute_layers=recompute_layers,
                                    recompute_vision=recompute_vision, recompute_vision_blocks=vision_blocks,
                                    activation_outputs_kept=outputs_kept)
        peak = memory_plan.peak_gib(arch, tried, layout)
        if peak <= budget:
            break
    if recompute == "full":
        what = f"--recompute full of {recompute_layers or layers} of {layers} decoder layers per stage"
    elif recompute_vision:
        what = (f"--recompute-vision true, the first {vision_blocks} of the vision tower's {depth} blocks"
                if vision_blocks else "--recompute-vision true, the vision tower's blocks") + " recomputed, no decoder layer"
    elif outputs_kept and not kept:
        what = "no recompute, the MLP activations' outputs kept"
    else:
        what = "no recompute"
    verdict = "fits" if peak <= budget else "does NOT fit even so"
    chosen = f"--recompute auto: {what} (planned {peak:.1f} GiB, {verdict} in {budget:.1f} GiB)"
    memory = dataclasses.replace(memory, recompute=recompute, recompute_layers=recompute_layers,
                                 recompute_vision=recompute_vision, recompute_vision_blocks=vision_blocks,
                                 recompute_mlp_activations=memory.recompute_mlp_activations
                                 if memory.recompute_mlp_activations is not None else not outputs_kept)
    return dataclasses.replace(config, memory=memory), chosen


def _plan_inputs(config: TrainConfig, arch: ModelArch, visual_share: float | None = None):
    """The memory plan's settings, layout and GPU memory (GiB) for this run. `visual_share`:
    the data's, when already read (`data_visual_share`)."""
    data, memory, parallelism = config.data, config.memory, config.parallelism
    tp, pp, ep = parallelism.tp, parallelism.pp, parallelism.ep
    gpus = memory.gpus or int(os.environ.get("WORLD_SIZE", "1"))
    if gpus % (tp * pp) or (gpus // pp) % ep:
        raise ConfigError(f"--gpus {gpus} is not a multiple of --tp {tp} x --pp {pp} and of --pp {pp} x --ep {ep}")
    dp = gpus // (tp * pp)
    settings = memory_plan.Settings(
        seq_len=data.seq_len, micro_batch_packs=data.micro_batch_packs, global_packs=data.global_packs(dp),
        recompute=memory.recompute, recompute_layers=memory.recompute_layers, grad_dtype=memory.grad_dtype,
        adam_state_dtype=memory.adam_state_dtype, master_weights=memory.master_weights,
        distributed_optimizer=parallelism.distributed_optimizer,
        freeze=tuple(config.model.freeze), lora=config.lora.spec(), recompute_vision=memory.recompute_vision,
        recompute_vision_blocks=memory.recompute_vision_blocks,
        visual_share=data_visual_share(data, arch) if visual_share is None else visual_share,
        sequence_parallel=sequence_parallel(arch, parallelism),
        activation_outputs_kept=memory.recompute_mlp_activations is False
        or not (config.model.compile and config.model.compile_decoder))
    gpu_gib = memory.gpu_memory_gib or (torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
                                        / memory_plan.GIB if torch.cuda.is_available() else 80.0)
    return settings, memory_plan.Layout(tp=tp, pp=pp, dp=dp, ep=ep), gpu_gib


def data_visual_share(config: DataConfig, arch: ModelArch) -> float:
    """Visual tokens per token of the data section's --data shards (`_visual_share`), else the
    recorded mixes'."""
    share = _visual_share(config.data, arch.vision.spatial_merge_size)
    return memory_plan.VISUAL_SHARE if share is None else share


def _visual_share(sources: list[str], merge: int) -> float | None:
    """The visual share (`memory_plan.visual_share`) of the local shard directories among
    `sources`; None where there are none (object stores, WebDataset exports)."""
    from shards_schema.manifest import MANIFEST_NAME, load_manifest
    from train.pack_plan.sources import parse_source

    directories = [parse_source(source)[0] for source in sources]
    totals = [load_manifest(d)["totals"] for d in directories if (Path(d) / MANIFEST_NAME).is_file()]
    return memory_plan.visual_share(totals, merge)


def train(config: TrainConfig) -> dict:
    """The whole run (what `vlmpack train` calls): set up, train, release --out."""
    with Trainer(config) as trainer:
        return trainer.train()


class Trainer:
    """One training run, read top to bottom:

        with Trainer(config) as trainer:   # config and layout checked, process groups, then
            result = trainer.train()       # --out locked and setup(); the loop: step() per
                                           # global batch, evaluate(), save(), the log

    Leaving the `with` releases --out; after an error a save in flight still completes if it
    can. The profiling options (`train.profiling`) are the trainer's own: a subclass or a
    caller reads `model`, `data` and `profiling` and never replaces the trainer's functions.
    The trainer holds the whole config; each part it builds gets only its sections."""

    def __init__(self, config: TrainConfig):
        config.validate()
        check_device(config.parallelism)
        with inputs_checked():
            checkpoint.check_run_directory(config)  # a refused --out is left as it was found
        # Packs differ in length and patch count: expandable segments keep the CUDA caching allocator
        # from fragmenting (near the memory limit, fragments cost whole layers of recompute). Read
        # when CUDA initialises, i.e. below; a PYTORCH_CUDA_ALLOC_CONF of the user's own wins.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        with inputs_checked():
            self.arch = resolve_arch(config.model)
            if config.checkpoints.resume:
                checkpoint.check_resume_arch(config, self.arch)  # before a model of the wrong shape is built
        check_layout(self.arch, config)  # before any process group exists: a bad layout fails on every rank alike
        parallelism = config.parallelism
        self.info = init_parallel(parallelism.tp, parallelism.pp, ep=parallelism.ep, device=parallelism.device,
                                  seed=config.data.seed)
        self.cuda = self.info.device.type == "cuda"
        if self.cuda and self.arch.lm.has_linear_attention and (refusal := gated_delta_net.fla_backward_refusal()):
            raise ConfigError(refusal)
        # after init_parallel: each rank plans for the GPU it was given
        self.config, chosen = resolve_recompute(config, self.arch, cuda=self.cuda)
        if chosen and self.info.is_main:
            print(f"vlmpack train: {chosen}", flush=True)
        self.out = Path(config.checkpoints.out)
        self.bf16 = config.memory.bf16 and self.cuda  # CPU runs (tests, smoke runs) are fp32 and bitwise reproducible
        self.dtype = torch.bfloat16 if self.bf16 else torch.float32
        if config.memory.grad_dtype == "bf16" and not self.bf16 and self.info.is_main:
            print("vlmpack train: --grad-dtype bf16 on a CPU run: its weights are fp32, and its gradients take their "
                  "dtype", file=sys.stderr, flush=True)
        if config.memory.recompute_mlp_activations and not self.cuda and self.info.is_main:
            print("vlmpack train: --recompute-mlp-activations true on a CPU run: its layers are eager, and eager "
                  "layers keep the activations' outputs", file=sys.stderr, flush=True)
        # megatron's DistributedOptimizer is CUDA-only
        self.use_distributed = parallelism.distributed_optimizer and self.cuda
        self._resources = ExitStack()

    def __enter__(self) -> Trainer:
        # the main rank alone creates or fills it, below
        self.out_made_from = outermost_missing(self.out)
        self.new_out = self.out_made_from is not None or (self.out.is_dir() and not any(self.out.iterdir()))
        try:
            with ExitStack() as stack:  # a failing setup releases what it took
                lock_output_dir(stack, self.out, self.info)
                self.saver = checkpoint.CheckpointSaver(self.out, self.info, self.config.checkpoints.keep_last,
                                                        background=self.config.checkpoints.async_save)
                stack.callback(self.saver.abandon)  # an error mid-run: a save in flight still completes if it can
                self.setup()
                self._resources = stack.pop_all()
        except BaseException:
            # a run refused in setup (W&B without a login, say) leaves no --out of its own behind:
            # nothing in it can be resumed, and a second try would meet it as an earlier run's
            if self.new_out and self.info.is_main:
                remove_refused_run(self.out, self.out_made_from)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        suppressed = self._resources.__exit__(exc_type, exc, tb)  # --out released, a save in flight completed
        # a run refused before it trained anything (a token id outside the vocabulary in the first
        # pack, a loss NaN at the first step) leaves its new --out as setup's refusals do
        if isinstance(exc, UserError) and exc.exit_code == EXIT_USER_ERROR and self.new_out and self.info.is_main \
                and self.out.is_dir() and only_setup_written(self.out):
            self.logger.close()  # W&B's files written before they are removed, not after
            remove_refused_run(self.out, self.out_made_from)
        return suppressed

    # --- setup ------------------------------------------------------------------------------

    def setup(self) -> None:
        """Data, model, optimizer and LR schedule, then the checkpoint --resume continues."""
        config, arch, info = self.config, self.arch, self.info
        with inputs_checked():
            self.data = TrainData(localize_sources(config.data, self.out, info), arch, info,
                                  padded=config.packs_padded(), plan_cache=self.out / "plans",
                                  eval_batches=config.schedule.eval_global_batches(),
                                  row_multiple=info.tp if sequence_parallel(arch, config.parallelism) else 1)
        self.model_config, self.model = self.build_model()
        self.optimizer = build_optimizer(config.optimizer, config.memory, self.model, self.cuda, self.use_distributed,
                                         self.bf16)
        self.scheduler = build_scheduler(self.optimizer, config.optimizer, config.schedule)
        self.model_config.grad_scale_func = self.optimizer.scale_loss
        self.model_config.finalize_model_grads_func = finalize_grads  # used by the PP schedule
        self.model_config.no_sync_func = self.model.no_sync
        self.step_count = self.resume() if config.checkpoints.resume else 0
        self.logger = MetricsLogger(self.out, config.logging, info, enabled=info.is_main,
                                    total_steps=config.schedule.train_steps, run_config=config.to_flat())
        self.timer = StepTimer(info.device)
        self.profiling = Profiling(config.profiling, self.out, info)
        self.forward_step = make_forward_step(self.data, self.dtype)
        self.seq_length = config.data.seq_len * config.data.micro_batch_packs
        self.lm_flops_per_token = lm_flops_per_token(arch)
        self.world_flops = peak_tflops(info.device) * 1e12 * info.world

    def build_model(self):
        """megatron's model config and this rank's stage, weights loaded, wrapped in megatron's DDP."""
        config, arch, info = self.config, self.arch, self.info
        model_config, model = model_setup.build_model_for_run(config.model, config.memory, arch, info, self.dtype,
                                                             self.bf16, sequence_parallel(arch, config.parallelism),
                                                             static_rows=config.packs_padded())
        with inputs_checked():
            model_setup.load_weights(model, config.model, config.lora, config.data.seed, arch, info)
        model_setup.freeze(model, config.model.freeze)
        if self.cuda:  # fla's kernels compiled for every kind of pack length now, not at a pack mid-run
            gated_delta_net.warm_up_linear_attention(model)
        if config.model.fp8:
            use_fp8(model, config.model.fp8, emulate=not self.cuda,
                    rows=config.data.seq_len * config.data.micro_batch_packs if config.packs_padded() else None)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=config.memory.grad_dtype == "fp32",
                                                   overlap_grad_reduce=False,
                                                   use_distributed_optimizer=self.use_distributed)
        model = DistributedDataParallel(model_config, ddp_config, model)
        if info.pp == 1:
            use_grad_buffers(model)
        return model_config, model

    def resume(self) -> int:
        """The newest checkpoint in --out restored (`checkpoint.resume`); its step, 0 without one."""
        config = self.config
        with inputs_checked():
            step = checkpoint.resume(self.out, self.model, self.optimizer, self.scheduler, self.data, self.info)
        train_steps = config.schedule.train_steps
        if config.schedule.extend_schedule and step and self.scheduler.lr_decay_steps != train_steps:
            saved = checkpoint.latest_checkpoint(self.out)
            line = self.scheduler.extend(train_steps, checkpoint.new_run_hint(saved, config.to_flat()))
            if self.info.is_main:
                print(f"vlmpack train: {line}", flush=True)
        if self.cuda and config.memory.adam_state_dtype == "fp32":
            use_fused_adamw(self.optimizer)  # the checkpoint may come from a run with bf16 moments
        return step

    # --- the loop ---------------------------------------------------------------------------

    def train(self) -> dict:
        """Steps until --train-steps (or a stop signal, or --exit-interval); the run's summary."""
        schedule, checkpoints = self.config.schedule, self.config.checkpoints
        result = {"start_step": self.step_count}
        last_saved = self.step_count
        self.model.train()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        # a scheduler's SIGTERM/SIGUSR1: finish the step, save, exit 0; Ctrl-C (SIGINT): the same, exit 130
        with StopRequest(repeat_line=self.repeat_line) as self.stop:
            while self.step_count < schedule.train_steps:
                started = time.perf_counter()
                with self.profiling.step(self.step_count + 1):
                    micro_batches = self.data.next_global_batch()
                    record = self.step(micro_batches, started)
                evaluating = schedule.eval_every and self.data.eval_loader is not None \
                    and self.step_count % schedule.eval_every == 0
                if evaluating and not self.stop_requested:
                    record["eval_loss"], record["eval_target_tokens"] = self.evaluate()
                t_checkpoint = time.perf_counter()
                self.saver.settle(self.saves_written)  # a background save every rank has written: complete it
                exiting = (bool(schedule.exit_interval) and self.step_count % schedule.exit_interval == 0) \
                    or self.stop_requested is not None
                final = self.step_count == schedule.train_steps and checkpoints.save_final
                if (checkpoints.save_every and self.step_count % checkpoints.save_every == 0) or final or exiting:
                    self.save()
                    last_saved = self.step_count
                    if exiting or final:
                        self.saver.wait()
                record.update(checkpoint_record(self.saver, time.perf_counter() - t_checkpoint))
                if self.step_count % self.config.logging.log_every == 0 or self.step_count == schedule.train_steps \
                        or "checkpoint_stall_s" in record:
                    self.logger.log(record)
                result = {**result, **record}
                if self.stop_requested:
                    result.update(self.stopped())
                if exiting:
                    break
        self.saver.wait()
        self.logger.close()
        if checkpoints.export_hf and self.step_count == schedule.train_steps == last_saved:  # not after a stop: goes on later
            checkpoint.export_hf_from_run(self.out, self.step_count, checkpoints.export_hf, self.info)
        result["final_step"] = self.step_count
        return result

    def step(self, micro_batches: list[dict], started: float) -> dict:
        """One optimizer step on this rank's micro-batches of a global batch (fetched since
        `started`); its metrics record. Sets `stop_requested` and `saves_written`, which ride
        the loss's all-reduce."""
        data_wait = time.perf_counter() - started
        self.model.zero_grad_buffer()
        grad_buffers_zeroed(self.model)
        self.optimizer.zero_grad()
        self.timer.mark()
        with fp8_weight_scales_once(self.model):
            losses = run_global_batch(self.model, micro_batches, self.forward_step, self.seq_length, self.info.pp,
                                      forward_only=False)
        self.timer.mark()
        update_ok, grad_norm, _ = self.optimizer.step()
        self.timer.mark()
        if update_ok:
            self.scheduler.step(increment=1)
        loss, target_tokens, self.stop_requested, self.saves_written = reduce_loss(losses, self.info, self.stop,
                                                                                  self.saver.progress())
        self.step_count += 1
        if self.cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        fwd_bwd, optimizer_s = self.timer.seconds()
        tokens = self.data.global_batch_tokens(micro_batches)
        record = {"step": self.step_count, "loss": loss, "target_tokens": target_tokens, "tokens": tokens,
                  "lr": self.scheduler.get_lr(self.optimizer.param_groups[0]), "grad_norm": grad_norm,
                  "skipped": not update_ok, "step_seconds": seconds, "data_wait_s": data_wait,
                  "fwd_bwd_s": fwd_bwd, "optimizer_s": optimizer_s, "tokens_per_s": tokens / seconds,
                  "tokens_per_s_per_gpu": tokens / seconds / self.info.world,
                  "mfu": tokens * self.lm_flops_per_token / seconds / self.world_flops if self.world_flops else None,
                  "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None,
                  # > 0 and growing: the allocator had to free its cache and retry, a stall of the
                  # whole step; use more recompute (--recompute-layers) or shorter packs
                  "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0) if self.cuda else None}
        lm = self.arch.lm
        if lm.is_moe and self.config.model.moe_aux_loss_coef:
            record["moe_load_balancing_loss"] = load_balancing_loss(len(micro_batches), lm.num_experts_per_tok)
        if not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm)):
            self.saver.wait()  # the save in flight (every rank is here: the loss and norm are global) completes
            raise UserError(diverged_advice(self.config, self.step_count, loss, grad_norm))  # this step is not saved
        return record

    def evaluate(self) -> tuple[float, int]:
        """(mean loss per target token, target tokens) of the --eval-data batches."""
        return evaluate(self.model, self.data, self.forward_step, self.seq_length, self.info)

    def save(self) -> None:
        """A checkpoint of this step (written in the background with --async-save)."""
        self.saver.save(self.step_count, self.model, self.optimizer, self.scheduler, self.data, self.arch,
                        run_config=self.config.to_flat(), source=self.config.model)

    def stopped(self) -> dict:
        """A stop signal ended the run at this step (saved): say so; the summary's keys."""
        if self.info.is_main:
            received = self.stop.received.name if self.stop.received else "a stop signal on another rank"
            print(f"vlmpack train: {received}: step {self.step_count} saved to {self.out}; continue with --resume",
                  file=sys.stderr, flush=True)
        return {"stopped_by_signal": True, "interrupted": self.stop_requested == "interrupt"}

    def repeat_line(self, sig) -> str:
        """A second signal: the process ends at once, mid-save maybe."""
        saved = checkpoint.latest_checkpoint(self.out)
        kept = f"checkpoint {saved.name} is the latest and intact" if saved else "no checkpoint was saved"
        return (f"vlmpack train: {sig.name} again: exiting at once; any checkpoint being written is left unfinished "
                f"(removed by the next run), {kept}")


def checkpoint_record(saver, stall: float) -> dict:
    """The step's checkpoint metrics: how long the training loop was blocked (snapshot, waiting
    for the save before, completing one) and which background saves completed, with how long
    their writing took."""
    timings = saver.take_timings()
    record = {}
    if timings:
        record["checkpoint_stall_s"] = stall
        record.update({f"checkpoint_{key}": value for key, value in timings.items()})
    if saver.completed:
        record["checkpoint_completed_step"] = saver.completed[-1]["step"]
        record["checkpoint_write_s"] = saver.completed[-1]["write_s"]
        saver.completed.clear()
    return record


def diverged_advice(config: TrainConfig, step: int, loss: float, grad_norm: float | None) -> str:
    """One line for a step whose loss or gradient norm is not finite: the settings that scale the
    update, and the checkpoint (saved before the step) to go on from."""
    what = f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {grad_norm}"
    settings = [f"--lr {config.optimizer.lr:g}"]
    if config.lora.lora_rank:
        settings.append(f"--lora-alpha {config.lora.spec().alpha:g} (the adapters' scale)")
    if config.model.moe_aux_loss_coef:
        settings.append(f"--moe-aux-loss-coef {config.model.moe_aux_loss_coef:g}")
    clipping = "; --clip-grad 0 turns clipping off: give e.g. --clip-grad 1" if config.optimizer.clip_grad == 0 else ""
    saved = checkpoint.latest_checkpoint(Path(config.checkpoints.out))
    if saved is None:
        where = "no checkpoint was saved"
    elif config.lora.lora_rank:
        where = f"checkpoint {saved} holds the adapters from before it"
    else:
        where = f"checkpoint {saved} holds the weights from before it: a new run starts from them with --init " \
                f"{saved / 'model'}"
    return (f"training diverged at step {step} ({what}; this step is not saved): lower {', '.join(settings)}, "
            f"or check the data with `vlmpack verify`{clipping}; {where}")


def is_out_of_memory(exc: BaseException) -> bool:
    """A CUDA allocation failure, whichever layer reports it: torch's allocator, cuBLAS, or NCCL
    allocating its buffers lazily at the first collective ("Failed to CUDA calloc")."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        sign in text for sign in ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDA calloc", "cudaErrorMemoryAllocation"))


def memory_savings(config: TrainConfig) -> tuple[list[str], list[str]]:
    """The settings of `config` that lower its memory, cheapest in speed first: those --resume
    accepts, and those that need a new run (they change the data order); not the layout."""
    memory, data = config.memory, config.data
    resumable, new_run = [], []  # settings --resume accepts / settings that change the data order
    if memory.bf16 and "fp32" in (memory.grad_dtype, memory.adam_state_dtype):
        resumable.append("--grad-dtype bf16 --adam-state-dtype bf16 (half the gradient and Adam-moment memory)")
    if memory.recompute != "full":
        resumable.append("--recompute full (decoder layers recomputed in backward)")
    elif memory.recompute_layers is not None:
        resumable.append(f"more --recompute-layers than {memory.recompute_layers}, or drop the flag (every layer recomputed)")
    if memory.recompute_vision is False:
        resumable.append("--recompute-vision true")
    elif memory.recompute_vision_blocks is not None:
        resumable.append(f"more --recompute-vision-blocks than {memory.recompute_vision_blocks}, or drop the flag "
                         "(every vision block recomputed)")
    if data.micro_batch_packs > 1:
        if data.global_batch_packs or data.global_batch_tokens:
            resumable.append("--micro-batch-packs 1 (more micro-batches, the same global batch)")
        else:  # the global batch defaults to dp x micro-batch packs: it would shrink
            new_run.append("--micro-batch-packs 1 with --global-batch-packs set to keep the global batch")
    new_run.append(f"a shorter --seq-len than {data.seq_len}")
    return resumable, new_run


def out_of_memory_advice(config: TrainConfig, exc: BaseException) -> str:
    """What ran out, the settings that lower memory (cheapest in speed first), and how to go on."""
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    where = ""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
        where = f" (peak {torch.cuda.max_memory_allocated() / 2**30:.1f} of {total:.1f} GiB allocated)"
    resumable, new_run = memory_savings(config)
    new_run.append(f"--tp {2 * config.parallelism.tp} or --pp {2 * config.parallelism.pp} over more GPUs")
    lines = [f"out of GPU memory{where}: {first_line}"]
    if resumable:
        lines.append("To fit, try (cheapest first): " + "; ".join(resumable) + ".")
    lines.append(("Or, as a new run: " if resumable else "To fit, start a new run with: ") + "; ".join(new_run) + ".")
    saved = checkpoint.latest_checkpoint(Path(config.checkpoints.out))
    lines.append(f"Checkpoint {saved} is intact: --resume continues it with the first kind of change; a new run "
                 f"starts from its weights with --init {saved / 'model'}." if saved else "No checkpoint was saved yet.")
    return "\n".join(lines)


class Train:
    """What `vlmpack train ...` runs (its flags are `train.cli.Train`'s, defined without torch);
    `python -m train.trainer` is the same."""

    @staticmethod
    def run(config: TrainConfig) -> int:
        """`config`: the flags read and validated (`train.cli.Train.run`)."""
        if config.memory.dry_run:
            report, fits = dry_run(config)
            print(report)
            return EXIT_OK if fits else EXIT_FAULT  # no layout fits: nothing to launch
        try:
            result = train(config)
        except RuntimeError as exc:  # torch.OutOfMemoryError is one
            if not is_out_of_memory(exc):
                raise
            # exit 3, not a user error: its advice runs over several lines
            print(f"vlmpack train: error: {out_of_memory_advice(config, exc)}", file=sys.stderr)
            return EXIT_OUT_OF_GPU_MEMORY
        except KeyboardInterrupt:  # Ctrl-C outside the training loop (setup, export), where a step is not saved
            saved = checkpoint.latest_checkpoint(Path(config.checkpoints.out))
            print("vlmpack train: interrupted (SIGINT) outside the training loop; "
                  + (f"the latest checkpoint, {saved}, is intact" if saved else "no checkpoint was saved"),
                  file=sys.stderr)
            return EXIT_INTERRUPTED
        finally:
            destroy_parallel()
        if result.get("final_step"):
            keys = ("start_step", "final_step", "loss", "stopped_by_signal")
            print(json.dumps({k: result[k] for k in keys if k in result}))
        return EXIT_INTERRUPTED if result.get("interrupted") else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """`python -m train.trainer ARGS` (e.g. under torchrun): `vlmpack train ARGS`, errors handled alike."""
    from shards_schema.cli import main as vlmpack

    return vlmpack(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
