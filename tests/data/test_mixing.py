"""Mixing datasets at scale: `ratio` (target shares of the training mix) and `weight`, sampled on indices,
and the realised mix in the data report."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from mudpuppy.cli import main
from mudpuppy.data import prepare_sft_data
from mudpuppy.data.pipeline import ratio_counts
from mudpuppy.errors import ConfigError


def chat(i, answer):
    return {"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": answer}]}


@pytest.fixture()
def two(write):
    """37 chats and 120 plain texts: neither ratio below can be met without repeating or sampling down."""
    a = write("a.jsonl", [chat(i, f"answer {i} " * (1 + i % 3)) for i in range(37)])
    b = write("b.jsonl", [{"text": f"plain text number {i}"} for i in range(120)])
    return a, b


def mixed(make_cfg, a, b, ra, rb, seed=3, **data):
    return make_cfg([{"path": str(a), "ratio": ra}, {"path": str(b), "ratio": rb}], training={"seed": seed}, **data)


@pytest.mark.parametrize("ratios", [(0.7, 0.3), (0.5, 0.5), (0.15, 0.85), (0.333, 0.667)])
def test_realised_shares_are_within_one_example_of_the_ratio(make_cfg, tok, two, ratios):
    a, b = two
    data = prepare_sft_data(mixed(make_cfg, a, b, *ratios), tok)
    total = len(data.train)
    assert total == 37 + 120                       # the mix keeps the training set's size
    sources = [e.source.rsplit(":", 1)[0] for e in data.train]
    for path, ratio in zip((a, b), ratios):
        assert abs(sources.count(str(path)) - ratio * total) < 1
    mix = data.report.mix
    assert [m["dataset"] for m in mix] == [str(a), str(b)]
    assert [m["examples"] for m in mix] == [sources.count(str(a)), sources.count(str(b))]
    assert all(abs(m["example_share"] - r) <= 1 / total for m, r in zip(mix, ratios))
    assert sum(m["tokens"] for m in mix) == sum(len(e) for e in data.train)
    trained = [sum(int(e.loss_mask[1:].sum()) for e, s in zip(data.train, sources) if s == str(p)) for p in (a, b)]
    assert [m["trained_tokens"] for m in mix] == trained
    assert mix[0]["trained_share"] == pytest.approx(trained[0] / sum(trained))


def test_the_mix_is_seeded_and_keeps_each_examples_tokens(make_cfg, tok, two):
    a, b = two
    first = prepare_sft_data(mixed(make_cfg, a, b, 0.7, 0.3), tok)
    again = prepare_sft_data(mixed(make_cfg, a, b, 0.7, 0.3), tok)
    other = prepare_sft_data(mixed(make_cfg, a, b, 0.7, 0.3, seed=4), tok)
    assert [e.source for e in first.train] == [e.source for e in again.train]
    assert [e.source for e in first.train] != [e.source for e in other.train]
    # Every example in the mix is its record's own tokens, whichever copy or draw it is.
    whole = prepare_sft_data(make_cfg([a, b]), tok)
    by_source = {e.source: e for e in whole.train}
    for ex in first.train:
        ref = by_source[ex.source]
        np.testing.assert_array_equal(ex.input_ids, ref.input_ids)
        np.testing.assert_array_equal(ex.loss_mask, ref.loss_mask)
    # a (37 examples) asked for 0.7 of 157 = 110: repeated twice whole, topped up with 36 seeded draws.
    counts = {}
    for ex in first.train:
        counts[ex.source] = counts.get(ex.source, 0) + 1
    assert sorted({n for s, n in counts.items() if s.startswith(str(a))}) == [2, 3]


def test_ratio_works_after_a_validation_split(make_cfg, tok, two):
    a, b = two
    data = prepare_sft_data(mixed(make_cfg, a, b, 0.4, 0.6, val_set_size=17), tok)
    assert len(data.val) == 17 and len(data.train) == 157 - 17
    sources = [e.source.rsplit(":", 1)[0] for e in data.train]
    assert abs(sources.count(str(a)) - 0.4 * 140) < 1
    assert not {e.source for e in data.val} & {e.source for e in data.train}


def test_ratio_counts_add_up_by_largest_remainder():
    assert ratio_counts([0.7, 0.3], 157) == [110, 47]
    assert ratio_counts([1 / 3, 1 / 3, 1 / 3], 10) == [4, 3, 3]
    for total in range(1, 60):
        counts = ratio_counts([0.2, 0.45, 0.35], total)
        assert sum(counts) == total
        assert all(abs(n - r * total) < 1 for n, r in zip(counts, [0.2, 0.45, 0.35]))


@pytest.mark.parametrize("specs,message", [
    ([{"ratio": 0.7}, {"weight": 2}], "ratio (datasets[0]) and weight (datasets[1]) are exclusive in one config"),
    ([{"ratio": 0.7}, {}], "datasets[1] has no ratio: when one dataset sets its share of the mix with ratio"),
    ([{"ratio": 0.7}, {"ratio": 0.2}], "the datasets' ratios add up to 0.9; they are shares of the training mix"),
])
def test_ratio_mistakes_are_one_message_naming_the_keys(make_cfg, two, specs, message):
    a, b = two
    with pytest.raises(ConfigError) as info:
        make_cfg([{"path": str(a), **specs[0]}, {"path": str(b), **specs[1]}])
    assert message in str(info.value)


def test_a_ratio_on_held_out_data_is_refused(make_cfg, two):
    a, b = two
    with pytest.raises(ConfigError, match=r"val_datasets\[0\]: ratio mixes training data"):
        make_cfg([a], val=[{"path": str(b), "ratio": 1.0}])


def test_preprocess_shows_the_realised_mix(tmp_path, tiny_model_dir, two):
    a, b = two
    cfg = {"model": {"base_model": str(tiny_model_dir)},
           "data": {"datasets": [{"path": str(a), "ratio": 0.7}, {"path": str(b), "ratio": 0.3}],
                    "sequence_len": 128, "cache_dir": str(tmp_path / "cache")},
           "training": {"micro_batch_size": 4, "seed": 3}, "output_dir": str(tmp_path / "out")}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(main, ["preprocess", str(path), "-n", "0"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    at = lines.index("training mix (per dataset: examples, share of examples, tokens, share of trained tokens):")
    assert lines[at + 1].startswith(f"  {a}: 110 examples (70.1%; ratio 0.7), ")
    assert lines[at + 2].startswith(f"  {b}: 47 examples (29.9%; ratio 0.3), ")
    assert lines[at + 2].endswith("of trained tokens")
    # The reused cache entry reports the same mix.
    again = CliRunner().invoke(main, ["preprocess", str(path), "-n", "0"])
    assert "cache: reused" in again.output and lines[at + 1] in again.output.splitlines()
