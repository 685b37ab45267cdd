"""Damaged and hostile files, and full disks: each ends in one message (exit 2), and nothing written before is lost.

- a crafted DCP `.metadata` (or a non-tensor DCP entry) that would run code on unpickling is refused, and
  the code does not run: through the DCP loader, and on --resume of a checkpoint with a planted sharded/;
- a full disk during a checkpoint or the final save: one line naming what was being written, the staging
  directory removed, earlier checkpoints and outputs intact (a real tmpfs when this process may mount one,
  else an ENOSPC raised mid-write);
- --resume skips a damaged newest checkpoint with one line and resumes from the next older one;
- safetensors files with a 2^40-byte header, random bytes, or cut short; a half-written config.json or
  tokenizer.json in a run directory that eval, chat or serve would load.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from mudpuppy import create_backend, load_config, run
from mudpuppy.cli import main
from mudpuppy.files import CorruptFile, WriteFailed, check_dcp_dir, check_safetensors, check_torch_file
from mudpuppy.training import checkpoints
from mudpuppy.training.loop import STAGING_FINAL, save_trained

from ..conftest import tiny_run_config

QUIET = dict(echo=lambda *_: None)


class RunsCode:
    """Unpickling this runs a shell command that creates `marker`: what a crafted checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def config(model_dir: Path, out: Path, **training) -> dict:
    cfg = tiny_run_config(model_dir, out)
    cfg["training"] = dict(cfg["training"], max_steps=4, save_steps=2, **training)
    cfg["eval"] = {"before_training": False, "after_training": False}
    return cfg


@pytest.fixture(scope="module")
def finished(tiny_model_dir, tmp_path_factory) -> Path:
    """A finished run with checkpoints at steps 2 and 4 (copied by each test that changes it)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    run(load_config(config(tiny_model_dir, out)), create_backend("cpu"), **QUIET)
    return out


def unfinished_copy(finished: Path, to: Path) -> Path:
    """The finished run as if its process had died after the last checkpoint: resumable."""
    shutil.copytree(finished, to)
    (to / "run_summary.json").unlink()
    return to


def step_dir(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step-{step:08d}"


def resume(model_dir: Path, out: Path, backend=None):
    cfg = config(model_dir, out)
    cfg["resume"] = True
    return run(load_config(cfg), backend or create_backend("cpu"), **QUIET)


# --------------------------------------------------------------------------- safetensors, JSON, torch files

def write_header(path: Path, length: int, body: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<Q", length) + body)
    return path


@pytest.mark.parametrize("make, said", [
    (lambda p: write_header(p, 2**40, b"{}" + b"\0" * 64), "claims 1,099,511,627,776 bytes"),
    (lambda p: p.write_bytes(os.urandom(4096)), "not a safetensors file"),
    (lambda p: p.write_bytes(b"\x01\x02"), "shorter than its 8-byte header"),
    (lambda p: write_header(p, 12, b'{"x":[1,2]}\n'), "no valid data_offsets"),
])
def test_a_bad_safetensors_header_is_named_before_anything_reads_it(tmp_path, make, said):
    path = tmp_path / "adapter_model.safetensors"
    make(path)
    with pytest.raises(CorruptFile, match=said) as info:
        check_safetensors(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_a_safetensors_file_cut_short_is_named(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "trainable.safetensors"
    save_file({"w": torch.ones(64, 64)}, str(path))
    check_safetensors(path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CorruptFile, match="cut short"):
        check_safetensors(path)


def test_a_torch_file_cut_short_or_hostile_is_named_and_never_run(tmp_path):
    from mudpuppy.backends.torch.safe_load import load_torch_file

    path = tmp_path / "trainer.pt"
    torch.save({"step": torch.tensor(3)}, path)
    check_torch_file(path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CorruptFile, match="trainer.pt: not a readable torch file"):
        check_torch_file(path)
    marker = tmp_path / "ran"
    torch.save({"x": RunsCode(marker)}, path)
    with pytest.raises(CorruptFile, match="trainer.pt: cannot be loaded"):
        load_torch_file(path)
    assert not marker.exists()


# --------------------------------------------------------------------------- DCP: nothing executes

def dcp_checkpoint(directory: Path):
    """A small DCP checkpoint of a model and its optimizer, and a state to load it into."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
    )

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    options = StateDictOptions(ignore_frozen_params=True)

    def state():
        return {"model": get_model_state_dict(model, options=options),
                "optim": get_optimizer_state_dict(model, optimizer, options=options)}

    with pytest.warns(UserWarning):       # "assuming the intent is to save in a single process"
        dcp.save(state(), checkpoint_id=str(directory))
    return state


def test_the_dcp_loader_reads_its_own_checkpoints(tmp_path):
    from mudpuppy.backends.torch.distributed import load_dcp

    state = dcp_checkpoint(tmp_path / "sharded")
    check_dcp_dir(tmp_path / "sharded")
    loaded = state()
    load_dcp(loaded, tmp_path / "sharded")
    assert loaded["optim"]["param_groups"][0]["lr"] == 1e-3


def test_a_crafted_dcp_metadata_is_refused_and_runs_nothing(tmp_path):
    from mudpuppy.backends.torch import distributed

    state = dcp_checkpoint(tmp_path / "sharded")
    marker = tmp_path / "ran"
    (tmp_path / "sharded" / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(CorruptFile, match=r"\.metadata: refused: it names posix\.system") as info:
        distributed.load_dcp(state(), tmp_path / "sharded")
    assert "\n" not in str(info.value)
    with pytest.raises(CorruptFile, match="refused"):
        check_dcp_dir(tmp_path / "sharded")
    # The reader load_dcp hands DCP refuses it by itself too (no check first), and so does DCP's load through it.
    with pytest.raises(CorruptFile, match="refused"):
        distributed._safe_reader(tmp_path / "sharded").read_metadata()
    import torch.distributed.checkpoint as dcp

    with pytest.raises(dcp.api.CheckpointException):
        dcp.load(state(), checkpoint_id=str(tmp_path / "sharded"),
                 storage_reader=distributed._safe_reader(tmp_path / "sharded"))
    assert not marker.exists()


def test_a_crafted_non_tensor_dcp_entry_is_refused_and_runs_nothing(tmp_path):
    import io

    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from mudpuppy.backends.torch import distributed

    marker = tmp_path / "ran"
    hostile = io.BytesIO()
    torch.save(RunsCode(marker), hostile)
    hostile.seek(0)
    item = ReadItem(LoadItemType.BYTE_IO, MetadataIndex("optim.param_groups.0.lr"), torch.Size([0]),
                    MetadataIndex("optim.param_groups.0.lr"), torch.Size([0]), torch.Size([0]))
    with pytest.raises(CorruptFile, match="optim.param_groups.0.lr refused"):
        distributed._safe_planner(tmp_path).load_bytes(item, hostile)
    assert not marker.exists()


def test_resume_refuses_a_checkpoint_with_a_planted_sharded_dir(finished, tiny_model_dir, tmp_path, capfd):
    out = unfinished_copy(finished, tmp_path / "run")
    marker = tmp_path / "ran"
    dcp_checkpoint(step_dir(out, 4) / "sharded")
    (step_dir(out, 4) / "sharded" / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))

    result = resume(tiny_model_dir, out)
    assert result.resumed_from == 2 and result.steps == 4
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "skipping checkpoint" in line]
    assert len(lines) == 1 and "step-00000004" in lines[0] and "holds both" in lines[0]
    assert not marker.exists()
    # Step 4 written again by the resumed run; the refused one kept aside, never deleted.
    assert checkpoints.checkpoint_problem(step_dir(out, 4)) is None
    (kept,) = (out / "checkpoints").glob(".damaged-step-00000004-*")
    assert (kept / "sharded" / ".metadata").exists()
    shutil.rmtree(step_dir(out, 4))
    shutil.copytree(kept, step_dir(out, 4))

    # Loaded directly (no --resume check first), the backend refuses it too.
    backend = create_backend("cpu")
    handle = backend.load_model(load_config(config(tiny_model_dir, out)).model, "fp32")
    backend.attach_adapter(handle, load_config(config(tiny_model_dir, out)).adapter)
    trainer = backend.create_trainer(handle, load_config(config(tiny_model_dir, out)).training)
    with pytest.raises(CorruptFile, match="holds both"):
        backend.load_training_state(handle, trainer, str(step_dir(out, 4)))
    # A sharded-only checkpoint (what a distributed run writes) goes through DCP, and is refused there.
    for name in ("trainable.safetensors", "trainer.pt"):
        (step_dir(out, 4) / name).unlink()
    with pytest.raises(CorruptFile, match="refused"):
        backend.load_training_state(handle, trainer, str(step_dir(out, 4)))
    marker_file = step_dir(out, 4) / "complete.json"
    marker_file.write_text(json.dumps({k: v for k, v in json.loads(marker_file.read_text()).items() if k != "files"}))
    assert "sharded/.metadata: refused" in checkpoints.checkpoint_problem(step_dir(out, 4))
    assert not marker.exists()


# --------------------------------------------------------------------------- --resume falls back

@pytest.mark.parametrize("damage, why", [
    (lambda d: (d / "trainable.safetensors").write_bytes(os.urandom(300)), "trainable.safetensors"),
    (lambda d: (d / "trainer.pt").write_bytes((d / "trainer.pt").read_bytes()[:100]), "trainer.pt"),
    (lambda d: (d / "pipeline_state.json").write_text('{"step": 4, "los'), "pipeline_state.json"),
    (lambda d: (d / "trainer.pt").unlink(), "trainer.pt: missing"),
])
def test_resume_skips_a_damaged_newest_checkpoint(finished, tiny_model_dir, tmp_path, capfd, damage, why):
    out = unfinished_copy(finished, tmp_path / "run")
    damage(step_dir(out, 4))
    result = resume(tiny_model_dir, out)
    assert result.resumed_from == 2 and result.steps == 4
    lines = [line for line in capfd.readouterr().err.splitlines() if "skipping checkpoint" in line]
    assert len(lines) == 1 and "step-00000004" in lines[0] and why in lines[0]
    assert len(list((out / "checkpoints").glob(".damaged-step-00000004-*"))) == 1   # kept, never deleted


def test_resume_with_no_readable_checkpoint_lists_them(finished, tiny_model_dir, tmp_path):
    out = unfinished_copy(finished, tmp_path / "run")
    for step in (2, 4):
        (step_dir(out, step) / "complete.json").write_text("{")
    with pytest.raises(CorruptFile, match="no checkpoint in .* reads: step-00000004 .*; step-00000002"):
        resume(tiny_model_dir, out)


# --------------------------------------------------------------------------- full disks

class Disk:
    """A small file system to fill: a real tmpfs where this process may mount one, else a simulated ENOSPC."""

    def __init__(self, root: Path, real: bool):
        self.root, self.real, self.filler = root, real, root / "filler"

    def fill(self, inside: Path | None = None) -> None:
        """Exhaust the space (real); or (simulated) leave a partial file in `inside` and raise ENOSPC."""
        if not self.real:
            (inside / "partial.bin").write_bytes(b"\0" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(inside / "partial.bin"))
        with self.filler.open("ab") as fh:
            try:
                while True:
                    fh.write(b"\0" * 65536)
                    fh.flush()
            except OSError:
                pass

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)


@pytest.fixture(params=["tmpfs", "simulated"])
def disk(request, tmp_path):
    root = tmp_path / "disk"
    root.mkdir()
    if request.param == "simulated":
        yield Disk(root, real=False)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(root)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.decode().strip()}); the simulated case runs")
    try:
        yield Disk(root, real=True)
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


class FillingBackend:
    """The cpu backend, with the disk filling right as a given save starts."""

    def __init__(self, disk: Disk, at: str):
        self.inner, self.disk, self.at, self.checkpoints = create_backend("cpu"), disk, at, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def save_training_state(self, handle, trainer, path):
        self.checkpoints += 1
        if self.at == "checkpoint" and self.checkpoints == 2:
            self.disk.fill(Path(path))
        return self.inner.save_training_state(handle, trainer, path)

    def save_adapter(self, handle, path):
        if self.at == "final" and STAGING_FINAL in str(path):
            self.disk.fill(Path(path))
        return self.inner.save_adapter(handle, path)


def test_a_full_disk_during_a_checkpoint_keeps_the_one_before(disk, tiny_model_dir):
    out = disk.root / "run"
    with pytest.raises(WriteFailed, match="writing checkpoint .*step-00000004: disk full") as info:
        run(load_config(config(tiny_model_dir, out)), FillingBackend(disk, "checkpoint"), **QUIET)
    assert "step-00000002, is kept" in str(info.value) and "\n" not in str(info.value)
    assert [c.name for c in checkpoints.list_checkpoints(out)] == ["step-00000002"]
    assert checkpoints.checkpoint_problem(step_dir(out, 2)) is None
    assert not list((out / "checkpoints").glob(".tmp-*"))          # the staging directory went
    disk.free()
    assert resume(tiny_model_dir, out).resumed_from == 2


def test_a_full_disk_during_the_final_save_replaces_nothing(disk, tiny_model_dir):
    out = disk.root / "run"
    with pytest.raises(WriteFailed, match=f"saving the trained model to {out}: disk full") as info:
        run(load_config(config(tiny_model_dir, out)), FillingBackend(disk, "final"), **QUIET)
    assert "step-00000004" in str(info.value) and "--resume" in str(info.value)
    for name in ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json", STAGING_FINAL):
        assert not (out / name).exists(), name
    assert checkpoints.checkpoint_problem(step_dir(out, 4)) is None
    disk.free()
    result = resume(tiny_model_dir, out)
    assert result.resumed_from == 4 and (out / "adapter_model.safetensors").is_file()
    check_safetensors(out / "adapter_model.safetensors")


def test_a_failed_final_save_leaves_the_older_result_byte_for_byte(disk, tiny_model_dir, tmp_path):
    cfg = load_config(config(tiny_model_dir, disk.root / "out"))
    backend = FillingBackend(disk, "final")
    handle = backend.load_model(cfg.model, "fp32")
    backend.attach_adapter(handle, cfg.adapter)
    out = disk.root / "out"
    out.mkdir()
    backend.at = "never"
    save_trained(cfg, backend, handle, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert {"adapter_model.safetensors", "tokenizer.json"} <= before.keys()
    backend.at = "final"
    with pytest.raises(WriteFailed, match="disk full"):
        save_trained(cfg, backend, handle, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_the_cli_ends_a_full_disk_in_one_line_and_exit_2(disk, tiny_model_dir, tmp_path, monkeypatch):
    import mudpuppy

    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(json.dumps(config(tiny_model_dir, disk.root / "run")))
    monkeypatch.setattr(mudpuppy, "create_backend", lambda *a, **k: FillingBackend(disk, "final"))
    result = CliRunner().invoke(main, ["run", "-c", str(cfg_path)])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: saving the trained model") and "disk full" in errors[0]
    assert "Traceback" not in result.output


# --------------------------------------------------------------------------- damaged run directories

def test_a_half_written_file_in_a_run_directory_is_named_for_eval_chat_and_serve(finished, tmp_path):
    from mudpuppy.evaluation.targets import resolve_target

    for name, cut in (("tokenizer.json", 40), ("adapter_config.json", 10), ("adapter_model.safetensors", 200)):
        out = tmp_path / name
        shutil.copytree(finished, out)
        (out / name).write_bytes((out / name).read_bytes()[:cut])
        with pytest.raises(CorruptFile, match=f"{out / name}: .*(cut short|damaged)"):
            resolve_target(str(out), None, None)


def test_a_half_written_config_json_ends_mudpuppy_eval_with_exit_2(tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_')
    data = tmp_path / "val.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    result = CliRunner().invoke(main, ["eval", str(model), "--data", str(data), "--out", str(tmp_path / "eval")])
    assert result.exit_code == 2, result.output
    assert "config.json" in result.stderr and "Traceback" not in result.output


def test_a_damaged_base_model_file_is_named_when_the_model_loads(tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    weights = next(model.glob("*.safetensors"))
    write_header(weights, 2**40)
    cfg = load_config(config(model, tmp_path / "run"))
    with pytest.raises(CorruptFile, match=f"{weights}: not a safetensors file"):
        create_backend("cpu").load_model(cfg.model, "fp32")


def test_a_staging_directory_left_by_a_killed_save_is_replaced(finished, tiny_model_dir, tmp_path):
    out = unfinished_copy(finished, tmp_path / "run")
    (out / STAGING_FINAL).mkdir()
    (out / STAGING_FINAL / "tokenizer.json").write_text("{")          # half written, then killed
    resume(tiny_model_dir, out)
    assert not (out / STAGING_FINAL).exists()
    json.loads((out / "tokenizer.json").read_text())


def test_checkpoints_list_their_files_with_sizes(finished):
    marker = json.loads((step_dir(finished, 4) / "complete.json").read_text())
    assert marker["files"]["trainable.safetensors"] == (step_dir(finished, 4) / "trainable.safetensors").stat().st_size
    assert "pipeline_state.json" in marker["files"] and "complete.json" not in marker["files"]


def test_a_full_disk_is_recognised_whatever_the_writer_raises(disk, tmp_path):
    """torch's zip writer says only "unexpected pos" on a full disk, safetensors "os error 28", Python ENOSPC."""
    from safetensors.torch import save_file

    from mudpuppy.files import disk_problem

    if not disk.real:
        pytest.skip("needs a real full file system")
    disk.fill()
    writers = {"torch.save": lambda: torch.save({"w": torch.ones(4096)}, disk.root / "x.pt"),
               "save_file": lambda: save_file({"w": torch.ones(4096)}, str(disk.root / "x.safetensors")),
               "write_text": lambda: (disk.root / "x.json").write_text("{}" * 100000)}
    for name, write in writers.items():
        with pytest.raises(Exception) as info:
            write()
        assert disk_problem(info.value, disk.root) == "disk full (no space left on device)", name
