"""The decode role: block reservation, KV import, continuous batching, streaming.

    role.py    DecodeRole: reserve (blocks held, the receiver expecting), start once the
               KV landed, continuous batching, TokenDeltas each step; whole requests
               (submit) in role both; an abort may overtake its reservation
    moves.py   live migration's worker side at both ends: the source sends whole blocks
               while it decodes, pauses with a marked last delta, sends the final copy;
               the target takes over, grows by the tokens made since, decodes on
"""
