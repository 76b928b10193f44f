"""``jaxamp.find_overflow``: the evaluator that finds the first non-finite op, and its report."""
