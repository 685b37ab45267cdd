"""A runs folder with a run in each state, and `mudpuppy ui`'s server over it on a free loopback port."""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from mudpuppy.ui.server import UIServer


def pytest_configure(config):
    config.addinivalue_line("markers", "browser: drives Debian's chromium through chromedriver (tests/ui); "
                                       "runs in `make test`, which installs both (make browser)")


def write_run(folder: Path, *, summary: dict | None = None, metrics=(), checkpoint: int | None = None,
              config: dict | None = None) -> Path:
    """A run folder as a run leaves it: marker, config.yaml, metrics.jsonl, and a summary or a checkpoint."""
    folder.mkdir(parents=True)
    (folder / ".mudpuppy-run.json").write_text(json.dumps({"format": 1, "written": [], "foreign": []}))
    (folder / ".mudpuppy-run.lock").write_text("")
    cfg = config or {"model": {"base_model": "tiny-llama"}, "method": "sft", "adapter": {"type": "lora"},
                     "backend": "cpu", "training": {"max_steps": 4}}
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in metrics))
    if summary is not None:
        (folder / "run_summary.json").write_text(json.dumps(summary))
    if checkpoint is not None:
        step = folder / "checkpoints" / f"step-{checkpoint:08d}"
        step.mkdir(parents=True)
        (step / "complete.json").write_text("{}")
    return folder


def losses(n: int, start: float = 5.0) -> list[dict]:
    return [{"step": s, "loss": start - 0.5 * s, "lr": 1e-3, "grad_norm": 1.0} for s in range(1, n + 1)]


@pytest.fixture()
def runs_root(tmp_path) -> Path:
    root = tmp_path / "runs"
    root.mkdir()
    write_run(root / "done", metrics=losses(4) + [{"step": 4, "eval_loss": 2.5}],
              summary={"status": "finished", "method": "sft", "adapter": "lora", "base_model": "tiny-llama",
                       "steps": 4, "final_loss": 3.0, "eval_after": {"loss": 2.5, "perplexity": 12.18, "samples": 16}})
    write_run(root / "group" / "halted", metrics=losses(2), checkpoint=2)
    write_run(root / "broken", metrics=[])
    (tmp_path / "secret.txt").write_text("not for the page")
    return root


@contextmanager
def serving(root: Path, host: str = "127.0.0.1", token: str | None = None):
    server = UIServer((host, 0), root, token)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stopping = True
        server.shutdown()
        server.server_close()
        for child in server.jobs.children.values():      # a test that failed mid-run leaves nothing training
            if child.poll() is None:
                child.kill()
                child.wait()


@pytest.fixture()
def ui(runs_root):
    with serving(runs_root) as server:
        yield server


@pytest.fixture(scope="session")
def finished_runs(tiny_model_dir, tmp_path_factory) -> Path:
    """A runs folder with two finished two-step LoRA runs of the tiny model (`a`, `b`: different learning rates)
    and a data file inside it (data/val.jsonl), trained in this process as `mudpuppy run` trains them."""
    import shutil

    from mudpuppy import create_backend, load_config, run

    from ..conftest import QUICKSTART_DATA, tiny_run_config

    root = tmp_path_factory.mktemp("ui-finished") / "runs"
    root.mkdir()
    for name, lr in (("a", 2e-2), ("b", 5e-3)):
        cfg = tiny_run_config(tiny_model_dir, root / name)
        cfg["training"].update(max_steps=2, learning_rate=lr)
        cfg["data"].update(cache=False, val_datasets=[])
        cfg["data"]["datasets"][0]["num_samples"] = 16
        cfg["eval"] = {"before_training": False, "after_training": False}
        run(load_config(cfg), create_backend("cpu"), echo=lambda *_a, **_k: None)
    (root / "data").mkdir()
    shutil.copy(QUICKSTART_DATA / "smart_home_val.jsonl", root / "data" / "val.jsonl")
    return root
