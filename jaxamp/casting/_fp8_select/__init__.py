"""Choosing which modules run FP8, by measuring autocast's gradients: ``jaxamp.fp8_select``."""
