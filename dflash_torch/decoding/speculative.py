"""The speculative decoding loop, and target-only decoding through the same runtime.

Each cycle: the drafter proposes a block in one pass, the target verifies it in one forward pass,
the longest prefix that equals the target's own choice is kept plus one bonus token from the target,
and both caches roll back to what was committed. Every emitted token is the target's, so greedy
output is exactly the target's greedy output.

A cycle's draft comes from one of several proposers (`proposers.py`): the drafter, prompt lookup
(copy what followed an earlier occurrence of the last few tokens, at no forward pass) and the
tokens a grammar forces. Each offers the number of drafted tokens it expects to keep; the best
offer drafts, and the target verifies every draft the same way.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .. import kernels
from . import trees
from .prefix_cache import PrefixCache, Session, capacity_for
from .proposers import DatastoreProposer, DrafterProposer, ForcedProposer, LookupProposer, plain_step, ranked
from .sampling import History, Sampler, TokenLogprobs, verify_greedy
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
    datastore_cycles: int = 0  # verify passes whose draft came from the drafter's datastore (datastore.py)
    datastore_drafted: int = 0
    datastore_accepted: int = 0
    forced_cycles: int = 0  # verify passes whose draft was what a grammar leaves no choice about
    forced_drafted: int = 0
    forced_accepted: int = 0
    cached_tokens: int = 0  # prompt tokens a prefix cache already held (not prefilled)
    tree_cycles: int = 0  # verify passes over a tree of drafts (trees.py)
    tree_side_kept: int = 0  # of those, passes that kept a path other than the drafter's first choices
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

    def record_cycle(self, drafted: int, accepted: int, committed: int, source: str | None = None) -> None:
        """One verify pass: `drafted` tokens proposed by `source` ("dflash", "lookup", "datastore", "forced";
        None for a plain step), the first `accepted` kept, `committed` tokens added (the target's own included)."""
        self.cycles += 1
        if source == "lookup":
            self.lookup_cycles, self.lookup_drafted = self.lookup_cycles + 1, self.lookup_drafted + drafted
            self.lookup_accepted += accepted
        elif source == "datastore":
            self.datastore_cycles, self.datastore_drafted = self.datastore_cycles + 1, self.datastore_drafted + drafted
            self.datastore_accepted += accepted
        elif source == "forced":
            self.forced_cycles, self.forced_drafted = self.forced_cycles + 1, self.forced_drafted + drafted
            self.forced_accepted += accepted
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

    def record_tree(self, rows: list[int]) -> None:
        """A verify pass over a tree that kept the path `rows` (row 0 first)."""
        self.tree_cycles += 1
        self.tree_side_kept += rows != list(range(len(rows)))

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
            "datastore_cycles": self.datastore_cycles,
            "datastore_drafted": self.datastore_drafted,
            "datastore_accepted": self.datastore_accepted,
            "forced_cycles": self.forced_cycles,
            "forced_drafted": self.forced_drafted,
            "forced_accepted": self.forced_accepted,
            "tree_cycles": self.tree_cycles,
            "tree_side_kept": self.tree_side_kept,
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
    rules = Rules(sampler, History(prompt, vocab, device) if sampler.adjusts else None, constraint)

    token = sampler.sample(rules.logits(logits))[0].item()  # the first token comes from the prefill
    rules.commit([token])
    _sync(device)
    stats.prefill_s = time.perf_counter() - t0
    stats.generated_tokens = 1
    stats.cycles = 0 if speculative or lookup else 1
    if logprobs is not None:
        logprobs.add(logits.view(1, -1), [token])
    yield token
    if token in stops or max_new_tokens == 1:
        return
    if not speculative and not lookup:
        yield from _decode(target, token, cache, rules, max_new_tokens, stops, stats, logprobs)
        return
    proposers = []  # cheapest first: a tie between offers goes to the earlier
    if lookup:
        proposers.append(LookupProposer([*prompt, token], lookup_width, sampler, vocab, constraint, lookup_costs))
        store = getattr(drafter, "datastore", None)  # the target's stock phrases, shipped beside its drafter
        if store is not None:  # priced by the verify costs that lookup measures (the same passes)
            proposers.append(DatastoreProposer(store, [*prompt, token], lookup_width, sampler, vocab, constraint,
                                               proposers[0].finder.costs))
    if speculative:
        proposers.append(DrafterProposer(drafter, target, block_size, n + max_new_tokens + block_size, hidden,
                                         sampler, rules.history, constraint, controller, stats, session))
    if constraint is not None:
        proposers.append(ForcedProposer(constraint, lookup_width, sampler, vocab))
    yield from _speculate(target, token, cache, proposers, rules, taps, max_new_tokens, stops, stats, logprobs)


@dataclass
class Rules:
    """What the target's tokens are chosen by besides its logits: penalties and a logit bias (which
    depend on the tokens before each position) and a grammar."""

    sampler: Sampler
    history: History | None
    constraint: Constraint | None

    def logits(self, logits: torch.Tensor, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """The logits [T, V] tokens are chosen from: row i as if drafts[:i] had been generated."""
        if self.history is not None:
            logits = self.sampler.adjust(logits, self.history, drafts)
        if self.constraint is not None:
            allowed = self.constraint.mask([] if drafts is None else drafts.tolist(), logits.shape[0])
            logits = logits.float().masked_fill(~allowed.to(logits.device), float("-inf"))
        return logits

    def commit(self, tokens: list[int]) -> None:
        if self.history is not None:
            self.history.add(tokens)
        if self.constraint is not None:
            self.constraint.commit(tokens)


def _decode(target, token: int, cache, rules: Rules, max_new_tokens: int, stops: set[int], stats: Stats,
            logprobs: TokenLogprobs | None) -> Iterator[int]:
    """Target-only decoding after the first token: one token per pass."""
    device, t0, run = _device(target), time.perf_counter(), _runner(target)
    while True:
        out = run(torch.tensor([[token]], device=device), cache, "last", ())
        token = rules.sampler.sample(rules.logits(out.logits[0]))[0].item()
        rules.commit([token])
        stats.cycles += 1
        stats.generated_tokens += 1
        stats.decode_s = time.perf_counter() - t0
        if logprobs is not None:
            logprobs.add(out.logits[0], [token])
        yield token
        if token in stops or stats.generated_tokens >= max_new_tokens:
            return


def _speculate(target, token: int, cache, proposers: list, rules: Rules, taps, max_new_tokens: int,
               stops: set[int], stats: Stats, logprobs: TokenLogprobs | None) -> Iterator[int]:
    """Speculative decoding after the first token: propose -> verify -> accept -> commit -> observe."""
    device, t0, run = _device(target), time.perf_counter(), _runner(target)
    while True:
        remaining = max_new_tokens - stats.generated_tokens
        t_cycle = time.perf_counter()
        pos = cache.length  # position of `token`, committed but not yet run through the target
        # propose: the offer expected to keep the most drafts; a drafter that the controller switched
        # off for this cycle declines, and the next offer (else a plain target step) takes it
        draft = None
        for offer in ranked([p.offer(remaining) for p in proposers]):
            draft = offer.proposer.draft(token, remaining, device)
            if draft is not None:
                break
        draft = draft or plain_step(token, device)
        out, rows, bonus, logits = _verify(target, draft, cache, taps, rules, run)  # rows: the kept path
        accepted = len(rows) - 1
        tokens = draft.token_list()
        new = _committed([tokens[r] for r in rows[1:]] + [bonus], remaining, stops)
        rules.commit(new)
        hidden = out.hidden
        if draft.parents is not None:  # a tree: the kept path's keys/values and features, in place of the first rows'
            rows = rows[: len(new)]
            cache.keep_rows(pos, rows)
            hidden = hidden[:, rows] if hidden is not None else None
            stats.record_tree(rows)
        cache.crop(pos + len(new))  # keep token + the accepted drafts; the last new token is not in yet
        now = time.perf_counter()
        for p in proposers:
            p.observe(draft, accepted, new, hidden, now - t_cycle)
        stats.record_cycle(draft.width - 1, accepted, len(new), source=getattr(draft.source, "name", None))
        stats.generated_tokens += len(new)
        stats.decode_s = now - t0
        if logprobs is not None:  # token i of `new` was chosen from row i of the verify pass
            logprobs.add(logits, new)
        yield from new
        token = new[-1]
        if token in stops or stats.generated_tokens >= max_new_tokens:
            return


# A verify pass whose LM head waits (`_defers_head`) runs it on this many rows first, and on the rest only
# if every draft among them was kept: most passes keep few drafts, and a head over 4 rows costs about
# a third of one over 16 (the block kernels are compute-bound there; docs/performance.md, "The LM head on
# the rows read").
HEAD_FIRST_ROWS = 4


def _runner(target):
    """The target's pass for one sequence, called as run(ids, cache, logits, taps[, parents]): its flat path
    itself where that serves every pass (`flat_serves`), else its forward."""
    serves = getattr(target, "flat_serves", None)
    if serves is not None and serves():
        return target._flat
    return lambda ids, cache, logits, taps, parents=None: target(ids, cache, logits=logits, taps=taps,
                                                                 **({} if parents is None else {"parents": parents}))


def _verify(target, draft, cache, taps, rules: Rules, run=None):
    """The target's pass over a draft -> (its output, the rows of the kept path from row 0, the target's next
    token, the logits [n, V] the kept path's tokens and the next one were chosen from). run: `_runner(target)`."""
    run = run or _runner(target)
    if draft.parents is None:  # a chain
        defer = _defers_head(target, draft.width, rules)  # the LM head on the rows read, not on every row
        out = run(draft.block, cache, "rows" if defer else "all", taps)
        rows, bonus, logits = _accept(target, out, draft, rules)
        return out, rows, bonus, logits
    # a tree (greedy): each row attends to its own ancestors; the path of the target's choices
    out = run(draft.block, cache, "all", taps, draft.parents)
    rows, bonus = trees.walk(draft.parents, draft.token_list(), kernels.argmax(out.logits[0]).tolist())
    return out, rows, bonus, out.logits[0, rows]


def _defers_head(target, width: int, rules: Rules) -> bool:
    # only where the choice of row i reads nothing but row i's logits (greedy, no penalties, no grammar)
    # and the head computes each row as if alone (the block kernels): then it is the same choice
    return (width > HEAD_FIRST_ROWS and rules.sampler.greedy and rules.history is None
            and rules.constraint is None and getattr(target, "defers_head", None) is not None
            and target.defers_head(width))


def _accept(target, out, draft, rules: Rules) -> tuple[list[int], int, torch.Tensor]:
    """A chain's acceptance: (the rows of the kept path: 0 .. drafts kept, the target's next token, the logits
    [n, V] of the verify pass's rows 0..n-1, which hold every row the kept tokens were chosen from). From a
    pass with its head deferred (`out.final`), the head runs on the first HEAD_FIRST_ROWS rows and on the
    others only if all drafts there are kept."""
    greedy = rules.sampler.greedy and rules.history is None and rules.constraint is None
    if out.final is None:
        logits = out.logits[0]
        if greedy:  # `Sampler.verify`'s greedy comparison, on the draft's token list
            accepted, bonus = verify_greedy(draft.token_list()[1:], logits)
            return list(range(accepted + 1)), bonus, logits
        drafts = draft.block[0, 1:]
        accepted, bonus = rules.sampler.verify(drafts, rules.logits(logits, drafts), draft.probs)
        return list(range(accepted + 1)), bonus, logits
    n, drafts = HEAD_FIRST_ROWS, draft.token_list()[1:]  # (deferred heads are greedy only: `_defers_head`)
    logits = target.head(out.final[:n])  # [n, V]
    accepted, bonus = verify_greedy(drafts[: n - 1], logits)
    if accepted == n - 1 and drafts[n - 1] == bonus:  # the first n drafts kept: the others are read
        logits = torch.cat([logits, target.head(out.final[n:])])
        accepted, bonus = verify_greedy(drafts, logits)
    return list(range(accepted + 1)), bonus, logits


def _device(target) -> torch.device:
    return target.embed_tokens.weight.device


def _committed(new: list[int], remaining: int, stops: set[int]) -> list[int]:
    """The tokens a cycle commits: at most `remaining`, up to and including the first stop token."""
    new = new[:remaining]
    for i, t in enumerate(new):
        if t in stops:
            return new[: i + 1]
    return new


def _prefill(target, prompt: list[int], capacity: int, taps, session: Session | None, device, chunk: int | None):
    """Run the prompt (or the part of it a prefix cache does not hold) -> the cache, the logits [1, V]
    at the prompt's last position, and the tap features [1, n, F] of the prompt (None without taps); with a
    prefix cache, as a list of parts [1, t, F] in position order (the cached ones, then the new)."""
    if session is None:
        cache = target.new_cache(capacity)
        return (cache, *_run_prompt(target, prompt, cache, taps, chunk, device))
    hit = session.hit = session.prefix.take(target, prompt, capacity, need_hidden=bool(taps))
    if hit is None:
        cache, done, hidden, logits = target.new_cache(capacity_for(capacity)), 0, None, None
    else:
        cache, done, hidden, logits = hit.cache, hit.length, hit.hidden, hit.logits
    session.cache, session.handed_out = cache, getattr(target, "handed_out", None)
    # tap features in position order, left as parts: after a long conversation, joining the cached ones to
    # the new ones copied them all before the first token (7 ms at 2,000 positions, 135M model)
    parts = [] if hidden is None else [hidden]
    if logits is None:  # run what the cache does not hold
        logits, new = _run_prompt(target, prompt[done:], cache, taps, chunk, device)
        parts += [new] if new is not None else []
        session.prompt_state = cache.state() if hasattr(cache, "state") else None
    else:  # the same prompt as the entry's: its prefill is still in the cache
        session.prompt_state = hit.entry.prompt_state
    session.logits = logits
    session.hidden = list(parts) if taps else []
    return cache, logits, (parts if taps else None)


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
