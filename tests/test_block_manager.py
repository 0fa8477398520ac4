"""BlockManager: reference counts, prefix-cache exactness and LRU eviction.

The state machine keeps a shadow KV cache in which every slot holds the whole token prefix that
produced it (what a real K/V entry depends on). A request may only ever read slots whose prefix
equals its own, which is exactly "cached blocks are reused only for identical prefixes".
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from plinth.core.block_manager import BlockManager
from plinth.core.request import Request, SamplingParams

BS = 4
NUM_BLOCKS = 12
_ids = itertools.count()


def make_request(tokens: list[int]) -> Request:
    return Request(f"r{next(_ids)}", tokens, SamplingParams(max_tokens=64))


class BlockManagerMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BS)
        self.live: dict[str, Request] = {}
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}   # (block, offset) -> prefix that wrote it
        self.num_added = 0

    # -- helpers
    def compute(self, req: Request, num_new: int) -> None:
        """Write the K/V of the next ``num_new`` tokens, as the model runner would."""
        tokens = req.all_token_ids
        for p in range(req.num_computed_tokens, req.num_computed_tokens + num_new):
            block = req.block_ids[p // BS]
            assert block != 0
            self.kv[(block, p % BS)] = tuple(tokens[:p + 1])
        req.num_computed_tokens += num_new

    def snapshot(self) -> tuple:
        return (self.bm.free_block_ids(), [self.bm.ref_count(b) for b in range(NUM_BLOCKS)],
                self.bm.num_cached_blocks)

    # -- rules
    @rule(target=requests, prompt=st.lists(st.integers(0, 2), min_size=1, max_size=14), data=st.data())
    def add_request(self, prompt, data):
        self.num_added += 1
        req = Request(f"m{self.num_added}", prompt, SamplingParams(max_tokens=64))
        cached, num_cached = self.bm.get_computed_blocks(req)
        assert num_cached == len(cached) * BS
        assert num_cached < len(prompt), "the last prompt token must always be computed"
        for i, block in enumerate(cached):
            for off in range(BS):
                p = i * BS + off
                assert self.kv[(block, off)] == tuple(prompt[:p + 1]), "cache hit on a different prefix"
        num_new = data.draw(st.integers(1, len(prompt) - num_cached), label="num_new")
        before = self.snapshot()
        ok_predicted = self.bm.can_allocate(req, num_new, cached)
        ok = self.bm.allocate_slots(req, num_new, cached)
        assert ok == ok_predicted
        if not ok:
            assert req.block_ids == [] and self.snapshot() == before
            return None
        req.num_computed_tokens = num_cached
        self.compute(req, num_new)
        self.live[req.request_id] = req
        return req.request_id

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 2), chunk=st.integers(1, 6))
    def step(self, data, token, chunk):
        req = self.live[data.draw(st.sampled_from(list(self.live)), label="request")]
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token(token)
        num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
        before = self.snapshot()
        if self.bm.allocate_slots(req, num_new):
            self.compute(req, num_new)
        else:
            assert not self.bm.can_allocate(req, num_new)
            assert self.snapshot() == before

    @rule(rid=consumes(requests))
    def free(self, rid):
        req = self.live.pop(rid, None) if rid is not None else None
        if req is not None:
            self.bm.free(req)
            assert req.block_ids == []

    @rule()
    def reset_prefix_cache(self):
        held = {b for r in self.live.values() for b in r.block_ids}
        cached_held = sum(1 for b in held if self.bm.is_cached(b))
        before = self.bm.num_cached_blocks
        dropped, still = self.bm.reset_prefix_cache()
        assert self.bm.num_cached_blocks == still == cached_held and dropped == before - cached_held

    # -- invariants
    @invariant()
    def refcounts_match_owners(self):
        counts = [0] * NUM_BLOCKS
        for req in self.live.values():
            assert len(set(req.block_ids)) == len(req.block_ids), "a request holds a block twice"
            assert 0 not in req.block_ids, "block 0 handed out"
            for b in req.block_ids:
                counts[b] += 1
        assert [self.bm.ref_count(b) for b in range(NUM_BLOCKS)] == counts

    @invariant()
    def free_list_is_exactly_unowned_blocks(self):
        free = self.bm.free_block_ids()
        assert len(free) == len(set(free)) == self.bm.num_free_blocks
        assert set(free) == {b for b in range(1, NUM_BLOCKS) if self.bm.ref_count(b) == 0}
        in_use = NUM_BLOCKS - 1 - len(free)
        assert self.bm.usage == pytest.approx(in_use / (NUM_BLOCKS - 1))

    @invariant()
    def requests_read_only_their_own_prefix(self):
        for req in self.live.values():
            assert len(req.block_ids) * BS >= req.num_computed_tokens
            tokens = req.all_token_ids
            for p in range(req.num_computed_tokens):
                assert self.kv[(req.block_ids[p // BS], p % BS)] == tuple(tokens[:p + 1])

    @invariant()
    def cached_blocks_are_full_and_consistent(self):
        for b in range(1, NUM_BLOCKS):
            if self.bm.is_cached(b):
                slots = [self.kv.get((b, off)) for off in range(BS)]
                assert all(s is not None for s in slots), f"cached block {b} is not fully computed"
                for a, c in itertools.pairwise(slots):
                    assert c[:-1] == a


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class StateCheckpointMachine(BlockManagerMachine):
    """The same with recurrent-state checkpoints (models with Mamba layers): a shadow state per slot and per request
    (the token prefix it has consumed). A restore must give exactly the hit's prefix, and a cached block's
    checkpoint must always hold the state after exactly that block's prefix."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BS, state_slots=3)
        self.saved: dict[int, tuple[int, ...]] = {}   # slot -> prefix its state consumed

    def compute(self, req: Request, num_new: int) -> None:
        restores, saves = self.bm.take_state_plan()
        start, tokens = req.num_computed_tokens, req.all_token_ids
        assert set(restores) <= {req.request_id} and set(saves) <= {req.request_id}
        if req.request_id in restores:
            assert start > 0 and self.saved[restores[req.request_id]] == tuple(tokens[:start])
        planned = saves.get(req.request_id, [])
        assert len({slot for _, slot in planned}) == len(planned)
        for offset, slot in planned:
            assert 0 < offset <= num_new and (start + offset) % BS == 0
            self.saved[slot] = tuple(tokens[:start + offset])
        super().compute(req, num_new)
        self.bm.begin_schedule()   # the next rule is the next step

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 6))
    def failed_step(self, data, chunk):
        """A step allocated and planned, then failed before it ran (nothing written), as the engine handles it."""
        req = self.live[data.draw(st.sampled_from(list(self.live)), label="request")]
        num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
        if num_new and self.bm.allocate_slots(req, num_new):
            _, saves = self.bm.take_state_plan()
            self.bm.uncache_unwritten(req, req.num_computed_tokens)
            self.bm.drop_state_saves(saves)
            self.bm.begin_schedule()

    @invariant()
    def checkpoints_hold_their_blocks_prefix(self):
        slot_of = self.bm._slot_of
        assert len(slot_of) <= 3 and len(set(slot_of.values())) == len(slot_of)
        for block, slot in slot_of.items():
            assert self.saved[slot] == self.kv[(block, BS - 1)]


TestStateCheckpointMachine = StateCheckpointMachine.TestCase
TestStateCheckpointMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# ------------------------------------------------------------------ targeted tests

def admit(bm: BlockManager, tokens: list[int]) -> Request:
    req = make_request(tokens)
    cached, n = bm.get_computed_blocks(req)
    assert bm.allocate_slots(req, len(tokens) - n, cached, query=True)
    req.num_computed_tokens = len(tokens)
    return req


def test_block_zero_is_never_handed_out():
    bm = BlockManager(5, 2)
    req = admit(bm, [1, 2, 3, 4, 5, 6, 7, 8])
    assert sorted(req.block_ids) == [1, 2, 3, 4]
    assert bm.num_free_blocks == 0 and bm.usage == 1.0
    assert not bm.allocate_slots(make_request([9]), 1)


def test_prefix_hit_is_whole_blocks_and_leaves_last_token():
    bm = BlockManager(16, 4)
    a = admit(bm, list(range(10)))              # blocks [0..3] [4..7] full, [8, 9] partial
    b = make_request(list(range(8)) + [99, 98])
    blocks, n = bm.get_computed_blocks(b)
    assert (blocks, n) == (a.block_ids[:2], 8)
    same = make_request(list(range(8)))          # fully cached prompt: the last block is recomputed
    assert bm.get_computed_blocks(same) == (a.block_ids[:1], 4)
    other = make_request([0, 1, 2, 4, 4, 5, 6, 7, 8])   # differs inside the first block
    assert bm.get_computed_blocks(other) == ([], 0)


def test_same_tokens_after_a_different_prefix_do_not_hit():
    bm = BlockManager(16, 2)
    admit(bm, [1, 2, 3, 4, 5])
    # block [3, 4] exists in the cache, but after the prefix [1, 2]; here it follows [7, 7]
    assert bm.get_computed_blocks(make_request([7, 7, 3, 4, 5])) == ([], 0)


def test_lru_eviction_order():
    bm = BlockManager(7, 2)                      # usable blocks 1..6
    a = admit(bm, [1, 1, 1, 1])                  # 2 blocks, both full and cached
    b = admit(bm, [2, 2, 2, 2])
    a_blocks, b_blocks = list(a.block_ids), list(b.block_ids)
    bm.free(a)
    bm.free(b)
    free = bm.free_block_ids()
    # never-used blocks first, then a (tail first), then b (tail first)
    assert free == [5, 6, a_blocks[1], a_blocks[0], b_blocks[1], b_blocks[0]]

    # a hit revives a's blocks: they leave the free list and return as most recently used
    a2 = make_request([1, 1, 1, 1, 9])
    cached, n = bm.get_computed_blocks(a2)
    assert cached == a_blocks and n == 4
    assert bm.allocate_slots(a2, 1, cached)
    bm.free(a2)
    # a2's private third block was uncached: it goes to the very front
    assert bm.free_block_ids()[-4:] == [b_blocks[1], b_blocks[0], a_blocks[1], a_blocks[0]]

    evictions = bm.stats.evictions
    c = admit(bm, [3, 3, 3, 3, 3, 3, 3, 3])      # needs 4 blocks: 2 uncached + b's two (LRU)
    assert bm.stats.evictions == evictions + 2
    assert set(c.block_ids) & set(b_blocks) == set(b_blocks)
    assert bm.get_computed_blocks(make_request([2, 2, 2, 2, 2]))[1] == 0     # b evicted
    assert bm.get_computed_blocks(make_request([1, 1, 1, 1, 1]))[1] == 4     # a survived


def test_duplicate_prefix_stays_private_and_the_chain_continues():
    bm = BlockManager(16, 2)
    a = make_request([1, 2, 3, 4, 5])
    b = make_request([1, 2, 3, 4, 5])
    assert bm.allocate_slots(a, 5)               # registers [1, 2] and [3, 4]
    assert bm.allocate_slots(b, 5)               # computes the same prefix without looking it up
    assert not any(bm.is_cached(x) for x in b.block_ids)
    b.num_computed_tokens = 5
    b.append_output_token(6)
    assert bm.allocate_slots(b, 1)               # fills b's third block: [5, 6] after a's prefix
    assert bm.is_cached(b.block_ids[2])
    bm.begin_schedule()                         # a later step (b's decode token completed that block)
    blocks, n = bm.get_computed_blocks(make_request([1, 2, 3, 4, 5, 6, 7]))
    assert n == 6 and blocks == [a.block_ids[0], a.block_ids[1], b.block_ids[2]]


def test_siblings_share_blocks_registered_in_the_same_step():
    bm = BlockManager(16, 4)
    prompt = list(range(9))
    a = make_request(prompt)
    assert bm.allocate_slots(a, 9)               # KV written later in the same step
    b = make_request(prompt)
    cached, n = bm.get_computed_blocks(b)
    assert n == 8 and cached == a.block_ids[:2]
    assert bm.allocate_slots(b, 1, cached)
    assert [bm.ref_count(x) for x in a.block_ids] == [2, 2, 1]
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]


def test_stats_count_admissions_once():
    bm = BlockManager(16, 4)
    admit(bm, list(range(12)))
    admit(bm, list(range(12)) + [50])
    s = bm.stats
    assert s.queries == 2
    assert s.query_tokens == 25
    assert s.hit_tokens == 12 and s.hit_blocks == 3
    assert s.miss_blocks == 3                    # the first request computed 3 full blocks
    assert s.hit_rate == pytest.approx(12 / 25)


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    a = admit(bm, list(range(12)))
    bm.free(a)
    assert bm.get_computed_blocks(make_request(list(range(12)))) == ([], 0)
    assert bm.num_cached_blocks == 0


def test_bad_construction_is_a_value_error():
    with pytest.raises(ValueError, match="block 0"):
        BlockManager(1, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(8, 0)


def test_a_block_completed_by_a_one_token_query_is_reusable_from_the_next_step():
    """In a step where every query is one token an attention backend may write the new K/V inside the
    attention launch, so a block a decode token completes is not offered to a request admitted in the same
    step (it would read the slot while it is written); from the next step on it is. A block completed by a
    longer query (that step attends after writing) is offered at once, e.g. to an n > 1 sibling."""
    bm = BlockManager(NUM_BLOCKS, BS)
    a = make_request([1, 2, 3])
    bm.begin_schedule()
    assert bm.allocate_slots(a, 3)
    a.num_computed_tokens = 3
    a.append_output_token(4)                          # a's decode token completes its first block
    bm.begin_schedule()
    assert bm.allocate_slots(a, 1)
    b = make_request([1, 2, 3, 4, 5])
    assert bm.get_computed_blocks(b) == ([], 0)       # admitted in the same step: computes them itself
    bm.begin_schedule()
    assert bm.get_computed_blocks(b) == (a.block_ids[:1], BS)

    c = make_request([9, 8, 7, 6, 5, 4, 3, 2, 1])     # a prefill completes two blocks
    assert bm.allocate_slots(c, 9)
    sibling = make_request([9, 8, 7, 6, 5, 4, 3, 2, 1])
    assert bm.get_computed_blocks(sibling) == (c.block_ids[:2], 2 * BS)


def test_a_cache_salt_shares_blocks_only_with_the_same_salt():
    """``cache_salt``: the same tokens hit only under the same salt (and the same adapter); no salt is a salt of
    its own."""
    bm = BlockManager(32, 2)
    prompt = [1, 2, 3, 4, 5]

    def salted(salt, lora_id=0):
        req = make_request(prompt)
        req.cache_salt = salt
        if lora_id:
            req.lora = type("Adapter", (), {"lora_id": lora_id})()
        return req

    first = salted("tenant-a")
    assert bm.allocate_slots(first, len(prompt))
    assert bm.get_computed_blocks(salted("tenant-a")) == (first.block_ids[:2], 4)
    assert bm.get_computed_blocks(salted("tenant-b")) == ([], 0)
    assert bm.get_computed_blocks(salted(None)) == ([], 0)
    assert bm.get_computed_blocks(salted("tenant-a", lora_id=1)) == ([], 0)
    plain = salted(None)
    assert bm.allocate_slots(plain, len(prompt))   # the unsalted prompt computes its own blocks
    assert set(plain.block_ids).isdisjoint(first.block_ids)
    assert bm.get_computed_blocks(salted(None)) == (plain.block_ids[:2], 4)
    assert bm.get_computed_blocks(salted("tenant-a")) == (first.block_ids[:2], 4)


def test_a_state_checkpoint_is_offered_from_the_step_after_its_save():
    """With recurrent state: a hit ends at the deepest block whose state is kept, and a state saved by the step
    being scheduled is not offered in it (restores run before the layers that save)."""
    bm = BlockManager(16, 4, state_slots=2)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    a = admit(bm, prompt)
    restores, saves = bm.take_state_plan()
    assert restores == {} and saves == {a.request_id: [(8, saves[a.request_id][0][1])]}   # before the last token
    sibling = make_request(prompt)
    assert bm.get_computed_blocks(sibling) == ([], 0)    # KV blocks cached, their state not yet written
    bm.begin_schedule()
    blocks, n = bm.get_computed_blocks(sibling)
    assert n == 8 and blocks == a.block_ids[:2]
    assert bm.allocate_slots(sibling, 1, blocks)
    restores, _ = bm.take_state_plan()
    assert restores == {sibling.request_id: saves[a.request_id][0][1]}
    # a longer prompt sharing only the first block finds no state there: no hit at all
    assert bm.get_computed_blocks(make_request([1, 2, 3, 4, 0, 0, 0, 0, 0])) == ([], 0)


def test_a_request_freed_in_its_step_drops_its_planned_save():
    bm = BlockManager(16, 4, state_slots=1)
    a = admit(bm, [1, 2, 3, 4, 5])
    bm.free(a)   # preempted before its step ran
    assert bm.take_state_plan() == ({}, {})
    b = admit(bm, [7, 7, 7, 7, 7])   # the one slot is free again
    assert bm.take_state_plan()[1] == {b.request_id: [(4, 0)]}
