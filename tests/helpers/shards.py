"""Building shard directories for tests: `vlmpack preprocess` over example rows, and
rewriting a shard in place with the manifest made to agree."""

from __future__ import annotations

from pathlib import Path

from preprocess.examples import example_rows, write_jsonl
from shards_schema.cli import main as vlmpack
from tests.helpers.train import SEQ_LEN


def preprocess(tmp: Path, name: str, profile: str = "qwen3-vl", rows: int = 24, seed: int = 5,
               seq_len: int = SEQ_LEN, size_range: tuple[int, int] = (32, 96), video_rows: float = 0.0) -> Path:
    data = write_jsonl(tmp / f"{name}.jsonl", example_rows(rows, seed=seed, family=profile, size_range=size_range,
                                                           video_rows=video_rows))
    out = tmp / name
    assert vlmpack(["preprocess", str(data), "--out", str(out), "--profile", profile, "--workers", "1",
                    "--max-seq-len", str(seq_len), "--no-progress"]) == 0
    return out
