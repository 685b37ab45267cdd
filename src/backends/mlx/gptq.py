"""`method: gptq` on MLX: delegated to mlx-lm's own GPTQ (`mlx_lm.quant.gptq.gptq_quantize`).

What that is, and so what this backend accepts: MLX's affine grid (a scale and a float offset per
group: asymmetric), 2, 4 or 8 bits, groups of 32, 64 or 128, damping fixed at 1% with no retry,
columns in their natural order, and every layer calibrated in one pass on the inputs of the
unquantized model (not true-sequential). Every gptq key that asks for something else is refused,
all of them in one message; `--backend cpu` (or cuda, rocm) runs mudpuppy's own GPTQ with all of
them. The output is an mlx-lm model directory (MLX's quantized layout, which `mlx_lm.load` and
mudpuppy's MLX backend read), not the GPTQ layout torch tools read.

Calibration is our data: each calibration example runs alone (batch size 1), so no padding enters
a Hessian. The embeddings stay in full precision (mlx-lm would quantize them at its "fallback"
settings; they are put back); an untied output head is a linear layer and mlx-lm quantizes it.
"""

from __future__ import annotations

import time

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten

from ...errors import DataError, MudpuppyError

GROUPS = (32, 64, 128)
BITS = (2, 4, 8)


def check_settings(g) -> None:
    """Every gptq setting mlx-lm's GPTQ cannot honour, named at once."""
    problems = []
    if g.bits not in BITS:
        problems.append(f"gptq.bits {g.bits}: mlx-lm packs 2, 4 or 8 bits")
    if g.group_size not in GROUPS:
        problems.append(f"gptq.group_size {g.group_size}: MLX quantizes groups of 32, 64 or 128")
    if g.sym:
        problems.append("gptq.sym: true: MLX's grid is affine (asymmetric); set sym: false")
    if g.desc_act:
        problems.append("gptq.desc_act: true: mlx-lm has no act-order; set desc_act: false")
    if g.true_sequential:
        problems.append("gptq.true_sequential: true: mlx-lm calibrates every layer in one pass on the original "
                        "model; set true_sequential: false")
    if g.damp_percent != 0.01:
        problems.append(f"gptq.damp_percent {g.damp_percent}: mlx-lm's damping is fixed at 0.01")
    if g.modules != "all-linear":
        problems.append("gptq.modules: mlx-lm quantizes every linear layer; leave it at all-linear")
    if problems:
        raise MudpuppyError(
            "method gptq on the mlx backend runs mlx-lm's own GPTQ (mlx_lm/quant/gptq.py), which cannot do what "
            "this config asks: " + "; ".join(problems) + ". Or run it with --backend cpu (or cuda, rocm): "
            "mudpuppy's GPTQ does all of these and writes the GPTQ layout other tools read.")


class OneAtATime:
    """Calibration examples as mlx-lm's loop slices them (data[s : s + batch]), one unpadded row each."""

    def __init__(self, examples):
        self.examples = [mx.array(e.input_ids.astype("int32"))[None] for e in examples]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: slice):
        (row,) = self.examples[index]          # batch size 1: exactly one example per slice
        return row


def run_gptq_mlx(cfg, backend, overwrite: bool, echo):
    from mlx_lm.models.switch_layers import SwitchLinear
    from mlx_lm.quant.gptq import gptq_quantize
    from mlx_lm.utils import save

    from ...data import load_data, prepare_sft_data
    from ...data.templates import apply_chat_template_choice
    from ...evaluation import evaluate
    from ...training import outputs
    from ...training.gptq import _describe, _table, pick_calibration
    from ...training.loop import RunResult

    started = time.perf_counter()
    g = cfg.gptq
    check_settings(g)
    loaded = load_data(cfg, "sft")
    backend.seed(cfg.training.seed)
    handle = backend.load_model(cfg.model, cfg.training.precision)
    data = prepare_sft_data(cfg, handle.tokenizer, loaded)
    calibration = pick_calibration(data.train, g.calibration_samples, cfg.training.seed)
    if not calibration:
        raise DataError(loaded.train[0].name if loaded.train else "data.datasets", None,
                        "no training examples left to calibrate GPTQ on")
    out, _ = outputs.start_output_dir(cfg, overwrite)
    echo(f"gptq on mlx: mlx-lm's GPTQ (mlx_lm.quant.gptq), {g.bits}-bit affine, group {g.group_size}; calibrating "
         f"on {len(calibration)} of {len(data.train)} training examples; {len(data.val)} held-out examples")
    measure = bool(data.val) and (cfg.eval.loss or cfg.eval.exact_match)
    original = rtn = None
    linear = (nn.Linear, SwitchLinear)
    if measure and cfg.eval.before_training:
        original = evaluate(backend, handle, data, cfg.eval)
        echo(f"original:         {_describe(original)}")
        nn.quantize(handle.model, group_size=g.group_size, bits=g.bits, mode="affine",
                    class_predicate=lambda _p, m: isinstance(m, linear))
        rtn = evaluate(backend, handle, data, cfg.eval)
        echo(f"round-to-nearest: {_describe(rtn)}")
        handle = backend.load_model(cfg.model, cfg.training.precision)     # the original weights again
        apply_chat_template_choice(handle.tokenizer, cfg.data.chat_template)   # saved with the run's template
    model = handle.model
    keep = [(k, m) for k, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
            if hasattr(m, "to_quantized") and not isinstance(m, linear)]     # embeddings: not quantized
    t0 = time.perf_counter()
    model, quantization = gptq_quantize(model, OneAtATime(calibration), g.bits, g.group_size, g.bits, g.group_size,
                                        batch_size=1)
    seconds = time.perf_counter() - t0
    if keep:
        model.update_modules(tree_unflatten(keep))
        for k, _ in keep:
            quantization.pop(k, None)
    handle.model = model
    config = {**handle.config, "quantization": quantization}
    save(out, handle.source, model, handle.tokenizer, config, donate_model=False)
    echo(f"saved the mlx-lm GPTQ model to {out} ({seconds:.0f} s)")
    result = RunResult(out, 0)
    result.before = original
    if measure:
        reread = backend.load_model(cfg.model.model_copy(update={"base_model": str(out), "tokenizer": None,
                                                                 "revision": None}), cfg.training.precision)
        result.after = evaluate(backend, reread, data, cfg.eval)
        result.model = reread
        echo(f"GPTQ (mlx-lm):    {_describe(result.after)}")
        if original is not None and rtn is not None and original.loss is not None:
            echo(_table(original, rtn, result.after))
    result.seconds = time.perf_counter() - started
    outputs.write_summary(out, {
        "status": "finished", "method": "gptq", "backend": "mlx", "implementation": "mlx_lm.quant.gptq",
        "adapter": "none", "base_model": cfg.model.base_model, "steps": 0,
        "train_examples": len(data.train), "val_examples": len(data.val),
        "quantization": {"bits": g.bits, "group_size": g.group_size, "mode": "affine"},
        "heldout_loss": {"original": original.loss if original else None, "round_to_nearest": rtn.loss if rtn else None,
                         "gptq": result.after.loss if result.after else None},
        "calibration_examples": len(calibration), "quantize_seconds": round(seconds, 1),
        "seconds": round(result.seconds, 1),
        "eval_before": original.as_dict() if original else None,
        "eval_round_to_nearest": rtn.as_dict() if rtn else None,
        "eval_after": result.after.as_dict() if result.after else None,
    })
    return result
