"""The speculative decoding loop, and target-only decoding through the same runtime.

Each cycle: the drafter proposes a block in one pass, the target verifies it in one forward pass,
the longest prefix that equals the target's own choice is kept plus one bonus token from the target,
and both caches roll back to what was committed. Every emitted token is the target's, so greedy
output is exactly the target's greedy output.

A cycle's draft may instead come from prompt lookup (`lookup.py`: copy what followed an earlier
occurrence of the last few tokens), which costs no forward pass; it is taken while it is expected
to keep more tokens than the drafter, and when the drafter is switched off for the cycle (the
controller chose a plain step). The target verifies it the same way.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .lookup import PromptLookup
from .prefix_cache import PrefixCache, Session, capacity_for
from .sampling import History, Sampler, TokenLogprobs
from .structured import Constraint


@dataclass
class Stats:
    """What one generation did. `cycles` counts target passes that committed tokens after prefill
    (verify passes; target-only: one per token, the prefill's first token included)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    cycles: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    block_size: int = 1
    mode: str = "target-only"
    lookup_cycles: int = 0  # verify passes whose draft came from prompt lookup
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    forced_cycles: int = 0  # verify passes whose draft was what a grammar leaves no choice about
    forced_drafted: int = 0
    forced_accepted: int = 0
    cached_tokens: int = 0  # prompt tokens a prefix cache already held (not prefilled)
    widths: dict[int, int] = field(default_factory=dict)  # verify passes per width (1 = a plain step)

    @property
    def acceptance_length_mean(self) -> float:
        """Tokens committed per verify pass, bonus included (1.0 for target-only)."""
        if not self.acceptance_lengths:
            return 1.0 if self.mode == "target-only" and self.generated_tokens else 0.0
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafted tokens / drafted tokens."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first, per second of decoding (prefill excluded)."""
        n = self.generated_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    def record_cycle(self, drafted: int, accepted: int, committed: int) -> None:
        self.cycles += 1
        self.widths[drafted + 1] = self.widths.get(drafted + 1, 0) + 1
        self.acceptance_lengths.append(committed)
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        while len(self.drafted_per_position) < drafted:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for k in range(drafted):
            self.drafted_per_position[k] += 1
            self.accepted_per_position[k] += k < accepted

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "generated_tokens": self.generated_tokens,
            "cycles": self.cycles,
            "acceptance_length_mean": round(self.acceptance_length_mean, 4),
            "acceptance_lengths": list(self.acceptance_lengths),  # tokens committed by each verify pass, in order
            "acceptance_rate": round(self.acceptance_rate, 4),
            "acceptance_per_position": [
                round(a / d, 4) for a, d in zip(self.accepted_per_position, self.drafted_per_position)
            ],
            "prefill_s": round(self.prefill_s, 4),
            "decode_s": round(self.decode_s, 4),
            "decode_tok_s": round(self.decode_tok_s, 2),
            "block_size": self.block_size,
            "mode": self.mode,
            "lookup_cycles": self.lookup_cycles,
            "lookup_drafted": self.lookup_drafted,
            "lookup_accepted": self.lookup_accepted,
            "forced_cycles": self.forced_cycles,
            "forced_drafted": self.forced_drafted,
            "forced_accepted": self.forced_accepted,
            "verify_widths": {str(w): n for w, n in sorted(self.widths.items())},
        }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def generate_tokens(
    target,
    prompt: list[int],
    *,
    max_new_tokens: int,
    drafter=None,
    block_size: int | None = None,
    stop_token_ids: tuple[int, ...] | list[int] = (),
    sampler: Sampler | None = None,
    stats: Stats | None = None,
    controller=None,
    lookup: bool = False,
    lookup_costs: dict[int, float] | None = None,
    prefix: PrefixCache | None = None,
    prefill_chunk: int | None = None,
    logprobs: TokenLogprobs | None = None,
    constraint: Constraint | None = None,
) -> Iterator[int]:
    """Yield the target's tokens one by one as they are decided; stop after a stop token or
    `max_new_tokens`. With a drafter, decide them by speculative decoding; `stats` is filled in.

    `controller` (optional) picks the block size of each drafter cycle: `controller.block_size(stats)`
    before it (1 = a plain target step, which still feeds the drafter's context so speculation can
    resume), `controller.observe(block_size, committed, seconds)` after it. `lookup`: also propose
    drafts by prompt lookup (`lookup.PromptLookup`), with or without a drafter. `lookup_costs`: seconds per
    verify width that prompt lookup has measured, shared with (and updated for) later generations, so a
    server does not measure them again for every request. `prefix`: start from the cache of an earlier
    generation that shares the prompt's beginning, and leave this one's there when done
    (`prefix_cache.py`; reused keys/values came from passes of other widths, which in float32 round
    differently, as verify and decode passes do). `prefill_chunk`: run the prompt in passes of at most
    this many tokens (bounds the prefill's peak memory on long prompts). Output depends on none of these.
    `logprobs`: filled with each token's log-probability (and top alternatives) before it is yielded.
    `constraint`: a grammar the output must follow (`structured.Constraint`, one per generation).
    """
    args = dict(max_new_tokens=max_new_tokens, drafter=drafter, block_size=block_size,
                stop_token_ids=stop_token_ids, sampler=sampler, stats=stats, controller=controller,
                lookup=lookup, lookup_costs=lookup_costs, prefill_chunk=prefill_chunk, logprobs=logprobs,
                constraint=constraint)
    if prefix is None:
        yield from _generate(target, prompt, session=None, **args)
        return
    # An exception from a pass is not caught: the cache may be half written, so it is not kept (the
    # entry it came from was taken out of `prefix`).
    session, emitted = Session(list(prompt), prefix), []
    try:
        for token in _generate(target, prompt, session=session, **args):
            emitted.append(token)
            yield token
    except GeneratorExit:  # the consumer stopped: the cache is consistent at every yield
        prefix.keep(session, emitted)
        raise
    prefix.keep(session, emitted)


@torch.inference_mode()
def _generate(target, prompt: list[int], *, max_new_tokens: int, drafter, block_size: int | None,
              stop_token_ids, sampler: Sampler | None, stats: Stats | None, controller, lookup: bool,
              lookup_costs: dict[int, float] | None, session: Session | None,
              prefill_chunk: int | None, logprobs: TokenLogprobs | None,
              constraint: Constraint | None) -> Iterator[int]:
    stats = stats if stats is not None else Stats()
    sampler = sampler or Sampler()
    device = target.embed_tokens.weight.device
    stops = set(stop_token_ids)
    if block_size is not None and block_size < 1:
        raise ValueError("block_size must be >= 1")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError("the prefill step size must be >= 1")
    vocab = target.config.vocab_size
    if sampler.logit_bias and not all(0 <= t < vocab for t in sampler.logit_bias):
        raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
    # lookup drafts fill at most the block size too (given, else the drafter's, else 16)
    lookup_width = (block_size or (drafter.block_size if drafter is not None else 16)) - 1
    if drafter is None:
        block_size = 1
    elif block_size is None or block_size > drafter.block_size:  # a drafter cannot fill more than it was built for
        block_size = drafter.block_size
    speculative = block_size > 1
    lookup = lookup and lookup_width > 0
    stats.block_size, stats.prompt_tokens = block_size, len(prompt)
    stats.mode = ("dflash" if speculative else "target-only") if not lookup else (
        "dflash+lookup" if speculative else "lookup")
    if max_new_tokens < 1:
        return
    n = len(prompt)
    taps = drafter.target_layer_ids if speculative else ()

    t0 = time.perf_counter()
    cache, logits, hidden = _prefill(target, prompt, n + max_new_tokens + block_size, taps, session, device,
                                     prefill_chunk)
    stats.cached_tokens = session.hit.length if session is not None and session.hit else 0
    # penalties, a logit bias and a grammar change the target's logits by what came before each position
    history = History(prompt, vocab, device) if sampler.adjusts else None

    def chosen_from(logits: torch.Tensor, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """The logits [T, V] tokens are chosen from: row i as if drafts[:i] had been generated."""
        if history is not None:
            logits = sampler.adjust(logits, history, drafts)
        if constraint is not None:
            allowed = constraint.mask([] if drafts is None else drafts.tolist(), logits.shape[0])
            logits = logits.float().masked_fill(~allowed.to(logits.device), float("-inf"))
        return logits

    def decided(tokens: list[int]) -> None:
        if history is not None:
            history.add(tokens)
        if constraint is not None:
            constraint.commit(tokens)

    token = sampler.sample(chosen_from(logits))[0].item()  # the first token comes from the prefill
    decided([token])
    _sync(device)
    stats.prefill_s = time.perf_counter() - t0
    stats.generated_tokens = 1
    stats.cycles = 0 if speculative or lookup else 1
    t0 = time.perf_counter()
    if logprobs is not None:
        logprobs.add(logits.view(1, -1), [token])
    yield token
    if token in stops or max_new_tokens == 1:
        return
    if not speculative and not lookup:
        while True:
            out = target(torch.tensor([[token]], device=device), cache, logits="last")
            token = sampler.sample(chosen_from(out.logits[0]))[0].item()
            decided([token])
            stats.cycles += 1
            stats.generated_tokens += 1
            stats.decode_s = time.perf_counter() - t0
            if logprobs is not None:
                logprobs.add(out.logits[0], [token])
            yield token
            if token in stops or stats.generated_tokens >= max_new_tokens:
                return

    if speculative:
        draft_cache = drafter.new_cache(n + max_new_tokens + block_size)
        # tap features [1, t, n_taps * H] not yet given to the drafter, joined only when it runs: a
        # running torch.cat copied the whole backlog every step while the fallback kept it off
        pending = [hidden]
    finder = PromptLookup([*prompt, token], max_draft=lookup_width) if lookup else None
    if finder is not None and lookup_costs is not None:
        finder.costs = lookup_costs  # the same dict: what this generation measures, the next one knows
    dflash_mean = 0.0  # running mean of drafted tokens kept per drafter cycle
    while True:
        remaining = max_new_tokens - stats.generated_tokens
        t_cycle = time.perf_counter()
        pos = cache.length  # position of `token`, committed but not yet run through the target
        # Which proposer: a lookup match while it keeps more than the drafter does, else the drafter
        # at the controller's width (1 = a plain target step, where a lookup match is used instead).
        match = finder.match(remaining - 1) if finder is not None else []
        found = match[: finder.draft_length(len(match))] if match else []
        if found and constraint is not None:  # cut where the grammar would refuse it anyway
            found = found[: constraint.allowed_prefix(found)]
        use_lookup = bool(found) and (not speculative or finder.expected_tokens(len(found) + 1) - 1 >= dflash_mean)
        bs = len(found) + 1 if use_lookup else 1
        # Tokens the grammar leaves no choice about (a JSON key, a closing tag) are a draft the target keeps
        # (unless it spells the same text with other tokens) at no drafting cost: used when longer than what
        # the lookup match, or else the drafter, is expected to keep.
        forced = constraint.forced(min(lookup_width, remaining - 1)) if constraint is not None else []
        use_forced = len(forced) > (len(found) if use_lookup else dflash_mean if speculative else 0)
        if use_forced:
            use_lookup, found, bs = False, forced, len(forced) + 1
        if speculative and not use_lookup and not use_forced:
            want = block_size if controller is None else max(1, min(controller.block_size(stats), block_size))
            bs = min(want, remaining)  # a block of bs positions commits at most bs tokens
            if bs == 1 and found:
                use_lookup, bs = True, len(found) + 1
        block = torch.full((1, bs), drafter.mask_token_id if speculative else 0, dtype=torch.long, device=device)
        block[0, 0] = token
        draft_probs = None
        if use_lookup or use_forced:
            block[0, 1:] = torch.tensor(found, device=device)
            if not sampler.greedy:  # a fixed proposal is a one-hot q: rejection sampling stays exact
                draft_probs = torch.zeros(bs - 1, target.config.vocab_size, device=device)
                draft_probs[torch.arange(bs - 1), block[0, 1:]] = 1.0
        elif bs > 1:
            ctx = pending[0] if len(pending) == 1 else torch.cat(pending, dim=1)  # [1, Tc, n_taps * H]
            draft_logits = drafter.propose(target, block, ctx, draft_cache)[0]  # [bs - 1, V]
            if history is not None:  # propose under the target's penalties and bias (the drafts' own repeats aside)
                draft_logits = sampler.adjust(draft_logits, history)
            select = getattr(drafter, "select", None)  # a drafter that picks its own tokens (DFlash2)
            block[0, 1:], draft_probs = (constraint.draft(draft_logits, sampler) if constraint is not None
                                         else select(draft_logits, token, sampler) if select is not None
                                         else sampler.draft(draft_logits))
            pending = []  # the drafter's cache holds it now
        out = target(block, cache, logits="all", taps=taps)  # verify: logits at every block position
        accepted, bonus = sampler.verify(block[0, 1:], chosen_from(out.logits[0], block[0, 1:]), draft_probs)
        new = block[0, 1 : accepted + 1].tolist() + [bonus]
        new = new[:remaining]
        for i, t in enumerate(new):
            if t in stops:
                new = new[: i + 1]
                break
        decided(new)
        cache.crop(pos + len(new))  # keep token + the accepted drafts; the last new token is not in yet
        if speculative:
            kept = out.hidden[:, : len(new)]
            if session is not None:  # held until the prefix cache takes it: not the whole block's features
                kept = kept.clone() if len(new) < bs else kept
                session.hidden.append(kept)
            pending.append(kept)
        stats.record_cycle(bs - 1, accepted, len(new))
        stats.generated_tokens += len(new)
        now = time.perf_counter()
        stats.decode_s = now - t0
        if use_lookup:
            checked, kept = bs - 1, accepted
            if accepted == bs - 1 and len(match) > checked and len(new) > checked:
                # kept whole: the bonus token also checks the match's next position, so a draft that
                # keeps being kept learns one position further each cycle
                checked, kept = checked + 1, kept + (match[checked] == new[checked])
            finder.observe(checked, kept)
            stats.lookup_cycles += 1
            stats.lookup_drafted += bs - 1
            stats.lookup_accepted += accepted
        elif use_forced:
            stats.forced_cycles += 1
            stats.forced_drafted += bs - 1
            stats.forced_accepted += accepted
        else:
            if match:  # what the unused match would have kept, as far as the new tokens tell
                kept = _common_prefix(match, new)
                finder.observe(min(len(match), len(new), kept + 1), kept, drafted=False)
            if bs > 1:
                dflash_mean = 0.7 * dflash_mean + 0.3 * accepted
            if controller is not None:
                controller.observe(bs, len(new), now - t_cycle)
        # Verify-only cycles time the lookup's widths. Not for a seeded sampled run: its random draws
        # depend on the block widths, so they must not depend on timing (unmeasured widths cost alike).
        if finder is not None and (use_lookup or bs == 1) and (sampler.greedy or sampler.seed is None):
            finder.observe_cost(bs, now - t_cycle)
        if finder is not None:
            finder.extend(new)
        if logprobs is not None:  # token i of `new` was chosen from row i of the verify pass
            logprobs.add(out.logits[0], new)
        for t in new:
            yield t
        token = new[-1]
        if token in stops or stats.generated_tokens >= max_new_tokens:
            return


def _prefill(target, prompt: list[int], capacity: int, taps, session: Session | None, device, chunk: int | None):
    """Run the prompt (or the part of it a prefix cache does not hold) -> the cache, the logits [1, V]
    at the prompt's last position, and the tap features [1, n, F] of the prompt (None without taps)."""
    if session is None:
        cache = target.new_cache(capacity)
        return (cache, *_run_prompt(target, prompt, cache, taps, chunk, device))
    hit = session.hit = session.prefix.take(target, prompt, capacity, need_hidden=bool(taps))
    if hit is None:
        cache, done, hidden, logits = target.new_cache(capacity_for(capacity)), 0, None, None
    else:
        cache, done, hidden, logits = hit.cache, hit.length, hit.hidden, hit.logits
    session.cache, session.handed_out = cache, getattr(target, "handed_out", None)
    if logits is None:  # run what the cache does not hold
        logits, new = _run_prompt(target, prompt[done:], cache, taps, chunk, device)
        hidden = new if hidden is None else torch.cat([hidden, new], dim=1)
        session.prompt_state = cache.state() if hasattr(cache, "state") else None
    else:  # the same prompt as the entry's: its prefill is still in the cache
        session.prompt_state = hit.entry.prompt_state
    session.logits = logits
    session.hidden = [hidden] if taps else []
    return cache, logits, hidden


def _run_prompt(target, tokens: list[int], cache, taps, chunk: int | None, device):
    """`tokens` through the target in passes of at most `chunk` (None: one pass) -> the logits [1, V] at
    the last one, and the tap features [1, T, F] (None without taps).

    The passes take whatever form the target is set to: `generate.load` makes a quantized target's
    prefills attend one query at a time, and its linear kernels give each row the same bits for any
    number of rows, so any chunking (and a prefix cache's reused part) gives the one-pass prefill's
    logits, features and keys/values bit for bit (tests/test_entry_points.py, tests/test_prefix_cache.py).
    A float32 target's fused passes of other widths round differently (~1e-6), which can flip a
    near-tie token; float32 activations keep that rare, but it is not excluded."""
    step = chunk or len(tokens)
    features = []
    for i in range(0, len(tokens), step):
        last = i + step >= len(tokens)
        out = target(torch.tensor([tokens[i : i + step]], device=device), cache, logits="last" if last else None,
                     taps=taps)
        features.append(out.hidden)
    hidden = None if not taps else features[0] if len(features) == 1 else torch.cat(features, dim=1)
    return out.logits[0], hidden


def _common_prefix(a: list[int], b: list[int]) -> int:
    k = 0
    while k < len(a) and k < len(b) and a[k] == b[k]:
        k += 1
    return k
