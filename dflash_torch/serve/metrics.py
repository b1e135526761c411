"""What `dflash serve` counts: Prometheus figures in a private registry (`/metrics`), fed by the engine's worker
after every cycle of a request and when it ends, and the same figures as JSON with the request in flight and the
last finished ones (`/metrics?format=json`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..decoding.speculative import Stats

if TYPE_CHECKING:  # the engine imports this module
    from .engine import Engine, Job

log = logging.getLogger("dflash.server")


class Metrics:
    """Prometheus figures in a private registry (several apps may live in one process)."""

    def __init__(self, engine: Engine) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.engine = engine
        r = self.registry = CollectorRegistry()
        self.requests = Counter("dflash_requests", "Requests by endpoint and HTTP status (499: the client left)",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("dflash_generation_tokens", "Tokens generated", registry=r)
        self.cached_tokens = Counter("dflash_prefix_cache_cached_tokens",
                                     "Prompt tokens taken from the prefix cache instead of prefilled", registry=r)
        self.prefix_hits = Counter("dflash_prefix_cache_hits", "Requests that started from a cached prefix",
                                   registry=r)
        self.ttft = Histogram("dflash_time_to_first_token_seconds", "Time to first token, queueing included",
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.tok_s = Histogram("dflash_decode_tokens_per_second", "Decode throughput per request (prefill excluded)",
                               buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000), registry=r)
        self.duration = Histogram("dflash_request_duration_seconds", "Request time, queueing included",
                                  buckets=(.05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=r)
        self.drafts = Counter("dflash_spec_decode_num_drafts", "Speculative cycles that drafted", registry=r)
        self.verify_widths = Counter("dflash_verify_passes", "Target passes after the prefill by width (1 = a plain "
                                     "step): what the adaptive block size, prompt lookup and the fallback chose",
                                     ["width"], registry=r)
        self.draft_tokens = Counter("dflash_spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("dflash_spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_per_pos = Counter("dflash_spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each block position", ["position"], registry=r)
        self.lookup_drafts = Counter("dflash_lookup_num_drafts", "Verify passes whose draft came from prompt lookup",
                                     registry=r)
        self.lookup_accepted = Counter("dflash_lookup_num_accepted_tokens", "Prompt-lookup draft tokens accepted",
                                       registry=r)
        self.datastore_drafts = Counter("dflash_datastore_num_drafts",
                                        "Verify passes whose draft came from the drafter's datastore", registry=r)
        self.datastore_accepted = Counter("dflash_datastore_num_accepted_tokens", "Datastore draft tokens accepted",
                                          registry=r)
        self.fallback_events = Counter("dflash_fallback_events", "Target-only fallback controller events",
                                       ["event"], registry=r)

        def live(f: Callable[[Stats], float]) -> Callable[[], float]:
            def read() -> float:
                job = engine.current  # read once: the worker may clear it meanwhile
                return f(job.stats) if job is not None else 0.0
            return read

        gauges = [
            ("dflash_model_ready", "1 once the model is loaded", lambda: float(engine.pipe is not None)),
            ("dflash_requests_waiting", "Requests in the queue", lambda: engine.queue.qsize()),
            ("dflash_requests_running", "Requests being generated (0 or 1)", lambda: float(engine.current is not None)),
            ("dflash_live_tokens_per_second", "Decode tok/s of the request in flight", live(lambda s: s.decode_tok_s)),
            ("dflash_live_acceptance_rate", "Draft acceptance rate of the request in flight",
             live(lambda s: s.acceptance_rate)),
            ("dflash_live_acceptance_length_mean", "Tokens per verify pass of the request in flight",
             live(lambda s: s.acceptance_length_mean)),
            ("dflash_live_generated_tokens", "Tokens generated so far by the request in flight",
             live(lambda s: s.generated_tokens)),
        ]
        for name, doc, f in gauges:
            Gauge(name, doc, registry=r).set_function(f)

    def sync_live(self, job: Job) -> None:
        """Move the job's new speculative counts and fallback events into the counters (every cycle)."""
        s, seen = job.stats, job.seen
        drafts = s.drafted_per_position[0] if s.drafted_per_position else 0
        for key, counter, value in (("drafts", self.drafts, drafts), ("draft", self.draft_tokens, s.drafted_tokens),
                                    ("accepted", self.accepted, s.accepted_tokens),
                                    ("lookup", self.lookup_drafts, s.lookup_cycles),
                                    ("lookup_accepted", self.lookup_accepted, s.lookup_accepted),
                                    ("datastore", self.datastore_drafts, s.datastore_cycles),
                                    ("datastore_accepted", self.datastore_accepted, s.datastore_accepted)):
            if value > seen.get(key, 0):
                counter.inc(value - seen.get(key, 0))
                seen[key] = value
        widths = seen.setdefault("widths", {})
        for w, value in s.widths.items():
            if value > widths.get(w, 0):
                self.verify_widths.labels(width=str(w)).inc(value - widths.get(w, 0))
                widths[w] = value
        per_pos = seen.setdefault("per_pos", [])
        for k, value in enumerate(s.accepted_per_position):
            if k == len(per_pos):
                per_pos.append(0)
            if value > per_pos[k]:
                self.accepted_per_pos.labels(position=str(k)).inc(value - per_pos[k])
                per_pos[k] = value
        events = job.controller.events if job.controller else []
        for e in events[seen.get("events", 0):]:
            self.fallback_events.labels(event=e["event"]).inc()
            if e["event"] == "fallback":
                log.info("%s: speculation %.2f ms/token vs target %.2f ms/token at token %d: target-only, "
                         "probing again in %d tokens", job.id, e["spec_ms_per_token"], e["target_ms_per_token"],
                         e["token"], e["probe_in_tokens"])
            elif e["event"] == "carried":
                log.info("%s: starts target-only (speculation was slower in an earlier request), probing in %d "
                         "tokens", job.id, e["probe_in_tokens"])
            else:
                log.info("%s: %s speculation at token %d", job.id, e["event"], e["token"])
        seen["events"] = len(events)

    def record(self, job: Job, status: int) -> None:
        """Count a finished (or cancelled, or failed) job."""
        self.requests.labels(endpoint=job.endpoint, status=str(status)).inc()
        self.prompt_tokens.inc(len(job.prompt_ids) if job.first_token else 0)
        self.generation_tokens.inc(job.completion_tokens)
        if job.stats.cached_tokens:
            self.cached_tokens.inc(job.stats.cached_tokens)
            self.prefix_hits.inc()
        if job.first_token:
            self.ttft.observe(job.first_token - job.created)
        if job.stats.decode_tok_s > 0:
            self.tok_s.observe(job.stats.decode_tok_s)
        self.duration.observe(time.perf_counter() - job.created)

    def text(self) -> bytes:
        """The Prometheus text exposition."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def as_json(self) -> dict:
        """The same figures as JSON, with the request in flight and the last finished ones."""
        figures: dict = {}
        for family in self.registry.collect():
            for s in family.samples:
                if s.name.endswith(("_created", "_bucket")):
                    continue
                name = s.name.removeprefix("dflash_")
                if s.labels:
                    key = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                    figures.setdefault(name, {})[key] = s.value
                else:
                    figures[name] = s.value
        e, job = self.engine, self.engine.current
        pipe = e.pipe
        return {
            "model": e.name, "ready": pipe is not None, "error": e.error,
            "drafter": str(pipe.draft_path) if pipe and pipe.drafter else None,
            "device": str(pipe.device) if pipe else None,
            "queue": {"waiting": e.queue.qsize(), "max": e.config.max_queue, "running": int(job is not None)},
            "metrics": figures,
            "prefix_cache": None if e.prefix is None else {
                "entries": len(e.prefix.entries), "max_entries": e.prefix.max_entries, "bytes": e.prefix.nbytes,
                "max_bytes": e.prefix.max_bytes, "hits": e.prefix.hits, "misses": e.prefix.misses,
                "disk": None if e.prefix.disk is None else {
                    "entries": len(e.prefix.disk.entries), "bytes": e.prefix.disk.nbytes,
                    "max_bytes": e.prefix.disk.max_bytes, "hits": e.prefix.disk_hits}},
            "current": job.summary() if job is not None else None,
            "recent": list(e.recent),
        }
