"""What a quantization costs: a written GGUF's held-out perplexity beside the merged model's it was written from.

    data        the run's held-out sets (data.val_datasets) or --eval-data FILE, tokenized as `mudpuppy eval`
                tokenizes a data file for that source (evaluation.suite.tokenize_for: the run's template,
                masks and sequence_len), the first records up to --eval-tokens tokens (EVAL_TOKENS)
    merged      the float model the GGUF was written from, loaded through the backend
    dequantized every tensor of the written GGUF dequantized by gguf-py (gguf.quants.dequantize), put back
                where the writer took it from (the writer's own plan, run over tensors whose values are their
                positions: q/k un-permuted, experts unstacked, norms unshifted), saved as a float32 model
                directory and loaded through the backend like any model
    llama.cpp   the GGUF itself through llama-cpp-python's evaluation, where `llama_cpp` imports

Both models are scored by the held-out code the runs use (evaluation.metrics.perplexity: the mean loss
over the tokens the run trains on), so an f32 GGUF scores what the merged model scores.
"""

from __future__ import annotations

import gc
import json
import math
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..errors import DataError, MudpuppyError
from ..evaluation.heldout import generate_answers
from ..evaluation.metrics import METRICS, perplexity
from ..evaluation.suite import read_data, tokenize_for
from .gguf import extra_tensors, family_of, plan_tensors
from .tensors import model_tensors, write_float_model

EVAL_TOKENS = 4096            # --eval-tokens default: seconds per model on a 135M model on 2 cores
_LOCAL = (1 << 32) - 1        # a position's index within its tensor; the tensor's number above it


@dataclass
class Heldout:
    """The held-out examples an export is scored on."""
    name: str                 # the data, as shown
    examples: list            # data.Example, in file order
    records: list[dict]       # the records behind them (generation prompts)
    tokens: int               # input tokens of `examples`


def check_eval_options(fmt: str, evaluate: bool, eval_data: str | None, eval_tokens: int | None) -> None:
    """--eval-data / --eval-tokens / --no-eval, before anything loads."""
    given = "--eval-data" if eval_data is not None else "--eval-tokens" if eval_tokens is not None else None
    if given is None:
        return
    if fmt not in ("gguf", "ollama"):
        raise MudpuppyError(f"{given} sets up the held-out perplexity of a GGUF (--format gguf or ollama); "
                            f"--format {fmt} writes none")
    if not evaluate:
        raise MudpuppyError(f"{given} sets up the held-out perplexity that --no-eval skips; give one or the other")
    if eval_tokens is not None and (isinstance(eval_tokens, bool) or not isinstance(eval_tokens, int)
                                    or eval_tokens < 1):
        raise MudpuppyError(f"--eval-tokens {eval_tokens}: give a whole number of tokens, 1 or more "
                            f"(default {EVAL_TOKENS})")


def heldout_for(src, tokenizer, eval_data: str | None, eval_tokens: int | None) -> Heldout | str:
    """The examples to score (a file's problems raised here, before any merge), or why there are none."""
    column = src.column
    limit = eval_tokens or EVAL_TOKENS
    if eval_data is not None:
        path = Path(eval_data).expanduser()
        if not path.is_file():
            what = "is a directory, not a data file" if path.is_dir() else "file not found"
            raise DataError(eval_data, None, f"--eval-data {what} (looked at {path.resolve()})")
        datasets = [read_data(column, path, None)]
    elif src.kind == "run" and column.cfg.data.val_datasets:
        from ..data.prepare import load_dataset

        datasets = [load_dataset(column.cfg, spec) for spec in column.cfg.data.val_datasets]
    else:
        what = "a run without data.val_datasets" if src.kind == "run" else f"{'an' if src.kind == 'adapter' else 'a'} {src.kind}"
        return f"{src.given} is {what}, so there is no held-out data; give --eval-data FILE"
    examples, records = [], []
    readable = METRICS["perplexity"].formats
    for ds in datasets:
        if ds.format not in readable:
            what = f"holds {ds.format} records; the perplexity reads {', '.join(readable)} records"
            if eval_data is not None:
                raise DataError(ds.name, None, f"--eval-data {what}")
            return f"the run's held-out set {ds.name} {what}: give --eval-data FILE"
        have = sum(len(ex) for ex in examples)
        if have >= limit:
            break
        more, more_records = first_tokens(tokenizer, column, ds, limit - have)
        examples += more
        records += more_records
    return Heldout(", ".join(ds.name for ds in datasets), examples, records, sum(len(ex) for ex in examples))


def first_tokens(tokenizer, column, ds, limit: int) -> tuple[list, list[dict]]:
    """The first examples of `ds` whose tokens reach `limit` (at least one), tokenizing no more records than
    needed (a few times more at most)."""
    count = 64
    while True:
        examples, records = tokenize_for(tokenizer, column, replace(ds, records=ds.records[:count]))
        ends = np.cumsum([len(ex) for ex in examples])
        if ends[-1] >= limit or count >= len(ds.records):
            keep = int(np.searchsorted(ends, limit)) + 1
            return examples[:keep], records[:keep]
        count *= 4


class _Positions:
    """A stored tensor whose values are their own positions (tensor number << 32 | flat index), so the
    writer's plan over it says where each value it writes came from."""

    def __init__(self, number: int, shape: tuple[int, ...]):
        self.number, self.shape = number, tuple(shape)

    def float32(self) -> np.ndarray:
        return (np.int64(self.number) << 32) + np.arange(math.prod(self.shape), dtype=np.int64).reshape(self.shape)


def dequantized_weights(gguf_path: Path, model_dir: Path) -> tuple[dict[str, np.ndarray], dict]:
    """The GGUF's tensors dequantized, under the names and layout of `model_dir` (the model it was written
    from), and the config.json to load them with: a head tied in the model but written apart (a family
    whose llama.cpp graph requires `output.weight`) comes back as its own lm_head."""
    import gguf
    from gguf.quants import dequantize

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    family = family_of(config, str(model_dir))
    stored = model_tensors(model_dir)
    keys = list(stored)
    planned = plan_tensors(config, family, {k: _Positions(i, stored[k].shape) for i, k in enumerate(keys)},
                           "f32", str(model_dir))
    computed = {p.name for p in extra_tensors(config, family)}       # rope factors: from config.json, not weights
    written = {t.name: t for t in gguf.GGUFReader(str(gguf_path)).tensors}
    out: dict[str, np.ndarray] = {}
    for p in planned:
        if p.name in computed:
            continue
        if p.name not in written:
            raise MudpuppyError(f"{gguf_path}: holds no {p.name}, which the writer makes from {model_dir}: "
                                "not a GGUF written from this model")
        tensor = written[p.name]
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(p.shape)
        origin = p.load()
        if origin.dtype.kind == "f":          # a norm written with its shift (Gemma's 1 + weight): undone
            shift = np.float32(family.norm_shift)
            origin = np.rint(origin - float(shift)).astype(np.int64)
            values = values - shift
        numbers = origin >> 32
        for number in np.unique(numbers):
            key = keys[int(number)]
            name = "lm_head.weight" if p.name == "output.weight" and key != "lm_head.weight" else key
            target = out.setdefault(name, np.empty(stored[key].shape, np.float32))
            pick = numbers == number
            target.reshape(-1)[origin[pick] & _LOCAL] = values[pick]
    if "lm_head.weight" in out and "lm_head.weight" not in stored:
        config = {**config, "tie_word_embeddings": False}
    return out, config


def write_dequantized(gguf_path: Path, model_dir: Path, target: Path) -> Path:
    """The GGUF as a float32 model directory beside `model_dir`'s tokenizer files."""
    weights, config = dequantized_weights(gguf_path, model_dir)
    write_float_model(model_dir, target, config, weights)
    return target


def score(backend, model_cfg, model_dir: Path, heldout: Heldout, batch_size: int,
          prompts: list[dict] | None = None, max_new_tokens: int = 8) -> dict:
    """Held-out perplexity (and, with `prompts`, greedy answers) of the model in `model_dir`, loaded in
    float32 through `backend` with `model_cfg`'s other settings, then freed."""
    cfg = model_cfg.model_copy(update={"base_model": str(model_dir), "tokenizer": str(model_dir), "revision": None})
    handle = backend.load_model(cfg, "fp32")
    measured = perplexity(backend, handle, heldout.examples, batch_size)
    if prompts:
        measured["answers"] = [answer for _, answer in
                               generate_answers(backend, handle, prompts, max_new_tokens, batch_size)]
    del handle
    gc.collect()
    return measured


def llama_cpp_perplexity(gguf_path: Path, heldout: Heldout) -> dict | None:
    """The same perplexity through llama.cpp's own evaluation (llama-cpp-python), None where it is not
    installed: each example evaluated alone, its scored tokens' log-probabilities from llama.cpp's logits."""
    try:
        import llama_cpp
    except ImportError:
        return None
    n_ctx = max(len(ex) for ex in heldout.examples)
    llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, verbose=False)
    total, count = 0.0, 0
    try:
        for ex in heldout.examples:
            ids = np.asarray(ex.input_ids, dtype=np.int64)
            at = np.flatnonzero(np.asarray(ex.loss_mask)[1:])      # logits at `at` predict ids[at + 1]
            if not len(at):
                continue
            llm.reset()
            llm.eval(ids.tolist())
            logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)[at]
            top = logits.max(axis=1)
            logz = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
            total += float((logz - logits[np.arange(len(at)), ids[at + 1]]).sum())
            count += len(at)
    finally:
        getattr(llm, "close", lambda: None)()
    loss = total / max(count, 1)
    return {"perplexity": math.exp(min(loss, 50.0)), "nll": loss, "tokens": count,
            "llama_cpp": getattr(llama_cpp, "__version__", "?")}


def measure_gguf(gguf_path: Path, quant: str, model_dir: Path, heldout: Heldout, model_cfg, backend,
                 batch_size: int, work: Path, echo) -> dict:
    """export.json's `perplexity`: the merged model's and the written quant's, a line each in the report."""
    merged = score(backend, model_cfg, model_dir, heldout, batch_size)
    target = write_dequantized(gguf_path, model_dir, Path(work) / "dequantized-gguf")
    try:
        ours = score(backend, model_cfg, target, heldout, batch_size)
    finally:
        shutil.rmtree(target, ignore_errors=True)
    theirs = llama_cpp_perplexity(gguf_path, heldout)
    base = merged["perplexity"]
    echo(f"held-out perplexity on {heldout.name} ({len(heldout.examples)} examples, {heldout.tokens:,} tokens, "
         f"{merged['tokens']:,} scored):")
    echo(f"  merged  {base:.4f}")
    echo(f"  {quant:<7} {ours['perplexity']:.4f} ({change(ours['perplexity'], base)}; mudpuppy's dequantized evaluation)")
    measured = {"mudpuppy": ours["perplexity"]}
    if theirs is None:
        echo("  (llama.cpp: llama_cpp does not import here, so not measured through it)")
    else:
        measured["llama_cpp"] = theirs["perplexity"]
        echo(f"  {quant:<7} {theirs['perplexity']:.4f} ({change(theirs['perplexity'], base)}; llama.cpp "
             f"{theirs['llama_cpp']})")
    return {"data": heldout.name, "examples": len(heldout.examples), "tokens": heldout.tokens,
            "scored_tokens": merged["tokens"], "merged": base, "quants": {quant: measured}}


def change(value: float, base: float) -> str:
    return f"{(value / base - 1) * 100:+.2f}% against merged"
