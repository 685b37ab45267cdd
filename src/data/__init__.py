"""Records to token arrays and loss masks. numpy only: no torch, no mlx."""

from .batching import IGNORE_INDEX, Batch, Batcher, collate, fixed_batches
from .prepare import DataReport, PreparedData, prepare_sft_data
from .tokenize import Example, generation_prompt

__all__ = [
    "IGNORE_INDEX", "Batch", "Batcher", "collate", "fixed_batches",
    "DataReport", "PreparedData", "prepare_sft_data", "Example", "generation_prompt",
]
