"""What holds a CUDA memory peak: a memory snapshot's allocation trace replayed to the moment
the allocated bytes were highest, and what was alive then, summed by the line that allocated it.

A snapshot comes from `vlmpack train --memory-snapshot` or `train_speed.py --memory-snapshot`
(torch.cuda.memory._dump_snapshot). The allocated bytes are those `max_memory_allocated`
counts: an allocation adds its block, a completed free takes it back. Blocks allocated before
the recording began are one row, "before the recording", sized from the snapshot's own end
state (its live blocks less the trace's net allocations). A trace recorded without stacks has
its blocks summed by size.

    python benchmarks/memory_peak.py SNAPSHOT.pickle [--top N] [--skip PATH ...] [--json-out FILE]
"""

from __future__ import annotations

import pickle
from collections import defaultdict
from pathlib import Path

from common import log, machine_info, parser, write_json

GIB = 2**30
# Frames inside these packages say how an allocation was made, not which part of the job asked
# for it: the site is the innermost Python frame outside them.
DEFAULT_SKIP = ("/torch/", "/triton/", "<frozen", "<string>")
LIVE_BLOCK_STATES = ("active_allocated", "active_pending_free")
BEFORE_RECORDING = "(allocated before the recording began)"
# a trace recorded without stacks (`_record_memory_history(context=None)`) names no line: its
# blocks are summed by size instead, which still tells a layer's saved input from a logit chunk
NO_STACK = "(no stack recorded) blocks of {mib:.1f} MiB"


def allocated_at_end(snapshot: dict, device: int) -> int:
    """Bytes in live blocks of `device` when the snapshot was taken."""
    return sum(block["size"] for segment in snapshot.get("segments", []) if segment.get("device", 0) == device
               for block in segment.get("blocks", []) if block.get("state") in LIVE_BLOCK_STATES)


def allocation_site(frames: list[dict], skip: tuple[str, ...]) -> str:
    """`file:line function` of the innermost Python frame outside `skip` (frames run innermost
    first), with the file cut to its last three path parts; C++ frames are passed over."""
    python = [f for f in frames if str(f.get("filename", "")).endswith(".py")]
    for frame in python:
        if not any(part in frame["filename"] for part in skip):
            break
    else:
        if not python:
            return "(no Python frame)"
        frame = python[0]
    name = "/".join(Path(frame["filename"]).parts[-3:])
    return f"{name}:{frame.get('line', '?')} {frame.get('name', '?')}"


def replay(events: list[dict], baseline: int) -> tuple[int, int]:
    """(peak bytes, index of the allocation that reached it) over the trace, starting from
    `baseline` allocated bytes; (baseline, -1) when no allocation rises above it."""
    current = peak = baseline
    peak_index = -1
    for index, event in enumerate(events):
        if event["action"] == "alloc":
            current += event["size"]
            if current > peak:
                peak, peak_index = current, index
        elif event["action"] == "free_completed":
            current -= event["size"]
    return peak, peak_index


def live_at(events: list[dict], until: int) -> tuple[dict[int, dict], int]:
    """The trace's allocations still alive after event `until` (addr -> event), and the bytes
    freed by then that were allocated before the recording began."""
    live, freed_before = {}, 0
    for event in events[:until + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            if live.pop(event["addr"], None) is None:
                freed_before += event["size"]
    return live, freed_before


def read_snapshot(path: str | Path) -> dict:
    """A snapshot pickle as torch.cuda.memory._dump_snapshot writes it."""
    with open(path, "rb") as f:
        return pickle.load(f)


def peak_report(snapshot: dict, device: int = 0, skip: tuple[str, ...] = DEFAULT_SKIP) -> dict:
    """The peak of `device`'s allocated bytes within the recorded trace and what held it."""
    traces = snapshot.get("device_traces", [])
    if device >= len(traces) or not traces[device]:
        raise ValueError(f"the snapshot holds no allocation trace for device {device}: record it with "
                         "torch.cuda.memory._record_memory_history() before the work it should show")
    events = traces[device]
    net = sum(e["size"] for e in events if e["action"] == "alloc") - \
        sum(e["size"] for e in events if e["action"] == "free_completed")
    baseline = allocated_at_end(snapshot, device) - net
    peak, index = replay(events, baseline)
    live, freed_before = live_at(events, index)
    sites: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for event in live.values():
        frames = event.get("frames")
        site = sites[allocation_site(frames, skip) if frames else NO_STACK.format(mib=event["size"] / 2**20)]
        site[0] += event["size"]
        site[1] += 1
    rows = [{"site": BEFORE_RECORDING, "gib": (baseline - freed_before) / GIB, "blocks": None}]
    rows += [{"site": site, "gib": size / GIB, "blocks": count} for site, (size, count) in sites.items()]
    rows.sort(key=lambda row: -row["gib"])
    reached_by = events[index] if index >= 0 else None
    return {
        "device": device,
        "peak_gib": peak / GIB,
        "events": len(events),
        "peak_event": index,
        "peak_reached_by": None if reached_by is None else {
            "gib": reached_by["size"] / GIB, "site": allocation_site(reached_by.get("frames") or [], skip)},
        "rows": rows,
    }


def main(argv=None) -> int:
    ap = parser(__doc__, json_out="the peak and its rows as JSON")
    ap.add_argument("snapshot", help="a memory snapshot pickle (torch.cuda.memory._dump_snapshot)")
    ap.add_argument("--device", type=int, default=0, help="the CUDA device whose trace is replayed (default 0)")
    ap.add_argument("--top", type=int, default=30, help="rows printed, largest first (default 30)")
    ap.add_argument("--skip", nargs="*", default=list(DEFAULT_SKIP), metavar="PATH",
                    help="frames whose file path holds one of these are passed over when naming an "
                         f"allocation's site (default: {' '.join(DEFAULT_SKIP)})")
    args = ap.parse_args(argv)
    path = Path(args.snapshot)
    if not path.is_file():
        ap.error(f"{path}: no such snapshot file")
    try:
        report = peak_report(read_snapshot(path), args.device, tuple(args.skip))
    except (OSError, pickle.UnpicklingError, EOFError, KeyError, TypeError, AttributeError) as exc:
        ap.error(f"{path}: not a torch memory snapshot ({type(exc).__name__}: {exc})")
    except ValueError as exc:
        ap.error(f"{path}: {exc}")
    log(f"peak {report['peak_gib']:.2f} GiB at event {report['peak_event']} of {report['events']}"
        + (f", reached by {report['peak_reached_by']['gib'] * 1024:.0f} MiB from {report['peak_reached_by']['site']}"
           if report["peak_reached_by"] else ""))
    for row in report["rows"][:args.top]:
        blocks = "" if row["blocks"] is None else f"{row['blocks']:6d}x"
        log(f"  {row['gib']:8.3f} GiB {blocks:>7}  {row['site']}")
    if args.json_out:
        write_json(args.json_out, {"machine": machine_info(), "snapshot": path.name, **report})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
