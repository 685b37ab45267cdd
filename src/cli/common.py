"""What every verb shares: the error handling that turns a user mistake into one line and an exit code, and
the options several verbs take (--config, --set, --debug, --tui).

User mistakes end in one message on stderr and exit code 2; `--debug` shows
the traceback. Anything else is a mudpuppy bug and keeps its traceback. In one
process of a distributed run the launcher prints the failure instead, once.
"""

from __future__ import annotations

import functools
import sys
import traceback

import click

from ..errors import MudpuppyError


def handle_errors(fn):
    """Run a verb: a MudpuppyError becomes `error: ...` and its exit code, Ctrl-C exit 130."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        debug = kwargs.get("debug", False)
        try:
            return fn(*args, **kwargs)
        except MudpuppyError as exc:
            if debug:
                traceback.print_exc()
            if not _reported_to_launcher(str(exc)):
                click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except Exception as exc:
            # A process of a distributed run whose collective failed because another process died:
            # the launcher names that one; this one only says it lost contact.
            from ..launch import PEER_LOST, is_peer_loss

            if is_peer_loss(exc) and _reported_to_launcher(f"{PEER_LOST} ({type(exc).__name__})"):
                sys.exit(1)
            _record_crash(exc)
            raise

    return wrapper


def _reported_to_launcher(message: str) -> bool:
    """In one process of a distributed run: hand the failure to the launcher, which prints it once.
    Under a plain torchrun each rank prints its own, prefixed with the rank."""
    from ..distributed import from_environment

    ranks = from_environment()
    if not ranks.distributed:
        return False
    from ..launch import record_failure

    if record_failure(message):
        return True
    click.echo(f"error (rank {ranks.rank}): {message}", err=True)
    return True


def _record_crash(exc: Exception) -> None:
    """A bug in one process of a distributed run: the launcher names it; the traceback is printed too."""
    from ..distributed import from_environment

    if from_environment().distributed:
        from ..launch import record_failure

        record_failure(f"crashed with {type(exc).__name__}: {exc} (traceback above)")


config_option = click.option("--config", "-c", "config_path", required=True,
                             type=click.Path(dir_okay=False), help="The run's YAML file.")
set_option = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                          help="Override a config value, e.g. --set training.max_steps=5 (repeatable).")
debug_option = click.option("--debug", is_flag=True, help="Show tracebacks for user errors too.")
tui_option = click.option("--tui", is_flag=True,
                          help="A live dashboard while training: progress, metrics with sparklines, hardware, log "
                               "(logging.tui). Off a terminal, plain progress lines.")
