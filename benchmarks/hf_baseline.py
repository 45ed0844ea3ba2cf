"""The strongest Hugging Face training recipe, on the very packs vlmpack trains on.

What a user of TRL (`padding_free`) or LLaMA-Factory (`neat_packing`) runs today, built on
transformers' own model classes:

- padding-free packs: the samples of each vlmpack pack laid end to end in one row, in the
  trainer's order, with each sample's M-RoPE positions from the shards and the 1-D text
  positions restarting at 0 per sample (`position_ids` [4, 1, T], transformers' packed layout);
- varlen FlashAttention for the language model and the vision tower: vlmpack's own
  `packed_attention` (torch's `varlen_attn`, FA2, or FA4 where `select_attention_kernel` chose
  it: the same kernel on both sides) registered through `transformers.AttentionInterface`. The
  name holds "flash", so the vision towers hand it their `cu_seqlens`; it is absent from the
  mask interface, so the language model builds no 4-D mask, and its sample boundaries come
  from the text positions (where they restart at 0), as transformers' own FA2 path finds them;
- Qwen3.5's Gated DeltaNet layers on flash-linear-attention's varlen kernels: the chunked gated
  delta rule given each pack's boundaries (transformers passes `cu_seq_lens_q` on to it), and
  the causal conv1d too (`fla.modules.causal_conv1d` with `cu_seqlens`, in place of
  transformers' conv, which takes no boundaries), so each sample starts fresh as it would alone;
- Liger kernels (`liger-kernel`) where they support the model (`apply_liger_kernel_to_<model>`):
  which parts they cover is recorded (`LigerCoverage`);
- bf16 parameters, fused AdamW (bf16 moments), gradient clipping at 1.0, the trainer's learning-rate
  schedule (`Recipe.train_steps`: transformers' cosine with warm-up); PEFT adapters for LoRA;
  transformers' default experts implementation for Mixture-of-Experts models;
- gradient checkpointing only where a step does not fit without it (the caller retries).

Each step is the trainer's global batch: one forward and backward per pack, the pack's mean loss
weighted by its share of the global batch's target tokens, so the gradient is the per-token
mean over the global batch, as vlmpack's.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from shards_schema.pixels import pixel_values_from_patches, video_pixel_values_from_patches
from train.model.attention import packed_attention

ATTENTION = "vlmpack_varlen_flash"  # "flash" in the name: the vision towers pass their cu_seqlens
IGNORE_INDEX = -100


def _boundaries(text_positions: torch.Tensor) -> tuple[torch.Tensor, int]:
    """cu_seqlens (int32) and the longest sample of a packed row, from its 1-D text positions
    [1, T] (each sample's start at position 0)."""
    positions = text_positions.reshape(-1)
    starts = torch.nonzero(positions == 0).reshape(-1)
    cu = torch.cat([starts, starts.new_tensor([positions.numel()])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


class _BoundaryCache:
    """The language model's layers of one forward all see the same text-position tensor: find
    its boundaries once (a host sync) instead of once per layer."""

    def __init__(self):
        self.key = None
        self.value = None

    def get(self, text_positions: torch.Tensor) -> tuple[torch.Tensor, int]:
        key = (text_positions.data_ptr(), text_positions.numel(), text_positions._version)
        if key != self.key:
            self.key, self.value = key, _boundaries(text_positions)
        return self.value


_boundary_cache = _BoundaryCache()


def packed_hf_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                        is_causal=None, cu_seq_lens_q=None, max_length_q=None, position_ids=None, **_):
    """transformers' attention interface (q/k/v [1, H, T, D] -> [1, T, H, D], None) onto
    vlmpack's packed attention. The vision towers pass `cu_seq_lens_q`; the language model
    passes its text positions."""
    if query.shape[0] != 1:
        raise ValueError(f"packed rows have batch size 1, got {query.shape[0]}")
    if cu_seq_lens_q is not None:
        cu, longest = cu_seq_lens_q, max_length_q
        if longest is None:
            longest = int((cu[1:] - cu[:-1]).max())
    elif position_ids is not None:
        cu, longest = _boundary_cache.get(position_ids)
    else:
        raise ValueError("packed attention needs the sample boundaries: cu_seq_lens_q or text position_ids")
    causal = module.is_causal if is_causal is None else is_causal
    # token-major and contiguous, as transformers' own flash path hands them to its kernels
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    out = packed_attention(q, k, v, cu, int(longest), causal=bool(causal), scale=scaling)
    return out.unsqueeze(0), None


def use_packed_attention(model) -> None:
    """Register `packed_hf_attention` and switch every config of `model` to it. The model loads
    with sdpa first: newer transformers refuse an unknown name holding "flash" at load time
    (taking it for a hub kernel), while the config setter takes any registered name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, packed_hf_attention)
    model.config._attn_implementation = ATTENTION  # recurses into the text and vision configs
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation_internal"):
            config._attn_implementation_internal = ATTENTION


def packed_causal_conv1d(original):
    """transformers' `causal_conv1d_fn` ([B, D, T] in and out) that, given the pack's boundaries
    (`cu_seq_lens_q`, which the Gated DeltaNet layer passes on in its keywords), runs
    flash-linear-attention's varlen causal conv1d, whose window restarts at each sample: the
    first tokens of a sample see zeros, not the end of the sample before. Without them it is
    `original`."""
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, cu_seq_lens_q=None, **kwargs):
        if cu_seq_lens_q is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        from fla.modules.causal_conv1d import causal_conv1d

        out, _ = causal_conv1d(x=hidden_states.transpose(1, 2).to(weight.dtype).contiguous(), weight=weight, bias=bias,
                               activation=activation, cu_seqlens=cu_seq_lens_q)
        return out.transpose(1, 2).to(hidden_states.dtype)

    causal_conv1d_fn.packed = True
    return causal_conv1d_fn


def calls_module_conv(layer) -> bool:
    """Whether a Gated DeltaNet layer's forward calls its module's `causal_conv1d_fn`, the
    function `use_packed_linear_attention` replaces (not a per-layer binding of its own)."""
    forward = inspect.unwrap(type(layer).forward)
    return "causal_conv1d_fn" in forward.__code__.co_names and "causal_conv1d_fn" not in vars(layer)


def use_packed_linear_attention(model) -> int:
    """Hand each Gated DeltaNet layer (Qwen3.5) its pack's sample boundaries as `cu_seq_lens_q`,
    the keyword transformers passes on to flash-linear-attention's `chunk_gated_delta_rule`, so
    each sample's recurrent state starts fresh, as a packing user's collator
    (`return_flash_attn_kwargs`) does, and to the layer's causal conv1d, which is made to take
    them (`packed_causal_conv1d`; transformers' own conv window runs across samples). The
    boundaries come from the text positions of the model's own call: the vision tower takes its
    `cu_seq_lens_q` from its grids, and a top-level keyword would reach it too. Returns the
    number of layers."""
    layers = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    if not layers:
        return 0
    if importlib.util.find_spec("fla") is None:
        raise RuntimeError("HF's packed recipe for Gated DeltaNet layers needs flash-linear-attention "
                           "(pip install fla-core; CUDA): transformers' own path runs packed samples into each other")
    for layer in layers:
        if not calls_module_conv(layer):
            raise RuntimeError(f"{type(layer).__name__} of this transformers version does not call its module's "
                               "causal_conv1d_fn: the packed recipe cannot give its conv the sample boundaries")
    for module in {sys.modules[type(layer).__module__] for layer in layers}:
        if not getattr(module.causal_conv1d_fn, "packed", False):
            module.causal_conv1d_fn = packed_causal_conv1d(module.causal_conv1d_fn)
    current: dict = {}

    def record(module, args, kwargs):
        positions = kwargs.get("position_ids")
        current["cu"] = _boundary_cache.get(positions[0])[0] if positions is not None else None

    def inject(module, args, kwargs):
        if current.get("cu") is not None:
            kwargs["cu_seq_lens_q"] = current["cu"]
        return args, kwargs

    model.register_forward_pre_hook(record, with_kwargs=True)
    for layer in layers:
        layer.register_forward_pre_hook(inject, with_kwargs=True)
    return len(layers)


# ------------------------------------------------------------------------------------- Liger

LIGER_PATCHES = {  # HF class -> liger_kernel.transformers function
    "Qwen3VLForConditionalGeneration": "apply_liger_kernel_to_qwen3_vl",
    "Qwen3VLMoeForConditionalGeneration": "apply_liger_kernel_to_qwen3_vl_moe",
    "Qwen2_5_VLForConditionalGeneration": "apply_liger_kernel_to_qwen2_5_vl",
    "Qwen3_5ForConditionalGeneration": "apply_liger_kernel_to_qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "apply_liger_kernel_to_qwen3_5_moe",
}
# kernels a patch function takes but documents as not supported for the model: Liger's rotary
# refuses Qwen3.5's hybrid layers (liger-kernel 0.8.5 raises NotImplementedError)
LIGER_UNSUPPORTED = {
    "Qwen3_5ForConditionalGeneration": ("rope",),
    "Qwen3_5MoeForConditionalGeneration": ("rope",),
}


@dataclasses.dataclass
class LigerCoverage:
    """What Liger replaced in one model: the function applied, its arguments, and the modules
    and functions that now run Liger's kernels (counted on the model, not assumed)."""

    function: str | None
    version: str | None = None
    arguments: dict = dataclasses.field(default_factory=dict)
    modules: dict = dataclasses.field(default_factory=dict)  # Liger module class -> count
    functions: list = dataclasses.field(default_factory=list)
    reason: str | None = None  # why nothing was applied
    implementation: str | None = None  # the kernel set Liger's dispatcher is pinned to


# Liger's Triton kernels. Liger prefers its CuTe DSL kernels wherever nvidia-cutlass-dsl imports
# (FA4 installs it); with them the 2B packed HF step ran at half the speed on one H200 (13.0k
# against 24.2-25.3k tokens/s), so the recipe pins the faster set for every op its patches use.
LIGER_IMPLEMENTATION = "nvidia-triton"
LIGER_TRITON_OPS = ("rope", "rms_norm", "swiglu", "cross_entropy", "fused_linear_cross_entropy")


def apply_liger(model, hf_class: str) -> LigerCoverage:
    """Every Liger kernel that supports this model, as Liger's documentation applies them, and
    what it replaced: modules that now name themselves Liger*, module-level functions of the
    modeling file that changed, and the forward (fused linear cross-entropy)."""
    import importlib
    import importlib.metadata
    import inspect

    name = LIGER_PATCHES.get(hf_class)
    if name is None:
        return LigerCoverage(None, reason=f"liger-kernel has no patch for {hf_class}")
    try:
        liger = importlib.import_module("liger_kernel.transformers")
    except ImportError as err:
        return LigerCoverage(name, reason=f"liger-kernel is not installed ({err})")
    for op in LIGER_TRITON_OPS:  # read by Liger's dispatcher at each call; harmless where it has none
        os.environ[f"LIGER_KERNEL_IMPL_{op.upper()}"] = LIGER_IMPLEMENTATION
    apply = getattr(liger, name)
    params = inspect.signature(apply).parameters
    # every kernel the function offers; the fused linear cross-entropy, not the plain one
    unsupported = LIGER_UNSUPPORTED.get(hf_class, ())
    arguments = {k: k != "cross_entropy" and k not in unsupported
                 for k in ("rope", "rms_norm", "swiglu", "cross_entropy", "fused_linear_cross_entropy") if k in params}
    hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model  # under PEFT
    modeling = importlib.import_module(type(hf_model).__module__)
    functions_before = {k: v for k, v in vars(modeling).items() if callable(v) and not isinstance(v, type)}
    apply(model=hf_model, **arguments)
    modules: dict[str, int] = {}
    for sub in hf_model.modules():
        if sub._get_name().startswith("Liger"):
            modules[sub._get_name()] = modules.get(sub._get_name(), 0) + 1
    functions = sorted(k for k, v in functions_before.items() if vars(modeling).get(k) is not v)
    if getattr(hf_model.forward, "__module__", "").startswith("liger_kernel"):
        functions.append("forward (fused linear cross-entropy)")
    return LigerCoverage(name, importlib.metadata.version("liger-kernel"), arguments, modules, functions,
                         implementation=LIGER_IMPLEMENTATION)


# ------------------------------------------------------------------------------------- model


def hf_model_class(arch):
    """transformers' class for the arch (Qwen3VL..., Qwen3VLMoe..., Qwen2_5_VL...ForConditionalGeneration)."""
    import transformers

    return getattr(transformers, arch.hf_architecture)


def write_init_checkpoint(arch, out_dir: Path, seed: int, dtype: torch.dtype, device: torch.device) -> Path:
    """Random weights of `arch` as an HF checkpoint directory: both sides start from it, so
    their first-step losses compare directly."""
    model_class = hf_model_class(arch)
    config = model_class.config_class(**arch.to_hf_config())
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class._from_config(config, dtype=dtype)
    model.save_pretrained(out_dir, safe_serialization=True)
    del model
    return out_dir


@dataclasses.dataclass
class Recipe:
    """The HF side's settings (`HFPackedTrainer`)."""

    lr: float = 1e-5
    liger: bool = True
    gradient_checkpointing: bool = False
    lora_rank: int = 0
    # fp32: each pack's gradients summed into fp32 copies of the bf16 parameters, which AdamW
    # steps and the parameters then take rounded, as vlmpack's default fp32 master weights and
    # gradient buffers do; bf16: gradients summed and AdamW applied on the bf16 parameters
    master_weights: str = "bf16"
    # the learning rate of vlmpack's runs (megatron's linear warm-up, then cosine to min_lr at
    # train_steps), through transformers' own scheduler; train_steps None: lr throughout
    train_steps: int | None = None
    warmup_steps: int = 0
    min_lr: float = 0.0


class HFPackedTrainer:
    """The HF model from `init_dir` under the recipe above, stepping on vlmpack's packs."""

    def __init__(self, arch, init_dir: Path, profile: dict, recipe: Recipe, device: torch.device,
                 dtype: torch.dtype | None = None):
        """`dtype`: of the parameters and the compute; default bf16 on CUDA, else fp32."""
        self.device, self.cuda = device, device.type == "cuda"
        self.dtype = dtype or (torch.bfloat16 if self.cuda else torch.float32)
        self.vision, self.video = profile["vision"], profile.get("video")
        model_class = hf_model_class(arch)
        self.model = model_class.from_pretrained(init_dir, dtype=self.dtype, attn_implementation="sdpa",
                                                 device_map=str(device))
        use_packed_attention(self.model)
        self.linear_attention_layers = use_packed_linear_attention(self.model)
        self.model.train()
        self.model.config.use_cache = False
        self.liger = LigerCoverage(None, reason="off (--hf-liger false)")
        if recipe.gradient_checkpointing:  # transformers' own per-layer recompute (non-reentrant)
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if recipe.lora_rank:  # PEFT's adapters on the same modules as vlmpack's, the base frozen
            from peft import LoraConfig, get_peft_model

            from train.model.lora import LoraSpec, peft_target_regex, resolve_sites

            spec = LoraSpec(rank=recipe.lora_rank, alpha=2.0 * recipe.lora_rank)
            self.model = get_peft_model(self.model, LoraConfig(
                r=spec.rank, lora_alpha=spec.alpha, target_modules=peft_target_regex(resolve_sites(arch, spec))))
        if recipe.liger:
            if self.cuda:
                self.liger = apply_liger(self.model, arch.hf_architecture)
            else:
                self.liger = LigerCoverage(None, reason="Liger's kernels are Triton kernels: CUDA only")
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.masters = None
        if recipe.master_weights == "fp32" and self.dtype != torch.float32:
            self.masters = [p.detach().float() for p in self.params]
        self.optimizer = torch.optim.AdamW(self.masters or self.params, lr=recipe.lr, betas=(0.9, 0.95), eps=1e-8,
                                           weight_decay=0.0, fused=self.cuda)
        self.scheduler = lr_schedule(self.optimizer, recipe)
        self.num_params = sum(p.numel() for p in self.params)

    def _sum_into_masters(self) -> None:
        """One pack's bf16 gradients added into the fp32 masters' (the sum of a step's packs kept
        in fp32, not rounded to bf16 at each pack), the parameters' cleared for the next pack."""
        for param, master in zip(self.params, self.masters):
            if param.grad is None:
                continue
            if master.grad is None:
                master.grad = param.grad.float()
            else:
                master.grad.add_(param.grad)
            param.grad = None

    def inputs(self, pack: dict) -> dict:
        """One collated pack (`collate_pack`) on the device, pixels normalised there."""
        dev = self.device
        inputs = {k: torch.from_numpy(pack[k]).to(dev, non_blocking=True) for k in ("input_ids", "position_ids", "labels")}
        if pack["pixel_patches"].shape[0]:
            v = self.vision
            patches = torch.from_numpy(pack["pixel_patches"]).to(dev, non_blocking=True)
            inputs["pixel_values"] = pixel_values_from_patches(
                patches, v["image_mean"], v["image_std"], int(v["patch_size"]), int(v["temporal_patch_size"]),
                int(v.get("channels", 3)), dtype=self.dtype)
            inputs["image_grid_thw"] = torch.from_numpy(pack["image_grid_thw"]).to(dev)
        if pack["video_patches"].shape[0]:
            patches = torch.from_numpy(pack["video_patches"]).to(dev, non_blocking=True)
            inputs["pixel_values_videos"] = video_pixel_values_from_patches(
                patches, self.video["image_mean"], self.video["image_std"], dtype=self.dtype)
            inputs["video_grid_thw"] = torch.from_numpy(pack["video_grid_thw"]).to(dev)
            if "second_per_grid_ts" in pack:
                inputs["second_per_grid_ts"] = torch.from_numpy(pack["second_per_grid_ts"]).to(dev)
        return inputs

    def step(self, packs: list[dict], targets: int | None = None, scale: float = 1.0) -> float:
        """One optimizer step over `packs`: each pack's mean loss weighted by its target tokens
        over `targets` (default: the packs' own; under data parallelism the global batch's) times
        `scale` (the data-parallel size where gradients are averaged over the ranks). Returns the
        weighted sum: the per-target-token mean loss of the packs' share, times `scale`."""
        targets = targets or sum(p["targets"] for p in packs)
        total = 0.0
        for pack in packs:
            loss = self.model(**self.inputs(pack), use_cache=False).loss
            weighted = loss * (pack["targets"] * scale / targets)
            weighted.backward()
            total += float(weighted.detach())
            if self.masters is not None:
                self._sum_into_masters()
        torch.nn.utils.clip_grad_norm_(self.masters or self.params, 1.0)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.masters is not None:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.masters)
        return total


def lr_schedule(optimizer, recipe: Recipe):
    """transformers' cosine schedule with warm-up as vlmpack's runs have it (megatron's: linear
    from 0 over warmup_steps, then cosine from lr to min_lr at train_steps); None without
    train_steps (lr throughout)."""
    if not recipe.train_steps:
        return None
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    return get_cosine_with_min_lr_schedule_with_warmup(optimizer, recipe.warmup_steps, recipe.train_steps,
                                                       min_lr=recipe.min_lr)


def collate_pack(samples: list[dict]) -> dict:
    """The samples of one pack as one padding-free HF row (numpy, int64): input_ids [1, T];
    position_ids [4, 1, T] (text positions restarting at 0 per sample, then the shards' M-RoPE
    rows); labels [1, T] in HF's unshifted convention (the token where the shard's loss mask
    is 1, else -100: a sample's first token is never a target, so the model's shift never makes
    a target across samples); the pixel patches and grids of its images and videos, in order."""
    ids = np.concatenate([np.asarray(s["input_ids"], dtype=np.int64) for s in samples])
    mask = np.concatenate([np.asarray(s["loss_mask"], dtype=bool) for s in samples])
    starts = np.cumsum([0] + [len(s["input_ids"]) for s in samples[:-1]])
    if mask[starts].any():
        raise ValueError("a sample's first token is a target: HF's shifted loss would cross samples")
    text = np.concatenate([np.arange(len(s["input_ids"]), dtype=np.int64) for s in samples])
    mrope = np.concatenate([np.asarray(s["position_ids"], dtype=np.int64).reshape(3, -1) for s in samples], axis=1)

    def cat(key: str, width: int, dtype) -> np.ndarray:
        parts = [np.asarray(s[key]).reshape(-1, width) for s in samples if key in s and len(s[key])]
        return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros((0, width), dtype)

    patch_width = next((np.asarray(s["pixel_patches"]).shape[-1] for s in samples if len(s["pixel_patches"])), 0)
    video_width = next((np.asarray(s["video_patches"]).shape[-1] for s in samples
                        if "video_patches" in s and len(s["video_patches"])), 0)
    out = {
        "input_ids": ids[None, :],
        "position_ids": np.concatenate([text[None, :], mrope])[:, None, :],
        "labels": np.where(mask, ids, IGNORE_INDEX)[None, :],
        "pixel_patches": cat("pixel_patches", patch_width, np.uint8),
        "image_grid_thw": cat("image_grid_thw", 3, np.int64),
        "video_patches": cat("video_patches", video_width, np.uint8),
        "video_grid_thw": cat("video_grid_thw", 3, np.int64),
        "tokens": int(len(ids)),
        "targets": int(mask.sum()),
    }
    if any("second_per_grid_ts" in s and len(s["second_per_grid_ts"]) for s in samples):
        out["second_per_grid_ts"] = np.concatenate([np.asarray(s["second_per_grid_ts"], dtype=np.float32)
                                                    for s in samples if len(s.get("second_per_grid_ts", []))])
    return out


def timed_steps(trainer: HFPackedTrainer, steps: list[list[dict]], warmup: int, log) -> list[dict]:
    """Each global batch of `steps` as one optimizer step, timed end to end (synchronized)."""
    out = []
    for k, packs in enumerate(steps):
        if trainer.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = trainer.step(packs)
        if trainer.cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        tokens = sum(p["tokens"] for p in packs)
        out.append({"step": k + 1, "loss": loss, "tokens": tokens, "target_tokens": sum(p["targets"] for p in packs),
                    "step_seconds": seconds, "tokens_per_s": tokens / seconds, "warmup": k < warmup,
                    "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if trainer.cuda else None})
        log(f"HF: step {k + 1}/{len(steps)}: {tokens:,} tokens in {seconds:.3f} s ({tokens / seconds:,.0f} tok/s), "
            f"loss {loss:.5f}")
    return out
