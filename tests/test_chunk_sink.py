"""A stream's text events go out through a template rendered once around the text
(``hydra_rpc.http.chat.ChunkSink``): the same bytes as the chunk object dumped whole."""
from __future__ import annotations

import json

import pytest

from hydra_rpc.http.chat import ChunkSink, dumps
from hydra_rpc.http.openai import chunk_object

TEXTS = ["Hello", ' "quoted" \\ back', "é ☃ 漢字", "\n\t\x01", "\ud83d"]  # the last: a lone surrogate


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_every_text_event_is_the_chunk_object_dumped(kind: str) -> None:
    def chunk(**kw):
        return chunk_object(kind, "cmpl-1", 1700000000, "m", 3, **kw)

    out: list[bytes] = []
    sink = ChunkSink(kind, chunk, out, plan=None, opens_reasoning=False, id_prefix="call_", logprobs=False)
    assert sink.fast
    for text in TEXTS:
        sink.text(text)
        out.append(b"|")  # a flush between two events: each stands alone
    events = b"".join(out).split(b"|")[:-1]
    assert events == [b"data: " + dumps(chunk(text=t)) + b"\n\n" for t in TEXTS]
    texts = [json.loads(e[6:])["choices"][0] for e in events]
    assert [c["text"] if kind == "text" else c["delta"]["content"] for c in texts] == TEXTS
