"""Supervised fine-tuning: one readable recipe, written against the backend protocol.

Supports: chat, text, instruction and completion data (loss on the trained
roles / the response; see docs/data.md), chat with images for vision-language
models (the backend's processor makes the pixels; not packed), exact packing and token-budget
batching; full fine-tuning, LoRA and DoRA; AdamW, SGD or Adafactor; linear,
cosine, cosine-with-restarts, polynomial or constant schedules with warmup;
gradient accumulation weighted by tokens; clipping; bf16 autocast where the
device has it; held-out loss every N steps with early stopping; atomic
checkpoints every N steps with exact resume (weights, optimizer, RNG, data
position, schedule); a non-finite loss skipped or stopping the run; Ctrl-C
saving a checkpoint; merging the adapter at the end.

Setup, then loop, then save. Every array operation happens in the backend.
"""

from __future__ import annotations

import time

from ..data import Batcher, load_data, prepare_sft_data
from ..evaluation import EvalResult, evaluate, heldout_loss
from ..monitor.memory import MemoryPhases
from . import outputs
from .merge import merge_at_end
from .loop import LoopState, checkpoint_writer, restore, resumed_step, save_trained, total_steps_for, train_loop
from .outputs import RunResult, run_summary


def run_sft(cfg, backend, overwrite: bool = False, echo=print) -> RunResult:
    started = time.perf_counter()
    # -- setup: data problems surface before any model loads or anything is written
    loaded = load_data(cfg, "sft")
    claim = outputs.claim_output_dir(cfg, overwrite)          # locked; a run --overwrite replaces stays for now
    out, resume_from = claim.out, claim.resume_from
    backend.seed(cfg.training.seed)
    handle = backend.load_model(cfg.model, cfg.training.precision, adapter=cfg.adapter)
    data = prepare_sft_data(cfg, handle.tokenizer, loaded)
    outputs.take_output_dir(cfg, claim, echo)                  # model and data loaded: now the old run goes
    rep = data.report
    echo(f"data: {rep.train_examples} train / {rep.val_examples} held-out examples, "
         f"{rep.loss_token_share:.0%} of tokens carry loss, {rep.truncated} truncated, {rep.dropped} dropped")
    state = LoopState()
    if cfg.eval.before_training and data.val and resume_from is None:
        before = evaluate(backend, handle, data, cfg.eval)
        state.before = before.as_dict()
        echo(f"before training: {_describe(before)}")

    info = backend.attach_adapter(handle, cfg.adapter)
    echo(f"model: {handle.describe()}")
    echo(f"adapter: {info.describe()}")
    trainer = backend.create_trainer(handle, cfg.training)
    batcher = Batcher.from_config(data.train, cfg, handle.tokenizer.pad_token_id)
    steps = total_steps_for(cfg, batcher)
    if resume_from is not None:
        state = restore(cfg, backend, handle, trainer, batcher, resume_from)
        echo(f"resumed from {resume_from} (step {state.step} of {steps})")

    # -- loop
    save = checkpoint_writer(cfg, backend, handle, trainer, batcher, out)
    held_out = _heldout_evaluator(cfg, backend, handle, data) if data.val else None
    memory = MemoryPhases(backend)
    stopped_early = train_loop(cfg, trainer, batcher, state, steps, save, out, echo, evaluate=held_out,
                               callbacks=[*outputs.run_callbacks(cfg, out, echo), memory])

    # -- save, then evaluate what was saved
    save_trained(cfg, backend, handle, out)
    result = RunResult(out, state.step, state.losses, state.lrs, skipped_steps=state.skipped,
                       stopped_early=stopped_early, model=handle, resumed_from=resumed_step(resume_from))
    result.before = EvalResult(**state.before) if state.before else None
    result.tokens_per_second = state.tokens_seen / max(state.train_time, 1e-9)
    if cfg.eval.after_training and data.val:
        result.after = evaluate(backend, handle, data, cfg.eval)
        echo(f"after training:  {_describe(result.after)}")
    merge_at_end(cfg, backend, out, echo)
    memory.record("after_training")
    result.seconds = time.perf_counter() - started
    outputs.write_summary(out, outputs.with_memory(_summary(cfg, result, info, rep), memory))
    return result


def _heldout_evaluator(cfg, backend, handle, data):
    def held_out() -> tuple[float, dict]:
        loss, _ = heldout_loss(backend, handle, data.val[: cfg.eval.max_samples or None], cfg.eval.batch_size)
        return loss, {"eval_loss": round(loss, 6)}

    return held_out


def _describe(ev: EvalResult) -> str:
    parts = []
    if ev.loss is not None:
        parts.append(f"held-out loss {ev.loss:.4f}")
    if ev.exact_match is not None:
        parts.append(f"exact match {ev.exact_match:.1%}")
    return ", ".join(parts) + f" ({ev.samples} examples)"


def _summary(cfg, result: RunResult, info, rep) -> dict:
    return run_summary(cfg, result, info, rep.train_examples, rep.val_examples)
