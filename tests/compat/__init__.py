"""Tests of ``jaxamp/compat/``: the constructors of other frameworks' loss scalers."""
