"""Typed transfer failures. Every one leaves both sides clean: the receiver's reserved
blocks released, the sender's buffers dropped."""


class KVTransferError(RuntimeError):
    def __init__(self, request_id: str | None, message: str):
        super().__init__(f"request {request_id}: {message}" if request_id else message)
        self.request_id = request_id
        self.message = message

    def __reduce__(self):  # crosses the Ray boundary as itself
        return type(self), (self.request_id, self.message)


class LayoutMismatchError(KVTransferError):
    """Sender and receiver disagree on the KV layout; nothing was sent."""


class TransferRefused(KVTransferError):
    """The receiver refused the handshake (unknown request, block ids that differ)."""


class TransferTimeout(KVTransferError):
    """Not every layer landed within the timeout."""


class TransferAborted(KVTransferError):
    """Either side aborted the transfer."""


class PeerLostError(KVTransferError):
    """The other process went away (crash, kill, closed connection)."""
