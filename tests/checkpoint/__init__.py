"""Tests of ``jaxamp/checkpoint/``: orbax round trips, what a checkpoint lacks, restored states."""
