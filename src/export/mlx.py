"""MLX: an mlx-lm model directory, made by mlx-lm's own converter (`mlx_lm.convert`) from the merged
model, optionally quantized by it (q4, q8: mlx-lm's affine quantization, groups of 64).

The merged directory is first brought to what mlx-lm reads (backends/mlx/families.py: the config
keys transformers 5 moved, gpt-oss's expert tensors), so `mlx_lm.load` of the export computes what
the MLX backend computes; a family the installed mlx-lm lacks is refused by name (`check_family`)."""

from __future__ import annotations

import contextlib
import io
import json
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


def require_mlx_lm():
    try:
        from mlx_lm import convert
    except ImportError as exc:
        raise MudpuppyError(f"--format mlx needs mlx-lm, which is not importable here ({exc}); "
                            "install it with: pip install 'mudpuppy[mlx]'") from exc
    return convert


def check_family(config: dict, where: str) -> None:
    """Refuse, before anything loads, a model family mlx-lm lacks or computes differently (exit 2)."""
    require_mlx_lm()
    from ..backends.mlx.families import check_family as check

    check(config, where)


def convert_to_mlx(model_dir: Path, out_dir: Path, dtype: str, quant: str | None) -> dict:
    """mlx_lm.convert of `model_dir` (a scratch merge: rewritten in place for mlx-lm first) into
    `out_dir` (which must not exist yet)."""
    convert = require_mlx_lm()
    from ..backends.mlx.families import prepare_directory

    notes = prepare_directory(Path(model_dir))
    bits = QUANTS[quant] if quant else None
    log = io.StringIO()
    with contextlib.redirect_stdout(log):     # its "[INFO] ..." lines; ours say what happened
        convert(str(model_dir), mlx_path=str(out_dir), quantize=bits is not None, q_bits=bits,
                q_group_size=GROUP_SIZE if bits else None, dtype=DTYPES[dtype])
    config_path = Path(out_dir) / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    # mlx-lm copies the merge's config: the dtype the weights are stored in, and a KV cache for whoever loads it.
    config.update({"dtype": DTYPES[dtype], "use_cache": True})
    config.pop("torch_dtype", None)
    config_path.write_text(json.dumps(config, indent=4) + "\n", encoding="utf-8")
    quantization = config.get("quantization")
    record = {"dtype": DTYPES[dtype], "quantization": quantization,
              "bytes": sum(f.stat().st_size for f in Path(out_dir).glob("*.safetensors"))}
    if notes:
        record["notes"] = notes
    return record
