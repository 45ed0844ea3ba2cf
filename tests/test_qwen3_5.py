"""Qwen3.5 / Qwen3.6 on the training side (`train.model.families.qwen3_5`) against transformers'
`Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration` (CPU, fp32, tiny).

- Architectures: every vendored published config.json is a built-in --arch whose HF tensors
  and parameter count are those of transformers' model built from the file on the meta device;
  configs the model cannot build are refused by field name.
- The model: each sample of a pack (text, images, video; padded rows between and after them)
  gets the logits and losses of HF's model run on that sample alone, dense and MoE; a pack
  equals its samples run one by one through our model (the packing is exact); gradients are
  HF's.
- Conversion: import-hf / export-hf round trip bit for bit at TP / PP / EP layouts with the
  multi-token-prediction tensors carried; exports load in transformers with the same logits.
- LoRA / DoRA on every linear (the Gated DeltaNet's projections included): exported in PEFT's
  format, loaded by PEFT onto HF's model, our logits and gradients.
- TP=2, PP=2, TP=2 x EP=2 and LoRA at TP=2 (two gloo processes) equal one process; the memory
  plan counts each rank's parameters and plans the published sizes.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shards_schema.pixels import pixel_values_from_patches, video_pixel_values_from_patches
from tests.helpers.models import QWEN3_5_IDS, tiny_qwen3_5, tiny_qwen3_5_config
from train import convert, memory_plan
from train.model import lora
from train.model.arch import ModelArch, builtin_arch
from train.model.families import qwen3_5
from train.model.qwen_vl import transformer_config
from train.model.batch import PackedBatch
from train.packed_batch import IGNORE_INDEX, assemble_pack
from train.parallel import build_model, destroy_parallel, init_parallel

TOLERANCE = 1e-4
IM_START, IM_END, PAD = 248045, 248046, 248044
MEAN = STD = (0.5, 0.5, 0.5)
PATCH = 3 * 16 * 16  # one stored frame of a 16 x 16 patch

# The parameters of the published checkpoints (transformers' model on the meta device; the
# multi-token-prediction layer is in the checkpoints, not in that model, and not counted).
PUBLISHED_PARAMS = {
    "qwen3.5-0.8b": 852_985_920, "qwen3.5-2b": 2_213_241_664, "qwen3.5-4b": 4_539_265_536,
    "qwen3.5-9b": 9_409_813_744, "qwen3.5-27b": 27_356_728_560, "qwen3.5-35b-a3b": 35_107_181_936,
    "qwen3.5-122b-a10b": 122_562_817_776, "qwen3.5-397b-a17b": 396_802_360_816,
    "qwen3.6-27b": 27_356_728_560, "qwen3.6-35b-a3b": 35_107_181_936,
}


# --- architectures ------------------------------------------------------------------------------


def _hf_meta_model(config: dict):
    import transformers

    config_class = transformers.Qwen3_5MoeConfig if config["model_type"] == "qwen3_5_moe" else transformers.Qwen3_5Config
    model_class = getattr(transformers, config["architectures"][0])
    with torch.device("meta"):
        return model_class(config_class(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")}))


def test_every_published_config_is_a_builtin_arch():
    files = sorted(qwen3_5.CONFIGS_DIR.glob("*.json"))
    assert {qwen3_5.preset_name(f) for f in files} == set(PUBLISHED_PARAMS)
    for name in PUBLISHED_PARAMS:
        assert builtin_arch(name).family == "qwen3.5"


@pytest.mark.parametrize("size", ["27b", "35b-a3b"])
def test_qwen3_6_builds_the_qwen3_5_model_of_its_size(size):
    """Qwen3.6's published configs differ from Qwen3.5's of the same size in layout and
    metadata only: the same architecture, hence the same model."""
    assert builtin_arch(f"qwen3.6-{size}") == builtin_arch(f"qwen3.5-{size}")


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_builtin_arch_is_the_transformers_model_of_its_config(name):
    """The arch of the vendored config.json: our HF tensor table is transformers' model's (its
    expert stacks read as the checkpoints' one tensor per expert), our Megatron model holds
    exactly its parameters, and what we write back reads as the same arch."""
    path = next(p for p in qwen3_5.CONFIGS_DIR.glob("*.json") if qwen3_5.preset_name(p) == name)
    config = json.loads(path.read_text())
    arch = builtin_arch(name)
    assert ModelArch.from_hf_config(config) == arch
    assert ModelArch.from_hf_config(arch.to_hf_config()) == arch
    model = _hf_meta_model(config)
    state = qwen3_5.hf_checkpoint_layout({k: torch.empty(v.shape, device="meta")
                                          for k, v in model.state_dict().items()}, arch)
    if arch.lm.tie_word_embeddings:
        state.pop(convert.HF_LM_HEAD, None)
    assert {k: tuple(v.shape) for k, v in state.items()} == convert.hf_shapes(arch)
    total = sum(p.numel() for p in model.parameters())
    assert total == PUBLISHED_PARAMS[name]
    assert sum(int(np.prod(s)) for s in convert.megatron_shapes(arch).values()) == total
    vision = sum(p.numel() for p in model.model.visual.parameters())
    assert arch.lm.num_params() == pytest.approx(total - vision, rel=1e-3)
    if arch.lm.is_moe:  # the active parameters: the "A3B" of the name, within 10 %
        active = float(name.rsplit("-a", 1)[1].removesuffix("b"))
        assert arch.lm.num_non_embedding_params() / 1e9 == pytest.approx(active, rel=0.1)


@pytest.mark.parametrize("moe", [False, True])
def test_tiny_archs_are_the_test_models(moe):
    assert ModelArch.from_hf_config(tiny_qwen3_5_config(moe).to_dict()) == \
        builtin_arch("tiny-qwen3.5-moe" if moe else "tiny-qwen3.5")


@pytest.mark.parametrize("change, message", [
    (dict(hidden_act="gelu"), "text_config.hidden_act 'gelu'"),
    (dict(attention_bias=True), "text_config.attention_bias"),
    (dict(layer_types=["linear_attention", "sliding_attention"] * 2), r"text_config.layer_types has \['sliding_attention'\]"),
    (dict(layer_types=["full_attention"] * 3), "layer_types lists 3 layers, num_hidden_layers is 4"),
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e7, partial_rotary_factor=0.25)), "rope_type 'yarn'"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads 3 must be a multiple of linear_num_key_heads 2"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.5, mrope_section=[2, 1, 1])),
     r"mrope_section \[2, 1, 1\] must sum to the rotary dims / 2 = 8"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=2.0)),
     r"partial_rotary_factor 2.0 must be in \(0, 1\]: the share of each attention head's dims M-RoPE rotates"),
    (dict(mlp_only_layers=[1]), "mlp_only_layers"),
    (dict(output_gate_type="sigmoid"), "text_config.output_gate_type 'sigmoid'"),
])
def test_configs_the_model_cannot_build_are_refused_by_name(change, message):
    config = builtin_arch("tiny-qwen3.5-moe").to_hf_config()
    config["text_config"].update(change)
    with pytest.raises(ValueError, match=message):
        ModelArch.from_hf_config(config)


def test_a_config_without_its_text_config_is_named_so():
    config = builtin_arch("tiny-qwen3.5").to_hf_config()
    text = config.pop("text_config")
    with pytest.raises(ValueError, match="config.json text_config is missing: a Qwen3.5 config needs it"):
        ModelArch.from_hf_config(config)
    text.pop("model_type")  # its fields at the top level, as a flat (Qwen2.5-VL style) config has them
    with pytest.raises(ValueError, match="config.json text_config is missing"):
        ModelArch.from_hf_config({**text, **config})


@pytest.mark.parametrize("change, message", [
    (dict(layer_types=["linear_attention"] * 3), "layer_types lists 3 layers, num_layers is 4"),
    (dict(layer_types=["linear_attention"] * 3 + ["sliding_attention"]), r"layer_types has \['sliding_attention'\]"),
    (dict(layer_types="linear_attention"), "layer_types must be a list of one type per layer"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads 3 must be a multiple of linear_num_key_heads 2"),
    (dict(partial_rotary_factor=0.5), r"mrope_section \[2, 1, 1\] must sum to the rotated dims / 2 = 8"),
])
def test_a_model_directory_whose_architecture_cannot_build_is_refused_by_name(tmp_path, change, message):
    """vlmpack_model.json is checked as config.json is: a hand-edited hybrid layout or rotary is
    named where the file is read (it was an IndexError or a ValueError deep in the model)."""
    from train.checkpoint_format import META_FILE, meta_arch
    from train.model.arch import ModelFileError, arch_dict

    d = arch_dict(builtin_arch("tiny-qwen3.5"))
    d["lm"].update(change)
    with pytest.raises(ModelFileError, match=f"{META_FILE}: the language model's {message}"):
        meta_arch(json.loads(json.dumps({"arch": d})), tmp_path)


# --- samples ------------------------------------------------------------------------------------


def make_sample(hf, seed: int, images=(), videos=(), text: int = 12) -> dict:
    """One sample as the shards hold it (`open_shards(DIR)[i]`): tokens, targets, HF's M-RoPE
    positions, uint8 patches. `images`: (h, w) grids in patches; `videos`: (t, h, w), each of
    the t temporal patches a frame group between timestamp-like text, as the Qwen3.5 processor
    writes them."""
    rng = np.random.default_rng(seed)
    words = lambda n: list(rng.integers(1000, 100_000, n))  # noqa: E731
    ids, pixel, video, image_grids, video_grids = [IM_START] + words(text), [], [], [], []
    for h, w in images:
        ids += [QWEN3_5_IDS["vision_start_token_id"]] + [QWEN3_5_IDS["image_token_id"]] * (h * w // 4)
        ids += [QWEN3_5_IDS["vision_end_token_id"]] + words(3)
        image_grids.append([1, h, w])
        pixel.append(rng.integers(0, 256, (h * w, PATCH), dtype=np.uint8))
    for t, h, w in videos:
        for _ in range(t):
            ids += words(2) + [QWEN3_5_IDS["vision_start_token_id"]] + [QWEN3_5_IDS["video_token_id"]] * (h * w // 4)
            ids += [QWEN3_5_IDS["vision_end_token_id"]]
        video_grids.append([t, h, w])
        video.append(rng.integers(0, 256, (t * h * w, 2 * PATCH), dtype=np.uint8))
    ids += words(text) + [IM_END]
    ids = np.array(ids, dtype=np.int64)
    loss_mask = np.zeros(len(ids), dtype=np.uint8)
    text_rows = np.flatnonzero(ids < 200_000)
    loss_mask[text_rows[len(text_rows) // 2:]] = 1  # the answer: the last half of the text tokens
    image_grids = np.array(image_grids, dtype=np.int32).reshape(-1, 3)
    video_grids = np.array(video_grids, dtype=np.int32).reshape(-1, 3)
    with torch.no_grad():
        positions, _ = hf.model.get_rope_index(
            torch.from_numpy(ids)[None], mm_token_type_ids=torch.from_numpy(_mm_types(ids))[None],
            image_grid_thw=torch.from_numpy(image_grids).long() if len(image_grids) else None,
            video_grid_thw=torch.from_numpy(video_grids).long() if len(video_grids) else None)
    return {"input_ids": ids, "loss_mask": loss_mask, "position_ids": positions[:, 0].numpy().astype(np.int32),
            "pixel_patches": np.concatenate(pixel) if pixel else np.zeros((0, PATCH), np.uint8),
            "image_grid_thw": image_grids,
            "video_patches": np.concatenate(video) if video else np.zeros((0, 2 * PATCH), np.uint8),
            "video_grid_thw": video_grids, "sample_uid": f"sample-{seed}"}


def _mm_types(ids: np.ndarray) -> np.ndarray:
    return ((ids == QWEN3_5_IDS["image_token_id"]) + 2 * (ids == QWEN3_5_IDS["video_token_id"])).astype(np.int64)


def visual_inputs(batch: dict | PackedBatch) -> dict:
    """pixel_values / image_grid_thw / pixel_values_videos / video_grid_thw of a sample or pack (torch)."""
    field = batch.__getitem__ if isinstance(batch, dict) else lambda name: getattr(batch, name)
    out = {}
    if len(field("image_grid_thw")):
        out.update(pixel_values=pixel_values_from_patches(torch.from_numpy(field("pixel_patches")), MEAN, STD, 16, 2),
                   image_grid_thw=torch.from_numpy(field("image_grid_thw")).long())
    if len(field("video_grid_thw")):
        out.update(pixel_values_videos=video_pixel_values_from_patches(torch.from_numpy(field("video_patches")), MEAN,
                                                                       STD),
                   video_grid_thw=torch.from_numpy(field("video_grid_thw")).long())
    return out


def pixel_inputs(pack: PackedBatch) -> dict:
    """Our model's inputs besides the pack: the vision tower's pixel values (the grids are the pack's)."""
    return {k: v for k, v in visual_inputs(pack).items() if k in ("pixel_values", "pixel_values_videos")}


def hf_alone(hf, sample: dict, device: str = "cpu") -> torch.Tensor:
    """HF's logits [L, V] (on the CPU) for one sample on its own: HF computes its positions
    itself. `hf` is on `device`."""
    ids = torch.from_numpy(sample["input_ids"])[None].to(device)
    hf.model.rope_deltas = None
    with torch.no_grad():
        return hf(input_ids=ids, mm_token_type_ids=torch.from_numpy(_mm_types(sample["input_ids"]))[None].to(device),
                  use_cache=False, **{k: v.to(device) for k, v in visual_inputs(sample).items()}).logits[0].cpu()


def our_pack(model, pack: PackedBatch, logits: bool = True) -> torch.Tensor:
    """Our model on one pack: logits [T, V] (or the per-token losses [T])."""
    with torch.no_grad():
        return model(pack.as_tensors(), return_logits=logits, **pixel_inputs(pack))


def sample_rows(pack: PackedBatch) -> list[np.ndarray]:
    return [np.arange(s, s + n) for s, n in zip(pack.cu_seqlens_padded[:-1], pack.sample_lengths)]


def make_pack(samples: list[dict], **kwargs) -> PackedBatch:
    return assemble_pack(samples, pad_token_id=PAD, **{"pad_to_multiple": 8, **kwargs})


def samples_of(hf) -> list[dict]:
    """Text only; two images of different shapes; a video of two frame groups and an image."""
    return [make_sample(hf, 1), make_sample(hf, 3, images=[(4, 4), (2, 8)]),
            make_sample(hf, 4, videos=[(2, 4, 4)], images=[(6, 4)])]


# --- the model ----------------------------------------------------------------------------------


def megatron_model(hf, arch, info):
    model = build_model(arch, transformer_config(arch, cpu=True), info).eval()
    convert.load_into_model(model, convert.shard(convert.hf_to_megatron(hf.state_dict(), arch), arch, 1, 0, 1, 0))
    return model


@pytest.fixture(scope="module", params=["dense", "moe"])
def case(request, info):
    hf = tiny_qwen3_5(moe=request.param == "moe")
    arch = ModelArch.from_hf_config(hf.config.to_dict())
    return request.param, hf, arch, megatron_model(hf, arch, info)


def test_each_packed_sample_equals_hf_on_that_sample_alone(case):
    """Logits and per-token losses of every sample of a pack (padding between the samples and
    after them) within 1e-4 of HF's model run on the sample alone, with images and video."""
    kind, hf, _, model = case
    samples = samples_of(hf)
    pack = make_pack(samples, seq_len=sum(-(-len(s["input_ids"]) // 8) * 8 for s in samples) + 13)
    logits, losses = our_pack(model, pack), our_pack(model, pack, logits=False)
    labels = torch.from_numpy(pack.labels)
    worst_logit = worst_loss = 0.0
    for sample, rows in zip(samples, sample_rows(pack)):
        ref = hf_alone(hf, sample)
        worst_logit = max(worst_logit, (logits[rows] - ref).abs().max().item())
        keep = labels[rows] != IGNORE_INDEX
        assert keep.any()
        ref_losses = F.cross_entropy(ref[keep], labels[rows][keep], reduction="none")
        worst_loss = max(worst_loss, (losses[rows][keep] - ref_losses).abs().max().item())
    assert worst_logit < TOLERANCE and worst_loss < TOLERANCE, (kind, worst_logit, worst_loss)
    assert torch.all(losses[labels == IGNORE_INDEX] == 0)
    print(f"\n{kind}: max |logit diff| {worst_logit:.2e}, max |loss diff| {worst_loss:.2e}")


def test_a_pack_equals_its_samples_alone(case):
    """The packing is exact: each sample's rows of a pack equal our model on that sample alone
    (Gated DeltaNet state and conv window, attention and positions restart per sample)."""
    _, hf, _, model = case
    samples = samples_of(hf)
    pack = make_pack(samples)
    logits = our_pack(model, pack)
    worst = max((logits[rows] - our_pack(model, make_pack([sample], pad_to_multiple=1))).abs().max().item()
                for sample, rows in zip(samples, sample_rows(pack)))
    assert worst < 1e-5, worst


def test_gradients_equal_hfs(case, info):
    """Backward through the hybrid decoder (Gated DeltaNet, gated attention, zero-centred norms,
    the shared expert): every parameter's gradient of a sample's summed loss equals HF's, read
    through the weight table (its transforms are reshapes and permutations, so they carry
    gradients as they carry weights), to 1e-4 of the larger of its own largest value and a
    hundredth of the model's largest gradient. (A_log's and dt_bias' gradients are sums that
    cancel to a few 1e-4 of their terms: there fp32 itself, HF's as ours, is off by 1e-4 to 1e-3
    of the value, measured against HF in float64.)"""
    kind, hf, arch, _ = case
    model = megatron_model(hf, arch, info).train()
    sample = samples_of(hf)[2]  # video and image
    pack = make_pack([sample], pad_to_multiple=1)
    labels = torch.from_numpy(pack.labels)
    keep = labels != IGNORE_INDEX
    hf.train()
    hf.zero_grad(set_to_none=True)
    try:
        hf.model.rope_deltas = None
        logits = hf(input_ids=torch.from_numpy(sample["input_ids"])[None],
                    mm_token_type_ids=torch.from_numpy(_mm_types(sample["input_ids"]))[None], use_cache=False,
                    **visual_inputs(sample)).logits[0]
        F.cross_entropy(logits[keep], labels[keep], reduction="sum").backward()
        hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    finally:
        hf.eval()
    want = convert.hf_to_megatron(qwen3_5.hf_checkpoint_layout(hf_grads, arch), arch)
    model(pack.as_tensors(), **pixel_inputs(pack)).sum().backward()
    got = {n: p.grad for n, p in model.named_parameters()}
    assert got.keys() == {n for n in want if n != convert.OUTPUT or not arch.lm.tie_word_embeddings}
    floor = 0.01 * max(g.abs().max().item() for g in got.values())
    worst = {n: ((got[n] - want[n]).abs().max() / max(want[n].abs().max().item(), floor)).item() for n in got}
    assert max(worst.values()) < 1e-4, sorted(worst.items(), key=lambda kv: -kv[1])[:3]


# --- conversion ---------------------------------------------------------------------------------

MTP = {"mtp.fc.weight": (64, 128), "mtp.pre_fc_norm_hidden.weight": (64,), "mtp.layers.0.mlp.gate_proj.weight": (128, 64),
       "mtp.norm.weight": (64,)}


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """kind -> (HF model, its save_pretrained directory with a multi-token-prediction layer's
    tensors added in bf16, as the published checkpoints carry them, and mtp_num_hidden_layers 1)."""
    from safetensors.torch import load_file, save_file

    made = {}
    for kind in ("dense", "moe"):
        hf = tiny_qwen3_5(moe=kind == "moe")
        path = tmp_path_factory.mktemp(f"hf-qwen3.5-{kind}")
        hf.save_pretrained(path)
        state = load_file(str(path / "model.safetensors"))
        generator = torch.Generator().manual_seed(7)
        state |= {k: torch.randn(s, generator=generator).to(torch.bfloat16) for k, s in MTP.items()}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((path / "config.json").read_text())
        config["text_config"]["mtp_num_hidden_layers"] = 1
        (path / "config.json").write_text(json.dumps(config))
        made[kind] = hf, path
    return made


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert value.dtype == b[key].dtype and torch.equal(value, b[key]), key


@pytest.mark.parametrize("kind, tp, pp, ep", [("dense", 2, 2, 1), ("moe", 2, 2, 2), ("moe", 1, 1, 2)])
def test_import_export_round_trip_is_bit_exact(hf_checkpoint, tmp_path, kind, tp, pp, ep):
    """import-hf at a TP x PP x EP layout, export-hf: the published tensor names (experts one by
    one) and every bit, the multi-token-prediction tensors carried through untouched."""
    from safetensors.torch import load_file

    _, path = hf_checkpoint[kind]
    convert.import_hf(path, tmp_path / "m", tp=tp, pp=pp, ep=ep)
    assert (tmp_path / "m" / "hf_carried.safetensors").is_file()
    _, side_files = convert.export_hf(tmp_path / "m", tmp_path / "hf")
    assert not any("multi-token" in note for note in side_files.notes)
    exported, original = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(path / "model.safetensors"))
    _assert_same(exported, original)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["text_config"]["mtp_num_hidden_layers"] == 1
    assert ModelArch.from_hf_config(config) == ModelArch.from_hf_dir(path)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_export_loads_in_transformers_with_the_same_logits(hf_checkpoint, tmp_path, kind):
    import transformers

    hf, path = hf_checkpoint[kind]
    convert.import_hf(path, tmp_path / "m", tp=2)
    convert.export_hf(tmp_path / "m", tmp_path / "hf")
    loaded = getattr(transformers, ModelArch.from_hf_dir(path).hf_architecture).from_pretrained(tmp_path / "hf").eval()
    _assert_same(loaded.state_dict(), hf.state_dict())
    sample = samples_of(hf)[2]
    # bitwise the same weights (above); transformers may run a model loaded from disk through
    # another experts kernel than one built in memory, whose fp32 sums round differently on some CPUs
    torch.testing.assert_close(hf_alone(loaded, sample), hf_alone(hf, sample), rtol=0, atol=1e-5)


def test_a_multi_token_prediction_tensor_of_integers_is_refused_naming_it(hf_checkpoint, tmp_path, capsys):
    """The carried tensors are weights as the model's are: an integer one (another file's
    tensor) is named before anything is written, by import-hf and by a run's setup."""
    from safetensors.torch import load_file, save_file

    from shards_schema.cli import main as vlmpack
    from tests.helpers.damage import damaged_copy, one_error_line

    _, intact = hf_checkpoint["dense"]
    state = load_file(str(intact / "model.safetensors"))
    state["mtp.fc.weight"] = state["mtp.fc.weight"].to(torch.int32)
    source = damaged_copy(intact, tmp_path / "hf", "config.json", lambda raw: raw)
    (source / "model.safetensors").unlink()
    save_file(state, str(source / "model.safetensors"))
    says = f"{source}: mtp.fc.weight is int32, where every weight is a floating-point tensor"
    for command in (["import-hf", str(source), "--out", str(tmp_path / "out")],
                    ["train", "--dry-run", "--hf-model", str(source)]):
        assert vlmpack(command) == 2
        assert says in one_error_line(capsys.readouterr().err, command[0])
    assert not (tmp_path / "out").exists()


def test_linear_attention_shards_are_the_gated_delta_net_tables(hf_checkpoint):
    """TP rank r of a Gated DeltaNet layer holds what the layer's own weight table gives rank r
    (`gated_delta_net.hf_to_rank`); shard -> unshard is exact at every TP x PP x EP layout."""
    from safetensors.torch import load_file

    from train.model import gated_delta_net as gdn

    _, path = hf_checkpoint["moe"]
    arch = ModelArch.from_hf_dir(path)
    hf = load_file(str(path / "model.safetensors"))
    full = convert.hf_to_megatron(hf, arch)
    layer = {k.removeprefix("model.language_model.layers.1."): v for k, v in hf.items()
             if k.startswith("model.language_model.layers.1.linear_attn.")}
    for rank in range(2):
        state = convert.shard(full, arch, 2, rank, 2, 0)
        want = gdn.hf_to_rank(layer, gdn.GatedDeltaNetDims.from_lm(arch.lm), 2, rank)
        for param, tensor in want.items():
            assert torch.equal(state[f"language_model.decoder.layers.1.self_attention.{param}"], tensor), param
    for tp, pp, ep in [(2, 1, 1), (1, 2, 2), (2, 2, 4)]:
        states = {key: convert.shard(full, arch, tp, key[0], pp, key[1], ep, key[2] if ep > 1 else 0)
                  for key in convert.rank_keys(tp, pp, ep)}
        _assert_same(convert.unshard(states, arch, tp, pp, ep), full)


def test_transformers_in_memory_experts_read_as_the_checkpoints(hf_checkpoint):
    """A state dict in transformers' in-memory layout (expert stacks) converts to the same weights
    as the checkpoint's one tensor per expert."""
    from safetensors.torch import load_file

    hf, path = hf_checkpoint["moe"]
    arch = ModelArch.from_hf_dir(path)
    saved = {k: v for k, v in load_file(str(path / "model.safetensors")).items() if not k.startswith("mtp.")}
    assert any(".experts.gate_up_proj" in k for k in hf.state_dict())
    _assert_same(convert.hf_to_megatron(hf.state_dict(), arch), convert.hf_to_megatron(saved, arch))


def test_random_init_exports_a_model_transformers_loads(tmp_path):
    """--arch qwen3.5 random weights (zero-centred norms at 0, the Gated DeltaNet's A_log and dt_bias
    as HF draws them) export with no MTP layers claimed and the built-in Qwen3.5 tokenizer, and load
    in transformers."""
    import transformers

    from shards_schema.builtin import builtin_tokenizer_json
    from train.model_setup import random_full_state

    arch = dataclasses.replace(builtin_arch("tiny-qwen3.5"), lm=dataclasses.replace(
        builtin_arch("tiny-qwen3.5").lm, mtp_num_hidden_layers=1))
    full = random_full_state(arch, seed=3)
    assert torch.all(full["language_model.decoder.layers.3.self_attention.q_layernorm.weight"] == 0)
    assert torch.all(full["language_model.decoder.layers.0.self_attention.dt_bias"] == 1)
    a = full["language_model.decoder.layers.0.self_attention.A_log"].exp()
    assert torch.all((a >= 0.01) & (a <= 16))
    convert.save_model_dir(tmp_path / "m", {(0, 0): convert.shard(full, arch, 1, 0, 1, 0)}, arch, 1, 1)
    _, side_files = convert.export_hf(tmp_path / "m", tmp_path / "hf")
    assert any("no multi-token-prediction weights" in note for note in side_files.notes)
    assert not any("tokenizer" in note for note in side_files.notes)  # the built-in Qwen3.5 tokenizer is written
    assert (tmp_path / "hf" / "tokenizer.json").read_text(encoding="utf-8") == builtin_tokenizer_json("qwen3.5")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["text_config"]["mtp_num_hidden_layers"] == 0
    assert json.loads((tmp_path / "hf" / "preprocessor_config.json").read_text())["processor_class"] == "Qwen3VLProcessor"
    loaded = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path / "hf")
    assert torch.equal(loaded.model.language_model.layers[0].linear_attn.A_log, a.log())


# --- LoRA ---------------------------------------------------------------------------------------

# every linear of the language model (gated q_proj, the Gated DeltaNet's in_proj_qkv/z/b/a and
# out_proj, the MLP or the shared expert) and of the vision tower; DoRA on the dense model
LORA_SPECS = {"dense": lora.LoraSpec(rank=4, alpha=8, parts=("llm", "vision", "merger"), dora=True),
              "moe": lora.LoraSpec(rank=4, alpha=8)}


def random_adapters(arch: ModelArch, spec: lora.LoraSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """A full adapter state in PEFT's names with every tensor non-zero (DoRA magnitudes near 1)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = lora.adapter_shapes(lora.resolve_sites(arch, spec), spec.rank, spec.dora)
    return {k: (1 + 0.3 * torch.rand(s, generator=generator)) if k.endswith(lora.MAGNITUDE)
            else 0.1 * torch.randn(s, generator=generator) for k, s in shapes.items()}


def test_lora_exports_load_in_peft_with_our_logits_and_gradients(case, info, tmp_path):
    """Our adapters, exported in PEFT's format and loaded by PEFT onto HF's model, adapt exactly
    our sites and give, on each sample of a pack, our logits there (HF run on the sample
    alone); their gradients equal PEFT's to 3e-4 of the largest (the vision merger's, whose
    gradient comes back through every decoder layer: PEFT's own fp32 gradient there is 5e-5 of
    the largest off its float64 value)."""
    import peft

    from train import adapter_format

    kind, hf_base, arch, _ = case
    spec = LORA_SPECS[kind]
    adapters = random_adapters(arch, spec)
    adapter_format.write_peft_dir(tmp_path, spec, arch, adapters, None)
    pm = peft.PeftModel.from_pretrained(tiny_qwen3_5(moe=kind == "moe"), tmp_path, is_trainable=True).eval()
    sites = lora.resolve_sites(arch, spec)
    assert {n for n, m in pm.base_model.model.named_modules() if hasattr(m, "lora_A")} == {s.module for s in sites}
    assert any("linear_attn.in_proj_qkv" in s.module for s in sites) and any("q_proj" in s.module for s in sites)
    model = megatron_model(hf_base, arch, info)
    attached = lora.attach(model, arch, spec, 1, range(arch.lm.num_layers))
    attached.load_state_dict(adapters)
    samples = samples_of(hf_base)[1:]
    pack = make_pack(samples)
    logits = our_pack(model, pack)
    worst = max((logits[rows] - hf_alone(pm, sample)).abs().max().item()
                for sample, rows in zip(samples, sample_rows(pack)))
    assert worst < TOLERANCE, worst
    assert (logits - our_pack(megatron_model(hf_base, arch, info), pack)).abs().max() > 1e3 * TOLERANCE

    sample = samples[1]
    single = make_pack([sample], pad_to_multiple=1)
    labels = torch.from_numpy(single.labels)
    keep = labels != IGNORE_INDEX
    pm.train()
    pm.base_model.model.model.rope_deltas = None
    ref = pm(input_ids=torch.from_numpy(sample["input_ids"])[None], use_cache=False,
             mm_token_type_ids=torch.from_numpy(_mm_types(sample["input_ids"]))[None], **visual_inputs(sample)).logits[0]
    F.cross_entropy(ref[keep], labels[keep], reduction="sum").backward()
    want = {k.replace(".default", "").removesuffix(".weight") if lora.MAGNITUDE in k else k.replace(".default", ""): p.grad
            for k, p in pm.named_parameters() if p.requires_grad}
    model(single.as_tensors(), **pixel_inputs(single)).sum().backward()
    assert set(want) == set(attached.params)
    scale = max(g.abs().max().item() for g in want.values())
    for key, param in attached.params.items():
        assert (param.grad - want[key]).abs().max().item() < 3e-4 * scale, key


# --- tensor, pipeline and expert parallelism ------------------------------------------------------


def _forward_backward(model, pack: PackedBatch, pp: int, pp_rank: int) -> torch.Tensor | None:
    """Logits (last stage; None elsewhere), then the summed loss's backward, through `pp` stages
    handing their activations and gradients on with send / recv (gloo)."""
    import torch.distributed as dist

    batch, pixels = pack.as_tensors(), pixel_inputs(pack)
    rows, hidden = len(pack.input_ids), model.config.hidden_size
    if pp_rank > 0:
        received = torch.empty(rows, 1, hidden)
        dist.recv(received, pp_rank - 1)
        received.requires_grad_()
        model.set_input_tensor(received)
    if pp_rank < pp - 1:
        out = model(batch, **pixels)
        dist.send(out.detach(), pp_rank + 1)
        grad = torch.empty_like(out)
        dist.recv(grad, pp_rank + 1)
        out.backward(grad)
        logits = None
    else:
        with torch.no_grad():
            logits = model(batch, return_logits=True, **pixels)
        if pp_rank > 0:
            model.set_input_tensor(received)
        model(batch, **pixels).sum().backward()
    if pp_rank > 0:
        dist.send(received.grad, pp_rank - 1)
    return logits


def _parallel_worker(rank: int, world: int, port: int, hf_dirs: dict, pack: PackedBatch, layouts: list, adapters: dict,
                     out: str) -> None:
    """One process of each layout in turn: the model built at (tp, pp, ep, sequence parallel),
    with `adapters[kind]`'s LoRA adapters where the layout says so, from the HF checkpoint, run
    forward and backward on `pack`, against the same model built whole in this process (TP = PP
    = EP = 1). Saves, per layout, the largest logit difference and the largest difference of
    this rank's gradients (the adapters' where it has them) relative to the model's largest; a
    gradient that megatron's `finalize_model_grads` sums over the TP ranks (norms and adapters
    held whole under sequence parallelism, q/k norms) is summed here too. Under EP an expert sees
    the tokens of every rank of its expert-parallel group: each TP rank's slice of the rows under
    sequence parallelism, each data-parallel rank's copy of the pack (there, twice the gradient)."""
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state

    from train.checkpoint_format import lazy_hf_state

    def run(kind, tp, pp, ep, sequence_parallel, adapted):
        info = init_parallel(tp, pp, ep=ep, device="cpu")
        arch = ModelArch.from_hf_dir(hf_dirs[kind])
        config = transformer_config(arch, tp=tp, pp=pp, ep=ep, cpu=True, sequence_parallel=sequence_parallel)
        model = build_model(arch, config, info)
        full = convert.hf_to_megatron(lazy_hf_state(hf_dirs[kind]), arch)
        convert.load_into_model(model, convert.shard(full, arch, tp, info.tp_rank, pp, info.pp_rank, ep, info.ep_rank))
        layers = convert.stage_layers(arch, pp)[info.pp_rank]
        plan = memory_plan.plan_stage(arch, memory_plan.Settings(seq_len=len(pack.input_ids)),
                                      memory_plan.Layout(tp=tp, pp=pp, dp=world // (tp * pp), ep=ep), info.pp_rank)
        params = sum(p.numel() for p in model.parameters()) == plan.params
        if adapted:
            spec, state = adapters[kind]
            attached = lora.attach(model, arch, spec, tp, layers)
            sites = lora.resolve_sites(arch, spec)
            attached.load_state_dict(lora.shard_adapters(state, sites, tp, info.tp_rank, layers, info.first_stage))
        logits = _forward_backward(model, pack, pp, info.pp_rank)
        grads = {}
        for name, param in model.named_parameters():
            grad = param.grad
            if grad is not None and tp > 1 and ((config.sequence_parallel and getattr(param, "sequence_parallel", False))
                                                or "q_layernorm" in name or "k_layernorm" in name):
                dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
            if grad is not None:
                grads[name] = grad
        if adapted:
            grads = {key: param.grad for key, param in attached.params.items()}
            expected = lambda whole: lora.shard_adapters(whole, sites, tp, info.tp_rank, layers, info.first_stage)  # noqa: E731
        else:
            expected = lambda whole: convert.shard(whole, arch, tp, info.tp_rank, pp, info.pp_rank, ep, info.ep_rank)  # noqa: E731
        parallel_state.destroy_model_parallel()
        return logits, grads, expected, params

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    whole = {}
    results = []
    for kind, tp, pp, ep, sequence_parallel, adapted in layouts:
        if (kind, adapted) not in whole:
            whole[kind, adapted] = run(kind, 1, 1, 1, False, adapted)
        logits, grads, expected, params = run(kind, tp, pp, ep, sequence_parallel, adapted)
        want_logits, want_grads, _, _ = whole[kind, adapted]
        scale = max(g.abs().max().item() for g in want_grads.values())
        want = expected(want_grads)
        copies = max(1, ep // tp)  # the pack's copies among the ranks whose tokens reach an expert
        errors = {name: (grad - want[name] * (copies if ".mlp.experts." in name else 1)).abs().max().item() / scale
                  for name, grad in grads.items()}
        results.append(dict(logits=None if logits is None else (logits - want_logits).abs().max().item(),
                            names=sorted(grads) == sorted(want), grads=errors, planned_params=params or adapted))
    torch.save(results, f"{out}.{rank}")
    destroy_parallel()


# (model, tp, pp, ep, sequence parallelism, LoRA): the ranks of each layout are the two processes.
# PP runs the untied (MoE) model: megatron syncs a tied embedding's pipeline copies through CUDA.
LAYOUTS = [("dense", 2, 1, 1, False, False), ("moe", 1, 2, 1, False, False), ("moe", 2, 1, 2, True, False),
           ("dense", 2, 1, 1, False, True)]


def test_tensor_pipeline_and_expert_parallel_equal_one_process(hf_checkpoint, tmp_path):
    """TP=2 (the Gated DeltaNet heads, the gated QKV groups and the shared expert split over the
    ranks; dense, and MoE with sequence parallelism and EP=2 on the same two ranks: the routed
    experts split, the shared expert whole), PP=2 (two linear-attention layers on the first
    stage, a linear and the full-attention layer on the second), and LoRA / DoRA adapters at TP=2 (in_proj_qkv's
    lora_B split as its heads, gated q_proj's placed per group): two gloo processes give one
    process's logits (to 1e-5) and gradients (to 5e-5 of the largest) (`_parallel_worker`), and
    each rank holds the parameters the memory plan counts for it.
    Measured: 1e-6 or less without adapters and with LoRA; DoRA's row norms, summed over the TP
    ranks in another order, 6e-6 on the logits and 1.3e-5 on the gradients."""
    import socket

    import torch.multiprocessing as mp

    hf_dirs = {kind: str(path) for kind, (_, path) in hf_checkpoint.items()}
    pack = make_pack(samples_of(hf_checkpoint["dense"][0])[1:])
    adapters = {}
    for kind, (hf, _) in hf_checkpoint.items():
        arch = ModelArch.from_hf_config(hf.config.to_dict())
        adapters[kind] = LORA_SPECS[kind], random_adapters(arch, LORA_SPECS[kind])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_parallel_worker, args=(2, port, hf_dirs, pack, LAYOUTS, adapters, str(tmp_path / "results")), nprocs=2)
    for rank in range(2):
        for layout, result in zip(LAYOUTS, torch.load(tmp_path / f"results.{rank}")):
            assert result["names"], layout
            assert result["planned_params"], layout  # --dry-run's parameter count is this rank's
            assert result["logits"] is None or result["logits"] < 1e-5, (layout, result["logits"])
            worst = max(result["grads"].items(), key=lambda kv: kv[1])
            assert worst[1] < 5e-5, (layout, rank, worst)


# --- the memory plan ----------------------------------------------------------------------------


def test_dry_run_plans_the_published_models(capsys):
    """`vlmpack train --dry-run` plans the largest Qwen3.5 models (Gated DeltaNet heads and the
    shared expert split over TP, experts over EP) and finds the smallest layout that fits;
    a linear-attention layer's estimate differs from a gated full-attention layer's by what
    their token mixers keep."""
    from shards_schema.cli import main as vlmpack

    arch = builtin_arch("qwen3.5-27b")
    lm = arch.lm
    linear = memory_plan._kept_beyond_fit(lm, 0, outputs_kept=False)
    full = memory_plan._kept_beyond_fit(lm, 3, outputs_kept=False)
    assert lm.layer_type(0) == "linear_attention" and lm.layer_type(3) == "full_attention"
    assert full - linear == 4 * lm.num_heads * lm.head_dim  # the output gate and the ungated output, bf16
    rc = vlmpack(["train", "--dry-run", "--arch", "qwen3.5-397b-a17b", "--gpus", "64", "--tp", "2", "--ep", "16",
                  "--pp", "4", "--seq-len", "8192", "--recompute", "full", "--gpu-memory-gib", "141"])
    out = capsys.readouterr().out
    assert rc == 0 and "memory plan: qwen3.5-397b-a17b on 64 GPU(s) as tp 2 x pp 4 x dp 8 (ep 16)" in out, out
    assert "smallest layout that fits: 64 GPU(s)" in out


# --- GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("moe", [False, True])
def test_gpu_bf16_packed_samples_stay_close_to_hf(moe):
    """On a GPU in bf16 (varlen attention, flash-linear-attention's Gated DeltaNet kernels where
    fla-core is installed, the grouped GEMM): each sample of a pack stays as close to HF's fp32
    model on that sample alone as HF's own bf16 model on the GPU does: its mean error within
    twice HF's, its largest within twice HF's largest or 2 % of the largest logit, whichever is
    larger. In the MoE model a token whose router scores nearly tie may pick another expert in
    bf16, on either side, and its row then differs by far more than rounding: there the bound
    on the largest error is 10 % of the largest logit."""
    import copy

    info = init_parallel(1, 1, device="cuda")
    try:
        hf = tiny_qwen3_5(moe=moe)
        arch = ModelArch.from_hf_config(hf.config.to_dict())
        samples = samples_of(hf)
        pack = make_pack(samples)
        # fp32 on the GPU: where fla-core is installed, transformers runs its Triton kernels for
        # any device, so the fp32 reference cannot run on the CPU
        hf_fp32 = copy.deepcopy(hf).cuda()
        references = [hf_alone(hf_fp32, sample, "cuda") for sample in samples]
        hf_bf16 = copy.deepcopy(hf).to("cuda", torch.bfloat16)
        model = build_model(arch, transformer_config(arch, params_dtype=torch.bfloat16, bf16=True), info).eval()
        full = convert.hf_to_megatron(hf.state_dict(), arch)
        convert.load_into_model(model, {k: v.to(torch.bfloat16) for k, v in convert.shard(full, arch, 1, 0, 1, 0).items()})
        pixels = {k: v.cuda().to(torch.bfloat16) for k, v in pixel_inputs(pack).items()}
        with torch.no_grad():
            ours = model(pack.as_tensors().to("cuda"), return_logits=True, **pixels).float().cpu()
        for sample, rows, reference in zip(samples, sample_rows(pack), references):
            ids = torch.from_numpy(sample["input_ids"])[None].cuda()
            inputs = {k: v.cuda().to(torch.bfloat16) if v.is_floating_point() else v.cuda()
                      for k, v in visual_inputs(sample).items()}
            hf_bf16.model.rope_deltas = None
            with torch.no_grad():
                theirs = hf_bf16(input_ids=ids, use_cache=False, **inputs,
                                 mm_token_type_ids=torch.from_numpy(_mm_types(sample["input_ids"]))[None].cuda())
            hf_error = (theirs.logits[0].float().cpu() - reference).abs()
            our_error = (ours[rows] - reference).abs()
            assert our_error.mean() <= 2 * hf_error.mean(), (our_error.mean().item(), hf_error.mean().item())
            share = 0.1 if moe else 0.02
            largest = max(2 * hf_error.max().item(), share * reference.abs().max().item())
            assert our_error.max().item() <= largest, (our_error.max().item(), hf_error.max().item())
    finally:
        destroy_parallel()
