"""Why a KV transfer failed, as a machine code with a human message beside it.

Every failure is a `TransferError` carrying `code` (one of `CODES`). Codes cross the KV wire as codes (the
`error` frame's `code` field, the message in `error`), and the receiving side rebuilds the exception with
`from_code`: nothing matches message text.
"""

from __future__ import annotations

from typing import Protocol, Sequence, TypeVar


class TransferError(RuntimeError):
    """A KV transfer failed: rejected, timed out, peer lost, or bytes corrupted."""

    code = "failed"

    def __init__(self, message: str = "", code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class ChecksumError(TransferError):
    """The bytes that landed differ from the bytes the sender read."""

    code = "checksum"


class LayoutMismatchError(TransferError):
    """Sender and receiver KV pools disagree on dtype, shape, layout version or backend."""

    code = "layout"


class StaleReservationError(TransferError):
    """A sender saw its reservation closed before the receiver said why (shm block tags cleared)."""

    code = "stale"


class HandshakeRefused(TransferError):
    """The two sides did not authenticate each other, speak different versions, or the receiver is full."""

    code = "auth"


# code -> the class a failure with that code is raised as; the human message travels beside the code
CODES: dict[str, type[TransferError]] = {
    "checksum": ChecksumError,        # what landed is not what was sent
    "layout": LayoutMismatchError,    # pools or backends do not fit each other
    "stale": StaleReservationError,   # shm tags withdrawn and no reason heard from the receiver
    "auth": HandshakeRefused,         # cluster secret not proven (either way)
    "version": HandshakeRefused,      # the peer speaks another KV wire version
    "busy": HandshakeRefused,         # the receiver holds max_connections already
    "refused": TransferError,         # bad token, blocks not reserved, another sender's reservation, done without open
    "missing": TransferError,         # no such reservation (never made, or resolved and handed back)
    "expired": TransferError,         # past the reservation's deadline
    "cancelled": TransferError,       # the receiver's owner cancelled the reservation
    "aborted": TransferError,         # the sender gave the transfer up
    "lost": TransferError,            # the connection between the two broke
    "unreachable": TransferError,     # no connection or handshake within connect_timeout
    "timeout": TransferError,         # no acknowledgement (or writes not sent) in time
    "closed": TransferError,          # the receiver closed while the transfer was pending
    "failed": TransferError,          # anything else (an unexpected exception, a frame out of order)
}


# A transfer made of parts (one per tensor-parallel rank, per_rank/) stops every part when one fails: the others
# then fail with these codes, which say what stopped them, not what went wrong.
SECONDARY_CODES = frozenset({"aborted", "cancelled"})


class _Coded(Protocol):
    @property
    def code(self) -> str | None: ...


C = TypeVar("C", bound=_Coded)


def root_cause(failures: Sequence[C]) -> C:
    """The first of a transfer's failures that is not only another's knock-on (SECONDARY_CODES), else the first."""
    return next((f for f in failures if f.code not in SECONDARY_CODES), failures[0])


def from_code(code: object, message: str) -> TransferError:
    """The exception for a failure that arrived as (code, message); an unknown code stays a TransferError
    that keeps it (both ends run this version, so that is a bug worth seeing in the logs)."""
    name = code if isinstance(code, str) and code else "failed"
    return CODES.get(name, TransferError)(message, name)
