"""On-disk layouts of model weights: our Megatron model directory and Hugging Face directories.

A Megatron model directory (`vlmpack import-hf` writes one; the trainer can save one):

    MODEL_DIR/
      vlmpack_model.json             format + version, the architecture (dataclasses.asdict of
                                     ModelArch), the tp / pp / ep it was saved with, the dtype;
                                     import-hf's also the weights fingerprint of its HF source
      model_tp{t}_pp{p}.safetensors  one per (tp_rank, pp_rank): exactly the keys and shapes of
                                     that rank's `QwenVLModel.state_dict()` (minus megatron's
                                     `_extra_state` entries, which hold no tensors), but for
                                     the experts when saved with ep > 1
      experts_pp{p}_ep{e}.safetensors
                                     with ep > 1, one per (pp_rank, ep_rank): the stacked
                                     experts of that expert-parallel rank (whole experts, the
                                     same on every TP rank), under the stage model's names
      hf_carried.safetensors         tensors of the Hugging Face source that the model does not
                                     build, kept as they are for export-hf (Qwen3.5's multi-token-
                                     prediction layers, `convert.carried_tensors`); absent where
                                     there are none
      hf/                            tokenizer, processor, chat template and generation files
                                     copied from the Hugging Face source (absent for a
                                     random-init architecture)
      profile.json                   a training save's: the preprocessing profile of the shards it
                                     was trained on, as their manifest records it (chat template
                                     text, image and video processor settings, tokenizer sha256),
                                     which `vlmpack export-hf` writes as Hugging Face files

Directories are written whole into `NAME.tmp` (every file fsynced) and renamed into place,
so a reader sees either no directory or a complete one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from shards_schema.atomic import TMP_SUFFIX, fsync_dir
from shards_schema.errors import first_few
from shards_schema.builtin import (
    BUILTIN_VIDEO,
    BUILTIN_VISION,
    SHIPS_VIDEO_PROCESSOR_CONFIG,
    builtin_chat_template_by_sha256,
    builtin_tokenizer_json,
    read_hf_chat_template,
)
from train.model import families
from train.model.arch import (LMArch, ModelArch, ModelFileError, arch_dict, check_buildable, check_field_kinds,
                              read_json_object)
from train.model.hf_config import json_kind
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
PROFILE_FILE = "profile.json"
CARRIED_FILE = "hf_carried.safetensors"
HF_MAX_SHARD_BYTES = 5 * 1024**3  # what `save_pretrained` uses by default
# Qwen chat checkpoints stop generating at <|im_end|> (or <|endoftext|>).
QWEN_GENERATION_CONFIG = {"bos_token_id": 151643, "pad_token_id": 151643, "eos_token_id": [151645, 151643]}


class CheckpointError(ValueError):
    """A model directory or a state dict does not match what the architecture implies."""


# What to do about a damaged file of each kind of directory.
MODEL_DIR_FIX = ("write the model directory again (`vlmpack import-hf`), or use another checkpoint's model/ "
                 "directory")
HF_DIR_FIX = "copy or download the Hugging Face checkpoint again"
FILE_FIX = "replace it with an intact copy (run again the command that wrote it, or use another checkpoint)"


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


def write_meta(directory: Path, arch: ModelArch, tp: int, pp: int, dtype: str, ep: int = 1,
               hf_fingerprint: str | None = None) -> None:
    """META_FILE of a model directory; `hf_fingerprint`: the `weights_fingerprint` of the Hugging
    Face directory whose weights it holds unchanged (cast at most), as `import-hf` writes one."""
    meta = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "arch": arch_dict(arch),
            "tp": tp, "pp": pp, "ep": ep, "dtype": dtype}
    if hf_fingerprint is not None:
        meta["hf_fingerprint"] = hf_fingerprint
    (Path(directory) / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def read_meta(directory: str | Path) -> dict:
    """META_FILE of a model directory, its format, architecture and layout checked."""
    path = Path(directory) / META_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory} is not a vlmpack model directory (no {META_FILE}); {model_dir_hint(directory)}")
    meta = read_json_object(path, MODEL_DIR_FIX)
    if meta.get("format") != FORMAT_NAME or meta.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{path}: format {meta.get('format')!r} version {meta.get('format_version')!r}; "
                              f"this vlmpack reads {FORMAT_NAME!r} versions "
                              f"{', '.join(map(str, READABLE_VERSIONS))}")
    for key in ("tp", "pp", "ep"):
        value = meta.get(key, 1 if key == "ep" else None)
        if type(value) is not int or value < 1:
            raise ModelFileError(f"{path}: {key} {value!r} is not a parallel size (an integer >= 1)", MODEL_DIR_FIX)
    if not isinstance(meta.get("arch"), dict):
        raise ModelFileError(f"{path}: no architecture (arch)", MODEL_DIR_FIX)
    return meta


def model_dir_hint(directory: str | Path) -> str:
    """What to give instead of `directory`, which holds no META_FILE: the model directory inside
    a training checkpoint or a run's output, or a Hugging Face checkpoint's own flag."""
    directory = Path(directory)
    inside = [directory / "model", *sorted((directory / "checkpoints").glob("step_*/model"))[-1:]]
    found = next((d for d in inside if (d / META_FILE).is_file()), None)
    if found is not None:
        return f"the model directory inside it is {found}: give that"
    if (directory / "config.json").is_file():
        return ("it holds a Hugging Face checkpoint (config.json): `vlmpack train` takes that as --hf-model, "
                "and `vlmpack import-hf` converts it")
    return "make one from a Hugging Face checkpoint with `vlmpack import-hf`"


def arch_from_dict(d: dict, source: str | Path = META_FILE) -> ModelArch:
    """Inverse of `arch_dict` (JSON turned the tuples into lists); `source`: the file it was read from."""
    def fields(sub: dict) -> dict:
        return {k: tuple(v) if isinstance(v, list) else v for k, v in sub.items()}
    for part in ("lm", "vision"):
        if part in d and not isinstance(d[part], dict):
            raise ModelFileError(f"{source}: arch.{part} is {json_kind(d[part])}, not a JSON object of settings",
                                 MODEL_DIR_FIX)
    try:
        # (files of an earlier vlmpack hold no video_token_id: theirs was the default)
        return ModelArch(family=d["family"], lm=LMArch(**fields(d["lm"])), vision=VisionArch(**fields(d["vision"])),
                         image_token_id=d["image_token_id"],
                         **({"video_token_id": d["video_token_id"]} if "video_token_id" in d else {}))
    except (KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{source}: the architecture does not match this vlmpack version ({exc})") from exc


def read_arch(directory: str | Path) -> ModelArch:
    """The architecture a model directory's metadata records, each number of the kind it must be."""
    return meta_arch(read_meta(directory), directory)


def meta_arch(meta: dict, directory: str | Path, file: str = META_FILE) -> ModelArch:
    """The architecture of a model (or adapter) directory's metadata `meta`, read from its `file`:
    each number of the kind it must be, so that a damaged value is refused naming its field
    before any tensor is read."""
    arch = arch_from_dict(meta["arch"], Path(directory) / file)
    check_field_kinds(arch, Path(directory) / file, MODEL_DIR_FIX, hf_names=False)
    check_buildable(arch, Path(directory) / file, MODEL_DIR_FIX, hf_names=False)
    return arch


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


def _file_mode() -> int:
    """What `open()` gives a new file: 0o666 less the umask (read once, at import: setting it to
    read it is process-wide, and saves run on a background thread)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


FILE_MODE = _file_mode()


def save_tensors(path: Path, state: dict[str, torch.Tensor]) -> None:
    # safetensors wants contiguous CPU tensors; the "pt" tag is what transformers checks for.
    save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()}, str(path), metadata={"format": "pt"})
    # safetensors writes its files owner-only (0600); a model's readers (a serving account, a
    # teammate) get what every other file of the directory gives them
    os.chmod(path, FILE_MODE)


def load_tensors(path: Path, fix: str = FILE_FIX) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file; `fix`: what to do when it is missing or damaged."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the model directory is incomplete")
    try:
        return load_file(str(path))
    except SafetensorError as exc:
        raise damaged_weights(path, exc, fix) from None


def damaged_weights(path: Path, exc: SafetensorError, fix: str) -> ModelFileError:
    """The error of a weight file safetensors cannot read (random bytes, cut short)."""
    return ModelFileError(f"{path}: not a readable safetensors file ({exc}; damaged or cut short)", fix)


def check_hf_side_files(src: str | Path) -> None:
    """ModelFileError naming a side file of the Hugging Face directory `src` that transformers
    could not read from an export carrying it: a JSON file that is no JSON object, a chat
    template (its own file, or the `chat_template` of a JSON file) that is no text or does not
    parse as Jinja. Run where the directory is first read, not when a checkpoint copies it."""
    for name in HF_SIDE_FILES:
        path = Path(src) / name
        if not path.is_file():
            continue
        if name.endswith(".json"):
            template = read_json_object(path, HF_DIR_FIX).get("chat_template")
            if template is not None and not isinstance(template, (str, list)):
                raise ModelFileError(f"{path}: chat_template is {json_kind(template)}, not a template's text", HF_DIR_FIX)
        elif name == CHAT_TEMPLATE_FILE:
            problem = jinja_syntax_error(path.read_text(encoding="utf-8", errors="replace"))
            if problem:
                raise ModelFileError(f"{path}: not a Jinja template ({problem})", HF_DIR_FIX)


def jinja_syntax_error(text: str) -> str | None:
    """Where and why `text` does not parse as transformers compiles chat templates (Jinja with
    loop controls); None when it does, or when jinja2 (which transformers brings) is absent."""
    try:
        import jinja2
    except ImportError:
        return None
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as exc:
        return f"line {exc.lineno}: {exc.message}"
    return None


def copy_hf_side_files(src: str | Path, dst: Path) -> list[str]:
    present = [name for name in HF_SIDE_FILES if (Path(src) / name).is_file()]
    if present:
        dst.mkdir(parents=True, exist_ok=True)
    for name in present:
        shutil.copyfile(Path(src) / name, dst / name)
    return present


# --- Hugging Face weights -------------------------------------------------------------------


def hf_weight_map(hf_dir: str | Path) -> dict[str, str] | None:
    """The index's tensor name -> file name map of a sharded HF model directory (None unsharded)."""
    index = Path(hf_dir) / HF_INDEX_FILE
    if not index.is_file():
        return None
    weight_map = read_json_object(index, HF_DIR_FIX).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelFileError(f"{index}: no weight_map of tensor names to file names", HF_DIR_FIX)
    return weight_map


def hf_weight_files(hf_dir: str | Path) -> list[Path]:
    """The safetensors files of a HF model directory (the index's when it is sharded)."""
    hf_dir = Path(hf_dir)
    weight_map = hf_weight_map(hf_dir)
    if weight_map is not None:
        names = sorted(set(weight_map.values()))
        missing = [name for name in names if not (hf_dir / name).is_file()]
        if missing:
            raise ModelFileError(f"{hf_dir / HF_INDEX_FILE} names weight files that {hf_dir} lacks "
                                 f"({first_few(missing)})", f"copy them into it, or {HF_DIR_FIX}")
        return [hf_dir / name for name in names]
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{hf_dir} has no *.safetensors weights (pytorch_model.bin checkpoints are not read: "
                              "re-save the model with `save_pretrained(..., safe_serialization=True)`)")
    unreadable = [path.name for path in files if not path.is_file()]  # a broken link, a directory
    if unreadable:
        raise ModelFileError(f"{hf_dir} holds {first_few(unreadable)}, which is no readable file (a broken symbolic "
                             "link, or a directory)", f"fix or remove it, or {HF_DIR_FIX}")
    return files


def check_index_tensors(hf_dir: str | Path, read: set[str] | dict) -> None:
    """Every tensor the index names was read from its weight files: an index naming one they lack
    is a checkpoint cut short or mixed from two saves, and its tensor would be silently missing."""
    weight_map = hf_weight_map(hf_dir)
    missing = sorted(set(weight_map or ()) - set(read))
    if missing:
        shown = first_few([f"{name} (in {weight_map[name]})" for name in missing])
        raise ModelFileError(f"{Path(hf_dir) / HF_INDEX_FILE} names tensors its weight files lack: {shown}",
                             f"copy the complete weight files into {hf_dir}, or {HF_DIR_FIX}")


class LazyTensor:
    """A tensor read (and transformed) only when `load()` is called: what a conversion needs
    to know of a whole checkpoint (names, shapes, dtypes) without holding it in memory."""

    def __init__(self, shape, dtype: torch.dtype, load, origin: tuple[str, ...] = ()):
        self.shape, self.dtype, self._load = tuple(shape), dtype, load
        self.origin = tuple(origin)  # the checkpoint tensors it is made from, to name them in errors

    def load(self) -> torch.Tensor:
        return self._load()

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def transpose(self, a: int, b: int) -> LazyTensor:
        shape = list(self.shape)
        shape[a], shape[b] = shape[b], shape[a]
        return LazyTensor(shape, self.dtype, lambda: self.load().transpose(a, b), self.origin)

    def contiguous(self) -> LazyTensor:
        return LazyTensor(self.shape, self.dtype, lambda: self.load().contiguous(), self.origin)


def materialize(tensor) -> torch.Tensor:
    return tensor.load() if isinstance(tensor, LazyTensor) else tensor


_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def lazy_hf_state(hf_dir: str | Path) -> dict[str, LazyTensor]:
    """Every tensor of a HF model directory's safetensors files, read one at a time on `load()`."""
    state: dict[str, LazyTensor] = {}
    for path in hf_weight_files(hf_dir):
        tensors = lazy_file_tensors(path)
        repeated = tensors.keys() & state.keys()
        if repeated:
            raise CheckpointError(f"{path}: tensor {min(repeated)} also appears in another weight file")
        state.update(tensors)
    check_index_tensors(hf_dir, state)
    return state


def lazy_file_tensors(path: Path, fix: str = HF_DIR_FIX) -> dict[str, LazyTensor]:
    """Every tensor of one safetensors file, read on `load()`; `fix`: what to do when it is damaged."""
    from safetensors import safe_open

    state: dict[str, LazyTensor] = {}
    try:
        f = safe_open(str(path), framework="pt")
    except SafetensorError as exc:
        raise damaged_weights(path, exc, fix) from None
    with f:
        for key in f.keys():
            info = f.get_slice(key)
            dtype = _SAFETENSORS_DTYPES.get(info.get_dtype())
            if dtype is None:
                raise ModelFileError(f"{path}: tensor {key} is {info.get_dtype()}, which vlmpack does not read",
                                     f"save the checkpoint in one of {', '.join(_SAFETENSORS_DTYPES)}")
            state[key] = LazyTensor(info.get_shape(), dtype, lambda path=path, key=key: _read_one(path, key))
    return state


def _read_one(path: Path, key: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(key)


def weights_fingerprint(model_dir: str | Path) -> str:
    """A digest of the weights of a Hugging Face or Megatron model directory that tells one
    model's weights from another's of the same shapes (a fine-tune of it, another seed), read
    without loading them: each tensor's name, dtype and shape, and a vector of its last dimension
    at the first, middle and last index of its first (a fine-tune moves every one). HF tensors
    are hashed by name, so the same weights saved in other shards match; a Megatron directory's
    digest is another than that of the HF directory it was imported from."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    megatron = (model_dir / META_FILE).is_file()
    files = sorted(model_dir.glob("*.safetensors")) if megatron else hf_weight_files(model_dir)
    rows = []
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    part = f.get_slice(key)
                    shape = part.get_shape()
                    if len(shape) < 2 or not shape[0]:
                        picked = [f.get_tensor(key)]  # a norm's or a bias's vector: small
                    else:  # one vector of the last dimension at the first, middle and last index of the first
                        picked = [part[(slice(i, i + 1), *[slice(0, 1)] * (len(shape) - 2), slice(None))]
                                  for i in sorted({0, shape[0] // 2, shape[0] - 1})]
                    digest = hashlib.sha256()
                    for tensor in picked:
                        digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
                    # a Megatron directory holds one file per TP rank, each with the same names
                    where = path.name if megatron else ""
                    rows.append(f"{where}/{key} {part.get_dtype()} {shape} {digest.hexdigest()}")
        except SafetensorError as exc:
            raise damaged_weights(path, exc, HF_DIR_FIX) from None
    return hashlib.sha256("\n".join(sorted(rows)).encode()).hexdigest()


def imported_fingerprint(model_dir: str | Path) -> str | None:
    """The `weights_fingerprint` of the Hugging Face directory a model directory was imported
    from (its META_FILE's `hf_fingerprint`); None for a model trained or written otherwise, or
    for a directory that is no model directory."""
    path = Path(model_dir) / META_FILE
    if not path.is_file():
        return None
    value = read_json_object(path, MODEL_DIR_FIX).get("hf_fingerprint")
    return value if isinstance(value, str) else None


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
    with tqdm(hf_weight_files(hf_dir), desc="reading weights", unit="file", disable=not progress) as bar:
        for path in bar:  # the bar is closed before an error's line
            part = load_tensors(path, HF_DIR_FIX)
            repeated = part.keys() & state.keys()
            if repeated:
                raise CheckpointError(f"{path}: tensor {min(repeated)} also appears in another weight file")
            state.update(part)
    check_index_tensors(hf_dir, state)
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


# --- the training data's profile ------------------------------------------------------------


def write_profile(directory: Path, profile: dict) -> None:
    """PROFILE_FILE: the preprocessing profile of the shards a checkpoint was trained on, as
    their manifest records it (`export-hf` writes its chat template and processor settings)."""
    text = json.dumps(profile, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    (Path(directory) / PROFILE_FILE).write_text(text, encoding="utf-8")


def read_profile(directory: str | Path) -> dict | None:
    """A model or adapter directory's PROFILE_FILE, or None where it has none (an import-hf
    output, a checkpoint of an earlier vlmpack)."""
    path = Path(directory) / PROFILE_FILE
    if not path.is_file():
        return None
    profile = read_json_object(path, "delete it to export without the training data's chat template and processor "
                                     "settings")
    if not isinstance(profile.get("vision"), dict):
        raise CheckpointError(f"{path}: not a preprocessing profile (no vision settings); delete it to export "
                              "without the training data's chat template and processor settings")
    return profile


# --- Hugging Face side files: tokenizer, processors, chat template, generation defaults -------

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                   "added_tokens.json")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# The bundled Qwen tokenizer's settings as the Qwen-VL checkpoints publish them.
BUILTIN_TOKENIZER_CONFIG = {
    "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
    "unk_token": None, "add_bos_token": False, "add_prefix_space": False, "clean_up_tokenization_spaces": False,
    "errors": "replace", "model_max_length": 131072, "split_special_tokens": False,
}
_PIXEL_STEPS = {"do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                "do_convert_rgb": True}


@dataclass
class SideFiles:
    """What an export wrote beside the weights and config.json."""

    written: list[str]  # the side files, in HF_SIDE_FILES order
    notes: list[str] = field(default_factory=list)  # one line each: what the directory lacks, and the fix


def _present(config: dict) -> dict:
    """`config` without the settings a profile does not record (one of an earlier vlmpack):
    transformers' class defaults fill them."""
    return {k: v for k, v in config.items() if v is not None and not (isinstance(v, dict) and None in v.values())}


def _size(settings: dict) -> dict:
    return {"shortest_edge": settings.get("min_pixels"), "longest_edge": settings.get("max_pixels")}


def _processor_class(family: str, video: bool = False) -> str:
    module = families.by_name(family)
    return module.hf_video_processor_class if video else module.hf_processor_class


def image_processor_config(family: str, vision: dict) -> dict:
    """preprocessor_config.json for image-processor constants (a profile's `vision`).
    `Qwen2VLImageProcessor` is the PIL one in transformers 4; in 5 the torchvision one, unless
    loaded with backend="pil" (the one whose pixels the shards hold bit for bit; the config
    cannot choose it: transformers 5 picks torchvision whenever it is installed)."""
    return _present({
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": _processor_class(family),
        "patch_size": vision["patch_size"], "temporal_patch_size": vision["temporal_patch_size"],
        "merge_size": vision["merge_size"], "image_mean": list(vision["image_mean"]),
        "image_std": list(vision["image_std"]), "size": _size(vision), "min_pixels": vision.get("min_pixels"),
        "max_pixels": vision.get("max_pixels"), **_PIXEL_STEPS,
    })


def video_processor_config(family: str, vision: dict, video: dict) -> dict:
    """video_preprocessor_config.json for a profile's `vision` and `video` settings. Frames are
    sampled at `fps` as the shards' were (Qwen2VLVideoProcessor samples none by default), with
    no per-frame pixel cap (preprocessing's default; `--video-pixel-cap` and the other job-wide
    `--video-*` options are the data's settings, not the profile's)."""
    return _present({
        "video_processor_type": _processor_class(family, video=True), "processor_class": _processor_class(family),
        "patch_size": vision["patch_size"], "temporal_patch_size": vision["temporal_patch_size"],
        "merge_size": vision["merge_size"], "image_mean": video.get("image_mean"), "image_std": video.get("image_std"),
        "size": _size(video), "do_sample_frames": True, "fps": video.get("fps"), "min_frames": video.get("min_frames"),
        "max_frames": video.get("max_frames"), "max_video_tokens": video.get("max_video_tokens"),
        "cap_pixels_per_frame": False, **_PIXEL_STEPS,
    })


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _update_json(path: Path, update: dict, drop: tuple[str, ...] = ()) -> None:
    """Change the keys of `update` that a JSON file has, and remove those of `drop`."""
    if not path.is_file():
        return
    obj = json.loads(path.read_text(encoding="utf-8"))
    changed = {k: v for k, v in update.items() if k in obj}
    if changed or any(k in obj for k in drop):
        _write_json(path, {k: v for k, v in {**obj, **changed}.items() if k not in drop})


def _write_tokenizer(out_dir: Path, family: str, profile: dict | None) -> list[str]:
    """Tokenizer files for a directory that has none: the bundled Qwen tokenizer, or the one the
    profile records when that is another (from its model directory, if it is still there);
    returns the notes."""
    builtin = builtin_tokenizer_json(family) if family in BUILTIN_VISION else None
    wanted = profile.get("tokenizer_sha256") if profile else None
    if builtin is None and not wanted:
        return [f"no tokenizer: the model directory kept none of its source checkpoint and vlmpack bundles no {family} "
                "tokenizer; copy tokenizer.json and tokenizer_config.json of the checkpoint into the export"]
    if wanted and (builtin is None or _sha256(builtin) != wanted):
        source = Path(str(profile.get("source")))
        found = source / "tokenizer.json"
        if found.is_file() and _sha256(found.read_text(encoding="utf-8")) == wanted:
            copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
            for name in copied:
                shutil.copyfile(source / name, out_dir / name)
            if "tokenizer_config.json" not in copied:
                _write_json(out_dir / "tokenizer_config.json", BUILTIN_TOKENIZER_CONFIG)
            return []
        has = f"the built-in {family} tokenizer" if builtin is not None else "no tokenizer"
        note = (f"the training data was tokenized with the tokenizer of {source} (sha256 {wanted}), which is not "
                f"there: the export has {has}; copy tokenizer.json and tokenizer_config.json of that checkpoint into it")
        if builtin is None:
            return [note]
    else:
        note = None
    (out_dir / "tokenizer.json").write_text(builtin, encoding="utf-8")
    _write_json(out_dir / "tokenizer_config.json", BUILTIN_TOKENIZER_CONFIG)
    return [note] if note else []


def _set_chat_template(out_dir: Path, text: str) -> None:
    """`text` as the directory's only chat template: transformers reads chat_template.jinja
    first, but a processor_config.json or tokenizer_config.json template could still be read."""
    (out_dir / CHAT_TEMPLATE_FILE).write_text(text, encoding="utf-8")
    (out_dir / "chat_template.json").unlink(missing_ok=True)
    for name in ("tokenizer_config.json", "processor_config.json"):
        _update_json(out_dir / name, {}, drop=("chat_template",))


def _write_chat_template(out_dir: Path, profile: dict | None, chat_template: str | None) -> list[str]:
    """The chat template: `chat_template` (given), else the training data's (the profile's text,
    or the built-in template with its sha256 where the profile predates the text), else the one
    copied from the source checkpoint; returns the notes."""
    kept = read_hf_chat_template(out_dir)
    fix = "pass --chat-template FILE to give it one"
    if chat_template is None and profile is not None:
        sha256 = profile.get("chat_template_sha256")
        chat_template = profile.get("chat_template") or builtin_chat_template_by_sha256(sha256)
        if chat_template is None and (kept is None or _sha256(kept) != sha256):
            has = "has the source checkpoint's chat template, another one" if kept else "has no chat template"
            return [f"the training data's profile records no chat template text (shards of an earlier vlmpack) and "
                    f"its template (sha256 {sha256}) is not a built-in one, so the export {has}: {fix} "
                    f"(the template of {profile.get('source')})"]
    if chat_template is not None:
        _set_chat_template(out_dir, chat_template)
    elif kept is None:
        return [f"no chat template: the model directory records no training data profile and no Hugging Face "
                f"chat template, so the export has none: {fix}"]
    return []


def check_kept_side_files(kept: Path) -> dict | None:
    """The side files a model or adapter directory `kept` holds, read as an export reads them:
    the JSON files kept of its source checkpoint (read by transformers too) and its PROFILE_FILE
    (returned). A damaged one is named before any weight is read or written."""
    hf_dir = Path(kept) / HF_SUBDIR
    for name in HF_SIDE_FILES:
        if name.endswith(".json") and (hf_dir / name).is_file():
            read_json_object(hf_dir / name, "copy it again from the Hugging Face checkpoint the model came from")
    return read_profile(kept)


def write_side_files(out_dir: Path, family: str, kept: Path | None, chat_template: str | None = None) -> SideFiles:
    """Everything of a HF model directory but its weights and config.json, from `kept` (a model
    or adapter directory): the files it kept of its source checkpoint (hf/); over them, what its
    PROFILE_FILE records of the training data (the image and video processor settings, the chat
    template); the built-in family's tokenizer, image- and video-processor and generation files for what
    neither gives; `chat_template` (the template's text) over all."""
    hf_dir = kept / HF_SUBDIR if kept is not None else None
    profile = check_kept_side_files(kept) if kept is not None else None
    copied = copy_hf_side_files(hf_dir, out_dir) if hf_dir is not None and hf_dir.is_dir() else []
    notes = []
    if not {"tokenizer.json", "vocab.json"} & set(copied):
        notes += _write_tokenizer(out_dir, family, profile)
    if profile is not None:
        configs = {"image_processor": image_processor_config(family, profile["vision"])}
        if isinstance(profile.get("video"), dict):
            configs["video_processor"] = video_processor_config(family, profile["vision"], profile["video"])
            _write_json(out_dir / "video_preprocessor_config.json", configs["video_processor"])
        _write_json(out_dir / "preprocessor_config.json", configs["image_processor"])
        _update_json(out_dir / "processor_config.json", configs)  # its nested copies would be read first
    else:  # the built-in family's published processors, for those the source checkpoint did not give
        defaults = families.by_name(family).processor_defaults_family
        vision = dataclasses.asdict(BUILTIN_VISION[defaults])
        if "preprocessor_config.json" not in copied:
            _write_json(out_dir / "preprocessor_config.json", image_processor_config(family, vision))
        if "video_preprocessor_config.json" not in copied and defaults in SHIPS_VIDEO_PROCESSOR_CONFIG:
            _write_json(out_dir / "video_preprocessor_config.json",
                        video_processor_config(family, vision, dataclasses.asdict(BUILTIN_VIDEO[defaults])))
    if "generation_config.json" not in copied:
        _write_json(out_dir / "generation_config.json", QWEN_GENERATION_CONFIG)
    notes += _write_chat_template(out_dir, profile, chat_template)
    return SideFiles([name for name in HF_SIDE_FILES if (out_dir / name).is_file()], notes)


def dtype_name(tensors) -> str:
    """The one floating dtype of some tensors ('bfloat16'), or 'mixed'."""
    names = {str(t.dtype).removeprefix("torch.") for t in tensors if t.is_floating_point()}
    return names.pop() if len(names) == 1 else "mixed"

