"""LoRA: our adapters on the megatron model == Hugging Face PEFT's on the HF model.

Model level (CPU, fp32): the same PEFT adapter state on both models gives the same logits,
per-token losses and adapter gradients on packed batches with images (tiny Qwen3-VL,
Qwen2.5-VL and Qwen3-VL MoE), with gradients on the adapters only; TP=2 (gloo) equals one
process. Training (`vlmpack train --lora-rank`): the frozen base stays bitwise unchanged,
only adapters (and modules_to_save) are in the optimizer, a stopped-and-resumed run equals
the uninterrupted one bitwise, the exported PEFT directory loads in `peft` with our logits,
`--merge` gives the same model as PEFT's merge, and `--init-lora` starts from a PEFT adapter.
"""

from __future__ import annotations

import json
import shutil
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from megatron.core import parallel_state

from preprocess.examples import example_rows, write_jsonl
from preprocess.job import PreprocessConfig, run_preprocess
from shards_schema import open_shards
from shards_schema.cli import main as vlmpack
from tests.helpers.models import tiny_qwen2_5_vl, tiny_qwen3_vl, tiny_qwen3_vl_moe
from tests.helpers.parity import TOLERANCE, hf_inputs, our_forward, our_model, pick, real_rows
from tests.helpers.shards import preprocess
from tests.helpers.train import BASE, ok, run_train
from train import adapter_format, convert
from train.checkpoint_format import weights_fingerprint
from train.model import lora
from train.model.arch import ModelArch
from train.model.batch import PackedBatch
from train.model.qwen_vl import transformer_config
from train.packed_batch import IGNORE_INDEX, assemble_pack
from train.parallel import build_model, destroy_parallel, init_parallel

peft = pytest.importorskip("peft")

# kind -> (HF model, LoRA spec): every part adapted on Qwen3-VL (with LoRA and with DoRA), a
# subset of targets with a fully trained merger, rank-stabilized scaling and DoRA on Qwen2.5-VL
# (fused layers with unadapted slots; q/k/v with a bias), attention on the MoE
CASES = {
    "qwen3-vl": (tiny_qwen3_vl, lora.LoraSpec(rank=4, alpha=8, parts=("llm", "vision", "merger"))),
    "qwen3-vl-dora": (tiny_qwen3_vl, lora.LoraSpec(rank=4, alpha=8, parts=("llm", "vision", "merger"), dora=True)),
    "qwen2.5-vl": (tiny_qwen2_5_vl, lora.LoraSpec(rank=4, alpha=12, targets=("q_proj", "v_proj", "up_proj", "down_proj"),
                                                  modules_to_save=("merger",), rslora=True, dora=True)),
    "qwen3-vl-moe": (tiny_qwen3_vl_moe, lora.LoraSpec(rank=8, alpha=8)),
}


@pytest.fixture
def info():  # per test: an in-process `vlmpack train` ends by destroying the process groups
    info = init_parallel(1, 1, device="cpu")
    yield info
    destroy_parallel()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    shards = {}
    for family in ("qwen3-vl", "qwen2.5-vl"):
        tmp = tmp_path_factory.mktemp(f"lora-{family}")
        rows = example_rows(12, seed=3, family=family, size_range=(32, 96), video_rows=0.3)
        run_preprocess(PreprocessConfig(inputs=[str(write_jsonl(tmp / "rows.jsonl", rows))], out=str(tmp / "shards"),
                                        profile=family, workers=1, progress=False))
        shards[family] = open_shards(tmp / "shards")
    return shards


def peft_config(arch: ModelArch, spec: lora.LoraSpec, init: bool = False):
    return peft.LoraConfig(**{k: v for k, v in adapter_format.peft_config(spec, arch, None).items()
                              if k in ("r", "lora_alpha", "target_modules", "modules_to_save", "use_rslora",
                                       "use_dora")},
                           init_lora_weights=init)


def peft_model(kind: str, seed: int = 0):
    """The tiny HF model with PEFT adapters of random (non-zero) values: (PEFT model, the HF
    model inside it, the base weights, architecture, spec)."""
    make, spec = CASES[kind]
    hf = make(seed)
    with torch.no_grad():  # HF starts biases at zero, where DoRA's handling of them would not show
        generator = torch.Generator().manual_seed(seed)
        for name, param in hf.named_parameters():
            if name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    base = {k: v.clone() for k, v in hf.state_dict().items()}
    arch = ModelArch.from_hf_config(hf.config.to_dict())
    torch.manual_seed(seed)
    pm = peft.get_peft_model(hf, peft_config(arch, spec))
    with torch.no_grad():  # DoRA starts each magnitude at its row's norm (a scale of 1): move them off it
        for name, param in pm.named_parameters():
            if lora.MAGNITUDE in name:
                param.mul_(1 + 0.5 * torch.rand(param.shape))
    return pm, hf, base, arch, spec


def peft_state(model) -> dict[str, torch.Tensor]:
    """PEFT's adapter state in its file names (what save_pretrained writes)."""
    return {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(model).items()}


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("images", ["mixed", "videos"])
def test_adapters_match_peft_logits_losses_and_gradients(kind, images, data, info):
    pm, hf, base, arch, spec = peft_model(kind)
    adapters = peft_state(pm)
    model, attached = our_model(base, arch, spec, adapters, info)
    shards = data["qwen2.5-vl" if kind.startswith("qwen2.5") else "qwen3-vl"]
    pack = assemble_pack(pick(shards, images), pad_to_multiple=8, seq_len=None)
    rows, labels = real_rows(pack), torch.from_numpy(pack.labels)
    keep = labels != IGNORE_INDEX

    ref = pm(**hf_inputs(hf, shards, pack)).logits[0]
    ref_loss = F.cross_entropy(ref[keep], labels[keep], reduction="sum")
    ref_loss.backward()
    with torch.no_grad():
        logits = our_forward(model, shards, pack, logits=True)
    diff = (logits[rows] - ref[rows].detach()).abs().max().item()
    assert diff < TOLERANCE, f"{kind}: max |logit diff| {diff:.2e}"
    losses = our_forward(model, shards, pack)
    assert (losses[keep] - F.cross_entropy(ref[keep].detach(), labels[keep], reduction="none")).abs().max() < TOLERANCE
    losses.sum().backward()

    peft_grads = {k.replace(".default", ""): p.grad for k, p in pm.named_parameters() if p.requires_grad}
    peft_grads = {k.replace(".modules_to_save", "").replace(f".{lora.MAGNITUDE}.weight", f".{lora.MAGNITUDE}"): g
                  for k, g in peft_grads.items()}
    trained = attached.params | attached.saved_modules
    assert set(trained) == set(peft_grads), sorted(set(trained) ^ set(peft_grads))[:4]
    for key, param in trained.items():
        want = peft_grads[key]
        scale = want.abs().max().item()
        assert scale > 0, f"{key}: PEFT's gradient is zero (the test would not see a wrong one)"
        assert (param.grad - want).abs().max().item() < TOLERANCE * scale, key
    frozen = [n for n, p in model.named_parameters() if all(p is not t for t in trained.values())]
    assert frozen and all(model.get_parameter(n).grad is None and not model.get_parameter(n).requires_grad
                          for n in frozen)
    # the adapters are in the computation: without them the logits differ
    with torch.no_grad():
        for p in attached.params.values():
            p.zero_()
        assert (our_forward(model, shards, pack, logits=True)[rows] - logits[rows]).abs().max() > 1e3 * TOLERANCE


def test_dora_starts_at_the_base_and_its_peft_export_and_merge_give_our_logits(data, info, tmp_path):
    """A fresh DoRA run starts each magnitude at its row's norm, as PEFT does, so the model is the
    base; trained DoRA adapters exported in PEFT's format load in PEFT with our logits, and the
    merged weights (rows scaled to their magnitudes) give them too."""
    from transformers import AutoModelForImageTextToText

    pm, hf, base, arch, spec = peft_model("qwen3-vl-dora")
    shards = data["qwen3-vl"]
    pack = assemble_pack(pick(shards, "mixed"), pad_to_multiple=8, seq_len=None)
    rows = real_rows(pack)

    def base_model():
        model = tiny_qwen3_vl(0)
        model.load_state_dict(base)
        return model.eval()

    fresh = base_model()
    with torch.no_grad():
        plain = fresh(**hf_inputs(fresh, shards, pack)).logits[0]
        peft_fresh = peft.get_peft_model(base_model(), peft_config(arch, spec, init=True))
    sites = lora.resolve_sites(arch, spec)

    model = build_model(arch, transformer_config(arch, cpu=True), info)
    convert.load_into_model(model, convert.shard(convert.hf_to_megatron(base, arch), arch, 1, 0, 1, 0))
    attached = lora.attach(model, arch, spec, 1, range(arch.lm.num_layers))
    attached.load_state_dict(lora.init_adapters(sites, spec.rank, seed=0), magnitudes_from_base=True)
    with torch.no_grad():
        start = our_forward(model, shards, pack, logits=True)
        for name, param in peft_fresh.named_parameters():
            if lora.MAGNITUDE in name:  # PEFT's start: ||W + scaling * B @ A|| with B = 0, i.e. ||W||
                key = name.replace(".default.weight", "")
                assert (attached.params[key] - param).abs().max() < 1e-5 * param.abs().max(), key
    assert (start[rows] - plain[rows]).abs().max() < TOLERANCE

    trained = peft_state(pm)  # random lora_B, magnitudes moved off the rows' norms
    model, _ = our_model(base, arch, spec, trained, info)
    (tmp_path / "peft").mkdir()
    adapter_format.write_peft_dir(tmp_path / "peft", spec, arch, trained, None)
    assert json.loads((tmp_path / "peft" / adapter_format.PEFT_CONFIG).read_text())["use_dora"] is True
    merged_state = adapter_format.merge_into_hf(convert.canonical_hf_names(fresh.state_dict()), trained, spec, arch)
    merged = AutoModelForImageTextToText.from_config(fresh.config).eval()
    merged.load_state_dict(convert.hub_hf_names(merged_state, arch.family))
    with torch.no_grad():
        ours = our_forward(model, shards, pack, logits=True)
        loaded = peft.PeftModel.from_pretrained(base_model(), tmp_path / "peft").eval()
        ref = loaded(**hf_inputs(fresh, shards, pack)).logits[0]
        merged_logits = merged(**hf_inputs(merged, shards, pack)).logits[0]
    assert (ours[rows] - ref[rows]).abs().max() < TOLERANCE
    assert (merged_logits[rows] - ref[rows]).abs().max() < TOLERANCE
    assert (ref[rows] - plain[rows]).abs().max() > 1e2 * TOLERANCE  # the adapters change the model


def test_peft_target_regex_selects_exactly_the_adapted_modules():
    for make, spec in CASES.values():
        hf = make(0)
        arch = ModelArch.from_hf_config(hf.config.to_dict())
        sites = lora.resolve_sites(arch, spec)
        pm = peft.get_peft_model(hf, peft_config(arch, spec))
        adapted = {n for n, m in pm.base_model.model.named_modules() if hasattr(m, "lora_A")}
        assert adapted == {s.module for s in sites}


@pytest.mark.parametrize("targets, parts, message", [
    (("gate_proj",), ("llm",), "gate_proj: no such linear module"),
    (("q_proj", "nope"), ("llm",), "--lora-targets nope"),
    (("attn.qkv",), ("llm",), "choose from"),
])
def test_targets_that_match_nothing_are_refused_by_name(targets, parts, message):
    arch = ModelArch.from_hf_config(tiny_qwen3_vl_moe().config.to_dict())
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        lora.resolve_sites(arch, lora.LoraSpec(rank=4, alpha=4, targets=targets, parts=parts))


def _tp_worker(rank: int, world: int, port: int, spec: lora.LoraSpec, adapters: dict, out: str,
               sequence_parallel: bool) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    info = init_parallel(world, 1, device="cpu")
    hf = tiny_qwen3_vl(0)
    arch = ModelArch.from_hf_config(hf.config.to_dict())
    model, attached = our_model(hf.state_dict(), arch, spec, adapters, info, tp=world,
                                sequence_parallel=sequence_parallel)
    n = 48
    ids = torch.randint(0, 2000, (n,), generator=torch.Generator().manual_seed(1))
    row = PackedBatch.from_segments(ids, torch.arange(n).expand(3, n), torch.tensor([0, 20, n], dtype=torch.int32), ids)
    losses = model(row)
    losses.sum().backward()
    for param in attached.params.values():  # what finalize_model_grads does for the marked ones
        if getattr(param, "sequence_parallel", False):
            torch.distributed.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())
    torch.save({"losses": losses.detach(), "grads": {k: p.grad for k, p in attached.params.items()}}, f"{out}.{rank}")
    destroy_parallel()


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sequence-parallel"])
@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_tp2_adapters_equal_one_process(tmp_path, dora, sequence_parallel):
    """Two gloo processes (TP=2: lora_B of column-parallel layers and lora_A of row-parallel
    ones split; DoRA's magnitudes split as lora_B, its row norms summed over TP on row-parallel
    layers) against one (TP=1): the same losses and, put back together, the same gradients.
    With sequence parallelism the hosts take or give each rank's rows: the adapters gather or
    scatter their rank-r hidden, and the tensors both ranks hold get their gradients summed."""
    import torch.multiprocessing as mp

    pm, _, _, arch, _ = peft_model("qwen3-vl-dora" if dora else "qwen3-vl")
    # the language model's adapters: the text-only batch reaches them all
    spec = lora.LoraSpec(rank=4, alpha=8, dora=dora)
    adapters = {k: v for k, v in peft_state(pm).items() if ".language_model." in k}
    for world in (1, 2):
        port = 29500 + os.getpid() % 400 + world
        mp.start_processes(_tp_worker, args=(world, port, spec, adapters, str(tmp_path / f"tp{world}"),
                                             sequence_parallel), nprocs=world, start_method="spawn")
    one = torch.load(tmp_path / "tp1.0")
    two = [torch.load(tmp_path / f"tp2.{r}") for r in range(2)]
    assert (two[0]["losses"] - one["losses"]).abs().max() < TOLERANCE
    sites = lora.resolve_sites(arch, spec)
    merged = lora.unshard_adapters({r: two[r]["grads"] for r in range(2)}, sites)
    for key, grad in one["grads"].items():
        assert (merged[key] - grad).abs().max() < TOLERANCE * grad.abs().max(), key
    split = [s for s in sites if s.split != "none"]
    assert all(two[0]["grads"][s.key("lora_B" if s.split == "column" else "lora_A")].shape
               != one["grads"][s.key("lora_B" if s.split == "column" else "lora_A")].shape for s in split)


# --- training --------------------------------------------------------------------------------

# `vlmpack train`'s Trainer with the model's parameters snapshotted after setup; at the end:
# which parameters changed, which the optimizer holds, and the gradient buffer's size.
WATCH_PARAMETERS = """
import argparse, json, sys, torch
from train.config import add_train_flags, config_from_args
from train.parallel import destroy_parallel
from train.trainer import Trainer
parser = argparse.ArgumentParser()
add_train_flags(parser)
with Trainer(config_from_args(parser.parse_args(sys.argv[2:]))) as trainer:
    before = {n: p.detach().clone() for n, p in trainer.model.module.named_parameters()}
    trainer.train()
model = trainer.model
changed = sorted(n for n, p in model.module.named_parameters() if not torch.equal(p.detach(), before[n]))
names = {id(p): n for n, p in model.module.named_parameters()}
optimizer = trainer.optimizer  # CpuAdamW, or megatron's (its groups hold fp32 copies): what DDP buffers
optimized = optimizer.params if hasattr(optimizer, "params") else [p for b in model.buffers for p in b.params]
report = {"changed": changed, "all": sorted(names.values()),
          "optimized": sorted(names[id(p)] for p in optimized),
          "grad_buffer": sum(b.grad_data.numel() for b in model.buffers),
          "adapters": sum(p.numel() for p in model.module.adapters.params.values()),
          "saved": sum(p.numel() for p in model.module.adapters.saved_modules.values())}
open(sys.argv[1], "w").write(json.dumps(report))
destroy_parallel()
"""


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> Path:
    """A tiny Qwen3-VL checkpoint directory, the base model of the LoRA runs."""
    path = tmp_path_factory.mktemp("hf-base") / "qwen3-vl"
    tiny_qwen3_vl(seed=4).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return preprocess(tmp_path_factory.mktemp("lora-train-data"), "shards")


def lora_args(shards: Path, hf_base: Path, out: Path, steps: int = 4) -> list[str]:
    args = [a for a in BASE if a not in ("--arch", "tiny")]
    return [*args, "--hf-model", str(hf_base), "--data", str(shards), "--out", str(out), "--train-steps", str(steps),
            "--lora-rank", "8", "--lora-alpha", "16", "--lora-modules-to-save", "merger", "--save-every", "2"]


@pytest.fixture(scope="module")
def lora_run(shards, hf_base, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("lora-run") / "run"
    report = out.parent / "report.json"
    # DoRA: the run's checkpoints, resume and exports carry the magnitudes beside lora_A / lora_B
    ok(run_train([str(report), *lora_args(shards, hf_base, out), "--lora-dora"], code=WATCH_PARAMETERS))
    return out, json.loads(report.read_text())


def test_only_adapters_and_modules_to_save_train_and_the_base_stays_bitwise(lora_run):
    _, report = lora_run
    trained = [n for n in report["all"] if ".lora." in n or n.startswith(("vision.merger.", "vision.deepstack_merger"))]
    assert report["optimized"] == sorted(trained)
    assert set(report["changed"]) == set(trained)  # every trained tensor moved, every other one is bitwise the same
    assert report["grad_buffer"] >= report["adapters"] + report["saved"]
    assert report["grad_buffer"] < 1.01 * (report["adapters"] + report["saved"])  # no gradient memory for the base


def test_checkpoints_hold_adapters_only_and_resume_bitwise(lora_run, shards, hf_base, tmp_path):
    out, _ = lora_run
    step = out / "checkpoints" / "step_00000004"
    assert not (step / "model").exists()
    assert sorted(p.name for p in (step / "adapter").iterdir()) == ["adapter_tp0_pp0.safetensors", "hf", "lora.json",
                                                                     "profile.json"]
    meta = json.loads((step / "adapter" / "lora.json").read_text())
    assert meta["base"] == {"hf_model": str(hf_base.resolve()), "fingerprint": weights_fingerprint(hf_base)}

    resumed = tmp_path / "resumed"
    ok(run_train([*lora_args(shards, hf_base, resumed), "--lora-dora", "--exit-interval", "2"]))
    ok(run_train([*lora_args(shards, hf_base, resumed), "--lora-dora", "--resume"]))
    name = "adapter/adapter_tp0_pp0.safetensors"
    a, b = (convert.load_tensors(d / "checkpoints" / "step_00000004" / name) for d in (out, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.endswith(lora.MAGNITUDE) for k in a)
    losses = [[json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (out, resumed)]
    assert losses[0] == losses[1]

    changed = tmp_path / "changed"
    shutil_copy_run(resumed, changed)
    proc = run_train([*lora_args(shards, hf_base, changed, steps=6), "--lora-dora", "--lora-rank", "4", "--resume"])
    assert proc.returncode == 2 and "resume with the same --lora-* settings" in proc.stderr
    # adapters recorded on other weights than --hf-model holds now
    (changed / "checkpoints" / "latest").write_text("step_00000002")
    saved = changed / "checkpoints" / "step_00000002" / "adapter" / "lora.json"
    saved.write_text(json.dumps({**meta, "base": {**meta["base"], "fingerprint": "0" * 64}}))
    proc = run_train([*lora_args(shards, hf_base, changed), "--lora-dora", "--resume"])
    assert proc.returncode == 2 and "were trained on other weights than" in proc.stderr, proc.stderr[-2000:]


def shutil_copy_run(src: Path, dst: Path) -> None:
    import shutil

    shutil.copytree(src, dst)
    (dst / ".vlmpack.lock").unlink(missing_ok=True)


def test_exported_peft_adapter_loads_in_peft_with_our_logits_and_merge_matches(lora_run, hf_base, data, info, tmp_path):
    from transformers import AutoModelForImageTextToText

    out, _ = lora_run
    step = out / "checkpoints" / "step_00000004"
    assert vlmpack(["export-hf", str(step), "--lora-format", "peft", "--out", str(tmp_path / "peft")]) == 0
    assert vlmpack(["export-hf", str(step), "--merge", "--out", str(tmp_path / "merged")]) == 0
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and config["base_model_name_or_path"] == str(hf_base.resolve())
    assert config["use_dora"] is True

    hf = AutoModelForImageTextToText.from_pretrained(hf_base).eval()
    with_adapter = peft.PeftModel.from_pretrained(hf, tmp_path / "peft").eval()
    shards = data["qwen3-vl"]
    pack = assemble_pack(pick(shards, "mixed"), pad_to_multiple=8, seq_len=None)
    rows = real_rows(pack)
    with torch.no_grad():
        ref = with_adapter(**hf_inputs(hf, shards, pack)).logits[0]
        merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged").eval()
        merged_logits = merged(**hf_inputs(merged, shards, pack)).logits[0]

    _, spec, arch, adapters = adapter_format.read_adapter_dir(step / "adapter")
    base = AutoModelForImageTextToText.from_pretrained(hf_base).eval()
    model, _ = our_model(base.state_dict(), arch, spec, adapters, info)
    with torch.no_grad():
        ours = our_forward(model, shards, pack, logits=True)
        plain = base(**hf_inputs(base, shards, pack)).logits[0]
    assert (ours[rows] - ref[rows]).abs().max() < TOLERANCE
    assert (merged_logits[rows] - ref[rows]).abs().max() < TOLERANCE
    assert (plain[rows] - ref[rows]).abs().max() > 1e2 * TOLERANCE  # the trained adapters change the model


def test_init_lora_starts_from_a_peft_adapter(shards, hf_base, tmp_path, capsys):
    hf = tiny_qwen3_vl(seed=4)
    arch = ModelArch.from_hf_config(hf.config.to_dict())
    spec = lora.LoraSpec(rank=8, alpha=16, modules_to_save=("merger",))
    torch.manual_seed(7)
    pm = peft.get_peft_model(hf, peft_config(arch, spec))
    pm.save_pretrained(tmp_path / "adapter")
    start = peft_state(pm)
    out = tmp_path / "run"
    # a learning rate so small that one AdamW step (|update| <= lr) leaves the values within 1e-9
    ok(run_train([*lora_args(shards, hf_base, out, steps=1), "--lr", "1e-10", "--warmup-steps", "0",
                  "--init-lora", str(tmp_path / "adapter"), "--export-hf", str(tmp_path / "exported")]))
    exported = convert.load_tensors(tmp_path / "exported" / adapter_format.PEFT_WEIGHTS)
    assert exported.keys() == start.keys()
    for key, value in start.items():
        assert (exported[key] - value).abs().max() < 1e-8, key

    code = vlmpack(["train", *lora_args(shards, hf_base, tmp_path / "other", steps=2), "--lora-rank", "4",
                    "--init-lora", str(tmp_path / "adapter")])
    assert code == 2
    assert "its r is 8, this run's --lora-rank is 4; pass --lora-rank 8" in capsys.readouterr().err
    code = vlmpack(["train", *lora_args(shards, hf_base, tmp_path / "other", steps=2), "--lora-rslora",
                    "--init-lora", str(tmp_path / "adapter")])
    assert code == 2
    assert "its use_rslora is False, this run's is True; drop --lora-rslora" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--lora-alpha", "8"], "--lora-alpha sets up LoRA adapters, which --lora-rank R (e.g. 16) turns on: give it too"),
    (["--lora-rank", "4", "--lora-targets", "q_proj,w_proj"], "--lora-targets w_proj: no such linear module"),
    (["--lora-rank", "4", "--lora-parts", "lm"], "--lora-parts lm: choose from"),
    (["--lora-rank", "4", "--lora-modules-to-save", "llm"], "--lora-modules-to-save llm: choose from vision,merger"),
    (["--lora-rank", "4", "--lora-parts", "llm,merger", "--lora-modules-to-save", "merger"], "not both"),
    (["--lora-rank", "4", "--freeze", "llm"], "--freeze llm: those parts are trained"),
    (["--lora-rank", "4", "--lora-dropout", "1"], "--lora-dropout must be in [0, 1)"),
    (["--lora-rank", "4", "--lora-dora", "--lora-dropout", "0.1"], "--lora-dora with --lora-dropout 0.1"),
    (["--lora-rank", "4", "--init-lora", "{empty}"], "no adapter_config.json"),
    (["--lora-rank", "4", "--init-lora", "{not_json}"], "not_json/adapter_config.json: not valid JSON"),
    (["--lora-rank", "4", "--init-lora", "{a_list}"], "a_list/adapter_config.json: holds a JSON array, not an object"),
])
def test_bad_lora_settings_exit_2_with_one_line(shards, tmp_path, capsys, extra, message):
    (tmp_path / "empty").mkdir()
    for name, text in (("not_json", "{"), ("a_list", "[]")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(text)
    extra = [a.format(**{name: tmp_path / name for name in ("empty", "not_json", "a_list")}) for a in extra]
    code = vlmpack(["train", *BASE, "--data", str(shards), "--out", str(tmp_path / "out"), "--train-steps", "2", *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("vlmpack train: error: ") and err.count("\n") == 1, err
    assert message in err


def test_moe_gate_up_down_targets_are_refused_naming_the_experts(shards, tmp_path, capsys):
    code = vlmpack(["train", *[a if a != "tiny" else "tiny-moe" for a in BASE], "--data", str(shards), "--out",
                    str(tmp_path / "out"), "--train-steps", "2", "--lora-rank", "4", "--lora-targets", "q_proj,gate_proj"])
    err = capsys.readouterr().err
    assert code == 2 and "Mixture-of-Experts" in err and "experts are stacked tensors" in err, err


def test_export_of_a_lora_checkpoint_whose_lora_json_is_damaged_exits_2_naming_it(lora_run, tmp_path, capsys):
    out, _ = lora_run
    step = tmp_path / "step"
    shutil.copytree(out / "checkpoints" / "step_00000004", step)
    (step / "adapter" / "lora.json").write_text("{")
    capsys.readouterr()
    assert vlmpack(["export-hf", str(step), "--lora-format", "peft", "--out", str(tmp_path / "peft")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{step / 'adapter' / 'lora.json'}: not valid JSON" in err, err


def test_export_flags_need_a_lora_checkpoint(lora_run, tmp_path, capsys):
    out, _ = lora_run
    model_dir = tmp_path / "model"
    assert vlmpack(["import-hf", str(_hf_dir(out)), "--out", str(model_dir)]) == 0
    capsys.readouterr()
    assert vlmpack(["export-hf", str(model_dir), "--merge", "--out", str(tmp_path / "x")]) == 2
    assert "is not a LoRA checkpoint" in capsys.readouterr().err
    step = out / "checkpoints" / "step_00000004"
    assert vlmpack(["export-hf", str(step), "--base", str(model_dir), "--out", str(tmp_path / "y")]) == 2
    assert "--base is the model to merge into or to export: it needs --merge or --lora-base" in capsys.readouterr().err
    assert vlmpack(["export-hf", str(step), "--merge", "--base", str(tmp_path), "--out", str(tmp_path / "z")]) == 2
    assert "pass --base DIR" in capsys.readouterr().err
    # merging into the base given as a Megatron model directory gives the same weights
    assert vlmpack(["export-hf", str(step), "--merge", "--base", str(model_dir), "--out", str(tmp_path / "a")]) == 0
    assert vlmpack(["export-hf", str(step), "--merge", "--out", str(tmp_path / "b")]) == 0
    a, b = (convert.load_tensors(tmp_path / d / "model.safetensors") for d in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # a model of the same architecture with other weights is no base for these adapters; the
    # base's own weights saved in other shards are
    tiny_qwen3_vl(seed=5).save_pretrained(tmp_path / "other")
    capsys.readouterr()
    assert vlmpack(["export-hf", str(step), "--merge", "--base", str(tmp_path / "other"), "--out",
                    str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds other weights than the adapters were trained on" in err, err
    assert not (tmp_path / "c").exists()
    # those other weights imported as a model directory are known by the fingerprint of the HF
    # directory import-hf records; a model directory without that record merges with a note
    assert vlmpack(["import-hf", str(tmp_path / "other"), "--out", str(tmp_path / "other-model")]) == 0
    capsys.readouterr()
    assert vlmpack(["export-hf", str(step), "--merge", "--base", str(tmp_path / "other-model"), "--out",
                    str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds other weights than the adapters were trained on" in err, err
    unrecorded = Path(shutil.copytree(model_dir, tmp_path / "unrecorded"))
    meta = json.loads((unrecorded / convert.META_FILE).read_text())
    (unrecorded / convert.META_FILE).write_text(json.dumps({k: v for k, v in meta.items() if k != "hf_fingerprint"}))
    (unrecorded / ".vlmpack.lock").unlink(missing_ok=True)
    assert vlmpack(["export-hf", str(step), "--merge", "--base", str(unrecorded), "--out", str(tmp_path / "f")]) == 0
    assert ("note: the adapters' base is recorded as a Hugging Face directory, and this model directory records no "
            f"import from one: the weights of {unrecorded} could not be compared") in capsys.readouterr().err
    from transformers import AutoModelForImageTextToText
    AutoModelForImageTextToText.from_pretrained(_hf_dir(out)).save_pretrained(tmp_path / "resharded",
                                                                              max_shard_size="200KB")
    assert len(list((tmp_path / "resharded").glob("*.safetensors"))) > 1
    assert vlmpack(["export-hf", str(step), "--merge", "--base", str(tmp_path / "resharded"), "--out",
                    str(tmp_path / "d")]) == 0
    d = convert.load_tensors(tmp_path / "d" / "model.safetensors")
    assert d.keys() == b.keys() and all(torch.equal(d[k], b[k]) for k in d)


def test_a_base_whose_weights_cannot_be_compared_is_checked_by_architecture_with_a_note(tmp_path):
    """lora.json without a fingerprint of its base, and a random-init base given as --base,
    merge on the architecture alone, saying so; nothing of the directory is read to say it."""
    from train.lora_export import check_base_weights

    given = tmp_path / "base"  # never read: nothing recorded to compare it with
    note = check_base_weights({"hf_model": "/models/qwen3-vl"}, given)
    assert note == (f"the adapters' lora.json records no fingerprint of their base's weights: the weights of {given} "
                    "could not be compared with the base's, only its architecture")
    note = check_base_weights({"arch": "tiny", "seed": 7}, given)
    assert note.startswith("the adapters were trained on a random init (--arch tiny, --seed 7): the weights of")


def _hf_dir(run: Path) -> Path:
    return Path(json.loads((run / "checkpoints" / "step_00000004" / "adapter" / "lora.json").read_text())["base"]["hf_model"])


# --- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_recompute_gives_every_adapter_its_gradient():
    """megatron's full recompute is a reentrant checkpoint: a layer whose input needs no gradient
    (the frozen embedding's output) would give its adapters none. Block recompute of the first
    layer and uniform recompute of all give the adapters the gradients of no recompute (fp32)."""
    info = init_parallel(1, 1, device="cuda")
    try:
        pm, _, base, arch, _ = peft_model("qwen3-vl")
        spec = lora.LoraSpec(rank=4, alpha=8)
        adapters = {k: v for k, v in peft_state(pm).items() if ".language_model." in k}
        n = 96
        ids = torch.randint(0, 2000, (n,), generator=torch.Generator().manual_seed(2)).cuda()
        grads = {}
        for recompute, layers in (("none", None), ("full", 1), ("full", None)):
            model = build_model(arch, transformer_config(arch, recompute=recompute, recompute_layers=layers), info)
            convert.load_into_model(model, convert.shard(convert.hf_to_megatron(base, arch), arch, 1, 0, 1, 0))
            attached = lora.attach(model, arch, spec, 1, range(arch.lm.num_layers))
            attached.load_state_dict(lora.shard_adapters(adapters, lora.resolve_sites(arch, spec), 1, 0,
                                                         range(arch.lm.num_layers), True))
            losses = model(PackedBatch.from_segments(ids, torch.arange(n, device="cuda").expand(3, n),
                                                     torch.tensor([0, 40, n], dtype=torch.int32, device="cuda"), ids))
            losses.sum().backward()
            grads[(recompute, layers)] = {k: p.grad for k, p in attached.params.items()}
        for setting in (("full", 1), ("full", None)):
            for key, want in grads[("none", None)].items():
                got = grads[setting][key]
                assert got is not None, f"{setting}: {key} got no gradient"
                assert (got - want).abs().max() <= 1e-4 * want.abs().max(), (setting, key)
    finally:
        destroy_parallel()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_lora_run_trains_adapters_only_and_resumes(shards, hf_base, tmp_path):
    """bf16, megatron's DistributedOptimizer, one recomputed layer: the base stays bitwise, only
    the adapters and the merger have gradient buffers and optimizer state, and a stop at step 2
    plus a resume gives the uninterrupted run's losses (up to GPU non-determinism)."""
    gpu = ["--device", "cuda", "--num-workers", "1", "--recompute", "full", "--recompute-layers", "1"]
    full, part, report = tmp_path / "full", tmp_path / "part", tmp_path / "report.json"
    ok(run_train([str(report), *lora_args(shards, hf_base, full), *gpu], code=WATCH_PARAMETERS))
    seen = json.loads(report.read_text())
    trained = [n for n in seen["all"] if ".lora." in n or n.startswith(("vision.merger.", "vision.deepstack_merger"))]
    assert set(seen["changed"]) == set(trained) and seen["optimized"] == sorted(trained)
    assert seen["grad_buffer"] < 1.01 * (seen["adapters"] + seen["saved"])
    state = torch.load(full / "checkpoints" / "step_00000004" / "optimizer_param_state_pp0_tp0.pt", weights_only=False)
    numel = sum(t.numel() for gbuf in state.values() if isinstance(gbuf, dict) for world in gbuf.values()
                for key, t in world.items() if key == "param")
    assert numel < 1.01 * (seen["adapters"] + seen["saved"])  # fp32 master weights of the trained tensors only
    ok(run_train([*lora_args(shards, hf_base, part), *gpu, "--exit-interval", "2"]))
    ok(run_train([*lora_args(shards, hf_base, part), *gpu, "--resume"]))
    a, b = ([json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (full, part))
    np.testing.assert_allclose(b, a, rtol=2e-3)
