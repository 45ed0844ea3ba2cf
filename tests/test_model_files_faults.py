"""Damaged model files: `vlmpack import-hf`, `vlmpack export-hf` and `vlmpack train --hf-model DIR
/ --init DIR` exit 2 with one line that names the damaged file and the fix, never a traceback.

Each case is an intact directory (a tiny Hugging Face Qwen3-VL checkpoint, or its `import-hf`
model directory) with one file replaced (`tests.helpers.damage`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from shards_schema.cli import main as vlmpack
from tests.helpers.damage import damaged_copy, one_error_line
from tests.helpers.models import tiny_qwen3_vl
from tests.helpers.shards import preprocess
from train import convert

SEQ_LEN = 512
TRAIN = ["--seq-len", str(SEQ_LEN), "--global-batch-packs", "1", "--num-workers", "0", "--tensorboard", "false",
         "--train-steps", "1"]


def _without(key: str):
    return lambda raw: json.dumps({k: v for k, v in json.loads(raw).items() if k != key}).encode()


def _with(**changes):
    return lambda raw: json.dumps({**json.loads(raw), **changes}).encode()


def _with_lm(**changes):
    def damage(raw: bytes) -> bytes:
        meta = json.loads(raw)
        return json.dumps({**meta, "arch": {**meta["arch"], "lm": {**meta["arch"]["lm"], **changes}}}).encode()
    return damage


def _without_in(section: str, key: str):
    def damage(raw: bytes) -> bytes:
        config = json.loads(raw)
        return json.dumps({**config, section: {k: v for k, v in config[section].items() if k != key}}).encode()
    return damage


# case -> (the file replaced, its new bytes from the intact ones, what the one line says after the file's path)
HF_DAMAGE = {
    "config_not_json": ("config.json", lambda raw: raw[:40], ": not valid JSON ("),
    "config_a_list": ("config.json", lambda raw: b"[1, 2]", ": holds a JSON array, not an object: use the config.json"),
    "config_without_model_type": ("config.json", _without("model_type"), ": vlmpack reads ["),
    "config_of_another_model": ("config.json", _with(model_type="llava"), ": vlmpack reads ["),
    "config_without_vision_config": ("config.json", _without("vision_config"), " has no 'vision_config'"),
    "text_config_null": ("config.json", _with(text_config=None), ": text_config is null, not a JSON object of settings"),
    "text_config_without_hidden_size": ("config.json", _without_in("text_config", "hidden_size"),
                                        " has no 'hidden_size' in its text_config"),
    "vision_config_without_depth": ("config.json", _without_in("vision_config", "depth"),
                                    " has no 'depth' in its vision_config"),
    "weights_random_bytes": ("model.safetensors", lambda raw: os.urandom(4096), ": not a readable safetensors file"),
    "weights_cut_short": ("model.safetensors", lambda raw: raw[:len(raw) // 2], ": not a readable safetensors file"),
    "index_not_json": ("model.safetensors.index.json", lambda raw: b'{"weight_map": ', ": not valid JSON ("),
    "index_names_a_missing_file": ("model.safetensors.index.json",
                                   lambda raw: json.dumps({"weight_map": {"lm_head.weight": "model-2.safetensors"}}).encode(),
                                   " names weight files that "),
    # side files an export carries into a directory transformers reads: named where they are first read
    "tokenizer_not_json": ("tokenizer.json", lambda raw: b"{bad", ": not valid JSON ("),
    "processor_config_a_list": ("preprocessor_config.json", lambda raw: b"[]", ": holds a JSON array, not an object"),
    "tokenizer_config_template_a_number": ("tokenizer_config.json", _with(chat_template=5),
                                           ": chat_template is a number, not a template's text"),
    "chat_template_not_jinja": ("chat_template.jinja", lambda raw: b"{% if %}", ": not a Jinja template (line 1: "),
    "index_names_a_missing_tensor": ("model.safetensors.index.json",
                                     lambda raw: json.dumps({"weight_map": {"model.extra.weight": "model.safetensors"}}).encode(),
                                     " names tensors its weight files lack: model.extra.weight (in model.safetensors)"),
}
MODEL_DAMAGE = {
    "meta_not_json": ("vlmpack_model.json", lambda raw: raw[:-30], ": not valid JSON ("),
    "meta_a_list": ("vlmpack_model.json", lambda raw: b"[]", ": holds a JSON array, not an object: write the model directory"),
    "meta_without_layout": ("vlmpack_model.json", _without("tp"), ": tp None is not a parallel size"),
    "meta_lm_a_string": ("vlmpack_model.json", lambda raw: json.dumps({**json.loads(raw), "arch": {
        **json.loads(raw)["arch"], "lm": "x"}}).encode(), ": arch.lm is a string, not a JSON object of settings"),
    "meta_layers_a_string": ("vlmpack_model.json", lambda raw: raw.replace(b'"num_layers": 3', b'"num_layers": "3"'),
                             ": the language model's num_layers must be an integer >= 1, got '3'"),
    "meta_not_utf8": ("vlmpack_model.json", lambda raw: b"\xff\xfe" + raw, ": not valid JSON ("),
    # relations between the architecture's numbers: refused where the file is read, not met as a traceback
    "meta_mrope_not_summing": ("vlmpack_model.json", _with_lm(mrope_section=[4, 2, 1]),
                               ": the language model's mrope_section [4, 2, 1] must sum to the rotated dims / 2 = 8"),
    "meta_layer_types_short": ("vlmpack_model.json", _with_lm(layer_types=["full_attention"]),
                               ": the language model's layer_types lists 1 layers, num_layers is 3"),
    "weights_random_bytes": ("model_tp0_pp0.safetensors", lambda raw: os.urandom(4096),
                             ": not a readable safetensors file"),
    "weights_cut_short": ("model_tp0_pp0.safetensors", lambda raw: raw[:len(raw) - 100],
                          ": not a readable safetensors file"),
    "kept_hf_file_not_json": ("hf/generation_config.json", lambda raw: raw[:10], ": not valid JSON ("),
    "profile_a_list": ("profile.json", lambda raw: b"[]", ": holds a JSON array, not an object: delete it"),
    # the tensors a checkpoint carries beside the model (Qwen3.5's multi-token prediction), which
    # every save copies: named before the first step
    "carried_random_bytes": ("hf_carried.safetensors", lambda raw: os.urandom(4096),
                             ": not a readable safetensors file"),
}


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "qwen3-vl"
    tiny_qwen3_vl(seed=1).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(hf_checkpoint, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "model"
    convert.import_hf(hf_checkpoint, path)
    return path


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return preprocess(tmp_path_factory.mktemp("data"), "shards", rows=8, seq_len=SEQ_LEN, size_range=(32, 48))


# the command, the fixture it reads, its damage table, and the file whose absence shows it wrote nothing
CONVERSIONS = {"import-hf": ("hf_checkpoint", HF_DAMAGE, "out"), "export-hf": ("model_dir", MODEL_DAMAGE, "out/config.json")}


@pytest.mark.parametrize("command, case", [(c, case) for c, (_, damage, _) in CONVERSIONS.items() for case in sorted(damage)])
def test_a_conversion_of_a_damaged_directory_exits_2_naming_the_file(request, tmp_path, capsys, command, case):
    fixture, damage_table, not_written = CONVERSIONS[command]
    name, damage, says = damage_table[case]
    source = damaged_copy(request.getfixturevalue(fixture), tmp_path / "source", name, damage)
    capsys.readouterr()
    assert vlmpack([command, str(source), "--out", str(tmp_path / "out")]) == 2
    line = one_error_line(capsys.readouterr().err, command)
    assert f"{source / name}{says}" in line, line
    assert not (tmp_path / not_written).exists()


# a config.json, an index or weights damaged (--hf-model), the metadata or the weights of a model directory (--init)
TRAIN_CASES = [("--hf-model", case) for case in ("config_not_json", "config_a_list", "config_of_another_model",
                                                 "weights_cut_short", "index_names_a_missing_file",
                                                 "index_names_a_missing_tensor", "tokenizer_not_json",
                                                 "chat_template_not_jinja")] + \
              [("--init", case) for case in ("meta_not_json", "meta_a_list", "weights_random_bytes",
                                             "carried_random_bytes")]


@pytest.mark.parametrize("flag, case", TRAIN_CASES, ids=[f"{flag} {case}" for flag, case in TRAIN_CASES])
def test_train_from_a_damaged_model_exits_2_naming_the_file(hf_checkpoint, model_dir, shards, tmp_path, capsys, flag,
                                                            case):
    intact, table = (hf_checkpoint, HF_DAMAGE) if flag == "--hf-model" else (model_dir, MODEL_DAMAGE)
    name, damage, says = table[case]
    source = damaged_copy(intact, tmp_path / "source", name, damage)
    capsys.readouterr()
    code = vlmpack(["train", *TRAIN, flag, str(source), "--data", str(shards), "--out", str(tmp_path / "run")])
    line = one_error_line(capsys.readouterr().err, "train")
    assert code == 2 and f"{source / name}{says}" in line, line
    assert not (tmp_path / "run").exists()  # refused in setup, before a step: no run directory left


def test_the_intact_files_linked_the_same_way_import_and_export(hf_checkpoint, tmp_path):
    """The cases above differ from these only in the damaged file."""
    source = damaged_copy(hf_checkpoint, tmp_path / "hf", "unrelated.json", lambda raw: raw)
    assert vlmpack(["import-hf", str(source), "--out", str(tmp_path / "model")]) == 0
    model = damaged_copy(tmp_path / "model", tmp_path / "linked", "unrelated.json", lambda raw: raw)
    assert vlmpack(["export-hf", str(model), "--out", str(tmp_path / "exported")]) == 0


def test_export_names_a_damaged_kept_file_before_reading_any_weight(model_dir, tmp_path, capsys, monkeypatch):
    """A damaged side file is found before the weights are read and written (on a large model
    that is the whole export's time), not after."""
    name, damage, says = MODEL_DAMAGE["kept_hf_file_not_json"]
    source = damaged_copy(model_dir, tmp_path / "source", name, damage)

    def weights_read(*args, **kwargs):
        raise AssertionError("the weights were read before the side files were checked")

    monkeypatch.setattr(convert, "load_full_state", weights_read)
    capsys.readouterr()
    assert vlmpack(["export-hf", str(source), "--out", str(tmp_path / "out")]) == 2
    assert f"{source / name}{says}" in one_error_line(capsys.readouterr().err, "export-hf")


def test_import_of_a_checkpoint_whose_fused_tensors_mix_dtypes_writes_their_common_dtype(hf_checkpoint, tmp_path):
    """q_proj saved in float16 beside float32 k/v_proj: megatron's fused qkv is made in float32, as
    torch.cat makes it, and the export gives q_proj back at its saved values."""
    import torch
    from safetensors.torch import load_file, save_file

    name = "model.language_model.layers.0.self_attn.q_proj.weight"

    def half_q(raw: bytes) -> bytes:
        (tmp_path / "intact.safetensors").write_bytes(raw)
        state = load_file(tmp_path / "intact.safetensors")
        state[name] = state[name].to(torch.float16)
        save_file(state, tmp_path / "mixed.safetensors", metadata={"format": "pt"})
        return (tmp_path / "mixed.safetensors").read_bytes()

    source = damaged_copy(hf_checkpoint, tmp_path / "source", "model.safetensors", half_q)
    assert vlmpack(["import-hf", str(source), "--out", str(tmp_path / "model")]) == 0
    assert vlmpack(["export-hf", str(tmp_path / "model"), "--out", str(tmp_path / "out")]) == 0
    exported = load_file(tmp_path / "out" / "model.safetensors")[name]
    assert exported.dtype == torch.float32
    assert torch.equal(exported, load_file(tmp_path / "mixed.safetensors")[name].float())


@pytest.mark.parametrize("seed", [0, 1])
def test_import_refuses_a_weight_that_holds_nan_or_inf_naming_it(hf_checkpoint, tmp_path, capsys, seed):
    """A NaN or an infinity anywhere in a random weight, or a finite value that --dtype float16
    makes infinite, is refused with one line naming the weight; nothing is left in --out."""
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    rng = np.random.default_rng(seed)
    state = load_file(hf_checkpoint / "model.safetensors")
    name = sorted(k for k, t in state.items() if t.is_floating_point() and t.numel() > 1)[
        int(rng.integers(0, len(state) - 1))]
    for bad, dtype in ((float("nan"), None), (float("-inf"), None), (1e6, "float16")):
        def poison(raw: bytes, bad=bad) -> bytes:
            (tmp_path / "intact.safetensors").write_bytes(raw)
            tensors = load_file(tmp_path / "intact.safetensors")
            tensors[name].view(-1)[int(rng.integers(0, tensors[name].numel()))] = bad
            save_file(tensors, tmp_path / "poisoned.safetensors", metadata={"format": "pt"})
            return (tmp_path / "poisoned.safetensors").read_bytes()

        source = damaged_copy(hf_checkpoint, tmp_path / f"source{bad}", "model.safetensors", poison)
        out = tmp_path / f"model{bad}"
        code = vlmpack(["import-hf", str(source), "--out", str(out), *(["--dtype", dtype] if dtype else [])])
        line = one_error_line(capsys.readouterr().err, "import-hf")
        assert code == 2 and "holds NaN or infinite values" in line and str(source) in line, line
        assert f"weight {name} holds" in line or f"{name} + " in line or f" + {name} holds" in line, line  # the file's name
        assert ("once cast to float16" in line) == (dtype == "float16"), line
        assert not out.exists() or not any(p.suffix == ".safetensors" for p in out.rglob("*")), list(out.rglob("*"))
    assert torch.isfinite(state[name]).all()


def test_a_weight_file_that_is_a_broken_link_exits_2_naming_it(hf_checkpoint, shards, tmp_path, capsys):
    import shutil

    source = tmp_path / "source"
    shutil.copytree(hf_checkpoint, source)
    (source / "model.safetensors").unlink()
    (source / "model.safetensors").symlink_to(tmp_path / "nowhere" / "model.safetensors")
    for argv, command in ((["import-hf", str(source), "--out", str(tmp_path / "out")], "import-hf"),
                          (["train", *TRAIN, "--hf-model", str(source), "--data", str(shards), "--out",
                            str(tmp_path / "run")], "train")):
        capsys.readouterr()
        assert vlmpack(argv) == 2
        line = one_error_line(capsys.readouterr().err, command)
        assert f"{source} holds model.safetensors, which is no readable file (a broken symbolic link" in line, line
    assert not (tmp_path / "out").exists()
