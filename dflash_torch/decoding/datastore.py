"""A datastore of the target's own phrases: a second free proposer beside prompt lookup.

Prompt lookup drafts what the context already holds. Much of what a small model writes is its own stock
phrasing ("Here is a step-by-step ...", "I hope this helps!"), which recurs across conversations rather than
inside one. A datastore built from the target's greedy replies to other prompts (and its greedy choices along
other text) keeps, for each context of 1 to 3 tokens, the token the target wrote next there, where it wrote
the same one in at least `min_share` of at least `min_count` occurrences; contexts it was unsure after are not
kept. Chained from the committed tokens (the longest kept context first, then its shorter tails), it drafts a
phrase without a forward pass.

It ships beside the drafter (`datastore.npz`, built by `tools/build_datastore.py` from drafter training data:
the target's replies and teacher-forced text; held-out prompts are not among them). The speculative loop
verifies its drafts like any other, so output is the target's either way (`proposers.DatastoreProposer`
decides when it drafts).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from .lookup import DraftPricing

FILE = "datastore.npz"
BITS = 21  # per token in a packed context key: 3 tokens in 63 bits, vocabularies up to 2M tokens
MAX_N = 3


def pack(tokens: Iterable[int]) -> int:
    """A context of up to 3 tokens as one integer key (the first token in the lowest bits)."""
    key = 0
    for i, t in enumerate(tokens):
        key |= int(t) << (BITS * i)
    return key


class Datastore:
    """next[n][pack(context)] = the token the target wrote after that n-token context (n = 2 .. max_n)."""

    def __init__(self, tables: dict[int, dict[int, int]]) -> None:
        if not tables or min(tables) < 1 or max(tables) > MAX_N:
            raise ValueError(f"a datastore keeps contexts of 1 to {MAX_N} tokens, got lengths {sorted(tables)}")
        self.next = tables
        self.max_n, self.min_n = max(tables), min(tables)

    def __len__(self) -> int:
        return sum(len(t) for t in self.next.values())

    @classmethod
    def build(cls, replies: Iterable[list[int]], forced: Iterable[tuple[list[int], int, list[int]]] = (), *,
              min_n: int = 2, max_n: int = MAX_N, min_count: int = 2, min_share: float = 0.5) -> Datastore:
        """From the target's replies (token sequences) and teacher-forced text (`forced`: (tokens, start,
        choices), choices[i] the target's greedy token after tokens[: start + i]): each context of min_n ..
        max_n tokens whose most frequent next token holds `min_share` of its >= `min_count` occurrences (ties:
        the lower id)."""
        if not 1 <= min_n <= max_n <= MAX_N:
            raise ValueError(f"need 1 <= min_n <= max_n <= {MAX_N}")
        if min_count < 1 or not 0 < min_share <= 1:
            raise ValueError(f"need min_count >= 1 and 0 < min_share <= 1, got {min_count} and {min_share}")
        counts: dict[int, dict[tuple[int, ...], Counter]] = {n: defaultdict(Counter) for n in range(min_n, max_n + 1)}

        def count(tokens: list[int], start: int, nexts: list[int]) -> None:
            if any(t < 0 or t >= 1 << BITS for t in (*tokens, *nexts)):
                raise ValueError(f"token ids must lie in [0, {1 << BITS})")
            for i, nxt in enumerate(nexts):
                j = start + i  # nxt follows tokens[:j]
                for n in range(min_n, min(max_n, j) + 1):
                    counts[n][tuple(tokens[j - n : j])][nxt] += 1

        for r in replies:
            r = list(r)
            count(r, 0, r)
        for tokens, start, choices in forced:
            if start + len(choices) > len(tokens):
                raise ValueError("teacher-forced choices past the end of their text")
            count(list(tokens), start, list(choices))
        tables = {}
        for n, table in counts.items():
            kept = {}
            for ctx, c in table.items():
                total = sum(c.values())
                tok, k = max(c.items(), key=lambda kv: (kv[1], -kv[0]))
                if k >= min_count and k >= min_share * total:
                    kept[pack(ctx)] = tok
            tables[n] = kept
        return cls(tables)

    def draft(self, context: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens chained from the end of `context`: each the kept next token of the longest
        kept context ending there; [] when none is kept."""
        out: list[int] = []
        tail = list(context[-self.max_n :])
        while len(out) < limit:
            tok = None
            for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
                tok = self.next[n].get(pack(tail[-n:]))
                if tok is not None:
                    break
            if tok is None:
                break
            out.append(tok)
            tail = (tail + [tok])[-self.max_n :]
        return out

    def save(self, path: str | Path) -> None:
        """Write it as `.npz`: per context length n, sorted keys (int64) and their next tokens (int32)."""
        arrays = {}
        for n, table in self.next.items():
            keys = np.array(sorted(table), dtype=np.int64)
            arrays[f"keys{n}"] = keys
            arrays[f"next{n}"] = np.array([table[int(k)] for k in keys], dtype=np.int32)
        with open(path, "wb") as f:  # np.savez would append .npz to a name without it
            np.savez_compressed(f, **arrays)

    @classmethod
    def load(cls, path: str | Path) -> Datastore:
        """Read a saved datastore; a file that is not one is a ValueError naming it."""
        try:
            with np.load(path, allow_pickle=False) as z:
                tables = {}
                for name in z.files:
                    if not name.startswith("keys"):
                        continue
                    n = int(name[4:])
                    keys, nxt = z[name], z[f"next{n}"]
                    if keys.shape != nxt.shape or keys.ndim != 1:
                        raise ValueError(f"keys{n} and next{n} differ in shape")
                    tables[n] = dict(zip(keys.tolist(), nxt.tolist()))
            return cls(tables)
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{path}: not a datastore ({e})") from None


def load_beside(directory: str | Path) -> Datastore | None:
    """The datastore shipped in a drafter's directory, or None where there is none."""
    f = Path(directory) / FILE
    return Datastore.load(f) if f.is_file() else None


class StoreLookup(DraftPricing):
    """A datastore as a source of free drafts for `proposers.LookupProposer`: the chain from the committed
    tokens' tail, priced like a prompt-lookup draft (`lookup.DraftPricing`)."""

    def __init__(self, store: Datastore, tokens: Iterable[int] = (), *, max_draft: int = 15,
                 decay: float = 0.8) -> None:
        super().__init__(max_draft, decay)
        self.store = store
        self.tail = list(tokens)[-store.max_n :]

    def extend(self, tokens: Iterable[int]) -> None:
        """Append committed tokens (only the last few are kept: the longest context)."""
        self.tail = (self.tail + list(tokens))[-self.store.max_n :]

    def match(self, limit: int) -> list[int]:
        """Up to `limit` (at most max_draft) drafted tokens; [] where the store keeps no context for the tail."""
        return self.store.draft(self.tail, min(limit, self.max_draft))

