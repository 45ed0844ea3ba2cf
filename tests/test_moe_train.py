"""`vlmpack train` of a Mixture-of-Experts model on CPU (`--arch tiny-moe`, 8 experts, top-2).

The loss goes down with the router's load-balancing loss on and reported; a stopped and
resumed run equals the uninterrupted one bitwise; DP=2 (gloo) gives the losses of one
process; TP > 1 is refused by name; the exported checkpoint reloads in transformers as a
Qwen3-VL MoE model.
"""

from __future__ import annotations

import numpy as np
import pytest

from shards_schema.cli import main as vlmpack
from tests.test_train import BASE, metrics, ok, run_train
from tests.test_train import shards  # noqa: F401  (the module's shard fixture)

MOE = [*(a if a != "tiny" else "tiny-moe" for a in BASE), "--moe-aux-loss-coef", "0.01"]


@pytest.fixture(scope="module")
def moe_run(shards, tmp_path_factory):  # noqa: F811
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


def test_moe_resume_equals_uninterrupted_run(shards, moe_run, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    args = [*MOE, "--data", str(shards), "--out", str(out), "--train-steps", "6", "--save-every", "3"]
    ok(run_train([*args, "--exit-interval", "3"]))
    ok(run_train([*args, "--resume"]))
    assert {m["step"]: m["loss"] for m in metrics(out)} == {m["step"]: m["loss"] for m in metrics(moe_run)}


def test_moe_data_parallel_matches_single_process(shards, moe_run, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    ok(run_train([*MOE, "--data", str(shards), "--out", str(out), "--train-steps", "3"], nproc=2))
    np.testing.assert_allclose([m["loss"] for m in metrics(out)], [m["loss"] for m in metrics(moe_run)][:3],
                               rtol=2e-5)


def test_moe_tensor_parallel_training_is_refused_by_name(shards, tmp_path, capsys):  # noqa: F811
    assert vlmpack(["train", *MOE, "--tp", "2", "--data", str(shards), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--tp 2 with a Mixture-of-Experts model" in err and "--tp 1" in err


def test_moe_export_loads_in_transformers(moe_run):
    import json

    import transformers

    config = json.loads((moe_run / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3VLMoeForConditionalGeneration"]
    model = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(moe_run / "hf")
    assert model.config.text_config.num_experts_per_tok == 2
