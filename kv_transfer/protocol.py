"""The wire protocol of one sender -> receiver pair.

Control (tag 0, one ordered stream): a BEGIN is one message of exactly CONTROL_BYTES,
int64[4] = [BEGIN, seq, inline_nbytes, extension_nbytes] followed by the handshake
(json of `Handshake`). The receiver keeps the next control receive posted, so a
BEGIN never waits for a round trip; a handshake too long for the message (tens of
thousands of blocks) sends its tail as one more control message of extension_nbytes.
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

Control: the receiver's TCPStore. `layout` describes the receiver; a new
pair registers under `join/<n>`; a failure's message waits under `reason/<pair>/<seq>`.
"""
from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import asdict, dataclass

import torch

from pdserve.kv_transfer.layout import KVLayout

BEGIN = 1
HEADER_LEN = 4
HEADER_BYTES = 8 * HEADER_LEN
CONTROL_BYTES = 16 << 10
LAYER_DATA, LAYER_ABORT = 1, 0
TRAILER_BYTES = 8
OK, REFUSED, ABORTED, TIMED_OUT = 0, 1, 2, 3
_TAG_SPACE = 1 << 29


def data_tag(seq: int) -> int:
    return 1 + seq % _TAG_SPACE


def ack_tag(seq: int) -> int:
    return 1 + _TAG_SPACE + seq % _TAG_SPACE

LAYOUT_KEY = "layout"
JOIN_COUNTER = "joins"


def join_key(index: int) -> str:
    return f"join/{index}"


def reason_key(pair: str, seq: int) -> str:
    return f"reason/{pair}/{seq}"


def begin_messages(seq: int, hs: "Handshake") -> list[torch.Tensor]:
    """The BEGIN control message, plus the handshake's tail when it does not fit."""
    body = hs.encode()
    inline = min(len(body), CONTROL_BYTES - HEADER_BYTES)
    message = torch.zeros(CONTROL_BYTES, dtype=torch.uint8)
    message[:HEADER_BYTES] = torch.tensor([BEGIN, seq, inline, len(body) - inline],
                                          dtype=torch.int64).view(torch.uint8)
    message[HEADER_BYTES:HEADER_BYTES + inline] = torch.frombuffer(body[:inline], dtype=torch.uint8)
    tail = body[inline:]
    return [message] + ([torch.frombuffer(tail, dtype=torch.uint8)] if tail else [])


def parse_begin(message: torch.Tensor) -> tuple[int, int, bytes, int]:
    """(kind, seq, inline handshake bytes, extension nbytes) of a control message."""
    raw = bytes(message.numpy())
    kind, seq, inline, extension = torch.frombuffer(bytearray(raw[:HEADER_BYTES]),
                                                    dtype=torch.int64).tolist()
    return kind, seq, raw[HEADER_BYTES:HEADER_BYTES + inline], extension


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

    @property
    def message_bytes(self) -> int:
        return len(self.block_ids) * self.kv_layout.block_bytes_per_layer + TRAILER_BYTES


@dataclass(frozen=True)
class JoinRecord:
    sender_id: str
    pair: str  # store prefix and name of the pair, unique per sender incarnation
    backend: str  # "gloo" (the field leaves room for a GPU-to-GPU data plane)
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
