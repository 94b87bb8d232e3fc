"""Context checkpoints' buffers on a real hybrid model (tiny-hybrid, llama.cpp's ``qwen35``): a
capture written into a dropped checkpoint's buffer is that buffer, holds what a new capture
holds, and puts the recurrent state back (engine.checkpoints, seq_state.get_partial)."""
from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.llama_backend import BatchItem, LoadedModel, SamplerParams, make_sampler
from engine.model_files import resolve_model

GREEDY = SamplerParams(temperature=0.0)


@pytest.fixture(scope="module")
def hybrid() -> Iterator[LoadedModel]:
    with LoadedModel(str(resolve_model("tiny-hybrid")), n_ctx=512, n_seq_max=2, n_batch=512, n_threads=1) as m:
        yield m


def generate(m: LoadedModel, seq: int, pos: int, n: int) -> list[int]:
    s, out = make_sampler(GREEDY, m), []
    for _ in range(n):
        out.append(s.sample(m, seq))
        m.decode([BatchItem(seq, [out[-1]], pos, True)])
        pos += 1
    s.free()
    return out


def test_a_capture_into_a_dropped_checkpoints_buffer_is_that_buffer_and_restores(hybrid: LoadedModel):
    m = hybrid
    m.clear_all()
    prompt = m.tokenize("The quick brown fox jumps over the lazy dog, and the river runs to the sea.")
    head, tail = prompt[:-4], prompt[-4:]  # as the engine: a checkpoint 4 tokens before the end
    m.decode([BatchItem(0, head, 0)])
    fresh = m.checkpoint_get(0)
    assert isinstance(fresh, bytearray) and len(fresh) > 0
    dropped = bytearray(b"\xee" * (len(fresh) + 100))  # an earlier capture's, larger and stale
    reused = m.checkpoint_get(0, dropped)
    assert reused is dropped and reused == fresh  # written in place, cut to what was written
    too_small = bytearray(len(fresh) - 1)
    assert m.checkpoint_get(0, too_small) is not too_small and len(too_small) == len(fresh) - 1
    m.decode([BatchItem(0, tail, len(head), True)])
    reference = generate(m, 0, len(prompt), 6)

    assert m.checkpoint_set(0, reused) and m.seq_rm(0, len(head), -1)  # back to the checkpoint
    m.decode([BatchItem(0, tail, len(head), True)])
    assert generate(m, 0, len(prompt), 6) == reference


def test_a_large_capture_goes_into_memory_its_copy_faults_in_and_restores(hybrid: LoadedModel, monkeypatch):
    """A checkpoint of a large recurrent state (63 MB on the fleet's model) goes into a lazily
    committed mapping, not a bytearray: a bytearray's zero-filling holds the GIL for ~23 ms and
    the event loop answers nothing meanwhile, where the mapping's pages are faulted in by
    llama.cpp's copy with the GIL released. Here every capture is "large": the same bytes as a
    small one, restored from, and the mapping reused as a dropped checkpoint's buffer."""

    from engine import buffers

    m = hybrid
    m.clear_all()
    prompt = m.tokenize("The quick brown fox jumps over the lazy dog, and the river runs to the sea.")
    head, tail = prompt[:-4], prompt[-4:]
    m.decode([BatchItem(0, head, 0)])
    small = m.checkpoint_get(0)
    monkeypatch.setattr(buffers, "LAZY_MIN", 0)
    monkeypatch.setattr(buffers, "HUGE_MIN", 0)  # and advised huge pages, as the fleet model's are
    large = m.checkpoint_get(0)
    assert isinstance(large, mmap.mmap) and large[:] == bytes(small)
    assert m.checkpoint_get(0, large) is large  # a spare mapping is written in place
    m.decode([BatchItem(0, tail, len(head), True)])
    reference = generate(m, 0, len(prompt), 6)

    assert m.checkpoint_set(0, large) and m.seq_rm(0, len(head), -1)
    m.decode([BatchItem(0, tail, len(head), True)])
    assert generate(m, 0, len(prompt), 6) == reference


def _vm_flags(address: int) -> list[str]:
    """The kernel's VmFlags of the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists() or not hasattr(mmap, "MADV_HUGEPAGE"),
                    reason="no /proc/self/smaps or no MADV_HUGEPAGE here")
def test_a_large_buffer_asks_for_huge_pages_a_smaller_one_does_not():
    """A new checkpoint of the fleet model's state (63 MB) cost 37 ms in a new buffer, 10 of them
    with huge pages (tools.bench.checkpoint_copy): buffers from HUGE_MIN on are advised so
    ("hg" in the mapping's VmFlags); below it they keep 4 KiB pages."""
    from engine.buffers import HUGE_MIN, LAZY_MIN, lazy_buffer

    for size, advised in ((HUGE_MIN, True), (LAZY_MIN, False)):
        buf = lazy_buffer(size)
        view = ctypes.c_char.from_buffer(buf)
        flags = _vm_flags(ctypes.addressof(view))
        del view
        buf.close()
        assert ("hg" in flags) is advised, (size, flags)


def test_a_capture_into_a_larger_spare_mapping_is_a_view_that_gives_the_rest_back(hybrid: LoadedModel,
                                                                                   monkeypatch):
    """A spare mapping from an earlier, larger capture is written in place and seen through a
    view of the bytes written; the pages past them are given back to the system, since what
    fits in memory is judged by the bytes in use (engine.buffers.release_tail)."""

    from engine import buffers

    m = hybrid
    m.clear_all()
    prompt = m.tokenize("The quick brown fox jumps over the lazy dog, and the river runs to the sea.")
    head, tail = prompt[:-4], prompt[-4:]
    m.decode([BatchItem(0, head, 0)])
    small = bytes(m.checkpoint_get(0))
    monkeypatch.setattr(buffers, "LAZY_MIN", 0)
    spare = buffers.lazy_buffer(len(small) + 3 * mmap.PAGESIZE)
    spare[:] = b"\xee" * len(spare)  # every page touched by an earlier capture
    view = m.checkpoint_get(0, spare)
    assert isinstance(view, memoryview) and view.obj is spare and bytes(view) == small
    kept = -(-len(small) // mmap.PAGESIZE) * mmap.PAGESIZE
    assert spare[kept:] == bytes(len(spare) - kept)  # given back: reads as zeros
    m.decode([BatchItem(0, tail, len(head), True)])
    reference = generate(m, 0, len(prompt), 6)

    assert m.checkpoint_set(0, view) and m.seq_rm(0, len(head), -1)
    m.decode([BatchItem(0, tail, len(head), True)])
    assert generate(m, 0, len(prompt), 6) == reference


def test_a_large_state_capture_is_a_view_of_a_mapping_and_restores(hybrid: LoadedModel, monkeypatch):
    """A whole sequence's state (a PREFILL's reply) goes into a mapping from 1 MiB up as well,
    not a zeroed ctypes array, for the same reason; here every capture is "large"."""

    from engine import buffers

    m = hybrid
    m.clear_all()
    m.decode([BatchItem(0, m.tokenize("The river runs to the sea, past three towns and a mill."), 0)])
    small = bytes(m.state_seq_get(0))
    monkeypatch.setattr(buffers, "LAZY_MIN", 0)
    large = m.state_seq_get(0)
    assert isinstance(large.obj, mmap.mmap) and large.readonly and bytes(large) == small
    assert m.state_seq_set(1, large) == len(small)  # restores (a read-only view is copied once to pass it)


def test_the_checkpoint_copy_bench_measures_a_real_capture():
    from tools.bench.checkpoint_copy import FIGURES, measure, runs_table

    run = measure(str(resolve_model("tiny-hybrid")), reps=1)
    assert run["state_bytes"] > 0 and all(run[key] >= 0 for key, _ in FIGURES)
    table = runs_table([{**run, "model": "tiny-hybrid"}, {**run, "model": "tiny-hybrid"}])
    assert table.splitlines()[0].startswith("| tiny-hybrid: a recurrent state of ") and len(table.splitlines()) == 6
