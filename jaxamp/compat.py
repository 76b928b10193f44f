"""Constructors that reproduce other frameworks' loss scalers, with their names and defaults.

Each returns a [`jaxamp.LossScaleState`][jaxamp.LossScaleState] whose
[`jaxamp.update`][jaxamp.update] follows the original's rule step for step, and validates its
arguments as the original does (raising ``ValueError`` where the original asserts). An argument of
the wrong type (a string, a bool for a number, ``None`` where the original takes none) raises
``TypeError`` naming it at once. Systems: PyTorch, Paddle, MegEngine, MindSpore, DeepSpeed,
Megatron-LM, NVIDIA Apex, Flax, jmp, Keras 3. Where an original has no floor or ceiling, the scale
still stays in ``[2**-126, 2**126]`` (see each docstring).

The constructors live in private modules (``_compat_frameworks``,
``_compat_large_scale``) over one table of each system's names and fixed
settings (``_compat_table``); this module is their public namespace.
"""

from jaxamp.loss_scale._compat_frameworks import (
    flax_dynamic_scale,
    jmp_dynamic_loss_scale,
    keras_loss_scale_optimizer,
    megengine_grad_scaler,
    mindspore_dynamic,
    mindspore_fixed,
    paddle_grad_scaler,
    torch_grad_scaler,
)
from jaxamp.loss_scale._compat_large_scale import (
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
