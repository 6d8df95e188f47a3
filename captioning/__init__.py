"""captioning package."""
