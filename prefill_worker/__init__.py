"""The prefill role: batched / chunked prefill with prefix caching, KV streamed out.

    role.py   PrefillRole: a prompt runs with max_tokens=1; the step that computes its
              last chunk begins the transfer and sends each layer as the forward pass
              writes it; the result once the decode side confirms. Pair set-up,
              confirmations, aborts and live migration's KV sends run on one lane
              thread per decode peer, never on the engine thread.
    destination.py  Destination: a decode worker as this worker's ranks send to it,
              its ranks' rendezvous and the routes of each KV head (tensor parallel)
"""
