"""A run never writes over a file it did not write that holds one of its report's names (issue 37, the
output contract): the user's README.md or loss.png, put in the live run directory before the run's card
and charts, stays; the run's own go beside it as README.mudpuppy.md and loss.mudpuppy.png, in one line.
The real command line on the tiny model."""

from __future__ import annotations

import importlib.util


from mudpuppy.output_dir import rundir

from ..contract_helpers import Held, cli
from .test_output_contract import write_cfg

PLOTS = importlib.util.find_spec("matplotlib") is not None


def test_the_users_card_and_chart_in_a_live_run_are_kept_and_the_runs_go_beside_them(tiny_config, tmp_path):
    cfg_path = write_cfg(tmp_path, tiny_config)
    run = tmp_path / "run"
    # held before the final save: PEFT's placeholder README.md comes with the adapter, the card after it
    held = Held(tmp_path / "held", "mudpuppy.training.loop:staged_final", "before", "run", "-c", cfg_path)
    held.wait()
    (run / "README.md").write_text("# my notes on this run\n")
    (run / "loss.png").write_bytes(b"my own chart")
    code, _, err = held.release()
    assert code == 0, err
    assert (run / "README.md").read_text() == "# my notes on this run\n"
    assert (run / "loss.png").read_bytes() == b"my own chart"
    card = (run / "README.mudpuppy.md").read_text()
    assert "base_model" in card
    lines = [line for line in err.splitlines() if "kept the files there that the run did not write" in line]
    assert len(lines) == 1 and "README.md as README.mudpuppy.md" in lines[0], err
    written = set(rundir.read_marker(run)["written"])
    assert "README.mudpuppy.md" in written and not {"README.md", "loss.png"} & written
    if PLOTS:
        assert "loss.png as loss.mudpuppy.png" in lines[0]
        assert (run / "loss.mudpuppy.png").read_bytes().startswith(b"\x89PNG") and "loss.mudpuppy.png" in written
        assert "](loss.mudpuppy.png)" in card
    again = cli("run", "-c", cfg_path, "--overwrite")       # the user's files are not the run's to remove
    assert again.returncode == 0, again.stderr
    assert (run / "README.md").read_text() == "# my notes on this run\n"
    assert (run / "loss.png").read_bytes() == b"my own chart"


def test_when_the_other_name_is_the_users_too_the_card_is_skipped_with_one_line(tiny_config, tmp_path):
    cfg_path = write_cfg(tmp_path, tiny_config)
    run = tmp_path / "run"
    held = Held(tmp_path / "held", "mudpuppy.training.loop:staged_final", "before", "run", "-c", cfg_path)
    held.wait()
    (run / "README.md").write_text("mine\n")
    (run / "README.mudpuppy.md").write_text("mine too\n")
    code, _, err = held.release()
    assert code == 0, err
    assert (run / "README.md").read_text() == "mine\n" and (run / "README.mudpuppy.md").read_text() == "mine too\n"
    assert sum("no README.md (that name and README.mudpuppy.md hold files the run did not write)" in line
               for line in err.splitlines()) == 1, err


def test_a_run_writes_its_card_over_its_own_placeholder(tiny_config, tmp_path):
    """Without a file of the user's, nothing changes: the card replaces PEFT's README.md, no other name."""
    cfg_path = write_cfg(tmp_path, tiny_config)
    done = cli("run", "-c", cfg_path)
    assert done.returncode == 0, done.stderr
    run = tmp_path / "run"
    assert "base_model" in (run / "README.md").read_text() and not (run / "README.mudpuppy.md").exists()
    assert "kept the files there" not in done.stderr
    if PLOTS:
        assert (run / "loss.png").is_file() and not (run / "loss.mudpuppy.png").exists()


