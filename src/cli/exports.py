"""Turning a trained run into something else: `export` (merged safetensors, GGUF, Ollama, MLX), `merge`
(an adapter into its base) and `convert-adapter` (PEFT's layout and mlx-lm's).

`export`, `merge` and `eval` take what they read first, positionally, and write inside a run by default:
<run>/export/<format>[-<quant>], <run>/merged and <run>/eval. Each default is an ordinary output under the
contract (mudpuppy.output_dir): a second write there stops unless --overwrite is given.
"""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import MudpuppyError
from .common import debug_option, handle_errors, set_option

RUN_CONFIG = "config.yaml"          # what makes a directory a run (evaluation.targets.RUN_CONFIG)


@click.command("export")
@click.argument("source")
@click.option("--format", "fmt", required=True, type=click.Choice(["merged", "gguf", "ollama", "mlx", "peft"]),
              help="merged: plain safetensors; gguf: one llama.cpp file; ollama: the GGUF and a Modelfile; "
                   "mlx: an mlx-lm model directory; peft: the adapter (PEFT and mlx-lm layouts), with the base "
                   "it trained on where training changed it (LoftQ's iterations).")
@click.option("--out", "out_dir", default=None, type=click.Path(),
              help="The directory to write (default: <run>/export/<format>[-<quant>] for a run directory, "
                   "else ./export-<name>-<format>[-<quant>]).")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
              help="merged and mlx: weight precision (default bf16); peft: a changed base's (default: the "
                   "checkpoint's).")
@click.option("--quant", default=None,
              help="gguf, ollama: q4_k_m, q5_k_m, q6_k, q4_k_s, q5_k_s, q3_k_s/m/l, q2_k (K-quants as "
                   "llama-quantize writes them, no llama.cpp needed), q8_0, q4_0, bf16, f16, f32 "
                   "(default: q4_k_m for ollama, f16 for gguf); mlx: q4 or q8 (default: none).")
@click.option("--imatrix", default=None, metavar="FILE|auto",
              help="gguf, ollama K-quants: an importance matrix, from llama-imatrix (its GGUF or legacy .dat "
                   "file) or, with auto, collected from the run's own training data and written beside the GGUF "
                   "(imatrix.gguf); each block's search weighs the columns as llama-quantize --imatrix does.")
@click.option("--eval-data", default=None, metavar="FILE",
              help="gguf, ollama: measure the written GGUF's held-out perplexity, and the merged model's, on this "
                   "data file (default: the run's held-out sets; a model or adapter is measured only with it).")
@click.option("--eval-tokens", default=None, type=int, metavar="N",
              help="gguf, ollama: the perplexity reads the held-out data's first N tokens (default 4096).")
@click.option("--no-eval", "no_eval", is_flag=True,
              help="gguf, ollama: skip the held-out perplexity (measured through mudpuppy's dequantized "
                   "evaluation, and llama.cpp's where llama_cpp imports).")
@click.option("--base-model", default=None, help="Base model for an adapter directory that does not name one.")
@click.option("--chat-template", default=None,
              help="For adapters and models without a run config: a built-in template name or Jinja "
                   "(default: the tokenizer's own). A run always exports the template it trained with.")
@click.option("--overwrite", is_flag=True, help="Replace an earlier export in --out.")
@click.option("--trust-remote-code", is_flag=True,
              help="Let Python files that came with the model run (auto_map); never taken from a run's config.yaml.")
@debug_option
@handle_errors
def export(source, fmt, out_dir, dtype, quant, imatrix, eval_data, eval_tokens, no_eval, base_model, chat_template,
           overwrite, trust_remote_code, debug):
    """Export a run, adapter or model as merged safetensors, GGUF, Ollama, MLX or a PEFT adapter (docs/export.md).

    SOURCE is a run directory, an adapter directory, a model directory, a .gguf file or a model alias.
    """
    from ..export import ExportRequest, export_model
    from ..export.quality import check_eval_options

    check_eval_options(fmt, not no_eval, eval_data, eval_tokens)      # before the default --out is worked out
    out_dir = out_dir or str(default_export_dir(source, fmt, dtype, quant))
    result = export_model(ExportRequest(source, fmt, out_dir, dtype, quant, overwrite, base_model, chat_template,
                                        trust_remote_code=trust_remote_code, imatrix=imatrix, evaluate=not no_eval,
                                        eval_data=eval_data, eval_tokens=eval_tokens), echo=click.echo)
    click.echo(f"exported {fmt} to {result.out}: {', '.join(result.files)}")
    if fmt == "ollama":
        click.echo(f"  ollama create NAME -f {result.out / 'Modelfile'}")


def default_export_dir(source: str, fmt: str, dtype: str | None, quant: str | None) -> Path:
    """Where an export goes without --out: inside the run it comes from, else beside the command. The name
    carries the quantization the format resolves to (gguf-f16, gguf-q8_0, mlx-q4), so exports of one run in
    two quantizations never meet, and a second export of the same kind meets the contract's --overwrite."""
    from ..export.pipeline import check_options

    _, resolved = check_options(fmt, dtype, quant)       # a bad --format/--quant named before any path
    name = f"{fmt}-{resolved}" if resolved else fmt
    path = Path(source).expanduser()
    if (path / RUN_CONFIG).is_file():
        return path / "export" / name
    stem = (path.absolute().name if path.is_dir() else path.name.removesuffix(".gguf")) or "model"
    return Path(f"export-{stem.replace('/', '-')}-{name}")


@click.command()
@click.argument("run_dir", required=False, type=click.Path(file_okay=False))
@click.option("--config", "-c", "config_path", default=None, type=click.Path(dir_okay=False),
              help="Instead of RUN_DIR: the run's YAML file (the adapter is read from its output_dir).")
@set_option
@click.option("--adapter", "adapter_dir", type=click.Path(file_okay=False), default=None,
              help="Adapter directory to merge (default: RUN_DIR, or the config's output_dir).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Where to write the merged model (default: <RUN_DIR>/merged, or <output_dir>/merged).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="Precision of the merged weights (default: the config's merge_dtype).")
@click.option("--overwrite", is_flag=True, help="Replace an existing merged model directory.")
@click.option("--trust-remote-code", is_flag=True,
              help="Let Python files that came with the model run (auto_map); never taken from a run's config.yaml.")
@debug_option
@handle_errors
def merge(run_dir, config_path, overrides, adapter_dir, out_dir, dtype, overwrite, trust_remote_code, debug):
    """Merge a trained LoRA/DoRA adapter into its base model (plain safetensors).

    RUN_DIR is a finished run's directory (it holds config.yaml), as `export` and `eval` take it;
    `--config FILE` (the run's YAML) still works instead.
    """
    from .. import create_backend
    from ..training.merge import merge_run

    if (run_dir is None) == (config_path is None):
        raise MudpuppyError("merge: give the run directory (mudpuppy merge outputs/run) or --config FILE, one of them")
    if run_dir is not None:
        cfg = run_config(run_dir, overrides, trust_remote_code)
        adapter_dir = adapter_dir or run_dir
        out_dir = out_dir or str(Path(run_dir) / "merged")
    else:
        from .. import load_config

        cfg = load_config(config_path, overrides, check_files=False)
    path = merge_run(cfg, create_backend(cfg.backend, **cfg.backend_options()), adapter_dir, out_dir, dtype, overwrite,
                     echo=click.echo)
    click.echo(f"merged model saved to {path}")


def run_config(run_dir: str, overrides, trust_remote_code: bool):
    """A run directory's own config.yaml, its model code allowed only by the command (as export and eval do)."""
    from .. import load_config
    from ..evaluation.targets import declares_code

    path = Path(run_dir)
    if not (path / RUN_CONFIG).is_file():
        raise MudpuppyError(f"{run_dir}: not a run directory (no {RUN_CONFIG}); give a run's output_dir, or "
                            "--config FILE with the run's YAML")
    cfg = load_config(path / RUN_CONFIG, overrides, check_files=False)
    asks = cfg.model.trust_remote_code or declares_code(Path(cfg.model.base_model).expanduser())
    if asks and not trust_remote_code:
        raise MudpuppyError(f"{run_dir}: its model may run Python files that came with it (trust_remote_code or "
                            "auto_map); mudpuppy runs such code only when the command asks: pass --trust-remote-code "
                            "if you trust where this run and its base model came from")
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"trust_remote_code": trust_remote_code})})


@click.command("convert-adapter")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--to", "to", required=True, type=click.Choice(["peft", "mlx"]),
              help="peft: adapter_model.safetensors for PEFT/torch; mlx: adapters.safetensors for mlx-lm.")
@debug_option
@handle_errors
def convert_adapter(src, dst, to, debug):
    """Convert a LoRA/DoRA adapter between PEFT's and mlx-lm's layout (lossless, no runtime needed)."""
    from ..backends.adapters import convert_adapter as convert, read_adapter
    from ..export.peft import refuse_adapter_alone

    refuse_adapter_alone(src, "convert-adapter")       # a LoftQ-iterated run's adapter needs its changed base
    out = convert(src, dst, to)
    adapter = read_adapter(out)
    click.echo(f"{src} -> {out} ({to}: {adapter.kind}, r={adapter.r}, alpha={adapter.alpha:g}, "
               f"{len(adapter.modules)} modules)")
