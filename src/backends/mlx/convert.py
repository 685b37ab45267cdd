"""mlx-lm's converter, for `mudpuppy export --format mlx` (export/mlx.py decides what to write, this module
runs mlx-lm on it): a merged model directory to an mlx-lm model directory, optionally quantized by mlx-lm's
affine quantization.

The merged directory is first brought to what mlx-lm reads (families.py: the config keys transformers 5
moved, gpt-oss's expert tensors), so `mlx_lm.load` of the export computes what the MLX backend computes; a
family the installed mlx-lm lacks is refused by name (`check_family`)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

from ...errors import MudpuppyError
from .families import check_family as check_loaded_family
from .families import prepare_directory


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
    check_loaded_family(config, where)


def convert_to_mlx(model_dir: Path, out_dir: Path, dtype: str, bits: int | None, group_size: int) -> dict:
    """mlx_lm.convert of `model_dir` (a scratch merge: rewritten in place for mlx-lm first) into `out_dir`
    (which must not exist yet), stored in `dtype` (bfloat16, float16, float32), quantized to `bits` if given;
    what export.json records of it."""
    convert = require_mlx_lm()
    notes = prepare_directory(Path(model_dir))
    log = io.StringIO()
    with contextlib.redirect_stdout(log):     # its "[INFO] ..." lines; ours say what happened
        convert(str(model_dir), mlx_path=str(out_dir), quantize=bits is not None, q_bits=bits,
                q_group_size=group_size if bits else None, dtype=dtype)
    config_path = Path(out_dir) / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    # mlx-lm copies the merge's config: the dtype the weights are stored in, and a KV cache for whoever loads it.
    config.update({"dtype": dtype, "use_cache": True})
    config.pop("torch_dtype", None)
    config_path.write_text(json.dumps(config, indent=4) + "\n", encoding="utf-8")
    record = {"dtype": dtype, "quantization": config.get("quantization"),
              "bytes": sum(f.stat().st_size for f in Path(out_dir).glob("*.safetensors"))}
    if notes:
        record["notes"] = notes
    return record
