"""A run killed right after a given optimizer step, as a crash or the OOM killer would: through the public
callback API (`mudpuppy.run(..., callbacks=[...])`), so that no run reads a test's wish from its environment.

tests/faults.py puts this folder first on PYTHONPATH of the processes a test starts (the CLI, or the
copies `--nproc` launches): Python imports sitecustomize.py from it at startup, which calls `install()`.
"""

from __future__ import annotations

import os
import signal

from mudpuppy.monitor.callbacks import Callback

STEP_ENV, RANK_ENV = "TEST_KILL_AFTER_STEP", "TEST_KILL_RANK"     # the test's channel to this folder, no one else's


class KillAfterStep(Callback):
    """SIGKILL this process once step `step` is done: after its checkpoint when the run saves at that step
    (`saves`), else once the step is reported; on rank `rank` only, or on every rank when None."""

    def __init__(self, step: int, rank: int | None = None, saves: bool = True):
        self.step, self.rank, self.saves = step, rank, saves

    def on_step_end(self, step: int, metrics: dict) -> None:
        if step == self.step and not self.saves:
            self.kill()

    def on_checkpoint(self, step: int, path) -> None:
        if step == self.step and self.saves:
            self.kill()

    def kill(self) -> None:
        from mudpuppy.distributed import from_environment     # the rank the launcher gave this process

        if self.rank is None or from_environment().rank == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)


def install() -> None:
    """Hand every `mudpuppy.run` of this process (the CLI's, a curriculum's stages) a KillAfterStep."""
    if not os.environ.get(STEP_ENV):
        return
    import mudpuppy.training as training

    step, rank = int(os.environ[STEP_ENV]), os.environ.get(RANK_ENV)
    real = training.run

    def run(cfg, *args, callbacks=(), **kwargs):
        every = cfg.training.save_steps
        killer = KillAfterStep(step, None if rank is None else int(rank), bool(every) and step % every == 0)
        return real(cfg, *args, callbacks=[*callbacks, killer], **kwargs)

    training.run = run
