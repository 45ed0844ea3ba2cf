"""The pack plan: which samples form each pack, in training order, decided offline.

The planner reads only per-sample token and patch counts (`ShardSet.sample_stats()`, list
offsets; never a token or pixel value) and returns a few numpy arrays. The loader later
slices the memory-mapped shards by these indices; no data is copied or rewritten. A source
may also be a WebDataset export of a shard directory (`open_source`): the same counts come
from its tar headers, and it packs exactly like the directory it was exported from.

Rules (each one is what a reproducible, resumable training run needs):

* Mixing. Source k of n_k samples with weight w_k contributes round(w_k / sum(w) * N)
  samples per epoch, N = sum(n_k) (round half up). Weights default to n_k for every source
  when none is given (each sample exactly once per epoch); when some are given, a missing
  weight is 1.0. Downsampled (count < n_k): a seeded draw without replacement, a different
  subset every epoch. Upsampled: every sample count // n_k times, plus count % n_k drawn
  without replacement — sampling with replacement, but with the least variance (each sample
  appears floor or ceil of its expected count times).
* Packing. Samples are shuffled (seeded), cut into blocks of `block_size` (4096), and each
  block is packed best-fit-decreasing: sorted by length, each sample goes into the open pack
  whose free room is the smallest that fits it (a bisect over a sorted list of free rooms).
  A sample's length counts rounded up to `pad_to_multiple`; a pack holds at most `seq_len`
  such tokens and, with `max_visual_tokens`, at most that many visual tokens
  (patches / merge_size^2); then image samples are placed first (best fit over both
  budgets) and text-only samples fill the gaps (`best_fit_decreasing`). Text-only and image
  samples share packs. A sample longer than `seq_len` (or with more visual tokens than the budget) is an
  error naming its directory, index, uid and length.
* Order and DP. Packs are shuffled (seeded) and stored in training order. They form global
  batches of `global_batch_packs` = G consecutive packs (G defaults to dp_size); when the
  number of packs is not a multiple of G, the P mod G packs with the fewest tokens are
  dropped (reported as `dropped_packs` / `dropped_samples`; which samples differs every
  epoch). Data that make fewer than G packs are a PackingError naming the numbers: such a
  plan would have no training step. The plan itself does not depend on dp_size: `rank_packs(rank, dp_size)` splits each
  global batch over the ranks at read time (G / dp_size packs each, greedy: packs by
  descending visual tokens, then tokens, onto the least-loaded rank). So the sequence of
  global batches is the same for any dp_size dividing G, which is what lets a run resume on
  a different number of GPUs.
* Epochs. Epoch e is planned with the seed sequence (seed, e): a new mix draw, new packs,
  a new order (not seed + e, which would make seed 1 epoch 0 equal seed 0 epoch 1).
* Cache. `build_pack_plan(..., cache_dir=D)` keys a plan by sha256 of (each source's
  manifest fingerprint: profile id, schema version, shard sha256 list; its weight; seq_len,
  seed, epoch, max_visual_tokens, G, pad_to_multiple, block size, planner version) and
  saves it atomically (temporary directory + rename), so ranks planning at once never read
  a half-written plan. dp_size is not in the key: the plan does not depend on it. A
  cached plan without a whole global batch is refused, never used.

Modules: `settings` (`PackSettings`: seq_len, seed, epoch, budgets, global batch, the one set
that `vlmpack pack`, the planner and the loader share), `sources` (per-sample counts of a
shard directory or WebDataset export), `mixing` (weights, counts, draws), `bin_packing`
(best-fit-decreasing under both budgets, ranks), `plan` (`PackPlan`, its key and cache,
`build_pack_plan`).
"""

from .bin_packing import assign_ranks, best_fit_decreasing
from .errors import PackingError
from .mixing import draw_samples, mix_counts, resolve_weights
from .plan import (
    ARRAY_NAMES,
    PLAN_META,
    PLANNER_VERSION,
    PackPlan,
    PlanRequest,
    build_pack_plan,
    check_plan_out,
    plan_from_stats,
    plan_keys,
    plan_request,
)
from .settings import DEFAULT_BLOCK_SIZE, MAX_PACK_SETTING, PackSettings
from .sources import (
    SourceStats,
    is_webdataset_export,
    load_source_stats,
    open_source,
    parse_source,
    source_fingerprint,
    source_manifest,
)

__all__ = [
    "ARRAY_NAMES", "DEFAULT_BLOCK_SIZE", "MAX_PACK_SETTING", "PLAN_META", "PLANNER_VERSION", "PackPlan",
    "PackSettings", "PackingError", "PlanRequest",
    "SourceStats", "assign_ranks", "best_fit_decreasing", "build_pack_plan", "check_plan_out", "draw_samples",
    "is_webdataset_export", "load_source_stats", "mix_counts", "open_source", "parse_source", "plan_from_stats",
    "plan_keys", "plan_request", "resolve_weights", "source_fingerprint", "source_manifest",
]
