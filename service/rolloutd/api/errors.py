"""Domain and engine errors -> gRPC status codes: the one table.

Every error a request can meet has a status; a test checks that no subclass is left out.
"""

from __future__ import annotations

import grpc

from rolloutd.domain import errors
from rolloutd.domain.engine import EngineDeadError, EngineError

STATUS: dict[type[Exception], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    # The engine refused the request and lives on: e.g. UpdateWeights with a path that holds no
    # weights. What was asked cannot be done as given.
    EngineError: grpc.StatusCode.INVALID_ARGUMENT,
    # The engine cannot serve any more requests; the service stops and is restarted.
    EngineDeadError: grpc.StatusCode.UNAVAILABLE,
}

MAPPED: tuple[type[Exception], ...] = tuple(STATUS)
"""What the servicer turns into a status; anything else is a bug and reaches gRPC as UNKNOWN."""


def status_of(exc: Exception) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    raise KeyError(f"no gRPC status for {type(exc).__name__}")
