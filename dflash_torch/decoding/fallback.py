"""Target-only fallback: speculate only while it beats plain target steps, measured on the fly.

A speculative cycle costs a draft pass plus a wider verify pass; when the drafter is often wrong
(a domain it was not trained on, sampling at a high temperature) that costs more per committed token
than a plain target step. `FallbackController` is the per-cycle `controller` hook of
`speculative.generate_tokens`: it times committed tokens in both modes over a moving window, drops to
block size 1 when speculation is slower, and probes speculation again after a number of tokens. The
gap doubles each time a probe fails, and is at least long enough that the time the last window lost
against plain steps is `probe_budget` of the time between probes: where a wide verify costs several
decode steps (quantized targets on a CPU), a probe costs more, so it comes less often. While
speculation keeps winning, the plain steps are timed again now and then (`remeasure_after` tokens, the gap
doubling each time): one slow measurement (a busy host) would otherwise keep a losing drafter on for the
rest of the request, and a server's baseline from earlier requests may be stale. A server carries the
fallen-back state into the next request (`carry`), so each request does not pay for finding out again.
Output never depends on it: every token is the target's.
"""

from __future__ import annotations

from collections import deque

SPECULATE = 1 << 30  # "as wide as the drafter allows": the loop clamps it to its block size


class FallbackController:
    """Per-request block-size policy for `generate_tokens(controller=...)`.

    window: cycles per mode that a comparison uses. measure_steps: plain steps timed to get a
    baseline when none is known. probe_after: tokens of target-only decoding before speculation is
    tried again (doubled after each failed probe, up to max_probe_after). margin: speculation must
    be this fraction slower than the target before falling back (noise guard). probe_budget: the
    share of decoding time that failed probes may cost.
    target_s_per_token: a known baseline (e.g. from earlier requests) that spares the first measurement.
    carried: `carry()` of the previous request's controller: start fallen back, probing when it was due.
    remeasure_after: tokens of speculation before the plain steps are timed again (doubled after each
    time speculation still wins, up to max_probe_after).
    """

    def __init__(
        self,
        window: int = 4,
        measure_steps: int = 4,
        probe_after: int = 64,
        max_probe_after: int = 2048,
        margin: float = 0.05,
        target_s_per_token: float | None = None,
        probe_budget: float = 0.05,
        carried: dict | None = None,
        remeasure_after: int = 256,
    ) -> None:
        self.window, self.measure_steps, self.margin = window, measure_steps, margin
        self.probe_after, self.max_probe_after, self._first_probe = probe_after, max_probe_after, probe_after
        self.spec: deque[tuple[float, int]] = deque(maxlen=window)
        self.plain: deque[tuple[float, int]] = deque(maxlen=window)
        self.prior = target_s_per_token
        self.state = "speculate"  # or "measure" (timing plain steps) or "target" (fallen back)
        self.tokens = 0  # committed so far (the prefill's first token is not seen here)
        self.events: list[dict] = []
        self._fresh = 0  # speculative cycles since the last decision
        # The first speculative cycle also feeds the drafter the whole prompt (after a probe: every
        # token decoded meanwhile), a one-off cost that would bias the window: it is not timed.
        self._skip_first = True
        self._probe_at = 0
        self.probe_budget = probe_budget
        self._remeasure_gap = self._remeasure_at = remeasure_after
        if carried is not None:  # the drafter lost in an earlier request: stay off until its probe is due
            self.state, self._probe_at = "target", max(0, int(carried["probe_in_tokens"]))
            self.probe_after = int(carried["probe_after"])
            self.events.append({"event": "carried", "token": 0, "probe_in_tokens": self._probe_at})

    def block_size(self, stats) -> int:
        """Block size for the next cycle (1 = a plain target step)."""
        return SPECULATE if self.state == "speculate" else 1

    def observe(self, block_size: int, committed: int, seconds: float) -> None:
        """Record one cycle and switch mode when the measurements say so."""
        self.tokens += committed
        if block_size > 1:
            if self._skip_first:
                self._skip_first = False
                return
            self.spec.append((seconds, committed))
            self._fresh += 1
        elif self.state != "speculate":  # a 1-wide cycle while speculating is just the request's last token
            self.plain.append((seconds, committed))
        if self.state == "speculate" and self._fresh >= self.window:
            self._fresh = 0
            if self.target_s_per_token is None or self.tokens >= self._remeasure_at:
                self.state = "measure"
                self.plain.clear()  # time them afresh
            else:
                self._decide()
        elif self.state == "measure" and len(self.plain) >= self.measure_steps:
            self._decide()
            if self.state == "speculate":  # still winning: the next measurement comes later
                self._remeasure_at = self.tokens + self._remeasure_gap
                self._remeasure_gap = min(2 * self._remeasure_gap, self.max_probe_after)
                self._skip_first = True  # the drafter first catches up on the plain steps' tokens
        elif self.state == "target" and self.tokens >= self._probe_at:
            self.state, self._fresh, self._skip_first = "speculate", 0, True
            self.spec.clear()  # judge the probe on fresh cycles only
            self.events.append({"event": "probe", "token": self.tokens})

    @property
    def spec_s_per_token(self) -> float | None:
        """Seconds per committed token over the recent speculative cycles."""
        return _per_token(self.spec)

    @property
    def target_s_per_token(self) -> float | None:
        """Seconds per token of plain target steps: measured here, else the prior."""
        measured = _per_token(self.plain)
        return measured if measured is not None else self.prior

    @property
    def fallbacks(self) -> int:
        """Times this request switched to target-only (a start carried over from the last one included)."""
        return sum(e["event"] in ("fallback", "carried") for e in self.events)

    def carry(self) -> dict | None:
        """What the next request should start from: None while speculating, else when to probe."""
        if self.state != "target":
            return None
        return {"probe_in_tokens": max(0, self._probe_at - self.tokens), "probe_after": self.probe_after}

    def _decide(self) -> None:
        spec, target = self.spec_s_per_token, self.target_s_per_token
        probing = bool(self.events) and self.events[-1]["event"] == "probe"
        if spec is not None and target is not None and spec > target * (1 + self.margin):
            self.state = "target"
            # seconds the window lost against plain steps, spread so probes cost probe_budget of the time
            lost = sum(s - n * target for s, n in self.spec)
            gap = min(max(self.probe_after, round(lost / (self.probe_budget * target))), self.max_probe_after)
            self._probe_at = self.tokens + gap
            self.probe_after = min(2 * gap, self.max_probe_after)
            self.events.append({
                "event": "fallback", "token": self.tokens, "spec_ms_per_token": round(spec * 1e3, 3),
                "target_ms_per_token": round(target * 1e3, 3), "probe_in_tokens": gap,
            })
            return
        self.state = "speculate"
        if probing:  # the probe won: speculation is back, and the next fallback probes soon again
            self.events.append({"event": "resume", "token": self.tokens})
            self.probe_after = self._first_probe
            self._remeasure_at = self.tokens + self._remeasure_gap  # the plain steps were timed just now


def _per_token(window: deque[tuple[float, int]]) -> float | None:
    tokens = sum(n for _, n in window)
    return sum(s for s, _ in window) / tokens if tokens else None
