"""``hydra-rpc inspect``: decode Hydra and ggml-RPC traffic from captures, a live tap or pasted hex.

Pipeline (each stage sans-IO except the inputs)::

    pcap_io (dpkt) ─► reassembly (TCP streams) ─► session (protocol per stream) ─► hydra_dissect / ggml_dissect
    tap (proxy)    ─────────────────────────────►        │                              │
    --hex / --raw  ─────────────────────────────►        ▼                              ▼
                                                   Message + Field tree (model) ─► filters ─► render / stats

One field tree per message (name, value, byte offset, length) drives the summary line, the
``-V`` tree, the ``-x`` hex dump, the NDJSON output and the ``-Y`` filters, as Wireshark's
field registry does. A dissection failure becomes an expert note on a raw node, never an
exception out of the inspector.
"""
