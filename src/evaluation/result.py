"""What a held-out evaluation measured, for every method: one type, and the one way to print it.

SFT, QAT and GPTQ measure the language model (loss, perplexity, exact match: heldout.py); preference,
reward and PRM runs measure their objective (loss, the method's accuracy and its other metrics:
objective.py); GRPO measures the weighted reward of greedy completions (training/grpo.py). Each fills
the fields it measured and leaves the rest None, so a reader (the end-of-run table, run_summary.json,
the loop's early stopping) asks the fields, never the type.

`as_dict` keeps each family's layout of run_summary.json's eval_before / eval_after as it has always
been (readers of old runs depend on it), and `from_dict` reads any of them back: a resumed run gets
its numbers from before training out of its checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

REWARD_KEY = "eval_reward"                      # GRPO's held-out reward, in metrics.jsonl and run_summary.json
REWARDS_PREFIX, REWARDS_SUFFIX = "eval_rewards/", "/mean"     # each reward function's mean: eval_rewards/NAME/mean
MODEL_FIELDS = ("loss", "perplexity", "exact_match", "samples", "examples")


@dataclass
class EvalResult:
    loss: float | None = None
    perplexity: float | None = None
    exact_match: float | None = None
    samples: int = 0                            # held-out examples (pairs, prompts) measured
    examples: list[dict] | None = None          # a few (reference, prediction) pairs
    accuracy: float | None = None               # an objective's headline accuracy (reward or step accuracy)
    accuracy_name: str | None = None            # set by objective-trained methods alone, even without accuracy
    metrics: dict[str, float] | None = None     # every metric the objective reports
    reward: float | None = None                 # GRPO: the weighted reward (higher is better)
    rewards: dict[str, float] | None = None     # GRPO: each reward function's mean, by name

    def as_dict(self) -> dict:
        """run_summary.json's layout for the method family that measured this."""
        if self.reward is not None:             # as GRPO's loop logs it, rounded to 6 places
            return {REWARD_KEY: round(self.reward, 6),
                    **{f"{REWARDS_PREFIX}{name}{REWARDS_SUFFIX}": round(value, 6)
                       for name, value in (self.rewards or {}).items()}}
        if self.accuracy_name is not None:      # an objective: every key, a missing accuracy as null
            return {"loss": self.loss, "accuracy": self.accuracy, "accuracy_name": self.accuracy_name,
                    "metrics": self.metrics if self.metrics is not None else {}, "samples": self.samples}
        return {name: value for name in MODEL_FIELDS if (value := getattr(self, name)) is not None}

    @classmethod
    def from_dict(cls, data: dict) -> "EvalResult":
        """What `as_dict` wrote, for any method family."""
        if REWARD_KEY in data:
            return cls(reward=data[REWARD_KEY], rewards={
                key[len(REWARDS_PREFIX) : -len(REWARDS_SUFFIX)]: value for key, value in data.items()
                if key.startswith(REWARDS_PREFIX) and key.endswith(REWARDS_SUFFIX)})
        return cls(**data)

    def describe(self, count: bool = True) -> str:
        """One line for the run's output: `held-out loss 1.2345, exact match 50.0% (8 examples)`."""
        if self.reward is not None:
            return f"held-out reward {self.reward:.4f}" + (f" (greedy, {self.samples} prompts)" if count else "")
        parts = [] if self.loss is None else [f"held-out loss {self.loss:.4f}"]
        if self.exact_match is not None:
            parts.append(f"exact match {self.exact_match:.1%}")
        if self.accuracy is not None:
            parts.append(f"{self.accuracy_name} {self.accuracy:.1%}")
        return ", ".join(parts) + (f" ({self.samples} examples)" if count else "")

    def for_loop(self) -> tuple[float, dict]:
        """What the training loop's `evaluate` returns (loop.Evaluate): the number early stopping watches,
        lower is better (the loss, or the reward negated), and the fields metrics.jsonl logs."""
        if self.reward is not None:
            return -self.reward, self.as_dict()
        fields = {"eval_loss": round(self.loss, 6)}
        fields.update({f"eval_{key}": round(value, 6) for key, value in (self.metrics or {}).items()})
        return self.loss, fields


def before_after_table(before: EvalResult | None, after: EvalResult | None) -> str:
    """The rows that either evaluation measured, aligned; an empty string when neither ran."""
    if before is None and after is None:
        return ""
    both = (before, after)
    rows = [("", "before", "after")]

    def row(label: str, name: str, fmt: str) -> None:
        values = [None if ev is None else getattr(ev, name) for ev in both]
        if any(value is not None for value in values):
            rows.append((label, *("-" if value is None else fmt.format(value) for value in values)))

    row("held-out loss", "loss", "{:.4f}")
    row("exact match", "exact_match", "{:.1%}")
    row(((after or before).accuracy_name or "accuracy").replace("_", " "), "accuracy", "{:.1%}")
    if (after or before).reward is not None:      # GRPO: the numbers run_summary.json holds, by name
        numbers = [ev.as_dict() if ev is not None else {} for ev in both]
        for key in dict.fromkeys([*numbers[0], *numbers[1]]):
            label = key.removeprefix("eval_").replace("rewards/", "").replace(REWARDS_SUFFIX, "")
            rows.append((label, *(f"{n[key]:.3f}" if n.get(key) is not None else "-" for n in numbers)))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def loss_table(rows: list[tuple[str, EvalResult]]) -> str:
    """Held-out loss of several models of one run, each against the first (GPTQ: original, round-to-nearest,
    GPTQ). Every row must have a loss."""
    first = rows[0][1].loss
    lines = [f"held-out loss      loss     vs {rows[0][0]}"]
    for name, ev in rows:
        lines.append(f"  {name:<16} {ev.loss:.4f}  {ev.loss - first:+.4f}")
    return "\n".join(lines)
