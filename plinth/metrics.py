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
        # speculative decoding: the engine's running totals, added to the counters as they grow
        self._spec = {key: Counter(f"plinth_spec_decode_{key}", help_text, lab, registry=r).labels(model_name)
                      for key, help_text in (("num_drafts", "Sequence steps that carried draft tokens."),
                                             ("num_draft_tokens", "Draft tokens computed."),
                                             ("num_accepted_tokens", "Draft tokens accepted."))}
        self._spec_seen = dict.fromkeys(self._spec, 0)

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
            if beams is not None:
                self.generation_tokens.inc(sum(len(b.token_ids) for b in beams[i]))
                reason = str(beams[i][0].finish_reason) if beams[i] else "abort"
            else:
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
            spec = engine_stats.get("speculative") or {}
            for key, counter in self._spec.items():
                total = int(spec.get(key, 0))
                if total > self._spec_seen[key]:
                    counter.inc(total - self._spec_seen[key])
                    self._spec_seen[key] = total
        return generate_latest(self.registry)


class RequestTracker:
    """Observes the outputs of one engine request; call :meth:`close` exactly once at the end."""

    def __init__(self, metrics: ServerMetrics):
        self._m = metrics
        self._start = time.monotonic()
        self._last: float | None = None
        self._seen: list[int] = []      # tokens seen so far, per sequence
        self._finish_reason: str | None = None
        self._closed = False

    def observe(self, out: RequestOutput | Any) -> None:
        now = time.monotonic()
        m = self._m
        if not isinstance(out.outputs, list):   # an embedding (PoolingRequestOutput): prompt tokens only
            if not self._seen:
                self._seen = [0]
                m.prompt_tokens.inc(len(out.prompt_token_ids))
            if out.finished:
                self._finish_reason = "stop" if out.outputs is not None else "abort"
            return
        if not self._seen:
            self._seen = [0] * len(out.outputs)
            m.prompt_tokens.inc(len(out.prompt_token_ids))
        growth = [len(c.token_ids) - seen for c, seen in zip(out.outputs, self._seen, strict=True)]
        steps = max(growth, default=0)   # sequences of one request advance together
        if steps > 0:
            m.generation_tokens.inc(sum(growth))
            if self._last is None:
                m.ttft.observe(now - self._start)
                steps -= 1   # the first token has no inter-token gap
                if steps > 0:   # later tokens came with it: the engine's time between its first and latest token
                    met = getattr(out, "metrics", None)
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
