"""The wire protocol of one sender -> receiver pair.

Control (tag 0, one ordered stream): a header int64[4] = [BEGIN, seq, 0, nbytes],
then the handshake (json of `Handshake`) as a uint8 payload of nbytes.
Data (tag `data_tag(seq)`): exactly num_layers payloads, layer 0 first, each the
transfer's blocks of one layer, [2, n, block, Hkv, D] bytes, then an int64 trailer:
LAYER_DATA, or LAYER_ABORT for scratch padding. On BEGIN the receiver posts all of
them at once, so layers flow without a round trip each. Posted receives cannot be
withdrawn, so every transfer's layers are always delivered in full: an aborting
sender pads the rest (the trailer says so, in the same ordered stream), and the
receiver drains what it refused. One transfer's failure never desynchronizes the
pair for the others.

Status (receiver -> sender, tag `ack_tag(seq)`): exactly one int64[1] per BEGIN,
OK, REFUSED, ABORTED or TIMED_OUT. The sender posts its receive before BEGIN.

Control: the receiver's TCPStore. `layout` and `device` describe the receiver; a new
pair registers under `join/<n>`; a failure's message waits under `reason/<pair>/<seq>`.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

from kv_transfer.layout import KVLayout

BEGIN = 1
HEADER_LEN = 4
LAYER_DATA, LAYER_ABORT = 1, 0
TRAILER_BYTES = 8
OK, REFUSED, ABORTED, TIMED_OUT = 0, 1, 2, 3
_TAG_SPACE = 1 << 29


def data_tag(seq: int) -> int:
    return 1 + seq % _TAG_SPACE


def ack_tag(seq: int) -> int:
    return 1 + _TAG_SPACE + seq % _TAG_SPACE

LAYOUT_KEY = "layout"
DEVICE_KEY = "device"
JOIN_COUNTER = "joins"


def join_key(index: int) -> str:
    return f"join/{index}"


def reason_key(pair: str, seq: int) -> str:
    return f"reason/{pair}/{seq}"


def header(kind: int, seq: int, layer: int = 0, nbytes: int = 0) -> torch.Tensor:
    return torch.tensor([kind, seq, layer, nbytes], dtype=torch.int64)


@dataclass(frozen=True)
class Handshake:
    request_id: str
    block_ids: list[int]  # the receiver's blocks to fill, in order
    num_cached_blocks: int  # leading blocks of the request the receiver already holds
    layout: dict

    def encode(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(json.dumps(asdict(self)).encode()), dtype=torch.uint8)

    @classmethod
    def decode(cls, payload: torch.Tensor) -> "Handshake":
        return cls(**json.loads(bytes(payload.numpy()).decode()))

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout(**self.layout)

    @property
    def message_bytes(self) -> int:
        return len(self.block_ids) * self.kv_layout.block_bytes_per_layer + TRAILER_BYTES


@dataclass(frozen=True)
class JoinRecord:
    sender_id: str
    pair: str  # store prefix and name of the pair, unique per sender incarnation
    backend: str  # "gloo" | "nccl"

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, raw: bytes) -> "JoinRecord":
        return cls(**json.loads(raw))
