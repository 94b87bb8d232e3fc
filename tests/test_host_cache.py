"""The RAM tier's bookkeeping (no model): prefix matching, obsolete and duplicate entries,
the byte limit, LRU eviction and model keys; and llama-server's --cache-reuse walk."""
from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.checkpoints import Checkpoint
from engine.host_cache import CachedPrompt, HostCache, _shares, common_prefix
from engine.prompt_cache import plan_chunk_reuse


def naive_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=40))
def test_common_prefix_is_the_longest_common_prefix(a, b):
    assert common_prefix(a, b) == naive_prefix(a, b)
    assert common_prefix(a, a + b) == len(a)



# long enough for several of _shares' doubling windows, an alphabet small enough to share long prefixes
LONG_TOKENS = st.lists(st.integers(0, 1), max_size=90)


@settings(max_examples=400, deadline=None)
@example(a=[0] * 70, b=[0] * 69 + [1], k=70)  # parting at the last token of the last window
@example(a=[0] * 40 + [1] + [0] * 29, b=[0] * 70, k=70)  # parting in a middle window, ending alike
@given(LONG_TOKENS, LONG_TOKENS, st.integers(0, 95))
def test_shares_is_a_common_prefix_of_k_tokens(a, b, k):
    assert _shares(a, b, k) == (len(a) >= k and len(b) >= k and a[:k] == b[:k])


@settings(max_examples=400, deadline=None)
@given(LONG_TOKENS, LONG_TOKENS, st.lists(st.integers(1, 90), max_size=3, unique=True), st.integers(1, 90))
def test_a_recurrent_entrys_prefix_is_usable_of_the_common_prefix(tokens, target, cuts, at_least):
    """A recurrent entry asks only its own length and its checkpoints' instead of walking the
    common prefix: the answer must be the same, and 0 below ``at_least``."""
    cps = [Checkpoint(tokens[:n], b"c") for n in sorted(cuts) if n < len(tokens)]
    e = CachedPrompt("m", tokens, b"state", checkpoints=cps)
    want = e.usable(naive_prefix(tokens, target), 0, recurrent=True)
    assert e.recurrent_prefix(target, at_least) == (want if want >= at_least else 0)

@settings(max_examples=400, deadline=None)
@example(prompts=[[0, 2], [0, 1]], target=[0, 1], at_least=1, recurrent=False)  # a later entry, one longer
@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=12), max_size=12),
       st.lists(st.integers(0, 2), max_size=14), st.integers(1, 8), st.booleans())
def test_best_and_put_agree_with_a_scan_of_every_entry(prompts, target, at_least, recurrent):
    """The lookup turns entries away with one comparison each: it must pick what comparing
    every entry in full picks (the longest usable prefix, the first of equals), and a put must
    drop exactly the entries the new one covers."""
    h = HostCache(limit_bytes=None)
    for p in prompts:
        held = [e.tokens for e in h.entries.values()]
        covered = any(naive_prefix(t, p) == len(p) and (not recurrent or len(t) == len(p)) for t in held)
        assert h.put("m", p, bytes(len(p)), recurrent=recurrent) is not covered
        if not covered:
            obsolete = [t for t in held if naive_prefix(t, p) == len(t) and (not recurrent or len(t) == len(p))]
            assert len(h) == len(held) - len(obsolete) + 1
    want = None
    for eid, e in h.entries.items():
        n = naive_prefix(e.tokens, target)
        if n >= at_least and (not recurrent or n == len(e.tokens)) and (want is None or n > want[1]):
            want = (eid, n)
    assert h.best("m", target, recurrent=recurrent, at_least=at_least) == want
    assert h.best("other", target) is None


def test_best_entry_takes_and_obsolete_entries():
    h = HostCache(limit_bytes=None)
    assert h.put("m", [1, 2, 3], b"abc")
    assert not h.put("m", [1, 2], b"ab")  # already held by a longer entry
    assert h.put("m", [1, 2, 3, 4, 5], b"abcde") and len(h) == 1  # [1,2,3] was a prefix of it: dropped
    assert h.put("m", [1, 9], b"x") and h.put("other", [1, 2, 3, 4, 5, 6], b"y")
    eid, n = h.best("m", [1, 2, 3, 4, 7])
    assert n == 4 and h.entries[eid].tokens == [1, 2, 3, 4, 5]
    assert h.best("m", [7]) is None
    before = h.n_bytes
    assert h.take(eid).state == b"abcde" and h.n_bytes == before - (5 + 4 * 5)
    h.keep_only("m")
    assert [e.model_key for e in h.entries.values()] == ["m"] and h.stats.invalidated == 1


def test_limit_evicts_the_oldest_and_refuses_the_oversized():
    size = 100 + 4 * 2  # state + tokens
    h = HostCache(limit_bytes=3 * size)
    for i in range(5):
        assert h.put("m", [i, i], bytes(100))
    assert [e.tokens[0] for e in h.entries.values()] == [2, 3, 4]
    assert h.stats.evictions == 2 and h.n_bytes == 3 * size
    assert not h.put("m", [9], bytes(4 * size)) and h.stats.refused == 1 and len(h) == 3


def test_chunk_reuse_walk_skips_dropped_cache_tokens():
    cached = [1, 2, 3, 7, 7, 4, 5, 6, 8, 9]
    prompt = [1, 2, 3, 4, 5, 6, 10]
    moves, n = plan_chunk_reuse(cached, prompt, 3, min_chunk=3)
    assert moves == [(5, 3, 3)] and n == 6  # [4, 5, 6] moved from position 5 to 3
    assert plan_chunk_reuse(cached, prompt, 3, min_chunk=4) == ([], 3)


def test_sliding_window_entries_serve_only_prefixes_whose_window_they_hold():
    h = HostCache(limit_bytes=None)
    long = list(range(100))
    assert h.put("m", long, b"s", pos_min=80, n_swa=16)  # cells of positions 80..99 only
    assert h.best("m", long + [1000], n_swa=16) == (next(iter(h.entries)), 100)
    assert h.best("m", long[:96] + [1000], n_swa=16) == (next(iter(h.entries)), 96)  # needs 81.. : held
    assert h.best("m", long[:90] + [1000], n_swa=16) is None  # needs cells from 75: gone
    # a shorter entry is not made obsolete by a longer one that no longer holds its window
    assert h.put("m", long[:50], b"p", pos_min=30, n_swa=16) and len(h) == 2
    assert h.best("m", long[:50] + [7], n_swa=16)[1] == 50


def test_a_recurrent_entry_serves_the_prefix_of_a_checkpoint_it_carries():
    """A recurrent state serves all its tokens only; with the slot's checkpoints it also serves
    their prefixes (an agent's next turn diverges a few tokens before its last prompt's end).
    The checkpoints count in the entry's bytes."""
    from engine.checkpoints import Checkpoint

    tokens = list(range(100))
    h = HostCache(limit_bytes=None)
    cps = [Checkpoint(tokens[:40], bytearray(7)), Checkpoint(tokens[:96], bytearray(7))]
    assert h.put("m", tokens, b"state", recurrent=True, checkpoints=cps)
    (eid, entry), = h.entries.items()
    assert entry.size == 5 + 4 * 100 + 14 and h.n_bytes == entry.size
    assert h.best("m", tokens[:98] + [7], recurrent=True) == (eid, 96)
    assert h.best("m", tokens[:60], recurrent=True) == (eid, 40)
    assert h.best("m", tokens[:60], recurrent=True, at_least=41) is None
    assert h.best("m", tokens + [7], recurrent=True) == (eid, 100)
    assert entry.checkpoint_at(96) is cps[1] and entry.checkpoint_at(50) is None
    bare = HostCache(limit_bytes=None)
    bare.put("m", tokens, b"state", recurrent=True)
    assert bare.best("m", tokens[:98] + [7], recurrent=True) is None  # what agents met before


def test_a_spilled_entry_takes_its_checkpoints_to_disk_and_back(tmp_path):
    """The disk tier keeps an entry's checkpoints too, each in a file of its own prefix: an
    agent's next prompt is served at a checkpoint whichever tier holds its conversation."""
    from engine.checkpoints import Checkpoint
    from engine.disk_tier import DiskTier

    tokens = list(range(50))
    h = HostCache(limit_bytes=4 * 50 + 5 + 10 + 4 * 40, disk=DiskTier(tmp_path))
    assert h.put("m", tokens, b"state", recurrent=True, checkpoints=[Checkpoint(tokens[:40], bytearray(b"c" * 10))])
    assert h.put("m", [9] * 50, b"other", recurrent=True)  # evicts the first to disk
    (eid, spilled), = h.spilled.items()
    assert h.disk_bytes == spilled.size == 4 * 50 + 5 + 10
    assert spilled.state == b"" and spilled.checkpoints[0].state == b""  # RAM keeps the prefixes only
    assert sorted(p.name for p in h.disk.dir.iterdir()) == ["1.1.ggsq", "1.ggsq"]
    assert h.best("m", tokens[:45], recurrent=True) == (eid, 40)
    back = h.take(eid)
    assert h.stats.disk_restores == h.stats.restores == 1
    assert back.state == b"state" and back.checkpoint_at(40).state == b"c" * 10 and back.paths == []
    assert not list(h.disk.dir.iterdir()) and h.disk_bytes == 0
    h.close()


def test_a_disk_that_fails_mid_entry_leaves_no_file(tmp_path, monkeypatch):
    from engine.checkpoints import Checkpoint
    from engine.disk_tier import DiskTier

    disk = DiskTier(tmp_path)
    real_open, opened = open, []

    def second_fails(path, mode="r", *a, **k):
        opened.append(path)
        if len(opened) == 2:
            raise OSError(28, "No space left on device")
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr("builtins.open", second_fails)
    h = HostCache(limit_bytes=4 * 50 + 5 + 10 + 4 * 40, disk=disk)
    assert h.put("m", list(range(50)), b"state", recurrent=True, checkpoints=[Checkpoint(list(range(40)), b"c" * 10)])
    assert h.put("m", [9] * 50, b"other", recurrent=True)
    monkeypatch.undo()
    assert not h.spilled and h.disk_bytes == 0 and not list(disk.dir.iterdir()) and len(opened) == 2
    h.close()


def test_the_disk_tier_maps_a_state_for_its_one_load_and_reads_checkpoints_into_buffers(tmp_path):
    """A state comes back as a writable view of its file mapped copy-on-write (llama.cpp reads
    it in place: ``seq_state._source`` copies only read-only views) that outlives the file's
    removal; a checkpoint, which a slot keeps, as a bytearray of its own. A file cut short
    is an OSError, which the prompt cache answers by computing the prompt."""
    from engine.disk_tier import DiskTier

    disk = DiskTier(tmp_path)
    state, tokens = bytes(range(256)) * 64, list(range(30))
    (path,) = disk.write(tokens, state)
    view = disk.read(path, len(tokens), mapped=True)
    disk.remove([path])
    assert not path.exists() and isinstance(view, memoryview) and not view.readonly and view == state
    (path,) = disk.write(tokens, state)
    copy = disk.read(path, len(tokens))
    assert isinstance(copy, bytearray) and copy == state
    (empty,) = disk.write(tokens, b"")
    assert disk.read(empty, len(tokens), mapped=True) == b""
    with open(path, "r+b") as f:
        f.truncate(50)  # into the tokens
    with pytest.raises(OSError):
        disk.read(path, len(tokens))
    disk.close()


def test_the_ram_tier_bench_measures_both_checkouts_in_one_run():
    """``tools.bench.ram_tier_lookup`` beside a revision (HEAD's engine/, from git): each round
    has both, every kind and size, and the table a row per figure with the ratio."""
    from tools.bench.ram_tier_lookup import KINDS, run, runs_table

    result = run("HEAD", rounds=1, entries=(10,))
    (one,) = result["rounds"]
    assert set(one) == {"this", "against"}
    for who in one.values():
        assert set(who) == {f"{kind}/10" for kind in KINDS}
        assert all(fig["best_us"] > 0 and fig["put_us"] > 0 for fig in who.values())
    table = runs_table([result]).splitlines()
    assert table[0].endswith("| HEAD / this, per round (min–max) |") and len(table) == 2 + 2 * len(KINDS)
