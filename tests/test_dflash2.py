"""DFlash2 drafters (decoding/dflash2.py) against the reference vectors of ../shared/fixtures/zlab-dflash2-tiny:
the forward pass, the candidate selector, the speculative loop through `dflash generate`, sampling, saving."""

from __future__ import annotations

import itertools
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from scipy.stats import chi2

from dflash_torch import loading
from dflash_torch.decoding.dflash2 import DFlash2Drafter
from dflash_torch.decoding.drafter import load_drafter
from dflash_torch.decoding.sampling import Sampler
from dflash_torch.decoding.speculative import generate_tokens

from .conftest import SMALL_VOCAB

# Float32 throughout (the fixture's README): agreement to ~1e-5 of the values' magnitude, ids exactly.
RTOL = 1e-5


@pytest.fixture(scope="module")
def fixture(zlab):
    path = zlab.parent / "zlab-dflash2-tiny"
    if not path.is_dir():
        pytest.fail(f"fixture directory {path} is missing (set DFLASH_SHARED to the shared/ folder)")
    return path


@pytest.fixture(scope="module")
def target(fixture):
    return loading.load_target(fixture / "target", torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def vector(fixture):
    return load_file(str(fixture / "forward_vector.safetensors"))


def _close(got, want):
    """assert_close at RTOL, with an absolute floor of RTOL times the reference's magnitude (values near 0
    carry the rounding of the large values they were computed from)."""
    torch.testing.assert_close(got, want, rtol=RTOL, atol=RTOL * float(want.abs().max()))


@torch.no_grad()
def _forward(drafter, target, v):
    """The fixture's one pass without cache: hidden [1, 8, H], logits [1, 7, V]."""
    ctx_len = v["target_hidden"].shape[1]
    pos = v["position_ids"][0]
    emb = target.embed_tokens(v["noise_ids"])
    hidden = drafter(emb, v["target_hidden"], pos[ctx_len:], pos[:ctx_len])
    return hidden, drafter.logits(hidden[:, 1:], target.lm_head)


def test_forward_and_selector_match_reference(fixture, target, vector):
    v = vector
    drafter = load_drafter(fixture / "draft")
    assert isinstance(drafter, DFlash2Drafter) and drafter.dtype == torch.float32
    assert (drafter.block_size, drafter.mask_token_id, drafter.target_layer_ids) == (8, 511, [1, 5])
    torch.testing.assert_close(target.embed_tokens(v["noise_ids"]), v["noise_embedding"], rtol=0, atol=0)
    hidden, logits = _forward(drafter, target, v)
    _close(hidden, v["draft_hidden"])
    _close(logits, v["draft_logits"])
    anchor = int(v["noise_ids"][0, 0])
    with torch.no_grad():
        sel = drafter.candidate_selector(logits[0], hidden[0, 1:], anchor)
    # The reference takes the top k unsorted and stores them in descending logit order; so do we.
    assert torch.equal(sel.candidates.sort(-1).values, v["candidates"][0].sort(-1).values)
    assert torch.equal(sel.candidates, v["candidates"][0])
    _close(sel.scores, v["selector_scores"][0])
    assert torch.equal(sel.tokens, v["draft_tokens"][0])
    differs = (sel.tokens != v["argmax_tokens"][0]).nonzero()[:, 0].tolist()
    assert differs == json.loads((fixture / "expected.json").read_text())["forward_vector"]["selector_differs_at"]


def test_convolutions_matter_as_the_reference_says(fixture, target, vector, monkeypatch):
    """Without the convolutions (every one passing its signal through) the hidden states move by the
    fixture's `conv_effect_max_abs`: they are computed, not skipped."""
    from dflash_torch.decoding import dflash2

    want = json.loads((fixture / "expected.json").read_text())["forward_vector"]["conv_effect_max_abs"]
    drafter = load_drafter(fixture / "draft")
    monkeypatch.setattr(dflash2.DynamicConv, "_convolve", lambda self, v, base, dyn, segment: v)
    bare, _ = _forward(drafter, target, vector)
    effect = float((bare - vector["draft_hidden"]).abs().max())
    assert effect == pytest.approx(want, rel=RTOL)


def test_propose_and_select_through_the_cache(fixture, target, vector):
    """The loop's calls: the context fed in two cycles through the draft cache, then propose + select
    give the reference's logits and tokens (greedy: no q)."""
    v = vector
    drafter = load_drafter(fixture / "draft").fuse_context_kv()  # as `generate.load` sets it up
    ctx = v["target_hidden"]
    cache = drafter.new_cache(64)
    with torch.no_grad():
        drafter.propose(target, v["noise_ids"][:, :4], ctx[:, :6], cache)  # an earlier cycle's context
        assert cache.length == 6
        logits = drafter.propose(target, v["noise_ids"], ctx[:, 6:], cache)
        assert cache.length == 11
        tokens, q = drafter.select(logits[0], int(v["noise_ids"][0, 0]), Sampler())
    _close(logits, v["draft_logits"])
    assert torch.equal(tokens, v["draft_tokens"][0]) and q is None
    with pytest.raises(ValueError, match="latest propose"):
        drafter.select(logits[0, :3], 7, Sampler())


def _pvalue(counts: dict, exact: dict, n: int, missing: float = 0.0) -> float:
    """Pearson chi-square of counts against probabilities `exact` (plus `missing` probability no cell
    holds); cells expected fewer than 5 times are pooled into one."""
    stat, df, pooled_o, pooled_e = 0.0, -1, 0, missing * n
    assert set(counts) <= set(exact), "drew a token pair of probability 0"
    for cell, p in exact.items():
        e, o = p * n, counts.get(cell, 0)
        if e < 5:
            pooled_o, pooled_e = pooled_o + o, pooled_e + e
        else:
            stat, df = stat + (o - e) ** 2 / e, df + 1
    if pooled_e > 0:
        stat, df = stat + (pooled_o - pooled_e) ** 2 / pooled_e, df + 1
    return float(chi2.sf(stat, df))


def test_training_blocks_side_by_side_convolve_each_block_alone(fixture, target, vector):
    """A training pass lays blocks side by side (`drafter.Blocks`): each block's convolutions restart at its
    first position, so its hidden states equal a pass of that block alone over its own context."""
    from dflash_torch.decoding.drafter import Blocks

    v = vector
    drafter = load_drafter(fixture / "draft")
    ctx, bs = v["target_hidden"], 8
    blocks = v["noise_ids"].repeat(1, 2)
    blocks[0, bs] = 9  # the second block's anchor
    ctx_len = torch.tensor([6, 11])  # each block's context: the rows before its anchor
    q_pos = torch.cat([torch.arange(6, 6 + bs), torch.arange(11, 11 + bs)])
    with torch.no_grad():
        emb = target.embed_tokens(blocks)
        both = drafter(emb, ctx, q_pos, torch.arange(11), extra_mask=Blocks(torch.tensor([0, 0]), ctx_len, bs))
        for i, n in enumerate(ctx_len.tolist()):
            alone = drafter(emb[:, i * bs : (i + 1) * bs], ctx[:, :n], q_pos[i * bs : (i + 1) * bs], torch.arange(n))
            _close(both[:, i * bs : (i + 1) * bs], alone)
        with pytest.raises(ValueError, match="pass Blocks"):
            drafter(emb[:, :bs], ctx, q_pos[bs:], torch.arange(11), extra_mask=torch.ones(bs, 11 + bs, dtype=bool))


def _cli_json(args, capsys):
    from dflash_torch.cli import main

    assert main(args) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


# (extra flags, whether the reference's acceptance lengths must come out): the reference loop drafts
# every cycle at the full block size, which prompt lookup, the fallback and adaptive sizes change.
MODES = [([], False), (["--no-lookup", "--no-fallback", "--no-adaptive"], True), (["--no-draft"], False)]


@pytest.mark.parametrize("extra,exact_cycles", MODES, ids=["default", "reference-loop", "no-draft"])
def test_generate_cli_matches_reference(fixture, capsys, monkeypatch, extra, exact_cycles):
    """`dflash generate` with the DFlash2 drafter: the reference's tokens on all three prompts, and with the
    reference's loop (no lookup, fallback or adaptive block size) its acceptance length of every cycle.
    The default `--quantize auto` keeps this float32 HF target unquantized, as `--quantize none` does."""
    expected = json.loads((fixture / "expected.json").read_text())
    assert loading.auto_quantize(json.loads((fixture / "target" / "config.json").read_text()),
                                 torch.device("cpu")) == (None, None)
    calls = []
    select = DFlash2Drafter.select
    monkeypatch.setattr(DFlash2Drafter, "select", lambda self, *a: calls.append(1) or select(self, *a))
    drafter_passes = 0
    for case in expected["generate"]:
        args = ["generate", "--model", str(fixture / "target"), "--draft", str(fixture / "draft"), "--prompt-ids",
                ",".join(map(str, case["prompt"])), "--max-tokens", "48", "--json", *extra]
        out = _cli_json(args, capsys)
        assert out["token_ids"] == case["dflash_output"] == case["greedy_output"]
        s = out["stats"]
        drafter_passes += (sum(n for w, n in s["verify_widths"].items() if int(w) > 1)
                           - s["lookup_cycles"] - s["datastore_cycles"])
        if "--no-draft" in extra:
            assert s["mode"] == "target-only"
        elif exact_cycles:
            assert s["mode"] == "dflash" and s["acceptance_lengths"] == case["acceptance_lengths"]
    # the selector picked every draft the drafter made; the default loop's fallback and adaptive width decide by
    # measured time whether it drafts at all, which a busy machine can tip towards none
    assert (len(calls) > 0) == (drafter_passes > 0)
    if "--no-draft" in extra:
        assert drafter_passes == 0
    if exact_cycles:
        assert drafter_passes > 0


@pytest.mark.parametrize("fmt", ["q8_0", "int8"])
def test_quantized_drafter_keeps_output(fixture, fmt):
    """`--quantize` goes through the DFlash2 drafter's linear layers too (convolution kernel and selector
    projections included, where the kernels take their shapes); the output is the quantized target's own."""
    from dflash_torch.generate import load
    from dflash_torch.models.quantize import BlockLinear, Int8Linear

    pipe = load(str(fixture / "target"), str(fixture / "draft"), "cpu", quiet=True, quantize=fmt)
    d = pipe.drafter
    kind = BlockLinear if fmt == "q8_0" else Int8Linear
    layer = d.layers[0]
    assert all(isinstance(m, kind) for m in (d.fc, layer.self_attn.q_proj, layer.attention_conv.kernel_projection,
                                             layer.mlp_conv.kernel_projection, d.candidate_selector.hidden_projection))
    prompt = json.loads((fixture / "expected.json").read_text())["generate"][0]["prompt"]
    plain = list(generate_tokens(pipe.target, prompt, max_new_tokens=32))
    assert list(generate_tokens(pipe.target, prompt, max_new_tokens=32, drafter=d)) == plain


def test_selector_q_is_what_its_tokens_are_drawn_from(fixture, target, vector):
    """Sampling: at each position the token is drawn from q (the softmax of the selector's scores at the
    sampler's temperature over its candidates, zero elsewhere), given the token drawn before it. Many seeded
    draws of a two-position block against q, by chi-square over the joint of both tokens; seeded runs repeat."""
    v = vector
    drafter = load_drafter(fixture / "draft")
    block = v["noise_ids"][:, :3]  # the anchor and two drafted positions
    with torch.no_grad():
        logits = drafter.propose(target, block, v["target_hidden"], drafter.new_cache(32))[0]  # [2, V]
    anchor, sampler, n = int(block[0, 0]), Sampler(temperature=2.0, seed=0), 3000
    counts, q_of = {}, {}
    for _ in range(n):
        tokens, q = drafter.select(logits, anchor, sampler)
        pair = tuple(tokens.tolist())
        counts[pair] = counts.get(pair, 0) + 1
        q_of[pair] = q
    for (a, b), q in q_of.items():
        assert q.shape == logits.shape and torch.allclose(q.sum(-1), torch.ones(2))
        assert q[0, a] > 0 and q[1, b] > 0 and (q > 0).sum(-1).tolist() == [4, 4]  # its k candidates only
    first = next(iter(q_of.values()))[0]
    assert all(torch.equal(q[0], first) for q in q_of.values())  # position 0 does not depend on the draw
    # the expected joint: q[0](a) times q[1](b | a), the second row as select() reported it after drawing a
    second = {a: q[1] for (a, _), q in q_of.items()}
    exact = {(a, b): float(first[a] * second[a][b]) for a in second for b in second[a].nonzero()[:, 0].tolist()}
    unseen = sum(float(first[a]) for a in first.nonzero()[:, 0].tolist() if a not in second)
    assert unseen * n < 5  # every first token likely enough to matter was drawn (and its q seen)
    assert _pvalue(counts, exact, n, missing=unseen) > 1e-3
    # q is the README's: at the first position the softmax of the selector's scores at the temperature
    with torch.no_grad():
        sel = drafter.candidate_selector(logits, drafter.last_hidden, anchor)
    torch.testing.assert_close(first[sel.candidates[0]], (sel.scores[0] / 2.0).softmax(-1), rtol=RTOL, atol=RTOL)

    def run(seed):
        s = Sampler(temperature=2.0, seed=seed)
        return [drafter.select(logits, anchor, s)[0].tolist() for _ in range(8)]

    assert run(1) == run(1) != run(2)


# --- sampling through the loop: exact in distribution ------------------------------------------------------


def _small_dflash2(target, seed: int = 0) -> DFlash2Drafter:
    """A random DFlash2 drafter for the 5-token target of conftest's `small_vocab`, its selector choosing
    among 3 of the 5 tokens (so a token the target wants is sometimes not a candidate: the residual path)."""
    c = target.config
    config = {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": c.hidden_size,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": SMALL_VOCAB, "num_target_layers": 1,
        "max_position_embeddings": 64, "rope_theta": 10000.0, "is_causal": False,
        "dflash_config": {"block_size": 3, "mask_token_id": SMALL_VOCAB - 1, "target_layer_ids": [0],
                          "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 3},
    }
    torch.manual_seed(seed)
    d = DFlash2Drafter(config)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 1.0 if "codebook" in name else 0.1)
    return d.requires_grad_(False).eval()


PROMPT, ANCHOR = [1, 3, 0, 2], 2  # the committed tokens; the block drafts the two after ANCHOR


@torch.inference_mode()
def _one_cycle(target, drafter):
    """What one speculative cycle after PROMPT + [ANCHOR] sees: the draft logits [2, V] of the block
    [ANCHOR, mask, mask], and the target's logits at the block's positions [3, V] for every pair of drafts
    (the verify pass's, here from one pass over the whole sequence)."""
    out = target(torch.tensor([PROMPT]), target.new_cache(len(PROMPT)), logits="last", taps=drafter.target_layer_ids)
    block = torch.tensor([[ANCHOR, drafter.mask_token_id, drafter.mask_token_id]])
    draft_logits = drafter.propose(target, block, out.hidden, drafter.new_cache(16))[0]
    verify = {}
    for pair in itertools.product(range(SMALL_VOCAB), repeat=2):
        seq = torch.tensor([[*PROMPT, ANCHOR, *pair]])
        verify[pair] = target(seq, target.new_cache(seq.shape[1]), logits="all").logits[0, -3:]
    return draft_logits, verify


def _cycle_counts(drafter, draft_logits, verify, n: int, wrong_q: bool = False):
    """Counts of the first two tokens after ANCHOR over n seeded cycles: select() drafts two tokens with q,
    Sampler.verify keeps a prefix and draws the next token. When a cycle emits one token, the second is the
    next cycle's first, which comes from the target's distribution after it (a drafted block's first token is
    the target's own, which this test checks). `wrong_q`: report q uniform over the candidates instead."""
    sampler, counts, kept = Sampler(temperature=1.0, seed=0), {}, [0, 0, 0]
    for _ in range(n):
        tokens, q = drafter.select(draft_logits, ANCHOR, sampler)
        if wrong_q:
            q = (q > 0).float() / (q > 0).sum(-1, keepdim=True)
        accepted, bonus = sampler.verify(tokens, verify[tuple(tokens.tolist())], q)
        kept[accepted] += 1
        new = tokens[:accepted].tolist() + [bonus]
        if len(new) == 1:
            new.append(int(sampler.sample(verify[(new[0], 0)][1:2])[0]))
        counts[tuple(new[:2])] = counts.get(tuple(new[:2]), 0) + 1
    return counts, kept


def test_sampling_with_the_selector_is_exact(small_vocab):
    """Speculative sampling with a DFlash2 drafter (its tokens and q from `select`, two drafted positions,
    the second drawn given the first) keeps the target's distribution: the joint of the two tokens after the
    anchor against target-only sampling, by chi-square, with drafts kept and rejected at both positions. The
    same test catches a q that is not the one the tokens were drawn from."""
    target, _ = small_vocab
    drafter = _small_dflash2(target)
    draft_logits, verify = _one_cycle(target, drafter)
    s = Sampler(temperature=1.0)
    first = s.probs(verify[(0, 0)][:1])[0]
    exact = {(a, b): float(first[a] * s.probs(verify[(a, 0)][1:2])[0, b])
             for a in range(SMALL_VOCAB) for b in range(SMALL_VOCAB)}

    assert min(exact.values()) * 1500 > 5  # every cell is expected often enough for the test, unpooled
    with torch.inference_mode():
        counts, kept = _cycle_counts(drafter, draft_logits, verify, 3000)
        assert min(kept) > 0.05 * 3000, kept  # none, one and both drafts kept: each position's accept and residual
        assert _pvalue(counts, exact, 3000) > 1e-3
        counts, _ = _cycle_counts(drafter, draft_logits, verify, 1500, wrong_q=True)
        assert _pvalue(counts, exact, 1500) < 1e-6


def test_sampled_generation_drafts_through_the_selector(small_vocab, monkeypatch):
    """In the loop, a sampled cycle's drafts and the q its verify step gets are select()'s (q on the k
    candidates only), and a seeded sampled run with a DFlash2 drafter repeats itself."""
    target, _ = small_vocab
    drafter = _small_dflash2(target)
    selected, verified = [], []
    select, verify = DFlash2Drafter.select, Sampler.verify

    def select_spy(self, *args):
        selected.append(select(self, *args))
        return selected[-1]

    def verify_spy(self, draft, logits, q):
        verified.append((draft, q))
        return verify(self, draft, logits, q)

    monkeypatch.setattr(DFlash2Drafter, "select", select_spy)
    monkeypatch.setattr(Sampler, "verify", verify_spy)

    def run(seed):
        return list(generate_tokens(target, PROMPT, max_new_tokens=12, drafter=drafter,
                                    sampler=Sampler(temperature=1.0, seed=seed)))

    assert run(3) == run(3)
    drafted = [(d, q) for d, q in verified if d.numel()]
    assert drafted and len(drafted) == len(selected)
    for (draft, q), (tokens, q_selected) in zip(drafted, selected, strict=True):
        assert torch.equal(draft, tokens) and q is q_selected and ((q > 0).sum(-1) <= 3).all()


# --- saving and loading ------------------------------------------------------------------------------------


def test_save_roundtrip_keeps_the_published_layout(fixture, target, vector, tmp_path):
    d = load_drafter(fixture / "draft")
    d.save(tmp_path / "d")
    names = json.loads((fixture / "expected.json").read_text())["draft_tensor_names"]
    assert sorted(load_file(str(tmp_path / "d" / "model.safetensors"))) == sorted(names)
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    want = json.loads((fixture / "draft" / "config.json").read_text())["dflash_config"]
    assert {k: config["dflash_config"][k] for k in want} == want
    e = load_drafter(tmp_path / "d")
    assert isinstance(e, DFlash2Drafter)
    for (k, a), (k2, b) in zip(d.state_dict().items(), e.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b), k
    (h1, l1), (h2, l2) = _forward(d, target, vector), _forward(e, target, vector)
    assert torch.equal(h1, h2) and torch.equal(l1, l2)


def test_loads_bfloat16_and_embedding_named_codebooks(fixture, target, vector, tmp_path):
    """Published checkpoints store bfloat16 (loaded as such, or as float32 on request); codebooks stored as
    embedding weights (`.weight`) load into the same tensors."""
    src = load_file(str(fixture / "draft" / "model.safetensors"))
    out = tmp_path / "bf16"
    out.mkdir()
    shutil.copy(fixture / "draft" / "config.json", out / "config.json")
    state = {k: v.to(torch.bfloat16) for k, v in src.items()}
    state["candidate_selector.successor_codebook.weight"] = state.pop("candidate_selector.successor_codebook")
    save_file(state, str(out / "model.safetensors"))
    d = load_drafter(out)
    assert d.dtype == torch.bfloat16 and d.candidate_selector.successor_codebook.dtype == torch.bfloat16
    f = load_drafter(out, dtype=torch.float32)
    for k, v in f.state_dict().items():
        assert torch.equal(v, src[k].to(torch.bfloat16).float()), k
    with torch.no_grad():
        cache = d.new_cache(32)
        logits = d.propose(target, vector["noise_ids"], vector["target_hidden"], cache)
        tokens, _ = d.select(logits[0], 7, Sampler())
    assert logits.shape == (1, 7, 512) and torch.isfinite(logits).all() and tokens.shape == (7,)


def test_incomplete_configs_are_refused(fixture, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(fixture / "draft", bare)
    config = json.loads((bare / "config.json").read_text())
    config["dflash_config"].pop("selector_top_k")
    (bare / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="selector_top_k"):
        load_drafter(bare)


def test_published_dflash2_drafter_is_registered():
    """z-lab/Qwen3.8-27B-DFlash2 for Qwen3.8-27B (as dflash-mlx's registry and SGLang's DFlash2 test pair
    them), found under the target's usual spellings."""
    from dflash_torch import registry

    for name in ("Qwen/Qwen3.8-27B", "mlx-community/Qwen3.8-27B-4bit", "qwen3.8-27b-q4_k_m.gguf"):
        assert registry.drafter_for(name) == "z-lab/Qwen3.8-27B-DFlash2", name
