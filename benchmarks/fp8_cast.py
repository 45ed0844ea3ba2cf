"""The FP8 cast written transposed, side by side in one process: `train.model.fp8_cast`'s Triton
kernel against Inductor's compiled cast + transposed copy (what torchao's cast and layout
change compile to on their own), at the 8B model's operand shapes.

Two ops per shape: the transposed bits alone (`cast_transposed`: a weight or an input for the
weight-gradient GEMM, e4m3), and row-major plus transposed bits from one read
(`cast_rows_and_transposed`: an output gradient, e5m2). Reported per shape and op: microseconds
per call (mean over CUDA-event-timed calls), the bandwidth that makes (bf16 read, FP8 writes),
and Inductor's time over ours. Both are checked to give the same bits. In a compiled decoder
layer Inductor fuses the cast into its neighbours' kernels instead, so the step's A/B is
`benchmarks/train_speed.py` with `--fp8 tensorwise`.

    python benchmarks/fp8_cast.py --json-out benchmarks/results/fp8_cast_h200_<yyyymmdd>.json
"""

from __future__ import annotations

import torch
from common import machine_info, parser, write_json

SHAPES = "8192x4096,8192x6144,8192x12288,8192x24576,4096x12288,24576x4096"


def time_call(fn, warmup: int, calls: int) -> float:
    """Mean microseconds per call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1e3


def as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--shapes", default=SHAPES, help="operand shapes ROWSxCOLS, comma-separated")
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls first")
    ap.add_argument("--calls", type=int, default=50, help="timed calls per op")
    args = ap.parse_args()

    from train.model.fp8_cast import cast_reference, cast_rows_and_transposed, cast_transposed

    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2

    @torch.compile(dynamic=False)
    def inductor_transposed(x, scale):
        return cast_reference(x, scale, e4m3).t().contiguous()

    @torch.compile(dynamic=False)
    def inductor_both(x, scale):
        bits = cast_reference(x, scale, e5m2)
        return bits, bits.t().contiguous()

    result = {"machine": machine_info(torch.device("cuda")), "args": vars(args), "shapes": {}}
    for shape in args.shapes.split(","):
        rows, cols = (int(n) for n in shape.split("x"))
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        scale = torch.tensor(30.0, device="cuda")
        ops = {"transposed": (lambda: cast_transposed(x, scale, e4m3), lambda: inductor_transposed(x, scale), 3),
               "rows_and_transposed": (lambda: cast_rows_and_transposed(x, scale, e5m2),
                                       lambda: inductor_both(x, scale), 4)}
        result["shapes"][shape] = {}
        for name, (ours, inductor, bytes_per_value) in ops.items():
            same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                       for a, b in zip(as_tuple(ours()), as_tuple(inductor())))
            ours_us, inductor_us = (time_call(fn, args.warmup, args.calls) for fn in (ours, inductor))
            row = {"ours_us": ours_us, "inductor_us": inductor_us, "inductor_over_ours": inductor_us / ours_us,
                   "ours_tb_s": rows * cols * bytes_per_value / ours_us / 1e6,
                   "inductor_tb_s": rows * cols * bytes_per_value / inductor_us / 1e6, "same_bits": same}
            result["shapes"][shape][name] = row
            print(f"{shape:>12} {name:<20} ours {ours_us:6.1f} us ({row['ours_tb_s']:.2f} TB/s), Inductor "
                  f"{inductor_us:6.1f} us ({row['inductor_tb_s']:.2f} TB/s): {row['inductor_over_ours']:.2f}x; "
                  f"same bits {same}", flush=True)
    if args.json_out:
        write_json(args.json_out, result)


if __name__ == "__main__":
    main()
