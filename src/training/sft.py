"""Supervised fine-tuning: one readable recipe, written against the backend protocol.

Supports: chat (loss on trained roles, assistant by default) and plain-text
JSONL; full fine-tuning, LoRA and DoRA adapters; AdamW or SGD; linear, cosine
or constant schedules with warmup; gradient accumulation weighted by tokens;
gradient clipping; bf16 autocast where the device has it; held-out loss and
exact-match evaluation before and after training.

Does not (yet): packing, checkpoints/resume, QLoRA, merging — see the issues.

Setup, then loop, then save. Every array operation happens in the backend.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..data import Batcher, prepare_sft_data
from ..evaluation import EvalResult, evaluate
from . import outputs
from .schedule import learning_rate


@dataclass
class RunResult:
    output_dir: Path
    steps: int
    losses: list[float] = field(default_factory=list)
    before: EvalResult | None = None
    after: EvalResult | None = None
    seconds: float = 0.0
    tokens_per_second: float = 0.0
    model: object = None          # the trained ModelHandle, for generation or further use in Python


def total_steps_for(cfg, batcher: Batcher) -> int:
    t = cfg.training
    if t.max_steps:
        return t.max_steps
    micro = math.ceil(t.epochs * batcher.batches_per_epoch)
    return max(1, math.ceil(micro / t.gradient_accumulation_steps))


def run_sft(cfg, backend, overwrite: bool = False, echo=print) -> RunResult:
    started = time.perf_counter()
    out = outputs.prepare_output_dir(cfg.output_dir, overwrite)
    outputs.write_config(out, cfg)

    # -- setup
    backend.seed(cfg.training.seed)
    handle = backend.load_model(cfg.model, cfg.training.precision)
    data = prepare_sft_data(cfg, handle.tokenizer)
    rep = data.report
    echo(f"data: {rep.train_examples} train / {rep.val_examples} held-out examples, "
         f"{rep.loss_token_share:.0%} of tokens carry loss, {rep.truncated} truncated, {rep.dropped} dropped")
    result = RunResult(out, 0)
    if cfg.eval.before_training and data.val:
        result.before = evaluate(backend, handle, data, cfg.eval)
        echo(f"before training: {_describe(result.before)}")

    info = backend.attach_adapter(handle, cfg.adapter)
    echo(f"adapter: {info.kind}, {info.trainable_params:,} trainable of {info.total_params:,} parameters")
    trainer = backend.create_trainer(handle, cfg.training)
    batcher = Batcher(data.train, cfg.training.micro_batch_size, handle.tokenizer.pad_token_id,
                      cfg.training.seed, cfg.data.shuffle)
    steps = total_steps_for(cfg, batcher)

    # -- loop
    log = outputs.MetricsLog(out)
    bar = _progress(steps, cfg.logging.progress_bar)
    tokens_seen, train_time = 0, 0.0
    try:
        for step in range(steps):
            lr = learning_rate(cfg.training, step, steps)
            micro = [batcher.next_batch() for _ in range(cfg.training.gradient_accumulation_steps)]
            t0 = time.perf_counter()
            res = trainer.step(micro, lr)
            dt = time.perf_counter() - t0
            train_time += dt
            tokens_seen += res.tokens
            result.losses.append(res.loss)
            if (step + 1) % cfg.logging.log_every == 0 or step + 1 == steps:
                log.write(step=step + 1, loss=round(res.loss, 6), lr=lr, tokens=res.tokens,
                          tokens_per_second=round(res.tokens / dt, 1), grad_norm=res.grad_norm,
                          skipped=res.skipped, epoch=batcher.epoch)
            if bar is not None:
                bar.set_postfix(loss=f"{res.loss:.4f}", tok_s=f"{res.tokens / dt:.0f}")
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        log.close()
    result.steps = steps
    result.tokens_per_second = tokens_seen / max(train_time, 1e-9)

    # -- save, then evaluate what was saved
    if cfg.adapter.type == "none":
        backend.save_model(handle, str(out))
    else:
        backend.save_adapter(handle, str(out))
        handle.tokenizer.save_pretrained(str(out))
    if cfg.eval.after_training and data.val:
        result.after = evaluate(backend, handle, data, cfg.eval)
        echo(f"after training:  {_describe(result.after)}")
    result.seconds = time.perf_counter() - started
    result.model = handle
    outputs.write_json_atomic(out / outputs.SUMMARY, _summary(cfg, result, info, rep))
    return result


def _describe(ev: EvalResult) -> str:
    parts = []
    if ev.loss is not None:
        parts.append(f"held-out loss {ev.loss:.4f}")
    if ev.exact_match is not None:
        parts.append(f"exact match {ev.exact_match:.1%}")
    return ", ".join(parts) + f" ({ev.samples} examples)"


def _summary(cfg, result: RunResult, info, rep) -> dict:
    return {
        "status": "finished",
        "method": cfg.method,
        "adapter": info.kind,
        "base_model": cfg.model.base_model,
        "steps": result.steps,
        "first_loss": result.losses[0] if result.losses else None,
        "final_loss": result.losses[-1] if result.losses else None,
        "trainable_params": info.trainable_params,
        "train_examples": rep.train_examples,
        "val_examples": rep.val_examples,
        "tokens_per_second": round(result.tokens_per_second, 1),
        "seconds": round(result.seconds, 1),
        "eval_before": result.before.as_dict() if result.before else None,
        "eval_after": result.after.as_dict() if result.after else None,
    }


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="train", unit="step", dynamic_ncols=True)
