"""What a finished run leaves for people: curves (loss.png and each method's own) and a model card (README.md).

Both are written from what the run already wrote to its output directory
(metrics.jsonl, config.yaml, the summary), by rank 0, just before
run_summary.json (training/results.write_summary calls write_run_report).
A chart or card name that holds a file the run did not write (the user's
README.md, put in the live run directory before the card was written: the
run's marker does not list it) is never written over: the run's own goes
beside it as NAME.mudpuppy.EXT (README.mudpuppy.md, loss.mudpuppy.png), said
in one line; if that name is someone else's too, that file is skipped.
The charts need matplotlib (`pip install 'mudpuppy[plot]'`); without it
they are skipped and the card says so. The card replaces the
placeholder README.md that PEFT's save_pretrained writes, keeping the front
matter the Hugging Face Hub and PEFT read (base_model, library_name, tags).
"""

from __future__ import annotations

import json
import math
import shlex
import sys
from pathlib import Path

import yaml

from .metrics import METRICS

LOSS_PNG = "loss.png"
CARD = "README.md"

# Each method's key curves beyond the loss: (file, title, [(metric, label)]) each.
REWARD = ("reward.png", "Reward", [("reward", "mean reward (sampled)"), ("eval_reward", "held-out reward (greedy)")])
IMPLICIT = ("margins.png", "Implicit reward", [("reward_margin", "margin (chosen - rejected)"),
                                               ("reward_accuracy", "accuracy")])
METHOD_CURVES = {
    "grpo": (REWARD,),
    "rloo": (REWARD,),                       # GRPO's rollouts and reward names
    "online_dpo": (REWARD, IMPLICIT),        # the sampled pairs' rewards, and DPO's implicit reward on them
    "preference": (IMPLICIT,),
    "rm": (("margins.png", "Reward model", IMPLICIT[2]),),
    "prm": (("accuracy.png", "Step accuracy", [("step_accuracy", "step accuracy")]),),
}


def read_metrics(out: Path) -> list[dict]:
    path = out / METRICS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric, skipping rows without it and nulls."""
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None and "step" in r]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def smooth(values: list[float], weight: float | None = None) -> list[float]:
    """An exponential moving average, debiased like TensorBoard's, so the first points are not pulled to 0."""
    if not values:
        return []
    weight = weight if weight is not None else min(0.9, 1 - 4 / max(len(values), 5))
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight ** i))
    return out


# --------------------------------------------------------------------------- charts

def write_charts(out: Path, method: str, rows: list[dict], place=lambda name: name) -> list[str]:
    """loss.png and the method's own curve; the file names written (none without matplotlib or metrics).
    `place(name)`: the name to write `name` under (None: not at all), the run's own names (Places)."""
    try:
        from matplotlib.figure import Figure     # no pyplot: no GUI backend, no global state
    except ImportError:
        return []
    written = []
    steps, loss = series(rows, "loss")
    if steps:
        fig = Figure(figsize=(8, 6.5), dpi=100)
        ax, lr_ax = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1])
        ax.plot(steps, loss, color="#9ab8d8", linewidth=1, label="training loss")
        ax.plot(steps, smooth(loss), color="#1f5aa6", linewidth=2, label="training loss (smoothed)")
        e_steps, e_loss = series(rows, "eval_loss")
        if e_steps:
            ax.plot(e_steps, e_loss, "o-", color="#d9541e", label="held-out loss")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend()
        lr_steps, lr = series(rows, "lr")
        lr_ax.plot(lr_steps, lr, color="#555555")
        lr_ax.set_ylabel("learning rate")
        lr_ax.set_xlabel("optimizer step")
        lr_ax.grid(alpha=0.3)
        fig.suptitle(f"{out.name}: {method}")
        fig.tight_layout()
        target = place(LOSS_PNG)
        if target is not None:
            fig.savefig(out / target)
            written.append(target)
    for name, title, keys in METHOD_CURVES.get(method, ()):
        present = [(k, label, *series(rows, k)) for k, label in keys]
        present = [p for p in present if p[2]]
        if present:
            fig = Figure(figsize=(8, 4), dpi=100)
            ax = fig.subplots()
            for _key, label, xs, ys in present:
                ax.plot(xs, ys, linewidth=1, alpha=0.5 if len(xs) > 1 else 1, marker="o" if len(xs) < 3 else None)
                if len(xs) > 1:
                    ax.plot(xs, smooth(ys), linewidth=2, color=ax.lines[-1].get_color(), label=label)
                else:
                    ax.lines[-1].set_label(label)
            ax.set_xlabel("optimizer step")
            ax.set_title(title)
            ax.grid(alpha=0.3)
            ax.legend()
            fig.tight_layout()
            target = place(name)
            if target is not None:
                fig.savefig(out / target)
                written.append(target)
    return written


# --------------------------------------------------------------------------- model card

def upstream_model(base_model: str) -> str:
    """The base model as the Hub knows it: an alias maps to the model its packaged weights came from."""
    from ..backends.models import MODEL_ALIASES

    alias = MODEL_ALIASES.get(base_model.lower())
    return alias.upstream if alias is not None and alias.upstream else base_model


def hub_link(model: str) -> str:
    """A Markdown link for a Hub id; a local path stays plain text."""
    from ..backends.models import HUB_ID

    if HUB_ID.match(model) and "/" in model and not Path(model).expanduser().exists():
        return f"[{model}](https://huggingface.co/{model})"
    return f"`{model}`"


def hub_datasets(cfg: dict) -> list[str]:
    """Datasets named by Hub id (not local files), for the card's `datasets:`."""
    names = []
    for spec in (cfg.get("data") or {}).get("datasets", []):
        path = str(spec.get("path", ""))
        local = path.startswith((".", "/", "~")) or Path(path).suffix in (".jsonl", ".json", ".csv", ".tsv",
                                                                            ".parquet", ".gz", ".txt")
        if path and not local and "/" in path and path not in names:
            names.append(path)
    return names


def command_line() -> str | None:
    """The command that started this process, when it was the mudpuppy CLI."""
    argv = sys.argv
    if not argv:
        return None
    prog = Path(argv[0]).name
    if prog in ("mudpuppy", "__main__.py") or prog.startswith("mudpuppy"):
        return "mudpuppy " + shlex.join(argv[1:])
    return None


def _fmt(value) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if 0 < abs(value) < 1e-3 or abs(value) >= 1e5:
            return f"{value:.3g}"
        return f"{value:.4f}".rstrip("0").rstrip(".") if abs(value) < 100 else f"{value:.1f}"
    return "-" if value is None else str(value)


PERCENT_KEYS = ("exact_match", "contains", "regex", "accuracy", "reward_accuracy", "step_accuracy")


def _percent(value) -> str:
    return "-" if value is None else f"{float(value):.1%}"


def results_table(summary: dict) -> list[str]:
    before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    keys = [k for k in dict.fromkeys([*before, *after])
            if k != "samples" and isinstance(before.get(k, after.get(k)), (int, float))]
    if not keys:
        return []
    lines = ["| held-out | before | after |", "| --- | --- | --- |"]
    for k in keys:
        fmt = _percent if k in PERCENT_KEYS else _fmt
        lines.append(f"| {k.replace('_', ' ')} | {fmt(before.get(k))} | {fmt(after.get(k))} |")
    samples = after.get("samples") or before.get("samples")
    if samples:
        lines.append("")
        lines.append(f"Measured on {samples} held-out examples by the run itself.")
    return lines


def settings_rows(cfg: dict, summary: dict) -> list[tuple[str, str]]:
    t, a, d = cfg.get("training", {}), cfg.get("adapter", {}), cfg.get("data", {})
    method = cfg.get("method", "sft")
    section = cfg.get(method) if isinstance(cfg.get(method), dict) else None
    rows = [("method", method + (f" ({section['type']})" if section and "type" in section else ""))]
    kind = a.get("type", "lora")
    if kind != "none":
        desc = f"{kind}, r={a.get('r')}, alpha={a.get('alpha')}, targets {a.get('target_modules')}"
        if kind == "qlora":
            desc += f", base quantized {a.get('quant_backend')}"
        rows.append(("adapter", desc))
    else:
        rows.append(("adapter", "none (full fine-tuning)"))
    rows += [
        ("backend", str(cfg.get("backend"))),
        ("steps", str(summary.get("steps"))),
        ("learning rate", f"{t.get('learning_rate')} ({t.get('lr_scheduler')}, warmup {t.get('warmup_steps', 0)})"),
        ("batch", f"{t.get('micro_batch_size')} x {t.get('gradient_accumulation_steps')} accumulation"),
        ("sequence length", str(d.get("sequence_len"))),
        ("precision", str(t.get("precision"))),
        ("seed", str(t.get("seed"))),
        ("examples", f"{summary.get('train_examples')} train / {summary.get('val_examples')} held-out"),
        ("time", f"{summary.get('seconds')} s, {summary.get('tokens_per_second')} tokens/s"),
    ]
    return rows


def model_card(out: Path, cfg: dict, summary: dict, charts: list[str], plots_missing: bool) -> str:
    from ..backends.provenance import describe_provenance

    record = summary.get("base") if isinstance(summary.get("base"), dict) else None
    given = str(cfg.get("model", {}).get("base_model", ""))
    base = record["base_model_name_or_path"] if record else upstream_model(given)
    adapter = (cfg.get("adapter") or {}).get("type", "lora") != "none"
    method = cfg.get("method", "sft")
    tags = ["mudpuppy", method]
    section = cfg.get(method) if isinstance(cfg.get(method), dict) else None
    if section and "type" in section:
        tags.append(section["type"])
    if adapter:
        tags += [cfg["adapter"]["type"], f"base_model:adapter:{base}"]
    # rm/prm save the whole model with the adapter merged in (the adapter goes to adapter/).
    peft_dir = adapter and method not in ("rm", "prm")
    front = {"base_model": base, "library_name": "peft" if peft_dir else "transformers",
             "pipeline_tag": "text-classification" if method in ("rm", "prm") else "text-generation",
             "tags": tags}
    datasets = hub_datasets(cfg)
    if datasets:
        front["datasets"] = datasets
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
             f"# {out.name}", "",
             f"Fine-tuned from {hub_link(base)} with "
             f"mudpuppy: {method}"
             + (f" with a {cfg['adapter']['type']} adapter." if adapter else ", full fine-tuning."), ""]
    if record:
        lines += ["## Base model", "", describe_provenance(record), ""]
    lines += ["## Training", "", "| setting | value |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in settings_rows(cfg, summary)]
    lines.append("")
    table = results_table(summary)
    if table:
        lines += ["## Results", "", *table, ""]
    if charts:
        lines += ["## Curves", ""] + [f"![{Path(c).stem}]({c})" for c in charts] + [""]
    elif plots_missing:
        lines += ["(No charts: matplotlib was not installed; `pip install 'mudpuppy[plot]'`.)", ""]
    lines += ["## Reproduce", "",
              "The resolved configuration is `config.yaml` beside this card (relative data paths are relative "
              "to the original config's directory)."]
    cmd = command_line()
    if cmd:
        lines += ["", "The command that produced this run:", "", "```", cmd, "```"]
    lines += ["", "## Use", ""]
    loftq = cfg.get("adapter") or {}
    if peft_dir and loftq.get("type") == "qlora" and loftq.get("init") == "loftq" and loftq.get("loftq_iter", 1) > 1:
        # The base under the adapter is what LoftQ's iterations made of the checkpoint (export/peft.py).
        lines += [f"The adapter trained on the 4-bit base LoftQ's {loftq['loftq_iter']} iterations made of "
                  f"{base} (adapter.loftq_iter), not on its own weights: loaded alone on {base} it is another "
                  "model. Export it with that base for PEFT and mlx-lm, or merged:", "", "```sh",
                  f"mudpuppy export {out.name} --format peft     # the adapter, and the base in base/",
                  f"mudpuppy export {out.name} --format merged   # the adapter folded in", "```"]
    elif peft_dir:
        lines += ["```python", "from peft import PeftModel", "from transformers import AutoModelForCausalLM, AutoTokenizer",
                  "", f'base = AutoModelForCausalLM.from_pretrained("{base}")',
                  f'model = PeftModel.from_pretrained(base, "{out.name}")',
                  f'tokenizer = AutoTokenizer.from_pretrained("{out.name}")', "```"]
    else:
        auto = "AutoModelForSequenceClassification" if method == "rm" else \
            "AutoModelForTokenClassification" if method == "prm" else "AutoModelForCausalLM"
        lines += ["```python", f"from transformers import {auto}, AutoTokenizer", "",
                  f'model = {auto}.from_pretrained("{out.name}")',
                  f'tokenizer = AutoTokenizer.from_pretrained("{out.name}")', "```"]
    lines += ["", f"Evaluate it with `mudpuppy eval {out.name} --data HELD_OUT.jsonl --base`."]
    return "\n".join(lines) + "\n"


class Places:
    """Where the run writes each of its report's names in `out`: the name itself, each recorded in the run's
    marker before it is written, unless it holds a file the run did not write (rundir.is_theirs)."""

    def __init__(self, out: Path):
        self.out, self.moved = out, []

    def __call__(self, name: str) -> str | None:
        from ..output_dir import rundir

        stem, _, ext = name.rpartition(".")
        for target in (name, f"{stem}.mudpuppy.{ext}"):
            if not rundir.is_theirs(self.out, target):
                rundir.record(self.out, [target])
                if target != name:
                    self.moved.append(f"{name} as {target}")
                return target
        self.moved.append(f"no {name} (that name and {stem}.mudpuppy.{ext} hold files the run did not write)")
        return None

    def say(self) -> None:
        if self.moved:
            print(f"{self.out}: kept the files there that the run did not write; wrote {', '.join(self.moved)}",
                  file=sys.stderr)


def write_run_report(out: Path, summary: dict) -> list[str]:
    """Charts and the model card for a finished run; returns the files written."""
    cfg_path = out / "config.yaml"
    cfg = yaml.safe_load(cfg_path.read_text(encoding="utf-8")) if cfg_path.exists() else {}
    rows = read_metrics(out)
    place = Places(out)
    charts = write_charts(out, cfg.get("method", "sft"), rows, place)
    try:
        import matplotlib  # noqa: F401
        missing = False
    except ImportError:
        missing = True
    card = place(CARD)
    if card is not None:
        (out / card).write_text(model_card(out, cfg, summary, charts, missing), encoding="utf-8")
    place.say()
    return [*charts, *([card] if card else [])]
