"""Tests of ``jaxamp/_utils/``: one file per module."""
