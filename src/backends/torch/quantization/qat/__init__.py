"""Quantization-aware training on torch: the layers, the converted model's files, the method."""
