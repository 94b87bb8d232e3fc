"""ggml-RPC over one TCP stream (docs/ggml.md has the protocol; this follows its inspector recipe).

Client → server ``[u8 cmd][u64 size][payload]``; server → client ``[u64 size][payload]`` with
no command and no id. Responses match requests FIFO, skipping the commands that get no reply
*at the negotiated version* (SET_TENSOR since 2.0.0, GRAPH_COMPUTE since 3.5.0, FREE_BUFFER /
BUFFER_CLEAR / INIT_TENSOR / MEMSET_TENSOR since 6.0.0), so the command table follows the
HELLO response (``codec.ggml.command_table``). Without a HELLO in the capture, ``--ggml-version``
says which table to use. Layouts, names and sizes all come from ``codec.ggml``.
"""
from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from codec import ggml as G
from codec.errors import CodecError

from .stream_dissector import StreamDissector
from .layout import construct_fields
from .model import ERROR, NOTE, WARN, Field, Message
from .pdu import DirectionReader, Pdu
from .util import Named, capped, human

_REQ = G.REQUEST_HEADER_STRUCT
_RESP = G.RESPONSE_HEADER_STRUCT
MAX_TENSORS_LISTED = 512

def _show(name: str, v: Any) -> str | None:
    if name.endswith(".type") and isinstance(v, int):
        return f"{G.type_name(v)} ({v})"
    if name.endswith((".id", ".buffer", ".data", ".remote_ptr", ".base_ptr", ".view_src")) and isinstance(v, int):
        return f"0x{v:x}"
    if isinstance(v, int) and name.endswith(("size", "_mem")) and v >= 1024:
        return f"{v} ({human(v)})"
    return None


def _fix_names(fields: list[Field]) -> None:
    """rpc_tensor names are NUL-padded 64-byte arrays: show them as strings."""
    for top in fields:
        for f in top.walk():
            if f.name.endswith(".name") and f.length == G.GGML_MAX_NAME and isinstance(f.value, str):
                f.value = bytes.fromhex(f.value).split(b"\0", 1)[0].decode("utf-8", "replace")
                f.show = repr(f.value)
            elif isinstance(f.value, dict) and isinstance(f.value.get("name"), str) and len(f.value["name"]) == 128:
                f.value["name"] = bytes.fromhex(f.value["name"]).split(b"\0", 1)[0].decode("utf-8", "replace")


def tensor_summary(t: G.RpcTensor) -> dict[str, Any]:
    return {"id": t.id, "name": t.name_str, "type": G.type_name(t.type), "op": G.op_name(t.op),
            "ne": list(t.ne), "buffer": t.buffer, "data": t.data}


class _Reader(DirectionReader):
    def __init__(self, emit: Callable[[Pdu], None], keep: int, on_head: Callable[[Pdu, int], bool], fmt: struct.Struct):
        super().__init__(emit, keep)
        self.header_size = fmt.size
        self.fmt, self.on_head = fmt, on_head

    def on_header(self, pdu: Pdu, header: bytes) -> bool:
        fields = self.fmt.unpack(header)
        size = fields[-1]
        pdu.info["size"] = size
        if len(fields) == 2:
            pdu.info["cmd"] = fields[0]
        pdu.declared = self.header_size + size
        return self.on_head(pdu, size)


@dataclass
class _Pending:
    cmd: int
    request: Message | None = None


class GgmlStream(StreamDissector):
    proto = "ggml"

    def __init__(self, stream: int, emit: Callable[[Message], None], *, keep: int, hex_keep: int,
                 client: str = "", server: str = "", version: tuple[int, int, int] | None = None,
                 fork: str | None = None):
        self.stream, self._emit, self.hex_keep = stream, emit, hex_keep
        self.client, self.server = client, server
        self.fork = fork
        self.version = version
        self.table = G.command_table(version, fork)
        self.pending: deque[_Pending] = deque()
        self.rdma = False
        self.req = _Reader(self._request_done, keep, self._request_head, _REQ)
        self.resp = _Reader(self._response_done, keep, self._response_head, _RESP)
        self._client_caps: bytes | None = None
        # Requests completed while the HELLO response is outstanding wait for it, so they are
        # decoded with the negotiated version's layouts (a pipelining client may send them).
        self._hello_pending = False
        self._held: list[Pdu] = []

    def end(self, direction: str, ts: float | None, frame: int | None) -> None:
        super().end(direction, ts, frame)
        if direction == "s2c" or self.resp.ended:
            self._release_held()

    def _release_held(self) -> None:
        self._hello_pending = False
        held, self._held = self._held, []
        for pdu in held:
            self._request_done(pdu)

    # ---- naming --------------------------------------------------------------------------
    def name(self, cmd: int) -> str:
        if cmd == G.Cmd.HELLO:
            return "HELLO"
        return G.command_name(cmd, self.version, self.fork)

    def answered(self, cmd: int) -> bool:
        if cmd == G.Cmd.HELLO:
            return True
        info = self.table.get(cmd)
        return info is None or info.has_response  # unknown (fork) commands: assume answered

    # ---- framing hooks -------------------------------------------------------------------
    def _request_head(self, pdu: Pdu, size: int) -> bool:
        p = _Pending(pdu.info["cmd"])
        pdu.info["pending"] = p
        if p.cmd == G.Cmd.HELLO and self.version is None:
            self._hello_pending = True
        self.pending.append(p)
        return True

    def _response_head(self, pdu: Pdu, size: int) -> bool:
        while self.pending:
            p = self.pending.popleft()
            if self.answered(p.cmd):
                pdu.info["pending"] = p
                return True
            if p.request is not None:
                p.request.attrs["answered"] = False
        pdu.info["reason"] = "response with no request awaiting one (FIFO lost: fork command or mid-stream capture)"
        return False

    def _vstr(self) -> str:
        return "v0 (pre-HELLO)" if self.version is None else ".".join(map(str, self.version))

    # ---- messages ------------------------------------------------------------------------
    def _junk(self, msg: Message, pdu: Pdu) -> None:
        self._show_raw(msg, pdu, f"{pdu.info.get('reason') or 'undecodable'}; the rest of this direction is shown raw",
                       f"undecodable {human(pdu.seen)}")

    def _request_done(self, pdu: Pdu) -> None:
        if self._hello_pending and not pdu.junk and pdu.info["cmd"] != G.Cmd.HELLO and len(self._held) < 64:
            self._held.append(pdu)
            return
        msg = self._base(pdu, "request")
        if pdu.junk:
            self._junk(msg, pdu)
        else:
            p: _Pending = pdu.info["pending"]
            p.request = msg
            self._dissect_guarded(msg, self._dissect_request, pdu)
            if not self.answered(p.cmd):
                msg.attrs["answered"] = False  # SET_TENSOR since 2.0.0, GRAPH_COMPUTE since 3.5.0, …
        self._emit(msg)

    def _response_done(self, pdu: Pdu) -> None:
        msg = self._base(pdu, "response")
        if pdu.junk:
            self._junk(msg, pdu)
            self._emit(msg)
            return
        p: _Pending = pdu.info["pending"]
        self._dissect_guarded(msg, self._dissect_response, pdu, p.cmd)
        if p.request is not None:
            p.request.peer, msg.peer = msg, p.request
        self._emit(msg)
        if p.cmd == G.Cmd.HELLO:
            self._release_held()

    def _head_fields(self, msg: Message, kept: bytes, pdu: Pdu, request: bool) -> tuple[int, bytes]:
        size = pdu.info["size"]
        if request:
            cmd = pdu.info["cmd"]
            msg.add("ggml.cmd", cmd, 0, 1, show=f"{self.name(cmd)} ({cmd})")
            msg.add("ggml.size", size, 1, 8, show=_show("ggml.size", size))
            hs = 9
        else:
            msg.add("ggml.size", size, 0, 8, show=_show("ggml.size", size))
            hs = 8
        payload = kept[hs : hs + size]
        if pdu.ended_early:
            msg.note(f"size claims {human(size)}, stream ended after {human(max(0, pdu.seen - hs))}", ERROR)
        elif pdu.missing:
            msg.note(f"{human(pdu.missing_bytes)} of this message missing from the capture", WARN)
        return hs, payload

    def _dissect_request(self, msg: Message, pdu: Pdu) -> None:
        kept = bytes(pdu.kept)
        cmd, size = pdu.info["cmd"], pdu.info["size"]
        name = self.name(cmd)
        msg.attrs.update(cmd=Named(cmd, name), op=Named(cmd, name), payload_len=size, version=self._vstr())
        hs, payload = self._head_fields(msg, kept, pdu, True)
        whole = len(payload) == size
        detail = ""
        if cmd == G.Cmd.HELLO:
            if size == G.CONN_CAPS_SIZE and whole:
                self._client_caps = payload
                msg.add("ggml.hello.conn_caps", payload.hex(), hs, size,
                        show="zero (TCP only)" if not any(payload) else payload.hex(" "))
                detail = "≥ 4.0, caps " + ("zero" if not any(payload) else "set (RDMA)")
            elif size == 0:
                detail = "legacy (1.x–3.x)"
            else:
                msg.note(f"HELLO of {size} bytes (a server accepts 0 or 24)", ERROR)
        elif cmd == G.Cmd.SET_TENSOR:
            detail = self._set_tensor(msg, payload, hs, size)
        elif cmd == G.Cmd.GRAPH_COMPUTE:
            detail = self._graph(msg, payload, hs, size, whole)
        else:
            layout = G.request_layout(cmd, self.version, self.fork)
            if layout is None:
                if cmd not in self.table:
                    msg.note(f"command {cmd} unknown at protocol {self._vstr()}", WARN)
                if size:
                    msg.add("ggml.payload", payload[:64].hex(), hs, size, show=human(size))
            elif size != layout.sizeof():
                msg.note(f"{name} payload of {size} bytes, the layout at {self._vstr()} has {layout.sizeof()}"
                         " (the server closes the connection)", ERROR)
            elif whole:
                fields = construct_fields(layout, payload, hs, "ggml", _show)
                _fix_names(fields)
                msg.fields.extend(fields)
                detail = _brief(fields)
        msg.summary = f"{name}" + (f" {detail}" if detail else "") + ("" if self.answered(cmd) else " (no reply)")

    def _set_tensor(self, msg: Message, payload: bytes, hs: int, size: int) -> str:
        try:
            h = G.parse_set_tensor_header(payload, size, self.version)
        except CodecError as e:
            msg.note(f"SET_TENSOR: {e}", ERROR)
            return human(size)
        tf = construct_fields(G.RPC_TENSOR, payload[: G.RPC_TENSOR_SIZE], hs, "ggml.tensor", _show)
        t = msg.add("ggml.tensor", tensor_summary(h.tensor), hs, G.RPC_TENSOR_SIZE, show=repr(h.tensor.name_str))
        t.children = tf
        _fix_names([t])
        if h.cache_flag is not None:
            msg.add("ggml.cache_flag", h.cache_flag, hs + G.RPC_TENSOR_SIZE, 1)
        msg.add("ggml.offset", h.offset, hs + h.data_offset - 8, 8)
        msg.add("ggml.data", None, hs + h.data_offset, h.data_len, show=human(h.data_len))
        msg.attrs["data_len"] = h.data_len
        return f"{h.tensor.name_str!r} {human(h.data_len)} at +{h.offset}"

    def _graph(self, msg: Message, payload: bytes, hs: int, size: int, whole: bool) -> str:
        if not whole:
            msg.note("GRAPH_COMPUTE not fully captured; counts not decoded", NOTE)
            return human(size)
        try:
            g = G.parse_graph_compute(payload, self.version, allow_trailing=True)
        except CodecError as e:
            msg.note(f"GRAPH_COMPUTE: {e}", ERROR)
            return human(size)
        off = hs
        if g.device is not None:
            msg.add("ggml.device", g.device, off, 4)
            off += 4
        msg.add("ggml.graph.n_nodes", len(g.nodes), off, 4)
        nodes, _ = capped(g.nodes)
        msg.add("ggml.graph.nodes", nodes, off + 4, 8 * len(g.nodes), show=f"{len(g.nodes)} node ids")
        off += 4 + 8 * len(g.nodes)
        msg.add("ggml.graph.n_tensors", len(g.tensors), off, 4)
        tl = msg.add("ggml.graph.tensors", len(g.tensors), off + 4, G.RPC_TENSOR_SIZE * len(g.tensors),
                     show=f"{len(g.tensors)} tensors")
        for i, t in enumerate(g.tensors[:MAX_TENSORS_LISTED]):
            s = tensor_summary(t)
            tl.add("ggml.graph.tensor", s, off + 4 + i * G.RPC_TENSOR_SIZE, G.RPC_TENSOR_SIZE,
                   show=f"{s['name']!r} {s['type']} ne={s['ne']} op={s['op']}")
        msg.attrs.update(n_nodes=len(g.nodes), n_tensors=len(g.tensors))
        return f"device {g.device}: {len(g.nodes)} nodes, {len(g.tensors)} tensors" if g.device is not None else \
            f"{len(g.nodes)} nodes, {len(g.tensors)} tensors"

    def _dissect_response(self, msg: Message, pdu: Pdu, cmd: int) -> None:
        kept = bytes(pdu.kept)
        name = self.name(cmd)
        size = pdu.info["size"]
        msg.attrs.update(cmd=Named(cmd, name), op=Named(cmd, name), payload_len=size)
        hs, payload = self._head_fields(msg, kept, pdu, False)
        whole = len(payload) == size
        detail = ""
        if cmd == G.Cmd.HELLO and whole:
            try:
                hello = G.parse_hello_response(payload)
            except CodecError as e:
                msg.note(f"HELLO response: {e}", ERROR)
            else:
                v = hello.version
                msg.add("ggml.hello.version", ".".join(map(str, v)), hs, 3)
                if hello.caps is not None:
                    msg.add("ggml.hello.conn_caps", hello.caps.hex(), hs + 4, G.CONN_CAPS_SIZE,
                            show="zero (TCP only)" if not any(hello.caps) else hello.caps.hex(" "))
                self.version = v
                self.table = G.command_table(v, self.fork)
                msg.attrs["version"] = self._vstr()
                detail = f"protocol {self._vstr()}"
                if hello.caps and any(hello.caps) and self._client_caps and any(self._client_caps):
                    self.rdma = True
                    msg.note("both sides offered RDMA: later traffic may leave TCP; decoding may stop here", WARN)
        elif cmd == G.Cmd.GET_TENSOR:
            msg.add("ggml.data", None, hs, size, show=human(size))
            detail = human(size)
        else:
            info = self.table.get(cmd)
            expected = info.response_size if info else None
            if expected is not None and size != expected:
                msg.note(f"{name} response of {size} bytes, expected {expected} (the real client aborts)", ERROR)
            layout = G.response_layout(cmd, self.version, self.fork)
            if layout is not None and whole and size == layout.sizeof() and size:
                fields = construct_fields(layout, payload, hs, "ggml", _show)
                msg.fields.extend(fields)
                detail = _brief(fields)
            elif size:
                msg.add("ggml.payload", payload[:64].hex(), hs, size, show=human(size))
        msg.summary = f"{name}" + (f" {detail}" if detail else "")


def _brief(fields: list[Field]) -> str:
    parts = []
    for f in fields:
        short = f.name.rsplit(".", 1)[-1]
        if f.children:
            nm = f.value.get("name") if isinstance(f.value, dict) else None
            parts.append(f"{short}={nm!r}" if nm is not None else short)
        else:
            parts.append(f"{short}={f.display()}")
    s = " ".join(parts)
    return s if len(s) <= 160 else s[:159] + "…"
