"""Quantization on torch: the seed's kernels, 4-bit formats, QLoRA's Linear4bit, GPTQ and QAT."""
