"""Slot files: a slot's tokens and KV state saved to, and restored from, ``slot_save_path``.

llama-server's ``POST /slots/{id}?action=save|restore`` with ``--slot-save-path``: the file is
llama.cpp's sequence state file (``codec.slotfile``), so files move between the two servers.
The state is taken and put back through the engine's STATE_GET / STATE_PUT path (the slot
must be idle; the same checks apply); only the file I/O happens here, on a worker thread.

A client names a file, never a path: the name is checked as llama.cpp's
``fs_validate_filename`` checks it (no separators, no "..", no control characters …), and the
file it resolves to, symlinks followed, must lie in the directory itself.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from codec.errors import CodecError
from codec.slotfile import HEAD_SIZE, encode_slot_file_head, parse_slot_file_head, parse_tokens

from .buffers import Buffer, lazy_buffer
from .jobs import BadInput, EngineBusy, EngineUnavailable

if TYPE_CHECKING:
    from .api import EngineApi

MAX_FILENAME_BYTES = 255
_FORBIDDEN = frozenset(':*?"<>|/\\') | {chr(0xFF0E), chr(0x2215), chr(0x2216), chr(0xFFFD), chr(0xFEFF)}


class SlotFilesDisabled(Exception):
    """The engine was started without a slot directory (``--slot-save-path``): HTTP 501."""


@dataclass(frozen=True)
class SlotFileResult:
    slot: int
    filename: str
    n_tokens: int
    n_bytes: int
    ms: float


def valid_filename(name: str) -> bool:
    """llama.cpp's ``fs_validate_filename`` (no subdirectories)."""
    if not name or len(name.encode("utf-8", "surrogatepass")) > MAX_FILENAME_BYTES:
        return False
    for ch in name:
        c = ord(ch)
        if c <= 0x1F or c == 0x7F or 0x80 <= c <= 0x9F or 0xD800 <= c <= 0xDFFF or ch in _FORBIDDEN:
            return False
    return not (name[0] == " " or name[-1] in " ." or ".." in name)


def slot_file_path(directory: str | os.PathLike[str] | None, filename: str) -> Path:
    """The file ``filename`` names in ``directory``. Raises SlotFilesDisabled or BadInput."""
    if not directory:
        raise SlotFilesDisabled("this server does not support slot files: start it with --slot-save-path DIR")
    if not isinstance(filename, str) or not valid_filename(filename):
        raise BadInput(f"invalid filename {filename!r}: a plain file name is expected (no path separators, "
                       "no '..', no control characters)")
    base = Path(directory).resolve()
    path = (base / filename).resolve()
    if path.parent != base:  # a symlink leading out of the directory
        raise BadInput(f"invalid filename {filename!r}: it resolves outside the slot directory")
    if path.exists() and not path.is_file():  # e.g. the prompt cache's private directory
        raise BadInput(f"invalid filename {filename!r}: not a file")
    return path


async def save(engine: "EngineApi", slot: int, filename: str) -> SlotFileResult:
    """Write ``slot``'s tokens and state. Raises SlotFilesDisabled, BadInput, EngineBusy, OSError."""
    path = slot_file_path(engine.slot_save_path, filename)
    t0 = time.perf_counter()
    out = await engine.state_get(slot)
    try:
        n = await asyncio.get_running_loop().run_in_executor(None, _write, path, out.tokens, out.state)
    finally:
        out.release()
    return SlotFileResult(slot, filename, len(out.tokens), n, (time.perf_counter() - t0) * 1000)


async def restore(engine: "EngineApi", slot: int, filename: str) -> SlotFileResult:
    """Load a slot file into ``slot``. Raises SlotFilesDisabled, BadInput (no such file, not a
    slot file, tokens this model does not have, a state llama.cpp refuses), EngineBusy."""
    path = slot_file_path(engine.slot_save_path, filename)
    t0 = time.perf_counter()
    try:
        tokens, state, size = await asyncio.get_running_loop().run_in_executor(None, _read, path,
                                                                               engine.n_ctx_slot)
    except FileNotFoundError:
        raise BadInput(f"no slot file {filename!r}") from None
    except CodecError as e:
        raise BadInput(f"slot file {filename!r}: {e}") from None
    nv = engine.n_vocab
    if any(not -1 <= t < nv for t in tokens):  # -1: a token we did not know when saving
        raise BadInput(f"slot file {filename!r} holds tokens outside this model's vocabulary (n_vocab {nv})")
    try:
        await engine.state_put(slot, tokens, state)
    except (EngineBusy, EngineUnavailable):
        raise
    except Exception as e:  # llama.cpp refused the state (another model, context or KV type)
        raise BadInput(f"unable to restore slot {slot} from {filename!r}: {e}") from e
    return SlotFileResult(slot, filename, len(tokens), size, (time.perf_counter() - t0) * 1000)


def _write(path: Path, tokens: list[int], state: memoryview) -> int:
    head = encode_slot_file_head(tokens)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".slot-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(head)
            f.write(state)
        os.replace(tmp, path)  # readers never see half a file
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return len(head) + len(state)


def _read(path: Path, max_tokens: int) -> tuple[list[int], Buffer, int]:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        n_tok = parse_slot_file_head(f.read(HEAD_SIZE), size, max_tokens)
        tokens = parse_tokens(f.read(4 * n_tok), n_tok)
        state = lazy_buffer(size - HEAD_SIZE - 4 * n_tok)  # the pages faulted in by readinto, the GIL released
        if f.readinto(state) != len(state):  # cut while being read: its tail would restore as zeros
            raise CodecError("the file was cut short while being read")
    return tokens, state, size
