"""The output contract: where every verb that writes puts its output, and what it may delete.

`run` (and every training method), `merge`, `export`, `eval --out` and `convert-adapter` keep the same
rules, all of them kept in this package:

1. Nothing of the user's is claimed. Every output has a marker listing what mudpuppy wrote there,
   recorded as it writes it, never by listing the folder: a verb's record file (records.py), a run
   folder's `.mudpuppy-run.json` (rundir.py).
2. `--overwrite` removes only those names; a folder without a marker is never written into, and some
   folders (the current or home directory, one holding what a run reads) never replaced (claim.py).
3. One writer at a time: a flock'ed lock file names its holder to the process it stops (locks.py).
4. Built beside, renamed into place: a verb's output, and a run's final save, is written in a hidden
   staging folder and renamed in once complete, so a failure or a kill leaves the target as it was
   (staging.py). A run folder, written as the run goes, is claimed before its model loads and taken
   once it has (claim.py).

    locks.py     acquire_lock / release_lock: the lock files and who holds them
    records.py   what each kind of output writes (Kind: EXPORT, EVAL, ADAPTER) and its record
    staging.py   writing(): an output built beside its target and published
    rundir.py    the run folder's marker and lock, what a run writes there (record), its final save
    claim.py     claim_output_dir / take_output_dir: start a run folder; what --overwrite refuses
"""

from .claim import Claim, check_overwrite_target, claim_dir, claim_output_dir, start_output_dir, take_output_dir
from .locks import OutputInUse, acquire_lock, release_lock
from .records import ADAPTER, EVAL, EXPORT, Kind, write_record
from .staging import Writing, writing

__all__ = ["ADAPTER", "EVAL", "EXPORT", "Claim", "Kind", "OutputInUse", "Writing", "acquire_lock",
           "check_overwrite_target", "claim_dir", "claim_output_dir", "release_lock", "start_output_dir",
           "take_output_dir", "write_record", "writing"]
