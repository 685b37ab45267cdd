"""What a person watching a run sees while it trains: the `--tui` dashboard.

dashboard.py turns the recorded state of a run (its metrics lines, log lines,
hardware readings and sample completions) into rich renderables, a pure
function that tests render to a fixed-width console; live.py drives it on a
terminal while a run trains, and falls back to plain progress lines when it
cannot; progress.py draws those lines (or a tqdm bar) when no dashboard
runs. Hardware readings come through the backend (backends/hardware.py).
"""
