"""Hydra payloads, per opcode and dialect, as fields with byte offsets.

Every decoder here gets the payload bytes that were captured and kept (``buf``, possibly a
prefix of the declared ``total``), the payload's offset in the message (``base``) and the
:class:`Message` to attach fields and expert notes to. The codec does the parsing; this
module only says where each value sits. A decoder that fails leaves a raw node and a note —
the caller (``hydra_dissect``) also catches anything unexpected, scapy-style.
"""
from __future__ import annotations

from typing import Any

from codec import decode_v3 as V3
from codec import payloads as P
from codec import store as S
from codec.enums import Op
from codec.errors import CodecError
from codec.hashing import kv_hash_str, parse_hash_str, xxh3_64
from codec.dialects import Dialect, decode_dialect, prefill_dialect
from codec.kvblob import (FLAG_CHECKPOINT, FLAG_RECURRENT_ONLY, KV_CHECKPOINT, KV_CHECKPOINT_HEAD, KV_V1_HEAD,
                          KV_V23_HEAD, parse_kv_blob_header)

from .layout import construct_fields
from .model import ERROR, NOTE, WARN, Field, Message
from .payload_base import Payload, fail, json_field  # also the dissector's (HP.Payload, HP.json_field)
from .util import capped, compact, human, text

MAX_CHILDREN = 2000  # pieces, frames, chunk records listed one by one


# ---- KV blobs (docs/protocol.md §7) ----------------------------------------------------------


def kv_blob(pl: Payload, parent: Field | Message, buf: bytes, off: int, total: int, *,
            state_size: int | None = None, logits_size: int | None = None, name: str = "hydra.kv") -> Field:
    f = parent.add(name, None, off, total)
    try:
        header, hlen = parse_kv_blob_header(buf, total_len=total)
    except CodecError as e:
        fail(pl.msg, "KV blob header", e)
        f.show = f"{human(total)} (header does not parse)"
        return f
    v1 = header.version == 1
    head = KV_V1_HEAD if v1 else KV_V23_HEAD
    values = {"version": header.version, "n_past": header.n_past, "n_tok": len(header.tokens)}
    f.children += construct_fields(head, None, off, name, values=values)
    pos = off + head.sizeof()
    toks, cut = capped(header.tokens)
    f.add(f"{name}.tokens", toks, pos, 4 * len(header.tokens), show=f"{len(header.tokens)} tokens: {compact(toks, 100)}")
    if cut:
        pl.msg.note(f"{name}.tokens: value lists the first {len(toks)} of {len(header.tokens)}", NOTE)
    pos += 4 * len(header.tokens)
    if not v1:
        flags = [n for bit, n in ((FLAG_CHECKPOINT, "checkpoint"), (FLAG_RECURRENT_ONLY, "recurrent-only"))
                 if header.flags & bit]
        f.add(f"{name}.flags", header.flags, pos, 1, show=f"0x{header.flags:02x} {flags or ''}".rstrip())
        pos += 1
        ck = header.checkpoint
        if ck is not None:
            cname = f"{name}.checkpoint"
            c = f.add(cname, {"pos_min": ck.pos_min, "pos_max": ck.pos_max, "n_tokens": ck.n_tokens,
                              "tgt_size": len(ck.tgt), "dft_size": len(ck.dft)}, pos, hlen - (pos - off))
            c.children += construct_fields(KV_CHECKPOINT_HEAD, None, pos, cname, values={
                "pos_min": ck.pos_min, "pos_max": ck.pos_max, "n_tokens": ck.n_tokens, "tgt_size": len(ck.tgt)})
            c.add(f"{cname}.dft_size", len(ck.dft), pos + KV_CHECKPOINT_HEAD.sizeof() + len(ck.tgt),
                  KV_CHECKPOINT.dft_size.sizeof())
    rest = total - hlen
    logits = logits_size or 0
    state = state_size if state_size is not None else rest - logits
    if state_size is not None and state + logits != rest:
        pl.msg.note(f"{name}: {human(rest)} after the header, but meta says state {human(state_size)}"
                    f" + logits {human(logits)}", ERROR)
        state = max(0, min(state, rest))
    f.add(f"{name}.state", None, off + hlen, max(0, state), show=human(max(0, state)))
    if logits:
        f.add(f"{name}.logits", None, off + hlen + state, logits, show=f"{human(logits)} = {logits // 4} × f32")
    f.value = {"version": header.version, "n_past": header.n_past, "n_tok": len(header.tokens),
               "state_len": max(0, state), "logits_len": logits}
    f.show = (f"v{header.version} n_past={header.n_past} n_tok={len(header.tokens)} state {human(max(0, state))}"
              + (f" logits {human(logits)}" if logits else ""))
    return f


# ---- DECODE v3 (docs/protocol.md §8) ---------------------------------------------------------


def decode_v3(pl: Payload, parent: Field | Message) -> str:
    buf, base, total, msg = pl.buf, pl.base, pl.total, pl.msg
    f = parent.add("hydra.v3", None, base, total)
    try:
        hdr_len, hdr_hash = V3.parse_decode_v3_prefix(buf[:V3.PREFIX_LEN], total)
    except CodecError as e:
        fail(msg, "DECODE v3 prefix", e)
        return "v3 (bad prefix)"
    f.children += construct_fields(V3.DECODE_V3_PREFIX, None, base, "hydra.v3",
                                   values={"hdr_len": hdr_len, "hdr_hash": f"{hdr_hash:016x}"})
    hh = f.children[-1]
    hdr_bytes = buf[V3.PREFIX_LEN : V3.PREFIX_LEN + hdr_len]
    if len(hdr_bytes) < hdr_len:
        msg.note("DECODE v3 control header not fully captured", WARN)
        return "v3 (header cut)"
    ok = xxh3_64(hdr_bytes) == hdr_hash
    hh.show = f"0x{hdr_hash:016x} ({'matches' if ok else 'MISMATCH: xxh3 of the header is ' + format(xxh3_64(hdr_bytes), '016x')})"
    f.add("hydra.v3.hdr_hash_ok", ok, hh.offset, hh.length)
    json_field(pl, f, "hydra.v3.header", hdr_bytes, base + V3.PREFIX_LEN)
    try:
        hdr = V3.validate_decode_v3(hdr_len, hdr_hash, hdr_bytes, total)
    except CodecError as e:
        fail(msg, "DECODE v3 validation (the engine answers BAD_REQUEST)", e)
        return "v3 (invalid)"
    body = base + V3.PREFIX_LEN + hdr_len
    parts = []
    for seg in hdr.segments:
        s = f.add("hydra.v3.segment", {"id": seg.id, "offset": seg.offset, "len": seg.len, "hash": seg.hash},
                  body + seg.offset, seg.len, show=f"{seg.id}: {human(seg.len)} at +{seg.offset} hash {seg.hash or '-'}")
        lo = V3.PREFIX_LEN + hdr_len + seg.offset
        data = buf[lo : lo + seg.len]
        parts.append(f"{seg.id} {human(seg.len)}")
        checked = _segment_hash(pl, s, seg, data)
        if seg.id == "prompt" and len(data) == seg.len:
            json_field(pl, s, "hydra.v3.prompt", data, body + seg.offset)
        elif seg.id == "kv" and seg.len:
            try:
                V3.validate_kv_segment(data, seg.len)
            except CodecError as e:
                fail(msg, "DECODE v3 kv segment", e)
            else:
                kv_blob(pl, s, data, body + seg.offset, seg.len)
        if seg.id == "kv" and checked is False:
            msg.note("DECODE v3 kv segment hash does not match (the engine rejects it)", ERROR)
    f.value = {"hdr_len": hdr_len, "segments": [s.id for s in hdr.segments], "valid": True}
    f.show = "merged DECODE v3: " + ", ".join(parts)
    return "v3: " + ", ".join(parts)


def _segment_hash(pl: Payload, parent: Field, seg: Any, data: bytes) -> bool | None:
    name = f"hydra.v3.{seg.id}_hash_ok"
    if not seg.hash:
        parent.add(name, None, parent.offset, parent.length, show="no hash sent")
        return None
    if len(data) != seg.len:
        parent.add(name, None, parent.offset, parent.length, show="not checked: segment not fully captured")
        return None
    try:
        want = parse_hash_str(seg.hash)
    except CodecError as e:
        fail(pl.msg, f"{seg.id} segment hash", e)
        return None
    got = xxh3_64(data)
    extra = " (the engine does not check the prompt hash)" if seg.id == "prompt" else ""
    parent.add(name, got == want, parent.offset, parent.length,
               show=("matches" if got == want else f"MISMATCH: bytes hash to {kv_hash_str(got)}") + extra)
    return got == want


# ---- requests --------------------------------------------------------------------------------


def request(pl: Payload, op: int) -> tuple[str, Dialect | str | None]:
    """Fields of a request payload. Returns (summary detail, dialect: a ``Dialect`` for PREFILL
    and DECODE, "json"/"raw" for SET_EXPERT_MODE's two forms)."""
    msg, buf, base, total = pl.msg, pl.buf, pl.base, pl.total
    if total == 0:
        return "", None
    if op in (Op.INFO, Op.STATE_GET, Op.STATE_META):
        pl.raw(msg)
        msg.note(f"{human(total)} payload on an op that takes none (our server drains it; the C++ desyncs)", WARN)
        return f"+{human(total)} ignored payload", None
    if op == Op.STATE_PUT:
        kv_blob(pl, msg, buf, base, total)
        return f"KV blob {human(total)}", None
    if op in (Op.CONFIGURE, Op.PIPELINE_ATTACH, Op.PUT_META):
        if pl.need_whole("JSON body"):
            f = json_field(pl, msg, "hydra.json", buf, base)
            return compact(f.value, 100), None
        return human(total), None
    if op == Op.PREFILL:
        return _prefill(pl)
    if op == Op.DECODE:
        return _decode(pl)
    if op == Op.SET_EXPERT_MODE:
        return _expert_mode(pl)
    if op == Op.SWAP_QUANT:
        return _swap_quant(pl), None
    if op in (Op.GET_CHUNKED, Op.SYNC_MISSING):
        return _hash_list(pl), None
    if op == Op.PUSH_CHUNKS:
        return _chunks(pl, indexed=False), None
    if op == Op.PUT_MANIFEST:
        return _manifest(pl), None
    pl.raw(msg)
    return human(total), None


def _expert_mode(pl: Payload) -> tuple[str, str | None]:
    msg, buf, base, total = pl.msg, pl.buf, pl.base, pl.total
    try:
        m = P.parse_expert_mode(buf)
    except CodecError as e:
        fail(msg, "SET_EXPERT_MODE", e, WARN)
        pl.raw(msg)
        return human(total), None
    msg.add("hydra.expert_mode", m.mode, base, total, show=f"{m.mode}{' (JSON form)' if m.json_form else ''}")
    if m.peer is not None:
        msg.add("hydra.expert_peer", m.peer, base, total)
    return m.mode, "json" if m.json_form else "raw"


def _swap_quant(pl: Payload) -> str:
    msg, buf, base, total = pl.msg, pl.buf, pl.base, pl.total
    try:
        sq = P.parse_swap_quant(buf)
    except CodecError as e:
        fail(msg, "SWAP_QUANT", e, WARN)
        pl.raw(msg)
        return human(total)
    qk_len, head = len(sq.qk.encode()), P.SWAP_QUANT.qk_len.sizeof()
    msg.add("hydra.swap_quant.qk_len", qk_len, base, head)
    msg.add("hydra.swap_quant.qk", sq.qk, base + head, qk_len)
    msg.add("hydra.swap_quant.pattern", sq.pattern, base + head + qk_len, total - head - qk_len)
    return f"qk={sq.qk!r} pattern={sq.pattern!r}"


def _hash_list(pl: Payload) -> str:
    """GET_CHUNKED / SYNC_MISSING: the hashes the client has."""
    if pl.need_whole("hash list"):
        try:
            hashes = S.parse_hash_list(pl.buf)
        except CodecError as e:
            fail(pl.msg, "hash list", e, WARN)
        else:
            pl.msg.add("hydra.store.hashes", hashes, pl.base, pl.total, show=f"{len(hashes)} hashes")
            return f"{len(hashes)} known hashes"
    return human(pl.total)


def _manifest(pl: Payload) -> str:
    if pl.need_whole("manifest"):
        f = json_field(pl, pl.msg, "hydra.store.manifest", pl.buf, pl.base)
        try:
            m = S.parse_manifest(pl.buf)
            return f"manifest: {len(m.chunks)} chunks, n_past {m.n_past}"
        except CodecError as e:
            fail(pl.msg, "manifest", e, WARN)
            return compact(f.value, 80)
    return human(pl.total)


def _prefill(pl: Payload) -> tuple[str, Dialect]:
    dialect = prefill_dialect(pl.buf[:4096] if not pl.whole else pl.buf)
    if dialect is Dialect.PREFILL_E1:
        if pl.need_whole("E1 token list"):
            try:
                toks = P.decode_e1_tokens(pl.buf)
            except CodecError as e:
                fail(pl.msg, "E1 tokens", e, WARN)
                return "e1", dialect
            vals, _ = capped(toks)
            pl.msg.add("hydra.e1.tokens", vals, pl.base, pl.total, show=f"{len(toks)} tokens: {compact(vals, 100)}")
            return f"E1 raw tokens ({len(toks)})", dialect
        return "e1", dialect
    if pl.need_whole("PREFILL JSON body"):
        f = json_field(pl, pl.msg, "hydra.json", pl.buf, pl.base)
        body = f.value if isinstance(f.value, dict) else {}
        n = len(body.get("messages") or []) if isinstance(body.get("messages"), list) else None
        return (f"json, {n} messages" if n is not None else "json") + (
            f", model {body['model']!r}" if isinstance(body.get("model"), str) else ""), dialect
    return "json", dialect


def _decode(pl: Payload) -> tuple[str, Dialect]:
    # A JSON body only partly captured decides as PIN (its "stream" key may be further on).
    dialect = decode_dialect(pl.buf if pl.whole else pl.buf[: V3.PREFIX_LEN + P.HYDRA_MAX_JSON_HEADER])
    if dialect is Dialect.DECODE_V3:
        return decode_v3(pl, pl.msg), dialect
    if not pl.need_whole(f"DECODE {dialect.label} body"):
        return dialect.label, dialect
    if dialect is Dialect.DECODE_E1:
        try:
            n_predict, toks = P.decode_e1_decode(pl.buf)
        except CodecError as e:
            fail(pl.msg, "E1 DECODE", e, WARN)
            return "e1", dialect
        pl.msg.add("hydra.e1.n_predict", n_predict, pl.base, 4)
        vals, _ = capped(toks)
        pl.msg.add("hydra.e1.tokens", vals, pl.base + 4, pl.total - 4, show=f"{len(toks)} tokens")
        return f"E1 n_predict={n_predict}, {len(toks)} tokens", dialect
    json_field(pl, pl.msg, "hydra.json", pl.buf, pl.base)
    try:
        d = P.parse_json_decode(pl.buf)
        detail = f"n_predict={d.n_predict}"
    except CodecError as e:
        fail(pl.msg, "JSON DECODE body", e, WARN)
        detail = "invalid"
    return f"{'PIN stream' if dialect is Dialect.DECODE_PIN else 'JSON, 9-byte frames'} {detail}", dialect


def _chunks(pl: Payload, indexed: bool) -> str:
    msg = pl.msg
    parent = msg.add("hydra.store.chunks", None, pl.base, pl.total)
    count = size = 0
    try:
        it = S.iter_indexed_chunks(pl.buf) if indexed else S.iter_sized_chunks(pl.buf)
        for rec in it:
            count += 1
            size += rec.size
            if count <= MAX_CHILDREN:
                head = 8 if indexed else 4
                parent.add("hydra.store.chunk", {"index": rec.index, "size": rec.size}, pl.base + rec.offset - head,
                           rec.size + head, show=f"{'#' + str(rec.index) + ' ' if indexed else ''}{human(rec.size)}")
    except CodecError as e:
        if pl.whole:
            fail(msg, "chunk records", e, WARN)
        else:
            msg.note(f"chunk records after {count}: not fully captured", NOTE)
    parent.value = {"count": count, "bytes": size}
    parent.show = f"{count} chunk records, {human(size)}"
    return parent.show


# ---- responses -------------------------------------------------------------------------------


def response(pl: Payload, op: int | None, status: int, meta: Any, dialect: Dialect | None,
             digest: int | None) -> str:
    """Fields of a response payload; ``op``/``dialect`` come from the paired request."""
    msg, buf, base, total = pl.msg, pl.buf, pl.base, pl.total
    meta = meta if isinstance(meta, dict) else {}
    if total == 0:
        return ""
    ok = status == 0
    if ok and op in (Op.STATE_GET, Op.PREFILL):
        state_size = meta.get("state_size") if isinstance(meta.get("state_size"), int) else None
        logits = meta.get("logits_size") if isinstance(meta.get("logits_size"), int) else None
        kv_blob(pl, msg, buf, base, total, state_size=state_size, logits_size=logits if op == Op.PREFILL else None)
        want = meta.get("kv_hash_str")
        if isinstance(want, str):
            _check_payload_hash(msg, want, digest, base, total)
        return f"KV blob {human(total)}"
    if ok and dialect is Dialect.DECODE_SPEC:
        return _token_frames(pl)
    if ok and dialect is Dialect.DECODE_E1:
        msg.add("hydra.text", text(buf), base, total, show=repr(text(buf[:200])))
        return f"text {text(buf[:40])!r}"
    if ok and op == Op.GET_CHUNKED:
        return _chunks(pl, indexed=True)
    if op == Op.LIST and ok and pl.need_whole("name list"):
        try:
            names = S.parse_list_payload(buf)
            msg.add("hydra.store.names", names, base, total, show=f"{len(names)} names")
            return f"{len(names)} names"
        except CodecError as e:
            fail(msg, "LIST payload", e, WARN)
    if (op == Op.SYNC_MISSING and ok or op == Op.PUT_MANIFEST and status == 3) and pl.need_whole("missing hashes"):
        try:
            hashes = S.parse_missing_hashes(buf)
            msg.add("hydra.store.missing_hashes", hashes, base, total, show=f"{len(hashes)} missing")
            return f"{len(hashes)} missing hashes"
        except CodecError as e:
            fail(msg, "missing_hashes payload", e, WARN)
    if op == Op.GET_MANIFEST and ok and pl.need_whole("manifest"):
        json_field(pl, msg, "hydra.store.manifest", buf, base)
        return "manifest"
    pl.raw(msg)
    return human(total)


def _check_payload_hash(msg: Message, want: str, digest: int | None, base: int, total: int) -> None:
    if digest is None:
        msg.add("hydra.kv_hash_ok", None, base, total, show="not checked: payload bytes missing from the capture")
        return
    try:
        ok = parse_hash_str(want) == digest
    except CodecError as e:
        fail(msg, "kv_hash_str", e, WARN)
        return
    msg.add("hydra.kv_hash_ok", ok, base, total,
            show=f"kv_hash_str {'matches the payload' if ok else 'MISMATCH: payload hashes to ' + kv_hash_str(digest)}")
    if not ok:
        msg.note(f"kv_hash_str {want} does not match the payload ({kv_hash_str(digest)})", ERROR)


def _token_frames(pl: Payload) -> str:
    if not pl.need_whole("token frames"):
        return human(pl.total)
    try:
        frames = P.decode_token_frames(pl.buf)
    except CodecError as e:
        fail(pl.msg, "9-byte token frames", e, WARN)
        pl.raw(pl.msg)
        return human(pl.total)
    parent = pl.msg.add("hydra.frames", {"count": len(frames), "tokens": [fr.token_id for fr in frames][:MAX_CHILDREN]},
                        pl.base, pl.total, show=f"{len(frames)} token frames")
    for i, fr in enumerate(frames[:MAX_CHILDREN]):
        parent.add("hydra.frame", {"token_id": fr.token_id, "logprob": fr.logprob, "final": fr.final}, pl.base + 9 * i, 9,
                   show=f"token {fr.token_id} logprob {fr.logprob:.4f}{' final' if fr.final else ''}")
    return f"{len(frames)} token frames"


def pin_pieces(msg: Message, buf: bytes, base: int, seen: int) -> str:
    """PIN's ``[u32 len][piece]`` frames after the head that started them, up to EOF."""
    parent = msg.add("hydra.pin", None, base, seen)
    dec = P.PieceStreamDecoder()
    try:
        pieces = dec.feed(buf)
    except CodecError as e:
        fail(msg, "PIN stream", e, WARN)
        pieces = []
    pos = 0
    for i, piece in enumerate(pieces[:MAX_CHILDREN]):
        parent.add("hydra.pin.piece", text(piece), base + pos, P.PIECE_HEAD.sizeof() + len(piece))
        pos += P.PIECE_HEAD.sizeof() + len(piece)
    if dec.buffered or seen > len(buf):
        left = seen - (len(buf) - dec.buffered)
        if len(buf) < seen:
            msg.note(f"PIN stream: {human(left)} after piece {len(pieces)} not kept or not captured", NOTE)
        else:
            msg.note(f"PIN stream ended inside a frame ({left} bytes of a frame)", WARN)
    joined = "".join(text(p) for p in pieces)
    parent.value = {"pieces": len(pieces), "text": joined}
    parent.show = f"{len(pieces)} pieces: {joined[:80]!r}"
    return f"PIN stream, {len(pieces)} pieces {joined[:40]!r}"
