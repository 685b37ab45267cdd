"""The before/after table printed at the end of a run: held-out loss, exact match, accuracy or GRPO's
held-out rewards, one row each, evaluated before and after training."""

from __future__ import annotations


def before_after_table(result) -> str:
    """The rows that either evaluation measured, aligned; an empty string when neither ran."""
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
