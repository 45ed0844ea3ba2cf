"""`vlmpack train` of a Mixture-of-Experts model on CPU (`--arch tiny-moe`, 8 experts, top-2).

The loss goes down with the router's load-balancing loss on and reported; a stopped and
resumed run equals the uninterrupted one bitwise; DP=2, with or without the experts split
over the ranks (EP=2), TP=2 with sequence parallelism, and TP=2 x EP=2 x DP=2 give the losses
of one process (gloo); the exported checkpoint reloads in transformers as a Qwen3-VL MoE model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shards_schema.cli import main as vlmpack
from tests.helpers.train import BASE, metrics, ok, run_train

MOE = [*(a if a != "tiny" else "tiny-moe" for a in BASE), "--moe-aux-loss-coef", "0.01"]


@pytest.fixture(scope="module")
def moe_run(shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe-full")
    ok(run_train([*MOE, "--data", str(shards), "--out", str(out), "--train-steps", "6", "--save-every", "3",
                  "--export-hf", str(out / "hf")]))
    return out


def test_moe_loss_decreases_and_reports_load_balance(moe_run):
    steps = metrics(moe_run)
    assert steps[-1]["loss"] < steps[0]["loss"]
    balance = [m["moe_load_balancing_loss"] for m in steps]
    # HF's units: k (= 2) when the routing is uniform, up to E (= 8) when one expert takes all
    assert all(1.9 < b < 8 for b in balance), balance


def test_moe_resume_equals_uninterrupted_run(shards, moe_run, tmp_path):
    out = tmp_path / "run"
    args = [*MOE, "--data", str(shards), "--out", str(out), "--train-steps", "6", "--save-every", "3"]
    ok(run_train([*args, "--exit-interval", "3"]))
    ok(run_train([*args, "--resume"]))
    assert {m["step"]: m["loss"] for m in metrics(out)} == {m["step"]: m["loss"] for m in metrics(moe_run)}


def test_moe_data_parallel_matches_single_process(shards, moe_run, tmp_path):
    out = tmp_path / "run"
    ok(run_train([*MOE, "--data", str(shards), "--out", str(out), "--train-steps", "3"], nproc=2))
    np.testing.assert_allclose([m["loss"] for m in metrics(out)], [m["loss"] for m in metrics(moe_run)][:3],
                               rtol=2e-5)


def test_moe_expert_parallel_matches_single_process_and_resumes(shards, moe_run, tmp_path):
    """DP=2 with the experts split over the two ranks (EP=2, megatron's all-to-all dispatcher
    over gloo): the same losses as one process holding every expert; each rank saves its own
    experts, a stopped run resumes to the same losses, and the checkpoint exports whole."""
    out = tmp_path / "run"
    args = [*MOE, "--ep", "2", "--data", str(shards), "--out", str(out), "--train-steps", "6", "--save-every", "3"]
    ok(run_train([*args, "--exit-interval", "3"], nproc=2))
    ok(run_train([*args, "--resume", "--export-hf", str(tmp_path / "hf")], nproc=2))
    np.testing.assert_allclose([m["loss"] for m in metrics(out)], [m["loss"] for m in metrics(moe_run)], rtol=2e-5)
    np.testing.assert_allclose([m["moe_load_balancing_loss"] for m in metrics(out)],
                               [m["moe_load_balancing_loss"] for m in metrics(moe_run)], rtol=2e-5)
    model = out / "checkpoints" / "step_00000006" / "model"
    assert sorted(p.name for p in model.glob("*.safetensors")) == ["experts_pp0_ep0.safetensors",
                                                                    "experts_pp0_ep1.safetensors",
                                                                    "model_tp0_pp0.safetensors"]
    from safetensors.torch import load_file
    ours = load_file(str(tmp_path / "hf" / "model.safetensors"))
    single = load_file(str(moe_run / "hf" / "model.safetensors"))
    assert ours.keys() == single.keys()
    for key, value in ours.items():
        np.testing.assert_allclose(value.numpy(), single[key].numpy(), rtol=1e-4, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("extra, message", [
    (["--ep", "3"], "--ep 3 must divide the 8 experts"),
    (["--arch", "tiny", "--ep", "2"], "--ep 2: expert parallelism needs a Mixture-of-Experts model"),
    (["--tp", "2"], "--tp 2 x --pp 1 needs a multiple of 2 processes, this run has 1"),
    (["--ep", "4", "--tp", "2", "--gpus", "2", "--dry-run"], "--gpus 2 is not a multiple of --tp 2 x --pp 1 and of --pp 1 x --ep 4"),
])
def test_expert_parallel_settings_that_cannot_run_exit_2(shards, tmp_path, capsys, extra, message):
    assert vlmpack(["train", *MOE, *extra, "--data", str(shards), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_moe_tensor_parallel_with_sequence_parallelism_matches_single_process(shards, moe_run, tmp_path):
    """TP=2 (gloo): megatron's MoE layers train under TP only with the rows split over the TP
    ranks, which is on by default for MoE models. Each rank routes its own rows through
    experts that both ranks hold whole, so their gradients are summed over the ranks and
    counted once in the norm; the packs get a padding row where their length is odd, which the
    router leaves out of the load-balancing loss. Losses, the balance loss and the gradient
    norms are those of one process."""
    out = tmp_path / "run"
    ok(run_train([*MOE, "--tp", "2", "--data", str(shards), "--out", str(out), "--train-steps", "6", "--save-every", "3"],
                 nproc=2))
    for key in ("loss", "moe_load_balancing_loss", "grad_norm"):
        np.testing.assert_allclose([m[key] for m in metrics(out)], [m[key] for m in metrics(moe_run)], rtol=2e-5,
                                   err_msg=key)


def test_moe_tensor_and_expert_parallel_with_data_parallel_matches_single_process(shards, moe_run, tmp_path):
    """TP=2 x EP=2 x DP=2 on four processes (gloo): the two ranks of a TP group hold different
    experts and exchange their rows' tokens (all-to-all over the TP group's ranks), the two
    DP replicas reduce the experts they share. Losses, balance loss and gradient norms are one
    process's; the checkpoint holds each TP rank's tensors and each EP rank's experts once,
    a stopped run resumes to the same losses, and it exports the single process's weights."""
    out = tmp_path / "run"
    args = [*MOE, "--tp", "2", "--ep", "2", "--data", str(shards), "--out", str(out), "--train-steps", "6",
            "--save-every", "3"]
    ok(run_train([*args, "--exit-interval", "3"], nproc=4))
    ok(run_train([*args, "--resume", "--export-hf", str(tmp_path / "hf")], nproc=4))
    for key in ("loss", "moe_load_balancing_loss", "grad_norm"):
        np.testing.assert_allclose([m[key] for m in metrics(out)], [m[key] for m in metrics(moe_run)], rtol=2e-5,
                                   err_msg=key)
    model = out / "checkpoints" / "step_00000006" / "model"
    assert sorted(p.name for p in model.glob("*.safetensors")) == [
        "experts_pp0_ep0.safetensors", "experts_pp0_ep1.safetensors",
        "model_tp0_pp0.safetensors", "model_tp1_pp0.safetensors"]
    from safetensors.torch import load_file
    ours = load_file(str(tmp_path / "hf" / "model.safetensors"))
    single = load_file(str(moe_run / "hf" / "model.safetensors"))
    assert ours.keys() == single.keys()
    for key, value in ours.items():
        np.testing.assert_allclose(value.numpy(), single[key].numpy(), rtol=1e-4, atol=1e-6, err_msg=key)


def test_moe_lora_under_tensor_parallelism_matches_single_process(shards, tmp_path):
    """LoRA on the attention of a MoE model at TP=2 (sequence parallelism on): the adapters
    gather or scatter their rank-r hidden with the hosts' rows; losses and gradient norms are
    those of one process."""
    args = [*MOE, "--lora-rank", "4", "--lr", "1e-2", "--data", str(shards), "--train-steps", "3"]
    ok(run_train([*args, "--out", str(tmp_path / "one")]))
    ok(run_train([*args, "--out", str(tmp_path / "tp2"), "--tp", "2"], nproc=2))
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([m[key] for m in metrics(tmp_path / "tp2")], [m[key] for m in metrics(tmp_path / "one")],
                                   rtol=2e-5, err_msg=key)


def test_moe_tensor_parallel_without_sequence_parallelism_is_refused(shards, tmp_path, capsys):
    assert vlmpack(["train", *MOE, "--tp", "2", "--sequence-parallel", "false", "--data", str(shards),
                    "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--tp 2 with a Mixture-of-Experts model needs sequence parallelism" in err


def test_moe_export_loads_in_transformers(moe_run):
    import json

    import transformers

    config = json.loads((moe_run / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3VLMoeForConditionalGeneration"]
    model = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(moe_run / "hf")
    assert model.config.text_config.num_experts_per_tok == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_grouped_gemm_equals_one_gemm_per_expert():
    """The experts' CUDA path (torch._grouped_mm) against their per-expert loop, bf16, with
    experts that get no rows: the same outputs and weight gradients up to bf16 rounding."""
    from train.model.arch import builtin_arch
    from train.model.moe import TorchGroupedMLP
    from train.model.qwen_vl import transformer_config
    from train.parallel import destroy_parallel, init_parallel

    init_parallel(1, 1, device="cuda")
    try:
        arch = builtin_arch("tiny-moe")
        experts = TorchGroupedMLP(8, transformer_config(arch, params_dtype=torch.bfloat16, bf16=True)).cuda()
        counts = torch.tensor([5, 0, 17, 3, 0, 40, 1, 14])
        x = torch.randn(int(counts.sum()), 64, device="cuda", dtype=torch.bfloat16)
        probs = torch.rand(len(x), device="cuda")
        results = {}
        for per_expert in (False, True):
            experts.per_expert = per_expert
            experts.zero_grad(set_to_none=True)
            out, _ = experts(x, counts, probs)
            out.float().square().sum().backward()
            results[per_expert] = (out.float(), experts.weight1.grad.float(), experts.weight2.grad.float())
        for got, want in zip(results[False], results[True]):
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        assert results[False][1].view(8, 64, -1)[1].abs().max() == 0  # no rows, no gradient
    finally:
        destroy_parallel()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_moe_trains_and_resumes(shards, tmp_path):
    """bf16, compiled, the all-to-all dispatcher and grouped GEMMs on a GPU."""
    from tests.helpers.train import GPU

    args = [*MOE, *GPU, "--data", str(shards), "--train-steps", "6", "--save-every", "3"]
    ok(run_train([*args, "--out", str(tmp_path / "full")]))
    steps = metrics(tmp_path / "full")
    assert steps[-1]["loss"] < steps[0]["loss"] and all(1.9 < m["moe_load_balancing_loss"] < 8 for m in steps)
    ok(run_train([*args, "--out", str(tmp_path / "part"), "--exit-interval", "3"]))
    ok(run_train([*args, "--out", str(tmp_path / "part"), "--resume"]))
    np.testing.assert_allclose([m["loss"] for m in metrics(tmp_path / "part")][-3:],
                               [m["loss"] for m in steps][-3:], rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("gpus, layout, files, dense_written", [
    (2, ["--ep", "2"], ["pp0_tp0_ep0", "pp0_tp0_ep1"], [True, False]),
    (4, ["--tp", "2", "--ep", "2"], ["pp0_tp0_ep0", "pp0_tp1_ep1"], [True, True]),
], ids=["ep2", "tp2-ep2-dp2"])
def test_gpu_expert_parallel_with_distributed_optimizer_saves_each_ranks_experts_and_resumes(
        shards, tmp_path, gpus, layout, files, dense_written):
    """megatron's distributed optimizer (bf16 gradients and moments, the fast step) under EP=2
    on two GPUs and TP=2 x EP=2 x DP=2 on four: the dense parameters' state is split over the
    data-parallel ranks, the experts' over the ranks that hold the same ones (a chained
    optimizer). The background save's parameter state equals megatron's own gather on every
    rank; the first DP rank of each TP rank writes the dense state and the first holder of
    each expert-parallel rank's experts writes theirs, one file per such rank; a stopped run
    resumes to the uninterrupted run's losses, which equal those of the same run without the
    distributed optimizer."""
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA GPUs")
    from tests.helpers.train import COMPARE_PARAMETER_STATE, GPU

    args = [*MOE, *GPU, *layout, "--grad-dtype", "bf16", "--adam-state-dtype", "bf16", "--data", str(shards),
            "--train-steps", "6", "--save-every", "3"]
    full, part, plain = tmp_path / "full", tmp_path / "part", tmp_path / "plain"
    proc = ok(run_train([*args, "--out", str(full)], nproc=gpus, code=COMPARE_PARAMETER_STATE))
    assert proc.stdout.count("parameter state of step 3: same") == gpus, proc.stdout[-2000:]
    ckpt = full / "checkpoints" / "step_00000003"
    saved = sorted(ckpt.glob("optimizer_param_state_*.pt"))
    assert [f.name for f in saved] == [f"optimizer_param_state_{name}.pt" for name in files]
    (dense0, experts0), (dense1, experts1) = (torch.load(f, weights_only=False) for f in saved)
    assert [dense0 is not None, dense1 is not None] == dense_written
    moments = [next(iter(s[0].values()))["exp_avg"] for s in (experts0, experts1)]  # buffer 0, its one dtype
    assert moments[0].shape == moments[1].shape and not torch.equal(*moments)  # each rank's own experts
    ok(run_train([*args, "--out", str(part), "--exit-interval", "3"], nproc=gpus))
    ok(run_train([*args, "--out", str(part), "--resume"], nproc=gpus))
    ok(run_train([*args, "--out", str(plain), "--distributed-optimizer", "false"], nproc=gpus))
    losses = [m["loss"] for m in metrics(full)]
    assert [m["step"] for m in metrics(part)] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([m["loss"] for m in metrics(part)], losses, rtol=2e-2)
    np.testing.assert_allclose([m["loss"] for m in metrics(plain)], losses, rtol=2e-2)
