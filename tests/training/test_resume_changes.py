"""--resume says what changed (issue 37, item 4), and a damaged newest checkpoint of any size falls back.

- a resume whose config changes what is trained (the learning rate, a data file edited in place with the
  same record count, ...) is refused with exit 2 and the changed keys, `path: old -> new`, before any model
  loads; `--allow-changes` continues, and metrics.jsonl, run_summary.json and later checkpoints show both
  values and the step; config.yaml keeps the config the run started with;
- keys that do not change training (logging, evaluation, checkpoint frequency, merge, backend, memory
  options) are never refused, and are recorded the same way; each key's kind is listed here deliberately;
- a curriculum stage resumed with changes is refused the same way, and goes on with allow_changes;
- a checkpoint whose bytes changed in place (same size: trainer.pt, the weights, the adapter) is skipped for
  the previous complete one with one line, and the resumed run equals the uninterrupted one; so is one
  whose damage only shows while it loads (a checkpoint written before digests).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from mudpuppy import RunConfig, create_backend, load_config, run
from mudpuppy.errors import MudpuppyError
from mudpuppy.training import checkpoints, resume_changes
from mudpuppy.training.resume_changes import compare, flatten, kind_of
from mudpuppy.training.schedule import learning_rate

from ..conftest import QUICKSTART_DATA, tiny_run_config

K = 4
QUIET = dict(echo=lambda *_: None)


def config(model_dir: Path, out: Path, data: Path | None = None) -> dict:
    """8 steps, checkpoints at 4 and 8, dropout on (an exact resume must restore the RNG of its masks)."""
    cfg = tiny_run_config(model_dir, out)
    cfg["adapter"] = {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.1}
    cfg["training"] = dict(cfg["training"], max_steps=2 * K, save_steps=K, learning_rate=1e-3, lr_scheduler="cosine",
                           warmup_steps=2)
    cfg["eval"] = {"before_training": False, "after_training": False}
    if data is not None:
        cfg["data"]["datasets"][0]["path"] = str(data)
    return cfg


@pytest.fixture(scope="module")
def straight(tiny_model_dir, tmp_path_factory):
    """An uninterrupted run, its data a copy each test may edit in its own copy: (output_dir, data file)."""
    base = tmp_path_factory.mktemp("straight")
    data = base / "train.jsonl"
    shutil.copy(QUICKSTART_DATA / "smart_home_train.jsonl", data)
    out = base / "run"
    run(load_config(config(tiny_model_dir, out, data)), create_backend("cpu"), **QUIET)
    return out, data


def stopped_at(straight, tmp_path: Path, step: int) -> tuple[Path, Path]:
    """The straight run as if its process had died right after the checkpoint of `step` (newer ones gone),
    with its own copy of the data: (output_dir, data file)."""
    out, data = tmp_path / "run", tmp_path / "train.jsonl"
    shutil.copytree(straight[0], out)
    shutil.copy(straight[1], data)
    (out / "run_summary.json").unlink()
    for ckpt in checkpoints.list_checkpoints(out):
        if checkpoints.step_of(ckpt) > step:
            shutil.rmtree(ckpt)
    # the checkpoints name the straight run's data file: point them at this copy, as if they had trained on it
    for ckpt in checkpoints.list_checkpoints(out):
        marker = json.loads((ckpt / checkpoints.MARKER).read_text())
        marker[resume_changes.RECORD]["data.datasets.0.path"] = str(data)
        (ckpt / checkpoints.MARKER).write_text(json.dumps(marker))
    return out, data


def resume_cfg(model_dir: Path, out: Path, data: Path, **training) -> dict:
    cfg = config(model_dir, out, data)
    cfg["training"].update(training)
    cfg["resume"] = True
    return cfg


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def assert_same_adapter(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a / "adapter_model.safetensors")), load_file(str(b / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys()
    for key in wa:
        np.testing.assert_array_equal(wa[key], wb[key], err_msg=key)


def cli(cfg: dict, path: Path, *flags):
    path.write_text(yaml.safe_dump(cfg))
    return subprocess.run([sys.executable, "-m", "mudpuppy.cli", "run", "-c", str(path), *flags],
                          capture_output=True, text=True, timeout=300)


# --------------------------------------------------------------------------- changed settings

def test_a_changed_learning_rate_is_refused_then_recorded_with_allow_changes(straight, tiny_model_dir, tmp_path):
    out, data = stopped_at(straight, tmp_path, K)
    before = (out / "metrics.jsonl").read_text()
    cfg = resume_cfg(tiny_model_dir, out, data, learning_rate=0.5)

    refused = cli(cfg, tmp_path / "cfg.yaml", "--resume")
    assert refused.returncode == 2, refused.stderr
    assert "training.learning_rate: 0.001 -> 0.5" in refused.stderr and "--allow-changes" in refused.stderr
    assert "Traceback" not in refused.stderr and "model:" not in refused.stdout          # before the model loads
    assert (out / "metrics.jsonl").read_text() == before
    assert [c.name for c in checkpoints.list_checkpoints(out)] == [f"step-{K:08d}"]

    done = cli(cfg, tmp_path / "cfg.yaml", "--resume", "--allow-changes")
    assert done.returncode == 0, done.stderr
    assert "training.learning_rate: 0.001 -> 0.5 (accepted: --allow-changes)" in done.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    change = {"key": "training.learning_rate", "old": 0.001, "new": 0.5, "changes_training": True}
    assert [r for r in rows if "config_changes" in r] == [{"step": K, "config_changes": [change]}]
    # steps 1..K on the old schedule, K+1.. on the new one, as the record says
    old_t, new_t = load_config(config(tiny_model_dir, out)).training, load_config(cfg).training
    lrs = [r["lr"] for r in rows if "loss" in r]
    assert lrs == [learning_rate(old_t, s, 2 * K) for s in range(K)] + \
                  [learning_rate(new_t, s, 2 * K) for s in range(K, 2 * K)]
    assert lrs[-2] > 0.01
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["config_changes"] == [{"step": K, **change}]
    assert yaml.safe_load((out / "config.yaml").read_text())["training"]["learning_rate"] == 0.001
    marker = json.loads((out / "checkpoints" / f"step-{2 * K:08d}" / checkpoints.MARKER).read_text())
    assert marker[resume_changes.HISTORY] == [{"step": K, **change}]
    assert marker[resume_changes.RECORD]["training.learning_rate"] == 0.5


def test_allow_changes_without_resume_is_refused(straight, tiny_model_dir, tmp_path):
    cfg = config(tiny_model_dir, tmp_path / "new")
    result = cli(cfg, tmp_path / "cfg.yaml", "--allow-changes")
    assert result.returncode == 2 and "--allow-changes" in result.stderr and "--resume" in result.stderr
    assert not (tmp_path / "new").exists()


def test_a_data_file_edited_in_place_is_refused(straight, tiny_model_dir, tmp_path):
    """Same record count, one answer changed: only the content digest can tell."""
    out, data = stopped_at(straight, tmp_path, K)
    lines = data.read_text().splitlines()
    lines[0] = lines[0].replace('"shopping_add"', '"thermostat_set"')
    data.write_text("\n".join(lines) + "\n")
    with pytest.raises(MudpuppyError, match=r"data\.datasets\.0\.content: sha256:\w{12} -> sha256:\w{12} "
                                            r"\(.*train\.jsonl\)") as info:
        run(load_config(resume_cfg(tiny_model_dir, out, data)), create_backend("cpu"), **QUIET)
    assert "learning_rate" not in str(info.value)
    said = []
    result = run(load_config(resume_cfg(tiny_model_dir, out, data)), create_backend("cpu"), echo=said.append,
                 allow_changes=True)
    assert result.resumed_from == K
    (change,) = json.loads((out / "run_summary.json").read_text())["config_changes"]
    assert change["key"] == "data.datasets.0.content" and change["step"] == K and change["changes_training"]
    assert change["old"] == checkpoints.file_digest(straight[1]) and change["new"] == checkpoints.file_digest(data)


@pytest.mark.parametrize("key, value", [
    ("logging.log_every", 3), ("logging.progress_bar", True), ("eval.after_training", True),
    ("eval.max_samples", 4), ("training.save_steps", 2), ("training.keep_last_n", 5), ("training.eval_steps", 2),
    ("merge", True), ("training.gradient_checkpointing", True),
])
def test_a_setting_that_does_not_change_training_is_recorded_not_refused(straight, tiny_model_dir, tmp_path, key,
                                                                       value):
    out, data = stopped_at(straight, tmp_path, K)
    cfg = resume_cfg(tiny_model_dir, out, data)
    section, _, name = key.rpartition(".")
    (cfg.setdefault(section, {}) if section else cfg)[name] = value
    old = resume_changes.flatten(load_config(config(tiny_model_dir, out)).dump()).get(key)
    result = run(load_config(cfg), create_backend("cpu"), **QUIET)            # no allow_changes
    assert result.resumed_from == K
    np.testing.assert_allclose(result.losses, losses(straight[0]), atol=1e-6, rtol=0)
    assert old != value
    recorded = json.loads((out / "run_summary.json").read_text())["config_changes"]
    assert recorded == [{"step": K, "key": key, "old": old, "new": value, "changes_training": False}]


def test_an_unchanged_resume_records_nothing_and_keeps_the_run_exact(straight, tiny_model_dir, tmp_path):
    out, data = stopped_at(straight, tmp_path, K)
    result = run(load_config(resume_cfg(tiny_model_dir, out, data)), create_backend("cpu"), **QUIET)
    assert result.resumed_from == K and json.loads((out / "run_summary.json").read_text())["config_changes"] == []
    assert not any("config_changes" in json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines())
    assert_same_adapter(out, straight[0])


def test_a_checkpoint_from_before_records_is_compared_with_the_runs_config_copy(straight, tiny_model_dir, tmp_path):
    out, data = stopped_at(straight, tmp_path, K)
    marker_file = out / "checkpoints" / f"step-{K:08d}" / checkpoints.MARKER
    marker = json.loads(marker_file.read_text())
    del marker[resume_changes.RECORD]
    marker_file.write_text(json.dumps(marker))
    said = []
    with pytest.raises(MudpuppyError, match="training.seed: 3 -> 4"):
        run(load_config(resume_cfg(tiny_model_dir, out, data, seed=4)), create_backend("cpu"), echo=said.append)
    assert any("comparing with the run's config.yaml" in line for line in said)


# what changes training, listed deliberately: each key and the kind a resume gives its change
KINDS = {
    "trains": ["training.learning_rate", "training.lr_scheduler", "training.warmup_steps", "training.warmup_ratio",
               "training.min_lr_ratio", "training.max_steps", "training.epochs", "training.seed",
               "training.precision", "training.weight_decay", "training.adam_beta2", "training.max_grad_norm",
               "training.micro_batch_size", "training.gradient_accumulation_steps", "training.on_nan",
               "adapter.dropout", "data.sequence_len", "data.packing", "data.tokens_per_batch", "data.shuffle",
               "data.val_set_size", "data.datasets.0.path", "data.datasets.0.num_samples",
               "data.datasets.0.content", "data.chat_template", "preference.beta", "preference.label_smoothing",
               "grpo.temperature", "grpo.num_generations", "grpo.loss_type", "reward.loss", "qat.group_size",
               "model.dtype", "distributed.mixed_precision", "training.early_stopping_patience"],
    "neutral": ["logging.log_every", "logging.progress_bar", "logging.report_to", "logging.tui", "eval.max_samples",
                "eval.before_training", "eval.after_training", "eval.batch_size", "training.save_steps",
                "training.keep_last_n", "training.eval_steps", "training.gradient_checkpointing",
                "training.compile", "merge", "merge_dtype", "backend", "devices", "memory.optimizer_offload",
                "memory.stream_layers", "data.cache", "data.cache_dir", "data.num_proc", "data.val_datasets.0.path",
                "data.val_datasets.0.content", "distributed.strategy", "distributed.timeout_s",
                "grpo.log_completions", "model.trust_remote_code"],
    "fixed": ["model.base_model", "method", "adapter.r", "adapter.alpha", "adapter.type", "adapter.target_modules",
              "adapter.init_from", "preference.type", "training.optimizer"],
}


@pytest.mark.parametrize("kind", KINDS)
def test_each_key_has_the_kind_it_is_listed_with(kind):
    assert {key: kind_of(key) for key in KINDS[kind]} == {key: kind for key in KINDS[kind]}


def test_with_early_stopping_what_decides_the_stop_changes_training():
    for key in ("training.eval_steps", "eval.max_samples", "data.val_datasets.0.content"):
        assert kind_of(key, early_stopping=True) == "trains"
    old = {"training.early_stopping_patience": 2, "training.eval_steps": 5}
    assert compare(old, {**old, "training.eval_steps": 10})[0]["kind"] == "trains"
    assert kind_of("logging.log_every", early_stopping=True) == "neutral"


def test_the_global_batch_decides_whether_batch_sizes_change_training():
    """2 processes at micro batch 2 resumed in 1 at micro batch 4 is the same run (docs/distributed.md)."""
    old = {"training.micro_batch_size": 2, "training.gradient_accumulation_steps": 1, resume_changes.PROCESSES: 2}
    same = compare(old, {**old, "training.micro_batch_size": 4, resume_changes.PROCESSES: 1})
    assert {c["key"]: c["kind"] for c in same} == {"training.micro_batch_size": "neutral",
                                                   resume_changes.PROCESSES: "neutral"}
    other = compare(old, {**old, "training.gradient_accumulation_steps": 2})
    assert {c["key"]: c["kind"] for c in other} == {"training.gradient_accumulation_steps": "trains"}


def test_comparing_lists_and_versions():
    old = flatten({"data": {"datasets": [{"path": "a.jsonl"}]}, "training": {"learning_rate": 1e-3}})
    new = flatten({"data": {"datasets": [{"path": "a.jsonl"}, {"path": "b.jsonl"}]},
                   "training": {"learning_rate": 0.001, "a_key_a_newer_version_added": 1}})
    assert compare(old, new) == [{"key": "data.datasets.1.path", "old": None, "new": "b.jsonl", "kind": "trains"}]
    assert compare({"data.datasets.0.content": "sha256:1"}, {}) == []       # a digest one side did not record


def schema_paths(schema: dict, defs: dict, prefix: str = "") -> set[str]:
    """Every dotted key path the config schema allows (list items as index 0)."""
    if "$ref" in schema:
        return schema_paths(defs[schema["$ref"].split("/")[-1]], defs, prefix)
    paths = {prefix[:-1]} if prefix else set()
    for option in schema.get("anyOf", []):
        paths |= schema_paths(option, defs, prefix)
    if schema.get("type") == "array" and "items" in schema:
        paths |= schema_paths(schema["items"], defs, f"{prefix}0.")
    for name, sub in schema.get("properties", {}).items():
        paths |= schema_paths(sub, defs, f"{prefix}{name}.")
    return paths


def test_every_listed_key_is_a_key_of_the_config():
    """The lists are of real keys (or the digests and process count the record adds): a renamed key would
    otherwise silently change kind."""
    schema = RunConfig.model_json_schema()
    known = schema_paths(schema, schema.get("$defs", {})) | {resume_changes.PROCESSES,
                                                             "data.datasets.0.content", "data.val_datasets.0.content"}
    lists = (*resume_changes.NEUTRAL, *resume_changes.STOPPING, *resume_changes.FIXED, *resume_changes.UNFIXED,
             *resume_changes.BATCH, *resume_changes.IGNORED, *(k for keys in KINDS.values() for k in keys))
    assert [key for key in lists if key not in known] == []


# --------------------------------------------------------------------------- damaged checkpoints

def flip_data_bytes(path: Path, count: int = 16) -> None:
    """Change `count` bytes inside the tensor data of a safetensors or torch (zip) file, keeping its size and
    every structure a reader checks: the damage only the content can show."""
    raw = bytearray(path.read_bytes())
    if path.suffix == ".safetensors":
        start = 8 + int.from_bytes(raw[:8], "little")
        middle = (start + len(raw)) // 2
    else:
        with zipfile.ZipFile(path) as zf:
            # a tensor's storage (trainer/data/N), not the pickle, whose zip CRC the structure check reads
            info = max((i for i in zf.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
        local = info.header_offset
        data = local + 30 + int.from_bytes(raw[local + 26:local + 28], "little") \
            + int.from_bytes(raw[local + 28:local + 30], "little")
        middle = data + info.file_size // 2
    raw[middle:middle + count] = bytes(b ^ 0x5A for b in raw[middle:middle + count])
    size = path.stat().st_size
    path.write_bytes(bytes(raw))
    assert path.stat().st_size == size


@pytest.mark.parametrize("name", ["trainer.pt", "trainable.safetensors", "adapter_model.safetensors"])
def test_a_same_size_damage_falls_back_to_the_previous_checkpoint(straight, tiny_model_dir, tmp_path, capfd, name):
    out, data = stopped_at(straight, tmp_path, 2 * K)
    newest = out / "checkpoints" / f"step-{2 * K:08d}"
    flip_data_bytes(newest / name)
    # the damage keeps every size and structure: without the digest it would pass
    marker = json.loads((newest / checkpoints.MARKER).read_text())
    undigested = tmp_path / "undigested"
    shutil.copytree(newest, undigested)
    (undigested / checkpoints.MARKER).write_text(json.dumps({k: v for k, v in marker.items()
                                                             if k != checkpoints.DIGESTS}))
    assert checkpoints.checkpoint_problem(undigested) is None
    assert name in checkpoints.checkpoint_problem(newest)

    result = run(load_config(resume_cfg(tiny_model_dir, out, data)), create_backend("cpu"), **QUIET)
    lines = [line for line in capfd.readouterr().err.splitlines() if "skipping checkpoint" in line]
    assert len(lines) == 1 and f"step-{2 * K:08d}" in lines[0] and name in lines[0] and "content changed" in lines[0]
    assert result.resumed_from == K and result.steps == 2 * K
    np.testing.assert_allclose(result.losses, losses(straight[0]), atol=1e-6, rtol=0)
    assert_same_adapter(out, straight[0])
    (kept,) = (out / "checkpoints").glob(f".damaged-step-{2 * K:08d}-*")                # kept, never deleted
    assert (kept / name).read_bytes() == (newest.parent.parent.parent / "undigested" / name).read_bytes()


def plant_loadable_wrong_state(ckpt):
    """A checkpoint as one written before digests, whose trainer.pt is a well-formed torch file that is not a
    trainer's state: it passes every check before loading."""
    import torch

    torch.save({"something": torch.zeros(3)}, ckpt / "trainer.pt")
    marker = json.loads((ckpt / checkpoints.MARKER).read_text())
    del marker[checkpoints.DIGESTS]
    marker["files"]["trainer.pt"] = (ckpt / "trainer.pt").stat().st_size
    (ckpt / checkpoints.MARKER).write_text(json.dumps(marker))


def test_damage_that_shows_only_while_loading_falls_back_too(straight, tiny_model_dir, tmp_path, capfd):
    """A checkpoint written before the marker held digests, whose trainer.pt is a well-formed torch file that
    is not a trainer's state: it passes every check, and fails to load."""
    import torch

    out, data = stopped_at(straight, tmp_path, 2 * K)
    newest = out / "checkpoints" / f"step-{2 * K:08d}"
    plant_loadable_wrong_state(newest)
    assert checkpoints.checkpoint_problem(newest) is None

    said = []
    result = run(load_config(resume_cfg(tiny_model_dir, out, data)), create_backend("cpu"), echo=said.append)
    lines = [line for line in capfd.readouterr().err.splitlines() if "skipping checkpoint" in line]
    assert len(lines) == 1 and f"step-{2 * K:08d}" in lines[0] and "did not load" in lines[0]
    assert result.resumed_from == K and any(f"resumed from {out / 'checkpoints' / f'step-{K:08d}'}" in s for s in said)
    np.testing.assert_allclose(result.losses, losses(straight[0]), atol=1e-6, rtol=0)
    assert_same_adapter(out, straight[0])
    assert json.loads((out / "run_summary.json").read_text())["resumed_from_step"] == K
    (kept,) = (out / "checkpoints").glob(f".damaged-step-{2 * K:08d}-*")
    assert set(torch.load(kept / "trainer.pt", weights_only=True)) == {"something"}


def test_a_damaged_checkpoint_with_nothing_older_ends_in_one_message(straight, tiny_model_dir, tmp_path):
    out, data = stopped_at(straight, tmp_path, K)
    ckpt = out / "checkpoints" / f"step-{K:08d}"
    plant_loadable_wrong_state(ckpt)
    with pytest.raises(MudpuppyError, match=f"cannot resume from {ckpt}: it did not load .*no older checkpoint reads"):
        run(load_config(resume_cfg(tiny_model_dir, out, data)), create_backend("cpu"), **QUIET)
    assert (ckpt / "trainer.pt").is_file()                          # kept as it is


# --------------------------------------------------------------------------- curricula

class StopsAtCall:
    """Backends whose trainers, together, stop the run at once (a second Ctrl-C) on optimizer step call n."""

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self, cfg):
        backend, outer = create_backend(cfg.backend), self

        class Stopping:
            def __getattr__(self, name):
                return getattr(backend, name)

            def create_trainer(self, handle, tcfg):
                trainer = backend.create_trainer(handle, tcfg)
                step = trainer.step

                def stopping(*args, **kwargs):
                    outer.calls += 1
                    if outer.calls == outer.n:
                        raise KeyboardInterrupt
                    return step(*args, **kwargs)

                trainer.step = stopping
                return trainer

        return Stopping()


def test_a_curriculum_stage_resumed_with_changes_is_refused_unless_allowed(tiny_model_dir, tmp_path):
    from mudpuppy import load_curriculum, run_curriculum
    from mudpuppy.training.loop import Interrupted

    from .test_curriculum import curriculum

    raw = curriculum(tiny_model_dir, tmp_path / "c")
    raw["stages"] = raw["stages"][:2]
    with pytest.raises(Interrupted):          # stage 1: calls 1-2; stage 2 saves its step 2 and stops in call 5
        run_curriculum(load_curriculum(raw), echo=lambda *_: None, backend_for=StopsAtCall(5))
    raw["stages"][1]["training"]["learning_rate"] = 1e-2
    with pytest.raises(MudpuppyError, match="training.learning_rate: 0.005 -> 0.01"):
        run_curriculum(load_curriculum(raw), echo=lambda *_: None)
    run_curriculum(load_curriculum(raw), echo=lambda *_: None, allow_changes=True)
    stage = tmp_path / "c" / "stage-2-more-intents"
    (change,) = json.loads((stage / "run_summary.json").read_text())["config_changes"]
    assert (change["key"], change["old"], change["new"], change["step"]) == ("training.learning_rate", 0.005, 0.01, 2)
