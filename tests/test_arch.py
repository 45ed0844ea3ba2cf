"""Built-in architectures against transformers: every published Qwen3-VL / Qwen2.5-VL size.

Oracle: the transformers model class of each architecture, built on the meta device from the
config we write (`to_hf_config`): its parameter names and shapes must be exactly the
checkpoint tensors our converter expects (`convert.hf_shapes`), and its parameter count the
published size. Configs we cannot build are refused by name.
"""

from __future__ import annotations

import json

import pytest
import torch

from shards_schema.errors import UserError
from train import convert
from train.model import families
from train.model.arch import BUILTIN_ARCHS, ModelArch
from train.model.families import qwen2_5_vl, qwen3_vl

# Parameters of the published checkpoints, in billions (the model cards' sizes, to 0.1 %).
PUBLISHED_BILLIONS = {
    "qwen3-vl-2b": 2.128, "qwen3-vl-4b": 4.438, "qwen3-vl-8b": 8.767, "qwen3-vl-32b": 33.357,
    "qwen3-vl-30b-a3b": 31.071, "qwen3-vl-235b-a22b": 235.670,
    "qwen2.5-vl-3b": 3.755, "qwen2.5-vl-7b": 8.292, "qwen2.5-vl-32b": 33.453, "qwen2.5-vl-72b": 73.411,
}
# Active parameters per token of the MoE models (the "A3B" / "A22B" in their names).
ACTIVE_BILLIONS = {"qwen3-vl-30b-a3b": 3.0, "qwen3-vl-235b-a22b": 22.0}


def _hf_meta_model(arch: ModelArch):
    import transformers

    config = arch.to_hf_config()
    config_class = getattr(transformers, arch.hf_architecture.replace("ForConditionalGeneration", "Config"))
    hf_config = config_class(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        return getattr(transformers, arch.hf_architecture)(hf_config)


@pytest.mark.parametrize("name", sorted({**qwen3_vl.builtin_archs(), **qwen2_5_vl.builtin_archs()}))
def test_builtin_arch_is_the_transformers_model(name):
    arch = BUILTIN_ARCHS[name]
    assert ModelArch.from_hf_config(arch.to_hf_config()) == arch
    model = _hf_meta_model(arch)
    state = {k: torch.empty(v.shape, device="meta") for k, v in model.state_dict().items()}
    # transformers holds MoE expert stacks as [E, 2F, H]; the checkpoint layout we read is [E, H, 2F]
    state = families.of(arch).hf_checkpoint_layout(state, arch)
    if arch.lm.tie_word_embeddings:
        state.pop(convert.HF_LM_HEAD, None)
    assert {k: tuple(v.shape) for k, v in state.items()} == convert.hf_shapes(arch)
    if name in PUBLISHED_BILLIONS:
        total = sum(p.numel() for p in model.parameters()) / 1e9
        assert total == pytest.approx(PUBLISHED_BILLIONS[name], rel=1e-3)
        assert arch.lm.num_params() / 1e9 == pytest.approx(total - sum(
            p.numel() for p in model.model.visual.parameters()) / 1e9, rel=1e-3)
    if name in ACTIVE_BILLIONS:
        assert arch.lm.num_non_embedding_params() / 1e9 == pytest.approx(ACTIVE_BILLIONS[name], rel=0.05)


@pytest.mark.parametrize("change, message", [
    (dict(mlp_only_layers=[1]), "mlp_only_layers"),
    (dict(decoder_sparse_step=2), "decoder_sparse_step"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(norm_topk_prob=False), "norm_topk_prob"),
])
def test_configs_the_model_cannot_build_are_refused_by_name(change, message):
    config = BUILTIN_ARCHS["tiny-moe"].to_hf_config()
    config["text_config"].update(change)
    with pytest.raises(ValueError, match=message):
        ModelArch.from_hf_config(config)


def test_transformers_saved_moe_config_reads_num_local_experts():
    """transformers 5.2x writes `num_local_experts`; the published configs `num_experts`."""
    config = BUILTIN_ARCHS["tiny-moe"].to_hf_config()
    config["text_config"]["num_local_experts"] = config["text_config"].pop("num_experts")
    assert ModelArch.from_hf_config(config) == BUILTIN_ARCHS["tiny-moe"]


def test_every_builtin_config_json_passes_the_field_checks(tmp_path):
    for name, arch in BUILTIN_ARCHS.items():
        (tmp_path / "config.json").write_text(json.dumps(arch.to_hf_config()))
        assert ModelArch.from_hf_dir(tmp_path) == arch, name


@pytest.mark.parametrize("section, key, value, says", [
    ("text_config", "hidden_size", "64", "the language model's hidden_size must be an integer >= 1, got '64'"),
    ("text_config", "num_hidden_layers", None, "the language model's num_hidden_layers must be an integer >= 1"),
    ("text_config", "num_attention_heads", 0, "the language model's num_attention_heads must be an integer >= 1"),
    ("text_config", "vocab_size", -5, "vocab_size must be an integer >= 1, got -5"),
    ("text_config", "rms_norm_eps", float("nan"), "rms_norm_eps must be a finite number above 0, got nan"),
    ("vision_config", "depth", 1.5, "the vision tower's depth must be an integer >= 1, got 1.5"),
])
def test_a_config_json_number_of_the_wrong_kind_is_refused_naming_the_file_and_field(tmp_path, section, key, value,
                                                                                  says):
    config = BUILTIN_ARCHS["tiny"].to_hf_config()
    config[section][key] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as err:
        ModelArch.from_hf_dir(tmp_path)
    assert str(err.value).startswith(f"{tmp_path / 'config.json'}: ") and says in str(err.value), str(err.value)
