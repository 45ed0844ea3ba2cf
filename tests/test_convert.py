"""HF <-> Megatron weight conversion, TP/PP sharding and the model directory format.

Oracles: tiny random Hugging Face models (their files and `from_pretrained`), megatron's own
`build_model` state dicts (keys and shapes) and, at TP=PP=1, the HF model's logits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from itertools import product

import pytest
import torch
from safetensors.torch import load_file, save_file

from shards_schema.errors import UserError
from shards_schema.outdir import LOCK_NAME, exclusive_output_dir, user_entries
from tests.helpers.cli import vlmpack_exit_code
from tests.helpers.models import tiny_qwen2_5_vl_config, tiny_qwen3_vl_config, tiny_qwen3_vl_moe_config
from train import convert as C
from train.checkpoint_format import (
    FILE_MODE,
    META_FILE,
    CheckpointError,
    rank_file,
    read_arch,
    read_hf_state,
    write_hf_state,
    write_meta,
)
from train.model.arch import ModelArch, builtin_arch
from train.model.families import qwen3_vl
from train.model.batch import PackedBatch

# Model kinds: the two families, and Qwen3-VL with Mixture-of-Experts MLPs.
HF_CLASSES = {"qwen3-vl": "Qwen3VLForConditionalGeneration", "qwen2.5-vl": "Qwen2_5_VLForConditionalGeneration",
              "qwen3-vl-moe": "Qwen3VLMoeForConditionalGeneration"}
CONFIGS = {"qwen3-vl": tiny_qwen3_vl_config, "qwen2.5-vl": tiny_qwen2_5_vl_config,
           "qwen3-vl-moe": tiny_qwen3_vl_moe_config}
KINDS = ["qwen3-vl", "qwen2.5-vl", "qwen3-vl-moe"]


def _hf_model(family: str, tied: bool, layers: int):
    import transformers

    config = CONFIGS[family]()
    config.tie_word_embeddings = tied
    config.text_config.num_hidden_layers = layers
    torch.manual_seed(0)
    return getattr(transformers, HF_CLASSES[family])(config).eval()


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """(family, tied) -> (HF model, its save_pretrained directory). 4 LM layers so that PP=2
    splits evenly (megatron requires it) with Qwen3's DeepStack layers 0, 1 on stage 0."""
    cache = {}

    def make(family: str, tied: bool = True):
        if (family, tied) not in cache:
            model = _hf_model(family, tied, layers=4 if family.startswith("qwen3-vl") else 2)
            path = tmp_path_factory.mktemp(f"hf-{family}-{'tied' if tied else 'untied'}")
            model.save_pretrained(path)
            cache[family, tied] = model, path
        return cache[family, tied]

    return make


def _load(path) -> tuple[ModelArch, dict]:
    return ModelArch.from_hf_dir(path), load_file(str(path / "model.safetensors"))


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert torch.equal(value, b[key]), key


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("family", KINDS)
def test_hf_megatron_hf_is_exact(hf_checkpoint, family, tied):
    _, path = hf_checkpoint(family, tied)
    arch, hf = _load(path)
    assert arch.lm.tie_word_embeddings is tied
    full = C.hf_to_megatron(hf, arch)
    assert (C.OUTPUT in full) is not tied
    back = C.megatron_to_hf(full, arch)
    if arch.lm.is_moe:  # save_pretrained wrote transformers' [E, 2F, H] stacks; export writes the hub's [E, H, 2F]
        e, h, f = arch.lm.num_experts, arch.lm.hidden_size, arch.lm.moe_intermediate_size
        gate_up = "model.language_model.layers.0.mlp.experts.gate_up_proj"
        assert hf[gate_up].shape == (e, 2 * f, h) and back[gate_up].shape == (e, h, 2 * f)
        hf = {k: v.transpose(1, 2) if ".experts." in k else v for k, v in hf.items()}
        # and the hub layout reads back to the same weights
        _assert_same(C.hf_to_megatron(back, arch), full)
    _assert_same(back, hf)


@pytest.mark.parametrize("family", KINDS)
def test_matches_built_model_and_hf_logits(hf_checkpoint, info, family):
    """TP=PP=1: our keys/shapes are megatron's, and the converted weights give HF's logits
    (which they would not with a wrong QKV grouping or fc1 order)."""
    from train.model.qwen_vl import transformer_config
    from train.parallel import build_model

    hf_model, path = hf_checkpoint(family, False)
    arch, hf = _load(path)
    model = build_model(arch, transformer_config(arch, cpu=True), info).eval()
    built = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith("._extra_state")}
    assert built == C.shard_shapes(arch, 1, 0, 1, 0) == C.megatron_shapes(arch)
    C.load_into_model(model, C.shard(C.hf_to_megatron(hf, arch), arch, 1, 0, 1, 0))
    ids = torch.arange(1000, 1016)
    with torch.no_grad():
        want = hf_model(input_ids=ids[None]).logits[0]
        row = PackedBatch.from_segments(ids, torch.arange(16).expand(3, 16), torch.tensor([0, 16], dtype=torch.int32))
        got = model(row, return_logits=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _expected_tp2_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    lm = arch.lm
    h, d, f = lm.hidden_size, lm.head_dim, lm.intermediate_size
    qkv = (lm.num_heads + 2 * lm.num_kv_heads) * d // 2
    shapes = {"self_attention.linear_qkv.weight": (qkv, h), "self_attention.linear_proj.weight": (h, lm.num_heads * d // 2),
              "input_layernorm.weight": (h,)}
    if lm.is_moe:  # experts and router whole on each TP rank (expert TP 1)
        e, fe = lm.num_experts, lm.moe_intermediate_size
        shapes.update({"mlp.router.weight": (e, h), "mlp.experts.weight1": (h, e * 2 * fe),
                       "mlp.experts.weight2": (e * fe, h)})
    else:
        shapes.update({"mlp.linear_fc1.weight": (f, h), "mlp.linear_fc2.weight": (h, f // 2)})
    if lm.qkv_bias:
        shapes["self_attention.linear_qkv.bias"] = (qkv,)
    return shapes


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("family", KINDS)
def test_shard_unshard(hf_checkpoint, family, tied):
    _, path = hf_checkpoint(family, tied)
    arch, hf = _load(path)
    full = C.hf_to_megatron(hf, arch)
    n_layers, vocab = arch.lm.num_layers, arch.lm.vocab_size
    for tp in (1, 2):
        for pp in (1, 2):
            states = {(t, p): C.shard(full, arch, tp, t, pp, p) for t in range(tp) for p in range(pp)}
            _assert_same(C.unshard(states, arch, tp, pp), full)
            for (t, p), state in states.items():
                layers = {k.split(".")[3] for k in state if ".layers." in k}
                assert layers == {str(i) for i in range(n_layers // pp)}  # numbered within the stage
                assert any(k.startswith("vision.") for k in state) == (p == 0)
                assert (C.EMBED in state) == (p == 0)
                # the last stage holds an output layer unless the embeddings are tied on one stage
                assert (C.OUTPUT in state) == (p == pp - 1 and (not tied or pp > 1))
                for key in (C.EMBED, C.OUTPUT):
                    if key in state:
                        assert state[key].shape == (vocab // tp, arch.lm.hidden_size)
                if tp == 2:
                    prefix = "language_model.decoder.layers.0."
                    assert {k: tuple(state[prefix + k].shape) for k in _expected_tp2_shapes(arch)} == _expected_tp2_shapes(arch)


def test_expert_parallel_shards_hold_their_experts(hf_checkpoint, tmp_path):
    """EP rank r holds experts r*E/ep ... of every MoE layer (megatron's local expert indices),
    the other tensors whole; shard -> unshard is exact for ep 2 and 4 with tp 1 and 2 and pp 1
    and 2; a model directory saved at tp=2 x ep=2 holds each TP rank's tensors but the experts
    once, and each EP rank's experts once; it reloads at any layout and exports the original
    checkpoint."""
    _, path = hf_checkpoint("qwen3-vl-moe", False)
    arch, hf = _load(path)
    full = C.hf_to_megatron(hf, arch)
    lm = arch.lm
    e, h, f = lm.num_experts, lm.hidden_size, lm.moe_intermediate_size
    stack = qwen3_vl.expert_layout(hf, lm)["model.language_model.layers.0.mlp.experts.gate_up_proj"]  # [E, H, 2F]
    down = qwen3_vl.expert_layout(hf, lm)["model.language_model.layers.0.mlp.experts.down_proj"]  # [E, F, H]
    for ep in (2, 4):
        for tp, pp in product((1, 2), (1, 2)):
            states = {key: C.shard(full, arch, tp, key[0], pp, key[1], ep, key[2]) for key in C.rank_keys(tp, pp, ep)}
            _assert_same(C.unshard(states, arch, tp, pp, ep), full)
        n = e // ep
        for r in range(ep):
            state = C.shard(full, arch, 1, 0, 1, 0, ep, r)
            w1 = state["language_model.decoder.layers.0.mlp.experts.weight1"]
            w2 = state["language_model.decoder.layers.0.mlp.experts.weight2"]
            assert w1.shape == (h, n * 2 * f) and w2.shape == (n * f, h)
            assert torch.equal(w1.reshape(n, h, 2 * f), stack[r * n:(r + 1) * n])
            assert torch.equal(w2.reshape(n, f, h), down[r * n:(r + 1) * n])
            assert torch.equal(state[C.EMBED], full[C.EMBED])
    model = tmp_path / "m"
    C.import_hf(path, model, tp=2, ep=2)
    files = {p.name: load_file(str(p)) for p in model.glob("*.safetensors")}
    assert sorted(files) == ["experts_pp0_ep0.safetensors", "experts_pp0_ep1.safetensors",
                             "model_tp0_pp0.safetensors", "model_tp1_pp0.safetensors"]
    experts = {k for k in full if k.endswith(("experts.weight1", "experts.weight2"))}
    assert experts and all(set(files[f"experts_pp0_ep{r}.safetensors"]) == experts for r in range(2))
    assert all(not experts & set(files[f"model_tp{t}_pp0.safetensors"]) for t in range(2))
    for t, r in product(range(2), range(2)):
        _assert_same(C.load_model_state(model, arch, 2, t, 1, 0, 2, r), C.shard(full, arch, 2, t, 1, 0, 2, r))
    _assert_same(C.load_model_state(model, arch), full)
    _assert_same(C.load_model_state(model, arch, 1, 0, 2, 1, 4, 3), C.shard(full, arch, 1, 0, 2, 1, 4, 3))
    C.export_hf(model, tmp_path / "hf")
    _assert_same(load_file(str(tmp_path / "hf" / "model.safetensors")), C.megatron_to_hf(full, arch))
    # rank states whose shared tensors differ between expert-parallel ranks do not merge
    states = {key: C.shard(full, arch, 1, key[0], 1, key[1], 2, key[2]) for key in C.rank_keys(1, 1, 2)}
    states[(0, 0, 1)] = {**states[(0, 0, 1)], C.EMBED: states[(0, 0, 1)][C.EMBED] + 1}
    with pytest.raises(CheckpointError, match="differs between expert-parallel ranks 0 and 1"):
        C.unshard(states, arch, 1, 1, 2)


def test_format_version_1_expert_parallel_directory_still_reads(hf_checkpoint, tmp_path):
    """A model directory of format version 1 saved at ep=2 (one whole stage file per EP rank,
    with that rank's experts) reloads at any layout and exports the original checkpoint."""
    _, path = hf_checkpoint("qwen3-vl-moe", False)
    arch, hf = _load(path)
    full = C.hf_to_megatron(hf, arch)
    model = tmp_path / "v1"
    model.mkdir()
    for r in range(2):
        save_file(C.shard(full, arch, 1, 0, 1, 0, 2, r), str(model / f"model_tp0_pp0_ep{r}.safetensors"))
    write_meta(model, arch, 1, 1, "float32", 2)
    meta = json.loads((model / META_FILE).read_text())
    (model / META_FILE).write_text(json.dumps({**meta, "format_version": 1}))
    _assert_same(C.load_model_state(model, arch, 1, 0, 1, 0, 2, 1), C.shard(full, arch, 1, 0, 1, 0, 2, 1))
    _assert_same(C.load_model_state(model, arch, 2, 1, 1, 0, 4, 2), C.shard(full, arch, 2, 1, 1, 0, 4, 2))
    C.export_hf(model, tmp_path / "hf")
    _assert_same(load_file(str(tmp_path / "hf" / "model.safetensors")), C.megatron_to_hf(full, arch))


@pytest.mark.parametrize("kind, tp, ep, message", [
    ("qwen3-vl", 1, 2, "ep=2: expert parallelism needs a Mixture-of-Experts model"),
    ("qwen3-vl-moe", 1, 3, "ep=3 does not divide the 8 experts"),
])
def test_expert_parallel_layouts_that_cannot_be_built_are_refused(hf_checkpoint, tmp_path, kind, tp, ep, message):
    _, path = hf_checkpoint(kind, True)
    with pytest.raises(CheckpointError, match=message):
        C.import_hf(path, tmp_path / "m", tp=tp, ep=ep)
    assert not (tmp_path / "m").exists()


def test_tp2_values_follow_megatron_semantics(hf_checkpoint):
    """Rank r of TP=2 holds GQA group r ([its 2 q heads, k head, v head]) and [gate_r; up_r]."""
    _, path = hf_checkpoint("qwen2.5-vl", True)
    arch, hf = _load(path)
    full = C.hf_to_megatron(hf, arch)
    src = "model.layers.1."
    d, f = arch.lm.head_dim, arch.lm.intermediate_size
    for rank in range(2):
        state = C.shard(full, arch, 2, rank, 2, 1)  # global layer 1 is stage 1's layer 0
        dst = "language_model.decoder.layers.0."
        for kind in ("weight", "bias"):
            q, k, v = (hf[f"{src}self_attn.{x}_proj.{kind}"] for x in "qkv")
            want = torch.cat([q[rank * 2 * d:(rank + 1) * 2 * d], k[rank * d:(rank + 1) * d], v[rank * d:(rank + 1) * d]])
            assert torch.equal(state[f"{dst}self_attention.linear_qkv.{kind}"], want)
        half = slice(rank * f // 2, (rank + 1) * f // 2)
        want = torch.cat([hf[src + "mlp.gate_proj.weight"][half], hf[src + "mlp.up_proj.weight"][half]])
        assert torch.equal(state[dst + "mlp.linear_fc1.weight"], want)
        assert torch.equal(state[dst + "mlp.linear_fc2.weight"], hf[src + "mlp.down_proj.weight"][:, half])
        assert torch.equal(state[C.OUTPUT], hf["model.embed_tokens.weight"][rank * 75968:(rank + 1) * 75968])


def _tp_worker(rank: int, world: int, port: int, model_dir: str, ids: torch.Tensor, out: str) -> None:
    from train.model.qwen_vl import transformer_config
    from train.parallel import build_model, destroy_parallel, init_parallel

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    info = init_parallel(world, 1, device="cpu")
    arch = read_arch(model_dir)
    model = build_model(arch, transformer_config(arch, tp=world, cpu=True), info).eval()
    C.load_into_model(model, C.load_model_state(model_dir, arch, world, info.tp_rank, 1, 0))
    n = ids.numel()
    with torch.no_grad():
        row = PackedBatch.from_segments(ids, torch.arange(n).expand(3, n), torch.tensor([0, n], dtype=torch.int32))
        logits = model(row, return_logits=True)
    if rank == 0:
        torch.save(logits, out)
    destroy_parallel()


@pytest.mark.parametrize("family", ["qwen3-vl", "qwen3-vl-moe"])
def test_tp2_model_gives_hf_logits(hf_checkpoint, tmp_path, family):
    """Two gloo processes run megatron's TP=2 forward on weights saved at TP=1 (resharded on load)."""
    import torch.multiprocessing as mp

    hf_model, path = hf_checkpoint(family, False)
    C.import_hf(path, tmp_path / "m")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ids = torch.arange(2000, 2012)
    mp.spawn(_tp_worker, args=(2, port, str(tmp_path / "m"), ids, str(tmp_path / "logits.pt")), nprocs=2)
    with torch.no_grad():
        want = hf_model(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), want, rtol=1e-5, atol=1e-5)


def test_model_dir_reshards_on_load(hf_checkpoint, tmp_path):
    _, path = hf_checkpoint("qwen3-vl", False)
    arch, hf = _load(path)
    full = C.hf_to_megatron(hf, arch)
    C.import_hf(path, tmp_path / "m", tp=2, pp=2)
    meta = json.loads((tmp_path / "m" / META_FILE).read_text())
    assert (meta["tp"], meta["pp"], meta["dtype"]) == (2, 2, "float32")
    assert sorted(p.name for p in (tmp_path / "m").glob("*.safetensors")) == sorted(
        rank_file(t, p) for t in range(2) for p in range(2))
    assert (tmp_path / "m" / "hf" / "generation_config.json").is_file()
    assert not list(tmp_path.glob("*.tmp"))
    _assert_same(C.load_model_state(tmp_path / "m", arch), full)  # tp=2/pp=2 -> tp=1/pp=1
    for tp, pp in ((2, 2), (2, 1), (1, 2)):
        for t in range(tp):
            for p in range(pp):
                _assert_same(C.load_model_state(tmp_path / "m", arch, tp, t, pp, p), C.shard(full, arch, tp, t, pp, p))


def _image_logits(model, family: str) -> torch.Tensor:
    """Logits of one image + text sample (runs the vision tower, DeepStack / windows, M-RoPE)."""
    grid, width = ([1, 4, 4], 1536) if family.startswith("qwen3-vl") else ([1, 8, 8], 1176)
    ids = torch.tensor([[1000, 151652] + [151655] * (grid[1] * grid[2] // 4) + [151653, 1001, 1002]])
    pixels = torch.randn(grid[1] * grid[2], width, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids, pixel_values=pixels, image_grid_thw=torch.tensor([grid]),
                     mm_token_type_ids=(ids == 151655).int()).logits


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("family", KINDS)
def test_export_loads_in_transformers(hf_checkpoint, tmp_path, family, tied):
    import transformers

    hf_model, path = hf_checkpoint(family, tied)
    C.import_hf(path, tmp_path / "m", tp=2, pp=2)
    _, side_files = C.export_hf(tmp_path / "m", tmp_path / "hf")
    # the checkpoint's own generation_config.json; the built-in tokenizer and processors for what it lacks
    # (a video processor file where the family's published checkpoints ship one: not Qwen2.5-VL's)
    video = [] if family == "qwen2.5-vl" else ["video_preprocessor_config.json"]
    assert user_entries(tmp_path / "hf") == ["config.json", "generation_config.json", "model.safetensors",
                                             "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json",
                                             *video]
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == \
        json.loads((path / "generation_config.json").read_text())
    assert len(side_files.notes) == 1 and "no chat template" in side_files.notes[0]
    # weight files as readable as the rest (safetensors alone writes them owner-only)
    for directory in (tmp_path / "m", tmp_path / "hf"):
        modes = {p.name: oct(p.stat().st_mode & 0o777) for p in directory.rglob("*") if p.is_file()}
        assert set(modes.values()) == {oct(FILE_MODE)}, modes
    loaded = getattr(transformers, HF_CLASSES[family]).from_pretrained(tmp_path / "hf").eval()
    assert loaded.config.tie_word_embeddings is tied
    _assert_same(loaded.state_dict(), hf_model.state_dict())
    torch.testing.assert_close(_image_logits(loaded, family), _image_logits(hf_model, family), rtol=0, atol=0)
    # the same tensor names as transformers' own save_pretrained (hub names for Qwen2.5-VL)
    assert load_file(str(tmp_path / "hf" / "model.safetensors")).keys() == load_file(str(path / "model.safetensors")).keys()


def test_export_random_init_gets_builtin_tokenizer_and_processor(tmp_path):
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    arch = builtin_arch("tiny")
    torch.manual_seed(0)
    full = {k: torch.randn(s) for k, s in C.megatron_shapes(arch).items()}
    C.save_model_dir(tmp_path / "m", {(0, 0): C.shard(full, arch, 1, 0, 1, 0)}, arch, 1, 1)
    _, files = C.export_hf(tmp_path / "m", tmp_path / "hf")
    assert files.written == ["tokenizer.json", "tokenizer_config.json", "preprocessor_config.json",
                             "video_preprocessor_config.json", "generation_config.json"]
    assert type(AutoConfig.from_pretrained(tmp_path / "hf")).__name__ == "Qwen3VLConfig"
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer("<|im_start|>user<|image_pad|><|im_end|>").input_ids == [151644, 872, 151655, 151645]
    assert tokenizer.eos_token_id == 151645
    processor = AutoImageProcessor.from_pretrained(tmp_path / "hf")
    assert (processor.patch_size, processor.merge_size, processor.temporal_patch_size) == (16, 2, 2)
    _assert_same(C.hf_to_megatron(load_file(str(tmp_path / "hf" / "model.safetensors")), arch), full)


def test_large_hf_checkpoints_are_written_as_indexed_shards(hf_checkpoint, tmp_path):
    _, path = hf_checkpoint("qwen2.5-vl", True)
    _, hf = _load(path)
    names = write_hf_state(tmp_path, hf, max_shard_bytes=8 << 20)
    assert len(names) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    _assert_same(read_hf_state(tmp_path), hf)


# --- errors ---------------------------------------------------------------------------------


def test_errors_name_the_tensor(hf_checkpoint):
    _, path = hf_checkpoint("qwen3-vl", True)
    arch, hf = _load(path)
    name = "model.language_model.layers.3.mlp.up_proj.weight"
    with pytest.raises(CheckpointError, match=rf"missing tensor {name} \(shape \(128, 64\) expected from config.json\)"):
        C.hf_to_megatron({k: v for k, v in hf.items() if k != name}, arch)
    with pytest.raises(CheckpointError, match=rf"^{name}: shape \(64, 64\) expected \(128, 64\) from config.json$"):
        C.hf_to_megatron({**hf, name: torch.zeros(64, 64)}, arch)
    with pytest.raises(CheckpointError, match="unexpected tensor model.language_model.layers.9.mlp.up_proj.weight"):
        C.hf_to_megatron({**hf, name.replace(".3.", ".9."): hf[name]}, arch)
    with pytest.raises(CheckpointError, match=rf"^{name}: dtype int32, where every weight is a floating-point tensor$"):
        C.hf_to_megatron({**hf, name: hf[name].to(torch.int32)}, arch)
    layer = [k for k in hf if ".layers.3." in k]  # several problems: the first three, on one line
    with pytest.raises(CheckpointError) as err:
        C.hf_to_megatron({k: v for k, v in hf.items() if k not in layer}, arch)
    assert "\n" not in str(err.value) and str(err.value).startswith(f"{len(layer)} problems: missing tensor ")
    assert str(err.value).count("missing tensor") == 3 and str(err.value).endswith(f"; and {len(layer) - 3} more")
    with pytest.raises(CheckpointError, match="lm_head.weight differs from .*embed_tokens"):
        C.hf_to_megatron({**hf, "lm_head.weight": torch.zeros_like(hf[C.HF_LM + "embed_tokens.weight"])}, arch)
    full = C.hf_to_megatron({**hf, "lm_head.weight": hf[C.HF_LM + "embed_tokens.weight"]}, arch)  # a tied copy is fine
    with pytest.raises(CheckpointError, match="tp=3 does not divide num_attention_heads = 4"):
        C.shard(full, arch, 3, 0, 1, 0)
    with pytest.raises(CheckpointError, match="cannot split 4 layers over pp=3"):
        C.shard(full, arch, 1, 0, 3, 0)
    with pytest.raises(CheckpointError, match="pp=4 puts 1 layers on the first stage, but DeepStack"):
        C.shard(full, arch, 1, 0, 4, 0)
    with pytest.raises(CheckpointError, match="no state dict for rank tp 1 pp 0"):
        C.unshard({(0, 0): C.shard(full, arch, 2, 0, 1, 0)}, arch, 2, 1)


def test_import_errors(hf_checkpoint, tmp_path):
    _, path = hf_checkpoint("qwen2.5-vl", True)
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((path / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "llava"}))
    with pytest.raises(ValueError, match="unsupported model_type 'llava'"):
        C.import_hf(bad, tmp_path / "out")
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        C.import_hf(bad, tmp_path / "out")
    hf = load_file(str(path / "model.safetensors"))
    save_file({k: v for k, v in hf.items() if k != "model.norm.weight"}, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor model.language_model.norm.weight"):
        C.import_hf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()

    C.import_hf(path, tmp_path / "m")
    with pytest.raises(UserError, match="holds a finished `vlmpack import-hf` output: pass --overwrite"):
        C.import_hf(path, tmp_path / "m")
    other = dataclasses.replace(ModelArch.from_hf_dir(path), image_token_id=7)
    with pytest.raises(CheckpointError, match="another architecture .*image_token_id: 151655 != 7"):
        C.load_model_state(tmp_path / "m", other)


def test_cli(hf_checkpoint, tmp_path, capsys):
    from shards_schema.cli import main

    _, path = hf_checkpoint("qwen2.5-vl", True)
    assert main(["import-hf", str(path), "--out", str(tmp_path / "m"), "--tp", "2"]) == 0
    assert main(["export-hf", str(tmp_path / "m"), "--out", str(tmp_path / "hf"), "--dtype", "bfloat16"]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    _assert_same(exported, {k: v.to(torch.bfloat16) for k, v in load_file(str(path / "model.safetensors")).items()})
    assert main(["import-hf", str(path), "--out", str(tmp_path / "m2"), "--tp", "3"]) == 2
    assert "tp=3 does not divide" in capsys.readouterr().err


def _files(directory) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name != LOCK_NAME}


def test_output_directories_hold_only_their_own_command_output(hf_checkpoint, tmp_path):
    _, path = hf_checkpoint("qwen2.5-vl", True)
    model = tmp_path / "m"
    C.import_hf(path, model, tp=2)
    tp2 = _files(model)
    assert {"model_tp0_pp0.safetensors", "model_tp1_pp0.safetensors", META_FILE} <= tp2
    # --overwrite replaces a finished output of the same command, leaving none of the old files
    C.import_hf(path, model, overwrite=True)
    assert "model_tp1_pp0.safetensors" not in _files(model) and read_arch(model) == ModelArch.from_hf_dir(path)
    # an interrupted run of the same command (no completion file) is replaced without --overwrite
    (model / META_FILE).unlink()
    (model / ".import-hf.tmp").mkdir()
    C.import_hf(path, model, tp=2)
    assert _files(model) == tp2
    # files of anything else are never written over, even with --overwrite: here the HF checkpoint itself
    with pytest.raises(UserError, match="is not the output of `vlmpack export-hf`: choose an empty or new directory"):
        C.export_hf(model, path, overwrite=True)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    for run in (lambda: C.import_hf(path, other, overwrite=True), lambda: C.export_hf(model, other, overwrite=True)):
        with pytest.raises(UserError, match=r"\(notes.txt\) and is not the output of"):
            run()
    assert _files(other) == {"notes.txt"}
    # LoRA adapters are exported by `vlmpack export-hf`: the message names that command
    with pytest.raises(UserError, match=r"not the output of `vlmpack export-hf \(of LoRA adapters, in PEFT's format\)`"):
        C.check_output_dir(other, "export-peft")
    # a job holding --out keeps every other job out of it
    with exclusive_output_dir(tmp_path / "busy", "export-hf"):
        with pytest.raises(UserError, match="is in use by another job"):
            C.export_hf(model, tmp_path / "busy")
    C.export_hf(model, tmp_path / "busy")  # free again
    assert (tmp_path / "busy" / "config.json").is_file() and not (tmp_path / "busy" / ".export-hf.tmp").exists()
    with exclusive_output_dir(tmp_path / "busy-import", "import-hf"):
        with pytest.raises(UserError, match="is in use by another job"):
            C.import_hf(path, tmp_path / "busy-import")
        assert _files(tmp_path / "busy-import") == set()
    C.import_hf(path, tmp_path / "busy-import")
    assert (tmp_path / "busy-import" / META_FILE).is_file()


# Each bad `vlmpack import-hf` / `export-hf` command line ({hf}: a HF checkpoint, {m}: a model
# directory, {f}: a file (not UTF-8 text), {e}: an empty directory, {t}: a fresh temporary directory) and a part
# of its one-line error.
BAD_CONVERT_ARGUMENTS = [
    (["import-hf", "{t}/missing", "--out", "{t}/o"], "HF_DIR {t}/missing: no such directory"),
    (["import-hf", "{e}", "--out", "{t}/o"], "HF_DIR {e} has no config.json"),
    (["import-hf", "{f}", "--out", "{t}/o"], "HF_DIR {f} is a file, not a directory"),
    (["export-hf", "{f}", "--out", "{t}/o"], "MODEL_DIR {f} is a file, not a directory"),
    (["import-hf", "{hf}", "--out", "{t}/o", "--tp", "0"], "--tp must be an integer >= 1, got 0"),
    (["import-hf", "{hf}", "--out", "{t}/o", "--tp", "two"], "argument --tp: invalid int value: 'two'"),
    (["export-hf", "{m}", "--out", "{t}/o", "--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
    (["import-hf", "{hf}", "--out", "{t}/o", "--pp", "-1"], "--pp must be an integer >= 1, got -1"),
    (["import-hf", "{hf}", "--out", "{t}/o", "--tp", "3"], "tp=3 does not divide"),
    (["import-hf", "{hf}", "--out", "{t}/o", "--tp", str(2**40)], f"tp={2**40} does not divide"),
    (["import-hf", "{hf}", "--out", "{t}/o", "--pp", str(2**40)], f"cannot split 2 layers over pp={2**40} stages"),
    (["import-hf", "{hf}", "--out", "{t}/o", "--ep", str(2**40)], f"ep={2**40}: expert parallelism needs a Mixture"),
    (["import-hf", "{hf}", "--out", "{t}/o", "--tp", str(2**70)], f"tp={2**70} does not divide"),
    (["import-hf", "{hf}", "--out", "{f}"], "--out {f} is a file, not a directory"),
    (["import-hf", "{hf}", "--out", "{hf}"], "--out {hf} is the input directory"),
    (["import-hf", "{hf}", "--out", "{hf}/megatron"], "--out {hf}/megatron lies inside the input directory {hf}"),
    (["import-hf", "{hf}", "--out", "{m}"], "--out {m} holds a finished `vlmpack import-hf` output: pass --overwrite"),
    (["export-hf", "{t}/missing", "--out", "{t}/o"], "MODEL_DIR {t}/missing: no such directory"),
    (["export-hf", "{hf}", "--out", "{t}/o"], f"MODEL_DIR {{hf}} has no {META_FILE}"),
    (["export-hf", "{m}", "--out", "{f}"], "--out {f} is a file, not a directory"),
    (["export-hf", "{m}", "--out", "{m}"], "--out {m} is the input directory"),
    (["export-hf", "{m}", "--out", "{m}/hf"], "--out {m}/hf lies inside the input directory {m}"),
    (["export-hf", "{m}", "--out", "{hf}", "--overwrite"], "--out {hf} is not empty"),
    (["export-hf", "{m}", "--out", "{t}/o", "--chat-template", "{t}/missing.jinja"],
     "--chat-template {t}/missing.jinja: no such file"),
    (["export-hf", "{m}", "--out", "{t}/o", "--chat-template", "{e}"], "--chat-template {e} is a directory"),
    (["export-hf", "{m}", "--out", "{t}/o", "--chat-template", "{f}"], "--chat-template {f} is not UTF-8 text"),
    (["export-hf", "{m}", "--out", "{t}/o", "--chat-template", "{t}/fifo"],
     "--chat-template {t}/fifo is not a regular file"),
    (["export-hf", "{m}", "--out", "{t}/o", "--lora-base"], "--lora-base: {m} is not a LoRA checkpoint"),
    (["export-hf", "{m}", "--out", "{t}/o", "--chat-template", "{t}/unclosed.jinja"],
     "--chat-template {t}/unclosed.jinja: not a Jinja template (line 1: Unexpected end of template."),
]


@pytest.mark.parametrize("argv, message", BAD_CONVERT_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_CONVERT_ARGUMENTS])
def test_cli_bad_arguments_exit_2_with_one_line_naming_them(hf_checkpoint, tmp_path_factory, tmp_path, capsys, argv,
                                                            message):
    _, path = hf_checkpoint("qwen2.5-vl", True)
    model = tmp_path_factory.getbasetemp() / "bad-arguments-model"
    if not model.exists():
        C.import_hf(path, model)
    capsys.readouterr()  # what making the checkpoints printed
    (tmp_path / "a_file").write_bytes(b"\xff\xfe x")  # not UTF-8
    (tmp_path / "empty").mkdir()
    os.mkfifo(tmp_path / "fifo")  # reading it would block until a writer comes
    (tmp_path / "unclosed.jinja").write_text("{% for m in messages %}{{ m.content }}")
    paths = {"hf": str(path), "m": str(model), "f": str(tmp_path / "a_file"), "e": str(tmp_path / "empty"),
             "t": str(tmp_path)}
    untouched = {p: _files(p) for p in (path, model)}
    assert vlmpack_exit_code([arg.format(**paths) for arg in argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"vlmpack {argv[0]}: error: "), captured.err
    assert message.format(**paths) in lines[0]
    assert not (tmp_path / "o").exists() and {p: _files(p) for p in (path, model)} == untouched


def test_import_streams_one_tensor_at_a_time(tmp_path, monkeypatch):
    """import-hf reads each checkpoint tensor when its rank file needs it and lets it go once
    written: at no point are the tensors it has read and still holds more than a few times the
    largest one (the whole checkpoint is many times that), and the files equal the in-memory
    conversion."""
    import weakref

    from train import checkpoint_format as fmt

    import transformers

    config = tiny_qwen3_vl_moe_config()  # a small vocabulary and 8 layers: no tensor is a large part of the whole
    config.text_config.vocab_size, config.text_config.num_hidden_layers = 512, 8
    torch.manual_seed(0)
    transformers.Qwen3VLMoeForConditionalGeneration(config).save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf"
    arch, hf = _load(path)
    alive, peak = [], [0]
    real = fmt._read_one

    def read_one(*args):
        tensor = real(*args)
        alive.append((weakref.ref(tensor), tensor.numel() * tensor.element_size()))
        peak[0] = max(peak[0], sum(n for ref, n in alive if ref() is not None))
        return tensor

    monkeypatch.setattr(fmt, "_read_one", read_one)
    C.import_hf(path, tmp_path / "m", tp=2, pp=2)
    largest = max(t.numel() * t.element_size() for t in hf.values())
    total = sum(t.numel() * t.element_size() for t in hf.values())
    assert len(alive) >= len(hf) and 0 < peak[0] <= 3 * largest < total / 2
    full = C.hf_to_megatron(hf, arch)
    for t in range(2):
        for p in range(2):
            _assert_same(load_file(str(tmp_path / "m" / rank_file(t, p))), C.shard(full, arch, 2, t, 2, p))


def test_streaming_safetensors_writer(tmp_path):
    from train.checkpoint_format import save_tensors_streaming

    tensors = {"a": torch.randn(3, 5).to(torch.bfloat16), "b": torch.arange(7), "c": torch.randn(2, 4).t()}
    entries = [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    save_tensors_streaming(tmp_path / "x.safetensors", entries, iter(tensors.values()))
    _assert_same(load_file(str(tmp_path / "x.safetensors")), {k: v.contiguous() for k, v in tensors.items()})
    with pytest.raises(CheckpointError, match="b is"):
        save_tensors_streaming(tmp_path / "y.safetensors", entries, iter([tensors["a"], tensors["a"], tensors["c"]]))


@pytest.mark.parametrize("change, says", [
    (dict(num_kv_heads=3), "num_heads 4 must be a multiple of num_kv_heads 3"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok 9 must be between 1 and num_experts 8"),
    (dict(mrope_section=[4, 4]), "mrope_section [4, 4] must list 3 sections"),
])
def test_a_model_directory_whose_architecture_cannot_be_built_is_refused_by_field(tmp_path, change, says):
    arch = builtin_arch("tiny-moe")
    write_meta(tmp_path, dataclasses.replace(arch, lm=dataclasses.replace(arch.lm, **change)), 1, 1, "bf16")
    with pytest.raises(ValueError) as err:
        read_arch(tmp_path)
    assert says in str(err.value) and META_FILE in str(err.value), str(err.value)
