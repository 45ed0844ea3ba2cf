"""`vlmpack export-hf` of a LoRA checkpoint: PEFT adapter files, the model with the adapters
merged, or the base model the adapters belong to.

    PEFT:    CHECKPOINT/adapter -> adapter_config.json + adapter_model.safetensors, which
             `peft.PeftModel.from_pretrained(base_hf_model, DIR)` loads onto the base model
    merged:  base model + scaling * lora_B @ lora_A on every adapted weight (and the trained
             modules_to_save) -> a full Hugging Face checkpoint, as `export-hf` writes one
    base:    the base model alone, as a full Hugging Face checkpoint: what PEFT loads the
             adapters onto when the run started from a random init (`--arch`), whose weights
             exist nowhere else (they are drawn again from the recorded seed)

The base of a merge is the one the run trained on (recorded in adapter/lora.json: a Hugging
Face directory, a Megatron model directory, or a built-in architecture and seed), or `base`.
Merged and base checkpoints get the side files of `convert.write_hf_dir` (tokenizer,
processors, the training data's chat template), and the tensors the base's source carries beside
the model as they are (`convert.carried_tensors`: Qwen3.5's multi-token-prediction layers).
"""

from __future__ import annotations

from pathlib import Path

import torch

from shards_schema.errors import UserError
from train import adapter_format, convert
from train.checkpoint_format import (META_FILE, SideFiles, arch_differences, imported_fingerprint, lazy_hf_state,
                                     materialize, weights_fingerprint)
from train.model.arch import ModelArch
from train.model_setup import random_full_state


def export_peft(adapter_dir: Path, out: str | Path, dtype: torch.dtype | None = None,
                overwrite: bool = False) -> tuple[ModelArch, int]:
    """PEFT directory of a LoRA checkpoint's adapters; returns the architecture and the tensors written."""
    convert.check_output_dir(out, "export-peft", overwrite=overwrite)
    meta, spec, arch, full = adapter_format.read_adapter_dir(adapter_dir)
    base = meta["base"].get("hf_model")
    with convert.staged_output_dir(out, "export-peft", overwrite) as tmp:
        adapter_format.write_peft_dir(tmp, spec, arch, full, base, dtype)
    return arch, len(full)


def base_carried(base: dict, arch: ModelArch, override: str | Path | None = None) -> dict[str, torch.Tensor]:
    """The tensors the base model's source carries beside the model (`convert.carried_tensors`:
    Qwen3.5's multi-token-prediction layers); none for a random init."""
    source = override or base.get("hf_model") or base.get("init")
    if source is None or not Path(source).is_dir():
        return {}
    return {k: materialize(v) for k, v in convert.read_carried(source, arch).items()}


def base_megatron_state(base: dict, arch: ModelArch,
                        override: str | Path | None = None) -> tuple[dict[str, torch.Tensor], str | None]:
    """The full Megatron state of the model the adapters were trained on, and a note where the
    weights of the directory it is read from cannot be compared with the recorded ones."""
    source = override or base.get("hf_model") or base.get("init")
    if source is None:
        return random_full_state(arch, base["seed"]), None
    source = Path(source)
    if (source / "config.json").is_file():
        found = ModelArch.from_hf_dir(source)
        loader = lambda: {k: materialize(v) for k, v in convert.hf_to_megatron(lazy_hf_state(source), arch).items()}  # noqa: E731
    elif (source / META_FILE).is_file():
        found, full = convert.load_full_state(source)
        loader = lambda: full  # noqa: E731
    else:
        raise UserError(f"the base model {source} is not there (the adapters were trained on it): pass --base DIR, "
                        "the Hugging Face or Megatron model directory it moved to")
    differences = arch_differences(found, arch)
    if differences:
        raise UserError(f"base model {source} is not the architecture the adapters were trained on: "
                        + "; ".join(differences))
    note = check_base_weights(base, source)  # before the weights are read: a wrong base fails at once
    return loader(), note


def base_fingerprints(base: dict) -> dict[str, str]:
    """The weights fingerprints lora.json records of the adapters' base, by the kind of
    directory each is of ("hf": a Hugging Face directory's, "megatron": a model directory's)."""
    if "hf_model" in base:
        found = {"hf": base.get("fingerprint")}
    else:  # a model directory imported from an HF one records that one's too
        found = {"megatron": base.get("fingerprint"), "hf": base.get("hf_fingerprint")}
    return {kind: value for kind, value in found.items() if isinstance(value, str)}


def directory_fingerprints(source: Path) -> dict[str, str]:
    """`base_fingerprints`' kinds for a model to merge into: its own weights' fingerprint, and for
    a model directory imported from an HF one, that one's."""
    if (source / "config.json").is_file():
        return {"hf": weights_fingerprint(source)}
    imported = imported_fingerprint(source)
    return {"megatron": weights_fingerprint(source), **({"hf": imported} if imported else {})}


def check_base_weights(base: dict, source: Path) -> str | None:
    """UserError where `source` holds other weights than the adapters' recorded base (a model of
    the same architecture: a fine-tune of it, another seed); a note where nothing recorded can
    be compared with it, so only its architecture was checked."""
    recorded = base_fingerprints(base)
    if "seed" in base:
        why = f"the adapters were trained on a random init (--arch {base.get('arch')}, --seed {base['seed']})"
    elif not recorded:
        why = "the adapters' lora.json records no fingerprint of their base's weights"
    else:
        given = directory_fingerprints(source)
        shared = sorted(set(recorded) & set(given))
        if shared and not any(recorded[kind] == given[kind] for kind in shared):
            trained_on = base.get("hf_model") or base.get("init")
            raise UserError(f"base model {source} holds other weights than the adapters were trained on ({trained_on} "
                            "when they were trained; its weights fingerprint differs): pass --base DIR, the model "
                            "they were trained on")
        if shared:
            return None
        why = ("the adapters' base is recorded as a Hugging Face directory, and this model directory records no "
               "import from one" if "hf_model" in base else
               "the adapters' base is recorded as a model directory, not imported from a Hugging Face one")
    return f"{why}: the weights of {source} could not be compared with the base's, only its architecture"


def export_merged(adapter_dir: Path, out: str | Path, base_dir: str | Path | None = None,
                  dtype: torch.dtype | None = None, progress: bool = False, overwrite: bool = False,
                  chat_template: str | None = None) -> tuple[ModelArch, SideFiles]:
    """Full HF checkpoint of the base with the adapters merged in; returns the architecture and side files."""
    convert.check_output_dir(out, "export-hf", overwrite=overwrite)
    meta, spec, arch, full = adapter_format.read_adapter_dir(adapter_dir)
    base, note = base_megatron_state(meta["base"], arch, base_dir)
    hf = convert.canonical_hf_names(convert.megatron_to_hf(base, arch))
    merged = convert.hub_hf_names(adapter_format.merge_into_hf(hf, full, spec, arch), arch.family)
    merged |= base_carried(meta["base"], arch, base_dir)
    side_files = convert.write_hf_dir(out, merged, arch, Path(adapter_dir), dtype, progress, overwrite, chat_template)
    return arch, with_note(side_files, note)


def export_base(adapter_dir: Path, out: str | Path, base_dir: str | Path | None = None,
                dtype: torch.dtype | None = None, progress: bool = False, overwrite: bool = False,
                chat_template: str | None = None) -> tuple[ModelArch, SideFiles]:
    """Full HF checkpoint of the base model the adapters were trained on (or `base_dir`, where
    it moved); returns the architecture and side files."""
    convert.check_output_dir(out, "export-hf", overwrite=overwrite)
    meta, _, arch = adapter_format.read_lora_meta(adapter_dir)
    base, note = base_megatron_state(meta["base"], arch, base_dir)
    hf = convert.megatron_to_hf(base, arch) | base_carried(meta["base"], arch, base_dir)
    side_files = convert.write_hf_dir(out, hf, arch, Path(adapter_dir), dtype, progress, overwrite, chat_template)
    return arch, with_note(side_files, note)


def with_note(side_files: SideFiles, note: str | None) -> SideFiles:
    """`side_files` with `note` (about the base) first among the notes the export prints."""
    if note is not None:
        side_files.notes.insert(0, note)
    return side_files
