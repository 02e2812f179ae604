"""Layer-wise paged KV streaming between a prefill (sender) and a decode (receiver)
worker over pairwise torch.distributed process groups."""
from kv_transfer.config import TransferConfig
from kv_transfer.errors import (KVTransferError, LayoutMismatchError, PeerLostError,
                                TransferAborted, TransferRefused, TransferTimeout)
from kv_transfer.layout import KVLayout
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender, SendHandle

__all__ = ["KVLayout", "KVReceiver", "KVSender", "SendHandle", "TransferConfig",
           "KVTransferError", "LayoutMismatchError", "PeerLostError", "TransferAborted",
           "TransferRefused", "TransferTimeout"]
