"""Checking before training: `validate` reads a config without loading a model, `preprocess` tokenizes and
caches its data and shows what training will see."""

from __future__ import annotations

import click

from .common import debug_option, handle_errors, set_option


@click.command()
@click.argument("config_path", type=click.Path(dir_okay=False))
@set_option
@debug_option
@handle_errors
def validate(config_path, overrides, debug):
    """Check a config (schema, values, data files) without loading a model."""
    from ..configure import load_config

    cfg = load_config(config_path, overrides)
    method = cfg.method if cfg.data_method() == cfg.method else f"{cfg.method} ({cfg.data_method()})"
    click.echo(f"{config_path}: ok (method {method}, adapter {cfg.adapter.type}, backend {cfg.backend}, "
               f"{len(cfg.data.datasets)} dataset(s))")


@click.command()
@click.argument("config_path", type=click.Path(dir_okay=False))
@set_option
@click.option("--samples", "-n", default=2, show_default=True, type=click.IntRange(min=0),
              help="Decoded training samples to show, loss-carrying tokens in [[ ]].")
@click.option("--refresh", is_flag=True, help="Tokenize afresh even when the cache matches.")
@debug_option
@handle_errors
def preprocess(config_path, overrides, samples, refresh, debug):
    """Tokenize and cache a config's data, then show what training will see.

    Data problems are reported before the tokenizer loads; the cache is keyed
    by the data files, the tokenizer and the data settings, so `run` reuses it
    only while all three match.
    """
    from ..backends.models import resolve_model
    from ..configure import load_config
    from ..data import load_data, load_tokenizer, prepare_data
    from ..data.report import format_report

    cfg = load_config(config_path, overrides)
    loaded = load_data(cfg)
    click.echo(f"{config_path}: {len(loaded.train)} training and {len(loaded.val)} validation dataset(s) "
               f"read and checked for method {cfg.method}")
    source = cfg.model.tokenizer or str(resolve_model(cfg.model.base_model, cfg.model.revision,
                                                      cfg.model.trust_remote_code).path)
    tokenizer = load_tokenizer(cfg.model, source)
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
