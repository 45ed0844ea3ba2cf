"""`vlmpack` subcommands owned by the training side (imported only when run)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from shards_schema import ShardFormatError

from .pack_plan import DEFAULT_BLOCK_SIZE, PackingError, build_pack_plan, parse_source


def _fmt_int(n) -> str:
    return f"{int(n):,}"


class Pack:
    """`vlmpack pack DIR [DIR:weight ...] --seq-len N [...] [--out PLAN_DIR]`."""

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("dirs", nargs="*", metavar="DIR[:WEIGHT]",
                            help="shard directories, each optionally with a mixing weight (DIR:0.7)")
        parser.add_argument("--data", action="append", default=[], metavar="DIR[:WEIGHT]",
                            help="another shard directory (repeatable; same as a positional DIR)")
        parser.add_argument("--seq-len", type=int, required=True, help="tokens per pack (the training sequence length)")
        parser.add_argument("--seed", type=int, default=0, help="shuffling / mixing seed (default 0)")
        parser.add_argument("--epoch", type=int, default=0, help="which epoch to plan (each epoch reshuffles; default 0)")
        parser.add_argument("--max-visual-tokens", type=int, default=None,
                            help="at most this many visual tokens (patches / merge^2) per pack")
        parser.add_argument("--dp-size", type=int, default=1, help="data-parallel ranks, for the balance report (default 1)")
        parser.add_argument("--global-batch-packs", type=int, default=None,
                            help="packs per global batch, a multiple of --dp-size (default: dp size)")
        parser.add_argument("--pad-to-multiple", type=int, default=1,
                            help="round every sample up to this many tokens (TP sequence parallel / context parallel)")
        parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help=argparse.SUPPRESS)
        parser.add_argument("--out", default=None, metavar="PLAN_DIR", help="write the plan here (a directory of .npy + plan.json)")
        parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
        parser.epilog = (
            "Weights: without any, each sample appears once per epoch; with weights, source k contributes "
            "round(w_k / sum(w) * total samples) per epoch (a missing weight is 1)."
        )

    @staticmethod
    def run(args) -> int:
        specs = [parse_source(s) for s in [*args.dirs, *args.data]]
        if not specs:
            print("vlmpack pack: error: give at least one shard directory (DIR or --data DIR[:WEIGHT])", file=sys.stderr)
            return 2
        t0 = time.perf_counter()
        try:
            plan = build_pack_plan(specs, seq_len=args.seq_len, seed=args.seed, epoch=args.epoch,
                                   max_visual_tokens=args.max_visual_tokens, dp_size=args.dp_size,
                                   global_batch_packs=args.global_batch_packs, pad_to_multiple=args.pad_to_multiple,
                                   block_size=args.block_size)
            seconds = time.perf_counter() - t0
            balance = plan.balance(args.dp_size) if args.dp_size > 1 and plan.num_packs else None
            saved = str(plan.save(args.out)) if args.out else None
        except (PackingError, ShardFormatError, OSError) as exc:
            print(f"vlmpack pack: error: {exc}", file=sys.stderr)
            return 2
        except (KeyError, TypeError) as exc:
            print(f"vlmpack pack: error: a manifest is malformed ({type(exc).__name__}: {exc}); "
                  "re-run the job that wrote it or check it with `vlmpack verify`", file=sys.stderr)
            return 2
        report = {"settings": plan.settings, "sources": plan.meta["sources"], "stats": plan.stats,
                  "balance": balance, "seconds": round(seconds, 3), "saved": saved, "key": plan.key}
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            print(format_pack_report(report))
        return 0


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
                 f"planning {st['plan_seconds']:.2f} s)")
    lines.append(f"saved          {report['saved']}" if report["saved"] else "saved          no (pass --out PLAN_DIR to write the plan)")
    return "\n".join(lines)


def _add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", choices=["keep", "bfloat16", "float16", "float32"], default="keep",
                        help="cast the weights (default: keep the dtype they are stored in)")


def _dtype(name: str):
    import torch

    return None if name == "keep" else getattr(torch, name)


class ImportHF:
    """`vlmpack import-hf HF_DIR --out MODEL_DIR [--tp N --pp N]`."""

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("hf_dir", metavar="HF_DIR",
                            help="Hugging Face Qwen3-VL / Qwen2.5-VL directory (config.json + *.safetensors)")
        parser.add_argument("--out", required=True, metavar="MODEL_DIR", help="new model directory to write")
        parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size to shard for (default 1)")
        parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to shard for (default 1)")
        _add_dtype_argument(parser)
        parser.epilog = ("The training run may use another --tp/--pp: loading reshards. Tokenizer, processor, "
                         "chat-template and generation files are kept in MODEL_DIR/hf/ for `vlmpack export-hf`.")

    @staticmethod
    def run(args) -> int:
        from .convert import import_hf

        t0 = time.perf_counter()
        try:
            arch = import_hf(args.hf_dir, args.out, tp=args.tp, pp=args.pp, dtype=_dtype(args.dtype), progress=True)
        except (ValueError, OSError) as exc:
            print(f"vlmpack import-hf: error: {exc}", file=sys.stderr)
            return 2
        print(f"{args.out}: {arch.family}, {arch.lm.num_layers} layers, "
              f"{arch.lm.num_params() / 1e9:.2f} B language-model parameters, tp={args.tp} pp={args.pp}, "
              f"{time.perf_counter() - t0:.1f} s")
        return 0


class ExportHF:
    """`vlmpack export-hf MODEL_DIR --out HF_DIR`."""

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("model_dir", metavar="MODEL_DIR", help="model directory (import-hf output or a training save)")
        parser.add_argument("--out", required=True, metavar="HF_DIR", help="new Hugging Face directory to write")
        _add_dtype_argument(parser)
        parser.epilog = (
            "Writes model.safetensors (numbered shards + index above 5 GiB), config.json and the tokenizer / "
            "processor / chat-template files kept at import. A model directory without them (a random-init "
            "architecture) gets the built-in profile's Qwen tokenizer, image-processor constants and Qwen "
            "generation defaults, but no chat template: copy chat_template.jinja from the official checkpoint "
            "before chat inference.")

    @staticmethod
    def run(args) -> int:
        from .convert import export_hf

        t0 = time.perf_counter()
        try:
            arch, side_files = export_hf(args.model_dir, args.out, dtype=_dtype(args.dtype), progress=True)
        except (ValueError, OSError) as exc:
            print(f"vlmpack export-hf: error: {exc}", file=sys.stderr)
            return 2
        print(f"{args.out}: {arch.family}, {len(side_files)} tokenizer/processor files "
              f"({', '.join(side_files) or 'none'}), {time.perf_counter() - t0:.1f} s")
        return 0


COMMANDS = {"pack": Pack, "import-hf": ImportHF, "export-hf": ExportHF}


def main(argv: list[str] | None = None) -> int:
    """`python -m train.cli COMMAND ...`: the same commands without the `vlmpack` dispatcher."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m train.cli {{{','.join(COMMANDS)}}} [options]", file=sys.stderr)
        return 2
    command = COMMANDS[argv[0]]
    parser = argparse.ArgumentParser(prog=f"vlmpack {argv[0]}")
    command.add_arguments(parser)
    return int(command.run(parser.parse_args(argv[1:])) or 0)


if __name__ == "__main__":
    sys.exit(main())
