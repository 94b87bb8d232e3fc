"""The read deadlines as a pure clock: every time is given, none is waited for."""
from __future__ import annotations

from hydra_rpc.hydra.deadlines import IDLE, STALLED, TOO_SLOW, ReadClock


def run(clock: ReadClock, steps: float, nbytes: int, until: float, t0: float = 0.0) -> tuple[str | None, float]:
    """``nbytes`` arrive every ``steps`` seconds from ``t0``; returns (reason, when) at the first
    expiry before ``until`` (checked at every due time, as the connection's timer does)."""
    now, next_rx = t0, t0 + steps
    while now < until:
        due = clock.next_check()
        assert due is not None
        if next_rx <= due:
            now = next_rx
            clock.received(nbytes, now)
            next_rx += steps
            continue
        now = due
        reason = clock.expired(now)
        if reason is not None:
            return reason, now
    return None, now


def test_idle_applies_only_before_the_first_byte_of_a_request():
    c = ReadClock(idle=120, stall=2, min_rate=1024, window=10)
    c.wait(0.0, idle=True)
    assert c.next_check() == 120 and c.expired(119.9) is None and c.expired(120) == IDLE
    c.wait(0.0, idle=True)
    c.received(1, 100.0)  # the next request starts: now the frame deadlines apply
    assert c.next_check() == 102 and c.expired(102) == STALLED


def test_a_steady_slow_link_is_never_cut_however_long_the_transfer():
    # 8 MiB at 1 MiB/s in 64 KiB segments, --stall-timeout 2: eight seconds and more are fine.
    c = ReadClock(idle=120, stall=2, min_rate=1024, window=10)
    c.wait(0.0, idle=False)
    assert run(c, steps=1 / 16, nbytes=64 << 10, until=600) == (None, 600)


def test_a_one_byte_per_second_dribbler_is_cut_after_one_window():
    c = ReadClock(idle=120, stall=2, min_rate=1024, window=10)
    c.wait(0.0, idle=False)
    reason, when = run(c, steps=1.0, nbytes=1, until=600)
    assert reason == TOO_SLOW and when == 10


def test_a_client_that_stops_is_cut_by_the_stall_deadline():
    c = ReadClock(idle=120, stall=2, min_rate=0, window=0)
    c.wait(0.0, idle=False)
    c.received(100, 0.5)
    assert c.next_check() == 2.5 and c.expired(2.4) is None and c.expired(2.5) == STALLED


def _waited_then_worked() -> ReadClock:
    c = ReadClock(idle=120, stall=2, min_rate=1024, window=10)
    c.wait(0.0, idle=False)
    c.received(5000, 1.0)
    c.stop(1.5)  # a handler works (or reading is paused) for a minute
    assert c.next_check() is None and c.expired(60.0) is None
    c.wait(61.0, idle=False)
    return c


def test_time_the_server_does_not_wait_is_not_counted():
    c = _waited_then_worked()  # the stall counts from the new wait, not from the last byte
    assert c.expired(62.9) is None and c.expired(63.0) == STALLED
    c = _waited_then_worked()  # the window holds 1.5 s of earlier waiting: it closes 8.5 s in
    for t in range(62, 70):
        c.received(2000, float(t))
    assert c.next_check() == 69.5
    assert c.expired(69.5) is None  # 21000 bytes in 10 s of waiting: above 1024/s


def test_a_window_that_met_the_rate_rolls_over():
    c = ReadClock(idle=120, stall=5, min_rate=100, window=10)
    c.wait(0.0, idle=False)
    c.received(500, 4.0)
    c.received(500, 8.0)
    assert c.expired(10.0) is None  # 1000 bytes in 10 s: exactly the rate
    c.received(10, 12.0)
    c.received(10, 16.0)
    assert c.expired(20.0) == TOO_SLOW  # 20 bytes in the second window


def test_new_frame_starts_a_fresh_window():
    c = ReadClock(idle=120, stall=100, min_rate=100, window=10)
    c.wait(0.0, idle=False)
    c.received(5, 4.0)
    c.stop(4.0)
    c.new_frame()  # the 4 s and 5 bytes of the last request do not count for the next
    c.wait(4.0, idle=False)
    c.received(500, 5.0)
    assert c.next_check() == 14.0 and c.expired(13.9) is None and c.expired(14.0) == TOO_SLOW
