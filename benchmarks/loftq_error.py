"""How much of QLoRA's quantization error adapter.init loftq takes back at step 0, on one runtime.

    python benchmarks/loftq_error.py --runtime cpu --model smollm2-135m-instruct --r 16 --alpha 32
    python benchmarks/loftq_error.py --runtime mlx --model smollm2-135m-instruct --r 16 --alpha 32
    python benchmarks/loftq_error.py --runtime cpu --r 16 --alpha 32 --iters 1,2,4   # adapter.loftq_iter

Per adapted layer: ||W - Q|| / ||W|| (plain QLoRA's start) and ||W - Q - scale*B@A|| / ||W|| (LoftQ's),
W the checkpoint's weight, Q the runtime's own dequantized 4-bit base (int4, groups of 64); then the
mean absolute difference of the next-token logits from the full-precision model's over the quickstart's
first 8 held-out chats, for plain QLoRA and for LoftQ. With --iters, LoftQ runs once per
adapter.loftq_iter in the list; above 1 the base itself changes, so each count also gets
||W - Q_k|| / ||W|| of its own base Q_k, and the seconds its start took. Prints a JSON line per count as it is measured, then one JSON line of everything. On a shared
machine run it with OPENBLAS_NUM_THREADS=1: numpy's SVD with two OpenBLAS threads on two busy cores
took 22-44 s a 1536x576 weight instead of 0.7 s.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runtime", default="cpu", help="cpu (torch) or mlx")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32)
    ap.add_argument("--iters", default="1", help="comma list of adapter.loftq_iter values to measure")
    args = ap.parse_args()
    iters = [int(k) for k in args.iters.split(",")]
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
    out["loftq_iter"] = {}
    for init, k in [("default", 1)] + [("loftq", k) for k in iters]:
        extra = {"loftq_iter": k} if init == "loftq" else {}
        cfg = AdapterConfig(type="qlora", r=args.r, alpha=args.alpha, init=init, **extra)
        handle = backend.load_model(model_cfg, "fp32", adapter=cfg)
        start = time.perf_counter()
        backend.attach_adapter(handle, cfg)
        seconds = time.perf_counter() - start
        mae = float(np.abs(backend.logits(handle, batch) - expected)[mask == 1].mean())
        if init == "default":
            out["logits_mae_default"] = mae
        else:
            before, after = layer_errors(args.runtime, handle, source)
            out["loftq_iter"][k] = {"logits_mae": mae, "weight_error_base": float(np.mean(before)),
                                    "weight_error": float(np.mean(after)), "attach_seconds": round(seconds, 1)}
            print(json.dumps({"loftq_iter": k, **out["loftq_iter"][k]}), flush=True)     # progress
            if k == 1:
                out.update(layers=len(before), weight_error_qlora=float(np.mean(before)),
                           weight_error_loftq=float(np.mean(after)), logits_mae_loftq=mae)
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
