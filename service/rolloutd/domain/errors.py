"""Domain errors. The API maps each class to one gRPC status code in one table."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class RolloutError(Exception):
    """Base class of errors a caller can act on."""


class InvalidArgument(RolloutError):
    """A request field is out of range or malformed; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class NotFound(RolloutError):
    """The named lease, snapshot or group does not exist."""


class ResourceExhausted(RolloutError):
    """Backpressure: the request would exceed a configured limit; retry later."""


class Unavailable(RolloutError):
    """The service is restoring, draining or not ready; retry later or elsewhere."""


class FailedPrecondition(RolloutError):
    """The request conflicts with the service's state (e.g. a rewind past the window)."""


def public_cause(exc: BaseException) -> str:
    """An error as a client may be told it: an ``OSError`` without the file it names (a path on
    the server is not the client's business, and tells an attacker the layout), anything else
    as it reads. The whole error goes to the service's log."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


def not_durable(what: str, exc: OSError) -> Unavailable:
    """The journal could not make ``what`` durable: the client hears that and why (without a
    server path), the log also where."""
    log.warning("%s could not be made durable: %s", what, exc)
    return Unavailable(f"{what} could not be made durable: {public_cause(exc)}")


class DeadlineExceeded(RolloutError):
    """Work the request started took longer than its configured bound and was abandoned."""


class InvariantError(RuntimeError):
    """An internal invariant does not hold. Never caught: it must fail loudly."""


class RestoreRefused(RuntimeError):
    """A snapshot cannot be restored as asked (start-up only, never an RPC); the message says
    why and what differs."""
