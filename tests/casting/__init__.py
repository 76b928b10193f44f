"""Tests of ``jaxamp/casting/``: one file per module, whichever room holds it."""
