"""benchmarks/fp8_client_clm.py: run_clm_flax's recipe (its loss, decay mask, schedule)
against references written here from the script's description, the CLI's argument
errors, and transformers' Flax GPT-2 trained in FP8 through fp8_clients' rows (its
ClientTask with the script's loss and optimizer hooks)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import fp8_client_clm  # noqa: E402
import fp8_clients  # noqa: E402

import jaxamp  # noqa: E402
from tests.conformance import fp8  # noqa: E402

# A GPT-2 small enough to compile in seconds: the rows, not the model, are under test.
TINY = {**fp8_client_clm.CONFIG, "n_embd": 32, "n_layer": 1, "n_head": 2}


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--noise-seeds", "-1"], ["--lr", "0"]])
def test_a_bad_count_names_the_flag_and_what_to_give(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit):
        fp8_client_clm.main(argv)
    err = capsys.readouterr().err
    assert f"{argv[0]} {argv[1]}:" in err and "give" in err


def test_the_loss_is_next_token_cross_entropy_of_the_shifted_logits() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 9, 256)) * 4
    ids = rng.integers(0, 256, (3, 9))
    # float64 reference: position t's logits against token t + 1, mean over 3 x 8.
    z = logits[:, :-1]
    zmax = z.max(-1, keepdims=True)
    logz = np.log(np.exp(z - zmax).sum(-1)) + zmax[..., 0]
    picked = np.take_along_axis(z, ids[:, 1:, None], -1)[..., 0]
    want = np.mean(logz - picked)
    got = fp8_client_clm.clm_loss(jnp.asarray(logits, jnp.float32), {"labels": jnp.asarray(ids)})
    # float32 logits (rounding 2**-24 relative) through a 256-way logsumexp.
    assert got.dtype == jnp.float32 and abs(float(got) - want) <= 1e-5 * abs(want)


def test_decay_mask_spares_biases_and_layer_norm_scales_only() -> None:
    leaf = jnp.zeros(())
    block = {
        "attn": {"c_attn": {"kernel": leaf, "bias": leaf}},
        "ln_1": {"scale": leaf, "bias": leaf},
        "ln_2": {"scale": leaf, "bias": leaf},
    }
    tree = {"transformer": {"h": {"0": block}, "ln_f": {"scale": leaf, "bias": leaf},
                            "wte": {"embedding": leaf}, "norm": {"scale": leaf}}}  # fmt: skip
    flat = {
        "/".join(str(getattr(k, "key", k)) for k in path): v
        for path, v in jax.tree_util.tree_leaves_with_path(fp8_client_clm.decay_mask(tree))
    }
    decayed = {name for name, v in flat.items() if v}
    # Only GPT-2's own LayerNorm names are spared: another module's scale decays.
    want = {"transformer/h/0/attn/c_attn/kernel", "transformer/wte/embedding",
            "transformer/norm/scale"}  # fmt: skip
    assert decayed == want and len(flat) == 10


def test_schedule_warms_up_then_decays_linearly_to_zero() -> None:
    lr = fp8_client_clm.linear_schedule(1.0, 200)
    ramp = 10  # 5 % of 200
    got = np.asarray(lr(jnp.arange(201)), np.float64)
    want = np.concatenate([np.arange(ramp) / ramp, 1 - np.arange(191) / 190])
    np.testing.assert_allclose(got, want, atol=1e-6)  # float32 steps, values <= 1


def test_gpt2_trains_in_fp8_through_fp8_clients_train() -> None:
    task = fp8_client_clm.ClmTask(TINY)
    built = task.built
    # The loss fp8_clients trains and judges by is the script's (ClientTask.client_loss),
    # not the lm1b example's weighted cross entropy: the same computation, bit for bit.
    window = task.batch(0)
    batch = fp8_client_clm.clm_batch(window)
    want = fp8_client_clm.clm_loss(built.apply(built.params, {}, batch)[0], batch)
    assert built.loss is fp8_client_clm.clm_loss
    assert float(task.loss(built.params, window)) == float(want)
    init = task.final_loss(built.params, jnp.float32)
    apply = jaxamp.autocast(built.apply, dtype=jnp.bfloat16, fp8=jaxamp.fp8("tensorwise"))
    # 1 layer: c_attn is the first product, the tied lm_head the last; c_proj, c_fc
    # and the MLP's c_proj take FP8 (attention's 2 batched products stay bfloat16).
    assert fp8._products(apply, built)["fp8"] == 3
    run = fp8_clients.train(task, apply, 2)
    assert run["skipped"] == 0 and math.isfinite(run["final"])
    assert run["final"] < init  # the warmup's one step at the peak learning rate trained it


def test_every_row_with_other_batches_runs_and_is_judged_against_bfloat16() -> None:
    task = fp8_client_clm.ClmTask(TINY)
    result = fp8_clients.run(task, steps=2, noise_seeds=1, log=lambda _: None)
    names = [r["row"] for r in result["rows"]]
    chosen = [f"fp8 {s}, fp8_select (budget 0.05)" for s in fp8.SCALINGS]
    others = [f"fp8 {s}, fp8_select (budget 0.05, 2 other batches)" for s in fp8.SCALINGS]
    assert names[:4] == ["float32", "bfloat16 autocast", "fp8 tensorwise", "fp8 rowwise"]
    assert names[4:] == chosen + others
    bf16 = result["rows"][1]["final"]
    assert all(r["ratio_bf16"] == r["final"] / bf16 and r["skipped"] == 0 for r in result["rows"])
    # Without other batches no noise is measured; with them a positive one.
    assert all(r["selection"]["noise"] == 0 for r in result["rows"][4:6])
    assert all(r["selection"]["noise"] > 0 for r in result["rows"][6:])
    assert (
        result["config"]["n_positions"] == task.seq
        and result["optimizer"] == task.optimizer_info
        and result["optimizer"]["peak_lr"] == fp8_client_clm.LR == 1e-3
    )
    assert "common" in fp8_client_clm.selections(result).splitlines()[-1]
    table = fp8_clients.format_table(result).splitlines()
    assert [line.split(" | ")[0] for line in table[2:10]] == [f"| {n}" for n in names]
    json.dumps(result, default=float)  # what --out writes
