"""lm-evaluation-harness tasks through `mudpuppy eval --tasks`: a local YAML task over a local file, offline,
on the tiny model with an adapter, checked against transformers + PEFT computing the same log-likelihoods."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from .conftest import VAL, mudpuppy_eval, read_eval

pytest.importorskip("lm_eval")

TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"
REPO = TASKS.parents[2]
DOCS = [json.loads(line) for line in (TASKS / "smart_home_intent.jsonl").read_text().splitlines()]


def label_perplexity(model_dir: Path, adapter_dir: Path | None, docs: list[dict]) -> tuple[float, float]:
    """lm-eval's loglikelihood task by hand: log p(" " + intent | "Command: ...\\nIntent:") summed over the
    continuation's tokens (the whole string encoded, the context's tokens cut off), then
    perplexity = exp(-mean) and acc = the share where every continuation token is the greedy one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    lls, greedy = [], []
    for doc in docs:
        context = f"Command: {doc['command']}\nIntent:"
        whole, ctx = tok.encode(context + " " + doc["intent"]), tok.encode(context)
        ids = torch.tensor([whole])
        with torch.no_grad():
            logps = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
        rows = torch.arange(len(ctx) - 1, len(whole) - 1)
        targets = ids[0, len(ctx):]
        lls.append(float(logps[rows, targets].sum()))
        greedy.append(bool((logps[rows].argmax(-1) == targets).all()))
    return math.exp(-sum(lls) / len(lls)), sum(greedy) / len(greedy)


def test_a_local_yaml_task_runs_offline_with_the_adapter(random_adapter, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)                      # the task's data_files are relative to the repository
    res = mudpuppy_eval(random_adapter, "--data", VAL, "--metrics", "perplexity", "--tasks", "smart_home_label_ll",
                        "--include-path", TASKS, "--max-samples", 5, "--batch-size", 4, "--out", tmp_path / "ev")
    assert res.exit_code == 0, res.output
    report = read_eval(tmp_path / "ev")
    assert report["tasks"] == ["smart_home_label_ll"] and report["data"]["records"] == 5
    # One table: the data file's metrics, then the task's (lm-eval's higher_is_better kept).
    assert [(r["key"], r["higher_is_better"]) for r in report["rows"]] == [
        ("perplexity", False), ("smart_home_label_ll:perplexity", False), ("smart_home_label_ll:acc", True)]
    got = report["models"][0]
    ppl, acc = label_perplexity(tiny_model_dir, random_adapter, DOCS[:5])
    assert got["values"]["smart_home_label_ll:perplexity"] == pytest.approx(ppl, rel=1e-4)
    assert got["values"]["smart_home_label_ll:acc"] == pytest.approx(acc)
    assert got["details"]["tasks"]["smart_home_label_ll"]["samples"] == 5
    assert got["details"]["examples"] == 5 and got["values"]["perplexity"] > 1
    # The adapter is really on: without it the number is another one, far beyond the tolerance.
    base_ppl, _ = label_perplexity(tiny_model_dir, None, DOCS[:5])
    assert ppl != pytest.approx(base_ppl, rel=1e-2)
    table = (tmp_path / "ev" / "eval.md").read_text()
    assert "| smart_home_label_ll perplexity |" in table and "smart_home_label_ll from" in table
    assert (tmp_path / "ev" / "smart_home_label_ll_perplexity.png").is_file() or "matplotlib" in res.output


@pytest.mark.parametrize("args, message", [
    (["--tasks", "smart_home_intent", "--include-path", "{tmp}/none"], "--include-path {tmp}/none: no such directory"),
    (["--tasks", "smart_home_intent", "--include-path", "{tasks}", "--backend", "mlx"],
     "--tasks: lm-evaluation-harness drives a transformers (torch) model, and this evaluation runs on mlx; "
     "pass --backend cpu"),
    (["--include-path", "{tasks}", "--data", "{val}"], "--include-path goes with --tasks NAMES"),
    ([], "nothing to measure: give --data FILE"),
    (["--tasks", " , "], "--tasks: no task named"),
    (["--tasks", "smart_home_intent", "--include-path", "{tasks}", "--metrics", "perplexity"],
     "--metrics measures records of a data file; give it with --data FILE"),
])
def test_bad_task_input_is_one_message(random_adapter, tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(REPO)
    names = {"tmp": tmp_path, "tasks": TASKS, "val": VAL}
    res = mudpuppy_eval(random_adapter, *[a.format(**names) for a in args], "--out", tmp_path / "ev")
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    assert message.format(**names) in lines[0]
    assert not (tmp_path / "ev").exists()


def test_without_lm_eval_one_message_names_the_extra(random_adapter, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    res = mudpuppy_eval(random_adapter, "--tasks", "smart_home_intent", "--include-path", TASKS,
                        "--out", tmp_path / "ev")
    assert res.exit_code == 2
    assert "pip install 'mudpuppy[lmeval]'" in res.output and len(res.output.strip().splitlines()) == 1
