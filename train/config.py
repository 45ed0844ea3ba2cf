"""`TrainConfig`: every setting of a training job, in sections, one dataclass each.

The sections are `--help`'s groups (`GROUPS`): `DataConfig`, `ModelConfig`, ..., and each part
of the trainer gets only the sections it reads. Every setting is a `shards_schema.flags.setting`
that carries its `--help` line and group, so a new setting cannot reach the command line
undocumented; the flags are generated from the fields (`add_train_flags`). The command line and
a YAML/JSON file (`--config FILE`) mirror each other: a file holds the same keys as the flags,
flat (dashes or underscores), flags given on the command line win. The resolved config is saved
next to every checkpoint in that same flat form (`TrainConfig.to_flat` / `from_flat`), so a run
can be reproduced from it. Each section checks its own settings (`validate`); checks that span
sections are `TrainConfig.validate`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import re
import reprlib
import sys
from dataclasses import dataclass
from pathlib import Path

from shards_schema.errors import UserError
from shards_schema.outdir import refuse_input_as_output
from shards_schema.storage import is_url, redact
from shards_schema.flags import (add_flags, flag_name, flat_paths, from_flat, nested, parse_bool, refuse_bad_location,
                                 setting, to_flat)
from train.model.settings import ATTENTION_KERNELS, FP8_RECIPES, LOSS_PATHS, ConfigError

FREEZABLE = ("vision", "merger", "llm")  # also the parts LoRA adapts or trains fully (train.model.lora)
EVAL_BATCHES = 4  # global batches per evaluation unless --eval-batches says
STATE_DTYPES = ("fp32", "bf16")  # --grad-dtype / --adam-state-dtype
RECOMPUTE = ("none", "selective", "full", "auto")
DEVICES = ("cuda", "cpu")
MEMORY_SNAPSHOT_STACKS = ("all", "python", "none")  # torch's `_record_memory_history` names (none: context=None)
COMMA_LISTS = ("freeze", "lora_targets", "lora_parts", "lora_modules_to_save")  # list settings also given as "a,b"
# A pack (x --micro-batch-packs) longer than this fits no GPU: even with every layer recomputed
# the 2B model keeps 2 x hidden x layers = 112 KiB a token (1.8 TiB here), and the host arrays
# of a padded pack stay below 1 GiB.
MAX_SEQ_LEN = 2**24
INT64_MAX = 2**63 - 1  # counts and seeds end up in int64 arrays, tensors and torch.manual_seed
# integer settings: (smallest, largest)
INT_RANGES = {
    "seq_len": (1, MAX_SEQ_LEN), "micro_batch_packs": (1, MAX_SEQ_LEN), "global_batch_packs": (1, INT64_MAX),
    "global_batch_tokens": (1, INT64_MAX), "max_visual_tokens": (1, INT64_MAX), "seed": (0, INT64_MAX),
    "tp": (1, INT64_MAX), "pp": (1, INT64_MAX), "ep": (1, INT64_MAX), "recompute_layers": (1, INT64_MAX),
    "recompute_vision_blocks": (1, INT64_MAX),
    "gpus": (1, INT64_MAX), "train_steps": (1, INT64_MAX), "warmup_steps": (0, INT64_MAX),
    "exit_interval": (0, INT64_MAX), "eval_every": (0, INT64_MAX), "eval_batches": (1, INT64_MAX),
    "lora_rank": (0, INT64_MAX), "save_every": (0, INT64_MAX), "keep_last": (1, INT64_MAX),
    "log_every": (1, INT64_MAX), "profile_start": (0, INT64_MAX), "profile_steps": (1, INT64_MAX),
}
# float settings: (low, high or None, low excluded, high excluded); every one must be finite
FLOAT_RANGES = {
    "lr": (0, 1, True, False), "min_lr": (0, 1, False, False), "weight_decay": (0, None, False, False),
    "adam_beta1": (0, 1, False, True), "adam_beta2": (0, 1, False, True), "adam_eps": (0, 1, True, False),
    "clip_grad": (0, None, False, False), "moe_aux_loss_coef": (0, None, False, False),
    "gpu_memory_gib": (0, None, True, False), "lora_alpha": (0, None, True, False),
    "lora_dropout": (0, 1, False, True),
}
# why a value is refused, where the range alone does not say it
UPPER_BOUND_REASONS = {
    "seq_len": "a pack that long fits no GPU", "micro_batch_packs": "a micro-batch that long fits no GPU",
    "num_workers": "more loader workers than the CPU cores this process may use only add processes",
    "lr": "AdamW moves every weight by about lr each step", "min_lr": "it is at most --lr",
    "adam_eps": "an epsilon above the gradients' scale turns the update off",
}
# --help shows the flags in these groups, in this order
GROUPS = {
    "data": "what is trained on, and how it is batched",
    "model": "where the weights come from, and what is trained",
    "parallelism": "how the model is split over the GPUs",
    "memory": "precision and the memory / speed trade-offs",
    "optimizer": "AdamW and gradient clipping",
    "schedule": "steps, learning-rate schedule, evaluation",
    "lora": "LoRA: low-rank adapters on a frozen model (PEFT's format)",
    "checkpoints": "the run directory, saving and resuming",
    "logging": "progress line, metrics.jsonl, TensorBoard",
    "profiling": "torch.profiler traces and CUDA memory snapshots under --out/profile",
}


def _why(name: str, value, low) -> str:
    reason = UPPER_BOUND_REASONS.get(name)
    return f" ({reason})" if reason and isinstance(value, (int, float)) and value > low else ""


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# A setting of each kind: its default, its --help group and line. The flag's own default is None
# (not given), so that a --config file's value is kept unless the flag overrides it.
def _int(default, group: str, help_: str):
    return setting(default, help=help_, group=group, flag_default=None, type=int, metavar="N")


def _float(default, group: str, help_: str):
    return setting(default, help=help_, group=group, flag_default=None, type=float, metavar="X")


def _bool(default, group: str, help_: str):
    return setting(default, help=help_, group=group, flag_default=None, type=parse_bool, nargs="?", const=True,
                   metavar="BOOL")


def _text(default, group: str, help_: str):
    return setting(default, help=help_, group=group, flag_default=None)


def _list(group: str, help_: str):
    """A repeatable setting (a fresh [] per config)."""
    return setting(default_factory=list, help=help_, group=group, flag_default=None, action="append",
                   metavar="VALUE")


def _check_numbers(section) -> None:
    """Every numeric setting of `section` within its range (`INT_RANGES`, `FLOAT_RANGES`); floats finite."""
    names = {f.name for f in dataclasses.fields(section)}
    ranges = {**INT_RANGES, "num_workers": (0, max(2, _usable_cores()))}
    for name, (low, high) in ranges.items():
        value = getattr(section, name) if name in names else None
        if value is not None and value < low:
            raise ConfigError(f"{flag_name(name)} must be >= {low}, got {value}")
        if value is not None and value > high:
            raise ConfigError(f"{flag_name(name)} must be <= {high}, got {value}{_why(name, value, low)}")
    for name, (low, high, open_low, open_high) in FLOAT_RANGES.items():
        value = getattr(section, name) if name in names else None
        if value is None:
            continue
        above = value > low if open_low else value >= low
        below = high is None or (value < high if open_high else value <= high)
        if not (math.isfinite(value) and above and below):
            if high is None:
                bounds = f"a finite number {'>' if open_low else '>='} {low}"
            else:
                bounds = f"in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
            raise ConfigError(f"{flag_name(name)} must be {bounds}, got {value}{_why(name, value, low)}")


def _check_choices(section, choices: dict) -> None:
    for name, allowed in choices.items():
        if getattr(section, name) not in allowed:
            raise ConfigError(f"{flag_name(name)} {getattr(section, name)!r}: choose from {list(allowed)}")


def _check_parts(section, name: str) -> None:
    bad = sorted(set(getattr(section, name)) - set(FREEZABLE))
    if bad:
        raise ConfigError(f"{flag_name(name)} {','.join(bad)}: choose from {','.join(FREEZABLE)}")


@dataclass
class DataConfig:
    """What is trained on, and how it is batched (the loader's settings)."""

    data: list[str] = _list("data", "shard directory or WebDataset export to train on, DIR or DIR:WEIGHT "
                                    "(repeatable); an s3:// / gs:// / hf:// URL is fetched into --data-cache first")
    eval_data: list[str] = _list("data", "held-out shard directory for --eval-every (repeatable)")
    data_cache: str | None = _text(None, "data", "local directory for copies of --data / --eval-data sources on "
                                                  "object stores (s3://, gs://, hf://), fetched and sha256-checked "
                                                  "before training (default: OUT/data_cache)")
    seq_len: int = _int(8192, "data", "tokens per pack (default 8192)")
    global_batch_packs: int | None = _int(None, "data", "packs per optimizer step, a multiple of dp x --micro-batch-packs "
                                                        "(default: dp x --micro-batch-packs)")
    global_batch_tokens: int | None = _int(None, "data", "alternative to --global-batch-packs: tokens per step, "
                                                         "rounded to whole packs of --seq-len")
    micro_batch_packs: int = _int(1, "data", "packs laid end to end in one forward pass (default 1)")
    pad_packs: bool | None = _bool(None, "data", "pad every pack to exactly --seq-len rows, so that the compiled "
                                                 "decoder layers see one fixed shape and Inductor writes fixed-shape "
                                                 "kernels (FP8's casts and scale reductions gain most); costs the "
                                                 "packs' empty rows (the fill `vlmpack pack` reports). Default: on with "
                                                 "--fp8 and with --pp > 1 (which needs it), else off")
    max_visual_tokens: int | None = _int(None, "data", "at most this many visual tokens per pack (default: no limit)")
    num_workers: int = _int(2, "data", "loader worker processes per rank (0: load in the training process; default 2)")
    seed: int = _int(0, "data", "seed of the pack order, data mixing and a random init (default 0)")

    def validate(self) -> None:
        _check_numbers(self)
        for flag, specs in (("--data", self.data), ("--eval-data", self.eval_data), ("--data-cache", [self.data_cache])):
            for spec in specs:
                refuse_bad_location(flag, spec, "give a shard directory's path" if flag != "--data-cache" else
                                    "give a local directory, or leave the flag out")
        if self.data_cache and is_url(self.data_cache):  # Path() would fold it into a local directory `s3:/...`
            raise ConfigError(f"--data-cache {redact(self.data_cache)} is a URL: the cache is a local directory the "
                              "store's sources are fetched into; give a local path (or drop it for OUT/data_cache)")
        if self.data_cache and self.data and not any(is_url(s) for s in self.data + self.eval_data):
            raise ConfigError(f"--data-cache {self.data_cache} holds copies of object-store sources (s3://, gs://, "
                              "hf://), and every --data / --eval-data here is local, so it would change nothing: "
                              "drop it")
        if self.seq_len * self.micro_batch_packs > MAX_SEQ_LEN:
            raise ConfigError(f"--micro-batch-packs {self.micro_batch_packs} x --seq-len {self.seq_len} rows in one "
                              f"forward pass: at most {MAX_SEQ_LEN} fit any GPU; lower --micro-batch-packs")
        if self.global_batch_packs is not None and self.global_batch_tokens is not None:
            raise ConfigError("give --global-batch-packs or --global-batch-tokens, not both")
        if self.global_batch_tokens is not None and round(self.global_batch_tokens / self.seq_len) < 1:
            raise ConfigError(f"--global-batch-tokens {self.global_batch_tokens} rounds to no pack of --seq-len "
                              f"{self.seq_len}: give at least {self.seq_len // 2 + 1} (one pack), or a shorter "
                              "--seq-len")

    def global_packs(self, dp: int) -> int:
        """Packs per global batch; a multiple of dp * micro_batch_packs."""
        if self.global_batch_packs is not None:
            packs = self.global_batch_packs
        elif self.global_batch_tokens is not None:
            packs = round(self.global_batch_tokens / self.seq_len)
        else:
            packs = dp * self.micro_batch_packs
        unit = dp * self.micro_batch_packs
        if packs % unit:
            raise ConfigError(f"global batch of {packs} packs is not a multiple of dp ({dp}) x --micro-batch-packs "
                              f"({self.micro_batch_packs}) = {unit}")
        return packs


@dataclass
class ModelConfig:
    """Where the weights come from, and what is trained (model setup's settings)."""

    # exactly one of hf_model (import on the fly), init (Megatron dir), arch (random init)
    hf_model: str | None = _text(None, "model", "start from this Hugging Face Qwen-VL checkpoint directory")
    init: str | None = _text(None, "model", "start from this Megatron model directory (`vlmpack import-hf`, or a "
                                            "checkpoint's model/)")
    arch: str | None = _text(None, "model", "start from random weights of this built-in architecture (e.g. tiny)")
    freeze: list[str] = _list("model", f"parts not trained: {', '.join(FREEZABLE)} (repeatable or comma-separated)")
    attention: str = _text("auto", "model", "CUDA attention kernel: fa2 (torch's own), fa4 (flash-attn-4, "
                                            "Hopper/Blackwell) or auto (default): fa4 where it runs, else fa2")
    loss: str = _text("chunked", "model", "how the output layer's loss is made: chunked (default; each chunk of logits "
                                          "made again in the backward) or fused (--tp 1: its gradients made in the "
                                          "forward, no logits made twice)")
    moe_aux_loss_coef: float = _float(0.0, "model", "Mixture-of-Experts models: weight of the router's load-balancing "
                                                     "loss (HF's router_aux_loss_coef, e.g. 0.001; default 0, as HF "
                                                     "trains without output_router_logits)")
    compile: bool = _bool(True, "model", "torch.compile the vision blocks and rotary kernels, CUDA only (default true)")
    fp8: str | None = _text(None, "model", "run the decoder layers' linear GEMMs in FP8 with this torchao float8 "
                                           "recipe: tensorwise, rowwise or rowwise_with_gw_hp (pip install -e "
                                           "'.[fp8]'; an sm89+ GPU; CPU runs emulate it). Default: bf16")
    compile_decoder: bool = _bool(True, "model", "with --compile: also torch.compile each dense language-model decoder "
                                                 "layer as one graph, norms, residual adds and casts fused around the "
                                                 "GEMMs (default true)")

    def validate(self) -> None:
        if sum(s is not None for s in (self.hf_model, self.init, self.arch)) != 1:
            raise ConfigError("give exactly one model source: --hf-model DIR, --init MEGATRON_DIR or --arch NAME")
        _check_numbers(self)
        _check_parts(self, "freeze")
        _check_choices(self, {"attention": ATTENTION_KERNELS, "loss": LOSS_PATHS,
                              **({"fp8": FP8_RECIPES} if self.fp8 is not None else {})})

    def check_arch_name(self) -> None:
        """--arch names a built-in architecture. Their table is the family modules', which load
        torch and megatron-core (seconds): checked after every other flag."""
        if self.arch is not None:
            from train.model.arch import builtin_arch_names

            if self.arch not in builtin_arch_names():
                raise ConfigError(f"unknown --arch {self.arch!r}: choose one of {builtin_arch_names()}")


@dataclass
class ParallelismConfig:
    """How the model is split over the GPUs."""

    tp: int = _int(1, "parallelism", "tensor-parallel size (divides the attention and KV heads; default 1)")
    pp: int = _int(1, "parallelism", "pipeline-parallel size (divides the decoder layers; default 1)")
    ep: int = _int(1, "parallelism", "expert-parallel size of a Mixture-of-Experts model: each group of ep "
                                     "ranks of a pipeline stage divides the experts, the ranks of a TP group "
                                     "first (divides the experts and gpus / pp; default 1)")
    sequence_parallel: bool | None = _bool(None, "parallelism", "with --tp > 1, each TP rank holds only its slice "
                                           "of the rows outside the attention and MLP GEMMs (megatron's sequence "
                                           "parallelism: less activation memory; packs are padded to a multiple of "
                                           "--tp). Default: on for Mixture-of-Experts models, which need it, off "
                                           "for dense ones")
    distributed_optimizer: bool = _bool(True, "parallelism", "shard the optimizer state over data-parallel ranks "
                                                             "(megatron's DistributedOptimizer, CUDA only; default true)")
    device: str | None = _text(None, "parallelism", "cuda or cpu (default: cuda when available)")

    def validate(self) -> None:
        _check_numbers(self)
        if self.device is not None:
            _check_choices(self, {"device": DEVICES})


# one line for --attention fa4 on a CPU run, whether the config names the device or the machine has no GPU
FA4_ON_CPU = ("--attention fa4 runs on a CUDA GPU (Hopper or Blackwell); a CPU run computes attention exactly with a "
              "masked kernel: drop --attention fa4 (or give auto)")


@dataclass
class MemoryConfig:
    """Precision and the memory / speed trade-offs."""

    # bf16 halves the gradient buffers (accumulated and reduced in bf16, megatron's own default;
    # bf16 runs only) / the Adam moments (stochastically rounded, train/adamw_bf16_state.py)
    bf16: bool = _bool(True, "memory", "bf16 weights and compute on GPU (CPU runs are fp32; default true)")
    recompute: str = _text("none", "memory", "activation recompute of the language model: none, selective, full, "
                                             "or auto: none if the memory plan fits the GPU (--gpu-memory-gib), "
                                             "else the fewest first vision blocks, up to the whole tower, else full "
                                             "for the fewest first layers per stage that make it fit (default none)")
    recompute_layers: int | None = _int(None, "memory", "with --recompute full: recompute only the first N decoder "
                                                        "layers per pipeline stage")
    recompute_vision: bool | None = _bool(None, "memory", "recompute the vision blocks in backward "
                                                          "(default: with --recompute full)")
    recompute_vision_blocks: int | None = _int(None, "memory", "where the vision blocks are recomputed: only the "
                                                               "first N of them (default: all)")
    recompute_mlp_activations: bool | None = _bool(
        None, "memory", "recompute each compiled MLP activation's output (SwiGLU, GELU) in backward instead of keeping "
                        "it: 2-2.5 bytes per unit of MLP width per token and layer saved for one pointwise pass "
                        "(default true; --recompute auto keeps them where the whole run then fits without recompute)")
    dry_run: bool = _bool(False, "memory", "print the predicted memory per GPU and the smallest layout that "
                                           "fits with the flags that launch it, then exit (exit code 1 when no "
                                           "layout fits)")
    gpus: int | None = _int(None, "memory", "with --dry-run: plan for this many GPUs (default: the launch's)")
    gpu_memory_gib: float | None = _float(None, "memory", "memory of one GPU that --dry-run and --recompute auto plan "
                                                          "for (default: this GPU's, else 80); a smaller figure than "
                                                          "the GPU's makes auto recompute more and leave the rest free")
    grad_dtype: str = _text("fp32", "memory", "gradient buffers: fp32 or bf16 (half the memory, bf16 runs; default fp32)")
    adam_state_dtype: str = _text("fp32", "memory", "Adam moments: fp32 or bf16 (stochastically rounded; default fp32)")
    master_weights: str = _text("fp32", "memory", "weights the optimizer updates: fp32 (an fp32 copy of every bf16 "
                                                  "weight, 4 bytes a trained parameter) or bf16 (the bf16 weights "
                                                  "themselves, updated with stochastic rounding: saves those 4 bytes, "
                                                  "at some accuracy risk in long runs; full fine-tuning with --bf16 "
                                                  "and the distributed optimizer only; default fp32)")

    def validate(self) -> None:
        _check_numbers(self)
        _check_choices(self, {"recompute": RECOMPUTE, "grad_dtype": STATE_DTYPES, "adam_state_dtype": STATE_DTYPES,
                              "master_weights": STATE_DTYPES})
        if self.recompute_layers is not None and self.recompute != "full":
            raise ConfigError(f"--recompute-layers {self.recompute_layers} needs --recompute full and a value >= 1 "
                              f"(the decoder layers per pipeline stage whose activations are recomputed)")
        if self.recompute_vision_blocks is not None:
            if self.recompute == "auto":
                raise ConfigError(f"--recompute-vision-blocks {self.recompute_vision_blocks} with --recompute auto: "
                                  "auto picks the vision blocks itself; drop --recompute-vision-blocks")
            if not (self.recompute_vision or (self.recompute_vision is None and self.recompute == "full")):
                raise ConfigError(f"--recompute-vision-blocks {self.recompute_vision_blocks} needs the vision blocks "
                                  "recomputed: add --recompute-vision true (or --recompute full)")
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if self.gpus is not None and not self.dry_run and self.gpus != launched:
            # --recompute auto would plan for the wrong data-parallel size
            raise ConfigError(f"--gpus {self.gpus} plans a --dry-run; this run is launched on {launched} GPU(s) "
                              "(WORLD_SIZE) and plans for those: add --dry-run, or drop --gpus")


@dataclass
class AdamWConfig:
    """AdamW and gradient clipping (the optimizer builder's settings)."""

    lr: float = _float(1e-5, "optimizer", "peak learning rate (default 1e-5)")
    min_lr: float = _float(0.0, "optimizer", "learning rate at the end of the cosine decay (default 0)")
    weight_decay: float = _float(0.0, "optimizer", "AdamW weight decay (default 0)")
    adam_beta1: float = _float(0.9, "optimizer", "AdamW beta1 (default 0.9)")
    adam_beta2: float = _float(0.95, "optimizer", "AdamW beta2 (default 0.95)")
    adam_eps: float = _float(1e-8, "optimizer", "AdamW epsilon (default 1e-8)")
    clip_grad: float = _float(1.0, "optimizer", "clip the global gradient norm to this (0: no clipping; default 1.0)")

    def validate(self) -> None:
        _check_numbers(self)
        if self.min_lr > self.lr:
            raise ConfigError(f"--min-lr {self.min_lr} must not exceed --lr {self.lr} (the cosine decays from --lr "
                              "down to --min-lr)")
        if self.lr * self.weight_decay >= 1:
            raise ConfigError(f"--weight-decay {self.weight_decay} with --lr {self.lr}: AdamW scales every weight by "
                              f"1 - lr x weight decay each step, here {1 - self.lr * self.weight_decay:g}, which zeroes "
                              "or flips it; lower --weight-decay")


@dataclass
class ScheduleConfig:
    """Steps, learning-rate schedule, evaluation."""

    train_steps: int = _int(100, "schedule", "optimizer steps of the whole run (default 100)")
    warmup_steps: int = _int(0, "schedule", "linear learning-rate warm-up steps, then cosine decay (default 0)")
    extend_schedule: bool = _bool(False, "schedule", "with --resume and a --train-steps other than the checkpoint's: "
                                                     "continue the learning rate from the checkpoint's step on a cosine "
                                                     "from its value there down to --min-lr at the new --train-steps "
                                                     "(default false: such a resume is refused)")
    exit_interval: int = _int(0, "schedule", "save and exit once the step is a multiple of this, for scheduler time "
                                             "slots (0: off; default 0)")
    eval_every: int = _int(0, "schedule", "evaluate on --eval-data every N steps (0: never; default 0)")
    eval_batches: int | None = _int(None, "schedule", "global batches per evaluation, with --eval-every (default 4)")

    def eval_global_batches(self) -> int:
        return EVAL_BATCHES if self.eval_batches is None else self.eval_batches

    def validate(self) -> None:
        _check_numbers(self)
        # a config saved before --eval-batches had no default of its own holds 4: read as unset
        if self.eval_batches not in (None, EVAL_BATCHES) and not self.eval_every:
            raise ConfigError(f"--eval-batches {self.eval_batches} sizes the evaluations of --eval-every N, and this "
                              "run has none: add --eval-every N (and --eval-data DIR), or drop --eval-batches")
        if self.warmup_steps >= self.train_steps:
            raise ConfigError(f"--warmup-steps {self.warmup_steps} must be smaller than --train-steps {self.train_steps}")


@dataclass
class LoraConfig:
    """LoRA: low-rank adapters on a frozen model."""

    # train/model/lora.py: adapters on the chosen linears, everything else frozen
    lora_rank: int = _int(0, "lora", "train LoRA adapters of this rank on a frozen model (0: full fine-tuning; "
                                     "default 0)")
    lora_alpha: float | None = _float(None, "lora", "adapter outputs are scaled by alpha / rank (default 2 x --lora-rank)")
    lora_dropout: float = _float(0.0, "lora", "dropout on the adapters' input (default 0)")
    lora_rslora: bool = _bool(False, "lora", "rank-stabilized: scale by alpha / sqrt(rank) (PEFT's use_rslora)")
    lora_dora: bool = _bool(False, "lora", "DoRA: a trained magnitude per row (PEFT's use_dora)")
    lora_targets: list[str] = _list("lora", "linear modules that get adapters, named as in PEFT's target_modules "
                                            "(q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj; vision: "
                                            "attn.qkv,attn.proj,...) or all-linear (default all-linear: every "
                                            "linear of --lora-parts)")
    lora_parts: list[str] = _list("lora", f"parts whose linears get adapters: {', '.join(FREEZABLE)} "
                                          "(default llm)")
    lora_modules_to_save: list[str] = _list("lora", "parts trained fully beside the adapters and saved with "
                                                    "them (PEFT's modules_to_save): vision, merger")
    init_lora: str | None = _text(None, "lora", "start the adapters from this PEFT adapter directory "
                                                "(adapter_config.json + adapter_model.safetensors)")

    def validate(self) -> None:
        _check_numbers(self)
        _check_parts(self, "lora_parts")
        lora_flags = [flag_name(n) for n in ("lora_alpha", "lora_dropout", "lora_rslora", "lora_dora", "lora_targets",
                                             "lora_parts", "lora_modules_to_save", "init_lora")
                      if getattr(self, n) not in (None, [], False, 0.0)]
        if self.lora_rank == 0:
            if lora_flags:
                raise ConfigError(f"{', '.join(lora_flags)} {'sets' if len(lora_flags) == 1 else 'set'} up LoRA "
                                  "adapters, which --lora-rank R (e.g. 16) turns on: give it too")
            return
        if self.lora_dora and self.lora_dropout:
            raise ConfigError(f"--lora-dora with --lora-dropout {self.lora_dropout}: DoRA here takes no dropout "
                              "(it would need a second pass of the base layer); drop one of them")
        bad = sorted(set(self.lora_modules_to_save) - {"vision", "merger"})
        if bad:
            raise ConfigError(f"--lora-modules-to-save {','.join(bad)}: choose from vision,merger")
        both = sorted(set(self.trained_parts()) & set(self.lora_modules_to_save))
        if both:
            raise ConfigError(f"{both} given to both --lora-parts and --lora-modules-to-save: a part gets adapters or "
                              "is trained fully, not both")

    def trained_parts(self) -> list[str]:
        """The parts that get adapters (--lora-parts, default llm)."""
        return self.lora_parts or ["llm"]

    def spec(self):
        """The run's `LoraSpec`, None for full fine-tuning."""
        if not self.lora_rank:
            return None
        from train.model.lora import ALL_LINEAR, LoraSpec

        return LoraSpec(rank=self.lora_rank, alpha=self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank,
                        dropout=self.lora_dropout, targets=tuple(self.lora_targets or [ALL_LINEAR]),
                        parts=tuple(p for p in ("llm", "vision", "merger") if p in self.trained_parts()),
                        modules_to_save=tuple(p for p in ("vision", "merger") if p in self.lora_modules_to_save),
                        rslora=self.lora_rslora, dora=self.lora_dora)


@dataclass
class CheckpointsConfig:
    """The run directory, saving and resuming."""

    out: str = _text("runs/train", "checkpoints", "run directory: checkpoints/, metrics.jsonl, tensorboard/ "
                                                  "(one job at a time; default runs/train)")
    save_every: int = _int(0, "checkpoints", "save a checkpoint every N steps (0: only at the end; default 0)")
    save_final: bool = _bool(True, "checkpoints", "save a checkpoint at the last step (default true)")
    keep_last: int = _int(3, "checkpoints", "keep the newest N checkpoints, delete older ones once a new one is "
                                            "complete (>= 1; default 3)")
    async_save: bool = _bool(True, "checkpoints", "write checkpoints in the background while training goes on "
                                                  "(default true)")
    resume: bool = _bool(False, "checkpoints", "continue from the newest checkpoint in --out (default false)")
    export_hf: str | None = _text(None, "checkpoints", "after the last step, export the model to this Hugging Face "
                                                       "directory (a LoRA run: its adapters, in PEFT's format)")

    def validate(self) -> None:
        refuse_bad_location("--out", self.out, "give the run directory")
        refuse_bad_location("--export-hf", self.export_hf, "give the export directory, or leave the flag out")
        _check_numbers(self)


@dataclass
class LoggingConfig:
    """Progress line, metrics.jsonl, TensorBoard, Weights & Biases (the logger's settings)."""

    log_every: int = _int(1, "logging", "log every N steps (default 1)")
    tensorboard: bool = _bool(True, "logging", "write TensorBoard scalars under --out/tensorboard (default true)")
    wandb_project: str | None = _text(None, "logging", "also log the scalars to this Weights & Biases project "
                                                    "(pip install wandb; WANDB_MODE=offline logs to --out/wandb only)")
    wandb_run_name: str | None = _text(None, "logging", "the Weights & Biases run's name (default: the --out "
                                                     "directory's name)")

    def validate(self) -> None:
        if self.wandb_run_name and not self.wandb_project:
            raise ConfigError(f"--wandb-run-name {self.wandb_run_name!r} needs --wandb-project NAME")
        if self.wandb_project and importlib.util.find_spec("wandb") is None:
            raise ConfigError(f"--wandb-project {self.wandb_project!r} needs Weights & Biases: pip install wandb "
                              "(or vlmpack's [wandb] extra)")
        _check_numbers(self)


@dataclass
class ProfilingConfig:
    """torch.profiler traces and CUDA memory snapshots (`train.profiling`'s settings)."""

    profile_start: int = _int(0, "profiling", "profile steps N .. N+K-1 (1-based; K: --profile-steps) under "
                                             "torch.profiler, each written as a Chrome trace to "
                                             "--out/profile/step_N_rank_R.json (0: off; default 0)")
    profile_steps: int | None = _int(None, "profiling", "with --profile-start: how many steps to profile "
                                                        "(default 1)")
    memory_snapshot: bool = _bool(False, "profiling", "record every CUDA allocation from the first step and write "
                                                      "the snapshot to --out/profile/ after the last profiled step "
                                                      "(step 1 without --profile-start), for pytorch.org/memory_viz "
                                                      "(default false)")
    memory_snapshot_stacks: str = _text("all", "profiling", "with --memory-snapshot: the stack recorded with each "
                                                            "allocation, as torch names it: all (Python and C++), "
                                                            "python, or none (each block's size and order only; "
                                                            "torch 2.11 fails to record stacks while compiled layers "
                                                            "are recomputed) (default all)")

    def validate(self) -> None:
        _check_numbers(self)
        _check_choices(self, {"memory_snapshot_stacks": MEMORY_SNAPSHOT_STACKS})
        if self.memory_snapshot_stacks != "all" and not self.memory_snapshot:
            raise ConfigError(f"--memory-snapshot-stacks {self.memory_snapshot_stacks} says what --memory-snapshot "
                              "records: add --memory-snapshot, or drop --memory-snapshot-stacks")
        if self.profile_steps is not None and not self.profile_start:
            raise ConfigError(f"--profile-steps {self.profile_steps} counts the steps profiled from --profile-start N: "
                              "add it, or drop --profile-steps")


@dataclass
class TrainConfig:
    """The whole job: one section per `--help` group. Flags and file keys are the settings' own
    names, without the section (`--seq-len`, not `--data-seq-len`)."""

    data: DataConfig = nested(default_factory=DataConfig)
    model: ModelConfig = nested(default_factory=ModelConfig)
    parallelism: ParallelismConfig = nested(default_factory=ParallelismConfig)
    memory: MemoryConfig = nested(default_factory=MemoryConfig)
    optimizer: AdamWConfig = nested(default_factory=AdamWConfig)
    schedule: ScheduleConfig = nested(default_factory=ScheduleConfig)
    lora: LoraConfig = nested(default_factory=LoraConfig)
    checkpoints: CheckpointsConfig = nested(default_factory=CheckpointsConfig)
    logging: LoggingConfig = nested(default_factory=LoggingConfig)
    profiling: ProfilingConfig = nested(default_factory=ProfilingConfig)

    def sections(self) -> list:
        """The section dataclasses, in --help's order."""
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def validate(self) -> None:
        """Each section's own checks, then those that span sections."""
        self.logging.validate()
        self.model.validate()
        if not self.data.data and not self.memory.dry_run:
            raise ConfigError("give at least one --data DIR[:WEIGHT]")
        for section in (self.data, self.parallelism, self.memory, self.optimizer, self.schedule, self.checkpoints,
                        self.profiling):
            section.validate()
        if self.schedule.eval_every and not self.data.eval_data:
            raise ConfigError(f"--eval-every {self.schedule.eval_every} needs held-out data to evaluate on: add "
                              "--eval-data DIR, or drop --eval-every")
        if self.data.eval_data and not self.schedule.eval_every:
            raise ConfigError("--eval-data is evaluated only with --eval-every N (every N steps): add it, or drop "
                              "--eval-data")
        if not self.memory.dry_run:
            self._refuse_outputs_inside_the_data()
        if self.schedule.extend_schedule and not self.checkpoints.resume:
            raise ConfigError("--extend-schedule continues a checkpoint's learning-rate schedule: it needs --resume")
        self.lora.validate()
        if self.parallelism.device == "cpu" and self.model.attention == "fa4":
            raise ConfigError(FA4_ON_CPU)
        memory = self.memory
        if memory.gpu_memory_gib is not None and not memory.dry_run and memory.recompute != "auto":
            raise ConfigError(f"--gpu-memory-gib {memory.gpu_memory_gib:g} sizes the memory plan of --dry-run and "
                              "--recompute auto; this run has neither, so it would change nothing: add --recompute "
                              "auto, or drop --gpu-memory-gib")
        if not memory.bf16 and (memory.dry_run or memory.recompute == "auto"):
            # the plan counts 2 bytes a weight and is fitted to bf16 peaks: an fp32 run's would be half its size
            raise ConfigError(f"--bf16 false with {'--dry-run' if memory.dry_run else '--recompute auto'}: the memory "
                              "plan sizes bf16 runs only (fp32 weights and activations take about twice its figures); "
                              "drop --bf16 false, or choose --recompute none|full yourself")
        if memory.recompute_mlp_activations and not self.model.compile:
            raise ConfigError("--recompute-mlp-activations true acts in compiled layers, and --compile false compiles "
                              "none (eager layers keep the activations' outputs): drop one of them")
        if self.profiling.profile_start > self.schedule.train_steps:
            raise ConfigError(f"--profile-start {self.profiling.profile_start} is past --train-steps "
                              f"{self.schedule.train_steps}: nothing would be profiled; give a step of the run")
        if self.parallelism.sequence_parallel and self.parallelism.tp == 1:
            raise ConfigError("--sequence-parallel true splits the rows over the ranks of a TP group: with --tp 1 "
                              "there is none; drop it, or give --tp N")
        frozen_by = "--freeze vision" if not self.lora.lora_rank else \
            "LoRA (the tower is in neither --lora-parts nor --lora-modules-to-save)"
        if "vision" in self.frozen_parts() and (self.memory.recompute_vision or
                                                self.memory.recompute_vision_blocks is not None):
            # a frozen tower keeps no activations for a backward: there is nothing to recompute
            given = ("--recompute-vision true" if self.memory.recompute_vision else
                     f"--recompute-vision-blocks {self.memory.recompute_vision_blocks}")
            raise ConfigError(f"{given} recomputes the vision blocks in backward, and {frozen_by} gives them none: "
                              f"drop {given.split()[0]}")
        if self.model.fp8 is not None and (self.lora.lora_rank or "llm" in self.model.freeze):
            raise ConfigError(f"--fp8 {self.model.fp8} runs the trained decoder linears' GEMMs in FP8, and "
                              f"{'--freeze llm' if not self.lora.lora_rank else 'LoRA'} leaves the decoder's linears "
                              "frozen (they stay bf16), so it would change nothing: drop --fp8")
        if not self.lora.lora_rank and set(FREEZABLE) <= set(self.model.freeze):
            raise ConfigError(f"--freeze {','.join(FREEZABLE)} freezes every part of the model: nothing would be "
                              "trained; drop one of them (or train adapters with --lora-rank R)")
        if self.lora.lora_rank:
            trained = set(self.lora.trained_parts()) | set(self.lora.lora_modules_to_save)
            frozen = sorted(set(self.model.freeze) & trained)
            if frozen:
                raise ConfigError(f"--freeze {','.join(frozen)}: those parts are trained (--lora-parts / --lora-modules-to-save); "
                                  "with LoRA every other part is frozen already")
            if self.model.freeze:
                raise ConfigError(f"--freeze {','.join(self.model.freeze)} with --lora-rank: LoRA freezes every part "
                                  "outside --lora-parts and --lora-modules-to-save already, so it would change nothing: "
                                  "drop --freeze")
        if self.memory.master_weights == "bf16":
            self._validate_bf16_master_weights()
        if self.memory.grad_dtype == "bf16" and not self.memory.bf16:
            # megatron's gradient buffers take the weights' dtype unless they reduce in fp32
            raise ConfigError("--grad-dtype bf16 with --bf16 false: the gradients take the weights' dtype, fp32 here; "
                              "drop --grad-dtype bf16 or --bf16 false")
        if self.data.pad_packs is False and self.parallelism.pp > 1:
            raise ConfigError(f"--pad-packs false with --pp {self.parallelism.pp}: the pipeline schedule sends packs of "
                              "one shape, so they are padded to --seq-len; drop --pad-packs false or use --pp 1")
        self.model.check_arch_name()

    def _refuse_outputs_inside_the_data(self) -> None:
        """--out and --export-hf write files a source directory's readers never expect (a shard
        directory is checked file by file, and its verify would fail)."""
        from train.pack_plan import parse_source

        outputs = [("--out", self.checkpoints.out), ("--export-hf", self.checkpoints.export_hf)]
        for spec in (*self.data.data, *self.data.eval_data):
            directory, _ = parse_source(spec)
            if is_url(directory):
                continue
            for flag, out in outputs:
                if out and not is_url(out):
                    refuse_input_as_output(out, directory, flag)

    def _validate_bf16_master_weights(self) -> None:
        """--master-weights bf16 drops the fp32 copy of weights that are bf16 and fully trained."""
        if self.lora.lora_rank:
            raise ConfigError(f"--master-weights bf16 with --lora-rank {self.lora.lora_rank}: LoRA trains only the "
                              "adapters (and --lora-modules-to-save), whose fp32 master weights are small; the frozen "
                              "base has none; drop --master-weights bf16")
        if not self.memory.bf16:
            raise ConfigError("--master-weights bf16 with --bf16 false: fp32 weights have no fp32 copy to drop; "
                              "drop --master-weights bf16 or --bf16 false")
        if not self.parallelism.distributed_optimizer:
            raise ConfigError("--master-weights bf16 with --distributed-optimizer false: the bf16 update is built on "
                              "the distributed optimizer (it still shards the Adam moments over data-parallel ranks); "
                              "drop --distributed-optimizer false")

    def frozen_parts(self) -> set[str]:
        """The parts that get no gradient at all: --freeze's, or with LoRA those neither adapted
        nor trained fully."""
        if self.lora.lora_rank:
            return set(FREEZABLE) - set(self.lora.trained_parts()) - set(self.lora.lora_modules_to_save)
        return set(self.model.freeze)

    def packs_padded(self) -> bool:
        """Every pack padded to exactly seq_len rows (--pad-packs, resolved)."""
        pad = self.data.pad_packs
        return pad if pad is not None else self.model.fp8 is not None or self.parallelism.pp > 1

    def to_flat(self) -> dict:
        """Every setting under its flag's name (underscored), in `--help`'s order: the form of a
        --config file and of the config a checkpoint saves."""
        return to_flat(self)

    @classmethod
    def from_flat(cls, values: dict) -> TrainConfig:
        """The config of flat `values` (`to_flat`'s form, dashes or underscores; settings not in
        it: their defaults), not validated. ConfigError naming keys that are no setting."""
        values = {k.replace("-", "_"): v for k, v in values.items()}
        unknown = sorted(set(values) - set(flat_paths(cls)))
        if unknown:
            raise ConfigError(f"unknown settings {unknown}: use the names of `vlmpack train` flags")
        return from_flat(cls, values)


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    """`--config FILE` and one flag per setting (lists repeatable), in its group; defaults left to the dataclasses."""
    parser.add_argument("--config", metavar="FILE", help="YAML or JSON file with the same keys as these flags "
                                                         "(flags given here win)")
    add_flags(parser, TrainConfig, GROUPS)


def read_text_file(path: str | Path, flag: str, what: str) -> str:
    """The text of the file a user named with `flag` (`--config FILE`); UserError naming it and
    `what` to pass instead when it is a directory, not a regular file (a FIFO or a device would
    block the read, or never end), unreadable, or not UTF-8."""
    if Path(path).is_dir():
        raise UserError(f"{flag} {path} is a directory: pass {what}")
    if Path(path).exists() and not Path(path).is_file():
        raise UserError(f"{flag} {path} is not a regular file: pass {what}")
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{flag} {path} is not UTF-8 text: pass {what}") from None
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot read it ({exc.strerror}): pass {what}") from None


def _refuse_repeated(path, keys: list) -> None:
    """ConfigError for a setting a --config file gives twice: the same key, or its two spellings
    (`seq-len` and `seq_len`), of which the parsers would silently keep the last."""
    seen: dict[str, object] = {}
    for key in keys:
        if not isinstance(key, str):
            continue  # refused by name once parsed (`load_config_file`)
        name = key.replace("-", "_")
        if name in seen:
            spellings = f"as {seen[name]!r} and {key!r}" if seen[name] != key else f"as {key!r} twice"
            raise ConfigError(f"--config {path}: {name} is given {spellings}: keep one")
        seen[name] = key


def load_config_file(path: str | Path) -> dict:
    """The settings of a --config file (YAML or JSON), keyed by their underscored names."""
    text = read_text_file(path, "--config", "a YAML or JSON file")
    if str(path).endswith((".yaml", ".yml")):
        import yaml

        class Loader(yaml.SafeLoader):
            """safe_load, refusing a key given twice in a mapping."""

        def mapping(loader, node):
            own = [key for key, _ in node.value if key.tag != "tag:yaml.org,2002:merge"]  # `<<:` may be overridden
            _refuse_repeated(path, [loader.construct_object(key, deep=True) for key in own])
            return loader.construct_mapping(node, deep=True)

        Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
        kind, parse, bad_syntax = "YAML", lambda t: yaml.load(t, Loader=Loader), yaml.YAMLError
    else:
        def mapping(pairs: list) -> dict:
            _refuse_repeated(path, [key for key, _ in pairs])
            return dict(pairs)

        kind, parse, bad_syntax = "JSON", lambda t: json.loads(t, object_pairs_hook=mapping), ValueError
    try:
        values = parse(text)
    except ConfigError:
        raise
    except bad_syntax as exc:
        named = "" if kind == "YAML" else " (a name ending in .yaml or .yml is read as YAML, any other as JSON)"
        raise ConfigError(f"--config {path}: not valid {kind} ({str(exc).splitlines()[0]}): fix the file{named}") from None
    if values is None or values == {}:  # an empty file, or one of comments only
        raise ConfigError(f"--config {path} holds no settings: write them as `name: value` lines (the flags' names), "
                          "or drop --config")
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path}: expected a mapping of settings, got {type(values).__name__}")
    named = [k for k in values if not isinstance(k, str)]
    if named:
        raise ConfigError(f"--config {path}: unknown settings {_shown(named)}: use the names of `vlmpack train` flags")
    return {k.replace("-", "_"): v for k, v in values.items()}


def _file_value(path, name: str, value):
    """A --config file's value as its flag would give it: YAML reads `1e-5` (no dot) as a
    string and `1.0e3` as a float, so numbers written either way are taken; anything else
    that is not of the setting's type is refused by name."""
    kind = {f.name: str(f.type) for section in TrainConfig().sections() for f in dataclasses.fields(section)}[name]
    try:
        if kind.startswith("list"):
            items = value if isinstance(value, list) else [value]
            if all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in items):
                return [str(v) for v in items]
        elif kind.startswith("bool"):
            if isinstance(value, bool):
                return value
            if isinstance(value, str):
                return parse_bool(value)
        elif kind.startswith(("int", "float")) and not isinstance(value, bool):
            number = float(value) if isinstance(value, str) else value
            if kind.startswith("float") and isinstance(number, (int, float)):
                return float(number)
            if isinstance(number, int):
                return number
            if isinstance(number, float) and number.is_integer():
                return int(number)
        elif isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    except (ValueError, argparse.ArgumentTypeError):
        pass
    what = {"list": "a list of names", "bool": "true or false", "int": "an integer", "float": "a number"}
    expected = next((text for prefix, text in what.items() if kind.startswith(prefix)), "a string")
    raise ConfigError(f"--config {path}: {name}: expected {expected}, got {_shown(value)}")


def _shown(value) -> str:
    """repr of a --config value, cut short: a YAML alias can make a few bytes of a file a value
    of billions of items, which a plain repr would try to spell out."""
    shown = reprlib.Repr()
    shown.maxlevel, shown.maxlist, shown.maxdict, shown.maxstring, shown.maxother = 2, 4, 4, 120, 120
    text = shown.repr(value)
    return text if len(text) <= 160 else text[:160] + "..."


def _naming_the_file(exc: ConfigError, path, from_file: set[str]) -> ConfigError:
    """`exc` naming the --config file as well where a flag it names was set there, not on the
    command line: the user looks for the value in the file."""
    named = [key for key in dict.fromkeys(m.replace("-", "_") for m in re.findall(r"--([a-z0-9][a-z0-9-]*)", str(exc)))
             if key in from_file]
    if not named:
        return exc
    return ConfigError(f"{exc} ({', '.join(named)} {'is' if len(named) == 1 else 'are'} set in --config {path})")


def _unknown_settings_fix(values: dict, unknown: list[str]) -> str:
    """What to write instead of a --config file's `unknown` keys, where the file's shape says
    more than the names: --help's groups written as sections, or a checkpoint's trainer.json
    (whose `config` holds the settings) given whole."""
    if {"config", "step", "loader"} <= set(values) and isinstance(values["config"], dict):
        return ("this is a checkpoint's trainer.json, whose `config` holds the run's settings: write that mapping "
                "to a file of its own and give that (or continue the run with --out RUN --resume)")
    sections = [key for key in unknown if key in GROUPS and isinstance(values[key], dict)]
    if sections:
        return (f"{', '.join(sections)} {'is a group' if len(sections) == 1 else 'are groups'} of --help, not "
                "a section of the file: the file is flat, so write the settings under it at the top level "
                f"(e.g. `{next(iter(values[sections[0]]), 'seq_len')}: ...`)")
    return "use the names of `vlmpack train` flags"


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    names = set(flat_paths(TrainConfig))
    values = load_config_file(args.config) if args.config else {}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"--config {args.config}: unknown settings {unknown}: {_unknown_settings_fix(values, unknown)}")
    # a setting given as null is left at its default, as a flag not given is
    values = {k: _file_value(args.config, k, v) for k, v in values.items() if v is not None}
    flags = {k: v for k, v in vars(args).items() if k in names and v is not None}
    from_file = set(values) - set(flags)
    values.update(flags)
    for key in ("data", "eval_data", *COMMA_LISTS):  # "a,b" and repeated flags both work
        if isinstance(values.get(key), str):
            values[key] = [values[key]]
        if key in COMMA_LISTS and key in values:
            values[key] = [p for item in values[key] for p in str(item).split(",") if p]
    try:
        config = TrainConfig.from_flat(values)
        config.validate()
    except ConfigError as exc:
        raise _naming_the_file(exc, args.config, from_file) from None
    # flags only: a saved config (`--config OUT/config.yaml`) holds both resolved, as a run without
    # --compile wrote them
    if args.compile is False and args.compile_decoder:
        print("vlmpack train: --compile-decoder true does nothing with --compile false: nothing is compiled",
              file=sys.stderr, flush=True)
    return config
