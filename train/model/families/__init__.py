"""The model families of the training side, one module each (`qwen3_vl`, `qwen2_5_vl`, `qwen3_5`),
and the lookups through which shared code reaches them.

A family module defines a `ModelFamily` and registers it here: its Hugging Face model types and
config translation (to the architecture and back), its built-in architectures, its HF weight-name
table and checkpoint shapes, its decoder layer specs, its processor classes for exports and, where
it defines one, its vision tower's variant (`vision.TowerVariant`). Shared code (`ModelArch`, the
model builder, the converter, the vision tower, the export's side files) asks `by_name` /
`by_model_type` / `of` and calls the family's hooks; it never compares family names.

The family modules are imported on the first lookup, not with this module: they import the
model's building blocks (torch, megatron-core), which import this one.
"""

from __future__ import annotations

import importlib

# The modules that define families; each calls `register` when imported.
FAMILY_MODULES = ("train.model.families.qwen3_vl", "train.model.families.qwen2_5_vl", "train.model.families.qwen3_5")

_FAMILIES: dict[str, ModelFamily] = {}
_loaded = False


class ModelFamily:
    """What a family module provides. Subclasses set the attributes and implement the methods;
    the methods with a body here are the defaults a family may keep."""

    name: str  # ModelArch.family
    model_types: dict[str, bool]  # HF model_type -> whether its language model is Mixture-of-Experts
    # the family whose vision tower it builds (`VisionArch.family`): its own name where it defines one
    vision_family: str
    # its tower's variant (`train.model.vision.TowerVariant`), or None where it builds another family's
    vision_tower = None
    hf_processor_class: str  # processor_config.json's class, for exported checkpoints
    hf_video_processor_class: str
    # the built-in family (`shards_schema.builtin.BUILTIN_VISION`) whose image-processor settings
    # its checkpoints publish: an export without the training data's profile writes those
    processor_defaults_family: str
    carried_prefixes: tuple[str, ...] = ()  # HF tensors kept as they are, not built (`convert.carried_tensors`)
    transforms: dict = {}  # `convert.TRANSFORMS` entries its weight table adds
    # (transformers 5.x prefix, the prefix its hub checkpoints use) pairs, where they differ
    hub_name_prefixes: tuple[tuple[str, str], ...] = ()

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
        """The transformers class of `arch`."""
        raise NotImplementedError

    def builtin_archs(self) -> dict:
        """--arch name -> ModelArch."""
        return {}

    def weight_mappings(self) -> tuple:
        """The HF <-> Megatron name table (`convert.WeightMapping` rows)."""
        raise NotImplementedError

    def hf_shapes(self, arch) -> dict[str, tuple[int, ...]]:
        """Every tensor of the HF checkpoint (transformers 5.x names where the table uses them) and its shape."""
        raise NotImplementedError

    def hf_checkpoint_layout(self, state: dict, arch) -> dict:
        """HF tensors in another layout transformers may hold them in -> the table's (default: as given)."""
        return state

    def hf_export_layout(self, state: dict, arch) -> dict:
        """HF tensors as the weight table gives them -> as the family's published checkpoints
        hold them (default: as given)."""
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


def by_name(name: str) -> ModelFamily:
    """The family of `ModelArch.family` == name; ValueError naming the known ones for another name."""
    _load()
    if name not in _FAMILIES:
        raise ValueError(f"unknown model family {name!r}: expected one of {sorted(_FAMILIES)}")
    return _FAMILIES[name]


def by_model_type(model_type: str) -> ModelFamily | None:
    """The family of a config.json's `model_type`, or None for one no family builds."""
    _load()
    return next((f for f in _FAMILIES.values() if model_type in f.model_types), None)


def model_types() -> list[str]:
    """Every Hugging Face model_type some family builds."""
    return sorted(t for f in all_families() for t in f.model_types)


def of(arch) -> ModelFamily:
    return by_name(arch.family)


def vision_tower(kind: str):
    """The `TowerVariant` of the vision tower kind `kind` (`VisionArch.family`): the variant of the
    family of that name; ValueError naming the kinds for another name."""
    _load()
    family = _FAMILIES.get(kind)
    if family is None or family.vision_tower is None:
        kinds = sorted(f.name for f in _FAMILIES.values() if f.vision_tower is not None)
        raise ValueError(f"unknown vision family {kind!r}: expected one of {kinds}")
    return family.vision_tower
