"""What a run reports while it trains, and what it leaves for people once it has: the training loop's callbacks.

callbacks.py defines the hooks the loop (training/loop.py) calls; every
reporter is a callback: metrics.py writes metrics.jsonl, trackers.py sends the
same records to logging.report_to's trackers (TensorBoard event files written
without torch), progress.py draws progress lines or a tqdm bar, and live.py
the `--tui` dashboard. dashboard.py turns the recorded state of a run (its
metrics lines, log lines, hardware readings and sample completions) into rich
renderables, a pure function that tests render to a fixed-width console.
report.py draws the charts and the model card from what the run wrote.
Hardware readings come through the backend (backends/hardware.py).
"""
