"""Parallelism, applied in one place: process groups, seeds, model stages, device.

`init_parallel(tp, pp)` starts torch.distributed (NCCL on GPUs, gloo on CPU; one process per
device under torchrun, or a single process without it), megatron-core's model-parallel
groups, and the RNG tracker. DP size = world / (tp * pp).

CPU runs (tests, smoke runs) work with megatron-core 0.16.1 because:
- weights are initialised on CPU (`use_cpu_initialization`, which also makes the initial
  weights independent of the TP size: the full matrix is drawn, then split);
- the RNG tracker is megatron's own no-op-fork variant (`inference_rng_tracker=True`): the
  CUDA tracker cannot fork CPU generators, and with dropout 0 nothing draws from it;
- our attention and rotary code never builds the default causal mask on "cuda";
- megatron allocates its gradient buffers (DDP) on `torch.cuda.current_device()`: on a
  machine without CUDA that call answers "cpu" (`_cpu_device_shim`, set only there).
"""

from __future__ import annotations

import datetime
import os
import random
import socket
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel.utils import get_pp_last_rank

from train.config import ConfigError


@dataclass(frozen=True)
class ParallelInfo:
    rank: int
    world: int
    tp: int
    pp: int
    dp: int
    dp_rank: int
    pp_rank: int
    tp_rank: int
    device: torch.device
    ep: int = 1  # expert parallelism: carved from the TP x DP ranks of a stage
    ep_rank: int = 0
    expert_dp_rank: int = 0  # rank among the ranks that hold the same experts

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_parallel(tp: int = 1, pp: int = 1, *, ep: int = 1, device: str | None = None, seed: int = 0) -> ParallelInfo:
    """`ep`: expert-parallel size of Mixture-of-Experts layers, carved from the tp x dp ranks
    of a pipeline stage (megatron's expert rank order: the EP rank runs fastest, so under TP
    the ranks of a TP group hold different experts). Experts are never split over TP ranks
    (expert TP 1): each is small, and whole experts keep the grouped GEMM's shapes those of
    the checkpoint."""
    use_cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    if not use_cuda and not torch.cuda.is_available():
        _cpu_device_shim()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        timeout = datetime.timedelta(minutes=30)
        if "WORLD_SIZE" in os.environ:  # torchrun (or another launcher) set the rendezvous
            dist.init_process_group(backend=backend, timeout=timeout)
        else:  # a lone process: a private store on a free port, the environment left alone
            dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                                    world_size=1, timeout=timeout)
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ConfigError(f"--tp {tp} x --pp {pp} needs a multiple of {tp * pp} processes, this run has {world}: "
                          "launch it with torchrun --nproc-per-node N")
    if (world // pp) % ep:
        raise ConfigError(f"the {world // pp} ranks of a pipeline stage cannot be split into expert-parallel groups "
                          f"of --ep {ep}: use an --ep that divides the number of processes / --pp")
    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                      expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
                                      create_gloo_process_groups=True)
    seed_everything(seed)
    if use_cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    return ParallelInfo(rank=dist.get_rank(), world=world, tp=tp, pp=pp, dp=world // (tp * pp),
                        dp_rank=mpu.get_data_parallel_rank(), pp_rank=mpu.get_pipeline_model_parallel_rank(),
                        tp_rank=mpu.get_tensor_model_parallel_rank(),
                        device=torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu"),
                        ep=ep, ep_rank=mpu.get_expert_model_parallel_rank(),
                        expert_dp_rank=mpu.get_expert_data_parallel_rank())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cpu_device_shim() -> None:
    torch.cuda.current_device = lambda: "cpu"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def destroy_parallel() -> None:
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def finalize_grads(model_chunks: list, num_tokens: torch.Tensor | None = None, pg_collection=None,
                   force_all_reduce: bool = False) -> None:
    """megatron's `finalize_model_grads` (the gradients reduced over the data-parallel ranks),
    then divided by the global batch's target-token count `num_tokens` (summed over those ranks)
    with the count's reciprocal as a host float. megatron multiplies by a 0-dim GPU tensor
    instead: with bf16 gradients that runs as a non-vectorised, dtype-casting kernel over the
    whole gradient buffer (benchmarks/grad_scaling.py). The count comes to the host either way:
    megatron too tests it for zero before scaling."""
    finalize_model_grads(model_chunks, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
    if num_tokens is None:
        return
    pp_group = pg_collection.pp if pg_collection is not None else mpu.get_pipeline_model_parallel_group()
    dp_group = (pg_collection.dp_cp if pg_collection is not None
                else mpu.get_data_parallel_group(with_context_parallel=True))
    dist.broadcast(num_tokens, src=get_pp_last_rank(pp_group), group=pp_group)  # the last stage counted them
    dist.all_reduce(num_tokens, group=dp_group)
    count = int(num_tokens.item())
    if count > 0:
        for chunk in model_chunks:
            chunk.scale_gradients(1.0 / count)


def build_model(arch, config, info: ParallelInfo, recompute_vision: bool | None = None,
                recompute_vision_blocks: int | None = None, compile: bool = False, compile_decoder: bool = True,
                static_rows: bool = False, recompute_mlp_activations: bool = True):
    """This rank's pipeline stage of the model, on its device; `compile`: torch.compile its
    elementwise-heavy parts (CUDA only: CPU runs are tests and stay eager), with
    `compile_decoder` its dense decoder layers too, for one row count with `static_rows`
    (`compile_model`; `recompute_mlp_activations` its MLPs' activations in backward)."""
    from train.model.qwen_vl import QwenVLModel, compile_model

    model = QwenVLModel(arch, config, pre_process=info.first_stage, post_process=info.last_stage,
                        recompute_vision=recompute_vision, recompute_vision_blocks=recompute_vision_blocks).to(info.device)
    if compile and info.device.type == "cuda":
        compile_model(model, decoder=compile_decoder, static_rows=static_rows,
                      recompute_mlp_activations=recompute_mlp_activations)
    return model
