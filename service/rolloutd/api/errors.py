"""Domain errors -> gRPC status codes: the one table."""

from __future__ import annotations

import grpc

from rolloutd.domain import errors

STATUS: dict[type[errors.RolloutError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
}


def status_of(exc: errors.RolloutError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]  # type: ignore[index]
    raise KeyError(f"no gRPC status for {type(exc).__name__}")
