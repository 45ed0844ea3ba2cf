"""What the first pack of a new kind of row count costs flash-linear-attention's kernels: the
causal conv and the chunked gated delta rule (Qwen3.5-2B's shape) timed call by call over packs
of the given row counts. Triton compiles a kernel once per kind of integer argument (a multiple
of 16 or not), so a row count of the other kind than all before it pays a compile.

    python benchmarks/fla_row_kinds.py [--rows N ...] [--backward] [--json-out FILE]

Needs a CUDA GPU and fla-core; `--backward` on Hopper with Triton 3.4-3.7.0 needs tilelang too.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from common import log, machine_info, parser, write_json

ROWS = (16381, 16381, 16381, 16365, 16384, 16384, 16312, 16000, 16383, 16368, 16380)


def one_pack(rows: int, heads: int, head_dim: int, backward: bool, segments: int = 5) -> float:
    """Seconds for the conv and the rule on one pack of `rows` rows cut into `segments` samples."""
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    g = torch.Generator().manual_seed(rows)
    cuts = sorted((torch.randperm(rows - 1, generator=g)[:segments - 1] + 1).tolist())
    cu_host = torch.tensor([0, *cuts, rows], dtype=torch.long)
    cu = cu_host.cuda()
    width = heads * head_dim
    x = torch.randn(1, rows, 3 * width, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
    weight = torch.randn(3 * width, 4, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
    a = torch.randn(1, rows, heads, device="cuda", requires_grad=backward)
    b = torch.randn(1, rows, heads, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
    torch.cuda.synchronize()
    started = time.perf_counter()
    y, _ = causal_conv1d(x=x, weight=weight, activation="silu", cu_seqlens=cu, cu_seqlens_cpu=cu_host)
    q, k, v = (t.reshape(1, rows, heads, head_dim) for t in y.split(width, dim=-1))
    out, _ = chunk_gated_delta_rule(q, k, v, g=-F.softplus(a), beta=b.sigmoid(), use_qk_l2norm_in_kernel=True,
                                    cu_seqlens=cu, cu_seqlens_cpu=cu_host)
    if backward:
        out.float().square().mean().backward()
    torch.cuda.synchronize()
    return time.perf_counter() - started


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS), metavar="N",
                    help="the packs' row counts, in order (default: %(default)s)")
    ap.add_argument("--backward", action="store_true", help="time the backward too")
    ap.add_argument("--heads", type=int, default=16, help="value heads (default 16, Qwen3.5-2B)")
    ap.add_argument("--head-dim", type=int, default=128, help="key and value head dim (default 128)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    if any(rows < 8 for rows in args.rows):
        ap.error("--rows: each pack needs at least 8 rows (5 samples)")
    calls = []
    for rows in args.rows:
        seconds = one_pack(rows, args.heads, args.head_dim, args.backward)
        calls.append({"rows": rows, "multiple_of_16": rows % 16 == 0, "ms": seconds * 1e3})
        log(f"rows {rows:6d} ({'a multiple of 16' if rows % 16 == 0 else f'{rows % 16} past a multiple of 16'}): "
            f"{seconds * 1e3:8.1f} ms")
    if args.json_out:
        write_json(args.json_out, {"machine": machine_info(), "args": vars(args), "calls": calls})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
