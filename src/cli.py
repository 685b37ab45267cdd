"""The `mudpuppy` command line.

User mistakes end in one message on stderr and exit code 2; `--debug` shows
the traceback. Anything else is a mudpuppy bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import sys
import traceback

import click

from .errors import MudpuppyError


def _handle_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        debug = kwargs.get("debug", False)
        try:
            return fn(*args, **kwargs)
        except MudpuppyError as exc:
            if debug:
                traceback.print_exc()
            if not _reported_to_launcher(str(exc)):
                click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except Exception as exc:
            # A process of a distributed run whose collective failed because another process died:
            # the launcher names that one; this one only says it lost contact.
            from .launch import PEER_LOST, is_peer_loss

            if is_peer_loss(exc) and _reported_to_launcher(f"{PEER_LOST} ({type(exc).__name__})"):
                sys.exit(1)
            _record_crash(exc)
            raise

    return wrapper


def _reported_to_launcher(message: str) -> bool:
    """In one process of a distributed run: hand the failure to the launcher, which prints it once.
    Under a plain torchrun each rank prints its own, prefixed with the rank."""
    from .distributed import from_environment

    ranks = from_environment()
    if not ranks.distributed:
        return False
    from .launch import record_failure

    if record_failure(message):
        return True
    click.echo(f"error (rank {ranks.rank}): {message}", err=True)
    return True


def _record_crash(exc: Exception) -> None:
    """A bug in one process of a distributed run: the launcher names it; the traceback is printed too."""
    from .distributed import from_environment

    if from_environment().distributed:
        from .launch import record_failure

        record_failure(f"crashed with {type(exc).__name__}: {exc} (traceback above)")


config_option = click.option("--config", "-c", "config_path", required=True,
                             type=click.Path(dir_okay=False), help="The run's YAML file.")
set_option = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                          help="Override a config value, e.g. --set training.max_steps=5 (repeatable).")
debug_option = click.option("--debug", is_flag=True, help="Show tracebacks for user errors too.")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mudpuppy")
def main():
    """Fine-tune language models on ROCm, CUDA, CPU or MLX from one YAML file."""
    _quiet_libraries()


def _quiet_libraries() -> None:
    """Keep the terminal to mudpuppy's own lines: no per-file loading bars, no library deprecation chatter.

    Must run before transformers / huggingface_hub are imported: they read these once.
    """
    import os
    import warnings

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers\..*")


@main.command()
@config_option
@click.option("--backend", "-b", default=None, help="auto, cpu, cuda, rocm or mlx (overrides the config).")
@set_option
@click.option("--overwrite", is_flag=True, help="Replace an output_dir that already holds a run.")
@click.option("--resume", is_flag=True, help="Continue from the newest complete checkpoint in output_dir.")
@click.option("--nproc", type=click.IntRange(min=1), default=None,
              help="Train with N processes on this node: torchrun's engine (torch), mlx.launch (MLX). "
                   "See docs/distributed.md for several nodes.")
@debug_option
@_handle_errors
def run(config_path, backend, overrides, overwrite, resume, nproc, debug):
    """Run the training job a config describes."""
    from . import create_backend, load_config
    from .distributed import launched
    from .training import run as run_method

    from .training.curriculum import is_curriculum

    if is_curriculum(config_path):
        if nproc and nproc > 1:
            raise MudpuppyError("--nproc: a curriculum runs in one process for now")
        _run_curriculum(config_path, list(overrides) + ([f"backend={backend}"] if backend else []), overwrite)
        return
    overrides = list(overrides) + ([f"backend={backend}"] if backend else []) + (["resume=true"] if resume else [])
    cfg = load_config(config_path, overrides)
    if nproc and nproc > 1:
        if launched():
            raise MudpuppyError("--nproc: this process is already one of a distributed run (started by torchrun or "
                                "mlx.launch); drop --nproc, the launcher sets the number of processes")
        sys.exit(_launch(cfg, nproc))
    impl = create_backend(cfg.backend, **cfg.backend_options())
    # In a distributed run rank 0 speaks for all.
    say = click.echo if getattr(impl, "ranks", None) is None or impl.ranks.is_main else (lambda *_a, **_k: None)
    say(f"backend: {impl.name} on {impl.device}")
    for note in getattr(getattr(impl, "plan", None), "notes", []):
        say(f"  {note}")
    result = run_method(cfg, impl, overwrite=overwrite, echo=say)
    say(_table(result))
    say(f"saved to {result.output_dir} ({result.steps} steps, {result.seconds:.0f} s, "
               f"{result.tokens_per_second:.0f} tokens/s while training)")


def _run_curriculum(config_path, overrides: list[str], overwrite: bool) -> None:
    """A config with `stages:`: each stage a run, resumed where it stopped when run again (--resume is implied)."""
    from .training.curriculum import load_curriculum, run_curriculum

    cur = load_curriculum(config_path, overrides)
    click.echo(f"curriculum: {len(cur.stages)} stages -> {cur.output_dir}")
    result = run_curriculum(cur, overwrite=overwrite, echo=click.echo)
    click.echo(f"report: {result.output_dir / 'curriculum.md'} ({len(result.ran)} stages trained now)")


def _launch(cfg, nproc: int) -> int:
    from .backends.factory import resolve_auto
    from .launch import child_arguments, launch

    name = cfg.backend if cfg.backend != "auto" else resolve_auto().name
    if name == "mlx" and cfg.distributed.strategy == "fsdp":
        raise MudpuppyError("distributed.strategy: fsdp is torch's (FSDP2); MLX trains data-parallel only: "
                            "use strategy: ddp with the mlx backend")
    args = child_arguments(sys.argv[sys.argv.index("run") + 1:])
    return launch(cfg, name, nproc, args, echo=click.echo)


@main.command()
@click.argument("config_path", type=click.Path(dir_okay=False))
@set_option
@debug_option
@_handle_errors
def validate(config_path, overrides, debug):
    """Check a config (schema, values, data files) without loading a model."""
    from .config import load_config

    cfg = load_config(config_path, overrides)
    method = cfg.method if cfg.data_method() == cfg.method else f"{cfg.method} ({cfg.data_method()})"
    click.echo(f"{config_path}: ok (method {method}, adapter {cfg.adapter.type}, backend {cfg.backend}, "
               f"{len(cfg.data.datasets)} dataset(s))")


@main.command()
@click.argument("config_path", type=click.Path(dir_okay=False))
@set_option
@click.option("--samples", "-n", default=2, show_default=True, type=click.IntRange(min=0),
              help="Decoded training samples to show, loss-carrying tokens in [[ ]].")
@click.option("--refresh", is_flag=True, help="Tokenize afresh even when the cache matches.")
@debug_option
@_handle_errors
def preprocess(config_path, overrides, samples, refresh, debug):
    """Tokenize and cache a config's data, then show what training will see.

    Data problems are reported before the tokenizer loads; the cache is keyed
    by the data files, the tokenizer and the data settings, so `run` reuses it
    only while all three match.
    """
    from transformers import AutoTokenizer

    from .backends.models import resolve_model
    from .config import load_config
    from .data import load_data, prepare_data
    from .data.report import format_report

    cfg = load_config(config_path, overrides)
    loaded = load_data(cfg)
    click.echo(f"{config_path}: {len(loaded.train)} training and {len(loaded.val)} validation dataset(s) "
               f"read and checked for method {cfg.method}")
    source = cfg.model.tokenizer or str(resolve_model(cfg.model.base_model, cfg.model.revision,
                                                      cfg.model.trust_remote_code).path)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.model.trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    prepared = prepare_data(cfg, tokenizer, loaded, write_cache=True, refresh=refresh)
    rep = prepared.report
    cache_line = {
        "reused": f"cache: reused {rep.cache_path} (tokenized {rep.cache_created}); nothing was re-tokenized",
        "written": f"cache: tokenized and saved to {rep.cache_path}; `mudpuppy run` will reuse it",
        "off": "cache: off (data.cache: false); tokenized but not saved",
    }.get(rep.cache, f"cache: {rep.cache}")
    click.echo(f"tokenizer: {source}")
    click.echo(cache_line)
    for line in format_report(prepared, cfg, tokenizer, samples):
        click.echo(line)


@main.command()
@config_option
@set_option
@click.option("--adapter", "adapter_dir", type=click.Path(file_okay=False), default=None,
              help="Adapter directory to merge (default: the config's output_dir).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Where to write the merged model (default: <output_dir>/merged).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="Precision of the merged weights (default: the config's merge_dtype).")
@click.option("--overwrite", is_flag=True, help="Replace an existing merged model directory.")
@debug_option
@_handle_errors
def merge(config_path, overrides, adapter_dir, out_dir, dtype, overwrite, debug):
    """Merge a trained LoRA/DoRA adapter into its base model (plain safetensors)."""
    from . import create_backend, load_config
    from .training.merge import merge_run

    cfg = load_config(config_path, overrides, check_files=False)
    path = merge_run(cfg, create_backend(cfg.backend, **cfg.backend_options()), adapter_dir, out_dir, dtype, overwrite)
    click.echo(f"merged model saved to {path}")


@main.command()
@click.argument("config_path", type=click.Path(dir_okay=False))
@click.option("--data", "data_path", required=True, type=click.Path(dir_okay=False),
              help="JSONL/JSON/CSV/Parquet records to score (text, chat, pairs, or PRM steps).")
@click.option("--backend", "-b", default=None, help="auto, cpu, cuda, rocm or mlx (overrides the config).")
@set_option
@debug_option
@_handle_errors
def score(config_path, data_path, backend, overrides, debug):
    """Print a trained reward model's scores, one JSON line per record, then a summary."""
    import json

    from . import create_backend, load_config
    from .evaluation.score import score_file

    overrides = list(overrides) + ([f"backend={backend}"] if backend else [])
    cfg = load_config(config_path, overrides, check_files=False)
    scored = score_file(cfg, create_backend(cfg.backend, **cfg.backend_options()), data_path)
    for row in scored.rows:
        click.echo(json.dumps(row))
    click.echo(scored.summary, err=True)


@main.command("eval")
@click.argument("targets", nargs=-1, required=True, metavar="TARGET [TARGET ...]")
@click.option("--data", "data_path", required=True, type=click.Path(dir_okay=False),
              help="JSONL/JSON/CSV/Parquet records: chat, text, instruction or completion (perplexity, "
                   "generation metrics), or preference pairs (preference).")
@click.option("--metrics", default=None, metavar="LIST",
              help="Comma-separated: perplexity, exact_match, contains, regex, preference "
                   "(default: perplexity,exact_match for conversations, perplexity for text, preference for pairs).")
@click.option("--backend", "-b", default=None, help="auto, cpu, cuda, rocm or mlx (default: the first run's).")
@click.option("--base", "with_base", is_flag=True, help="Add the base model (adapter off) as a column.")
@click.option("--base-model", default=None, help="Base model for adapter directories (default: their "
                                                 "adapter_config.json's base_model_name_or_path).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Where eval.json, eval.md and the charts go (default: <first target>/eval for a run, "
                   "else ./eval-<timestamp>).")
@click.option("--overwrite", is_flag=True, help="Replace an existing eval.json in --out.")
@click.option("--max-samples", type=click.IntRange(min=1), default=None, help="Use the first N records.")
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
@debug_option
@_handle_errors
def evaluate(targets, data_path, metrics, backend, with_base, base_model, out_dir, overwrite, max_samples, regex,
             normalize, max_new_tokens, batch_size, precision, beta, chat_template, debug):
    """Measure runs, adapters or models on a data file, side by side (docs/eval.md).

    TARGET is a run directory, an adapter directory, a merged or plain model
    directory, a .gguf file or a model alias.
    """
    from .evaluation.metrics import parse_metrics
    from .evaluation.suite import EvalOptions, run_eval

    strip, casefold = _normalize_flags(normalize)
    options = EvalOptions(parse_metrics(metrics) if metrics else None, max_samples, regex, strip, casefold,
                          max_new_tokens, batch_size, beta, precision)
    run_eval(list(targets), data_path, options, backend=backend, base=with_base, base_model=base_model,
             chat_template=chat_template, out=out_dir, overwrite=overwrite, echo=click.echo)


def _normalize_flags(text: str) -> tuple[bool, bool]:
    names = {n.strip() for n in text.split(",") if n.strip()}
    if names == {"none"}:
        return False, False
    if not names or names - {"strip", "casefold"}:
        raise MudpuppyError(f"--normalize {text!r}: use strip, casefold, strip,casefold or none")
    return "strip" in names, "casefold" in names


@main.command()
@debug_option
@_handle_errors
def backends(debug):
    """List every backend, whether it works here, and why not."""
    from .backends.factory import describe, probe_all

    for a in probe_all():
        status = f"available  {a.device}" if a.available else f"unavailable  {a.reason}"
        click.echo(f"{a.name:5s} {status}")
        click.echo(f"      {describe(a.name)}")


@main.command("convert-adapter")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--to", "to", required=True, type=click.Choice(["peft", "mlx"]),
              help="peft: adapter_model.safetensors for PEFT/torch; mlx: adapters.safetensors for mlx-lm.")
@debug_option
@_handle_errors
def convert_adapter(src, dst, to, debug):
    """Convert a LoRA/DoRA adapter between PEFT's and mlx-lm's layout (lossless, no runtime needed)."""
    from .backends.adapters import convert_adapter as convert, read_adapter

    out = convert(src, dst, to)
    adapter = read_adapter(out)
    click.echo(f"{src} -> {out} ({to}: {adapter.kind}, r={adapter.r}, alpha={adapter.alpha:g}, "
               f"{len(adapter.modules)} modules)")


def _table(result) -> str:
    before, after = result.before, result.after
    if before is None and after is None:
        return ""
    rows = [("", "before", "after")]

    def cell(ev, attr, fmt):
        value = getattr(ev, attr, None) if ev else None
        return fmt.format(value) if value is not None else "-"

    if any(getattr(e, "loss", None) is not None for e in (before, after)):
        rows.append(("held-out loss", cell(before, "loss", "{:.4f}"), cell(after, "loss", "{:.4f}")))
    if any(getattr(e, "exact_match", None) is not None for e in (before, after)):
        rows.append(("exact match", cell(before, "exact_match", "{:.1%}"), cell(after, "exact_match", "{:.1%}")))
    if any(getattr(e, "accuracy", None) is not None for e in (before, after)):
        name = getattr(after or before, "accuracy_name", "accuracy").replace("_", " ")
        rows.append((name, cell(before, "accuracy", "{:.1%}"), cell(after, "accuracy", "{:.1%}")))
    if isinstance(after or before, dict):      # GRPO: held-out rewards by name
        keys = list(dict.fromkeys([*(before or {}), *(after or {})]))
        for key in keys:
            pick = [f"{e[key]:.3f}" if e and e.get(key) is not None else "-" for e in (before, after)]
            rows.append((key.removeprefix("eval_").replace("rewards/", "").replace("/mean", ""), *pick))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
