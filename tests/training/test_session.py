"""session.py, the start and end every training recipe shares: the numbers measured before training go into
the loop state (so into every checkpoint) and come back typed in the RunResult, also for a resumed run,
which measures nothing again; the end-to-end behaviour is tested per recipe (test_sft.py, test_resume.py...)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from mudpuppy.evaluation import EvalResult
from mudpuppy.training.loop import LoopState
from mudpuppy.output_dir import Claim
from mudpuppy.training.session import Run

OBJECTIVE = EvalResult(loss=0.6931, accuracy=0.5, accuracy_name="reward_accuracy", metrics={}, samples=8)
REWARD = EvalResult(reward=0.25, rewards={"exact_match": 0.25}, samples=3)


def a_run(tmp_path: Path, resume_from: Path | None = None, before=True, after=True) -> tuple[Run, list[str]]:
    lines: list[str] = []
    cfg = SimpleNamespace(eval=SimpleNamespace(before_training=before, after_training=after))
    return Run(cfg, backend=None, echo=lines.append, claim=Claim(tmp_path, resume_from), started=0.0,
               handle=None), lines


@pytest.mark.parametrize("measured", [EvalResult(loss=1.5, exact_match=0.25, samples=4), OBJECTIVE, REWARD])
def test_the_numbers_before_training_survive_a_checkpoint_typed(tmp_path, measured):
    run, lines = a_run(tmp_path)
    run.measure_before(lambda: measured)
    assert lines == [f"before training: {measured.describe()}"]
    # what a resumed run reads back: the loop state as a checkpoint holds it (JSON)
    run.state = LoopState.from_dict(json.loads(json.dumps(run.state.__dict__)))
    result = run.result(stopped_early=False, trainer=None)
    assert isinstance(result.before, EvalResult) and result.before.as_dict() == measured.as_dict()


def test_a_resumed_run_measures_nothing_before_and_eval_flags_are_honoured(tmp_path):
    def never():
        raise AssertionError("measured")

    run, lines = a_run(tmp_path, resume_from=tmp_path / "checkpoints" / "step-2")
    run.measure_before(never)
    assert lines == [] and run.state.before is None and run.result(False, None).resumed_from == 2
    run, lines = a_run(tmp_path, before=False, after=False)
    run.measure_before(never)
    assert run.measure_after(never) is None and lines == []
    run, lines = a_run(tmp_path)
    assert run.measure_after(None) is None                     # no held-out data
    assert run.measure_after(lambda: REWARD, count=False) is REWARD
    assert lines == ["after training:  held-out reward 0.2500"]


def test_the_trainer_releases_its_memory_after_the_last_checkpoint_and_before_the_evaluation(tiny_config, monkeypatch):
    """Issue 28 item 6: the optimizer state and gradients go once the final checkpoint and the trained weights
    are written, before the evaluation after training and the merge."""
    from mudpuppy import create_backend, load_config, run
    from mudpuppy.backends.torch.trainer import TorchTrainer
    from mudpuppy.training import session

    events, released = [], []
    real_release = TorchTrainer.release

    def release(self):
        out = Path(tiny_config["output_dir"])
        events.append(("release", (out / "checkpoints").is_dir(), (out / "adapter_model.safetensors").is_file()))
        released.append(self)
        real_release(self)

    real_measure = session.Run.measure_after
    monkeypatch.setattr(TorchTrainer, "release", release)
    monkeypatch.setattr(session.Run, "measure_after",
                        lambda self, *a, **k: events.append(("evaluate", [t.optimizer for t in released] == [None]))
                        or real_measure(self, *a, **k))
    tiny_config["training"].update(max_steps=2, save_steps=2)
    run(load_config(tiny_config), create_backend("cpu"), echo=lambda *_: None)
    assert events == [("release", True, True), ("evaluate", True)]
