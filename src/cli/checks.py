"""Checking before training: `validate` reads a config or a curriculum (stage by stage) without loading a
model, and with --data reads the data files too; `preprocess` tokenizes and caches the data and shows what
training will see."""

from __future__ import annotations

from dataclasses import dataclass

import click

from ..errors import MudpuppyError
from .common import debug_option, handle_errors, set_option


@click.command()
@click.argument("config_path", type=click.Path(dir_okay=False))
@set_option
@click.option("--data", "read_data", is_flag=True,
              help="Also read every data file through the reader training uses: each bad record named by "
                   "file:line (exit 2 unless data.skip_bad_records), and the record counts the mix draws from.")
@debug_option
@handle_errors
def validate(config_path, overrides, read_data, debug):
    """Check a config or a curriculum, stage by stage (schema, values, data files), without loading a model."""
    from ..training.curriculum import is_curriculum, load_curriculum

    if is_curriculum(config_path):
        cur = load_curriculum(config_path, overrides)       # every stage checked whole, problems named by stage
        click.echo(f"{config_path}: a curriculum of {len(cur.stages)} stage(s) -> {cur.output_dir}")
        checked = [(f"  stage {s.index} ({s.name})", s.cfg) for s in cur.stages]
    else:
        from ..configure import load_config

        checked = [(str(config_path), load_config(config_path, overrides))]
    refused = []
    for label, cfg in checked:
        method = cfg.method if cfg.data_method() == cfg.method else f"{cfg.method} ({cfg.data_method()})"
        click.echo(f"{label}: ok (method {method}, adapter {cfg.adapter.type}, backend {cfg.backend}, "
                   f"{len(cfg.data.datasets)} dataset(s))")
        counts, lines = read_datasets(cfg) if read_data else (None, [])
        indent = "  " if label.startswith("  ") else ""          # a stage's lines sit under the stage
        for line in lines + mix_lines(cfg, counts):
            click.echo(indent + line)
        if counts is not None and counts.bad and not cfg.data.skip_bad_records:
            refused.append(f"{label.strip()}: {counts.bad} bad record(s)")
    if refused:
        raise MudpuppyError(f"{'; '.join(refused)} (listed above, by file:line); training would stop at the first. "
                            "Fix them, or set data.skip_bad_records: true to leave them out")


@dataclass
class DataCounts:
    records: list[int]          # per training dataset, the records read (after num_samples)
    bad: int                    # bad records over every dataset, training and held-out


def read_datasets(cfg) -> tuple[DataCounts, list[str]]:
    """Every dataset read as training reads it, but gathering every bad record instead of stopping at the first
    (skip_bad_records' reader); the lines name each as file:line."""
    from ..data import load_data

    gather = cfg.data.model_copy(update={"skip_bad_records": True})
    loaded = load_data(cfg.model_copy(update={"data": gather}))
    bad, lines = 0, []
    for ds in loaded.train + loaded.val:
        n = ds.skipped_count()
        bad += n
        lines.append(f"  {ds.name}: {ds.format}, {ds.record_count()} usable record(s)" + (f", {n} bad:" if n else ""))
        lines += [f"    {line}" for line in ds.skipped]
        if n > len(ds.skipped):
            lines.append(f"    ... and {n - len(ds.skipped)} more")
    return DataCounts([ds.record_count() for ds in loaded.train], bad), lines


def mix_lines(cfg, counts: DataCounts | None) -> list[str]:
    """The training mix the config asks for (datasets[].ratio or .weight); with the data read, the examples each
    dataset gives the mix before length filtering and any validation split (data/pipeline.py draws them)."""
    from ..data.pipeline import ratio_counts

    specs = cfg.data.datasets
    if not specs:
        return ["  mix: no training datasets"]
    ratios = [s.ratio for s in specs] if any(s.ratio is not None for s in specs) else None
    if counts is None:
        return ["  mix: " + ", ".join(f"{s.path} {_asked(s, ratios)}" for s in specs)]
    drawn = (ratio_counts(ratios, sum(counts.records)) if ratios else
             [n if s.weight is None else round(s.weight * n) for s, n in zip(specs, counts.records)])
    lines = ["  mix (examples drawn from each dataset, before length filtering and any validation split):"]
    for spec, n, take in zip(specs, counts.records, drawn):
        lines.append(f"    {spec.path}: {_asked(spec, ratios)}: {take} of its {n} record(s) ({take / max(sum(drawn), 1):.1%})")
    return lines


def _asked(spec, ratios) -> str:
    if ratios:
        return f"ratio {spec.ratio:g}"
    return f"weight {spec.weight:g}" if spec.weight is not None else "whole"


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
