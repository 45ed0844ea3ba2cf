"""`vlmpack train` refuses in one line (exit 2) before it builds anything: `--device cuda` where
no CUDA device is, the data of a `--dry-run` that a run would refuse, a `--config` file that
gives a setting twice. `--config` and `--chat-template` files are refused alike (one reader)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from shards_schema.cli import main as vlmpack
from train.model.arch import builtin_arch
from tests.helpers.damage import one_error_line
from tests.helpers.shards import preprocess

SEQ_LEN = 512
RUN = ["--global-batch-packs", "1", "--num-workers", "0", "--tensorboard", "false", "--train-steps", "1"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return preprocess(tmp_path_factory.mktemp("data"), "shards", rows=8, seq_len=SEQ_LEN, size_range=(32, 48))


def train(args: list[str], capsys) -> tuple[int, str]:
    """`vlmpack train ARGS` in this process: its exit code and its stderr."""
    capsys.readouterr()
    code = vlmpack(["train", *args])
    return code, capsys.readouterr().err


def test_device_cuda_without_a_cuda_device_exits_2_saying_to_run_on_cpu(shards, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err = train(["--arch", "tiny", "--seq-len", str(SEQ_LEN), *RUN, "--device", "cuda", "--data", str(shards),
                       "--out", str(tmp_path / "run")], capsys)
    line = one_error_line(err, "train")
    assert code == 2 and "--device cuda: no CUDA device is available" in line and "run with --device cpu" in line, line
    assert not (tmp_path / "run").exists()


# a --dry-run's data that a run refuses before it builds the model ({shards}: intact shards of
# the tiny Qwen3-VL, {missing}: no such directory), and what the one line says
DRY_RUN_DATA = {
    "a missing directory": (["--arch", "tiny", "--data", "{missing}"], "{missing}: no such directory"),
    "a missing eval directory": (["--arch", "tiny", "--data", "{shards}", "--eval-data", "{missing}", "--eval-every",
                                  "1"], "{missing}: no such directory"),
    "shards of another model family": (["--arch", "tiny-qwen2.5", "--data", "{shards}"],
                                       "{shards}: shards were preprocessed for another model: family 'qwen3-vl' "
                                       "(model: 'qwen2.5-vl')"),
    # it made a local directory `s3:/bucket/cache` and fetched the store's sources into it
    "a data cache on a store": (["--arch", "tiny", "--data", "{shards}", "--data-cache", "s3://bucket/cache"],
                                "--data-cache s3://bucket/cache is a URL: the cache is a local directory"),
    "a data cache for local sources only": (["--arch", "tiny", "--data", "{shards}", "--data-cache", "{missing}"],
                                            "--data-cache {missing} holds copies of object-store sources (s3://, "
                                            "gs://, hf://), and every --data / --eval-data here is local"),
    "mixing weights all 0": (["--arch", "tiny", "--data", "{shards}:0"],
                             "mixing weights must be finite, >= 0 and not all 0, got [0.0]"),
    "an export target that is a file": (["--arch", "tiny", "--data", "{shards}", "--export-hf", "{file}"],
                                        "--export-hf {file} is a file, not a directory"),
    "every part frozen": (["--arch", "tiny", "--data", "{shards}", "--freeze", "vision,merger", "--freeze", "llm"],
                          "--freeze vision,merger,llm freezes every part of the model: nothing would be trained"),
    "a shard file cut short": (["--arch", "tiny", "--data", "{truncated}"],
                               "bytes on disk, the manifest says"),
    "a source whose rows were all rejected": (["--arch", "tiny", "--data", "{shards}", "--data", "{no_samples}"],
                                              "{no_samples}: holds no samples (its preprocessing wrote none"),
    "FA4 on CPU": (["--arch", "tiny", "--data", "{shards}", "--attention", "fa4", "--device", "cpu"],
                   "--attention fa4 runs on a CUDA GPU"),
    "a frozen vision tower recomputed": (["--arch", "tiny", "--data", "{shards}", "--freeze", "vision", "--recompute",
                                          "full", "--recompute-vision-blocks", "2"],
                                         "--freeze vision gives them none: drop --recompute-vision-blocks"),
    "a frozen vision tower recomputed, all blocks": (["--arch", "tiny", "--data", "{shards}", "--freeze", "vision",
                                                      "--recompute-vision", "true"],
                                                     "--freeze vision gives them none: drop --recompute-vision"),
    "a router loss for a dense model": (["--arch", "tiny", "--data", "{shards}", "--moe-aux-loss-coef", "0.01"],
                                        "--moe-aux-loss-coef 0.01 weighs a Mixture-of-Experts router's load-balancing "
                                        "loss; qwen3-vl here is dense"),
    "sequence parallelism without TP": (["--arch", "tiny", "--data", "{shards}", "--sequence-parallel", "true"],
                                        "--sequence-parallel true splits the rows over the ranks of a TP group: with "
                                        "--tp 1 there is none"),
    # settings that would change nothing
    "a source named twice": (["--arch", "tiny", "--data", "{shards}", "--data", "{shards}/"],
                             "source {shards}/ is the same directory as {shards}: its samples would be drawn twice "
                             "per epoch"),
    "a vision tower LoRA leaves frozen, recomputed": (["--arch", "tiny", "--data", "{shards}", "--lora-rank", "4",
                                                       "--recompute", "full", "--recompute-vision", "true"],
                                                      "and LoRA (the tower is in neither --lora-parts nor "
                                                      "--lora-modules-to-save) gives them none: drop --recompute-vision"),
    "--freeze beside LoRA": (["--arch", "tiny", "--data", "{shards}", "--lora-rank", "4", "--freeze", "vision"],
                             "--freeze vision with --lora-rank: LoRA freezes every part outside --lora-parts and "
                             "--lora-modules-to-save already, so it would change nothing: drop --freeze"),
    "FP8 with LoRA": (["--arch", "tiny", "--data", "{shards}", "--lora-rank", "4", "--fp8", "tensorwise"],
                      "--fp8 tensorwise runs the trained decoder linears' GEMMs in FP8, and LoRA leaves the decoder's "
                      "linears frozen (they stay bf16), so it would change nothing: drop --fp8"),
    "FP8 with the decoder frozen": (["--arch", "tiny", "--data", "{shards}", "--freeze", "llm", "--fp8", "rowwise"],
                                    "and --freeze llm leaves the decoder's linears frozen"),
    "evaluation batches without evaluations": (["--arch", "tiny", "--data", "{shards}", "--eval-batches", "8"],
                                               "--eval-batches 8 sizes the evaluations of --eval-every N, and this "
                                               "run has none"),
}


def test_a_saved_config_holding_the_former_default_eval_batches_is_read():
    """Configs saved before --eval-batches had a default of its own hold 4 without --eval-every."""
    from train.config import TrainConfig

    TrainConfig.from_flat(dict(data=["d"], arch="tiny", seq_len=4096, out="o", eval_batches=4)).schedule.validate()


def test_global_batch_tokens_under_half_a_pack_is_refused_naming_the_least_that_gives_one():
    from train.config import ConfigError, TrainConfig

    flat = dict(data=["d"], arch="tiny", seq_len=4096, out="o")
    with pytest.raises(ConfigError, match=r"--global-batch-tokens 2048 rounds to no pack of --seq-len 4096: give at "
                                          r"least 2049 \(one pack\)"):
        TrainConfig.from_flat({**flat, "global_batch_tokens": 2048}).data.validate()
    assert TrainConfig.from_flat({**flat, "global_batch_tokens": 2049}).data.global_packs(1) == 1
    assert TrainConfig.from_flat({**flat, "global_batch_tokens": 10_000}).data.global_packs(1) == 2


@pytest.mark.parametrize("case", list(DRY_RUN_DATA))
def test_dry_run_refuses_the_data_a_run_refuses_with_the_same_line(shards, tmp_path, capsys, case):
    extra, says = DRY_RUN_DATA[case]
    paths = {"shards": str(shards), "missing": str(tmp_path / "missing"), "file": str(tmp_path / "file"),
             "truncated": str(tmp_path / "truncated"), "no_samples": str(tmp_path / "no_samples")}
    (tmp_path / "file").write_text("a file")
    if "{no_samples}" in extra:  # preprocessed from rows that are all rejected: a manifest, no shard
        (tmp_path / "bad.jsonl").write_text('{"messages": 5}\n' * 3)
        assert vlmpack(["preprocess", str(tmp_path / "bad.jsonl"), "--out", paths["no_samples"], "--profile",
                        "qwen3-vl", "--workers", "1", "--no-progress"]) == 1
    if "{truncated}" in extra:
        shutil.copytree(shards, tmp_path / "truncated")
        shard = sorted((tmp_path / "truncated").glob("*.arrow"))[-1]
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    extra = [arg.format(**paths) for arg in extra]
    dry_code, dry_err = train(["--dry-run", "--seq-len", str(SEQ_LEN), *extra], capsys)
    run_code, run_err = train(["--seq-len", str(SEQ_LEN), *RUN, *extra, "--out", str(tmp_path / "run")], capsys)
    dry_line, run_line = one_error_line(dry_err, "train"), one_error_line(run_err, "train")
    assert dry_code == run_code == 2 and dry_line == run_line, (dry_line, run_line)
    assert says.format(**paths) in dry_line, dry_line


def test_dry_run_plans_on_a_webdataset_export_and_refuses_one_missing_a_tar(shards, tmp_path, capsys):
    """An export (tars and index.json, no manifest.json or shard files) is a training source:
    --dry-run stats its tars as index.json lists them, not the exported directory's shards."""
    tars = tmp_path / "tars"
    assert vlmpack(["export", str(shards), "--out", str(tars), "--samples-per-tar", "3"]) == 0
    code, err = train(["--dry-run", "--seq-len", str(SEQ_LEN), "--arch", "tiny", "--data", str(tars)], capsys)
    assert code == 0, err
    last = sorted(tars.glob("*.tar"))[-1]
    last.write_bytes(last.read_bytes()[:512])
    code, err = train(["--dry-run", "--seq-len", str(SEQ_LEN), "--arch", "tiny", "--data", str(tars)], capsys)
    line = one_error_line(err, "train")
    assert code == 2 and f"{last}: 512 bytes, index.json says" in line and "export the shard directory again" in line
    last.unlink()
    code, err = train(["--dry-run", "--seq-len", str(SEQ_LEN), "--arch", "tiny", "--data", str(tars)], capsys)
    assert code == 2 and f"{last}: listed in index.json but missing" in one_error_line(err, "train")


def test_an_empty_out_or_config_file_is_refused_before_anything_is_written(shards, tmp_path, capsys, monkeypatch):
    """An unset shell variable (`--out "$OUT"`) would train into the current directory; an empty
    --config file would run on the defaults it meant to replace."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    for extra, says in ((["--out", ""], "--out is given as an empty string (''): give the run directory"),
                        (["--out", "run", "--export-hf", " "], "--export-hf is given as an empty string"),
                        (["--out", "run", "--config", "empty.yaml"], "--config empty.yaml holds no settings")):
        code, err = train(["--arch", "tiny", "--seq-len", str(SEQ_LEN), *RUN, "--data", str(shards), *extra], capsys)
        assert code == 2 and says in one_error_line(err, "train"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.yaml"]


def test_a_store_url_missing_its_slashes_is_refused_before_anything_is_written(shards, tmp_path, capsys, monkeypatch):
    """`--out s3:/bucket/run` (one slash) would train into a local directory named `s3:`; a source
    written so would be looked for there. Each refused in one line giving the URL as meant."""
    monkeypatch.chdir(tmp_path)
    base = ["--arch", "tiny", "--seq-len", str(SEQ_LEN), *RUN]
    for extra, says in ((["--data", str(shards), "--out", "s3:/bucket/run"], "--out 's3:/bucket/run' is not a URL"),
                        (["--data", "gs:bkt/shards:0.5", "--out", "run"], "write gs://bkt/shards:0.5"),
                        (["--data", str(shards), "--eval-data", "hf:/datasets/o/n", "--out", "run"],
                         "--eval-data 'hf:/datasets/o/n' is not a URL"),
                        (["--data", "s3://b/shards", "--data-cache", "s3:/b/cache", "--out", "run"],
                         "--data-cache 's3:/b/cache' is not a URL"),
                        (["--data", str(shards), "--out", "run", "--export-hf", "s3:/b/hf"], "write s3://b/hf")):
        code, err = train([*base, *extra], capsys)
        assert code == 2 and says in one_error_line(err, "train"), err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_token_id_outside_the_models_vocabulary_stops_the_run_naming_the_row(shards, tmp_path, capsys, workers):
    """A shard consistent with its manifest whose row holds a token id past the embedding's
    table (or negative) would index out of it: named in one line, shard, row and fix, whether
    the pack was read in the training process or in a DataLoader worker. The run trained
    nothing: its new --out (and the parent it made) goes again."""
    from tests.helpers.shards import rewrite_shard

    data = Path(shutil.copytree(shards, tmp_path / "data"))
    vocab = builtin_arch("tiny").lm.vocab_size
    bad_id = vocab if workers == "0" else -1

    def damage(samples):  # every row: whichever pack comes first holds one
        for sample in samples:
            sample.input_ids = sample.input_ids.copy()
            sample.input_ids[3] = bad_id

    for k in range(len(json.loads((data / "manifest.json").read_text())["shards"])):
        rewrite_shard(data, k, damage)
    code, err = train(["--arch", "tiny", "--seq-len", str(SEQ_LEN), *RUN, "--num-workers", workers, "--data", str(data),
                       "--out", str(tmp_path / "runs" / "run")], capsys)
    line = one_error_line(err, "train")
    assert code == 2 and re.search(rf"{re.escape(str(data))}/shard-\d+\.arrow row \d+: \[token_id\] token 3 has id "
                                   rf"{bad_id}, outside the model's vocabulary 0\.\.{vocab - 1} \(1 such\)", line), err
    assert "vlmpack verify" in line
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("out_exists", [False, True])
def test_a_run_refused_in_setup_leaves_its_out_as_it_found_it(shards, tmp_path, capsys, monkeypatch, out_exists):
    """--wandb-project without a Weights & Biases login stops the run at the end of its setup,
    after it wrote its plans, config and metrics file: none of them stays, nor a --out it made,
    nor the parent it made for it; an empty --out the user gave stays, empty."""
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc holding a key
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "runs" / "run"
    if out_exists:
        out.mkdir(parents=True)
    code, err = train(["--arch", "tiny", "--seq-len", str(SEQ_LEN), *RUN, "--data", str(shards), "--out", str(out),
                       "--wandb-project", "vlmpack-tests"], capsys)
    line = one_error_line(err, "train")
    assert code == 2 and "--wandb-project vlmpack-tests: Weights & Biases did not start" in line, err
    assert (out.is_dir() and not any(out.iterdir())) if out_exists else not (tmp_path / "runs").exists()


def test_a_gpu_size_without_a_plan_is_refused(shards, tmp_path, capsys):
    """--gpu-memory-gib sizes the plan of --dry-run and --recompute auto; a run with neither is
    refused rather than run as if it were not given."""
    base = ["--arch", "tiny", "--seq-len", str(SEQ_LEN), *RUN, "--data", str(shards), "--gpu-memory-gib", "40"]
    code, err = train([*base, "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and "--gpu-memory-gib 40 sizes the memory plan of --dry-run and --recompute auto; this run has " \
        "neither" in one_error_line(err, "train"), err
    assert train([*base, "--dry-run"], capsys)[0] == 0
    assert train([*base, "--recompute", "auto", "--out", str(tmp_path / "auto")], capsys)[0] == 0


def test_dry_run_refuses_the_out_and_the_resume_a_run_refuses_with_the_same_line(shards, tmp_path, capsys):
    """--out and the checkpoint a --resume continues are checked by a --dry-run as by the run: a
    file, a run's directory without --resume, a checkpoint of another architecture or kind."""
    run, file = tmp_path / "run", tmp_path / "file"
    file.write_text("a file")
    assert train(["--arch", "tiny", "--seq-len", str(SEQ_LEN), *RUN, "--data", str(shards), "--out", str(run)],
                 capsys)[0] == 0
    cases = [
        (["--arch", "tiny", "--out", str(file)], f"--out {file} is a file, not a directory"),
        (["--arch", "tiny", "--out", str(file / "run")], f"--out {file / 'run'}: a file stands in the path"),
        (["--arch", "tiny", "--out", str(run)], f"--out {run} holds the checkpoints of an earlier run"),
        (["--arch", "tiny-moe", "--out", str(run), "--resume"], "its model is not the one --arch tiny-moe builds"),
        (["--arch", "tiny", "--out", str(run), "--resume", "--lora-rank", "4"],
         "holds a full fine-tuning run's model, not LoRA adapters: resume it without --lora-rank"),
    ]
    for extra, says in cases:
        dry_code, dry_err = train(["--dry-run", "--seq-len", str(SEQ_LEN), *RUN, "--data", str(shards), *extra],
                                  capsys)
        run_code, run_err = train(["--seq-len", str(SEQ_LEN), *RUN, "--data", str(shards), *extra], capsys)
        dry_line, run_line = one_error_line(dry_err, "train"), one_error_line(run_err, "train")
        assert dry_code == run_code == 2 and dry_line == run_line, (dry_line, run_line)
        assert says in dry_line, dry_line


def test_dry_run_refuses_a_seq_len_that_a_sample_of_the_data_certainly_exceeds(shards, capsys, tmp_path):
    """A shard whose samples average more tokens than --seq-len holds one that fits no pack: the
    run refuses it (when it plans the packs), and so does --dry-run, from the manifest alone."""
    manifest = json.loads((shards / "manifest.json").read_text())
    shard = max(manifest["shards"], key=lambda s: s["tokens"] / s["rows"])
    short = math.ceil(shard["tokens"] / shard["rows"]) - 1
    code, err = train(["--dry-run", "--arch", "tiny", "--seq-len", str(short), "--data", str(shards)], capsys)
    line = one_error_line(err, "train")
    assert code == 2 and (f"shard {shard['file']} holds {shard['rows']} samples of {shard['tokens']} tokens, "
                          f"{short + 1} on average, so at least one is longer than --seq-len {short}") in line, line
    assert f"use --seq-len >= {SEQ_LEN} (the --max-seq-len it was preprocessed with)" in line, line
    code, err = train(["--arch", "tiny", "--seq-len", str(short), *RUN, "--data", str(shards), "--out",
                       str(tmp_path / "run")], capsys)
    assert code == 2 and f"longer than --seq-len {short}" in one_error_line(err, "train")
    # the data's own length, and no data at all, plan as before
    assert train(["--dry-run", "--arch", "tiny", "--seq-len", str(SEQ_LEN), "--data", str(shards)], capsys)[0] == 0
    assert train(["--dry-run", "--arch", "tiny", "--seq-len", str(short)], capsys)[0] == 0


@pytest.mark.parametrize("name, text, says", [
    ("run.yaml", "seq-len: 512\nlr: 1.0e-4\nseq_len: 1024\n", "seq_len is given as 'seq-len' and 'seq_len': keep one"),
    ("run.json", '{"seq_len": 512, "seq-len": 1024}', "seq_len is given as 'seq_len' and 'seq-len': keep one"),
    ("run.yaml", "lr: 1.0e-4\nlr: 2.0e-4\n", "lr is given as 'lr' twice: keep one"),
    ("run.json", '{"lr": 1e-4, "lr": 2e-4}', "lr is given as 'lr' twice: keep one"),
], ids=["YAML two spellings", "JSON two spellings", "YAML one key twice", "JSON one key twice"])
def test_a_config_file_giving_a_setting_twice_exits_2_naming_both(shards, tmp_path, capsys, name, text, says):
    (tmp_path / name).write_text(text)
    code, err = train(["--config", str(tmp_path / name), "--arch", "tiny", *RUN, "--data", str(shards), "--out",
                       str(tmp_path / "run")], capsys)
    line = one_error_line(err, "train")
    assert code == 2 and f"--config {tmp_path / name}: {says}" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("text, flags, says", [
    ("lr: -1\n", [], "--lr must be in (0, 1], got -1.0 (lr is set in --config {path})"),
    ("lr: -1\n", ["--lr", "-2"], "--lr must be in (0, 1], got -2.0"),
    ("tp: 2\nsequence_parallel: true\n", ["--tp", "1"],
     "--sequence-parallel true splits the rows over the ranks of a TP group: with --tp 1 there is none; drop it, or "
     "give --tp N (sequence_parallel is set in --config {path})"),
], ids=["set in the file", "overridden by the flag", "one of two set in the file"])
def test_a_bad_value_a_config_file_set_names_the_file_too(shards, tmp_path, capsys, text, flags, says):
    """A value the run refuses is named by its flag; where it came from the --config file (not a
    flag on the command line), the line says so, so the user edits the right place."""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    code, err = train(["--config", str(path), "--arch", "tiny", *RUN, "--data", str(shards), "--out",
                       str(tmp_path / "run"), *flags], capsys)
    line = one_error_line(err, "train")
    assert code == 2 and line.endswith(says.format(path=path)), line
    assert flags or "--config" in line


def _alias_bomb() -> str:
    """A YAML list of 9^9 items in 300 bytes: each level's anchor repeated nine times by the next."""
    levels = ["&l0 [x, x, x, x, x, x, x, x, x]"]
    levels += [f"&l{k} [{', '.join([f'*l{k - 1}'] * 9)}]" for k in range(1, 9)]
    return f"[{', '.join(levels)}]"


@pytest.mark.parametrize("text, says", [
    (f"lr: {_alias_bomb()}\n", "lr: expected a number, got [["),
    (f"freeze: {_alias_bomb()}\n", "freeze: expected a list of names, got [["),
], ids=["a number", "a list"])
def test_a_yaml_alias_bomb_is_one_short_line(shards, tmp_path, capsys, text, says):
    """A value of billions of items made by YAML aliases is named, cut short, in one line; it
    is never spelled out (which took gigabytes and ended in a MemoryError)."""
    (tmp_path / "run.yaml").write_text(text)
    code, err = train(["--config", str(tmp_path / "run.yaml"), "--arch", "tiny", *RUN, "--data", str(shards), "--out",
                       str(tmp_path / "run")], capsys)
    line = one_error_line(err, "train")
    assert code == 2 and says in line and len(line) < 400, line


@pytest.mark.parametrize("name, text, says", [
    ("run.yaml", "memory:\n  recompute: full\nlora:\n  lora_rank: 8\n",
     "unknown settings ['lora', 'memory']: lora, memory are groups of --help, not a section of the file: the file is "
     "flat, so write the settings under it at the top level (e.g. `lora_rank: ...`)"),
    ("trainer.json", json.dumps({"step": 2, "loader": {}, "config": {"seq_len": 512}, "layout": {}}),
     "unknown settings ['config', 'layout', 'loader', 'step']: this is a checkpoint's trainer.json, whose `config` "
     "holds the run's settings: write that mapping to a file of its own and give that"),
    ("run.yaml", "seqlen: 512\n", "unknown settings ['seqlen']: use the names of `vlmpack train` flags"),
], ids=["--help's groups as sections", "a checkpoint's trainer.json", "a misspelt name"])
def test_a_config_file_of_another_shape_says_what_to_write_instead(tmp_path, capsys, name, text, says):
    """The keys a user is most likely to write that are no settings: the groups --help shows its
    flags under, and the whole trainer.json whose `config` the docs say is a config file."""
    (tmp_path / name).write_text(text)
    code, err = train(["--dry-run", "--config", str(tmp_path / name), "--arch", "tiny"], capsys)
    line = one_error_line(err, "train")
    assert code == 2 and f"--config {tmp_path / name}: {says}" in line, line


def test_a_yaml_config_under_another_name_says_how_names_are_read(shards, tmp_path, capsys):
    (tmp_path / "run.txt").write_text("lr: 1.0e-4\n")
    code, err = train(["--config", str(tmp_path / "run.txt"), "--arch", "tiny", *RUN, "--data", str(shards), "--out",
                       str(tmp_path / "run")], capsys)
    line = one_error_line(err, "train")
    assert code == 2 and "not valid JSON" in line and "a name ending in .yaml or .yml is read as YAML" in line, line


def test_config_and_chat_template_files_are_refused_alike(tmp_path, capsys):
    """A directory, a FIFO (reading it would block) and a file that is not UTF-8, named as a
    --config or a --chat-template: the same line, but for the flag and what to pass instead."""
    (tmp_path / "directory").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "binary").write_bytes(b"lr: \xff\xfe\n")
    for name in ("directory", "fifo", "binary"):
        path = tmp_path / name
        config_code, config_err = train(["--config", str(path), "--arch", "tiny", "--data", "d"], capsys)
        capsys.readouterr()
        template_code = vlmpack(["export-hf", str(tmp_path / "model"), "--out", str(tmp_path / "out"),
                                 "--chat-template", str(path)])
        config_line = one_error_line(config_err, "train").removeprefix("vlmpack train: error: ")
        template_line = one_error_line(capsys.readouterr().err, "export-hf").removeprefix("vlmpack export-hf: error: ")
        assert config_code == template_code == 2
        assert config_line.startswith(f"--config {path} ") and template_line.startswith(f"--chat-template {path} ")
        assert config_line.split(": pass ")[0].removeprefix("--config") == \
            template_line.split(": pass ")[0].removeprefix("--chat-template"), (config_line, template_line)
        assert config_line.endswith(": pass a YAML or JSON file"), config_line


def _step_dir(root: Path) -> Path:
    """A run's output with one checkpoint step whose model directory holds vlmpack_model.json."""
    model = root / "checkpoints" / "step_00000002" / "model"
    model.mkdir(parents=True)
    (model / "vlmpack_model.json").write_text("{}")
    return model


@pytest.mark.parametrize("given", ["run", "step"])
def test_init_or_export_of_a_runs_output_or_step_names_the_model_directory_inside(tmp_path, capsys, given):
    model = _step_dir(tmp_path / "run")
    path = tmp_path / "run" if given == "run" else model.parent
    for command in (["train", "--dry-run", "--gpus", "1", "--init", str(path)],
                    ["export-hf", str(path), "--out", str(tmp_path / "export")]):
        code = vlmpack(command)
        err = capsys.readouterr().err
        assert code == 2 and f"the model directory inside it is {model}: give that" in one_error_line(err, command[0])


def test_a_hugging_face_checkpoint_given_as_a_model_directory_and_the_reverse_name_the_right_flag(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    for command in (["train", "--dry-run", "--gpus", "1", "--init", str(hf)],
                    ["export-hf", str(hf), "--out", str(tmp_path / "export")]):
        code = vlmpack(command)
        err = capsys.readouterr().err
        assert code == 2 and "it holds a Hugging Face checkpoint (config.json): `vlmpack train` takes that as " \
            "--hf-model" in one_error_line(err, command[0])
    model = _step_dir(tmp_path / "run")
    code = vlmpack(["train", "--dry-run", "--gpus", "1", "--hf-model", str(model)])
    err = capsys.readouterr().err
    assert code == 2 and f"--hf-model {model} is a vlmpack model directory (vlmpack_model.json), not a Hugging " \
        "Face one: --init takes it" in one_error_line(err, "train")
