"""One token store per machine, shared by every rank of a distributed run.

Under `--nproc N` every rank trains on the same tokenized data, so tokenizing
it N times would cost N times the time and N copies of the memory. Instead:

    local rank 0 of each machine   reads the cache entry, or tokenizes into a store (data.num_proc workers)
    the other ranks                wait in a collective (which carries local rank 0's answer or its error)
    every rank                     maps the same files; the pages of a memory map are the page cache's,
                                   so the machine holds one copy of the tokens, not N
    once every rank has mapped     an uncached store's names go from <cache_dir>/.scratch (a second
                                   collective: no rank removes a file another has yet to open)

Ranks are numbered machine by machine (torchrun's and mlx.launch's layout),
so the local rank 0 of rank r is r - local_rank. The second collective also
gathers how many stores each rank tokenized: the report's `tokenized_by` is
measured, not assumed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from ..errors import MudpuppyError
from . import cache, claims, pipeline
from .prepared import DataReport, PreparedData


def prepare_shared(ranks, prepare_here: Callable[[], tuple[PreparedData, Path, bool]]) -> PreparedData:
    """`prepare_here()` -> (prepared, the folder holding its store, whether that folder is scratch), run on
    local rank 0; every other rank of the machine maps the same folder."""
    built_before = pipeline.BUILT[0]
    leader = ranks.rank - ranks.local_rank
    prepared, scratch, raised, outcome = None, None, None, None
    if ranks.local_rank == 0:
        try:
            prepared, folder, is_scratch = prepare_here()
            scratch = folder if is_scratch else None
            outcome = ("ok", str(folder), asdict(prepared.report))
        except MudpuppyError as exc:
            raised, outcome = exc, ("error", str(exc), exc.exit_code)
    outcomes = ranks.gather(outcome)
    try:
        _raise_first_error(outcomes, raised)
        if prepared is None:
            prepared = open_shared(Path(outcomes[leader][1]), outcomes[leader][2])
        built = ranks.gather(pipeline.BUILT[0] - built_before)      # every rank has mapped the store by now
    finally:
        if scratch is not None:
            claims.release(scratch)
    prepared.report.tokenized_by = [r for r, n in enumerate(built) if n]
    prepared.report.mapped_by = ranks.world
    return prepared


def _raise_first_error(outcomes: list, raised: MudpuppyError | None) -> None:
    """A user error on one machine's local rank 0 stops every rank with its message (as `Ranks.on_main`)."""
    if raised is not None:
        raise raised
    for outcome in outcomes:
        if outcome is not None and outcome[0] == "error":
            error = MudpuppyError(outcome[1])
            error.exit_code = outcome[2]
            raise error


def open_shared(folder: Path, report: dict) -> PreparedData:
    """The store local rank 0 wrote or verified, mapped by another rank; checked for size, not re-hashed
    (local rank 0 checked the checksums of a reused entry, and wrote a fresh one moments ago)."""
    meta = json.loads((folder / "meta.json").read_text())
    train, val, val_records, _, _ = cache.read_store_entry(folder, meta, verify=False)
    return PreparedData(train, val, val_records, DataReport(**report))


def describe_sharing(report: DataReport) -> str | None:
    """One line naming which ranks tokenized and how many map the store; None outside a distributed run."""
    if not report.mapped_by:
        return None
    who = ", ".join(f"rank {r}" for r in report.tokenized_by) or "no rank (the cache entry was reused)"
    return f"token store: tokenized by {who}; mapped by {report.mapped_by} ranks"
