"""A curriculum from Python: the same stages as configs/curriculum.yaml, with the backend of each stage
chosen in code, and each stage's run reachable on its own.

    python examples/curriculum.py                 # torch for every stage
    python examples/curriculum.py --last-on mlx   # switch the last stage to MLX

Two ways to drive it: `run_curriculum` does everything configs/curriculum.yaml
does (skipping finished stages, resuming an interrupted one); the loop at the
bottom shows the same thing stage by stage with `run` and `create_backend`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mudpuppy import create_backend, load_curriculum, run, run_curriculum

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "curriculum.yaml"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--last-on", default="cpu", help="backend of the last stage (cpu, cuda, rocm, mlx)")
    parser.add_argument("--output-dir", default="outputs/curriculum-example")
    parser.add_argument("--steps", type=int, default=3, help="steps per stage (small: this is a demonstration)")
    parser.add_argument("--by-hand", action="store_true", help="run the stages one by one with run()")
    args = parser.parse_args()
    overrides = [f"output_dir={args.output_dir}", f"training.max_steps={args.steps}", "backend=cpu",
                 f"stages.2.backend={args.last_on}", f"stages.2.training.max_steps={args.steps}",
                 "logging.progress_bar=false"]
    cur = load_curriculum(CONFIG, overrides)
    if not args.by_hand:
        result = run_curriculum(cur)
        print(f"report: {result.output_dir / 'curriculum.md'}")
        return
    # The same, by hand: each stage is an ordinary run whose config already starts from the stage before.
    for stage in cur.stages:
        backend = create_backend(stage.cfg.backend, **stage.cfg.backend_options())
        result = run(stage.cfg, backend, overwrite=True)
        print(f"{stage.label} on {backend.name}: held-out {result.after.describe() if result.after else '-'}")


if __name__ == "__main__":
    main()
