"""The trainer's data: packed global batches from shard directories, on the device.

Every rank of a data-parallel replica (its TP and PP peers) reads the same packs: the
loader's rank is the DP rank. A micro-batch is `micro_batch_packs` packs laid end to end
in one row (segment boundaries kept), so the model always sees one packed row. With
pipeline parallelism packs are padded to exactly `seq_len` (the schedule sends fixed-shape
activations between stages), and so they are with FP8 or `--pad-packs` (the compiled decoder
layers then have fixed shapes).

Before anything is built, the shard directories are checked against the model: same
family, patch and merge sizes, image token id, and the same pixel normalisation across all
sources (it is applied on the GPU here, from the manifest's profile).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from train.loader import PackedLoader, pixel_values_on_device
from train.model.batch import PackedBatch
from train.pack_plan import PackSettings, parse_source, source_manifest
from shards_schema.pixels import video_pixel_values_from_patches


def check_sources(dirs: list[str], arch) -> tuple[dict, dict | None]:
    """The sources' common vision profile and video normalisation (None where no source holds
    videos); ValueError naming the directory and what is wrong: no samples, another model's
    profile, or normalisations that differ."""
    vision = video = None
    for directory in dirs:
        manifest = source_manifest(directory)
        if not sum(int(shard.get("rows", 0)) for shard in manifest["shards"]):
            raise ValueError(f"{directory}: holds no samples (its preprocessing wrote none; its rejects.jsonl says "
                             "why): drop it from --data / --eval-data, or preprocess its inputs again")
        profile = manifest["profile"]
        if int(manifest["totals"].get("videos", 0)):
            v = profile["video"]
            if video is not None and (v["image_mean"], v["image_std"]) != (video["image_mean"], video["image_std"]):
                raise ValueError(f"{directory}: video normalisation {v['image_mean']}/{v['image_std']} differs from "
                                 f"another source's {video['image_mean']}/{video['image_std']}; preprocess all "
                                 "sources with one profile")
            video = video or v
        v = profile["vision"]
        expected = {"family": arch.family, "patch_size": arch.vision.patch_size,
                    "merge_size": arch.vision.spatial_merge_size,
                    "temporal_patch_size": arch.vision.temporal_patch_size, "image_pad": arch.image_token_id}
        found = {"family": profile["family"], "patch_size": v["patch_size"], "merge_size": v["merge_size"],
                 "temporal_patch_size": v["temporal_patch_size"], "image_pad": profile["special_tokens"]["image_pad"]}
        wrong = {k: (found[k], expected[k]) for k in expected if found[k] != expected[k]}
        if wrong:
            detail = ", ".join(f"{k} {a!r} (model: {b!r})" for k, (a, b) in wrong.items())
            raise ValueError(f"{directory}: shards were preprocessed for another model: {detail}; re-run "
                             f"`vlmpack preprocess --profile {arch.family}` (or --model with this checkpoint)")
        if vision is not None and (v["image_mean"], v["image_std"]) != (vision["image_mean"], vision["image_std"]):
            raise ValueError(f"{directory}: pixel normalisation {v['image_mean']}/{v['image_std']} differs from "
                             f"{dirs[0]}'s {vision['image_mean']}/{vision['image_std']}; preprocess all sources with one profile")
        vision = vision or v
    return vision, video


def export_profile(dirs: list[str]) -> dict:
    """The preprocessing profile of the training sources, which checkpoints keep for `vlmpack
    export-hf` (its chat template and processor settings). The sources share one (the pack
    planner refuses others); a manifest written before profiles held the chat template's text
    has none, so a source whose manifest has it is preferred."""
    profiles = [source_manifest(directory)["profile"] for directory in dirs]
    return next((p for p in profiles if p.get("chat_template")), profiles[0])


class TrainData:
    def __init__(self, config, arch, info, *, padded: bool, plan_cache: Path, eval_batches: int = 0,
                 row_multiple: int = 1):
        """The loaders of the run's data section `config` (`train.config.DataConfig`). `padded`:
        every pack padded to --seq-len rows; `plan_cache`: where pack plans are kept;
        `eval_batches`: global batches per evaluation; `row_multiple`: every pack's row count is a
        multiple of it (sequence parallelism: --tp)."""
        self.config, self.info, self.eval_global_batches = config, info, eval_batches
        self.image_token_id, self.video_token_id = arch.image_token_id, arch.video_token_id
        specs = [parse_source(s) for s in config.data]
        self.vision, self.video = check_sources([d for d, _ in specs] + [parse_source(s)[0] for s in config.eval_data],
                                                 arch)
        self.profile = export_profile([d for d, _ in specs])
        self.global_packs = config.global_packs(info.dp)
        self.packs_per_micro_batch = config.micro_batch_packs
        cuda = info.device.type == "cuda"
        packing = PackSettings(seq_len=config.seq_len, seed=config.seed, dp_size=info.dp,
                               global_batch_packs=self.global_packs, max_visual_tokens=config.max_visual_tokens)
        loader_kwargs = dict(rank=info.dp_rank, pad_to_seq_len=padded, row_multiple=row_multiple,
                             cache_dir=Path(plan_cache),
                             num_workers=config.num_workers, pin_memory=cuda,
                             prefetch_factor=4 if config.num_workers else None, vocab_size=arch.lm.vocab_size)
        self.loader = PackedLoader(specs, packing, **loader_kwargs)
        self.eval_loader = PackedLoader([parse_source(s) for s in config.eval_data], packing, **loader_kwargs) \
            if config.eval_data else None
        self._packs = None
        # plan now: a sample longer than seq_len, or too little data for one global batch, fails
        # before the model is built (and the eval data's before any step, not at the first eval)
        self.loader.dataset()
        if self.eval_loader is not None:
            self.eval_loader.dataset()

    def _forever(self):
        while True:
            yield from self.loader

    def _to_device(self, pack: PackedBatch) -> PackedBatch:
        """The pack on the device, but for what the host reads to queue the forward: image and
        video grids stay on the CPU (the vision tower builds its index tensors there), and the
        <|image_pad|> and <|video_pad|> rows and the rows with a target (the only ones the loss
        computes logits for) are found on the CPU copy. So no forward step waits for the GPU."""
        cuda = self.info.device.type == "cuda"
        return pack.with_rows(self.image_token_id, self.video_token_id, pin_memory=cuda).to(self.info.device)

    def _micro_batches(self, packs_iter, count: int) -> list[PackedBatch]:
        per = self.packs_per_micro_batch
        packs = [self._to_device(next(packs_iter)) for _ in range(count)]
        return [PackedBatch.concat(packs[i:i + per]) for i in range(0, count, per)]

    def next_global_batch(self) -> list[PackedBatch]:
        """This rank's micro-batches of the next global batch (on the device)."""
        if self._packs is None:
            self._packs = self._forever()
        return self._micro_batches(self._packs, self.global_packs // self.info.dp)

    def eval_batches(self):
        """The first `eval_batches` global batches of the eval data, the same ones every time."""
        self.eval_loader.load_state_dict({**self.eval_loader.state_dict(), "epoch": 0, "packs_consumed": 0})
        packs = iter(self.eval_loader)
        for _ in range(min(self.eval_global_batches, len(self.eval_loader) // (self.global_packs // self.info.dp))):
            yield self._micro_batches(packs, self.global_packs // self.info.dp)

    def pixel_values(self, batch: PackedBatch, dtype: torch.dtype):
        if batch.pixel_patches.shape[0] == 0:
            return None
        return pixel_values_on_device(batch.pixel_patches, self.vision, dtype)

    def pixel_values_videos(self, batch: PackedBatch, dtype: torch.dtype):
        if batch.video_patches.shape[0] == 0:
            return None
        return video_pixel_values_from_patches(batch.video_patches, self.video["image_mean"], self.video["image_std"],
                                               dtype=dtype)

    def global_batch_tokens(self, micro_batches: list[PackedBatch]) -> int:
        """Real (non-padding) tokens in the whole global batch."""
        local = torch.tensor([sum(int(m.sample_lengths.sum()) for m in micro_batches)], dtype=torch.int64,
                             device=self.info.device)
        dist.all_reduce(local, group=mpu.get_data_parallel_group())
        return int(local.item())

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)
        self._packs = None
