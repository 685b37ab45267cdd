"""Records to token arrays and loss masks. numpy only: no torch, no mlx.

    readers    files and hub datasets -> records tagged with file and line
    formats    format detection, field mapping, validation, METHOD_FORMATS
    templates  chat templates: the tokenizer's, built-in ones, the user's
    render     records -> text with the character spans that carry loss
    tokenize   text + spans -> token ids and loss masks, per format
    images     image content parts: accepted shapes, files beside the data, Pillow
    vision     vision-language chat: the processor's template and image-token expansion
    examples   the tokenized example types
    packing    which examples share a packed row
    batch      examples -> one padded or packed numpy batch
    batching   the deterministic, resumable batch order (Batcher)
    cache      tokenized data on disk, keyed by data + tokenizer + settings
    prepare    config -> PreparedData (the entry point pipelines call); the tokenizer alone
    report     statistics and marked samples for `mudpuppy preprocess`
"""

from .batch import IGNORE_INDEX, Batch, collate, collate_packed
from .batching import Batcher, fixed_batches
from .examples import Example, LabeledExample, PairExample, PromptExample, StepExample
from .formats import FORMATS, METHOD_FORMATS, check_method_format
from .packing import pack_sequences
from .prepare import DataReport, LoadedData, PreparedData, load_data, load_tokenizer, prepare_data, prepare_sft_data
from .templates import BUILTIN_TEMPLATES
from .tokenize import generation_prompt

__all__ = [
    "IGNORE_INDEX", "Batch", "Batcher", "collate", "collate_packed", "fixed_batches",
    "Example", "PairExample", "LabeledExample", "StepExample", "PromptExample",
    "FORMATS", "METHOD_FORMATS", "check_method_format", "pack_sequences",
    "DataReport", "LoadedData", "PreparedData", "load_data", "load_tokenizer", "prepare_data", "prepare_sft_data",
    "BUILTIN_TEMPLATES", "generation_prompt",
]
