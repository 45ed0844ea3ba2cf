"""Tiny random-weight Hugging Face Qwen-VL models: CPU oracles for tests.

The shapes are small but keep every structural feature of the real checkpoints that our
code must reproduce (Qwen3-VL-2B / Qwen2.5-VL-3B): the real vocab (so real token ids work),
GQA, tied embeddings at the top level (the only place transformers 5.x reads it), M-RoPE
with sections summing to head_dim/2 in the same proportions (interleaved for Qwen3-VL,
chunked for Qwen2.5-VL), DeepStack on non-final vision blocks, window + full attention in
the Qwen2.5 vision tower. Models are fp32, eval mode, and deterministic for a given seed.
"""

from __future__ import annotations

import numpy as np
import torch

IMAGE_TOKEN_ID = 151655
VIDEO_TOKEN_ID = 151656
VISION_START_TOKEN_ID = 151652
VISION_END_TOKEN_ID = 151653
VOCAB_SIZE = 151936

_SPECIAL_IDS = dict(
    image_token_id=IMAGE_TOKEN_ID,
    video_token_id=VIDEO_TOKEN_ID,
    vision_start_token_id=VISION_START_TOKEN_ID,
    vision_end_token_id=VISION_END_TOKEN_ID,
)


def tiny_qwen3_vl_config():
    """Qwen3-VL-2B in miniature. head_dim 16 -> 8 rotary freqs; [4, 2, 2] interleaved puts
    H on freqs 1, 4 and W on 2, 5 (T on the rest), the 8-freq analogue of [24, 20, 20]."""
    from transformers import Qwen3VLConfig

    text = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,  # DeepStack feeds layers 0, 1; layer 2 has none
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        attention_bias=False,
        rope_parameters=dict(
            rope_type="default", rope_theta=5e6, mrope_section=[4, 2, 2], mrope_interleaved=True
        ),
    )
    vision = dict(
        depth=3,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        hidden_act="gelu_pytorch_tanh",
        in_channels=3,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=64,
        num_position_embeddings=2304,  # 48 x 48 like the real model: exercises the resampling
        deepstack_visual_indexes=[0, 1],
    )
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **_SPECIAL_IDS)


def tiny_qwen3_vl_moe_config():
    """Qwen3-VL-30B-A3B in miniature: the tiny Qwen3-VL with every MLP a Mixture of 8 SwiGLU
    experts (width 24), 2 per token, the router's aux-loss coefficient as published (0.001)."""
    from transformers import Qwen3VLMoeConfig

    dense = tiny_qwen3_vl_config()
    text = dense.text_config.to_dict()
    for key in ("model_type", "transformers_version", "architectures", "dtype", "torch_dtype"):
        text.pop(key, None)
    text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1,
                mlp_only_layers=[], router_aux_loss_coef=0.001)
    vision = dense.vision_config.to_dict()
    for key in ("model_type", "transformers_version", "architectures", "dtype", "torch_dtype"):
        vision.pop(key, None)
    return Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **_SPECIAL_IDS)


def tiny_qwen2_5_vl_config():
    """Qwen2.5-VL-3B in miniature. head_dim 64/4 = 16 -> 8 rotary freqs, chunked [2, 3, 3]
    (the 8-freq analogue of [16, 24, 24]). window_size is in pixels: 56 / patch 14 / merge 2
    = 2x2 merged tokens per window; full attention at blocks 1 and 3 of 4."""
    from transformers import Qwen2_5_VLConfig

    text = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[2, 3, 3]),
    )
    vision = dict(
        depth=4,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        hidden_act="silu",
        in_channels=3,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        tokens_per_second=2,
        window_size=56,
        out_hidden_size=64,
        fullatt_block_indexes=[1, 3],
    )
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **_SPECIAL_IDS)


def _build(model_cls, config, seed: int):
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype=torch.float32)
    return model.eval()


def tiny_qwen3_vl(seed: int = 0):
    """A `Qwen3VLForConditionalGeneration` with `tiny_qwen3_vl_config()`, fp32, eval."""
    from transformers import Qwen3VLForConditionalGeneration

    return _build(Qwen3VLForConditionalGeneration, tiny_qwen3_vl_config(), seed)


def tiny_qwen3_vl_moe(seed: int = 0):
    """A `Qwen3VLMoeForConditionalGeneration` with `tiny_qwen3_vl_moe_config()`, fp32, eval."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    return _build(Qwen3VLMoeForConditionalGeneration, tiny_qwen3_vl_moe_config(), seed)


def tiny_qwen2_5_vl(seed: int = 0):
    """A `Qwen2_5_VLForConditionalGeneration` with `tiny_qwen2_5_vl_config()`, fp32, eval."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    return _build(Qwen2_5_VLForConditionalGeneration, tiny_qwen2_5_vl_config(), seed)


def hf_rope_index(model, input_ids, image_grid_thw, image_pad_id: int = IMAGE_TOKEN_ID) -> np.ndarray:
    """HF `get_rope_index` for one sample -> numpy int64 [3, L].

    `mm_token_type_ids` (0 text, 1 image pad) is always passed: without it transformers 5.x
    Qwen3-VL raises and Qwen2/2.5-VL silently return 1-D positions.
    """
    ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long).reshape(1, -1)
    mm_types = (ids == image_pad_id).to(torch.int32)
    grid = None
    if image_grid_thw is not None and np.asarray(image_grid_thw).size:
        grid = torch.as_tensor(np.asarray(image_grid_thw), dtype=torch.long).reshape(-1, 3)
    with torch.no_grad():
        pos, _ = model.model.get_rope_index(ids, mm_token_type_ids=mm_types, image_grid_thw=grid)
    return pos[:, 0].numpy()
