"""Running the model: the paged KV cache, attention backends, the model runner and the compiled forward."""
