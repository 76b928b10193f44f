"""``tx.update`` called by Flax's own optimizers, which cannot keep what a skipped step wrote.

Flax's ``TrainState.apply_gradients`` writes the fields it is given (``batch_stats=``,
fp8 metadata) after ``tx.update`` returns, and Flax's ``nnx.Optimizer`` hands the
``tx`` the params alone: on a step jaxamp skips, a non-finite batch's model state
would stay. The caller's frames say which called: only once the program has
imported that part of Flax can it be one, so nothing here imports Flax.
"""

from __future__ import annotations

from types import FrameType

from jaxamp._utils.conversion_checks import warn_flax_train_state
from jaxamp._utils.optional import loaded

# optax.chain, MultiSteps, inject_hyperparams and multi_transform each add a frame or two.
_FRAMES_UP = 12


def check_flax_callers(frame: FrameType | None) -> None:
    """Raises if this ``tx.update`` runs inside Flax's ``nnx.Optimizer.update`` for a
    model that holds state a forward can write; warns if it runs inside Flax's own
    ``TrainState.apply_gradients`` that will also write model state on a skipped step.

    ``frame`` is the caller's; Flax may call this ``tx`` through wrappers
    (``optax.chain``, ``MultiSteps``), so a few frames up are looked at. Only Flax's
    own ``apply_gradients`` is recognised (its code object), so a subclass that
    overrides it (``jaxamp.TrainState``, or the user's own with
    ``jaxamp.where_stepped``) is never warned about; ``jaxamp.nnx.Optimizer`` never
    comes here: it runs the guarded step directly and takes no wrapped ``tx``.
    """
    nnx, train_state = loaded("flax.nnx"), loaded("flax.training.train_state")
    optimizer = None if nnx is None else nnx.Optimizer
    code = None if train_state is None else train_state.TrainState.apply_gradients.__code__
    for _ in range(_FRAMES_UP):
        if frame is None or (optimizer is None and code is None):
            return
        if frame.f_code is code:
            warn_flax_train_state(frame.f_locals)
            code = None
        caller = frame.f_locals.get("self")
        if optimizer is not None and isinstance(caller, optimizer):
            from jaxamp.skip._nnx_state import refuse_written_state  # flax.nnx is loaded

            # Flax names it `model`; a subclass's own update may call it anything.
            for model in [v for v in frame.f_locals.values() if isinstance(v, nnx.Module)]:
                if model is not caller:
                    refuse_written_state(model)
            optimizer = None
        frame = frame.f_back
