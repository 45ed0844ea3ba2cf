"""What the training loader costs per sample, against an on-the-fly Hugging Face loader, and
what packing buys over padded batches. One process, the same rows for every path.

Data: `preprocess.examples.example_rows` (single/multi-image, text-only, multi-turn, tool
calls; images of --size-range px, JPEG/PNG data URIs), written to JSONL and preprocessed with
`run_preprocess` on --workers processes (default: all cores) into a shard directory, which is
also exported to WebDataset tars.

(a) vlmpack: `build_pack_plan` + `PackedDataset` through a torch `DataLoader(batch_size=None)`
    at each --seq-len, with num_workers 0 and 2 (and the WebDataset export at workers 0): the
    epoch's packs, repeated as fresh datasets (shards mapped anew, as every epoch does) until at
    least --packs packs. CPU = this process's `time.process_time` + the DataLoader workers' CPU
    (`RUSAGE_CHILDREN`, read after they exit; their start-up included); "main ms/pack" is the
    training process's own share. On a machine with CUDA the same runs are repeated with
    pin_memory (what the trainer does there: the pack ends in pinned memory, the buffer the
    GPU copy reads). Planning is timed apart (once per epoch per rank). "floor":
    fetch each pack's samples and concatenate their pixel patches, nothing else: the one copy
    any loader handing the trainer a contiguous pixel buffer makes.
(b) HF on the fly, per sample: `json.loads` -> `apply_chat_template` (official template,
    --template) -> `transformers.image_utils.load_image` -> `Qwen2VLImageProcessorPil` (Qwen3-VL
    constants) -> image-pad expansion -> tokenize; CPU ms per sample over --hf-rows rows. A
    lower bound on such a loader: no M-RoPE positions, no collation, no padding.
(d) Worker hand-off: per pack, assemble and make the pixel patches sendable to the training
    process, into a private array then `share_memory_()` (a second copy) vs straight into
    shared memory (what the loader's workers do); see `measure_handoff`.
(c) Packing vs padding at a 16k token budget: packed = the plan's packs of --fill-seq-len;
    padded = samples in random order, greedily batched while B * longest <= budget, each batch
    padded to its longest sample (also with the epoch sorted by length: padding's best case).
    Fill = real tokens / budget; for padded batches also real / (B * longest).

(a) and (b) run --rounds times, interleaved so machine noise hits every path alike; each
figure is the median round (all rounds are in the JSON). Data sit in the page cache (just
written), the steady state of a node re-reading its shards; cold storage adds read time.

    python benchmarks/loader_speed.py --rows 3000 --json-out benchmarks/results/loader_speed_<device>_<yyyymmdd>.json
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import REPO, machine_info, parser, write_json
from torch.utils.data import ConcatDataset, DataLoader

from preprocess.examples import example_rows, write_jsonl
from preprocess.job import PreprocessConfig, run_preprocess
from preprocess.profiles import builtin_profile
from shards_schema.builtin import QWEN3_VL_VISION
from shards_schema import open_shards
from shards_schema.webdataset import WebDatasetShards, export_webdataset
from train.loader import PackedDataset, shared_uint8
from train.pack_plan import PackSettings, build_pack_plan
from train.packed_batch import assemble_pack, patch_rows

DEFAULT_TEMPLATE = REPO / "tests" / "fixtures" / "qwen3_vl_instruct.chat_template.jinja"


# --------------------------------------------------------------------------- data


def build_data(work: Path, rows: int, size_range: tuple[int, int], seed: int, workers: int, rows_per_shard: int) -> dict:
    t0 = time.perf_counter()
    jsonl = write_jsonl(work / "chats.jsonl", example_rows(rows, seed=seed, size_range=size_range))
    generated = time.perf_counter() - t0
    t0 = time.perf_counter()
    manifest = run_preprocess(PreprocessConfig(inputs=[str(jsonl)], out=str(work / "shards"), workers=workers,
                                               rows_per_shard=rows_per_shard, progress=False))
    preprocessed = time.perf_counter() - t0
    t0 = time.perf_counter()
    export_webdataset(work / "shards", work / "tars")
    exported = time.perf_counter() - t0
    t0 = time.perf_counter()
    open_shards(work / "shards").sample_stats()
    arrow_sizes = time.perf_counter() - t0
    t0 = time.perf_counter()
    WebDatasetShards(work / "tars").sample_stats()  # first call in this process: the tar-header walk, uncached
    tar_sizes = time.perf_counter() - t0
    totals = manifest["totals"]
    return {
        "jsonl": str(jsonl), "shards": str(work / "shards"), "tars": str(work / "tars"),
        "rows": rows, "size_range": list(size_range), "samples": totals["rows"], "tokens": totals["tokens"],
        "images": totals["images"], "visual_tokens": totals["patches"] // QWEN3_VL_VISION.merge_size**2,
        "shard_bytes": totals["bytes"], "jsonl_bytes": jsonl.stat().st_size, "generate_seconds": round(generated, 2),
        "preprocess_seconds": round(preprocessed, 2), "preprocess_workers": workers, "export_seconds": round(exported, 2),
        "sizes_read_us_per_sample": {"arrow_offsets": arrow_sizes / totals["rows"] * 1e6,
                                     "webdataset_tar_headers": tar_sizes / totals["rows"] * 1e6},
    }


# --------------------------------------------------------------------------- (a) our loader


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure_loader(source: str, seq_len: int, num_workers: int, min_packs: int, seed: int, pin: bool = False) -> dict:
    """The epoch's packs, `repeats` times, through one DataLoader. Each repeat is a fresh
    `PackedDataset` whose shards are mapped anew (in the workers too), so every repeat pays
    the page-mapping faults a real epoch pays once per page; workers start once. `pin`: the
    trainer's setting on GPUs, packs end in pinned memory (the copy the GPU transfer reads)."""
    t0 = time.perf_counter()
    plan = build_pack_plan([source], PackSettings(seq_len=seq_len, seed=seed))
    plan_seconds = time.perf_counter() - t0
    epochs = [PackedDataset(plan, pin_memory=pin)]
    epochs += [PackedDataset(plan, pin_memory=pin) for _ in range(-(-min_packs // len(epochs[0])) - 1)]
    loader = DataLoader(ConcatDataset(epochs), batch_size=None, num_workers=num_workers, pin_memory=pin)
    samples = tokens = packs = 0
    cpu0, child0, wall0 = time.process_time(), children_cpu(), time.perf_counter()
    for batch in loader:  # exhausting the iterator joins the workers, so their CPU is in RUSAGE_CHILDREN
        packs += 1
        samples += batch.num_samples
        tokens += int(batch.sample_lengths.sum())
    wall = time.perf_counter() - wall0
    main_cpu, worker_cpu = time.process_time() - cpu0, children_cpu() - child0
    cpu = main_cpu + worker_cpu
    return {
        "source": "webdataset" if Path(source, "index.json").is_file() else "arrow", "seq_len": seq_len,
        "num_workers": num_workers, "pinned": pin, "packs": packs, "epochs": len(epochs), "samples": samples, "tokens": tokens,
        "samples_per_pack": samples / packs, "fill": plan.stats["fill_efficiency"],
        "wall_seconds": wall, "packs_per_s": packs / wall, "samples_per_s": samples / wall, "tokens_per_s": tokens / wall,
        "cpu_seconds": cpu, "cpu_main_seconds": main_cpu, "cpu_worker_seconds": worker_cpu,
        "cpu_us_per_sample": cpu / samples * 1e6, "cpu_ms_per_pack": cpu / packs * 1e3,
        "main_cpu_ms_per_pack": main_cpu / packs * 1e3, "plan_seconds": plan_seconds,
    }


def measure_copy_floor(source: str, seq_len: int, min_packs: int, seed: int) -> dict:
    """The floor under any loader that hands the trainer one contiguous pixel buffer per pack:
    fetch the pack's samples (`PackedDataset.samples`) and concatenate their pixel patches, and
    nothing else, under the same fresh-mapping protocol as `measure_loader` (workers 0)."""
    plan = build_pack_plan([source], PackSettings(seq_len=seq_len, seed=seed))
    first = PackedDataset(plan)
    epochs = [first] + [PackedDataset(plan) for _ in range(-(-min_packs // len(first)) - 1)]
    samples = 0
    cpu0 = time.process_time()
    for dataset in epochs:
        for k in range(len(dataset)):
            parts = dataset.samples(k)
            pixels = np.concatenate([s["pixel_patches"] for s in parts])
            samples += len(parts)
            del pixels
    cpu = time.process_time() - cpu0
    return {"seq_len": seq_len, "samples": samples, "cpu_us_per_sample": cpu / samples * 1e6}


# --------------------------------------------------------------------------- (b) HF on the fly


def measure_handoff(source: str, seq_len: int, seed: int) -> dict:
    """(d) What a DataLoader worker spends per pack to assemble it AND make its pixel patches
    sendable to the training process (shared memory), three ways on the same packs, in rotating
    order: `private` = assemble into a private array, then `share_memory_()` (what the result
    queue does to a plain tensor: a second copy); `faulting` = assemble straight into a block
    allocated in shared memory, its pages faulted in one by one by the copy; `shared` = the same
    with the block's pages mapped up front (`train.loader.shared_uint8`, what `PackedDataset`
    does in a worker)."""
    plan = build_pack_plan([source], PackSettings(seq_len=seq_len, seed=seed))
    dataset = PackedDataset(plan)
    ways = ("private", "faulting", "shared")
    cpu = dict.fromkeys(ways, 0.0)
    samples_total = 0
    for k in range(len(dataset)):
        samples = dataset.samples(k)
        samples_total += len(samples)
        for way in ways[k % 3:] + ways[:k % 3]:
            t0 = time.process_time()
            if way == "private":
                torch.from_numpy(assemble_pack(samples).pixel_patches).share_memory_()
            else:
                rows, width = patch_rows(samples)
                out = shared_uint8(rows, width, prefault=way == "shared").numpy() if rows else None
                assemble_pack(samples, patch_out=None if out is None else {"pixel_patches": out})
            cpu[way] += time.process_time() - t0
    return {"seq_len": seq_len, "packs": len(dataset), "samples": samples_total,
            **{f"{way}_us_per_sample": cpu[way] / samples_total * 1e6 for way in ways},
            "private_over_shared": cpu["private"] / cpu["shared"],
            "faulting_over_shared": cpu["faulting"] / cpu["shared"]}


def hf_loader(template: str, tmp: Path):
    """The per-sample function of an on-the-fly HF loader (imports transformers only here)."""
    from transformers import AutoTokenizer
    from transformers.image_utils import load_image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok_dir = tmp / "hf_tokenizer"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_text(builtin_profile("qwen3-vl").tokenizer_json, encoding="utf-8")
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    v = QWEN3_VL_VISION
    processor = Qwen2VLImageProcessorPil(patch_size=v.patch_size, merge_size=v.merge_size,
                                         temporal_patch_size=v.temporal_patch_size, image_mean=list(v.image_mean),
                                         image_std=list(v.image_std), min_pixels=v.min_pixels, max_pixels=v.max_pixels)
    pad = "<|image_pad|>"

    def sample(line: str) -> tuple[list[int], np.ndarray | None]:
        row = json.loads(line)
        messages = row["messages"]
        text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
        urls = [p["image_url"]["url"] for m in messages if isinstance(m.get("content"), list)
                for p in m["content"] if p.get("type") == "image_url"]
        pixel_values = None
        if urls:
            features = processor(images=[load_image(u) for u in urls], return_tensors="np")
            pixel_values = features["pixel_values"]
            pieces = text.split(pad)
            if len(pieces) != len(urls) + 1:
                raise RuntimeError(f"row {row.get('id')}: {len(pieces) - 1} image pads for {len(urls)} images")
            counts = [int(g.prod()) // v.merge_size**2 for g in features["image_grid_thw"]]
            text = pieces[0] + "".join(pad * c + p for c, p in zip(counts, pieces[1:]))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids, pixel_values

    return sample


def measure_hf(sample, lines: list[str]) -> dict:
    tokens = 0
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for line in lines:
        tokens += len(sample(line)[0])
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return {"samples": len(lines), "tokens": tokens, "cpu_seconds": cpu, "wall_seconds": wall,
            "cpu_ms_per_sample": cpu / len(lines) * 1e3, "cpu_us_per_sample": cpu / len(lines) * 1e6,
            "samples_per_s": len(lines) / wall}


def median_run(runs: list[dict]) -> dict:
    """The round with the median CPU per sample, plus every round's figure (machine noise)."""
    ordered = sorted(runs, key=lambda r: r["cpu_us_per_sample"])
    out = dict(ordered[(len(ordered) - 1) // 2])
    out["cpu_us_per_sample_rounds"] = [round(r["cpu_us_per_sample"], 2) for r in runs]
    return out


# --------------------------------------------------------------------------- (c) packing vs padding


def padded_batches(lengths: np.ndarray, budget: int) -> dict:
    """Greedy batches in the given order: add samples while (B + 1) * longest <= budget."""
    batches, real, area = [], 0, 0
    count, longest = 0, 0
    for length in lengths.tolist():
        if length > budget:
            continue
        if count and (count + 1) * max(longest, length) > budget:
            batches.append((count, longest, real))
            count, longest, real = 0, 0, 0
        count, longest, real = count + 1, max(longest, length), real + length
    if count:
        batches.append((count, longest, real))
    b = np.array(batches, dtype=np.int64)
    area = b[:, 0] * b[:, 1]
    return {"batches": len(b), "samples_per_batch": float(b[:, 0].mean()),
            "real_tokens_per_batch": float(b[:, 2].mean()), "fill_of_budget": float(b[:, 2].sum() / (len(b) * budget)),
            "fill_of_padded": float(b[:, 2].sum() / area.sum())}


def packing_efficiency(shards_dir: str, budget: int, seed: int) -> dict:
    lengths = open_shards(shards_dir).sample_stats()["num_tokens"].astype(np.int64)
    plan = build_pack_plan([shards_dir], PackSettings(seq_len=budget, seed=seed))
    pack_tokens = np.asarray(plan.pack_tokens, dtype=np.int64)
    shuffled = lengths[np.random.default_rng(seed).permutation(len(lengths))]
    return {
        "budget": budget, "samples": len(lengths), "mean_length": float(lengths.mean()), "max_length": int(lengths.max()),
        "packed": {"batches": plan.num_packs, "samples_per_batch": plan.stats["samples_per_pack_mean"],
                   "real_tokens_per_batch": float(pack_tokens.mean()), "fill_of_budget": plan.stats["fill_efficiency"],
                   "dropped_samples": plan.stats["dropped_samples"]},
        "padded_random": padded_batches(shuffled, budget),
        "padded_sorted": padded_batches(np.sort(lengths)[::-1], budget),
    }


# --------------------------------------------------------------------------- report


def print_report(report: dict) -> None:
    d = report["data"]
    print(f"\ndata: {d['samples']:,} samples ({d['rows']:,} rows, images {d['size_range'][0]}-{d['size_range'][1]} px), "
          f"{d['tokens']:,} tokens ({d['visual_tokens'] / d['tokens']:.0%} visual), {d['images']:,} images; "
          f"shards {d['shard_bytes'] / 1e6:.1f} MB; preprocess {d['preprocess_seconds']:.1f} s on {d['preprocess_workers']} workers")
    sizes = d["sizes_read_us_per_sample"]
    print(f"planner's size read: {sizes['arrow_offsets']:.2f} us/sample from Arrow offsets, "
          f"{sizes['webdataset_tar_headers']:.2f} us/sample from the WebDataset tar headers (uncached)")
    hf = report["hf"]
    print(f"\n(b) HF on the fly: {hf['cpu_ms_per_sample']:.2f} CPU ms/sample ({hf['samples']} samples, "
          f"{hf['samples_per_s']:.0f} samples/s on one process; rounds {hf['cpu_us_per_sample_rounds']} us)")
    print("\n(a) vlmpack loader")
    head = (f"{'source':<11}{'seq_len':>8}{'workers':>8}{'pinned':>7}{'packs':>7}{'smp/pack':>9}{'packs/s':>9}{'smp/s':>8}"
            f"{'Mtok/s':>7}{'CPU us/smp':>11}{'CPU ms/pack':>12}{'main ms/pack':>13}{'floor us/smp':>13}{'HF/ours':>8}")
    print(head)
    print("-" * len(head))
    for r in report["ours"]:
        floor = f"{r['copy_floor_us_per_sample']:.1f}" if "copy_floor_us_per_sample" in r else "-"
        print(f"{r['source']:<11}{r['seq_len']:>8}{r['num_workers']:>8}{'yes' if r['pinned'] else 'no':>7}{r['packs']:>7}{r['samples_per_pack']:>9.1f}"
              f"{r['packs_per_s']:>9.0f}{r['samples_per_s']:>8.0f}{r['tokens_per_s'] / 1e6:>7.1f}"
              f"{r['cpu_us_per_sample']:>11.1f}{r['cpu_ms_per_pack']:>12.2f}{r['main_cpu_ms_per_pack']:>13.2f}"
              f"{floor:>13}{r['hf_cpu_ratio']:>7.0f}x")
    ratio = report["hf_over_ours"]
    print(f"HF CPU per sample / ours: best {ratio['best']:.0f}x; the pixel-copy floor alone allows at most "
          f"{ratio['ceiling_from_copy_floor']:.0f}x (floor = fetch the samples + concatenate their pixels)")
    h = report["worker_handoff"]
    last = h["rounds"][-1]
    print(f"\n(d) worker hand-off at seq_len {last['seq_len']} (assemble + make the patches sendable): private array "
          f"then share_memory_() {last['private_us_per_sample']:.0f} us/sample, straight into shared memory "
          f"{last['faulting_us_per_sample']:.0f} us/sample, the same with its pages mapped up front "
          f"{last['shared_us_per_sample']:.0f} us/sample: {h['private_over_shared_median']:.2f}x / "
          f"{h['faulting_over_shared_median']:.2f}x less CPU with the last (median over rounds)")
    p = report["packing"]
    print(f"\n(c) tokens per batch at a {p['budget']:,}-token budget (mean sample {p['mean_length']:.0f} tokens, "
          f"max {p['max_length']:,})")
    print(f"{'layout':<28}{'batches':>8}{'smp/batch':>10}{'real tok/batch':>15}{'fill of budget':>15}{'fill of padded':>15}")
    for name, label in (("packed", "packed (THD)"), ("padded_random", "padded, random order"),
                        ("padded_sorted", "padded, sorted by length")):
        r = p[name]
        fill_padded = f"{r['fill_of_padded']:.1%}" if "fill_of_padded" in r else "-"
        print(f"{label:<28}{r['batches']:>8}{r['samples_per_batch']:>10.1f}{r['real_tokens_per_batch']:>15,.0f}"
              f"{r['fill_of_budget']:>15.1%}{fill_padded:>15}")


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--rows", type=int, default=3000, help="synthetic conversations to preprocess")
    ap.add_argument("--size-range", type=int, nargs=2, default=[64, 640], metavar=("MIN", "MAX"), help="image side, px")
    ap.add_argument("--workers", type=int, default=os.cpu_count(), help="preprocessing workers (default: all cores)")
    ap.add_argument("--rows-per-shard", type=int, default=256, help="rows per shard file")
    ap.add_argument("--seq-len", type=int, nargs="+", default=[8192, 16384, 32768], help="pack lengths to measure")
    ap.add_argument("--loader-workers", type=int, nargs="+", default=[0, 2], help="DataLoader num_workers to measure")
    ap.add_argument("--packs", type=int, default=300, help="at least this many packs per loader measurement")
    ap.add_argument("--hf-rows", type=int, default=300, help="rows for the HF on-the-fly path")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every measurement; medians are reported")
    ap.add_argument("--fill-seq-len", type=int, default=16384, help="token budget of the packing-vs-padding comparison")
    ap.add_argument("--template", type=Path, default=DEFAULT_TEMPLATE, help="official Qwen3-VL chat template")
    ap.add_argument("--seed", type=int, default=0, help="seed of the data and the plans")
    ap.add_argument("--work-dir", default=None, help="scratch directory parent (default: the system temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the generated data")
    args = ap.parse_args()
    if not args.template.is_file():
        ap.error(f"--template {args.template}: no such file (the official template is in tests/fixtures/)")

    work = Path(tempfile.mkdtemp(prefix="loader-speed-", dir=args.work_dir))
    try:
        print(f"building {args.rows} rows in {work} ...", flush=True)
        data = build_data(work, args.rows, tuple(args.size_range), args.seed, args.workers, args.rows_per_shard)
        wds_seq = 16384 if 16384 in args.seq_len else args.seq_len[0]
        configs = [(data["shards"], seq_len, w, False) for seq_len in args.seq_len for w in args.loader_workers]
        if torch.cuda.is_available():  # what the trainer runs on GPUs: packs in pinned memory
            configs += [(data["shards"], seq_len, w, True) for seq_len in args.seq_len for w in args.loader_workers]
        configs.append((data["tars"], wds_seq, 0, False))
        runs: dict[tuple, list[dict]] = {c: [] for c in configs}
        floors: dict[int, list[dict]] = {seq_len: [] for seq_len in args.seq_len}
        hf_runs: list[dict] = []
        handoffs: list[dict] = []
        hf_sample = hf_loader(args.template.read_text(encoding="utf-8"), work)
        hf_lines = Path(data["jsonl"]).read_text(encoding="utf-8").splitlines()[: args.hf_rows]
        for line in hf_lines[:3]:  # warm up: template compilation, lazy imports
            hf_sample(line)
        for r in range(args.rounds):  # rounds interleave all paths, so machine noise hits them alike
            for source, seq_len, workers, pin in configs:
                runs[source, seq_len, workers, pin].append(measure_loader(source, seq_len, workers, args.packs, args.seed, pin))
            for seq_len in args.seq_len:
                floors[seq_len].append(measure_copy_floor(data["shards"], seq_len, args.packs, args.seed))
            hf_runs.append(measure_hf(hf_sample, hf_lines))
            handoffs.append(measure_handoff(data["shards"], wds_seq, args.seed))
            print(f"  round {r + 1}/{args.rounds}: HF {hf_runs[-1]['cpu_ms_per_sample']:.2f} ms/sample; ours (us/sample) "
                  + ", ".join(f"{Path(c[0]).name} {c[1]}/w{c[2]}{'/pinned' if c[3] else ''} {v[-1]['cpu_us_per_sample']:.0f}"
                              for c, v in runs.items()),
                  flush=True)
        hf = median_run(hf_runs)
        hf.update(template=str(args.template), torch_threads=torch.get_num_threads())
        ours = [median_run(runs[c]) for c in configs]
        for r in ours:
            r["hf_cpu_ratio"] = hf["cpu_ms_per_sample"] * 1e3 / r["cpu_us_per_sample"]
            if r["source"] == "arrow" and r["num_workers"] == 0 and not r["pinned"]:
                floor = median_run(floors[r["seq_len"]])
                r["copy_floor_us_per_sample"] = floor["cpu_us_per_sample"]
                r["copy_floor_us_per_sample_rounds"] = floor["cpu_us_per_sample_rounds"]
        packing = packing_efficiency(data["shards"], args.fill_seq_len, args.seed)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    report = {
        "machine": {**machine_info("cpu"), "torch_threads": torch.get_num_threads()},
        # the scratch paths are the run's own; only their names say which data
        "data": {**data, **{key: Path(data[key]).name for key in ("jsonl", "shards", "tars")}}, "ours": ours, "hf": hf, "packing": packing,
        "worker_handoff": {"rounds": handoffs,
                           **{f"{ratio}_median": float(np.median([h[ratio] for h in handoffs]))
                              for ratio in ("private_over_shared", "faulting_over_shared")}},
        "hf_over_ours": {"best": max(r["hf_cpu_ratio"] for r in ours),
                         "ceiling_from_copy_floor": max((hf["cpu_ms_per_sample"] * 1e3 / r["copy_floor_us_per_sample"]
                                                         for r in ours if "copy_floor_us_per_sample" in r),
                                                        default=float("nan"))},
    }
    print_report(report)
    if args.json_out:
        write_json(args.json_out, report)
        print(f"\nwrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
