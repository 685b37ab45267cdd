"""`method: gptq`: post-training quantization calibrated on the config's data. No optimizer, no steps.

Supports: 2, 3, 4 and 8 bits; groups of any power of two or one per row; symmetric or asymmetric
grids; act-order (desc_act); damping raised automatically when the Cholesky factorisation fails,
then round-to-nearest for that set of layers (reported); true-sequential quantization inside each
block, block after block with the quantized outputs fed forward, one decoder layer on the device
at a time (quantization/gptq.py). Output: the standard GPTQ layout (quantization/gptq_format.py)
that transformers + optimum/gptqmodel, AutoGPTQ, GPTQModel, vLLM and TGI read, and mudpuppy
loads back for eval, chat, export and as a frozen base for LoRA.

Does not: quantize the embeddings or the output head; calibrate on batches of padded sequences
(each example runs alone, so no padding enters a Hessian); resume (there is nothing to resume:
a run takes minutes, not hours, on the models it is for).

Setup (data, calibration sample, output directory), then the baselines (held-out loss of the
original model and of round-to-nearest at the same bits and groups), then GPTQ, save, and the
held-out loss of the model read back from what was saved.
"""

from __future__ import annotations

import random
import time

from ..data.tokenizers import save_tokenizer
from ..data import load_data, prepare_sft_data
from ..errors import DataError, MudpuppyError
from ..evaluation import EvalResult, evaluate
from . import outputs
from .loop import RunResult

TORCH_BACKENDS = ("cpu", "cuda", "rocm")


def run_gptq(cfg, backend, overwrite: bool = False, echo=print) -> RunResult:
    if cfg.resume:
        raise MudpuppyError("--resume: method gptq writes no checkpoints (it trains nothing); run it again with "
                            "--overwrite")
    if backend.name == "mlx":
        from ..backends.mlx.gptq import run_gptq_mlx

        return run_gptq_mlx(cfg, backend, overwrite, echo)
    if backend.name not in TORCH_BACKENDS:
        raise MudpuppyError(f"method gptq: backend {backend.name} has no GPTQ; use --backend cpu, cuda or rocm")
    return _run_torch(cfg, backend, overwrite, echo)


def _run_torch(cfg, backend, overwrite: bool, echo) -> RunResult:
    from ..quantization.gptq import (
        QuantSpec, load_host_model, plan_linears, quantize_model, round_to_nearest_model, save_quantized,
    )
    from ..quantization.gptq_format import quantization_config

    started = time.perf_counter()
    g = cfg.gptq
    spec = QuantSpec.from_config(g)
    # -- setup: data, model and settings problems surface before anything is written
    loaded = load_data(cfg, "sft")
    backend.seed(cfg.training.seed)
    handle = backend.load_model(cfg.model, cfg.training.precision)
    chosen = plan_linears(handle.model, g.modules)[2]      # unknown module names, unpackable shapes
    data = prepare_sft_data(cfg, handle.tokenizer, loaded)
    calibration = pick_calibration(data.train, g.calibration_samples, cfg.training.seed)
    if not calibration:
        raise DataError(loaded.train[0].name if loaded.train else "data.datasets", None,
                        "no training examples left to calibrate GPTQ on (the datasets are empty, or every "
                        "example was dropped); gptq calibrates on data.datasets")
    out, _ = outputs.start_output_dir(cfg, overwrite, echo)    # model and data loaded: lock, replace, config
    tokens = sum(len(e.input_ids) for e in calibration)
    echo(f"gptq: {spec.bits}-bit, group {'per row' if spec.group_size <= 0 else spec.group_size}, "
         f"{'symmetric' if spec.sym else 'asymmetric'}{', act-order' if spec.desc_act else ''}; calibrating on "
         f"{len(calibration)} of {len(data.train)} training examples ({tokens:,} tokens); "
         f"{len(data.val)} held-out examples")
    measure = bool(data.val) and (cfg.eval.loss or cfg.eval.exact_match)
    original = rtn = None
    if measure and cfg.eval.before_training:
        original = evaluate(backend, handle, data, cfg.eval)
        echo(f"original:         {_describe(original)}")
        round_to_nearest_model(handle.model, spec, g.modules)
        rtn = evaluate(backend, handle, data, cfg.eval)
        echo(f"round-to-nearest: {_describe(rtn)}")
    source, tokenizer = handle.source, handle.tokenizer
    del handle

    # -- quantize: the model in host memory, one decoder layer at a time on the device
    host = load_host_model(source, cfg.model.trust_remote_code)
    report = quantize_model(host, [e.input_ids for e in calibration], spec, backend.device, g.modules,
                            g.true_sequential, echo)
    for line in report.raised_damping:
        echo(f"  damping raised after a failed Cholesky factorisation: {line}")
    for line in report.fallbacks:
        echo(f"  WARNING: rounded to nearest (the Hessian could not be factorised at any damping): {line}")
    from .. import __version__

    blocks = None if g.modules == "all-linear" else [chosen]      # what optimum reads to leave the rest alone
    qconfig = quantization_config(spec.bits, spec.group_size, spec.sym, spec.desc_act, spec.damp_percent,
                                  g.true_sequential, spec.damp_auto_increment, __version__, blocks)
    files = save_quantized(host, out, qconfig, source)
    save_tokenizer(tokenizer, out)           # with the chat template the data was rendered with
    del host
    echo(f"saved the GPTQ model to {out} ({report.linears} linear layers in {report.seconds:.0f} s)")

    # -- evaluate what was saved, read back as any later run reads it
    result = RunResult(out, 0)
    result.before = original
    if measure:
        reread = backend.load_model(cfg.model.model_copy(update={"base_model": str(out), "tokenizer": None,
                                                                 "revision": None}), cfg.training.precision)
        result.after = evaluate(backend, reread, data, cfg.eval)
        result.model = reread
        echo(f"GPTQ:             {_describe(result.after)}")
        if rtn is not None and original is not None and original.loss is not None:
            echo(_table(original, rtn, result.after))
    result.seconds = time.perf_counter() - started
    outputs.write_summary(out, _summary(cfg, result, rtn, report, qconfig, files, len(data.train), len(data.val)))
    return result


def pick_calibration(train: list, count: int, seed: int) -> list:
    """`count` training examples drawn without replacement under the run's seed (all when fewer), in their
    original order: a file sorted by topic still calibrates on every topic."""
    if len(train) <= count:
        return list(train)
    chosen = sorted(random.Random(seed).sample(range(len(train)), count))
    return [train[i] for i in chosen]


def _describe(ev: EvalResult) -> str:
    parts = [f"held-out loss {ev.loss:.4f}"] if ev.loss is not None else []
    if ev.exact_match is not None:
        parts.append(f"exact match {ev.exact_match:.1%}")
    return ", ".join(parts) + f" ({ev.samples} examples)"


def _table(original: EvalResult, rtn: EvalResult, gptq: EvalResult) -> str:
    rows = [("original", original), ("round-to-nearest", rtn), ("GPTQ", gptq)]
    lines = ["held-out loss      loss     vs original"]
    for name, ev in rows:
        lines.append(f"  {name:<16} {ev.loss:.4f}  {ev.loss - original.loss:+.4f}")
    return "\n".join(lines)


def _summary(cfg, result: RunResult, rtn, report, qconfig: dict, files: list[str], n_train: int, n_val: int) -> dict:
    before, after = result.before, result.after
    return {
        "status": "finished",
        "method": "gptq",
        "adapter": "none",
        "base_model": cfg.model.base_model,
        "steps": 0,
        "train_examples": n_train,
        "val_examples": n_val,
        "quantization_config": qconfig,
        "heldout_loss": {
            "original": before.loss if before else None,
            "round_to_nearest": rtn.loss if rtn else None,
            "gptq": after.loss if after else None,
        },
        "gptq": report.as_dict(),
        "files": files,
        "seconds": round(result.seconds, 1),
        "eval_before": before.as_dict() if before else None,
        "eval_round_to_nearest": rtn.as_dict() if rtn else None,
        "eval_after": after.as_dict() if after else None,
    }
