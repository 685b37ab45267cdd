"""Does `--imatrix auto` help Q4_K_M on a model whose weights sit on no quantization grid? (issue 41)

    .venv/bin/python benchmarks/imatrix_scratch.py --work DIR --paired   # 3 seeds, one after another
    .venv/bin/python benchmarks/imatrix_scratch.py --work DIR --seeds 2  # one seed (resume: same DIR)
    .venv/bin/python benchmarks/imatrix_scratch.py --seeds 1 --steps 20  # a quick look

On 2 cores shared with other jobs (load 5-10), a seed took 24-28 min to train (100 steps, ~300k tokens) and
15-20 min to measure; seeds in one DIR may run as concurrent processes (one per seed, each its own --seeds),
then one run over all of them (resumed, nothing measured twice) writes the combined JSON.

The quickstart's model (SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF) carries Q4_1's grid in its weights
and has a hidden size (576) that is not a multiple of 256, so most of its matrices never reach a K-quant
block. This benchmark makes the fair test with nothing downloaded:

1. a Llama model from a transformers config (hidden 256, FFN 768, 6 layers, 4 heads of 64, 2 KV heads:
   every row length a multiple of 256), randomly initialized with the seed and saved in bfloat16, with the
   tokenizer and chat template of the embedded SmolLM2 (49,152 tokens, tied embeddings);
2. trained from scratch by `mudpuppy run` (full fine-tune, precision auto, packed rows of 512 tokens) on
   text records cut from this Python's standard library sources: files are split by a hash of their path,
   about one in ten held out, so the held-out set is other files than the training set;
3. measured by `benchmarks/export_quality.py`'s `measure` (the merge, `--imatrix auto`'s collection from the
   run's own training data, the export's writer, the dequantized evaluation and llama.cpp's perplexity where
   llama_cpp imports) at q4_k_m without and with the importance matrix, q4_0, q4_k_s, q5_k_m, q6_k and q8_0;
4. with --paired, Q4_K_M written by `mudpuppy export` itself without and with `--imatrix FILE` (the matrix of
   step 3) and scored example by example beside the merged model: each change of log-perplexity with a 95%
   bootstrap interval over the held-out examples, to tell an effect from noise.

The corpus depends on the Python version (its standard library); the JSON records which. Writes the
per-seed rows and the medians to benchmarks/results/imatrix_scratch-<date>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import export_quality  # noqa: E402  (benchmarks/ is not a package)

REPO = export_quality.REPO
TYPES = ["q4_k_m", "q4_k_m + imatrix", "q4_0", "q4_k_s", "q5_k_m", "q6_k", "q8_0"]
SKIP = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__"}
CHUNK_CHARS = 1200          # a text record: consecutive whole lines of one file, ~350 tokens
HELD_OUT_RECORDS = 400      # the validation file (the run's eval and the export's perplexity read its start)


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not SKIP & set(p.relative_to(root).parts))


def held_out(path: Path) -> bool:
    """About one file in ten, by a hash of its path under the standard library (not of its contents)."""
    rel = path.relative_to(sysconfig.get_paths()["stdlib"]).as_posix()
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 10 == 0


def chunks(text: str) -> list[str]:
    out, cur = [], ""
    for line in text.splitlines(keepends=True):
        if cur and len(cur) + len(line) > CHUNK_CHARS:
            out.append(cur)
            cur = ""
        cur += line[:CHUNK_CHARS]
    if cur.strip():
        out.append(cur)
    return [c for c in out if c.strip()]


def write_corpus(folder: Path) -> dict:
    """train.jsonl and val.jsonl of {"text": ...} records (docs/data.md, text format), in file order."""
    folder.mkdir(parents=True, exist_ok=True)
    train, val = [], []
    files = stdlib_files()
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        (val if held_out(path) else train).extend(chunks(text))
    val = val[:HELD_OUT_RECORDS]
    for name, records in (("train.jsonl", train), ("val.jsonl", val)):
        with open(folder / name, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps({"text": r}) + "\n")
    return {"python": sys.version.split()[0], "files": len(files),
            "held_out_files": sum(held_out(p) for p in files), "train_records": len(train),
            "train_chars": sum(map(len, train)), "val_records": len(val)}


def build_model(path: Path, seed: int) -> Path:
    """A random Llama in bfloat16 with the embedded SmolLM2's tokenizer and chat template."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from mudpuppy.backends.models import resolve_model

    if (path / "config.json").is_file():
        return path
    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct").path)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, rope_theta=10000.0, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    tmp.rename(path)
    return path


def run_config(model: Path, corpus: Path, out: Path, seed: int, steps: int) -> str:
    return f"""# written by benchmarks/imatrix_scratch.py
model:
  base_model: {model}
backend: cpu
method: sft
adapter:
  type: none
data:
  datasets:
    - path: {corpus / 'train.jsonl'}
  val_datasets:
    - path: {corpus / 'val.jsonl'}
      num_samples: 64
  sequence_len: 512
  packing: true
  num_proc: 1
training:
  max_steps: {steps}
  micro_batch_size: 8
  learning_rate: 3.0e-3
  lr_scheduler: cosine
  warmup_steps: 20
  weight_decay: 0.01
  precision: auto
  gradient_checkpointing: false
  seed: {seed}
eval:
  batch_size: 16
output_dir: {out}
logging:
  log_every: 10
  progress_bar: false
"""


def train(work: Path, corpus: Path, seed: int, steps: int) -> tuple[Path, dict]:
    run = work / f"run-seed{seed}"
    summary = run / "run_summary.json"
    if not summary.is_file():
        model = build_model(work / f"init-seed{seed}", seed)
        cfg = work / f"run-seed{seed}.yaml"
        cfg.write_text(run_config(model, corpus, run, seed, steps), encoding="utf-8")
        started = time.monotonic()
        subprocess.run([sys.executable, "-m", "mudpuppy", "run", "--config", str(cfg)], check=True, cwd=REPO)
        (work / f"run-seed{seed}.seconds").write_text(f"{time.monotonic() - started:.0f}\n")
    seconds = work / f"run-seed{seed}.seconds"
    info = json.loads(summary.read_text(encoding="utf-8"))
    return run, {"train_seconds": int(seconds.read_text()) if seconds.is_file() else None, "summary": info}


def paired(run: Path, work: Path, eval_tokens: int, draws: int = 2000) -> dict:
    """Whether the matrix's effect is above the noise: Q4_K_M written by `mudpuppy export` without and with
    `--imatrix FILE` (the matrix `measure` collected as --imatrix auto does, in `work`), each dequantized and
    scored per held-out example beside the merged model; the change of log-perplexity over all tokens, with a
    95% bootstrap interval over the examples (the same examples in each draw for every model)."""
    import numpy as np

    from mudpuppy.backends import create_backend
    from mudpuppy.evaluation.metrics import perplexity
    from mudpuppy.export.quality import heldout_for, write_dequantized
    from mudpuppy.export.source import resolve_source

    saved = work / "paired.json"
    if saved.is_file():
        return json.loads(saved.read_text(encoding="utf-8"))
    src = resolve_source(str(run))
    heldout = heldout_for(src, src.load_tokenizer(), None, eval_tokens)
    backend = create_backend("cpu")
    sums = {}
    for label, extra in (("merged", None), ("q4_k_m", []), ("q4_k_m + imatrix", ["--imatrix", str(work / "imatrix.gguf")])):
        model = work / "merged"
        if extra is not None:
            out = work / f"cli-{label.replace(' + ', '-')}"
            if not (out / "model-q4_k_m.gguf").is_file():
                subprocess.run([sys.executable, "-m", "mudpuppy", "export", str(run), "--format", "gguf", "--quant",
                                "q4_k_m", *extra, "--no-eval", "--out", str(out)], check=True, cwd=REPO)
            shutil.rmtree(work / "paired-dequantized", ignore_errors=True)
            model = write_dequantized(out / "model-q4_k_m.gguf", work / "merged", work / "paired-dequantized")
        handle = backend.load_model(src.cfg.model.model_copy(update={"base_model": str(model), "tokenizer": str(model),
                                                                     "revision": None}), "fp32")
        sums[label] = [(m := perplexity(backend, handle, [ex], 1))["nll"] * m["tokens"] for ex in heldout.examples]
        del handle
    tokens = np.array([int(ex.loss_mask[1:].sum()) for ex in heldout.examples])
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(tokens), size=(draws, len(tokens)))
    out = {"examples": len(tokens), "tokens": int(tokens.sum())}
    for a, b in (("q4_k_m", "merged"), ("q4_k_m + imatrix", "merged"), ("q4_k_m + imatrix", "q4_k_m")):
        diff = np.array(sums[a]) - np.array(sums[b])
        boot = diff[picks].sum(1) / tokens[picks].sum(1)
        out[f"{a} vs {b}"] = {"log_ppl_change": float(diff.sum() / tokens.sum()),
                              "interval_95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))]}
    out["load_average"] = [round(x, 2) for x in os.getloadavg()]
    saved.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    return out


def medians(per_seed: list[dict]) -> list[dict]:
    rows = []
    for label in ["merged (float32)"] + TYPES:
        got = [(by[label], by["merged (float32)"]) for by in ({r["type"]: r for r in s["rows"]} for s in per_seed)
               if label in by]
        if not got:
            continue
        row = {"type": label, "seeds": len(got), "bytes": [r["bytes"] for r, _ in got]}
        for key in ("perplexity", "llama_cpp_perplexity"):
            vals = [r[key] for r, _ in got if key in r]
            if vals:
                row[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "each": vals}
        rel = [r["perplexity"] / m["perplexity"] - 1 for r, m in got]
        row["vs_merged"] = {"median": statistics.median(rel), "min": min(rel), "max": max(rel), "each": rel}
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """One line a type: its size, each seed's perplexity (llama.cpp's in parentheses) and the median change
    against each seed's merged model (min to max)."""
    def each(r: dict) -> str:
        theirs = r.get("llama_cpp_perplexity", {}).get("each", [])
        return ", ".join(f"{v:.2f}" + (f" ({theirs[i]:.2f})" if i < len(theirs) else "")
                         for i, v in enumerate(r["perplexity"]["each"]))
    head = ["| type | file size | held-out perplexity per seed (llama.cpp's) | vs merged: median (min to max) |",
            "|---|---|---|---|"]
    return "\n".join(head + [f"| {r['type']} | {statistics.median(r['bytes']) / 1e6:.2f} MB | {each(r)} | "
                             f"{r['vs_merged']['median'] * 100:+.3f}% ({r['vs_merged']['min'] * 100:+.3f} to "
                             f"{r['vs_merged']['max'] * 100:+.3f}) |" for r in rows])


def imatrix_gain(per_seed: dict) -> dict:
    """Per seed, Q4_K_M with the run's matrix against Q4_K_M without (the bytes llama.cpp's quantizer
    writes without one), in each evaluation: the relative change of perplexity (negative: the matrix helps)."""
    out = {}
    for seed, s in per_seed.items():
        rows = {r["type"]: r for r in s["rows"]}
        if "q4_k_m" in rows and "q4_k_m + imatrix" in rows:
            out[seed] = {key: rows["q4_k_m + imatrix"][key] / rows["q4_k_m"][key] - 1
                         for key in ("perplexity", "llama_cpp_perplexity") if key in rows["q4_k_m"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1,2,3", help="comma list of seeds (model init and training)")
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps of 8 packed rows of 512 tokens")
    ap.add_argument("--eval-tokens", type=int, default=16384, help="held-out tokens scored per file")
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--paired", action="store_true", help="also score Q4_K_M without and with the matrix per "
                    "example (files from `mudpuppy export`): the change with a bootstrap interval")
    ap.add_argument("--work", type=Path, help="a folder kept between runs (resumable; default: a temporary one)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / f"imatrix_scratch-{date.today()}.json")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    kinds = [k.strip() for k in args.types.split(",")]
    if unknown := [k for k in kinds if k not in TYPES]:
        raise SystemExit(f"--types {', '.join(unknown)}: types are {', '.join(TYPES)}")
    started = time.monotonic()
    work = (args.work or Path(tempfile.mkdtemp(prefix="imatrix-scratch-"))).resolve()
    corpus = work / "corpus"
    corpus_info = write_corpus(corpus) if not (corpus / "val.jsonl").is_file() else \
        json.loads((work / "corpus.json").read_text(encoding="utf-8"))
    (work / "corpus.json").write_text(json.dumps(corpus_info, indent=2) + "\n", encoding="utf-8")
    print(f"corpus: {corpus_info}", flush=True)
    result = {"corpus": corpus_info, "steps": args.steps, "eval_tokens": args.eval_tokens, "seeds": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        run, info = train(work, corpus, seed, args.steps)
        measured = export_quality.measure(run, work / f"measure-seed{seed}", args.eval_tokens, 0, kinds,
                                          work / f"measure-seed{seed}.json")
        if args.paired:
            measured["paired"] = paired(run, work / f"measure-seed{seed}", args.eval_tokens)
            print(f"paired: {measured['paired']}", flush=True)
        result["seeds"][str(seed)] = {**info, **measured}
        result["medians"] = medians(list(result["seeds"].values()))
        result["imatrix_gain"] = imatrix_gain(result["seeds"])
        result.update(date=str(date.today()), machine=export_quality.machine(),
                      load_average=[round(x, 2) for x in os.getloadavg()], seconds=round(time.monotonic() - started),
                      command="python benchmarks/imatrix_scratch.py " + " ".join(sys.argv[1:]))
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(export_quality.table(measured), flush=True)
    print(table(result["medians"]))
    for seed, gain in result["imatrix_gain"].items():
        print(f"seed {seed}: q4_k_m + imatrix against q4_k_m: "
              + ", ".join(f"{k} {v * 100:+.2f}%" for k, v in gain.items()))
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
