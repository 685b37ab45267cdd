"""`mudpuppy ui`: a local web page over a folder of runs: the runs list, a run's live curves and log, a form
that starts, stops and resumes runs, a chat pane, export buttons and one-click evaluation. Everything it does
goes through what the command line does: the run folder's records (output_dir/, metrics.jsonl,
run_summary.json), configure.load_config and shortcuts.train_config for the form, `mudpuppy run` / `train` /
`export` / `eval` as child processes, serving's ChatSession and engine for the chat (docs/ui.md).

    runs.py     the runs under the folder and their status, read from their records; paths kept inside it
    jobs.py     the form as a command; start (a child process), stop (SIGINT), resume (--resume)
    talk.py     the chat pane: a finished run (and its base) through serving's ChatSession and engine, one run held
    ship.py     export buttons and one-click eval: `mudpuppy export` / `mudpuppy eval` as child processes
    extras.py   a run page's hardware readings (the training process's, as --tui shows them), sampled completions
    server.py   the HTTP server: the page, its JSON API, the live feed (server-sent events), who may call it
    static/     the page: plain HTML, CSS and JavaScript, curves drawn as SVG by hand (no build step)
"""

from __future__ import annotations

from pathlib import Path


def serve_ui(root: str | Path, host: str = "127.0.0.1", port: int = 7860, token: str | None = None, echo=print):
    """Serve the page over `root` until Ctrl-C; runs started from it go on training."""
    from .server import UIServer

    server = UIServer((host, port), Path(root), token)
    where = server.url + (f"?token={token}" if token else "")
    echo(f"mudpuppy ui: {server.root} at {where} (Ctrl-C to stop the page; runs it started go on)")
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.stopping = True
        server.server_close()
