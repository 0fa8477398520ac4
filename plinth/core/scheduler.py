"""Continuous batching: which requests run each step, and how many tokens each computes.

Policy, every step, within ``max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences:

1. running requests that decode (one new token each), oldest first;
2. running requests still in their prefill (chunked prefill: a long prompt is spread over
   several steps, mixed with decodes), oldest first, each taking what is left of the budget;
3. waiting requests, first come first served, while blocks and budget last. A prompt whose
   leading full blocks are in the prefix cache starts at the cached count; the queue is strict
   (the head blocks the rest) so that a long prompt cannot starve. A request with a LoRA adapter also needs
   its adapter among the running requests' or a free adapter slot (``max_loras``); until then it keeps its
   place and the requests behind it are considered (at most ``MAX_ADAPTER_SKIPS`` passed over per step), for
   ``MAX_ADAPTER_WAIT_STEPS`` steps; after that it blocks the queue until a slot frees.

With a prefill allowance (``Scheduler.prefill_allowance``, set by the engine for an inter-token
latency target), a step that carries decodes gives its prefill chunks only the tokens the allowance
grants for that many decodes (at least one block's worth, so prompts keep moving); steps without
decodes keep the whole budget.

When a running request needs a block and none is free, the most recently admitted running
request that is not yet scheduled in this step (possibly the one asking) is preempted: its
blocks are released, it goes back to the FRONT of the waiting queue and is recomputed later
(its sampled tokens are kept; its cached blocks usually survive). No admission happens in a
step that preempted.

The ``priority`` policy (``SchedulerConfig.scheduling_policy``) orders by each request's rank,
``(priority, arrival)``, smaller first: the waiting queue (a preempted request goes back to its
rank's place), the running requests within the decodes and within the prefills, and the choice of
victim (the least important running request not yet scheduled in this step). Before anything else
in a step, a waiting head that outranks running requests but finds no sequence slot or too few
blocks is admitted by preempting the least important of them, only when enough of them can make
the room (its first chunk leaves a token of budget for each running request); no other request is
admitted in that step.

``num_computed_tokens`` advances when a step is scheduled; ``update_from_output`` appends the
sampled tokens and applies every stop condition but stop strings. How the engine learns finish
reasons: ``update_from_output`` returns the requests it finished (``request.finish_reason``,
``request.stop_reason``); stop strings are found by the engine's detokenizer, which then calls
:meth:`Scheduler.finish_request`; aborts come from :meth:`Scheduler.abort`. Every finished id is
also listed once in the next :class:`SchedulerOutput` (``finished_request_ids``) for the runner.

Asynchronous scheduling: the engine may schedule step N+1 before step N's sampled tokens are
known. A request sampled by the step in flight has ``num_pending_tokens > 0``; it is scheduled as
a decode of that unknown token (the runner takes it from step N's output on the device), unless
the pending token will reach ``max_tokens`` or ``max_model_len`` anyway. A waiting (preempted)
request with a pending token is not admitted until the token is known, and a decode of a pending
token that needs a block nobody has free waits for the next step instead of preempting anyone (the
token may end the request). A request that turns out to have stopped (EOS, stop string) had one
wasted position computed, whose token is dropped. The prefix-cache block that a pending token
completes is registered when the token arrives.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable, Sequence

from plinth.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, SchedulerConfig
from plinth.core.block_manager import BlockManager, PrefixCacheStats
from plinth.core.request import FinishReason, Request, RequestStatus
from plinth.errors import UserFacingError

#: waiting requests whose LoRA adapter has no slot passed over in one step (the requests behind them are admitted)
MAX_ADAPTER_SKIPS = 64
#: steps a request waiting for an adapter slot lets the requests behind it pass; then it blocks the queue
MAX_ADAPTER_WAIT_STEPS = 64


class RequestRejectedError(UserFacingError, ValueError):
    """A request that can never run (too long for the model or the KV cache, empty, duplicate id).
    ``param``: the request field at fault, when it is not the prompt."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _later_needs(needs: list[int]) -> list[int]:
    """For each position, the sum of ``needs`` after it."""
    out, total = [0] * len(needs), 0
    for i in range(len(needs) - 1, -1, -1):
        out[i] = total
        total += needs[i]
    return out


class QueueFullError(UserFacingError, RuntimeError):
    """The waiting queue holds ``max_waiting_requests`` requests; retry later."""


_STATUS_OF_REASON = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
}


@dataclasses.dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step."""

    request: Request
    num_new_tokens: int
    num_computed_tokens: int   # tokens already in the KV cache before this step: the first new position
    sample: bool               # this step reaches the last known token: sample from its logits
    is_decode: bool            # a running request computing its last sampled token (and any drafts)
    num_drafts: int = 0        # speculative decoding: draft tokens after it (``request.draft_token_ids``)

    @property
    def token_ids(self) -> list[int]:
        """The tokens computed this step."""
        start = self.num_computed_tokens
        if self.num_drafts:
            return self.request.all_token_ids[start:start + 1] + self.request.draft_token_ids
        return self.request.all_token_ids[start:start + self.num_new_tokens]


@dataclasses.dataclass
class SchedulerOutput:
    """What to run in one step. ``scheduled`` is ordered: decodes first, then prefill chunks."""

    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    num_decodes: int                     # the first ``num_decodes`` entries are decodes
    new_request_ids: list[str]           # admitted (or resumed after preemption) in this step
    preempted_request_ids: list[str]     # preempted in this step
    finished_request_ids: list[str]      # finished or aborted since the previous step
    #: models with Mamba layers, prefix cache on: request id -> the checkpoint slot its state starts from, and
    #: request id -> ``[(offset, slot)]``, save its state after ``offset`` of its tokens of the step (see
    #: :meth:`~plinth.core.block_manager.BlockManager.take_state_plan`)
    state_restores: dict[str, int] = dataclasses.field(default_factory=dict)
    state_saves: dict[str, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def sampled(self) -> list[ScheduledRequest]:
        """The entries whose last position is sampled, in batch order."""
        return [s for s in self.scheduled if s.sample]

    def expand_sampled(self, token_ids: Sequence[int]) -> list[int | None]:
        """Spread the tokens sampled for :attr:`sampled` (same order) over every scheduled entry,
        ``None`` for mid-prefill entries: the argument :meth:`Scheduler.update_from_output` takes."""
        num_sampled = sum(1 for s in self.scheduled if s.sample)
        if len(token_ids) != num_sampled:
            raise ValueError(f"got {len(token_ids)} sampled tokens for {num_sampled} sampled requests")
        it = iter(token_ids)
        return [next(it) if s.sample else None for s in self.scheduled]


@dataclasses.dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_cache_usage: float
    prefix_cache: PrefixCacheStats


class Scheduler:
    """Decides each step's batch and tracks every unfinished request.

    Args:
        config: the batching limits.
        block_manager: the KV-cache allocator (its ``block_size`` and block count bound requests).
        max_model_len: the longest sequence, prompt plus output.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 max_loras: int = 0):
        if not config.resolved:   # the engine fills these from the platform; a bare scheduler takes the base values
            config = config.with_defaults(DEFAULT_MAX_NUM_SEQS, DEFAULT_MAX_NUM_BATCHED_TOKENS)
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []   # in admission order
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished_ids: list[str] = []
        self._arrivals = itertools.count()
        self._by_priority = config.scheduling_policy == "priority"
        #: ``decodes -> prefill tokens`` that fit beside them (None: no limit); set by the engine
        self.prefill_allowance: Callable[[int], int | None] | None = None
        #: the most LoRA adapters among the running requests (0: no adapters)
        self.max_loras = max_loras
        #: speculative decoding: ``(request, limit) -> draft tokens`` (at most ``limit``) for a decode; set by
        #: the engine
        self.proposer: Callable[[Request, int], list[int]] | None = None
        #: the most rows a step's decodes take with their drafts (None: no cap): drafts beyond it are not sent (a
        #: CPU decode plan runs up to so many rows in one native call; more rows cost more than drafts gain there)
        self.max_decode_rows: int | None = None
        #: the most positions one image fills where an image's positions attend to each other (Gemma 3), set by the
        #: engine: a prompt chunk never ends inside an image, and a step leaves prefill chunks at least so many
        #: tokens; 0: chunks end anywhere
        self.whole_images = 0
        #: a step budget that may leave a prompt chunk no room for a whole image beside the decodes: a prompt waiting
        #: for that room holds back new requests (whose decodes would keep taking it); set by the engine
        self.hold_for_images = False

    # ---------------------------------------------------------------- intake

    def add_request(self, request: Request) -> None:
        """Queue a request, resolving ``request.max_tokens`` against ``max_model_len``.

        Raises:
            RequestRejectedError: empty prompt, duplicate id, or too long to ever run.
            QueueFullError: ``max_waiting_requests`` are already waiting.
        """
        rid = request.request_id
        if rid in self.requests:
            raise RequestRejectedError(f"request id {rid!r} is already in use")
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise RequestRejectedError(f"request {rid!r}: the prompt is empty; at least one token is needed")
        limit = self.max_model_len
        bm = self.block_manager
        pooling = request.pooling is not None   # an input to embed: its one sampled token is dropped, never fed back
        if pooling and num_prompt > limit:
            raise RequestRejectedError(f"request {rid!r}: the input ({num_prompt} tokens) is longer than "
                                       f"max_model_len ({limit}); shorten it")
        if not pooling and num_prompt >= limit:
            raise RequestRejectedError(
                f"request {rid!r}: the prompt ({num_prompt} tokens) leaves no room for any output within "
                f"max_model_len ({limit}); shorten the prompt")
        unset = request.max_tokens is None
        room = None
        if unset:   # the rest of the context, or of the KV cache when it holds less
            request.max_tokens = limit - num_prompt
            room = bm.num_usable_blocks * bm.block_size - num_prompt + 1   # the last token needs no slot
            if 1 <= room < request.max_tokens:
                request.max_tokens = room
        elif not pooling and num_prompt + request.max_tokens > limit:
            # as vLLM's engine: the output stops at the end of the context (finish reason "length"); the server
            # refuses such a request itself (a 400, as vLLM's)
            request.max_tokens = limit - num_prompt
        min_tokens = request.sampling_params.min_tokens
        if min_tokens > request.max_tokens:
            raise RequestRejectedError(
                f"request {rid!r}: min_tokens ({min_tokens}) is more than the {request.max_tokens} tokens "
                f"the prompt ({num_prompt} tokens) leaves in this engine's "
                + ("KV cache" if request.max_tokens == room else f"max_model_len ({limit})")
                + "; lower min_tokens or shorten the prompt", param="min_tokens")
        if unset and request.default_max_tokens is not None and request.max_tokens > request.default_max_tokens:
            request.max_tokens = min(request.max_tokens,
                                     max(request.default_max_tokens, request.sampling_params.min_tokens))
        # The last sampled token is never fed back, so it needs no KV slot.
        need = bm.blocks_needed(num_prompt + request.max_tokens - 1)
        if need > bm.num_usable_blocks:
            alone = bm.blocks_needed(num_prompt)   # the prompt by itself: no max_tokens can help
            param = None
            if pooling or alone > bm.num_usable_blocks:
                what = f"the {'input' if pooling else 'prompt'} ({num_prompt} tokens)"
                need, fix = alone, "shorten it"
            else:
                what = f"the prompt ({num_prompt} tokens) plus max_tokens ({request.max_tokens})"
                fix, param = "lower max_tokens", "max_tokens"
            raise RequestRejectedError(
                f"request {rid!r}: {what} needs {need} KV blocks of {bm.block_size} tokens, but the KV cache has only "
                f"{bm.num_usable_blocks}; {fix} or give the cache more memory", param=param)
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and num_prompt > budget:
            raise RequestRejectedError(
                f"request {rid!r}: the prompt has {num_prompt} tokens, more than max_num_batched_tokens "
                f"({budget}) with chunked prefill disabled; enable chunked prefill or raise the budget")
        cap = self.config.max_waiting_requests
        # requests that arrive between two steps wait until the next one even when the batch has room for them:
        # the cap counts the waiting requests beyond the running batch's free places
        free = max(self.config.max_num_seqs - len(self.running), 0)
        if cap is not None and len(self.waiting) >= cap + free:
            raise QueueFullError(f"the waiting queue is full ({cap} requests beyond the running batch); retry later")
        request.status = RequestStatus.WAITING
        request.arrival_seq = next(self._arrivals)
        self.requests[rid] = request
        self._enqueue(request)

    @staticmethod
    def _rank(req: Request) -> tuple[int, int]:
        """A request's place in the priority policy's order (smaller: more important)."""
        return req.priority, req.arrival_seq

    def _enqueue(self, req: Request, front: bool = False) -> None:
        """Into the waiting queue: at its end (``front``: its start) first come, first served; by rank with
        the priority policy."""
        if not self._by_priority:
            if front:
                self.waiting.appendleft(req)
            else:
                self.waiting.append(req)
            return
        rank = self._rank(req)
        if not self.waiting or rank >= self._rank(self.waiting[-1]):
            self.waiting.append(req)
        else:
            self.waiting.insert(bisect.bisect_right(self.waiting, rank, key=self._rank), req)

    def _victim(self, exclude: set[str]) -> Request | None:
        """The running request to preempt: the last admitted (first come, first served) or the least
        important (priority); none outside ``exclude`` -> None."""
        candidates = (r for r in reversed(self.running) if r.request_id not in exclude)
        if not self._by_priority:
            return next(candidates, None)
        return max(candidates, key=self._rank, default=None)

    # ---------------------------------------------------------------- scheduling

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch, allocating blocks; advances ``num_computed_tokens``."""
        bm = self.block_manager
        bm.begin_schedule()
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        done: set[str] = set()        # request ids scheduled this step
        preempted: list[str] = []     # by the running requests' growth (no admission then)
        displaced: list[str] = []     # by a more important arrival (priority policy)
        early: list[ScheduledRequest] = []
        new_ids: list[str] = []
        if self._by_priority and self.waiting:
            budget -= self._admit_over_lower_ranks(budget, early, done, displaced, new_ids)

        running = RequestStatus.RUNNING
        decodes: list[Request] = []
        prefills: list[Request] = []
        max_model_len = self.max_model_len
        for r in self.running:
            pending = r.num_pending_tokens
            left = r.num_tokens + pending - r.num_computed_tokens
            if left == 1:
                if pending and (r.num_output_tokens + pending >= r.max_tokens
                                or r.num_tokens + pending >= max_model_len):
                    continue   # the token in flight is its last one
                decodes.append(r)
            elif left > 1:
                prefills.append(r)
        if self._by_priority:
            decodes.sort(key=self._rank)
            prefills.sort(key=self._rank)
        draft_room = (self.max_decode_rows - len(decodes) if self.max_decode_rows is not None else max_model_len)
        # blocks the decodes after each one need for their own token (drafts may not take them)
        reserve = ([0] * len(decodes) if self.proposer is None or draft_room <= 0
                   else _later_needs([bm.blocks_to_take(r, 1) for r in decodes]))
        stalled = False   # a prompt chunk that cannot reach the end of an image this step: no admissions
        for is_decode, group in ((True, decodes), (False, prefills)):
            if not is_decode and (prefills or self.waiting):
                budget = self._prefill_budget(budget, len(scheduled))
            for index, req in enumerate(group):
                if budget == 0:
                    break
                if req.request_id in done or (preempted and req.status is not running):
                    continue   # admitted before the loop, or preempted earlier in it
                start = req.num_computed_tokens
                num_tokens = req.num_tokens + req.num_pending_tokens
                num_new = min(num_tokens - start, budget)
                if req.num_pending_tokens and not bm.can_allocate(req, num_new):
                    continue   # no preemption for a token that may end the request: next step, once known
                drafts = (self._drafts(req, min(budget, draft_room + 1), reserve[index])
                          if is_decode and self.proposer is not None and draft_room > 0 else ())
                if drafts:   # verified with the token: the step samples after each of them
                    draft_room -= len(drafts)
                    req.draft_token_ids = drafts
                    scheduled.append(ScheduledRequest(req, 1 + len(drafts), start, True, True, len(drafts)))
                    req.num_computed_tokens = start + 1 + len(drafts)
                    done.add(req.request_id)
                    budget -= 1 + len(drafts)
                    continue
                if not is_decode and self.config.enable_chunked_prefill and not bm.can_allocate(req, num_new):
                    # a prompt chunk without room: a shorter one that fits, else it waits with its blocks while
                    # this step's other work runs (preempting itself would throw its computed tokens away; a
                    # decode that needs its blocks preempts it); with nothing else to run, preemption as usual
                    fit = self._fitting_chunk(req, num_new)
                    if fit and self.whole_images:   # (a chunk that fits but ends inside an image: none)
                        fit = self._whole_images(req, start, fit)
                    if fit:
                        num_new = fit
                    elif scheduled or early:
                        continue
                if not is_decode and self.whole_images:
                    num_new = self._whole_images(req, start, num_new)
                    if not num_new:   # (the budget left: the next step's, whose decodes come first)
                        stalled = self.hold_for_images
                        continue
                while not bm.allocate_slots(req, num_new):
                    victim = self._victim(done)
                    assert victim is not None   # req itself is a candidate
                    self._preempt(victim)
                    preempted.append(victim.request_id)
                    if victim is req:
                        break
                else:
                    req.num_computed_tokens = start + num_new
                    scheduled.append(ScheduledRequest(req, num_new, start, start + num_new == num_tokens, is_decode))
                    done.add(req.request_id)
                    budget -= num_new

        scheduled.extend(early)   # prefills, after the decodes
        adapters = self._running_adapters() if self.max_loras else set()
        skipped = 0   # waiting requests passed over because their adapter has no slot
        while (not preempted and not displaced and not stalled and len(self.waiting) > skipped and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[skipped]
            if req.num_pending_tokens:
                break   # preempted with a token in flight: admitted once the token is known
            if req.lora is not None and not self._fits(req, adapters):
                # its adapter waits for a slot (the running requests of another adapter to finish); the requests
                # behind it whose adapter has a slot, or that need none, go on, until it has waited long enough
                # that the running adapters must drain for it (else a stream of their requests would starve it)
                req.adapter_waits += 1
                if req.adapter_waits > MAX_ADAPTER_WAIT_STEPS:
                    break
                skipped += 1
                if skipped >= MAX_ADAPTER_SKIPS:
                    break
                continue
            cached, num_cached = self._cached_prefix(req)
            num_new = req.num_tokens - num_cached
            if num_new > budget:
                if not self.config.enable_chunked_prefill and req.num_output_tokens == 0:
                    break
                num_new = budget
            if self.whole_images:
                num_new = self._whole_images(req, num_cached, num_new)
                if not num_new:
                    break
            if not bm.allocate_slots(req, num_new, cached, query=self._queries(req)):
                break
            scheduled.append(self._admit(req, num_new, num_cached, skipped))
            new_ids.append(req.request_id)
            budget -= num_new
            if req.lora is not None:
                adapters.add(req.lora_id)

        num_decodes = sum(1 for s in scheduled if s.is_decode)   # first in the list
        finished, self._finished_ids = self._finished_ids, []
        restores, saves = bm.take_state_plan()
        return SchedulerOutput(
            scheduled=scheduled,
            num_scheduled_tokens=sum(s.num_new_tokens for s in scheduled),
            num_decodes=num_decodes,
            new_request_ids=new_ids,
            preempted_request_ids=displaced + preempted,
            finished_request_ids=finished,
            state_restores=restores,
            state_saves=saves,
        )

    def _drafts(self, req: Request, budget: int, reserved: int = 0) -> list[int]:
        """Draft tokens for a decode of ``req``, with their slots allocated: cut to the budget, the request's
        limits and the free blocks beyond ``reserved`` (those this step's later decodes need for their own token),
        so speculation never preempts."""
        assert self.proposer is not None
        if req.num_pending_tokens:
            return []
        limit = min(budget - 1, req.max_tokens - req.num_output_tokens - 1,
                    self.max_model_len - req.num_tokens - 1)
        drafts = self.proposer(req, limit) if limit > 0 else []
        bm = self.block_manager
        room = bm.num_free_blocks - reserved
        while drafts and bm.blocks_to_take(req, 1 + len(drafts)) > room:
            drafts = drafts[:-1]   # the drafts that fit the blocks it holds and those left over
        if drafts and not bm.allocate_slots(req, 1 + len(drafts)):
            return []
        return drafts

    def _running_adapters(self) -> set[int]:
        return {r.lora_id for r in self.running if r.lora is not None}

    def _fits(self, req: Request, adapters: set[int]) -> bool:
        """Whether ``req``'s LoRA adapter can run beside ``adapters`` (at most ``max_loras`` of them: one device
        slot each)."""
        return req.lora_id in adapters or len(adapters) < self.max_loras

    @staticmethod
    def _queries(req: Request) -> bool:
        """Whether admitting ``req`` counts as a prefix-cache query: its first admission, with the lookup made
        (a resumed request finding its own blocks again is no query, as in vLLM's hit rate)."""
        return req.status == RequestStatus.WAITING and not req.computes_whole_prompt

    def _cached_prefix(self, req: Request) -> tuple[list[int], int]:
        if not req.computes_whole_prompt:
            return self.block_manager.get_computed_blocks(req)
        return [], 0   # every prompt position's logits (or hidden states) are wanted

    def _admit(self, req: Request, num_new: int, num_cached: int, index: int = 0) -> ScheduledRequest:
        """Move waiting request ``index`` (the head, or one behind requests waiting for an adapter slot), whose
        slots are allocated, to the running requests."""
        if index:
            del self.waiting[index]
        else:
            self.waiting.popleft()
        self.running.append(req)
        if req.status == RequestStatus.WAITING:   # first admission (not a resume)
            req.num_cached_tokens = num_cached
            req.metrics.num_cached_prompt_tokens = num_cached
            req.metrics.first_scheduled_time = time.time()
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_cached
        return self._commit(req, num_new, is_decode=False)

    def _admit_over_lower_ranks(self, budget: int, early: list[ScheduledRequest], done: set[str],
                                displaced: list[str], new_ids: list[str]) -> int:
        """Priority policy, before anything else is scheduled: admit the waiting head by preempting less
        important running requests, when it outranks them and finds no sequence slot or too few blocks, and
        only when enough of them can make the room. Returns the tokens it takes from the budget."""
        bm = self.block_manager
        head = self.waiting[0]
        if head.num_pending_tokens or (head.lora is not None and not self._fits(head, self._running_adapters())):
            return 0
        rank = self._rank(head)
        lower = sorted((r for r in self.running if self._rank(r) > rank), key=self._rank, reverse=True)
        if not lower:
            return 0
        cached, num_cached = self._cached_prefix(head)
        # leave one token of budget to each running request (decodes first)
        num_new = min(head.num_tokens - num_cached, budget - len(self.running))
        if self.whole_images and num_new > 0:   # (no one preempted for a chunk that cannot reach an image's end)
            num_new = self._whole_images(head, num_cached, num_new)
        if num_new <= 0 or (num_new < head.num_tokens - num_cached and not self.config.enable_chunked_prefill
                            and head.num_output_tokens == 0):
            return 0
        full = len(self.running) >= self.config.max_num_seqs
        if not full and bm.can_allocate(head, num_new, cached):
            return 0   # fits as it is: admitted in turn
        need = bm.blocks_to_take(head, num_new, cached)
        # the running requests that stay decode this step too: keep the blocks their next tokens take
        next_token = {r.request_id: bm.blocks_to_take(r, 1) for r in self.running}
        reserved = sum(next_token.values())
        free, victims = bm.num_free_blocks, []
        for victim in lower:
            if free >= need + reserved and (victims or not full):
                break
            victims.append(victim)
            free += bm.num_exclusive_blocks(victim)
            reserved -= next_token[victim.request_id]
        if free < need + reserved or (full and not victims):
            return 0   # not even all of them make the room: nobody is preempted
        for victim in victims:
            self._preempt(victim)
            displaced.append(victim.request_id)
        # the largest chunk (at most the one planned: the budget per running request grew with the victims gone)
        # that leaves the staying requests their next blocks; a cached block of the head's prompt that only a
        # victim held comes back through the free list and counts
        cached, num_cached = self._cached_prefix(head)
        num_new = min(head.num_tokens - num_cached, num_new)
        if self.config.enable_chunked_prefill or head.num_output_tokens:
            num_new = self._fitting_chunk(head, num_new, cached, reserved)
        if self.whole_images:
            num_new = self._whole_images(head, num_cached, num_new)
        if num_new <= 0 or bm.blocks_to_take(head, num_new, cached) + reserved > bm.num_free_blocks \
                or not bm.allocate_slots(head, num_new, cached, query=self._queries(head)):
            return 0
        early.append(self._admit(head, num_new, num_cached))
        done.add(head.request_id)
        new_ids.append(head.request_id)
        return num_new

    def _fitting_chunk(self, req: Request, num_new: int, cached: Sequence[int] = (), reserved: int = 0) -> int:
        """The most of ``num_new`` tokens whose blocks the free list has, keeping ``reserved`` blocks back."""
        bm = self.block_manager
        lo, hi = 0, num_new   # blocks taken grow with the tokens: the largest that fits, by bisection
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if bm.blocks_to_take(req, mid, cached) + reserved <= bm.num_free_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _prefill_budget(self, budget: int, num_decodes: int) -> int:
        """What is left of ``budget`` for prefill chunks beside ``num_decodes`` scheduled decodes."""
        if not num_decodes or self.prefill_allowance is None or not self.config.enable_chunked_prefill:
            return budget
        allowance = self.prefill_allowance(num_decodes)
        if allowance is None:
            return budget
        return min(budget, max(allowance, self.block_manager.block_size, self.whole_images))

    @staticmethod
    def _whole_images(req: Request, start: int, num_new: int) -> int:
        """The most of a prompt chunk of ``num_new`` tokens from ``start`` that does not end inside one of the
        request's images (0: the chunk starts at or inside an image whose end it does not reach)."""
        end = start + num_new
        for item in req.images:
            if item.offset < end < item.end and not item.prompt:
                return max(0, item.offset - start)
        return num_new

    def _commit(self, req: Request, num_new: int, is_decode: bool) -> ScheduledRequest:
        start = req.num_computed_tokens
        req.num_computed_tokens = start + num_new
        return ScheduledRequest(req, num_new, start, sample=req.num_computed_tokens == req.num_tokens,
                                is_decode=is_decode)

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req)
        self.running.remove(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req, front=True)

    # ---------------------------------------------------------------- results

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           sampled_token_ids: Sequence[int | None]) -> list[Request]:
        """Append this step's sampled tokens and apply stop conditions (all but stop strings).

        Args:
            scheduler_output: the step that ran.
            sampled_token_ids: one per ``scheduled`` entry: the sampled id where ``sample`` is
                set, ``None`` elsewhere; for an entry with drafts, the list of the step's tokens
                (accepted drafts, then the one sampled after them: see
                :func:`plinth.core.speculative.accepted_tokens`).

        Returns:
            The requests finished by this update (EOS unless ``ignore_eos``, a stop token id,
            ``max_tokens``, ``max_model_len``); their blocks are already released. EOS and
            stop ids do not count before ``min_tokens`` output tokens.
        """
        entries = scheduler_output.scheduled
        if len(sampled_token_ids) != len(entries):
            raise ValueError(f"got {len(sampled_token_ids)} sampled tokens for {len(entries)} scheduled requests")
        finished: list[Request] = []
        now = time.time()
        running = RequestStatus.RUNNING
        max_model_len = self.max_model_len
        for entry, token in zip(entries, sampled_token_ids, strict=True):
            req = entry.request
            if entry.sample != (token is not None):
                raise ValueError(f"request {req.request_id!r}: sample={entry.sample} but got token {token!r}")
            if token is None or req.is_finished:
                continue   # mid-prefill, or finished/aborted since it was scheduled
            if entry.num_drafts:
                tokens = token if isinstance(token, list) else [token]
                if not 1 <= len(tokens) <= entry.num_drafts + 1:
                    raise ValueError(f"request {req.request_id!r}: {len(tokens)} tokens from a step with "
                                     f"{entry.num_drafts} drafts")
                req.draft_token_ids = []
                # the cache holds the step's first token and the accepted drafts; the rejected positions are
                # overwritten later
                req.num_computed_tokens = entry.num_computed_tokens + len(tokens)
            else:
                tokens = (token,)
            metrics = req.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            status = None
            for token in tokens:
                # (a request preempted since it was scheduled keeps the token and recomputes later)
                req.append_output_token(token)
                num_output = len(req.output_token_ids)
                if token in req.stop_token_ids and num_output > req.sampling_params.min_tokens:
                    if token in req.sampling_params.stop_token_ids:
                        req.stop_reason = token
                    status = RequestStatus.FINISHED_STOPPED
                elif num_output >= req.max_tokens or req.num_tokens >= max_model_len:
                    status = RequestStatus.FINISHED_LENGTH
                if status is not None:
                    break
            if req.num_computed_tokens >= req.num_tokens or entry.num_drafts:
                # the step in flight computes past this token (or this step computed the accepted drafts):
                # the blocks they completed are known now
                self.block_manager.register_computed_blocks(req)
            if status is None:
                continue
            self._finish(req, status, remove_from_running=False)
            finished.append(req)
        if finished:
            self.running = [r for r in self.running if r.status is running]
        return finished

    def finish_request(self, request_id: str, reason: FinishReason,
                       stop_reason: str | int | None = None) -> Request | None:
        """Finish an unfinished request (a stop string, an abort); returns it, or None if unknown."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        if stop_reason is not None:
            req.stop_reason = stop_reason
        self._finish(req, _STATUS_OF_REASON[FinishReason(reason)], remove_from_running=True)
        return req

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        """Abort requests (waiting or running), releasing their blocks at once; unknown ids are ignored."""
        out = []
        for rid in request_ids:
            req = self.finish_request(rid, FinishReason.ABORT)
            if req is not None:
                out.append(req)
        return out

    def _finish(self, req: Request, status: RequestStatus, remove_from_running: bool) -> None:
        if req.status == RequestStatus.RUNNING:
            if remove_from_running:
                self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.block_manager.free(req)
        req.status = status
        req.metrics.finished_time = time.time()
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)

    # ---------------------------------------------------------------- introspection

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions=self.num_preemptions,
            kv_cache_usage=self.block_manager.usage,
            prefix_cache=dataclasses.replace(self.block_manager.stats),
        )
