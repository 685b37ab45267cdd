"""How long a metrics.jsonl line takes to reach the page's live feed (docs/ui.md): N lines appended to a run's
metrics.jsonl, each timed from its write to its server-sent event. `python -m tests.ui.feed_delay [N]`."""

from __future__ import annotations

import http.client
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tests.ui.conftest import serving, write_run


def measure(n: int = 40) -> list[float]:
    root = Path(tempfile.mkdtemp()) / "runs"
    root.mkdir()
    run = write_run(root / "r", metrics=[])
    delays = []
    with serving(root) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
        conn.request("GET", "/api/events?name=r&from=0")
        res = conn.getresponse()
        time.sleep(0.5)
        for step in range(1, n + 1):
            time.sleep(0.137)                      # off the feed's 0.2 s beat: every phase of it is sampled
            with (run / "metrics.jsonl").open("a") as fh:
                fh.write(json.dumps({"step": step, "loss": 1.0}) + "\n")
            written = time.monotonic()
            while True:
                line = res.fp.readline().decode()
                if line.startswith("data: ") and f'"step": {step},' in line:
                    delays.append(time.monotonic() - written)
                    break
        conn.close()
    return sorted(delays)


if __name__ == "__main__":
    got = measure(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
    print(f"{len(got)} lines: median {statistics.median(got) * 1000:.0f} ms, "
          f"p95 {got[int(0.95 * len(got)) - 1] * 1000:.0f} ms, max {got[-1] * 1000:.0f} ms")
