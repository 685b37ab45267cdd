"""`mudpuppy merge`: fold a finished run's adapter into its base model.

The merged directory gets what `mudpuppy export --format merged` gives it besides the weights: a model
card naming the base by its Hub id and where its weights came from, and export.json recording the base,
so a later `mudpuppy export` of the merged model (to GGUF, say) still names the base it was trained on.

It is written under the output contract (mudpuppy.output_dir): built in a hidden folder beside --out and
renamed into place once complete, so a failed or killed merge leaves the previous merged model whole; with
--overwrite only the earlier merge's (or export's) own files go, after the new one is in place; a folder
that holds neither is never written into.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import MudpuppyError
from ..evaluation.targets import load_trained_adapter
from ..export.pipeline import describe
from ..export.source import resolve_source
from ..output_dir import EXPORT, rundir, writing


def merge_run(cfg, backend, adapter_dir: str | None = None, out_dir: str | None = None,
              dtype: str | None = None, overwrite: bool = False, echo=None) -> Path:
    if cfg.method in ("rm", "prm"):
        raise MudpuppyError(f"a reward model's output_dir ({cfg.output_dir}) already holds the whole model with "
                            "its adapter merged in; nothing to merge")
    adapter = Path(adapter_dir or cfg.output_dir)
    if not (adapter / "adapter_config.json").is_file():
        raise MudpuppyError(
            f"{adapter} holds no adapter (no adapter_config.json); merge needs a LoRA/DoRA run's output_dir "
            "or --adapter DIR (a full fine-tune is already a plain model)")
    out = Path(out_dir) if out_dir else Path(cfg.output_dir) / "merged"
    with writing(out, EXPORT, overwrite, what="--out", echo=echo) as written:
        # A QLoRA adapter learned on the 4-bit base: load rebuilds exactly that base (quantizing is
        # deterministic and reads the checkpoint's own values); any other adapter merges into fp32 weights.
        qlora = cfg.adapter.type == "qlora"
        handle = backend.load_model(cfg.model, "fp32", adapter=cfg.adapter if qlora else None)
        if qlora:
            backend.quantize_base(handle, cfg.adapter)
        load_trained_adapter(backend, handle, cfg.adapter, adapter)
        backend.merge_and_save(handle, str(written.dir), dtype or cfg.merge_dtype)
        describe_merge(written.dir, out, adapter, dtype or cfg.merge_dtype)
    return out


def describe_merge(staging: Path, out: Path, adapter: Path, dtype: str) -> None:
    """The model card and export.json of a merged model (written in `staging`, bound for `out`), as
    `mudpuppy export --format merged` writes them."""
    src = resolve_source(str(adapter))
    record = {"dtype": dtype, "source": str(adapter), "source_kind": src.kind, "described": src.describe(),
              "format": "merged", "base": src.base, "finetune": src.finetune}
    describe(staging, out, "merged", src, record, verb="merge")


def merge_at_end(cfg, backend, out: Path, echo, adapter: Path | None = None, what: str = "merged model") -> bool:
    """`merge: true`: output_dir/merged, from the saved adapter (`adapter`, default output_dir) onto a freshly
    loaded base, so the merge lands on the full-precision weights whatever precision the base was held in for
    training. Returns whether it merged.

    The base is loaded again in fp32 while the trained model still holds the device (an 8B base is 32 GB
    more): the merge runs on the host (`backend.host_backend()`), never on a GPU. A QLoRA base rebuilt there
    gets the same 4-bit codes (quantizing is exact elementwise arithmetic)."""
    # Rank 0 of a distributed run alone: the merge reads the saved adapter, not the sharded model.
    if not (cfg.merge and cfg.adapter.type != "none" and backend.ranks.is_main):
        return False
    host = backend.host_backend()
    if host is not backend:
        echo(f"merging on the host ({host.device}): the trained model still holds {backend.device}")
    rundir.record(out, ["merged"])        # the run's own output (its files listed in merged/'s own marker)
    merged = merge_run(cfg, host, str(adapter or out), str(out / "merged"), cfg.merge_dtype, overwrite=True,
                       echo=echo)
    echo(f"{what} ({cfg.merge_dtype}) saved to {merged}")
    return True
