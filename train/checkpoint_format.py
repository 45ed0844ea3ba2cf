"""On-disk layouts of model weights: our Megatron model directory and Hugging Face directories.

A Megatron model directory (`vlmpack import-hf` writes one; the trainer can save one):

    MODEL_DIR/
      vlmpack_model.json             format + version, the architecture (dataclasses.asdict of
                                     ModelArch), the tp / pp / ep it was saved with, the dtype
      model_tp{t}_pp{p}.safetensors  one per (tp_rank, pp_rank): exactly the keys and shapes of
                                     that rank's `QwenVLModel.state_dict()` (minus megatron's
                                     `_extra_state` entries, which hold no tensors), but for
                                     the experts when saved with ep > 1
      experts_pp{p}_ep{e}.safetensors
                                     with ep > 1, one per (pp_rank, ep_rank): the stacked
                                     experts of that expert-parallel rank (whole experts, the
                                     same on every TP rank), under the stage model's names
      hf/                            tokenizer, processor, chat template and generation files
                                     copied from the Hugging Face source (absent for a
                                     random-init architecture)

Directories are written whole into `NAME.tmp` (every file fsynced) and renamed into place,
so a reader sees either no directory or a complete one.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from shards_schema.atomic import TMP_SUFFIX, fsync_dir
from shards_schema.builtin import BUILTIN_VISION, builtin_tokenizer_json
from train.model.arch import LMArch, ModelArch, arch_dict
from train.model.vision import VisionArch

FORMAT_NAME = "vlmpack-megatron-model"
FORMAT_VERSION = 2
# Version 1 wrote one file per (tp_rank, pp_rank, ep_rank) with ep > 1, each with that rank's
# experts and a copy of the rest (only tp 1 could be saved so); it is still read.
READABLE_VERSIONS = (1, 2)
META_FILE = "vlmpack_model.json"
HF_SUBDIR = "hf"
# Everything of a HF model directory except the config and the weights: what a user needs to
# run the exported model (tokenizer, image/video processor, chat template, generation defaults).
HF_SIDE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
    "added_tokens.json", "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
    "video_preprocessor_config.json", "processor_config.json", "generation_config.json",
)
HF_INDEX_FILE = "model.safetensors.index.json"
HF_MAX_SHARD_BYTES = 5 * 1024**3  # what `save_pretrained` uses by default
# Qwen chat checkpoints stop generating at <|im_end|> (or <|endoftext|>).
QWEN_GENERATION_CONFIG = {"bos_token_id": 151643, "pad_token_id": 151643, "eos_token_id": [151645, 151643]}


class CheckpointError(ValueError):
    """A model directory or a state dict does not match what the architecture implies."""


def rank_file(tp_rank: int, pp_rank: int) -> str:
    """The file of one TP rank's stage model (without its experts when ep > 1)."""
    return f"model_tp{tp_rank}_pp{pp_rank}.safetensors"


def expert_file(pp_rank: int, ep_rank: int) -> str:
    """The file of one expert-parallel rank's experts of a stage (ep > 1)."""
    return f"experts_pp{pp_rank}_ep{ep_rank}.safetensors"


def v1_expert_rank_file(pp_rank: int, ep_rank: int) -> str:
    """Format version 1's file of rank (tp 0, pp_rank, ep_rank) with ep > 1: the whole stage
    model with that rank's experts."""
    return f"model_tp0_pp{pp_rank}_ep{ep_rank}.safetensors"


# --- metadata -------------------------------------------------------------------------------


def write_meta(directory: Path, arch: ModelArch, tp: int, pp: int, dtype: str, ep: int = 1) -> None:
    meta = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "arch": arch_dict(arch),
            "tp": tp, "pp": pp, "ep": ep, "dtype": dtype}
    (Path(directory) / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def read_meta(directory: str | Path) -> dict:
    path = Path(directory) / META_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory} is not a vlmpack model directory (no {META_FILE}); "
                              "make one from a Hugging Face checkpoint with `vlmpack import-hf`")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT_NAME or meta.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{path}: format {meta.get('format')!r} version {meta.get('format_version')!r}; "
                              f"this vlmpack reads {FORMAT_NAME!r} versions "
                              f"{', '.join(map(str, READABLE_VERSIONS))}")
    return meta


def arch_from_dict(d: dict) -> ModelArch:
    """Inverse of `arch_dict` (JSON turned the tuples into lists)."""
    def fields(sub: dict) -> dict:
        return {k: tuple(v) if isinstance(v, list) else v for k, v in sub.items()}
    try:
        return ModelArch(family=d["family"], lm=LMArch(**fields(d["lm"])), vision=VisionArch(**fields(d["vision"])),
                         image_token_id=d["image_token_id"])
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"{META_FILE}: the architecture does not match this vlmpack version ({exc})") from exc


def read_arch(directory: str | Path) -> ModelArch:
    return arch_from_dict(read_meta(directory)["arch"])


def arch_differences(a: ModelArch, b: ModelArch) -> list[str]:
    """'lm.num_layers: 3 != 4'-style lines for every field that differs."""
    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out
    fa, fb = flat(arch_dict(a)), flat(arch_dict(b))
    return [f"{k}: {fa.get(k)!r} != {fb.get(k)!r}" for k in sorted(fa.keys() | fb.keys()) if fa.get(k) != fb.get(k)]


# --- files ----------------------------------------------------------------------------------


def fsync_tree(root: Path) -> None:
    for directory, _, files in os.walk(root):
        for name in files:
            fd = os.open(Path(directory) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(directory))


def check_new_dir(target: str | Path) -> None:
    """Output directories must not exist or be empty: replacing a model directory in place
    could destroy the only copy of a run's weights, so that is left to the user."""
    target = Path(target)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"{target} already exists and is not empty: choose another output directory")


@contextmanager
def atomic_dir(target: str | Path):
    """Yield a fresh `target.tmp` to fill; on success fsync it and rename it to `target`."""
    target = Path(target)
    check_new_dir(target)
    tmp = target.with_name(target.name + TMP_SUFFIX)
    shutil.rmtree(tmp, ignore_errors=True)  # left over by an interrupted write
    tmp.mkdir(parents=True)
    try:
        yield tmp
        fsync_tree(tmp)
        os.replace(tmp, target)  # rename(2) replaces an empty directory
        fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_tensors(path: Path, state: dict[str, torch.Tensor]) -> None:
    # safetensors wants contiguous CPU tensors; the "pt" tag is what transformers checks for.
    save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()}, str(path), metadata={"format": "pt"})


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the model directory is incomplete")
    return load_file(str(path))


def copy_hf_side_files(src: str | Path, dst: Path) -> list[str]:
    present = [name for name in HF_SIDE_FILES if (Path(src) / name).is_file()]
    if present:
        dst.mkdir(parents=True, exist_ok=True)
    for name in present:
        shutil.copyfile(Path(src) / name, dst / name)
    return present


# --- Hugging Face weights -------------------------------------------------------------------


def hf_weight_files(hf_dir: str | Path) -> list[Path]:
    """The safetensors files of a HF model directory (the index's when it is sharded)."""
    hf_dir = Path(hf_dir)
    index = hf_dir / HF_INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [hf_dir / name for name in names]
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{hf_dir} has no *.safetensors weights (pytorch_model.bin checkpoints are not read: "
                              "re-save the model with `save_pretrained(..., safe_serialization=True)`)")
    return files


class LazyTensor:
    """A tensor read (and transformed) only when `load()` is called: what a conversion needs
    to know of a whole checkpoint (names, shapes, dtypes) without holding it in memory."""

    def __init__(self, shape, dtype: torch.dtype, load):
        self.shape, self.dtype, self._load = tuple(shape), dtype, load

    def load(self) -> torch.Tensor:
        return self._load()

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def transpose(self, a: int, b: int) -> LazyTensor:
        shape = list(self.shape)
        shape[a], shape[b] = shape[b], shape[a]
        return LazyTensor(shape, self.dtype, lambda: self.load().transpose(a, b))

    def contiguous(self) -> LazyTensor:
        return LazyTensor(self.shape, self.dtype, lambda: self.load().contiguous())


def materialize(tensor) -> torch.Tensor:
    return tensor.load() if isinstance(tensor, LazyTensor) else tensor


_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def lazy_hf_state(hf_dir: str | Path) -> dict[str, LazyTensor]:
    """Every tensor of a HF model directory's safetensors files, read one at a time on `load()`."""
    from safetensors import safe_open

    state: dict[str, LazyTensor] = {}
    for path in hf_weight_files(hf_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key in state:
                    raise CheckpointError(f"{path}: tensor {key} also appears in another weight file")
                info = f.get_slice(key)
                state[key] = LazyTensor(info.get_shape(), _SAFETENSORS_DTYPES[info.get_dtype()],
                                        lambda path=path, key=key: _read_one(path, key))
    return state


def _read_one(path: Path, key: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(key)


def save_tensors_streaming(path: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]], tensors) -> None:
    """A safetensors file written one tensor at a time: the header from `entries` (name,
    shape, dtype, in file order) first, then each tensor of the iterable `tensors` (the same
    order) as it comes, so only one is held. Readable by `safetensors.safe_open` / `load_file`."""
    codes = {v: k for k, v in _SAFETENSORS_DTYPES.items()}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dtype in entries:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": codes[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for (name, shape, dtype), tensor in zip(entries, tensors, strict=True):
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise CheckpointError(f"{path}: {name} is {tuple(tensor.shape)} {tensor.dtype}, "
                                      f"the header says {tuple(shape)} {dtype}")
            f.write(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().data)


def read_hf_state(hf_dir: str | Path, progress: bool = False) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in tqdm(hf_weight_files(hf_dir), desc="reading weights", unit="file", disable=not progress):
        part = load_tensors(path)
        repeated = part.keys() & state.keys()
        if repeated:
            raise CheckpointError(f"{path}: tensor {min(repeated)} also appears in another weight file")
        state.update(part)
    return state


def write_hf_state(out_dir: Path, state: dict[str, torch.Tensor], progress: bool = False,
                   max_shard_bytes: int = HF_MAX_SHARD_BYTES) -> list[str]:
    """model.safetensors, or numbered shards + index when larger than `max_shard_bytes`."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for name, shard in tqdm(list(zip(names, shards)), desc="writing weights", unit="file", disable=not progress):
        save_tensors(out_dir / name, shard)
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: name for name, shard in zip(names, shards) for k in shard}}
        (out_dir / HF_INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return names


def write_builtin_side_files(family: str, out_dir: Path) -> list[str]:
    """Tokenizer, image-processor and generation files for a checkpoint that carries none.

    From the built-in preprocessing profile: the bundled Qwen tokenizer (Qwen2.5 variant for
    qwen2.5-vl) and the published image-processor constants. No chat template: the official
    VL templates are not bundled, so copy `chat_template.jinja` from the official checkpoint
    before using the directory for chat inference."""
    vision = BUILTIN_VISION[family]
    qwen3 = family == "qwen3-vl"
    (out_dir / "tokenizer.json").write_text(builtin_tokenizer_json(family), encoding="utf-8")
    tokenizer_config = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                        "bos_token": None, "unk_token": None, "add_bos_token": False, "add_prefix_space": False,
                        "clean_up_tokenization_spaces": False, "errors": "replace", "model_max_length": 131072,
                        "split_special_tokens": False}
    preprocessor = {
        "image_processor_type": "Qwen2VLImageProcessorFast" if qwen3 else "Qwen2VLImageProcessor",
        "processor_class": "Qwen3VLProcessor" if qwen3 else "Qwen2_5_VLProcessor",
        "patch_size": vision.patch_size, "temporal_patch_size": vision.temporal_patch_size,
        "merge_size": vision.merge_size, "image_mean": list(vision.image_mean), "image_std": list(vision.image_std),
        "size": {"shortest_edge": vision.min_pixels, "longest_edge": vision.max_pixels},
        "min_pixels": vision.min_pixels, "max_pixels": vision.max_pixels,
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
    }
    files = {"tokenizer_config.json": tokenizer_config, "preprocessor_config.json": preprocessor,
             "generation_config.json": QWEN_GENERATION_CONFIG}
    for name, obj in files.items():
        (out_dir / name).write_text(json.dumps(obj, indent=2) + "\n")
    return ["tokenizer.json", *files]


def dtype_name(tensors) -> str:
    """The one floating dtype of some tensors ('bfloat16'), or 'mixed'."""
    names = {str(t.dtype).removeprefix("torch.") for t in tensors if t.is_floating_point()}
    return names.pop() if len(names) == 1 else "mixed"

