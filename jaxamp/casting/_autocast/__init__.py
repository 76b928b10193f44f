"""``jaxamp.autocast``: its arguments checked, the user's function or object traced, interpreted."""
