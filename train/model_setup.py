"""A run's model: its architecture, this rank's stage built for the parallel layout, its
weights (a Hugging Face import, a Megatron model directory, or a random init that no layout
changes), and a LoRA/DoRA run's adapters on the frozen base.

    resolve_arch -> build_model_for_run: megatron config -> stage -> weights -> adapters ->
                    freeze -> FP8

`train.checkpoint` saves and resumes what is built here; `train.lora_export` draws a random
base again with `random_full_state`.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from shards_schema.errors import UserError
from train import adapter_format
from train import checkpoint_format as fmt
from train import convert
from train.model import families, lora
from train.config import FA4_ON_CPU
from train.model.arch import ModelArch, builtin_arch


def unwrap(model):
    """The model inside a DistributedDataParallel wrapper (or the model itself)."""
    return model.module if hasattr(model, "module") else model


def read_model_arch(model_dir: str | Path) -> ModelArch:
    return fmt.read_arch(model_dir)


def resolve_arch(config) -> ModelArch:
    """The architecture of the model section `config`'s source (`train.config.ModelConfig`):
    --arch, --hf-model or --init."""
    if config.arch:
        return builtin_arch(config.arch)
    if config.hf_model:
        given = Path(config.hf_model)
        if not (given / "config.json").is_file() and (given / fmt.META_FILE).is_file():
            raise UserError(f"--hf-model {given} is a vlmpack model directory ({fmt.META_FILE}), not a Hugging Face "
                            "one: --init takes it")
        arch = ModelArch.from_hf_dir(config.hf_model)
        fmt.check_hf_side_files(config.hf_model)  # its checkpoints carry them: named now, not at the first save
    else:
        arch = read_model_arch(config.init)
    # every checkpoint copies the tensors the model does not build (Qwen3.5's multi-token
    # prediction) from the source: a damaged file is named now, not at the first save, steps later
    convert.read_carried(config.hf_model or config.init, arch)
    return arch


def _load_shard(model, full: dict, arch: ModelArch, info) -> None:
    """This rank's part of the full Megatron state dict `full` into `model`."""
    convert.load_into_model(unwrap(model), convert.shard(full, arch, info.tp, info.tp_rank, info.pp, info.pp_rank,
                                                          info.ep, info.ep_rank))


def load_hf_weights(model, hf_dir: str, arch: ModelArch, info) -> None:
    """Import a Hugging Face checkpoint into this rank's stage (no conversion step on disk):
    each rank reads only the tensors its stage holds, one at a time."""
    _load_shard(model, convert.hf_to_megatron(fmt.lazy_hf_state(hf_dir), arch), arch, info)


RANDOM_CHUNK = 1 << 22  # elements per generator: the draw is the same for any number of threads


def _chunk_seed(seed: int, name: str, chunk: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}/{name}/{chunk}".encode(), digest_size=8).digest(), "little")


def init_threads() -> int:
    """CPU threads for the draw: the machine's cores shared by the node's ranks (torchrun's LOCAL_WORLD_SIZE)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _random_tensor(name: str, shape: tuple[int, ...], seed: int, std: float, num_layers: int, pool) -> torch.Tensor:
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if "norm" in name:  # RMSNorm / LayerNorm gains
        return torch.ones(shape)
    if name.endswith(("linear_proj.weight", "linear_fc2.weight", "experts.weight2")) and name.startswith("language_model."):
        std = std / math.sqrt(2.0 * num_layers)  # megatron's scaled init of the residual-branch outputs
    out = torch.empty(shape)
    flat = out.view(-1)

    def fill(chunk: int) -> None:  # torch's normal_ releases the GIL: chunks fill in parallel
        part = flat[chunk * RANDOM_CHUNK:(chunk + 1) * RANDOM_CHUNK]
        part.normal_(0.0, std, generator=torch.Generator().manual_seed(_chunk_seed(seed, name, chunk)))

    list(pool.map(fill, range(-(-flat.numel() // RANDOM_CHUNK))))
    return out


def random_full_state(arch: ModelArch, seed: int, std: float = 0.02, layers: range | None = None,
                      threads: int | None = None) -> dict:
    """The full Megatron state of a random init; each tensor depends only on (seed, its name):
    it is drawn in chunks of RANDOM_CHUNK elements, each from its own generator seeded by
    (seed, name, chunk), so any number of threads gives the same values.
    `layers`: draw only these decoder layers (the others are meta tensors, never loaded);
    `threads`: the pool's size (default `init_threads()`)."""
    def drawn(name: str) -> bool:
        return layers is None or not name.startswith("language_model.decoder.layers.") or int(name.split(".")[3]) in layers

    family = families.of(arch)

    def value(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        special = family.init_tensor(name, shape, seed) if family is not None else None  # e.g. zero-centred norms
        return special if special is not None else _random_tensor(name, shape, seed, std, arch.lm.num_layers, pool)

    with ThreadPoolExecutor(threads or init_threads()) as pool:
        return {n: value(n, shape) if drawn(n) else torch.empty(shape, device="meta")
                for n, shape in convert.megatron_shapes(arch).items()}


def init_random_weights(model, arch: ModelArch, seed: int, info, std: float = 0.02) -> None:
    """Random init that depends only on (seed, parameter name), never on the TP/PP layout: every
    tensor of the full model is drawn from its own generator, then sharded like a checkpoint.
    So 1 GPU, DP, TP and PP runs start from the same weights and their loss curves compare."""
    _load_shard(model, random_full_state(arch, seed, std, convert.stage_layers(arch, info.pp)[info.pp_rank]), arch, info)


def base_reference(config, seed: int) -> dict:
    """What a LoRA run's adapters sit on: the model source of its model section `config` (and
    the --seed of a random init)."""
    for key in ("hf_model", "init"):
        source = getattr(config, key)
        if source:  # the fingerprints tell a later export whether a --base holds these weights
            reference = {key: str(Path(source).resolve()), "fingerprint": fmt.weights_fingerprint(source)}
            imported = fmt.imported_fingerprint(source) if key == "init" else None
            if imported is not None:  # a model directory imported from an HF one: known in that one too
                reference["hf_fingerprint"] = imported
            return reference
    return {"arch": config.arch, "seed": seed}


def add_adapters(model, arch: ModelArch, source, config, seed: int, info) -> None:
    """Freeze this rank's stage and give it the adapters of the LoRA section `config`
    (`model.adapters`): PEFT's default init from the run's `seed`, or the adapters of the
    --init-lora PEFT directory; `source`: the model section, whose base they sit on."""
    spec = config.spec()
    module = unwrap(model)
    layers = convert.stage_layers(arch, info.pp)[info.pp_rank]
    adapters = lora.attach(module, arch, spec, info.tp, layers)  # adapters.sites: this stage's
    full = (adapter_format.read_peft_dir(config.init_lora, arch, spec) if config.init_lora
            else lora.init_adapters(adapters.sites, spec.rank, seed))
    local = lora.shard_adapters(full, adapters.sites, info.tp, info.tp_rank, layers, info.first_stage)
    saved = {k: full.get(k, p) for k, p in adapters.saved_modules.items()}  # a PEFT dir may carry trained modules
    adapters.load_state_dict(local | saved, magnitudes_from_base=spec.dora and not config.init_lora)
    adapters.base = base_reference(source, seed)
    module.adapters = adapters


def load_model_weights(model, model_dir: str | Path, arch: ModelArch, info) -> None:
    state = convert.load_model_state(model_dir, arch, info.tp, info.tp_rank, info.pp, info.pp_rank, info.ep, info.ep_rank)
    convert.load_into_model(unwrap(model), state)



def freeze(model, parts: list[str]) -> None:
    """Stop training the parameters of `parts` (`convert.model_part`)."""
    for name, param in model.named_parameters():
        if convert.model_part(name) in parts:
            param.requires_grad_(False)


def build_model_for_run(config, memory, arch: ModelArch, info, dtype: torch.dtype, bf16: bool, sequence_parallel: bool,
                        static_rows: bool):
    """megatron's TransformerConfig of the run and this rank's pipeline stage built with it, on
    its device, weights not loaded yet (`load_weights`); on CUDA the attention kernel chosen.
    `config`, `memory`: the model and memory sections (`train.config`); the layout is `info`'s;
    `static_rows`: every pack padded to --seq-len rows."""
    from train.model.attention import FA4_HEAD_DIMS, fa4_unavailable, select_attention_kernel
    from train.model.qwen_vl import transformer_config
    from train.parallel import build_model

    cuda = info.device.type == "cuda"
    model_config = transformer_config(arch, tp=info.tp, pp=info.pp, ep=info.ep, params_dtype=dtype, bf16=bf16,
                                      cpu=not cuda, recompute=memory.recompute,
                                      recompute_layers=memory.recompute_layers,
                                      moe_aux_loss_coef=config.moe_aux_loss_coef,
                                      sequence_parallel=sequence_parallel, calculate_per_token_loss=True)
    if not cuda and config.attention == "fa4":
        raise UserError(FA4_ON_CPU)
    if cuda:
        kernel, on_fa2 = select_attention_kernel(config.attention, {"language model": arch.lm.head_dim,
                                                                    "vision tower": arch.vision.head_dim})
        if info.is_main and config.attention == "auto":
            why = f" ({fa4_unavailable()})" if kernel == "fa2" else ""
            print(f"vlmpack train: --attention auto: {kernel}{why}", file=sys.stderr)
        if on_fa2 and info.is_main:
            print(f"vlmpack train: --attention {kernel}: {', '.join(on_fa2)} keep FA2 "
                  f"(FA4 runs head dims {', '.join(map(str, FA4_HEAD_DIMS))})", file=sys.stderr)
    model = build_model(arch, model_config, info, recompute_vision=memory.recompute_vision,
                        recompute_vision_blocks=memory.recompute_vision_blocks, compile=config.compile,
                        compile_decoder=config.compile_decoder, static_rows=static_rows,
                        recompute_mlp_activations=memory.recompute_mlp_activations is not False)
    model.fused_loss = config.loss == "fused" and model.post_process
    return model_config, model


def load_weights(model, config, lora_config, seed: int, arch: ModelArch, info) -> None:
    """The starting weights of the model section `config` into this rank's stage: --hf-model,
    --init or a random init from `seed`; with the LoRA section `lora_config`'s --lora-rank the
    base frozen and the adapters (random or --init-lora) added."""
    if config.hf_model:
        load_hf_weights(model, config.hf_model, arch, info)
    elif config.init:
        load_model_weights(model, config.init, arch, info)
    else:
        init_random_weights(model, arch, seed, info)
    if lora_config.lora_rank:
        add_adapters(model, arch, config, lora_config, seed, info)
