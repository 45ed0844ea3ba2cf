"""The README's examples run as written and print what the README says they do.

The commands are read from README.md itself: the quickstart from the first ```bash block (the
one CI runs), the five pipeline steps from every later ```bash line that starts with
`vlmpack`, and each ```python block. They run once, in order, in one scratch directory (the
quickstart's output feeds the rest, as it does for a reader), with `vlmpack` taken from this
Python's environment.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from shards_schema import open_shards
from tests.helpers.cli import process_env

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PIPELINE = ("preprocess", "inspect", "show", "verify", "pack", "train", "export-hf")
VLMPACK = [sys.executable, "-m", "shards_schema.cli"]


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block, in order."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)]


def command(line: str) -> str:
    """A shell line without its trailing comment."""
    return re.sub(r"\s+#.*$", "", line).strip()


def readme_examples() -> tuple[str, list[str], list[str]]:
    """(quickstart command, pipeline commands in README order, python blocks)."""
    blocks = fenced_blocks(README.read_text(encoding="utf-8"))
    bash = [body for lang, body in blocks if lang == "bash"]
    install = [command(line) for line in bash[0].splitlines() if line.strip()]
    assert len(install) == 2 and install[1] == "pytest", "the first bash block must stay: install && quickstart, pytest"
    quickstart = install[0].split("&&")[1].strip()
    pipeline = [command(line) for body in bash[1:] for line in body.splitlines() if line.startswith("vlmpack ")]
    python = [body for lang, body in blocks if lang == "python"]
    return quickstart, pipeline, python


def run(cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    argv = shlex.split(cmd)
    assert argv[0] == "vlmpack", cmd
    return subprocess.run([*VLMPACK, *argv[1:]], cwd=cwd, env=process_env(), capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    """Runs the quickstart, then every pipeline command; {subcommand: [(command, result)]}."""
    work = tmp_path_factory.mktemp("readme")
    quickstart, pipeline, _ = readme_examples()
    results = {"quickstart": [(quickstart, run(quickstart, work))]}
    for cmd in pipeline:
        results.setdefault(shlex.split(cmd)[1], []).append((cmd, run(cmd, work)))
    return work, results


def only(results: dict, name: str) -> tuple[str, subprocess.CompletedProcess]:
    assert len(results[name]) == 1, f"README has {len(results[name])} `vlmpack {name}` examples"
    cmd, proc = results[name][0]
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return cmd, proc


def test_readme_shows_each_pipeline_step():
    _, pipeline, python = readme_examples()
    assert [shlex.split(c)[1] for c in pipeline] == list(PIPELINE)
    assert any("pixel_values_from_patches(" in body for body in python)


def test_quickstart_writes_the_example_shards(readme_run):
    work, results = readme_run
    _, proc = only(results, "quickstart")
    assert "rows:           read 70 = written 68 + rejected 2" in proc.stdout
    assert re.search(r"^videos:\s+5 \(", proc.stdout, re.M)
    assert len(open_shards(work / "vlmpack-quickstart" / "shards")) == 68


def test_preprocess_example(readme_run):
    work, results = readme_run
    cmd, proc = only(results, "preprocess")
    assert "read 70 = written 68 + rejected 2" in proc.stdout
    assert len(open_shards(work / shlex.split(cmd)[shlex.split(cmd).index("--out") + 1])) == 68


def test_inspect_and_verify_examples(readme_run):
    _, results = readme_run
    assert re.search(r"^rows\s+68$", only(results, "inspect")[1].stdout, re.M)
    assert ": OK:" in only(results, "verify")[1].stdout


def test_show_example_saves_the_samples_images(readme_run):
    from PIL import Image

    work, results = readme_run
    cmd, proc = only(results, "show")
    argv = shlex.split(cmd)
    sample = open_shards(work / argv[2])[int(argv[argv.index("--index") + 1])]
    grids = sample["image_grid_thw"].tolist()
    assert grids, "the README's `show --save-images` example must pick a sample with images"
    pngs = sorted((work / argv[argv.index("--save-images") + 1]).glob("*.png"))
    assert len(pngs) == len(grids) == proc.stdout.count("saved image")
    for png, (_, h, w) in zip(pngs, grids):
        with Image.open(png) as image:
            assert image.size == (w * 16, h * 16)  # Qwen3-VL patches are 16 px


def test_pack_example_plans_packs(readme_run):
    work, results = readme_run
    cmd, proc = only(results, "pack")
    argv = shlex.split(cmd)
    plan = json.loads((work / argv[argv.index("--out") + 1] / "plan.json").read_text())
    stats = plan["stats"]
    assert stats["packs"] > 0 and stats["samples"] + stats["dropped_samples"] == 68  # every sample planned or reported
    assert f"dropped {stats['dropped_samples']} samples in {stats['dropped_packs']} packs" in proc.stdout


def test_train_and_export_examples(readme_run):
    import transformers

    work, results = readme_run
    cmd, proc = only(results, "train")
    argv = shlex.split(cmd)
    final = json.loads(proc.stdout.strip().splitlines()[-1])
    assert final["final_step"] == int(argv[argv.index("--train-steps") + 1])
    cmd, _ = only(results, "export-hf")
    out = work / shlex.split(cmd)[shlex.split(cmd).index("--out") + 1]
    assert (out / "model.safetensors").stat().st_size > 0
    assert transformers.AutoConfig.from_pretrained(out).model_type == "qwen3_vl"


def test_python_example_rebuilds_pixel_values(readme_run):
    work, _ = readme_run
    (body,) = [b for b in readme_examples()[2] if "pixel_values_from_patches(" in b]
    proc = subprocess.run([sys.executable, "-c", body], cwd=work, env=process_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shards = re.search(r'open_shards\("([^"]+)"\)', body).group(1)
    sample = open_shards(work / shards)[int(re.search(r"shards\[(\d+)\]", body).group(1))]
    patches = int(sum(t * h * w for t, h, w in sample["image_grid_thw"].tolist()))
    assert patches > 0
    assert f"({patches}, 1536) float32" in proc.stdout
