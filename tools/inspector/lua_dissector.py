"""``hydra-rpc inspect --dissector > hydra.lua``: a Wireshark Lua dissector for Hydra framing.

Generated from the codec's construct headers (``codec.framing.REQUEST_HEADER`` /
``RESPONSE_HEADER``) and its enums, so the Lua and the Python cannot drift apart: a field
renamed, resized or moved in the codec changes the generated script, and a header change the
generator does not understand (a missing length field) fails generation instead of producing
a wrong dissector (kaitai-struct#50, tunneldigger PR #36: "keep in sync").

Use::

    tshark -o tcp.try_heuristic_first:TRUE -X lua_script:hydra.lua -r capture.pcap -Y hydra   # heuristic: 59 48 …
    tshark -X lua_script:hydra.lua -d tcp.port==9503,hydra -r capture.pcap
    tshark -X lua_script:hydra.lua -X lua_script1:port=40123 -r capture.pcap

Why ``tcp.try_heuristic_first``: by default TCP offers a segment to the dissector registered for
its lower port before any heuristic. A client's ephemeral port is sometimes one Wireshark knows
(8080, 1883, 44818, …); if that connection's first segment is a partial header, the other
dissector takes it and the request is lost. Heuristics first, and Hydra's own check (magic and a
known opcode) decides. A Lua script cannot set TCP's preferences, hence the option
(``TSHARK_OPTIONS``, what the tests run).

What a Wireshark user sees matches ``hydra-rpc inspect`` on the framing:

* PDUs are cut by the dissector itself (``desegment_offset``/``desegment_len``, and
  ``DESEGMENT_ONE_MORE_SEGMENT`` while a header is incomplete), so a header split across
  TCP segments reassembles;
* each connection keeps a FIFO of its requests (Hydra is one request at a time), so every
  response names the opcode it answers (``hydra.request_op``), the frame of its request
  (``hydra.request_in``; also ``hydra.response_to``) and the seconds since that request
  (``hydra.time``, as ``http.time``); a request names its response's frame
  (``hydra.response_in``) once the response has been seen: on a second pass (the GUI,
  ``tshark -2``), as HTTP's does;
* a response's meta is shown as text (``hydra.meta``) and, through Wireshark's JSON
  dissector, as a tree (``json.member``, ``json.key``, …);
* after a PIN DECODE (a JSON DECODE without ``"stream": false``) answered ``OK`` with no meta
  and no payload, the server side is ``[u32 len][piece]`` frames until it closes
  (``hydra.pin.piece``), as the inspector decodes it;
* a heuristic dissector claims a connection on any port whose first bytes are the magic and
  a known opcode.

Decisions that depend on earlier packets (direction, pairing, PIN mode) are made on the first
pass and remembered per frame and offset, so a second pass (the GUI, ``tshark -2``) shows the
same. Payload decoding per opcode stays the inspector's job.
"""
from __future__ import annotations

from string import Template

from construct import Struct

from codec.enums import Op, Status
from codec.framing import MAGIC, REQUEST_HEADER, RESPONSE_HEADER
from codec.payloads import PIECE_HEAD

from .layout import fixed_members, lua_type

DEFAULT_PORT = 9503
_HEX_FIELDS = {"magic", "op", "flags", "status"}
_VALUE_STRINGS = {"op": "op_names", "status": "status_names"}
TSHARK_OPTIONS = ("-o", "tcp.try_heuristic_first:TRUE")  # see the module docstring
MAX_DESEGMENT = 0x7FFFFFFF  # pinfo.desegment_len is a guint32; a larger claim waits for the end of the stream


def _fields(layout: Struct, side: str) -> tuple[list[str], dict[str, tuple[int, int, str]]]:
    """Lua ProtoField declarations and ``name → (offset, size, lua var)`` for one header."""
    decls, where = [], {}
    for name, off, size, inner in fixed_members(layout):
        kind = lua_type(inner, size)
        if kind is None:
            raise ValueError(f"{side} header member {name!r} is not an integer; update the Lua generator")
        var = f"f_{side}_{name}"
        base = "base.HEX" if name in _HEX_FIELDS else "base.DEC"
        vals = f", {_VALUE_STRINGS[name]}" if name in _VALUE_STRINGS else ""
        label = name.replace("_", " ").capitalize()
        decls.append(f'local {var} = ProtoField.{kind}("hydra.{name}", "{label}", {base}{vals})')
        where[name] = (off, size, var)
    return decls, where


def _need(where: dict[str, tuple[int, int, str]], *names: str) -> None:
    missing = [n for n in names if n not in where]
    if missing:
        raise ValueError(f"the codec header lacks {missing}; the Lua length function needs them")


def _read(where: dict[str, tuple[int, int, str]], name: str, tvb: str = "tvb", base: str = "offset") -> str:
    off, size, _ = where[name]
    if size == 8:
        return f"{tvb}({base} + {off}, 8):le_uint64():tonumber()"
    return f"{tvb}({base} + {off}, {size}):le_uint()"


def _adds(where: dict[str, tuple[int, int, str]], tree: str) -> str:
    return "\n".join(f"    {tree}:add_le({var}, buf({off}, {size}))" for off, size, var in where.values())


_LUA = Template(r'''-- Hydra engine RPC dissector for Wireshark/tshark.
-- GENERATED by `hydra-rpc inspect --dissector` from codec/framing.py (construct layouts)
-- and codec/enums.py. Do not edit: regenerate.
-- Usage: tshark -o tcp.try_heuristic_first:TRUE -X lua_script:hydra.lua -r capture.pcap -Y hydra
-- (heuristics first: a client port another dissector knows must not take a split first header)

local hydra = Proto("hydra", "Hydra engine RPC")
local op_names = { $ops }
local status_names = { $statuses }
$decls
local f_key = ProtoField.string("hydra.key", "Key")
local f_trace = ProtoField.string("hydra.trace", "Trace id")
local f_meta = ProtoField.string("hydra.meta", "Meta (JSON)")
local f_payload = ProtoField.bytes("hydra.payload", "Payload")
local f_dir = ProtoField.string("hydra.direction", "Direction")
local f_answers = ProtoField.uint8("hydra.request_op", "Answers", base.HEX, op_names)
local f_resp_to = ProtoField.framenum("hydra.response_to", "Response to the request in frame")
local f_request_in = ProtoField.framenum("hydra.request_in", "Request in frame", base.NONE, frametype.REQUEST)
local f_response_in = ProtoField.framenum("hydra.response_in", "Response in frame", base.NONE, frametype.RESPONSE)
local f_time = ProtoField.double("hydra.time", "Time since request (s)")
local f_piece_len = ProtoField.uint32("hydra.pin.len", "PIN piece length")
local f_piece = ProtoField.string("hydra.pin.piece", "PIN piece")
hydra.fields = { $field_vars, f_key, f_trace, f_meta, f_payload, f_dir, f_answers, f_resp_to,
                 f_request_in, f_response_in, f_time, f_piece_len, f_piece }
local ef_bad_magic = ProtoExpert.new("hydra.bad_magic", "Bad magic: the server closes without a reply",
                                     expert.group.MALFORMED, expert.severity.ERROR)
local ef_unpaired = ProtoExpert.new("hydra.unpaired", "Response with no request before it in the capture",
                                    expert.group.SEQUENCE, expert.severity.WARN)
hydra.experts = { ef_bad_magic, ef_unpaired }

hydra.prefs.port = Pref.uint("Server TCP port", $port, "TCP port of the engine")
local tcp_stream = Field.new("tcp.stream")
local json_dissector = Dissector.get("json")

-- `-X lua_script1:port=N` overrides the preference (preferences cannot be assigned).
local port_arg = nil
for _, a in ipairs({ ... }) do
    local p = string.match(a, "^port=(%d+)$$")
    if p then port_arg = tonumber(p) end
end
local function server_pref() return port_arg or hydra.prefs.port end

-- Per connection (tcp.stream): the server's port, the requests not answered yet (FIFO) and
-- whether the server side has turned into a PIN piece stream. Per frame and offset: what the
-- first pass decided, for later passes.
local conns = {}
local seen = {}
function hydra.init()
    conns = {}
    seen = {}
end

-- Client bytes in the Info column and item labels: printable ASCII, the rest as \xNN
-- (a piece may be half of a UTF-8 character).
local function printable(s)
    return (string.gsub(s, "[^\32-\126]", function(ch) return string.format("\\x%02x", string.byte(ch)) end))
end

local function has_magic(tvb, offset)
    return tvb:len() - offset >= 2 and tvb(offset + $magic_off, 1):uint() == 0x$magic_lo
        and tvb(offset + $magic_off + 1, 1):uint() == 0x$magic_hi
end

local function new_conn(server_port)
    return { server_port = server_port, pending = {}, head = 1, tail = 0, pin = false }
end

local function conn_of(tvb, pinfo)
    local s = tcp_stream()
    local key = s and tostring(s.value) or "?"
    local c = conns[key]
    if c == nil then
        local sp
        if has_magic(tvb, 0) then
            sp = pinfo.dst_port
        elseif pinfo.dst_port == server_pref() or pinfo.src_port == server_pref() then
            sp = server_pref()
        else
            sp = pinfo.dst_port
        end
        c = new_conn(sp)
        conns[key] = c
    end
    return c
end

-- A PIN DECODE is JSON (first non-space byte '{', no NUL in its first bytes) without "stream": false.
local function pin_request(buf, pos)
    if buf:len() <= pos then return false end
    local n = math.min(buf:len() - pos, 4096)
    local head = buf(pos, n):raw()
    local first = string.match(head, "^[ \t\r\n]*(.)")
    if first ~= "{" or string.find(string.sub(head, 1, 4), "\0", 1, true) then return false end
    return string.find(head, '"stream"%s*:%s*false') == nil
end

-- Length of the PDU at offset: a number, nil (header incomplete) or false (not Hydra).
local function pdu_len(tvb, offset, is_req, pin)
    local avail = tvb:len() - offset
    if is_req then
        if avail < 2 then return nil end
        if not has_magic(tvb, offset) then return false end
        if avail < $req_size then return nil end
        return $req_len
    end
    if pin then
        if avail < $piece_size then return nil end
        return $piece_size + tvb(offset, $piece_size):le_uint()
    end
    if avail < $resp_size then return nil end
    return $resp_len
end

local function dissect_request(buf, pinfo, tree, c, memo)
    local t = tree:add(hydra, buf())
    local op = $op_read
    local kl, tl = $kl, $tl
    t:add(f_dir, "request")
$req_adds
    local pos = $req_size
    -- one hydra.key per request, even an empty one, so key lists line up with hydra.op
    if kl > 0 then t:add_packet_field(f_key, buf(pos, kl), ENC_UTF_8) else t:add(f_key, "") end
    pos = pos + kl
    if tl > 0 then t:add_packet_field(f_trace, buf(pos, tl), ENC_UTF_8) end
    pos = pos + tl
    if buf:len() > pos then t:add(f_payload, buf(pos)) end
    if not pinfo.visited then
        c.tail = c.tail + 1
        memo.req = { op = op, frame = pinfo.number, ts = pinfo.abs_ts, pin = op == $decode and pin_request(buf, pos) }
        c.pending[c.tail] = memo.req
    end
    if memo.req.response_frame ~= nil then  -- known once its response was dissected (a second pass)
        t:add(f_response_in, memo.req.response_frame):set_generated()
    end
    local name = op_names[op] or string.format("0x%02X", op)
    local key = kl > 0 and printable(buf($req_size, kl):raw()) or ""
    t:append_text(": " .. name .. " key=" .. key)
    pinfo.cols.info:append(name .. " key=" .. key .. " ")
end

local function dissect_response(buf, pinfo, tree, c, memo)
    local t = tree:add(hydra, buf())
    local st = $st_read
    local ml = $ml
    t:add(f_dir, "response")
$resp_adds
    if ml > 0 then
        t:add_packet_field(f_meta, buf($resp_size, ml), ENC_UTF_8)
        -- the meta as a tree; the JSON dissector must not take over the columns
        local proto_col, info_col = tostring(pinfo.cols.protocol), tostring(pinfo.cols.info)
        pcall(function() json_dissector:call(buf($resp_size, ml):tvb(), pinfo, t) end)
        pinfo.cols.protocol = proto_col
        pinfo.cols.info:set(info_col)
    end
    if buf:len() > $resp_size + ml then t:add(f_payload, buf($resp_size + ml)) end
    if not pinfo.visited then
        local req = c.pending[c.head]
        if req ~= nil then
            c.pending[c.head] = nil
            c.head = c.head + 1
            memo.op, memo.frame, memo.time = req.op, req.frame, pinfo.abs_ts - req.ts
            req.response_frame = pinfo.number
            c.pin = req.pin and st == $ok and ml == 0 and $pl == 0
        end
    end
    local name = status_names[st] or string.format("0x%02X", st)
    if memo.op ~= nil then
        t:add(f_answers, memo.op):set_generated()
        t:add(f_resp_to, memo.frame):set_generated()
        t:add(f_request_in, memo.frame):set_generated()
        t:add(f_time, memo.time):set_generated()
        local op = op_names[memo.op] or string.format("0x%02X", memo.op)
        t:append_text(": " .. name .. " (" .. op .. ")")
        pinfo.cols.info:append(name .. " (" .. op .. ") ")
    else
        t:add_proto_expert_info(ef_unpaired)
        t:append_text(": " .. name)
        pinfo.cols.info:append(name .. " ")
    end
end

local function dissect_piece(buf, pinfo, tree)
    local t = tree:add(hydra, buf())
    local n = buf(0, $piece_size):le_uint()
    t:add(f_dir, "response")
    t:add_le(f_piece_len, buf(0, $piece_size))
    local text = ""
    if n > 0 then
        t:add_packet_field(f_piece, buf($piece_size, n), ENC_UTF_8)
        text = printable(buf($piece_size, n):raw())
    end
    t:append_text(': PIN piece "' .. text .. '"')
    pinfo.cols.info:append('PIN "' .. text .. '" ')
end

function hydra.dissector(tvb, pinfo, tree)
    local len = tvb:len()
    if len == 0 then return 0 end
    pinfo.cols.protocol = "HYDRA"
    pinfo.cols.info:clear()
    local c = conn_of(tvb, pinfo)
    local is_req = pinfo.dst_port == c.server_port
    local offset = 0
    while offset < len do
        local key = pinfo.number .. ":" .. offset .. ":" .. (is_req and "q" or "r")
        local memo = seen[key]
        if memo == nil then
            memo = { pin = not is_req and c.pin }
            seen[key] = memo
        end
        local n = pdu_len(tvb, offset, is_req, memo.pin)
        if n == false then
            local t = tree:add(hydra, tvb(offset))
            t:add_proto_expert_info(ef_bad_magic)
            pinfo.cols.info:append("not Hydra: bad magic ")
            return len
        end
        if n == nil then
            pinfo.desegment_offset = offset
            pinfo.desegment_len = DESEGMENT_ONE_MORE_SEGMENT
            return len
        end
        if offset + n > len then
            pinfo.desegment_offset = offset
            pinfo.desegment_len = math.min(offset + n - len, $max_desegment)
            return len
        end
        local buf = tvb(offset, n):tvb()
        if is_req then
            dissect_request(buf, pinfo, tree, c, memo)
        elseif memo.pin then
            dissect_piece(buf, pinfo, tree)
        else
            dissect_response(buf, pinfo, tree, c, memo)
        end
        offset = offset + n
    end
    return offset
end

-- Any port: a connection whose first bytes are the magic and a known opcode is Hydra. Two
-- bytes of magic are enough to claim a segment that splits the first header.
local function heuristic(tvb, pinfo, tree)
    if not has_magic(tvb, 0) then return false end
    if tvb:len() > $op_off and op_names[tvb($op_off, 1):uint()] == nil then return false end
    local s = tcp_stream()
    if s and conns[tostring(s.value)] == nil then
        conns[tostring(s.value)] = new_conn(pinfo.dst_port)
    end
    pinfo.conversation = hydra
    hydra.dissector(tvb, pinfo, tree)
    return true
end

hydra:register_heuristic("tcp", heuristic)
DissectorTable.get("tcp.port"):add(server_pref(), hydra)
''')


def generate() -> str:
    req_decls, req = _fields(REQUEST_HEADER, "req")
    resp_decls, resp = _fields(RESPONSE_HEADER, "resp")
    _need(req, "magic", "op", "key_len", "trace_len", "payload_len")
    _need(resp, "status", "meta_len", "payload_len")
    req_size, resp_size = REQUEST_HEADER.sizeof(), RESPONSE_HEADER.sizeof()
    # Both headers have a payload_len: two ProtoFields with one abbreviation and one type,
    # which Wireshark allows (the filter hydra.payload_len matches either).
    field_vars = [v for _, _, v in req.values()] + [v for _, _, v in resp.values()]
    return _LUA.substitute(
        ops=", ".join(f"[0x{int(o):02x}] = \"{o.name}\"" for o in Op),
        statuses=", ".join(f"[{int(s)}] = \"{s.name}\"" for s in Status),
        decls="\n".join(req_decls + resp_decls), field_vars=", ".join(field_vars), port=DEFAULT_PORT,
        magic_off=req["magic"][0], magic_lo=f"{MAGIC & 0xFF:02x}", magic_hi=f"{MAGIC >> 8:02x}",
        op_off=req["op"][0], req_size=req_size, resp_size=resp_size, piece_size=PIECE_HEAD.sizeof(),
        req_len=" + ".join([str(req_size), _read(req, "key_len"), _read(req, "trace_len"), _read(req, "payload_len")]),
        resp_len=" + ".join([str(resp_size), _read(resp, "meta_len"), _read(resp, "payload_len")]),
        op_read=_read(req, "op", "buf", "0"), kl=_read(req, "key_len", "buf", "0"),
        tl=_read(req, "trace_len", "buf", "0"), st_read=_read(resp, "status", "buf", "0"),
        ml=_read(resp, "meta_len", "buf", "0"), pl=_read(resp, "payload_len", "buf", "0"),
        req_adds=_adds(req, "t"), resp_adds=_adds(resp, "t"), decode=f"0x{int(Op.DECODE):02x}",
        ok=int(Status.OK), max_desegment=f"0x{MAX_DESEGMENT:X}",
    )
