"""Packing samples into packs under a token and a visual-token budget, and packs onto ranks."""

from __future__ import annotations

from bisect import bisect_left, insort

import numpy as np

from .errors import PackingError
from .sources import SourceStats


def check_sizes(source: SourceStats, padded: np.ndarray, seq_len: int, pad_to_multiple: int,
                max_visual_tokens: int | None) -> None:
    """PackingError naming the first sample that fits in no pack (too many tokens once rounded
    to `pad_to_multiple`, or more visual tokens than the budget), with the fix."""
    def who(i: int) -> str:
        extra = ""
        if source.describe is not None:
            try:
                extra = f" ({source.describe(i)})"
            except Exception:  # the description is a courtesy; never hide the real error
                extra = ""
        return f"sample {i}{extra}"

    too_long = np.flatnonzero(padded > seq_len)
    if len(too_long):
        i = int(too_long[0])
        pad_note = f" (rounded up to a multiple of {pad_to_multiple})" if pad_to_multiple > 1 else ""
        longest = int(padded.max())
        raise PackingError(
            f"{source.name}: {len(too_long)} sample(s) longer than --seq-len {seq_len}; first: {who(i)} "
            f"has {int(source.num_tokens[i])} tokens{pad_note}; the longest has {longest}. "
            + (f"Use --seq-len >= {longest}, or a --pad-to-multiple that divides --seq-len"
               if int(source.num_tokens.max()) <= seq_len else
               f"Use --seq-len >= {longest}, or re-run `vlmpack preprocess` with --max-seq-len <= {seq_len}")
        )
    if max_visual_tokens is not None:
        too_many = np.flatnonzero(source.visual_tokens > max_visual_tokens)
        if len(too_many):
            i = int(too_many[0])
            raise PackingError(
                f"{source.name}: {len(too_many)} sample(s) have more than --max-visual-tokens {max_visual_tokens} "
                f"visual tokens; first: {who(i)} has {int(source.visual_tokens[i])}; the largest has "
                f"{int(source.visual_tokens.max())}. Raise --max-visual-tokens, or lower the image budget "
                "(`vlmpack preprocess --max-pixels`)"
            )


_SHIFT = 21  # keys are room * 2^21 + pack number (a block has < 2^21 packs)
_MASK = (1 << _SHIFT) - 1


def best_fit_decreasing(
    lengths: np.ndarray,
    visual: np.ndarray | None,
    block_starts: np.ndarray,
    *,
    seq_len: int,
    max_visual_tokens: int | None,
) -> np.ndarray:
    """Pack id (int64) of each item. Blocks are [block_starts[b], block_starts[b+1]); packs
    never span blocks; inside a block the items are expected sorted by length descending.

    Tokens only: the free rooms of a block's open packs live in one sorted Python list of
    keys room * 2^21 + pack, so "the smallest room >= length" is one bisect; a pack taken out
    goes back with its new room by an insort (a memmove of a few thousand ints). One Python
    iteration per sample, no scan over packs.

    With a visual budget, a pack that fits a sample's tokens may lack visual room, and a
    bisect on one budget cannot skip those (they pile up and a bounded scan opens needless
    packs). So each block is packed in two phases: image samples first, in descending order
    of their larger share of either budget, each to the open pack that leaves the least
    normalised room (token room / seq_len + visual room / budget) over all packs where both
    fit — a numpy scan over the block's open packs (hundreds); then the text-only samples,
    which need no visual room, by the token bisect above, filling the gaps the images left.
    """
    out = [0] * len(lengths)
    lengths_list = lengths.tolist()
    bounds = block_starts.tolist()
    two_budgets = max_visual_tokens is not None and visual is not None
    base = 0
    for b in range(len(bounds) - 1):
        lo, hi = bounds[b], bounds[b + 1]
        keys: list[int] = []
        room: list[int] = []
        if two_budgets:
            vis = np.asarray(visual[lo:hi], dtype=np.int64)
            images = np.flatnonzero(vis > 0)
            room = _pack_images(np.asarray(lengths[lo:hi], dtype=np.int64), vis, images, seq_len, int(max_visual_tokens),
                                out, lo, base)
            keys = sorted((r << _SHIFT) | p for p, r in enumerate(room) if r > 0)
            items = (np.flatnonzero(vis == 0) + lo).tolist()
        else:
            items = range(lo, hi)
        for i in items:
            length = lengths_list[i]
            j = bisect_left(keys, length << _SHIFT)
            if j < len(keys):
                p = keys[j] & _MASK
                del keys[j]
                room[p] -= length
            else:
                p = len(room)
                room.append(seq_len - length)
            if room[p] > 0:
                insort(keys, (room[p] << _SHIFT) | p)
            out[i] = p + base
        base += len(room)
    return np.asarray(out, dtype=np.int64)


def _pack_images(lengths: np.ndarray, visual: np.ndarray, images: np.ndarray, seq_len: int, vis_cap: int,
                 out: list[int], lo: int, base: int) -> list[int]:
    """Phase 1 of `best_fit_decreasing` for one block; returns the packs' free token rooms.

    The normalised room left after placing item x in pack p is norm[p] - (x's own share), so
    the best pack is the argmin of norm over the feasible packs: five numpy calls per item."""
    share = np.maximum(lengths[images] / seq_len, visual[images] / vis_cap)
    order = images[np.argsort(-share, kind="stable")].tolist()
    room = np.empty(len(order), dtype=np.int64)
    vroom = np.empty(len(order), dtype=np.int64)
    norm = np.empty(len(order), dtype=np.float64)
    inv_t, inv_v = 1.0 / seq_len, 1.0 / vis_cap
    inf = np.inf
    n = 0
    lengths_list, visual_list = lengths.tolist(), visual.tolist()
    for i in order:
        length, v = lengths_list[i], visual_list[i]
        p = -1
        if n:
            fits = room[:n] >= length
            fits &= vroom[:n] >= v
            p = int(np.where(fits, norm[:n], inf).argmin())
            if not fits[p]:
                p = -1
        if p < 0:
            p = n
            n += 1
            room[p], vroom[p] = seq_len, vis_cap
        room[p] -= length
        vroom[p] -= v
        norm[p] = room[p] * inv_t + vroom[p] * inv_v
        out[lo + i] = p + base
    return room[:n].tolist()


def assign_ranks(pack_visual: np.ndarray, pack_tokens: np.ndarray, global_batch_packs: int, dp_size: int) -> np.ndarray:
    """Rank (int32 [P]) of each pack: within each global batch of G consecutive packs, G/dp
    packs per rank, greedy by descending (visual tokens, tokens) onto the least-loaded rank
    (by visual tokens, then tokens; ties to the lowest rank). Vectorised over global batches:
    one numpy step per position within a batch."""
    G, P = int(global_batch_packs), len(pack_visual)
    if dp_size < 1 or G % dp_size:
        raise PackingError(f"--global-batch-packs {G} is not a multiple of --dp-size {dp_size}")
    if P % G:
        raise PackingError(f"{P} packs do not form whole global batches of {G}")
    if dp_size == 1 or P == 0:
        return np.zeros(P, dtype=np.int32)
    B, per = P // G, G // dp_size
    vis = np.asarray(pack_visual, dtype=np.int64).reshape(B, G)
    tok = np.asarray(pack_tokens, dtype=np.int64).reshape(B, G)
    order = np.lexsort((-tok, -vis), axis=-1)  # per batch: descending visual, then tokens
    scale = int(tok.sum(axis=1).max()) + 1
    load = np.zeros((B, dp_size), dtype=np.int64)  # visual * scale + tokens
    count = np.zeros((B, dp_size), dtype=np.int64)
    ranks = np.empty((B, G), dtype=np.int32)
    rows = np.arange(B)
    full = np.iinfo(np.int64).max
    for j in range(G):
        col = order[:, j]
        r = np.argmin(np.where(count >= per, full, load), axis=1)
        ranks[rows, col] = r
        load[rows, r] += vis[rows, col] * scale + tok[rows, col]
        count[rows, r] += 1
    return ranks.reshape(P)
