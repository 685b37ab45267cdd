"""`method: gptq` on MLX: delegated to mlx-lm's own GPTQ (`mlx_lm.quant.gptq.gptq_quantize`), behind
`BackendProtocol.plan_gptq`; the recipe around it (data, baselines, held-out check) is training/gptq.py.

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

from ...errors import MudpuppyError

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
        self.examples = [mx.array(e.astype("int32"))[None] for e in examples]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: slice):
        (row,) = self.examples[index]          # batch size 1: exactly one example per slice
        return row


class MlxGptq:
    """protocol.GptqPlan for MLX: mlx-lm's GPTQ, refused at settings it cannot honour (`check_settings`)."""

    label = "GPTQ (mlx-lm)"

    def __init__(self, backend, gptq_cfg):
        check_settings(gptq_cfg)
        self.backend, self.cfg = backend, gptq_cfg
        self.rounded = False          # round_to_nearest changed the handle's weights: quantize reads them again
        self.description = (f"mlx-lm's GPTQ (mlx_lm.quant.gptq), {gptq_cfg.bits}-bit affine, "
                            f"group {gptq_cfg.group_size}")

    def check(self, handle) -> None:
        """Nothing the model could refuse that `check_settings` has not: mlx-lm quantizes every linear layer."""

    def round_to_nearest(self, handle) -> None:
        """MLX's own affine quantization of every linear layer, in place, at GPTQ's bits and group size."""
        nn.quantize(handle.model, group_size=self.cfg.group_size, bits=self.cfg.bits, mode="affine",
                    class_predicate=lambda _p, m: isinstance(m, _linear_classes()))
        self.rounded = True

    def quantize(self, handle, model_cfg, examples, out, echo) -> dict:
        """mlx-lm's GPTQ of the model as loaded (read again after round_to_nearest), saved by mlx-lm's
        `save` with the handle's tokenizer; the embeddings stay in full precision."""
        from mlx_lm.quant.gptq import gptq_quantize
        from mlx_lm.utils import save

        g = self.cfg
        model = self._original_model(handle, model_cfg)
        keep = [(k, m) for k, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
                if hasattr(m, "to_quantized") and not isinstance(m, _linear_classes())]    # embeddings
        t0 = time.perf_counter()
        model, quantization = gptq_quantize(model, OneAtATime(examples), g.bits, g.group_size, g.bits, g.group_size,
                                            batch_size=1)
        seconds = time.perf_counter() - t0
        if keep:
            model.update_modules(tree_unflatten(keep))
            for k, _ in keep:
                quantization.pop(k, None)
        config = {**handle.config, "quantization": quantization}
        save(out, handle.source, model, handle.tokenizer, config, donate_model=False)
        echo(f"quantized with mlx-lm's GPTQ in {seconds:.0f} s")
        return {"backend": "mlx", "implementation": "mlx_lm.quant.gptq",
                "quantization": {"bits": g.bits, "group_size": g.group_size, "mode": "affine"},
                "calibration_examples": len(examples), "quantize_seconds": round(seconds, 1)}

    def _original_model(self, handle, model_cfg):
        """The handle's model as loaded, taken from it; read again where round_to_nearest changed it (the
        rounded copy goes first)."""
        model, handle.model = handle.model, None
        if not self.rounded:
            return model
        del model
        return self.backend.load_model(model_cfg, handle.precision).model


def _linear_classes() -> tuple:
    """The layers mlx-lm's GPTQ quantizes: linear layers and mixture-of-experts stacks."""
    from mlx_lm.models.switch_layers import SwitchLinear

    return (nn.Linear, SwitchLinear)
