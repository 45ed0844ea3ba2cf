"""`benchmarks/memory_peak.py`: a memory snapshot's trace replayed to its allocation peak, and
what was alive then summed by allocation site. Checked on random snapshots built here against a
brute-force count, with blocks alive before the recording began and frees still pending."""

from __future__ import annotations

import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from memory_peak import BEFORE_RECORDING, GIB, NO_STACK, allocation_site, peak_report  # noqa: E402

SITES = [
    [{"filename": "/site/torch/nn/functional.py", "line": 10, "name": "linear"},
     {"filename": "/repo/train/model/mlp.py", "line": 42, "name": "forward"}],
    [{"filename": "??", "line": 0, "name": "c10::alloc"},
     {"filename": "/repo/train/model/loss.py", "line": 7, "name": "fused_cross_entropy"}],
    [{"filename": "/site/megatron/core/distributed/param_and_grad_buffer.py", "line": 99, "name": "__init__"}],
]


def _snapshot(seed: int):
    """Random allocations and frees over blocks that partly predate the recording; returns the
    snapshot and the expected (peak bytes, {site: bytes} alive at the first time it was reached)."""
    rng = random.Random(seed)
    before = {0x1000 * (i + 1): rng.randrange(1, 64) * 512 for i in range(rng.randint(0, 4))}
    live = dict(before)  # addr -> size
    site_of, events, next_addr = {}, [], 0x100000
    best, best_live = sum(live.values()), {a: s for a, s in live.items()}
    for _ in range(rng.randint(1, 60)):
        if live and rng.random() < 0.45:
            addr = rng.choice(sorted(live))
            size = live.pop(addr)
            events.append({"action": "free_requested", "addr": addr, "size": size, "frames": []})
            events.append({"action": "free_completed", "addr": addr, "size": size, "frames": []})
        else:
            addr, size, site = next_addr, rng.randrange(1, 64) * 512, rng.randrange(len(SITES))
            next_addr += 0x10000
            live[addr], site_of[addr] = size, site
            events.append({"action": "alloc", "addr": addr, "size": size, "frames": SITES[site]})
            if sum(live.values()) > best:
                best, best_live = sum(live.values()), dict(live)
    blocks = [{"size": size, "state": "active_allocated"} for size in live.values()]
    blocks.append({"size": 4096, "state": "inactive"})  # free cache is not allocated memory
    snapshot = {"segments": [{"device": 0, "blocks": blocks}], "device_traces": [events]}
    expected: dict[str, int] = {}
    for addr, size in best_live.items():
        key = BEFORE_RECORDING if addr in before else allocation_site(SITES[site_of[addr]], ("/torch/",))
        expected[key] = expected.get(key, 0) + size
    return snapshot, best, expected


@pytest.mark.parametrize("seed", range(40))
def test_peak_and_its_holders_match_a_brute_force_count(seed):
    snapshot, peak, expected = _snapshot(seed)
    if not snapshot["device_traces"][0]:
        pytest.fail("the builder always records at least one event")
    report = peak_report(snapshot, skip=("/torch/",))
    assert report["peak_gib"] * GIB == pytest.approx(peak)
    got = {row["site"]: row["gib"] * GIB for row in report["rows"] if row["gib"]}
    assert got == pytest.approx({k: v for k, v in expected.items() if v})
    assert [row["gib"] for row in report["rows"]] == sorted((row["gib"] for row in report["rows"]), reverse=True)


def test_site_is_the_innermost_python_frame_outside_the_skipped_packages():
    assert allocation_site(SITES[0], ("/torch/",)) == "train/model/mlp.py:42 forward"
    assert allocation_site(SITES[1], ("/torch/",)) == "train/model/loss.py:7 fused_cross_entropy"
    # every Python frame skipped: the innermost one still names the site
    assert allocation_site(SITES[0][:1], ("/torch/",)) == "torch/nn/functional.py:10 linear"
    assert allocation_site([{"filename": "??", "line": 0, "name": "x"}], ()) == "(no Python frame)"


def test_a_trace_without_stacks_is_summed_by_block_size():
    mib = 2**20
    sizes = [128 * mib, 128 * mib, 485 * mib, 128 * mib, 2 * mib]
    events = [{"action": "alloc", "addr": 0x1000 * (i + 1), "size": size, "frames": []} for i, size in enumerate(sizes)]
    events += [{"action": "free_requested", "addr": 0x3000, "size": 485 * mib, "frames": []},
               {"action": "free_completed", "addr": 0x3000, "size": 485 * mib, "frames": []}]
    blocks = [{"size": s, "state": "active_allocated"} for i, s in enumerate(sizes) if i != 2]
    report = peak_report({"segments": [{"device": 0, "blocks": blocks}], "device_traces": [events]})
    rows = {row["site"]: (row["gib"] * GIB, row["blocks"]) for row in report["rows"]}
    assert report["peak_gib"] * GIB == sum(sizes)
    assert rows[NO_STACK.format(mib=128.0)] == (3 * 128 * mib, 3)
    assert rows[NO_STACK.format(mib=485.0)] == (485 * mib, 1)
    assert rows[NO_STACK.format(mib=2.0)] == (2 * mib, 1)
    assert report["peak_reached_by"]["site"] == "(no Python frame)"


def test_cli_reports_the_peak_and_refuses_a_file_that_is_no_snapshot(tmp_path):
    snapshot, peak, _ = _snapshot(3)
    good, bad, empty = tmp_path / "s.pickle", tmp_path / "bad.pickle", tmp_path / "empty.pickle"
    good.write_bytes(pickle.dumps(snapshot))
    bad.write_bytes(b"not a pickle")
    empty.write_bytes(pickle.dumps({"segments": [], "device_traces": []}))
    script = ROOT / "benchmarks" / "memory_peak.py"
    ran = subprocess.run([sys.executable, script, good, "--json-out", tmp_path / "r.json"], capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    assert f"peak {peak / GIB:.2f} GiB" in ran.stdout + ran.stderr
    for path, says in ((bad, "not a torch memory snapshot"), (empty, "no allocation trace for device 0"),
                       (tmp_path / "missing.pickle", "no such snapshot file")):
        ran = subprocess.run([sys.executable, script, path], capture_output=True, text=True)
        assert ran.returncode == 2 and says in ran.stderr and "Traceback" not in ran.stderr
