"""`method: gptq`: post-training quantization calibrated on the config's data. No optimizer, no steps.

One recipe for every backend; what GPTQ is on each comes from `backend.plan_gptq` (protocol.GptqPlan).
The torch backends (cpu, cuda, rocm) run mudpuppy's own GPTQ (backends/torch/quantization/gptq/method.py): 2, 3, 4 and 8
bits; groups of any power of two or one per row; symmetric or asymmetric grids; act-order
(desc_act); damping raised automatically when the Cholesky factorisation fails, then round-to-nearest
for that set of layers (reported); true-sequential quantization inside each block, block after block
with the quantized outputs fed forward, one decoder layer on the device at a time. Output: the
standard GPTQ layout (backends/torch/quantization/gptq/format.py) that transformers + optimum/gptqmodel, AutoGPTQ,
GPTQModel, vLLM and TGI read, and mudpuppy loads back for eval, chat, export and as a frozen base for
LoRA. The mlx backend delegates to mlx-lm's GPTQ (backends/mlx/gptq.py says what it refuses) and
writes an mlx-lm model directory.

Does not: quantize the embeddings or the output head (torch); resume (there is nothing to resume:
a run takes minutes, not hours, on the models it is for).

Setup (data, calibration sample, output directory), then the baselines (held-out loss of the
original model and of round-to-nearest at the same bits and groups), then GPTQ, save, and the
held-out loss of the model read back from what was saved.
"""

from __future__ import annotations

import random
import time

from ..data import load_data, prepare_sft_data
from ..errors import DataError, MudpuppyError
from ..evaluation import evaluate, loss_table
from ..output_dir import start_output_dir
from . import results
from .loop import RunResult, staged_final


def run_gptq(cfg, backend, overwrite: bool = False, echo=print) -> RunResult:
    if cfg.resume:
        raise MudpuppyError("--resume: method gptq writes no checkpoints (it trains nothing); run it again with "
                            "--overwrite")
    started = time.perf_counter()
    gptq = backend.plan_gptq(cfg.gptq)                     # settings this backend cannot honour, before loading
    # -- setup: data, model and settings problems surface before anything is written
    loaded = load_data(cfg, "sft")
    backend.seed(cfg.training.seed)
    handle = backend.load_model(cfg.model, cfg.training.precision)
    gptq.check(handle)                                     # unknown module names, unpackable shapes
    data = prepare_sft_data(cfg, handle.tokenizer, loaded, ranks=backend.ranks)
    calibration = pick_calibration(data.train, cfg.gptq.calibration_samples, cfg.training.seed)
    if not calibration:
        raise DataError(loaded.train[0].name if loaded.train else "data.datasets", None,
                        "no training examples left to calibrate GPTQ on (the datasets are empty, or every "
                        "example was dropped); gptq calibrates on data.datasets")
    out, _ = start_output_dir(cfg, overwrite, echo, ranks=backend.ranks)    # model and data loaded: lock, replace, config
    tokens = sum(len(e.input_ids) for e in calibration)
    echo(f"gptq: {gptq.description}; calibrating on {len(calibration)} of {len(data.train)} training examples "
         f"({tokens:,} tokens); {len(data.val)} held-out examples")
    measure = bool(data.val) and (cfg.eval.loss or cfg.eval.exact_match)
    original = rtn = None
    if measure and cfg.eval.before_training:
        original = evaluate(backend, handle, data, cfg.eval)
        echo(f"original:         {original.describe()}")
        gptq.round_to_nearest(handle)
        rtn = evaluate(backend, handle, data, cfg.eval)
        echo(f"round-to-nearest: {rtn.describe()}")

    # -- quantize and save (the handle's model is released)
    with staged_final(out, backend.ranks) as stage:       # written beside, renamed into output_dir once complete (loop.py)
        own = gptq.quantize(handle, cfg.model, [e.input_ids for e in calibration], stage, echo)
    del handle
    echo(f"saved the {gptq.label} model to {out}")

    # -- evaluate what was saved, read back as any later run reads it
    result = RunResult(out, 0)
    result.before = original
    if measure:
        reread = backend.load_model(cfg.model.model_copy(update={"base_model": str(out), "tokenizer": None,
                                                                 "revision": None}), cfg.training.precision)
        result.after = evaluate(backend, reread, data, cfg.eval)
        result.model = reread
        echo(f"{gptq.label + ':':<18}{result.after.describe()}")
        if rtn is not None and original is not None and original.loss is not None:
            echo(loss_table([("original", original), ("round-to-nearest", rtn), ("GPTQ", result.after)]))
    result.seconds = time.perf_counter() - started
    results.write_summary(out, backend.ranks, _summary(cfg, result, rtn, own, len(data.train), len(data.val)))
    return result


def pick_calibration(train: list, count: int, seed: int) -> list:
    """`count` training examples drawn without replacement under the run's seed (all when fewer), in their
    original order: a file sorted by topic still calibrates on every topic."""
    if len(train) <= count:
        return list(train)
    chosen = sorted(random.Random(seed).sample(range(len(train)), count))
    return [train[i] for i in chosen]


def _summary(cfg, result: RunResult, rtn, own: dict, n_train: int, n_val: int) -> dict:
    """run_summary.json: the run's numbers, with the backend's own keys (its format, its report)."""
    before, after = result.before, result.after
    return {
        "status": "finished",
        "method": "gptq",
        "adapter": "none",
        "base_model": cfg.model.base_model,
        "steps": 0,
        "train_examples": n_train,
        "val_examples": n_val,
        **own,
        "heldout_loss": {
            "original": before.loss if before else None,
            "round_to_nearest": rtn.loss if rtn else None,
            "gptq": after.loss if after else None,
        },
        "seconds": round(result.seconds, 1),
        "eval_before": before.as_dict() if before else None,
        "eval_round_to_nearest": rtn.as_dict() if rtn else None,
        "eval_after": after.as_dict() if after else None,
    }
