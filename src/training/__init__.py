"""Training methods, each one recipe written against the backend protocol."""

from .grpo import run_grpo
from ..output_dir.rundir import end_run
from .preference import run_preference
from .reward import run_reward
from .sft import RunResult, run_sft

__all__ = ["RunResult", "run_grpo", "run_preference", "run_reward", "run_sft", "run"]


def _run_gptq(cfg, backend, overwrite=False, echo=print, callbacks=()):
    from .gptq import run_gptq              # imported when used: the quantization code is not on other paths
    return run_gptq(cfg, backend, overwrite=overwrite, echo=echo)     # no optimizer step for callbacks to hear


def _run_distill(cfg, backend, overwrite=False, echo=print, callbacks=()):
    from .distill import run_distill        # imported when used, as gptq and qat
    return run_distill(cfg, backend, overwrite=overwrite, echo=echo, callbacks=callbacks)


def _run_qat(cfg, backend, overwrite=False, echo=print, callbacks=()):
    from .qat import run_qat
    return run_qat(cfg, backend, overwrite=overwrite, echo=echo, callbacks=callbacks)


METHODS = {"sft": run_sft, "preference": run_preference, "rm": run_reward, "prm": run_reward, "grpo": run_grpo,
           "rloo": run_grpo, "online_dpo": run_grpo,       # GRPO's recipe with their own objectives
           "distill": _run_distill, "gptq": _run_gptq, "qat": _run_qat}


def run(cfg, backend=None, overwrite: bool = False, echo=print, allow_changes: bool = False,
        callbacks=()) -> RunResult:
    """Run the method a config names on `backend` (created from the config when omitted).

    `callbacks`: monitor.callbacks.Callback objects that hear every optimizer step, held-out check and
    checkpoint, after the run's own (metrics.jsonl, trackers, progress); in a distributed run every rank's
    callbacks hear its own loop. GPTQ trains nothing: its callbacks hear nothing. `allow_changes`: a resumed
    run continues with settings or data that differ from its checkpoint's, recording each change, instead
    of refusing them (`mudpuppy run --resume --allow-changes`; training/resume_changes.py)."""
    from .resume_changes import allowing
    from ..backends import create_backend

    from ..errors import MudpuppyError
    from ..monitor.live import note_run

    backend = backend or create_backend(cfg.backend, **cfg.backend_options())
    note_run(cfg, backend, echo)    # the --tui dashboard's header, when one is drawing for `echo`
    ranks = backend.ranks         # this process's place in the run, as the backend joined it
    if ranks.distributed:
        if cfg.method in ("grpo", "rloo", "online_dpo") and cfg.distributed.strategy == "fsdp":
            # Sampling runs as many decoding steps as a rank's own completions need; FSDP2 gathers each
            # layer's weights in a collective every forward, which would leave the ranks waiting on each other.
            raise MudpuppyError("distributed.strategy: fsdp: GRPO samples a different number of tokens on each "
                                "rank, and FSDP2 needs every rank to run the same forward passes; use "
                                "strategy: ddp (every rank holds the whole model)")
        from ..distributed import check_same_config

        check_same_config(cfg, ranks)
        if not ranks.is_main:
            echo = _silent            # rank 0 speaks for the run
    try:
        with allowing(allow_changes):
            return METHODS[cfg.method](cfg, backend, overwrite=overwrite, echo=echo, callbacks=list(callbacks))
    finally:
        end_run(cfg.output_dir)       # the run directory's lock goes with the run, whether it ended well or not


def _silent(*_args, **_kwargs) -> None:
    pass
