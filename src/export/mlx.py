"""MLX: an mlx-lm model directory, made by mlx-lm's own converter (`mlx_lm.convert`) from the merged
model, optionally quantized by it (q4, q8: mlx-lm's affine quantization, groups of 64).

What to write is decided here; mlx-lm runs in the MLX backend (backends/mlx/convert.py), which first
brings the merged directory to what mlx-lm reads and refuses a family the installed mlx-lm lacks."""

from __future__ import annotations

from pathlib import Path

from ..errors import MudpuppyError

QUANTS = {"q4": 4, "q8": 8}
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
GROUP_SIZE = 64


def check_quant(quant: str | None) -> str | None:
    if quant is None:
        return None
    q = quant.lower()
    if q not in QUANTS:
        raise MudpuppyError(f"--quant {quant}: MLX export quantizes to {', '.join(QUANTS)} "
                            "(mlx-lm's affine quantization), or leave --quant out")
    return q


def check_family(config: dict, where: str) -> None:
    """Refuse, before anything loads, a model family mlx-lm lacks or computes differently (exit 2)."""
    from ..backends.mlx.convert import check_family as check

    check(config, where)


def convert_to_mlx(model_dir: Path, out_dir: Path, dtype: str, quant: str | None) -> dict:
    """mlx_lm.convert of `model_dir` (a scratch merge) into `out_dir`, through the MLX backend's converter."""
    from ..backends.mlx.convert import convert_to_mlx as convert

    return convert(Path(model_dir), Path(out_dir), DTYPES[dtype], QUANTS[quant] if quant else None, GROUP_SIZE)
