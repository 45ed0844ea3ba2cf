"""The output layer and its cross-entropy, forward + backward, side by side in one process on
one micro-batch's target rows:

- `chunked`: vlmpack's default loss (`train.model.loss.chunked_cross_entropy`: logit chunks
  of `loss_chunk_rows` rows for the vocabulary, recomputed in the backward);
- `fused`: `--loss fused` (`fused_cross_entropy`: each chunk's gradients made in the forward,
  the weight gradient added into an fp32 buffer as megatron's `main_grad`);
- `liger`: Liger's fused linear cross-entropy (`liger_fused_linear_cross_entropy`, sum
  reduction, fp32 weight-gradient accumulation), where liger-kernel is installed;
- `chunked@N`, `fused@N`: the same with chunks of N rows, for each N of `--chunk-rows`.

The loss functions are compiled as the trainer compiles them (CUDA). Reported per path: the
median milliseconds of a call, the peak memory a call adds to what the inputs hold, and the
largest differences of the loss and the input and weight gradients from the chunked path's
(relative to that path's largest value). Defaults: Qwen3.5's vocabulary and the 2B model's
hidden size, about one 16k pack's target rows.

    python benchmarks/loss_speed.py --json-out benchmarks/results/loss_speed_h200_<yyyymmdd>.json
"""

from __future__ import annotations

import statistics

import torch
from common import machine_info, parser, write_json

from train.model.loss import chunked_cross_entropy, fused_cross_entropy, token_loss, token_loss_and_grad


def _liger():
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        return None
    return liger_fused_linear_cross_entropy


def loss_paths(device: torch.device, chunk_rows: tuple[int, ...] = ()) -> dict:
    """name -> fn(hidden [T, H], weight [V, H], labels [T]) -> the summed loss (a scalar to
    backward through); the weight gradient lands in `weight.grad` or `weight.main_grad`."""
    compile_ = (lambda fn: torch.compile(fn, dynamic=True)) if device.type == "cuda" else (lambda fn: fn)
    row_loss, row_loss_and_grad = compile_(token_loss), compile_(token_loss_and_grad)

    def output_layer(h, weight):
        return torch.matmul(h, weight.t()), None

    paths = {
        "chunked": lambda h, w, y: chunked_cross_entropy(h[:, None], y, output_layer, w, row_loss).sum(),
        "fused": lambda h, w, y: fused_cross_entropy(h[:, None], y, w, row_loss_and_grad).sum(),
    }
    for rows in chunk_rows:
        paths[f"chunked@{rows}"] = lambda h, w, y, rows=rows: chunked_cross_entropy(
            h[:, None], y, output_layer, w, row_loss, chunk=rows).sum()
        paths[f"fused@{rows}"] = lambda h, w, y, rows=rows: fused_cross_entropy(
            h[:, None], y, w, row_loss_and_grad, chunk=rows).sum()
    liger = _liger() if device.type == "cuda" else None
    if liger is not None:
        paths["liger"] = lambda h, w, y: liger(h, w, y, reduction="sum", accum_dtype=torch.float32)
    return paths


def run_path(fn, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, buffered: bool,
             warmup: int, calls: int) -> dict:
    """One path's timing, peak memory and results (loss, input gradient, weight gradient in fp32)."""
    cuda = hidden.device.type == "cuda"
    times, peaks = [], []
    for k in range(warmup + calls):
        h = hidden.detach().requires_grad_()
        weight.grad = None
        if buffered:
            weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        elif hasattr(weight, "main_grad"):
            del weight.main_grad
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            held = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        loss = fn(h, weight, labels)
        loss.backward()
        if cuda:
            end.record()
            torch.cuda.synchronize()
            if k >= warmup:
                times.append(start.elapsed_time(end))
                peaks.append((torch.cuda.max_memory_allocated() - held) / 2**30)
    grad_weight = weight.main_grad if buffered else weight.grad
    return {"ms": statistics.median(times) if times else None, "peak_gib": max(peaks) if peaks else None,
            "loss": loss.detach().float(), "grad_hidden": h.grad.float(), "grad_weight": grad_weight.float()}


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--rows", type=int, default=6144, help="target rows of the micro-batch (default 6144)")
    ap.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048, Qwen3.5-2B)")
    ap.add_argument("--vocab", type=int, default=248320, help="vocabulary size (default 248320, Qwen3.5)")
    ap.add_argument("--ignored", type=float, default=0.0,
                    help="share of the rows whose label is -100 (default 0: the trainer passes target rows only)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (correctness only, no timing)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3; compiles)")
    ap.add_argument("--calls", type=int, default=10, help="timed calls per path (default 10)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    ap.add_argument("--chunk-rows", type=int, nargs="*", default=[], metavar="N",
                    help="also run the chunked and fused losses with chunks of N rows (default: only the "
                         "trainer's chunk for the vocabulary)")
    args = ap.parse_args(argv)
    if any(n < 1 for n in args.chunk_rows):
        ap.error(f"--chunk-rows: every N must be at least 1, got {args.chunk_rows}")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    hidden = torch.randn(args.rows, args.hidden, generator=g).to(device, dtype)
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * args.hidden ** -0.5).to(device, dtype)
    weight.requires_grad_()
    labels = torch.randint(0, args.vocab, (args.rows,), generator=g)
    labels[torch.rand(args.rows, generator=g) < args.ignored] = -100
    labels = labels.to(device)

    results = {}
    for name, fn in loss_paths(device, tuple(args.chunk_rows)).items():
        results[name] = run_path(fn, hidden, weight, labels, buffered=name.startswith("fused"), warmup=args.warmup,
                                 calls=args.calls)
    base = results["chunked"]
    report = {"machine": machine_info(device), "args": vars(args), "paths": {}}
    for name, r in results.items():
        row = {"ms": r["ms"], "peak_gib": r["peak_gib"], "loss": float(r["loss"])}
        for key in ("loss", "grad_hidden", "grad_weight"):
            scale = base[key].abs().max().clamp_min(1e-30)
            row[f"{key}_difference"] = float((r[key] - base[key]).abs().max() / scale)
        if r["ms"] and base["ms"]:
            row["chunked_ms_over_this"] = base["ms"] / r["ms"]
        report["paths"][name] = row
        timing = f"{r['ms']:.2f} ms, {r['peak_gib']:.2f} GiB, " if r["ms"] is not None else ""
        print(f"{name:>12}: {timing}loss {row['loss']:.6g}, differences from chunked: loss "
              f"{row['loss_difference']:.1e}, input grad {row['grad_hidden_difference']:.1e}, weight grad "
              f"{row['grad_weight_difference']:.1e}", flush=True)
    if args.json_out:
        write_json(args.json_out, report)
    return report


if __name__ == "__main__":
    main()
