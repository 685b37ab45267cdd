"""On-policy distillation against its teacher and against SFT on the same prompts' labels (issue 40, 4a).

    # configs/distill.yaml trains 2 epochs, distill-teacher.yaml 1: the SFT cells must be told the same
    python benchmarks/distill_quality.py --seeds 42,11,7 --threads 1 --set training.epochs=2
    python benchmarks/distill_quality.py --table-only
    # a variant of the distillation settings, filed under its own tag (SFT cells follow its training.* keys):
    python benchmarks/distill_quality.py --tag fkl --set distill.loss=forward_kl --seeds 42,11,7

The tickets task (configs/data/make_tickets.py: 400 training chats, 100 held-out chats in wording never
trained on). Cells, each `mudpuppy run -c <config>` in its own process with --set overrides only, so a
cell is what a user of the config gets:

- teacher: configs/distill-teacher.yaml at seed 42 (LoRA SFT on the labels, merged). Reused from
  --teacher-dir when a finished seed-42 run with its merged model is there (the lead's
  outputs/tickets-teacher), else trained there.
- distill: configs/distill.yaml at each seed, the teacher's merged model as distill.teacher: the base
  SmolLM2-135M-Instruct learns from the prompts alone (lmbda 1: every micro-batch the student's samples).
- sft: configs/distill-teacher.yaml at each seed without the merge: the same data, steps, lr, schedule,
  adapter and batch as the student (checked before anything runs), trained on the labels.

Every adapter is then scored by benchmarks/quality.py's evaluator in a separate process that imports no
mudpuppy code (plain transformers + PEFT, fp32): greedy exact match of the answer on the 100 held-out
chats and the mean loss over the answer tokens. Cells are appended to --out as they finish; a rerun
skips the cells already there. --tag/--set run the distillation with other settings: every override
goes to the distill cells, the ones outside `distill.` to the SFT cells too (their key names them, so an
SFT cell is shared by the variants that train it the same way).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import load_results, machine, model_path, save_results  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TEACHER_CONFIG = REPO / "configs" / "distill-teacher.yaml"
STUDENT_CONFIG = REPO / "configs" / "distill.yaml"
TEACHER_SEED = 42
TARGET_POINTS = 3.0          # issue 40: the student within 3 points of the teacher's held-out exact match
DEFAULT_OUT = REPO / "benchmarks" / "results" / f"distill_quality-{date.today().isoformat()}.json"
SHARED = ("data", "adapter", "training")   # what the student and the SFT baseline must have alike


def check_same_recipe(sets: list[str]) -> None:
    """The SFT cells train as the student does (data, adapter, training apart from the seed), or stop."""
    from mudpuppy import load_config

    student = load_config(STUDENT_CONFIG, sets)
    sft = load_config(TEACHER_CONFIG, sft_sets(sets))
    differ = [f"{section}.{k}: distill {v!r}, sft {getattr(sft, section).model_dump()[k]!r}"
              for section in SHARED for k, v in getattr(student, section).model_dump().items()
              if getattr(sft, section).model_dump()[k] != v]
    if differ:
        raise SystemExit(f"{STUDENT_CONFIG.name} and {TEACHER_CONFIG.name} must train alike for SFT to be the "
                         f"baseline; they differ in: {'; '.join(differ)}")


def sft_sets(sets: list[str]) -> list[str]:
    return [s for s in sets if not s.startswith("distill.")]


def train(config: Path, out: Path, seed: int, sets: list[str], threads: int | None) -> dict:
    """One `mudpuppy run` in its own process; its run_summary and per-step losses."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cmd = [sys.executable, "-m", "mudpuppy", "run", "-c", str(config), "--overwrite",
           "--set", f"training.seed={seed}", "--set", f"output_dir={out}", "--set", "logging.progress_bar=false",
           "--set", "eval.before_training=false", "--set", "eval.after_training=false"]
    for s in sets:
        cmd += ["--set", s]
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(out.parent / f"{out.name}.log", "w") as log:
        res = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}); its output: {out.parent / (out.name + '.log')}")
    return read_run(out, time.perf_counter() - start)


def read_run(out: Path, seconds: float | None) -> dict:
    summary = json.loads((out / "run_summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss" in r and "step" in r]
    sampled = [r["completions/tokens"] for r in steps if "completions/tokens" in r]
    return {"adapter": str(out), "steps": summary["steps"], "train_seconds": summary["seconds"],
            "run_seconds": seconds, "losses": [r["loss"] for r in steps],
            "sampled_tokens": statistics.fmean(sampled) if sampled else None}


def evaluate(adapter: str, base: str, threads: int | None) -> dict:
    """benchmarks/quality.py's evaluator (transformers + PEFT, no mudpuppy import) in its own process."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if threads:
        env["QUALITY_THREADS"] = str(threads)
    result = Path(adapter) / "heldout_eval.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "quality.py"), "--worker", "eval", "--task-name",
                    "tickets", "--worker-dir", adapter, "--model-path", base, "--result", str(result)],
                   check=True, env=env)
    return json.loads(result.read_text())


def teacher_cell(args) -> dict:
    out = args.teacher_dir
    reuse = (out / "merged" / "config.json").exists() and same_run(out, TEACHER_CONFIG, TEACHER_SEED, ["merge=true"])
    if reuse:
        print(f"   reusing the teacher in {out}: a finished, merged run of {TEACHER_CONFIG.name} at seed "
              f"{TEACHER_SEED}", flush=True)
        trained = read_run(out, None)
    else:
        trained = train(TEACHER_CONFIG, out, TEACHER_SEED, ["merge=true"], args.threads)
    return {**trained, "reused": reuse}


COMPARED = ("model", "method", "adapter", "data", "training", "distill")


def same_run(out: Path, config: Path, seed: int, sets: list[str]) -> bool:
    """Whether `out` holds a finished run of `config` at `seed` with `sets`: the sections that decide what
    it trains (not output_dir, eval, logging) equal, the teacher's path compared resolved."""
    import yaml
    from mudpuppy import load_config

    if not (out / "run_summary.json").exists() or not (out / "config.yaml").exists():
        return False
    if json.loads((out / "run_summary.json").read_text()).get("status") != "finished":
        return False
    saved = yaml.safe_load((out / "config.yaml").read_text())
    wanted = load_config(config, [f"training.seed={seed}", *sets]).model_dump(mode="json")

    def norm(raw: dict) -> dict:
        picked = {k: raw.get(k) for k in COMPARED}
        if picked.get("distill"):
            picked["distill"] = {**picked["distill"], "teacher": str((REPO / picked["distill"]["teacher"]).resolve())}
        return picked

    return alike(norm(saved), norm(wanted))


def alike(saved, wanted) -> bool:
    """Equal, where a key the saved config lacks (a setting added to mudpuppy after that run) is not compared."""
    if isinstance(saved, dict) and isinstance(wanted, dict):
        return all(k in wanted and alike(v, wanted[k]) for k, v in saved.items())
    return saved == wanted


def run_cell(args, kind: str, seed: int, sets: list[str], base: str) -> dict:
    start = time.perf_counter()
    if kind == "teacher":
        trained = teacher_cell(args)
    elif kind == "distill":
        out = args.work / f"distill-{args.tag}-{seed}"
        with_teacher = [f"distill.teacher={args.teacher_dir / 'merged'}", *sets]
        same = [d for d in args.reuse if same_run(d, STUDENT_CONFIG, seed, with_teacher)]
        if same:
            print(f"   reusing {same[0]}: a finished run of these settings", flush=True)
            trained = {**read_run(same[0], None), "reused": True}
        else:
            trained = train(STUDENT_CONFIG, out, seed, with_teacher, args.threads)
    else:
        out = args.work / f"sft-{'_'.join(sets) or 'config'}-{seed}".replace("/", "_")
        trained = train(TEACHER_CONFIG, out, seed, ["merge=false", *sets], args.threads)
    ev = evaluate(trained["adapter"], base, args.threads)
    return {"kind": kind, "seed": seed, "sets": sets, "reused": False, **trained, "exact_match": ev["exact_match"],
            "heldout_loss": ev["heldout_loss"], "wrong": ev["wrong"], "cell_seconds": time.perf_counter() - start,
            "loadavg": Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else None,
            "threads": args.threads, "date": date.today().isoformat()}


def cell_keys(tag: str, sets: list[str], seeds: list[int]) -> list[tuple[str, str, int, list[str]]]:
    """(key, kind, seed, overrides) of every cell a run needs, in order: teacher, then per seed distill, sft."""
    keys = [("teacher", "teacher", TEACHER_SEED, [])]
    for seed in seeds:
        keys.append((f"distill|{tag}|{seed}", "distill", seed, sets))
        keys.append((f"sft|{','.join(sft_sets(sets))}|{seed}", "sft", seed, sft_sets(sets)))
    return keys


def spread(values: list[float]) -> str:
    pct = [100 * v for v in values]
    std = statistics.stdev(pct) if len(pct) > 1 else 0.0
    return f"{statistics.fmean(pct):.1f} ± {std:.1f} ({min(pct):.0f}-{max(pct):.0f})"


def record(out: Path, key: str | None = None, cell: dict | None = None, run: dict | None = None) -> dict:
    """The results file with a cell (or a run's record) added, read again under a lock first: two drivers
    (say, --kinds sft and --kinds distill at once) may share one file."""
    import fcntl

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(Path(tempfile.gettempdir()) / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        results = load_results(out)
        if run is not None:
            results["meta"].setdefault("runs", []).append(run)
        if key is not None:
            results["cells"][key] = cell
        save_results(out, results)
    return results


def print_table(results: dict, tags: list[str] | None = None) -> None:
    cells = results["cells"]
    teacher = cells.get("teacher")
    if teacher:
        print(f"teacher (SFT seed {TEACHER_SEED}, merged): held-out exact match {100 * teacher['exact_match']:.1f}%, "
              f"loss {teacher['heldout_loss']:.4f}")
    variants = {}
    for c in cells.values():
        if c["kind"] == "distill":
            variants.setdefault(c.get("tag", "config"), c["sets"])
    for tag, sets in variants.items():
        if tags and tag not in tags:
            continue
        distilled = {c["seed"]: c for k, c in cells.items() if k.startswith(f"distill|{tag}|")}
        sft = {c["seed"]: c for k, c in cells.items() if k.startswith(f"sft|{','.join(sft_sets(sets))}|")}
        seeds = [s for s in (42, 11, 7) if s in distilled or s in sft]
        seeds += sorted(s for s in {*distilled, *sft} if s not in seeds)
        shown = [x for x in sets if not x.startswith("distill.teacher=")]
        print(f"\n== variant {tag} ({', '.join(shown) or 'configs/distill.yaml as it is'}) ==")
        print(f"{'seed':>5s} | {'distilled EM':>12s} {'loss':>7s} {'sampled/batch':>13s} {'train s':>7s} | "
              f"{'SFT EM':>6s} {'loss':>7s}")
        for seed in seeds:
            d, s = distilled.get(seed), sft.get(seed)
            if d:
                tok = f"{d['sampled_tokens']:.1f}" if d.get("sampled_tokens") is not None else "-"
                row = (f"{seed:>5d} | {100 * d['exact_match']:>11.1f}% {d['heldout_loss']:7.4f} {tok:>13s} "
                       f"{d['train_seconds']:7.0f} | ")
            else:
                row = f"{seed:>5d} | {'-':>12s} {'-':>7s} {'-':>13s} {'-':>7s} | "
            row += f"{100 * s['exact_match']:>5.1f}% {s['heldout_loss']:7.4f}" if s else f"{'-':>6s}"
            print(row)
        em = [distilled[s]["exact_match"] for s in seeds if s in distilled]
        print(f"  distilled n={len(em)}: exact match % mean ± std (min-max) {spread(em)}")
        sft_em = [sft[s]["exact_match"] for s in seeds if s in sft]
        if sft_em:
            print(f"  SFT       n={len(sft_em)}: exact match % mean ± std (min-max) {spread(sft_em)}")
        if teacher and em:
            gap = round(100 * (teacher["exact_match"] - statistics.fmean(em)), 6)
            print(f"  teacher - distilled mean: {gap:+.1f} points; target (within {TARGET_POINTS:g}): "
                  f"{'met' if gap <= TARGET_POINTS else 'missed'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="42,11,7")
    ap.add_argument("--tag", default="config", help="name of the distillation settings (cells are keyed by it)")
    ap.add_argument("--set", action="append", default=[], help="mudpuppy override key=value (dotted), repeatable")
    ap.add_argument("--teacher-dir", type=Path, default=REPO / "outputs" / "tickets-teacher")
    ap.add_argument("--work", type=Path, default=REPO / "outputs" / "bench-distill")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--threads", type=int, default=None, help="torch threads per process (default: torch's)")
    ap.add_argument("--reuse", type=Path, action="append", default=[],
                    help="a finished run to take as a distill cell where its settings are the cell's "
                         "(e.g. outputs/distill from `mudpuppy run -c configs/distill.yaml`)")
    ap.add_argument("--kinds", default="teacher,distill,sft", help="run only these cells (the table shows all)")
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--show-tags", default=None, help="comma list of variants to print (default: all)")
    args = ap.parse_args()
    bad = [s for s in args.set if "=" not in s]
    if bad:
        raise SystemExit(f"--set {bad[0]!r}: expected key=value, e.g. distill.loss=forward_kl")
    results = load_results(args.out)
    if args.table_only:
        print_table(results, args.show_tags.split(",") if args.show_tags else None)
        return
    kinds = args.kinds.split(",")
    unknown = [k for k in kinds if k not in ("teacher", "distill", "sft")]
    if unknown:
        raise SystemExit(f"--kinds {','.join(unknown)}: the cells are teacher, distill and sft")
    check_same_recipe(args.set)
    base = model_path()
    results = record(args.out, run={"date": date.today().isoformat(), "argv": sys.argv[1:], **machine()})
    seeds = [int(s) for s in args.seeds.split(",")]
    for key, kind, seed, sets in cell_keys(args.tag, args.set, seeds):
        if kind not in kinds or key in load_results(args.out)["cells"]:     # another driver may have run it
            continue
        print(f"-- {key} ...", flush=True)
        cell = run_cell(args, kind, seed, sets, base)
        if kind == "distill":
            cell["tag"] = args.tag
        results = record(args.out, key, cell)
        print(f"   exact match {100 * cell['exact_match']:.1f}%  held-out loss {cell['heldout_loss']:.4f}  "
              f"(train {cell['train_seconds']:.0f} s, cell {cell['cell_seconds']:.0f} s, load {cell['loadavg']})",
              flush=True)
    print_table(results, [args.tag])


if __name__ == "__main__":
    main()
