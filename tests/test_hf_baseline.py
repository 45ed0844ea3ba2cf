"""The training-speed benchmark's Hugging Face side (`benchmarks/hf_baseline.py`) computes what
vlmpack computes: on a pack of several samples, HF's loss through the packed recipe (varlen
attention registered with transformers, boundaries from the text positions, the vision tower's
own cu_seqlens) equals the target-weighted mean of HF's per-sample losses without packing (sdpa,
one sample at a time), for both families and a Mixture-of-Experts model; and the benchmark's
own step-1 check (both sides from the same weights, on the same packs) holds in fp32."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from shards_schema import open_shards

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import hf_baseline  # noqa: E402
import train_speed  # noqa: E402
from synthetic_shards import SyntheticSpec, write_synthetic_shards  # noqa: E402

from train.model.arch import builtin_arch  # noqa: E402

SMALL_MIX = dict(text_tokens=(40, 300), image_tokens=(8, 48), max_tokens=768)


@pytest.mark.parametrize("arch_name", ["tiny", "tiny-qwen2.5", "tiny-moe"])
def test_packed_recipe_equals_hf_per_sample(tmp_path, arch_name):
    arch = builtin_arch(arch_name)
    write_synthetic_shards(tmp_path / "data", SyntheticSpec(num_samples=5, seed=11, **SMALL_MIX),
                           profile_name=arch.family, log=None)
    shards = open_shards(tmp_path / "data")
    samples = [shards[i] for i in range(len(shards))]
    assert sum(len(s["image_grid_thw"]) for s in samples) >= 2  # images in the pack
    init = hf_baseline.write_init_checkpoint(arch, tmp_path / "init", seed=3, dtype=torch.float32,
                                             device=torch.device("cpu"))
    trainer = hf_baseline.HFPackedTrainer(arch, init, shards.manifest["profile"], hf_baseline.Recipe(),
                                          torch.device("cpu"))
    pack = hf_baseline.collate_pack(samples)
    with torch.no_grad():
        packed = float(trainer.model(**trainer.inputs(pack), use_cache=False).loss)

    reference = hf_baseline.hf_model_class(arch).from_pretrained(init, dtype=torch.float32, attn_implementation="sdpa")
    reference.train()  # the same mode (MoE routing, no dropout configured)
    weighted, targets = 0.0, 0
    with torch.no_grad():
        for sample in samples:
            one = hf_baseline.collate_pack([sample])
            inputs = trainer.inputs(one)
            inputs["position_ids"] = inputs["position_ids"][1:]  # one sample: its own M-RoPE rows, no packing
            loss = float(reference(**inputs, use_cache=False).loss)
            weighted += loss * one["targets"]
            targets += one["targets"]
    assert packed == pytest.approx(weighted / targets, abs=2e-5)


def test_fp32_master_weights_step_fp32_copies_and_round_them_into_the_bf16_parameters(tmp_path):
    """`--hf-master-weights fp32`: AdamW's state and steps live on fp32 copies; the bf16 model
    takes them rounded after each step. At a learning rate below bf16's resolution of most
    weights, updating the bf16 parameters in place leaves those weights as they were."""
    arch = builtin_arch("tiny")
    write_synthetic_shards(tmp_path / "data", SyntheticSpec(num_samples=3, seed=5, **SMALL_MIX),
                           profile_name=arch.family, log=None)
    shards = open_shards(tmp_path / "data")
    pack = hf_baseline.collate_pack([shards[i] for i in range(len(shards))])
    init = hf_baseline.write_init_checkpoint(arch, tmp_path / "init", seed=3, dtype=torch.float32,
                                             device=torch.device("cpu"))
    moved = {}
    for master_weights in ("fp32", "bf16"):
        trainer = hf_baseline.HFPackedTrainer(arch, init, shards.manifest["profile"],
                                              hf_baseline.Recipe(lr=1e-6, liger=False, master_weights=master_weights),
                                              torch.device("cpu"), dtype=torch.bfloat16)
        before = [p.detach().float().clone() for p in trainer.params]
        for _ in range(2):
            trainer.step([pack])
        if master_weights == "fp32":
            assert all(m.dtype == torch.float32 and torch.equal(p, m.to(p.dtype))
                       for p, m in zip(trainer.params, trainer.masters))
            assert all(p.grad is None for p in trainer.params)
            changed = sum(int((m != b).sum()) for m, b in zip(trainer.masters, before))
        else:
            assert trainer.masters is None
            changed = sum(int((p.float() != b).sum()) for p, b in zip(trainer.params, before))
        moved[master_weights] = changed / sum(b.numel() for b in before)
    assert moved["fp32"] > 0.9 and moved["bf16"] < 0.5, moved


def test_fp32_master_weights_sum_the_packs_gradients_in_fp32(tmp_path, monkeypatch):
    """`--hf-master-weights fp32` sums a step's packs' gradients in fp32 (as vlmpack's fp32
    gradient buffers do): AdamW sees each pack's bf16 gradients added in fp32, not their sum
    rounded to bf16 at every pack."""
    arch = builtin_arch("tiny")
    write_synthetic_shards(tmp_path / "data", SyntheticSpec(num_samples=3, seed=5, **SMALL_MIX),
                           profile_name=arch.family, log=None)
    shards = open_shards(tmp_path / "data")
    packs = [hf_baseline.collate_pack([shards[0], shards[1]]), hf_baseline.collate_pack([shards[2]])]
    init = hf_baseline.write_init_checkpoint(arch, tmp_path / "init", seed=3, dtype=torch.float32,
                                             device=torch.device("cpu"))
    trainer = hf_baseline.HFPackedTrainer(arch, init, shards.manifest["profile"],
                                          hf_baseline.Recipe(lr=1e-6, liger=False, master_weights="fp32"),
                                          torch.device("cpu"), dtype=torch.bfloat16)
    targets = sum(p["targets"] for p in packs)
    per_pack = []
    for pack in packs:  # each pack's bf16 gradients, as the step makes them
        (trainer.model(**trainer.inputs(pack), use_cache=False).loss * (pack["targets"] / targets)).backward()
        per_pack.append([p.grad.clone() for p in trainer.params])
        trainer.model.zero_grad(set_to_none=True)
    seen = {}
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, norm: None)
    monkeypatch.setattr(trainer.optimizer, "step", lambda: seen.setdefault("grads", [m.grad.clone() for m in trainer.masters]))
    trainer.step(packs)
    in_fp32 = [a.float() + b.float() for a, b in zip(*per_pack)]
    in_bf16 = [(a + b).float() for a, b in zip(*per_pack)]
    assert all(torch.equal(g, want) for g, want in zip(seen["grads"], in_fp32))
    assert sum(int((a != b).sum()) for a, b in zip(in_fp32, in_bf16)) > 0  # the two sums differ: the check can fail


def test_the_gated_delta_net_layers_call_the_conv_the_packed_recipe_replaces():
    """transformers' Qwen3.5 (dense and MoE) Gated DeltaNet layers call their module's
    `causal_conv1d_fn`, which the packed recipe replaces with the varlen conv; a layer holding
    its own binding would be refused."""
    from tests.helpers.models import tiny_qwen3_5

    for moe in (False, True):
        layers = [m for m in tiny_qwen3_5(moe=moe).modules() if type(m).__name__.endswith("GatedDeltaNet")]
        assert layers and all(hf_baseline.calls_module_conv(layer) for layer in layers)
    layers[0].causal_conv1d_fn = lambda *args, **kwargs: None
    assert not hf_baseline.calls_module_conv(layers[0])


def test_collate_pack_refuses_a_target_at_a_sample_start():
    sample = {"input_ids": np.arange(4), "loss_mask": np.array([1, 0, 1, 1], np.uint8),
              "position_ids": np.zeros((3, 4), np.int64), "pixel_patches": np.zeros((0, 8), np.uint8),
              "image_grid_thw": np.zeros((0, 3), np.int32)}
    with pytest.raises(ValueError, match="first token is a target"):
        hf_baseline.collate_pack([sample])


def test_train_speed_both_sides_start_equal_and_train_alike(tmp_path):
    """The benchmark end to end on CPU: same weights, same packs, step-1 losses within 1e-4
    (fp32), and the run reports both sides. At a learning rate that moves the tiny model, every
    later step's loss agrees within 1e-5 too: HF trains with the trainer's optimizer, gradient
    clipping and learning-rate schedule (HF at a constant rate against the trainer's cosine
    decay is 1.8e-2 off by step 4)."""
    out = tmp_path / "run"
    code = train_speed.main(["--arch", "tiny", "--device", "cpu", "--seq-len", "1024", "--samples", "16",
                             "--warmup", "1", "--steps", "3", "--text-tokens", "40", "300", "--image-tokens", "8", "48",
                             "--lr", "1e-3", "--num-workers", "0", "--vision-reps", "0", "--out-dir", str(out)])
    result = json.loads((out / "train_speed.json").read_text())
    assert code == 0, result.get("loss_check")
    check = result["loss_check"]
    assert check["ok"] and check["absolute_difference"] <= 1e-4
    run = result["repeats"][0]
    assert [s["tokens"] for s in run["hf"]["steps"]] == [s["tokens"] for s in run["ours"]["steps"]]
    ours, hf = ([s["loss"] for s in side["steps"]] for side in (run["ours"], run["hf"]))
    assert len(ours) == 4 and max(abs(a - b) for a, b in zip(ours, hf)) <= 1e-5, (ours, hf)
    assert run["hf"]["gradient_checkpointing"] is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (flash-linear-attention's kernels)")
def test_gpu_qwen3_5_packed_recipe_resets_the_linear_attention_state():
    """Qwen3.5 on HF's packed recipe (bf16, flash-linear-attention's chunked gated delta rule
    and causal conv1d, the pack's boundaries handed to each Gated DeltaNet layer): each sample
    of a text pack is as close to the same model on that sample alone as bf16 allows, and at
    least 5 times closer than without the boundaries (the recurrent state and the conv window
    run on across samples); the first tokens of each sample, which only the conv window
    reaches, too."""
    pytest.importorskip("fla")
    from transformers import Qwen3_5ForConditionalGeneration

    from tests.helpers.models import tiny_qwen3_5_config

    config = tiny_qwen3_5_config()
    config.text_config.linear_key_head_dim = config.text_config.linear_value_head_dim = 32
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    model.to("cuda", torch.bfloat16)
    hf_baseline.use_packed_attention(model)
    lengths = [300, 517, 211]
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 150000, (n,), generator=g) for n in lengths]

    def positions(ns: list[int]) -> torch.Tensor:
        text = torch.cat([torch.arange(n) for n in ns])
        return torch.stack([text, text, text, text])[:, None, :].cuda()

    def logits(ns, tokens):
        with torch.no_grad():
            return model(input_ids=torch.cat(tokens)[None].cuda(), position_ids=positions(ns),
                         use_cache=False).logits[0].float()

    alone = [logits([n], [t]) for n, t in zip(lengths, ids)]
    crossing = logits(lengths, ids)
    assert hf_baseline.use_packed_linear_attention(model) == 3
    packed = logits(lengths, ids)
    starts = np.cumsum([0] + lengths)
    for k in (1, 2):  # the samples after the first
        rows = slice(int(starts[k]), int(starts[k + 1]))
        reset = (packed[rows] - alone[k]).abs().max().item()
        run_on = (crossing[rows] - alone[k]).abs().max().item()
        scale = alone[k].abs().max().item()
        assert reset <= 0.02 * scale and reset * 5 <= run_on, (k, reset, run_on, scale)
        head = slice(int(starts[k]), int(starts[k]) + 3)  # the tokens the conv window reaches back from
        first = (packed[head] - alone[k][:3]).abs().max().item()
        assert first <= 0.02 * scale, (k, first, scale)


def test_train_speed_combine_joins_runs_of_one_command_and_refuses_others(tmp_path):
    """Two invocations of one command (the second on the first's shards) join into one
    comparison over both runs; a result of another command, or of other packs, is refused, and
    an option a result's version lacked counts as its default."""
    first, second = tmp_path / "a", tmp_path / "b"
    base = ["--arch", "tiny", "--device", "cpu", "--seq-len", "1024", "--samples", "8", "--warmup", "1",
            "--steps", "1", "--text-tokens", "40", "200", "--image-tokens", "8", "32", "--num-workers", "0",
            "--vision-reps", "0", "--repeats", "1"]
    assert train_speed.main(base + ["--out-dir", str(first)]) == 0
    assert train_speed.main(base + ["--out-dir", str(second), "--data-dir", str(first / "data")]) == 0
    joined = tmp_path / "joined.json"
    assert train_speed.main(["--combine", str(first / "train_speed.json"), str(second / "train_speed.json"),
                             "--json-out", str(joined)]) == 0
    result = json.loads(joined.read_text())
    assert len(result["runs"]) == 2
    assert len(result["ratios"]["tokens_per_s"]["vlmpack"]["runs"]) == 2
    curves = result["curves"]
    assert curves["steps"] == 2 and len(curves["hf_vs_hf"]["per_step"]) == 2

    # a result from before an option existed joins one that ran it at its default, not another value
    older = json.loads((second / "train_speed.json").read_text())
    del older["args"]["memory_snapshot_stacks"]
    (tmp_path / "older.json").write_text(json.dumps(older))
    assert train_speed.main(["--combine", str(first / "train_speed.json"), str(tmp_path / "older.json"),
                             "--json-out", str(tmp_path / "older_joined.json")]) == 0
    newer = json.loads((first / "train_speed.json").read_text())
    newer["args"]["memory_snapshot_stacks"] = "none"
    (tmp_path / "newer.json").write_text(json.dumps(newer))
    with pytest.raises(SystemExit, match="differs in: memory_snapshot_stacks"):
        train_speed.main(["--combine", str(tmp_path / "newer.json"), str(tmp_path / "older.json")])

    other = json.loads((second / "train_speed.json").read_text())
    other["args"]["lr"] = 1e-3
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="differs in: lr"):
        train_speed.main(["--combine", str(first / "train_speed.json"), str(tmp_path / "other.json")])
    other = json.loads((second / "train_speed.json").read_text())
    other["repeats"][0]["ours"]["packs"] = other["repeats"][0]["ours"]["packs"][::-1]
    (tmp_path / "packs.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="other packs"):
        train_speed.main(["--combine", str(first / "train_speed.json"), str(tmp_path / "packs.json")])


def _runs(curves_ours, curves_hf) -> list[dict]:
    return [{"ours": {"steps": [{"loss": x} for x in a]}, "hf": {"steps": [{"loss": x} for x in b]}}
            for a, b in zip(curves_ours, curves_hf)]


def test_curve_check_judges_runs_of_one_distribution_alike_whatever_the_pair_counts():
    """Two runs per side give four vlmpack-HF pairs against one HF-HF pair. Curves drawn from one
    distribution must come out alike (a per-step largest over pairs calls them 1.5x apart);
    a curve offset by a few times the noise must not."""
    rng = np.random.default_rng(0)
    base = np.linspace(12.0, 9.0, 4000)
    draw = lambda: (base + rng.normal(0, 4e-4, base.size)).tolist()  # noqa: E731
    same = train_speed.curve_check(_runs([draw(), draw()], [draw(), draw()]))
    assert same["vlmpack_vs_hf"]["pairs"] == 4 and same["hf_vs_hf"]["pairs"] == 1
    assert same["vlmpack_vs_hf"]["median"] == pytest.approx(same["hf_vs_hf"]["median"], rel=0.05)
    assert len(same["vlmpack_vs_hf"]["per_step"]) == base.size
    offset = [(np.array(draw()) + 2e-3).tolist() for _ in range(2)]
    apart = train_speed.curve_check(_runs(offset, [draw(), draw()]))
    assert not apart["within_hf_spread"]
    assert apart["vlmpack_vs_hf"]["median"] > 3 * apart["hf_vs_hf"]["median"]


def _timed(seconds_ours, seconds_hf, warmup):
    ours = [{"step": i + 1, "step_seconds": t} for i, t in enumerate(seconds_ours)]
    hf = [{"step": i + 1, "step_seconds": t, "warmup": i < warmup} for i, t in enumerate(seconds_hf)]
    return {"ours": {"steps": ours}, "hf": {"steps": hf}}


def test_step_by_step_ratio_is_not_moved_by_one_sides_stalled_steps():
    """Both sides run the same packs: HF 1.15x slower on every step, but for two measured steps
    where it stalls (an autotune). The step-by-step median stays at 1.15x, while the run's median
    step moves; warm-up steps are left out, and a step missing on one side is not paired."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        warmup = 3
        steps = warmup + int(rng.integers(6, 10))  # the protocol measures 6 steps or more
        ours = rng.uniform(0.6, 1.3, steps)
        hf = ours * 1.15
        hf[:warmup] += 200.0  # the first steps compile
        stalled = rng.choice(np.arange(warmup, steps), size=2, replace=False)
        hf[stalled] += rng.uniform(2.0, 4.0, 2)
        got = train_speed.per_step_ratios([_timed(ours, hf, warmup), _timed(ours * 1.01, hf, warmup)])
        assert got["pairs"] == 4 and got["steps"] == steps - warmup
        assert got["median"] == pytest.approx(1.15, rel=0.02)
        assert got["largest_step_ratio"] > 2
    assert train_speed.per_step_ratios([{"ours": {"steps": []}, "hf": {"error": "out of memory"}}]) is None


def _killed_outright() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_train_speed_child_killed_outright_fails_the_run_instead_of_hanging():
    """A run's process killed by a signal (the host's out-of-memory killer) sends no result;
    the benchmark stops naming the signal rather than waiting for ever."""
    with pytest.raises(SystemExit, match="_killed_outright failed: its process ended without a result "
                                         r"\(killed by signal 9 \(SIGKILL: out of host memory\?\)\)"):
        train_speed.isolated(_killed_outright)


@pytest.mark.parametrize("lr, min_lr, warmup, steps", [(1e-5, 0.0, 0, 20), (3e-4, 1e-5, 3, 17), (1e-3, 0.0, 2, 5)])
def test_the_hf_recipe_steps_with_vlmpacks_learning_rate_schedule(lr, min_lr, warmup, steps):
    """The HF side's learning rate at every step is the trainer's (megatron's warm-up and cosine
    schedule, `build_scheduler`), so loss curves compare like with like: transformers' own
    cosine scheduler with warm-up and a floor, stepped after each optimizer step."""
    from train.config import AdamWConfig, ScheduleConfig
    from train.trainer import build_scheduler

    def lrs(optimizer, scheduler_step) -> list[float]:
        seen = []
        for _ in range(steps + 1):  # each step's, and where the run ends: the floor
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler_step()
        return seen

    ours = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    schedule = build_scheduler(ours, AdamWConfig(lr=lr, min_lr=min_lr), ScheduleConfig(train_steps=steps, warmup_steps=warmup))
    theirs = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    hf = hf_baseline.lr_schedule(theirs, hf_baseline.Recipe(lr=lr, train_steps=steps, warmup_steps=warmup, min_lr=min_lr))
    np.testing.assert_allclose(lrs(theirs, hf.step), lrs(ours, lambda: schedule.step(increment=1)), rtol=1e-12, atol=1e-15)
    assert hf_baseline.lr_schedule(theirs, hf_baseline.Recipe(lr=lr)) is None  # no train_steps: lr throughout


def test_packed_hf_attention_hands_the_kernel_token_major_contiguous_rows(monkeypatch):
    """transformers' own flash path hands its kernels contiguous token-major q/k/v [T, H, D]."""
    seen = []

    def record(q, k, v, cu, longest, *, causal, scale):
        seen.extend((q, k, v))
        return q

    monkeypatch.setattr(hf_baseline, "packed_attention", record)
    module = torch.nn.Module()
    module.is_causal = True
    q = torch.randn(1, 4, 10, 8)  # [1, H, T, D], as transformers hands it over
    kv = torch.randn(1, 2, 10, 8)
    cu = torch.tensor([0, 6, 10], dtype=torch.int32)
    out, _ = hf_baseline.packed_hf_attention(module, q, kv, kv, None, cu_seq_lens_q=cu, max_length_q=6)
    assert [t.shape for t in seen] == [(10, 4, 8), (10, 2, 8), (10, 2, 8)]
    assert all(t.is_contiguous() for t in seen)
    assert torch.equal(seen[0], q[0].transpose(0, 1)) and out.shape == (1, 10, 4, 8)


class _LigerTarget(torch.nn.Module):
    def forward(self, x):
        return x


def test_liger_is_applied_on_its_triton_kernels(monkeypatch):
    """Liger's dispatcher reads LIGER_KERNEL_IMPL_<OP> at each call: the recipe pins every op its
    patches use to the Triton kernels before applying them (with nvidia-cutlass-dsl importable
    Liger would pick CuTe DSL kernels), and records which set ran."""
    import importlib.metadata
    import types

    seen = {}

    def apply_liger_kernel_to_qwen3_vl(model=None, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                       fused_linear_cross_entropy=True):
        seen["arguments"] = dict(rope=rope, rms_norm=rms_norm, swiglu=swiglu, cross_entropy=cross_entropy,
                                 fused_linear_cross_entropy=fused_linear_cross_entropy)
        seen["env"] = {op: os.environ.get(f"LIGER_KERNEL_IMPL_{op.upper()}") for op in hf_baseline.LIGER_TRITON_OPS}

    fake = types.ModuleType("liger_kernel.transformers")
    fake.apply_liger_kernel_to_qwen3_vl = apply_liger_kernel_to_qwen3_vl
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.8.5")
    for op in hf_baseline.LIGER_TRITON_OPS:
        monkeypatch.setenv(f"LIGER_KERNEL_IMPL_{op.upper()}", "nvidia-cutedsl")  # undone after the test
    coverage = hf_baseline.apply_liger(_LigerTarget(), "Qwen3VLForConditionalGeneration")
    assert set(hf_baseline.LIGER_TRITON_OPS) >= {"rope", "rms_norm", "swiglu", "fused_linear_cross_entropy"}
    assert seen["env"] == {op: "nvidia-triton" for op in hf_baseline.LIGER_TRITON_OPS}
    assert seen["arguments"] == dict(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                     fused_linear_cross_entropy=True)
    assert coverage.implementation == "nvidia-triton" and coverage.function == "apply_liger_kernel_to_qwen3_vl"
