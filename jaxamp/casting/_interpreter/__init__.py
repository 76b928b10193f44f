"""The autocast jaxpr interpreter: its trace context, casts, analysis, handlers and decision log."""
