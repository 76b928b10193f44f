"""What dtype each op takes: the op table and ``choose``, primitive kinds, scopes, policies."""
