"""Where a cycle's draft comes from: the drafter, prompt lookup, or the grammar's forced tokens.

Each proposer offers a draft with the number of drafted tokens it expects the target to keep
(`offer`), drafts when chosen (`draft`), and learns from every cycle's outcome, chosen or not
(`observe`). `ranked` is the policy: the offer expected to keep the most first. Which proposer
drafts changes speed only: the target verifies every draft, so the output is the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from . import trees
from .datastore import StoreLookup
from .lookup import PromptLookup
from .sampling import History, Sampler
from .structured import Constraint

# Greedy drafter cycles verify a tree of the drafter's candidates (trees.py) where the target can
# (`verifies_trees`: block-format weights on the compiled kernels); off, a chain as other targets do.
# Output is the same either way.
TREES = True


@dataclass
class Draft:
    """A block to verify: the last committed token, then the drafted ones."""

    source: object | None  # the proposer that drafted it; None for a plain target step
    block: torch.Tensor  # [1, bs] long
    probs: torch.Tensor | None = None  # [bs - 1, V]: the distribution each draft was drawn from (None when greedy)
    parents: list[int] | None = None  # a tree (greedy only): each row's parent row; None: a chain
    tokens: list[int] | None = None  # block[0] as a list where the proposer had it (else read once from block)

    @property
    def width(self) -> int:
        return self.block.shape[1]

    def token_list(self) -> list[int]:
        """block[0] as a list: the loop compares and commits these (each tensor operation after a pass costs
        more than the comparison)."""
        if self.tokens is None:
            self.tokens = self.block[0].tolist()
        return self.tokens


@dataclass
class Offer:
    proposer: object
    expected: float  # drafted tokens the target is expected to keep


def ranked(offers: list[Offer | None]) -> list[Offer]:
    """The policy: the offers expected to keep the most first; a tie goes to the one offered first
    (the proposers are listed cheapest first: lookup, drafter, forced tokens)."""
    return sorted((o for o in offers if o is not None), key=lambda o: -o.expected)


def plain_step(token: int, device) -> Draft:
    """A cycle without a draft: the target decodes one token (its verify pass is a decode step)."""
    return Draft(None, torch.tensor([[token]], device=device), tokens=[token])


def fixed_draft(source, token: int, tokens: list[int], sampler: Sampler, vocab_size: int, device) -> Draft:
    """A draft of known tokens: to rejection sampling, a one-hot q, so sampled output stays exact."""
    row = [token, *tokens]
    block = torch.tensor([row], device=device)
    probs = None
    if not sampler.greedy:
        probs = torch.zeros(len(tokens), vocab_size, device=device)
        probs[torch.arange(len(tokens)), block[0, 1:]] = 1.0
    return Draft(source, block, probs, tokens=row)


class LookupProposer:
    """Prompt lookup (`lookup.PromptLookup`): the tokens that followed the last few tokens' earlier
    occurrence, as many as its measured acceptance and verify costs make worth drafting."""

    name = "lookup"
    times_plain_steps = True  # plain steps price width 1 in the cost table

    def __init__(self, tokens: list[int], width: int, sampler: Sampler, vocab_size: int,
                 constraint: Constraint | None, costs: dict[int, float] | None, finder=None) -> None:
        # finder: where drafts come from and how they are priced (`lookup.DraftPricing`; default: prompt lookup)
        self.finder = finder if finder is not None else PromptLookup(tokens, max_draft=width)
        if costs is not None:
            self.finder.costs = costs  # the same dict: what this generation measures, the next one knows
        self.sampler, self.vocab_size, self.constraint = sampler, vocab_size, constraint
        self.match: list[int] = []  # this cycle's match, kept to learn from even when not drafted
        self.found: list[int] = []

    def offer(self, remaining: int) -> Offer | None:
        f = self.finder
        self.match = f.match(remaining - 1)
        self.found = self.match[: f.draft_length(len(self.match))] if self.match else []
        if self.found and self.constraint is not None:  # cut where the grammar would refuse it anyway
            self.found = self.found[: self.constraint.allowed_prefix(self.found)]
        return Offer(self, f.expected_tokens(len(self.found) + 1) - 1) if self.found else None

    def draft(self, token: int, remaining: int, device) -> Draft:
        return fixed_draft(self, token, self.found, self.sampler, self.vocab_size, device)

    def observe(self, draft: Draft, accepted: int, new: list[int], hidden, seconds: float) -> None:
        match, bs = self.match, draft.width
        if draft.source is self:
            checked, kept = bs - 1, accepted
            if accepted == bs - 1 and len(match) > checked and len(new) > checked:
                # kept whole: the bonus token also checks the match's next position, so a draft that
                # keeps being kept learns one position further each cycle
                checked, kept = checked + 1, kept + (match[checked] == new[checked])
            self.finder.observe(checked, kept)
        elif match:  # what the unused match would have kept, as far as the new tokens tell
            kept = _common_prefix(match, new)
            self.finder.observe(min(len(match), len(new), kept + 1), kept, drafted=False)
        # Verify-only cycles time the lookup's widths. Not for a seeded sampled run: its random draws
        # depend on the block widths, so they must not depend on timing (unmeasured widths cost alike).
        if ((draft.source is self or (bs == 1 and self.times_plain_steps))
                and (self.sampler.greedy or self.sampler.seed is None)):
            self.finder.observe_cost(bs, seconds)
        self.finder.extend(new)


class DatastoreProposer(LookupProposer):
    """The target's stock phrases (`datastore.Datastore`, shipped beside the drafter): the tokens it wrote after
    the last 2-3 tokens in other conversations, drafted and priced as prompt lookup's are. Its verify costs are
    the table prompt lookup measures (the same passes), so plain steps are timed there once, not here again."""

    name = "datastore"
    times_plain_steps = False

    def __init__(self, store, tokens: list[int], width: int, sampler: Sampler, vocab_size: int,
                 constraint: Constraint | None, costs: dict[int, float] | None) -> None:
        super().__init__(tokens, width, sampler, vocab_size, constraint, costs,
                         finder=StoreLookup(store, tokens, max_draft=width))


class ForcedProposer:
    """Tokens the grammar leaves no choice about (a JSON key, a closing tag): a draft the target keeps
    (unless it spells the same text with other tokens) at no drafting cost."""

    name = "forced"

    def __init__(self, constraint: Constraint, width: int, sampler: Sampler, vocab_size: int) -> None:
        self.constraint, self.width, self.sampler, self.vocab_size = constraint, width, sampler, vocab_size
        self.forced: list[int] = []

    def offer(self, remaining: int) -> Offer | None:
        self.forced = self.constraint.forced(min(self.width, remaining - 1))
        return Offer(self, len(self.forced)) if self.forced else None

    def draft(self, token: int, remaining: int, device) -> Draft:
        return fixed_draft(self, token, self.forced, self.sampler, self.vocab_size, device)

    def observe(self, draft: Draft, accepted: int, new: list[int], hidden, seconds: float) -> None:
        pass  # what the grammar forces does not depend on what was kept before


class DrafterProposer:
    """The DFlash drafter: a block of `block_size` positions in one pass, conditioned on the target's
    tap features of every committed token. `controller` (optional) sets each cycle's width; when it
    chooses a plain step the drafter declines and the next offer (or a plain step) takes the cycle."""

    name = "dflash"

    def __init__(self, drafter, target, block_size: int, capacity: int, hidden: torch.Tensor | list[torch.Tensor],
                 sampler: Sampler, history: History | None, constraint: Constraint | None, controller, stats,
                 session) -> None:
        self.drafter, self.target, self.block_size = drafter, target, block_size
        self.sampler, self.history, self.constraint = sampler, history, constraint
        self.controller, self.stats, self.session = controller, stats, session
        self.cache = drafter.new_cache(capacity)
        # tap features [1, t, n_taps * H] not yet given to the drafter, joined only when it runs: a
        # running torch.cat copied the whole backlog every step while the fallback kept it off
        self.pending = list(hidden) if isinstance(hidden, list) else [hidden]
        self.mean = 0.0  # running mean of drafted tokens kept per drafter cycle
        # trees of candidates where the choice is the argmax and the target verifies trees
        vt = getattr(target, "verifies_trees", None)
        self.ranks = (trees.shared_ranks(drafter) if TREES and sampler.greedy and history is None
                      and constraint is None and vt is not None and vt(block_size) else None)
        estimate = getattr(controller, "estimate_with", None)  # the adaptive width prices trees by their shapes
        if estimate is not None:
            estimate(self.ranks.expected_tokens if self.ranks is not None else None)
        self.top: list[list[int]] = []  # this cycle's candidates per position (with trees)

    def offer(self, remaining: int) -> Offer:
        return Offer(self, self.mean)

    def draft(self, token: int, remaining: int, device) -> Draft | None:
        c = self.controller
        want = self.block_size if c is None else max(1, min(c.block_size(self.stats), self.block_size))
        bs = min(want, remaining)  # a block of bs positions commits at most bs tokens
        if bs == 1:
            return None
        if self.ranks is not None:  # a tree of bs - 1 nodes (where the likeliest is a chain, a chain)
            return self._draft_tree(token, bs - 1, device)
        block = torch.full((1, bs), self.drafter.mask_token_id, dtype=torch.long, device=device)
        block[0, 0] = token
        ctx = self._context()
        select = getattr(self.drafter, "select", None)  # a drafter that picks its own tokens (DFlash2)
        vocab = getattr(self.drafter, "draft_vocab", None)
        if (vocab is not None and self.sampler.greedy and self.history is None and self.constraint is None
                and select is None):
            # greedy over the draft vocabulary's own logits: its ids ascend, so the first maximum among them
            # is the first maximum of the full row (-inf elsewhere) that the general path builds
            small = self.drafter.propose(self.target, block, ctx, self.cache, full=False)[0]  # [bs - 1, |vocab|]
            block[0, 1:], probs = vocab[kernels.argmax(small)], None
        else:
            draft_logits = self.drafter.propose(self.target, block, ctx, self.cache)[0]  # [bs - 1, V]
            if self.history is not None:  # propose under the target's penalties and bias (not the drafts' repeats)
                draft_logits = self.sampler.adjust(draft_logits, self.history)
            block[0, 1:], probs = (self.constraint.draft(draft_logits, self.sampler) if self.constraint is not None
                                   else select(draft_logits, token, self.sampler) if select is not None
                                   else self.sampler.draft(draft_logits))
        self.pending = []  # the drafter's cache holds it now
        return Draft(self, block, probs)

    def _context(self):
        # [1, Tc, n_taps * H]; a windowed drafter takes the parts as they are and copies only the rows it keeps
        # (after a long prompt and a few plain steps, joining them first copied the whole prompt's features)
        return (self.pending[0] if len(self.pending) == 1 else list(self.pending)
                if getattr(self.drafter, "window", None) is not None else torch.cat(self.pending, dim=1))

    def _draft_tree(self, token: int, nodes: int, device) -> Draft:
        """The drafter's block of nodes + 1 positions, its top candidates per position with its own probabilities
        of them, and the tree of the `nodes` paths likeliest under those probabilities (`trees.best_shape`:
        deep where the drafter is sure, wide where it is not; a chain where that is likeliest). A drafter with a
        candidate selector (DFlash2) prices each candidate given its parent's token instead."""
        block = torch.full((1, nodes + 1), self.drafter.mask_token_id, dtype=torch.long, device=device)
        block[0, 0] = token
        vocab = getattr(self.drafter, "draft_vocab", None)
        kw = {} if vocab is None else {"full": False}  # over the draft vocabulary's rows where there is one
        logits = self.drafter.propose(self.target, block, self._context(), self.cache, **kw)[0].float()  # [n, V']
        selector = getattr(self.drafter, "candidate_selector", None)
        k = min(trees.KMAX if selector is None else selector.top_k, logits.shape[-1])
        probs, top = kernels.top_probs(logits, k)  # [n, k]: the drafter's softmax at its candidates, their indices
        ids = top if vocab is None else vocab[top]
        if selector is None:
            shape = trees.best_shape(probs.tolist(), nodes)
        else:  # position 1 given the anchor, each later one given its parent's candidate
            first, trans = selector.transitions(probs, ids, self.drafter.last_hidden, token)
            shape = trees.best_shape([first.tolist(), *probs[1:].tolist()], nodes, trans.tolist())
        self.pending = []
        self.top = ids.tolist()
        tokens = shape.tokens(token, self.top)
        return Draft(self, torch.tensor([tokens], device=device), None, None if shape.chain else shape.parents,
                     tokens)

    def observe(self, draft: Draft, accepted: int, new: list[int], hidden: torch.Tensor, seconds: float) -> None:
        kept = hidden[:, : len(new)]  # [1, len(new), n_taps * H]: the features of what was committed
        if self.session is not None:  # held until the prefix cache takes it: not the whole block's features
            kept = kept.clone() if len(new) < draft.width else kept
            self.session.hidden.append(kept)
        self.pending.append(kept)
        if draft.source is self:
            self.mean = 0.7 * self.mean + 0.3 * accepted
            if self.ranks is not None:
                self.ranks.observe(self.top, new)
        if self.controller is not None and (draft.source is self or draft.source is None):
            self.controller.observe(draft.width, len(new), seconds)


def _common_prefix(a: list[int], b: list[int]) -> int:
    k = 0
    while k < len(a) and k < len(b) and a[k] == b[k]:
        k += 1
    return k
