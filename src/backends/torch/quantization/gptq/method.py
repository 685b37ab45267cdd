"""`method: gptq` on torch (cpu, cuda, rocm): mudpuppy's own GPTQ behind `BackendProtocol.plan_gptq`.

Every gptq setting is honoured: 2, 3, 4 and 8 bits, groups of any power of two or one per row,
symmetric or asymmetric grids, act-order, damping raised automatically, true-sequential. The model
is quantized from its checkpoint in host memory, one decoder layer at a time on the device
(layers.py, the sweep in sweep.py), and saved in the GPTQ layout other tools read
(format.py, files.py). The recipe around it is training/gptq.py.
"""

from __future__ import annotations

from pathlib import Path

from .....data.tokenizers import save_tokenizer
from .format import quantization_config
from .files import load_host_model, save_quantized
from .layers import plan_linears, quantize_model, round_to_nearest_model
from .sweep import QuantSpec


class TorchGptq:
    """protocol.GptqPlan for the torch backends, at one config's gptq settings."""

    label = "GPTQ"

    def __init__(self, gptq_cfg, device: str):
        self.cfg, self.device = gptq_cfg, device
        self.spec = QuantSpec.from_config(gptq_cfg)
        self.chosen: list[str] = []         # the linears of a block to quantize, once `check` has seen the model
        spec = self.spec
        self.description = (f"{spec.bits}-bit, group {'per row' if spec.group_size <= 0 else spec.group_size}, "
                            f"{'symmetric' if spec.sym else 'asymmetric'}{', act-order' if spec.desc_act else ''}")

    def check(self, handle) -> None:
        """Unknown module names and shapes the layout cannot pack, named at once (gptq_layers.plan_linears)."""
        self.chosen = plan_linears(handle.model, self.cfg.modules)[2]

    def round_to_nearest(self, handle) -> None:
        round_to_nearest_model(handle.model, self.spec, self.cfg.modules)

    def quantize(self, handle, model_cfg, examples, out: Path, echo) -> dict:
        """GPTQ of the checkpoint read into host memory: the device copy in `handle` goes first."""
        from ..... import __version__

        g, spec = self.cfg, self.spec
        source, tokenizer = handle.source, handle.tokenizer
        handle.model = None                  # the device copy goes before the host copy loads
        host = load_host_model(Path(source), model_cfg.trust_remote_code)
        report = quantize_model(host, examples, spec, self.device, g.modules, g.true_sequential, echo)
        for line in report.raised_damping:
            echo(f"  damping raised after a failed Cholesky factorisation: {line}")
        for line in report.fallbacks:
            echo(f"  WARNING: rounded to nearest (the Hessian could not be factorised at any damping): {line}")
        blocks = None if g.modules == "all-linear" else [self.chosen]    # what optimum reads to leave the rest alone
        qconfig = quantization_config(spec.bits, spec.group_size, spec.sym, spec.desc_act, spec.damp_percent,
                                      g.true_sequential, spec.damp_auto_increment, __version__, blocks)
        files = save_quantized(host, out, qconfig, source)
        save_tokenizer(tokenizer, out)       # with the chat template the data was rendered with
        del host
        echo(f"quantized {report.linears} linear layers in {report.seconds:.0f} s")
        return {"quantization_config": qconfig, "gptq": report.as_dict(), "files": files}
