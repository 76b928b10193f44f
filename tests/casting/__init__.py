"""Tests of ``jaxamp/casting/``: autocast (rules, interpreter, wrapper), policies, find_overflow."""
