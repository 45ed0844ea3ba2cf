"""The end of a global batch's backward, side by side in one process: megatron's
`finalize_model_grads` against `train.parallel.finalize_grads`, on the real model's gradient
buffers under megatron DDP on one GPU.

Both reduce the gradients over the data-parallel ranks (none here) and divide them by the
global batch's target-token count. megatron multiplies the buffer by the count's reciprocal as
a 0-dim GPU tensor; `finalize_grads` by a host float. Reported per gradient dtype: milliseconds
per call (median, CUDA-synchronised), the gradient buffer's size, and the ratio; and whether the
two give the same gradients.

    python benchmarks/grad_scaling.py --arch qwen3-vl-8b --json-out benchmarks/results/grad_scaling_h200_<yyyymmdd>.json
"""

from __future__ import annotations

import statistics
import time

import torch
from common import machine_info, parser, write_json

from train.model.arch import builtin_arch


def time_calls(fn, model, tokens: int, warmup: int, calls: int) -> float:
    times = []
    for i in range(warmup + calls):
        count = torch.tensor(tokens, device="cuda", dtype=torch.int)
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn([model], num_tokens=count)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--arch", default="qwen3-vl-8b", help="built-in architecture whose gradient buffers are scaled")
    ap.add_argument("--tokens", type=int, default=16303, help="target tokens of the global batch (the divisor)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls first")
    ap.add_argument("--calls", type=int, default=10, help="timed calls per function")
    ap.add_argument("--grad-dtypes", default="bf16,fp32",
                    help="gradient buffer dtypes to measure, comma-separated (one model each, built in turn)")
    args = ap.parse_args()

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from train.model.qwen_vl import transformer_config
    from train.parallel import build_model, destroy_parallel, finalize_grads, init_parallel

    info = init_parallel(1, 1, device="cuda")
    arch = builtin_arch(args.arch)
    config = transformer_config(arch, params_dtype=torch.bfloat16, bf16=True)
    result = {"machine": machine_info(torch.device("cuda")), "args": vars(args), "grads": {}}
    for grad_dtype in args.grad_dtypes.split(","):
        model = DistributedDataParallel(config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=grad_dtype == "fp32", use_distributed_optimizer=True), build_model(arch, config, info))
        gen = torch.Generator(device="cuda").manual_seed(0)
        for buffer in model.buffers:
            buffer.grad_data.normal_(0.0, 1.0, generator=gen)
        saved = [buffer.grad_data.clone() for buffer in model.buffers]
        finalize_model_grads([model], num_tokens=torch.tensor(args.tokens, device="cuda", dtype=torch.int))
        theirs = [buffer.grad_data.clone() for buffer in model.buffers]
        for buffer, grads in zip(model.buffers, saved):  # the same gradients again, through ours
            buffer.grad_data.copy_(grads)
        finalize_grads([model], num_tokens=torch.tensor(args.tokens, device="cuda", dtype=torch.int))
        diff = eps = 0.0
        for buffer, other in zip(model.buffers, theirs):
            for ours_part, theirs_part in zip(buffer.grad_data.split(1 << 28), other.split(1 << 28)):
                diff = max(diff, (ours_part.float() - theirs_part.float()).abs().max().item())
                eps = max(eps, theirs_part.float().abs().max().item() * torch.finfo(theirs_part.dtype).eps)
        del saved, theirs
        # Timed calls keep dividing the same buffers; a GPU multiply takes the same time whatever the values.
        megatron_ms = time_calls(finalize_model_grads, model, args.tokens, args.warmup, args.calls)
        ours_ms = time_calls(finalize_grads, model, args.tokens, args.warmup, args.calls)
        gib = sum(b.grad_data.numel() * b.grad_data.element_size() for b in model.buffers) / 2**30
        row = {"buffer_gib": gib, "megatron_ms": megatron_ms, "ours_ms": ours_ms,
               "megatron_over_ours": megatron_ms / ours_ms, "max_abs_difference": diff,
               "largest_gradient_eps": eps}
        result["grads"][grad_dtype] = row
        print(f"{grad_dtype} gradients, {gib:.1f} GiB: megatron {megatron_ms:.1f} ms, ours {ours_ms:.1f} ms "
              f"({megatron_ms / ours_ms:.2f}x); largest difference {diff:.3g} "
              f"(the largest gradient times its dtype's eps: {eps:.3g})", flush=True)
        del model
        torch.cuda.empty_cache()
    destroy_parallel()
    if args.json_out:
        write_json(args.json_out, result)


if __name__ == "__main__":
    main()
