"""Quantization-aware training (`method: qat`): SFT with fake-quantized weights, converted to a real
low-bit model at the end, and measured against post-training quantization of the same fine-tune.

Supports: everything SFT's loop does (it is SFT's loop: data, schedule, accumulation, checkpoints,
resume, early stopping, held-out checks), full fine-tuning and LoRA; int4 or int8 weights in
symmetric groups, optionally int8 dynamic per-token activations; `fake_quant_after_n_steps`;
the torch backends (cpu, cuda, rocm), in one process. Not supported: DoRA, QLoRA, adapter
dropout (backends/torch/quantization/qat/layers.py says why), the mlx backend (its `plan_qat` refuses),
distributed runs. What QAT is on a backend comes from `backend.plan_qat` (protocol.QatPlan).

    setup           data; the group size checked against the model's layers; model, adapter,
                    torchao fake quantizers (backends/torch/quantization/qat/layers.py), switched off
    PTQ baseline    the same fine-tune without fake quantization, then round-to-nearest at the
                    same bits and group size, measured on the held-out data (see below)
    loop            SFT's train_loop; fake quantization switched on from step
                    fake_quant_after_n_steps (0: from the start)
    save            output_dir: the converted model (codes + scales, backends/torch/quantization/qat/files.py's
                    layout), loadable by mudpuppy; output_dir/trained: the fine-tuned float
                    weights (the LoRA adapter, or the whole model); merged/ with merge: true
    report          held-out loss (and exact match) of the float fine-tune, PTQ, QAT with fake
                    quantization, and QAT converted

The comparison the issue asks for, "PTQ (round-to-nearest of the same fine-tuned model)
against QAT", is read as: the same fine-tuning run (same data order, seed, schedule and
steps) without fake quantization, then quantized by round-to-nearest on the very grid QAT
trains against. Quantizing the QAT-trained weights instead would measure QAT twice. The two
runs are identical until fake quantization starts, so they share their first
`fake_quant_after_n_steps` steps: those run once, the training state is kept, the baseline
finishes, and QAT continues from the kept state. The baseline runs only when there is held-out
data to measure it on and eval.after_training is on; it writes no checkpoints (QAT's branch
does), and its numbers are kept in output_dir/ptq_baseline.json so a resumed run reports them.
"""

from __future__ import annotations

import copy
import json
import shutil
import time

from ..data.tokenizers import save_tokenizer
from ..data import Batcher, load_data, prepare_sft_data
from ..errors import MudpuppyError
from ..evaluation import EvalResult, evaluate
from ..files import write_json_atomic
from ..output_dir import rundir
from . import results
from .loop import Checkpoints, Interrupted, LoopState, RunResult, staged_final, train_loop
from .merge import merge_at_end
from .session import start_run
from .sft import describe_data, loss_check, measure_model

BASELINE = "ptq_baseline.json"
BRANCH_POINT = "qat-branch-point"     # training state where the baseline and QAT part ways (removed after)
TRAINED = "trained"                   # the float fine-tune: adapter or whole model


def run_qat(cfg, backend, overwrite: bool = False, echo=print, callbacks=()) -> RunResult:
    started = time.perf_counter()
    qat = backend.plan_qat(cfg.qat)                       # a backend without fake quantization refuses here
    if backend.ranks.distributed:
        raise MudpuppyError("method qat runs in one process for now (start it without --nproc / torchrun)")
    qat.check_adapter(cfg.adapter)
    # -- setup: data and group-size problems surface before any model loads or anything is written
    loaded = load_data(cfg, "sft")
    qat.check_model(cfg.model)
    run = start_run(cfg, backend, overwrite, echo, started, callbacks)   # output_dir locked, model loaded
    handle, out = run.handle, run.out
    data = prepare_sft_data(cfg, handle.tokenizer, loaded, ranks=backend.ranks)
    run.take_output_dir()                                      # model and data loaded: now the old run goes
    rep = describe_data(data, echo)
    run.measure_before(measure_model(cfg, backend, handle, data))
    run.attach_adapter()
    layers = qat.prepare(handle)
    start_fq = cfg.qat.fake_quant_after_n_steps or 0
    echo(f"qat: {layers.describe()}; fake quantization from step {start_fq + 1}")
    trainer = backend.create_trainer(handle, cfg.training)    # the runtime's optimizer step (trainer.py)
    batcher = Batcher.from_config(data.train, cfg, handle.tokenizer.pad_token_id, ranks=backend.ranks)
    steps = run.restore(trainer, batcher)       # a resumed run: weights, optimizer, RNG, data position
    held_out = loss_check(cfg, backend, handle, data)
    measured = bool(data.val) and cfg.eval.after_training

    # -- the PTQ baseline (a resumed run reads the one it measured), then the loop with fake quantization
    baseline = None
    if run.resume_from is not None:
        baseline = _read_baseline(out) if measured else None
    elif measured:
        run.state, baseline = _ptq_baseline(cfg, backend, qat, handle, trainer, batcher, run.state, steps,
                                             min(start_fq, steps), data, out, echo, held_out, callbacks)
    switching = FakeQuantSwitch(trainer, qat, handle, run.state, start_fq)
    heard = [*results.run_callbacks(cfg, out, echo, backend.ranks), *callbacks]      # no memory phases in QAT's summary
    stopped_early = train_loop(cfg, run.state, steps, switching, batcher, run.checkpoints(trainer, batcher), heard,
                               evaluate=held_out, echo=echo)

    # -- save the float fine-tune, measure it fake-quantized, convert, save and measure the result
    qat.set_fake_quant(handle, True)
    trained = out / TRAINED
    with staged_final(out, backend.ranks) as stage:      # each save written beside, renamed into output_dir once complete
        _save_trained(cfg, backend, handle, stage / TRAINED)
    result = run.result(stopped_early, trainer)
    fake = evaluate(backend, handle, data, cfg.eval) if measured else None
    with staged_final(out, backend.ranks) as stage:
        size = qat.convert(handle, layers, stage)
    echo(f"converted model ({qat.description}, {size / 2**20:.1f} MiB) saved to {out}; "
         f"the fine-tuned float weights to {trained}")
    if measured:
        result.after = evaluate(backend, handle, data, cfg.eval)
        _report(echo, qat.description, baseline, fake, result.after)
    merge_at_end(cfg, backend, out, echo, adapter=trained, what="merged float model")   # on the host
    return run.finish(result, rep.train_examples, rep.val_examples, merge=False,   # merged above, the float model
                      qat=_qat_summary(cfg, layers, baseline, fake, result.after, size, start_fq, steps, measured))


class FakeQuantSwitch:
    """The trainer, with fake quantization switched on before each step from `start` on (off before it,
    and throughout when `enabled` is False: the PTQ baseline's fine-tune)."""

    def __init__(self, trainer, qat, handle, state: LoopState, start: int, enabled: bool = True):
        self.trainer, self.qat, self.handle = trainer, qat, handle
        self.state, self.start, self.enabled = state, start, enabled

    def step(self, micro_batches, lr, objective=None):
        self.qat.set_fake_quant(self.handle, self.enabled and self.state.step >= self.start)
        return self.trainer.step(micro_batches, lr, objective)

    def __getattr__(self, name):
        return getattr(self.trainer, name)


class _Pause(Exception):
    """Raised by `PausingBatcher` to end a loop at the branch point, before a batch is drawn."""


class PausingBatcher:
    """The batcher, refusing to hand out the batches of step `pause_at` (0-based) and after: the loop
    then stops with the data position exactly where the next step would start."""

    def __init__(self, batcher, state: LoopState, pause_at: int):
        self.batcher, self.state, self.pause_at = batcher, state, pause_at

    def next_batch(self):
        if self.state.step >= self.pause_at:
            raise _Pause
        return self.batcher.next_batch()

    def __getattr__(self, name):
        return getattr(self.batcher, name)


def _ptq_baseline(cfg, backend, qat, handle, trainer, batcher, state, steps, branch_at, data, out, echo, held_out,
                  callbacks=()):
    """Train to `branch_at` (shared), keep the state, fine-tune on without fake quantization, measure it
    in float and round-to-nearest, then go back to the kept state. Returns (state at the branch, numbers)."""
    quiet = cfg.model_copy(update={"training": cfg.training.model_copy(update={"save_steps": None})})

    no_checkpoints = Checkpoints(out, lambda _state: None, backend.ranks)

    try:
        if branch_at:
            echo(f"steps 1-{branch_at}: shared by QAT and its PTQ baseline (fake quantization starts after them)")
            try:
                train_loop(quiet, state, steps, FakeQuantSwitch(trainer, qat, handle, state, 0, enabled=False),
                           PausingBatcher(batcher, state, branch_at), no_checkpoints,
                           [*results.run_callbacks(quiet, out, echo, backend.ranks), *callbacks], evaluate=held_out, echo=echo)
            except _Pause:
                pass
        point = out / BRANCH_POINT
        rundir.record(out, [BRANCH_POINT])
        point.mkdir(exist_ok=True)
        backend.save_training_state(handle, trainer, str(point))
        kept = copy.deepcopy(state.as_dict(batcher))     # phase two appends to the same loss lists
        echo(f"PTQ baseline: fine-tuning steps {state.step + 1}-{steps} without fake quantization")
        stopped = train_loop(quiet, state, steps, FakeQuantSwitch(trainer, qat, handle, state, 0, enabled=False),
                             batcher, no_checkpoints, [*results.run_callbacks(quiet, out, echo, backend.ranks), *callbacks],
                             evaluate=held_out, echo=echo)
    except Interrupted:
        raise Interrupted("interrupted during the PTQ baseline, before QAT's own steps; no checkpoint is written "
                          "until they start: run again with --overwrite") from None
    qat.set_fake_quant(handle, False)
    plain = evaluate(backend, handle, data, cfg.eval)
    qat.set_fake_quant(handle, True)
    ptq = evaluate(backend, handle, data, cfg.eval)
    qat.set_fake_quant(handle, False)
    baseline = {"steps": state.step, "stopped_early": stopped,
                "final_train_loss": state.losses[-1] if state.losses else None,
                "fine_tuned": plain.as_dict(), "ptq": ptq.as_dict()}
    rundir.record(out, [BASELINE])
    write_json_atomic(out / BASELINE, baseline)
    echo(f"PTQ baseline: fine-tuned (float) {plain.describe()}; round-to-nearest {ptq.describe()}")
    backend.load_training_state(handle, trainer, str(point))
    batcher.load_state_dict(kept["batcher"])
    shutil.rmtree(point)
    return LoopState.from_dict(kept), baseline


def _read_baseline(out):
    path = out / BASELINE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _save_trained(cfg, backend, handle, path) -> None:
    """What SFT would save in output_dir (the adapter and tokenizer, or the whole model), in `path`."""
    path.mkdir(parents=True, exist_ok=True)
    if cfg.adapter.type == "none":
        backend.save_model(handle, str(path))    # fake quantizers hold no tensors: the state dict is the model's
    else:
        backend.save_adapter(handle, str(path))
        save_tokenizer(handle.tokenizer, path)


def _baseline_results(baseline: dict | None) -> tuple[EvalResult | None, EvalResult | None]:
    """The PTQ baseline's float fine-tune and its round-to-nearest quantization, as measured (None: not measured)."""
    if baseline is None:
        return None, None
    return EvalResult.from_dict(baseline["fine_tuned"]), EvalResult.from_dict(baseline["ptq"])


def _report(echo, grid: str, baseline, fake: EvalResult, converted: EvalResult) -> None:
    def loss(ev: EvalResult | None) -> str:
        if ev is None:
            return "not measured"
        return "n/a" if ev.loss is None else f"{ev.loss:.4f}"

    plain, ptq = _baseline_results(baseline)
    echo(f"held-out loss ({grid}): fine-tuned float {loss(plain)}, PTQ round-to-nearest {loss(ptq)}, "
         f"QAT fake-quantized {loss(fake)}, QAT converted {loss(converted)}")
    if baseline is None:
        echo("PTQ baseline not measured: this run resumed from a checkpoint written without one")
    echo(f"after conversion: {converted.describe()}")


def _qat_summary(cfg, layers, baseline, fake, converted, size, start_fq, steps, measured) -> dict:
    def numbers(ev: EvalResult | None) -> dict | None:
        return None if ev is None else {k: v for k, v in ev.as_dict().items() if k != "examples"}

    plain, ptq = _baseline_results(baseline)
    return {
        "weight_bits": cfg.qat.weight_bits, "group_size": cfg.qat.group_size, "activations": cfg.qat.activations,
        "fake_quant_after_n_steps": start_fq, "steps_with_fake_quant": max(0, steps - start_fq),
        "quantized_layers": len(layers.names()), "converted_bytes": size,
        "ptq_baseline_run": None if baseline is None else {
            k: baseline[k] for k in ("steps", "stopped_early", "final_train_loss")},
        "heldout": None if not measured else {
            "fine_tuned_float": numbers(plain),
            "ptq_round_to_nearest": numbers(ptq),
            "qat_fake_quantized": numbers(fake),
            "qat_converted": numbers(converted),
        },
    }
