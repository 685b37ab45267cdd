"""`mudpuppy export`: one source, one format, one output directory.

Every check that needs no weights runs first (options, the output directory, the source, the
architecture and tokenizer for GGUF, the chat layout for Ollama, an --imatrix file, the held-out data
a GGUF's perplexity is measured on, mlx-lm for MLX), so a mistake costs seconds, not a merge. A GGUF's
report ends with its held-out perplexity beside the merged model's (quality.py; --no-eval skips it).
Every format gets a model card (card.py: the base by its Hub id, where its weights came from, how to
load the export).

The export keeps the output contract (mudpuppy.output_dir): --out is locked for the whole export, the export is
built in a hidden folder beside it and renamed into place only once complete; with --overwrite only
the earlier export's own files go, after the new one is in place (a file of yours in --out stays); a
directory that is not a mudpuppy export is never written into.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import MudpuppyError
from ..evaluation.suite import check_chat_template
from ..files import move_into
from ..output_dir import EXPORT, write_record, writing
from . import gguf as gguf_format
from . import mlx as mlx_format
from . import peft as peft_format
from .card import CARD, export_card
from .chat_layout import LayoutError, TurnLayout, infer_layout, turn_tokens
from .quality import Heldout, check_eval_options, heldout_for, measure_gguf
from .source import ExportSource, resolve_source

FORMATS = ("merged", "gguf", "ollama", "mlx", "peft")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DEFAULT_QUANT = {"gguf": "f16", "ollama": "q4_k_m"}
AUTO = "auto"          # --imatrix auto: from the run's own training data (calibrate.py)
IMATRIX_FILE = "imatrix.gguf"


@dataclass
class ExportRequest:
    source: str
    format: str
    out: str
    dtype: str | None = None          # merged, mlx: bf16 | fp16 | fp32 (default bf16)
    quant: str | None = None          # gguf: f16 ... (default f16); ollama: (default q4_k_m); mlx: q4 | q8
    overwrite: bool = False
    base_model: str | None = None     # for an adapter directory that does not name its base
    chat_template: str | None = None  # for adapters and models without a run config
    backend: str = "cpu"              # the torch backend that merges
    trust_remote_code: bool = False   # --trust-remote-code: model code may run (never from a run's config.yaml)
    imatrix: str | None = None        # gguf, ollama K-quants: an importance-matrix file (llama-imatrix's forms)
    evaluate: bool = True             # gguf, ollama: the written quant's held-out perplexity (quality.py)
    eval_data: str | None = None      # ... on this data file instead of the run's held-out sets
    eval_tokens: int | None = None    # ... on its first N tokens (default quality.EVAL_TOKENS)


@dataclass
class ExportResult:
    out: Path
    files: list[str]
    record: dict = field(default_factory=dict)


def check_options(fmt: str, dtype: str | None, quant: str | None) -> tuple[str | None, str | None]:
    if fmt not in FORMATS:
        raise MudpuppyError(f"--format {fmt}: formats are {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise MudpuppyError(f"--dtype {dtype}: use {', '.join(DTYPES)}")
    if fmt in ("gguf", "ollama"):
        if dtype is not None:
            raise MudpuppyError(f"--dtype is for --format merged and mlx; a {fmt} export's precision is its "
                                f"--quant ({', '.join(gguf_format.QUANTS)})")
        # Ollama's library and most GGUF repositories ship Q4_K_M: what a user pulls is what they get here.
        return None, gguf_format.check_quant(quant or DEFAULT_QUANT[fmt])
    if fmt == "merged":
        if quant is not None:
            raise MudpuppyError("--quant is for --format gguf, ollama and mlx; a merged export is plain "
                                "16-bit or 32-bit safetensors (--dtype bf16, fp16 or fp32)")
        return dtype or "bf16", None
    if fmt == "peft":
        if quant is not None:
            raise MudpuppyError("--quant is for --format gguf, ollama and mlx; --format peft writes the adapter as "
                                "it trained (and a base it changed, at --dtype)")
        return (DTYPES[dtype] if dtype else None), None     # None: the checkpoint's own dtype (export/peft.py)
    return dtype or "bf16", mlx_format.check_quant(quant)


def export_model(req: ExportRequest, echo=print) -> ExportResult:
    dtype, quant = check_options(req.format, req.dtype, req.quant)
    check_eval_options(req.format, req.evaluate, req.eval_data, req.eval_tokens)
    check_chat_template(req.chat_template)
    with writing(req.out, EXPORT, req.overwrite, what="--out", echo=echo) as out:
        src = resolve_source(req.source, req.base_model, req.chat_template, req.trust_remote_code)
        if req.chat_template and src.kind == "run":
            raise MudpuppyError("--chat-template: a run exports the chat template it trained with "
                                f"(data.chat_template in {req.source}/config.yaml); leave the option out")
        echo(f"source: {src.describe()}")
        tokenizer = src.load_tokenizer()
        layout = preflight(src, req.format, quant, tokenizer)
        weights = importance(req.imatrix, req.format, quant, src, echo)
        heldout = heldout_data(req, src, tokenizer, echo)
        record = write_export(req, src, tokenizer, layout, dtype, quant, out, echo, weights, heldout)
    record["files"] = out.names               # stamped into export.json by the publish: what this export wrote
    return ExportResult(out.shown, out.names, record)


def importance(path: str | None, fmt: str, quant: str | None, src: ExportSource, echo) -> dict | str | None:
    """The --imatrix file's per-column weights (read before any merge, so a bad file costs seconds), or
    AUTO: collected from the run's data once the merged model exists (write_format)."""
    if path is None:
        return None
    if fmt not in ("gguf", "ollama") or quant not in gguf_format.K_QUANTS:
        raise MudpuppyError(f"--imatrix weights GGUF K-quants ({', '.join(gguf_format.K_QUANTS)}); "
                            f"--format {fmt}{' --quant ' + quant if quant else ''} does not use one")
    if path == AUTO:
        if src.kind != "run":
            raise MudpuppyError(f"--imatrix auto calibrates on a run's training data, and {src.given} is "
                                f"{'an' if src.kind == 'adapter' else 'a'} {src.kind}: export a run directory, or "
                                "give --imatrix FILE (llama-imatrix's output)")
        return AUTO
    from .imatrix import read_imatrix

    matrix = read_imatrix(Path(path).expanduser())
    echo(f"importance matrix: {path} ({len(matrix.weights)} tensors"
         + (f", {matrix.chunk_count} chunks" if matrix.chunk_count else "") + ")")
    return matrix.weights


def heldout_data(req: ExportRequest, src: ExportSource, tokenizer, echo) -> Heldout | None:
    """What a GGUF's perplexity is measured on (read and tokenized before any merge), None when not measured."""
    if req.format not in ("gguf", "ollama") or not req.evaluate:
        return None
    found = heldout_for(src, tokenizer, req.eval_data, req.eval_tokens)
    if isinstance(found, str):
        echo(f"held-out perplexity: not measured: {found}")
        return None
    return found


def write_export(req: ExportRequest, src: ExportSource, tokenizer, layout, dtype, quant, out, echo,
                 imatrix: dict | str | None = None, heldout: Heldout | None = None) -> dict:
    """The format's files, its card and export.json, in the staging folder `out.dir` (output_dir.Writing);
    returns the record."""
    started = time.monotonic()
    staging, work = out.dir, out.scratch()
    src.dequantize_into(work, echo)
    record = write_format(req.format, src, tokenizer, layout, dtype, quant, staging, work, req.backend, echo,
                          imatrix, heldout, final=out.target)
    record.update(source=req.source, source_kind=src.kind, described=src.describe(), format=req.format,
                  base=src.base, finetune=src.finetune, seconds=round(time.monotonic() - started, 1))
    # The card last: it states what the format wrote (mlx_lm.convert's own, front matter only, is replaced).
    describe(staging, out.shown, req.format, src, record)
    return record


def describe(staging: Path, out: Path, fmt: str, src: ExportSource, record: dict, verb: str = "export") -> None:
    """The model card and export.json of an export or merge bound for `out`, written in its staging folder."""
    (staging / CARD).write_text(export_card(out, fmt, src, record, verb=verb), encoding="utf-8")
    write_record(staging, EXPORT, record)


def preflight(src: ExportSource, fmt: str, quant: str | None, tokenizer) -> TurnLayout | None:
    """What can fail without loading weights; returns the chat layout (Ollama needs one; GGUF uses it
    for the end-of-turn id when the template has one)."""
    config = src.model_config()
    where = str(src.model_dir())
    if fmt in ("gguf", "ollama"):
        gguf_format.family_of(config, where)
        from .gguf_vocab import byte_level_pre, tokenizer_kind, tokenizer_spec

        spec = tokenizer_spec(tokenizer)
        if tokenizer_kind(spec) == "gpt2":
            byte_level_pre(spec)
        if fmt == "ollama":
            return infer_layout(tokenizer, src.given)
        try:
            return infer_layout(tokenizer, src.given) if tokenizer.chat_template else None
        except LayoutError:
            return None
    if fmt == "mlx":
        mlx_format.check_family(config, where)       # a family mlx-lm lacks: refused before the merge
    if fmt == "peft":
        peft_format.check_source(src)
    return None


def write_format(fmt: str, src: ExportSource, tokenizer, layout, dtype, quant, staging: Path, work: Path,
                 backend_name: str, echo, imatrix: dict | str | None = None, heldout: Heldout | None = None,
                 final: Path | None = None) -> dict:
    from ..backends import create_backend

    if fmt == "peft":
        return {"peft": peft_format.write_peft_export(src, tokenizer, dtype, staging, final, work, backend_name, echo)}
    if fmt == "merged":
        echo(f"merging into plain {DTYPES[dtype]} safetensors")
        src.merge_into(create_backend(src.rebuilt_on(backend_name)), staging, DTYPES[dtype])
        return {"dtype": DTYPES[dtype]}
    if fmt == "mlx":
        # Through the backend even without an adapter: the directory mlx-lm reads then carries the
        # training chat template and the top-level rope_theta mlx-lm needs.
        echo("merging into float32 for mlx-lm's converter")
        merged = src.merge_into(create_backend(src.rebuilt_on(backend_name)), work / "merged", "float32")
        echo(f"converting with mlx_lm.convert ({DTYPES[dtype]}{', ' + quant if quant else ''})")
        converted = mlx_format.convert_to_mlx(merged, work / "mlx", dtype, quant)   # mlx-lm makes its folder
        move_into(work / "mlx", staging)
        return {"mlx": converted}
    model_dir, merged = src.plain_dir(), None
    backend = create_backend(backend_name)
    if model_dir is None:
        echo("merging into float32 for the GGUF writer")
        model_dir = work / "merged"
        if src.rebuilt_on(backend_name) != backend_name:      # the rest (imatrix, perplexity) reads model_dir
            src.merge_into(create_backend(src.rebuilt_on(backend_name)), model_dir, "float32")
        else:
            merged = src.merge_loaded(backend, model_dir, "float32")
    if imatrix == AUTO:
        from .calibrate import collect_from_run

        imatrix = collect_from_run(src, tokenizer, model_dir, backend, staging / IMATRIX_FILE, echo, merged)
    del merged          # the writer reads the saved files tensor by tensor: the loaded model is not kept
    name = f"model-{quant}.gguf"
    echo(f"writing {name}")
    base = src.base or {}
    fine_tuned = src.kind in ("run", "adapter") or bool(src.finetune)
    general_name = gguf_format.model_name(base, src.finetune, src.name)
    record = {"gguf": gguf_format.write_gguf(model_dir, tokenizer, tokenizer.chat_template, quant,
                                             staging / name, general_name, end_of_turn_id(tokenizer, layout),
                                             base.get("hub_id") if fine_tuned else None, imatrix)}
    for note in record["gguf"]["notes"]:
        echo(f"note: {note}")
    if heldout is not None:
        record["perplexity"] = measure_gguf(staging / name, quant, model_dir, heldout, src.cfg.model,
                                            backend, src.cfg.eval.batch_size, work, echo)
    if fmt == "ollama":
        from .ollama import modelfile, sampling_parameters, stop_words

        params = sampling_parameters(model_dir)
        (staging / "Modelfile").write_text(modelfile(name, tokenizer, layout, params, src.given), encoding="utf-8")
        record["ollama"] = {"stop": stop_words(tokenizer, layout), "system": layout.default_system,
                            "parameters": params}
    return record


def end_of_turn_id(tokenizer, layout: TurnLayout | None) -> int | None:
    """The token that closes an assistant turn in the training template: llama.cpp stops on it."""
    if layout is None:
        return None
    ends, _ = turn_tokens(tokenizer, layout)
    return tokenizer.convert_tokens_to_ids(ends[0]) if ends else None
