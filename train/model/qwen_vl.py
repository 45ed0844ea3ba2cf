"""Qwen3-VL / Qwen2.5-VL on megatron-core.

    pixel_values -> VisionTower (first pipeline stage only) -> image embeddings
    input_ids -> GPTModel.embedding -> image embeddings scattered in at <|image_pad|> rows
             -> GPTModel.decoder (packed attention, per-token M-RoPE, DeepStack adds after
                layers 0..n-1) -> final norm -> per-token cross-entropy (train.model.loss)

The language model is megatron-core's `GPTModel` (weights, TP sharding, pipeline stages,
tied embeddings), with a local layer spec whose core attention is `PackedCoreAttention`.
We call its embedding and decoder directly rather than `GPTModel.forward`, because the
rotary table (M-RoPE from position_ids) and the loss (never a full fp32 logit matrix) are
ours.

DeepStack features travel through the decoder as the `context` / `context_mask` arguments
that TransformerBlock hands to every layer (and through activation recompute), so
`DecoderLayer` gets them as explicit inputs rather than hidden model state: context is
[num_deepstack, N_image_tokens, hidden], context_mask the row index of each image token.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (TransformerBlock, TransformerBlockSubmodules,
                                                         get_num_layers_to_build)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import Tensor

from train.model import families
from train.model.activation import RecomputedActivation, swiglu
from train.model.arch import ModelArch
from train.model.attention import PackedCoreAttention, PackedRows
from train.model.batch import PackedBatch
from train.model.linear import ColumnParallelLinear, OutputLinear, RowParallelLinear
from train.model.loss import (chunked_cross_entropy, fused_cross_entropy, token_loss, token_loss_and_grad,
                               vocab_parallel_token_loss)
from train.model.moe import moe_config, moe_layer_spec
from train.model.rope import MRoPE, apply_rotary
from train.model.vision import VisionTower



class DecoderLayer(TransformerLayer):
    """megatron's decoder layer. If it is one of the first `num_deepstack` layers, it adds its
    DeepStack feature to the image rows of its output (HF: `_deepstack_process` after layer i
    for i < len(deepstack_visual_embeds)).

    `compiled_forward` (set by `compile_model`): one torch.compile of `TransformerLayer.forward`
    shared by every dense layer. The DeepStack add stays outside it because it reads the
    layer's number, on which a compiled graph would specialise once per layer. `static_rows`
    (packs padded to one length): the graph is compiled for the pack's row count, not for any."""

    compiled_forward = None
    static_rows = False

    def forward(self, *args, **kwargs):
        # The layer has no cross-attention: `context` is DeepStack's alone, and kept out of the
        # compiled graph, which would otherwise compile again for packs without images (None).
        features, rows = kwargs.pop("context", None), kwargs.pop("context_mask", None)
        if self.compiled_forward is not None:
            if self.static_rows:  # megatron's TransformerBlock passes every input by keyword
                mark_rows_static(kwargs["hidden_states"], kwargs.get("packed_seq_params"))
            hidden, _ = self.compiled_forward(self, *args, **kwargs)
        else:
            hidden, _ = super().forward(*args, **kwargs)
        index = self.layer_number - 1  # layer_number is 1-based and global across pipeline stages
        if features is not None and index < features.shape[0]:
            hidden = hidden.index_add(0, rows, features[index].unsqueeze(1).to(hidden.dtype))
        return hidden, features


def mark_rows_static(hidden: Tensor, packed: PackedRows | None) -> None:
    """Compile the decoder layer for these tensors' row count (every other size stays dynamic).
    Marked at each call: recompute and each layer hand over new tensors, and a graph compiled
    on an unmarked one would be the dynamic one."""
    torch._dynamo.mark_static(hidden, 0)
    for table in (packed.rope_cos, packed.rope_sin) if packed is not None else ():
        if table is not None:
            torch._dynamo.mark_static(table, 0)


class SwiGLUMLP(RecomputedActivation, MLP):
    """megatron's dense MLP. Inside a compiled layer with gradients its SwiGLU output is
    recomputed in backward rather than kept (`train.model.activation`); elsewhere it is megatron's
    own forward (its fused SwiGLU on CUDA)."""

    def forward(self, hidden_states: Tensor, per_token_scale=None, **kwargs):
        if per_token_scale is not None or not self.recomputes_output:
            return super().forward(hidden_states, per_token_scale, **kwargs)
        fc1, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            fc1 = fc1 + bias
        return self.linear_fc2(self.activation(swiglu, fc1))


class RMSNorm(torch.nn.RMSNorm):
    """megatron's norm interface (config, hidden_size, eps) on torch's RMSNorm, for every norm
    of the language model. Unlike megatron's `WrappedTorchNorm` it runs under sequence
    parallelism: each TP rank then normalises only its slice of the rows, so the gain is marked
    for megatron's `finalize_model_grads` to sum its gradient over the TP ranks."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def layer_spec(arch: ModelArch, cpu: bool = False):
    moe = arch.lm.is_moe
    spec = get_gpt_layer_local_spec(qk_layernorm=arch.lm.qk_norm, normalization="RMSNorm",
                                    num_experts=arch.lm.num_experts if moe else None, moe_grouped_gemm=moe)
    if moe:
        spec = moe_layer_spec(spec, cpu)
    layer, attention = spec.submodules, spec.submodules.self_attention.submodules
    attention.core_attention = PackedCoreAttention
    attention.linear_qkv, attention.linear_proj = ColumnParallelLinear, RowParallelLinear
    if not moe:
        layer.mlp.module = SwiGLUMLP
        layer.mlp.submodules.linear_fc1, layer.mlp.submodules.linear_fc2 = ColumnParallelLinear, RowParallelLinear
    layer.input_layernorm = layer.pre_mlp_layernorm = RMSNorm
    if arch.lm.qk_norm:
        attention.q_layernorm = attention.k_layernorm = RMSNorm
    spec.module = DecoderLayer
    return spec


def block_spec(arch: ModelArch, config: TransformerConfig, vp_stage=None) -> ModuleSpec:
    """This pipeline stage's decoder block, as `arch`'s family builds it (`train.model.families`)."""
    return families.of(arch).block_spec(arch, config, vp_stage)


def uniform_block_spec(arch: ModelArch, config: TransformerConfig, vp_stage=None) -> ModuleSpec:
    """A decoder block of this stage's layers, each `layer_spec`, and the final norm (Qwen3-VL's, Qwen2.5-VL's)."""
    layers = get_num_layers_to_build(config, vp_stage)
    return ModuleSpec(module=TransformerBlock, submodules=TransformerBlockSubmodules(
        layer_specs=[layer_spec(arch, cpu=config.use_cpu_initialization)] * layers, layer_norm=RMSNorm))


def transformer_config(arch: ModelArch, *, tp: int = 1, pp: int = 1, ep: int = 1, params_dtype=torch.float32,
                       bf16: bool = False, cpu: bool = False, recompute: str = "none",
                       recompute_layers: int | None = None, moe_aux_loss_coef: float = 0.0,
                       sequence_parallel: bool = False, **overrides) -> TransformerConfig:
    """megatron TransformerConfig for the language model; `recompute`: none | selective | full.
    `sequence_parallel` (TP > 1): outside the attention and MLP GEMMs each TP rank holds only
    its slice of the rows (norms, residuals, the MoE router and experts); the row count of a
    pack must then be a multiple of `tp`.

    With full, `recompute_layers` N recomputes only the first N decoder layers of each pipeline
    stage (megatron's block method) and keeps the others' activations: on one 80 GB GPU a
    16k pack of the 2B model fits with a few layers recomputed, and every layer not recomputed
    saves a third of its forward."""
    lm = arch.lm
    recompute_kw = {}
    if recompute == "full":
        if recompute_layers is not None and recompute_layers < 1:
            raise ValueError(f"recompute_layers {recompute_layers} must be >= 1 (or recompute 'none')")
        if recompute_layers is None or recompute_layers >= lm.num_layers // pp:
            recompute_kw = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        else:
            recompute_kw = dict(recompute_granularity="full", recompute_method="block",
                                recompute_num_layers=recompute_layers)
    elif recompute == "selective":
        recompute_kw = dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    elif recompute != "none":
        raise ValueError(f"unknown recompute {recompute!r}: none | selective | full")
    return TransformerConfig(
        num_layers=lm.num_layers, hidden_size=lm.hidden_size, num_attention_heads=lm.num_heads,
        num_query_groups=lm.num_kv_heads, kv_channels=lm.head_dim, ffn_hidden_size=lm.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=lm.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=lm.qkv_bias,
        qk_layernorm=lm.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=params_dtype, bf16=bf16, pipeline_dtype=params_dtype if pp > 1 else None,
        use_cpu_initialization=cpu, init_method_std=0.02, apply_rope_fusion=False,
        # megatron's fused SwiGLU (torch.compile'd, no TE): one kernel each way and only the fc1
        # output kept for backward. CPU runs (tests) keep the eager op: no compile step there.
        bias_activation_fusion=not cpu, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, cross_entropy_loss_fusion=False,
        cuda_graph_scope=[],  # no CUDA graphs; megatron's default ("full") warns that it is deprecated
        attention_output_gate=lm.attn_output_gate, **_linear_attention_config(lm),
        **(moe_config(lm, ep, moe_aux_loss_coef) if lm.is_moe else {}), **recompute_kw, **overrides)


def _linear_attention_config(lm) -> dict:
    """The Gated DeltaNet layers' shape (megatron's linear_* fields, `GatedDeltaNetDims.from_config`)."""
    if not lm.has_linear_attention:
        return {}
    return dict(linear_num_key_heads=lm.linear_num_key_heads, linear_num_value_heads=lm.linear_num_value_heads,
                linear_key_head_dim=lm.linear_key_head_dim, linear_value_head_dim=lm.linear_value_head_dim,
                linear_conv_kernel_dim=lm.linear_conv_kernel_dim)


def compile_model(model: QwenVLModel, decoder: bool = True, backend: str = "inductor",
                  static_rows: bool = False, recompute_mlp_activations: bool = True) -> None:
    """torch.compile where eager PyTorch spends the GPU on elementwise passes (CUDA runs):
    each vision block (norms, fp32 rotary, GELU, bias and residual adds fused around the GEMMs
    and the varlen attention op, and fewer tensors kept for backward), the language model's
    rotary and, with TP = 1, the cross-entropy over the vocabulary. `decoder`: also each dense
    decoder layer as one graph (norms, residual adds, casts, SwiGLU and the rotary around the
    GEMMs and the attention op; in a Gated DeltaNet layer, around its causal conv and delta rule,
    which run eagerly between two graphs); Mixture-of-Experts layers stay eager (under --ep > 1 megatron's
    all-to-all dispatch waits for the host). Dynamic shapes: packs differ in length and patch count, and the
    vision blocks share one graph, as do the decoder layers (parameters are graph inputs), so
    each compiles once per process (once more for the grad-free forward of a recomputed layer).
    `static_rows` (every pack padded to --seq-len): the decoder layers' graphs take the row
    count as fixed, which spares FP8's casts and scale reductions the symbolic indexing that
    slows them (docs/benchmarks.md). `recompute_mlp_activations`: the compiled MLPs recompute their
    activation's output in backward (`train.model.activation`), else keep it."""
    rotary = torch.compile(apply_rotary, dynamic=True, backend=backend)
    if model.token_loss is token_loss:
        model.token_loss = torch.compile(token_loss, dynamic=True, backend=backend)
        model.token_loss_and_grad = torch.compile(token_loss_and_grad, dynamic=True, backend=backend)
    for module in model.modules():
        if isinstance(module, PackedCoreAttention):
            module.rotary = rotary
        if isinstance(module, RecomputedActivation):
            module.recompute_output = recompute_mlp_activations
    if model.vision is not None:
        for block in model.vision.blocks:
            block.compile(dynamic=True, backend=backend)
    if decoder:
        layer_forward = torch.compile(TransformerLayer.forward, dynamic=True, backend=backend)
        for layer in model.language_model.decoder.layers:
            if not isinstance(layer.mlp, MoELayer):
                layer.compiled_forward, layer.static_rows = layer_forward, static_rows


class QwenVLModel(MegatronModule):
    """One pipeline stage of the VLM. The first stage owns the vision tower and embeddings,
    the last the final norm and output layer (tied to the embeddings when the arch says so)."""

    def __init__(self, arch: ModelArch, config: TransformerConfig, *, pre_process: bool = True,
                 post_process: bool = True, recompute_vision: bool | None = None,
                 recompute_vision_blocks: int | None = None, pg_collection=None, vp_stage=None):
        """`recompute_vision`: redo the vision blocks in backward (default: with full recompute);
        `recompute_vision_blocks` N: only the first N of them (default all)."""
        super().__init__(config=config)
        self.arch = arch
        self.pre_process, self.post_process = pre_process, post_process
        self.vision = None
        if pre_process:
            device = None if config.use_cpu_initialization else torch.cuda.current_device()
            self.vision = VisionTower(arch.vision, params_dtype=config.params_dtype, device=device)
            recomputed = config.recompute_granularity == "full" if recompute_vision is None else recompute_vision
            depth = len(self.vision.blocks)
            self.vision.recompute_blocks = min(depth, recompute_vision_blocks or depth) if recomputed else 0
        self.language_model = GPTModel(
            config=config, transformer_layer_spec=block_spec(arch, config, vp_stage), vocab_size=arch.lm.vocab_size,
            max_sequence_length=1 << 20, pre_process=pre_process, post_process=post_process,
            parallel_output=True, share_embeddings_and_output_weights=arch.lm.tie_word_embeddings,
            position_embedding_type="none", pg_collection=pg_collection, vp_stage=vp_stage,
            scatter_embedding_sequence_parallel=False)  # visual embeddings go in first: `_decoder_input`
        if post_process:  # its weight gradient into the buffer, as the decoder linears' (`OutputLinear`)
            output_layer = self.language_model.output_layer
            output_layer.__class__ = OutputLinear
            if self.language_model.share_embeddings_and_output_weights:
                output_layer.shared_weight = self.language_model.shared_embedding_or_output_weight
        self.sequence_parallel = config.sequence_parallel
        if self.sequence_parallel and post_process:
            # The last hidden states are gathered once, before the chunked loss picks its rows
            # (`forward`), so the output layer takes whole rows: megatron's non-SP TP path,
            # whose backward all-reduces the input gradient.
            self.language_model.output_layer.sequence_parallel = False
            self.language_model.output_layer.allreduce_dgrad = True
        # megatron's local spec builds torch.nn.RMSNorm without a dtype: fp32 gains beside bf16
        # activations, which torch.rms_norm cannot fuse (it warns and falls back to an fp32
        # composite that is slow and keeps fp32 copies for backward). Gains in the compute
        # dtype, as in HF's bf16 model; the optimizer still holds fp32 master copies.
        for module in self.language_model.modules():
            if isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
                module.to(config.params_dtype)
        self.rope = MRoPE(arch.lm.rotary_dim, arch.lm.rope_theta, arch.lm.mrope_section, arch.lm.mrope_interleaved)
        self.share_embeddings_and_output_weights = arch.lm.tie_word_embeddings
        self.token_loss = token_loss if config.tensor_model_parallel_size == 1 else vocab_parallel_token_loss
        self.token_loss_and_grad = token_loss_and_grad
        self.fused_loss = False  # `--loss fused` (TP = 1): train.model.loss
        self.model_type = self.language_model.model_type  # megatron's schedules ask for it

    def shared_embedding_or_output_weight(self):
        """megatron's finalize_model_grads syncs the tied embedding grads through this (PP > 1)."""
        return self.language_model.shared_embedding_or_output_weight()

    def set_input_tensor(self, input_tensor) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def _decoder_input(self, input_ids: Tensor, pixel_values: Tensor | None, image_grid_thw: Tensor | None,
                       image_rows: Tensor | None, pixel_values_videos: Tensor | None = None,
                       video_grid_thw: Tensor | None = None, video_rows: Tensor | None = None):
        """Text embeddings with image and video embeddings scattered in; DeepStack context for the decoder.

        Images and videos go through the vision tower in one call (it attends within each frame
        of each item, so items do not see each other); image embeddings land on the
        <|image_pad|> rows and video embeddings on the <|video_pad|> rows, each in order, as HF
        scatters them. The DeepStack context follows the same rows."""
        embeds = self.language_model.embedding(input_ids=input_ids[None], position_ids=None)  # [T, 1, H]
        parts = []  # (pixel values, grid, rows, pad token)
        if pixel_values is not None and pixel_values.shape[0]:
            rows = image_rows if image_rows is not None else torch.nonzero(input_ids == self.arch.image_token_id)[:, 0]
            parts.append((pixel_values, image_grid_thw, rows, "<|image_pad|>"))
        if pixel_values_videos is not None and pixel_values_videos.shape[0]:
            rows = video_rows if video_rows is not None else torch.nonzero(input_ids == self.arch.video_token_id)[:, 0]
            parts.append((pixel_values_videos, video_grid_thw, rows, "<|video_pad|>"))
        if not parts:
            return embeds, None, None
        merge = self.arch.vision.spatial_merge_size ** 2
        for _, grid, rows, pad in parts:
            need = int(grid.to("cpu", torch.long).prod(dim=1).sum()) // merge
            if rows.numel() != need:
                raise ValueError(f"batch has {rows.numel()} {pad} tokens but its grids {grid.tolist()} give {need} embeddings")
        values, grid, rows = (torch.cat([p[i] for p in parts]) if len(parts) > 1 else parts[0][i] for i in range(3))
        visual_embeds, deepstack = self.vision(values, grid)
        embeds = embeds.clone()
        embeds[rows, 0] = visual_embeds.to(embeds.dtype)
        if not deepstack:
            return embeds, None, None
        context = torch.stack(deepstack)
        if self.sequence_parallel:
            context, rows = self._local_deepstack(context, rows, embeds.shape[0])
        return embeds, context, rows

    def _local_deepstack(self, context: Tensor, rows: Tensor, total: int) -> tuple[Tensor, Tensor]:
        """The DeepStack features of the rows in this TP rank's slice of the sequence, with
        their row indices within the slice. Each rank adds only its rows, so the features'
        gradient is summed over the TP ranks (`copy_to_tensor_model_parallel_region`) before
        the replicated vision tower sees it. Rows outside the slice add zeros to row 0 rather
        than being dropped: no device-to-host sync to count them."""
        mine = self._rank_rows(total)
        context = tensor_parallel.copy_to_tensor_model_parallel_region(context)
        rows = rows - mine.start
        inside = (rows >= 0) & (rows < mine.stop - mine.start)
        return context * inside[None, :, None].to(context.dtype), torch.where(inside, rows, 0)

    def _rank_rows(self, total: int) -> slice:
        """This TP rank's rows of a `total`-row pack under sequence parallelism."""
        local = total // self.config.tensor_model_parallel_size
        start = parallel_state.get_tensor_model_parallel_rank() * local
        return slice(start, start + local)

    def forward(self, batch: PackedBatch, pixel_values: Tensor | None = None,
                pixel_values_videos: Tensor | None = None, return_logits: bool = False) -> Tensor:
        """One packed row (`PackedBatch`, its tensors on this device but for the grids): it reads
        input_ids, labels, position_ids, cu_seqlens_padded (row offsets) and max_seqlen, the
        image and video grids (best on the CPU), padding_mask (MoE routers leave those rows out
        of the load-balancing loss), and the rows found on the host when given (`with_rows`:
        then the forward never waits for the GPU): image_rows / video_rows, where the visual
        embeddings land, and loss_rows, the only rows that go through the output layer and the
        loss. `pixel_values` / `pixel_values_videos`: the vision tower's inputs, made from the
        batch's patches (`train.data.TrainData.pixel_values`).
        Last stage: per-token loss [T] (fp32, 0 where labels == -100), or full logits [T, V]
        with `return_logits`. Other stages: hidden [T, 1, H] (their input is the previous
        stage's output, `set_input_tensor`)."""
        input_ids, position_ids, padding_mask = batch.input_ids, batch.position_ids, batch.padding_mask
        cu_seqlens, max_seqlen = batch.cu_seqlens_padded, batch.max_seqlen
        context = rows = None
        decoder_input = None
        if self.pre_process:
            decoder_input, context, rows = self._decoder_input(input_ids, pixel_values, batch.image_grid_thw,
                                                               batch.image_rows, pixel_values_videos,
                                                               batch.video_grid_thw, batch.video_rows)
            if self.sequence_parallel:  # each TP rank keeps its slice of the rows from here to the loss
                decoder_input = tensor_parallel.scatter_to_sequence_parallel_region(decoder_input)
            # The embedding hands over [T, 1, H] as a transpose of [1, T, H]: the same layout as
            # every later layer's input but for the size-1 dim's stride, on which a compiled
            # decoder layer would compile a second graph. `view` gives the canonical strides.
            decoder_input = decoder_input.view(-1, 1, decoder_input.shape[-1])
            if (torch.is_grad_enabled() and not decoder_input.requires_grad
                    and self.config.recompute_granularity == "full"):
                # megatron's full recompute is a reentrant checkpoint: a layer whose input needs no
                # gradient gives its parameters none (a frozen embedding under LoRA adapters)
                decoder_input = decoder_input.detach().requires_grad_()
        # qkv_format "sbhd" on purpose, and M-RoPE applied by our core attention: see PackedCoreAttention.
        cos, sin = self.rope(position_ids, self.config.params_dtype)
        packed = PackedRows(qkv_format="sbhd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                            max_seqlen_q=int(max_seqlen), max_seqlen_kv=int(max_seqlen), rope_cos=cos, rope_sin=sin)
        moe = {}
        if self.arch.lm.is_moe and padding_mask is not None:
            if self.sequence_parallel:
                padding_mask = padding_mask[self._rank_rows(padding_mask.shape[0])]
            moe["padding_mask"] = padding_mask[None]  # [b, s], as megatron's MoE layer takes it
        hidden = self.language_model.decoder(
            hidden_states=decoder_input, attention_mask=None, context=context, context_mask=rows,
            packed_seq_params=packed, **moe)
        if not self.post_process:
            return hidden
        if self.sequence_parallel:  # whole rows again: the loss picks its rows by their index in the pack
            hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        weight = self.language_model.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        if return_logits:
            logits, _ = self.language_model.output_layer(hidden, weight=weight)
            return tensor_parallel.gather_from_tensor_model_parallel_region(logits)[:, 0].float()
        if self.fused_loss and torch.is_grad_enabled():
            weight = self.language_model.output_layer.weight if weight is None else weight
            return fused_cross_entropy(hidden, batch.labels, weight, self.token_loss_and_grad, rows=batch.loss_rows)
        return chunked_cross_entropy(hidden, batch.labels, self.language_model.output_layer, weight, self.token_loss,
                                     rows=batch.loss_rows)
