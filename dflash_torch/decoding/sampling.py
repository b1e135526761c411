"""Token choice and draft acceptance.

Greedy (temperature 0): a draft token is kept while it equals the target's argmax; the bonus is the
target's argmax after the kept prefix. Output is token-identical to target-only greedy decoding.

Sampling (temperature > 0): speculative rejection sampling. Draft token x, drawn from the drafter's
processed distribution q, is kept with probability min(1, p(x) / q(x)) under the target's processed
distribution p; at the first rejection the replacement is drawn from the normalised residual
max(0, p - q); after a fully kept block the bonus is drawn from p. Each emitted token is then
distributed exactly as if sampled from the target alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import kernels


class History:
    """What the penalties look at: how often each token occurred in the output [V], and whether it
    occurred in the prompt or the output [V]."""

    def __init__(self, prompt: list[int], vocab_size: int, device: torch.device) -> None:
        self.counts = torch.zeros(vocab_size, device=device)
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.seen[torch.tensor(prompt, dtype=torch.long, device=device)] = True

    def add(self, tokens: list[int]) -> None:
        t = torch.tensor(tokens, dtype=torch.long, device=self.counts.device)
        self.counts.index_add_(0, t, torch.ones(len(tokens), device=t.device))
        self.seen[t] = True


@dataclass
class TokenLogprobs:
    """Collects, for each emitted token, its log-probability under the target's own distribution
    (log-softmax of the raw logits: before temperature, filtering, penalties and grammar) and the `top`
    most likely tokens there. `entries[i]` = (logprob, [top ids], [top logprobs]) for the i-th token of the generation.
    The rows are the target's logits at the emitted positions, the same in a verify pass as in decode
    steps, so speculative decoding reports what target-only decoding reports."""

    top: int = 0
    entries: list = field(default_factory=list)

    def add(self, logits: torch.Tensor, tokens: list[int]) -> None:
        """Record tokens [T] chosen from the target's logits [>= T, V] (row i for token i)."""
        lp = logits[: len(tokens)].float().log_softmax(-1)  # [T, V]
        chosen = lp.gather(-1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
        if self.top > 0:
            values, ids = lp.topk(min(self.top, lp.shape[-1]), dim=-1)  # [T, top]
            values, ids = values.tolist(), ids.tolist()
        else:
            values, ids = [[]] * len(tokens), [[]] * len(tokens)
        self.entries += list(zip(chosen, ids, values))


def accept_greedy(draft: list[int], target_choice: list[int]) -> int:
    """Length of the longest prefix where draft [K] equals the target's argmax [K] (as lists: a verify pass
    compares a few tokens, where each tensor operation costs more than the comparison)."""
    k = 0
    while k < len(draft) and draft[k] == target_choice[k]:
        k += 1
    return k


def verify_greedy(draft: list[int], logits: torch.Tensor) -> tuple[int, int]:
    """(drafts kept, the target's next token) for draft [K] against the argmax of the target's logits [>= K + 1, V]
    at the block positions, compared as lists."""
    choice = kernels.argmax(logits).tolist()
    accepted = accept_greedy(draft, choice)
    return accepted, choice[accepted]


@dataclass
class Sampler:
    """Sampling settings for one request. temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    # OpenAI's penalties on tokens generated so far (subtracted from the logits: presence once, frequency
    # per occurrence), the repetition penalty of transformers/vLLM on tokens of the prompt or the output
    # (a logit above 0 divided by it, one below multiplied), and a bias added to given token ids' logits
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 <= self.min_p < 1:
            raise ValueError("min_p must be in [0, 1)")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        # Values so small that float32 breaks them become the nearest that does not, which picks the same
        # tokens: a temperature under 1e-5 is greedy (as vLLM takes it; logits / 1e-40 overflow to inf), a
        # top_p under 1e-8 keeps the most likely token only, as any that small does (one under 1.4e-45 rounds
        # to 0 and drops that token too), and a repetition_penalty under 1e-6 puts a repeated token above all
        # others, as any that small does (logits / 1e-300 overflow).
        if self.temperature < 1e-5:
            self.temperature = 0.0
        self.top_p = max(self.top_p, 1e-8)
        self.repetition_penalty = max(self.repetition_penalty, 1e-6)
        self._generator: torch.Generator | None = None
        self._bias: torch.Tensor | None = None

    @property
    def adjusts(self) -> bool:
        """True when the logits are changed before choosing (penalties or a logit bias)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias)

    def adjust(self, logits: torch.Tensor, history: History, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """The logits [T, V] with the bias and the penalties applied, row i as if drafts[:i] [T - 1] had
        been generated after `history` (row i decides the token after them, which matters only when
        they are kept). Equal to adjusting one row at a time with the drafts appended to the history."""
        x = logits.float().clone()
        if self.logit_bias:
            if self._bias is None or self._bias[0].device != x.device:
                ids, values = zip(*self.logit_bias.items())
                self._bias = (torch.tensor(ids, device=x.device), torch.tensor(values, device=x.device))
            x[:, self._bias[0]] += self._bias[1]
        if not (self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1):
            return x
        # Only tokens seen so far or drafted before a row are penalised: work on those columns alone.
        d = drafts[: x.shape[0] - 1] if drafts is not None else x.new_zeros(0, dtype=torch.long)
        cols = torch.cat([history.seen.nonzero()[:, 0], d]).unique()  # [C]
        before = (cols[:, None] == d[None, :]).float().cumsum(1)  # [C, T - 1]: drafts up to each one
        before = torch.cat([before.new_zeros(len(cols), 1), before], 1).T  # [T, C]: drafts before each row
        counts = history.counts[cols] + before  # [T, C] occurrences in the output
        seen = history.seen[cols] | (before > 0)
        v = x[:, cols]
        if self.repetition_penalty != 1:
            r = self.repetition_penalty
            v = torch.where(seen, torch.where(v > 0, v / r, v * r), v)
        x[:, cols] = v - self.frequency_penalty * counts - self.presence_penalty * (counts > 0).float()
        return x

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def _gen(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        return self._generator

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed distribution [T, V]: temperature, then top-k, top-p and min-p filtering."""
        scores = logits.float() / self.temperature
        if 0 < self.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = scores.softmax(-1)
        if self.top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop_sorted = sorted_p.cumsum(-1) - sorted_p >= self.top_p
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        if self.min_p > 0:
            probs = probs.masked_fill(probs < self.min_p * probs.max(-1, keepdim=True).values, 0.0)
        return probs / probs.sum(-1, keepdim=True)

    def _draw(self, probs: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(probs, 1, generator=self._gen(probs.device))[:, 0]

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """One token per row of logits [T, V] -> [T]."""
        if self.greedy:
            return kernels.argmax(logits)
        return self._draw(self.probs(logits))

    def draft(self, draft_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens [K] from the drafter's logits [K, V], and q [K, V] when sampling."""
        if self.greedy:
            return kernels.argmax(draft_logits), None
        q = self.probs(draft_logits)
        return self._draw(q), q

    def verify(
        self, draft: torch.Tensor, target_logits: torch.Tensor, draft_probs: torch.Tensor | None
    ) -> tuple[int, int]:
        """(number of draft tokens kept, the target's next token) for draft [K] and the target's
        logits [K + 1, V] at the block positions."""
        if self.greedy:
            return verify_greedy(draft.tolist(), target_logits)
        p = self.probs(target_logits)  # [K + 1, V]
        k = draft.shape[0]
        if k == 0:
            return 0, int(self._draw(p[-1:])[0])
        px = p[:k].gather(-1, draft[:, None])[:, 0]
        qx = draft_probs.gather(-1, draft[:, None])[:, 0]
        u = torch.rand(k, device=p.device, generator=self._gen(p.device))
        # u < p/q  <=>  u * q < p  (q(x) > 0 because x was drawn from q)
        accepted = int((u * qx < px).int().cumprod(0).sum())
        if accepted == k:
            return k, int(self._draw(p[-1:])[0])
        residual = (p[accepted] - draft_probs[accepted]).clamp_min(0)
        total = residual.sum()
        # p == q exactly leaves no residual mass; then a rejection cannot happen, but stay safe.
        residual = residual / total if total > 0 else p[accepted]
        return accepted, int(self._draw(residual[None])[0])
