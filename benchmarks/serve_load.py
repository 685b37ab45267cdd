"""`mudpuppy serve` under load: one client against N concurrent ones, through the official `openai` client.

    python benchmarks/serve_load.py                  # 8 clients, 16 tokens each, SmolLM2-135M-Instruct
    python benchmarks/serve_load.py --clients 4 --rounds 3 --precision fp32

Starts `mudpuppy serve smollm2-135m-instruct` (the embedded model, as configs/quickstart.yaml
names it) on 127.0.0.1 with a free port, greedy, and measures:

1. one client: --rounds requests one after another, each for --tokens tokens;
2. N clients at once, each sending --rounds requests back to back (a closed loop);
3. the server while one client streams a very long answer: a second client's short request
   is timed against the same request alone, and a request for 10^9 tokens must be refused
   at once (400) rather than hold the model.

Prints p50/p90 latency per request, total generated tokens/s, and the ratios N clients / one.
The prompts ask for long answers so that every request generates its --tokens tokens.
Loopback only; bounded loops; the server is stopped with SIGTERM at the end and must exit 0.
Needs `pip install 'mudpuppy[bench]'` (OpenAI's client).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
PROMPTS = [
    "Write a long story about a salamander who learns to swim.",
    "Explain in detail how a refrigerator keeps food cold.",
    "Describe your ideal smart home, room by room.",
    "List twenty things to pack for a week of camping, with a reason for each.",
    "Write a long poem about the sea at night.",
    "Explain step by step how to bake bread at home.",
    "Describe the water cycle to a ten-year-old, at length.",
    "Write a detailed letter to a neighbour about a lost cat.",
]


def start_server(log, *flags: str, model: str = MODEL) -> tuple[subprocess.Popen, str]:
    """`mudpuppy serve MODEL` on a free loopback port with greedy decoding; (process, its /v1 URL)."""
    cmd = [sys.executable, "-m", "mudpuppy", "serve", model, "--host", "127.0.0.1", "--port", "0",
           "--temperature", "0", *flags]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        found = re.search(r"at (http://\S+/v1)", line)
        if found:
            threading.Thread(target=proc.stdout.read, daemon=True).start()    # keep the pipe drained
            return proc, found.group(1)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise SystemExit("the server did not start (its log: above)")


def ask(client, prompt: str, tokens: int) -> tuple[float, int]:
    started = time.perf_counter()
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=tokens, temperature=0)
    return time.perf_counter() - started, answer.usage.completion_tokens


def load(client, clients: int, rounds: int, tokens: int) -> dict:
    """`clients` threads, each sending `rounds` requests one after another."""
    latencies: list[float] = []
    generated = [0]
    lock = threading.Lock()

    def worker(i: int) -> None:
        for r in range(rounds):
            seconds, n = ask(client, PROMPTS[(i + r) % len(PROMPTS)], tokens)
            with lock:
                latencies.append(seconds)
                generated[0] += n

    started = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    q = statistics.quantiles(latencies, n=10) if len(latencies) > 1 else latencies * 9
    return {"p50": statistics.median(latencies), "p90": q[8], "tokens_per_s": generated[0] / wall,
            "requests": len(latencies), "tokens": generated[0]}


def long_answer_check(client, tokens: int) -> dict:
    """A second client's latency while one stream runs long; the 10^9-token request refused."""
    import openai

    alone = min(ask(client, PROMPTS[1], tokens)[0] for _ in range(2))
    stream = client.chat.completions.create(model=MODEL, stream=True, max_tokens=2000, temperature=0,
                                            messages=[{"role": "user", "content": "Count from 1 to 2000, "
                                                                                  "separated by commas."}])
    chunks = iter(stream)
    next(chunks)
    during = ask(client, PROMPTS[1], tokens)[0]
    still_running = next(chunks, None) is not None
    stream.close()                                    # the client leaves: the server stops that generation
    started = time.perf_counter()
    try:
        client.chat.completions.create(model=MODEL, max_tokens=10**9,
                                       messages=[{"role": "user", "content": "Count forever."}])
        refused = False
    except openai.BadRequestError:
        refused = True
    refusal = time.perf_counter() - started
    after = ask(client, PROMPTS[1], tokens)[0]
    return {"alone": alone, "during": during, "still_running": still_running, "refused": refused,
            "refusal_s": refusal, "after": after}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="requests per client in each phase")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    args = parser.parse_args()
    from openai import OpenAI

    cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout.strip()
    print(f"{cpu or 'CPU: unknown'}; {os.cpu_count()} cores; precision {args.precision}")
    log = tempfile.TemporaryFile("w+")       # the server's log, shown when it exits badly
    proc, url = start_server(log, "--precision", args.precision)
    try:
        client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
        for prompt in PROMPTS[:2]:                       # warm-up: first calls allocate and tune
            ask(client, prompt, args.tokens)
        one = load(client, 1, max(args.rounds, 4), args.tokens)
        many = load(client, args.clients, args.rounds, args.tokens)
        check = long_answer_check(client, args.tokens)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    print(f"\n{'':>10} {'requests':>8} {'p50 s':>7} {'p90 s':>7} {'tokens/s':>9}")
    for name, r in (("1 client", one), (f"{args.clients} clients", many)):
        print(f"{name:>10} {r['requests']:>8} {r['p50']:>7.2f} {r['p90']:>7.2f} {r['tokens_per_s']:>9.1f}")
    print(f"\nthroughput ratio {many['tokens_per_s'] / one['tokens_per_s']:.2f}x (target >= 3)   "
          f"p50 latency ratio {many['p50'] / one['p50']:.2f}x (target <= 2.5)")
    print(f"a {args.tokens}-token request: {check['alone']:.2f} s alone, {check['during']:.2f} s while another "
          f"client streams a 2000-token answer (still running after it: {check['still_running']}), "
          f"{check['after']:.2f} s after that client left")
    print(f"max_tokens 10^9: {'refused (400)' if check['refused'] else 'ACCEPTED'} in {check['refusal_s']:.2f} s")
    print(f"server exit code after SIGTERM: {code}")
    if code != 0:
        log.seek(0)
        print("server log (end):\n" + "".join(log.readlines()[-30:]))
    print(f"RESULT throughput_ratio={many['tokens_per_s'] / one['tokens_per_s']:.3f} "
          f"p50_ratio={many['p50'] / one['p50']:.3f} one_p50={one['p50']:.3f} many_p50={many['p50']:.3f} "
          f"one_tps={one['tokens_per_s']:.2f} many_tps={many['tokens_per_s']:.2f}")


if __name__ == "__main__":
    main()
