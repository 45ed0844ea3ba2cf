"""`vlmpack train` under faults, on CPU: killed (kill -9) anywhere, a full disk before or while
a checkpoint is written, a damaged checkpoint file. A killed run resumes to the uninterrupted
run's losses (bitwise), a full disk exits 4 with one line and leaves the previous checkpoint as
it was, no unfinished checkpoint (step_N.tmp) is ever taken for `latest`, and a resume from a
damaged checkpoint exits 2 with one line naming the file and the checkpoint to go on from.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shards_schema.cli import main as vlmpack
from tests.helpers.cli import process_env
from tests.helpers.damage import damaged_copy, one_error_line
from tests.helpers.shards import preprocess
from tests.helpers.train import metrics, ok, run_train, start_run_from
from train.parallel import _free_port

# short packs, one a step: the tiny model's 152k-token output layer is most of a step's time
BASE = ["--arch", "tiny", "--seq-len", "512", "--global-batch-packs", "1", "--lr", "3e-3", "--warmup-steps", "1",
        "--num-workers", "0", "--tensorboard", "false"]
STEPS = ["--train-steps", "5", "--save-every", "2", "--keep-last", "2"]  # saves at steps 2, 4 and 5


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return preprocess(tmp_path_factory.mktemp("fault-data"), "shards", rows=16, seq_len=512, size_range=(32, 64))


@pytest.fixture(scope="module")
def reference(shards, tmp_path_factory) -> Path:
    """The uninterrupted run, saving on the training thread (--async-save false)."""
    out = tmp_path_factory.mktemp("reference")
    ok(run_train([*BASE, *STEPS, "--data", str(shards), "--out", str(out), "--async-save", "false"]))
    return out


def checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir() if p.name != "latest")


def test_keep_last_deletes_the_oldest_once_a_new_checkpoint_is_complete(reference):
    assert checkpoints(reference) == ["step_00000004", "step_00000005"]
    assert (reference / "checkpoints" / "latest").read_text() == "step_00000005"
    saves = [m for m in metrics(reference) if "checkpoint_stall_s" in m]
    assert [m["step"] for m in saves] == [2, 4, 5]
    # written on the training thread: each save completes within its own step
    assert [m["checkpoint_completed_step"] for m in saves] == [2, 4, 5]
    assert all(m["checkpoint_stall_s"] >= m["checkpoint_write_s"] > 0 for m in saves)


# The child process SIGKILLs itself at the chosen point: the start of its n-th global batch
# ("step"), while its n-th background save writes its rank file ("write": the model and
# trainer.json are on disk), or right after its n-th save was renamed, before `latest` moved
# ("rename").
KILL_AT = """
import os, signal, sys
import train.checkpoint as ckpt, train.trainer as trainer
site, n = sys.argv[1], int(sys.argv[2])
counts = {}
def kill_on(name):
    counts[name] = counts.get(name, 0) + 1
    if name == site and counts[name] == n:
        os.kill(os.getpid(), signal.SIGKILL)
def wrap(module, attr, name, when=lambda *a: True):
    real = getattr(module, attr)
    def wrapped(*a, **k):
        if when(*a):
            kill_on(name)
        return real(*a, **k)
    setattr(module, attr, wrapped)
wrap(trainer, "run_global_batch", "step")
wrap(ckpt, "_torch_save", "write", lambda obj, path: path.name.startswith("rank_"))
wrap(ckpt, "fsync_dir", "rename")
sys.exit(trainer.main(sys.argv[3:]))
"""


def kill_points(seed: int, count: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(rng.choice(["step", "write", "rename"]), rng.randint(1, 3)) for _ in range(count)]


@pytest.mark.parametrize("seed", [0, 3])  # two kills each: in a save's write and a step; in a step and a rename
def test_kill_9_anywhere_then_resume_gives_the_uninterrupted_losses(shards, reference, tmp_path, seed):
    out = tmp_path / "run"
    args = [*BASE, *STEPS, "--data", str(shards), "--out", str(out)]
    killed = 0
    for site, n in kill_points(seed, 2):
        resume = ["--resume"] if (out / "checkpoints").exists() else []
        proc = run_train([site, str(n), *args, *resume], code=KILL_AT)
        if proc.returncode == 0:
            break
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
        killed += 1
        latest = out / "checkpoints" / "latest"
        if latest.exists():  # a kill before the first complete save leaves none
            name = latest.read_text()
            assert not name.endswith(".tmp") and (out / "checkpoints" / name / "rank_00000.pt").is_file()
    else:
        ok(run_train([*args, "--resume"]))
    assert killed == 2, "the chosen kill points were not reached"
    expected = {m["step"]: m["loss"] for m in metrics(reference)}
    seen = metrics(out)  # every process's steps; steps after the last save ran twice
    assert sorted({m["step"] for m in seen}) == list(expected)
    assert all(m["loss"] == expected[m["step"]] for m in seen)  # bitwise
    assert checkpoints(out) == ["step_00000004", "step_00000005"]  # a killed save's step_N.tmp is gone too


# ENOSPC while the background writer writes step 2's rank file: torch.save sees a failing write
# (on a real full disk it reports "unexpected pos N vs M"); step 1 stays the checkpoint.
FULL_AT_STEP_2 = """
import contextlib, errno, sys
import train.checkpoint as ckpt, train.trainer as trainer
real_open = ckpt.atomic_open
class FullDisk:
    def __init__(self, fh):
        self.fh, self.written = fh, 0
    def write(self, data):
        self.written += len(data)
        if self.written > 4096:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.fh.write(data)
    def __getattr__(self, name):
        return getattr(self.fh, name)
@contextlib.contextmanager
def atomic_open(path, mode="wb"):
    with real_open(path, mode) as fh:
        yield FullDisk(fh) if "step_00000002" in str(path) and path.name.startswith("rank_") else fh
ckpt.atomic_open = atomic_open
sys.exit(trainer.main(sys.argv[1:]))
"""

# free space as the disk reports it; "lie": plenty, so the real write runs into the full disk
DISK_USAGE = """
import shutil, sys
import train.trainer as trainer
real, free = shutil.disk_usage, int(sys.argv[1])
shutil.disk_usage = lambda path: real(path)._replace(free=free) if "checkpoints" in str(path) else real(path)
sys.exit(trainer.main(sys.argv[2:]))
"""


def assert_disk_full_exit(proc, out: Path, kept: str, failed: str, others: tuple[str, ...] = ()) -> str:
    """Exit 4 in one line naming the failed and the intact checkpoint; `others`: the older
    checkpoints still there, which the line says --keep-last 1 would delete first (with none,
    it does not advise --keep-last: the newest checkpoint is never deleted before a new one)."""
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("vlmpack train: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    message = lines[0]
    assert failed in message and str(out / "checkpoints") in message
    assert f"checkpoint {kept} is intact" in message
    assert "another --out" in message and "--resume" in message
    if others:
        assert "with --keep-last 1 (now " in message and f"a save short of space first deletes {', '.join(others)}" \
            in message
    else:
        assert "--keep-last" not in message
    assert checkpoints(out) == sorted([*others, kept])  # no step_N.tmp left behind
    assert (out / "checkpoints" / "latest").read_text() == kept
    assert (out / "checkpoints" / kept / "rank_00000.pt").is_file()
    return message


def test_disk_full_while_a_background_save_writes_exits_4_and_keeps_the_previous(shards, tmp_path):
    out = tmp_path / "full"
    proc = run_train([*BASE, "--data", str(shards), "--out", str(out), "--train-steps", "3", "--save-every", "1"],
                     code=FULL_AT_STEP_2)
    message = assert_disk_full_exit(proc, out, "step_00000001", "no space left on the device writing checkpoint "
                                                                "step_00000002")
    assert "it needs about" in message
    assert [m["step"] for m in metrics(out)] == [1, 2]  # surfaced at step 3, the latest by its own save


def test_checkpoint_that_cannot_fit_exits_4_before_writing(shards, reference, tmp_path):
    """The free-space check: the previous checkpoint's size against the free bytes (keep-last's
    deletions are not counted: they happen only after the new checkpoint is complete)."""
    out = tmp_path / "no-room"
    start_run_from(reference / "checkpoints" / "step_00000004", out)
    size = sum(p.stat().st_size for p in (out / "checkpoints" / "step_00000004").rglob("*") if p.is_file())
    proc = run_train([str(size - 1), *BASE, *STEPS, "--keep-last", "1", "--data", str(shards), "--out", str(out),
                      "--resume"], code=DISK_USAGE)
    message = assert_disk_full_exit(proc, out, "step_00000004", "not enough space for checkpoint step_00000005")
    needed, free = (int(n.replace(",", "")) for n in re.findall(r"\(([\d,]+) bytes\)", message))
    assert needed >= size and free == size - 1


def test_real_full_tmpfs_during_a_save_exits_4_and_keeps_the_previous(shards, tmp_path):
    """A real full file system (a small tmpfs), the free-space check told there is room: the
    writer's own ENOSPC (safetensors' or torch.save's) is recognised."""
    out = tmp_path / "tmpfs"
    out.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200m", "tmpfs", str(out)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("mounting a tmpfs is not permitted here (the injected ENOSPC tests cover the handling)")
    try:
        proc = run_train([str(10**12), *BASE, "--data", str(shards), "--out", str(out), "--train-steps", "3",
                          "--save-every", "1", "--keep-last", "1"], code=DISK_USAGE)
        assert_disk_full_exit(proc, out, "step_00000001", "no space left on the device writing checkpoint step_00000002")
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert records[0]["step"] == 1
    finally:
        subprocess.run(["umount", "-l", str(out)], check=True)


# a disk of CAPACITY bytes that holds only the checkpoints: free = capacity - their bytes
SMALL_DISK = """
import shutil, sys
from pathlib import Path
import train.trainer as trainer
real, capacity = shutil.disk_usage, int(sys.argv[1])
def disk_usage(path):
    if "checkpoints" not in str(path):
        return real(path)
    used = sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
    return real(path)._replace(free=max(0, capacity - used))
shutil.disk_usage = disk_usage
sys.exit(trainer.main(sys.argv[2:]))
"""


def test_a_save_short_of_space_first_deletes_what_keep_last_would(shards, reference, tmp_path):
    """Room for about 2.5 checkpoints, a save every step: step 3 does not fit beside steps 1 and 2.
    With --keep-last 3 none may go early (exit 4, and the line says --keep-last 1 would delete
    step 1 first); resumed with --keep-last 1, step 1 is deleted before step 3 is written, the
    log says so, and step 2 (the newest) stays until step 3 is complete."""
    size = sum(p.stat().st_size for p in (reference / "checkpoints" / "step_00000004").rglob("*") if p.is_file())
    out = tmp_path / "small"
    args = [str(int(2.5 * size)), *BASE, "--data", str(shards), "--out", str(out), "--train-steps", "3",
            "--save-every", "1"]
    proc = run_train([*args, "--keep-last", "3"], code=SMALL_DISK)
    assert_disk_full_exit(proc, out, "step_00000002", "not enough space for checkpoint step_00000003",
                          others=("step_00000001",))
    proc = ok(run_train([*args, "--keep-last", "1", "--resume"], code=SMALL_DISK))
    assert ("vlmpack train: deleted checkpoint step_00000001 before writing step_00000003: the save needs about "
            in proc.stderr), proc.stderr[-3000:]
    assert "--keep-last 1 would delete it once the new one is complete, and the newest, step_00000002, stays" \
        in proc.stderr
    assert checkpoints(out) == ["step_00000003"]
    assert (out / "checkpoints" / "latest").read_text() == "step_00000003"
    assert [m["step"] for m in metrics(out)] == [1, 2, 3]


@pytest.mark.parametrize("pointer,want", [(None, "step_00000003"), ("", "step_00000003"),
                                          ("step_00000099", "step_00000003"), ("\x00\xff garbage", "step_00000003"),
                                          ("step_00000002.tmp", "step_00000003"), (".", "step_00000003"),
                                          ("step_00000001", "step_00000001"), ("step_00000001\n", "step_00000001")])
def test_a_resume_without_a_usable_latest_pointer_takes_the_newest_complete_checkpoint(tmp_path, pointer, want):
    """`latest` names the checkpoint a resume continues; missing, empty or naming no complete
    checkpoint (a crash between a save's rename and the pointer's write, or a hand edit), the
    newest complete one is taken, never a start from step 0 beside the saved ones."""
    from train.checkpoint import latest_checkpoint

    root = tmp_path / "checkpoints"
    for name in ("step_00000001", "step_00000003", "step_00000002.tmp", "step_00000004.tmp"):
        (root / name).mkdir(parents=True)
    if pointer is not None:
        (root / "latest").write_text(pointer, errors="surrogateescape")
    assert latest_checkpoint(tmp_path) == root / want
    for name in ("step_00000001", "step_00000003"):
        (root / name).rmdir()
    assert latest_checkpoint(tmp_path) is None


def test_directories_beside_the_checkpoints_are_neither_resumed_nor_deleted(tmp_path):
    """Only a save's own names (`step_` and digits) are checkpoints: a user's copy or notes beside
    them in checkpoints/ (`step_00000002.bak`, `step_notes`) are never taken for the newest one
    nor deleted by --keep-last."""
    from train.checkpoint import CheckpointSaver, latest_checkpoint

    root = tmp_path / "checkpoints"
    for name in ("step_00000001", "step_00000002", "step_00000002.bak", "step_notes", "step_00000003.tmp"):
        (root / name).mkdir(parents=True)
    assert latest_checkpoint(tmp_path) == root / "step_00000002"
    saver = object.__new__(CheckpointSaver)  # its completing a save alone: no process group
    saver.root, saver.keep_last = root, 1
    saver._complete({"step": 3, "tmp": root / "step_00000003.tmp"})
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002.bak", "step_00000003", "step_notes"]
    assert latest_checkpoint(tmp_path) == root / "step_00000003"


def test_a_resume_past_an_unusable_latest_pointer_says_which_checkpoint_it_took(reference, shards, tmp_path):
    """A `latest` naming no complete checkpoint is not followed silently: the resume line names
    the pointer's fault and the checkpoint taken instead."""
    from train.checkpoint import latest_pointer_problem

    out = tmp_path / "run"
    shutil.copytree(reference, out)
    assert latest_pointer_problem(out) is None
    (out / "checkpoints" / "latest").write_text("step_00000099")
    proc = ok(run_train([*BASE, *STEPS, "--data", str(shards), "--out", str(out), "--resume"]))
    assert (f"resumed from {out / 'checkpoints' / 'step_00000005'} (step 5) ({out / 'checkpoints' / 'latest'} "
            "names 'step_00000099', which is no complete checkpoint: the newest complete checkpoint taken)"
            in proc.stdout), proc.stdout[-2000:]
    (out / "checkpoints" / "latest").unlink()
    (out / "checkpoints" / "latest").mkdir()
    assert latest_pointer_problem(out).endswith("latest is not a file")


def _edited(raw: bytes, section: str, **values) -> bytes:
    """trainer.json's bytes with `values` set in its `section` (config, loader)."""
    meta = json.loads(raw)
    return json.dumps({**meta, section: {**meta[section], **values}}).encode()


def _arch_edited(raw: bytes, **lm) -> bytes:
    """vlmpack_model.json's bytes with `lm` set in its architecture's language model."""
    meta = json.loads(raw)
    meta["arch"]["lm"].update(lm)
    return json.dumps(meta).encode()


def _saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


# a file of the checkpoint -> (its new bytes from the intact ones, what the one line says after the file's path)
CHECKPOINT_DAMAGE = {
    "trainer.json not JSON": ("trainer.json", lambda raw: raw[:len(raw) // 2], ": not valid JSON ("),
    "trainer.json a list": ("trainer.json", lambda raw: b"[]", ": holds a JSON array, not an object: the checkpoint is damaged"),
    "trainer.json without its step": ("trainer.json",
                                      lambda raw: json.dumps({**json.loads(raw), "step": None}).encode(),
                                      ": not a vlmpack checkpoint's record"),
    "trainer.json a null train_steps": ("trainer.json", lambda raw: _edited(raw, "config", train_steps=None),
                                        ": its loader state or settings are not of a vlmpack checkpoint"),
    "trainer.json a negative position": ("trainer.json", lambda raw: _edited(raw, "loader", packs_consumed=-5),
                                         ": its loader state or settings are not of a vlmpack checkpoint"),
    "trainer.json a position as text": ("trainer.json", lambda raw: _edited(raw, "loader", packs_consumed="x"),
                                        ": its loader state or settings are not of a vlmpack checkpoint"),
    "trainer.json a data-parallel size as text": ("trainer.json", lambda raw: _edited(raw, "loader", dp_size="2"),
                                                  ": its loader state or settings are not of a vlmpack checkpoint"),
    "trainer.json of another step": ("trainer.json", lambda raw: json.dumps({**json.loads(raw), "step": 50}).encode(),
                                     ": records step 50 in the directory of step 5"),
    "rank file of no run": ("rank_00000.pt", lambda raw: _saved({}), ": not a vlmpack checkpoint's rank state"),
    "rank file random bytes": ("rank_00000.pt", lambda raw: os.urandom(4096), ": not a readable checkpoint file ("),
    "rank file cut short": ("rank_00000.pt", lambda raw: raw[:len(raw) // 2], ": not a readable checkpoint file ("),
    "model weights cut short": ("model/model_tp0_pp0.safetensors", lambda raw: raw[:len(raw) // 2],
                                ": not a readable safetensors file ("),
    "model metadata not JSON": ("model/vlmpack_model.json", lambda raw: raw[1:], ": not valid JSON ("),
    "model metadata a size as text": ("model/vlmpack_model.json", lambda raw: _arch_edited(raw, hidden_size="64"),
                                      ": the language model's hidden_size must be an integer >= 1, got '64'"),
}


@pytest.mark.parametrize("case", list(CHECKPOINT_DAMAGE))
def test_a_resume_from_a_damaged_checkpoint_exits_2_naming_the_file_and_how_to_go_on(shards, reference, tmp_path,
                                                                                       capsys, case):
    """One line naming the damaged file, and that --resume continues the checkpoint before it
    once this one is moved out of the way."""
    name, damage, says = CHECKPOINT_DAMAGE[case]
    step = damaged_copy(reference / "checkpoints" / "step_00000005", tmp_path / "checkpoints" / "step_00000005", name,
                        damage)
    (tmp_path / "checkpoints" / "step_00000004").symlink_to(reference / "checkpoints" / "step_00000004")
    (tmp_path / "checkpoints" / "latest").write_text(step.name)
    capsys.readouterr()
    code = vlmpack(["train", *BASE, *STEPS, "--data", str(shards), "--out", str(tmp_path), "--resume"])
    line = one_error_line(capsys.readouterr().err, "train")
    assert code == 2 and f"{step / name}{says}" in line, line
    assert line.endswith(f": the checkpoint is damaged: move step_00000005 out of {tmp_path / 'checkpoints'} and "
                         "--resume continues step_00000004"), line


@pytest.mark.parametrize("missing", ["model", "model/vlmpack_model.json"])
def test_a_resume_from_a_checkpoint_without_its_weights_directory_or_record_names_it(shards, reference, tmp_path,
                                                                                    capsys, missing):
    """A checkpoint missing its model/ or the record that makes it a model directory is named as
    damaged, with the checkpoint to go on from: not as no model directory to import, nor as a
    checkpoint of the other kind (LoRA adapters against a whole model)."""
    from train.checkpoint import check_resume_kind
    from train.model.arch import ModelFileError

    step = damaged_copy(reference / "checkpoints" / "step_00000005", tmp_path / "checkpoints" / "step_00000005",
                        "trainer.json", lambda raw: raw)
    shutil.rmtree(step / missing) if (step / missing).is_dir() else (step / missing).unlink()
    (tmp_path / "checkpoints" / "step_00000004").symlink_to(reference / "checkpoints" / "step_00000004")
    (tmp_path / "checkpoints" / "latest").write_text(step.name)
    capsys.readouterr()
    code = vlmpack(["train", *BASE, *STEPS, "--data", str(shards), "--out", str(tmp_path), "--resume"])
    line = one_error_line(capsys.readouterr().err, "train")
    said = "model/ (its weights)" if missing == "model" else missing
    assert code == 2 and line.startswith(f"vlmpack train: error: {step} has no {said}: the checkpoint is damaged: "
                                         f"move step_00000005 out of {tmp_path / 'checkpoints'} and --resume "
                                         "continues step_00000004"), line
    emptied = tmp_path / "lora" / "checkpoints" / "step_00000002"  # a LoRA checkpoint's, alike
    emptied.mkdir(parents=True)
    with pytest.raises(ModelFileError, match=r"has no adapter/ \(its LoRA adapters\): the checkpoint is damaged"):
        check_resume_kind(emptied, True, 4)


# ---------------------------------------------------------------- the distributed optimizer's state file


class DistributedOptimizer:
    """Stands in for megatron's (matched by name, as `train.checkpoint` matches it): DP rank
    `dp_rank` of its group; records what the scatter from DP rank 0 would get."""

    def __init__(self, dp_rank: int):
        self.data_parallel_group = type("Group", (), {"rank": lambda _: dp_rank})()
        self.optimizer = type("Inner", (), {})()
        self.optimizer.state = {"w": {"step": torch.tensor(7.0), "exp_avg": None}}
        self.loaded = []

    def load_parameter_state_from_dp_zero(self, state):
        assert "step" not in self.optimizer.state["w"]  # megatron's load would copy a missing 'step' key
        self.loaded.append(state)


def _parameter_state_checkpoint(tmp_path: Path, content: bytes | None) -> tuple[Path, Path]:
    checkpoint = tmp_path / "checkpoints" / "step_00000002"
    checkpoint.mkdir(parents=True)
    file = checkpoint / "optimizer_param_state_pp0_tp0.pt"
    if content is not None:
        file.write_bytes(content)
    return checkpoint, file


def _saved_state() -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save({0: {torch.float32: {"param": torch.arange(6.0), "exp_avg": torch.ones(6)}}}, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("case", ["intact", "missing", "cut short", "not a zip", "not my file to read"])
def test_the_distributed_optimizers_state_file_is_read_or_refused_naming_it(tmp_path, case):
    from train.checkpoint import _load_parameter_state
    from train.model.arch import ModelFileError
    saved = _saved_state()
    content = {"intact": saved, "missing": None, "cut short": saved[:len(saved) // 2], "not a zip": b"\x80\x04garbage",
               "not my file to read": None}[case]
    checkpoint, file = _parameter_state_checkpoint(tmp_path, content)
    optimizer = DistributedOptimizer(dp_rank=1 if case == "not my file to read" else 0)
    if case in ("intact", "not my file to read"):
        _load_parameter_state(optimizer, file, checkpoint)
        if case == "intact":
            assert torch.equal(optimizer.loaded[0][0][torch.float32]["param"], torch.arange(6.0))
        else:
            assert optimizer.loaded == [None]  # only DP rank 0 reads; the others get their part from it
        assert optimizer.optimizer.state["w"]["step"] == 7.0
        return
    with pytest.raises(ModelFileError) as raised:
        _load_parameter_state(optimizer, file, checkpoint)
    assert str(file if case != "missing" else checkpoint) in raised.value.problem
    assert "move step_00000002 out of" in raised.value.fix
    assert optimizer.loaded == [] and optimizer.optimizer.state["w"]["step"] == 7.0


def _load_on_rank(rank: int, init: str, file: str, results) -> None:
    import torch.distributed as dist

    from shards_schema.errors import UserError
    from train.checkpoint import _load_parameter_state
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        _load_parameter_state(DistributedOptimizer(dp_rank=rank), Path(file), Path(file).parent)
        results.put((rank, "loaded"))
    except UserError as exc:
        results.put((rank, str(exc)))
    finally:
        dist.destroy_process_group()


def test_a_damaged_state_file_stops_every_rank_not_only_its_reader(tmp_path):
    """DP rank 0 cannot read the file: rank 1, which would wait for its part in megatron's
    scatter, stops too, with the same file named."""
    import multiprocessing

    _, file = _parameter_state_checkpoint(tmp_path, _saved_state()[:100])
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    procs = [context.Process(target=_load_on_rank, args=(r, f"file://{tmp_path / 'init'}", str(file), results))
             for r in range(2)]
    for proc in procs:
        proc.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
    assert set(got) == {0, 1} and all(str(file) in problem for problem in got.values()), got
    assert got[1].endswith("(on another rank)"), got


def test_a_resume_with_one_ranks_file_damaged_stops_every_rank_with_one_line(shards, tmp_path):
    """DP=2, rank 1's file of the checkpoint damaged: rank 0, whose own files are intact, stops
    too, before the first step's collectives, and both say which file."""
    out = tmp_path / "dp2"
    dp2 = [*BASE, "--global-batch-packs", "2", "--data", str(shards), "--out", str(out)]
    ok(run_train([*dp2, "--train-steps", "2", "--save-every", "2"], nproc=2))
    rank_file = out / "checkpoints" / "step_00000002" / "rank_00001.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:1000])
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "train.trainer", *dp2, "--train-steps", "2", "--resume"], cwd=Path(__file__).resolve().parents[1],
                              env={**process_env(), "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank),
                                   "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    errors = [proc.communicate(timeout=300)[1] for proc in procs]
    for rank, (proc, err) in enumerate(zip(procs, errors)):
        line = one_error_line(err, "train")
        assert proc.returncode == 2 and f"{rank_file}: not a readable checkpoint file (" in line, (rank, err)
        assert line.endswith("(on another rank)") == (rank == 0), (rank, line)
