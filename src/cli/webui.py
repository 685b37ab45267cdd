"""`mudpuppy ui`: the web page over a folder of runs (src/ui, docs/ui.md)."""

from __future__ import annotations

import click

from .common import debug_option, handle_errors


@click.command("ui")
@click.argument("runs_dir", required=False, default=".", type=click.Path(file_okay=False, exists=True))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; beyond loopback (0.0.0.0) only with --token.")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=7860, show_default=True,
              help="TCP port (0: a free one, printed at start).")
@click.option("--token", envvar="MUDPUPPY_UI_TOKEN", default=None, show_envvar=True,
              help="Require this token on every request (the printed address carries it once; the browser then "
                   "keeps it as a cookie). Needed beyond loopback.")
@debug_option
@handle_errors
def ui(runs_dir, host, port, token, debug):
    """A web page over RUNS_DIR (default: here): every run, live curves, start / stop / resume (docs/ui.md)."""
    from ..ui import serve_ui

    serve_ui(runs_dir, host, port, token, echo=click.echo)
