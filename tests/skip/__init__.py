"""Tests of ``jaxamp/skip/``: one file per module (``test_guard.py`` for ``_guard.py``, ...)."""
