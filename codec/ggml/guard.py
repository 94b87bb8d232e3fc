"""What one ggml-RPC session may send to an rpc-server: the passthrough's guard, sans-IO.

llama.cpp's rpc-server trusts its client: a SET_TENSOR claiming 2^64−1 bytes throws out of
``std::vector::resize``, a tensor whose ``data`` lies outside its buffer trips a GGML_ASSERT,
an op number past ``enum ggml_op`` or a null graph node crashes the compute, and the custom
ops call a function pointer taken from the wire. The guard follows a session in both
directions and refuses, before a byte of it is forwarded, any frame the server would crash on
or that reaches outside this session's own buffers (docs/ggml.md lists the rules). ggml-RPC
has no error frame, so a refusal (:class:`Refused`) ends the session: the relay closes both
sides.

Shape: :class:`SessionGuard` holds the state both directions share — the buffers this session
allocated (learnt from ALLOC_BUFFER and BUFFER_GET_BASE replies) and the FIFO of requests
awaiting a reply. ``guard.requests.feed(data)`` / ``guard.responses.feed(data)`` return the
chunks that may be forwarded now, in order — memoryview slices of ``data`` where possible
(zero copy) — and leave a payload's unparsed remainder to ``body_left``, which a relay may
move itself (``consume_body``), e.g. with ``os.splice``. The relay runs one thread per
direction, so every field below has exactly one writing direction (noted at each).

The session starts after the relay's own HELLO with the server: the client's HELLO is
answered locally (``to_client``) with the server's version and zero conn_caps, which keeps
both ends on TCP (no RDMA behind a proxy).
"""
from __future__ import annotations

import struct
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import CodecError, RemoteProtocolError
from .commands import CONN_CAPS_SIZE, Cmd, at_least, command_table, normalize_version, request_layout
from .fast import FastLayout, fast_layout
from .framing import REQUEST_HEADER_STRUCT, RESPONSE_HEADER_STRUCT, Buffer, encode_hello_response
from .payloads import parse_graph_compute, set_tensor_header_size
from .tables import TypeTraits, enums_for
from .tensor import RPC_TENSOR_STRUCT, RpcTensor, tensor_from_flat

MAX_GRAPH_BYTES = 16 << 20  # a graph is ids and tensor headers: 56k tensors, 10× a large model's
MAX_GRAPH_DEPTH = 10_000  # the server rebuilds a graph recursively: a deep chain overflows its stack
SMALL_REPLY = 64 << 10
_INT64_MAX = (1 << 63) - 1
_U64 = struct.Struct("<Q")


class Refused(RemoteProtocolError):
    """The client sent what the guard will not pass on; the session is closed (no error frame
    exists). Also raised for a reply from the server that the real client would abort on."""

    recoverable = False
    approved: tuple | list = ()  # set by feed(): the chunks approved before the refused frame


@dataclass(slots=True)
class _RemoteBuffer:
    size: int
    base: int | None = None  # known once a BUFFER_GET_BASE reply passed


class SessionGuard:
    def __init__(self, version: Iterable[int], *, max_alloc_bytes: int, max_graph_bytes: int = MAX_GRAPH_BYTES):
        self.version = normalize_version(version)
        self.table = command_table(self.version)
        self.enums = enums_for(self.version)  # None: op numbers cannot be checked at this version
        self.max_alloc_bytes = max_alloc_bytes
        self.max_graph_bytes = max_graph_bytes
        self.set_tensor_head = set_tensor_header_size(self.version)
        self.hello_size = CONN_CAPS_SIZE if at_least(self.version, 4) else 0
        self._types = (self.enums or _NEWEST).types
        self._fast: dict[int, FastLayout] = {}
        self.buffers: dict[int, _RemoteBuffer] = {}  # added by responses, removed by requests
        self.pending: deque[tuple[int, int]] = deque()  # (cmd, arg) appended by requests, popped by responses
        self.requested = 0  # requests: ALLOC_BUFFER sizes asked for
        self.freed = 0  # requests: sizes of buffers freed
        self.granted = 0  # responses: sizes of buffers allocated
        self.answered = 0  # responses: the asked-for sizes of ALLOC_BUFFERs answered
        self.requests = RequestGuard(self)
        self.responses = ResponseGuard(self)

    @property
    def allocated(self) -> int:
        """Bytes this session holds on the server, counting allocations still unanswered."""
        return self.granted - self.freed + self.requested - self.answered

    def buffer_of(self, t: RpcTensor) -> _RemoteBuffer:
        buf = self.buffers.get(t.buffer)
        if buf is None:
            raise Refused(f"tensor {t.name_str!r}: buffer 0x{t.buffer:x} is not one of this session's buffers",
                          rule="ggml.guard.buffer")
        if buf.base is None:
            raise Refused(f"tensor {t.name_str!r}: buffer 0x{t.buffer:x} used before BUFFER_GET_BASE",
                          rule="ggml.guard.base")
        return buf

    def layout(self, cmd: int) -> FastLayout:
        fast = self._fast.get(cmd)
        if fast is None:
            fast = self._fast[cmd] = fast_layout(request_layout(cmd, self.version))
        return fast

    def traits(self, t: RpcTensor) -> TypeTraits:
        traits = self._types[t.type] if t.type < len(self._types) else None
        if traits is None:
            raise Refused(f"tensor {t.name_str!r}: type {t.type} is not a ggml type", rule="ggml.guard.type")
        return traits

    def check_tensor(self, t: RpcTensor, *, needs_buffer: bool = True) -> None:
        """What ``deserialize_tensor`` asserts, plus: a tensor names this session's buffers only."""
        traits = self.traits(t)
        ne = t.ne
        if ne[1] > 1 or ne[2] > 1 or ne[3] > 1:  # as ggml_new_tensor_impl's GGML_ASSERT, for 4 dims
            n = ne[0]
            for d in ne[1:]:
                if d > 1:
                    if _INT64_MAX // d <= n:
                        raise Refused(f"tensor {t.name_str!r}: {ne} elements overflow int64", rule="ggml.guard.ne")
                    n *= d
        if t.buffer == 0:
            if needs_buffer or t.data:
                raise Refused(f"tensor {t.name_str!r} has no buffer", rule="ggml.guard.buffer")
            return
        buf = self.buffer_of(t)
        if not (buf.base <= t.data and t.data + nbytes(t, traits.block_size, traits.type_size) <= buf.base + buf.size):
            raise Refused(f"tensor {t.name_str!r} at 0x{t.data:x} lies outside its buffer "
                          f"[0x{buf.base:x}, +{buf.size})", rule="ggml.guard.bounds")

    def check_region(self, t: RpcTensor, offset: int, size: int, what: str, *, in_tensor: bool = True) -> None:
        """``[data + offset, + size)`` inside the tensor's buffer (the server's own sanitize check)
        and, for a read or write of the tensor, inside the tensor (ggml_backend_tensor_set/get
        GGML_ASSERT it; the server does not check)."""
        buf = self.buffer_of(t)
        p, end = t.data + offset, buf.base + buf.size
        if not buf.base <= p < end or size > end - p:
            raise Refused(f"{what}: {size} bytes at 0x{p:x} outside buffer [0x{buf.base:x}, +{buf.size})",
                          rule="ggml.guard.region")
        if in_tensor and size:
            traits = self.traits(t)
            if offset + size > nbytes(t, traits.block_size, traits.type_size):
                raise Refused(f"{what}: {size} bytes at +{offset} past the end of tensor {t.name_str!r}",
                              rule="ggml.guard.region")

    def check_op(self, t: RpcTensor) -> None:
        if self.enums is None:
            return
        if t.op >= len(self.enums.ops):
            raise Refused(f"tensor {t.name_str!r}: op {t.op} is not a ggml op at protocol "
                          f"{'.'.join(map(str, self.version))}", rule="ggml.guard.op")
        if t.op in self.enums.custom_ops:
            raise Refused(f"tensor {t.name_str!r}: op {self.enums.ops[t.op]} carries a host function pointer",
                          rule="ggml.guard.custom_op")


_NEWEST = enums_for((7, 0, 0))


def nbytes(t: RpcTensor, block_size: int, type_size: int) -> int:
    """``ggml_nbytes`` in exact arithmetic (the server's wraps at 2^64; exact never passes a bound it fails)."""
    ne, nb = t.ne, t.nb
    if 0 in ne:
        return 0
    rest = (ne[1] - 1) * nb[1] + (ne[2] - 1) * nb[2] + (ne[3] - 1) * nb[3]
    if block_size == 1:
        return type_size + (ne[0] - 1) * nb[0] + rest
    return ne[0] * nb[0] // block_size + rest


class _Filter:
    """One direction: header, then the first ``inspect`` payload bytes checked, then the rest
    (``body_left``) passed through unparsed."""

    _HEADER: struct.Struct

    def __init__(self, guard: SessionGuard):
        self.g = guard
        self.body_left = 0
        self._held = bytearray()  # a header (and inspected head) split across feeds
        self._inspect: int | None = None  # decided for the frame being held
        self._size = 0

    @property
    def wanted(self) -> int:
        """Bytes that must arrive before anything more can be decided or forwarded: the rest of
        the header or of the checked head, else the payload left. A relay can sleep until then
        (SO_RCVLOWAT) instead of waking for every segment of a frame."""
        if self.body_left:
            return self.body_left
        hs = self._HEADER.size
        return (hs if self._inspect is None else hs + self._inspect) - len(self._held)

    def consume_body(self, n: int) -> None:
        if not 0 <= n <= self.body_left:
            raise ValueError(f"consume_body({n}) with {self.body_left} left")
        self.body_left -= n

    def feed(self, data: Buffer) -> list[Buffer]:
        """The chunks of ``data`` that may be forwarded now, in order. A refusal carries what was
        approved before the refused frame (``Refused.approved``): an rpc-server reading the same
        stream would have acted on those frames before it closed."""
        mv = memoryview(data)
        out: list[Buffer] = []
        a = b = 0  # approved bytes mv[a:b] not yet in out (inlined: this runs per received chunk)
        pos, n = 0, len(mv)
        header = self._HEADER
        hs = header.size
        try:
            while pos < n:
                if self.body_left:
                    take = min(self.body_left, n - pos)
                    if b != pos:
                        if b > a:
                            out.append(mv[a:b])
                        a = pos
                    pos += take
                    b = pos
                    self.body_left -= take
                    continue
                if not self._held and n - pos >= hs:  # fast path: the header is here whole
                    fields = header.unpack_from(mv, pos)
                    size = self._size = fields[-1]
                    inspect = self._on_header(*fields)
                    end = pos + hs + inspect
                    if end <= n:
                        if self._on_head(mv[pos + hs : end]):
                            if b != pos:
                                if b > a:
                                    out.append(mv[a:b])
                                a = pos
                            b = end
                        pos = end
                        self.body_left = size - inspect
                        continue
                    self._inspect = inspect
                pos, frame = self._gather(mv, pos, n)  # slow path: a header or head split across feeds
                if frame is not None:
                    if b > a:
                        out.append(mv[a:b])
                    a = b = pos
                    out.append(frame)
        except Refused as e:
            if b > a:
                out.append(mv[a:b])
            e.approved = out
            raise
        if b > a:
            out.append(mv[a:b])
        return out

    def _gather(self, mv: memoryview, pos: int, n: int) -> tuple[int, Buffer | None]:
        """Add to ``_held`` what ``mv[pos:n]`` has of the header or inspected head; returns the
        position after it and, once the head is whole and the frame forwarded, the held bytes."""
        hs = self._HEADER.size
        take = min((hs if self._inspect is None else hs + self._inspect) - len(self._held), n - pos)
        self._held += mv[pos : pos + take]
        pos += take
        if self._inspect is None and len(self._held) >= hs:
            fields = self._HEADER.unpack_from(self._held)
            self._size = fields[-1]
            self._inspect = self._on_header(*fields)
        if self._inspect is None or len(self._held) < hs + self._inspect:
            return pos, None
        frame = bytes(self._held) if self._on_head(memoryview(self._held)[hs:]) else None
        self.body_left = self._size - self._inspect
        self._held = bytearray()  # a new one: a held graph's memory is given back at once
        self._inspect = None
        return pos, frame

    def _on_header(self, *fields: int) -> int:
        """Check a header; return how many payload bytes must be seen before forwarding."""
        raise NotImplementedError

    def _on_head(self, head: memoryview) -> bool:
        """Check the inspected bytes; return whether the frame is forwarded (else dropped)."""
        raise NotImplementedError


class RequestGuard(_Filter):
    """Client → server. ``to_client`` collects the replies the guard gives itself (the HELLO);
    a relay sends them before forwarding anything else."""

    _HEADER = REQUEST_HEADER_STRUCT

    def __init__(self, guard: SessionGuard):
        super().__init__(guard)
        self.to_client: list[bytes] = []
        self._hello_done = False
        self._cmd = 0

    def _on_header(self, cmd: int, size: int) -> int:
        g = self.g
        self._cmd = cmd
        if not self._hello_done:
            if cmd != Cmd.HELLO or size != g.hello_size:
                raise Refused(f"a session starts with a HELLO of {g.hello_size} bytes, not command {cmd} of "
                              f"{size} bytes", rule="ggml.guard.hello")
            return size
        info = g.table.get(cmd)
        if info is None or cmd == Cmd.HELLO:
            raise Refused(f"command {cmd} is not allowed here at protocol {_v(g)}", rule="ggml.guard.cmd")
        if cmd == Cmd.SET_TENSOR:
            head = g.set_tensor_head
            if size < head:
                raise Refused(f"SET_TENSOR of {size} bytes is shorter than its {head}-byte head",
                              rule="ggml.guard.size")
            return head
        if cmd == Cmd.GRAPH_COMPUTE:
            if size > g.max_graph_bytes:
                raise Refused(f"GRAPH_COMPUTE of {size} bytes > {g.max_graph_bytes}", rule="ggml.guard.graph_size")
            return size
        if size != info.request_size:
            raise Refused(f"{info.name} payload of {size} bytes, the layout at {_v(g)} has {info.request_size}",
                          rule="ggml.guard.size")
        return size

    def _on_head(self, head: memoryview) -> bool:
        g, cmd = self.g, self._cmd
        if not self._hello_done:
            self._hello_done = True
            self.to_client.append(encode_hello_response(g.version))
            return False
        if cmd == Cmd.SET_TENSOR:
            arg = self._set_tensor(head)
        elif cmd == Cmd.GRAPH_COMPUTE:
            arg = self._graph(head)
        else:
            arg = self._fixed(cmd, g.layout(cmd).unpack(head))
        if g.table[cmd].has_response:
            g.pending.append((cmd, arg))
        return True

    def _set_tensor(self, head: memoryview) -> int:
        t = tensor_from_flat(RPC_TENSOR_STRUCT.unpack_from(head))
        offset = _U64.unpack_from(head, len(head) - 8)[0]
        self.g.check_tensor(t)
        self.g.check_region(t, offset, self._size - len(head), "SET_TENSOR")
        return 0

    def _fixed(self, cmd: int, f: dict) -> int:
        g = self.g
        if cmd == Cmd.ALLOC_BUFFER:
            if g.allocated + f["size"] > g.max_alloc_bytes:
                raise Refused(f"ALLOC_BUFFER of {f['size']} bytes: the session would hold more than "
                              f"{g.max_alloc_bytes}", rule="ggml.guard.alloc")
            g.requested += f["size"]
            return f["size"]
        if cmd in (Cmd.BUFFER_GET_BASE, Cmd.FREE_BUFFER, Cmd.BUFFER_CLEAR):
            ptr = f["remote_ptr"]
            if ptr not in g.buffers:
                raise Refused(f"{Cmd(cmd).name} of 0x{ptr:x}, not one of this session's buffers",
                              rule="ggml.guard.buffer")
            if cmd == Cmd.FREE_BUFFER:
                g.freed += g.buffers.pop(ptr).size
            return ptr
        if cmd in (Cmd.GET_TENSOR, Cmd.MEMSET_TENSOR, Cmd.SET_TENSOR_HASH):
            t = f["tensor"]
            g.check_tensor(t)
            g.check_region(t, f["offset"], f.get("size", 0), Cmd(cmd).name)
            return f.get("size", 0)
        if cmd == Cmd.COPY_TENSOR:
            src, dst = f["src"], f["dst"]
            g.check_tensor(src)
            g.check_tensor(dst)
            traits = g.traits(src)
            size = nbytes(src, traits.block_size, traits.type_size)
            g.check_region(dst, 0, size, "COPY_TENSOR", in_tensor=False)  # the server copies nbytes(src)
        elif "tensor" in f:  # INIT_TENSOR, GET_ALLOC_SIZE, GET_DEVICE_SUPPORTS_OP: may be unallocated
            for t in (f["tensor"], *f.get("srcs", ())):
                if t is f["tensor"] or t.id:
                    g.check_tensor(t, needs_buffer=False)
            if cmd == Cmd.GET_DEVICE_SUPPORTS_OP:
                g.check_op(f["tensor"])
        return 0

    def _graph(self, payload: memoryview) -> int:
        """Every tensor checked; sources listed before their consumers (as llama.cpp's client
        serializes them), which bounds the server's recursion; nodes unique and not null."""
        g = self.g
        try:
            graph = parse_graph_compute(payload, g.version)
        except CodecError as e:
            raise Refused(str(e), rule=e.rule) from None
        depth: dict[int, int] = {}
        for t in graph.tensors:
            if t.id == 0 or t.id in depth:
                raise Refused(f"GRAPH_COMPUTE lists tensor id 0x{t.id:x} as {'null' if not t.id else 'twice'}",
                              rule="ggml.guard.graph_id")
            g.check_tensor(t)
            g.check_op(t)
            d = 0
            for s in (*t.src, t.view_src):
                if s:
                    ds = depth.get(s)
                    if ds is None:
                        raise Refused(f"GRAPH_COMPUTE tensor {t.name_str!r} uses 0x{s:x}, not an earlier tensor",
                                      rule="ggml.guard.graph_src")
                    d = max(d, ds)
            if d >= MAX_GRAPH_DEPTH:
                raise Refused(f"GRAPH_COMPUTE deeper than {MAX_GRAPH_DEPTH}", rule="ggml.guard.graph_depth")
            depth[t.id] = d + 1
        if len(set(graph.nodes)) != len(graph.nodes):
            raise Refused("GRAPH_COMPUTE lists a node twice", rule="ggml.guard.graph_node")
        for node in graph.nodes:
            if node not in depth:
                raise Refused(f"GRAPH_COMPUTE node 0x{node:x} is {'null' if not node else 'not a tensor of it'}",
                              rule="ggml.guard.graph_node")
        return 0


class ResponseGuard(_Filter):
    """Server → client: learns the session's buffers before their replies reach the client,
    and holds the server to the reply sizes the real client checks."""

    _HEADER = RESPONSE_HEADER_STRUCT
    _WATCHED = (Cmd.ALLOC_BUFFER, Cmd.BUFFER_GET_BASE)

    def __init__(self, guard: SessionGuard):
        super().__init__(guard)
        self._cmd = 0
        self._arg = 0

    def _on_header(self, size: int) -> int:
        g = self.g
        if not g.pending:
            raise Refused("the server sent a reply no request was waiting for", rule="ggml.guard.unsolicited")
        self._cmd, self._arg = g.pending.popleft()
        want = self._arg if self._cmd == Cmd.GET_TENSOR else g.table[self._cmd].response_size
        if size != want:
            raise Refused(f"the server's {g.table[self._cmd].name} reply is {size} bytes, not {want} "
                          "(the client would abort)", rule="ggml.guard.reply_size")
        # small replies are checked whole, so a reply goes on in one piece (header with payload)
        return size if self._cmd in self._WATCHED or size <= SMALL_REPLY else 0

    def _on_head(self, head: memoryview) -> bool:
        g = self.g
        if self._cmd == Cmd.ALLOC_BUFFER:
            ptr, size = _U64.unpack_from(head)[0], _U64.unpack_from(head, 8)[0]
            if ptr:
                g.buffers[ptr] = _RemoteBuffer(size)
                g.granted += size
            g.answered += self._arg
        elif self._cmd == Cmd.BUFFER_GET_BASE:
            buf = g.buffers.get(self._arg)
            if buf is not None:
                buf.base = _U64.unpack_from(head)[0]
        return True


def _v(g: SessionGuard) -> str:
    return ".".join(map(str, g.version)) if g.version else "v0"
