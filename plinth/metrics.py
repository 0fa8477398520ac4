"""Prometheus metrics of the server, in a registry of their own (one per app, no global state).

Latencies are measured where the client sees them: from the moment the server hands a
request to the engine front to the moment each output reaches the server.

Metric names (all labelled with ``model_name``):

- ``plinth_time_to_first_token_seconds`` (histogram)
- ``plinth_inter_token_latency_seconds`` (histogram, one observation per generated token after the first)
- ``plinth_e2e_request_latency_seconds`` (histogram)
- ``plinth_num_requests_running``, ``plinth_num_requests_waiting`` (gauges)
- ``plinth_kv_cache_usage_ratio`` (gauge, 0..1: blocks owned by requests over usable blocks)
- ``plinth_prefix_cache_hit_rate`` (gauge, 0..1: prompt tokens served from the prefix cache)
- ``plinth_prompt_tokens_total``, ``plinth_generation_tokens_total`` (counters)
- ``plinth_requests_finished_total`` (counter, label ``finish_reason``: stop, length, abort, error)
- ``plinth_request_queue_time_seconds`` (histogram: arrival to first admission)
- ``plinth_request_prompt_tokens``, ``plinth_request_generation_tokens`` (histograms, per finished request)
- ``plinth_num_preemptions_total`` (counter: requests preempted, their blocks taken and recomputed later)
- ``plinth_prefix_cache_queries_total``, ``plinth_prefix_cache_hits_total`` (counters, in tokens: prompt tokens
  looked up at first admissions, and those found in the cache)
- ``plinth_spec_decode_num_drafts_total``, ``plinth_spec_decode_num_draft_tokens_total``,
  ``plinth_spec_decode_num_accepted_tokens_total`` (counters, speculative decoding: sequence steps with drafts,
  draft tokens, accepted draft tokens)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from plinth.core.request import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5)

#: tokens per request: 1, 2, 5, 10, 20, 50, ... up to 5 million
_TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5))

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """Every metric of one server.

    Args:
        model_name: the served model name (the ``model_name`` label).
        registry: where to register (default: a new ``CollectorRegistry``).
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        r, lab = self.registry, ["model_name"]
        self.ttft = Histogram("plinth_time_to_first_token_seconds", "Time to the first generated token.",
                              lab, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("plinth_inter_token_latency_seconds", "Time between generated tokens.",
                             lab, buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("plinth_e2e_request_latency_seconds", "Time from arrival to the last output.",
                             lab, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.running = Gauge("plinth_num_requests_running", "Requests in the running batch.",
                             lab, registry=r).labels(model_name)
        self.waiting = Gauge("plinth_num_requests_waiting", "Requests queued for admission.",
                             lab, registry=r).labels(model_name)
        self.kv_usage = Gauge("plinth_kv_cache_usage_ratio", "Fraction of KV-cache blocks owned by requests.",
                              lab, registry=r).labels(model_name)
        self.prefix_hit_rate = Gauge("plinth_prefix_cache_hit_rate",
                                     "Fraction of admitted prompt tokens served from the prefix cache.",
                                     lab, registry=r).labels(model_name)
        self.prompt_tokens = Counter("plinth_prompt_tokens", "Prompt tokens of requests that started.",
                                     lab, registry=r).labels(model_name)
        self.generation_tokens = Counter("plinth_generation_tokens", "Generated tokens.",
                                         lab, registry=r).labels(model_name)
        self._finished = Counter("plinth_requests_finished", "Finished requests by finish reason.",
                                 ["model_name", "finish_reason"], registry=r)
        for reason in ("stop", "length", "abort", "error"):
            self._finished.labels(model_name, reason)   # export zeros from the start
        self.queue_time = Histogram("plinth_request_queue_time_seconds", "Time from arrival to the first admission.",
                                    lab, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.request_prompt_tokens = Histogram("plinth_request_prompt_tokens", "Prompt tokens per finished request.",
                                               lab, buckets=_TOKEN_BUCKETS, registry=r).labels(model_name)
        self.request_generation_tokens = Histogram("plinth_request_generation_tokens",
                                                   "Generated tokens per finished request (all its sequences).",
                                                   lab, buckets=_TOKEN_BUCKETS, registry=r).labels(model_name)
        # the engine's running totals (a path into its stats), added to the counters as they grow
        totals = ((("num_preemptions",), "plinth_num_preemptions", "Requests preempted (recomputed later)."),
                  (("prefix_cache", "query_tokens"), "plinth_prefix_cache_queries",
                   "Prompt tokens looked up in the prefix cache (first admissions)."),
                  (("prefix_cache", "hit_tokens"), "plinth_prefix_cache_hits",
                   "Prompt tokens served from the prefix cache."),
                  (("speculative", "num_drafts"), "plinth_spec_decode_num_drafts",
                   "Sequence steps that carried draft tokens."),
                  (("speculative", "num_draft_tokens"), "plinth_spec_decode_num_draft_tokens", "Draft tokens computed."),
                  (("speculative", "num_accepted_tokens"), "plinth_spec_decode_num_accepted_tokens",
                   "Draft tokens accepted."))
        self._totals = [(path, Counter(name, help_text, lab, registry=r).labels(model_name))
                        for path, name, help_text in totals]
        self._totals_seen = [0] * len(self._totals)

    def count_finished(self, reason: str) -> None:
        self._finished.labels(self.model_name, reason).inc()

    def request(self) -> RequestTracker:
        """Start timing one engine request."""
        return RequestTracker(self)

    def count_beam_search(self, prompt_lens: Sequence[int], beams: Sequence[Sequence[Any]] | None, error: bool,
                          seconds: float) -> None:
        """One beam search that ran (its rounds' engine requests are not counted one by one): each prompt counts
        as one request, its prompt tokens once, the tokens of the beams returned for it as generated tokens, and
        the best beam's finish reason (``beams`` None: cut short, ``abort``, or ``error``)."""
        for i, n in enumerate(prompt_lens):
            self.prompt_tokens.inc(n)
            self.request_prompt_tokens.observe(n)
            if beams is not None:
                generated = sum(len(b.token_ids) for b in beams[i])
                self.generation_tokens.inc(generated)
                self.request_generation_tokens.observe(generated)
                reason = str(beams[i][0].finish_reason) if beams[i] else "abort"
            else:
                self.request_generation_tokens.observe(0)
                reason = "error" if error else "abort"
            self.e2e.observe(seconds)
            self.count_finished(reason)

    def render(self, engine_stats: dict[str, Any] | None = None) -> bytes:
        """The exposition text, with the gauges refreshed from ``engine_stats`` first."""
        if engine_stats:
            self.running.set(engine_stats.get("num_running", 0))
            self.waiting.set(engine_stats.get("num_waiting", 0))
            self.kv_usage.set(engine_stats.get("kv_cache_usage", 0.0))
            self.prefix_hit_rate.set(engine_stats.get("prefix_cache_hit_rate", 0.0))
            for i, (path, counter) in enumerate(self._totals):
                total: Any = engine_stats
                for key in path:
                    total = (total or {}).get(key, 0)
                total = int(total or 0)
                if total > self._totals_seen[i]:
                    counter.inc(total - self._totals_seen[i])
                self._totals_seen[i] = total   # (a total that fell was reset: counted on from there)
        return generate_latest(self.registry)


class RequestTracker:
    """Observes the outputs of one engine request; call :meth:`close` exactly once at the end."""

    def __init__(self, metrics: ServerMetrics):
        self._m = metrics
        self._start = time.monotonic()
        self._last: float | None = None
        self._seen: list[int] = []      # tokens seen so far, per sequence
        self._num_prompt: int | None = None
        self._queued = False            # the queue time is observed
        self._finish_reason: str | None = None
        self._closed = False

    def observe(self, out: RequestOutput | Any) -> None:
        now = time.monotonic()
        m = self._m
        met = getattr(out, "metrics", None)
        if not self._queued and met is not None and met.first_scheduled_time is not None:
            self._queued = True
            m.queue_time.observe(max(met.first_scheduled_time - met.arrival_time, 0.0))
        if self._num_prompt is None:
            self._num_prompt = getattr(out, "num_prompt_positions", None) or len(out.prompt_token_ids)
        if not isinstance(out.outputs, list):   # an embedding (PoolingRequestOutput): prompt tokens only
            if not self._seen:
                self._seen = [0]
                m.prompt_tokens.inc(len(out.prompt_token_ids))
            if out.finished:
                self._finish_reason = "stop" if out.outputs is not None else "abort"
            return
        if not self._seen:
            self._seen = [0] * len(out.outputs)
            m.prompt_tokens.inc(out.num_prompt_positions)
        growth = [len(c.token_ids) - seen for c, seen in zip(out.outputs, self._seen, strict=True)]
        steps = max(growth, default=0)   # sequences of one request advance together
        if steps > 0:
            m.generation_tokens.inc(sum(growth))
            if self._last is None:
                m.ttft.observe(now - self._start)
                steps -= 1   # the first token has no inter-token gap
                if steps > 0:   # later tokens came with it: the engine's time between its first and latest token
                    first, latest = (met.first_token_time, met.last_token_time) if met is not None else (None, None)
                    span = max(latest - first, 0.0) if first is not None and latest is not None else 0.0
                    for _ in range(steps):
                        m.itl.observe(span / steps)
            else:
                for _ in range(steps):
                    m.itl.observe((now - self._last) / steps)
            self._last = now
            self._seen = [len(c.token_ids) for c in out.outputs]
        if out.finished:
            reasons = [str(c.finish_reason) for c in out.outputs if c.finish_reason is not None]
            self._finish_reason = "abort" if "abort" in reasons else (reasons[0] if reasons else "abort")

    def discard(self) -> None:
        """Count nothing: the engine refused the request when it arrived (a 400, as the server's own checks)."""
        self._closed = True

    def close(self, error: bool = False) -> None:
        """Count the outcome: its finish reason, ``abort`` when it was cut short, or ``error``."""
        if self._closed:
            return
        self._closed = True
        m = self._m
        m.e2e.observe(time.monotonic() - self._start)
        m.count_finished("error" if error else (self._finish_reason or "abort"))
        if self._num_prompt is not None:   # it started: its sizes
            m.request_prompt_tokens.observe(self._num_prompt)
            m.request_generation_tokens.observe(sum(self._seen))
