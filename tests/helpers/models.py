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


# family -> its tiny model
TINY_MODELS = {"qwen3-vl": tiny_qwen3_vl, "qwen2.5-vl": tiny_qwen2_5_vl}


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


# --- Qwen3.5 / Qwen3.6 -------------------------------------------------------------------------

QWEN3_5_IDS = dict(image_token_id=248056, video_token_id=248057, vision_start_token_id=248053,
                   vision_end_token_id=248054)
QWEN3_5_VOCAB_SIZE = 248320


def tiny_qwen3_5_config(moe: bool = False, layers: int = 4):
    """Qwen3.5 in miniature, written as the published configs are: `layers` decoder layers, three
    of every four Gated DeltaNet (2 key heads serving 4 value heads, key/value head dims 8/12),
    every fourth gated softmax attention (4 heads, 2 KV heads, head_dim 32 of which 8 rotate:
    partial_rotary_factor 0.25, interleaved M-RoPE [2, 1, 1] = T, H, W, T over its 4
    frequencies), the real vocabulary; a 2-block vision tower without DeepStack. `moe`: every MLP
    is 8 experts of width 24, 2 per token, plus a shared expert of width 40 (Qwen3.5-35B-A3B in
    miniature, untied like it); dense models are tied like Qwen3.5-0.8B."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    text = dict(
        vocab_size=QWEN3_5_VOCAB_SIZE, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=262144,
        attention_bias=False, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
        linear_num_key_heads=2, linear_num_value_heads=4,
        rope_parameters=dict(rope_type="default", rope_theta=1e7, mrope_section=[2, 1, 1], mrope_interleaved=True,
                             partial_rotary_factor=0.25))
    if moe:
        text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                    router_aux_loss_coef=0.001)
    else:
        text["intermediate_size"] = 128
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, hidden_act="gelu_pytorch_tanh",
                  in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                  num_position_embeddings=2304)
    config_class = Qwen3_5MoeConfig if moe else Qwen3_5Config
    return config_class(text_config=text, vision_config=vision, tie_word_embeddings=not moe, **QWEN3_5_IDS)


def tiny_qwen3_5(seed: int = 0, moe: bool = False, layers: int = 4):
    """A `Qwen3_5ForConditionalGeneration` (`moe`: `Qwen3_5MoeForConditionalGeneration`) with
    `tiny_qwen3_5_config()`, fp32, eval, every parameter moved off its initial value (the
    zero-centred norms' zeros, the gated norms' and dt_bias' ones), so a norm read as 1 + w or as
    w, or a missing gate, shows."""
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration

    model = _build(Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration,
                   tiny_qwen3_5_config(moe, layers), seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1 or "norm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
    return model


def tiny_qwen3_5_moe(seed: int = 0, layers: int = 4):
    return tiny_qwen3_5(seed, moe=True, layers=layers)
