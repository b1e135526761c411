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

With a `DiskStore`, entries pushed out of memory are written to files and read back into a new cache
when a later prompt matches one of them better than anything in memory (a prefill on a CPU costs far
more than reading its keys and values back).

Reusing keys and values computed by earlier passes is exact arithmetic on the same numbers, but not
always the same bits as one prefill over the whole prompt would give (a pass over many positions rounds
differently from passes over few); every emitted token is still the target's choice given its cache.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

DEFAULT_MAX_ENTRIES = 4
DEFAULT_MAX_BYTES = 2 << 30


@dataclass(eq=False)  # entries are compared by identity
class Entry:
    ids: list[int]  # the tokens at cache positions [0, len(ids)) (the cache's length)
    cache: object
    hidden: torch.Tensor | None  # tap features [1, len(ids), F] of those positions (None: no taps)
    prompt_len: int  # the request's prompt: ids[:prompt_len]
    logits: torch.Tensor | None  # [1, V] the prefill's logits at the prompt's last position
    prompt_state: object = None  # hybrid caches: the conv/recurrent state after the prompt (cache.state())
    nbytes: int = 0
    handed_out: int | None = None  # single-cache targets: their new_cache count when this cache was theirs

    @property
    def has_logits(self) -> bool:
        return self.logits is not None

    def restorable(self, m: int) -> bool:
        """Whether the cache can go back to m positions (keys/values: any m; a hybrid's state: where known)."""
        if not hasattr(self.cache, "restore"):
            return True
        return (m == self.prompt_len and self.prompt_state is not None) or self.cache.can_crop(m)


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

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES,
                 disk: DiskStore | None = None) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("a prefix cache needs max_entries >= 1 and max_bytes >= 1")
        self.max_entries, self.max_bytes, self.disk = max_entries, max_bytes, disk
        self.entries: list[Entry] = []
        self.hits = self.misses = self.cached_tokens = self.disk_hits = 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def clear(self) -> None:
        self.entries.clear()

    def take(self, target, prompt: list[int], capacity: int, need_hidden: bool) -> Hit | None:
        """A cache holding the first tokens of `prompt`, from the entry (in memory or on disk) that covers
        the most of it: the entry's own cache, taken out (the generation owns it now), or a copy of those
        positions when they are only the beginning of the entry (which stays); None: no entry helps (the
        caller makes a new cache)."""
        best: tuple[int, Entry] | None = None
        single = getattr(target, "single_cache", False)  # new_cache rewinds the one cache entries hold
        # a target that owns one cache (cudagraph.GraphedTarget) rewinds it on every new_cache: an entry
        # whose cache was handed out again since is gone
        self.entries = [e for e in self.entries if e.handed_out == getattr(target, "handed_out", None)]
        for e in self.entries:  # most recent first: it wins a tie
            if need_hidden and e.hidden is None:
                continue
            m = _usable(e, prompt)
            if m > 0 and (best is None or m > best[0]):
                best = (m, e)
        stored = self._best_stored(prompt, need_hidden)
        if stored is not None and stored[0] > (best[0] if best else 0):  # read it back into a new cache
            if single:
                self.entries.clear()
            try:
                best = (stored[0], self.disk.load(stored[1], target, capacity))
                self.disk_hits += 1
            except Exception:  # a file gone or unreadable: as if it had never been stored (it is forgotten)
                pass
        if best is None:
            self.misses += 1
            if single:
                self.entries.clear()
            return None
        m, e = best
        self.hits += 1
        self.cached_tokens += m
        hidden = None if e.hidden is None or not need_hidden else e.hidden[:, :m]
        # the same prompt again: its prefill's logits, so no pass runs before the first token
        logits = e.logits if m == len(prompt) == e.prompt_len else None
        hybrid = hasattr(e.cache, "restore")
        if (m < e.cache.length and e in self.entries and not single
                and (not hybrid or (m == e.prompt_len and e.prompt_state is not None))):
            # a shorter prefix of a longer entry (a shared system prompt, the same prompt again): copy those
            # positions into a new cache and keep the entry for its own conversation
            state = e.prompt_state if hybrid else None
            return Hit(moved(target, e.cache, m, capacity_for(capacity), state), m, hidden, logits, e)
        if e in self.entries:
            self.entries.remove(e)
        if m == e.prompt_len and e.prompt_state is not None and m != e.cache.length:
            e.cache.restore(m, e.prompt_state)  # hybrid: the state saved after that prompt's prefill
        elif m != e.cache.length:
            e.cache.crop(m)
        cache = e.cache
        if cache.max_len < capacity:  # a longer conversation than the cache was made for: move it
            cache = moved(target, cache, m, capacity_for(capacity))
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
            old = self.entries.pop()
            if self.disk is not None:
                self.disk.save(old)

    def _best_stored(self, prompt: list[int], need_hidden: bool) -> tuple[int, Stored] | None:
        """(tokens it covers, the stored entry) that covers the most of `prompt`, or None."""
        best = None
        for s in self.disk.entries if self.disk is not None else []:
            if need_hidden and not s.has_hidden:
                continue
            m = _usable(s, prompt)
            if m > 0 and (best is None or m > best[0]):
                best = (m, s)
        return best


def _usable(x: Entry | Stored, prompt: list[int]) -> int:
    """How many of `prompt`'s first tokens entry `x` (in memory or on disk) can give back (0: none)."""
    m, limit = 0, min(len(x.ids), len(prompt))
    while m < limit and x.ids[m] == prompt[m]:
        m += 1
    if not (m == len(prompt) == x.prompt_len and x.has_logits):  # (the earlier request's own prompt: no prefill)
        m = min(m, len(prompt) - 1)  # the prompt's last token must run, for its logits
    return m if m > 0 and x.restorable(m) else 0


@dataclass(eq=False)
class Stored:
    """An entry written to disk by `DiskStore`: what choosing it needs, in memory; the tensors in a file."""

    ids: list[int]
    prompt_len: int
    path: Path
    nbytes: int
    has_hidden: bool
    has_logits: bool
    hybrid: bool
    has_prompt_state: bool

    def restorable(self, m: int) -> bool:
        """A stored hybrid state is the one at the end, and (if kept) the one after the prompt."""
        return not self.hybrid or m == len(self.ids) or (m == self.prompt_len and self.has_prompt_state)


class DiskStore:
    """Entries pushed out of memory, as safetensors files (at most `max_bytes` of them, most recent kept)
    in a directory of their own under `directory`, made for this process and removed when it exits, so
    files of another run (another model) are never read."""

    def __init__(self, directory: str | Path, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError("a disk store needs max_bytes >= 1")
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self.dir = Path(tempfile.mkdtemp(prefix="dflash-prefix-", dir=directory))
        except OSError as e:
            raise ValueError(f"cannot keep prefix-cache files in {directory}: {e}") from None
        atexit.register(shutil.rmtree, self.dir, True)
        self.max_bytes = max_bytes
        self.entries: list[Stored] = []
        self._count = 0

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.entries)

    def save(self, e: Entry) -> None:
        """Write entry `e` (its cache's first len(e.ids) positions) to a file; forget the oldest files over
        the budget."""
        from safetensors.torch import save_file

        n, cache, t = len(e.ids), e.cache, {}
        for i, kv in enumerate(_kv_list(cache)):
            t[f"k{i}"], t[f"v{i}"] = kv.k[:, :, :, :n], kv.v[:, :, :, :n]
        hybrid = hasattr(cache, "restore")
        if hybrid:  # the state at the end, and (if kept) after the prompt
            states = [("conv", cache.conv), ("rec", cache.recurrent)]
            if e.prompt_state is not None:
                states += [("pconv", e.prompt_state[0]), ("prec", e.prompt_state[1])]
            for name, tensors in states:
                t |= {f"{name}{j}": x for j, x in enumerate(tensors)}
        if e.hidden is not None:
            t["hidden"] = e.hidden
        if e.logits is not None:
            t["logits"] = e.logits
        self._count += 1
        path = self.dir / f"{self._count:08d}.safetensors"
        save_file({k: v.detach().contiguous().cpu() for k, v in t.items()}, str(path))
        self.entries.insert(0, Stored(list(e.ids), e.prompt_len, path, path.stat().st_size, e.hidden is not None,
                                      e.logits is not None, hybrid, e.prompt_state is not None))
        while self.entries and self.nbytes > self.max_bytes:
            self.entries.pop().path.unlink(missing_ok=True)

    def load(self, s: Stored, target, capacity: int) -> Entry:
        """Read stored entry `s` back into a new cache of at least `capacity` positions (the file is removed:
        the entry lives in memory again)."""
        from safetensors.torch import load_file

        self.entries.remove(s)
        device = target.embed_tokens.weight.device
        try:
            t = load_file(str(s.path), device=str(device))
        finally:
            s.path.unlink(missing_ok=True)
        n = len(s.ids)
        cache = target.new_cache(capacity_for(max(capacity, n + 1)))
        for i, kv in enumerate(_kv_list(cache)):
            kv.k[:, :, :, :n].copy_(t[f"k{i}"])
            kv.v[:, :, :, :n].copy_(t[f"v{i}"])
        cache.length = n
        prompt_state = None
        if s.hybrid:
            count = len(cache.conv)
            cache.restore(n, ([t[f"conv{j}"] for j in range(count)], [t[f"rec{j}"] for j in range(count)]))
            if s.has_prompt_state:
                prompt_state = ([t[f"pconv{j}"] for j in range(count)], [t[f"prec{j}"] for j in range(count)])
        hidden, logits = t.get("hidden"), t.get("logits")
        e = Entry(list(s.ids), cache, hidden, s.prompt_len, logits, prompt_state,
                  handed_out=getattr(target, "handed_out", None))
        e.nbytes = cache_bytes(cache) + (0 if hidden is None else hidden.nbytes)
        return e

    def clear(self) -> None:
        for s in self.entries:
            s.path.unlink(missing_ok=True)
        self.entries.clear()

    def close(self) -> None:
        """Forget everything and remove this store's directory."""
        self.entries.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


def _kv_list(cache) -> list:
    """The `KVCache`s of a target cache, in a fixed order."""
    if hasattr(cache, "groups"):  # Gemma 4: one per shape
        return [cache.groups[k] for k in sorted(cache.groups)]
    if hasattr(cache, "kv"):  # Qwen3.5
        return [cache.kv]
    return [cache]


def capacity_for(length: int) -> int:
    """Cache capacity for a generation that needs `length` positions: the next power of two (at least
    256), so the next turn of a conversation usually fits in the same cache."""
    return 1 << max(8, (length - 1).bit_length())


def moved(target, cache, length: int, capacity: int, state=None):
    """A new cache of `capacity` positions holding the first `length` of `cache`; a hybrid cache's
    conv/recurrent state goes along as it is (the cache is at `length`) or is `state` (saved at `length`)."""
    new = target.new_cache(capacity)
    for src, dst in zip(_kv_list(cache), _kv_list(new)):
        dst.k[:, :, :, :length].copy_(src.k[:, :, :, :length])  # [L, B, Hkv, S, D]
        dst.v[:, :, :, :length].copy_(src.v[:, :, :, :length])
    new.length = length
    if hasattr(cache, "restore"):
        new.restore(length, state or (cache.conv, cache.recurrent))
    return new


def cache_bytes(cache) -> int:
    """Bytes of a target cache's tensors (keys/values, and conv/recurrent state where there is one)."""
    states = [*cache.conv, *cache.recurrent] if hasattr(cache, "kv") else []  # Qwen3.5's per-layer states
    return sum(kv.k.nbytes + kv.v.nbytes for kv in _kv_list(cache)) + sum(t.nbytes for t in states)
