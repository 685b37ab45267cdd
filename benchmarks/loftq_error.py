"""How much of QLoRA's quantization error adapter.init loftq takes back at step 0, on one runtime.

    python benchmarks/loftq_error.py --runtime cpu --model smollm2-135m-instruct --r 16 --alpha 32
    python benchmarks/loftq_error.py --runtime mlx --model smollm2-135m-instruct --r 16 --alpha 32

Per adapted layer: ||W - Q|| / ||W|| (plain QLoRA's start) and ||W - Q - scale*B@A|| / ||W|| (LoftQ's),
W the checkpoint's weight, Q the runtime's own dequantized 4-bit base (int4, groups of 64); then the
mean absolute difference of the next-token logits from the full-precision model's over the quickstart's
first 8 held-out chats, for plain QLoRA and for LoftQ. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runtime", default="cpu", help="cpu (torch) or mlx")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32)
    args = ap.parse_args()
    from mudpuppy import create_backend
    from mudpuppy.backends.models import resolve_model
    from mudpuppy.config import AdapterConfig, ModelConfig
    from mudpuppy.data import Batch

    model_cfg = ModelConfig(base_model=args.model)
    source = Path(resolve_model(args.model, None, False).path)
    backend = create_backend(args.runtime)
    full = backend.load_model(model_cfg, "fp32")
    chats = [json.loads(line) for line in (ROOT / "configs/data/smart_home_val.jsonl").open()][:8]
    texts = [full.tokenizer.apply_chat_template(c["messages"], tokenize=False) for c in chats]
    ids = [full.tokenizer(t, add_special_tokens=False)["input_ids"][:96] for t in texts]
    width = max(map(len, ids))
    mask = np.array([[1] * len(i) + [0] * (width - len(i)) for i in ids])
    tokens = np.array([i + [0] * (width - len(i)) for i in ids])
    batch = Batch(tokens, np.where(mask == 1, 0, -100), mask)
    expected = backend.logits(full, batch)
    del full
    out = {"runtime": args.runtime, "model": args.model, "r": args.r, "alpha": args.alpha}
    for init in ("default", "loftq"):
        cfg = AdapterConfig(type="qlora", r=args.r, alpha=args.alpha, init=init)
        handle = backend.load_model(model_cfg, "fp32", adapter=cfg)
        backend.attach_adapter(handle, cfg)
        out[f"logits_mae_{init}"] = float(np.abs(backend.logits(handle, batch) - expected)[mask == 1].mean())
        if init == "loftq":
            before, after = layer_errors(args.runtime, handle, source)
            out.update(layers=len(before), weight_error_qlora=float(np.mean(before)),
                       weight_error_loftq=float(np.mean(after)))
        del handle
    print(json.dumps(out))


def layer_errors(runtime: str, handle, source: Path) -> tuple[list[float], list[float]]:
    from safetensors.numpy import load_file

    weights = {}
    for f in sorted(source.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    before, after = [], []
    for name, q, delta in adapted(runtime, handle):
        w = weights[f"{name}.weight"].astype(np.float32)
        before.append(np.linalg.norm(w - q) / np.linalg.norm(w))
        after.append(np.linalg.norm(w - q - delta) / np.linalg.norm(w))
    return before, after


def adapted(runtime: str, handle):
    """(name, dequantized base, scale*B@A) of each 4-bit adapted layer."""
    if runtime == "mlx":
        import mlx.core as mx
        from mlx import nn

        from mudpuppy.backends.mlx.layers import adapter_layers, base_weight

        for path, layer in adapter_layers(handle.model).items():
            if isinstance(layer.linear, nn.QuantizedLinear):
                q = np.array(base_weight(layer.linear).astype(mx.float32))
                delta = layer.scale * (np.array(layer.lora_a) @ np.array(layer.lora_b)).T
                yield path, q, delta
        return
    import torch
    from peft.tuners.lora import LoraLayer

    for name, layer in handle.model.base_model.model.named_modules():
        if isinstance(layer, LoraLayer) and hasattr(layer.get_base_layer(), "dequantize"):
            with torch.no_grad():
                yield (name, layer.get_base_layer().dequantize(torch.float32).numpy(),
                       layer.get_delta_weight("default").numpy())


if __name__ == "__main__":
    main()
