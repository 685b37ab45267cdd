"""Peak memory of one distillation loss and its backward (issue 40): mudpuppy's chunked backend.token_divergence
against both models' full [N, vocab] logits (TRL's GKD generalized_jsd_loss on them).

    .venv/bin/python benchmarks/distill_memory.py chunked /tmp/distill-mem    # torch, 256 positions a chunk
    .venv/bin/python benchmarks/distill_memory.py full /tmp/distill-mem       # torch, full logits
    .venv/bin/python benchmarks/distill_memory.py mlx /tmp/distill-mem        # MLX, chunked

Two random 2-layer Llamas with SmolLM2's vocabulary size (49,152; hidden 64 student, 96 teacher, built once in
the directory given), a LoRA student, 8 x 512 tokens (4,088 loss positions), JSD at beta 0.5, fp32. Prints
the loss and the peak memory the loss and backward added (RSS; on MLX also mx.get_peak_memory). One process a
mode: the peak RSS of a process only grows.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import numpy as np

from mudpuppy import create_backend
from mudpuppy.config import AdapterConfig, ModelConfig
from mudpuppy.data import Batch
from mudpuppy.training.distill_loss import Divergence

V, B, T = 49152, 8, 512


def build(path: Path, hidden: int, seed: int) -> None:
    import torch
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if (path / "config.json").exists():
        return
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                 tie_word_embeddings=True)).save_pretrained(path)
    vocab = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=vocab, pad_token="t0", eos_token="t1").save_pretrained(path)


def main(mode: str, root: Path) -> dict:
    build(root / "student", 64, 0)
    build(root / "teacher", 96, 1)
    backend = create_backend("mlx" if mode == "mlx" else "cpu")
    student = backend.load_model(ModelConfig(base_model=str(root / "student")), "fp32")
    backend.attach_adapter(student, AdapterConfig(type="lora", r=8, alpha=16))
    teacher = backend.load_model(ModelConfig(base_model=str(root / "teacher")), "fp32")
    ids = np.random.default_rng(0).integers(2, V, (B, T))
    labels = np.concatenate([ids[:, 1:], np.full((B, 1), -100)], axis=1)
    batch = Batch(ids, labels, np.ones_like(ids))
    divergence = Divergence(backend.ops, 0.5)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"mode": mode, "loss_positions": int((labels != -100).sum()), "vocab": V}
    if mode == "mlx":
        import mlx.core as mx
        import mlx.nn as nn

        mx.reset_peak_memory()
        loss, grads = nn.value_and_grad(student.model, lambda m: backend.token_divergence(
            student, teacher, batch, divergence))(student.model)
        mx.eval(loss, grads)
        out["mx_peak_mb"] = round(mx.get_peak_memory() / 2**20)
    elif mode == "chunked":
        loss = backend.token_divergence(student, teacher, batch, divergence, grad=True)
        loss.backward()
    else:
        import torch
        from trl.experimental.gkd.gkd_trainer import GKDTrainer

        inputs = {"input_ids": torch.as_tensor(ids), "attention_mask": torch.ones(B, T, dtype=torch.long)}
        s = student.model(**inputs).logits
        with torch.no_grad():
            t = teacher.model(**inputs).logits
        loss = GKDTrainer.generalized_jsd_loss(s, t, torch.as_tensor(labels), beta=0.5, reduction="sum")
        loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {**out, "loss": round(float(loss.item()), 4), "added_rss_mb": round((peak - before) / 1024)}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], Path(sys.argv[2]))))
