"""The training recipes (train/recipes/*.yaml): each loads as a `--config`, its dry run fits the
GPUs its header names in the layout the recipe sets, and the docs list it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shards_schema.cli import main as vlmpack
from train.config import load_config_file

RECIPES = sorted((Path(__file__).resolve().parents[1] / "train" / "recipes").glob("*.yaml"))
DOCS = Path(__file__).resolve().parents[1] / "docs" / "training.md"


def header(path: Path) -> dict[str, str]:
    return dict(re.findall(r"^# (gpus|arch): (.+)$", path.read_text(), re.MULTILINE))


def test_there_are_recipes():
    assert len(RECIPES) >= 6


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_fits_its_gpus_in_its_own_layout(path, capsys):
    fields = header(path)
    gpus, gib = re.fullmatch(r"(\d+) x (\d+)", fields["gpus"]).groups()
    config = load_config_file(path)
    assert "arch" not in config, "the model comes from the command line (--hf-model / --init)"
    code = vlmpack(["train", "--dry-run", "--config", str(path), "--arch", fields["arch"], "--gpus", gpus,
                    "--gpu-memory-gib", gib])
    out = capsys.readouterr().out
    assert code == 0, out
    tp, pp = config.get("tp", 1), config.get("pp", 1)
    dp = int(gpus) // (tp * pp)
    assert f"on {gpus} GPU(s) as tp {tp} x pp {pp} x dp {dp}" in out
    assert f", fits in 95% of {float(gib):.1f} GiB per GPU" in out
    # the docs' table gives this plan's figure
    largest = re.search(r"largest stage: ([\d.]+) GiB", out).group(1)
    row = next(line for line in DOCS.read_text().splitlines() if line.startswith(f"| [`train/recipes/{path.name}`"))
    assert f"| {largest} GiB" in row, (largest, row)


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_is_listed_in_the_training_docs(path):
    assert f"train/recipes/{path.name}" in DOCS.read_text()
