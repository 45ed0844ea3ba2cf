"""M-RoPE for the language model from the batch's precomputed position_ids [3, T].

Each of the head_dim/2 rotary frequencies reads one of the three position rows (T, H, W):
- Qwen3-VL, interleaved: frequency j uses H if j % 3 == 1, W if j % 3 == 2 (within the first
  3 * section[1] resp. 3 * section[2] frequencies), T otherwise (sections 24/20/20).
- Qwen2.5-VL, chunked: T for the first section[0] frequencies, then H, then W (16/24/24).
megatron-core's MultimodalRotaryEmbedding has only the chunked kind, and its THD path
assumes positions restart at 0 per sample; we build the per-token table ourselves, once per
micro-batch: cos/sin [T, 1, head_dim] of cat(freqs, freqs) in the compute dtype (HF's
rounding), applied with the rotate-half convention HF uses by `PackedCoreAttention`, so
megatron's per-layer cos/sin and its unfused rotary path are never run.
"""

from __future__ import annotations

import torch
from torch import Tensor


def mrope_axis_of_frequency(section: tuple[int, int, int], interleaved: bool) -> Tensor:
    """[head_dim/2] int64: which position row (0 T, 1 H, 2 W) each frequency uses."""
    n = sum(section)
    j = torch.arange(n)
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(section))
    axis = torch.zeros(n, dtype=torch.long)
    axis[(j % 3 == 1) & (j < 3 * section[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return axis


class MRoPE(torch.nn.Module):
    """`head_dim`: the rotated dims of each head (all of it, or HF's partial rotary's share)."""

    def __init__(self, head_dim: int, theta: float, section: tuple[int, int, int], interleaved: bool):
        super().__init__()
        if sum(section) != head_dim // 2:
            raise ValueError(f"mrope section {section} must sum to head_dim/2 = {head_dim // 2}")
        # Plain fp32 attributes, not buffers: a whole-model `.to(bfloat16)` would round the
        # frequencies and shift long-context angles by radians.
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.axis = mrope_axis_of_frequency(section, interleaved)
        self._on_device: dict[torch.device, tuple[Tensor, Tensor]] = {}  # copied once, not every step

    def _tables(self, device: torch.device) -> tuple[Tensor, Tensor]:
        if device not in self._on_device:
            self._on_device[device] = (self.axis.to(device), self.inv_freq.to(device))
        return self._on_device[device]

    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """position_ids [3, T] -> (cos, sin) [T, 1, head_dim]: angles in fp32, then cast to
        `dtype` as HF does before applying them."""
        axis, inv_freq = self._tables(position_ids.device)
        pos = position_ids[axis].float()  # [head_dim/2, T]
        freqs = (pos * inv_freq[:, None]).t()
        angles = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF's rotate-half rotary, `x * cos + rotate_half(x) * sin` over the last dim (cos/sin
    broadcast). Plain elementwise torch: `compile_model` fuses it into one kernel on GPUs.
    Partial rotary (cos/sin narrower than x, Qwen3.5): the first cos.shape[-1] dims of x rotate,
    the rest pass unchanged, as HF's `apply_rotary_pos_emb` does."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
