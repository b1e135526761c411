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


@dataclass
class TokenLogprobs:
    """Collects, for each emitted token, its log-probability under the target's own distribution
    (log-softmax of the raw logits: before temperature and filtering) and the `top` most likely tokens
    there. `entries[i]` = (logprob, [top ids], [top logprobs]) for the i-th token of the generation.
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


def accept_greedy(draft: torch.Tensor, target_choice: torch.Tensor) -> int:
    """Length of the longest prefix where draft [K] equals the target's argmax [K]."""
    return int((draft == target_choice).int().cumprod(0).sum())


@dataclass
class Sampler:
    """Sampling settings for one request. temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 <= self.min_p < 1:
            raise ValueError("min_p must be in [0, 1)")
        self._generator: torch.Generator | None = None

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
            return logits.argmax(-1)
        return self._draw(self.probs(logits))

    def draft(self, draft_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens [K] from the drafter's logits [K, V], and q [K, V] when sampling."""
        if self.greedy:
            return draft_logits.argmax(-1), None
        q = self.probs(draft_logits)
        return self._draw(q), q

    def verify(
        self, draft: torch.Tensor, target_logits: torch.Tensor, draft_probs: torch.Tensor | None
    ) -> tuple[int, int]:
        """(number of draft tokens kept, the target's next token) for draft [K] and the target's
        logits [K + 1, V] at the block positions."""
        if self.greedy:
            choice = target_logits.argmax(-1)
            accepted = accept_greedy(draft, choice[:-1])
            return accepted, int(choice[accepted])
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
