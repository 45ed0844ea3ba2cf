"""`vlmpack inspect DIR`: what a shard directory holds, at a glance.

Totals (rows, tokens, targets, images, visual tokens, bytes and bytes per visual token next
to Hugging Face's float32 `pixel_values`), rejects by reason with one example each, input
accounting, and per-sample distributions (sequence length, images, visual tokens, target
fraction) as terminal histograms, JSON (`--json`) or PNG charts plus a self-contained HTML
report (`--plots OUT/`).

Only small data is read: the manifest, the list *offsets* of each shard (`ShardSet.
sample_stats`), the `num_target_tokens` column and the `sample_uid` strings (to count repeated
uids). Pixel bytes and token values are never touched, so inspecting a million samples takes
seconds.

Also home of `patches_to_image`, the exact inverse of the stored patch layout (used by
`vlmpack show --save-images`); pure numpy, so this module imports neither side.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import math
import re
import sys
from contextlib import nullcontext
from pathlib import Path

import numpy as np

from .errors import EXIT_USER_ERROR, print_error, user_error_from_os_error
from .flags import refuse_empty
from .manifest import REJECTS_NAME, ShardFormatError, profile_name
from .outdir import prepare_output_dir, refuse_input_as_output, viewer_output_dir
from .reader import open_shards

HISTOGRAM_BINS = 10
BAR_WIDTH = 40
_EIGHTHS = " ▏▎▍▌▋▊▉█"
PERCENTILES = (50, 90, 99)

# name -> (label, integer-valued?, fixed value range or None)
DISTRIBUTIONS = {
    "seq_len": ("sequence length (tokens per sample)", True, None),
    "images_per_sample": ("images per sample", True, None),
    "visual_tokens_per_sample": ("visual tokens per sample", True, None),
    "target_fraction": ("target fraction (target tokens / tokens)", False, (0.0, 1.0)),
}


# ------------------------------------------------------------------------ pixels


def patches_to_image(pixel_patches: np.ndarray, grid_thw, patch_size: int, merge_size: int, channels: int = 3) -> np.ndarray:
    """Stored `pixel_patches` of one image -> the resized RGB image, uint8 [gh*P, gw*P, C].

    Exact inverse of `preprocess.images.image_to_patches`: rows are in merge-block order
    (gh/m, gw/m, m, m) and columns (C, P, P); one reshape and one transpose undo it.
    """
    t, gh, gw = (int(v) for v in np.asarray(grid_thw).reshape(-1))
    p, m, c = int(patch_size), int(merge_size), int(channels)
    if t != 1:
        raise ValueError(f"grid {t}x{gh}x{gw}: stored images have one temporal frame (t == 1), got t = {t}")
    if gh % m or gw % m:
        raise ValueError(f"grid {t}x{gh}x{gw}: h and w must be multiples of merge_size {m}")
    expected = (gh * gw, c * p * p)
    if tuple(pixel_patches.shape) != expected:
        raise ValueError(f"pixel_patches shape {tuple(pixel_patches.shape)} does not match grid {t}x{gh}x{gw}: expected {expected}")
    if pixel_patches.dtype != np.uint8:
        raise TypeError(f"pixel_patches must be uint8, got {pixel_patches.dtype}")
    blocks = pixel_patches.reshape(gh // m, gw // m, m, m, c, p, p)
    # (block row, row in block, py, block col, col in block, px, channel)
    return np.ascontiguousarray(blocks.transpose(0, 2, 5, 1, 3, 6, 4)).reshape(gh * p, gw * p, c)


def video_patches_to_frames(video_patches: np.ndarray, grid_thw, patch_size: int, merge_size: int,
                            temporal_patch_size: int, channels: int = 3) -> np.ndarray:
    """Stored `video_patches` of one video -> its resized frames, uint8 [t*T, gh*P, gw*P, C] (the
    last temporal patch's repeated frame included). Exact inverse of
    `preprocess.patchify.planes_to_rows`: rows in merge-block order per temporal patch,
    columns (C, T, P, P)."""
    t, gh, gw = (int(v) for v in np.asarray(grid_thw).reshape(-1))
    p, m, c, tp = int(patch_size), int(merge_size), int(channels), int(temporal_patch_size)
    expected = (t * gh * gw, c * tp * p * p)
    if tuple(video_patches.shape) != expected or gh % m or gw % m:
        raise ValueError(f"video_patches shape {tuple(video_patches.shape)} does not match grid {t}x{gh}x{gw}: "
                         f"expected {expected} with h, w multiples of {m}")
    blocks = video_patches.reshape(t, gh // m, gw // m, m, m, c, tp, p, p)
    # (temporal patch, frame in it, block row, row in block, py, block col, col in block, px, channel)
    frames = blocks.transpose(0, 6, 1, 3, 7, 2, 4, 8, 5)
    return np.ascontiguousarray(frames).reshape(t * tp, gh * p, gw * p, c)


# ------------------------------------------------------------------------ numbers


def _nice_width(raw: float) -> int:
    """A bin width >= raw that reads well: any integer below 10, else 1/2/2.5/5 x 10^k."""
    if raw <= 10:
        return max(1, math.ceil(raw))
    exp = 10 ** math.floor(math.log10(raw))
    for step in (1, 2, 2.5, 5, 10):
        if step * exp >= raw:
            return int(step * exp)
    return int(10 * exp)


def distribution(values: np.ndarray, *, integer: bool, bins: int = HISTOGRAM_BINS, value_range=None) -> dict:
    """Summary statistics and ~`bins` histogram bins of one per-sample quantity.

    Integer quantities get integer-aligned bins with inclusive `lo..hi` (widths 1..10, then 1/2/2.5/5 x 10^k);
    real ones equal-width bins over `value_range` (or min..max), half-open except the last.
    Percentiles are observed values (inverted CDF), never interpolations.
    """
    values = np.asarray(values)
    n = int(values.size)
    out = {"count": n, "integer": integer}
    if n == 0:
        return {**out, "min": None, "max": None, "mean": None, **{f"p{q}": None for q in PERCENTILES}, "bins": []}
    cast = int if integer else float
    lo, hi = values.min(), values.max()
    out.update(min=cast(lo), max=cast(hi), mean=float(values.mean(dtype=np.float64)))
    for q, v in zip(PERCENTILES, np.percentile(values, PERCENTILES, method="inverted_cdf")):
        out[f"p{q}"] = cast(v)
    if integer:
        lo, hi = int(lo), int(hi)
        width = _nice_width((hi - lo + 1) / bins)
        start = lo - lo % width
        counts = np.bincount((values.astype(np.int64) - start) // width, minlength=(hi - start) // width + 1)
        out["bins"] = [
            {"lo": start + i * width, "hi": start + (i + 1) * width - 1, "count": int(c)} for i, c in enumerate(counts)
        ]
    else:
        r_lo, r_hi = value_range if value_range is not None else (float(lo), float(hi))
        if r_hi <= r_lo:
            r_hi = r_lo + 1.0
        counts, edges = np.histogram(values, bins=bins, range=(r_lo, r_hi))
        out["bins"] = [{"lo": float(edges[i]), "hi": float(edges[i + 1]), "count": int(c)} for i, c in enumerate(counts)]
    return out


def _first_reject_examples(path: Path, codes) -> dict[str, dict]:
    """The first rejects.jsonl record of each code; stops reading once every code is seen."""
    wanted, found = set(codes), {}
    if not wanted or not path.is_file():
        return found
    try:
        fh = open(path, encoding="utf-8", errors="replace")
    except OSError:  # unreadable (its permissions): no examples, as when it is missing; `verify` names it
        return found
    with fh:
        for line in fh:
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):  # a damaged line: `vlmpack verify` names it
                continue
            if not isinstance(record, dict):
                continue
            code = record.get("code")
            if code in wanted and code not in found:
                found[code] = {k: record.get(k) for k in ("source", "row", "reason")}
                if len(found) == len(wanted):
                    break
    return found


def storage_per_visual_token(shard_bytes: int, patches: int, video_patches: int, vision: dict,
                             patch_row_width: int) -> dict:
    """What a visual token costs on disk, as `preprocess`, `merge`, `quickstart` and `inspect`
    all report it: the shard files' bytes (pixels, token ids, masks, positions) over the
    visual tokens of images and videos together; the uint8 pixels alone (an image patch holds
    one frame, a video patch its T frames); and HF's float32 `pixel_values` per token."""
    merge_area = int(vision["merge_size"]) ** 2
    temporal = int(vision["temporal_patch_size"])
    tokens = (patches + video_patches) // merge_area
    hf_bytes = 4 * temporal * patch_row_width * merge_area
    per_token = shard_bytes / tokens if tokens else None
    return {
        "bytes_per_visual_token": per_token,
        "pixel_bytes_per_visual_token": (patches + video_patches * temporal) * patch_row_width / tokens if tokens else None,
        "hf_pixel_values_bytes_per_visual_token": hf_bytes,
        "hf_pixel_values_to_disk_ratio": hf_bytes / per_token if per_token else None,
    }


def format_storage_per_visual_token(t: dict) -> str:
    """One line for `storage_per_visual_token`'s numbers, naming what each counts."""
    if not t["bytes_per_visual_token"]:
        return "- (no images or videos)"
    return (f"{t['bytes_per_visual_token']:,.0f} (shard files' bytes over the image and video tokens; pixels alone "
            f"{t['pixel_bytes_per_visual_token']:,.0f}); HF float32 pixel_values {t['hf_pixel_values_bytes_per_visual_token']:,} "
            f"({t['hf_pixel_values_to_disk_ratio']:.1f}x larger)")


def _video_totals(shards, counted: dict, merge_area: int, temporal_patch_size: int) -> dict:
    """Videos, their sampled frames (temporal patches x T, the last patch padded), seconds and tokens."""
    if "videos" not in counted:
        return {}
    grids = np.concatenate([shards.shard(k).list_values("video_grid_thw") for k in range(len(shards.shard_files))]
                           or [np.zeros(0, np.int32)]).reshape(-1, 3).astype(np.int64)
    seconds = np.concatenate([shards.shard(k).list_values("second_per_grid_ts") for k in range(len(shards.shard_files))]
                             or [np.zeros(0, np.float32)]).astype(np.float64)
    return {"video_frames": int(grids[:, 0].sum()) * temporal_patch_size,
            # seconds per grid are stored as float32: rounded, a 3.5 s video reads 3.5, not 3.4999998807907104
            "video_seconds": round(float((grids[:, 0] * seconds).sum()), 6) if len(seconds) == len(grids) else None,
            "video_tokens": counted["video_patches"] // merge_area}


def _collect(directory: str | Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(report, per-sample arrays): the report `inspect_shards` returns, plus the raw values for charts."""
    directory = Path(directory)
    shards = open_shards(directory)  # ShardFormatError on anything that is not a complete shard dir
    manifest = shards.manifest
    profile, vision = manifest["profile"], manifest["profile"]["vision"]
    merge_area = int(vision["merge_size"]) ** 2
    stats = shards.sample_stats()

    num_tokens = stats["num_tokens"]
    targets = stats["num_target_tokens"]
    arrays = {
        "seq_len": num_tokens,
        "images_per_sample": stats["num_images"],
        "visual_tokens_per_sample": stats["num_patches"] // merge_area,
        "target_fraction": targets / np.maximum(num_tokens, 1),
    }

    m_totals = manifest["totals"]
    bytes_on_disk = sum((directory / f).stat().st_size for f in shards.shard_files)
    counted = {
        "rows": len(num_tokens),
        "tokens": int(num_tokens.sum()),
        "target_tokens": int(targets.sum()),
        "images": int(stats["num_images"].sum()),
        "patches": int(stats["num_patches"].sum()),
        "bytes": bytes_on_disk,
    }
    consistency = [
        f"{key}: manifest says {int(m_totals[key]):,}, the shards hold {value:,} (run `vlmpack verify {directory}`)"
        for key, value in counted.items()
        if int(m_totals.get(key, -1)) != value
    ]
    if "videos" in m_totals:
        counted["videos"] = int(stats["num_videos"].sum())
        counted["video_patches"] = int(stats["num_video_patches"].sum())
        consistency += [
            f"{key}: manifest says {int(m_totals[key]):,}, the shards hold {counted[key]:,} (run `vlmpack verify {directory}`)"
            for key in ("videos", "video_patches") if int(m_totals[key]) != counted[key]]
    visual_tokens = counted["patches"] // merge_area
    totals = {
        "shards": len(shards.shard_files),
        **counted,
        "target_fraction": counted["target_tokens"] / counted["tokens"] if counted["tokens"] else 0.0,
        "visual_tokens": visual_tokens,
        **storage_per_visual_token(counted["bytes"], counted["patches"], counted.get("video_patches", 0), vision,
                                   int(manifest["patch_row_width"])),
        **_video_totals(shards, counted, merge_area, int(vision["temporal_patch_size"])),
        **_repeated_uids(shards),
    }

    acc = manifest.get("accounting", {})
    by_reason = acc.get("rejects_by_reason", {}) or {}
    examples = _first_reject_examples(directory / REJECTS_NAME, by_reason)
    rejects = [
        {"code": code, "count": int(count), "example": examples.get(code)}
        for code, count in sorted(by_reason.items(), key=lambda kv: (-int(kv[1]), kv[0]))
    ]
    report = {
        "directory": str(directory.resolve()),
        "format": manifest["format"],
        "schema_version": manifest["schema_version"],
        "profile": {
            "name": profile_name(profile),
            "family": profile.get("family"),
            "id": profile.get("id"),
            "source": profile.get("source"),
            "tokenizer_sha256": profile.get("tokenizer_sha256"),
            "chat_template_sha256": profile.get("chat_template_sha256"),
            "vlmpack_version": profile.get("vlmpack_version"),
            "vision": vision,
        },
        "settings": manifest.get("settings", {}),
        "totals": totals,
        "accounting": {
            "rows_read": acc.get("rows_read"),
            "rows_written": acc.get("rows_written"),
            "rows_rejected": acc.get("rows_rejected"),
            "inputs": acc.get("inputs", []),
        },
        "rejects": rejects,
        "distributions": {
            name: {"label": label, **distribution(arrays[name], integer=integer, value_range=value_range)}
            for name, (label, integer, value_range) in DISTRIBUTIONS.items()
        },
        "consistency": consistency,
    }
    return report, arrays


def _repeated_uids(shards) -> dict:
    """How many sample_uids occur more than once, and in how many rows (the uid column only)."""
    import pyarrow.compute as pc

    counts = pc.value_counts(shards.string_column("sample_uid")).field("counts")  # int64, no nulls
    # read from the buffer: `to_numpy` and scalars made from Python ints import pandas (a quarter second)
    counts = np.frombuffer(counts.buffers()[1], np.int64)[counts.offset : counts.offset + len(counts)]
    repeated = counts[counts > 1]
    return {"repeated_sample_uids": len(repeated), "rows_with_repeated_uid": int(repeated.sum())}


def inspect_shards(directory: str | Path) -> dict:
    """Everything `vlmpack inspect` shows, as one JSON-ready dict (plain ints/floats/strings).

    Keys: directory, format, schema_version, profile, settings, totals, accounting, rejects
    [{code, count, example}], distributions {name: {label, count, min, p50, p90, p99, max,
    mean, integer, bins [{lo, hi, count}]}}, consistency (manifest/shard disagreements).
    """
    return _collect(directory)[0]


# ------------------------------------------------------------------------ text


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _bar(count: int, peak: int, width: int = BAR_WIDTH) -> str:
    eighths = round(count / peak * width * 8) if peak else 0
    if count and not eighths:
        eighths = 1  # a non-empty bin is never invisible
    full, rest = divmod(eighths, 8)
    return "█" * full + (_EIGHTHS[rest] if rest else "")


def _fmt_num(v, integer: bool) -> str:
    if v is None:
        return "-"
    return f"{int(v):,}" if integer else f"{v:.3f}"


def format_distribution(dist: dict) -> list[str]:
    integer = dist["integer"]
    head = f"{dist['label']}:"
    if not dist["count"]:
        return [f"{head} no samples"]
    stats = "  ".join(
        f"{k} {_fmt_num(dist[k], integer)}" for k in ("min", "p50", "p90", "p99", "max")
    )
    lines = [f"{head}  count {dist['count']:,}  {stats}  mean {dist['mean']:,.{1 if integer else 3}f}"]
    if integer:
        labels = [f"{b['lo']:,}" if b["lo"] == b["hi"] else f"{b['lo']:,}–{b['hi']:,}" for b in dist["bins"]]
    else:
        labels = [f"{b['lo']:.2f}–{b['hi']:.2f}" for b in dist["bins"]]
    label_w = max(len(s) for s in labels)
    peak = max(b["count"] for b in dist["bins"])
    count_w = len(f"{peak:,}")
    for label, b in zip(labels, dist["bins"]):
        share = b["count"] / dist["count"]
        lines.append(f"  {label:>{label_w}} │{_bar(b['count'], peak):<{BAR_WIDTH}} {b['count']:>{count_w},} {share:6.1%}")
    return lines


def format_report(report: dict) -> str:
    t, acc, prof = report["totals"], report["accounting"], report["profile"]
    vision = prof["vision"]
    m = vision["merge_size"]
    lines = [
        f"shard directory  {report['directory']}",
        f"profile          {prof['name']}  fingerprint {prof['id']}  source {prof['source']}",
        f"shards           {t['shards']} files, {human_bytes(t['bytes'])} ({t['bytes']:,} bytes)",
        f"rows             {t['rows']:,}",
        f"tokens           {t['tokens']:,}  targets {t['target_tokens']:,} ({t['target_fraction']:.1%})",
        f"images           {t['images']:,}  visual tokens {t['visual_tokens']:,} ({t['patches']:,} patches / {m}x{m})",
    ]
    if t.get("videos"):
        seconds = "?" if t["video_seconds"] is None else f"{t['video_seconds']:,.1f}"
        lines.append(f"videos           {t['videos']:,}  {t['video_frames']:,} frames, {seconds} s  "
                     f"visual tokens {t['video_tokens']:,} ({t['video_patches']:,} patches / {m}x{m})")
    lines.append(f"bytes/visual tok {format_storage_per_visual_token(t)}")
    if t["repeated_sample_uids"]:
        lines.append(
            f"sample uids      {t['repeated_sample_uids']:,} repeated, in {t['rows_with_repeated_uid']:,} rows "
            "(the input's ids repeat; `vlmpack show --uid` shows the first match)"
        )
    else:
        lines.append("sample uids      all unique")
    settings = report["settings"]
    if settings:
        lines.append("settings         " + "  ".join(f"{k} {v}" for k, v in settings.items()))
    if acc["rows_read"] is not None:
        lines.append(
            f"inputs           {acc['rows_read']:,} rows read = {acc['rows_written']:,} written + {acc['rows_rejected']:,} rejected"
        )
    for inp in acc["inputs"]:
        extra = "  ".join(f"{k} {inp[k]:,}" if isinstance(inp[k], int) else f"{k} {inp[k]}" for k in inp if k != "path")
        lines.append(f"  {inp.get('path')}  {extra}")
    if report["rejects"]:
        lines.append(f"rejects          {sum(r['count'] for r in report['rejects']):,} rows (details: {report['directory']}/{REJECTS_NAME})")
        code_w = max(len(r["code"]) for r in report["rejects"])
        count_w = max(len(f"{r['count']:,}") for r in report["rejects"])
        for r in report["rejects"]:
            ex = r["example"]
            example = f"  e.g. {ex['source']}:{ex['row']}: {ex['reason']}" if ex else ""
            lines.append(f"  {r['code']:<{code_w}} {r['count']:>{count_w},}{example}")
    else:
        lines.append("rejects          none")
    for problem in report["consistency"]:
        lines.append(f"WARNING          {problem}")
    for dist in report["distributions"].values():
        lines.append("")
        lines.extend(format_distribution(dist))
    return "\n".join(lines)


# ------------------------------------------------------------------------ charts + HTML


def _chart_bins(values: np.ndarray, integer: bool, value_range) -> tuple[np.ndarray, np.ndarray]:
    """Finer bins than the terminal: one bar per value for small integer ranges, else 40."""
    if integer and values.size and int(values.max()) - int(values.min()) < 60:
        lo, hi = int(values.min()), int(values.max())
        return np.bincount(values - lo, minlength=hi - lo + 1), np.arange(lo, hi + 2) - 0.5
    if value_range is None and values.size:
        value_range = (float(values.min()), float(values.max()) if values.max() > values.min() else float(values.min()) + 1)
    return np.histogram(values, bins=40, range=value_range)


PLOT_FILES = re.compile(r"[a-z0-9_]+\.png|report\.html")  # what --plots writes: a chart per distribution


def write_charts(report: dict, arrays: dict[str, np.ndarray], out_dir: Path) -> dict[str, Path]:
    """One PNG per distribution (matplotlib, Agg backend); returns name -> path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    prepare_output_dir(out_dir, what="--plots")
    paths = {}
    for name, (label, integer, value_range) in DISTRIBUTIONS.items():
        values, dist = arrays[name], report["distributions"][name]
        fig, ax = plt.subplots(figsize=(7.2, 3.6), dpi=100)
        if values.size:
            counts, edges = _chart_bins(values, integer, value_range)
            ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge", color="#3b7dd8", edgecolor="white", linewidth=0.5)
            for q, style in zip(PERCENTILES, ("-", "--", ":")):
                ax.axvline(dist[f"p{q}"], color="#d8453b", linestyle=style, linewidth=1.2, label=f"p{q} {_fmt_num(dist[f'p{q}'], integer)}")
            ax.legend(loc="upper right", fontsize=8, frameon=False)
        else:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        mean = "-" if dist["mean"] is None else f"{dist['mean']:,.{1 if integer else 3}f}"
        ax.set_title(f"{label}  (n={dist['count']:,}, mean {mean})", fontsize=10)
        ax.set_xlabel(label.split(" (")[0])
        ax.set_ylabel("samples")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        if integer:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.spines[["top", "right"]].set_visible(False)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
        paths[name] = path
    return paths


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1100px;color:#222;padding:0 1em}
h1{font-size:1.4em}h2{font-size:1.1em;margin-top:1.6em;border-bottom:1px solid #ddd;padding-bottom:.2em}
table{border-collapse:collapse;font-size:.92em}td,th{padding:.25em .8em;border-bottom:1px solid #eee;text-align:left;vertical-align:top}
td.n{text-align:right;font-variant-numeric:tabular-nums}code{font-size:.9em}
.charts{display:grid;grid-template-columns:repeat(auto-fit,minmax(500px,1fr));gap:1em}.charts img{width:100%;border:1px solid #eee}
.warn{color:#b00}
"""


def _row(cells, numeric=()) -> str:
    return "<tr>" + "".join(
        f"<td class=n>{html.escape(str(c))}</td>" if i in numeric else f"<td>{html.escape(str(c))}</td>" for i, c in enumerate(cells)
    ) + "</tr>"


def write_html_report(report: dict, charts: dict[str, Path], path: Path) -> Path:
    """A single self-contained HTML file: charts embedded as base64 PNG, no external resources."""
    t, acc, prof = report["totals"], report["accounting"], report["profile"]
    summary = [
        ("directory", report["directory"]),
        ("profile", f"{prof['name']} (fingerprint {prof['id']}, source {prof['source']})"),
        ("shards", f"{t['shards']:,} files, {human_bytes(t['bytes'])} ({t['bytes']:,} bytes)"),
        ("rows", f"{t['rows']:,}"),
        ("tokens", f"{t['tokens']:,}"),
        ("target tokens", f"{t['target_tokens']:,} ({t['target_fraction']:.1%})"),
        ("images", f"{t['images']:,}"),
        ("visual tokens", f"{t['visual_tokens']:,} ({t['patches']:,} patches)"),
        ("shard files' bytes / visual token (images and videos)",
         f"{t['bytes_per_visual_token']:,.0f}" if t["bytes_per_visual_token"] else "-"),
        ("HF float32 pixel_values bytes / visual token", f"{t['hf_pixel_values_bytes_per_visual_token']:,}"),
    ]
    if acc["rows_read"] is not None:
        summary.append(("input rows", f"{acc['rows_read']:,} read = {acc['rows_written']:,} written + {acc['rows_rejected']:,} rejected"))
    parts = [
        "<!doctype html><html lang=en><head><meta charset=utf-8>",
        f"<title>vlmpack inspect: {html.escape(report['directory'])}</title><style>{_CSS}</style></head><body>",
        f"<h1>vlmpack inspect: <code>{html.escape(report['directory'])}</code></h1>",
        "<h2>Summary</h2><table>",
        *(_row(r) for r in summary),
        "</table>",
    ]
    for problem in report["consistency"]:
        parts.append(f"<p class=warn>WARNING: {html.escape(problem)}</p>")
    parts.append("<h2>Distributions</h2><table><tr><th>per sample</th><th>count</th><th>min</th><th>p50</th><th>p90</th><th>p99</th><th>max</th><th>mean</th></tr>")
    for dist in report["distributions"].values():
        i = dist["integer"]
        parts.append(_row(
            [dist["label"], f"{dist['count']:,}", *(_fmt_num(dist[k], i) for k in ("min", "p50", "p90", "p99", "max")),
             "-" if dist["mean"] is None else f"{dist['mean']:,.3f}"],
            numeric=range(1, 8),
        ))
    parts.append("</table><div class=charts>")
    for name, chart in charts.items():
        data = base64.b64encode(Path(chart).read_bytes()).decode()
        label = report["distributions"][name]["label"]
        parts.append(f'<figure><img alt="{html.escape(label)}" data-chart="{name}" src="data:image/png;base64,{data}"></figure>')
    parts.append("</div><h2>Rejects</h2>")
    if report["rejects"]:
        parts.append("<table><tr><th>code</th><th>rows</th><th>first example</th></tr>")
        for r in report["rejects"]:
            ex = r["example"]
            parts.append(_row([r["code"], f"{r['count']:,}", f"{ex['source']}:{ex['row']}: {ex['reason']}" if ex else "-"], numeric=(1,)))
        parts.append("</table>")
    else:
        parts.append("<p>none</p>")
    if acc["inputs"]:
        keys = sorted({k for inp in acc["inputs"] for k in inp}, key=lambda k: (k != "path", k))
        parts.append("<h2>Inputs</h2><table><tr>" + "".join(f"<th>{html.escape(k)}</th>" for k in keys) + "</tr>")
        parts.extend(_row([inp.get(k, "") for k in keys]) for inp in acc["inputs"])
        parts.append("</table>")
    if report["settings"]:
        parts.append("<h2>Settings</h2><table>")
        parts.extend(_row([k, v]) for k, v in report["settings"].items())
        parts.append("</table>")
    parts.append("</body></html>\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


# ------------------------------------------------------------------------ CLI


class Inspect:
    """`vlmpack inspect DIR [--json] [--plots OUT/]`."""

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("dir", help="shard directory (holds manifest.json)")
        parser.add_argument("--json", action="store_true", help="print one JSON object (all numbers and histogram bins) instead of text")
        parser.add_argument("--plots", metavar="OUT", default=None,
                            help="also write one PNG chart per distribution and a self-contained OUT/report.html")

    @staticmethod
    def run(args) -> int:
        if args.plots is not None:
            refuse_empty("--plots", args.plots, "give a directory's path")
            refuse_input_as_output(args.plots, args.dir, what="--plots")
        with viewer_output_dir(args.plots, "inspect", "--plots", PLOT_FILES) if args.plots else nullcontext():
            try:
                report, arrays = _collect(args.dir)  # the manifest and each shard checked as they are opened
            except ShardFormatError as exc:
                print_error("inspect", exc)
                return EXIT_USER_ERROR
            except OSError as exc:  # permissions and the like, worded as for every command; else what the system said
                mapped = user_error_from_os_error(exc)
                print_error("inspect", mapped or f"{exc.filename}: cannot be read ({exc.strerror})")
                return mapped.exit_code if mapped else EXIT_USER_ERROR  # a failing storage (EIO) is a fault, exit 1
            return Inspect._print(args, report, arrays)  # a closed pipe: the dispatcher ends quietly

    @staticmethod
    def _print(args, report: dict, arrays: dict) -> int:
        written = []
        if args.plots:
            out = Path(args.plots)
            charts = write_charts(report, arrays, out)
            written = [*charts.values(), write_html_report(report, charts, out / "report.html")]
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            print(format_report(report))
        if written:
            print(f"\nwrote {len(written) - 1} charts and {written[-1]}", file=sys.stderr if args.json else sys.stdout)
        return 0
