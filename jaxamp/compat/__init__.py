"""Constructors that reproduce other frameworks' loss scalers, with their names and defaults."""

from jaxamp.compat._frameworks import (
    flax_dynamic_scale,
    jmp_dynamic_loss_scale,
    keras_loss_scale_optimizer,
    megengine_grad_scaler,
    mindspore_dynamic,
    mindspore_fixed,
    paddle_grad_scaler,
    torch_grad_scaler,
)
from jaxamp.compat._large_scale import (
    apex_loss_scaler,
    deepspeed_fp16_config,
    deepspeed_loss_scaler,
    megatron_grad_scaler,
)

__all__ = [
    "apex_loss_scaler",
    "deepspeed_fp16_config",
    "deepspeed_loss_scaler",
    "flax_dynamic_scale",
    "jmp_dynamic_loss_scale",
    "keras_loss_scale_optimizer",
    "megatron_grad_scaler",
    "megengine_grad_scaler",
    "mindspore_dynamic",
    "mindspore_fixed",
    "paddle_grad_scaler",
    "torch_grad_scaler",
]
