"""Setup, loop and save for every method that trains an objective on items (preference, reward, PRM).

A method describes itself with a `Recipe`: which model head it needs, how
tokenized examples become training items, how those are batched, and its
objective. This module does the rest, the same way for all of them, on top
of the loop SFT uses (loop.py):

    records read and checked (format, identical pairs, empty completions)   before any model loads
    model loaded, data tokenized, bad examples dropped or refused, report
    adapter attached; method-specific preparation (reference log-probs)
    held-out numbers before training; the loop; save; held-out numbers after
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..data.tokenizers import save_tokenizer
from ..data import Batcher, load_data, prepare_data
from ..data.pairs import Screening, drop_screened, fixed_item_batches, screen_records
from ..data.pipeline import num_workers
from ..errors import DataError
from ..evaluation import EvalResult, evaluate_objective
from .loop import save_trained, staged_final, train_loop
from .results import RunResult
from .session import start_run

SHOWN = 5      # bad records listed in an error
ADAPTER_DIR = "adapter"   # where a scalar-head run keeps its adapter, beside the whole model


@dataclass
class Recipe:
    """What one method family contributes to a run."""

    head: str | None                                   # model head (None: causal LM)
    bad_input: str                                     # "drop" or "error": the bad_pairs policy
    make_items: Callable[[list, list], tuple[list, list]]      # (train, val) examples -> items
    collate: Callable                                  # items -> one micro-batch
    objective: object                                  # protocol.Objective
    # (backend, handle, train, val) -> (train, val), after the adapter is attached and before any
    # step (also when resuming: checkpoint weights load later): e.g. precomputed reference log-probs
    prepare: Callable | None = None
    describe: str = ""                                 # one line for the start of the run
    check: Callable | None = None                      # (LoadedData) -> None: raise on data the method refuses


def run_recipe(cfg, backend, recipe: Recipe, overwrite: bool = False, echo=print, callbacks=()) -> RunResult:
    """Train `recipe`'s objective on cfg's data; `callbacks` hear every step after the run's own."""
    started = time.perf_counter()
    method = cfg.data_method()
    # -- setup: data problems surface before any model loads or anything is written
    loaded = load_data(cfg, method)
    if recipe.check is not None:
        recipe.check(loaded)
    screening = screen_records(loaded.train + loaded.val, num_workers(cfg))
    if screening.bad and recipe.bad_input == "error":
        raise_bad_records(screening, method)
    run = start_run(cfg, backend, overwrite, echo, started, callbacks, head=recipe.head)   # output_dir locked, model
    handle, out = run.handle, run.out
    data = prepare_data(cfg, handle.tokenizer, loaded, method=method, ranks=backend.ranks)
    # An example with no target left after truncation is one whose prompt fills sequence_len.
    no_room = data.report.dropped_no_target
    if no_room and recipe.bad_input == "error":
        raise DataError(loaded.train[0].name, None,
                        f"{no_room} examples leave no room for the completion within data.sequence_len "
                        f"({cfg.data.sequence_len}); raise sequence_len, shorten the prompts, or set bad_pairs: drop")
    train, val = drop_screened(data.train, screening), drop_screened(data.val, screening)
    if not train:
        raise DataError(loaded.train[0].name, None, "no usable training examples left after dropping bad ones")
    echo(f"{recipe.describe}: {len(train)} train / {len(val)} held-out examples; "
         + describe_drops(screening, no_room, data.report, cfg.data.sequence_len))
    train_items, val_items = recipe.make_items(train, val)
    run.take_output_dir()                                      # model and data loaded: now the old run goes
    run.attach_adapter()
    if recipe.prepare is not None:
        train_items, val_items = recipe.prepare(backend, handle, train_items, val_items)
    pad = handle.tokenizer.pad_token_id
    evaluated = val_items[: cfg.eval.max_samples or None]
    val_batches = fixed_item_batches(evaluated, cfg.eval.batch_size, pad, recipe.collate)

    def held_out() -> EvalResult:
        return evaluate_objective(backend, handle, val_batches, recipe.objective, len(evaluated))

    measure = held_out if val_batches else None
    run.measure_before(measure)
    trainer = backend.create_trainer(handle, cfg.training)    # the runtime's optimizer step (trainer.py)
    batcher = Batcher.from_config(train_items, cfg, pad, collate_fn=recipe.collate, ranks=backend.ranks)
    steps = run.restore(trainer, batcher)       # a resumed run: weights, optimizer, RNG, data position

    # -- loop (loop.train_loop), minimising the recipe's objective
    evaluate = (lambda: held_out().for_loop()) if val_batches else None
    stopped_early = train_loop(cfg, run.state, steps, trainer, batcher, run.checkpoints(trainer, batcher),
                               run.callbacks(), evaluate=evaluate, objective=recipe.objective, echo=echo)

    # -- save, then evaluate what was saved
    if recipe.head is not None:
        save_whole(cfg, backend, handle, out, echo)
    else:
        save_trained(cfg, backend, handle, out)
    result = run.result(stopped_early, trainer)
    result.after = run.measure_after(measure)
    # merge: true, but a reward model's output_dir holds the merged model already (save_whole)
    return run.finish(result, len(train), len(val), merge=recipe.head is None, objective=method,
                      dropped=dropped_counts(screening, no_room))


def save_whole(cfg, backend, handle, out: Path, echo) -> None:
    """A scalar-head model is only useful whole: output_dir gets the complete model (adapter merged
    in, at the training dtype, so scores stay exact), loadable with AutoModelFor*Classification
    alone; the adapter, with its trained head, goes to output_dir/adapter for PEFT users."""
    with staged_final(out, backend.ranks) as stage:          # all written first, then renamed into output_dir (loop.py)
        if cfg.adapter.type == "none":
            backend.save_model(handle, str(stage))
            return
        adapter = stage / ADAPTER_DIR
        backend.save_adapter(handle, str(adapter))       # collective in a distributed run; rank 0 writes
        if not backend.ranks.is_main:
            return                  # under ddp rank 0 holds the whole model too, and merges it alone
        save_tokenizer(handle.tokenizer, adapter)
        dtype = "float32" if cfg.model.dtype == "auto" else cfg.model.dtype
        backend.merge_and_save(handle, str(stage), dtype)
    echo(f"saved the whole model ({dtype}, adapter merged) to {out}; the adapter alone to {out / ADAPTER_DIR}")


def raise_bad_records(screening: Screening, method: str) -> None:
    counts = ", ".join(f"{n} {reason}" for reason, n in screening.counts().items())
    where = "; ".join(f"{src}: {reason}" for src, reason in list(screening.bad.items())[:SHOWN])
    more = f" (and {len(screening.bad) - SHOWN} more)" if len(screening.bad) > SHOWN else ""
    raise DataError("data", None, f"method {method}: {len(screening.bad)} records would teach nothing ({counts}): "
                                  f"{where}{more}; fix them, or set bad_pairs: drop to leave them out")


def describe_drops(screening: Screening, no_room: int, report, sequence_len: int) -> str:
    parts = [f"{n} {reason}" for reason, n in screening.counts().items()]
    if no_room:
        parts.append(f"{no_room} with no room for the completion within sequence_len {sequence_len}")
    if report.dropped_too_long:
        parts.append(f"{report.dropped_too_long} longer than sequence_len (data.truncation: drop)")
    dropped = f"dropped {', '.join(parts)}" if parts else "nothing dropped"
    return f"{dropped}; {report.truncated} truncated"


def dropped_counts(screening: Screening, no_room: int) -> dict[str, int]:
    """run_summary.json's `dropped`: examples left out, by reason."""
    return {**screening.counts(), **({"no room within sequence_len": no_room} if no_room else {})}

