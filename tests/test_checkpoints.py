"""Context checkpoints (engine/checkpoints.py) on their own, against a model that records what
it is asked: where they are taken, which one a diverging prompt gets back, and which go first."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.checkpoints import DIVERGED_MIN_TOKENS, END_OFFSET, SPARE_PER_SLOT, Checkpoint, Checkpoints


@dataclass
class Recording:
    recurrent: bool = True
    n_swa: int = 0
    kv_shareable: bool = True
    refuse_set: bool = False
    refuse_rm: bool = False
    taken: list[int] = field(default_factory=list)  # seq of each checkpoint_get
    offered: list[bytearray | None] = field(default_factory=list)  # the buffer each was offered
    state_of: dict[int, bytes] = field(default_factory=dict)  # what checkpoint_get returns per seq
    calls: list[tuple] = field(default_factory=list)

    def checkpoint_get(self, seq: int, reuse: bytearray | None = None) -> bytearray:
        self.taken.append(seq)
        self.offered.append(reuse)
        state = self.state_of.get(seq, b"state-%d" % len(self.taken))
        if not isinstance(state, bytes):
            return state  # a given buffer (a mapping, a view of one): handed back as LoadedModel does
        if reuse is not None and len(reuse) >= len(state):  # as LoadedModel: written into it
            reuse[:] = state
            return reuse
        return bytearray(state)

    def checkpoint_set(self, seq: int, data: bytes) -> bool:
        self.calls.append(("set", seq, data))
        return not self.refuse_set

    def seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        self.calls.append(("rm", seq, p0, p1))
        return not self.refuse_rm


def test_only_memories_that_cannot_be_cut_back_want_them():
    ck = Checkpoints()
    assert ck.wanted(Recording(recurrent=True))
    assert ck.wanted(Recording(recurrent=False, n_swa=128, kv_shareable=False))
    assert not ck.wanted(Recording(recurrent=False, n_swa=128, kv_shareable=True))  # --swa-full keeps every cell
    assert not ck.wanted(Recording(recurrent=False))
    assert not Checkpoints(max_per_slot=0).wanted(Recording())


def test_positions_as_llama_server_takes_them_and_chunks_end_there():
    # 4 + n_ubatch and 4 tokens before the end, each at most n_batch (tools/server's
    # checkpoint_offsets); n_batch does not move them, as long as it is the larger
    assert Checkpoints.points(100, 2048, 32) == (100 - END_OFFSET - 32, 100 - END_OFFSET)
    assert Checkpoints.points(100, 32, 32) == (100 - 32, 100 - END_OFFSET)  # capped by n_batch
    assert Checkpoints.points(100, 4, 32) == (100 - END_OFFSET,)  # both capped alike: one point
    assert Checkpoints.points(20, 2048, 32) == (20 - END_OFFSET,)  # the earlier one would be before 0
    assert Checkpoints.points(1215, 2048, 512) == (699, 1211)  # a document's last ubatch is computed again
    # and where a chat's last user turn starts (engine.chat.turns), in order, once
    assert Checkpoints.points(100, 2048, 32, 50) == (50, 64, 96)
    assert Checkpoints.points(100, 2048, 32, 64) == (64, 96)
    assert Checkpoints.points(100, 2048, 32, 0) == Checkpoints.points(100, 2048, 32, 100) == (64, 96)
    assert Checkpoints.chunk_len(0, 80, Checkpoints.points(100, 2048, 32, 50)) == 50
    points = Checkpoints.points(100, 2048, 32)
    # a chunk from 0 of up to 80 tokens stops at the first point (64), the next at 96
    assert Checkpoints.chunk_len(0, 80, points) == 64
    assert Checkpoints.chunk_len(64, 80, points) == 32
    assert Checkpoints.chunk_len(96, 80, points) == 80  # no point ahead: the whole chunk


def test_where_a_prompt_parted_from_the_slot_when_it_computes_enough_again_before_it():
    # restored at 500 (a checkpoint), parted from the slot's tokens at 1,000: one there, so
    # that the next prompt parting there too computes nothing before it
    # (the slot's newest checkpoint 4 tokens before its previous prompt's end, 1,200)
    assert Checkpoints.diverged(500, 1000, 1010, 1196) == 1000
    assert Checkpoints.diverged(500, 1000, 1010, None) == 1000  # none to restore: computed from 500 on
    assert Checkpoints.diverged(1000 - DIVERGED_MIN_TOKENS, 1000, 1010, 1196) == 1000
    assert Checkpoints.diverged(1001 - DIVERGED_MIN_TOKENS, 1000, 1010, 1196) is None  # too little recomputed
    assert Checkpoints.diverged(1000, 1000, 1010, 1196) is None  # kept all it shared: nothing recomputed
    assert Checkpoints.diverged(0, 1000, 1000, 1196) is None  # the whole prompt was the slot's: no point inside
    assert Checkpoints.diverged(0, 0, 1000, 1196) is None  # nothing shared
    # an agent's next turn parts in the answer after its prompt's last checkpoint (the template
    # renders the answer anew): that checkpoint serves the turn after, none is taken
    assert Checkpoints.diverged(1196, 1400, 1500, 1196) is None
    # a chunk ends there, beside llama-server's points and a chat's user turn
    assert Checkpoints.points(1010, 2048, 512, None, 1000) == (494, 1000, 1006)
    assert Checkpoints.points(1010, 2048, 512, 300, 1000) == (300, 494, 1000, 1006)
    assert Checkpoints.chunk_len(500, 2048, Checkpoints.points(1010, 2048, 512, None, 1000)) == 500
    ck = Checkpoints()
    assert ck.newest(0) is None
    ck.before_chunk(Recording(), 0, list(range(8)), (8,))
    ck.before_chunk(Recording(), 0, list(range(4)), (4,))
    assert ck.newest(0) == 8


def test_taken_at_a_point_once_and_not_for_unknown_tokens():
    ck, model = Checkpoints(), Recording()
    points = Checkpoints.points(100, 2048, 32)
    ck.before_chunk(model, 0, list(range(63)), points)  # not a point
    assert model.taken == []
    ck.before_chunk(model, 0, list(range(64)), points)
    ck.before_chunk(model, 0, list(range(64)), points)  # the same state: kept once
    assert model.taken == [0] and ck.created == 1
    ck.before_chunk(model, 1, [-1] * 64, points)  # a restored state's unknown tokens
    assert model.taken == [0] and ck.of_slot(0) == [{"n_tokens": 64, "size": len(b"state-1")}]
    assert ck.of_slot(1) == []


def fill(ck: Checkpoints, model: Recording, lengths: list[int], seq: int = 0) -> None:
    for n in lengths:  # each n a point of a prompt ending END_OFFSET later
        ck.before_chunk(model, seq, list(range(n)), Checkpoints.points(n + END_OFFSET, 1 << 20, 512))


def test_when_full_one_close_to_its_predecessor_goes_first_else_the_oldest():
    ck, model = Checkpoints(max_per_slot=3, min_step=10), Recording()
    fill(ck, model, [10, 50, 55])
    fill(ck, model, [100])  # 55 is within 10 of 50: it goes
    assert [c["n_tokens"] for c in ck.of_slot(0)] == [10, 50, 100]
    fill(ck, model, [200])  # none close: the oldest goes
    assert [c["n_tokens"] for c in ck.of_slot(0)] == [50, 100, 200]
    assert ck.count() == 3 and ck.n_bytes() == sum(c["size"] for c in ck.of_slot(0))


def test_a_diverging_prompt_gets_the_newest_shared_prefix_back():
    ck, model = Checkpoints(), Recording()
    fill(ck, model, [10, 20, 30])
    held = list(range(40))
    target = list(range(25)) + [999] * 10  # diverges at 25: 30 is not a prefix of it
    best = ck.best(0, held, target, limit=len(target) - 1)
    assert best is not None and best.n == 20
    assert ck.best(0, held, target, limit=15).n == 10  # limited (the last token must be decoded again)
    assert ck.best(0, [7] * 40, target, limit=40) is None  # the slot no longer holds that prefix
    assert ck.restore(model, 0, best)
    assert model.calls == [("set", 0, best.state), ("rm", 0, 20, -1)] and ck.restored == 1


def test_a_refused_restore_is_reported_and_not_counted():
    ck = Checkpoints()
    fill(ck, Recording(), [10])
    (c,) = ck.per_slot[0]
    assert not ck.restore(Recording(refuse_set=True), 0, c)
    refuse_rm = Recording(refuse_rm=True)
    assert not ck.restore(refuse_rm, 0, c) and refuse_rm.calls[0][0] == "set"
    assert ck.restored == 0


def test_pruned_to_what_the_slot_holds_and_forgotten_with_its_state():
    ck, model = Checkpoints(), Recording()
    fill(ck, model, [10, 20, 30])
    fill(ck, model, [10], seq=1)
    ck.prune(0, list(range(25)))  # 30 is past what the slot holds now
    assert [c["n_tokens"] for c in ck.of_slot(0)] == [10, 20]
    ck.prune(0, [5] + list(range(1, 25)))  # token 0 changed: no prefix is shared any more
    assert ck.of_slot(0) == []
    ck.forget(1)
    assert ck.of_slot(1) == [] and ck.count() == 0
    fill(ck, model, [10], seq=2)
    ck.forget()  # a new model: every slot's go
    assert ck.count() == 0


def test_a_dropped_checkpoints_buffer_takes_the_next_one():
    """A new buffer of tens of MiB costs ten times the copy into it: the buffers of checkpoints
    that go (evicted, replaced, pruned) are kept, at most SPARE_PER_SLOT a slot, for the slot's
    next ones, and go with the slot's state or the model."""
    ck, model = Checkpoints(max_per_slot=2, min_step=0), Recording()
    fill(ck, model, [10, 20])
    assert model.offered == [None, None]
    oldest = ck.per_slot[0][0].state
    fill(ck, model, [30])  # full: the oldest goes and its buffer holds the new one
    assert model.offered[-1] is oldest and ck.per_slot[0][-1].state is oldest
    assert [c["n_tokens"] for c in ck.of_slot(0)] == [20, 30]
    ck.prune(0, [5] * 40)  # a new prompt shares nothing: both go, their buffers stay spare
    assert ck.of_slot(0) == [] and len(ck.spare[0]) == SPARE_PER_SLOT
    assert ck.n_bytes() == sum(len(b) for b in ck.spare[0])  # held memory is still counted
    spare = list(ck.spare[0])
    fill(ck, model, [10], seq=1)  # another slot's checkpoint gets a new buffer
    assert model.offered[-1] is None
    fill(ck, model, [50, 60])
    assert all(any(b is s for s in spare) for b in model.offered[-2:]) and ck.spare[0] == []
    fill(ck, model, [70])  # full again: evicted, reused
    ck.prune(0, [])
    assert len(ck.spare[0]) == 2
    ck.forget(0)  # the slot's state replaced: its buffers go with it
    assert 0 not in ck.spare and ck.n_bytes() == len(b"state-4")
    ck.forget()
    assert ck.spare == {} and ck.n_bytes() == 0


def test_a_dropped_mapping_or_a_view_of_one_is_a_spare_too():
    """Large captures live in lazily committed mappings (engine.buffers.lazy_buffer), written
    whole or seen through a view of what was written: either way the mapping is what the next
    capture reuses; a ``bytes`` state (read back from elsewhere) is no buffer to write into."""
    import mmap

    ck, model = Checkpoints(max_per_slot=3, min_step=0), Recording()
    whole, cut = mmap.mmap(-1, 64), mmap.mmap(-1, 64)
    ck.adopt(0, [Checkpoint(list(range(10)), b"read back")])  # as the RAM tier puts one back
    for n, state in ((20, whole), (30, memoryview(cut)[:10])):
        model.state_of[0] = state
        fill(ck, model, [n])
    ck.prune(0, [5] * 40)  # a new prompt shares nothing: all three go, the bytes first
    assert len(ck.spare[0]) == 2 and ck.spare[0][0] is whole and ck.spare[0][1] is cut


def test_handed_over_checkpoints_leave_no_spares_and_adopted_ones_join_in_order():
    """Checkpoints that went to the RAM tier with their slot's state are the entry's now: their
    buffers must not be written by the slot's next capture. Those that come back with an entry
    join the slot's list, shortest first, at most ``max_per_slot``."""
    ck, model = Checkpoints(max_per_slot=3, min_step=0), Recording()
    fill(ck, model, [10, 20, 30])
    leaving = ck.per_slot[0][1:]
    ck.hand_over(0, leaving)
    assert [c.n for c in ck.per_slot[0]] == [10] and ck.spare.get(0, []) == []
    fill(ck, model, [40])
    assert model.offered[-1] is None  # a new buffer, not one of the entry's
    ck.adopt(1, leaving)
    assert [c.n for c in ck.per_slot[1]] == [20, 30]
    ck.adopt(0, leaving)  # four for three places: the oldest goes
    assert [c.n for c in ck.per_slot[0]] == [20, 30, 40]
