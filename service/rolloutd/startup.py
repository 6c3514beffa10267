"""Start-up failures a user causes, told in one line: the cause, then what to do about it.

``rolloutd serve`` catches exactly the types in ``START_FAILURES``, prints ``rolloutd: <line>`` and
exits 1; the traceback goes to the debug log. Anything else is a bug and keeps its traceback. The
engine's own ``EngineStartError`` already is one such line; the others get their hint here, where
the configuration is known, so each raising module keeps a message about its own concern.
"""

from __future__ import annotations

import os
from pathlib import Path

from rolloutd.api.startup_errors import PortUnavailable
from rolloutd.checkpoint.claim import StoreHeld
from rolloutd.checkpoint.journal import CorruptJournal
from rolloutd.checkpoint.reader import SnapshotNotFound
from rolloutd.checkpoint.restore import RestoreRefused
from rolloutd.config import Config
from rolloutd.dataset import DatasetError
from rolloutd.domain.engine import EngineStartError

START_FAILURES: tuple[type[BaseException], ...] = (
    EngineStartError,
    PortUnavailable,
    RestoreRefused,
    SnapshotNotFound,
    DatasetError,
    OSError,
)


def describe(exc: BaseException, config: Config) -> str:
    """The one line for a failure in ``START_FAILURES``."""
    if isinstance(
        exc, EngineStartError | PortUnavailable | RestoreRefused | StoreHeld | CorruptJournal
    ):
        return str(exc)
    if isinstance(exc, SnapshotNotFound):
        return (
            f"{exc.args[0]}; `rolloutd checkpoints list --dir {config.checkpoint.dir}` shows "
            "what there is: pass --restore one of those, latest, or none to start afresh"
        )
    if isinstance(exc, DatasetError):
        return (
            f"{exc}; pass --dataset (dataset.path) a JSONL or Parquet file with a prompt or "
            "messages per row, or leave it unset for the bundled prompts"
        )
    assert isinstance(exc, OSError)
    where = f"{exc.filename}: " if exc.filename else ""
    cause = f"{where}{exc.strerror or exc}"
    if exc.filename and _under(str(exc.filename), config.checkpoint.dir):
        return (
            f"checkpoint.dir {config.checkpoint.dir}: {cause}; pass --checkpoint-dir a "
            "directory this user can create and write (or an s3:// URL)"
        )
    return f"{cause}; check that the path exists and that this user may use it"


def _under(path: str, directory: str) -> bool:
    if "://" in directory:
        return path.startswith(directory.split("://", 1)[1].rstrip("/"))
    resolved = Path(directory).resolve()
    return os.path.commonpath([Path(path).resolve(), resolved]) == str(resolved)
