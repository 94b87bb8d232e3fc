"""The disk tier under the RAM tier: states the RAM tier evicts, spilled to files.

A private directory inside ``--slot-save-path`` (``.hydra-prompt-cache-<pid>-<random>``), one
llama.cpp sequence state file per entry (``codec.slotfile``: the same format as a saved
slot) and one per context checkpoint it carries (the same format, holding the checkpoint's
prefix), deleted when the entry is taken back, evicted, invalidated by a reload, and all at
once when the engine stops. Entries are only ever loaded by the process and model instance
that wrote them (the RAM tier's model keys), so nothing here outlives its model.

Called on the inference thread only, like the RAM tier.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

from codec.errors import CodecError
from codec.slotfile import HEAD_SIZE, encode_slot_file_head, parse_slot_file_head

from .buffers import Buffer, lazy_buffer
from .checkpoints import Checkpoint


class DiskTier:
    def __init__(self, parent: str | os.PathLike[str]):
        self.dir = Path(tempfile.mkdtemp(prefix=f".hydra-prompt-cache-{os.getpid()}-", dir=parent))
        self._n = 0

    def write(self, tokens: list[int], state: bytes | memoryview,
              checkpoints: Sequence[Checkpoint] = ()) -> list[Path]:
        """The entry's files: its state's, then one per checkpoint. OSError: none is left."""
        self._n += 1
        paths: list[Path] = []
        try:
            for i, (prefix, data) in enumerate([(tokens, state), *((c.tokens, c.state) for c in checkpoints)]):
                paths.append(self.dir / (f"{self._n}.ggsq" if i == 0 else f"{self._n}.{i}.ggsq"))
                with open(paths[-1], "wb") as f:
                    f.write(encode_slot_file_head(prefix))
                    f.write(data)
        except OSError:
            self.remove(paths)
            raise
        return paths

    def read(self, path: Path, n_tokens: int, *, mapped: bool = False) -> Buffer | memoryview:
        """The state in a file this tier wrote (its header is checked all the same).

        ``mapped``: a view of the file mapped copy-on-write, for a state that is loaded into a
        slot once and dropped. llama.cpp then reads the page cache in place: a read into a new
        buffer would first copy it all and fault every page in (200 MiB: ~110 ms against ~12).
        The view outlives the file's removal. Otherwise a buffer of its own, for a
        checkpoint a slot keeps (it does not hold on to a removed file, and can become a spare
        buffer)."""
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            try:
                parse_slot_file_head(f.read(HEAD_SIZE), size, n_tokens)
            except CodecError as e:  # changed behind our back: as good as gone
                raise OSError(f"{path.name}: {e}") from None
            start = HEAD_SIZE + 4 * n_tokens
            if size == start:
                return bytearray()
            if mapped:
                return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))[start:]
            out = lazy_buffer(size - start)  # the pages faulted in by readinto, the GIL released
            f.seek(start)
            if f.readinto(out) != len(out):
                raise OSError(f"{path.name}: cut short while being read")
            return out

    @staticmethod
    def remove(paths: Sequence[Path]) -> None:
        for path in paths:
            with contextlib.suppress(OSError):
                path.unlink()

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
