"""Layer-wise paged KV streaming between a prefill (sender) and a decode (receiver)
worker over pairwise torch.distributed process groups."""
from pdserve.kv_transfer.config import TransferConfig
from pdserve.kv_transfer.errors import (
                                KVTransferError,
                                LayoutMismatchError,
                                PeerLostError,
                                TransferAborted,
                                TransferRefused,
                                TransferTimeout,
)
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.receiver import KVReceiver
from pdserve.kv_transfer.sender import KVSender, SendHandle

__all__ = ["KVLayout", "KVReceiver", "KVSender", "SendHandle", "TransferConfig",
           "KVTransferError", "LayoutMismatchError", "PeerLostError", "TransferAborted",
           "TransferRefused", "TransferTimeout"]
