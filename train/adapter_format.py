"""LoRA adapters on disk: a training checkpoint's `adapter/` directory, and Hugging Face PEFT's.

A LoRA run's checkpoint holds its adapters, not the model:

    CHECKPOINT/adapter/
      lora.json                        the LoRA settings, the architecture, the tp / pp layout, and
                                       the base model the adapters belong to
      adapter_tp{t}_pp{p}.safetensors  the adapter tensors rank (t, p) holds (split as its base
                                       layers are), and the tensors of the modules trained fully
                                       (modules_to_save), under PEFT's file names

A PEFT directory (`vlmpack export-hf --lora-format peft`, `vlmpack train --init-lora`):

    adapter_config.json                PEFT's LoraConfig: r, lora_alpha, target_modules (a regex
                                       of the adapted modules' HF names), modules_to_save, ...
    adapter_model.safetensors          `base_model.model.<module>.lora_A.weight` / `.lora_B.weight`
                                       (+ modules_to_save tensors), as `peft` saves them
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from train.checkpoint_format import CheckpointError, load_tensors, meta_arch, save_tensors
from train.model import lora
from train.model.arch import ModelArch, arch_dict, read_json_object

ADAPTER_SUBDIR = "adapter"
LORA_META = "lora.json"
LORA_FORMAT = "vlmpack-lora-adapter"
LORA_FORMAT_VERSION = 1
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


def adapter_file(tp_rank: int, pp_rank: int) -> str:
    return f"adapter_tp{tp_rank}_pp{pp_rank}.safetensors"


def write_lora_meta(directory: Path, spec: lora.LoraSpec, arch: ModelArch, tp: int, pp: int, base: dict) -> None:
    meta = {"format": LORA_FORMAT, "format_version": LORA_FORMAT_VERSION, "lora": spec.to_dict(),
            "arch": arch_dict(arch), "tp": tp, "pp": pp, "base": base}
    (Path(directory) / LORA_META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def find_adapter_dir(path: str | Path) -> Path | None:
    """The adapter directory of a LoRA checkpoint given as itself or as the checkpoint; None if neither."""
    for candidate in (Path(path), Path(path) / ADAPTER_SUBDIR):
        if (candidate / LORA_META).is_file():
            return candidate
    return None


def read_lora_meta(directory: str | Path) -> tuple[dict, lora.LoraSpec, ModelArch]:
    meta = read_json_object(Path(directory) / LORA_META, "the adapter directory is damaged: use another "
                            "checkpoint's adapters")
    if meta.get("format") != LORA_FORMAT or meta.get("format_version") != LORA_FORMAT_VERSION:
        raise CheckpointError(f"{directory}/{LORA_META}: not a {LORA_FORMAT} v{LORA_FORMAT_VERSION} file")
    return meta, lora.LoraSpec.from_dict(meta["lora"]), meta_arch(meta, directory, LORA_META)


def read_adapter_dir(directory: str | Path) -> tuple[dict, lora.LoraSpec, ModelArch, dict[str, torch.Tensor]]:
    """(metadata, LoRA settings, architecture, the full adapter state in PEFT names) of an adapter directory."""
    meta, spec, arch = read_lora_meta(directory)
    sites = lora.resolve_sites(arch, spec)
    by_tp: dict[int, dict[str, torch.Tensor]] = {}
    for tp_rank in range(meta["tp"]):
        for pp_rank in range(meta["pp"]):
            by_tp.setdefault(tp_rank, {}).update(load_tensors(Path(directory) / adapter_file(tp_rank, pp_rank)))
    full = lora.unshard_adapters(by_tp, sites)
    full |= {k: v for k, v in by_tp[0].items() if k not in full}  # modules_to_save: whole on every rank
    check_adapter_state(full, arch, spec, str(directory))
    return meta, spec, arch, full


def check_adapter_state(full: dict[str, torch.Tensor], arch: ModelArch, spec: lora.LoraSpec, source: str) -> None:
    """CheckpointError naming the first adapter tensor that is missing or has the wrong shape."""
    expected = lora.adapter_shapes(lora.resolve_sites(arch, spec), spec.rank, spec.dora)
    for key, shape in expected.items():
        if key not in full:
            raise CheckpointError(f"{source}: adapter tensor {key} is missing")
        if tuple(full[key].shape) != shape:
            raise CheckpointError(f"{source}: adapter tensor {key} has shape {tuple(full[key].shape)}, expected {shape} "
                                  f"(rank {spec.rank})")


def peft_modules_to_save(arch: ModelArch, parts: tuple[str, ...]) -> list[str]:
    """PEFT's `modules_to_save` names for our parts (PEFT wraps modules, not module lists: each
    DeepStack merger is named on its own)."""
    names = []
    if "vision" in parts:
        names += ["patch_embed", *(f"blocks.{i}" for i in range(arch.vision.depth))]
        names += ["pos_embed"] if arch.vision.variant.learned_position_table else []
    if "merger" in parts:
        names += ["merger"] + [f"deepstack_merger_list.{i}" for i in range(len(arch.vision.deepstack_visual_indexes))]
    return [f"model.visual.{n}" for n in names]


def peft_config(spec: lora.LoraSpec, arch: ModelArch, base_model: str | None) -> dict:
    """adapter_config.json: the LoraConfig fields that define these adapters (PEFT fills in the rest)."""
    return {"peft_type": "LORA", "task_type": None, "base_model_name_or_path": base_model,
            "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
            "target_modules": lora.peft_target_regex(lora.resolve_sites(arch, spec)),
            "modules_to_save": peft_modules_to_save(arch, spec.modules_to_save) or None,
            "bias": "none", "fan_in_fan_out": False, "use_rslora": spec.rslora, "use_dora": spec.dora,
            "init_lora_weights": True, "inference_mode": True}


def write_peft_dir(out: Path, spec: lora.LoraSpec, arch: ModelArch, full: dict[str, torch.Tensor],
                   base_model: str | None, dtype: torch.dtype | None = None) -> None:
    state = {k: v.to(dtype) if dtype is not None else v for k, v in full.items()}
    save_tensors(out / PEFT_WEIGHTS, state)
    (out / PEFT_CONFIG).write_text(json.dumps(peft_config(spec, arch, base_model), indent=2) + "\n")


def check_peft_config(directory: str | Path, spec: lora.LoraSpec) -> dict:
    """A PEFT directory's adapter_config.json, if its adapters can start a run with `spec`
    (CheckpointError naming what does not fit: no config, another rank or alpha, DoRA)."""
    directory = Path(directory)
    config_path = directory / PEFT_CONFIG
    if not config_path.is_file():
        raise CheckpointError(f"--init-lora {directory}: no {PEFT_CONFIG}; pass a directory written by PEFT's "
                              f"save_pretrained or `vlmpack export-hf --lora-format peft`")
    config = read_json_object(config_path, "pass a directory written by PEFT's save_pretrained or `vlmpack "
                                           "export-hf --lora-format peft`")
    if config.get("peft_type") != "LORA":
        raise CheckpointError(f"--init-lora {directory}: peft_type {config.get('peft_type')!r}, only LORA adapters load")
    for key, ours, flag in (("r", spec.rank, "--lora-rank"), ("lora_alpha", spec.alpha, "--lora-alpha")):
        if float(config.get(key, -1)) != float(ours):
            raise CheckpointError(f"--init-lora {directory}: its {key} is {config.get(key)}, this run's {flag} is "
                                  f"{ours}; pass {flag} {config.get(key)}")
    for key, ours, flag in (("use_rslora", spec.rslora, "--lora-rslora"), ("use_dora", spec.dora, "--lora-dora")):
        if bool(config.get(key)) != ours:
            fix = f"add {flag}" if config.get(key) else f"drop {flag}"
            raise CheckpointError(f"--init-lora {directory}: its {key} is {bool(config.get(key))}, this run's is "
                                  f"{ours}; {fix}")
    return config


def read_peft_dir(directory: str | Path, arch: ModelArch, spec: lora.LoraSpec) -> dict[str, torch.Tensor]:
    """The adapters of a PEFT directory for a run with `spec` on `arch` (CheckpointError naming
    what does not fit, see `check_peft_config`, or adapters on modules the run does not adapt)."""
    directory = Path(directory)
    config = check_peft_config(directory, spec)
    state = load_tensors(directory / PEFT_WEIGHTS)
    state = {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v
             for k, v in state.items()}
    expected = lora.adapter_shapes(lora.resolve_sites(arch, spec), spec.rank, spec.dora)
    extra = sorted(k for k in state if ".lora_" in k and k not in expected)
    if extra:
        raise CheckpointError(f"--init-lora {directory}: adapter {extra[0]} is on a module this run does not adapt "
                              f"({len(extra)} such tensors); set --lora-targets / --lora-parts to the adapter's "
                              f"target_modules {config.get('target_modules')!r}")
    check_adapter_state(state, arch, spec, f"--init-lora {directory}")
    return {k: v.float() for k, v in state.items()}


def merge_into_hf(hf: dict[str, torch.Tensor], full: dict[str, torch.Tensor], spec: lora.LoraSpec,
                  arch: ModelArch) -> dict[str, torch.Tensor]:
    """HF weights (transformers 5.x names) with every adapter merged in (W + scaling * B @ A, in
    fp32, stored in W's dtype; with DoRA each row then scaled to its magnitude) and the
    modules_to_save tensors replaced by the trained ones."""
    out = dict(hf)
    for site in lora.resolve_sites(arch, spec):
        name = site.module + ".weight"
        merged = lora.merged_weight(hf[name], full[site.key("lora_A")], full[site.key("lora_B")], spec.scaling)
        if spec.dora:
            merged = merged * (full[site.key(lora.MAGNITUDE)].float() / merged.norm(dim=1))[:, None]
        out[name] = merged.to(hf[name].dtype)
    for key, value in full.items():
        if ".lora_" not in key:
            name = key.removeprefix(lora.PEFT_PREFIX)
            out[name] = value.to(hf[name].dtype)
    return out
