"""Predicted GPU memory per rank of a training run, before anything is built or allocated
(`vlmpack train --dry-run`).

Model state is counted exactly: each pipeline stage's parameters are the shapes that
`convert.shard` gives this rank (on meta tensors, so nothing is allocated), and their bytes
follow the memory settings:
  weights     2 bytes per parameter (bf16 on GPUs; a LoRA base is frozen in bf16 too);
  gradients   4 or 2 bytes per trained parameter (--grad-dtype);
  optimizer   fp32 master weights (4 bytes; none with --master-weights bf16, which updates the
              2-byte weights themselves) + two Adam moments of 4 or 2 bytes (--adam-state-dtype)
              per trained parameter, split by the distributed optimizer over the ranks that hold
              the same parameter: the data-parallel ranks, for experts dp / ep of them.
  step copy   4 bytes per trained parameter (split as the optimizer state) when gradients
              are bf16: megatron's optimizer step casts every gradient to an fp32 copy,
              alive at once after the activations are freed.
              The distributed optimizer with bf16 moments or bf16 master weights reads the
              bf16 buffer in place (`optim.use_fast_step`) and makes no copy.
A stage's peak is model state plus the larger of its activations and its step copy.
Activations are an estimate in bytes per token (S tokens per micro-batch, h the hidden size),
fitted to peaks measured on H100s and H200s (bf16, FlashAttention, packed sequences):
  a recomputed decoder layer keeps its input             LAYER_INPUT x h x S
  a layer that keeps its activations for backward        LAYER_KEPT x h x S
    (under TP, all but LAYER_KEPT_WHOLE x h x S of it is split over the TP ranks; under
     sequence parallelism all of it, and the recomputed layers' inputs too)
  one layer being recomputed, when any is                RECOMPUTE_WORKING x h x S
    (split over the TP ranks as a kept layer's activations are)
    a Mixture-of-Experts layer adds                      MOE_RECOMPUTE_WORKING x k x h x S
  the last stage's logits and loss                       LOGITS x S x vocab / tp
    (the constant also covers a recomputed vision tower's working set; a frozen tower keeps
     none, so LoRA runs come out up to 18 % high)
    (fitted on loss chunks of 4096 rows: a chunk of R rows holds LOSS_CHUNK_HELD x
     (4096 - R) x vocab / tp less, its bf16 logits and their gradient in its backward)
  a vision tower that keeps its activations (trained, not recomputed), on stage 0, for the
  P = S x visual share x merge^2 patches of a micro-batch    VISION_KEPT x P x depth x hv
    (with --recompute-vision-blocks N, only its depth - N other blocks keep theirs)
    (not divided by tp: every TP rank runs the whole tower)
    (hv its hidden size; the visual share is the shards' visual tokens per token, read from
     the manifests of --data, else VISUAL_SHARE, that of the recorded mixes)
Under pipeline parallelism a stage holds up to pp - stage micro-batches in flight (1F1B).
Compiled layers recompute each MLP activation's output in backward (`train.model.activation`);
eager ones keep it, ACTIVATION_OUTPUT x its width per token (or patch) and layer: the
Mixture-of-Experts layers always (measured: 30B-A3B's, with 8 experts of width 768 a token,
keeps what an eager dense layer of its hidden size keeps, so its width counts as 3 h), the dense
layers and the vision blocks under --compile false or --recompute-mlp-activations false (and
under --compile-decoder false, where the still compiled vision blocks are planned a little high).
A layer unlike the fitted runs' (plain softmax attention, a dense MLP of width 3 h) keeps
LAYER_KEPT x h x S plus the difference of what it keeps in bf16 (`_kept_beyond_fit`, split
over the TP ranks with the heads and the MLP's width):
  a dense MLP of width I            MLP_KEPT x (I - 3 h)   (Qwen2.5-VL-3B's, I = 5.4 h: its
                                               16k-pack runs on an H200, with the vision tower
                                               kept and with it recomputed)
  a gated attention's output gate   2 x 2 q   (the gate and the ungated output; q its width)
  a Gated DeltaNet                  0         (compiled around fla's conv and chunked rule, it
                                               measured as a softmax-attention layer of its
                                               hidden size: Qwen3.5-2B without recompute and
                                               Qwen3.5-9B with 17 of 32 layers recomputed)
  a shared expert                   2 x 3 S   (its [gate; up] output and the SwiGLU, width S)
The constants were fitted on three H100 runs (Qwen3-VL-2B with every layer recomputed and with
24 of its 28 layers kept, Qwen3-VL-8B at TP=2), the MoE recompute term on two H200 runs
(30B-A3B with 3 and 48 layers, every layer recomputed), VISION_KEPT on the Qwen3-VL-2B runs of
16k packs with compiled decoder layers and no decoder layer recomputed (H200: the whole tower
kept, images alone and a 30 % video mix, and part of it recomputed), LAYER_KEPT_WHOLE on the
TP=2 runs without recompute (2B dense, and the 30B-A3B cut to 3 layers with sequence parallelism),
all of them with the activations' outputs kept and loss chunks of 4096 rows (`loss_chunk_rows`
in the records); ACTIVATION_OUTPUT on an H200 A/B of Qwen3-VL-2B
without recompute, outputs kept against recomputed (103.4 against 91.8 GiB: 2.5 bytes per unit
of width where the bf16 output alone is 2; tests/fixtures/measured_peaks.json marks the runs that
kept them, `activation_outputs_kept`). tests/test_memory_plan.py checks the plan against every
recorded peak in benchmarks/results.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from train import convert
from train.model import lora
from train.model.arch import ModelArch
from train.model.loss import loss_chunk_rows

GIB = 2**30
LAYER_INPUT = 2.0
LAYER_KEPT = 32.3
LAYER_KEPT_WHOLE = 5.0  # of LAYER_KEPT: what TP does not split (outside the attention and MLP GEMMs)
RECOMPUTE_WORKING = 30.0
MLP_KEPT = 1.0  # per unit of a dense MLP's width beyond the fitted runs' 3 h
ACTIVATION_OUTPUT = 2.5  # per unit of an MLP's width where the layer keeps its activation's output (fitted; bf16 alone is 2)
LOGITS = 3.0
LOSS_CHUNK_HELD = 4.0  # bytes per logit of the loss chunk in its backward: bf16 logits and bf16 gradient
FITTED_LOSS_CHUNK_ROWS = 4096  # the loss chunk of the runs LOGITS was fitted on
VISION_KEPT = 48.0
VISUAL_SHARE = 0.34
MOE_RECOMPUTE_WORKING = 23.0
FIT_FRACTION = 0.95  # of a GPU's memory: the rest is the CUDA context and the allocator's fragments


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def __str__(self) -> str:
        return f"tp {self.tp} x pp {self.pp} x dp {self.dp}" + (f" (ep {self.ep})" if self.ep > 1 else "")


@dataclasses.dataclass(frozen=True)
class Settings:
    """The run's memory settings (TrainConfig's names)."""

    seq_len: int
    micro_batch_packs: int = 1
    global_packs: int | None = None  # packs per step (default: one micro-batch per data-parallel rank)
    recompute: str = "none"
    recompute_layers: int | None = None
    grad_dtype: str = "fp32"
    adam_state_dtype: str = "fp32"
    master_weights: str = "fp32"
    distributed_optimizer: bool = True
    freeze: tuple[str, ...] = ()
    lora: lora.LoraSpec | None = None
    recompute_vision: bool | None = None  # default: with --recompute full
    recompute_vision_blocks: int | None = None  # where the tower is recomputed: its first N blocks (None: all)
    visual_share: float = VISUAL_SHARE  # visual tokens per pack token
    sequence_parallel: bool | None = None  # rows split over the TP ranks; None: the trainer's default (MoE at TP > 1)
    activation_outputs_kept: bool = False  # the MLPs keep their activations' outputs (eager layers)
    loss_chunk_rows: int | None = None  # rows of the loss's logit chunks; None: the trainer's (`loss_chunk_rows`)

    @property
    def vision_trained(self) -> bool:
        return ("vision" in self.lora.parts or "vision" in self.lora.modules_to_save) if self.lora else \
            "vision" not in self.freeze

    def vision_kept_blocks(self, depth: int) -> int:
        """The vision blocks that keep their activations for backward."""
        if not self.vision_trained:
            return 0
        recomputed = self.recompute == "full" if self.recompute_vision is None else self.recompute_vision
        return depth - min(depth, self.recompute_vision_blocks or depth) if recomputed else depth

    def micro_batches(self, dp: int) -> int:
        """Micro-batches per data-parallel rank per step: they bound what 1F1B keeps in flight."""
        return max(1, -(-(self.global_packs or dp * self.micro_batch_packs) // (dp * self.micro_batch_packs)))


@dataclasses.dataclass(frozen=True)
class StagePlan:
    stage: int
    params: int
    trained: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    step_copy: float  # fp32 gradient copy of the optimizer step (activations freed by then)

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + max(self.activations, self.step_copy)


@functools.lru_cache(maxsize=4096)
def _stage_counts(arch: ModelArch, tp: int, pp: int, ep: int, stage: int) -> tuple[tuple[str, bool, int], ...]:
    """Parameters of a stage's rank, summed per (model part, whether an expert stack). Cached:
    a layout search plans the same stage under many settings."""
    full = {n: torch.empty(s, device="meta") for n, s in convert.megatron_shapes(arch).items()}
    counts: dict[tuple[str, bool], int] = {}
    for name, tensor in convert.shard(full, arch, tp, 0, pp, stage, ep, 0).items():
        key = (convert.model_part(name), _is_expert(name))
        counts[key] = counts.get(key, 0) + tensor.numel()
    return tuple((part, expert, n) for (part, expert), n in counts.items())


@functools.lru_cache(maxsize=4096)
def _adapter_params(arch: ModelArch, spec: lora.LoraSpec, layout: Layout, stage: int) -> int:
    layers = convert.stage_layers(arch, layout.pp)[stage]
    total = 0
    for site in lora.resolve_sites(arch, spec):
        if site.part == "llm":
            if int(site.module.split("layers.")[1].split(".")[0]) not in layers:
                continue
        elif stage != 0:
            continue
        a_in = site.in_features // layout.tp if site.split == "row" else site.in_features
        b_out = site.out_features // layout.tp if site.split == "column" else site.out_features
        total += spec.rank * (a_in + b_out) + (b_out if spec.dora else 0)  # DoRA: a magnitude per row
    return total


def _rows_split(arch: ModelArch, settings: Settings) -> bool:
    """Sequence parallelism: as set, else the trainer's default (on for MoE models)."""
    return arch.lm.is_moe if settings.sequence_parallel is None else settings.sequence_parallel


def _kept_beyond_fit(lm, layer: int, outputs_kept: bool) -> float:
    """Bytes per token a decoder layer keeps for backward beyond the fitted runs' compiled layer
    of its hidden size (the module docstring's table): an output gate, a shared expert, a dense
    MLP of another width than 3 h, an activation's output kept."""
    gate = 4.0 * lm.num_heads * lm.head_dim if lm.layer_type(layer) != "linear_attention" and lm.attn_output_gate \
        else 0.0
    mlp = 0.0 if lm.is_moe else MLP_KEPT * (lm.intermediate_size - 3 * lm.hidden_size)
    output = ACTIVATION_OUTPUT * (3 * lm.hidden_size if lm.is_moe else lm.intermediate_size) \
        if lm.is_moe or outputs_kept else 0.0
    return gate + 6.0 * lm.shared_expert_intermediate_size + mlp + output


def _logits(vocab: float, tokens: int, settings: Settings) -> float:
    """Bytes of the last stage's logits and loss, over a vocabulary (shard) of `vocab` entries."""
    rows = settings.loss_chunk_rows or loss_chunk_rows(int(vocab))
    smaller = min(FITTED_LOSS_CHUNK_ROWS, tokens) - min(rows, tokens)
    return max(0.0, tokens * LOGITS * vocab - LOSS_CHUNK_HELD * smaller * vocab)


def _activations(arch: ModelArch, settings: Settings, layout: Layout, stage: int) -> float:
    lm = arch.lm
    tokens = settings.seq_len * settings.micro_batch_packs
    stage_layers = convert.stage_layers(arch, layout.pp)[stage]
    layers = len(stage_layers)
    if settings.recompute == "full":
        recomputed = min(layers, settings.recompute_layers or layers)
    else:
        recomputed = 0
    rows = layout.tp if _rows_split(arch, settings) else 1  # sequence parallelism: each TP rank holds a TP-th of the rows
    plain_layer = (LAYER_KEPT_WHOLE / rows + (LAYER_KEPT - LAYER_KEPT_WHOLE) / layout.tp) * lm.hidden_size
    # megatron's block recompute redoes the stage's first layers and keeps the others'
    kept_by_layer = [plain_layer + _kept_beyond_fit(lm, i, settings.activation_outputs_kept) / layout.tp
                     for i in stage_layers]
    per_micro_batch = tokens * (recomputed * LAYER_INPUT * lm.hidden_size / rows + sum(kept_by_layer[recomputed:]))
    in_flight = min(layout.pp - stage, settings.micro_batches(layout.dp))
    working_per_token = RECOMPUTE_WORKING * lm.hidden_size
    if lm.is_moe:
        working_per_token += MOE_RECOMPUTE_WORKING * lm.num_experts_per_tok * lm.hidden_size
    # the layer being recomputed holds what a kept layer does: split over TP alike
    largest = max(kept_by_layer[:recomputed], default=plain_layer)
    working = tokens * working_per_token * largest / (LAYER_KEPT * lm.hidden_size) if recomputed else 0.0
    logits = _logits(lm.vocab_size / layout.tp, tokens, settings) if stage == layout.pp - 1 else 0.0
    vision = 0.0
    v = arch.vision
    if stage == 0 and settings.vision_kept_blocks(v.depth):
        patches = tokens * settings.visual_share * v.spatial_merge_size ** 2
        # every TP rank runs the whole tower
        per_patch = VISION_KEPT * v.hidden_size + (ACTIVATION_OUTPUT * v.intermediate_size
                                                   if settings.activation_outputs_kept else 0.0)
        vision = per_patch * patches * settings.vision_kept_blocks(v.depth)
    return in_flight * (per_micro_batch + vision) + working + logits


def visual_share(totals: list[dict], merge: int) -> float | None:
    """Visual tokens per token over shard-directory totals (a manifest's `totals`: tokens,
    patches, video_patches); None where they hold no tokens."""
    tokens = sum(t.get("tokens") or 0 for t in totals)
    patches = sum((t.get("patches") or 0) + (t.get("video_patches") or 0) for t in totals)
    return patches / merge ** 2 / tokens if tokens else None


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def plan_stage(arch: ModelArch, settings: Settings, layout: Layout, stage: int) -> StagePlan:
    counts = _stage_counts(arch, layout.tp, layout.pp, layout.ep, stage)
    params = sum(n for _, _, n in counts)
    distributed = settings.distributed_optimizer
    if settings.lora is not None:
        adapters = _adapter_params(arch, settings.lora, Layout(tp=layout.tp, pp=layout.pp), stage)
        saved = sum(n for part, _, n in counts if part in settings.lora.modules_to_save)
        params, trained = params + adapters, adapters + saved
        sharded = float(trained)  # adapters are few: the plan keeps their optimizer state whole
    else:
        trained = sum(n for part, _, n in counts if part not in settings.freeze)
        experts = sum(n for part, expert, n in counts if expert and part not in settings.freeze)
        # what this rank's optimizer holds: each parameter split over the ranks that hold it
        # (under --ep megatron's expert data-parallel group: the tp x dp ranks of a stage that
        # hold the same experts; at ep 1 the experts are dense parameters to it)
        expert_dp = layout.tp * layout.dp // layout.ep if layout.ep > 1 else layout.dp
        sharded = ((trained - experts) / layout.dp + experts / expert_dp) if distributed \
            else float(trained)
    grad_bytes = 4 if settings.grad_dtype == "fp32" else 2
    moment_bytes = 4 if settings.adam_state_dtype == "fp32" else 2
    master_bytes = 4 if settings.master_weights == "fp32" else 0
    fast_step = distributed and "bf16" in (settings.adam_state_dtype, settings.master_weights)
    step_copy = 4.0 * sharded if grad_bytes == 2 and not fast_step else 0.0
    return StagePlan(stage=stage, params=params, trained=trained, weights=2.0 * params,
                     gradients=float(grad_bytes * trained),
                     optimizer=sharded * (master_bytes + 2 * moment_bytes),
                     activations=_activations(arch, settings, layout, stage), step_copy=step_copy)


def plan(arch: ModelArch, settings: Settings, layout: Layout) -> list[StagePlan]:
    """One plan per pipeline stage (rank 0 of its tensor- and expert-parallel group)."""
    return [plan_stage(arch, settings, layout, stage) for stage in range(layout.pp)]


def peak_gib(arch: ModelArch, settings: Settings, layout: Layout) -> float:
    """The largest stage's plan in GiB: a run fits only if every rank does."""
    return max(s.total for s in plan(arch, settings, layout)) / GIB


def describe(arch: ModelArch, settings: Settings, layout: Layout) -> str:
    """The layout, and sequence parallelism where the plan splits the rows over the TP ranks."""
    return f"{layout}" + (" with sequence parallelism" if layout.tp > 1 and _rows_split(arch, settings) else "")


def report(name: str, arch: ModelArch, settings: Settings, layout: Layout, gpu_gib: float) -> str:
    """What `vlmpack train --dry-run` prints of the run's own layout (the trainer adds the
    smallest layout that fits, `train.trainer.smallest_layout_that_fits`)."""
    stages = plan(arch, settings, layout)
    state = (f"gradients {settings.grad_dtype}, Adam moments {settings.adam_state_dtype}, "
             f"master weights {settings.master_weights}"
             + (f", LoRA rank {settings.lora.rank}" if settings.lora else ""))
    lines = [f"memory plan: {name} on {layout.gpus} GPU(s) as {describe(arch, settings, layout)}, "
             f"{settings.seq_len:,}-token packs x "
             f"{settings.micro_batch_packs}, --recompute {settings.recompute}"
             + (f" (first {settings.recompute_layers} layers)" if settings.recompute_layers else "") + f", {state}",
             "per GPU, GiB".ljust(28) + "".join(f"stage {s.stage}".rjust(10) for s in stages)]

    def row(label, values):
        lines.append(label.ljust(28) + "".join(v.rjust(10) for v in values))

    row("parameters (B)", [f"{s.params / 1e9:.3f}" for s in stages])
    row("  trained (B)", [f"{s.trained / 1e9:.3f}" for s in stages])
    row("weights", [f"{s.weights / GIB:.1f}" for s in stages])
    row("gradients", [f"{s.gradients / GIB:.1f}" for s in stages])
    row("optimizer", [f"{s.optimizer / GIB:.1f}" for s in stages])
    row("activations (estimate)", [f"{s.activations / GIB:.1f}" for s in stages])
    if any(s.step_copy for s in stages):
        row("step's fp32 gradient copy", [f"{s.step_copy / GIB:.1f}" for s in stages])
    row("total", [f"{s.total / GIB:.1f}" for s in stages])
    peak = max(s.total for s in stages) / GIB
    verdict = "fits" if peak <= FIT_FRACTION * gpu_gib else "does NOT fit"
    lines.append(f"largest stage: {peak:.1f} GiB, {verdict} in {FIT_FRACTION:.0%} of {gpu_gib:.1f} GiB per GPU")
    kept, depth = settings.vision_kept_blocks(arch.vision.depth), arch.vision.depth
    if kept:
        which = "the vision tower keeps its activations" if kept == depth else \
            f"{kept} of the vision tower's {depth} blocks keep their activations"
        lines.append(f"note: {which}, planned for {settings.visual_share:.0%} of each pack's tokens visual")
    if settings.lora:
        lines.append("note: LoRA's frozen vision tower keeps no activations: the estimate is up to 18 % high")
    return "\n".join(lines)
