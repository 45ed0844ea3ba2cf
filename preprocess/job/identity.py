"""What a job is: its inputs' names and content fingerprints, and the identity (profile,
settings, inputs) that must match for an output directory to be resumed or merged."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from shards_schema import storage
from shards_schema.flags import flag_name, flat_paths

from ..errors import ConfigError
from ..inputs import InputFile, describe_input, hub_dataset_files, is_hub_dataset
from ..pipeline import SampleOptions
from ..profiles import Profile
from .config import PreprocessConfig

SAMPLE_BLOCK_BYTES = 64 << 10
SAMPLE_BLOCKS = 16  # files up to SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES (1 MiB) are hashed whole


def printable(text: str) -> str:
    """`text` with what UTF-8 cannot hold (lone surrogates from JSON escapes or from undecodable
    file names) written as backslash escapes: every string the job writes goes through here."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def printable_path(path: str) -> str:
    """A file name as text: bytes the file system name holds that are not UTF-8 become \\xNN."""
    try:
        return os.fsencode(path).decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate that no file-name byte decodes to
        return printable(path)


def input_name(given: str) -> str:
    """How an input is recorded in sources, rejects and the manifest.

    The same file spelled differently (`rows.jsonl`, `./rows.jsonl`, its absolute path) gets
    one name: relative to the working directory when the file lies under it, otherwise the
    spelling given, normalized. Undecodable file-name bytes are written as \\xNN.
    """
    absolute = os.path.abspath(given)
    relative = os.path.relpath(absolute)
    if relative != os.pardir and not relative.startswith(os.pardir + os.sep):
        name = relative
    else:
        name = absolute if os.path.isabs(given) else os.path.normpath(given)
    return printable_path(name)


def input_files(spec: str) -> list[str]:
    """The files an input consists of (a `datasets` directory: its data and metadata files; a
    Hub dataset: its prepared Arrow files in the `datasets` cache; a URL: itself)."""
    if is_hub_dataset(spec):
        return [str(p) for p in hub_dataset_files(spec)]
    if not storage.is_url(spec) and Path(spec).is_dir():
        return sorted(str(p) for p in Path(spec).iterdir() if p.is_file())
    return [spec]


def file_stat(spec: str) -> dict:
    """{"size", "mtime_ns"} of a local file or a URL."""
    if storage.is_url(spec):
        return storage.info(spec)
    st = os.stat(spec)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _hash_file(spec: str, size: int, mode: str, digest) -> None:
    name = spec.rsplit("/", 1)[-1] if storage.is_url(spec) else os.path.basename(spec)
    digest.update(os.fsencode(name) + b"\0" + str(size).encode() + b"\0")
    with storage.open_binary(spec) as fh:
        if mode == "full" or size <= SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
            return
        for k in range(SAMPLE_BLOCKS):  # first and last block included, the rest evenly between
            fh.seek((size - SAMPLE_BLOCK_BYTES) * k // (SAMPLE_BLOCKS - 1))
            digest.update(fh.read(SAMPLE_BLOCK_BYTES))


def input_fingerprint(path: str, mode: str) -> tuple[dict, int]:
    """(content fingerprint, newest modification time in ns) of one input.

    The fingerprint depends on content only (it is part of the job identity, which partitions
    on other machines must share); the modification time is checked on resume in "sampled"
    mode, where an edit between sampled blocks would otherwise go unseen.
    """
    digest = hashlib.sha256()
    stats = [(file, file_stat(file)) for file in input_files(path)]
    for file, stat in stats:
        _hash_file(file, stat["size"], mode, digest)
    mtime_ns = max((stat["mtime_ns"] for _, stat in stats), default=0)
    return {"mode": mode, "sha256": digest.hexdigest()}, mtime_ns


@dataclass(frozen=True)
class JobInput:
    file: InputFile  # what workers read (`file.path` is the spelling given)
    name: str
    location: str  # the resolved path: the same file however spelled
    fingerprint: dict
    mtime_ns: int
    stamp: tuple = ()  # (file, size, mtime_ns) of each of its files before it was scanned (`input_stamp`)

    def identity(self) -> dict:
        return {**self.file.identity(), "path": self.name, "fingerprint": self.fingerprint}

    def seen(self) -> dict:
        return {"name": self.name, "location": self.location, "mtime_ns": self.mtime_ns}


def input_stamp(spec: str) -> tuple:
    """(file, size, mtime_ns) of each file of a local input, which any write to it changes; ()
    for a URL or a Hub dataset (objects in a store are replaced whole, not written in place)."""
    if is_hub_dataset(spec) or storage.is_url(spec):
        return ()
    return tuple((file, st.st_size, st.st_mtime_ns) for file in input_files(spec) for st in [os.stat(file)])


def changed_while_read(inp: JobInput) -> bool:
    """Whether `inp` was written to, replaced or removed since `describe_job_input` stamped it:
    its units may then have been read from other bytes than the job recorded."""
    try:
        return input_stamp(inp.file.path) != inp.stamp
    except OSError:
        return True


def input_changed_error(name: str, what: str, out: str) -> ConfigError:
    """The refusal of a job whose input changed while it read it: the shards already written may
    hold rows of the input's earlier content, so the directory never becomes a dataset."""
    return ConfigError(f"input {name} changed while the job read it ({what}), so its shards may match neither "
                       f"version of it and no manifest is written: leave an input unchanged until "
                       f"its job ends (give a copy of a file that is still being written), then re-run into a new "
                       f"--out directory, or delete {printable_path(out)} to start over")


def describe_job_input(given: str, rows_per_unit: int, hash_mode: str, input_format: str = "auto",
                       max_row_bytes: int = SampleOptions.max_row_bytes) -> JobInput:
    stamp = input_stamp(given)  # before the scan: a write during the scan or the job is seen at its end
    file = describe_input(given, rows_per_unit, input_format, max_row_bytes)
    fingerprint, mtime_ns = input_fingerprint(given, hash_mode)
    if is_hub_dataset(given) or storage.is_url(given):  # a name, not a path; recorded without credentials
        return JobInput(file, storage.redact(given), storage.redact(given), fingerprint, mtime_ns, stamp)
    return JobInput(file, input_name(given), printable_path(os.path.realpath(given)), fingerprint, mtime_ns, stamp)


def job_identity(cfg: PreprocessConfig, profile: Profile, inputs: list[JobInput]) -> dict:
    """What must match for outputs to be resumed or merged: never the worker count or partition index.

    Round-tripped through JSON so it compares equal to the copy read back from disk; paths in
    it (a --model or --media-root directory) are recorded in their printable form.
    """
    return _printable_strings(json.loads(json.dumps({
        "profile": profile.fingerprint,
        "settings": {**_sample_settings(cfg.sample), "rows_per_shard": cfg.rows_per_shard},
        "inputs": [inp.identity() for inp in inputs],
        "num_partitions": cfg.num_partitions,
    })))


def _sample_settings(options: SampleOptions) -> dict:
    """The sample options that decide output bytes: all but how patiently remote media are fetched."""
    settings = dataclasses.asdict(options)
    del settings["remote_fetch"]
    return settings


def _printable_strings(obj):
    if isinstance(obj, str):
        return printable_path(obj)
    if isinstance(obj, dict):
        return {printable_path(k): _printable_strings(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_printable_strings(v) for v in obj]
    return obj


def same_job(recorded, identity: dict) -> bool:
    """Whether a recorded job identity is `identity`. The profile's chat template text and its
    name are left out: the template's sha256 is compared with the rest of the profile, and a job
    recorded by a vlmpack that kept neither in the profile is the same job (resuming it records
    them)."""
    def without_text(ident):
        if not isinstance(ident, dict) or not isinstance(ident.get("profile"), dict):
            return ident
        return {**ident, "profile": {k: v for k, v in ident["profile"].items() if k not in ("chat_template", "name")}}

    return without_text(with_later_settings(recorded)) == without_text(identity)


def with_later_settings(recorded):
    """A recorded job identity with the sample settings that vlmpack added since (which the job
    could not have set) at their defaults, so that a job started by an earlier vlmpack resumes."""
    if not isinstance(recorded, dict) or not isinstance(recorded.get("settings"), dict):
        return recorded
    defaults = json.loads(json.dumps(_sample_settings(SampleOptions())))
    return {**recorded, "settings": {**defaults, **recorded["settings"]}}


# ---------------------------------------------------------------- what differs between two jobs

def _flags_of_identity() -> dict[tuple, str]:
    """The flag of each setting a job identity records, by its path in the identity."""
    where = {("rows_per_shard",): ("settings", "rows_per_shard"), ("num_partitions",): ("num_partitions",)}
    flags = {}
    for dest, path in flat_paths(PreprocessConfig).items():
        if path[0] == "sample":
            flags[("settings", *path[1:])] = flag_name(dest)
        elif path in where:
            flags[where[path]] = flag_name(dest)
    return flags


def _leaves(value, path: tuple = ()):
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _leaves(inner, (*path, key))
    else:
        yield path, value


def _shown(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _input_content(entry: dict) -> str:
    digest = (entry.get("fingerprint") or {}).get("sha256", "")
    return f"{entry.get('rows')} rows, {entry.get('bytes')} bytes" + (f", sha256 {digest[:12]}" if digest else "")


_PROFILE_FLAGS = {("vision", "min_pixels"): "--min-pixels", ("vision", "max_pixels"): "--max-pixels"}


def _profile_field(path: tuple) -> str:
    """A field of the profile, with the flag that sets it (the others come from --profile or --model)."""
    return f"the profile's {'.'.join(path)} ({_PROFILE_FLAGS.get(path, '--profile / --model')})"


def job_differences(first, second) -> list[tuple[str, object, object]]:
    """What differs between two recorded job identities, as (what, its value in `first`, in
    `second`): a setting named by its flag, the profile by --profile (or by the fields that
    differ when the name is the same: --model, --min-pixels, ...), inputs by their paths. Empty
    when they are one job (`same_job`)."""
    first, second = (with_later_settings(ident) if isinstance(ident, dict) else {} for ident in (first, second))
    flags = _flags_of_identity()
    found = []
    settings = [dict(_leaves({k: ident.get(k) for k in ("settings", "num_partitions")})) for ident in (first, second)]
    for path in sorted(set(settings[0]) | set(settings[1]), key=lambda p: (p not in flags, p)):
        a, b = settings[0].get(path), settings[1].get(path)
        if a != b:
            found.append((flags.get(path, ".".join(path)), a, b))
    profiles = [{k: v for k, v in (ident.get("profile") or {}).items() if k not in ("chat_template", "id", "name")}
                for ident in (first, second)]
    if profiles[0] != profiles[1]:
        names = [(ident.get("profile") or {}).get("name") for ident in (first, second)]
        if names[0] != names[1]:
            found.append(("--profile", names[0], names[1]))
        else:
            leaves = [dict(_leaves(profile)) for profile in profiles]
            found += [(_profile_field(path), leaves[0].get(path), leaves[1].get(path))
                      for path in sorted(set(leaves[0]) | set(leaves[1])) if leaves[0].get(path) != leaves[1].get(path)]
    inputs = [ident.get("inputs") or [] for ident in (first, second)]
    paths = [[entry.get("path") for entry in given] for given in inputs]
    if paths[0] != paths[1]:
        found.append(("the inputs", ", ".join(map(str, paths[0])) or "none", ", ".join(map(str, paths[1])) or "none"))
    else:
        for a, b in zip(*inputs):
            if a == b:
                continue
            modes = [(entry.get("fingerprint") or {}).get("mode") for entry in (a, b)]
            if modes[0] != modes[1]:
                found.append(("--input-hash", modes[0], modes[1]))
            elif a.get("row_format", "openai") != b.get("row_format", "openai"):
                found.append((f"the layout (--input-format) of input {a['path']}", a.get("row_format", "openai"),
                              b.get("row_format", "openai")))
            else:
                found.append((f"input {a['path']}", _input_content(a), _input_content(b)))
    return found


def describe_job_differences(first, second, first_name: str, second_name: str, most: int = 6) -> str:
    """`job_differences` as one line: "--max-seq-len: 16384 in A, 4096 in B; ..."."""
    found = job_differences(first, second)
    if not found:
        return "their recorded job files differ"
    text = "; ".join(f"{what}: {_shown(a)} in {first_name}, {_shown(b)} in {second_name}"
                     for what, a, b in found[:most])
    return text + (f"; and {len(found) - most} more" if len(found) > most else "")
