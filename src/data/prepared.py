"""What preparing data produces, and the helpers both ways of tokenizing share.

`prepare.py` tokenizes into lists of examples (every method); `pipeline.py`
tokenizes SFT data into a memory-mapped store (`store.py`). Both report
through a `DataReport` and return a `PreparedData`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from .examples import Example
from .readers import Record
from .render import RenderOptions, instruction_prompt
from .tools import uses_tools

SKIPPED_SHOWN = 20     # bad-record locations kept for the report
EVAL_TOOL_FORMAT = "_tool_format"   # key of an eval record: how its dataset rendered tool calls


@dataclass
class DataReport:
    per_dataset: dict[str, int] = field(default_factory=dict)   # dataset path -> examples kept
    formats: dict[str, str] = field(default_factory=dict)       # dataset path -> format
    tool_formats: dict[str, str] = field(default_factory=dict)  # dataset path -> how its tool calls render
    truncated: int = 0
    dropped: int = 0                 # too long (truncation: drop) or nothing to learn
    dropped_too_long: int = 0
    dropped_no_target: int = 0
    skipped: int = 0                 # bad records left out (skip_bad_records)
    skipped_at: list[str] = field(default_factory=list)
    train_examples: int = 0
    val_examples: int = 0
    loss_token_share: float = 0.0
    cache: str = "off"               # off | fresh | written | reused
    cache_path: str = ""
    cache_created: str = ""
    warnings: list[str] = field(default_factory=list)
    # The training mix as realised (SFT): per dataset, examples, tokens, trained tokens and their shares
    mix: list[dict] = field(default_factory=list)
    # A distributed run (shared.py): the ranks that tokenized, and how many map the one store
    tokenized_by: list[int] = field(default_factory=list)
    mapped_by: int = 0


@dataclass
class PreparedData:
    # SFT: views of a memory-mapped token store (store.StoreView); other methods: lists of their
    # example types (see examples.py). Either way a sequence: len, indexing, slicing, iteration.
    train: Sequence[Example]
    val: Sequence[Example]
    val_records: list[dict]       # raw records behind `val`, for generation checks
    report: DataReport


@dataclass
class LoadedDataset:
    spec: object                  # the DatasetSpec
    name: str                     # how errors and reports name it
    format: str
    records: list[Record]         # empty where the file is streamed (see `stream`)
    fingerprint: str
    skipped: list[str] = field(default_factory=list)
    # A streamed JSON-lines file (stream.py): its records are read again, chunk by chunk, when tokenized;
    # only their count, the bad ones' total and a few probe records are kept from the scan.
    stream: Callable[[], Iterator[Record]] | None = None
    count: int = 0
    skipped_total: int = 0
    probe: list[Record] = field(default_factory=list)

    def probe_records(self) -> list[Record]:
        """Records enough to answer 'does any record ...' questions (templates, tool formats)."""
        return self.probe if self.stream is not None else self.records

    def record_count(self) -> int:
        return self.count if self.stream is not None else len(self.records)

    def skipped_count(self) -> int:
        """Bad records left out: `skipped` lists only the first of them where the file was scanned."""
        return max(self.skipped_total, len(self.skipped))

    def jobs(self, size: int) -> Iterator:
        """What tokenizing takes, `size` records at a time: lists of records, or a streamed JSON-lines file's
        raw lines (`stream.RawLines`), which the worker that tokenizes them parses (the scan parsed them here)."""
        source = self.stream() if self.stream is not None else None
        if hasattr(source, "line_chunks"):
            yield from source.line_chunks(size)
        else:
            yield from self.chunks(size)

    def chunks(self, size: int) -> Iterator[list[Record]]:
        if self.stream is None:
            yield from (self.records[i : i + size] for i in range(0, len(self.records), size))
            return
        chunk = []
        for record in self.stream():
            chunk.append(record)
            if len(chunk) == size:
                yield chunk
                chunk = []
        if chunk:
            yield chunk


@dataclass
class LoadedData:
    train: list[LoadedDataset]
    val: list[LoadedDataset]

    def fingerprints(self) -> list[str]:
        return [d.fingerprint for d in self.train + self.val]


# --------------------------------------------------------------------------- shared steps

def render_options(spec, has_template: bool) -> RenderOptions:
    chat = spec.prompt_style == "chat" or (spec.prompt_style == "auto" and has_template)
    return RenderOptions(frozenset(spec.roles_to_train), spec.train_on_inputs, spec.train_on_eos, chat,
                         spec.system_prompt, spec.tool_format)


def record_for_eval(fmt: str, data: dict, opts: RenderOptions) -> dict:
    """The record as evaluation reads it: prompt/response data rendered as chat gets the
    conversation it was trained as, so generation checks work on it too; a record with tools
    carries the tool format its dataset rendered them in."""
    if uses_tools(data):
        data = {**data, EVAL_TOOL_FORMAT: opts.tool_format}
    if not opts.chat or fmt not in ("instruction", "completion"):
        return data
    if fmt == "instruction":
        prompt, answer, system = instruction_prompt(data)[0], data["output"], data.get("system") or opts.system_prompt
    else:
        prompt, answer, system = data["prompt"], data["completion"], opts.system_prompt
    if not isinstance(prompt, str) or not isinstance(answer, str):
        return data
    head = [{"role": "system", "content": system}] if system else []
    return {**data, "messages": head + [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}


def fit_length(examples: list, records: list[dict], max_len: int, policy: str, report: DataReport):
    """Truncate or drop what is longer than `max_len`; drop what has nothing to learn."""
    out_ex, out_rec = [], []
    for ex, rec in zip(examples, records):
        if len(ex) > max_len:
            # Never cut through an image's tokens: its pixels would have no place left.
            if policy == "drop" or getattr(ex, "image_end", 0) > max_len:
                report.dropped_too_long += 1
                continue
            report.truncated += 1
            ex = ex.truncated(max_len)
        if not ex.has_target():
            report.dropped_no_target += 1
            continue
        out_ex.append(ex)
        out_rec.append(rec)
    report.dropped = report.dropped_too_long + report.dropped_no_target
    return out_ex, out_rec


