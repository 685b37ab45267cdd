"""MLX's distributed runtime on this machine: two ring processes (`--nproc 2` on the mlx backend) against
one process at the same global batch."""

from __future__ import annotations

import pytest

pytest.importorskip("mlx.core")

import numpy as np  # noqa: E402

from mudpuppy import create_backend, load_config, run  # noqa: E402

from .test_torch_distributed import STEPS, TOL, _tiny, assert_same_adapter, launch, losses, quiet, sft_config  # noqa: E402

pytestmark = pytest.mark.mlx


def mlx_config(tiny_model_dir, tmp_path, out, micro):
    cfg = sft_config(_tiny(tiny_model_dir, tmp_path), out, micro)
    cfg["backend"] = "mlx"
    return cfg


def test_two_mlx_processes_equal_one_at_the_same_global_batch(tiny_model_dir, tmp_path):
    one = mlx_config(tiny_model_dir, tmp_path, tmp_path / "one", 4)
    run(load_config(one), create_backend("mlx"), echo=quiet)
    done = launch(mlx_config(tiny_model_dir, tmp_path, tmp_path / "two", 2), tmp_path / "two.yaml")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mx.distributed, ring backend" in done.stdout
    assert len(losses(tmp_path / "two")) == STEPS
    np.testing.assert_allclose(losses(tmp_path / "two"), losses(tmp_path / "one"), atol=TOL, rtol=0)
    assert_same_adapter(tmp_path / "one", tmp_path / "two")


def test_a_failing_mlx_rank_stops_the_run_with_its_message(tiny_model_dir, tmp_path):
    from ..faults import kill_after

    cfg = mlx_config(tiny_model_dir, tmp_path, tmp_path / "broken", 2)
    done = launch(cfg, tmp_path / "broken.yaml", env=kill_after(2, rank=1))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith("error: rank 1 failed: killed by SIGKILL"), done.stderr
