class TransferError(RuntimeError):
    """A KV transfer failed: rejected, timed out, peer lost, or bytes corrupted."""


class ChecksumError(TransferError):
    """The bytes that landed differ from the bytes the sender read."""


class LayoutMismatchError(TransferError):
    """Sender and receiver KV pools disagree on dtype, shape or layout version."""


class StaleReservationError(TransferError):
    """A sender saw its reservation closed before the receiver said why (shm block tags cleared)."""
