"""PyTorch backends: one shared implementation, one small module per device kind."""
