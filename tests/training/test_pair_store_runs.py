"""DPO and reward runs on pairs from the token store: the same losses, bit for bit, as the in-memory lists gave,
and exact resume after a SIGKILL."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from mudpuppy import create_backend, load_config, run
from mudpuppy.data import pipeline, prepare
from mudpuppy.training import checkpoints

from ..conftest import QUICKSTART_DATA
from ..faults import kill_after
from .test_preference_runs import metrics, preference_config, quiet
from .test_resume import cli


BAD = {"pref": {"prompt": "p", "chosen": "same", "rejected": "same"},
       "kto": {"prompt": "p", "completion": " ", "label": True}, "reward": None, "prm": None}
FILES = {"pref": "smart_home_pref", "kto": "smart_home_kto", "reward": "smart_home_reward", "prm": "arithmetic_prm"}


def big_pairs(tmp_path, copies=3, data="pref"):
    """Over stream.KEEP records, so dpo (and kto) scan the file and read it again; a bad record among them."""
    rows = [json.loads(line) for line in (QUICKSTART_DATA / f"{FILES[data]}_train.jsonl").read_text().splitlines()]
    rows = rows * (copies if data != "prm" else 5)
    rows[5] = BAD[data] or rows[5]
    path = tmp_path / f"{data}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def pair_config(tiny_model_dir, tmp_path, name, kind="dpo", data="pref", **pref):
    cfg = preference_config(tiny_model_dir, tmp_path / name, kind, FILES[data], **pref)
    cfg["data"]["datasets"] = [{"path": str(big_pairs(tmp_path, data=data))}]
    cfg["data"]["val_set_size"] = 6
    cfg["data"]["num_proc"] = 2
    cfg["training"].update(max_steps=4, micro_batch_size=2)
    if kind in ("rm", "prm"):
        cfg.update(method=kind, adapter={"type": "lora", "r": 4, "alpha": 8}, reward={"bad_pairs": "drop"})
        del cfg["preference"]
    else:
        cfg["preference"]["bad_pairs"] = "drop"
    return cfg


def run_both(cfg, monkeypatch):
    """(losses and logged rows with the lists, the same with the store)."""
    built = []
    original = pipeline.prepare_store
    monkeypatch.setattr(prepare, "prepare_store", lambda *a, **k: (built.append(1), original(*a, **k))[1])
    outs = []
    for lists in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            if lists:
                mp.setattr(prepare, "STREAMED", ("sft",))
                mp.setattr(prepare, "stored", lambda method, loaded: method == "sft")
            out = dict(cfg, output_dir=f"{cfg['output_dir']}-{'lists' if lists else 'store'}")
            result = run(load_config(out), create_backend("cpu"), echo=quiet)
        rows = [{k: v for k, v in r.items() if k not in ("time", "elapsed", "tokens_per_sec", "samples_per_sec")}
                for r in metrics(result.output_dir) if "loss" in r]
        outs.append((result.losses, rows, json.loads((result.output_dir / "run_summary.json").read_text())))
        assert len(built) == (0 if lists else 1)
    return outs


@pytest.mark.parametrize("kind, data, pref", [("dpo", "pref", {"precompute_ref": True}), ("dpo", "pref", {}),
                                              ("rm", "pref", {}), ("kto", "kto", {"precompute_ref": True}),
                                              ("rm", "reward", {}), ("prm", "prm", {})])
def test_losses_from_the_store_are_the_lists_losses_bit_for_bit(tiny_model_dir, tmp_path, monkeypatch, kind, data,
                                                                pref):
    (old_losses, old_rows, old_sum), (new_losses, new_rows, new_sum) = run_both(
        pair_config(tiny_model_dir, tmp_path, kind, kind, data, **pref), monkeypatch)
    assert len(new_losses) == 4 and new_losses == old_losses
    assert [r["loss"] for r in new_rows] == [r["loss"] for r in old_rows]
    assert new_rows[0].keys() == old_rows[0].keys()
    dropped = {"pref": {"chosen and rejected are identical": 1}, "kto": {"empty completion": 1}, "reward": {},
               "prm": {}}
    assert new_sum["dropped"] == old_sum["dropped"] == dropped[data]
    assert new_sum["eval_after"] == old_sum["eval_after"]


def test_a_killed_dpo_run_resumes_with_the_same_batches(tiny_model_dir, tmp_path):
    k = 3
    outs = {}
    for name in ("straight", "broken"):
        cfg = pair_config(tiny_model_dir, tmp_path, name)
        cfg["training"].update(max_steps=2 * k, save_steps=k)
        cfg["eval"] = {"before_training": False, "after_training": False}
        outs[name] = cfg["output_dir"]
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    assert cli(tmp_path / "straight.yaml").returncode == 0
    killed = cli(tmp_path / "broken.yaml", env=kill_after(k))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    straight, broken = Path(outs["straight"]), Path(outs["broken"])
    assert [c.name for c in checkpoints.list_checkpoints(broken)] == [f"step-{k:08d}"]
    resumed = cli(tmp_path / "broken.yaml", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    a, b = metrics(straight), metrics(broken)
    a, b = [r for r in a if "loss" in r], [r for r in b if "loss" in r]
    assert [r["step"] for r in b] == list(range(1, 2 * k + 1))
    assert [r["loss"] for r in b] == [r["loss"] for r in a]
    wa, wb = load_file(str(straight / "adapter_model.safetensors")), load_file(str(broken / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys()
    for key in wa:
        np.testing.assert_array_equal(wa[key], wb[key])
