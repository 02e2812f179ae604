"""The wire protocol of one sender -> receiver pair: three ordered streams.

Control (sender -> receiver, gloo, tag 0): messages of exactly CONTROL_BYTES, each an
int64[4] header and, for BEGIN, the handshake:
    BEGIN  [BEGIN, seq, inline_nbytes, extension_nbytes] + json of `Handshake`
           (a handshake too long for the message, tens of thousands of blocks, sends
           its tail as the next extension_nbytes / CONTROL_BYTES messages, rounded up)
    LAYER  [LAYER, seq, layer, nbytes]: the next message on the data stream is layer
           `layer` of transfer `seq`, exactly nbytes
    ABORT  [ABORT, seq, 0, 0]: the sender gives up on transfer `seq`
Every control message has one size, so the receiver keeps CONTROL_RING receives posted
ahead and announcements stream without a round trip each (a gloo send moves no byte
until its receive is posted).

Data (sender -> receiver, one FIFO: the pair's second gloo group, on one tag, or its
NCCL communicator): payloads only, [2, n, block, Hkv, D] of one layer's blocks, in the
order their LAYER messages announced them. Nothing on it is told apart by tag: the
receiver posts one receive per LAYER, in control order, which is the order the
sender issued the sends (announcement and data go out under one lock). This is
NCCL's matching rule (per communicator and peer, in issue order), so the same
protocol runs on gloo and on NCCL. A receive is posted only for an announced message
and every announced message is sent, so nothing is ever left posted: an abort is one
control message, and a transfer the receiver refused or ended is drained as it comes.

Status (receiver -> sender, gloo, tag `ack_tag(seq)`): exactly one int64[1] per
BEGIN: OK, REFUSED, ABORTED or TIMED_OUT. The sender posts its receive before BEGIN.
(It learns of an early end only at finish: a gloo Work reports completion only once
waited, so the layers of a refused transfer still go out, and are dropped.)

Control: the receiver's TCPStore. `layout` and `device` describe the receiver; a new
pair registers under `join/<n>`; a failure's message waits under `reason/<pair>/<seq>`.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import struct
from dataclasses import asdict, dataclass

import torch

from pdserve.kv_transfer.layout import KVLayout

BEGIN, LAYER, ABORT = 1, 2, 3
HEADER_LEN = 4
HEADER_BYTES = 8 * HEADER_LEN
CONTROL_BYTES = 4 << 10
CONTROL_RING = 16
OK, REFUSED, ABORTED, TIMED_OUT = 0, 1, 2, 3
CONTROL_TAG = 0
DATA_TAG = 0  # gloo's data stream: one tag, so one FIFO, as NCCL
_TAG_SPACE = 1 << 29


def ack_tag(seq: int) -> int:
    return 2 + seq % _TAG_SPACE


LAYOUT_KEY = "layout"
DEVICE_KEY = "device"
JOIN_COUNTER = "joins"


def join_key(index: int) -> str:
    return f"join/{index}"


def reason_key(pair: str, seq: int) -> str:
    return f"reason/{pair}/{seq}"


def _header(kind: int, seq: int, a: int, b: int) -> torch.Tensor:
    message = torch.zeros(CONTROL_BYTES, dtype=torch.uint8)
    message[:HEADER_BYTES] = torch.tensor([kind, seq, a, b], dtype=torch.int64).view(torch.uint8)
    return message


def begin_messages(seq: int, hs: "Handshake") -> list[torch.Tensor]:
    """The BEGIN control message, plus the handshake's tail when it does not fit."""
    body = hs.encode()
    inline = min(len(body), CONTROL_BYTES - HEADER_BYTES)
    message = _header(BEGIN, seq, inline, len(body) - inline)
    message[HEADER_BYTES:HEADER_BYTES + inline] = torch.frombuffer(body[:inline], dtype=torch.uint8)
    tail = body[inline:]
    chunks = []
    for start in range(0, len(tail), CONTROL_BYTES):
        chunk = torch.zeros(CONTROL_BYTES, dtype=torch.uint8)
        piece = tail[start:start + CONTROL_BYTES]
        chunk[:len(piece)] = torch.frombuffer(piece, dtype=torch.uint8)
        chunks.append(chunk)
    return [message] + chunks


def extension_messages(extension_nbytes: int) -> int:
    return -(-extension_nbytes // CONTROL_BYTES)


def layer_message(seq: int, layer: int, nbytes: int) -> torch.Tensor:
    return _header(LAYER, seq, layer, nbytes)


def abort_message(seq: int) -> torch.Tensor:
    return _header(ABORT, seq, 0, 0)


def parse_control(raw: bytes | torch.Tensor) -> tuple[int, int, int, int, bytes]:
    """(kind, seq, a, b, inline body) of a control message; for BEGIN a and b are the
    inline and extension byte counts, for LAYER the layer and its byte count."""
    if isinstance(raw, torch.Tensor):
        raw = bytes(raw.numpy())
    kind, seq, a, b = struct.unpack_from("<4q", raw)
    body = raw[HEADER_BYTES:HEADER_BYTES + a] if kind == BEGIN else b""
    return kind, seq, a, b, body


@dataclass(frozen=True)
class Handshake:
    request_id: str
    block_ids: list[int]  # the receiver's blocks to fill, in order
    num_cached_blocks: int  # leading blocks of the request the receiver already holds
    layout: dict

    def encode(self) -> bytearray:
        # Not asdict(): it deep-copies every block id, a measurable cost per transfer.
        return bytearray(json.dumps({"request_id": self.request_id, "block_ids": self.block_ids,
                                     "num_cached_blocks": self.num_cached_blocks,
                                     "layout": self.layout}).encode())

    @classmethod
    def decode(cls, raw: bytes) -> "Handshake":
        return cls(**json.loads(raw.decode()))

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout(**self.layout)


@dataclass(frozen=True)
class JoinRecord:
    sender_id: str
    pair: str  # store prefix and name of the pair, unique per sender incarnation
    backend: str  # the data stream's: "gloo" or "nccl" (backend.choose)
    proof: str = ""  # HMAC-SHA256 of `pair` under the cluster's secret

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, raw: bytes) -> "JoinRecord":
        """A well-formed record, or ValueError (anyone who reaches the store can write)."""
        try:
            fields = json.loads(raw)
            return cls(**{k: str(fields[k]) for k in ("sender_id", "pair", "backend")},
                       proof=str(fields.get("proof", "")))
        except (ValueError, TypeError, KeyError) as err:
            raise ValueError(f"malformed join record: {err}") from None


def join_proof(secret: str, pair: str) -> str:
    """What a join must carry: only a holder of the cluster's secret can compute it."""
    return hmac.new(secret.encode(), pair.encode(), hashlib.sha256).hexdigest()
