"""`vlmpack <command> --help` on a machine without the training stack (a preprocessing box):
every command's help must print, and print the same text as where torch is installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from shards_schema.cli import COMMANDS

TRAINING_STACK = ("torch", "megatron", "transformers")

# Prints {command: [exit status, output]} for `vlmpack --help` and every `vlmpack COMMAND --help`,
# all in one process. With argv[1] == "block", importing the training stack fails first, as it
# does where it is not installed.
BLOCK = r"""
import contextlib, io, json, sys

if sys.argv[1] == "block":
    class NotInstalled:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in %r:
                raise ImportError(f"No module named {name!r}")
            return None

    sys.meta_path.insert(0, NotInstalled())
    try:
        import torch
    except ImportError:
        pass
    else:
        raise SystemExit("the blocker let torch through")
""" % (TRAINING_STACK,)

HELP_ALL = BLOCK + r"""
from shards_schema.cli import COMMANDS, main

results = {}
for argv in [["--help"]] + [[name, "--help"] for name in COMMANDS]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            status = main(argv)
        except SystemExit as exc:
            status = exc.code
        except BaseException as exc:
            status, _ = repr(exc), out.write(repr(exc))
    results[" ".join(argv)] = [status, out.getvalue()]
loaded = sorted(m for m in sys.modules if m.split(".")[0] in %r)
print(json.dumps({"results": results, "loaded": loaded}))
""" % (TRAINING_STACK,)


def help_outputs(mode: str) -> dict:
    env = {**os.environ, "COLUMNS": "100"}
    done = subprocess.run([sys.executable, "-c", HELP_ALL, mode], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_every_command_help_works_without_torch_and_matches():
    blocked, normal = help_outputs("block"), help_outputs("normal")
    assert blocked["loaded"] == []
    assert set(blocked["results"]) == {"--help", *(f"{name} --help" for name in COMMANDS)}
    for argv, (status, text) in blocked["results"].items():
        assert status in (0, None), f"vlmpack {argv} without torch: exit {status}\n{text}"
        assert text.strip(), f"vlmpack {argv} printed nothing"
        assert [status, text] == normal["results"][argv], f"vlmpack {argv}: help differs without torch"


# `vlmpack train ARGV...` with the training stack blocked: its exit status and stderr, and what
# of the stack it loaded
REFUSED_TRAIN = BLOCK + r"""
from shards_schema.cli import main

err = io.StringIO()
with contextlib.redirect_stderr(err):
    status = main(["train", *sys.argv[2:]])
loaded = sorted(m for m in sys.modules if m.split(".")[0] in %r)
print(json.dumps({"status": status, "err": err.getvalue(), "loaded": loaded}))
""" % (TRAINING_STACK,)


def test_a_refused_train_flag_is_said_before_the_training_stack_loads(tmp_path):
    """A flag `vlmpack train` refuses (a value out of range, a setting that needs another) is
    one line, exit 2, before torch and megatron take seconds to load: with them blocked, the
    same refusal. (--arch's name is checked last: the built-in table loads them.)"""
    for argv, said in ((["--lr", "0"], "--lr must be in (0, 1], got 0.0"),
                       (["--eval-every", "5"], "--eval-every 5 needs held-out data"),
                       (["--recompute-layers", "4"], "--recompute-layers 4 needs --recompute full")):
        done = subprocess.run([sys.executable, "-c", REFUSED_TRAIN, "block", "--data", str(tmp_path), "--arch",
                               "tiny-qwen3-vl", *argv],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert result["status"] == 2 and result["loaded"] == [], result
        assert result["err"].startswith("vlmpack train: error: ") and result["err"].count("\n") == 1, result
        assert said in result["err"], result
