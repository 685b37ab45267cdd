"""`mudpuppy serve` against slow clients (slowloris): how long until a normal client is answered.

    python benchmarks/serve_slowloris.py                       # 128 slow clients, the default flags
    python benchmarks/serve_slowloris.py --flags "--header-timeout 600"

Starts `mudpuppy serve` on the tests' tiny model (127.0.0.1, a free port, torch CPU), then opens
--slow connections (default 128: every place of the default --max-connections), each sending a request
line and then one byte of a header every --gap seconds, never finishing it. Half a second later a
normal client asks every 0.5 s (a 503 means the pool is full) until it gets a 200, or --seconds pass.
Prints: the seconds to the first 200 and the 503s before it, what the slow clients got back (408s)
and how long each held its connection (median, min-max). Loopback only, bounded in count and time.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_flood import QUESTION, post, start_server, stop  # noqa: E402  (beside this file)
from serve_load import REPO  # noqa: E402


def trickle(port: int, gap: float, limit: float, out: list) -> None:
    """One slow client; appends (what the server sent first, seconds the connection was held)."""
    started = time.monotonic()
    answer = b"no answer: left after its time limit"
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=limit)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        while time.monotonic() - started < limit:
            sock.settimeout(gap)
            try:
                answer = sock.recv(200) or b"closed by the server, unanswered"
                break
            except TimeoutError:
                sock.sendall(b"a")
        sock.close()
    except OSError as exc:
        answer = type(exc).__name__.encode()
    out.append((answer.split(b"\r\n", 1)[0].decode(errors="replace"), time.monotonic() - started))


def first_answer(port: int, seconds: float) -> tuple[float | None, Counter]:
    body = json.dumps({"messages": QUESTION, "max_tokens": 2}).encode()
    started, seen = time.monotonic(), Counter()
    while time.monotonic() - started < seconds:
        outcome, _ = post(port, body, 30)
        seen[outcome] += 1
        if outcome == "200":
            return time.monotonic() - started, seen
        time.sleep(0.5)
    return None, seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slow", type=int, default=128)
    parser.add_argument("--gap", type=float, default=1.0, help="seconds between a slow client's bytes")
    parser.add_argument("--seconds", type=float, default=40.0, help="how long the normal client keeps asking")
    parser.add_argument("--flags", default="", help="extra `serve` flags, one string")
    args = parser.parse_args()
    args.slow, args.seconds = min(args.slow, 512), min(args.seconds, 300)
    cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.strip()
    print(f"{cpu or 'CPU: unknown'}; {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f} at start")
    with tempfile.TemporaryDirectory() as tmp:
        sys.path.insert(0, str(REPO / "tests"))
        from conftest import build_tiny_model

        model = str(build_tiny_model(Path(tmp) / "tiny"))
        log = tempfile.TemporaryFile("w+")
        proc, port = start_server(model, log, *shlex.split(args.flags))
        try:
            post(port, json.dumps({"messages": QUESTION, "max_tokens": 2}).encode(), 120)    # warm-up
            held: list = []
            threads = [threading.Thread(target=trickle, args=(port, args.gap, args.seconds + 5, held), daemon=True)
                       for _ in range(args.slow)]
            for t in threads:
                t.start()
            time.sleep(0.5)
            waited, seen = first_answer(port, args.seconds)
            for t in threads:
                t.join(args.seconds + 15)
        finally:
            code, tracebacks = stop(proc, log)
    times = sorted(s for _, s in held)
    print(f"serve {args.flags or '(default flags)'}; {args.slow} slow clients, a byte every {args.gap:g} s")
    print(f"normal client: first 200 after {waited:.1f} s" if waited is not None
          else f"normal client: no 200 within {args.seconds:g} s", f"({dict(seen)})")
    print(f"slow clients got: {dict(Counter(a for a, _ in held))}; held their connection "
          f"{statistics.median(times):.1f} s (median, {times[0]:.1f}-{times[-1]:.1f})")
    print(f"server: exit {code}, {tracebacks} tracebacks in its log")


if __name__ == "__main__":
    main()
