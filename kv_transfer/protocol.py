"""The wire protocol of one sender -> receiver pair: three ordered streams.

Control (sender -> receiver, gloo, tag 0): messages of exactly CONTROL_BYTES, each an
int64[4] header and, for BEGIN and STEP, a body:
    BEGIN  [BEGIN, seq, inline_nbytes, extension_nbytes] + json of `Handshake`
    STEP   [STEP, k, inline_nbytes, extension_nbytes] + int64 (seq, nbytes) x k: the
           next num_layers x k messages on the data stream are layer 0 of each of the
           k transfers in this order, then layer 1 of each, and so on (layer-major, as
           one prefill step's forward pass writes them), each exactly its nbytes
    ABORT  [ABORT, seq, 0, 0]: the sender gives up on transfer `seq`
    STEP_SENT  [STEP_SENT, k, 0, 0]: every slot of the pair's oldest open step (of k
           transfers) went out; its transfers not aborted before this message are
           whole. A transfer is complete once this arrived and its layers landed: a
           payload landing before an ABORT was read might be padding
A body too long for the message (a handshake of tens of thousands of blocks, a step
of hundreds of transfers) sends its tail as the next extension_nbytes / CONTROL_BYTES
messages, rounded up. Every control message has one size, so the receiver keeps
CONTROL_RING receives posted ahead and messages stream without a round trip each (a
gloo send moves no byte until its receive is posted).

Data (sender -> receiver, one FIFO: the pair's second gloo group, on one tag, or its
NCCL communicator): payloads only, [2, n, block, Hkv, D] of one layer's blocks, in
the order STEP messages announced them. Nothing on it is told apart by tag: the
receiver posts receives in STEP order, as far ahead as its receive window allows, and
the sender issues a step's sends in that order, one step after the other. This is
NCCL's matching rule (per communicator and peer, in issue order), so the same
protocol runs on gloo and on NCCL. Every announced slot is sent: a transfer aborted
mid-step still has its remaining slots filled with padding, which the receiver drops
(as it drops the payload of a transfer it refused or ended), so the stream stays in
step; the two streams are two connections, so padding may land before its ABORT is
read, and STEP_SENT (after any ABORT) is what makes a landed transfer whole.
Announcing a whole step up front lets the receiver post every receive before its
payload is even gathered (the ordered protocol before it posted each on its own
announcement, a round trip per layer).

Status (receiver -> sender, gloo, tag `ack_tag(seq)`): exactly one int64[1] per
BEGIN: OK, REFUSED, ABORTED or TIMED_OUT. The sender posts its receive before BEGIN.
(It learns of an early end only at finish: a gloo Work reports completion only once
waited, so the layers of a refused transfer still go out, and are dropped.)

Control: the receiver's TCPStore. `layout` and `device` describe the receiver (and
`ranks`, of a tensor-parallel worker's rank 0, its other ranks' rendezvous); a new
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

BEGIN, STEP, ABORT, STEP_SENT = 1, 2, 3, 4
HEADER_LEN = 4
HEADER_BYTES = 8 * HEADER_LEN
CONTROL_BYTES = 4 << 10
CONTROL_RING = 16
MAX_STEP = 1 << 12  # transfers one STEP may announce
OK, REFUSED, ABORTED, TIMED_OUT = 0, 1, 2, 3
CONTROL_TAG = 0
DATA_TAG = 0  # gloo's data stream: one tag, so one FIFO, as NCCL
_TAG_SPACE = 1 << 29


def ack_tag(seq: int) -> int:
    return 2 + seq % _TAG_SPACE


LAYOUT_KEY = "layout"
DEVICE_KEY = "device"
RANKS_KEY = "ranks"  # a tensor-parallel receiver's other ranks' rendezvous, rank 1 first
JOIN_COUNTER = "joins"


def join_key(index: int) -> str:
    return f"join/{index}"


def reason_key(pair: str, seq: int) -> str:
    return f"reason/{pair}/{seq}"


def _header(kind: int, seq: int, a: int, b: int) -> torch.Tensor:
    message = torch.zeros(CONTROL_BYTES, dtype=torch.uint8)
    message[:HEADER_BYTES] = torch.tensor([kind, seq, a, b], dtype=torch.int64).view(torch.uint8)
    return message


def _with_body(kind: int, first: int, body: bytes | bytearray) -> list[torch.Tensor]:
    """One control message carrying `body`, plus its tail when it does not fit."""
    inline = min(len(body), CONTROL_BYTES - HEADER_BYTES)
    message = _header(kind, first, inline, len(body) - inline)
    if inline:
        message[HEADER_BYTES:HEADER_BYTES + inline] = torch.frombuffer(
            bytearray(body[:inline]), dtype=torch.uint8)
    tail = body[inline:]
    chunks = []
    for start in range(0, len(tail), CONTROL_BYTES):
        chunk = torch.zeros(CONTROL_BYTES, dtype=torch.uint8)
        piece = bytearray(tail[start:start + CONTROL_BYTES])
        chunk[:len(piece)] = torch.frombuffer(piece, dtype=torch.uint8)
        chunks.append(chunk)
    return [message] + chunks


def begin_messages(seq: int, hs: "Handshake") -> list[torch.Tensor]:
    """The BEGIN control message, plus the handshake's tail when it does not fit."""
    return _with_body(BEGIN, seq, hs.encode())


def step_messages(members: list[tuple[int, int]]) -> list[torch.Tensor]:
    """The STEP message of transfers (seq, nbytes per layer), in their slot order."""
    flat = [value for member in members for value in member]
    return _with_body(STEP, len(members), struct.pack(f"<{len(flat)}q", *flat))


def step_members(count: int, body: bytes) -> list[tuple[int, int]]:
    """The (seq, nbytes) of a STEP's `count` transfers; ValueError if the body is not
    exactly that."""
    if len(body) != 16 * count:
        raise ValueError(f"a STEP of {count} transfers carried {len(body)} bytes")
    values = struct.unpack(f"<{2 * count}q", body)
    return list(zip(values[::2], values[1::2]))


def extension_messages(extension_nbytes: int) -> int:
    return -(-extension_nbytes // CONTROL_BYTES)


def abort_message(seq: int) -> torch.Tensor:
    return _header(ABORT, seq, 0, 0)


def step_sent_message(count: int) -> torch.Tensor:
    return _header(STEP_SENT, count, 0, 0)


def parse_control(raw: bytes | torch.Tensor) -> tuple[int, int, int, int, bytes]:
    """(kind, seq or count, a, b, inline body) of a control message; for BEGIN and
    STEP a and b are the body's inline and extension byte counts."""
    if isinstance(raw, torch.Tensor):
        raw = bytes(raw.numpy())
    kind, seq, a, b = struct.unpack_from("<4q", raw)
    body = raw[HEADER_BYTES:HEADER_BYTES + a] if kind in (BEGIN, STEP) else b""
    return kind, seq, a, b, body


@dataclass(frozen=True)
class Handshake:
    request_id: str
    block_ids: list[int]  # the receiver's blocks to fill, in order
    num_cached_blocks: int  # leading blocks of the request the receiver already holds
    layout: dict  # the payload's: num_kv_heads counts the heads sent
    heads: list[int] | None = None  # [start, end) of the receiver's KV heads; None: all

    def encode(self) -> bytearray:
        # Not asdict(): it deep-copies every block id, a measurable cost per transfer.
        return bytearray(json.dumps({"request_id": self.request_id, "block_ids": self.block_ids,
                                     "num_cached_blocks": self.num_cached_blocks,
                                     "layout": self.layout, "heads": self.heads}).encode())

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
