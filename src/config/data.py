"""The `data` section: which datasets, how their records become token rows, and how rows are batched.

Whether `chat_template` names a template that exists is the check step's (`mudpuppy.configure`), since
the built-in templates live in `data/`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_serializer, model_validator

from .base import _Strict, outside_check

# One record's size limit by default: 4 MiB, about a million tokens of text, past any sequence a model
# trains on. Tokenizing one record takes a few hundred times its size in memory (measured through
# `mudpuppy preprocess` on the tiny test tokenizer: a 4 MB line peaked at 2.0 GB, a 16 MB one at 6.8 GB,
# a 60 MB one past 10 GB), so a larger default would not bound anything.
MAX_RECORD_BYTES = 4 * 2**20

DATASET_TYPES = (
    "auto", "chat", "text", "instruction", "completion",
    "preference", "kto", "reward", "rl", "prm",
)


class DatasetSpec(_Strict):
    """One dataset: where it is, what format it holds, and how its records become tokens.

    Formats, fields and options are documented with examples in docs/data.md.
    """

    path: str = Field(min_length=1, description="JSONL/JSON/CSV/Parquet file, or hub dataset name")
    type: Literal[DATASET_TYPES] = "auto"  # type: ignore[valid-type]
    split: str = Field("train", description="hub datasets: which split to read")
    subset: str | None = Field(None, description="hub datasets: the configuration (subset) name")
    streaming: bool = Field(False, description="hub datasets: read rows as they download, nothing prepared on disk first")
    field_map: dict[str, str] = Field(default_factory=dict, description="source field -> our field")
    roles_to_train: list[Literal["system", "user", "assistant", "tool"]] = ["assistant"]
    train_on_inputs: bool = Field(False, description="prompt tokens carry loss too")
    train_on_eos: Literal["turn", "last", "none"] = Field(
        "turn", description="which end-of-turn markers carry loss: every trained turn's, the last one's, or none")
    prompt_style: Literal["auto", "chat", "raw"] = Field(
        "auto", description="render prompt/response formats through the chat template (chat), as plain text "
                            "(raw), or chat when a template is available (auto)")
    system_prompt: str | None = Field(None, description="system message put before prompts rendered as chat")
    tool_format: Literal["auto", "template", "hermes", "llama3"] = Field(
        "auto", description="how tool schemas and calls are written: the chat template's own (template), a built-in "
                            "format (hermes, llama3), or the template when it renders tool calls, else built-in (auto)")
    num_samples: int | None = Field(None, gt=0, description="use the first N records")
    weight: float | None = Field(None, gt=0, description="scale this dataset's share of training examples")
    ratio: float | None = Field(None, gt=0, le=1, description="this dataset's target share of the training mix "
                                                               "(every dataset then has one; they add up to 1)")

    @model_serializer(mode="wrap")
    def _unset_ratio_left_out(self, handler):
        # A run checkpointed before `ratio` existed records no such key for its datasets; --resume reads a key
        # one side lacks inside a list as a change (resume_changes.compare): an unset ratio stays out of dumps.
        # So does an unset `streaming`, which also keeps the data cache keys of earlier runs.
        dumped = handler(self)
        if isinstance(dumped, dict) and dumped.get("ratio") is None:
            dumped.pop("ratio", None)
        if isinstance(dumped, dict) and dumped.get("streaming") is False:
            dumped.pop("streaming", None)
        return dumped


class DataConfig(_Strict):
    datasets: list[DatasetSpec] = Field(min_length=1)
    val_datasets: list[DatasetSpec] = Field(default_factory=list)
    val_set_size: float = Field(0.0, ge=0.0, description="fraction (<1) or count (>=1) held out")
    sequence_len: int = Field(2048, gt=8)
    truncation: Literal["truncate", "drop"] = "truncate"
    chat_template: str | None = Field(
        None, description="'tokenizer' (default), a built-in name (chatml, llama3, ...), or a Jinja template")
    packing: bool = Field(False, description="pack examples into sequence_len rows, attention isolated per example")
    tokens_per_batch: int | None = Field(
        None, gt=0, description="token budget per micro-batch (padded size); replaces micro_batch_size")
    group_by_length: bool = Field(False, description="batch examples of similar length together")
    shuffle: bool = True
    skip_bad_records: bool = False
    max_record_bytes: int = Field(
        MAX_RECORD_BYTES, gt=0, description="largest record read from a data file (a JSON line's bytes); a larger "
                                            "one is an error naming file:line (or skipped with skip_bad_records)")
    num_proc: int | None = Field(
        None, gt=0, description="worker processes tokenizing SFT data; default: the cores this process may use")
    cache: bool = Field(True, description="reuse data tokenized by `mudpuppy preprocess` when it still matches")
    cache_dir: str | None = Field(None, description="where tokenized data is cached; default <mudpuppy cache>/data")

    @field_validator("val_set_size")
    @classmethod
    def _whole_counts(cls, v):
        if v >= 1 and v != int(v):
            raise ValueError("a count must be a whole number; a fraction must be below 1")
        return v

    @field_validator("chat_template")
    @classmethod
    def _known_template(cls, v, info: ValidationInfo):
        outside_check(info, "data.chat_template", v)    # 'tokenizer', a built-in name, or a Jinja template
        return v

    @model_validator(mode="after")
    def _ratios_make_one_mix(self):
        problems = ratio_problems(self.datasets, self.val_datasets)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _budget_fits_a_sequence(self):
        if self.tokens_per_batch is not None and self.tokens_per_batch < self.sequence_len:
            raise ValueError(f"tokens_per_batch ({self.tokens_per_batch}) must be at least sequence_len "
                             f"({self.sequence_len}), or the longest examples fit in no batch")
        return self



def ratio_problems(datasets: list[DatasetSpec], val_datasets: list[DatasetSpec]) -> list[str]:
    """`ratio` is each training dataset's share of one mix: all of them have one, adding up to 1, and no
    dataset scales its share with `weight` besides (two ways of saying the same thing would disagree)."""
    held = [f"val_datasets[{i}]" for i, s in enumerate(val_datasets) if s.ratio is not None]
    if held:
        return [f"{', '.join(held)}: ratio mixes training data; held-out datasets are used whole, drop their ratio"]
    with_ratio = [i for i, s in enumerate(datasets) if s.ratio is not None]
    if not with_ratio:
        return []
    weighted = [i for i, s in enumerate(datasets) if s.weight is not None]
    if weighted:
        return [f"ratio (datasets[{with_ratio[0]}]) and weight (datasets[{weighted[0]}]) are exclusive in one config: "
                "give every dataset a ratio (its share of the mix), or scale datasets with weight alone"]
    missing = [f"datasets[{i}]" for i, s in enumerate(datasets) if s.ratio is None]
    if missing:
        return [f"{', '.join(missing)} {'has' if len(missing) == 1 else 'have'} no ratio: when one dataset sets "
                "its share of the mix with ratio, every training dataset needs one"]
    total = sum(s.ratio for s in datasets)
    if abs(total - 1) > 1e-6:
        return [f"the datasets' ratios add up to {total:g}; they are shares of the training mix and must add up to 1"]
    return []
