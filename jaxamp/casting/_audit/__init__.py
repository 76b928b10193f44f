"""``jaxamp.audit``: the per-op dtype view of an autocast program and its compiled HLO."""
