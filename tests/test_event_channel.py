"""engine.jobs.EventChannel: a job's token events from the actor to its reader, in order, each
delivered once — also when a reader is cancelled after it was woken."""
from __future__ import annotations

import asyncio

import pytest

from engine.jobs import EventChannel


@pytest.mark.asyncio
async def test_items_arrive_in_order_and_a_waiting_reader_is_woken():
    ch = EventChannel()
    ch.put_nowait(1)
    ch.put_nowait(2)
    assert ch.qsize() == 2 and not ch.empty()
    assert await ch.get() == 1
    assert ch.get_nowait() == 2
    with pytest.raises(asyncio.QueueEmpty):
        ch.get_nowait()
    reader = asyncio.ensure_future(ch.get())
    await asyncio.sleep(0)
    assert not reader.done()  # nothing to read: it waits
    ch.put_nowait(None)
    assert await asyncio.wait_for(reader, 5) is None


@pytest.mark.asyncio
async def test_a_reader_cancelled_after_its_wake_leaves_the_item_to_the_next():
    ch = EventChannel()
    first = asyncio.ensure_future(ch.get())
    second = asyncio.ensure_future(ch.get())
    await asyncio.sleep(0)  # both wait
    ch.put_nowait("token")  # wakes the first ...
    first.cancel()  # ... which is cancelled before it runs
    assert await asyncio.wait_for(second, 5) == "token"
    assert first.cancelled() and ch.empty()


@pytest.mark.asyncio
async def test_a_cancelled_reader_is_passed_over():
    ch = EventChannel()
    gone = asyncio.ensure_future(ch.get())
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    ch.put_nowait("x")
    assert await asyncio.wait_for(ch.get(), 5) == "x"
