"""How a start ends, told in one line: the ``ready`` line, or a failure a user caused.

A start that succeeds ends with :func:`ready_line`: where to connect, where the dashboard is,
and what the service started from (a snapshot, the journal alone, or nothing), with the flag
that starts fresh. Start-up failures a user causes are one line too: the cause, then what to do
about it.

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
from rolloutd.domain.report import RestoreReport

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", ""})
"""Bind addresses that accept connections on every interface: shown as ``localhost``."""

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


def ready_line(
    grpc: str,
    http: str | None,
    checkpoint_dir: str,
    restored: RestoreReport | None,
    *,
    not_ready: str = "",
    https: bool = False,
) -> str:
    """The last line of a start: ``restored`` is None after ``--restore none``.

    Scripts find the addresses by ``gRPC <host:port>,`` and ``dashboard http://<host:port>/``
    (``https://`` with ``https``, the admin port's TLS, or ``dashboard off``); a wildcard bind
    address is shown as ``localhost``."""
    dashboard = "dashboard off (http.enabled is false)"
    if http is not None:
        dashboard = f"dashboard {'https' if https else 'http'}://{_reachable(http)}/"
    head = "ready" if not not_ready else f"started but {not_ready}"
    return (
        f"{head}: gRPC {_reachable(grpc)}, {dashboard}; {_started_from(checkpoint_dir, restored)}"
    )


def _started_from(checkpoint_dir: str, restored: RestoreReport | None) -> str:
    if restored is None:
        return "started fresh (--restore none)"
    if restored.sequence is not None:
        tag = f" (tag {restored.tag})" if restored.tag else ""
        skipped = f", {len(restored.skipped)} newer skipped" if restored.skipped else ""
        return (
            f"restored snapshot {restored.sequence}{tag} from {checkpoint_dir}{skipped}; "
            "--restore none starts fresh"
        )
    if restored.skipped:
        return (
            f"started fresh: no snapshot in {checkpoint_dir} verifies "
            f"({len(restored.skipped)} skipped, see above)"
        )
    if restored.replayed:
        return (
            f"no snapshot in {checkpoint_dir} yet; replayed {restored.replayed} journal records "
            "(acks, leases, submitted prompts); --restore none starts fresh"
        )
    return (
        f"started fresh: no snapshot in {checkpoint_dir} yet "
        "(a restart restores the latest; --restore none starts fresh)"
    )


def _reachable(address: str) -> str:
    host, _, port = address.rpartition(":")
    return f"localhost:{port}" if host in WILDCARD_HOSTS else address
