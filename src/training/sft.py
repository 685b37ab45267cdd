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

from ..data import Batcher, collate, load_data, prepare_sft_data
from ..data.report import run_lines
from ..evaluation import EvalResult, evaluate, heldout_loss
from .loop import save_trained, train_loop
from .results import RunResult
from .session import start_run


def eva_batches(cfg, examples, pad_id: int) -> list | None:
    """adapter.init eva: the training examples in order, micro_batch_size a batch, whose layer inputs EVA
    decomposes (PEFT cycles through them until its components converge); None for other inits."""
    if cfg.adapter.init != "eva":
        return None
    size = cfg.training.micro_batch_size
    return [collate(examples[i:i + size], pad_id) for i in range(0, len(examples), size)]


def run_sft(cfg, backend, overwrite: bool = False, echo=print, callbacks=()) -> RunResult:
    """Fine-tune on cfg's data; `callbacks` (monitor/callbacks.py) hear every step after the run's own."""
    started = time.perf_counter()
    # -- setup: data problems surface before any model loads or anything is written
    loaded = load_data(cfg, "sft")
    run = start_run(cfg, backend, overwrite, echo, started, callbacks)   # output_dir locked, model loaded
    handle = run.handle
    data = prepare_sft_data(cfg, handle.tokenizer, loaded, ranks=backend.ranks)
    run.take_output_dir()                                      # model and data loaded: now the old run goes
    rep = describe_data(data, echo)
    measure = measure_model(cfg, backend, handle, data)
    run.measure_before(measure)
    run.attach_adapter(eva_batches(cfg, data.train, handle.tokenizer.pad_token_id))
    trainer = backend.create_trainer(handle, cfg.training)    # the runtime's optimizer step (trainer.py)
    batcher = Batcher.from_config(data.train, cfg, handle.tokenizer.pad_token_id, ranks=backend.ranks)
    steps = run.restore(trainer, batcher)       # a resumed run: weights, optimizer, RNG, data position

    # -- loop: each optimizer step is written out in loop.train_loop, the runtime's part in its trainer.step
    stopped_early = train_loop(cfg, run.state, steps, trainer, batcher, run.checkpoints(trainer, batcher),
                               run.callbacks(), evaluate=loss_check(cfg, backend, handle, data), echo=echo)

    # -- save, then evaluate what was saved
    save_trained(cfg, backend, handle, run.out)
    result = run.result(stopped_early, trainer)
    result.after = run.measure_after(measure)
    return run.finish(result, rep.train_examples, rep.val_examples)


def describe_data(data, echo):
    """The data line SFT and QAT print once it is tokenized; returns the data's report."""
    rep = data.report
    echo(f"data: {rep.train_examples} train / {rep.val_examples} held-out examples, "
         f"{rep.loss_token_share:.0%} of tokens carry loss, {rep.truncated} truncated, {rep.dropped} dropped")
    for line in run_lines(rep):                # the training mix; under --nproc, which ranks tokenized
        echo(line)
    return rep


def measure_model(cfg, backend, handle, data):
    """The held-out evaluation of SFT and QAT (loss, exact match: eval settings), None without held-out data."""
    return (lambda: evaluate(backend, handle, data, cfg.eval)) if data.val else None


def loss_check(cfg, backend, handle, data):
    """The loop's held-out check (eval_steps, early stopping) for SFT and QAT: the loss alone; None without
    held-out data."""
    if not data.val:
        return None
    val = data.val[: cfg.eval.max_samples or None]

    def held_out() -> tuple[float, dict]:
        loss, perplexity = heldout_loss(backend, handle, val, cfg.eval.batch_size)
        return EvalResult(loss=loss, perplexity=perplexity, samples=len(val)).for_loop()

    return held_out
