"""Paged KV-cache blocks: reference counts, a prefix cache and LRU eviction.

Blocks ``1 .. num_blocks-1`` are handed out; block 0 is the scratch block that padding rows
write into (see :mod:`plinth.attention_backends.interface`) and never belongs to a request.

Prefix cache. A FULL block is registered under the key ``(parent_id, tokens)``: ``tokens`` is
the tuple of its ``block_size`` token ids and ``parent_id`` identifies the exact prefix before
it (``ROOT`` for the first block). Every registration draws a fresh ``prefix id`` that is never
reused, so a key names one token-for-token prefix: a hit is exact, there are no hash collisions
to worry about (dict keys compare by equality) and a child whose parent was evicted simply
becomes unreachable. The first block of a request with a LoRA adapter hangs from that adapter's own root
(``ROOT - lora_int_id``): the same tokens give other keys and values under another adapter. A block holding image positions
has each image's digest in its key too (the placeholder ids are the same for every image). A request with a
``cache_salt`` hangs its first block from ``(that root, salt, epoch)``, and after :meth:`BlockManager.new_epoch`
(new model weights) every request from ``(that root, salt or None, epoch)``: it shares blocks only with requests of
the same salt (a tenant's prompts cannot be found, or timed, through another's cache hits), and no request finds
blocks computed before the epoch changed, even those running requests still hold.
A request's blocks are registered as soon as they are allocated for the
step that fills them, so a request admitted later in the same step (an ``n > 1`` sibling) can
reuse them: attention backends write a layer's new K/V for the whole batch before attending,
except in a step where every query is one token, where a backend may write them inside the
attention launch (the Triton decode kernel that applies RoPE); so a block completed by a
one-token query is offered to other requests only from the next :meth:`BlockManager.begin_schedule`
on (a request admitted in the same step computes those tokens itself, which also makes its
step a prefill step).

Recurrent state (models with Mamba layers, ``state_slots > 0``). A hit must also give the layers' state after the
hit's last token, which, unlike keys and values, is not in the blocks: the manager keeps ``state_slots`` checkpoint
slots, each holding the state after the last token of one block, and a hit ends at the deepest block of the chain
that has one. A step that takes a request's tokens over a block boundary saves the state there: the end of the
prompt's blocks the cache already held without a kept state (a shared system prompt: the next request with it
resumes there), the boundary before its prompt's last token (a request with the same prompt resumes there), and
later the last boundary it passes (the next turn of a conversation resumes there; a request's rolling checkpoint
moves on in its own slot, so a running request holds at most three slots).
:meth:`BlockManager.take_state_plan` hands the step's saves and the restores of admitted requests to the worker.
Slots are evicted least recently used first, and with their block; a slot saved by the step being scheduled is not
offered in that step (the restores run before the layers).

Free blocks (reference count 0) sit in one LRU list. Cached ones keep their contents and can
be revived by a hit until a new block is needed; then the least recently used goes first.
Uncached free blocks are at the front (nothing to lose), and a freed request's blocks enter
tail-first, so that the shared head of a prompt outlives its private tail.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence

from plinth.core.request import Request

ROOT = -1  # the parent id of a sequence's first block


def _block_tokens(request: Request, tokens: Sequence[int], i: int, bs: int) -> tuple:
    """The token part of block ``i``'s key: its token ids, and for a block with image positions each image's digest
    and offset (their placeholder ids are the same whatever the image)."""
    key = tuple(tokens[i * bs:(i + 1) * bs])
    if request.images:
        from plinth.multimodal.images import block_key_extra

        key += block_key_extra(request.images, i * bs, (i + 1) * bs)
    return key

_Key = tuple[int | tuple[int, str | None, int], tuple[int, ...]]


@dataclasses.dataclass
class PrefixCacheStats:
    """Counters since construction (or the last :meth:`BlockManager.reset_stats`).

    A query is a request's first admission that looked up the cache (counted when its blocks are allocated, so
    that a request waiting for blocks is not counted once per step; a preempted request taking its own blocks back
    when it resumes, or a prompt whose every position's logits are wanted, is not one).
    """

    queries: int = 0          # admissions that looked up the cache
    query_tokens: int = 0     # tokens of those requests
    hit_tokens: int = 0       # tokens served from the cache
    hit_blocks: int = 0
    miss_blocks: int = 0      # full blocks of those requests that had to be computed
    evictions: int = 0        # cached blocks whose contents were dropped to make room

    @property
    def miss_tokens(self) -> int:
        return self.query_tokens - self.hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class BlockManager:
    """Hands out KV blocks to requests and keeps finished prefixes around for reuse.

    Args:
        num_blocks: blocks in the KV cache, block 0 included (it is never handed out).
        block_size: tokens per block.
        enable_prefix_caching: look up and register full blocks.

    The manager owns ``request.block_ids``; callers only read it.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, state_slots: int = 0):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._key: list[_Key | None] = [None] * num_blocks   # registration key of a cached block
        self._prefix_id = [ROOT] * num_blocks                 # prefix id of a cached block
        self._cache: dict[_Key, int] = {}                      # key -> block
        self._epoch = 0   # bumped by new_epoch: the roots of first blocks change with it
        self._roots: dict[str, int | tuple[int, str | None, int]] = {}   # request id -> its first block's root
        # Free blocks in eviction order (front = evicted first); values unused.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        # Per request: the prefix id of each of its leading full blocks that is known to the cache.
        self._chains: dict[str, list[int]] = {}
        self._next_prefix_id = 0
        # cached blocks completed by a one-token query of the step being scheduled (not reusable in it)
        self._filling: set[int] = set()
        self.stats = PrefixCacheStats()
        # recurrent-state checkpoints (models with Mamba layers; see the module's docstring)
        self.state_slots = state_slots if enable_prefix_caching else 0
        self._slot_of: dict[int, int] = {}                    # block -> slot holding the state after it
        self._block_of: dict[int, int] = {}                   # slot -> block
        self._free_slots = list(range(self.state_slots - 1, -1, -1))
        self._slot_lru: OrderedDict[int, None] = OrderedDict()   # assigned slots, least recently used first
        self._saving: set[int] = set()                        # slots written by the step being scheduled
        self._rolling: dict[str, int] = {}                    # request -> block of its rolling checkpoint
        self._saves: dict[str, list[tuple[int, int]]] = {}    # request -> [(offset in its step's tokens, slot)]
        self._restores: dict[str, int] = {}                   # request -> slot it starts from

    # ---------------------------------------------------------------- queries

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner (cached or not): what new allocations can draw from."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """The fraction of usable blocks owned by at least one request."""
        return 1.0 - len(self._free) / self.num_usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cache)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def is_cached(self, block_id: int) -> bool:
        return self._key[block_id] is not None

    def free_block_ids(self) -> list[int]:
        """Free blocks, the next to be handed out (and evicted) first."""
        return list(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def new_epoch(self) -> None:
        """Blocks computed so far become unreachable to every later lookup (the model's weights changed), also those
        running requests hold (they go on with their own blocks; freed, the blocks are evicted as any unused)."""
        self._epoch += 1

    def _root(self, request: Request) -> int | tuple[int, str | None, int]:
        """The parent of a request's first block: its adapter's root, with its ``cache_salt`` and the epoch."""
        root = ROOT - request.lora_id
        if request.cache_salt is None and self._epoch == 0:
            return root
        return (root, request.cache_salt, self._epoch)

    def begin_schedule(self) -> None:
        """A new step is being scheduled: blocks completed by last step's one-token queries (now
        written) become reusable, and so do the state checkpoints it saved."""
        self._filling.clear()
        self._saving.clear()

    def take_state_plan(self) -> tuple[dict[str, int], dict[str, list[tuple[int, int]]]]:
        """The scheduled step's work on state checkpoints: ``(restores, saves)``, request id -> the slot it starts
        from, and request id -> ``[(offset, slot)]`` in increasing offsets: save its state after the first
        ``offset`` of its tokens of the step into ``slot``."""
        plan = self._restores, self._saves
        self._restores, self._saves = {}, {}
        return plan

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Find the longest cached prefix of ``request.all_token_ids`` in whole blocks.

        Never covers every token: the last token is always left to compute so that the step
        produces logits. Pure: takes no reference and changes no counter.

        Returns:
            ``(blocks, num_cached_tokens)`` with ``num_cached_tokens == len(blocks) * block_size``.
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        tokens = request.all_token_ids
        blocks: list[int] = []
        parent = self._root(request)
        reach = 0   # with recurrent state: the blocks up to the deepest one whose state is kept
        for i in range((len(tokens) - 1) // bs):
            block = self._cache.get((parent, _block_tokens(request, tokens, i, bs)))
            if block is None or block in self._filling:
                break
            blocks.append(block)
            parent = self._prefix_id[block]
            slot = self._slot_of.get(block)
            if slot is not None and slot not in self._saving:
                reach = len(blocks)
        if self.state_slots:
            del blocks[reach:]
        return blocks, len(blocks) * bs

    def blocks_to_take(self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int] = ()) -> int:
        """Free blocks :meth:`allocate_slots` with these arguments would take (cached ones revived included)."""
        return self._num_to_take(request, num_new_tokens, cached_blocks)

    def num_exclusive_blocks(self, request: Request) -> int:
        """Blocks :meth:`free` of the request would return to the free list (those no other request holds)."""
        return sum(1 for b in request.block_ids if self._ref[b] == 1)

    def can_allocate(self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Whether :meth:`allocate_slots` with the same arguments would succeed."""
        return self._num_to_take(request, num_new_tokens, cached_blocks) <= len(self._free)

    # ---------------------------------------------------------------- changes

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int] = (),
                       query: bool = False) -> bool:
        """Grow the request's blocks so that ``num_computed + num_new_tokens`` tokens fit.

        Args:
            request: its ``num_computed_tokens`` are the tokens already in its blocks.
            num_new_tokens: tokens to be computed this step (all known: prompt or sampled).
            cached_blocks: from :meth:`get_computed_blocks`, only for a request holding no
                blocks; they are taken first and cover its leading tokens (the caller then
                advances ``num_computed_tokens`` by ``len(cached_blocks) * block_size``).

        Returns:
            False, changing nothing, when there are not enough free blocks. On success, the
            blocks that become full once this step's tokens are computed are registered in the
            prefix cache.
        """
        if request.block_ids and not cached_blocks:
            if self._fits(request, num_new_tokens):
                if self.state_slots:
                    self._plan_save(request, request.num_computed_tokens, num_new_tokens)
                return True
        elif cached_blocks and request.block_ids:
            raise ValueError(f"request {request.request_id!r} already holds blocks; cached blocks are only "
                             "given at admission")
        num_take = self._num_to_take(request, num_new_tokens, cached_blocks)
        if num_take > len(self._free):
            return False
        is_admission = not request.block_ids
        if is_admission:   # its blocks hang from the root of now (the epoch may change while it runs)
            self._roots[request.request_id] = self._root(request)
        for block in cached_blocks:
            if self._ref[block] == 0:
                del self._free[block]
            self._ref[block] += 1
        request.block_ids.extend(cached_blocks)
        chain = self._chains.setdefault(request.request_id, [])
        if cached_blocks:
            chain[:] = [self._prefix_id[b] for b in cached_blocks]
        num_total = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        for _ in range(self.blocks_needed(num_total) - len(request.block_ids)):
            request.block_ids.append(self._take_free_block())
        if self.state_slots:   # (before registering: a block found private hands its checkpoint to the cached one)
            if cached_blocks:
                slot = self._slot_of[cached_blocks[-1]]
                self._restores[request.request_id] = slot
                self._slot_lru.move_to_end(slot)
            self._plan_save(request, num_total - num_new_tokens, num_new_tokens)
        if self.enable_prefix_caching:
            # a decode's one token (and the drafts after it) completes a block while this step computes it
            self._register_full_blocks(request, min(num_total, request.num_tokens), chain,
                                       filling=num_new_tokens == 1 or num_total > request.num_tokens)
            if is_admission and query:
                self._record_query(request, len(cached_blocks))
        return True

    def register_computed_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose tokens are all known and computed (or being
        computed): for a block completed by a token that was unknown when its slot was allocated."""
        if self.enable_prefix_caching and request.block_ids:
            chain = self._chains.setdefault(request.request_id, [])
            self._register_full_blocks(request, min(request.num_computed_tokens, request.num_tokens), chain)

    def uncache_unwritten(self, request: Request, num_written: int) -> None:
        """Take the request's blocks past its first ``num_written`` tokens out of the prefix cache: they were
        registered when allocated for a step that failed, so their contents were never written (a hit on them
        would read garbage). A request freed since (aborted or preempted while the step was in flight) holds no
        blocks: the cached ones of its tokens are found by their keys."""
        if not self.enable_prefix_caching:
            return
        first = num_written // self.block_size
        held = bool(request.block_ids)
        for block in (request.block_ids if held else self._cached_chain(request))[first:]:
            if self._key[block] is not None:
                self._uncache(block)
        chain = self._chains.get(request.request_id) if held else None   # (a freed request's id may be another's)
        if chain is not None:
            del chain[first:]

    def free(self, request: Request) -> None:
        """Drop the request's references; its cached blocks stay reusable until evicted."""
        rid = request.request_id
        if self.state_slots:
            self._restores.pop(rid, None)
            for _, slot in self._saves.get(rid, [])[:]:   # preempted in the step that was to save: nothing is written
                self._release_slot(slot)
            self._saves.pop(rid, None)
            self._rolling.pop(rid, None)
        for block in reversed(request.block_ids):
            ref = self._ref[block] - 1
            assert ref >= 0, f"block {block} freed more often than taken"
            self._ref[block] = ref
            if ref == 0:
                self._free[block] = None
                if self._key[block] is None:
                    self._free.move_to_end(block, last=False)
                    if block in self._slot_of:   # a state after a block no lookup can reach
                        self._release_slot(self._slot_of[block])
        request.block_ids = []
        self._chains.pop(rid, None)
        self._roots.pop(rid, None)

    def reset_prefix_cache(self) -> tuple[int, int]:
        """Forget every cached block that no request holds. Returns ``(dropped, held)``: the blocks forgotten, and
        the cached blocks running requests hold, which stay cached (they are in use)."""
        dropped = 0
        for block in self._free:
            if self._key[block] is not None:
                self._uncache(block)
                dropped += 1
        return dropped, len(self._cache)

    def reset_stats(self) -> PrefixCacheStats:
        """Return the counters so far and start new ones."""
        stats, self.stats = self.stats, PrefixCacheStats()
        return stats

    # ---------------------------------------------------------------- internals

    def _fits(self, request: Request, num_new_tokens: int) -> bool:
        """The common case of a decode step: the tokens fit the blocks the request holds and no
        block fills up, so :meth:`allocate_slots` has nothing to do."""
        num_total = request.num_computed_tokens + num_new_tokens
        bs = self.block_size
        if num_total > len(request.block_ids) * bs:
            return False
        if not self.enable_prefix_caching:
            return True
        chain = self._chains.get(request.request_id)
        return chain is not None and min(num_total, request.num_tokens) // bs <= len(chain)

    def _num_to_take(self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int]) -> int:
        """Free-list entries the allocation would consume (revived cached blocks included)."""
        num_total = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        num_new_blocks = max(0, self.blocks_needed(num_total) - len(request.block_ids) - len(cached_blocks))
        return num_new_blocks + sum(1 for b in cached_blocks if self._ref[b] == 0)

    def _take_free_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        if self._key[block] is not None:
            self._uncache(block)
            self.stats.evictions += 1
        elif block in self._slot_of:
            self._release_slot(self._slot_of[block])
        self._ref[block] = 1
        return block

    def _uncache(self, block: int) -> None:
        key = self._key[block]
        assert key is not None
        del self._cache[key]
        self._filling.discard(block)
        self._key[block] = None
        self._prefix_id[block] = ROOT
        slot = self._slot_of.get(block)
        if slot is not None:
            self._release_slot(slot)

    # ---------------------------------------------------------------- recurrent-state checkpoints

    def _plan_save(self, request: Request, start: int, num_new: int) -> None:
        """Plan the state saves of a step computing the request's tokens ``start .. start + num_new - 1``: where its
        prompt's cached keys and values run past the deepest kept state (a shared prefix, a system prompt, seen
        before without its state), at their end; at the boundary before its prompt's last token if the step passes
        it; else (past its prompt) at the last boundary it reaches, which replaces the request's previous rolling
        checkpoint."""
        rid = request.request_id
        if rid in self._saves:
            return
        bs = self.block_size
        end = start + num_new
        prompt_mark = (request.num_prompt_tokens - 1) // bs * bs
        marks: list[tuple[int, bool]] = []
        if start < prompt_mark <= end:
            marks.append((prompt_mark, False))
        elif prompt_mark < end // bs * bs and start < end // bs * bs:
            marks.append((end // bs * bs, True))
        if start < prompt_mark:   # (planned last: the most recently used of the request's slots)
            shared = self._cached_reach(request) * bs
            if start < shared <= end and shared < prompt_mark:
                marks.append((shared, False))
        for mark, rolling in marks:
            self._plan_one(request, start, mark, rolling)
        if len(self._saves.get(rid, ())) > 1:
            self._saves[rid].sort()

    def _cached_reach(self, request: Request) -> int:
        """How many leading full blocks of the request's prompt the cache holds (states kept or not)."""
        tokens, bs = request.all_token_ids, self.block_size
        parent = self._roots.get(request.request_id) or self._root(request)   # (as its blocks are registered)
        for i in range((request.num_prompt_tokens - 1) // bs):
            block = self._cache.get((parent, _block_tokens(request, tokens, i, bs)))
            if block is None:
                return i
            parent = self._prefix_id[block]
        return (request.num_prompt_tokens - 1) // bs

    def _cached_chain(self, request: Request) -> list[int]:
        """The cached blocks that hold the leading full blocks of tokens of a request that holds no blocks (filling
        ones included)."""
        tokens, bs = request.all_token_ids, self.block_size
        parent = self._root(request)
        blocks: list[int] = []
        for i in range(len(tokens) // bs):
            block = self._cache.get((parent, _block_tokens(request, tokens, i, bs)))
            if block is None:
                break
            blocks.append(block)
            parent = self._prefix_id[block]
        return blocks

    def _plan_one(self, request: Request, start: int, mark: int, rolling: bool) -> None:
        rid = request.request_id
        block = request.block_ids[mark // self.block_size - 1]
        if block in self._slot_of:
            return
        previous = self._rolling.get(rid) if rolling else None
        if previous is not None and previous in self._slot_of:   # the request's rolling checkpoint moves on
            slot = self._slot_of[previous]
            self._release_slot(slot)
            self._free_slots.remove(slot)
        else:
            slot = self._take_slot()
            if slot is None:
                return
        if rolling:
            self._rolling[rid] = block
        self._slot_of[block] = slot
        self._block_of[slot] = block
        self._slot_lru[slot] = None
        self._saving.add(slot)
        self._saves.setdefault(rid, []).append((mark - start, slot))

    def _adopt_slot(self, rid: str, own: int, existing: int) -> None:
        """The request's block ``own`` turned out private (``existing`` holds its prefix in the cache): its state
        checkpoint goes to ``existing``, unless that has one (then it is dropped, with its save if still to come).
        Should ``existing`` be evicted before the save runs, releasing the slot drops the save; should the step fail,
        the engine drops its saves' slots (:meth:`drop_state_saves`)."""
        slot = self._slot_of[own]
        if existing not in self._slot_of:
            del self._slot_of[own]
            self._slot_of[existing] = slot
            self._block_of[slot] = existing
            if self._rolling.get(rid) == own:
                self._rolling[rid] = existing
            return
        if self._rolling.get(rid) == own:
            del self._rolling[rid]
        self._release_slot(slot)

    def _take_slot(self) -> int | None:
        """A free checkpoint slot, else the least recently used one not written or read by this step."""
        if self._free_slots:
            return self._free_slots.pop()
        busy = self._saving | set(self._restores.values())
        victim = next((s for s in self._slot_lru if s not in busy), None)
        if victim is not None:
            self._release_slot(victim)
            return self._free_slots.pop()
        return None

    def _release_slot(self, slot: int) -> None:
        """Free ``slot``; a save into it planned in this step is dropped (the slot may be planned again)."""
        block = self._block_of.pop(slot, None)
        if block is None:
            return
        del self._slot_of[block]
        self._slot_lru.pop(slot, None)
        if slot in self._saving:
            self._saving.discard(slot)
            for rid, saves in list(self._saves.items()):
                kept = [save for save in saves if save[1] != slot]
                if len(kept) != len(saves):
                    if kept:
                        self._saves[rid] = kept
                    else:
                        del self._saves[rid]
        self._free_slots.append(slot)

    def drop_state_saves(self, saves: dict[str, list[tuple[int, int]]]) -> None:
        """A step failed before its saves ran: forget the checkpoints it was to write (``saves`` as
        :meth:`take_state_plan` gave them; a slot given to another block since is dropped too: that costs a
        checkpoint, never a wrong state)."""
        for planned in saves.values():
            for _, slot in planned:
                self._release_slot(slot)

    def _register_full_blocks(self, request: Request, num_tokens: int, chain: list[int],
                              filling: bool = False) -> None:
        """Register blocks ``len(chain) .. num_tokens // block_size - 1`` of the request (``filling``:
        completed by this step's one-token query, so not offered until the next step)."""
        bs = self.block_size
        tokens = request.all_token_ids
        for i in range(len(chain), num_tokens // bs):
            parent = chain[-1] if chain else self._roots.get(request.request_id) or self._root(request)
            key = (parent, _block_tokens(request, tokens, i, bs))
            existing = self._cache.get(key)
            if existing is not None:
                # Same prefix computed elsewhere (a sibling in the same step): keep that entry and
                # continue the chain from it; this block stays private and uncached.
                chain.append(self._prefix_id[existing])
                if request.block_ids[i] in self._slot_of:
                    self._adopt_slot(request.request_id, request.block_ids[i], existing)
                continue
            block = request.block_ids[i]
            assert self._key[block] is None, f"block {block} is already cached"
            self._cache[key] = block
            self._key[block] = key
            if filling:
                self._filling.add(block)
            self._prefix_id[block] = self._next_prefix_id
            chain.append(self._next_prefix_id)
            self._next_prefix_id += 1

    def _record_query(self, request: Request, num_hit_blocks: int) -> None:
        s = self.stats
        s.queries += 1
        s.query_tokens += request.num_tokens
        s.hit_blocks += num_hit_blocks
        s.hit_tokens += num_hit_blocks * self.block_size
        s.miss_blocks += max(0, request.num_tokens // self.block_size - num_hit_blocks)
