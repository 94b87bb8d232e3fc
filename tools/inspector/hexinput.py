"""``--hex``: bytes pasted from a log, in whatever hex form the log used.

Accepted: plain hex (``5948430001…``), bytes separated by spaces, colons, commas or dashes,
``0x`` / ``\\x`` prefixes, Python ``b'...'`` reprs with ``\\xNN`` escapes, and dump lines
with an offset column and an ASCII column (``xxd``, ``hexdump -C``, ``od -A x -t x1z``, our own
``-x``): the offset and the ASCII part are dropped.
"""
from __future__ import annotations

import ast
import re

# An offset column: hex digits, then ':' or 2+ spaces, then a 2- or 4-digit group. It is only
# taken as an offset if it equals the number of bytes read so far (so plain hex stays data).
_OFFSET = re.compile(r"^\s*(?:0x)?([0-9a-fA-F]{4,16})(?::\s*|\s{2,})(?=[0-9a-fA-F]{2}(?:[0-9a-fA-F]{2})?\b)")
_ASCII_COL = re.compile(r"\s{2,}\|.*\|\s*$|\s{2,}[ -~]{1,16}\s*$")
_BYTES_REPR = re.compile(r"""^\s*b(['"]).*\1\s*$""", re.S)


class HexError(ValueError):
    pass


def parse_hex(text: str) -> bytes:
    if _BYTES_REPR.match(text):
        try:
            v = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError) as e:
            raise HexError(f"not a bytes literal: {e}") from None
        if isinstance(v, bytes):
            return v
    out = bytearray()
    for line_no, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0] if line.lstrip().startswith("#") else line
        m = _OFFSET.match(line)
        if m and int(m.group(1), 16) == len(out):
            line = line[m.end():]
            line = _ASCII_COL.sub("", line) if "|" in line or _looks_like_dump_tail(line) else line
        cleaned = re.sub(r"0[xX]|\\[xX]", " ", line)
        cleaned = re.sub(r"[\s:,\-]+", " ", cleaned).strip()
        if not cleaned:
            continue
        for tok in cleaned.split(" "):
            if not re.fullmatch(r"[0-9a-fA-F]+", tok):
                raise HexError(f"line {line_no}: {tok[:20]!r} is not hex")
            if len(tok) % 2:
                raise HexError(f"line {line_no}: {tok[:20]!r} has an odd number of hex digits")
            out += bytes.fromhex(tok)
    return bytes(out)


def _looks_like_dump_tail(line: str) -> bool:
    """xxd puts the ASCII column after two spaces; hex groups are 2 or 4 digits."""
    parts = re.split(r"\s{2,}", line.strip())
    return len(parts) >= 2 and not re.fullmatch(r"[0-9a-fA-F ]+", parts[-1])
