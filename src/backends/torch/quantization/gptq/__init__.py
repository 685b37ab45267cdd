"""GPTQ on torch: the sweep of one matrix, the walk over layers, the format, its files, the method."""
