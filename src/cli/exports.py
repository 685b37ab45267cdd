"""Turning a trained run into something else: `export` (merged safetensors, GGUF, Ollama, MLX), `merge`
(an adapter into its base, from a config) and `convert-adapter` (PEFT's layout and mlx-lm's)."""

from __future__ import annotations

import click

from .common import config_option, debug_option, handle_errors, set_option


@click.command("export")
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
@handle_errors
def export(source, fmt, out_dir, dtype, quant, base_model, chat_template, overwrite, trust_remote_code, debug):
    """Export a run, adapter or model as merged safetensors, GGUF, Ollama or MLX (docs/export.md).

    SOURCE is a run directory, an adapter directory, a model directory, a .gguf file or a model alias.
    """
    from ..export import ExportRequest, export_model

    result = export_model(ExportRequest(source, fmt, out_dir, dtype, quant, overwrite, base_model, chat_template,
                                        trust_remote_code=trust_remote_code), echo=click.echo)
    click.echo(f"exported {fmt} to {result.out}: {', '.join(result.files)}")
    if fmt == "ollama":
        click.echo(f"  ollama create NAME -f {result.out / 'Modelfile'}")


@click.command()
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
@handle_errors
def merge(config_path, overrides, adapter_dir, out_dir, dtype, overwrite, debug):
    """Merge a trained LoRA/DoRA adapter into its base model (plain safetensors)."""
    from .. import create_backend, load_config
    from ..training.merge import merge_run

    cfg = load_config(config_path, overrides, check_files=False)
    path = merge_run(cfg, create_backend(cfg.backend, **cfg.backend_options()), adapter_dir, out_dir, dtype, overwrite,
                     echo=click.echo)
    click.echo(f"merged model saved to {path}")


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

    out = convert(src, dst, to)
    adapter = read_adapter(out)
    click.echo(f"{src} -> {out} ({to}: {adapter.kind}, r={adapter.r}, alpha={adapter.alpha:g}, "
               f"{len(adapter.modules)} modules)")
