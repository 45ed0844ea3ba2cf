"""`TrainConfig`: every setting of a training job, one dataclass.

The command line and a YAML/JSON file (`--config FILE`) mirror each other: a file holds the
same keys as the flags (dashes or underscores), flags given on the command line win. The
resolved config is saved next to every checkpoint, so a run can be reproduced from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

FREEZABLE = ("vision", "merger", "llm")
ATTENTION_KERNELS = ("fa2", "fa4")  # train.model.attention.select_attention_kernel
STATE_DTYPES = ("fp32", "bf16")  # --grad-dtype / --adam-state-dtype


@dataclass
class TrainConfig:
    data: list[str] = field(default_factory=list)  # DIR[:WEIGHT] shard dirs or WebDataset exports
    out: str = "runs/train"
    # model: exactly one of hf_model (import on the fly), init (Megatron dir), arch (random init)
    hf_model: str | None = None
    init: str | None = None
    arch: str | None = None
    # batch
    seq_len: int = 8192
    global_batch_packs: int | None = None
    global_batch_tokens: int | None = None  # alternative: packs = tokens / seq_len
    micro_batch_packs: int = 1
    max_visual_tokens: int | None = None
    # parallelism / precision
    tp: int = 1
    pp: int = 1
    bf16: bool = True
    recompute: str = "none"  # none | selective | full (language model)
    recompute_layers: int | None = None  # with full: recompute only the first N decoder layers per stage
    recompute_vision: bool | None = None  # redo the vision blocks in backward (default: with full)
    compile: bool = True  # torch.compile the vision blocks and the rotary kernels (CUDA runs only)
    attention: str = "fa2"  # CUDA attention kernel: fa2 (torch's own) | fa4 (flash-attn-4 package, sm90/sm100)
    distributed_optimizer: bool = True  # CUDA only (megatron's DistributedOptimizer)
    # memory: bf16 halves the gradient buffers (accumulated and reduced in bf16, megatron's own
    # default; bf16 runs only) / the Adam moments (stochastically rounded, train/adamw_bf16_state.py)
    grad_dtype: str = "fp32"
    adam_state_dtype: str = "fp32"
    device: str | None = None  # cuda | cpu (default: cuda when available)
    # optimisation
    train_steps: int = 100
    lr: float = 1e-5
    min_lr: float = 0.0
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    freeze: list[str] = field(default_factory=list)
    seed: int = 0
    # checkpoints, eval, logs
    save_every: int = 0  # 0: only at the end
    save_final: bool = True  # checkpoint at the last step (benchmarks turn it off)
    exit_interval: int = 0  # save and exit once the step is a multiple of this (scheduler time slots)
    resume: bool = False
    export_hf: str | None = None
    eval_data: list[str] = field(default_factory=list)
    eval_every: int = 0
    eval_batches: int = 4
    log_every: int = 1
    num_workers: int = 2
    tensorboard: bool = True

    def validate(self) -> None:
        sources = [self.hf_model, self.init, self.arch]
        if sum(s is not None for s in sources) != 1:
            raise ValueError("give exactly one model source: --hf-model DIR, --init MEGATRON_DIR or --arch NAME")
        if not self.data:
            raise ValueError("give at least one --data DIR[:WEIGHT]")
        for name in ("seq_len", "micro_batch_packs", "tp", "pp", "train_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps >= self.train_steps:
            raise ValueError(f"--warmup-steps {self.warmup_steps} must be smaller than --train-steps {self.train_steps}")
        if self.global_batch_packs is not None and self.global_batch_tokens is not None:
            raise ValueError("give --global-batch-packs or --global-batch-tokens, not both")
        bad = sorted(set(self.freeze) - set(FREEZABLE))
        if bad:
            raise ValueError(f"--freeze {bad}: choose from {list(FREEZABLE)}")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"--recompute {self.recompute!r}: none | selective | full")
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"--attention {self.attention!r}: choose from {list(ATTENTION_KERNELS)}")
        for name in ("grad_dtype", "adam_state_dtype"):
            if getattr(self, name) not in STATE_DTYPES:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)!r}: choose from {list(STATE_DTYPES)}")
        if self.recompute_layers is not None and (self.recompute != "full" or self.recompute_layers < 1):
            raise ValueError(f"--recompute-layers {self.recompute_layers} needs --recompute full and a value >= 1 "
                             f"(the decoder layers per pipeline stage whose activations are recomputed)")

    def global_packs(self, dp: int) -> int:
        """Packs per global batch; a multiple of dp * micro_batch_packs."""
        if self.global_batch_packs is not None:
            packs = self.global_batch_packs
        elif self.global_batch_tokens is not None:
            packs = max(1, round(self.global_batch_tokens / self.seq_len))
        else:
            packs = dp * self.micro_batch_packs
        unit = dp * self.micro_batch_packs
        if packs % unit:
            raise ValueError(f"global batch of {packs} packs is not a multiple of dp ({dp}) x --micro-batch-packs "
                             f"({self.micro_batch_packs}) = {unit}")
        return packs

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field (lists repeatable), defaults left to the dataclass."""
    parser.add_argument("--config", metavar="FILE", help="YAML or JSON file with the same keys as these flags")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type)
        if kind.startswith("list"):
            parser.add_argument(flag, action="append", default=None, metavar="VALUE")
        elif kind.startswith("bool"):
            parser.add_argument(flag, type=_bool, nargs="?", const=True, default=None, metavar="BOOL")
        elif "int" in kind:
            parser.add_argument(flag, type=int, default=None)
        elif "float" in kind:
            parser.add_argument(flag, type=float, default=None)
        else:
            parser.add_argument(flag, default=None)


def load_config_file(path: str | Path) -> dict:
    text = Path(path).read_text()
    if str(path).endswith((".yaml", ".yml")):
        import yaml
        values = yaml.safe_load(text) or {}
    else:
        values = json.loads(text)
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of settings, got {type(values).__name__}")
    return {k.replace("-", "_"): v for k, v in values.items()}


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values = load_config_file(args.config) if args.config else {}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"{args.config}: unknown settings {unknown}")
    values.update({k: v for k, v in vars(args).items() if k in names and v is not None})
    for key in ("data", "eval_data", "freeze"):  # "a,b" and repeated flags both work
        if isinstance(values.get(key), str):
            values[key] = [values[key]]
        if key == "freeze" and key in values:
            values[key] = [p for item in values[key] for p in str(item).split(",") if p]
    config = TrainConfig(**values)
    config.validate()
    return config
