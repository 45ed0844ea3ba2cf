"""One data-parallel training run of Hugging Face transformers under torch FSDP2: the multi-GPU
baseline that `loss_curves.py --hf-fsdp N` runs on the same shard directory and GPUs as the
trainer's layouts. One process per GPU:

    python -m torch.distributed.run --standalone --nproc-per-node N benchmarks/hf_fsdp_worker.py \\
        --data DIR --out OUT --arch ARCH --batch B --steps S [--layers L] [--gradient-checkpointing]

Model: `train_speed.HFTrainer`, the single-GPU baseline (random init from --seed, sdpa, bf16
parameters, torch AdamW betas 0.9/0.95, clipping 1.0, optional transformers gradient
checkpointing), then `torch.distributed.fsdp.fully_shard` on every decoder layer and on the
root: parameters, gradients and Adam state are split over the N ranks, compute and reductions
stay bf16. The vision tower is in the root unit, and the loss gets 0 x the sum of its
parameters: a rank whose batch holds no image or video does not call the tower, and FSDP2
reduce-scatters only parameters that have a gradient, so without that term the ranks' gradient
reductions would differ in size and hang (as ZeRO-3 trainers feed a dummy image for the same
reason). The optimizer is rebuilt over the sharded parameters.

Samples: every sample of DIR, shuffled from --seed; step k of rank r trains on the right-padded
batch k * N + r of B samples (`to_padded_batch`, collated before the clock starts). Each step is
timed from a barrier to a barrier, so every rank's step is in it. Rank 0 appends one record per
step to OUT/metrics.jsonl with the trainer's keys: loss (mean over ranks), tokens (real tokens
of all ranks), padded_tokens, step_seconds, tokens_per_s, tokens_per_s_per_gpu, mfu (6 * N_lm
per real token), rank 0's peak allocated memory and, for a MoE model, the experts kernel
transformers chose (`experts_implementation`: grouped_mm, batched_mm or eager). Out of memory
is not caught: the launcher stops every rank, and loss_curves.py tries the next smaller batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from common import register_fewer_layers
from train_speed import HFTrainer

from shards_schema import open_shards
from train.metrics import lm_flops_per_token, peak_tflops
from train.model.arch import builtin_arch


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="shard directory")
    ap.add_argument("--out", required=True, help="directory for metrics.jsonl")
    ap.add_argument("--arch", required=True, help="builtin architecture (random init)")
    ap.add_argument("--layers", type=int, default=None, help="keep only this many decoder layers")
    ap.add_argument("--batch", type=int, required=True, help="samples per rank per step")
    ap.add_argument("--steps", type=int, required=True, help="training steps")
    ap.add_argument("--seed", type=int, default=0, help="init and sample-order seed")
    ap.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="transformers' per-layer recompute")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: gloo, fp32 (smoke runs)")
    return ap.parse_args(argv)


def shard_model(model: torch.nn.Module, mesh) -> None:
    """One FSDP2 unit per decoder layer; the rest (embeddings, vision tower, norm, head) is the
    root unit, kept gathered from its forward to its backward."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.language_model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    visual = model.model.visual

    def every_vision_parameter_in_the_loss(module, inputs, output):
        output.loss = output.loss + 0.0 * sum(p.sum() for p in visual.parameters())
        return output

    model.register_forward_hook(every_vision_parameter_in_the_loss)


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = args.device == "cuda"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,))
    arch_name = register_fewer_layers(args.arch, args.layers) if args.layers else args.arch
    arch = builtin_arch(arch_name)

    shards = open_shards(args.data)
    profile = shards.manifest["profile"]
    hf_args = argparse.Namespace(hf_precision="bf16", seed=args.seed, lr=args.lr, lora_rank=0,
                                 hf_gradient_checkpointing=args.gradient_checkpointing)
    hf = HFTrainer(hf_args, arch, profile, device)
    shard_model(hf.model, mesh)
    hf.params = [p for p in hf.model.parameters() if p.requires_grad]
    hf.optimizer = torch.optim.AdamW(hf.params, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

    order = np.random.default_rng(args.seed).permutation(len(shards))
    need = args.steps * world * args.batch
    order = np.resize(order, need)  # more steps than samples: the order repeats
    out = Path(args.out)
    metrics = out / "metrics.jsonl"
    n_lm, peak = lm_flops_per_token(arch), peak_tflops(device) * 1e12
    # which MoE experts kernel transformers chose (grouped_mm, batched_mm, eager); None when dense
    experts = getattr(hf.model.config.get_text_config(), "_experts_implementation", None) if arch.lm.is_moe else None
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(1, args.steps + 1):
        first = ((step - 1) * world + rank) * args.batch
        batch = hf.collate([shards[int(i)] for i in order[first:first + args.batch]])
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        loss = hf.step(batch)
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()
        seconds = time.perf_counter() - t0
        totals = torch.tensor([loss, batch["real_tokens"], batch["padded_tokens"]], dtype=torch.float64,
                              device=device)
        dist.all_reduce(totals)
        if rank == 0:
            tokens = int(totals[1])
            tps = tokens / seconds
            record = {"step": step, "loss": float(totals[0]) / world, "tokens": tokens,
                      "padded_tokens": int(totals[2]), "batch_per_rank": args.batch, "step_seconds": seconds,
                      "tokens_per_s": tps, "tokens_per_s_per_gpu": tps / world,
                      "mfu": tps / world * n_lm / peak if peak else None,
                      "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
                      "experts_implementation": experts}
            with open(metrics, "a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"step {step}/{args.steps}: {tokens:,} real tokens in {seconds:.2f} s ({tps:,.0f} tok/s), "
                  f"loss {record['loss']:.3f}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
