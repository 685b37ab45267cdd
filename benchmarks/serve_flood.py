"""`mudpuppy serve` flooded: every connection answered (200 or 503), none reset; huge bodies refused at once.

    python benchmarks/serve_flood.py                          # the tiny test model, 64 clients for 20 s
    python benchmarks/serve_flood.py --clients 128 --seconds 30 --model smollm2-135m-instruct

Starts `mudpuppy serve` on 127.0.0.1 (a free port, greedy, torch CPU) and measures:

1. flood: --clients threads for --seconds, each sending requests one after another, each on a new
   connection (so every request is also a connect and an accept) for --tokens tokens; every outcome
   is counted: 200, 503 (with Retry-After), another status, a reset, a connection closed without an
   answer, a timeout;
2. bodies: --bodies concurrent requests of --body-mb MB each (one user message of that many
   characters), against this server (default --max-body: refused with a 413 before the body is read)
   and against a second one started with --max-body above them (the body is read and parsed, the
   prompt refused by its length in characters before it is tokenized); each request's time to its
   answer, and the server's peak RSS (VmHWM, /proc/PID/status) before and after.

The model by default is the tiny random Llama the tests build (tests/conftest.py: 2 layers, hidden
32, a 320-token BPE, context 512), so the numbers measure the server, not the model. Loopback only;
every loop is bounded in time and count; each server is stopped with SIGTERM and must exit 0.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_load  # noqa: E402  (beside this file: its server start is shared)

REPO = Path(__file__).resolve().parents[1]
QUESTION = [{"role": "user", "content": "Turn on the kitchen light."}]


def start_server(model: str, log, *flags: str) -> tuple[subprocess.Popen, int]:
    """serve_load's server on the CPU backend; (process, its port)."""
    proc, url = serve_load.start_server(log, "--backend", "cpu", *flags, model=model)
    return proc, int(re.search(r":(\d+)/v1", url).group(1))


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set so far (VmHWM), in MB."""
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", text).group(1)) / 1024


def post(port: int, body: bytes, timeout: float) -> tuple[str, float]:
    """One request on a new connection: (outcome, seconds)."""
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        outcome = str(resp.status)
        if resp.status == 503 and not resp.getheader("Retry-After"):
            outcome = "503 without Retry-After"
    except ConnectionResetError:
        outcome = "reset"
    except (http.client.RemoteDisconnected, BrokenPipeError):
        outcome = "closed unanswered"
    except TimeoutError:
        outcome = "timed out"
    except OSError as exc:
        outcome = type(exc).__name__
    finally:
        conn.close()
    return outcome, time.perf_counter() - started


def flood(port: int, clients: int, seconds: float, tokens: int) -> tuple[Counter, list[float]]:
    body = json.dumps({"messages": QUESTION, "max_tokens": tokens}).encode()
    outcomes: Counter = Counter()
    latencies: list[float] = []
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def client() -> None:
        while time.monotonic() < end:
            outcome, took = post(port, body, timeout=120)
            with lock:
                outcomes[outcome] += 1
                if outcome == "200":
                    latencies.append(took)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 180)
    return outcomes, latencies


def bodies(port: int, count: int, megabytes: float) -> list[tuple[str, float]]:
    body = json.dumps({"messages": [{"role": "user", "content": "x" * int(megabytes * 2**20)}]}).encode()
    results: list[tuple[str, float]] = [("", 0.0)] * count

    def client(i: int) -> None:
        results[i] = post(port, body, timeout=300)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(330)
    return results


def stop(proc: subprocess.Popen, log) -> tuple[int, int]:
    """SIGTERM; (exit code, tracebacks in its log)."""
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(60)
    log.seek(0)
    return code, log.read().count("Traceback")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="what `serve` loads (default: the tests' tiny model)")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--tokens", type=int, default=8, help="max_tokens of each flood request")
    parser.add_argument("--bodies", type=int, default=6)
    parser.add_argument("--body-mb", type=float, default=15.0)
    args = parser.parse_args()
    args.clients, args.seconds, args.bodies = min(args.clients, 512), min(args.seconds, 300), min(args.bodies, 32)

    cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.strip()
    print(f"{cpu or 'CPU: unknown'}; {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f} at start")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            sys.path.insert(0, str(REPO / "tests"))
            from conftest import build_tiny_model

            model = str(build_tiny_model(Path(tmp) / "tiny"))
        log = tempfile.TemporaryFile("w+")
        proc, port = start_server(model, log)
        try:
            post(port, json.dumps({"messages": QUESTION, "max_tokens": 2}).encode(), 120)   # warm-up
            outcomes, latencies = flood(port, args.clients, args.seconds, args.tokens)
            before = peak_rss_mb(proc.pid)
            refused = bodies(port, args.bodies, args.body_mb)
            after = peak_rss_mb(proc.pid)
        finally:
            code, tracebacks = stop(proc, log)
        log2 = tempfile.TemporaryFile("w+")
        proc2, port2 = start_server(model, log2, "--max-body", str(int(args.body_mb * 2 + 8)))
        try:
            before2 = peak_rss_mb(proc2.pid)
            read = bodies(port2, args.bodies, args.body_mb)
            after2 = peak_rss_mb(proc2.pid)
        finally:
            code2, tracebacks2 = stop(proc2, log2)

    total = sum(outcomes.values())
    print(f"\nflood: {args.clients} clients for {args.seconds:g} s, a new connection per request, "
          f"max_tokens {args.tokens}")
    print(f"  {total} connections: " + ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items())))
    if latencies:
        q = statistics.quantiles(latencies, n=10) if len(latencies) > 1 else latencies * 9
        print(f"  200s: p50 {statistics.median(latencies):.2f} s, p90 {q[8]:.2f} s, "
              f"{len(latencies) / args.seconds:.1f} answers/s")
    for name, results, peak in ((f"default --max-body ({args.bodies} x {args.body_mb:g} MB)", refused,
                                 (before, after)),
                                (f"--max-body {int(args.body_mb * 2 + 8)} (read, parsed, refused by length)", read,
                                 (before2, after2))):
        print(f"bodies, {name}: " + ", ".join(f"{o} in {t:.2f} s" for o, t in results))
        print(f"  server peak RSS {peak[0]:.0f} MB before, {peak[1]:.0f} MB after")
    print(f"servers: exit codes {code}, {code2} after SIGTERM; tracebacks in their logs: {tracebacks + tracebacks2}")
    bad = total - outcomes["200"] - outcomes["503"]
    print(f"RESULT connections={total} ok={outcomes['200']} busy={outcomes['503']} unanswered={bad} "
          f"body_max_s={max(t for _, t in refused + read):.2f} "
          f"peak_rss_mb={max(after, after2):.0f}")


if __name__ == "__main__":
    main()
