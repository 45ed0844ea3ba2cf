"""What the model code shares with the run's settings (`train.config`) without importing them:
the error a setting that cannot work raises, and the choices of settings the model code
implements. Imports nothing but shards_schema, so `vlmpack train --help` stays light."""

from __future__ import annotations

from shards_schema.errors import UserError

FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's float8 recipes (train.model.fp8)
ATTENTION_KERNELS = ("auto", "fa2", "fa4")  # train.model.attention.select_attention_kernel
LOSS_PATHS = ("chunked", "fused")  # train.model.loss


class ConfigError(UserError, ValueError):
    """A setting that cannot work with this model, data or cluster; the message names the fix."""
