"""Speculative greedy decoding is exactly target-only greedy decoding, whatever the drafter does."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_torch import loading
from dflash_torch.decoding.drafter import load_drafter
from dflash_torch.decoding.sampling import History, Sampler, TokenLogprobs
from dflash_torch.decoding.speculative import Stats, generate_tokens
from dflash_torch.models.cache import KVCache

from .conftest import make_drafter

BLOCK_SIZES = (2, 4, 8, 16)


def _run(target, prompt, n, drafter=None, bs=None, stops=(), controller=None):
    stats = Stats()
    ids = list(generate_tokens(target, prompt, max_new_tokens=n, drafter=drafter, block_size=bs,
                               stop_token_ids=stops, stats=stats, controller=controller))
    return ids, stats


@torch.inference_mode()
def _clear(target, prompt: list[int], completion: list[int], margin: float) -> torch.Tensor:
    """Per position from the last prompt token on (len(completion) + 1 rows): whether the greedy choice
    there wins by more than `margin` (relative to the winning logit)."""
    cache = target.new_cache(len(prompt) + len(completion))
    ids = torch.tensor([prompt + completion], device=target.embed_tokens.weight.device)
    logits = target(ids, cache, logits="all").logits[0, len(prompt) - 1:]
    top = logits.float().topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]) > margin * top[:, 0].abs().clamp_min(1.0)


def clear_margins(target, prompt: list[int], completion: list[int], margin: float = 1e-3) -> bool:
    """True when every greedy choice along prompt + completion wins by more than `margin` (relative).
    On a closer call the 1-position and many-position passes may round to different winners, which
    says nothing about the loop; such cases are skipped by the tests that compare exact tokens."""
    return bool(_clear(target, prompt, completion, margin).all())


def clear_case(target, draw, tries: int = 30) -> tuple[list[int], int, list[int]]:
    """(prompt, n, target-only greedy output) of the first case `draw()` -> (prompt, n) whose output has no
    near-tie (`clear_margins`); a test fails after `tries` near-ties in a row."""
    for _ in range(tries):
        prompt, n = draw()
        ref = list(generate_tokens(target, prompt, max_new_tokens=n))
        if clear_margins(target, prompt, ref):
            return prompt, n, ref
    pytest.fail(f"{tries} cases in a row with a near-tie")


def clear_prefix(target, prompt: list[int], completion: list[int], margin: float = 1e-3) -> int:
    """How many leading tokens of `completion` were clear greedy choices (each won by more than `margin`).
    Any other computation of the same target (other pass widths, reused caches) picks those same tokens,
    so a run that must equal `completion` must equal completion[:clear_prefix(...)] at least; past the
    first near-tie it may go either way."""
    clear = _clear(target, prompt, completion, margin)[: len(completion)].tolist()
    return clear.index(False) if False in clear else len(completion)


@pytest.fixture(scope="module")
def models_and_drafters(tiny_models, zlab, tmp_path_factory):
    base = tmp_path_factory.mktemp("drafters")
    out = []
    for kind, path in tiny_models.items():
        target = loading.load_target(path, torch.device("cpu"), torch.float32)
        drafter = load_drafter(make_drafter(path, base / kind, block_size=16))
        out.append((kind, target, drafter))
    out.append(("zlab", loading.load_target(zlab / "target", torch.device("cpu"), torch.float32),
                load_drafter(zlab / "draft")))
    return out


def test_speculative_equals_target_only_many_prompts(models_and_drafters):
    """27+ random prompts per model x 4 models (108+) x block sizes {2, 4, 8, 16}; some runs stop at
    an EOS that falls mid-block, all others at max tokens mid-block."""
    rng = random.Random(0)
    checked = 0
    for kind, target, drafter in models_and_drafters:
        vocab = target.config.vocab_size
        for i in range(27):
            prompt = [rng.randrange(vocab - 1) for _ in range(rng.randint(1, 20))]
            n = rng.randint(1, 40)
            ref, _ = _run(target, prompt, n)
            while not clear_margins(target, prompt, ref):
                prompt = [rng.randrange(vocab - 1) for _ in range(rng.randint(1, 20))]
                ref, _ = _run(target, prompt, n)
            assert len(ref) == n
            # every third prompt: make a token from the middle of the reference an EOS
            stops = (ref[len(ref) // 2],) if i % 3 == 0 else ()
            want = ref[: ref.index(stops[0]) + 1] if stops else ref
            if stops:
                assert _run(target, prompt, n, stops=stops)[0] == want
            for bs in BLOCK_SIZES:
                got, stats = _run(target, prompt, n, drafter, bs, stops)
                assert got == want, (kind, i, bs)
                assert stats.generated_tokens == len(want)
                assert sum(stats.acceptance_lengths) == len(want) - 1
                checked += 1
    assert checked >= 400


class OracleDrafter:
    """Proposes the true greedy continuation, corrupting each position with probability p.
    Records, per proposal, how many leading proposed tokens were correct."""

    def __init__(self, truth: list[int], prompt_len: int, vocab: int, p: float, block_size: int, seed: int = 0):
        self.truth, self.n, self.vocab, self.p = truth, prompt_len, vocab, p
        self.block_size, self.mask_token_id, self.target_layer_ids = block_size, vocab - 1, [0]
        self.rng = random.Random(seed)
        self.correct_prefixes: list[int] = []

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache(1, 1, 1, max_len)

    def propose(self, target, block, ctx, cache):
        start = cache.length + ctx.shape[1]  # position of block[0]
        cache.length = start
        k = block.shape[1] - 1
        logits = torch.zeros(1, k, self.vocab)
        prefix, broken = 0, False
        for j in range(k):
            idx = start + 1 + j - self.n  # index into the completion of the proposed token
            tok = self.truth[idx] if idx < len(self.truth) else 0
            if self.rng.random() < self.p:
                tok = (tok + 1) % (self.vocab - 1)  # a different token: certainly rejected
                broken = True
            prefix += not broken
            logits[0, j, tok] = 10.0
        self.correct_prefixes.append(prefix)
        return logits


@pytest.mark.parametrize("p", [0.0, 0.15, 0.5])
@pytest.mark.parametrize("bs", [4, 16])
def test_oracle_drafter_acceptance_stats(models_and_drafters, p, bs):
    kind, target, _ = models_and_drafters[0]
    rng = random.Random(int(p * 100) + bs)
    for trial in range(6):
        prompt = [rng.randrange(255) for _ in range(rng.randint(2, 12))]
        n = rng.randint(10, 60)
        truth, _ = _run(target, prompt, n + 16)
        while not clear_margins(target, prompt, truth):
            prompt = [rng.randrange(255) for _ in range(rng.randint(2, 12))]
            truth, _ = _run(target, prompt, n + 16)
        oracle = OracleDrafter(truth, len(prompt), target.config.vocab_size, p, bs, seed=trial)
        got, stats = _run(target, prompt, n, oracle, bs)
        assert got == truth[:n]
        # each cycle keeps exactly the oracle's correct prefix, plus the bonus, cut at max tokens
        remaining = n - 1
        prefixes = iter(oracle.correct_prefixes)
        for committed in stats.acceptance_lengths:
            # with one token left the cycle is a plain target step: nothing is proposed
            expect = 1 if remaining == 1 else min(next(prefixes) + 1, remaining)
            assert committed == expect
            remaining -= committed
        assert remaining == 0 and next(prefixes, None) is None
        assert stats.accepted_tokens == sum(oracle.correct_prefixes)
        if p == 0.0:  # a drafter that is the truth: every full block is accepted whole
            assert all(a == min(bs, r) for a, r in zip(stats.acceptance_lengths, _remainders(n, bs)))
            assert stats.acceptance_rate == 1.0


def _remainders(n: int, bs: int) -> list[int]:
    out, left = [], n - 1
    while left > 0:
        out.append(left)
        left -= min(bs, left)
    return out


class SwitchingController:
    """Alternates plain target steps and speculative blocks, to check mode switches are lossless."""

    def __init__(self):
        self.calls = 0
        self.observed: list[int] = []

    def block_size(self, stats):
        self.calls += 1
        return 1 if (self.calls // 3) % 2 else 16

    def observe(self, block_size, committed, seconds):
        assert committed <= block_size
        self.observed.append(block_size)


def test_block_size_controller_keeps_output(models_and_drafters):
    for kind, target, drafter in models_and_drafters:
        prompt = list(range(3, 12))
        ref, _ = _run(target, prompt, 50)
        truth, _ = _run(target, prompt, 80)
        oracle = OracleDrafter(truth, len(prompt), target.config.vocab_size, 0.1, 16)
        for d in (drafter, oracle):
            controller = SwitchingController()
            got, stats = _run(target, prompt, 50, d, 16, controller=controller)
            assert got == ref, kind
            # plain target steps (width 1: nothing drafted) and drafter blocks both ran, and the stats count
            # each cycle at the width the controller chose (a rejected draft also commits 1 token, so
            # acceptance lengths alone would not tell)
            plain = controller.observed.count(1)
            assert plain >= 3 and stats.widths.get(1, 0) == plain, (kind, stats.widths)  # calls 3-5 at least
            assert sum(n for w, n in stats.widths.items() if w > 1) == len(controller.observed) - plain >= 3


def _logprob_runs(target, drafter, prompt, n, top=4):
    """(tokens, entries) of target-only decoding, then of speculative runs with the drafter (block
    sizes 2 and 16, with and without prompt lookup)."""
    ref = TokenLogprobs(top)
    runs = [(list(generate_tokens(target, prompt, max_new_tokens=n, logprobs=ref)), ref.entries)]
    for bs in (2, 16):
        for lookup in (False, True):
            got = TokenLogprobs(top)
            toks = list(generate_tokens(target, prompt, max_new_tokens=n, drafter=drafter, block_size=bs,
                                        lookup=lookup, logprobs=got))
            runs.append((toks, got.entries))
    return runs


def test_logprobs_equal_target_only(models_and_drafters):
    """Each token's log-probability and best alternatives are the target's at that position, whichever
    pass decided it: the first token's prefill, decode steps, verify passes of a drafter or of lookup."""
    rng = random.Random(1)
    tokens = 0
    for kind, target, drafter in models_and_drafters:
        vocab = target.config.vocab_size
        for _ in range(3):
            prompt = [rng.randrange(vocab - 1) for _ in range(rng.randint(2, 12))]
            truth, _ = _run(target, prompt, 40)
            oracle = OracleDrafter(truth, len(prompt), vocab, 0.1, 16)
            for d in (drafter, oracle):
                (want, ref), *runs = _logprob_runs(target, d, prompt, 30)
                k = clear_prefix(target, prompt, want)  # past a near-tie a run may round the other way
                for toks, entries in runs:
                    assert toks[:k] == want[:k] and len(entries) == len(toks) == 30, kind
                    for (lp, ids, vals), (lp0, ids0, vals0) in zip(entries[:k], ref[:k]):
                        assert abs(lp - lp0) < 1e-4 and max(abs(a - b) for a, b in zip(vals, vals0)) < 1e-4, kind
                        assert ids[0] == ids0[0] and len(ids) == 4
                    tokens += k
    # 4 models x 3 prompts x 2 drafters x 4 runs x 30 tokens = 2880; these seeds compare 1600 or more of them
    # up to the first near-tie (about 2/3 of what they give on AVX-512 and AVX2 alike)
    assert tokens >= 1600, tokens


@pytest.mark.fastpath
def test_logprobs_bit_exact_with_quantized_weights(tiny_models):
    """With int4 weights a verify pass reproduces decode steps bit for bit, and so do the logprobs."""
    from dflash_torch.models.quantize import quantize_int4

    target = loading.load_target(tiny_models["llama"], torch.device("cpu"), torch.float32)
    quantize_int4(target)
    prompt = list(range(5, 14))
    truth, _ = _run(target, prompt, 40)
    for p in (0.0, 0.3):
        (want, ref), *runs = _logprob_runs(target, OracleDrafter(truth, len(prompt), target.config.vocab_size, p, 16),
                                           prompt, 30)
        for toks, entries in runs:
            assert toks == want and entries == ref


PENALTIES = dict(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={5: 2.0, 7: -3.0})


@torch.inference_mode()
def clear_adjusted_prefix(target, prompt, completion, sampler, margin: float = 1e-3) -> int:
    """clear_prefix for the logits after penalties and bias (each row with its own history)."""
    cache = target.new_cache(len(prompt) + len(completion))
    logits = target(torch.tensor([prompt + completion]), cache, logits="all").logits[0, len(prompt) - 1:]
    history = History(prompt, target.config.vocab_size, logits.device)
    for i, t in enumerate(completion):
        top = sampler.adjust(logits[i : i + 1], history)[0].topk(2).values
        if top[0] - top[1] <= margin * top[0].abs().clamp_min(1.0):
            return i
        history.add([t])
    return len(completion)


def test_penalties_keep_speculative_greedy_equal_to_target_only(models_and_drafters):
    """Greedy with presence/frequency/repetition penalties and a logit bias: each row of a verify pass
    is penalised as if the drafts before it had been generated, so speculation (drafter, lookup, a
    drafter that proposes the penalised output itself) gives target-only's penalised output."""
    rng = random.Random(2)
    changed = tokens = 0
    for kind, target, drafter in models_and_drafters:
        vocab = target.config.vocab_size
        for _ in range(4):
            prompt = [rng.randrange(vocab - 1) for _ in range(rng.randint(2, 12))]
            want = list(generate_tokens(target, prompt, max_new_tokens=40, sampler=Sampler(**PENALTIES)))
            changed += want != _run(target, prompt, 40)[0]
            truth = list(generate_tokens(target, prompt, max_new_tokens=60, sampler=Sampler(**PENALTIES)))
            oracle = OracleDrafter(truth, len(prompt), vocab, 0.0, 16)
            k = clear_adjusted_prefix(target, prompt, want, Sampler(**PENALTIES))
            for d, bs, lookup in ((drafter, 4, False), (drafter, 16, True), (oracle, 16, False)):
                stats = Stats()
                got = list(generate_tokens(target, prompt, max_new_tokens=40, drafter=d, block_size=bs,
                                           lookup=lookup, sampler=Sampler(**PENALTIES), stats=stats))
                assert got[:k] == want[:k] and len(got) == 40, kind  # past a near-tie it may round either way
                tokens += k
                if d is oracle and got == want:  # the truth is the penalised output: every block kept whole
                    assert stats.acceptance_rate == 1.0, kind
    assert changed >= 8  # the penalties do change what greedy decoding picks
    # 4 models x 4 prompts x 3 runs x 40 tokens = 1920: at least 1200 of them compared (about 2/3 of
    # what these seeds give, as the machine is and under ATEN_CPU_CAPABILITY=avx2)
    assert tokens >= 1200, tokens


@pytest.mark.fastpath
def test_penalties_bit_exact_with_quantized_weights(tiny_models):
    from dflash_torch.models.quantize import quantize_int4

    target = loading.load_target(tiny_models["qwen3"], torch.device("cpu"), torch.float32)
    quantize_int4(target)
    for prompt in ([3, 9, 27], list(range(20, 34))):
        want = list(generate_tokens(target, prompt, max_new_tokens=40, sampler=Sampler(**PENALTIES)))
        truth = list(generate_tokens(target, prompt, max_new_tokens=60, sampler=Sampler(**PENALTIES)))
        for p in (0.0, 0.3):
            d = OracleDrafter(truth, len(prompt), target.config.vocab_size, p, 16)
            assert list(generate_tokens(target, prompt, max_new_tokens=40, drafter=d, lookup=True,
                                        sampler=Sampler(**PENALTIES))) == want


class FondDrafter(OracleDrafter):
    """The oracle's logits (10 on the true token) plus 20 on one favourite token everywhere: its argmax is
    always the favourite, the truth comes second."""

    def __init__(self, *args, favourite: int, **kw) -> None:
        super().__init__(*args, **kw)
        self.favourite = favourite

    def propose(self, target, block, ctx, cache):
        logits = super().propose(target, block, ctx, cache)
        logits[..., self.favourite] += 20.0
        return logits


def test_drafts_are_proposed_under_the_bias(models_and_drafters):
    """A drafter fond of a token the logit bias bans: proposing under the same bias removes it, so the
    truth behind it is proposed and kept (all but the last block whole); output = target-only's."""
    kind, target, _ = models_and_drafters[0]
    vocab, prompt = target.config.vocab_size, [3, 1, 4, 1, 5]
    free = list(generate_tokens(target, prompt, max_new_tokens=30))
    banned = free[0]
    sampler = dict(logit_bias={banned: -100.0})
    want = list(generate_tokens(target, prompt, max_new_tokens=30, sampler=Sampler(**sampler)))
    assert banned not in want
    truth = list(generate_tokens(target, prompt, max_new_tokens=50, sampler=Sampler(**sampler)))
    stats = Stats()
    got = list(generate_tokens(target, prompt, max_new_tokens=30, sampler=Sampler(**sampler), stats=stats,
                               drafter=FondDrafter(truth, len(prompt), vocab, 0.0, 8, favourite=banned)))
    assert got == want and all(n == 8 for n in stats.acceptance_lengths[:-1]), stats.acceptance_lengths
