"""kernelkite: an async client for kernelkite-service, and (in `kernelkite.kernelbot_launcher`,
the one module that imports kernelbot) a launcher that runs kernelbot submissions through it."""

from kernelkite.client import (
    STATES,
    TERMINAL_STATES,
    Conflict,
    Invalid,
    KernelkiteClient,
    KernelkiteError,
    NotFound,
    ServerError,
    ServiceError,
    StateEvent,
    Unauthorized,
    Unreachable,
    valid_queue_name,
)

__all__ = [
    "STATES",
    "TERMINAL_STATES",
    "Conflict",
    "Invalid",
    "KernelkiteClient",
    "KernelkiteError",
    "NotFound",
    "ServerError",
    "ServiceError",
    "StateEvent",
    "Unauthorized",
    "Unreachable",
    "valid_queue_name",
]
