"""embedding_cache package."""
