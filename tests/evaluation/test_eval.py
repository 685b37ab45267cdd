"""`mudpuppy eval`: each metric against an independent computation, the comparison table, bad input."""

from __future__ import annotations

import importlib.util
import json
import math
import re

import numpy as np
import pytest

from .conftest import PAIRS, VAL, Oracle, mudpuppy_eval, read_eval, records


def test_perplexity_equals_transformers_and_peft(tiny_runs, tiny_model_dir, tmp_path):
    run_dir = tiny_runs[0]
    res = mudpuppy_eval(run_dir, "--data", VAL, "--metrics", "perplexity", "--max-samples", 24,
                        "--out", tmp_path / "ev")
    assert res.exit_code == 0, res.output
    got = read_eval(tmp_path / "ev")["models"][0]

    oracle = Oracle(tiny_model_dir, run_dir)
    total, tokens = 0.0, 0
    for rec in records(VAL, 24):
        logp, n = oracle.answer_logprob(rec["messages"][:-1], rec["messages"][-1]["content"])
        total, tokens = total - logp, tokens + n
    assert got["details"]["tokens"] == tokens            # the same masked tokens
    assert got["values"]["perplexity"] == pytest.approx(math.exp(total / tokens), rel=1e-4)
    assert got["details"]["nll"] == pytest.approx(total / tokens, rel=1e-4)


def test_two_targets_and_the_base_make_one_table(tiny_runs, adapter_copy, tiny_model_dir, tmp_path):
    out = tmp_path / "ev"
    res = mudpuppy_eval(tiny_runs[0], adapter_copy, "--base", "--data", VAL, "--metrics", "perplexity,exact_match",
                        "--max-samples", 8, "--max-new-tokens", 3, "--out", out)
    assert res.exit_code == 0, res.output
    report = read_eval(out)
    assert [m["name"] for m in report["models"]] == ["run-a", "adapter-b", "base"]
    assert [m["kind"] for m in report["models"]] == ["run", "adapter", "base"]
    header = [line for line in res.output.splitlines() if "run-a" in line and "adapter-b" in line]
    assert len(header) == 1 and header[0].split() == ["run-a", "adapter-b", "base"]
    for label in ("perplexity", "exact match"):
        assert sum(line.startswith(label) for line in res.output.splitlines()) == 1
    assert "|  | run-a | adapter-b | base |" in (out / "eval.md").read_text()
    ppl = [m["values"]["perplexity"] for m in report["models"]]
    assert len(set(ppl)) == 3                           # three different models
    if importlib.util.find_spec("matplotlib"):
        assert report["charts"] == ["perplexity.png", "exact_match.png"]
        assert all((out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for name in report["charts"])
    else:
        assert report["charts"] == [] and "matplotlib is not installed" in res.output

    # The base column is the base model itself: the same number as evaluating it as a target.
    alone = mudpuppy_eval(tiny_model_dir, "--data", VAL, "--metrics", "perplexity", "--max-samples", 8,
                          "--out", tmp_path / "base")
    assert alone.exit_code == 0, alone.output
    assert read_eval(tmp_path / "base")["models"][0]["values"]["perplexity"] == pytest.approx(ppl[2], rel=1e-6)


def test_generation_metrics_equal_a_direct_computation(tiny_runs, tiny_model_dir, tmp_path):
    run_dir = tiny_runs[0]
    oracle = Oracle(tiny_model_dir, run_dir)
    rows = records(VAL, 8)
    answers = [oracle.generate(r["messages"][:-1], 3) for r in rows]
    # Half the references become the model's own answer (upper-cased: casefold must undo it).
    for i in range(0, len(rows), 2):
        rows[i]["messages"][-1]["content"] = f"  {answers[i].upper()} "
    data = tmp_path / "gen.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pattern = r"^\s*(\S+)"

    def norm(text):
        return " ".join(text.split()).casefold()

    refs = [r["messages"][-1]["content"] for r in rows]
    exact = np.mean([norm(a) == norm(r) for a, r in zip(answers, refs)])
    contains = np.mean([norm(r) in norm(a) for a, r in zip(answers, refs)])
    found = [re.search(pattern, a, re.DOTALL) for a in answers]
    regex = np.mean([m is not None and norm(m.group(1)) == norm(r) for m, r in zip(found, refs)])
    assert 0 < exact < 1

    res = mudpuppy_eval(run_dir, "--data", data, "--metrics", "exact_match,contains,regex", "--regex", pattern,
                        "--max-new-tokens", 3, "--out", tmp_path / "ev")
    assert res.exit_code == 0, res.output
    got = read_eval(tmp_path / "ev")["models"][0]
    assert got["values"] == {"exact_match": exact, "contains": contains, "regex": regex}
    assert [a["answer"] for a in got["answers"]] == answers[:5]
    hits = [(norm(a) == norm(r), norm(r) in norm(a), m is not None and norm(m.group(1)) == norm(r))
            for a, r, m in zip(answers, refs, found)]
    assert [a["answer"] for a in got["misses"]] == [a for a, h in zip(answers, hits) if not all(h)][:5]

    # Without casefolding the upper-cased references no longer match.
    strict = mudpuppy_eval(run_dir, "--data", data, "--metrics", "exact_match", "--normalize", "strip",
                           "--max-new-tokens", 3, "--out", tmp_path / "strict")
    assert strict.exit_code == 0, strict.output
    expected = np.mean([" ".join(a.split()) == " ".join(r.split()) for a, r in zip(answers, refs)])
    assert read_eval(tmp_path / "strict")["models"][0]["values"]["exact_match"] == expected


def test_preference_accuracy_and_margin_equal_a_direct_computation(tiny_runs, tiny_model_dir, tmp_path):
    run_dir = tiny_runs[1]
    res = mudpuppy_eval(run_dir, "--data", PAIRS, "--max-samples", 16, "--beta", 0.5, "--base", "--out", tmp_path)
    assert res.exit_code == 0, res.output
    tuned, base = read_eval(tmp_path)["models"]
    assert list(tuned["values"]) == ["preference_accuracy", "reward_margin"]      # the default for pairs

    policy, reference = Oracle(tiny_model_dir, run_dir), Oracle(tiny_model_dir)
    wins, margins = [], []
    for rec in records(PAIRS, 16):
        c, _ = policy.answer_logprob(rec["prompt"], rec["chosen"])
        r, _ = policy.answer_logprob(rec["prompt"], rec["rejected"])
        c_ref, _ = reference.answer_logprob(rec["prompt"], rec["chosen"])
        r_ref, _ = reference.answer_logprob(rec["prompt"], rec["rejected"])
        wins.append(c > r)
        margins.append(0.5 * ((c - c_ref) - (r - r_ref)))
    assert tuned["values"]["preference_accuracy"] == np.mean(wins)
    assert tuned["values"]["reward_margin"] == pytest.approx(np.mean(margins), rel=1e-4, abs=5e-5)
    assert base["values"]["reward_margin"] == 0.0


@pytest.mark.parametrize("args, message", [
    (["{empty}", "--data", "{val}"], "{empty}: a directory, but not a run (config.yaml), an adapter"),
    (["{tmp}/missing", "--data", "{val}"], "{tmp}/missing: no such file or directory"),
    (["{run}", "--data", "{tmp}/nope.jsonl"], "nope.jsonl: --data file not found"),
    (["{run}", "--data", "{val}", "--metrics", "preference"],
     "--metrics preference: configs/data/smart_home_val.jsonl holds chat records, and preference needs preference"),
    (["{run}", "--data", "{pairs}", "--metrics", "perplexity"], "--metrics perplexity: "),
    (["{run}", "--data", "{val}", "--metrics", "bleu"], "--metrics: unknown metric 'bleu'"),
    (["{run}", "--data", "{val}", "--metrics", "regex"], "--metrics regex: give the pattern with --regex"),
    (["{run}", "--data", "{val}", "--regex", "("], "--regex '(': not a valid regular expression"),
    (["{run}", "--data", "{val}", "--normalize", "lower"], "--normalize 'lower': use strip, casefold"),
    (["{model}", "--base", "--data", "{val}"], "--base: none of the targets has a base model"),
])
def test_bad_input_is_one_message_and_exit_2(tiny_runs, tiny_model_dir, tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(VAL.parents[2])                  # data paths show relative to the repository
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("not a model")
    names = {"empty": tmp_path / "empty", "tmp": tmp_path, "val": VAL, "pairs": PAIRS, "run": tiny_runs[0],
             "model": tiny_model_dir}
    res = mudpuppy_eval(*[a.format(**names) for a in args], "--out", tmp_path / "ev")
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    assert message.format(**names) in lines[0]
    assert not (tmp_path / "ev").exists()              # refused before anything was written


def test_an_evaluation_is_never_overwritten_without_the_flag(tiny_runs):
    run_dir = tiny_runs[0]
    first = mudpuppy_eval(run_dir, "--data", VAL, "--metrics", "perplexity", "--max-samples", 4)
    assert first.exit_code == 0, first.output
    written = run_dir / "eval" / "eval.json"          # the default place for a run
    before = written.read_bytes()
    again = mudpuppy_eval(run_dir, "--data", VAL, "--metrics", "perplexity", "--max-samples", 6)
    assert again.exit_code == 2
    assert f"{written} already holds an evaluation; pass --overwrite" in again.output
    assert written.read_bytes() == before
    forced = mudpuppy_eval(run_dir, "--data", VAL, "--metrics", "perplexity", "--max-samples", 6, "--overwrite")
    assert forced.exit_code == 0, forced.output
    assert read_eval(run_dir / "eval")["models"][0]["details"]["examples"] == 6


def test_mlx_measures_what_torch_measures(tiny_runs, tmp_path):
    pytest.importorskip("mlx.core")
    values = {}
    for backend in ("cpu", "mlx"):
        for name, data in (("ppl", VAL), ("pairs", PAIRS)):
            out = tmp_path / f"{backend}-{name}"
            res = mudpuppy_eval(tiny_runs[0], "--data", data, "--max-samples", 8, "--metrics",
                                "perplexity" if name == "ppl" else "preference", "--backend", backend, "--out", out)
            assert res.exit_code == 0, res.output
            values[backend, name] = read_eval(out)["models"][0]["values"]
    assert values["mlx", "ppl"]["perplexity"] == pytest.approx(values["cpu", "ppl"]["perplexity"], rel=1e-4)
    assert values["mlx", "pairs"]["preference_accuracy"] == values["cpu", "pairs"]["preference_accuracy"]
    assert values["mlx", "pairs"]["reward_margin"] == pytest.approx(values["cpu", "pairs"]["reward_margin"],
                                                                    rel=1e-3, abs=1e-4)


def test_an_mlx_layout_adapter_evaluates_on_torch(tiny_runs, tiny_model_dir, tmp_path):
    from mudpuppy.backends.adapters import convert_adapter

    mlx_dir = convert_adapter(tiny_runs[0], tmp_path / "adapter-mlx", "mlx")
    assert not (mlx_dir / "adapter_model.safetensors").exists()
    values = []
    for target in (tiny_runs[0], mlx_dir):
        res = mudpuppy_eval(target, "--data", VAL, "--metrics", "perplexity", "--max-samples", 8,
                            "--backend", "cpu", "--out", tmp_path / target.name)
        assert res.exit_code == 0, res.output
        values.append(read_eval(tmp_path / target.name)["models"][0]["values"]["perplexity"])
    assert values[1] == pytest.approx(values[0], rel=1e-6)


@pytest.mark.parametrize("adapter", [{"type": "qlora", "r": 4, "alpha": 8, "quant_group_size": 16},
                                     {"type": "none"}], ids=["qlora", "full"])
def test_eval_reproduces_the_runs_own_held_out_loss(tiny_model_dir, tmp_path, adapter):
    """A QLoRA run's base is quantized again as in training; a full fine-tune's whole model is loaded."""
    from mudpuppy import create_backend, load_config, run

    from ..conftest import tiny_run_config

    cfg = tiny_run_config(tiny_model_dir, tmp_path / "run")
    cfg["adapter"] = adapter
    cfg["training"]["max_steps"] = 2
    cfg["eval"] = {"before_training": False, "exact_match": False}
    cfg["data"]["cache"] = False
    result = run(load_config(cfg), create_backend("cpu"), echo=lambda *_a, **_k: None)
    res = mudpuppy_eval(result.output_dir, "--data", VAL, "--max-samples", 16, "--metrics", "perplexity", "--base")
    assert res.exit_code == 0, res.output
    tuned, base = read_eval(result.output_dir / "eval")["models"]
    assert tuned["values"]["perplexity"] == pytest.approx(math.exp(result.after.loss), rel=1e-4)
    assert base["values"]["perplexity"] != pytest.approx(tuned["values"]["perplexity"], rel=1e-3)
