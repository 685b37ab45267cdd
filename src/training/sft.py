"""Supervised fine-tuning: one readable recipe, written against the backend protocol.

Supports: chat, text, instruction and completion data (loss on the trained
roles / the response; see docs/data.md), exact packing and token-budget
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

import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..data import Batcher, load_data, prepare_sft_data
from ..errors import MudpuppyError
from ..evaluation import EvalResult, evaluate, heldout_loss
from . import checkpoints, outputs
from .schedule import learning_rate

# Fault injection for the resume tests: SIGKILL this process right after the
# given step (and its checkpoint) completes, as a crash or OOM kill would.
FAULT_ENV = "MUDPUPPY_FAULT_AFTER_STEP"


class TrainingDiverged(MudpuppyError):
    exit_code = 3


class Interrupted(MudpuppyError):
    exit_code = 130


@dataclass
class RunResult:
    output_dir: Path
    steps: int
    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    before: EvalResult | None = None
    after: EvalResult | None = None
    seconds: float = 0.0
    tokens_per_second: float = 0.0
    skipped_steps: int = 0
    stopped_early: bool = False
    resumed_from: int | None = None
    model: object = None          # the trained ModelHandle, for generation or further use in Python


@dataclass
class LoopState:
    """Everything the loop carries from step to step; saved in each checkpoint."""

    step: int = 0
    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    tokens_seen: int = 0
    train_time: float = 0.0
    skipped: int = 0
    best_eval: float | None = None
    evals_without_gain: int = 0
    before: dict | None = None

    def as_dict(self, batcher: Batcher) -> dict:
        return {**self.__dict__, "batcher": batcher.state_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> "LoopState":
        fields = {k: v for k, v in data.items() if k != "batcher"}
        return cls(**fields)


def total_steps_for(cfg, batcher: Batcher) -> int:
    t = cfg.training
    if t.max_steps:
        return t.max_steps
    micro = math.ceil(t.epochs * batcher.batches_per_epoch)
    return max(1, math.ceil(micro / t.gradient_accumulation_steps))


def checkpoint_identity(cfg) -> dict:
    """What a checkpoint must share with the config that resumes it."""
    return {"base_model": cfg.model.base_model, "method": cfg.method,
            "adapter": cfg.adapter.model_dump(mode="json", exclude={"dropout"})}


def run_sft(cfg, backend, overwrite: bool = False, echo=print) -> RunResult:
    started = time.perf_counter()
    # -- setup: data problems surface before any model loads or anything is written
    loaded = load_data(cfg, "sft")
    out, resume_from = outputs.prepare_output_dir(cfg.output_dir, overwrite, cfg.resume)
    outputs.write_config(out, cfg)
    backend.seed(cfg.training.seed)
    handle = backend.load_model(cfg.model, cfg.training.precision)
    data = prepare_sft_data(cfg, handle.tokenizer, loaded)
    rep = data.report
    echo(f"data: {rep.train_examples} train / {rep.val_examples} held-out examples, "
         f"{rep.loss_token_share:.0%} of tokens carry loss, {rep.truncated} truncated, {rep.dropped} dropped")
    state = LoopState()
    if cfg.eval.before_training and data.val and resume_from is None:
        before = evaluate(backend, handle, data, cfg.eval)
        state.before = before.as_dict()
        echo(f"before training: {_describe(before)}")

    info = backend.attach_adapter(handle, cfg.adapter)
    echo(f"adapter: {info.kind}, {info.trainable_params:,} trainable of {info.total_params:,} parameters")
    trainer = backend.create_trainer(handle, cfg.training)
    batcher = Batcher.from_config(data.train, cfg, handle.tokenizer.pad_token_id)
    steps = total_steps_for(cfg, batcher)
    if resume_from is not None:
        state = _restore(cfg, backend, handle, trainer, batcher, resume_from, out)
        echo(f"resumed from {resume_from} (step {state.step} of {steps})")

    # -- loop
    save = _checkpoint_writer(cfg, backend, handle, trainer, batcher, out)
    stopped_early = _train_loop(cfg, backend, handle, trainer, batcher, data, state, steps, save, out, echo)

    # -- save, then evaluate what was saved
    if cfg.adapter.type == "none":
        backend.save_model(handle, str(out))
    else:
        backend.save_adapter(handle, str(out))
        handle.tokenizer.save_pretrained(str(out))
    result = RunResult(out, state.step, state.losses, state.lrs, skipped_steps=state.skipped,
                       stopped_early=stopped_early, model=handle,
                       resumed_from=int(resume_from.name.split("-")[1]) if resume_from else None)
    result.before = EvalResult(**state.before) if state.before else None
    result.tokens_per_second = state.tokens_seen / max(state.train_time, 1e-9)
    if cfg.eval.after_training and data.val:
        result.after = evaluate(backend, handle, data, cfg.eval)
        echo(f"after training:  {_describe(result.after)}")
    if cfg.merge and cfg.adapter.type != "none":
        merged = out / "merged"
        backend.merge_and_save(handle, str(merged), cfg.merge_dtype)
        echo(f"merged model ({cfg.merge_dtype}) saved to {merged}")
    result.seconds = time.perf_counter() - started
    outputs.write_json_atomic(out / outputs.SUMMARY, _summary(cfg, result, info, rep))
    return result


def _train_loop(cfg, backend, handle, trainer, batcher, data, state, steps, save, out, echo) -> bool:
    """Run optimizer steps from state.step to `steps`; True when early stopping ended it."""
    t = cfg.training
    log = outputs.MetricsLog(out, truncate_after=state.step)
    bar = _progress(steps, state.step, cfg.logging.progress_bar)
    fault_step = int(os.environ.get(FAULT_ENV, "0") or 0)
    last_saved = state.step
    try:
        while state.step < steps:
            step = state.step
            lr = learning_rate(t, step, steps)
            micro = [batcher.next_batch() for _ in range(t.gradient_accumulation_steps)]
            t0 = time.perf_counter()
            res = trainer.step(micro, lr)
            dt = time.perf_counter() - t0
            if res.skipped:
                state.skipped += 1
                if t.on_nan == "stop":
                    where = f"; the last good checkpoint is {checkpoints.newest_checkpoint(out)}" if last_saved else ""
                    raise TrainingDiverged(
                        f"step {step + 1}: non-finite loss or gradient (loss {res.loss}, grad norm {res.grad_norm}); "
                        f"stopped with weights untouched (training.on_nan: stop){where}")
            state.step += 1
            state.train_time += dt
            state.tokens_seen += res.tokens
            state.losses.append(res.loss)
            state.lrs.append(lr)
            if state.step % cfg.logging.log_every == 0 or state.step == steps:
                log.write(step=state.step, loss=round(res.loss, 6), lr=lr, tokens=res.tokens,
                          tokens_per_second=round(res.tokens / dt, 1), grad_norm=res.grad_norm,
                          skipped=res.skipped, epoch=batcher.epoch)
            if bar is not None:
                bar.set_postfix(loss=f"{res.loss:.4f}", tok_s=f"{res.tokens / dt:.0f}")
                bar.update(1)
            if t.eval_steps and state.step % t.eval_steps == 0 and data.val:
                if _evaluate_and_check_patience(cfg, backend, handle, data, state, log, echo):
                    save(state)
                    return True
            if t.save_steps and state.step % t.save_steps == 0:
                save(state)
                last_saved = state.step
            if fault_step and state.step == fault_step:
                os.kill(os.getpid(), signal.SIGKILL)
    except KeyboardInterrupt:
        if state.step > last_saved:
            path = save(state)
            raise Interrupted(f"interrupted at step {state.step}; checkpoint saved to {path}. "
                              "Continue with: mudpuppy run --config ... --resume") from None
        raise Interrupted(f"interrupted at step {state.step}; the newest checkpoint is up to date. "
                          "Continue with: mudpuppy run --config ... --resume") from None
    finally:
        if bar is not None:
            bar.close()
        log.close()
    if t.save_steps and last_saved != state.step:
        save(state)
    return False


def _evaluate_and_check_patience(cfg, backend, handle, data, state, log, echo) -> bool:
    t = cfg.training
    loss, _ = heldout_loss(backend, handle, data.val[: cfg.eval.max_samples or None], cfg.eval.batch_size)
    log.write(step=state.step, eval_loss=round(loss, 6))
    if state.best_eval is None or loss < state.best_eval - t.early_stopping_min_delta:
        state.best_eval, state.evals_without_gain = loss, 0
    else:
        state.evals_without_gain += 1
    if t.early_stopping_patience and state.evals_without_gain >= t.early_stopping_patience:
        echo(f"early stopping at step {state.step}: held-out loss {loss:.4f} has not improved on "
             f"{state.best_eval:.4f} for {state.evals_without_gain} evaluations")
        return True
    return False


def _checkpoint_writer(cfg, backend, handle, trainer, batcher, out):
    identity = checkpoint_identity(cfg)

    def save(state: LoopState) -> Path:
        return checkpoints.save_checkpoint(
            out, state.step, identity, state.as_dict(batcher),
            lambda d: backend.save_training_state(handle, trainer, str(d)), cfg.training.keep_last_n)

    return save


def _restore(cfg, backend, handle, trainer, batcher, path: Path, out: Path) -> LoopState:
    data = checkpoints.read_checkpoint(path, checkpoint_identity(cfg))
    backend.load_training_state(handle, trainer, str(path))
    batcher.load_state_dict(data["batcher"])
    return LoopState.from_dict(data)


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
        "skipped_steps": result.skipped_steps,
        "stopped_early": result.stopped_early,
        "resumed_from_step": result.resumed_from,
        "trainable_params": info.trainable_params,
        "train_examples": rep.train_examples,
        "val_examples": rep.val_examples,
        "tokens_per_second": round(result.tokens_per_second, 1),
        "seconds": round(result.seconds, 1),
        "eval_before": result.before.as_dict() if result.before else None,
        "eval_after": result.after.as_dict() if result.after else None,
    }


def _progress(total: int, done: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, desc="train", unit="step", dynamic_ncols=True)
