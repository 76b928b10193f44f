"""Tests of ``jaxamp/loss_scale/``: the state and its rule."""
