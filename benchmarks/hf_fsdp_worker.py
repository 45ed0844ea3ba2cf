"""One data-parallel training run of Hugging Face transformers under torch FSDP2, on the
strongest single-GPU recipe (`hf_baseline.py`: padding-free packs, varlen attention, Liger,
fused AdamW): the multi-GPU baseline that `loss_curves.py --hf-fsdp N` runs on the same shard
directory and GPUs as the trainer's layouts. One process per GPU:

    python -m torch.distributed.run --standalone --nproc-per-node N benchmarks/hf_fsdp_worker.py \\
        --data DIR --out OUT --arch ARCH --seq-len S --global-batch-packs G --steps K [--layers L]

Packs: vlmpack's own plan of DIR (`build_pack_plan`, the trainer's seed, --seq-len and global
batch), each global batch split over the ranks as the trainer splits it (`rank_packs`), so both
sides train on the same packs in the same order. Weights: rank 0 writes random weights of the
arch as an HF checkpoint (`hf_baseline.write_init_checkpoint`, --seed) and every rank loads it.

Model: `hf_baseline.HFPackedTrainer`, then `torch.distributed.fsdp.fully_shard` on every decoder
layer and on the root: parameters, gradients and Adam state are split over the N ranks, compute
and reductions stay bf16. Each rank weights its packs' mean losses by their targets over the
global batch's target count (summed over the ranks) times N, since FSDP2 averages gradients over
the ranks: the gradient is the per-token mean of the global batch, as the trainer's. The vision
tower is in the root unit, and the loss gets 0 x the sum of its parameters: a rank whose packs
hold no image or video does not call the tower, and FSDP2 reduce-scatters only parameters that
have a gradient, so without that term the ranks' gradient reductions would differ and hang.

Each step is timed from a barrier to a barrier. Rank 0 appends one record per step to
OUT/metrics.jsonl with the trainer's keys: loss (per target token over the global batch), tokens,
target_tokens, step_seconds, tokens_per_s, tokens_per_s_per_gpu, mfu (6 * N_lm per token), rank
0's peak allocated memory and, for a MoE model, the experts kernel transformers chose. Out of
memory is not caught: the launcher stops every rank, and loss_curves.py retries with
--gradient-checkpointing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import parser, register_fewer_layers
from hf_baseline import HFPackedTrainer, Recipe, collate_pack, lr_schedule, write_init_checkpoint

from shards_schema import open_shards
from shards_schema.flags import parse_bool
from train.metrics import lm_flops_per_token, peak_tflops
from train.model.arch import builtin_arch
from train.pack_plan import PackSettings, build_pack_plan


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser(__doc__, json_out=None)
    ap.add_argument("--data", required=True, help="shard directory")
    ap.add_argument("--out", required=True, help="directory for metrics.jsonl (and the initial weights)")
    ap.add_argument("--arch", required=True, help="builtin architecture (random init)")
    ap.add_argument("--layers", type=int, default=None, help="keep only this many decoder layers")
    ap.add_argument("--seq-len", type=int, required=True, help="pack length, as the trainer's")
    ap.add_argument("--global-batch-packs", type=int, required=True, help="packs per step over all ranks")
    ap.add_argument("--steps", type=int, required=True, help="training steps")
    ap.add_argument("--seed", type=int, default=0, help="init and pack-plan seed (the trainer's --seed)")
    ap.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    ap.add_argument("--warmup-steps", type=int, default=0, help="linear learning-rate warm-up steps (the trainer's)")
    ap.add_argument("--train-steps", type=int, default=None,
                    help="steps of the cosine decay to 0, as the trainer's --train-steps (default --steps)")
    ap.add_argument("--liger", type=parse_bool, default=True, help="apply Liger's kernels (default true)")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="transformers' per-layer recompute")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: gloo, fp32 (smoke runs)")
    return ap.parse_args(argv)


def shard_model(model: torch.nn.Module, mesh) -> None:
    """One FSDP2 unit per decoder layer; the rest (embeddings, vision tower, norm, head) is the
    root unit, kept gathered from its forward to its backward."""
    from torch.distributed.fsdp import fully_shard

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in inner.model.language_model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    visual = inner.model.visual

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
    arch = builtin_arch(register_fewer_layers(args.arch, args.layers) if args.layers else args.arch)
    out = Path(args.out)
    init_dir = out / "init"
    if rank == 0:
        write_init_checkpoint(arch, init_dir, args.seed, torch.bfloat16 if cuda else torch.float32, device)
    dist.barrier()

    shards = open_shards(args.data)
    plan = build_pack_plan([args.data], PackSettings(seq_len=args.seq_len, seed=args.seed, dp_size=world,
                                                     global_batch_packs=args.global_batch_packs))
    mine = plan.rank_packs(rank, world)
    per_rank = args.global_batch_packs // world
    if len(mine) < args.steps * per_rank:
        raise SystemExit(f"{len(mine)} packs for rank {rank}, {args.steps} steps need {args.steps * per_rank}: "
                         "more samples or fewer --steps")

    recipe = Recipe(lr=args.lr, liger=args.liger, gradient_checkpointing=args.gradient_checkpointing,
                    train_steps=args.train_steps or args.steps, warmup_steps=args.warmup_steps)
    hf = HFPackedTrainer(arch, init_dir, shards.manifest["profile"], recipe, device)
    shard_model(hf.model, mesh)
    hf.params = [p for p in hf.model.parameters() if p.requires_grad]
    hf.optimizer = torch.optim.AdamW(hf.params, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    hf.scheduler = lr_schedule(hf.optimizer, recipe)

    metrics = out / "metrics.jsonl"
    n_lm, peak = lm_flops_per_token(arch), peak_tflops(device) * 1e12
    # which MoE experts kernel transformers chose (grouped_mm, batched_mm, eager); None when dense
    experts = getattr(hf.model.config.get_text_config(), "_experts_implementation", None) if arch.lm.is_moe else None
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(1, args.steps + 1):
        packs = [collate_pack([shards[int(i)] for i in plan.pack_samples(int(p))[1]])
                 for p in mine[(step - 1) * per_rank:step * per_rank]]
        counts = torch.tensor([sum(p["tokens"] for p in packs), sum(p["targets"] for p in packs)],
                              dtype=torch.float64, device=device)
        dist.all_reduce(counts)
        tokens, targets = int(counts[0]), int(counts[1])
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        loss = hf.step(packs, targets=targets, scale=world)
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()
        seconds = time.perf_counter() - t0
        total = torch.tensor([loss / world], dtype=torch.float64, device=device)  # this rank's share of the mean
        dist.all_reduce(total)
        if rank == 0:
            tps = tokens / seconds
            record = {"step": step, "loss": float(total), "tokens": tokens, "target_tokens": targets,
                      "packs_per_rank": per_rank, "step_seconds": seconds, "tokens_per_s": tps,
                      "tokens_per_s_per_gpu": tps / world, "mfu": tps / world * n_lm / peak if peak else None,
                      "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
                      "experts_implementation": experts, "liger": hf.liger.function}
            with open(metrics, "a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"step {step}/{args.steps}: {tokens:,} tokens in {seconds:.2f} s ({tps:,.0f} tok/s), "
                  f"loss {record['loss']:.4f}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
