"""The pieces of a distributed run that need no second process: data shares, ranks, launcher messages."""

from __future__ import annotations

import numpy as np
import pytest

from mudpuppy import distributed
from mudpuppy.data.batching import Batcher
from mudpuppy.data.examples import Example
from mudpuppy.errors import MudpuppyError
from mudpuppy.launch import child_arguments, first_cause


def examples(lengths):
    return [Example(np.arange(1, n + 1), np.ones(n, dtype=bool), f"ex{i}") for i, n in enumerate(lengths)]


@pytest.mark.parametrize("options", [{}, {"packing": True, "sequence_len": 16}, {"group_by_length": True}])
def test_the_ranks_shares_of_a_step_are_the_one_process_batch(options):
    data = examples([3, 5, 7, 4, 6, 8, 2, 9, 5, 3, 6])
    two = [Batcher(data, 2, 0, seed=5, shard=(r, 2), **options) for r in range(2)]
    grouped = bool(options.get("group_by_length"))
    # A length-grouped unit is a whole batch: one process at micro 2 reads two of them per step of two ranks.
    one = Batcher(data, 2 if grouped else 4, 0, seed=5, **options)
    per_step = 2 if grouped else 1
    assert two[0].batches_per_epoch == -(-one.batches_per_epoch // per_step)

    def rows(batches):
        return [row[row != 0].tolist() for batch in batches if not getattr(batch, "placeholder", False)
                for row in batch.input_ids]

    for _ in range(7):                        # across an epoch boundary
        shares = [b.next_batch() for b in two]
        assert rows(shares) == rows([one.next_batch() for _ in range(per_step)])
        assert two[0].state_dict() == two[1].state_dict()


def test_a_rank_left_without_data_gets_a_weightless_placeholder():
    data = examples([3, 4, 5, 6, 7])            # 5 examples at 2 x 2 per step: the second step holds one
    ranks = [Batcher(data, 2, 0, seed=1, shuffle=False, shard=(r, 2)) for r in range(2)]
    [b.next_batch() for b in ranks]
    last = [b.next_batch() for b in ranks]
    assert not getattr(last[0], "placeholder", False) and last[0].input_ids.shape[0] == 1
    assert last[1].placeholder is True


def test_ranks_come_from_the_launchers_environment():
    r = distributed.from_environment({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (r.rank, r.world, r.local_rank, r.local_world, r.is_main, r.distributed) == (3, 4, 1, 2, False, True)
    r = distributed.from_environment({"MLX_RANK": "1", "MLX_WORLD_SIZE": "2"})
    assert (r.rank, r.world, r.local_rank) == (1, 2, 1)
    assert distributed.from_environment({}).world == 1


def test_on_main_raises_rank_zeros_error_everywhere():
    boxes = {}

    def broadcast(obj):             # rank 1's view: it receives what rank 0 sent
        return boxes["sent"]

    main = distributed.Ranks(0, 2, broadcast=lambda obj: boxes.setdefault("sent", obj))
    with pytest.raises(MudpuppyError, match="already holds"):
        main.on_main(lambda: (_ for _ in ()).throw(MudpuppyError("output_dir x already holds a run")))
    other = distributed.Ranks(1, 2, broadcast=broadcast)
    with pytest.raises(MudpuppyError, match="already holds") as info:
        other.on_main(lambda: pytest.fail("only rank 0 runs it"))
    assert info.value.exit_code == 2


def test_child_arguments_drop_nproc_only():
    assert child_arguments(["-c", "x.yaml", "--nproc", "2", "--set", "a=1", "--resume"]) == \
        ["-c", "x.yaml", "--set", "a=1", "--resume"]
    assert child_arguments(["--nproc=4", "-c", "x.yaml"]) == ["-c", "x.yaml"]


class Failure:
    def __init__(self, exitcode, message="", wrote=False, signal=""):
        self.exitcode, self.message, self._signal = exitcode, message, signal
        self.error_file_data = {"message": message} if wrote else {"message": "<NONE>"}

    def signal_name(self):
        return self._signal


def test_the_launcher_names_the_rank_that_failed_not_the_ones_it_stopped():
    stopped = Failure(-15, signal="SIGTERM")
    assert first_cause({0: stopped, 1: Failure(-9, signal="SIGKILL")}) == (1, "killed by SIGKILL", 1)
    assert first_cause({0: stopped, 1: Failure(2, "bad data", wrote=True)}) == (1, "bad data", 2)
    assert first_cause({0: Failure(3), 1: stopped}) == (0, "exit code 3", 3)
    lost = Failure(1, "lost contact with another process (DistBackendError)", wrote=True)
    assert first_cause({0: lost, 1: Failure(-9, signal="SIGKILL")}) == (1, "killed by SIGKILL", 1)
    # Every rank raised the same error; rank 0 was stopped by the launcher while exiting.
    said = Failure(-15, "bad data", wrote=True, signal="SIGTERM")
    assert first_cause({0: said, 1: Failure(2, "bad data", wrote=True)}) == (1, "bad data", 2)


def gpus():
    from mudpuppy.backends.torch.devices.gpu import Gpu

    return [Gpu(0, "Radeon 780M", "gfx1103", 16, (11, 0), integrated=True, problem="integrated GPU"),
            Gpu(1, "RX 7900 XTX", "gfx1100", 24, (11, 0)), Gpu(2, "RX 7900 XTX", "gfx1100", 24, (11, 0))]


def test_local_ranks_map_onto_the_usable_gpus_only(monkeypatch):
    from mudpuppy.backends.torch.devices.gpu import select_rank_device

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for local, expected in ((0, 1), (1, 2)):          # the integrated GPU the probe skipped never counts
        monkeypatch.setenv("LOCAL_RANK", str(local))
        assert select_rank_device(gpus(), None) == expected


def test_more_processes_than_usable_gpus_is_refused(monkeypatch):
    from mudpuppy.backends.torch.devices.gpu import select_rank_device
    from mudpuppy.errors import BackendUnavailable

    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(BackendUnavailable, match="3 processes on this node but 2 usable GPU"):
        select_rank_device(gpus(), None)
    with pytest.raises(BackendUnavailable, match=r"devices: \[0\] are not usable"):
        select_rank_device(gpus(), [0, 1, 2])


def test_a_rank_with_another_config_stops_the_run(tiny_config):
    from mudpuppy import load_config
    from mudpuppy.distributed import check_same_config

    cfg = load_config(tiny_config)
    other = distributed.Ranks(0, 3, gather=lambda digest: [digest, digest, "0123456789ab"])
    with pytest.raises(MudpuppyError, match="ranks 2 run a different config from rank 0"):
        check_same_config(cfg, other)
    check_same_config(cfg, distributed.Ranks(0, 2, gather=lambda digest: [digest, digest]))
