"""Adaptive block size: pick, each cycle, the block size with the most expected tokens per second.

A block of b positions commits E(b) = 1 + r_1 + ... + r_{b-1} tokens on average, where r_k is the
probability that the first k drafted tokens are all accepted (the running per-position acceptance).
It costs t(b) = draft + verify seconds, measured per block size (a calibration at start, then a
moving average of the cycles actually run), plus what the context adds: every verify row attends to
every cached position, so after a long prompt a wide pass costs more decode steps than after a short
one. That growth is learnt per block size from the cycles run far past the calibration's context
(seconds per position beyond it); a width not run there yet is priced from the ones that were, half a
plain step's growth per extra row, more than the attention kernels added on the AMD EPYC Zen 4 measured
(docs/performance.md, "AMD EPYC Zen 4"), so a guess errs towards narrow passes. The first cycle that
far out, with nothing learnt yet, is a plain step, so the prices start from a measurement. The best
block size maximises E(b) / t(b); b = 1 is a plain target step (E = 1), so a drafter that stops paying
is dropped the same way. Now and then the full block is tried again so the acceptance of the far
positions stays current: every `probe_every` cycles at most, and no more often than keeps what those
tries lose against the best width within `probe_budget` of the time (where a wide verify costs several
plain steps, as on a CPU, that is rarely).
Output never depends on this choice: every token is the target's.
"""

from __future__ import annotations

import time

import torch

from .. import kernels
from .lookup import between

# Positions past the calibration's context from which a cycle's time teaches the growth with the context
# (nearer, it updates the costs at the calibration's context): far enough that the growth stands out of
# the noise of a cycle's time.
GROWTH_SPAN = 512


class AdaptiveBlockSize:
    """`controller` for `speculative.generate_tokens`.

    costs: {block size: seconds per cycle} to start from (see `calibrate`), measured after `context`
    positions; max_block: the drafter's block size; decay: weight kept by old acceptance counts each
    cycle; probe_every: the fewest cycles between full-block probes; probe_budget: the share of time that
    probes may lose against the best width. One instance may serve many generations in turn (a server's
    requests): what it learned (the growth with the context included), and when its next probe is due,
    carry over.
    """

    def __init__(self, costs: dict[int, float], max_block: int, decay: float = 0.97, probe_every: int = 16,
                 probe_budget: float = 0.05, context: int = 64) -> None:
        self.costs = {b: t for b, t in costs.items() if 1 <= b <= max_block}  # at `context` positions
        self.context = context  # where `costs` hold (calibrate's context)
        self.slopes: dict[int, float] = {}  # block size -> seconds per position past `context`, learnt
        self.position = context  # the cache's length at the cycle being chosen (set by block_size)
        self._stats, self._first = None, False  # the generation being run; its first drafter cycle not yet seen
        if 1 not in self.costs or max_block not in self.costs:
            raise ValueError("costs must include block size 1 and the drafter's block size")
        self.max_block, self.decay, self.probe_every, self.probe_budget = max_block, decay, probe_every, probe_budget
        self._last_probe = 0  # cycle of the last full-block try
        self.accepted = [0.0] * max_block  # [k]: decayed count of cycles whose first k + 1 drafts were kept
        self.drafted = [0.0] * max_block
        self.cycles = 0
        self.history: list[int] = []  # block size chosen per cycle (for metrics and bench output)
        self.estimate = None  # E(b) from the drafter's tree statistics where it drafts trees (estimate_with)

    def estimate_with(self, fn) -> None:
        """E(b) from `fn(b)` (a tree-drafting proposer's `RankStats.expected_tokens`: a tree of b rows keeps
        what its shape holds, not a chain's prefix), or from the per-position counts below (None)."""
        self.estimate = fn

    def expected_tokens(self, b: int) -> float:
        """E(b): expected committed tokens of a b-wide cycle under the current acceptance estimates."""
        if self.estimate is not None:
            return self.estimate(b)
        total, r, odds = 1.0, 1.0, 0.5
        for k in range(b - 1):
            if self.drafted[k] > 0.5:
                last, r = r, self.accepted[k] / self.drafted[k]
                odds = min(1.0, r / last) if last > 0 else 0.0  # kept, given the drafts before it were
            else:
                # a position never drafted yet: the chain goes on at the odds of the last one drafted (even
                # odds while none was), so the next positions get tried as far as they promise, without a
                # first cycle as wide as the drafter allows (after a long prompt a 16-wide pass costs several
                # plain steps: "AMD EPYC Zen 4" in docs/performance.md)
                r *= odds
            total += r
        return total

    def base(self, b: int) -> float:
        """t(b) at the calibration's context, interpolated linearly between measured block sizes."""
        return between(self.costs, b)  # 1 and the drafter's block size are always measured

    def slope(self, b: int) -> float:
        """Seconds per position past the calibration's context that a cycle of width b adds: as learnt for
        b; else interpolated between the widths learnt around it; past the widest (or with only narrower
        ones), half the plain step's growth more per extra row. 0 while nothing is learnt."""
        s = self.slopes
        if not s:
            return 0.0
        at = between(s, b)
        if at is not None:
            return at
        if b > max(s):
            lo = max(s)
            return s[lo] + 0.5 * s.get(1, s[lo] / (1 + 0.5 * (lo - 1))) * (b - lo)
        hi = min(s)  # only wider widths learnt: scaled down as the rows go
        return s[hi] * (1 + 0.5 * (b - 1)) / (1 + 0.5 * (hi - 1))

    def cost(self, b: int) -> float:
        """t(b) at the current position."""
        return self.base(b) + self.slope(b) * max(0, self.position - self.context)

    def best(self) -> int:
        return max(range(1, self.max_block + 1), key=lambda b: self.expected_tokens(b) / self.cost(b))

    def probe_gap(self, best: int) -> float:
        """Cycles between full-block probes: at least probe_every, and enough that the seconds one probe
        loses against `best` (the width it replaces) are probe_budget of the time between probes."""
        rate = self.expected_tokens(best) / self.cost(best)  # tokens per second at the best width
        lost = max(0.0, self.cost(self.max_block) - self.expected_tokens(self.max_block) / rate)
        return max(self.probe_every, lost / (self.probe_budget * self.cost(best)))

    def block_size(self, stats) -> int:
        """Block size for the next cycle (stats: the generation's `Stats`, for its position; None: the
        calibration's context)."""
        self.cycles += 1
        self.locate(stats)
        if not self.slopes and self.position - self.context >= GROWTH_SPAN:
            self.history.append(1)  # far past the calibration with no growth learnt: measure a plain step
            return 1
        b = self.best()
        if b != self.max_block and self.cycles - self._last_probe >= self.probe_gap(b):
            b = self.max_block
        if b == self.max_block:
            self._last_probe = self.cycles
        self.history.append(b)
        return b

    def locate(self, stats) -> None:
        """Where the next cycle runs: the generation's position (None: the calibration's context)."""
        self.position = self.context if stats is None else stats.prompt_tokens + stats.generated_tokens
        if stats is not None and stats is not self._stats:  # a new generation: its first drafter cycle also
            self._stats, self._first = stats, True  # feeds the drafter the prompt (a one-off, not timed)

    def observe(self, block_size: int, committed: int, seconds: float) -> None:
        """Update acceptance per position and the cost of this block size (or its growth with the
        context, far past the calibration's)."""
        if block_size > 1:
            kept = min(committed - 1, block_size - 1)
            for k in range(self.max_block):
                self.accepted[k] *= self.decay
                self.drafted[k] *= self.decay
            for k in range(block_size - 1):
                self.drafted[k] += 1
                self.accepted[k] += k < kept
        if block_size > 1 and self._first:
            self._first = False
            return
        far = self.position - self.context
        if far >= GROWTH_SPAN:  # what the context adds to this width, per position
            slope = max(0.0, seconds - self.base(block_size)) / far
            old = self.slopes.get(block_size)
            self.slopes[block_size] = slope if old is None else 0.8 * old + 0.2 * slope
            return
        seconds -= self.slope(block_size) * max(0, far)  # near the calibration's context: the base cost
        old = self.costs.get(block_size)
        self.costs[block_size] = seconds if old is None else 0.8 * old + 0.2 * seconds


def use_adaptive(flag: bool | None, block_size: int | None, sampler) -> bool:
    """Whether generate and chat pick block sizes adaptively: on unless `--no-adaptive`, off when
    `--block-size` fixes the width, and off for a seeded sampled run (its random draws depend on the
    block sizes, which would then depend on timing)."""
    return flag is not False and block_size is None and (sampler.greedy or sampler.seed is None)


class WithFallback:
    """The adaptive width, inside a target-only fallback controller's decision to speculate at all.
    Attribute reads (events, fallbacks, ...) go to the fallback controller."""

    def __init__(self, fallback, adaptive: AdaptiveBlockSize) -> None:
        self.fallback, self.adaptive = fallback, adaptive

    def block_size(self, stats) -> int:
        if self.fallback.block_size(stats) == 1:
            self.adaptive.locate(stats)  # its plain steps still teach the adaptive width their cost there
            return 1
        return self.adaptive.block_size(stats)

    def observe(self, block_size: int, committed: int, seconds: float) -> None:
        self.fallback.observe(block_size, committed, seconds)
        self.adaptive.observe(block_size, committed, seconds)

    def estimate_with(self, fn) -> None:
        self.adaptive.estimate_with(fn)

    def __getattr__(self, name: str):
        return getattr(self.fallback, name)


@torch.inference_mode()
def calibrate(target, drafter, sizes: tuple[int, ...] | None = None, context: int = 64, repeats: int = 2) -> dict:
    """Measure draft + verify seconds per block size after a dummy context of `context` tokens, in the
    steady state of a generation: the drafter has seen the context and gets a few new features per
    cycle (its first pass, which projects the whole prompt, is a one-off). Median of `repeats` after a
    warm-up; one prefill for all sizes (this runs before the first generation, so it is kept short)."""
    device = target.embed_tokens.weight.device
    sizes = sizes or tuple(sorted({1, 2, 4, 8, drafter.block_size}))
    sizes = tuple(b for b in sizes if b <= drafter.block_size)
    vocab = target.config.vocab_size
    prompt = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(0)).to(device)
    new = min(4, context)  # tap features the drafter has not seen yet, per cycle
    cache = target.new_cache(context + max(sizes) + 1)
    dcache = drafter.new_cache(context + max(sizes) + 1)
    out = target(prompt, cache, logits="last", taps=drafter.target_layer_ids)
    block = torch.full((1, max(sizes)), drafter.mask_token_id, dtype=torch.long, device=device)
    drafter.propose(target, block[:, :2], out.hidden, dcache)  # the one-off first pass over the context
    seen = dcache.length  # the context's slots (fewer than its positions for a windowed drafter)
    costs = {}
    for b in sizes:
        times = []
        for _ in range(repeats + 1):  # the first run warms up
            cache.crop(context)
            dcache.crop(seen - new)
            blk = block[:, :b].clone()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            if b > 1:  # as a greedy cycle drafts (proposers.DrafterProposer): over the draft vocabulary's rows
                vocab = getattr(drafter, "draft_vocab", None)
                full = vocab is None or getattr(drafter, "select", None) is not None
                kw = {} if full else {"full": False}
                draft = kernels.argmax(drafter.propose(target, blk, out.hidden[:, -new:], dcache, **kw)[0])
                blk[0, 1:] = draft if full else vocab[draft]
            logits = target(blk, cache, logits="all", taps=drafter.target_layer_ids).logits
            kernels.argmax(logits[0]).tolist()  # the loop's acceptance decision syncs here too
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        costs[b] = sorted(times[1:])[len(times[1:]) // 2]
    return costs


CALIBRATION_DAYS = 7  # a stored calibration older than this is measured again


def calibrated(pipe) -> dict:
    """`calibrate`'s costs for this pipeline on this machine, measured once and kept in the user cache:
    `dflash generate` and `chat` start from them instead of spending a prefill and a dozen passes (and
    their memory) at every start. They are only where the adaptive width starts; it updates them from
    every cycle it runs. Keyed by what the costs depend on: the model, the drafter and their formats,
    the CPU, the threads, torch and the kernels."""
    import hashlib
    import json
    import os

    from ..loading import cache_home, cpu_name

    cpu = cpu_name()
    drafter = pipe.drafter
    key = json.dumps([str(pipe.model_path), str(pipe.draft_path), pipe.quantize, pipe.lm_head, str(pipe.dtype),
                      str(pipe.device), cpu, torch.get_num_threads(), torch.__version__, kernels.best_isa(),
                      kernels.fingerprint() if kernels.ensure() == "compiled" else None,
                      os.environ.get("ATEN_CPU_CAPABILITY"), getattr(drafter, "window", None),
                      getattr(drafter, "draft_vocab", None) is None, drafter.block_size])
    file = cache_home() / "calibration" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    try:
        saved = json.loads(file.read_text())
        if saved["key"] == key and time.time() - saved["time"] < CALIBRATION_DAYS * 86400:
            return {int(b): float(t) for b, t in saved["costs"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    costs = calibrate(pipe.target, drafter)
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "time": time.time(), "costs": costs}) + "\n")
        tmp.replace(file)
    except OSError:  # a read-only cache: measured again next time
        pass
    return costs
