"""The wire protocol of one sender -> receiver pair.

Data: one ordered stream per pair. Every message is a header tensor
int64[4] = [kind, seq, layer, nbytes] followed, when nbytes > 0, by a uint8 payload.
  BEGIN  payload: the handshake (json of `Handshake`)
  LAYER  payload: layer `layer` of the transfer's blocks, [2, n, block, Hkv, D] bytes
  ABORT  no payload: the sender gave up on the transfer
The receiver drains every payload even for a refused or aborted transfer, so one
transfer's failure never desynchronizes the pair for the others.

Control: the receiver's TCPStore. `layout` and `device` describe the receiver; a new
pair registers under `join/<n>`; the receiver answers each transfer under
`ack/<pair>/<seq>` with "ok" or "<reason>:<message>".
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

from kv_transfer.layout import KVLayout

BEGIN, LAYER, ABORT = 1, 2, 3
HEADER_LEN = 4

ACK_OK = "ok"
REFUSED, ABORTED, TIMED_OUT = "refused", "aborted", "timeout"

LAYOUT_KEY = "layout"
DEVICE_KEY = "device"
JOIN_COUNTER = "joins"


def join_key(index: int) -> str:
    return f"join/{index}"


def ack_key(pair: str, seq: int) -> str:
    return f"ack/{pair}/{seq}"


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


def encode_ack(reason: str, message: str = "") -> str:
    return reason if reason == ACK_OK else f"{reason}:{message}"


def decode_ack(raw: bytes) -> tuple[str, str]:
    reason, _, message = raw.decode().partition(":")
    return reason, message
