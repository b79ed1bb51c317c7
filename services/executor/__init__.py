"""The executor: a Llama-family engine with continuous batching over a paged KV cache."""
