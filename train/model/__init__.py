"""The Qwen-VL model on megatron-core: packed attention, M-RoPE, vision towers, the VLM."""
