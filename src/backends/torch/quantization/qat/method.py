"""`method: qat` on torch (cpu, cuda, rocm): torchao's fake quantization and our conversion behind
`BackendProtocol.plan_qat`. The layers are layers.py, the converted model's files files.py, the
recipe around them training/qat.py.
"""

from __future__ import annotations

from pathlib import Path

from ....models import resolve_model
from .files import save_quantized
from .layers import QatLayers, QatSpec, check_adapter, check_group_size, convert_qat, prepare_qat, set_fake_quant


class TorchQat:
    """protocol.QatPlan for the torch backends, at one config's qat settings."""

    def __init__(self, qat_cfg):
        self.spec = QatSpec.from_config(qat_cfg)
        self.description = self.spec.describe()

    def check_adapter(self, adapter_cfg) -> None:
        check_adapter(adapter_cfg)

    def check_model(self, model_cfg) -> None:
        """The group size against every layer to quantize, from the model's config.json alone."""
        resolved = resolve_model(model_cfg.base_model, model_cfg.revision, model_cfg.trust_remote_code)
        check_group_size(resolved.path, self.spec, model_cfg.trust_remote_code)

    def prepare(self, handle) -> QatLayers:
        return prepare_qat(handle.model, self.spec)

    def set_fake_quant(self, handle, enabled: bool) -> None:
        set_fake_quant(handle.model, enabled)

    def convert(self, handle, prepared: QatLayers, out: Path) -> int:
        handle.model = convert_qat(handle.model, prepared)
        return save_quantized(handle.model, handle.tokenizer, out)
