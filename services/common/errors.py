"""Errors that services raise to answer a request with a specific gRPC status.

The server bootstrap's interceptor (`kuberl.common.server`) turns a `ServiceError` into its
status code and message, `ValueError` / pydantic validation errors into INVALID_ARGUMENT, and
anything else into INTERNAL, counting each in `kuberl_<service>_rpc_errors_total`. Service code
raises; it never builds a status by hand.
"""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    """An expected failure with the gRPC status a caller should see."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, retry_after_seconds: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_seconds = retry_after_seconds


class InvalidArgument(ServiceError):
    """The request is malformed (NaN reward, wrong array length, unknown verifier)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ServiceError):
    """The thing was created before (e.g. a second group for one prompt and epoch)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(ServiceError):
    """The request conflicts with the current state (e.g. a policy version going backwards)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class PermissionDenied(ServiceError):
    """The caller's role may not call this method (kuberl.common.roles)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(ServiceError):
    """Backpressure: try again after `retry_after_seconds`."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    """Not ready yet, or a dependency is down; retrying later may succeed."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
