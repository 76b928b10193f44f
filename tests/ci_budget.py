"""The tests `make test` leaves to `make test-slow`, for CI's budget, and why.

`make test` must finish in 15 minutes and 25 CPU-minutes on 2 cores. These tests
cost the most (`pytest --durations`) and each has a cheaper test in `make test`
that holds its claim's core: the other side of the same path, a smaller model of
the same library, the same API on another structure. tests/conftest.py marks each
`slow` (`make test-slow` runs them, on 8 devices where they need them; `make
matrix` and `make conformance` hold the matrix and the third-party models whole)
and fails the run if an entry names no test, so the list cannot go stale.

Keyed by test file, then by test function or one parametrization of it (a pytest
node id's two parts); each value says what still covers the claim in `make test`.
"""

from __future__ import annotations

LEFT_OUT: dict[str, dict[str, str]] = {
    # ---- the differential matrix: CI keeps issue 30's named-bug cells, every
    # composition and every dtype; these cells are there to reach every value of
    # every axis, which `make matrix` does in full.
    "tests/matrix/test_matrix.py": {
        "test_cell[flax_opt-sr-auto_rep-none]": "make matrix",
        "test_cell[flax_opt-kahan-explicit_rep-lora]": "make matrix",
        "test_cell[update-kahan-shard_map_stacked-bn]": "make matrix",
        "test_cell[step-spikes-auto_shard-dropout]": "make matrix",
        "test_cell[nnx-multi-shard_map-bn]": "make matrix",
        "test_cell[nnx_flaxgrad-spikes-explicit_shard-teacher]": "make matrix",
        "test_cell[train_state-every_k-pmap-lora]": "make matrix",
        "test_composition[update-guard_stored_8bit-one-none]": (
            "the same structure in bfloat16 (guard_stored_bf16); 8-bit moments kept bit "
            "for bit on a skip on every path: tests/low_precision_state/"
            "test_transformation_skipped.py"
        ),
    },
    # ---- real multi-process runs: CI keeps two processes skipping together, a
    # dying process failing the launch, and the in-process checks.
    "tests/multiprocess/test_multiprocess.py": {
        "test_four_processes_skip_together": "two processes skip together",
        "test_restore_into_another_process_count_and_continue": (
            "tests/multidevice/test_resume.py restores onto another device count"
        ),
        "test_a_hung_process_times_out_and_everything_is_killed": (
            "a process that dies fails the launch"
        ),
        "test_restore_onto_a_mesh_that_does_not_divide_fails_clearly": (
            "tests/checkpoint's restore errors"
        ),
        "test_the_multiprocess_example_runs": "two processes skip together, on the same launcher",
    },
    # ---- third-party models: CI keeps BERT and equinox's BatchNorm CNN in the
    # conformance rows and the nnx LM on a mesh.
    "tests/casting/test_find_overflow.py": {
        "test_hf_bert_activation_overflow": (
            "the BERT conformance row; find_overflow's program-level tests"
        ),
        "test_hf_bert_loss_scale_too_large": "test_loss_scale_too_large",
        "test_flax_linen_transformer_healthy": "find_overflow's own healthy-model tests",
    },
    "tests/repo/test_docs_recipes.py": {
        "test_routes_huggingface_model_trains_under_autocast_and_evaluates_in_it": (
            "the BERT conformance row"
        ),
    },
    # ---- checkpoints of stored moments: CI keeps the same restore and conversion
    # through a CheckpointManager.
    "tests/checkpoint/test_stored_blocks.py": {
        (
            "test_another_block_size_is_named_and_convert_state_moves_the_restored_state"
            "[checkpointer]"
        ): "the same test through a CheckpointManager ([manager])",
    },
    "tests/repo/test_fp8_clients.py": {
        # benchmarks/fp8_clients.py on a stand-in for flax's lm1b models.py: the corpus,
        # an FP8 train step's compile (~6 s), and every row with fp8_select (~30 s).
        "test_a_client_loaded_by_path_trains_in_fp8_with_its_products_counted": (
            "the FP8 conformance rows' tests (tests/conformance/test_fp8_rows.py) and "
            "the flag's error test in this file"
        ),
        "test_every_row_runs_and_is_judged_against_bfloat16_autocast": (
            "fp8_select's own tests; the train test above in make test-slow"
        ),
    },
    "tests/repo/test_fp8_client_gemma.py": {
        # fp8_client_gemma on a stand-in for flax's examples/gemma: an FP8 train step's
        # compile (~7 s) and every row with fp8_select (~35 s), as the lm1b ones above.
        "test_the_nnx_client_trains_in_fp8_with_its_products_counted": (
            "the FP8 conformance rows' tests (their nnx LM) and this file's loading tests"
        ),
        "test_every_row_of_the_nnx_client_runs_with_its_layers_named": (
            "tests/casting/test_fp8_layers.py's nnx module merged inside the function; "
            "the train test above in make test-slow"
        ),
    },
    "tests/repo/test_fp8_client_clm.py": {
        # benchmarks/fp8_client_clm.py on a 1-layer GPT-2: an FP8 train step's compile
        # and every row with both fp8_select calibrations, as the lm1b ones above.
        "test_gpt2_trains_in_fp8_through_fp8_clients_train": (
            "the hf-gpt2 FP8 conformance rows (tests/conformance/test_fp8_rows.py) and "
            "this file's tests of the recipe (loss, decay mask, schedule) and the CLI's errors"
        ),
        "test_every_row_with_other_batches_runs_and_is_judged_against_bfloat16": (
            "fp8_select's other_batches tests (tests/casting/test_fp8_select.py); the "
            "train test above in make test-slow"
        ),
    },
    "tests/multidevice/test_conformance_mesh.py": {
        "test_conformance_explicit_mesh[flax-nnx-attention@data-float16]": (
            "the same model on the tensor axis in bfloat16"
        ),
    },
    # ---- examples and docs: CI keeps the demo, the quick start, the README and
    # each page's own blocks; these run an example's longer claims.
    "tests/repo/test_examples.py": {
        "test_nnx_example_claims": "the matrix's nnx cells",
        "test_bf16_params_example_claims": "tests/test_low_precision_params.py",
        "test_data_parallel_matches_single_device_plain_optax": (
            "tests/multidevice/test_data_parallel.py"
        ),
        "test_small_example_runs[flax_train_state]": "the matrix's train_state cells",
        "test_small_example_runs[module_rules]": "tests/casting's module-rule tests",
        "test_small_example_runs[checkpointing]": "tests/checkpoint's round trips",
        "test_clipping_equals_plain_clip_then_adam[unscaled_grads]": "its grad_clipping twin",
        "test_accumulation_inf_costs_exactly_one_window": (
            "tests/skip/test_every_k.py's windows against PyTorch's loop"
        ),
    },
    # ---- one path's second model or second configuration.
    "tests/casting/test_autocast_program.py": {
        "test_fully_masked_padding_rows_stay_finite[bf16]": "the float16 case",
    },
    "tests/casting/test_wrapper.py": {
        "test_linen_lifted_transform_inside_apply[jit]": "the remat and scan cases",
    },
    "tests/casting/test_fp8_health.py": {
        "test_products_in_a_while_body_are_named_unmeasured": (
            "test_fp8_health_loops.py's scan and remat in a while body, named unmeasured"
        ),
    },
    "tests/casting/test_fp8_health_loops.py": {
        "test_remat_and_nested_jit_are_measured_as_inline_products[checkpoint_policy]": (
            "the checkpoint case (a policy decides what is saved, not what is measured)"
        ),
    },
    "tests/casting/test_autocast_isolation.py": {
        "test_log_softmax_same_answer_whether_or_not_traced_before": (
            "test_log_softmax_in_process_equals_fresh_process"
        ),
    },
    "tests/low_precision_state/test_transformation.py": {
        "test_jit_and_no_jit_agree[8bit]": (
            "the bfloat16 case (the same transformation run op by op); the 8-bit code "
            "under jit in every other test"
        ),
    },
    "tests/checkpoint/test_nnx_record.py": {
        "test_a_0_3_lora_checkpoint_resumes_as_0_3_ran_it": (
            "the other 0.3 checkpoint tests of test_nnx_record.py"
        ),
    },
    "tests/behaviour/test_state_paths.py": {
        "test_orbax_round_trip_into_another_configuration": (
            "the matrix's restores into another configuration"
        ),
    },
    "tests/multidevice/test_resume.py": {
        "test_resume_in_a_fresh_process_on_8_and_on_4_devices": (
            "the matrix's orbax restores on 8 devices"
        ),
    },
    "tests/utils/test_optional.py": {
        "test_import_the_optax_path_step_and_autocast_run_without_flax": (
            "make test's wheel-smoke runs the wheel without flax"
        ),
    },
}
