"""Export a run, an adapter or a model for deployment (docs/export.md).

    merged   plain safetensors at bf16, fp16 or fp32, the adapter folded in
    gguf     one llama.cpp file written with the gguf package (no llama.cpp build)
    ollama   the GGUF beside a Modelfile whose template and stop tokens are the training template's
    mlx      an mlx-lm model directory, through mlx-lm's own converter
    peft     the adapter (PEFT's and mlx-lm's layouts), with the base it trained on where LoftQ's iterations
             changed it (base/)

    from mudpuppy.export import ExportRequest, export_model
    export_model(ExportRequest("outputs/quickstart", "gguf", "exports/qs-gguf", quant="q8_0"))
"""

from .pipeline import FORMATS, ExportRequest, ExportResult, export_model
from .source import register_dequantizer

__all__ = ["FORMATS", "ExportRequest", "ExportResult", "export_model", "register_dequantizer"]
