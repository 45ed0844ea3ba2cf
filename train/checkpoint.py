"""Training checkpoints: save every N steps and at the end, resume exactly.

    OUT/checkpoints/step_00000100/
        model/               the weights as a Megatron model directory (train.convert's format:
                             `vlmpack export-hf` and `--init` read it directly), with the
                             training data's profile (`checkpoint_format.PROFILE_FILE`); a LoRA
                             run has adapter/ instead (`train.adapter_format`)
        rank_00000.pt ...    per rank: optimizer (+ scheduler), RNG states, step
        optimizer_param_state_pp{p}_tp{t}[_ep{e}].pt  distributed optimizer's parameter state, written
                             by DP rank 0 of each model-parallel group; under --ep one file per
                             (TP, expert-parallel) rank pair of a writer: the dense state of DP
                             rank 0, the experts' state of the first rank that holds them
        trainer.json         step, loader state, config, arch, layout
    OUT/checkpoints/latest   name of the newest complete checkpoint

A checkpoint is written to `step_N.tmp/` by all ranks (by default on a background thread
while training goes on, see CheckpointSaver); once every rank's files are written rank 0
renames it and then updates `latest` (atomic replace), so a killed job leaves either the
previous checkpoint or the new one, never a torn one, and loses at most the steps since the
last complete save. Then the oldest checkpoints beyond --keep-last are deleted.
The loader state makes `--resume` continue with exactly the next pack; the RNG and optimizer
states make the continuation equal to an uninterrupted run (bitwise on CPU).
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import os
import pickle
import random
import re
import shutil
import sys
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from shards_schema.atomic import TMP_SUFFIX, atomic_open, fsync_dir, write_json_atomic
from shards_schema.errors import DiskFullError, UserError, first_few
from train import adapter_format
from train import checkpoint_format as fmt
from train import convert
from shards_schema.flags import flag_name
from shards_schema.manifest import MANIFEST_NAME
from shards_schema.outdir import recorded_command, shown_command, user_entries
from shards_schema.storage import is_url
from train.config import ConfigError
from train.metrics import METRICS_FILE
from train.model.arch import ModelArch, ModelFileError, read_json_object
from train.model_setup import load_model_weights, read_model_arch, unwrap

CHECKPOINTS = "checkpoints"
# the directories a run makes in --out, and what each holds
RUN_SUBDIRS = {CHECKPOINTS: "its checkpoints", "plans": "its pack plans", "tensorboard": "its TensorBoard scalars",
               "data_cache": "the shards fetched from a store", "profile": "its profiler traces",
               "wandb": "its Weights & Biases files"}
LATEST = "latest"
CHECKPOINT_NAME = re.compile(r"step_\d+")  # a save's directory; `step_00000004.bak` beside it is the user's
TRAINER_META = "trainer.json"


def _model_files(model_state: dict, arch: ModelArch, info) -> dict[str, dict]:
    """{file name: tensors} of the model directory (`checkpoint_format`) that this rank writes:
    its TP rank's stage file if it is DP rank 0 and, under --ep, its experts' file if it is the
    first of the ranks that hold those experts. Every file is written by exactly one rank."""
    if info.ep == 1:
        return {fmt.rank_file(info.tp_rank, info.pp_rank): model_state} if info.dp_rank == 0 else {}
    files = {}
    if info.dp_rank == 0:
        files[fmt.rank_file(info.tp_rank, info.pp_rank)] = convert.file_part(model_state, arch, info.pp, info.pp_rank,
                                                                             experts=False)
    if info.expert_dp_rank == 0:
        files[fmt.expert_file(info.pp_rank, info.ep_rank)] = convert.file_part(model_state, arch, info.pp,
                                                                               info.pp_rank, experts=True)
    return files


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


def parameter_state_file(info) -> str:
    """This rank's file of the distributed optimizer's parameter state. Under --ep a rank writes
    the dense parameters' state if it is DP rank 0 and its experts' state if it is rank 0 of
    the ranks that hold the same experts (megatron's chained list, the other entry None), so
    each expert-parallel rank has a file of its own."""
    ep = f"_ep{info.ep_rank}" if info.ep > 1 else ""
    return f"optimizer_param_state_pp{info.pp_rank}_tp{info.tp_rank}{ep}.pt"


def _load_parameter_state(optimizer, file: Path, checkpoint: Path) -> None:
    """The distributed optimizer's parameter state from `file` of `checkpoint`, as megatron's
    `load_parameter_state` loads it: DP rank 0 of each optimizer reads the file and scatters
    it. Here the readers read it first, and every rank learns whether each could
    (`on_every_rank`) before the scatter, where a reader's failure would leave the others waiting.

    megatron-core 0.16.1 with torch's AdamW (no Apex / TE) has two bugs here, both fixed
    around the load: `load_state_dict` puts ONE 'step' tensor into every parameter's state,
    so AdamW's foreach step would add 1 to it once per parameter (wrong bias correction from
    the first step after a resume); and the load copies every state key from the file, which
    holds none for 'step' (KeyError). The steps are set aside for the copy and put back, one
    tensor per parameter."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    loading = [(i, o) for i, o in enumerate(chained)
               if hasattr(o, "load_parameter_state_from_dp_zero") and not getattr(o, "is_stub_optimizer", False)]
    reads = any(o.data_parallel_group.rank() == 0 for _, o in loading)
    states = on_every_rank(lambda: _read_torch_file(file, checkpoint, weights_only=True) if reads else None, checkpoint)
    inner = [o.optimizer for o in _distributed_optimizers(optimizer) if not getattr(o, "is_stub_optimizer", False)]
    steps = [{p: s.pop("step") for p, s in opt.state.items() if "step" in s} for opt in inner]
    try:
        for index, o in loading:
            state = None if states is None or o.data_parallel_group.rank() != 0 else (
                states if len(chained) == 1 else states[index])
            o.load_parameter_state_from_dp_zero(state)
    finally:
        for opt, saved in zip(inner, steps):
            for param, step in saved.items():
                opt.state[param]["step"] = step.clone()


def on_every_rank(read, checkpoint: Path):
    """`read()`'s value. Where it fails on any rank (a damaged or unreadable file of
    `checkpoint`), every rank stops with the first failing rank's message, a UserError, before
    the collectives that follow could leave the others waiting for it."""
    value, error = None, None
    try:
        value = read()
    except UserError as exc:
        error = exc
    except (OSError, ValueError, KeyError, TypeError, EOFError, pickle.UnpicklingError) as exc:  # unreadable, or
        # of unexpected content: the file's failure all the same (our own CheckpointError says what, unnamed)
        what = "" if isinstance(exc, fmt.CheckpointError) else f"{type(exc).__name__}: "
        error = ModelFileError(f"{checkpoint}: {what}{(str(exc).strip().splitlines() or [''])[0]}",
                               damaged_checkpoint_fix(checkpoint))
    messages = [str(error) if error else ""]
    if dist.is_initialized() and dist.get_world_size() > 1:
        messages = [None] * dist.get_world_size()
        dist.all_gather_object(messages, str(error) if error else "")
    if error is not None:
        raise error
    failed = [m for m in messages if m]
    if failed:
        raise UserError(f"{failed[0]} (on another rank)")
    return value


def _gather_parameter_state(optimizer):
    """megatron's `save_parameter_state` without its `torch.save`: the DistributedOptimizer's
    parameter state gathered (a collective, so on the training thread) into new CPU tensors
    on DP rank 0, None elsewhere; a chained optimizer's as the list megatron's loader reads."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    states = [o.get_parameter_state_dp_zero() if hasattr(o, "get_parameter_state_dp_zero") else None for o in chained]
    return _one_or_list(states)


def _one_or_list(states: list):
    """What megatron's (Chained)Optimizer.save_parameter_state writes for these per-optimizer states."""
    if len(states) == 1:
        return states[0]
    return states if any(s is not None for s in states) else None


PARAMETER_STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context


class ParameterStateSnapshot:
    """The DistributedOptimizer's parameter state for a background save.

    megatron's `get_parameter_state_dp_zero` copies every parameter's main weights and Adam
    moments to the CPU one synchronous copy at a time into freshly zeroed buffers, then
    gathers them on DP rank 0 (on an H100, 60-75 s for a 2B model, all of it blocking
    training). Here the training thread only copies this rank's shards into reused pinned
    host buffers (asynchronous copies); `assemble()`, on the writer thread, lays them out and
    gathers them exactly as megatron does (same layout, same gloo group), so
    `load_parameter_state` reads the file as if megatron had written it."""

    def __init__(self, optimizer, host: HostCopies):
        self.optimizers = []
        self.nbytes = 0  # of the file this rank will write (DP rank 0's world tensors)
        for o in getattr(optimizer, "chained_optimizers", [optimizer]):
            if not hasattr(o, "get_parameter_state_dp_zero"):
                self.optimizers.append(None)
                continue
            buffers = []
            for gbuf_idx, gbuf_range_maps in enumerate(o.gbuf_ranges):
                assert len(gbuf_range_maps) == 1, "single dtype supported, for now."  # as megatron
                (dtype, bucket_maps), = gbuf_range_maps.items()
                buckets = []
                for bucket_idx, gbuf_range_map in enumerate(bucket_maps):
                    bucket = o.buffers[gbuf_idx].buckets[bucket_idx]
                    shards = []
                    for model_param, param_range_map in gbuf_range_map["param_map"].items():
                        tensors = o._get_main_param_and_optimizer_states(model_param)
                        local = param_range_map["gbuf_local"]
                        shards.append((local.start, local.end,
                                       host.copy({k: tensors[k].detach() for k in PARAMETER_STATE_KEYS})))
                    buckets.append((bucket.grad_data.numel(), bucket.numel_unpadded, shards))
                buffers.append((dtype, o.buffers[gbuf_idx].numel_unpadded, buckets))
                if o.data_parallel_group_gloo.rank() == 0:
                    self.nbytes += 4 * len(PARAMETER_STATE_KEYS) * o.buffers[gbuf_idx].numel_unpadded
            self.optimizers.append((o.data_parallel_group_gloo, buffers))

    def assemble(self):
        return _one_or_list([self._assemble(*o) if o is not None else None for o in self.optimizers])

    @staticmethod
    def _assemble(group, buffers):
        size, rank = group.size(), group.rank()
        root = dist.get_process_group_ranks(group)[0]
        state = {"buckets_coalesced": True}
        for gbuf_idx, (dtype, numel_unpadded, buckets) in enumerate(buffers):
            world = {}
            if rank == 0:
                world = {k: torch.zeros(numel_unpadded, dtype=torch.float32) for k in PARAMETER_STATE_KEYS}
                world["numel_unpadded"] = numel_unpadded
            offset = 0
            for bucket_numel, bucket_unpadded, shards in buckets:
                local_numel = bucket_numel // size
                for key in PARAMETER_STATE_KEYS:
                    local = torch.zeros(local_numel, dtype=torch.float32)
                    for start, end, tensors in shards:
                        local[start:end].copy_(tensors[key])
                    if size == 1:
                        gathered = local
                    else:
                        parts = [torch.empty(local_numel, dtype=torch.float32) for _ in range(size)] if rank == 0 else None
                        dist.gather(local, parts, root, group)
                        gathered = torch.cat(parts) if rank == 0 else None
                    if rank == 0:
                        world[key][offset:offset + bucket_unpadded].copy_(gathered[:bucket_unpadded])
                offset += bucket_unpadded
            state[gbuf_idx] = {dtype: world}
        return state if rank == 0 else None


class HostCopies:
    """Copies of tensors in CPU memory that training cannot change while they are written.

    A save's buffers are reused by the next one. On CUDA they are page-locked after their
    first save, on the writer thread: then the next snapshots are asynchronous device-to-host
    copies at full speed with one synchronize. Pinning takes tens of seconds for a 2B model's
    optimizer state (allocating pinned memory up front cost the first save 30 s on an H100),
    so the training thread never does it."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._spare: dict[tuple, list[torch.Tensor]] = {}
        self._in_use: list[torch.Tensor] = []

    def copy(self, obj):
        """`obj` (nested dicts / lists / tuples) with every tensor copied to the host, the rest deep-copied."""
        if isinstance(obj, torch.Tensor):
            tensor = obj.detach()
            key = (tuple(tensor.shape), tensor.dtype)
            spare = self._spare.get(key)
            host = spare.pop() if spare else torch.empty(key[0], dtype=key[1])
            self._in_use.append(host)
            return host.copy_(tensor, non_blocking=self.cuda and host.is_pinned())
        if isinstance(obj, dict):
            return type(obj)((k, self.copy(v)) for k, v in obj.items())
        if type(obj) in (list, tuple):
            return type(obj)(self.copy(v) for v in obj)
        return copy.deepcopy(obj)

    def ready(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def pin(self) -> None:
        """Writer thread, once the copies are written: page-lock their buffers for the next snapshots."""
        if not self.cuda:
            return
        for host in self._in_use:
            if host.numel() and not host.is_pinned():  # a failure leaves it pageable: slower, still right
                torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel() * host.element_size(),
                                                     CUDA_HOST_REGISTER_PORTABLE)

    def release(self) -> None:
        """The copies are written: keep their buffers for the next snapshot."""
        for host in self._in_use:
            self._spare.setdefault((tuple(host.shape), host.dtype), []).append(host)
        self._in_use = []


class _RecordWriteErrors:
    """A file object for torch.save that keeps the OSError of a failed write: torch reports a
    full disk as "unexpected pos N vs M", without the errno."""

    def __init__(self, fh):
        self._fh, self.error = fh, None

    def write(self, data):
        try:
            return self._fh.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def __getattr__(self, name):
        return getattr(self._fh, name)


def _torch_save(obj, path: Path) -> None:
    with atomic_open(path) as fh:
        recorder = _RecordWriteErrors(fh)
        try:
            torch.save(obj, recorder)
        except RuntimeError:
            if recorder.error is not None:
                raise recorder.error from None
            raise


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC / EDQUOT, also where a library reports it only in its message (safetensors)."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(sign in str(exc) for sign in ("No space left on device", "Disk quota exceeded")):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, ParameterStateSnapshot):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class CheckpointSaver:
    """Saves a run's checkpoints, at most one in flight, and keeps the newest `keep_last`.

    A save snapshots what it needs on the training thread (model, optimizer, scheduler, RNG
    and loader state; on GPU into CPU memory) and, with `background`, writes the files on a
    thread of its own while the next steps run. Every rank reports through
    `progress()` whether its files are written; the trainer sums the reports over the ranks
    in the step's loss all-reduce and passes them to `settle()`, so a checkpoint is taken as
    complete (renamed from step_N.tmp, `latest` updated, old ones deleted) only once every
    rank's files are on disk, with no collective of its own. `wait()` blocks until the save
    in flight is complete (the next save, the end of training and a stop wait for it).

    A save short of space (free space below the size of the previous checkpoint or, for the
    first, of the state to write) first deletes the checkpoints --keep-last would delete after
    it (`deletable_early`). One that still cannot fit, or that fills the disk while writing,
    raises DiskFullError on every rank; step_N.tmp is removed and the previous checkpoint stays
    as it was.
    """

    def __init__(self, out: Path, info, keep_last: int, background: bool):
        self.root = Path(out) / CHECKPOINTS
        self.info, self.keep_last, self.background = info, keep_last, background
        self.host = HostCopies(info.device)
        self._pending: dict | None = None
        self._timings: dict[str, float] = {}
        self.completed: list[dict] = []  # {"step", "write_s"} of saves completed since the trainer last looked
        if info.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("*" + TMP_SUFFIX):  # a killed job's unfinished save (the --out lock is ours)
                shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
        dist.barrier()

    # --- what the trainer calls -----------------------------------------------------------

    def save(self, step: int, model, optimizer, scheduler, data, arch: ModelArch, *, run_config: dict, source) -> None:
        """Checkpoint `step`; `run_config`: the run's settings, flat (`TrainConfig.to_flat`),
        kept in trainer.json; `source`: the model section, whose source's side files and
        tensors the model does not build travel with it."""
        self.wait()
        t0 = time.perf_counter()
        module = unwrap(model)
        adapters = getattr(module, "adapters", None)
        if adapters is not None:  # a LoRA run saves its adapters (one copy per TP/PP rank), not the model
            model_state = adapters.state_dict()
            files = {adapter_format.adapter_file(self.info.tp_rank, self.info.pp_rank): model_state} \
                if self.info.dp_rank == 0 else {}
        else:
            model_state = {k: v for k, v in module.state_dict().items() if not k.endswith("_extra_state")}
            files = _model_files(model_state, arch, self.info)
        state = {"model": files,
                 "rank": {"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                          "rng": _rng_state(self.info.device)}}
        distributed = _uses_distributed_optimizer(optimizer)
        if self.background:  # training goes on and changes the live tensors: write copies
            state = self.host.copy(state)
            state["param_state"] = ParameterStateSnapshot(optimizer, self.host) if distributed else None
            self.host.ready()
        else:
            state["param_state"] = _gather_parameter_state(optimizer) if distributed else None
        state["dtype"] = fmt.dtype_name(model_state.values())
        if self.info.is_main:
            state["trainer"] = {"step": step, "loader": copy.deepcopy(data.state_dict()), "config": run_config,
                                "layout": {"tp": self.info.tp, "pp": self.info.pp, "ep": self.info.ep,
                                           "dp": self.info.dp, "world": self.info.world}}
            side_files = source.hf_model or (Path(source.init) / fmt.HF_SUBDIR if source.init else None)
            state["side_files"] = side_files if side_files and Path(side_files).is_dir() else None
            # the source's tensors the model does not build (`convert.carried_tensors`) travel too
            state["carried_from"] = None if adapters is not None else (source.hf_model or source.init)
            state["profile"] = data.profile
        state["lora"] = (adapters.spec, adapters.base) if adapters is not None else None
        self._add_time("snapshot_s", t0)
        tmp = self.root / f"step_{step:08d}{TMP_SUFFIX}"
        needed = self._check_space(step, tensor_bytes(state))
        if self.info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / _weights_subdir(state)).mkdir(parents=True)
        dist.barrier()
        pending = {"step": step, "tmp": tmp, "needed": needed, "error": None, "done": threading.Event()}
        self._pending = pending
        if self.background:
            thread = threading.Thread(target=self._write, args=(pending, state, arch), name=f"checkpoint-{step}")
            pending["thread"] = thread
            thread.start()
        else:
            self._write(pending, state, arch)
            self.wait()

    def progress(self) -> tuple[float, float, float]:
        """This rank's part of the step's all-reduce: (files written, failed on a full disk, failed otherwise)."""
        pending = self._pending
        if pending is None or not pending["done"].is_set():
            return 0.0, 0.0, 0.0
        error = pending["error"]
        return 1.0, float(error is not None and is_disk_full(error)), float(error is not None and not is_disk_full(error))

    def settle(self, summed: tuple[float, float, float]) -> None:
        """With `progress()` summed over all ranks: complete the save in flight once every rank wrote its files."""
        pending = self._pending
        if pending is None or summed[0] < self.info.world:
            return
        t0 = time.perf_counter()
        self._pending = None
        if "thread" in pending:
            pending["thread"].join()
        self.host.release()
        if summed[1] or summed[2]:
            if self.info.is_main:
                shutil.rmtree(pending["tmp"], ignore_errors=True)
            self._raise(pending, disk_full=bool(summed[1]))
        if self.info.is_main:
            self._complete(pending)
        self.completed.append({"step": pending["step"], "write_s": pending["write_s"]})
        self._add_time("complete_s", t0)

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete; raises what its writing raised."""
        pending = self._pending
        if pending is None:
            return
        t0 = time.perf_counter()
        pending["done"].wait()
        self._add_time("wait_s", t0)
        summed = torch.tensor(self.progress(), dtype=torch.float64, device=self.info.device)
        dist.all_reduce(summed)
        self.settle(tuple(summed.tolist()))

    def abandon(self) -> None:
        """The run ends on an error: let this rank's writing finish; the main rank completes the
        checkpoint when every rank's files are there (the others cannot be asked any more)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending["done"].wait()
        tmp = pending["tmp"]
        if (self.info.is_main and pending["error"] is None
                and all((tmp / f"rank_{r:05d}.pt").is_file() for r in range(self.info.world))):
            self._complete(pending)

    def take_timings(self) -> dict[str, float]:
        """Seconds the training thread spent on checkpoints since the last call, by phase."""
        timings, self._timings = self._timings, {}
        return timings

    # --- the parts ----------------------------------------------------------------------

    def _add_time(self, key: str, since: float) -> None:
        self._timings[key] = self._timings.get(key, 0.0) + time.perf_counter() - since

    def _write(self, pending: dict, state: dict, arch: ModelArch) -> None:
        """This rank's files, its rank file last (the main rank's completes a checkpoint on an error exit)."""
        t0 = time.perf_counter()
        tmp, info = pending["tmp"], self.info
        try:
            subdir = tmp / _weights_subdir(state)
            for name, tensors in state["model"].items():
                fmt.save_tensors(subdir / name, tensors)
            param_state = state["param_state"]
            if isinstance(param_state, ParameterStateSnapshot):
                param_state = param_state.assemble()  # a collective of the DP group's writer threads
            if param_state is not None:
                _torch_save(param_state, tmp / parameter_state_file(info))
            if info.is_main:
                if state["lora"]:
                    spec, base = state["lora"]
                    adapter_format.write_lora_meta(subdir, spec, arch, info.tp, info.pp, base)
                else:
                    fmt.write_meta(subdir, arch, info.tp, info.pp, state["dtype"], info.ep)
                if state["side_files"]:  # tokenizer/processor files travel to export-hf
                    fmt.copy_hf_side_files(state["side_files"], subdir / fmt.HF_SUBDIR)
                if state["carried_from"] and Path(state["carried_from"]).is_dir():
                    convert.write_carried(subdir, state["carried_from"], arch)
                fmt.write_profile(subdir, state["profile"])  # and the data's chat template and processor settings
                write_json_atomic(tmp / TRAINER_META, state["trainer"])
            _torch_save(state["rank"], tmp / f"rank_{info.rank:05d}.pt")
            if self.background:
                self.host.pin()
        except Exception as exc:  # reported to every rank through progress(), raised by settle()
            pending["error"] = exc
        finally:
            pending["write_s"] = time.perf_counter() - t0
            pending["done"].set()

    def _check_space(self, step: int, local_bytes: int) -> int:
        """The bytes this checkpoint needs; DiskFullError on every rank if any rank lacks them.

        Short of space, the checkpoints that --keep-last would delete once this one is complete
        (those beyond the newest keep_last - 1) are deleted first, oldest first, as many as it
        takes; never the newest complete one, nor the one `latest` names."""
        total = torch.tensor([local_bytes], dtype=torch.float64, device=self.info.device)
        dist.all_reduce(total)
        previous = latest_checkpoint(self.root.parent)
        needed = max(int(total.item()), directory_bytes(previous) if previous else 0)
        if self._short_of(needed):
            self._delete_for_space(step, needed)
        if self._short_of(needed):
            free = shutil.disk_usage(self.root).free
            where = "are free" if needed > free else "are free here, less on another rank's disk"
            raise DiskFullError(
                f"not enough space for checkpoint step_{step:08d} in {self.root}: it needs about {_fmt_bytes(needed)} "
                f"({needed:,} bytes), {_fmt_bytes(free)} ({free:,} bytes) {where}; {self._kept_note(previous)}")
        return needed

    def _short_of(self, needed: int) -> bool:
        """Whether any rank has less than `needed` bytes free where the checkpoints go."""
        short = torch.tensor([float(needed > shutil.disk_usage(self.root).free)], dtype=torch.float64,
                             device=self.info.device)
        dist.all_reduce(short)
        return bool(short.item())

    def deletable_early(self, keep_last: int) -> list[Path]:
        """Checkpoints a save short of space may delete before it is written, oldest first: those
        beyond the newest keep_last - 1 (--keep-last deletes them anyway once the new one is
        complete), but never the newest complete one, nor the one `latest` names."""
        complete = complete_checkpoints(self.root.parent)
        kept = set(complete[-max(keep_last - 1, 1):]) | {latest_checkpoint(self.root.parent)}
        return [p for p in complete if p not in kept]

    def _delete_for_space(self, step: int, needed: int) -> None:
        """Main rank: delete `deletable_early` checkpoints until `needed` bytes are free, and say so."""
        deleted = []
        if self.info.is_main:
            free_before = shutil.disk_usage(self.root).free
            for old in self.deletable_early(self.keep_last):
                if shutil.disk_usage(self.root).free >= needed:
                    break
                shutil.rmtree(old, ignore_errors=True)
                deleted.append(old.name)
            if deleted:
                newest = complete_checkpoints(self.root.parent)[-1].name
                print(f"vlmpack train: deleted checkpoint {', '.join(deleted)} before writing step_{step:08d}: the "
                      f"save needs about {_fmt_bytes(needed)} and {_fmt_bytes(free_before)} were free; --keep-last "
                      f"{self.keep_last} would delete it once the new one is complete, and the newest, {newest}, "
                      "stays", file=sys.stderr, flush=True)
        dist.barrier()

    def _kept_note(self, previous: Path | None) -> str:
        kept = f"checkpoint {previous.name} is intact" if previous else "no checkpoint was saved yet"
        fewer = self.deletable_early(1)  # what a save short of space deletes first under --keep-last 1
        lower = (f"; with --keep-last 1 (now {self.keep_last}) a save short of space first deletes "
                 f"{', '.join(p.name for p in fewer)} ({_fmt_bytes(sum(directory_bytes(p) for p in fewer))})"
                 if fewer else "")
        return f"{kept}. Free space or use another --out, then continue with --resume{lower}"

    def _raise(self, pending: dict, disk_full: bool) -> None:
        error = pending["error"]
        if disk_full:
            free = shutil.disk_usage(self.root).free
            raise DiskFullError(
                f"no space left on the device writing checkpoint step_{pending['step']:08d} in {self.root} (it needs "
                f"about {_fmt_bytes(pending['needed'])}, {_fmt_bytes(free)} free now); the unfinished files are "
                f"removed and {self._kept_note(latest_checkpoint(self.root.parent))}") from error
        if error is not None:
            raise error
        raise RuntimeError(f"writing checkpoint step_{pending['step']:08d} failed on another rank (its log says why)")

    def _complete(self, pending: dict) -> None:
        """Main rank: step_N.tmp -> step_N, `latest` -> step_N, then the oldest beyond keep_last go."""
        final = self.root / f"step_{pending['step']:08d}"
        shutil.rmtree(final, ignore_errors=True)
        os.replace(pending["tmp"], final)
        fsync_dir(self.root)
        with atomic_open(self.root / LATEST, "w") as fh:
            fh.write(final.name)
        complete = complete_checkpoints(self.root.parent)
        for old in complete[:-self.keep_last]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)


def _weights_subdir(state: dict) -> str:
    return adapter_format.ADAPTER_SUBDIR if state["lora"] else "model"


def latest_checkpoint(out: Path) -> Path | None:
    """The checkpoint `latest` names. Without a usable pointer (missing, empty, or naming no
    complete checkpoint: a crash between a save's rename and the pointer's write, or a hand
    edit), the newest complete checkpoint: a save renames its directory into place only once
    it is whole."""
    named = _named_checkpoint(out)
    if not isinstance(named, str):
        return named
    complete = complete_checkpoints(out)
    return complete[-1] if complete else None


def latest_pointer_problem(out: Path) -> str | None:
    """Why `latest` names no complete checkpoint (None when it does, or when none is saved)."""
    named = _named_checkpoint(out)
    return named if isinstance(named, str) and complete_checkpoints(out) else None


def _named_checkpoint(out: Path) -> Path | str:
    """The complete checkpoint `latest` names, or what is wrong with the pointer."""
    pointer = Path(out) / CHECKPOINTS / LATEST
    if not pointer.exists():
        return f"{pointer} is missing"
    if not pointer.is_file():
        return f"{pointer} is not a file"
    name = pointer.read_text(errors="replace").strip()
    path = pointer.parent / name
    if CHECKPOINT_NAME.fullmatch(name) and path.is_dir():
        return path
    return f"{pointer} names {name[:60]!r}, which is no complete checkpoint"


# what a resume takes from its checkpoint, whatever the command line says: the learning-rate
# schedule (megatron's scheduler state), the optimizer's hyperparameters (its param groups) and,
# through the loader state, the data order
SCHEDULE_SETTINGS = ("train_steps", "warmup_steps", "lr", "min_lr")
OPTIMIZER_SETTINGS = ("weight_decay", "adam_beta1", "adam_beta2", "adam_eps")
DATA_ORDER_SETTINGS = ("seq_len", "seed", "max_visual_tokens")  # and the global batch, and the data itself
LORA_SETTINGS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_rslora", "lora_dora", "lora_targets", "lora_parts",
                 "lora_modules_to_save")  # the adapters the checkpoint holds


def complete_checkpoints(out: Path) -> list[Path]:
    """The complete checkpoints under OUT (not a `.tmp` save), oldest first. Only names a save
    writes (`step_` and digits) count: a copy beside them (`step_00000004.bak`) is the user's,
    never resumed from nor deleted by --keep-last."""
    root = Path(out) / CHECKPOINTS
    return sorted((p for p in root.glob("step_*") if p.is_dir() and CHECKPOINT_NAME.fullmatch(p.name)),
                  key=lambda p: int(p.name[5:]))


def new_run_hint(path: Path, saved_config: dict) -> str:
    """How a new run starts from checkpoint `path`'s weights."""
    if saved_config.get("lora_rank"):
        return (f"export its adapters (vlmpack export-hf {path} --lora-format peft --out DIR) and give "
                "--init-lora DIR")
    return f"--init {path / 'model'}"


WEIGHT_SOURCES = ("hf_model", "init", "init_lora")  # where a new run's weights come from


def _same_source(given: str, saved) -> bool:
    """Whether two spellings of a weight source name one directory (a URL: the same text)."""
    if not isinstance(saved, str):
        return False
    if is_url(given) or is_url(saved):
        return given == saved
    return os.path.realpath(given) == os.path.realpath(saved)


def _shown(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def check_run_directory(config) -> None:
    """Before anything is built or written in --out: a new run refuses a directory that holds an
    earlier run (its checkpoints would be orphaned, `latest` repointed and metrics.jsonl mixed),
    and a resume refuses settings its checkpoint would silently override or break. `config`:
    the whole `TrainConfig`, as a resume compares every section with the checkpoint's."""
    out = Path(config.checkpoints.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a directory: pass a directory path")
    blocking = next((parent for parent in out.parents if parent.exists() and not parent.is_dir()), None)
    if blocking is not None:
        raise ConfigError(f"--out {out}: a file stands in the path ({blocking}): pass a directory path")
    writer = recorded_command(out) if out.is_dir() else None
    if writer not in (None, "train"):
        raise ConfigError(f"--out {out} holds the output of `vlmpack {shown_command(writer)}`: give the run a new "
                          "or empty --out")
    for name, what in ((MANIFEST_NAME, "a shard directory"), (fmt.META_FILE, "a model directory")):
        if (out / name).is_file():
            raise ConfigError(f"--out {out} is {what} ({name}): give the run a new or empty --out")
    for name, what in RUN_SUBDIRS.items():
        if (out / name).exists() and not (out / name).is_dir():
            raise ConfigError(f"--out {out} holds a file named {name}, where a run keeps {what}: move it out of "
                              "--out, or give another --out")
    blocking = _save_name_taken(out / CHECKPOINTS)
    if blocking is not None:
        held, saved = ("a directory", "the pointer to the newest checkpoint") if blocking.name == LATEST \
            else ("no directory", "a checkpoint")
        raise ConfigError(f"--out {out}: {blocking} is {held}, where a save writes {saved}, so the save would fail "
                          f"after training up to it: move it out of {CHECKPOINTS}/, or give another --out")
    check_export_target(config.checkpoints.export_hf, out)
    if not config.checkpoints.resume:
        saved = complete_checkpoints(out)
        if saved:
            newest = latest_checkpoint(out) or saved[-1]
            raise ConfigError(f"--out {out} holds the checkpoints of an earlier run (newest {newest.name}): continue "
                              "it with --resume, or give a fresh --out for a new run")
        metrics = out / METRICS_FILE
        if metrics.is_file() and metrics.stat().st_size:
            raise ConfigError(f"--out {out} holds the {METRICS_FILE} of an earlier run (which saved no checkpoint): a "
                              f"new run would add its records to it; give a fresh --out, or move {METRICS_FILE} and "
                              "tensorboard/ out of it first")
        return
    path = latest_checkpoint(out)
    if path is not None:
        check_resume_settings(config, read_trainer_meta(path), path)


def _save_name_taken(root: Path) -> Path | None:
    """An entry of checkpoints/ under a name a save writes, but not what a save writes there (a
    file or FIFO named step_N, a directory named `latest`): the save would fail after the steps
    before it were trained."""
    if not root.is_dir():
        return None
    for entry in sorted(root.iterdir()):
        if CHECKPOINT_NAME.fullmatch(entry.name) and not entry.is_dir():
            return entry
        if entry.name == LATEST and entry.is_dir():
            return entry
    return None


def check_export_target(target: str | None, out: Path) -> None:
    """--export-hf names where the run exports when it ends: refused now, not after the run, when
    it is a file, a directory holding anything, --out itself, a directory holding --out, or one
    in its checkpoints (a directory of its own inside --out is fine)."""
    if not target:
        return
    path = Path(target)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--export-hf {target} is a file, not a directory: give a new or empty directory for the "
                          "export")
    export, run, checkpoints = path.resolve(), out.resolve(), (out / CHECKPOINTS).resolve()
    if export == run or export in run.parents or export == checkpoints or checkpoints in export.parents:
        raise ConfigError(f"--export-hf {target} is --out {out}, holds it or lies in its {CHECKPOINTS}/: give the "
                          "export a directory of its own")
    entries = user_entries(path) if path.is_dir() else []
    if entries:
        shown = first_few(entries)
        raise ConfigError(f"--export-hf {target} is not empty ({shown}): give a new or empty directory for the "
                          "export (the run writes it when it ends)")


def check_resume_arch(config, arch: ModelArch) -> None:
    """A resume continues its newest checkpoint's kind of run (LoRA adapters or a whole model,
    `check_resume_kind`), and a full fine-tuning resume builds the architecture that checkpoint
    holds: another (another --arch, --hf-model or --init) is refused before the model is built,
    naming the fields that differ. A LoRA checkpoint's base is checked where its adapters load; a
    damaged checkpoint is reported where the resume reads it."""
    path = latest_checkpoint(Path(config.checkpoints.out))
    if path is None:
        return
    check_resume_kind(path, bool(config.lora.lora_rank), read_trainer_meta(path)["config"].get("lora_rank"))
    if not (path / "model").is_dir():
        return
    try:
        saved = read_model_arch(path / "model")
    except (ModelFileError, fmt.CheckpointError):  # damaged: named where the resume reads it, with the way on
        return
    if saved == arch:
        return
    model = config.model
    source = f"--arch {model.arch}" if model.arch else f"--hf-model {model.hf_model}" if model.hf_model \
        else f"--init {model.init}"
    differ = fmt.arch_differences(saved, arch)
    shown = first_few(differ, "; ")
    raise ConfigError(f"--resume from checkpoint {path.name}: its model is not the one {source} builds ({shown}, "
                      f"the checkpoint's first): resume with the --arch, --hf-model or --init the run was started "
                      f"with, or start a new run from its weights with --init {path / 'model'}")


def check_resume_kind(path: Path, lora_run: bool, saved_rank=None) -> None:
    """A LoRA run resumes a checkpoint of LoRA adapters, a full fine-tuning run one of a whole
    model: the other kind is refused (`saved_rank`: the checkpoint's --lora-rank, for the fix). One
    holding neither is damaged, not of the other kind."""
    adapters = (path / adapter_format.ADAPTER_SUBDIR).is_dir()
    if not adapters and not (path / "model").is_dir():
        saved = f"{adapter_format.ADAPTER_SUBDIR}/ (its LoRA adapters)" if saved_rank else "model/ (its weights)"
        raise ModelFileError(f"{path} has no {saved}", damaged_checkpoint_fix(path))
    if adapters and not lora_run:
        raise ConfigError(f"{path} holds LoRA adapters, not a model: resume with its LoRA settings "
                          f"(--lora-rank {saved_rank} ...)")
    if lora_run and not adapters:
        raise ConfigError(f"{path} holds a full fine-tuning run's model, not LoRA adapters: resume it without "
                          f"--lora-rank, or start a LoRA run from its weights with --init {path / 'model'}")


def damaged_checkpoint_fix(path: Path) -> str:
    """What to do about checkpoint `path` when a file of it is damaged: without it, a resume takes
    the newest other complete checkpoint (`latest_checkpoint`)."""
    others = [p for p in complete_checkpoints(path.parent.parent) if p.name != path.name]
    then = f"--resume continues {others[-1].name}" if others else "--resume starts at step 0 (no other checkpoint)"
    return f"the checkpoint is damaged: move {path.name} out of {path.parent} and {then}"


def read_trainer_meta(path: Path) -> dict:
    """Checkpoint `path`'s TRAINER_META, what a resume reads of it checked (ModelFileError naming
    the file when it is damaged)."""
    fix = damaged_checkpoint_fix(path)
    file = path / TRAINER_META
    if not file.is_file():
        raise ModelFileError(f"{path} has no {TRAINER_META}", fix)
    meta = read_json_object(file, fix)
    layout, config, loader = meta.get("layout"), meta.get("config"), meta.get("loader")
    sizes_ok = isinstance(layout, dict) and all(type(layout.get(k)) is int for k in ("tp", "pp", "world"))
    if type(meta.get("step")) is not int or meta["step"] < 0 or not sizes_ok \
            or not isinstance(config, dict) or not isinstance(loader, dict):
        raise ModelFileError(f"{file}: not a vlmpack checkpoint's record (its step, layout, config and loader state)",
                             fix)
    counts = [loader.get(k) for k in ("seed", "epoch", "packs_consumed")]  # each a whole number >= 0
    dp_size = loader.get("dp_size", 1)
    numbers = [config[k] for k in (*SCHEDULE_SETTINGS, *OPTIMIZER_SETTINGS, "seq_len", "seed") if k in config]
    if not isinstance(loader.get("fingerprint"), str) or any(type(v) is not int or v < 0 for v in counts) \
            or type(dp_size) is not int or dp_size < 1 \
            or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in numbers) \
            or type(config.get("train_steps", 1)) is not int:
        raise ModelFileError(f"{file}: its loader state or settings are not of a vlmpack checkpoint (whole numbers "
                             "where positions and steps are, numbers where rates are)", fix)
    if path.name.startswith("step_") and path.name[5:].isdigit() and int(path.name[5:]) != meta["step"]:
        raise ModelFileError(f"{file}: records step {meta['step']} in the directory of step {int(path.name[5:])}", fix)
    return meta


def check_resume_settings(config, meta: dict, path: Path) -> None:
    """ConfigError naming each setting that differs from checkpoint `path`'s (trainer.json `meta`)
    where the resume would not follow it: the schedule and optimizer settings (the checkpoint's
    win), the data order. A new --train-steps is taken only with --extend-schedule."""
    saved, step = meta.get("config", {}), int(meta["step"])
    where = f"--resume from checkpoint {path.name} (step {step})"
    new_run = new_run_hint(path, saved)
    given = config.to_flat()
    lora_settings = {k: saved[k] for k in LORA_SETTINGS if k in saved}
    theirs, mine = dataclasses.replace(config.lora, **lora_settings).spec(), config.lora.spec()
    if theirs is not None and mine is not None and theirs != mine:  # LoRA against full fine-tuning: at loading
        raise ConfigError(f"{where} was trained with LoRA {theirs.to_dict()}, this run asks for {mine.to_dict()}: "
                          "resume with the same --lora-* settings")
    for key in WEIGHT_SOURCES:  # the checkpoint's weights are loaded: another source given would go unused
        if given.get(key) is not None and not _same_source(given[key], saved.get(key)):
            raise ConfigError(f"{where}: {flag_name(key)} {given[key]} (the checkpoint's: {_shown(saved.get(key))}): a "
                              f"resume loads the checkpoint's own weights, so {flag_name(key)} would go unused; drop "
                              f"it to resume, or give a new --out to start a new run from {given[key]}")
    differ = [(flag_name(k), saved[k], given[k])
              for k in (*SCHEDULE_SETTINGS[1:], *OPTIMIZER_SETTINGS, *DATA_ORDER_SETTINGS)
              if k in saved and saved[k] != given[k]]
    if isinstance(saved.get("freeze"), list) and sorted(saved["freeze"]) != sorted(given["freeze"]):
        differ.append((flag_name("freeze"), saved["freeze"], given["freeze"]))  # the optimizer state's parameters
    dp = meta.get("layout", {}).get("dp")
    if dp:
        sizing = ("seq_len", "global_batch_packs", "global_batch_tokens", "micro_batch_packs")
        try:
            packs = (dataclasses.replace(config.data, **{k: saved[k] for k in sizing if k in saved}).global_packs(dp),
                     config.data.global_packs(dp))
        except ConfigError:  # a global batch this layout cannot take: refused where the run sizes it
            packs = (0, 0)
        if packs[0] != packs[1]:
            differ.append(("the global batch", f"{packs[0]} packs", f"{packs[1]} packs"))
    schedule = " ".join(f"{flag_name(k)} {_shown(saved[k])}" for k in SCHEDULE_SETTINGS if k in saved)
    if differ:
        listing = ", ".join(f"{flag} {_shown(given)} (the checkpoint's: {_shown(theirs)})" for flag, theirs, given in differ)
        raise ConfigError(f"{where}: {listing}: a resume continues the checkpoint's learning-rate schedule ({schedule}), "
                          f"optimizer state and data order as they were, so these would be overridden or break it; "
                          f"resume with the checkpoint's values, or start a new run from its weights with {new_run}")
    train_steps = config.schedule.train_steps
    old_end = saved.get("train_steps", train_steps)
    if train_steps == old_end:
        return
    if step >= old_end and saved.get("min_lr") == 0:
        raise ConfigError(f"{where}: --train-steps {train_steps}, but its learning-rate schedule ({schedule}) "
                          "has ended, at --min-lr 0, so continuing it would train nothing (--extend-schedule too); "
                          f"start a new run (a new warm-up and decay) from its weights with {new_run}")
    if train_steps > old_end:
        effect = f"every step after {old_end} would run at --min-lr {_shown(saved.get('min_lr', config.optimizer.min_lr))}"
    else:
        effect = f"the run would stop at step {train_steps} in the middle of the decay"
    if not config.schedule.extend_schedule:
        raise ConfigError(f"{where}: --train-steps {train_steps}, but its learning-rate schedule ({schedule}) "
                          f"decays to step {old_end}, so {effect}; resume with --train-steps {old_end}, add "
                          f"--extend-schedule to restretch the decay from step {step} to step {train_steps} "
                          f"(docs/training.md), or start a new run from its weights with {new_run}")
    if train_steps <= step:
        raise ConfigError(f"{where}: --extend-schedule --train-steps {train_steps} must be past the "
                          f"checkpoint's step {step}")


def resume(out: Path, model, optimizer, scheduler, data, info) -> int:
    """Restore the newest checkpoint under OUT; returns its step (0 if there is none)."""
    path = latest_checkpoint(out)
    if path is None:
        if info.is_main:
            print(f"--resume: no checkpoint under {Path(out) / CHECKPOINTS}; starting from step 0", flush=True)
        return 0
    meta = read_trainer_meta(path)
    layout = meta["layout"]
    if (layout["tp"], layout["pp"], layout.get("ep", 1), layout["world"]) != (info.tp, info.pp, info.ep, info.world):
        raise ConfigError(f"{path} was written with tp={layout['tp']} pp={layout['pp']} ep={layout.get('ep', 1)} on "
                          f"{layout['world']} ranks; "
                          f"resume with the same layout, or start a new run from its weights with --init {path / 'model'}")
    rank_state = on_every_rank(lambda: _load_run_weights(model, path, info, meta["config"])
                               or _load_rank_state(path, info.rank), path)
    # a state of other parameter groups (a rank file of another run) is this checkpoint's fault too
    on_every_rank(lambda: optimizer.load_state_dict(rank_state["optimizer"]), path)
    if _uses_distributed_optimizer(optimizer):
        _load_parameter_state(optimizer, path / parameter_state_file(info), path)
    on_every_rank(lambda: scheduler.load_state_dict(rank_state["scheduler"]), path)
    try:
        data.load_state_dict(meta["loader"])
    except ValueError as exc:  # other shards, weights or packing settings than the checkpoint's
        given = " ".join(data.config.data)
        other_packs = meta["loader"]["fingerprint"] != data.loader.fingerprint
        if other_packs and meta["config"].get("data") == list(data.config.data):  # the settings: compared before
            raise ConfigError(f"--resume from checkpoint {path.name}: the shards under --data {given} are not the ones "
                              "it was trained on (the same --data, but their manifests changed since it was saved: "
                              "the shards written again or replaced); resume on the shards it was trained on, or "
                              f"start a new run from its weights with {new_run_hint(path, meta['config'])}") from None
        raise ConfigError(f"--resume from checkpoint {path.name}: {exc}; it was trained on --data "
                          f"{' '.join(meta['config']['data'])}, this run has --data {given}") \
            from None
    _set_rng_state(rank_state["rng"], info.device)
    if info.is_main:
        problem = latest_pointer_problem(out)
        taken = f" ({problem}: the newest complete checkpoint taken)" if problem else ""
        print(f"resumed from {path} (step {meta['step']}){taken}", flush=True)
    return int(meta["step"])


def _load_rank_state(path: Path, rank: int) -> dict:
    """Rank `rank`'s file of checkpoint `path` (ModelFileError naming it when it is missing or damaged)."""
    state = _read_torch_file(path / f"rank_{rank:05d}.pt", path)
    if not isinstance(state, dict) or not {"optimizer", "scheduler", "rng"} <= set(state):
        raise ModelFileError(f"{path / f'rank_{rank:05d}.pt'}: not a vlmpack checkpoint's rank state",
                             damaged_checkpoint_fix(path))
    return state


def _read_torch_file(file: Path, checkpoint: Path, weights_only: bool = False):
    """What `torch.save` wrote to `file` of `checkpoint`; ModelFileError naming it when it is
    missing or damaged."""
    if not file.is_file():
        raise ModelFileError(f"{checkpoint} has no {file.name}", damaged_checkpoint_fix(checkpoint))
    if not zipfile.is_zipfile(file):  # torch.save writes a zip archive; other bytes would go to pickle as they are
        raise ModelFileError(f"{file}: not a readable checkpoint file (no zip archive: damaged or cut short)",
                             damaged_checkpoint_fix(checkpoint))
    try:
        return torch.load(file, map_location="cpu", weights_only=weights_only)
    except (RuntimeError, EOFError, pickle.UnpicklingError) as exc:  # torch's zip reader on damaged members
        message = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelFileError(f"{file}: not a readable checkpoint file ({message})",
                             damaged_checkpoint_fix(checkpoint)) from None


def _load_run_weights(model, path: Path, info, saved_config: dict) -> None:
    """The trained weights of checkpoint `path` into `model`: the whole model, or a LoRA run's
    adapters (the base is the run's own, loaded already: it must be the one the adapters were
    trained on)."""
    adapters = getattr(unwrap(model), "adapters", None)
    adapter_dir = path / adapter_format.ADAPTER_SUBDIR
    check_resume_kind(path, adapters is not None, saved_config.get("lora_rank"))
    # missing, the directory would read as no model directory at all, with advice for an import
    meta_file = adapter_dir / adapter_format.LORA_META if adapters is not None else path / "model" / fmt.META_FILE
    if not meta_file.is_file():
        raise ModelFileError(f"{path} has no {meta_file.relative_to(path)}", damaged_checkpoint_fix(path))
    if adapters is None:
        try:
            load_model_weights(model, path / "model", read_model_arch(path / "model"), info)
        except ModelFileError as exc:  # a file of the checkpoint's model/: the checkpoint before it is the way on
            raise ModelFileError(exc.problem, damaged_checkpoint_fix(path)) from None
        return
    meta, spec, _ = adapter_format.read_lora_meta(adapter_dir)
    if spec != adapters.spec:
        raise ConfigError(f"{path} was trained with LoRA {spec.to_dict()}, this run asks for {adapters.spec.to_dict()}: "
                          "resume with the same --lora-* settings")
    saved_base, base = dict(meta["base"]), dict(adapters.base)
    fingerprints = ("fingerprint", "hf_fingerprint")
    for key in fingerprints:  # compared where both record it (a base may be recorded without either)
        if key not in saved_base or key not in base:
            saved_base.pop(key, None)
            base.pop(key, None)
    if saved_base != base:
        if saved_base.keys() == base.keys() and all(saved_base[k] == base[k] for k in base if k not in fingerprints):
            source = base.get("hf_model") or base.get("init")
            raise ConfigError(f"{path}'s adapters were trained on other weights than {source} holds now (its weights "
                              "fingerprint differs): resume on the model they were trained on")
        raise ConfigError(f"{path}'s adapters were trained on {saved_base}, this run's model is {base}: "
                          "resume with the same --hf-model / --init / --arch and --seed")
    adapters.load_state_dict(fmt.load_tensors(adapter_dir / adapter_format.adapter_file(info.tp_rank, info.pp_rank),
                                              damaged_checkpoint_fix(path)))


def export_hf_from_run(out: Path, step: int, hf_out: str, info) -> None:
    if info.is_main:
        path = latest_checkpoint(out)
        adapter_dir = adapter_format.find_adapter_dir(path)
        if adapter_dir is not None:  # a LoRA run: its adapters, as PEFT loads them
            from train.lora_export import export_peft

            export_peft(adapter_dir, hf_out)
        else:
            _, side_files = convert.export_hf(path / "model", hf_out)
            for note in side_files.notes:
                print(f"vlmpack train: --export-hf: {note}", file=sys.stderr, flush=True)
        print(f"exported {path.name} to {hf_out}", flush=True)
    dist.barrier()
