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


def _set_text(key, value, drop=()):
    def change(text):
        for name in drop:
            text.pop(name, None)
        *inner, last = key.split(".")
        section = text
        for name in inner:
            section = section[name]
        section[last] = value
    return change


# settings a config.json reader computes with (divides by, sums, counts), of the wrong kind or
# value: (architecture, change of its text_config, what the one line says)
COMPUTED_WITH = {
    "head_dim a string": ("tiny", _set_text("head_dim", "16"), "the language model's head_dim must be an integer >= 1, "
                                                                "got '16'"),
    "mrope_section a number": ("tiny", _set_text("rope_parameters.mrope_section", 5),
                               "the language model's rope_parameters.mrope_section must be a list of integers >= 0, "
                               "got 5"),
    "mrope_section of strings": ("tiny", _set_text("rope_parameters.mrope_section", ["4", 2, 2]),
                                 "mrope_section must be a list of integers >= 0, got ['4', 2, 2]"),
    "rope_theta a word": ("tiny", _set_text("rope_parameters.rope_theta", "x"),
                          "rope_parameters.rope_theta must be a finite number above 0, got 'x'"),
    "rope_parameters a string": ("tiny", _set_text("rope_parameters", "x"),
                                 "the language model's rope_parameters is a string, not a JSON object of settings"),
    "no linear key heads": ("tiny-qwen3.5", _set_text("linear_num_key_heads", 0),
                            "text_config.linear_num_key_heads must be an integer >= 1, got 0"),
    "linear value heads null": ("tiny-qwen3.5", _set_text("linear_num_value_heads", None),
                                "text_config.linear_num_value_heads must be an integer >= 1, got None"),
    "layer_types a string": ("tiny-qwen3.5", _set_text("layer_types", "linear_attention"),
                             "text_config.layer_types must be a list of one type per layer, got 'linear_attention'"),
    "full attention every 0 layers": ("tiny-qwen3.5", _set_text("full_attention_interval", 0, drop=["layer_types"]),
                                      "text_config.full_attention_interval must be an integer >= 1, got 0"),
    "layers a string": ("tiny-qwen3.5", _set_text("num_hidden_layers", "4", drop=["layer_types"]),
                        "the language model's num_hidden_layers must be an integer >= 1, got '4'"),
    "layers null": ("tiny-qwen3.5", _set_text("num_hidden_layers", None, drop=["layer_types"]),
                    "text_config.num_hidden_layers must be an integer >= 1, got None"),
    "qwen3.5 head_dim null": ("tiny-qwen3.5", _set_text("head_dim", None), "text_config.head_dim is null"),
    # numbers of the right kind that the model cannot be built from together
    "heads in broken groups": ("tiny", _set_text("num_key_value_heads", 3),
                               "num_attention_heads 4 must be a multiple of num_key_value_heads 3"),
    "qwen3.5 heads in broken groups": ("tiny-qwen3.5-moe", _set_text("num_key_value_heads", 3),
                                       "num_attention_heads 4 must be a multiple of num_key_value_heads 3"),
    "two M-RoPE sections": ("tiny-qwen3.5", _set_text("rope_parameters.mrope_section", [2, 2]),
                            "mrope_section [2, 2] must list 3 sections (temporal, height, width), got 2"),
    "more than the whole head rotated": ("tiny-qwen3.5", lambda text: text["rope_parameters"].update(
                                             partial_rotary_factor=1.5, mrope_section=[8, 8, 8]),
                                         "partial_rotary_factor 1.5 must be in (0, 1]"),
    "an odd number of dims rotated": ("tiny-qwen3.5", lambda text: text["rope_parameters"].update(
                                          partial_rotary_factor=0.03125, mrope_section=[0, 0, 0]),
                                      "rotate an even number of each head's 32 dims (it rotates 1)"),
    "a MoE model type without experts": ("tiny-qwen3.5-moe", _set_text("num_experts", 0),
                                         "text_config.num_experts must be an integer >= 1 for a Mixture-of-Experts"),
    "a Qwen3-VL MoE model type without experts": ("tiny-moe", _set_text("num_experts", 0),
                                                  "text_config.num_experts must be an integer >= 1 for a "
                                                  "Mixture-of-Experts"),
    "more experts per token than experts": ("tiny-qwen3.5-moe", _set_text("num_experts_per_tok", 9),
                                            "num_experts_per_tok 9 must be between 1 and num_experts 8"),
    "no expert per token": ("tiny-moe", _set_text("num_experts_per_tok", 0),
                            "num_experts_per_tok 0 must be between 1 and num_experts 8"),
}


@pytest.mark.parametrize("case", list(COMPUTED_WITH))
def test_a_config_json_setting_computed_with_is_refused_by_name_not_as_a_traceback(tmp_path, case):
    name, change, says = COMPUTED_WITH[case]
    config = BUILTIN_ARCHS[name].to_hf_config()
    change(config["text_config"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:  # the commands report it in one line (a ModelFileError is one)
        ModelArch.from_hf_dir(tmp_path)
    assert says in str(err.value) and "config.json" in str(err.value), str(err.value)
