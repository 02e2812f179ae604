"""Layer-wise paged KV streaming between a prefill (sender) and a decode (receiver)
worker over pairwise torch.distributed process groups. It knows requests only as ids
and block lists.

    sender.py          KVSender, the prefill side: begin / announce / send_layers /
                       finish / abort; layer i sent while layer i+1 computes
    receiver.py        KVReceiver, the decode side: expect / wait / abort, layers
                       scattered as they land; each transfer under a lease; a BEGIN
                       gets exactly one status
    channel.py         one pair: a 2-rank gloo group for control and status over a
                       prefix of the receiver's TCPStore, plus the pair's data stream
    data_plane.py      the data stream, one FIFO with no tags: GlooData or NcclData
    backend.py         which data stream a pair uses, from both caches' devices: NCCL
                       between distinct GPUs, gloo otherwise
    protocol.py        the wire protocol: fixed-size control messages (BEGIN, STEP,
                       ABORT, STEP_SENT), the ordered data stream, a status per BEGIN
    receive_window.py  the receiver's receives, posted ahead of the payloads up to
                       receive_window_bytes
    staging.py         CUDA caches over gloo: each send issued once its device-to-host
                       copy's event fired, in order, off the engine thread
    rendezvous.py      the receiver's TCPStore, on its node's address only, keys under
                       the cluster's secret (SECURITY.md)
    layout.py          KVLayout: what both sides must agree on, and its differences
    heads.py           which rank of a tensor-parallel sender sends which KV heads to
                       which rank of a receiver of another size (pure); a transfer
                       may carry a slice of heads, and a receiver takes a request's
                       heads in parts
    buffer_pool.py     reusable message buffers in size classes (25% waste at most)
    config.py          TransferConfig, frozen settings
    errors.py          typed transfer failures, each leaving both sides clean
"""
from __future__ import annotations

from pdserve.lazy import lazy_names

# Loaded on first use (PEP 562): the settings (config.py) import no torch, so a
# process that only configures transfers (the simulator) does not load it.
_LAZY = {
    "TransferConfig": "pdserve.kv_transfer.config",
    "KVLayout": "pdserve.kv_transfer.layout",
    "KVReceiver": "pdserve.kv_transfer.receiver",
    "KVSender": "pdserve.kv_transfer.sender",
    "SendHandle": "pdserve.kv_transfer.sender",
    **{name: "pdserve.kv_transfer.errors" for name in (
        "KVTransferError", "LayoutMismatchError", "PeerLostError", "TransferAborted",
        "TransferRefused", "TransferTimeout")},
}
__all__ = list(_LAZY)


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())
