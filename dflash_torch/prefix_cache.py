"""Prefix cache: a finished request's caches, kept so that a later prompt that starts the same way
skips that part of the prefill.

Position is the index in every cache here, so a cache holding positions [0, L) of token ids `ids`
serves any prompt that shares its first m tokens: set its length to m and prefill the rest. Multi-turn
chat is what this is for: each turn's prompt is the last prompt, the reply and one new message, so
only the new message is prefilled. The target's tap features of the cached positions are kept too
(the drafter's context), and for a prompt seen before, the prefill's logits: the same prompt again
skips the prefill altogether and replays the earlier request's passes exactly.

State with no position axis (Qwen3.5's Gated DeltaNet conv and recurrent state) can only come back
where it was: at the end of the earlier request (the cache as it is), inside that request's last pass
(the cache's own rollback), or at the end of its prompt (a copy taken after the prefill).

Reusing keys and values computed by earlier passes is exact arithmetic on the same numbers, but not
always the same bits as one prefill over the whole prompt would give (a pass over many positions rounds
differently from passes over few); every emitted token is still the target's choice given its cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

DEFAULT_MAX_ENTRIES = 4
DEFAULT_MAX_BYTES = 2 << 30


@dataclass
class Entry:
    ids: list[int]  # the tokens at cache positions [0, len(ids)) (the cache's length)
    cache: object
    hidden: torch.Tensor | None  # tap features [1, len(ids), F] of those positions (None: no taps)
    prompt_len: int  # the request's prompt: ids[:prompt_len]
    logits: torch.Tensor | None  # [1, V] the prefill's logits at the prompt's last position
    prompt_state: object = None  # hybrid caches: the conv/recurrent state after the prompt (cache.state())
    nbytes: int = 0
    handed_out: int | None = None  # single-cache targets: their new_cache count when this cache was theirs


@dataclass
class Hit:
    """What `PrefixCache.take` hands a generation: a cache holding the prompt's first `length` tokens."""

    cache: object
    length: int
    hidden: torch.Tensor | None  # tap features [1, length, F], or None
    logits: torch.Tensor | None  # set when the whole prompt is cached: no prefill to run
    entry: Entry


@dataclass
class Session:
    """One generation's side of the prefix cache: filled by `speculative.generate_tokens`."""

    prompt: list[int]
    prefix: PrefixCache
    hit: Hit | None = None
    cache: object = None
    logits: torch.Tensor | None = None
    prompt_state: object = None
    hidden: list[torch.Tensor] = field(default_factory=list)  # tap features, in position order
    handed_out: int | None = None  # see Entry


class PrefixCache:
    """Up to `max_entries` caches of finished requests (and at most `max_bytes` of them), most recent
    first. A generation takes the entry that covers most of its prompt and gives it back, extended by
    its reply, when it ends (`speculative.generate_tokens(prefix=...)`)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("a prefix cache needs max_entries >= 1 and max_bytes >= 1")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.entries: list[Entry] = []
        self.hits = self.misses = self.cached_tokens = 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def clear(self) -> None:
        self.entries.clear()

    def take(self, target, prompt: list[int], capacity: int, need_hidden: bool) -> Hit | None:
        """The entry that covers the most of `prompt`, restored to that many tokens and removed from the
        cache (the generation owns it now), or None (and the caller makes a new cache)."""
        best: tuple[int, Entry] | None = None
        # a target that owns one cache (cudagraph.GraphedTarget) rewinds it on every new_cache: an entry
        # whose cache was handed out again since is gone
        self.entries = [e for e in self.entries if e.handed_out == getattr(target, "handed_out", None)]
        for e in self.entries:  # most recent first: it wins a tie
            if need_hidden and e.hidden is None:
                continue
            m = _usable(e, prompt)
            if m > 0 and (best is None or m > best[0]):
                best = (m, e)
        if best is None:
            self.misses += 1
            if getattr(target, "single_cache", False):  # its new_cache rewinds the one cache entries hold
                self.entries.clear()
            return None
        m, e = best
        self.entries.remove(e)
        if m == e.prompt_len and e.prompt_state is not None and m != e.cache.length:
            e.cache.restore(m, e.prompt_state)  # hybrid: the state saved after that prompt's prefill
        elif m != e.cache.length:
            e.cache.crop(m)
        # the same prompt again: its prefill's logits, so no pass runs before the first token
        logits = e.logits if m == len(prompt) == e.prompt_len else None
        cache = e.cache
        if cache.max_len < capacity:  # a longer conversation than the cache was made for: move it
            cache = moved(target, cache, m, capacity_for(capacity))
        self.hits += 1
        self.cached_tokens += m
        hidden = None if e.hidden is None or not need_hidden else e.hidden[:, :m]
        return Hit(cache, m, hidden, logits, e)

    def keep(self, session: Session, tokens: list[int]) -> None:
        """Store the cache a generation ended with. `tokens`: what it emitted, in order; the cache holds
        the prompt and all of them but the last (which no pass has run through yet)."""
        with torch.inference_mode():
            self._keep(session, tokens)

    def _keep(self, session: Session, tokens: list[int]) -> None:
        cache = session.cache
        if cache is None:
            return
        ids = [*session.prompt, *tokens][: cache.length]
        if len(ids) < cache.length:  # closed before emitting tokens its passes had committed
            try:
                cache.crop(len(ids))
            except ValueError:  # a hybrid cache cannot go back that far
                return
        hidden = None
        if session.hidden and all(h is not None for h in session.hidden):
            hidden = torch.cat(session.hidden, dim=1)[:, : len(ids)]
            if hidden.shape[1] < len(ids):
                hidden = None
        e = Entry(ids, cache, hidden, len(session.prompt), session.logits, session.prompt_state,
                  handed_out=session.handed_out)
        e.nbytes = cache_bytes(cache) + (0 if hidden is None else hidden.nbytes)
        self.entries.insert(0, e)
        while self.entries and (len(self.entries) > self.max_entries or self.nbytes > self.max_bytes):
            self.entries.pop()


def _usable(e: Entry, prompt: list[int]) -> int:
    """How many of `prompt`'s first tokens entry `e` can give back (0: none)."""
    m = 0
    limit = min(len(e.ids), len(prompt))
    while m < limit and e.ids[m] == prompt[m]:
        m += 1
    if m == len(prompt) == e.prompt_len and e.logits is not None:
        return m  # the earlier request's own prompt: nothing to prefill
    m = min(m, len(prompt) - 1)  # else the prompt's last token must run, for its logits
    if not hasattr(e.cache, "restore"):
        return m  # keys/values only: any length
    # hybrid: where the conv/recurrent state is known
    if (m == e.prompt_len and e.prompt_state is not None) or e.cache.can_crop(m):
        return m
    return 0


def capacity_for(length: int) -> int:
    """Cache capacity for a generation that needs `length` positions: the next power of two (at least
    256), so the next turn of a conversation usually fits in the same cache."""
    return 1 << max(8, (length - 1).bit_length())


def moved(target, cache, length: int, capacity: int):
    """A new cache of `capacity` positions holding the first `length` of `cache` (which is at `length`:
    a hybrid cache's conv/recurrent state goes along as it is)."""
    new = target.new_cache(capacity)
    for src, dst in _kv_pairs(cache, new):
        dst.k[:, :, :, :length].copy_(src.k[:, :, :, :length])  # [L, B, Hkv, S, D]
        dst.v[:, :, :, :length].copy_(src.v[:, :, :, :length])
    new.length = length
    if hasattr(cache, "restore"):
        new.restore(length, (cache.conv, cache.recurrent))
    return new


def _kv_pairs(a, b) -> list:
    """The (source, destination) `KVCache` pairs of two target caches of one model."""
    if hasattr(a, "groups"):  # Gemma 4: one KVCache per shape
        return [(a.groups[k], b.groups[k]) for k in a.groups]
    if hasattr(a, "kv"):  # Qwen3.5
        return [(a.kv, b.kv)]
    return [(a, b)]


def cache_bytes(cache) -> int:
    """Bytes of a target cache's tensors (keys/values, and conv/recurrent state where there is one)."""
    if hasattr(cache, "groups"):  # Gemma 4: one KVCache per shape
        return sum(cache_bytes(c) for c in cache.groups.values())
    if hasattr(cache, "kv"):  # Qwen3.5: keys/values of the attention layers + per-layer states
        return cache_bytes(cache.kv) + sum(t.nbytes for t in [*cache.conv, *cache.recurrent])
    return cache.k.nbytes + cache.v.nbytes
