"""Generation on torch: seeded sampling, streaming, and continuous batching for `serve`."""
