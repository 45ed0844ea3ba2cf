"""`vlmpack` subcommands owned by the training side (imported only when run)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from shards_schema.errors import UserError
from shards_schema.flags import refuse_bad_location
from shards_schema.outdir import refuse_input_as_output
from shards_schema.storage import is_url

from .config import read_text_file
from .pack_plan import DEFAULT_BLOCK_SIZE, PackSettings, build_pack_plan, check_plan_out, parse_source


def _fmt_int(n) -> str:
    return f"{int(n):,}"


class Pack:
    """`vlmpack pack DIR [DIR:weight ...] --seq-len N [...] [--out PLAN_DIR]`."""

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        _one_line_help(parser)
        data = parser.add_argument_group("data")
        data.add_argument("dirs", nargs="*", metavar="DIR[:WEIGHT]", help="shard directory, optionally with a mixing weight")
        data.add_argument("--data", action="append", default=[], metavar="DIR[:WEIGHT]",
                          help="another shard directory (repeatable)")
        packing = parser.add_argument_group("packing")
        packing.add_argument("--seq-len", type=int, metavar="N", required=True, help="tokens per pack (the training sequence length)")
        packing.add_argument("--max-visual-tokens", type=int, metavar="N", default=None, help="visual tokens per pack at most")
        packing.add_argument("--pad-to-multiple", type=int, metavar="N", default=1, help="round each sample up to this many tokens")
        packing.add_argument("--seed", type=int, metavar="N", default=0, help="shuffling and mixing seed (default 0)")
        packing.add_argument("--epoch", type=int, metavar="N", default=0, help="epoch to plan; each one reshuffles (default 0)")
        packing.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help=argparse.SUPPRESS)
        parallel = parser.add_argument_group("parallelism")
        parallel.add_argument("--dp-size", type=int, metavar="N", default=1, help="data-parallel ranks, for the balance report")
        parallel.add_argument("--global-batch-packs", type=int, metavar="N", default=None,
                              help="packs per global batch, a multiple of --dp-size")
        output = parser.add_argument_group("output")
        output.add_argument("--out", default=None, metavar="PLAN_DIR", help="write the plan to this directory")
        output.add_argument("--json", action="store_true", help="print the report as one JSON object")
        parser.epilog = (
            "Weights: without any, each sample appears once per epoch; with weights, source k contributes "
            "round(w_k / sum(w) * total samples) per epoch (a missing weight is 1). --pad-to-multiple is for "
            "TP sequence parallel / context parallel; --global-batch-packs defaults to --dp-size."
        )

    @staticmethod
    def run(args) -> int:
        specs = [parse_source(s) for s in [*args.dirs, *args.data]]
        if not specs:
            raise UserError("give at least one shard directory (DIR or --data DIR[:WEIGHT])")
        if args.out:
            for directory, _ in specs:
                if not is_url(directory):
                    refuse_input_as_output(args.out, directory)
            check_plan_out(args.out)
        t0 = time.perf_counter()
        packing = PackSettings(seq_len=args.seq_len, seed=args.seed, epoch=args.epoch,
                               max_visual_tokens=args.max_visual_tokens, dp_size=args.dp_size,
                               global_batch_packs=args.global_batch_packs, pad_to_multiple=args.pad_to_multiple,
                               block_size=args.block_size)
        plan = build_pack_plan(specs, packing)  # manifests and shards are checked as they are opened
        seconds = time.perf_counter() - t0
        balance = plan.balance(args.dp_size) if args.dp_size > 1 else None
        saved = str(plan.save(args.out)) if args.out else None
        report = {"settings": plan.settings, "sources": plan.meta["sources"], "stats": {**plan.stats, **plan.timings},
                  "balance": balance, "seconds": round(seconds, 3), "saved": saved, "key": plan.key}
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            print(format_pack_report(report))
        return 0


class Train:
    """`vlmpack train ...`: the flags here (`train.config`, no torch needed, so `--help` works
    anywhere), the run in `train.trainer`, imported only when it starts."""

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        from train.config import add_train_flags

        add_train_flags(parser)
        parser.epilog = ("Multi-GPU: torchrun --nproc-per-node N $(which vlmpack) train ... ; every flag can also be "
                         "given in --config FILE (YAML/JSON, same keys), flags win.")

    @staticmethod
    def run(args) -> int:
        from shards_schema.cli import interrupted_before_start
        from train.config import config_from_args

        # read and validated before torch and megatron load (seconds): a refused flag is said at once;
        # ConfigError: one line, exit 2 (the dispatcher)
        config = config_from_args(args)
        try:
            from train.trainer import Train as TrainRun
        except KeyboardInterrupt:
            return interrupted_before_start("train")
        return TrainRun.run(config)


def format_pack_report(report: dict) -> str:
    s, st = report["settings"], report["stats"]
    vis = s["max_visual_tokens"] if s["max_visual_tokens"] is not None else "none"
    lines = [
        f"pack plan      seq_len {s['seq_len']}, seed {s['seed']}, epoch {s['epoch']}, "
        f"global batch {s['global_batch_packs']} packs, pad to multiple {s['pad_to_multiple']}, max visual tokens {vis}",
        "sources",
    ]
    for src in report["sources"]:
        weight = "natural" if src["weight"] is None else f"{src['weight']:g}"
        lines.append(f"  {src['dir']}  weight {weight}: {_fmt_int(src['samples'])} samples, "
                     f"{_fmt_int(src['drawn'])} drawn, {_fmt_int(src['in_plan'])} in the plan")
    packs = st["packs"]
    lines += [
        f"samples        {_fmt_int(st['samples'])} in {_fmt_int(packs)} packs "
        f"({_fmt_int(st['global_batches'])} global batches; dropped {_fmt_int(st['dropped_samples'])} samples "
        f"in {st['dropped_packs']} packs to make whole global batches)",
        f"fill           {st['fill_efficiency'] * 100:.2f}% of {_fmt_int(packs)} x {s['seq_len']} tokens are real "
        f"({_fmt_int(st['tokens'])} tokens)",
        f"padding added  {_fmt_int(st['padding_tokens'])} tokens (per-sample, pad_to_multiple); "
        f"{_fmt_int(st['trailing_padding_tokens'])} to fill packs to seq_len",
        f"samples/pack   mean {st['samples_per_pack_mean']:.2f}, max {st['samples_per_pack_max']}",
        f"visual tokens  per pack mean {st['visual_tokens_per_pack_mean']:.0f}, max {_fmt_int(st['visual_tokens_per_pack_max'])}",
    ]
    b = report["balance"]
    if b:
        lines.append(
            f"DP balance     dp_size {b['dp_size']}: busiest rank / mean rank, per global batch: visual tokens "
            f"{b['visual_max_over_mean']:.3f} mean, {b['visual_max_over_mean_worst']:.3f} worst; tokens "
            f"{b['tokens_max_over_mean']:.3f} mean, {b['tokens_max_over_mean_worst']:.3f} worst"
        )
    lines.append(f"time           {report['seconds']:.2f} s (reading sizes {st.get('read_stats_seconds', 0):.2f} s, "
                 f"planning {st.get('plan_seconds', 0):.2f} s)")
    lines.append(f"saved          {report['saved']}" if report["saved"] else "saved          no (pass --out PLAN_DIR to write the plan)")
    return "\n".join(lines)


def _one_line_help(parser: argparse.ArgumentParser) -> None:
    """Room for every option and its help on one line of `--help`."""
    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, max_help_position=30, width=100)


def _add_output_arguments(parser: argparse.ArgumentParser, out_metavar: str, out_help: str) -> None:
    output = parser.add_argument_group("output")
    output.add_argument("--out", required=True, metavar=out_metavar, help=out_help)
    output.add_argument("--overwrite", action="store_true",
                        help="replace a finished output of this command in --out")
    output.add_argument("--dtype", choices=["keep", "bfloat16", "float16", "float32"], default="keep", metavar="DTYPE",
                        help="keep (default), bfloat16, float16 or float32")


def _bars() -> bool:
    """Progress bars on a terminal only: in a log they are lines of carriage returns, and an
    error's one line would come after them."""
    return sys.stderr.isatty()


def _dtype(name: str):
    import torch

    return None if name == "keep" else getattr(torch, name)


def _convert_module():
    """`train.convert`, imported only by the commands that need it (it loads megatron-core)."""
    from train import convert

    return convert


def _input_dir(path: str, metavar: str, needs: str, what: str, hint=None) -> None:
    """`hint(path)`: what to give instead, where the directory lacks `needs`."""
    if not Path(path).exists():
        raise UserError(f"{metavar} {path}: no such directory: pass {what}")
    if not Path(path).is_dir():
        raise UserError(f"{metavar} {path} is a file, not a directory: pass {what}")
    if not (Path(path) / needs).is_file():
        raise UserError(f"{metavar} {path} has no {needs}: " + (hint(path) if hint else f"pass {what}"))


class ImportHF:
    """`vlmpack import-hf HF_DIR --out MODEL_DIR [--tp N --pp N --ep N]`."""

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        _one_line_help(parser)
        source = parser.add_argument_group("input")
        source.add_argument("hf_dir", metavar="HF_DIR", help="Hugging Face Qwen3.5 / 3.6, Qwen3-VL or Qwen2.5-VL model directory")
        parallel = parser.add_argument_group("parallelism")
        parallel.add_argument("--tp", type=int, metavar="N", default=1, help="tensor-parallel size to shard for (default 1)")
        parallel.add_argument("--pp", type=int, metavar="N", default=1, help="pipeline-parallel size to shard for (default 1)")
        parallel.add_argument("--ep", type=int, metavar="N", default=1,
                              help="expert-parallel size to shard a Mixture-of-Experts model for (default 1)")
        _add_output_arguments(parser, "MODEL_DIR", "model directory to write (new or empty)")
        parser.epilog = ("HF_DIR holds config.json and *.safetensors. The training run may use another --tp/--pp/--ep: "
                         "loading reshards. Tokenizer, processor, chat-template and generation files are kept in "
                         "MODEL_DIR/hf/ for `vlmpack export-hf`.")

    @staticmethod
    def run(args) -> int:
        _input_dir(args.hf_dir, "HF_DIR", "config.json", "a Hugging Face model directory")
        for flag, value in (("--tp", args.tp), ("--pp", args.pp), ("--ep", args.ep)):
            if value < 1:
                raise UserError(f"{flag} must be an integer >= 1, got {value}")
        convert = _convert_module()
        t0 = time.perf_counter()
        try:
            arch = convert.import_hf(args.hf_dir, args.out, tp=args.tp, pp=args.pp, dtype=_dtype(args.dtype),
                                     progress=_bars(), overwrite=args.overwrite, ep=args.ep)
        except ValueError as exc:  # a checkpoint that does not match its config.json, or tp/pp that do not fit it
            raise UserError(str(exc)) from None
        print(f"{args.out}: {arch.family}, {arch.lm.num_layers} layers, "
              f"{arch.lm.num_params() / 1e9:.2f} B language-model parameters, tp={args.tp} pp={args.pp} ep={args.ep}, "
              f"{time.perf_counter() - t0:.1f} s")
        return 0


class ExportHF:
    """`vlmpack export-hf MODEL_DIR --out HF_DIR`."""

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        _one_line_help(parser)
        source = parser.add_argument_group("input")
        source.add_argument("model_dir", metavar="MODEL_DIR", help="import-hf output, a training save, or a LoRA "
                                                                   "run's checkpoint")
        adapters = parser.add_argument_group("LoRA checkpoints")
        adapters.add_argument("--lora-format", choices=["peft"], default=None,
                              help="PEFT's adapter_config.json + adapter_model.safetensors (default)")
        adapters.add_argument("--merge", action="store_true",
                              help="write the base model with the adapters merged in, as a full checkpoint")
        adapters.add_argument("--lora-base", action="store_true",
                              help="write the base model the adapters sit on, for PEFT (a full checkpoint)")
        adapters.add_argument("--base", metavar="DIR", default=None,
                              help="with --merge or --lora-base: the base model's directory (default: the run's)")
        files = parser.add_argument_group("Hugging Face files")
        files.add_argument("--chat-template", metavar="FILE", default=None,
                           help="chat template to write (default: the training data's, else the kept one)")
        _add_output_arguments(parser, "HF_DIR", "Hugging Face directory to write (new or empty)")
        parser.epilog = (
            "Writes model.safetensors (numbered shards + index above 5 GiB), config.json and the tokenizer, processor, "
            "chat-template and generation files: those kept at import, the image and video processor settings and "
            "chat template of the shards a training save was trained on over them, and the built-in Qwen tokenizer, "
            "processor settings and generation defaults for what neither gives. AutoProcessor.from_pretrained(HF_DIR) "
            "then gives the shards' token ids and grids, and their pixels bit for bit once its image_processor is "
            "AutoImageProcessor.from_pretrained(HF_DIR, backend=\"pil\"). What the directory lacks is named in a "
            "note. A LoRA checkpoint exports as PEFT adapter files (default), merged into its base (--merge), or as "
            "that base alone (--lora-base: a random-init run's base exists nowhere else), onto which PEFT loads the "
            "adapter files.")

    @staticmethod
    def run(args) -> int:
        refuse_bad_location("MODEL_DIR", args.model_dir, "give the model or checkpoint directory's path")
        refuse_bad_location("--out", args.out, "give the export directory's path")
        convert = _convert_module()
        from train import checkpoint_format
        from train.adapter_format import find_adapter_dir

        chat_template = _read_chat_template(args.chat_template) if args.chat_template else None
        adapter_dir = find_adapter_dir(args.model_dir)
        if adapter_dir is not None:
            return ExportHF.run_lora(args, adapter_dir, chat_template)
        for flag, given in (("--lora-format", args.lora_format), ("--merge", args.merge),
                            ("--lora-base", args.lora_base), ("--base", args.base)):
            if given:
                raise UserError(f"{flag}: {args.model_dir} is not a LoRA checkpoint (no adapter/lora.json); drop {flag}")
        _input_dir(args.model_dir, "MODEL_DIR", convert.META_FILE, "a model directory written by `vlmpack import-hf` or "
                   "training", hint=checkpoint_format.model_dir_hint)
        if chat_template is not None:
            _check_template_family(args.chat_template, chat_template, checkpoint_format.read_arch(args.model_dir).family)
        t0 = time.perf_counter()
        try:
            arch, side_files = convert.export_hf(args.model_dir, args.out, dtype=_dtype(args.dtype), progress=_bars(),
                                                 overwrite=args.overwrite, chat_template=chat_template)
        except ValueError as exc:  # a model directory whose files do not match its architecture
            raise UserError(str(exc)) from None
        _report_export(args.out, arch, side_files, time.perf_counter() - t0)
        return 0

    @staticmethod
    def run_lora(args, adapter_dir: Path, chat_template: str | None) -> int:
        from train import lora_export

        chosen = [flag for flag, given in (("--lora-format peft", args.lora_format), ("--merge", args.merge),
                                           ("--lora-base", args.lora_base)) if given]
        if len(chosen) > 1:
            raise UserError(f"give one of --lora-format peft (the adapter files), --merge (a full checkpoint with the "
                            f"adapters merged in) or --lora-base (the base model), not {' and '.join(chosen)}")
        if args.base and not (args.merge or args.lora_base):
            raise UserError("--base is the model to merge into or to export: it needs --merge or --lora-base")
        if chat_template is not None and not (args.merge or args.lora_base):
            raise UserError("--chat-template: a PEFT adapter directory holds no chat template; give it with --merge or "
                            "--lora-base, whose full checkpoint has one")
        t0 = time.perf_counter()
        try:
            if args.merge or args.lora_base:
                export = lora_export.export_merged if args.merge else lora_export.export_base
                arch, side_files = export(adapter_dir, args.out, args.base, dtype=_dtype(args.dtype), progress=_bars(),
                                          overwrite=args.overwrite, chat_template=chat_template)
                _report_export(args.out, arch, side_files, time.perf_counter() - t0,
                               "adapters merged" if args.merge else "the adapters' base model")
                return 0
            arch, count = lora_export.export_peft(adapter_dir, args.out, dtype=_dtype(args.dtype),
                                                  overwrite=args.overwrite)
        except ValueError as exc:  # adapter files that do not match their lora.json
            raise UserError(str(exc)) from None
        print(f"{args.out}: {arch.family}, PEFT adapter, {count} tensors, {time.perf_counter() - t0:.1f} s")
        return 0


def _check_template_family(path: str, text: str, family: str) -> None:
    """--chat-template FILE may be any template of the user's, but not another family's official
    one: its tokens and turns are not this model's."""
    from shards_schema.builtin import BUILTIN_PROFILE_FAMILY, builtin_template_name

    name = builtin_template_name(text)
    if name is not None and BUILTIN_PROFILE_FAMILY[name] != family:
        raise UserError(f"--chat-template {path} is the official {name} chat template, and the model is a {family} "
                        f"model: pass its own family's template (or one of your own)")


def _read_chat_template(path: str) -> str:
    """--chat-template FILE's text (UserError naming the file when it cannot be one)."""
    what = "a jinja chat template file (chat_template.jinja)"
    if not Path(path).exists():
        raise UserError(f"--chat-template {path}: no such file: pass {what}")
    text = read_text_file(path, "--chat-template", what)
    if not text.strip():
        raise UserError(f"--chat-template {path} is empty: pass {what}")
    from train.checkpoint_format import jinja_syntax_error

    problem = jinja_syntax_error(text)
    if problem:
        raise UserError(f"--chat-template {path}: not a Jinja template ({problem}): fix it, or pass {what}")
    return text


def _report_export(out: str, arch, side_files, seconds: float, what: str | None = None) -> None:
    for note in side_files.notes:
        print(f"vlmpack export-hf: note: {note}", file=sys.stderr)
    print(f"{out}: {arch.family}, {what + ', ' if what else ''}{len(side_files.written)} tokenizer/processor files "
          f"({', '.join(side_files.written) or 'none'}), {seconds:.1f} s")
