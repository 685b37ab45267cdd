"""A run's folder: claimed before any model loads, taken once the model and data have loaded, and what
`--overwrite` may never replace.

claim_output_dir locks the folder (rundir.py) and decides: a new run, a resume from its newest checkpoint,
or a replacement; nothing is removed then. take_output_dir, once the model and data have loaded, removes
the replaced run's files (only those its marker lists) and writes the config copy: a typo in the model
name or a bad data file fails before and costs nothing. A folder that is neither empty, new nor marked
is never written into, and `--overwrite` never replaces the current or home directory, one above them,
or a folder holding what the run reads (check_overwrite_target).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..errors import MudpuppyError, OutputExists
from . import rundir
from .rundir import CONFIG, SUMMARY


@dataclass
class Claim:
    """An output directory this process holds the lock of, and what the run will do there."""

    out: Path
    resume_from: Path | None = None      # the checkpoint to resume from
    replacing: bool = False              # --overwrite: the old run goes in take_output_dir, not before


def claim_output_dir(cfg, overwrite: bool, ranks) -> Claim:
    """Lock the run's directory and decide what happens to it, before any model loads; nothing is removed
    here. In a distributed run rank 0 decides (and holds the lock) and every rank gets its answer, or its
    error, so no two processes clear or write the same directory."""
    from ..monitor.trackers import check_available

    check_available(list(cfg.logging.report_to))          # a missing tracker stops the run before it starts
    return ranks.on_main(lambda: claim_dir(cfg.output_dir, overwrite, cfg.resume, cfg))


def take_output_dir(cfg, claim: Claim, echo=print, *, ranks) -> Path:
    """Once the model and data have loaded: the run replaced by --overwrite goes (only what it wrote), then
    the config copy. A typo in the model name, a bad data file, fail before this and cost nothing."""
    ranks.on_main(lambda: _take(cfg, claim, echo))
    return claim.out


def start_output_dir(cfg, overwrite: bool, echo=print, *, ranks) -> tuple[Path, Path | None]:
    """claim_output_dir and take_output_dir at once: for a method that has loaded its model and data already."""
    claim = claim_output_dir(cfg, overwrite, ranks)
    take_output_dir(cfg, claim, echo, ranks=ranks)
    return claim.out, claim.resume_from


def claim_dir(path: str | Path, overwrite: bool, resume: bool | str = False, cfg=None) -> Claim:
    """The decisions of claim_output_dir, in this process.

    A directory is written to only when it is empty, new, or marked as a mudpuppy run (rundir.MARKER); a
    run from before markers may be resumed (it is adopted), never replaced. The lock is taken before
    anything that could remove a file is decided, and the state is read again under it.
    """
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise OutputExists(f"output_dir {out} is a file, not a directory")
    if overwrite:
        check_overwrite_target(out, cfg)
    _refuse_foreign(out, overwrite)
    if resume is True and not overwrite and not out.is_dir():
        raise OutputExists(f"--resume: no complete checkpoint in {out}/checkpoints ({out} does not exist)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputExists(f"output_dir {out}: cannot create it ({exc.strerror})") from None
    rundir.start_run(out)
    try:
        claim = _decide(out, overwrite, resume)
    except MudpuppyError:
        rundir.end_run(out)
        raise
    if rundir.read_marker(out) is None:       # a new run, or one from before markers resumed: adopted for the
        ours, theirs = rundir.adopt(out)      # run layout's names alone (the user's notes are never claimed)
        rundir.write_marker(out, written=ours, foreign=theirs)
    return claim


def _refuse_foreign(out: Path, overwrite: bool) -> None:
    """A non-empty directory without the marker: nothing mudpuppy may write into (or clear)."""
    if not rundir.entries(out) or rundir.read_marker(out) is not None:
        return
    if rundir.looks_like_old_run(out):
        if overwrite:
            raise OutputExists(
                f"--overwrite: output_dir {out} holds a run made before mudpuppy marked its runs (no "
                f"{rundir.MARKER}), so mudpuppy cannot tell the run's files from yours and will not replace it; "
                f"delete it yourself (rm -r {out}) if you no longer need it, or choose another output_dir")
        return                   # --resume adopts it; without either flag _decide says what to do
    refusing = "refusing to clear it even with --overwrite; " if overwrite else ""
    raise OutputExists(f"output_dir {out} is not empty and does not look like a mudpuppy run (no {rundir.MARKER}); "
                       f"{refusing}choose another output_dir (e.g. --set output_dir=...)")


def _decide(out: Path, overwrite: bool, resume: bool | str) -> Claim:
    from ..training.checkpoints import newest_checkpoint, remove_stale_staging

    finished = (out / SUMMARY).exists()
    if resume and not overwrite:
        ckpt = newest_checkpoint(out)
        if finished:
            raise OutputExists(f"output_dir {out} holds a finished run; nothing to resume "
                               "(pass --overwrite to train again from scratch)")
        if ckpt is not None:
            remove_stale_staging(out)
            return Claim(out, ckpt)
        if resume is True:
            raise OutputExists(f"--resume: no complete checkpoint in {out}/checkpoints "
                               "(set training.save_steps to write them)")
    ours, foreign = rundir.split_entries(out, rundir.read_marker(out))
    if ours and not overwrite:
        what = "a finished run" if finished else "files"
        hint = "" if finished else ", --resume to continue from its newest checkpoint,"
        raise OutputExists(
            f"output_dir {out} already holds {what}; choose another output_dir "
            f"(e.g. --set output_dir=...){hint} or pass --overwrite to replace it")
    return Claim(out, replacing=bool(ours or foreign))


def _take(cfg, claim: Claim, echo) -> None:
    out = claim.out
    if claim.replacing:
        ours, kept = rundir.split_entries(out, rundir.read_marker(out))
        stayed = rundir.remove_entries(out, ours)
        if ours:
            echo(f"--overwrite: removed the previous run from {out} ({_names(ours)})")
        if stayed:
            echo(f"--overwrite: kept what the previous run's outputs held that it did not write: {_names(stayed)}")
            kept = sorted(set(kept) | {name.split('/')[0] for name in stayed})
        if kept:
            echo(f"--overwrite: kept {len(kept)} entr{'y' if len(kept) == 1 else 'ies'} the previous run did "
                 f"not write: {_names(kept)}")
        rundir.write_marker(out, foreign=kept)
    write_config(out, cfg)


def _names(names: list[str], shown: int = 8) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def write_config(out: Path, cfg) -> None:
    rundir.record(out, [CONFIG])
    # source_dir first: the run's relative paths resolve against the folder its config came from when
    # this copy is loaded again (export --imatrix auto, held-out scoring, eval), not against `out`
    where = {"source_dir": cfg.source_dir} if getattr(cfg, "source_dir", None) else {}
    (out / CONFIG).write_text(yaml.safe_dump({**where, **cfg.dump()}, sort_keys=False), encoding="utf-8")


# --------------------------------------------------------------------------- what --overwrite refuses
def check_overwrite_target(out: Path, cfg=None, inside=()) -> None:
    """Refuse to replace a directory whose loss no marker could excuse: the cwd or one above it, the home
    directory or one above it, and any directory holding a file the run reads (its config, data, reward
    functions, the model or adapter it starts from), files under the folders `inside` aside (a
    curriculum's stages, which start from each other and replace only themselves)."""
    target = _real(out)
    cwd, home = _real(Path.cwd()), _real(Path.home())
    why = None
    if target == Path(target.anchor):
        why = "the filesystem root"
    elif _within(cwd, target):
        why = "the current directory" if cwd == target else f"a directory above the current one ({cwd})"
    elif _within(home, target):
        why = "the home directory" if home == target else f"a directory above the home directory ({home})"
    elif cfg is not None:
        skip = [_real(p) for p in inside]
        used = next((f"{what}: {p}" for what, p in _files_in_use(cfg)
                     if _within(_real(p), target) and not any(_within(_real(p), s) for s in skip)), None)
        if used:
            why = f"a directory holding what this run reads ({used})"
    if why:
        raise OutputExists(f"--overwrite: output_dir {out} is {why}; mudpuppy never replaces such a directory. "
                           "Give the run a directory of its own (e.g. --set output_dir=outputs/my-run)")


def _files_in_use(cfg) -> list[tuple[str, Path]]:
    used = []
    if getattr(cfg, "source_dir", None):
        used.append(("the config file's folder", Path(cfg.source_dir)))
    for section in ("datasets", "val_datasets"):
        for i, spec in enumerate(getattr(cfg.data, section)):
            used.append((f"data.{section}.{i}.path", cfg.resolve_path(spec.path)))
    for i, spec in enumerate(_reward_specs(cfg)):
        if spec.kind in ("file", "reward_model"):
            used.append((f"grpo.reward_funcs.{i}", cfg.resolve_path(spec.target)))
    used.append(("model.base_model", Path(os.path.expanduser(cfg.model.base_model))))
    if cfg.adapter.init_from:
        used.append(("adapter.init_from", cfg.resolve_path(cfg.adapter.init_from)))
    return [(what, p) for what, p in used if p.exists()]


def _reward_specs(cfg) -> list:
    if getattr(cfg, "rollout", None) is None:
        return []
    from ..rewards import parse_reward_specs

    return parse_reward_specs(cfg.rollout.reward_funcs, cfg.rollout.reward_weights)


def _real(path: Path) -> Path:
    return Path(os.path.realpath(os.path.expanduser(path)))


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


