"""Peak host memory of `vlmpack import-hf` on a real-size checkpoint, against its size.

Writes a random-weight Hugging Face checkpoint of a built-in architecture (bf16, 5 GiB
safetensors shards with an index, as `save_pretrained` writes them; one shard in memory at a
time), then converts it twice, each in a child process whose peak resident memory
(ru_maxrss) is read: `vlmpack import-hf` (streaming: each output file written one tensor at a
time) and the whole-checkpoint conversion it replaces (read every tensor, convert, shard,
write: `read_hf_state` -> `hf_to_megatron` -> `shard` -> `save_model_dir`). Both outputs must
hold the same tensors.

    python benchmarks/convert_memory.py --arch qwen3-vl-8b --json-out benchmarks/results/convert_memory_cpu2_<yyyymmdd>.json
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import REPO, log, machine_info, parser, write_json
from safetensors import safe_open
from safetensors.torch import save_file

from train.checkpoint_format import HF_INDEX_FILE, HF_MAX_SHARD_BYTES
from train.convert import HF_LM_HEAD, hf_shapes, hub_hf_names
from train.model.arch import builtin_arch
from train.model.families.qwen3_vl import expert_layout

GiB = 1024**3


def write_random_checkpoint(arch, out: Path, seed: int) -> dict:
    """The HF checkpoint of `arch` with random bf16 weights, shard by shard (drawn on a GPU
    where there is one: a 32B model's 33 G draws take minutes on one CPU thread)."""
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
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(seed)
    for file, group in zip(files, groups):
        state = {n: (torch.randn(shapes[n], generator=generator, device=device) * 0.02).to(torch.bfloat16).cpu()
                 for n in group}
        save_file(expert_layout(state, arch.lm), str(out / file), metadata={"format": "pt"})
        del state
    total = 2 * sum(int(torch.Size(s).numel()) for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": {n: f for f, g in zip(files, groups) for n in g}}
    (out / HF_INDEX_FILE).write_text(json.dumps(index))
    (out / "config.json").write_text(json.dumps(arch.to_hf_config(), indent=2))
    largest = max(2 * int(torch.Size(s).numel()) for s in shapes.values())
    return {"bytes": total, "files": len(files), "largest_tensor_bytes": largest}


# The whole-checkpoint conversion, as a child process of its own.
WHOLE = """
import sys
from train import convert
from train.checkpoint_format import read_hf_state
from train.model.arch import ModelArch
arch = ModelArch.from_hf_dir(sys.argv[1])
full = convert.hf_to_megatron(read_hf_state(sys.argv[1]), arch)
convert.save_model_dir(sys.argv[2], {(0, 0): convert.shard(full, arch, 1, 0, 1, 0)}, arch, 1, 1)
"""


def same_tensors(a: Path, b: Path) -> bool:
    """The two safetensors files hold the same names and tensors (compared one at a time)."""
    with safe_open(str(a), framework="pt") as fa, safe_open(str(b), framework="pt") as fb:
        return set(fa.keys()) == set(fb.keys()) and all(torch.equal(fa.get_tensor(k), fb.get_tensor(k))
                                                        for k in fa.keys())


def child_peak(cmd: list[str]) -> dict:
    """Run `cmd` from the repository; its wall seconds and peak resident bytes (a fresh
    `python -c` measures its children's peak through this one, so each run is a child of a
    child that reports only its own)."""
    probe = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
             "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
             "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)")
    out = subprocess.run([sys.executable, "-c", probe, *cmd], cwd=REPO, check=True, capture_output=True, text=True)
    seconds, peak = out.stdout.split()
    return {"seconds": float(seconds), "peak_rss_bytes": int(peak), "command": " ".join(cmd[:3])}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--arch", default="qwen3-vl-8b", help="built-in architecture (default %(default)s)")
    ap.add_argument("--work-dir", default=None, help="where the checkpoint and the import go (default: a temp dir)")
    args = ap.parse_args()
    arch = builtin_arch(args.arch)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="convert_memory_"))
    work.mkdir(parents=True, exist_ok=True)
    hf, out, whole = work / "hf", work / "imported", work / "whole"
    for path in (hf, out, whole):
        shutil.rmtree(path, ignore_errors=True)
    hf.mkdir()
    t0 = time.perf_counter()
    checkpoint = write_random_checkpoint(arch, hf, seed=0)
    log(f"{args.arch}: wrote {checkpoint['bytes'] / GiB:.2f} GiB in {checkpoint['files']} files "
        f"({time.perf_counter() - t0:.0f} s); largest tensor {checkpoint['largest_tensor_bytes'] / GiB:.2f} GiB")
    runs = {"import-hf (streaming)": [sys.executable, "-m", "shards_schema.cli", "import-hf", str(hf), "--out", str(out)],
            "whole checkpoint": [sys.executable, "-c", WHOLE, str(hf), str(whole)]}
    result = {"args": vars(args), "machine": machine_info(), "checkpoint": checkpoint}
    for name, cmd in runs.items():
        result[name] = child_peak(cmd)
        log(f"{name}: {result[name]['seconds']:.0f} s, peak resident memory {result[name]['peak_rss_bytes'] / GiB:.2f} "
            f"GiB = {result[name]['peak_rss_bytes'] / checkpoint['bytes']:.2f}x the checkpoint, "
            f"{result[name]['peak_rss_bytes'] / checkpoint['largest_tensor_bytes']:.1f}x its largest tensor")
        if args.json_out:  # each run as it ends: a long job stopped in the baseline keeps the streaming figure
            write_json(args.json_out, result)
    same = same_tensors(out / "model_tp0_pp0.safetensors", whole / "model_tp0_pp0.safetensors")
    result["same_tensors"] = same
    result["whole_over_streaming"] = (result["whole checkpoint"]["peak_rss_bytes"]
                                      / result["import-hf (streaming)"]["peak_rss_bytes"])
    log(f"streaming holds {result['whole_over_streaming']:.2f}x less at its peak; same tensors: {same}")
    if args.json_out:
        write_json(args.json_out, result)
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
