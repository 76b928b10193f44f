"""Logging ``jaxamp.metrics`` to a CSV (or TensorBoard, or wandb) with no host sync per step.

The train step returns the loss and ``jaxamp.metrics(opt_state)`` as device arrays.
The loop keeps each step's metrics in a list (a reference to arrays still on the
device, or still being computed: nothing waits) and every ``LOG_EVERY`` steps stacks
the window on the device. It fetches the window with one ``jax.device_get`` only after
dispatching the next window's first step, so the device runs that step while Python
writes the rows (the fetch waits for the window's last step and its stacking, queued
before it). The host waits once per window, not once per step; the last window may be
shorter and is logged after the loop. ``jaxamp.check_health`` runs after the rows are
logged, on the loss-scale state of the window's last step, which the fetch has already
waited for.

The loop runs under ``jax.transfer_guard("disallow")``: on a GPU or TPU a
``float(loss)`` or a ``print(m["loss_scale"])`` slipped into it raises instead of syncing
every step (on a CPU JAX guards only host-to-device transfers, such as a Python step
index passed to the step each iteration: the counter stays on the device here). The one
transfer per window is allowed explicitly, where the logging happens.

The logger is the only part that depends on where the numbers go:

    log = csv_logger(path)                                # a CSV file (this example)
    log = tensorboard_logger(SummaryWriter(logdir))       # TensorBoard (tensorboardX or torch)
    log = lambda step, row: wandb.log(row, step=step)     # wandb, after wandb.init(...)

Run it with ``python examples/log_metrics.py [out.csv]``; ``tests/repo/test_docs_recipes.py``
checks that the CSV's rows are the metrics each step returned.
"""

from __future__ import annotations

import csv
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

import jaxamp

LOG_EVERY = 10
BAD_STEP = 25  # this step's batch holds an inf: the CSV shows the skip and the backoff
model = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(1)])

Logger = Callable[[int, dict[str, float]], None]


def csv_logger(path: str) -> tuple[Logger, Callable[[], None]]:
    """A logger writing one row per step, and the function that closes the file."""
    f = open(path, "w", newline="")
    writer: csv.DictWriter | None = None

    def log(step: int, row: dict[str, float]) -> None:
        nonlocal writer
        if writer is None:
            writer = csv.DictWriter(f, fieldnames=["step", *row])
            writer.writeheader()
        writer.writerow({"step": step, **row})  # repr of each float: read back exactly

    return log, f.close


def tensorboard_logger(summary_writer: Any) -> Logger:
    """TensorBoard through a ``SummaryWriter`` (``tensorboardX`` or ``torch.utils.tensorboard``)."""
    return lambda step, row: [summary_writer.add_scalar(k, v, step) for k, v in row.items()]


def make_train_step(tx: optax.GradientTransformation, x: jax.Array, y: jax.Array):
    loss_fn = jaxamp.autocast(
        lambda p, x, y: jnp.mean((model.apply(p, x) - y) ** 2), dtype=jnp.float16
    )

    @jax.jit
    def train_step(params, opt_state, step):
        # The batch of this step, made on the device (the step counter lives there too).
        batch_x = jnp.where(step == BAD_STEP, x.at[0, 0].set(jnp.inf), x)
        loss, grads = jaxamp.value_and_grad(loss_fn)(opt_state, params, batch_x, y)
        params, opt_state = jaxamp.step(tx, grads, opt_state, params)
        metrics = {"loss": loss, **jaxamp.metrics(opt_state)}
        return params, opt_state, step + 1, metrics

    return train_step


# One dispatch that turns a window of per-step dicts into one dict of stacked arrays.
stack_window = jax.jit(lambda window: jax.tree.map(lambda *xs: jnp.stack(xs), *window))


def log_window(log: Logger, first_step: int, stacked: dict[str, jax.Array], scale: Any) -> None:
    """Fetches a stacked window with one device-to-host transfer, logs each step, then
    checks the health of the loss scale of the window's last step."""
    with jax.transfer_guard("allow"):  # the one transfer of the window
        host = jax.device_get(stacked)
        for i in range(len(host["loss"])):
            log(first_step + i, {k: v[i].item() for k, v in host.items()})
        jaxamp.check_health(scale)  # after the rows: raises if training stopped recovering


def setup() -> tuple[Any, Any, Any, jax.Array]:
    """The jitted train step, the params, the optimizer state and the step counter."""
    x = jax.random.normal(jax.random.key(0), (128, 8))
    y = jnp.sin(x.sum(axis=1, keepdims=True))
    params = model.init(jax.random.key(1), x)
    # A short growth interval, so that the scale visibly moves in a short run.
    tx = jaxamp.skip_nonfinite(optax.adam(1e-2), jaxamp.dynamic_scale(growth_interval=20))
    return make_train_step(tx, x, y), params, tx.init(params), jnp.zeros((), jnp.int32)


def train(steps: int, log: Logger, log_every: int = LOG_EVERY) -> Any:
    """Trains ``steps`` steps, logging every step's metrics in windows of ``log_every``."""
    train_step, params, opt_state, step = setup()
    window: list[dict[str, jax.Array]] = []
    pending = None  # the last window, stacked on the device, not fetched yet
    with jax.transfer_guard("disallow"):  # no host transfer in the loop but log_window's
        for i in range(steps):
            params, opt_state, step, metrics = train_step(params, opt_state, step)
            if pending is not None:  # this step is queued: now wait for the last window
                log_window(log, *pending)
                pending = None
            window.append(metrics)
            if len(window) == log_every or i == steps - 1:
                first = i + 1 - len(window)
                pending = (first, stack_window(window), jaxamp.get_loss_scale(opt_state))
                window = []
        if pending is not None:
            log_window(log, *pending)
    return params, opt_state


def main(path: str = "metrics.csv", steps: int = 60) -> None:
    log, close = csv_logger(path)
    try:
        train(steps, log)
    finally:
        close()
    with open(path) as f:
        rows = list(csv.DictReader(f))
    for row in rows[BAD_STEP - 1 : BAD_STEP + 2] + rows[-1:]:
        print(
            f"step {row['step']:>3}  loss {float(row['loss']):.4f}  "
            f"loss scale {float(row['loss_scale']):g}  skipped {row['skipped']}"
        )
    print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
