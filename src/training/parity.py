"""Runtime parity: the first steps of one config on two backends, side by side (`mudpuppy parity`).

Both sides start from the same weights: the base checkpoint, and for LoRA/DoRA the
adapter one side initialises, carried to the other as a PEFT adapter
(backends/adapters.py's layout, which every backend writes and reads). Each side
tokenizes the data itself and builds its batches with the run's own batcher and
seed; the batches are checked to be identical before every step. Each step is
the run's step (its learning-rate schedule over the run's full length, its
accumulation, its objective). What is compared: per step the loss and the
gradient norm (before clipping), and the token counts, which must match exactly;
at the end the trained adapter (or, for full fine-tuning, every weight) in PEFT
layout. The figures are held to tolerances by precision class (TOLERANCES, whose
numbers and how they were measured are in docs/cli.md#mudpuppy-parity).

Supports: method sft (lora, dora, full), method preference (dpo, ipo, simpo,
orpo, kto) and method distill's off-policy mode (the teacher loaded on each side
from its checkpoint; distill.lmbda pinned to 0, since on-policy micro-batches are
sampled from each runtime's own random stream), any pair of backends. Refuses what cannot give the same numbers on
two runtimes by design: GRPO (sampled rollouts), reward and QAT/GPTQ methods,
QLoRA and a quantized teacher (each runtime has its own 4-bit format), adapter dropout (each runtime
draws its own masks). Everything is written in a temporary directory; the
config's output_dir is never touched.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..backends import adapters as fmt
from ..data import Batcher, load_data, prepare_data
from ..errors import MudpuppyError
from .loop import total_steps_for
from .schedule import learning_rate


@dataclass(frozen=True)
class Tolerances:
    """What two runtimes may differ by. loss and grad_norm: |a - b| <= tol * max(1, |a|) (absolute below 1,
    relative above). The trained weights, both measured against the change training made (final minus
    initial weights, on the first side), since that change scales with the learning rate and the steps:
    adapter_max bounds the largest elementwise difference over the largest elementwise change, adapter_rel
    the norm of the difference over the norm of the change."""

    loss: float
    grad_norm: float
    adapter_max: float
    adapter_rel: float


# Measured on the tiny test Llama (10 steps) and SmolLM2-135M-Instruct (the quickstart, 3 and 5 steps), cpu vs
# mlx (docs/cli.md#mudpuppy-parity): loss, grad_norm and adapter_rel sit 5-10x above the worst difference seen.
# adapter_max is a bound, not a precision: Adam moves a weight whose gradient is near zero by about the
# learning rate in whichever direction rounding gives its gradient, so the largest elementwise difference
# can approach the largest change, or pass it, at any precision (measured: 0.38 of it in fp32, 1.22 in bf16);
# it catches a wrong start or a run that went elsewhere.
TOLERANCES = {
    "fp32": Tolerances(loss=3e-4, grad_norm=1e-3, adapter_max=2.0, adapter_rel=5e-3),
    "bf16": Tolerances(loss=3e-2, grad_norm=5e-2, adapter_max=3.0, adapter_rel=0.3),
}

REFUSED_METHODS = {
    "grpo": "GRPO samples its completions from each runtime's own random stream, so the two runs train on "
            "different rollouts by design",
    "rloo": "RLOO samples its completions from each runtime's own random stream, so the two runs train on "
            "different rollouts by design",
    "online_dpo": "online DPO samples its pairs from each runtime's own random stream, so the two runs train on "
                  "different pairs by design",
    "rm": "a reward model's new scalar head is initialised by each runtime's own random stream",
    "prm": "a process reward model's new head is initialised by each runtime's own random stream",
    "gptq": "GPTQ quantizes once without optimizer steps; compare its exports instead",
    "qat": "QAT's fake quantization is torch's (torchao)",
}


@dataclass
class Side:
    """One backend's half of the comparison."""

    name: str
    backend: object
    handle: object = None
    trainer: object = None
    objective: object = None
    batcher: object = None


@dataclass
class StepRow:
    step: int
    lr: float
    loss: tuple[float, float]
    grad_norm: tuple[float | None, float | None]
    tokens: tuple[int, int]
    loss_tokens: tuple[int, int]
    skipped: tuple[bool, bool]

    @property
    def loss_diff(self) -> float:
        return abs(self.loss[0] - self.loss[1])

    @property
    def grad_diff(self) -> float | None:
        a, b = self.grad_norm
        return None if a is None or b is None else abs(a - b)


@dataclass
class ParityResult:
    backends: tuple[str, str]
    devices: tuple[str, str]
    method: str
    adapter: str
    precision: str                 # what both sides ran at (auto pinned to fp32)
    tolerance_class: str           # fp32 or bf16
    tolerances: Tolerances
    steps_asked: int
    run_steps: int                 # the run's full length, which the schedule follows
    rows: list[StepRow] = field(default_factory=list)
    compared: str = ""             # "adapter" or "weights"
    tensors: int = 0
    max_abs: float = 0.0
    max_update: float = 0.0        # the largest elementwise change training made (first side), for scale
    relative: float = 0.0
    worst_tensor: str = ""
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict:
        data = asdict(self)
        data["ok"] = self.ok
        data["rows"] = [{**asdict(r), "loss_diff": r.loss_diff, "grad_norm_diff": r.grad_diff} for r in self.rows]
        return data


# --------------------------------------------------------------------------- checks before anything loads

def check_supported(cfg) -> None:
    """Refuse, in one message, a config whose two runs cannot give the same numbers by design."""
    if cfg.method in REFUSED_METHODS:
        raise MudpuppyError(f"method {cfg.method}: parity compares sft, preference and distill runs; "
                            f"{REFUSED_METHODS[cfg.method]}")
    if cfg.method == "distill" and cfg.distill.teacher_quantize:
        raise MudpuppyError("distill.teacher_quantize: each runtime quantizes the teacher to its own 4-bit format, "
                            "so the two runs differ by the quantization, not the runtime; compare with "
                            "--set distill.teacher_quantize=false")
    if cfg.adapter.type == "qlora":
        raise MudpuppyError("adapter.type qlora: each runtime quantizes the base to its own 4-bit format, so the "
                            "two runs differ by the quantization, not the runtime; compare with adapter.type lora")
    if cfg.adapter.dropout > 0:
        raise MudpuppyError(f"adapter.dropout {cfg.adapter.dropout}: each runtime draws its own dropout masks, so "
                            "the two runs differ by design; compare with --set adapter.dropout=0")


def pin_precision(cfg):
    """The config both sides run: training.precision auto pinned to fp32.

    auto resolves per runtime (bf16 autocast on a torch CPU or GPU with native bf16, fp32 on MLX's CPU
    build, bf16 on a Metal GPU), and two runs at two precisions differ by the rounding, not the runtime
    (measured on the quickstart: losses 10% apart by step 4). fp32 and bf16 are compared as asked."""
    if cfg.training.precision != "auto":
        return cfg
    return cfg.model_copy(update={"training": cfg.training.model_copy(update={"precision": "fp32"})})


def off_policy(cfg, echo):
    """distill's config with lmbda pinned to 0: on-policy micro-batches are sampled from each runtime's own
    random stream, so parity compares the off-policy mode (the teacher over the data's completions)."""
    if cfg.method != "distill" or cfg.distill.lmbda == 0:
        return cfg
    echo(f"distill.lmbda {cfg.distill.lmbda:g} pinned to 0: parity compares distillation's off-policy mode "
         "(on-policy samples come from each runtime's own random stream)")
    return cfg.model_copy(update={"distill": cfg.distill.model_copy(update={"lmbda": 0.0})})


def tolerance_class(precision: str) -> str:
    """fp32 for fp32, bf16 for the 16-bit precisions."""
    return "fp32" if precision == "fp32" else "bf16"


# --------------------------------------------------------------------------- the run

def run_parity(cfg, backends: list, names: list[str], steps: int, echo=print) -> ParityResult:
    """Run `steps` optimizer steps of `cfg` on both backends from the same start; compare as they go."""
    check_supported(cfg)
    cfg = off_policy(pin_precision(cfg), echo)
    method = cfg.data_method()
    loaded = load_data(cfg, method)                  # data problems surface before any model loads
    if cfg.method == "distill":
        from .distill import check_vocabularies

        check_vocabularies(cfg)
    sides = [Side(n, b) for n, b in zip(names, backends)]
    klass = tolerance_class(cfg.training.precision)
    shown = "distill" if cfg.method == "distill" else method      # the data method is sft's there
    result = ParityResult(tuple(names), tuple(b.device for b in backends), shown, cfg.adapter.type,
                          cfg.training.precision, klass, TOLERANCES[klass], steps, 0)
    with tempfile.TemporaryDirectory(prefix="mudpuppy-parity-") as tmp:
        work = Path(tmp)
        init = start_from_same_weights(cfg, sides, work, echo)
        for side in sides:
            items = training_items(cfg, side, loaded, method)
            side.batcher = Batcher.from_config(items, cfg, side.handle.tokenizer.pad_token_id,
                                               collate_fn=collate_for(method))
            side.trainer = side.backend.create_trainer(side.handle, cfg.training)
            side.objective = objective_for(cfg, side.backend, side.name)
        result.run_steps = total_steps_for(cfg, sides[0].batcher)
        n = min(steps, result.run_steps)
        if n < steps:
            echo(f"the run has {result.run_steps} steps; comparing those")
        for line in header(names):
            echo(line)
        for step in range(n):
            result.rows.append(one_step(cfg, sides, step, result.run_steps, result))
            echo(format_row(result.rows[-1]))
        compare_final(cfg, sides, init, work, result)
    judge(result)
    return result


def start_from_same_weights(cfg, sides: list[Side], work: Path, echo) -> Path:
    """Load the model on both sides with identical trainable weights; returns where the initial ones are
    saved (PEFT layout, or the whole model for full fine-tuning).

    Full fine-tuning starts both from the base checkpoint. An adapter is initialised on the first side
    (as its run would: the run's seed, and the config's own adapter.init_from if any), saved, and the
    second side attaches its adapter from that one (adapter.init_from, which every backend reads)."""
    first, second = sides
    first.handle = load(cfg, first)
    info = attach(cfg, first, cfg.adapter)
    init = work / "init"
    if cfg.adapter.type == "none":
        first.backend.save_model(first.handle, str(init))
    else:
        first.backend.save_adapter(first.handle, str(init))
    echo(f"adapter: {info.describe()}" + ("" if cfg.adapter.type == "none" else f"; initialised on {first.name}"))
    second.handle = load(cfg, second)
    # PiSSA and OLoRA start from the base's own factors, the same on every runtime; their saved adapter is
    # already the rank-2r plain LoRA an export reads, which init_from could not take as the starting point.
    derived = cfg.adapter.type == "none" or cfg.adapter.init in ("pissa", "olora")
    same_start = cfg.adapter if derived else cfg.adapter.model_copy(update={"init_from": str(init)})
    attach(cfg, second, same_start)
    return init


def load(cfg, side: Side):
    """Seed with the run's seed, then load: a run's order, so the adapter initialises as in the run."""
    side.backend.seed(cfg.training.seed)
    return side.backend.load_model(cfg.model, cfg.training.precision, adapter=cfg.adapter)


def attach(cfg, side: Side, adapter_cfg):
    """attach_adapter, a refusal named by the backend that refused."""
    try:
        return side.backend.attach_adapter(side.handle, adapter_cfg)
    except MudpuppyError as exc:
        raise MudpuppyError(f"{side.name} cannot run this config: {exc}") from exc


def training_items(cfg, side: Side, loaded, method: str) -> list:
    """This side's training items, tokenized by its own tokenizer, prepared as the method's recipe does."""
    data = prepare_data(cfg, side.handle.tokenizer, loaded, method=method)
    if cfg.method in ("sft", "distill"):
        return data.train
    from ..data.pairs import drop_screened, kto_items, pair_items, screen_records
    from .preference import precompute_reference
    from .runner import raise_bad_records

    pref = cfg.preference
    screening = screen_records(loaded.train + loaded.val)
    if screening.bad and pref.bad_pairs == "error":
        raise_bad_records(screening, method)        # as the run would refuse them
    train = drop_screened(data.train, screening)
    items = kto_items(train, cfg.data.sequence_len) if pref.type == "kto" else pair_items(train)
    if pref.precompute_ref and pref.needs_reference:
        items = precompute_reference(side.backend, side.handle, items, cfg.eval.batch_size,
                                     side.handle.tokenizer.pad_token_id)
    return items


def collate_for(method: str):
    from ..data import collate
    from ..data.pairs import collate_items

    return collate if method == "sft" else collate_items


def objective_for(cfg, backend, name: str):
    if cfg.method == "sft":
        return None
    if cfg.method == "distill":
        from .distill import DistillObjective, load_teacher

        try:
            teacher = load_teacher(cfg, backend)
        except MudpuppyError as exc:
            raise MudpuppyError(f"{name} cannot load the teacher: {exc}") from exc
        return DistillObjective(backend, teacher, cfg.distill)
    from .preference import PreferenceObjective

    return PreferenceObjective(backend, cfg.preference)


def one_step(cfg, sides: list[Side], step: int, total: int, result: ParityResult) -> StepRow:
    lr = learning_rate(cfg.training, step, total)
    micro = [[s.batcher.next_batch() for _ in range(cfg.training.gradient_accumulation_steps)] for s in sides]
    if not all(np.array_equal(token_ids(a), token_ids(b)) for a, b in zip(*micro)):
        result.failures.append(f"step {step + 1}: the two sides' batches differ (their tokenizers encode the data "
                               "differently), so they do not run the same run")
    out = []
    for side, batches in zip(sides, micro):
        res = side.trainer.step(batches, lr) if side.objective is None else side.trainer.step(batches, lr,
                                                                                               side.objective)
        out.append(res)
    a, b = out
    return StepRow(step + 1, lr, (a.loss, b.loss), (a.grad_norm, b.grad_norm), (a.tokens, b.tokens),
                   (a.loss_tokens, b.loss_tokens), (a.skipped, b.skipped))


def token_ids(batch) -> np.ndarray:
    """The token ids of a micro-batch: a data.Batch, or an ItemBatch holding one."""
    return getattr(batch, "batch", batch).input_ids


# --------------------------------------------------------------------------- the final weights

def compare_final(cfg, sides: list[Side], init: Path, work: Path, result: ParityResult) -> None:
    finals = []
    for i, side in enumerate(sides):
        path = work / f"final-{i}"
        if cfg.adapter.type == "none":
            side.backend.save_model(side.handle, str(path))
        else:
            side.backend.save_adapter(side.handle, str(path))
        finals.append(path)
    read = model_tensors if cfg.adapter.type == "none" else peft_tensors
    a, b, start = read(finals[0]), read(finals[1]), read(init)
    missing = sorted(set(a) ^ set(b))
    if missing:
        result.failures.append(f"final weights: {len(missing)} tensors are on one side only, e.g. {missing[0]}")
    result.compared = "weights" if cfg.adapter.type == "none" else "adapter"
    (result.max_abs, result.max_update, result.relative, result.worst_tensor,
     result.tensors) = diff_tensors(a, b, start)


def peft_tensors(path: Path) -> dict[str, np.ndarray]:
    tensors, _ = fmt.read_safetensors(Path(path) / fmt.PEFT_WEIGHTS)
    return {name: t.to_float32() for name, t in tensors.items()}


def model_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a saved model directory (one file or shards), as float32."""
    out = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        tensors, _ = fmt.read_safetensors(file)
        out.update({name: t.to_float32() for name, t in tensors.items()})
    return out


def diff_tensors(a: dict, b: dict, start: dict) -> tuple[float, float, float, str, int]:
    """(largest |a - b|, largest |a - start|, ||a - b|| / ||a - start||, the tensor holding the largest
    difference, tensors compared)."""
    max_abs, max_update, worst, diff_sq, update_sq = 0.0, 0.0, "", 0.0, 0.0
    names = sorted(set(a) & set(b))
    for name in names:
        d = np.abs(a[name].astype(np.float64) - b[name])
        if d.size and d.max() > max_abs:
            max_abs, worst = float(d.max()), name
        diff_sq += float((d * d).sum())
        if name in start:
            u = a[name].astype(np.float64) - start[name]
            update_sq += float((u * u).sum())
            max_update = max(max_update, float(np.abs(u).max()) if u.size else 0.0)
    if diff_sq == 0.0:
        relative = 0.0
    else:
        relative = math.sqrt(diff_sq / update_sq) if update_sq > 0 else math.inf
    return max_abs, max_update, relative, worst, len(names)


# --------------------------------------------------------------------------- judging and showing

def judge(result: ParityResult) -> None:
    """Every figure against its tolerance; each one beyond it becomes a failure naming step and figure."""
    tol, (na, nb) = result.tolerances, result.backends
    for r in result.rows:
        if r.tokens[0] != r.tokens[1] or r.loss_tokens[0] != r.loss_tokens[1]:
            result.failures.append(f"step {r.step}: tokens counted differ ({na} {r.tokens[0]}/{r.loss_tokens[0]}, "
                                   f"{nb} {r.tokens[1]}/{r.loss_tokens[1]} tokens/loss units)")
        if r.skipped[0] != r.skipped[1]:
            skipper = na if r.skipped[0] else nb
            result.failures.append(f"step {r.step}: {skipper} skipped the update (non-finite loss or gradient)")
        if not within(r.loss[0], r.loss[1], tol.loss):
            result.failures.append(f"step {r.step}: loss differs by {r.loss_diff:.3g} ({na} {r.loss[0]:.6f}, "
                                   f"{nb} {r.loss[1]:.6f}; tolerance {tol.loss:g})")
        ga, gb = r.grad_norm
        if ga is not None and gb is not None and not within(ga, gb, tol.grad_norm):
            result.failures.append(f"step {r.step}: gradient norm differs by {r.grad_diff:.3g} ({na} {ga:.6f}, "
                                   f"{nb} {gb:.6f}; tolerance {tol.grad_norm:g})")
    what = f"final {result.compared}"
    if not result.max_abs <= tol.adapter_max * result.max_update:
        result.failures.append(f"{what}: max |difference| {result.max_abs:.3g} in {result.worst_tensor}, "
                               f"{share(result.max_abs, result.max_update)} of the largest change training made "
                               f"({result.max_update:.3g}; tolerance {tol.adapter_max:g})")
    if not result.relative <= tol.adapter_rel:
        result.failures.append(f"{what}: relative difference {result.relative:.3g} of the update "
                               f"(tolerance {tol.adapter_rel:g})")


def share(part: float, whole: float) -> str:
    return f"{part / whole:.3g}" if whole > 0 else ("0" if part == 0 else "inf")


def within(a: float, b: float, tol: float) -> bool:
    """|a - b| <= tol * max(1, |a|); False for any non-finite figure unless both are the same."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return a == b or (math.isnan(a) and math.isnan(b))
    return abs(a - b) <= tol * max(1.0, abs(a))


def header(names) -> list[str]:
    a, b = names
    return [f"{'step':>4}  {'lr':>9}  {'loss ' + a:>11}  {'loss ' + b:>11}  {'|diff|':>8}  "
            f"{'grad ' + a:>11}  {'grad ' + b:>11}  {'|diff|':>8}"]


def format_row(r: StepRow) -> str:
    ga, gb = (f"{g:.6f}" if g is not None else "-" for g in r.grad_norm)
    gd = f"{r.grad_diff:.2e}" if r.grad_diff is not None else "-"
    return (f"{r.step:>4}  {r.lr:>9.3e}  {r.loss[0]:>11.6f}  {r.loss[1]:>11.6f}  {r.loss_diff:>8.2e}  "
            f"{ga:>11}  {gb:>11}  {gd:>8}")


def summary_lines(result: ParityResult) -> list[str]:
    tol = result.tolerances
    layout = "PEFT layout" if result.compared == "adapter" else "as saved"
    lines = [f"final {result.compared} ({result.tensors} tensors, {layout}): max |diff| {result.max_abs:.2e}, "
             f"{share(result.max_abs, result.max_update)} of the largest change {result.max_update:.2e} (tolerance "
             f"{tol.adapter_max:g}); relative to the update {result.relative:.2e} (tolerance {tol.adapter_rel:g})",
             f"tolerances ({result.tolerance_class}, training.precision {result.precision}): loss {tol.loss:g}, "
             f"grad norm {tol.grad_norm:g} (absolute below 1, relative above)"]
    if result.ok:
        lines.append(f"parity: {result.backends[0]} and {result.backends[1]} agree within tolerances over "
                     f"{len(result.rows)} steps")
    else:
        lines += [f"parity: beyond tolerance: {f}" for f in result.failures]
    return lines
