"""StepLedger: the accounting both trainers share, checked without a runtime."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mudpuppy.backends.stepping import StepLedger
from mudpuppy.distributed import Ranks


class Units:
    def count(self, batch):
        return batch.units


def batch(units, real_tokens=10, placeholder=False):
    return SimpleNamespace(units=units, real_tokens=real_tokens, placeholder=placeholder)


def test_one_process_normalises_by_the_step_and_weighs_metrics_by_count():
    ledger = StepLedger([batch(3), batch(0), batch(1.5)], Units())
    assert ledger.counts == [3, 0, 1.5] and ledger.units == 4.5 and ledger.scale == 1 / 4.5
    assert ledger.run_by_all == ledger.run_here == [0, 2]
    ledger.add(0, 6.0, {"acc": 1.0})
    ledger.add(2, 3.0, {"acc": 0.0, "kl": 2.0})
    ledger.finish()
    assert ledger.mean == 9.0 / 4.5 and ledger.tokens == 30
    assert ledger.metrics == {"acc": 3 / 4.5, "kl": 2.0}
    result = ledger.result(0.5)
    assert (result.loss, result.loss_tokens, result.tokens, result.grad_norm, result.skipped) == (2.0, 4.5, 30, 0.5, False)


def test_a_placeholder_counts_nothing_but_runs_where_ranks_run_in_lockstep():
    # This rank: a real micro-batch and a placeholder; the other rank has 2 and 4 units in them.
    other = [2, 4]
    ranks = Ranks(0, 2, gather=lambda obj: [obj, obj])
    ledger = StepLedger([batch(1), batch(5, placeholder=True)], Units(), ranks,
                        lambda values: [v + (other[i] if i < len(other) else 0) for i, v in enumerate(values)])
    assert ledger.counts == [1, 0] and ledger.step_counts == [3, 4] and ledger.units == 7
    assert ledger.scale == 2 / 7                      # the ranks' gradients are averaged
    assert ledger.run_by_all == [0, 1] and ledger.run_here == [0]
    assert ledger.weight(0) == 1.0 and ledger.weight(1) == 0.0
    ledger.add(1, 123.0, {"acc": 1.0})               # a placeholder's loss and metrics count for nothing
    assert ledger.total == 0.0 and ledger.sums == {}
    assert ledger.tokens == 10                        # real tokens of real micro-batches only


def test_a_non_finite_loss_or_norm_skips():
    ledger = StepLedger([batch(2)], Units())
    ledger.add(0, float("nan"), {})
    ledger.finish()
    assert not ledger.finite(1.0)
    ledger = StepLedger([batch(2)], Units())
    ledger.add(0, 1.0, {})
    ledger.finish()
    assert ledger.finite(1.0) and not ledger.finite(float("inf"))
    assert ledger.result(float("inf"), skipped=True).skipped
    assert ledger.mean == pytest.approx(0.5)
