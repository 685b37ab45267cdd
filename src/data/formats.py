"""Dataset formats: which fields each holds, how one is recognised, what each method accepts.

A file's format is decided from all its records, not the first one: every
record is matched against the formats below (most specific first), and the
file must agree on one. A record that matches nothing in a file whose other
records agree is reported as missing that format's fields; a file whose
records match different formats is reported as mixing them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import DataError
from .images import image_reference
from .readers import Problem, RawSource, Record, record_error
from .tools import IMAGE_PART_TYPES, check_tool_calls, check_tools, join_content_parts

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT and similar datasets name roles differently.
ROLE_ALIASES = {"human": "user", "gpt": "assistant", "model": "assistant", "bot": "assistant",
                "function": "tool", "observation": "tool"}


@dataclass(frozen=True)
class Format:
    name: str
    keys: tuple[tuple[str, ...], ...]   # alternative sets of required fields
    example: dict                       # a minimal valid record (docs/data.md shows the same)

    def describe_keys(self) -> str:
        return " or ".join("{" + ", ".join(repr(k) for k in ks) + "}" for ks in self.keys)


_MSGS = [{"role": "user", "content": "Turn on the lights"}, {"role": "assistant", "content": "lights_on"}]

# Order matters: detection takes the first format whose fields a record has,
# so a format whose fields extend another's comes before it (kto before completion).
FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("chat", (("messages",), ("conversations",)),
           {"messages": _MSGS}),
    Format("prm", (("prompt", "completions", "labels"),),
           {"prompt": "What is 2+3*4?", "completions": ["3*4 = 12", "2 + 12 = 14"], "labels": [True, True]}),
    Format("preference", (("prompt", "chosen", "rejected"),),
           {"prompt": "Say hi", "chosen": "Hello!", "rejected": "Go away."}),
    Format("kto", (("prompt", "completion", "label"),),
           {"prompt": "Say hi", "completion": "Hello!", "label": True}),
    Format("completion", (("prompt", "completion"),),
           {"prompt": "The capital of France is", "completion": " Paris."}),
    Format("rl", (("prompt",),),
           {"prompt": "What is 6*7?", "answer": "42"}),
    Format("reward", (("text", "label"),),
           {"text": "Q: 2+2? A: 4", "label": 1.0}),
    Format("text", (("text",),),
           {"text": "Any text; every token carries loss."}),
    Format("instruction", (("instruction", "output"), ("instruction", "response"), ("input", "output")),
           {"instruction": "Translate to French", "input": "cat", "output": "chat"}),
)}

# Formats whose records hold messages, and so may carry a `tools` column.
TOOL_FORMATS_WITH_MESSAGES = ("chat", "completion", "kto", "preference", "rl")

# Which formats each training method consumes.
METHOD_FORMATS: dict[str, tuple[str, ...]] = {
    "sft": ("chat", "text", "instruction", "completion"),
    "dpo": ("preference",),
    "ipo": ("preference",),
    "simpo": ("preference",),
    "orpo": ("preference",),
    "kto": ("kto",),
    "rm": ("reward", "preference"),
    "prm": ("prm",),
    "grpo": ("rl",),
}


def check_method_format(method: str, fmt: str, where: str) -> None:
    """Raise a DataError when `method` cannot train on `fmt` data, naming the fields it needs."""
    accepted = METHOD_FORMATS.get(method)
    if accepted is None:
        raise DataError(where, None, f"unknown method {method!r}; known: {', '.join(METHOD_FORMATS)}")
    if fmt in accepted:
        return
    wanted = "; ".join(f"{name} {FORMATS[name].describe_keys()}" for name in accepted)
    raise DataError(where, None, f"method {method!r} cannot train on {fmt!r} data "
                                 f"(fields {FORMATS[fmt].describe_keys()}); it expects {wanted}")


# --------------------------------------------------------------------------- mapping

def rename_fields(record: dict, field_map: dict[str, str]) -> dict:
    """Apply `field_map` (source name -> our name) to the record and to the keys inside its messages."""
    if not field_map:
        return record
    out = {field_map.get(k, k): v for k, v in record.items()}
    for key in ("messages", "conversations", "prompt", "chosen", "rejected", "completion"):
        value = out.get(key)
        if isinstance(value, list) and all(isinstance(m, dict) for m in value):
            out[key] = [{field_map.get(k, k): v for k, v in m.items()} for m in value]
    return out


def matching_format(record: dict) -> str | None:
    for fmt in FORMATS.values():
        if any(all(k in record for k in ks) for ks in fmt.keys):
            return fmt.name
    return None


def detect_format(source: RawSource, declared: str = "auto", tolerant: bool = False) -> str:
    """The one format the source's records share (or the declared one, checked on every record).

    With `tolerant`, a file that mixes formats is read as its most common
    format, and the other records are reported as bad instead.
    """
    if declared != "auto":
        return declared
    seen: dict[str, list[Record]] = {}
    for rec in source.records:
        fmt = matching_format(rec.data)
        if fmt is not None:
            seen.setdefault(fmt, []).append(rec)
    if not seen:
        first = source.records[0]
        expected = "; ".join(f"{f.name} {f.describe_keys()}" for f in FORMATS.values())
        raise record_error(source.name, first, f"no known format: found fields {_fields(first.data)}; expected one of: "
                                               f"{expected} (rename fields with field_map, or set type:)")
    if len(seen) > 1 and not tolerant:
        raise DataError(source.name, None, _describe_mix(seen))
    return max(seen, key=lambda fmt: len(seen[fmt]))


def _describe_mix(seen: dict[str, list[Record]]) -> str:
    ranked = sorted(seen.items(), key=lambda kv: -len(kv[1]))
    main, main_recs = ranked[0]
    parts = [f"{main} ({len(main_recs)} records, first at {main_recs[0].where()})"]
    for fmt, recs in ranked[1:]:
        missing = _missing_keys(FORMATS[main], recs[0].data)
        hint = f"; missing {', '.join(map(repr, missing))} for {main}?" if missing else ""
        parts.append(f"{fmt} ({len(recs)} records, first at {recs[0].where()}{hint})")
    return f"the file mixes formats: {', '.join(parts)}; use one format per file, or set type: per dataset"


def _missing_keys(fmt: Format, record: dict) -> list[str]:
    """The fields the record lacks for the closest of the format's key sets."""
    options = [[k for k in ks if k not in record] for ks in fmt.keys]
    return min(options, key=len)


# --------------------------------------------------------------------------- validation

def normalize_records(source: RawSource, fmt: str, tolerant: bool, images: bool = False) -> list[Record]:
    """Each record checked against `fmt` and brought to its canonical shape.

    Bad records raise a DataError at their line, or are recorded in
    `source.problems` and left out when `tolerant` is set. With `images` (a
    vision-language model), chat messages may hold image parts (see images.py).
    """
    out = []
    for rec in source.records:
        try:
            data = normalize_record(fmt, rec.data, images)
        except ValueError as exc:
            if not tolerant:
                raise record_error(source.name, rec, str(exc)) from None
            message = str(exc) if rec.line is not None else f"row {rec.row}: {exc}"
            source.problems.append(Problem(rec.line, message))
            continue
        out.append(Record(data, rec.row, rec.line))
    if not out:
        first = source.problems[0]
        raise DataError(source.name, first.line, f"no usable records: all {len(source.problems)} were bad; "
                                                 f"the first: {first.message}")
    return out


def normalize_record(fmt: str, record: dict, images: bool = False) -> dict:
    """A copy of the record in canonical form; ValueError says what is wrong."""
    spec = FORMATS[fmt]
    missing = _missing_keys(spec, record)
    if missing:
        raise ValueError(f"missing field {', '.join(map(repr, missing))} for {fmt} format "
                         f"(expected {spec.describe_keys()}, found fields {_fields(record)})")
    out = dict(record)
    if fmt in TOOL_FORMATS_WITH_MESSAGES and record.get("tools") is not None:
        out["tools"] = check_tools(record["tools"])
    if fmt == "chat":
        key = "messages" if "messages" in record else "conversations"
        out.pop("conversations", None)
        out["messages"] = check_messages(record[key], key, images)
    elif fmt == "text":
        check_str(record, "text")
    elif fmt == "instruction":
        if "instruction" not in record:          # {"input", "output"}: the input is the instruction
            out["instruction"] = out.pop("input")
        response_key = "output" if "output" in out else "response"
        out["output"] = out.pop(response_key)
        out.pop("response", None)
        check_str(out, "instruction", "input" if "instruction" not in record else "instruction")
        check_str(out, "output", response_key)
        if out.get("input") is not None:
            check_str(out, "input")
        if out.get("system") is not None:
            check_str(out, "system")
    elif fmt in ("completion", "kto"):
        out["prompt"] = check_text_or_messages(record, "prompt")
        out["completion"] = check_text_or_messages(record, "completion")
        if fmt == "kto":
            check_bool(record, "label")
    elif fmt == "preference":
        for key in ("prompt", "chosen", "rejected"):
            out[key] = check_text_or_messages(record, key)
    elif fmt == "reward":
        check_str(record, "text")
        value = record["label"]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"field 'label' must be a number (the score), found {_kind(value)}")
        out["label"] = float(value)
    elif fmt == "rl":
        out["prompt"] = check_text_or_messages(record, "prompt")
    elif fmt == "prm":
        check_str(record, "prompt")
        steps, labels = record["completions"], record["labels"]
        if not isinstance(steps, list) or not steps or not all(isinstance(s, str) and s.strip() for s in steps):
            raise ValueError(f"field 'completions' must be a non-empty list of non-empty strings (the steps), "
                             f"found {_kind(steps)}")
        if not isinstance(labels, list) or not all(isinstance(b, bool) for b in labels):
            raise ValueError(f"field 'labels' must be a list of true/false, one per step, found {_kind(labels)}")
        if len(labels) != len(steps):
            raise ValueError(f"'labels' has {len(labels)} entries but 'completions' has {len(steps)} steps")
    return out


def check_str(record: dict, key: str, shown: str | None = None) -> None:
    if not isinstance(record.get(key), str):
        raise ValueError(f"field {shown or key!r} must be a string, found {_kind(record.get(key))}")


def check_bool(record: dict, key: str) -> None:
    if not isinstance(record.get(key), bool):
        raise ValueError(f"field {key!r} must be true or false, found {_kind(record.get(key))}")


def check_text_or_messages(record: dict, key: str) -> str | list[dict]:
    value = record[key]
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return check_messages(value, key)
    raise ValueError(f"field {key!r} must be a string or a list of messages, found {_kind(value)}")


def check_messages(messages, key: str = "messages", images: bool = False) -> list[dict]:
    """Messages as [{"role", "content", "train"?}], accepting ShareGPT's {"from", "value"} too.
    With `images`, a message with image parts keeps them, in order, as "parts" beside its text."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"field {key!r} must be a non-empty list of {{'role', 'content'}} objects, "
                         f"found {_kind(messages)}")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"{key}[{i}] must be an object with 'role' and 'content', found {_kind(msg)}")
        role = msg.get("role", msg.get("from"))
        if not isinstance(role, str):
            raise ValueError(f"{key}[{i}] needs a string 'role', found {_kind(role)}")
        role = ROLE_ALIASES.get(role, role)
        if role not in ROLES:
            raise ValueError(f"{key}[{i}].role {_short(role)} is not one of {', '.join(ROLES)} "
                             f"(or ShareGPT's {', '.join(ROLE_ALIASES)})")
        clean = {"role": role, "content": check_content(msg, f"{key}[{i}]", images)}
        if images and isinstance(msg.get("content"), list):
            parts = image_parts(msg["content"], f"{key}[{i}].content", role)
            if parts:
                clean["parts"] = parts
        if msg.get("tool_calls"):
            if role != "assistant":
                raise ValueError(f"{key}[{i}] has tool_calls but its role is {role!r}; only assistant turns call tools")
            clean["tool_calls"] = check_tool_calls(msg["tool_calls"], f"{key}[{i}].tool_calls")
        for extra in ("name", "tool_call_id"):      # which call a tool result answers; some templates write them
            if role == "tool" and isinstance(msg.get(extra), str):
                clean[extra] = msg[extra]
        train = msg.get("train")
        if train is not None:
            if not isinstance(train, bool):
                raise ValueError(f"{key}[{i}].train must be true or false, found {_kind(train)}")
            if train and role == "tool":
                raise ValueError(f"{key}[{i}].train is true on a tool result; tool results never carry loss "
                                 "(they are what the tool returned, not what the model writes)")
            clean["train"] = train
        out.append(clean)
    return out


def check_content(msg: dict, where: str, images: bool = False) -> str:
    """A message's text: a string, or a list of content parts whose text parts are joined.
    An assistant turn that only calls tools may have no content (null), as OpenAI exports write it."""
    content = msg.get("content", msg.get("value"))
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return join_content_parts(content, f"{where}.content", images)
    if content is None and msg.get("tool_calls"):
        return ""
    raise ValueError(f"{where}.content must be a string, found {_kind(content)} "
                     "(a list of content parts [{'type': 'text', 'text': ...}] is accepted too)")


def image_parts(content: list, where: str, role: str) -> list[dict] | None:
    """The parts of a message holding images, as [{"type": "text", "text"} | {"type": "image", "image": path}]
    in their order (None without images); the paths are resolved later, beside the data file."""
    parts, seen = [], False
    for j, part in enumerate(content):
        kind = part.get("type", "text" if "text" in part else None)
        if kind in IMAGE_PART_TYPES or (kind is None and ("image" in part or "image_url" in part)):
            if role != "user":
                raise ValueError(f"{where}[{j}] is an image in a {role!r} turn; images go in user turns "
                                 "(the model reads images, it does not write them)")
            parts.append({"type": "image", "image": image_reference(part, f"{where}[{j}]")})
            seen = True
        else:
            parts.append({"type": "text", "text": part["text"]})
    return parts if seen else None


def _kind(value) -> str:
    if value is None:
        return "nothing (null or absent)"
    return f"{type(value).__name__} {_short(value)}"


def _short(value, limit: int = 40) -> str:
    """repr(value) cut to `limit` characters: a record may hold megabytes, its error message should not.
    A long string is cut before its repr is built."""
    text = repr(value[:limit] if isinstance(value, str) else value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fields(record: dict) -> str:
    """The record's field names for a message: sorted, each cut short, at most 12 of them."""
    names = sorted(map(str, record))
    shown = ", ".join(_short(n) for n in names[:12])
    return f"[{shown}{f', ... ({len(names) - 12} more)' if len(names) > 12 else ''}]"
