"""`benchmarks/trace_summary.py` (and `train_speed.py --trace`): each kernel of a chrome trace
joined to the host ranges open at its launch; a backward kernel takes the model part of the
forward op whose autograd node it runs. Checked on traces built here, with random layouts."""

from __future__ import annotations

import gzip
import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from train_speed import BACKWARD_NODE, gpu_idle_summary, kernel_sources  # noqa: E402


class TraceBuilder:
    """A torch.profiler-like chrome trace: host ranges on threads, launches, kernels."""

    def __init__(self):
        self.events, self.correlation = [], 0

    def span(self, tid, cat, name, ts, dur, **args):
        self.events.append({"ph": "X", "cat": cat, "name": name, "tid": tid, "ts": ts, "dur": dur, "args": args})

    def launch(self, tid, ts, kernel, gpu_ts, gpu_dur):
        self.correlation += 1
        self.span(tid, "cuda_runtime", "cudaLaunchKernel", ts, 1, correlation=self.correlation)
        self.span(7, "kernel", kernel, gpu_ts, gpu_dur, correlation=self.correlation)


def _trace(seed: int):
    """Random layers, each a forward op (sequence number) launching an elementwise kernel in a
    labelled range, its backward node on the autograd thread launching another, and an
    optimizer kernel outside the model. Returns the trace and the expected rows."""
    rng = random.Random(seed)
    t, want, clock, gpu = TraceBuilder(), [], 0.0, 1000.0
    layers = rng.randint(1, 5)
    for layer in range(layers):
        part = f"lm.layer{layer:02d}"
        t.span(1, "user_annotation", part, clock, 100)
        t.span(1, "cpu_op", "aten::mul", clock + 10, 20, **{"Sequence number": layer})
        t.span(1, "cpu_op", "aten::empty", clock + 12, 8)  # open at the launch too: the outer op is named
        dur = rng.randint(5, 50)
        t.launch(1, clock + 15, "void at::native::vectorized_elementwise_kernel<4, MulFunctor>", gpu, dur)
        want.append(("elementwise", "lm.layer*", "aten::mul", "forward", dur))
        clock, gpu = clock + 200, gpu + 100
    for layer in reversed(range(layers)):
        t.span(2, "cpu_op", "autograd::engine::evaluate_function: MulBackward0", clock, 50,
               **{"Sequence number": layer})
        t.span(2, "cpu_op", "aten::mul", clock + 5, 20)
        dur = rng.randint(5, 50)
        t.launch(2, clock + 10, "triton_poi_fused_mul_cat_0", gpu, dur)
        want.append(("fused by Inductor", "lm.layer*", "aten::mul", "backward: MulBackward0", dur))
        clock, gpu = clock + 100, gpu + 100
    t.span(1, "cpu_op", "aten::_fused_adamw_", clock, 30)
    t.launch(1, clock + 5, "multi_tensor_apply_kernel<FusedOptimizer>", gpu, 40)
    want.append(("other", "(none)", "aten::_fused_adamw_", "outside the model", 40))
    return {"traceEvents": t.events}, want


@pytest.mark.parametrize("seed", range(4))
def test_every_kernel_is_attributed_to_its_part_op_and_phase(seed):
    trace, want = _trace(seed)
    got = kernel_sources(trace)
    expected: dict = {}
    for kind, part, op, phase, us in want:
        slot = expected.setdefault((kind, part, op, phase), [0, 0.0])
        slot[0] += 1
        slot[1] += us
    assert {tuple(r["key"]): [r["kernels"], r["ms"]] for r in got["by_source"]} == \
        {key: [n, round(us / 1e3, 3)] for key, (n, us) in expected.items()}
    assert got["gpu_ms"] == pytest.approx(sum(w[-1] for w in want) / 1e3)
    assert [r["ms"] for r in got["by_source"]] == sorted((r["ms"] for r in got["by_source"]), reverse=True)


def test_nodes_of_a_recomputed_layer_take_its_part_though_their_numbers_repeat_the_forwards():
    """A layer recomputed in backward makes its autograd nodes on the autograd thread, whose own
    sequence numbers repeat numbers of the forward thread: each node's kernels go to the part of
    the op that made it, on the thread the node names (the profiler's thread number)."""
    t, clock, gpu = TraceBuilder(), 0.0, 1000.0
    for seq in range(6):  # the forward thread: six vision ops, then the checkpointed layer
        t.span(1, "user_annotation", "vision.block00", clock, 50)
        t.span(1, "cpu_op", "aten::mm", clock + 5, 20, **{"Sequence number": seq, "Fwd thread id": 0})
        clock += 100
    t.span(1, "user_annotation", "lm.layer00", clock, 50)
    t.span(1, "cpu_op", "CheckpointFunction", clock + 5, 20, **{"Sequence number": 6, "Fwd thread id": 0})
    clock += 100
    # backward on thread 2 (profiler thread number 2; the forward thread's is 1)
    t.span(2, "cpu_op", BACKWARD_NODE + "CheckpointFunctionBackward", clock, 400,
           **{"Sequence number": 6, "Fwd thread id": 1})
    t.span(2, "user_annotation", "lm.layer00", clock + 10, 300)
    for seq in (5, 6, 7):  # the recomputed forward: thread 2's numbers, 5 and 6 also thread 1's
        t.span(2, "cpu_op", "aten::_grouped_mm", clock + 20 + 20 * seq, 10, **{"Sequence number": seq, "Fwd thread id": 0})
    clock += 500
    for seq in (7, 6, 5):
        t.span(2, "cpu_op", BACKWARD_NODE + "GroupedMmBackward0", clock, 50, **{"Sequence number": seq, "Fwd thread id": 2})
        t.launch(2, clock + 10, "cutlass_grouped_gemm_kernel", gpu, 10)
        clock, gpu = clock + 100, gpu + 100
    for seq in reversed(range(6)):
        t.span(2, "cpu_op", BACKWARD_NODE + "MmBackward0", clock, 50, **{"Sequence number": seq, "Fwd thread id": 1})
        t.launch(2, clock + 10, "nvjet_gemm_kernel", gpu, 10)
        clock, gpu = clock + 100, gpu + 100
    rows = {tuple(r["key"]): r["kernels"] for r in kernel_sources({"traceEvents": t.events})["by_source"]}
    assert rows == {("experts (grouped GEMM, dispatch)", "lm.layer*", "(no aten op)", "backward: GroupedMmBackward0"): 3,
                    ("gemm", "vision.block*", "(no aten op)", "backward: MmBackward0"): 6}, rows


def test_a_layer_is_named_by_the_attention_it_runs():
    t = TraceBuilder()
    for layer, kernel in enumerate(("chunk_gated_delta_rule_fwd_kernel_h", "flash_fwd_kernel")):
        t.span(1, "user_annotation", f"lm.layer{layer:02d}", layer * 100, 50)
        t.launch(1, layer * 100 + 10, kernel, 1000 + layer * 100, 10)
        t.launch(1, layer * 100 + 20, "void at::native::vectorized_elementwise_kernel<4, AddFunctor>",
                 1050 + layer * 100, 5)
    parts = {tuple(r["key"]) for r in kernel_sources({"traceEvents": t.events})["by_kind_and_part"]}
    assert parts == {("linear attention", "lm.layer* (Gated DeltaNet)"), ("attention", "lm.layer* (attention)"),
                     ("elementwise", "lm.layer* (Gated DeltaNet)"), ("elementwise", "lm.layer* (attention)")}


def test_the_cli_summarises_a_saved_trace(tmp_path, capsys):
    import trace_summary

    trace, _ = _trace(0)
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    out = tmp_path / "summary.json"
    assert trace_summary.main([str(path), "--json-out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["kernel_sources"] == json.loads(json.dumps(kernel_sources(trace)))
    assert saved["gpu_idle"] == json.loads(json.dumps(gpu_idle_summary(trace)))
    assert "aten::mul | backward: MulBackward0" in capsys.readouterr().out
    bad = {"not json.json": "{", "not a trace.json": '{"traceEvents": 5}', "no events.json": "[]",
           "not gzip.json.gz": "{}"}
    for name, text in bad.items():
        (tmp_path / name).write_text(text)
    for name in ["missing.json.gz", *bad]:
        with pytest.raises(SystemExit) as exit_info:
            trace_summary.main([str(tmp_path / name)])
        assert exit_info.value.code == 2, name
        assert name in capsys.readouterr().err.splitlines()[-1], name
