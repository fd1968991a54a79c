"""Shared test helpers: tiny models and tokenizers built from configs, a background server, W&B log reading."""
