"""Model families that live in one module each (`train.model.families.qwen3_5`), and the lookups through
which shared code reaches them.

A family module defines a `ModelFamily` and registers it here: its Hugging Face model types and
config translation, its built-in architectures, its HF weight-name table, its decoder layer
specs and its vision tower. Shared code (`ModelArch.from_hf_config`, the model builder, the
converter, the vision tower's config reader) asks `by_name` / `by_model_type` and calls the
family's hooks; a family not found here is one of the original two (Qwen3-VL, Qwen2.5-VL), whose
code paths are the shared modules' own.

The family modules are imported on the first lookup, not with this module: they import the
model's building blocks (megatron-core), which the shared modules import this one without.
"""

from __future__ import annotations

import importlib

# The modules that define families; each calls `register` when imported.
FAMILY_MODULES = ("train.model.families.qwen3_5",)

_FAMILIES: dict[str, ModelFamily] = {}
_loaded = False


class ModelFamily:
    """What a family module provides. Subclasses set the attributes and implement the methods."""

    name: str  # ModelArch.family
    model_types: dict[str, bool]  # HF model_type -> whether its language model is Mixture-of-Experts
    vision_family: str  # the `VisionTower` kind its vision tower is (`VisionArch.family`)
    hf_processor_class: str  # processor_config.json's class, for exported checkpoints
    hf_video_processor_class: str
    # the built-in family (`shards_schema.builtin.BUILTIN_VISION`) whose image-processor settings
    # its checkpoints publish: an export without the training data's profile writes those
    processor_defaults_family: str
    carried_prefixes: tuple[str, ...] = ()  # HF tensors kept as they are, not built (`convert.carried_tensors`)
    transforms: dict = {}  # `convert.TRANSFORMS` entries its weight table adds

    def arch_from_hf_config(self, config: dict):
        """A config.json (dict) of one of `model_types` -> ModelArch; ValueError naming a field
        the model cannot build."""
        raise NotImplementedError

    def to_hf_config(self, arch) -> dict:
        """The config.json transformers loads for an exported checkpoint of `arch`."""
        raise NotImplementedError

    def hf_model_type(self, arch) -> str:
        return next(t for t, moe in self.model_types.items() if moe == arch.lm.is_moe)

    def hf_architecture(self, arch) -> str:
        raise NotImplementedError

    def builtin_archs(self) -> dict:
        """--arch name -> ModelArch."""
        return {}

    def weight_mappings(self) -> tuple:
        """The HF <-> Megatron name table (`convert.WeightMapping` rows)."""
        raise NotImplementedError

    def hf_shapes(self, arch) -> dict[str, tuple[int, ...]]:
        """Every tensor of the HF checkpoint (the names the published checkpoints use) and its shape."""
        raise NotImplementedError

    def hf_checkpoint_layout(self, state: dict, arch) -> dict:
        """HF tensors in another layout transformers may hold them in -> the checkpoint's (default: as given)."""
        return state

    def block_spec(self, arch, config, vp_stage=None):
        """This pipeline stage's megatron decoder block spec."""
        raise NotImplementedError

    def init_tensor(self, name: str, shape: tuple[int, ...], seed: int):
        """A random-init value for the full-model Megatron tensor `name` where the family's differs
        from the default draw (`checkpoint.random_full_state`), else None."""
        return None


def register(family: ModelFamily) -> None:
    _FAMILIES[family.name] = family


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True  # first: a lookup while a family module is being imported finds no family, not a loop
        try:
            for module in FAMILY_MODULES:
                importlib.import_module(module)
        except BaseException:
            _loaded = False
            raise


def all_families() -> list[ModelFamily]:
    _load()
    return list(_FAMILIES.values())


def by_name(name: str) -> ModelFamily | None:
    """The family module of `ModelArch.family` == name, or None for the original two families."""
    _load()
    return _FAMILIES.get(name)


def by_model_type(model_type: str) -> ModelFamily | None:
    _load()
    return next((f for f in _FAMILIES.values() if model_type in f.model_types), None)


def of(arch) -> ModelFamily | None:
    return by_name(arch.family)
