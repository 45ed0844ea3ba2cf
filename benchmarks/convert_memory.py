"""Peak host memory of `vlmpack import-hf` on a real-size checkpoint, against its size.

Writes a random-weight Hugging Face checkpoint of a built-in architecture (bf16, 5 GiB
safetensors shards with an index, as `save_pretrained` writes them; one shard in memory at a
time), then runs `vlmpack import-hf` on it in a child process and reads the child's peak
resident memory (ru_maxrss). The conversion streams: each output file is written one tensor
at a time, so the peak should stay near the import's own footprint plus a few of the largest
tensors, not the checkpoint.

    python benchmarks/convert_memory.py --arch qwen3-vl-8b --json-out benchmarks/results/convert_memory_cpu2_<yyyymmdd>.json
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import REPO, log, machine_info, parser, write_json
from safetensors.torch import save_file

from train.checkpoint_format import HF_INDEX_FILE, HF_MAX_SHARD_BYTES
from train.convert import HF_LM_HEAD, expert_layout, hf_shapes, hub_hf_names
from train.model.arch import builtin_arch

GiB = 1024**3


def write_random_checkpoint(arch, out: Path, seed: int) -> dict:
    """The HF checkpoint of `arch` with random bf16 weights, shard by shard."""
    shapes = hf_shapes(arch)
    if arch.lm.tie_word_embeddings:
        shapes.pop(HF_LM_HEAD, None)
    names = list(hub_hf_names({k: None for k in shapes}, arch.family))
    shapes = dict(zip(names, shapes.values()))
    groups, size = [[]], 0
    for name, shape in shapes.items():
        nbytes = 2 * int(torch.Size(shape).numel())
        if groups[-1] and size + nbytes > HF_MAX_SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    generator = torch.Generator().manual_seed(seed)
    for file, group in zip(files, groups):
        state = {n: (torch.randn(shapes[n], generator=generator) * 0.02).to(torch.bfloat16) for n in group}
        save_file(expert_layout(state, arch.lm), str(out / file), metadata={"format": "pt"})
        del state
    total = 2 * sum(int(torch.Size(s).numel()) for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": {n: f for f, g in zip(files, groups) for n in g}}
    (out / HF_INDEX_FILE).write_text(json.dumps(index))
    (out / "config.json").write_text(json.dumps(arch.to_hf_config(), indent=2))
    largest = max(2 * int(torch.Size(s).numel()) for s in shapes.values())
    return {"bytes": total, "files": len(files), "largest_tensor_bytes": largest}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--arch", default="qwen3-vl-8b", help="built-in architecture (default %(default)s)")
    ap.add_argument("--work-dir", default=None, help="where the checkpoint and the import go (default: a temp dir)")
    args = ap.parse_args()
    arch = builtin_arch(args.arch)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="convert_memory_"))
    work.mkdir(parents=True, exist_ok=True)
    hf, out = work / "hf", work / "imported"
    shutil.rmtree(hf, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    hf.mkdir()
    t0 = time.perf_counter()
    checkpoint = write_random_checkpoint(arch, hf, seed=0)
    log(f"{args.arch}: wrote {checkpoint['bytes'] / GiB:.2f} GiB in {checkpoint['files']} files "
        f"({time.perf_counter() - t0:.0f} s); largest tensor {checkpoint['largest_tensor_bytes'] / GiB:.2f} GiB")
    cmd = [sys.executable, "-m", "shards_schema.cli", "import-hf", str(hf), "--out", str(out)]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    written = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    log(f"import-hf: {seconds:.0f} s, peak resident memory {peak / GiB:.2f} GiB = "
        f"{peak / checkpoint['bytes']:.2f}x the checkpoint, {peak / checkpoint['largest_tensor_bytes']:.1f}x its largest "
        f"tensor; wrote {written / GiB:.2f} GiB")
    result = {"args": vars(args), "machine": machine_info(), "checkpoint": checkpoint, "import_seconds": seconds,
              "peak_rss_bytes": peak, "peak_over_checkpoint": peak / checkpoint["bytes"],
              "peak_over_largest_tensor": peak / checkpoint["largest_tensor_bytes"], "written_bytes": written}
    if args.json_out:
        write_json(args.json_out, result)
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
