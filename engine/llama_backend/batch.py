"""One reusable ``llama_batch`` holding the tokens of several sequences for one decode.

Core of continuous batching: every running slot contributes a prompt chunk or its next
token, and ONE ``llama_decode`` computes them all. Rows are written through numpy views of
the C arrays; a row's sequence id is rewritten only when it changes.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

import llama_cpp.llama_cpp as L

from ..backend import BatchItem


class LlamaBatch:
    def __init__(self, capacity: int, n_seq_max: int):
        self.raw = L.llama_batch_init(int(capacity), 0, n_seq_max)
        self.capacity = int(capacity)
        self.n_seq_max = n_seq_max
        b = self.raw
        self._tok = np.ctypeslib.as_array(b.token, shape=(capacity,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(capacity,))
        self._lg = np.ctypeslib.as_array(b.logits, shape=(capacity,))
        np.ctypeslib.as_array(b.n_seq_id, shape=(capacity,))[:] = 1
        self._seq_ptrs = b.seq_id
        self._row_seq = [-1] * capacity  # what we last wrote into seq_id[row][0]

    def free(self) -> None:
        if self.raw is not None:
            L.llama_batch_free(self.raw)
            self.raw = None

    def fill(self, items: Sequence[BatchItem], keep_order: bool = False) -> dict[int, int]:
        """Write ``items`` into the batch; returns {seq: output row} for their logits rows.

        Rows go in ascending sequence order: llama.cpp views the KV of a ubatch's streams as
        one range s0..s1, so with one stream per sequence (kv_unified off) a batch whose
        sequences come in another order is split into several ubatches — each a full pass
        over the weights (docs/performance.md, "Many streams: batches in stream order").
        ``keep_order`` exists only to measure that (``tools/bench/stream_order.py``).
        Raises ValueError for an invalid item (the batch is then unusable until refilled).
        """
        if not keep_order:
            items = sorted(items, key=lambda it: it.seq)
        total = sum(len(it.tokens) for it in items)
        if total > self.capacity:
            raise ValueError(f"{total} tokens in one decode() exceed n_batch={self.capacity}; split the prompt")
        tok, pos, lg = self._tok, self._pos, self._lg
        row_seq, seq_ptrs = self._row_seq, self._seq_ptrs
        out: dict[int, int] = {}
        seen: set[int] = set()
        i = 0
        for it in items:
            seq = it.seq
            k = len(it.tokens)
            if not 0 <= seq < self.n_seq_max:
                raise ValueError(f"seq {seq} out of range 0..{self.n_seq_max - 1}")
            if k == 0:
                raise ValueError(f"empty token list for seq {seq}")
            if seq in seen:
                raise ValueError(f"seq {seq} appears twice in one decode()")
            seen.add(seq)
            if k == 1:  # the common decode step: no numpy slicing overhead
                tok[i] = it.tokens[0]
                pos[i] = it.pos0
                lg[i] = 0
                if row_seq[i] != seq:
                    seq_ptrs[i][0] = seq
                    row_seq[i] = seq
            else:
                j = i + k
                tok[i:j] = it.tokens
                pos[i:j] = np.arange(it.pos0, it.pos0 + k, dtype=np.int32)
                lg[i:j] = 0
                for r in range(i, j):
                    if row_seq[r] != seq:
                        seq_ptrs[r][0] = seq
                        row_seq[r] = seq
            if it.logits_last:
                lg[i + k - 1] = 1
                out[seq] = i + k - 1
            i += k
        self.raw.n_tokens = total
        return out
