"""What each GGUF quantization of the quickstart run costs: file size, held-out perplexity, greedy answers.

    .venv/bin/python benchmarks/export_quality.py                       # trains the quickstart first
    .venv/bin/python benchmarks/export_quality.py --run outputs/quickstart --prompts 32

The quickstart run (configs/quickstart.yaml: LoRA on SmolLM2-135M-Instruct) is merged once in float32 and
written as GGUF at f16, q8_0, q4_0, q4_k_m without and with an importance matrix from the run's own
training data (`--imatrix auto`'s collection, export/calibrate.py), q5_k_m and q6_k, by the writer
`mudpuppy export` uses. Each file is measured as the export's report measures it (export/quality.py):
dequantized by gguf-py, loaded through the backend in float32, scored on the run's held-out set (all of
it by default) and asked the held-out prompts greedily; its answers are compared with the merged model's.
Where llama_cpp imports, each file's perplexity through llama.cpp is added. Prints a markdown table and
writes the JSON to benchmarks/results/export_quality-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TYPES = [("q4_k_m", "q4_k_m", False), ("q4_k_m + imatrix", "q4_k_m", True), ("q4_0", "q4_0", False),
         ("q4_k_s", "q4_k_s", False), ("q5_k_m", "q5_k_m", False), ("q6_k", "q6_k", False), ("q8_0", "q8_0", False), ("f16", "f16", False),
         ("q3_k_s", "q3_k_s", False), ("q3_k_m", "q3_k_m", False), ("q3_k_l", "q3_k_l", False), ("q2_k", "q2_k", False),
         ("q5_k_s", "q5_k_s", False)]


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        return f"{fields.get('Model name', '?').strip()}, {fields.get('CPU(s)', '?').strip()} CPUs"
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or platform.machine()


def train_quickstart(out: Path) -> Path:
    """`mudpuppy run` of configs/quickstart.yaml into `out` (as `make demo` runs it)."""
    subprocess.run([sys.executable, "-m", "mudpuppy", "run", "--config", str(REPO / "configs" / "quickstart.yaml"),
                    "--set", f"output_dir={out}"], check=True, cwd=REPO)
    return out


def measure(run: Path, work: Path, eval_tokens: int, prompts: int, kinds: list[str], out: Path) -> dict:
    """The table's rows, `out` rewritten after each one. Resumable: a `work` folder keeps the merged model
    and the importance matrix, and rows already in `out` (same run, data and prompts) are not measured again."""
    from mudpuppy.backends import create_backend
    from mudpuppy.evaluation.heldout import normalize_answer
    from mudpuppy.export.calibrate import collect_from_run
    from mudpuppy.export.gguf import model_name, write_gguf
    from mudpuppy.export.imatrix import read_imatrix
    from mudpuppy.export.pipeline import end_of_turn_id, preflight
    from mudpuppy.export.quality import heldout_for, llama_cpp_perplexity, score, write_dequantized
    from mudpuppy.export.source import resolve_source

    src = resolve_source(str(run))
    tokenizer = src.load_tokenizer()
    layout = preflight(src, "gguf", "f16", tokenizer)
    heldout = heldout_for(src, tokenizer, None, eval_tokens)
    if isinstance(heldout, str):
        raise SystemExit(f"export_quality: {heldout}")
    asked = heldout.records[:prompts]
    result = {"run": str(run), "data": heldout.name, "examples": len(heldout.examples), "tokens": heldout.tokens,
              "prompts": len(asked), "max_new_tokens": src.cfg.eval.max_new_tokens, "rows": []}
    if out.is_file():
        earlier = json.loads(out.read_text(encoding="utf-8"))
        if all(earlier.get(k) == result[k] for k in ("run", "data", "tokens", "prompts")):
            result = earlier
    backend = create_backend("cpu")
    batch, new_tokens = src.cfg.eval.batch_size, src.cfg.eval.max_new_tokens
    merged_dir = work / "merged"
    if not (merged_dir / "config.json").is_file():
        started = time.monotonic()
        src.merge_into(backend, merged_dir, "float32")
        print(f"merged in float32 ({time.monotonic() - started:.0f} s)", flush=True)
    references = [normalize_answer(r["messages"][-1]["content"]) for r in asked]

    def hits(answers: list[str]) -> int:          # the quickstart's exact match: whitespace and case folded
        return sum(normalize_answer(a) == r for a, r in zip(answers, references))

    def save(row: dict) -> None:
        result["rows"] = [r for r in result["rows"] if r["type"] != row["type"]] + [row]
        out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")

    done = {r["type"]: r for r in result["rows"]}
    if "merged (float32)" not in done:
        merged = score(backend, src.cfg.model, merged_dir, heldout, batch, asked, new_tokens)
        save({"type": "merged (float32)", "perplexity": merged["perplexity"], "scored_tokens": merged["tokens"],
              "bytes": sum(f.stat().st_size for f in merged_dir.glob("*.safetensors")), "answers": merged.get("answers", []),
              "same_answers": len(asked), "exact_match": hits(merged.get("answers", []))})
        print(f"merged: perplexity {merged['perplexity']:.4f}", flush=True)
    merged_answers = next(r for r in result["rows"] if r["type"] == "merged (float32)")["answers"]
    imatrix = None
    if any(with_matrix and label not in done for label, _, with_matrix in TYPES if label in kinds):
        if (work / "imatrix.gguf").is_file():
            imatrix = read_imatrix(work / "imatrix.gguf").weights          # as --imatrix FILE reads it
        else:
            started = time.monotonic()
            imatrix = collect_from_run(src, tokenizer, merged_dir, backend, work / "imatrix.gguf", print)
            result["imatrix_seconds"] = round(time.monotonic() - started, 1)
            result["imatrix_load_average"] = [round(x, 2) for x in os.getloadavg()]
            print(f"importance matrix collected ({result['imatrix_seconds']:.0f} s, load {result['imatrix_load_average']})",
                  flush=True)
    name = model_name(src.base, src.finetune, src.name)
    for label in kinds:
        quant, with_matrix = next((q, m) for lab, q, m in TYPES if lab == label)
        if label in done:
            continue
        path = work / f"model-{label.replace(' + ', '-')}.gguf"
        started = time.monotonic()
        written = write_gguf(merged_dir, tokenizer, tokenizer.chat_template, quant, path, name,
                             end_of_turn_id(tokenizer, layout), None, imatrix if with_matrix else None)
        seconds = time.monotonic() - started
        theirs = llama_cpp_perplexity(path, heldout)
        target = write_dequantized(path, merged_dir, work / "dequantized")
        got = score(backend, src.cfg.model, target, heldout, batch, asked, new_tokens)
        row = {"type": label, "quant": quant, "imatrix": with_matrix, "bytes": written["bytes"],
               "tensor_types": written["tensor_types"], "write_seconds": round(seconds, 1),
               "perplexity": got["perplexity"], "answers": got.get("answers", []),
               "same_answers": sum(a == b for a, b in zip(got.get("answers", []), merged_answers)),
               "exact_match": hits(got.get("answers", [])), "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "load_average": [round(x, 2) for x in os.getloadavg()]}
        if theirs is not None:
            row["llama_cpp_perplexity"] = theirs["perplexity"]
        save(row)
        print(f"{label}: {written['bytes'] / 1e6:.1f} MB, perplexity {got['perplexity']:.4f}"
              + (f" (llama.cpp {theirs['perplexity']:.4f})" if theirs else "")
              + f", {row['same_answers']}/{len(asked)} answers as merged ({seconds:.0f} s to write)", flush=True)
        shutil.rmtree(target)
        path.unlink()
    return result


def table(result: dict) -> str:
    lines = ["| type | file size | held-out perplexity | vs merged | through llama.cpp | greedy answers equal to the "
             "merged model's | exact match |", "|---|---|---|---|---|---|---|"]
    base = result["rows"][0]["perplexity"]
    n = result["prompts"]
    for row in result["rows"]:
        theirs = f"{row['llama_cpp_perplexity']:.4f}" if "llama_cpp_perplexity" in row else "-"
        lines.append(f"| {row['type']} | {row['bytes'] / 1e6:.1f} MB | {row['perplexity']:.4f} | "
                     f"{(row['perplexity'] / base - 1) * 100:+.2f}% | {theirs} | {row['same_answers']} / {n} | "
                     f"{row['exact_match']} / {n} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, help="a finished quickstart run (default: train one into a temporary folder)")
    ap.add_argument("--eval-tokens", type=int, default=10**7, help="held-out tokens scored (default: all of them)")
    ap.add_argument("--prompts", type=int, default=10**6, help="held-out prompts answered (default: all of them)")
    ap.add_argument("--types", default=",".join(label for label, _, _ in TYPES),
                    help="comma list of the types to write (default: all)")
    ap.add_argument("--work", type=Path, help="a folder kept between runs (merged model, importance matrix): "
                    "run again to resume (default: a temporary folder)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / f"export_quality-{date.today()}.json")
    args = ap.parse_args()
    kinds = [k.strip() for k in args.types.split(",")]
    unknown = [k for k in kinds if k not in [label for label, _, _ in TYPES]]
    if unknown:
        raise SystemExit(f"--types {', '.join(unknown)}: types are {', '.join(label for label, _, _ in TYPES)}")
    started = time.monotonic()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="export-quality-"))
    work.mkdir(parents=True, exist_ok=True)
    run = args.run or train_quickstart(work / "quickstart")
    result = measure(run.resolve(), work, args.eval_tokens, args.prompts, kinds, args.out)
    result.update(date=str(date.today()), machine=machine(), load_average=list(os.getloadavg()),
                  seconds=round(time.monotonic() - started), command="python benchmarks/export_quality.py "
                  + " ".join(sys.argv[1:]), measured_by="mudpuppy's dequantized evaluation (gguf-py dequantize, "
                  "torch fp32 through the backend); llama_cpp_perplexity: llama-cpp-python's evaluation of the file")
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if args.work is None:
        shutil.rmtree(work)
    print(table(result))
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
