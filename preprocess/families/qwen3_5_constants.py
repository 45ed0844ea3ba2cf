"""What the published Qwen3.5 / Qwen3.6 checkpoints fix for preprocessing: image and video
processor settings, the token ids the processor and the model use, and the M-RoPE layout.

Sources: the checkpoints' own files. The processor files as shown by Hugging Face for
repositories duplicated from Qwen/Qwen3.5-9B and Qwen/Qwen3.5-35B-A3B (a duplicate carries the
files unchanged); they are the values and sizes of Qwen3-VL-*-Instruct's. The Qwen3.6 processor
files were not found published anywhere. config.json: train/model/configs/qwen3_5/.

* `preprocessor_config.json` (390 bytes): `size` {longest_edge 16777216, shortest_edge 65536},
  patch_size 16, temporal_patch_size 2, merge_size 2, image_mean/std 0.5, processor_class
  `Qwen3VLProcessor`, image_processor_type `Qwen2VLImageProcessorFast`;
* `video_preprocessor_config.json` (385 bytes): `size` {longest_edge 25165824, shortest_edge
  4096}, the same patch sizes and mean/std, video_processor_type `Qwen3VLVideoProcessor`. It sets
  no fps / min_frames / max_frames, so the class defaults apply (transformers 5.17 and 5.24:
  fps 2, min_frames 4, max_frames 768, do_sample_frames on). The -Base checkpoints ship
  longest_edge 234881024 instead;
* `config.json`: image_token_id 248056, video_token_id 248057, vision_start 248053, vision_end
  248054; vision tower patch 16, temporal patch 2, spatial merge 2, 2304 learned position
  embeddings (48 x 48), no DeepStack; text rope_parameters {mrope_interleaved true, mrope_section
  [11, 11, 10], rope_theta 10000000, partial_rotary_factor 0.25} with head_dim 256, so 64 rotary
  dimensions (32 frequencies) per head.

transformers maps model_type `qwen3_5` and `qwen3_5_moe` to `Qwen3VLProcessor`,
`Qwen2VLImageProcessor` (`Qwen2VLImageProcessorPil` without torchvision) and
`Qwen3VLVideoProcessor`: the Qwen3-VL classes. So the pixel arithmetic (smart_resize with factor
32, patch order, `<t seconds>` video timestamps) is Qwen3-VL's, with these constants, which equal
Qwen3-VL's too. What differs from Qwen3-VL is the token ids (below) and the model side: the
rotary layout covers 64 of 256 head dimensions (Qwen3-VL: 128 of 128, sections 24/20/20).
"""

from __future__ import annotations

from shards_schema.builtin import QWEN3_5_VIDEO, QWEN3_5_VISION

__all__ = ["QWEN3_5_VISION", "QWEN3_5_VIDEO"]  # the image and video constants, kept in shards_schema.builtin

# The two processor files as published (key order kept), for profiles and for tests.
PREPROCESSOR_CONFIG = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
VIDEO_PREPROCESSOR_CONFIG = {
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "video_processor_type": "Qwen3VLVideoProcessor",
}
# The -Base checkpoints' video_preprocessor_config.json differs only here.
BASE_VIDEO_MAX_PIXELS = 234881024


# Token ids (config.json and the tokenizer's added tokens).
TOKEN_IDS = {
    "endoftext": 248044,  # also eos_token_id of text_config and the tokenizer's pad/unk
    "im_start": 248045,
    "im_end": 248046,
    "vision_start": 248053,
    "vision_end": 248054,
    "image_pad": 248056,
    "video_pad": 248057,
    "tool_call": 248058,
    "tool_call_end": 248059,
    "tool_response": 248066,
    "tool_response_end": 248067,
    "think": 248068,
    "think_end": 248069,
}
VOCAB_SIZE = 248320  # embedding and lm_head rows

# M-RoPE of the text model (config.json text_config.rope_parameters and head_dim).
HEAD_DIM = 256
PARTIAL_ROTARY_FACTOR = 0.25
ROTARY_DIM = int(HEAD_DIM * PARTIAL_ROTARY_FACTOR)  # 64: the first 64 dims of each q/k head rotate
MROPE_SECTION = (11, 11, 10)  # T, H, W frequencies; interleaved like Qwen3-VL, sums to ROTARY_DIM // 2
MROPE_INTERLEAVED = True
ROPE_THETA = 10_000_000
