"""Training checkpoints: save every N steps and at the end, resume exactly.

    OUT/checkpoints/step_00000100/
        model/               the weights as a Megatron model directory (train.convert's format:
                             `vlmpack export-hf` and `--init` read it directly)
        rank_00000.pt ...    per rank: optimizer (+ scheduler), RNG states, step
        optimizer_param_state_pp{p}_tp{t}.pt  distributed optimizer's parameter state (DP rank 0 of each model-parallel group)
        trainer.json         step, loader state, config, arch, layout
    OUT/checkpoints/latest   name of the newest complete checkpoint

A checkpoint is written to `step_N.tmp/` by all ranks; after a barrier rank 0 renames it and
then updates `latest` (atomic replace), so a killed job leaves either the previous
checkpoint or the new one, never a torn one, and loses at most the steps since the last save.
The loader state makes `--resume` continue with exactly the next pack; the RNG and optimizer
states make the continuation equal to an uninterrupted run (bitwise on CPU).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from shards_schema.atomic import atomic_open, fsync_dir, write_json_atomic
from train import checkpoint_format as fmt
from train import convert
from train.model.arch import ModelArch

CHECKPOINTS = "checkpoints"
LATEST = "latest"


def _unwrap(model):
    return model.module if hasattr(model, "module") else model


def read_model_arch(model_dir: str | Path) -> ModelArch:
    return fmt.read_arch(model_dir)


def load_hf_weights(model, hf_dir: str, arch: ModelArch, info) -> None:
    """Import a Hugging Face checkpoint into this rank's stage (no conversion step on disk)."""
    full = convert.hf_to_megatron(fmt.read_hf_state(hf_dir, progress=info.is_main), arch)
    convert.load_into_model(_unwrap(model), convert.shard(full, arch, info.tp, info.tp_rank, info.pp, info.pp_rank))


def _random_tensor(name: str, shape: tuple[int, ...], seed: int, std: float, num_layers: int) -> torch.Tensor:
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if "norm" in name:  # RMSNorm / LayerNorm gains
        return torch.ones(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")) and name.startswith("language_model."):
        std = std / math.sqrt(2.0 * num_layers)  # megatron's scaled init of the residual-branch outputs
    return torch.randn(shape, generator=generator) * std


def init_random_weights(model, arch: ModelArch, seed: int, info, std: float = 0.02) -> None:
    """Random init that depends only on (seed, parameter name), never on the TP/PP layout: every
    tensor of the full model is drawn from its own generator, then sharded like a checkpoint.
    So 1 GPU, DP, TP and PP runs start from the same weights and their loss curves compare."""
    layers = convert.stage_layers(arch, info.pp)[info.pp_rank]

    def on_this_stage(name: str) -> bool:
        return not name.startswith("language_model.decoder.layers.") or int(name.split(".")[3]) in layers

    full = {n: _random_tensor(n, shape, seed, std, arch.lm.num_layers) if on_this_stage(n)
            else torch.empty(shape, device="meta")  # other stages' layers: never drawn, never loaded
            for n, shape in convert.megatron_shapes(arch).items()}
    convert.load_into_model(_unwrap(model), convert.shard(full, arch, info.tp, info.tp_rank, info.pp, info.pp_rank))


def load_model_weights(model, model_dir: str | Path, arch: ModelArch, info) -> None:
    state = convert.load_model_state(model_dir, arch, info.tp, info.tp_rank, info.pp, info.pp_rank)
    convert.load_into_model(_unwrap(model), state)


def _rng_state(device) -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict, device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _distributed_optimizers(optimizer) -> list:
    return [o for o in getattr(optimizer, "chained_optimizers", [optimizer]) if type(o).__name__ == "DistributedOptimizer"]


def _uses_distributed_optimizer(optimizer) -> bool:
    return bool(_distributed_optimizers(optimizer))


def _load_parameter_state(optimizer, filename: str) -> None:
    """megatron-core 0.16.1 with torch's AdamW (no Apex / TE) has two bugs here, both fixed
    around the call: `load_state_dict` puts ONE 'step' tensor into every parameter's state,
    so AdamW's foreach step would add 1 to it once per parameter (wrong bias correction from
    the first step after a resume); and `load_parameter_state` copies every state key from the
    file, which holds none for 'step' (KeyError). The steps are set aside for the copy and
    put back, one tensor per parameter."""
    inner = [o.optimizer for o in _distributed_optimizers(optimizer)]
    steps = [{p: s.pop("step") for p, s in opt.state.items() if "step" in s} for opt in inner]
    try:
        optimizer.load_parameter_state(filename)
    finally:
        for opt, saved in zip(inner, steps):
            for param, step in saved.items():
                opt.state[param]["step"] = step.clone()


def save(out: Path, step: int, model, optimizer, scheduler, data, config, arch: ModelArch, info) -> Path:
    root = Path(out) / CHECKPOINTS
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    module = _unwrap(model)
    state = {k: v for k, v in module.state_dict().items() if not k.endswith("_extra_state")}
    if info.dp_rank == 0:
        (tmp / "model").mkdir(exist_ok=True)
        fmt.save_tensors(tmp / "model" / fmt.rank_file(info.tp_rank, info.pp_rank), state)
    if _uses_distributed_optimizer(optimizer):
        optimizer.save_parameter_state(str(tmp / f"optimizer_param_state_pp{info.pp_rank}_tp{info.tp_rank}.pt"))
    with atomic_open(tmp / f"rank_{info.rank:05d}.pt") as fh:
        torch.save({"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "rng": _rng_state(info.device)}, fh)
    dist.barrier()
    if info.is_main:
        fmt.write_meta(tmp / "model", arch, info.tp, info.pp, fmt.dtype_name(state.values()))
        side_files = config.hf_model or (Path(config.init) / fmt.HF_SUBDIR if config.init else None)
        if side_files and Path(side_files).is_dir():  # tokenizer/processor files travel to export-hf
            fmt.copy_hf_side_files(side_files, tmp / "model" / fmt.HF_SUBDIR)
        write_json_atomic(tmp / "trainer.json", {
            "step": step, "loader": data.state_dict(), "config": config.to_dict(),
            "layout": {"tp": info.tp, "pp": info.pp, "dp": info.dp, "world": info.world}})
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(root)
        with atomic_open(root / LATEST, "w") as fh:
            fh.write(final.name)
    dist.barrier()
    return final


def latest_checkpoint(out: Path) -> Path | None:
    pointer = Path(out) / CHECKPOINTS / LATEST
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if path.is_dir() else None


def resume(out: Path, model, optimizer, scheduler, data, info) -> int:
    """Restore the newest checkpoint under OUT; returns its step (0 if there is none)."""
    path = latest_checkpoint(out)
    if path is None:
        if info.is_main:
            print(f"--resume: no checkpoint under {Path(out) / CHECKPOINTS}; starting from step 0", flush=True)
        return 0
    meta = json.loads((path / "trainer.json").read_text())
    layout = meta["layout"]
    if (layout["tp"], layout["pp"], layout["world"]) != (info.tp, info.pp, info.world):
        raise ValueError(f"{path} was written with tp={layout['tp']} pp={layout['pp']} on {layout['world']} ranks; "
                         f"resume with the same layout, or start a new run from its weights with --init {path / 'model'}")
    arch = read_model_arch(path / "model")
    load_model_weights(model, path / "model", arch, info)
    rank_state = torch.load(path / f"rank_{info.rank:05d}.pt", map_location="cpu", weights_only=False)
    optimizer.load_state_dict(rank_state["optimizer"])
    if _uses_distributed_optimizer(optimizer):
        _load_parameter_state(optimizer, str(path / f"optimizer_param_state_pp{info.pp_rank}_tp{info.tp_rank}.pt"))
    scheduler.load_state_dict(rank_state["scheduler"])
    data.load_state_dict(meta["loader"])
    _set_rng_state(rank_state["rng"], info.device)
    if info.is_main:
        print(f"resumed from {path} (step {meta['step']})", flush=True)
    return int(meta["step"])


def export_hf_from_run(out: Path, step: int, hf_out: str, info) -> None:
    if info.is_main:
        path = latest_checkpoint(out)
        convert.export_hf(path / "model", hf_out)
        print(f"exported {path.name} to {hf_out}", flush=True)
    dist.barrier()
