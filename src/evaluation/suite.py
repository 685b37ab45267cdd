"""`mudpuppy eval`: measure runs, adapters and models on one data file, side by side.

Setup, then one model at a time, then the report:

    targets resolved (targets.py), the data read and checked against the metrics, the
    embedding model found (voice.py), the lm-eval tasks found and loaded (harness.py),
    the output directory checked                                     before any model loads
    per column: load (adapter on, or off for --base), tokenize the data with that column's
    chat template and masks, measure every metric (metrics.py, voice.py), run the lm-eval
    tasks on the same loaded model (harness.py), free the model
    the table, eval.json, eval.md and the charts (report.py)

Everything runs through the backend protocol, so cpu, cuda, rocm and mlx measure alike.
`measure` also serves a model that is already loaded (a curriculum stage, a notebook).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..data.prepare import DataReport, LoadedDataset, fit_length, load_dataset, render_options, tokenize_dataset
from ..data.render import as_messages
from ..data.templates import BUILTIN_TEMPLATES, apply_chat_template_choice, is_jinja
from ..errors import DataError, MudpuppyError
from . import harness, voice
from .heldout import generate_answers
from .metrics import (
    ANSWERING, Row, Scoring, check_metrics, default_metrics, generation_scores, perplexity,
    preference_scores, rows_for,
)
from .targets import Column, resolve_targets, with_bases


@dataclass
class EvalOptions:
    """What to measure and how; None means "from the first run's config, else the default"."""

    metrics: list[str] | None = None      # None: what the data format supports
    max_samples: int | None = None        # the first N records of the data file
    regex: str | None = None
    strip: bool = True
    casefold: bool = True
    max_new_tokens: int | None = None     # run's eval.max_new_tokens, else 32
    batch_size: int | None = None         # run's eval.batch_size, else 16
    beta: float | None = None             # run's preference.beta (dpo, ipo, kto), else 0.1
    precision: str = "fp32"
    embedding_model: str | None = None    # voice_fidelity's sentence-transformers model (None: all-MiniLM-L6-v2)
    tasks: list[str] | None = None        # lm-evaluation-harness tasks (torch backends)
    include_path: str | None = None       # a directory of local lm-eval task YAML files
    tasks_chat_template: bool = False     # lm-eval's apply_chat_template for the tasks' prompts

    def resolved(self, columns: list[Column]) -> EvalOptions:
        runs = [c.cfg for c in columns if c.kind == "run"]
        first = runs[0] if runs else None
        pref = next((c.preference for c in runs if c.preference is not None and c.preference.needs_reference), None)
        return replace(
            self, metrics=list(self.metrics) if self.metrics else self.metrics,
            max_new_tokens=self.max_new_tokens or (first.eval.max_new_tokens if first else 32),
            batch_size=self.batch_size or (first.eval.batch_size if first else 16),
            beta=self.beta if self.beta is not None else (pref.beta if pref else 0.1))

    @property
    def scoring(self) -> Scoring:
        return Scoring(self.strip, self.casefold, self.regex)


@dataclass
class ModelResult:
    name: str
    target: str
    kind: str
    description: str
    values: dict[str, float | None]          # row key -> value
    details: dict = field(default_factory=dict)     # nll, tokens, examples, pairs, ...
    answers: list[dict] = field(default_factory=list)   # the first few generations
    misses: list[dict] = field(default_factory=list)    # the first few that missed a metric
    seconds: float = 0.0
    task_rows: list[Row] = field(default_factory=list)  # the lm-eval tasks' metrics, known once they ran


@dataclass
class EvalReport:
    data: str | None          # the data file, as shown (None: lm-eval tasks only)
    format: str | None
    records: int
    metrics: list[str]
    rows: list[Row]
    models: list[ModelResult]
    backend: str
    device: str
    options: EvalOptions


def check_chat_template(value: str | None) -> None:
    if value is None or value == "tokenizer" or value in BUILTIN_TEMPLATES or is_jinja(value):
        return
    raise MudpuppyError(f"--chat-template {value!r}: use 'tokenizer', a built-in template "
                        f"({', '.join(BUILTIN_TEMPLATES)}) or a Jinja template")


def read_data(col: Column, path: Path, max_samples: int | None) -> LoadedDataset:
    """The data file's records, read with the column's dataset options (field_map, roles_to_train,
    train_on_eos, system_prompt...: those of the run's held-out set, else its training set)."""
    like = (col.cfg.data.val_datasets or col.cfg.data.datasets)[0]
    spec = like.model_copy(update={"path": str(path.resolve()), "type": "auto", "split": "train",
                                   "subset": None, "num_samples": max_samples, "weight": None})
    return load_dataset(col.cfg, spec)


def plan(targets: list[str], data: str | None, options: EvalOptions, base: bool = False,
         base_model: str | None = None, chat_template: str | None = None, trust_remote_code: bool = False
         ) -> tuple[list[Column], list[LoadedDataset | None], EvalOptions]:
    """Columns, each one's records (None each without --data), and the options resolved: every user
    mistake found here, before any model loads (the lm-eval tasks' datasets are read here too)."""
    check_chat_template(chat_template)
    if data is None and not options.tasks:
        raise MudpuppyError("nothing to measure: give --data FILE (perplexity, generation, preference and voice "
                            "metrics), --tasks NAMES (lm-evaluation-harness tasks), or both")
    if data is None and (options.metrics or options.regex or options.embedding_model):
        given = "--metrics" if options.metrics else "--regex" if options.regex else "--embedding-model"
        raise MudpuppyError(f"{given} measures records of a data file; give it with --data FILE")
    if (options.include_path or options.tasks_chat_template) and not options.tasks:
        given = "--include-path" if options.include_path else "--tasks-chat-template"
        raise MudpuppyError(f"{given} goes with --tasks NAMES (lm-evaluation-harness tasks); name the tasks to run")
    columns = resolve_targets(targets, base_model, chat_template, trust_remote_code)
    if base:
        columns = with_bases(columns)
    if data is None:
        harness.check_tasks(options.tasks, options.include_path)
        return columns, [None] * len(columns), options.resolved(columns)
    path = Path(data).expanduser()
    if not path.is_file():
        what = "is a directory, not a data file" if path.is_dir() else "file not found"
        raise DataError(data, None, f"--data {what} (looked at {path.resolve()})")
    datasets = [read_data(col, path, options.max_samples) for col in columns]
    options = options.resolved(columns)
    fmt, name = datasets[0].format, datasets[0].name
    metrics = options.metrics or default_metrics(fmt, options.regex)
    if not metrics:
        raise DataError(name, None, f"{fmt} records: no eval metric reads them; perplexity and the generation "
                                    "metrics read chat, text, instruction or completion data, preference reads "
                                    "{prompt, chosen, rejected} pairs")
    if options.regex and "regex" not in metrics:
        metrics = metrics + ["regex"]
    if options.embedding_model and "voice_fidelity" not in metrics:
        metrics = metrics + ["voice_fidelity"]
    for ds in datasets:
        check_metrics(metrics, ds.format, ds.name, options.regex)
    if "voice_fidelity" in metrics:
        voice.resolve_embedding_model(options.embedding_model)
    if options.tasks:          # last: indexing lm-eval's tasks and reading their data is the slow check
        harness.check_tasks(options.tasks, options.include_path)
    options.metrics = metrics
    return columns, datasets, options


def evaluate_columns(backend, columns: list[Column], datasets: list[LoadedDataset | None], options: EvalOptions,
                     echo=print) -> EvalReport:
    results = []
    metrics = options.metrics or []
    for i, (col, ds) in enumerate(zip(columns, datasets), start=1):
        started = time.perf_counter()
        echo(f"[{i}/{len(columns)}] {col.name} ({col.describe()})")
        handle = col.load(backend, options.precision)
        result = measure(backend, handle, col, ds, options)
        del handle
        gc.collect()            # one model in memory at a time
        result.seconds = time.perf_counter() - started
        echo(f"      {summary_line(result, rows_for(metrics) + result.task_rows)} ({result.seconds:.0f} s)")
        results.append(result)
    first = datasets[0]
    rows = rows_for(metrics) + list({row.key: row for r in results for row in r.task_rows}.values())
    return EvalReport(first.name if first else None, first.format if first else None,
                      len(first.records) if first else 0, metrics, rows, results, backend.name,
                      getattr(backend, "device", ""), options)


def measure(backend, handle, col: Column, ds: LoadedDataset | None, options: EvalOptions) -> ModelResult:
    """Every metric of `options` for one loaded model, the data tokenized with `col.cfg`'s settings, then
    its lm-eval tasks (`options.tasks`, torch backends). Options left at None are filled in as `plan`
    fills them (metrics: what the data supports)."""
    options = options.resolved([col])
    result = ModelResult(col.name, col.target, col.kind, col.describe(), {}, {"examples": 0})
    if ds is not None:
        measure_data(backend, handle, col, ds, options, result)
    if options.tasks:
        tasks = harness.run_tasks(backend, handle, harness.plan_for(options.tasks, options.include_path),
                                  options.batch_size, options.max_samples, options.tasks_chat_template)
        result.values.update(tasks.values)
        result.details["tasks"] = tasks.details
        result.task_rows = tasks.rows
    return result


def measure_data(backend, handle, col: Column, ds: LoadedDataset, options: EvalOptions, result: ModelResult) -> None:
    metrics = options.metrics or default_metrics(ds.format, options.regex)
    check_metrics(metrics, ds.format, ds.name, options.regex)
    examples, records = tokenize_for(handle.tokenizer, col, ds)
    values, details = result.values, result.details
    details["examples"] = len(examples)
    if "perplexity" in metrics:
        measured = perplexity(backend, handle, examples, options.batch_size)
        values["perplexity"] = measured.pop("perplexity")
        details.update(measured)
    if any(m in metrics for m in ANSWERING):
        records = conversations(records, ds, handle.tokenizer, col)
        check_conversations(examples, records, ds, metrics)
        pairs = generate_answers(backend, handle, records, options.max_new_tokens, options.batch_size)
        scores, result.answers, result.misses = generation_scores(pairs, metrics, options.scoring)
        values.update(scores)
        if "voice_fidelity" in metrics:
            embedder = voice.load_embedder(voice.resolve_embedding_model(options.embedding_model))
            values["voice_fidelity"], measured = voice.voice_scores(embedder, pairs, [ex.source for ex in examples])
            details.update(measured)
            for row, scored in zip(result.answers, measured["voice_fidelity_per_example"]):
                row["voice_fidelity"] = scored["similarity"]
    if "preference" in metrics:
        measured = preference_scores(backend, handle, examples, options.batch_size, options.beta, col.has_adapter)
        if col.kind == "base":
            measured["reward_margin"] = 0.0     # the base is its own reference: no margin, by definition
        values["preference_accuracy"] = measured.pop("preference_accuracy")
        values["reward_margin"] = measured.pop("reward_margin")
        details.update(measured)


def conversations(records: list[dict], ds: LoadedDataset, tokenizer, col: Column) -> list[dict]:
    """Preference pairs as the conversation their chosen answer completes (system prompt, prompt, chosen),
    rendered through the chat template as training rendered them; other records as they are."""
    if ds.format != "preference":
        return records
    template = apply_chat_template_choice(tokenizer, col.cfg.data.chat_template)
    opts = render_options(ds.spec, template is not None)
    out = []
    for rec in records:
        if not (opts.chat or isinstance(rec["prompt"], list) or isinstance(rec["chosen"], list)):
            out.append(rec)          # plain-text pair: check_conversations names it
            continue
        system = [{"role": "system", "content": opts.system_prompt}] if opts.system_prompt else []
        out.append({**rec, "messages": system + as_messages(rec["prompt"], "user")
                    + as_messages(rec["chosen"], "assistant")})
    return out


def tokenize_for(tokenizer, col: Column, ds: LoadedDataset) -> tuple[list, list[dict]]:
    """Tokens and masks exactly as the column's run would make them for training."""
    template = apply_chat_template_choice(tokenizer, col.cfg.data.chat_template)
    examples, records = tokenize_dataset(ds, tokenizer, template is not None)
    data = col.cfg.data
    examples, records = fit_length(examples, records, data.sequence_len, data.truncation, DataReport())
    if not examples:
        raise DataError(ds.name, None, f"no record has a loss-carrying token within data.sequence_len "
                                       f"({data.sequence_len}) of {col.name}'s settings")
    return examples, records


def check_conversations(examples: list, records: list[dict], ds: LoadedDataset, metrics: list[str]) -> None:
    """Generation answers a conversation's last assistant turn; every record must have one."""
    wanted = ", ".join(m for m in metrics if m in ANSWERING)
    for ex, rec in zip(examples, records):
        messages = rec.get("messages")
        if not messages:
            raise DataError(ds.name, None, f"{wanted}: {ex.source} is {ds.format} data rendered without a chat "
                                           "template, so there is no conversation to answer; give the tokenizer a "
                                           "chat template (--chat-template, or data.chat_template in the run)")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(ds.name, None, f"{wanted}: {ex.source} has no assistant turn to compare an answer with")


def summary_line(result: ModelResult, rows: list[Row]) -> str:
    from .report import format_value

    parts = [f"{row.label} {format_value(row, result.values.get(row.key))}" for row in rows]
    examples = result.details.get("examples", 0)
    return ", ".join(parts) + (f"; {examples} examples" if examples else "")


def run_eval(targets: list[str], data: str | None, options: EvalOptions | None = None, *, backend: str | None = None,
             base: bool = False, base_model: str | None = None, chat_template: str | None = None,
             out: str | None = None, overwrite: bool = False, trust_remote_code: bool = False,
             echo=print) -> tuple[EvalReport, Path]:
    """The whole `mudpuppy eval`: check, measure, write; returns the report and where it was written.
    `trust_remote_code` (--trust-remote-code) lets model code run; a run's own config.yaml never does."""
    from ..backends import create_backend
    from .report import out_dir_for, write_report, writing_report

    columns, datasets, options = plan(targets, data, options or EvalOptions(), base, base_model, chat_template,
                                      trust_remote_code)
    out_dir = out_dir_for(out, columns)
    with writing_report(out_dir, overwrite, echo) as written:    # locked and checked before any model loads
        report = measure_all(columns, datasets, options, create_backend(backend or _run_backend(columns)), echo)
        write_report(report, written.dir, echo, shown=out_dir)
    return report, out_dir


def _run_backend(columns) -> str:
    return next((c.cfg.backend for c in columns if c.kind == "run"), "auto")


def measure_all(columns, datasets, options, impl, echo) -> EvalReport:
    """What run_eval says before it measures, then every column measured (`impl` is a probe until then)."""
    if options.tasks:
        harness.check_backend(impl)
    echo(f"backend: {impl.name} on {impl.device}; precision {options.precision}")
    if datasets[0] is not None:
        echo(f"data: {datasets[0].name} ({datasets[0].format}, {len(datasets[0].records)} records); "
             f"metrics: {', '.join(options.metrics)}")
    if "voice_fidelity" in (options.metrics or []):
        echo(f"voice fidelity: embeddings of {voice.resolve_embedding_model(options.embedding_model).name}")
    if options.tasks:
        echo(f"lm-eval tasks: {', '.join(options.tasks)}"
             + (f" (limit {options.max_samples} per task)" if options.max_samples else ""))
    return evaluate_columns(impl, columns, datasets, options, echo)
