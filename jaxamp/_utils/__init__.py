"""Helpers every subpackage shares: pytree plumbing and the JAX internals jaxamp relies on."""
