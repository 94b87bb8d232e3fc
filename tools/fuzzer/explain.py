"""What a finding's report says about it: the input that caused it, tracebacks the target
logged, and memory growth the client asked for.

* ``describe_input(case)`` — the first request's opcode, key and payload as the bytes say
  (header fields taken as they are, lies included), plus the field the generator mutated
  and the value it put there;
* ``tracebacks(text)`` — Python tracebacks in a slice of ``target.log`` (plain or JSON log
  lines), each as (exception line, innermost frame, whole text);
* ``requested_growth(out)`` — did a reply in this case accept a setting that rebuilds the
  context or model (CONFIGURE / ``hydra_config`` of a T2/T3 key)? Then a memory jump is the
  target doing what it was told, not a finding.
"""
from __future__ import annotations

import json
import re
import struct
from typing import Any

from codec.enums import op_name
from codec.frames import split_frames

from .cases import Case

_REQ = struct.Struct("<HBBHQH")
REBUILD_TIERS = ("T2", "T3", "T4")
_TB_HEAD = "Traceback (most recent call last):"
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def _text(b: bytes, limit: int = 48) -> str:
    """Bytes as text when they are printable UTF-8, else as a bytes literal."""
    try:
        s = b.decode("utf-8")
        if s.isprintable():
            return repr(s[:limit]) + ("…" if len(s) > limit else "")
    except UnicodeDecodeError:
        pass
    return repr(b[:limit]) + ("…" if len(b) > limit else "")


def first_frame(data: bytes) -> dict[str, Any] | None:
    """The first request header in ``data``, fields as sent (no validation), and what followed it."""
    if len(data) < _REQ.size:
        return None
    magic, op, flags, key_len, payload_len, trace_len = _REQ.unpack_from(data)
    body = data[_REQ.size:]
    key = body[:key_len]
    payload = body[key_len + trace_len:key_len + trace_len + payload_len]
    out: dict[str, Any] = {"op": op_name(op), "key": _text(key), "payload_len": payload_len}
    if magic != 0x4859:
        out["magic"] = data[:2].hex(" ")
    if flags:
        out["flags"] = f"0x{flags:02x}"
    if len(payload) != payload_len:
        out["payload_sent"] = len(payload)
    if payload:
        out["payload"] = _text(payload, 80)
    return out


def describe_input(case: Case) -> dict[str, Any]:
    """opcode, key, the mutated field and its value — what the summary shows for a finding."""
    data = b"".join(m.data for m in case.messages)
    d: dict[str, Any] = {"generator": case.generator, "note": case.note}
    if case.program is not None:
        d["program"] = case.note
        ops = [str(s.get("op", "?")) for s in case.program if isinstance(s, dict)]
        d["op"] = " → ".join(ops[:8]) + (" …" if len(ops) > 8 else "")
    elif case.decoder is not None:
        d["op"] = f"decoder {case.decoder}"
        d["payload_len"] = len(data)
    else:
        f = first_frame(data)
        if f is not None:
            d.update(f)
        elif data:
            d["op"] = f"{len(data)} bytes (less than a header)"
        if len(case.messages) > 1 or (f and len(data) > 16 + f["payload_len"] + 64):
            d["messages"] = len(case.messages)
        if case.messages and case.messages[-1].then != "none":
            d["then"] = case.messages[-1].then.upper()
    if case.mutated:
        d["field"], d["value"] = case.mutated.get("field", ""), case.mutated.get("value", "")
    return d


def input_line(d: dict[str, Any]) -> str:
    """One line: ``CONFIGURE key '' (payload_len 20: '{"n_ctx":16777216}') — n_ctx = 16777216``."""
    if "program" in d:
        head = f"stateful program {d['program'][:140]}"
    else:
        head = f"{d.get('op', '?')}"
        if "key" in d:
            head += f" key {d['key']}"
        extras = []
        for k in ("magic", "flags"):
            if k in d:
                extras.append(f"{k} {d[k]}")
        if "payload_len" in d:
            pl = f"payload_len {d['payload_len']}"
            if "payload_sent" in d:
                pl += f" ({d['payload_sent']} sent)"
            if "payload" in d:
                pl += f": {d['payload']}"
            extras.append(pl)
        if d.get("messages"):
            extras.append(f"{d['messages']} message(s)")
        if d.get("then"):
            extras.append(f"then {d['then']}")
        if extras:
            head += " (" + ", ".join(extras) + ")"
    if d.get("field"):
        mut = f"mutated {d['field']} = {d['value']}"
    else:
        mut = d.get("note", "")
    return f"{head} — {d.get('generator', '?')}: {mut}"


# ------------------------------------------------------------------------------ tracebacks
def _expand_json_lines(text: str) -> str:
    """JSON log lines carry a traceback inside a string: unfold those strings."""
    out = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("{") and "Traceback" in s:
            try:
                obj = json.loads(s)
            except ValueError:
                out.append(line)
                continue
            out.extend(str(v) for v in (obj.values() if isinstance(obj, dict) else [obj]))
        else:
            out.append(line)
    return "\n".join(out)


_CHAIN = ("During handling", "The above exception")


def tracebacks(text: str) -> list[tuple[str, str, str]]:
    """(exception line, innermost frame "path:line in func", whole traceback) for each
    Python traceback in ``text``; a chained one ("During handling …") counts once, by its last
    exception. A log format that indents the traceback (or prefixes each line) is read relative
    to the "Traceback" line's own prefix."""
    lines = _expand_json_lines(text).splitlines()
    n = len(lines)
    found: list[tuple[str, str, str]] = []
    i = 0
    while i < n:
        at = lines[i].find(_TB_HEAD)
        if at < 0:
            i += 1
            continue
        prefix = lines[i][:at]
        start, frame, exc = i, "", ""

        def body(k: int) -> str | None:
            """Line k without the traceback's prefix (None: not part of the traceback)."""
            line = lines[k]
            if line.startswith(prefix):
                return line[len(prefix):]
            return "" if not line.strip() and not prefix.strip() else None

        i += 1
        while i < n:
            line = body(i)
            if line is None:
                break
            if _TB_HEAD in line or line.startswith(_CHAIN) or not line.strip() or line[0] in " \t":
                m = _FRAME.search(line)
                if m:
                    frame = f"{m.group(1)}:{m.group(2)} in {m.group(3)}"
                i += 1
                continue
            exc = line.strip()
            i += 1
            j = i
            while j < n and body(j) == "":
                j += 1
            nxt = body(j) if j < n else None
            if nxt is not None and nxt.startswith(_CHAIN):
                i = j
                continue
            break
        found.append((exc or "(no exception line)", frame, "\n".join(lines[start:i])[-4000:]))
    return found


def exception_type(exc_line: str) -> str:
    head = exc_line.split(":", 1)[0].strip()
    return head.rsplit(".", 1)[-1] if re.fullmatch(r"[\w.]+", head) else "unknown"


# ------------------------------------------------------------------------------ requested memory
def config_asked(sent: list[bytes]) -> str | None:
    """If a request of this case carried a ``hydra_config`` (PREFILL and DECODE may: the engine
    rebuilds for it before it answers), say which keys: the memory is what it asked for."""
    for frame in split_frames(b"".join(sent)).frames:
        try:
            body = json.loads(frame.payload)
        except ValueError:
            continue
        config = body.get("hydra_config") if isinstance(body, dict) else None
        if isinstance(config, dict) and config:
            return (f"the request's hydra_config asked for {', '.join(map(str, list(config)[:6]))}: "
                    "the memory is what the request asked for")
    return None


def requested_growth(responses: list[dict[str, Any]]) -> str | None:
    """If a reply in this case accepted a setting that rebuilds the context or the model, say
    which: the memory it takes is what the client asked for."""
    for r in responses:
        meta = r.get("meta") if isinstance(r, dict) else None
        if not isinstance(meta, dict) or r.get("status") != "OK":
            continue
        keys = list(meta.get("deferred_keys") or []) + list((meta.get("params_applied") or {}).keys())
        reload = meta.get("reload")
        tier = meta.get("tier")
        if keys and (reload or tier in REBUILD_TIERS):
            return (f"the target accepted {', '.join(map(str, keys[:6]))} (tier {tier or '?'}) and rebuilt for it: "
                    "the memory is what the request asked for")
    return None
