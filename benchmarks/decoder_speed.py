"""The language model's decoder layers alone, forward + backward, with and without CUDA graphs.

    python3 benchmarks/decoder_speed.py --arch qwen3-vl-2b --json-out FILE.json

What CUDA graphs could take off the language model's part of a training step, at best: the
real architecture's decoder layers as the trainer builds them (random weights, bf16, megatron's
DDP with each linear's weight gradient added into its gradient buffer), one pack of
`--seq-len` rows cut into documents like the training mix, the same pack at every repetition,
so every shape is fixed (the case graph replay needs; the trainer's packs differ in their
document count and longest document). Modes, interleaved `--reps` times:

- `compiled`: what the trainer runs with `--pad-packs`: each decoder layer one Inductor graph
  compiled for the pack's row count (`compile_model(static_rows=True)`), launched from Python;
- `graphs`: the same layer graphs compiled with `mode="reduce-overhead"` (Inductor's CUDA graph
  trees: each layer's forward and backward recorded once, then replayed), the gradient
  buffers marked as static addresses so that the backward's adds into them can be recorded.

Per mode: the median wall time of one forward+backward (synchronised), the host's own time
to queue it (until `backward()` returns) and the GPU's kernel time from one profiled
repetition; then Inductor's counters named for CUDA graphs and the graphs it declined to
record, with its reasons. Both modes start from the same weights and input; their weight
gradients are compared. Memory is not compared: the allocator's peak does not count what graph
trees keep in their own pool.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time

import numpy as np
import torch
from common import log, machine_info, parser, write_json

from train.model.arch import builtin_arch
from train.model.attention import PackedRows, select_attention_kernel
from train.model.linear import use_grad_buffers
from train.model.qwen_vl import transformer_config
from train.parallel import build_model, destroy_parallel, init_parallel

MODES = ("compiled", "graphs")


def parse_args(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--arch", default="qwen3-vl-2b", help="built-in architecture whose decoder layers run")
    ap.add_argument("--layers", type=int, default=None, help="run only the first N decoder layers (default: all)")
    ap.add_argument("--seq-len", type=int, default=16384, help="rows of the pack (default %(default)s)")
    ap.add_argument("--doc-tokens", type=int, nargs=2, default=(200, 4000), metavar=("MIN", "MAX"),
                    help="tokens per document of the pack, drawn uniformly (default %(default)s)")
    ap.add_argument("--recompute-layers", type=int, default=0,
                    help="recompute the first N layers in backward (megatron's full recompute, block method; "
                         "default %(default)s: none)")
    ap.add_argument("--attention", default="fa2", choices=("fa2", "fa4"), help="CUDA attention kernel")
    ap.add_argument("--reps", type=int, default=8, help="interleaved repetitions of both modes (medians reported)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed passes per mode first (compile, graph recording)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the pack and the weights")
    return ap.parse_args(argv)


def document_bounds(rng: np.random.Generator, rows: int, tokens: tuple[int, int]) -> list[int]:
    """cu_seqlens of one pack: documents of `tokens` lengths until `rows` are filled."""
    bounds = [0]
    while bounds[-1] < rows:
        bounds.append(min(rows, bounds[-1] + int(rng.integers(tokens[0], tokens[1] + 1))))
    return bounds


class SkippedGraphs(logging.Handler):
    """Inductor's reasons for running a graph without CUDA graphs (its perf-hint log)."""

    def __init__(self):
        super().__init__()
        self.reasons: dict[str, int] = {}

    def emit(self, record):
        msg = record.getMessage()
        if "cudagraph" in msg.lower():
            self.reasons[msg] = self.reasons.get(msg, 0) + 1


def build(arch, mode: str, info, seed: int, recompute_layers: int):
    """The whole model built and compiled as the trainer does, wrapped in megatron's DDP with
    gradient buffers; `graphs` recompiles the decoder layers with CUDA graph trees."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from train.model.qwen_vl import DecoderLayer

    recompute = {"recompute": "full", "recompute_layers": recompute_layers} if recompute_layers else {}
    config = transformer_config(arch, params_dtype=torch.bfloat16, bf16=True, calculate_per_token_loss=True,
                                **recompute)
    torch.manual_seed(seed)
    model = build_model(arch, config, info, compile=True, static_rows=True)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    layers = [m for m in model.language_model.decoder.layers if isinstance(m, DecoderLayer)]
    if mode == "graphs":
        forward = torch.compile(TransformerLayer.forward, mode="reduce-overhead", dynamic=False)
        for layer in layers:
            layer.compiled_forward = forward
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=False), model)
    use_grad_buffers(ddp)
    if mode == "graphs":
        for module in ddp.modules():
            if getattr(module, "grad_buffer", None) is not None:
                torch._dynamo.mark_static_address(module.grad_buffer)
    return ddp


def fwd_bwd(ddp, hidden: torch.Tensor, packed: PackedRows, grad: torch.Tensor, mode: str) -> float:
    """One forward + backward of the decoder block; returns the host's queueing seconds."""
    if mode == "graphs":
        torch.compiler.cudagraph_mark_step_begin()
    ddp.zero_grad_buffer()
    t0 = time.perf_counter()
    out = ddp.module.language_model.decoder(hidden_states=hidden, attention_mask=None, packed_seq_params=packed)
    out.backward(grad)
    return time.perf_counter() - t0


def kernel_seconds(fn) -> float:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6


def main(argv=None) -> int:
    args = parse_args(argv)
    from torch._dynamo.utils import counters

    if not torch.cuda.is_available():
        print("decoder_speed.py needs a CUDA GPU", file=sys.stderr)
        return 2
    skipped = SkippedGraphs()
    torch._logging.set_logs(perf_hints=True)
    logging.getLogger("torch._inductor").addHandler(skipped)

    arch = builtin_arch(args.arch)
    if args.layers is not None:
        from common import register_fewer_layers
        arch = builtin_arch(register_fewer_layers(args.arch, args.layers))
    select_attention_kernel(args.attention, {"language model": arch.lm.head_dim})
    info = init_parallel(1, 1, device="cuda", seed=args.seed)
    device = info.device
    rng = np.random.default_rng(args.seed)
    bounds = document_bounds(rng, args.seq_len, tuple(args.doc_tokens))
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)
    lengths = np.diff(bounds)
    positions = torch.from_numpy(np.concatenate([np.arange(n) for n in lengths])).to(device).expand(3, -1)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    hidden = torch.randn(args.seq_len, 1, arch.lm.hidden_size, device=device, dtype=torch.bfloat16, generator=gen)
    hidden.requires_grad_()
    grad = torch.randn(hidden.shape, device=device, dtype=torch.bfloat16, generator=gen)

    models, packed, compile_s = {}, {}, {}
    for mode in MODES:
        models[mode] = build(arch, mode, info, args.seed, args.recompute_layers)
        cos, sin = models[mode].module.rope(positions, torch.bfloat16)
        packed[mode] = PackedRows(qkv_format="sbhd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                  max_seqlen_q=int(lengths.max()), max_seqlen_kv=int(lengths.max()),
                                  rope_cos=cos, rope_sin=sin)
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            fwd_bwd(models[mode], hidden, packed[mode], grad, mode)
        torch.cuda.synchronize()
        compile_s[mode] = time.perf_counter() - t0
        log(f"{mode}: {args.warmup} warmup passes in {compile_s[mode]:.1f} s")

    # Same weights, same input: the two modes must give the same gradients.
    grads = {}
    for mode in MODES:
        hidden.grad = None
        fwd_bwd(models[mode], hidden, packed[mode], grad, mode)
        torch.cuda.synchronize()
        grads[mode] = [p.main_grad.float().clone() for p in models[mode].module.language_model.decoder.parameters()]
        grads[mode].append(hidden.grad.float().clone())
    grad_rel = max(((a - b).norm() / a.norm().clamp(min=1e-30)).item() for a, b in zip(*grads.values()))
    del grads

    wall = {m: [] for m in MODES}
    host = {m: [] for m in MODES}
    for rep in range(args.reps):
        for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
            hidden.grad = None
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            host[mode].append(fwd_bwd(models[mode], hidden, packed[mode], grad, mode))
            torch.cuda.synchronize()
            wall[mode].append(time.perf_counter() - t0)
    kernels = {mode: kernel_seconds(lambda m=mode: fwd_bwd(models[m], hidden, packed[m], grad, m)) for mode in MODES}

    per_mode = {mode: {"wall_s": statistics.median(wall[mode]), "host_s": statistics.median(host[mode]),
                       "kernel_s": kernels[mode], "wall_s_reps": wall[mode]}
                for mode in MODES}
    for row in per_mode.values():
        row["gpu_busy"] = row["kernel_s"] / row["wall_s"]
    result = {
        "machine": machine_info(device), "args": vars(args), "layers": arch.lm.num_layers,
        "documents": len(lengths), "max_seqlen": int(lengths.max()), "warmup_s": compile_s,
        "modes": per_mode, "graphs_over_compiled_wall": per_mode["compiled"]["wall_s"] / per_mode["graphs"]["wall_s"],
        "max_rel_grad_diff": grad_rel, "graphs_declined": skipped.reasons,
        "inductor_cudagraph_counters": {k: v for k, v in counters["inductor"].items() if "cudagraph" in k},
    }
    print(f"{args.arch} decoder, {arch.lm.num_layers} layers, one {args.seq_len}-row pack of {len(lengths)} documents, "
          f"{args.attention}, medians of {args.reps} reps, {result['machine']['device']}")
    for mode, row in per_mode.items():
        print(f"  {mode:>8}: wall {row['wall_s'] * 1e3:8.1f} ms, host {row['host_s'] * 1e3:8.1f} ms, "
              f"kernels {row['kernel_s'] * 1e3:8.1f} ms (GPU busy {row['gpu_busy']:.1%})")
    print(f"  compiled / graphs wall: {result['graphs_over_compiled_wall']:.3f}x; max rel grad diff {grad_rel:.3g}")
    print(f"  Inductor's CUDA graph counters: {result['inductor_cudagraph_counters']}")
    for reason, count in skipped.reasons.items():
        print(f"  declined x{count}: {reason}")
    if args.json_out:
        write_json(args.json_out, result)
    destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
