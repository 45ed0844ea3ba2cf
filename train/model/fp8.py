"""FP8 GEMMs for the language model's decoder linears (`--fp8`), through torchao's float8 training.

The decoder layers' linears (qkv and attention output; fc1 and fc2 in dense layers) run their
forward, input-gradient and weight-gradient GEMMs in float8 with dynamic scales taken from
each operand, as torchao's float8 training recipes define them:
- `tensorwise`: one scale per tensor (cuBLAS's FP8 GEMM), e4m3 forward and e5m2 gradients;
- `rowwise`: one power-of-two scale per row (CUTLASS's rowwise GEMM), e4m3 throughout;
- `rowwise_with_gw_hp`: rowwise, with the weight-gradient GEMM in bf16.
Everything else stays bf16: embeddings, norms, attention, the output layer, the MoE experts and
the vision tower. The weights stay bf16 parameters with fp32 master copies in the optimizer;
each GEMM casts its operands, and a compiled decoder layer (`compile_model`) fuses the casts
and scale reductions into the neighbouring elementwise work. The operands the backward GEMMs
read transposed (the weight, the input, the output gradient) are cast by a tiled kernel of
our own (`train.model.fp8_cast`) where a tensorwise linear's dims are all aligned (packs
padded to one length), with torchao's scales and casts. Linears whose weight is frozen
(LoRA's base, `--freeze llm`) keep megatron's bf16 path: torchao's backward always computes
the weight gradient.

The linears themselves, and the tensor-parallel communication around their GEMMs, are in
`train.model.linear`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from train.model.settings import FP8_RECIPES as RECIPES
from train.model.settings import ConfigError
from train.model.fp8_cast import cast_rows_and_transposed, cast_transposed
from train.model.grad_buffer import accumulate_float8_weight_grad


INNER_DIM_MULTIPLE = 16  # torch._scaled_mm's FP8 GEMMs need every dim a multiple of 16


@dataclasses.dataclass(frozen=True)
class Float8Gemm:
    """One torchao recipe, ready for its matmul: the linear config and its GEMM configs."""

    config: object  # torchao.float8.Float8LinearConfig
    mm_config: object  # torchao.float8.float8_training_tensor.LinearMMConfig
    transposes_by_tile: bool  # GEMMs through `_TensorwiseFloat8Matmul` (`_transposes_by_tile`)


def _transposes_by_tile(config) -> bool:
    """Whether `_TensorwiseFloat8Matmul` can run a torchao config: every operand is cast with one
    dynamic scale (so a transposed cast carries the row-major one's, both gradient GEMMs read
    one cast of the output gradient, and both of the weight's casts take one scale), and no
    inner dim is padded (torchao's pad copies each operand, whatever its layout)."""
    from torchao.float8.config import ScalingGranularity, ScalingType

    operands = ("input", "weight", "grad_output", "input_for_grad_weight", "weight_for_grad_input",
                "grad_output_for_grad_weight")
    casts = [getattr(config, f"cast_config_{operand}") for operand in operands]
    same_grad_cast = config.cast_config_grad_output == config.cast_config_grad_output_for_grad_weight
    same_weight_cast = config.cast_config_weight == config.cast_config_weight_for_grad_input
    return (not config.pad_inner_dim and same_grad_cast and same_weight_cast
            and all(cast.scaling_type is ScalingType.DYNAMIC
                    and cast.scaling_granularity is ScalingGranularity.TENSORWISE for cast in casts))


def use_amax_rows_first() -> None:
    """Make torchao take a tensorwise amax per row first, then over the rows (idempotent).

    torchao takes it as one reduction over the whole tensor. With the token count dynamic (a
    compiled decoder layer), Inductor splits that reduction into chunks of a symbolic size and
    indexes them with a modulo, which rules out vectorised loads. A reduction over the static
    last dim has no such index and still fuses into the kernel that produces the tensor (the
    8B FP8 step's A/B is in docs/benchmarks.md). A max is exact in any order, so the scales are
    bit-identical to torchao's."""
    from torchao.float8 import float8_utils

    if getattr(float8_utils.tensor_to_amax, "rows_first", False):
        return
    torchao_amax = float8_utils.tensor_to_amax
    tensorwise = float8_utils.ScalingGranularity.TENSORWISE

    @torch.no_grad()
    def tensor_to_amax(x, reduce_amax=False, device_mesh=None, scaling_granularity=tensorwise, axiswise_dim=None):
        if scaling_granularity is tensorwise and x.dim() >= 2:
            x = torch.abs(x).amax(dim=-1)
        return torchao_amax(x, reduce_amax, device_mesh, scaling_granularity, axiswise_dim)

    tensor_to_amax.rows_first = True
    float8_utils.tensor_to_amax = tensor_to_amax


def float8_gemm(recipe: str, emulate: bool = False, pad_inner_dim: bool = True) -> Float8Gemm:
    """torchao's `recipe`; `emulate`: the casts and scaled GEMMs in plain torch ops (CPU runs,
    tests), where the GPU calls `torch._scaled_mm`. `pad_inner_dim`: pad each GEMM's inner dim
    to a multiple of 16, which the FP8 kernels need; the weight-gradient GEMM's is the pack's
    row count. Turn it off only where every inner dim is known aligned (`use_fp8`): the pad is
    a copy of each operand whether or not it adds a row."""
    if recipe not in RECIPES:
        raise ConfigError(f"--fp8 {recipe!r}: choose one of {', '.join(RECIPES)}")
    if not emulate and torch.cuda.get_device_capability() < (8, 9):
        major, minor = torch.cuda.get_device_capability()
        raise ConfigError(f"--fp8 needs FP8 GEMMs (Ada, Hopper or Blackwell GPUs, sm89+); this GPU is sm{major}{minor}: "
                          f"drop --fp8")
    try:
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig
    except ImportError as err:
        raise ConfigError(f"--fp8 needs torchao: pip install -e '.[fp8]' ({err})") from None
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate,
                                 pad_inner_dim=pad_inner_dim)
    use_amax_rows_first()
    gemms = [ScaledMMConfig(emulate, gemm.use_fast_accum, False, pad_inner_dim)
             for gemm in (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)]
    return Float8Gemm(config, LinearMMConfig(*gemms), _transposes_by_tile(config))


def _role(operand: str):
    """torchao's GEMM role of an operand named as in its cast configs (`input_for_grad_weight`: input)."""
    from torchao.float8.float8_training_tensor import GemmInputRole

    return {"input": GemmInputRole.INPUT, "weight": GemmInputRole.WEIGHT,
            "grad_output": GemmInputRole.GRAD_OUTPUT}[operand.split("_for_")[0]]


def _float8(bits: Tensor, scale: Tensor, orig_dtype: torch.dtype, gemm: Float8Gemm, operand: str):
    """torchao's float8 tensor of `bits` in the role of `operand`; torch.mm on two of them runs
    torchao's scaled GEMM with the config of that pair of roles."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    return Float8TrainingTensor(bits, scale, orig_dtype, gemm.mm_config, _role(operand))


def _format(gemm: Float8Gemm, operand: str) -> torch.dtype:
    """The FP8 format torchao casts `operand` to (`cast_config_<operand>`)."""
    return getattr(gemm.config, f"cast_config_{operand}").target_dtype


def _scale(hp: Tensor, gemm: Float8Gemm, operand: str) -> tuple[Tensor, torch.dtype]:
    """torchao's tensorwise scale of `hp` for `operand` (`cast_config_<operand>`), and its format."""
    from torchao.float8.float8_utils import tensor_to_scale

    dtype = _format(gemm, operand)
    return tensor_to_scale(hp, dtype, round_scales_to_power_of_2=gemm.config.round_scales_to_power_of_2), dtype


def _cast_rows(hp: Tensor, gemm: Float8Gemm, operand: str, scale: Tensor | None = None):
    """`hp` cast row-major by torchao (its dynamic tensorwise cast, which Inductor fuses);
    `scale`: its scale, already taken."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8

    if scale is not None:
        return hp_tensor_and_scale_to_float8(hp, scale, _format(gemm, operand), gemm.mm_config, _role(operand))
    return hp_tensor_to_float8_dynamic(hp, _format(gemm, operand),
                                       gemm.mm_config, gemm_input_role=_role(operand),
                                       round_scales_to_power_of_2=gemm.config.round_scales_to_power_of_2)


def _cast_columns(hp: Tensor, gemm: Float8Gemm, operand: str, scale: Tensor | None = None):
    """`hp` [M, N] cast as torchao casts it, as an [M, N] float8 tensor stored column-major;
    `scale`: its scale, already taken."""
    if scale is None:
        scale, _ = _scale(hp, gemm, operand)
    dtype = _format(gemm, operand)
    return _float8(cast_transposed(hp, scale, dtype), scale, hp.dtype, gemm, operand).t()


@torch._dynamo.allow_in_graph
class _TensorwiseFloat8Matmul(torch.autograd.Function):
    """torchao's `matmul_with_hp_or_float8_args` (input [..., in] @ weight [out, in]^T) for a
    recipe with every operand scaled tensorwise (`Float8Gemm.transposes_by_tile`): the same
    scales, casts and scaled GEMMs, bit for bit, but each operand that a backward GEMM reads
    column-major is written so by `train.model.fp8_cast`, the output gradient in both layouts
    from one read. With `grad_buffer`, the weight gradient is added into it (written, where it
    holds zeros: `train.model.grad_buffer`), not returned. With `weight_scale`
    (`weight_scales`), the weight is cast with that scale instead of one taken at each cast."""

    @staticmethod
    def forward(ctx, input: Tensor, weight: Tensor, gemm: Float8Gemm, grad_buffer: Tensor | None,
                holds_zeros: Tensor | None, weight_scale: Tensor | None):
        ctx.save_for_backward(input, weight, grad_buffer, holds_zeros, weight_scale)
        ctx.gemm = gemm
        rows = input.reshape(-1, input.shape[-1])
        output = torch.mm(_cast_rows(rows, gemm, "input"), _cast_rows(weight, gemm, "weight", weight_scale).t())
        return output.reshape(*input.shape[:-1], output.shape[-1])

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        input, weight, grad_buffer, holds_zeros, weight_scale = ctx.saved_tensors
        gemm = ctx.gemm
        grad = grad_output.reshape(-1, grad_output.shape[-1])
        scale, dtype = _scale(grad, gemm, "grad_output")
        # torchao's config gives the two gradient casts one format and scale (`transposes_by_tile`)
        grad_bits, grad_bits_t = cast_rows_and_transposed(grad, scale, dtype)
        grad_input = torch.mm(_float8(grad_bits, scale, grad.dtype, gemm, "grad_output"),
                              _cast_columns(weight, gemm, "weight_for_grad_input", weight_scale))
        rows = input.reshape(-1, input.shape[-1])
        rows_scale, rows_dtype = _scale(rows, gemm, "input_for_grad_weight")
        rows_bits_t = cast_transposed(rows, rows_scale, rows_dtype)
        if grad_buffer is None:
            grad_weight = torch.mm(_float8(grad_bits_t, scale, grad.dtype, gemm, "grad_output_for_grad_weight"),
                                   _float8(rows_bits_t, rows_scale, rows.dtype, gemm, "input_for_grad_weight").t())
        else:
            mm = gemm.mm_config.grad_weight  # torchao's config for this pair of roles
            accumulate_float8_weight_grad(grad_buffer, holds_zeros, grad_bits_t, scale, rows_bits_t.t(), rows_scale,
                                          grad.dtype, mm.use_fast_accum, mm.emulate)
            grad_weight = None
        return grad_input.reshape(input.shape), grad_weight, None, None, None, None


def weight_scales(weights: list[Tensor], gemm: Float8Gemm) -> Tensor:
    """torchao's tensorwise scale of each weight [out, in] for both of its casts under `gemm`
    (`transposes_by_tile`), from one amax launch over all of them: the forward, a recomputed
    forward and the input-gradient GEMM would each take it again, at every micro-batch."""
    from torchao.float8.float8_utils import amax_to_scale

    amaxes = torch.stack(torch._foreach_norm(weights, float("inf")))  # max |w|: exact, as torchao's amax
    return amax_to_scale(amaxes, _format(gemm, "weight"),
                         round_scales_to_power_of_2=gemm.config.round_scales_to_power_of_2)


def float8_matmul(gemm: Float8Gemm, input: Tensor, weight: Tensor, grad_buffer: Tensor | None = None,
                  holds_zeros: Tensor | None = None, weight_scale: Tensor | None = None) -> Tensor:
    """input [..., in] @ weight [out, in]^T with the three GEMMs in float8 (torchao's recipe).
    `grad_buffer`: the weight's gradient buffer (`train.model.linear.use_grad_buffers`), and its
    `holds_zeros` flag (`train.model.grad_buffer`), into which a tensorwise recipe's backward
    adds the weight gradient instead of returning it. `weight_scale`: the weight's scale,
    already taken (`weight_scales`), for a tensorwise recipe."""
    if gemm.transposes_by_tile:
        return _TensorwiseFloat8Matmul.apply(input, weight, gemm, grad_buffer, holds_zeros, weight_scale)
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    return matmul_with_hp_or_float8_args.apply(input, weight.t(), gemm.mm_config, gemm.config)
