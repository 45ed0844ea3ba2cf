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
HELP_ALL = r"""
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
""" % (TRAINING_STACK, TRAINING_STACK)


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
