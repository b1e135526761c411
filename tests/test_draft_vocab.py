"""A draft vocabulary (draft_vocab.json): proposals from some rows of the LM head, output unchanged."""

from __future__ import annotations

import json
import random

import pytest
import torch

from dflash_torch import loading
from dflash_torch.decoding.drafter import VOCAB_FILE, load_drafter
from dflash_torch.decoding.speculative import Stats, generate_tokens
from dflash_torch.models import quantize
from dflash_torch.models.layers import SKINNY_ROWS, set_skinny_rows

from .conftest import assert_within_steps, make_drafter
from .test_lossless import clear_margins
from .test_train import run_train, tiny_data  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def llama_pair(tiny_models, tmp_path_factory):
    path = tiny_models["llama"]
    target = loading.load_target(path, torch.device("cpu"), torch.float32)
    drafter = load_drafter(make_drafter(path, tmp_path_factory.mktemp("vocab") / "d", block_size=16))
    return target, drafter


def _run(target, prompt, n, drafter=None, bs=None):
    stats = Stats()
    return list(generate_tokens(target, prompt, max_new_tokens=n, drafter=drafter, block_size=bs, stats=stats)), stats


@pytest.mark.fastpath
def test_restricted_logits_are_the_head_rows(llama_pair):
    """Float, int8 and int4 heads: the draft vocabulary's logits are the full head's on those rows
    (int8 exactly; int4 re-packs its dequantized rows), -inf elsewhere."""
    target, drafter = llama_pair
    ids = sorted(random.Random(1).sample(range(256), 96))
    drafter.set_draft_vocab(ids)
    out = torch.tensor(sorted(set(range(256)) - set(ids)))
    hidden = torch.randn(1, 5, 64)
    try:
        heads = [("float", target.lm_head), ("int8", quantize.Int8Linear(target.lm_head)),
                 ("int4", quantize.Int4Linear(target.lm_head))]
        for name, head in heads:
            full, sub = head(hidden), drafter.logits(hidden, head)
            assert sub.shape == full.shape, name
            assert type(drafter.draft_head(head)) is type(head), name
            assert drafter.draft_head(head).out_features == len(ids), name
            if name != "int4":  # the same weights, the same kernel: bit for bit
                assert torch.equal(sub[..., ids], full[..., ids]), name
            else:
                # `_weight_int4pack_mm_for_cpu` on both sides, the rows re-packed: each weight is re-rounded to
                # an int4 grid whose scale and zero point are bfloat16 (within 2 bf16 steps of its group's
                # largest weight), and the output is rounded to bfloat16 once (1 step): 3 steps of |h| @ G^T,
                # G being each weight's group maximum
                w = head.weight.float()[ids]  # [96, 64]
                g = w.abs().reshape(len(ids), -1, head.group_size).amax(-1).repeat_interleave(head.group_size, -1)
                scale = hidden.bfloat16().float().abs() @ g.T
                assert_within_steps(sub[..., ids], full[..., ids], scale, 3)
            assert torch.isneginf(sub[..., out]).all(), name
            assert drafter.logits(hidden, head, full=False).shape == (1, 5, len(ids)), name
        set_skinny_rows(drafter, 0)  # the sub-head follows the drafter's float32 matmul setting
        assert drafter.draft_head(target.lm_head).skinny == 0
        set_skinny_rows(drafter, SKINNY_ROWS)
        assert drafter.draft_head(target.lm_head).skinny == SKINNY_ROWS
    finally:
        drafter.set_draft_vocab(None)


def test_speculative_with_a_draft_vocab_equals_target_only(llama_pair):
    """Vocabularies that hold all, some or almost none of the target's tokens: the same output as
    target-only decoding, and the drafter only ever proposes tokens of its vocabulary."""
    target, drafter = llama_pair
    rng = random.Random(0)
    proposed = []
    propose = drafter.propose

    def spy(*args, **kwargs):
        logits = propose(*args, **kwargs)
        best = logits.argmax(-1).flatten()
        if not kwargs.get("full", True):  # the greedy shortcut's logits: one column per vocabulary id
            best = drafter.draft_vocab[best]
        proposed.extend(best.tolist())
        return logits

    drafter.propose = spy
    try:
        checked = 0
        for size in (256, 128, 8):
            ids = sorted(rng.sample(range(256), size))
            drafter.set_draft_vocab(ids)
            for _ in range(6):
                for _ in range(30):  # a prompt whose target-only run has no near-tie (it may round either way)
                    prompt = [rng.randrange(255) for _ in range(rng.randint(2, 12))]
                    ref, _ = _run(target, prompt, 24)
                    if clear_margins(target, prompt, ref):
                        break
                else:
                    pytest.fail("30 prompts in a row with a near-tie")
                for bs in (2, 5, 16):
                    proposed.clear()
                    got, stats = _run(target, prompt, 24, drafter, bs)
                    assert got == ref, (size, bs)
                    assert proposed and set(proposed) <= set(ids), (size, bs)
                    checked += 1
        assert checked == 54  # every case: 3 vocabularies x 6 prompts x 3 block sizes
    finally:
        drafter.propose = propose
        drafter.set_draft_vocab(None)


def test_a_vocabulary_with_the_truth_keeps_full_acceptance(llama_pair):
    """A drafter that knows the target's next tokens (one-hot hidden states through an identity head)
    keeps every block whole when its vocabulary holds the reply's tokens, and no draft when it does not."""
    target, drafter = llama_pair
    prompt = [3, 14, 15, 92, 65]
    ref, _ = _run(target, prompt, 30)
    truth = prompt + ref
    eye = torch.nn.Linear(256, 256, bias=False)
    eye.weight.data = torch.eye(256)

    def truth_propose(target_, block, ctx, cache, full=True):
        start = cache.length + ctx.shape[1]
        cache.length = start
        hidden = torch.zeros(1, block.shape[1] - 1, 256)  # [1, bs - 1, V]: the true next tokens, one-hot
        for j in range(block.shape[1] - 1):
            hidden[0, j, truth[start + 1 + j] if start + 1 + j < len(truth) else 0] = 1.0
        return drafter.logits(hidden, eye, full=full)

    propose = drafter.propose
    drafter.propose = truth_propose
    try:
        for ids, cycles in ((sorted(set(ref)), -(-(len(ref) - 1) // 8)), (sorted(set(range(256)) - set(ref)),
                                                                          len(ref) - 1)):
            drafter.set_draft_vocab(ids)
            got, stats = _run(target, prompt, 30, drafter, 8)
            assert got == ref
            assert len(stats.acceptance_lengths) == cycles
    finally:
        drafter.propose = propose
        drafter.set_draft_vocab(None)


def test_draft_vocab_file_roundtrip_and_errors(zlab, tmp_path):
    d = load_drafter(zlab / "draft")
    assert d.draft_vocab is None
    d.set_draft_vocab([9, 3, 7])
    d.save(tmp_path / "d")
    assert json.loads((tmp_path / "d" / VOCAB_FILE).read_text()) == {"token_ids": [3, 7, 9]}
    e = load_drafter(tmp_path / "d")
    assert e.draft_vocab.tolist() == [3, 7, 9]
    # saved again without one: the old file does not stay behind to restrict the new drafter
    e.set_draft_vocab(None)
    e.save(tmp_path / "d")
    assert not (tmp_path / "d" / VOCAB_FILE).exists() and load_drafter(tmp_path / "d").draft_vocab is None
    for bad in ('{"token_ids": [1, 1]}', '{"ids": [1]}', '{"token_ids": ["a"]}', "[1, 2", '{"token_ids": []}'):
        (tmp_path / "d" / VOCAB_FILE).write_text(bad)
        with pytest.raises(ValueError, match="draft_vocab.json"):
            load_drafter(tmp_path / "d")
    vocab = d.config["vocab_size"]
    (tmp_path / "d" / VOCAB_FILE).write_text(json.dumps({"token_ids": [1, vocab]}))
    f = load_drafter(tmp_path / "d")
    with pytest.raises(ValueError, match="outside the target vocab"):
        f.check_target({"hidden_size": f.config["hidden_size"]}, 10_000, vocab)


def test_draft_labels():
    from dflash_torch.decoding.drafter import DFlashDrafter

    d = DFlashDrafter.__new__(DFlashDrafter)
    torch.nn.Module.__init__(d)
    d.draft_vocab, d._head = torch.tensor([2, 5, 9]), None
    labels = torch.tensor([[5, 2, -100, 3, 9, 400]])
    assert d.draft_labels(labels).tolist() == [[1, 0, -100, -100, 2, -100]]


def test_train_with_a_draft_vocab(tiny_data, tmp_path):  # noqa: F811 (the fixture)
    """`--draft-vocab N`: the N most frequent training-reply tokens, trained on, exported, kept on resume
    and by --init-from, and lossless once loaded."""
    from dflash_torch import data, train

    target_dir, out = tiny_data
    common = ["--data", str(out), "--layers", "1", "--block-size", "8", "--seqs", "2", "--anchors", "4",
              "--eval-every", "2", "--eval-blocks", "8", "--no-bf16"]
    last = run_train([*common, "--out", str(tmp_path / "run"), "--steps", "2", "--stop-after", "1",
                      "--draft-vocab", "40"])
    assert last["step"] == 1
    run_train([*common, "--out", str(tmp_path / "run"), "--steps", "2", "--resume",
               "--export", str(tmp_path / "d1")])
    records, _, _ = data.load_shards(out)
    train_recs = train.split_records(records)[0]
    want = train.top_tokens(train_recs, 40)
    assert len(want) == 40 and set(want) <= {t for r in train_recs for t in r["response_ids"]}
    d1 = load_drafter(tmp_path / "d1")
    assert d1.draft_vocab.tolist() == want
    with pytest.raises(ValueError, match="positive number"):
        run_train([*common, "--out", str(tmp_path / "bad"), "--draft-vocab", "0"])
    run_train([*common, "--out", str(tmp_path / "run2"), "--steps", "0", "--init-from", str(tmp_path / "d1"),
               "--export", str(tmp_path / "d2")])
    assert load_drafter(tmp_path / "d2").draft_vocab.tolist() == want
    target = loading.load_target(target_dir, torch.device("cpu"), torch.float32)
    for prompt in ([5, 17, 42, 99], [7, 8, 9, 10, 11, 12, 13]):
        assert _run(target, prompt, 20, d1)[0] == _run(target, prompt, 20)[0]


def test_top_tokens_order():
    from dflash_torch.train import top_tokens

    recs = [{"response_ids": [4, 4, 4, 7, 7, 1, 9, 9]}, {"response_ids": [7, 2]}]
    assert top_tokens(recs, 2) == [4, 7]
    assert top_tokens(recs, 3) == [4, 7, 9]  # 9 (2) before 1 and 2 (1 each)
    assert top_tokens(recs, 10) == [1, 2, 4, 7, 9]  # never a token the replies lack


def test_cli_switch_and_generate_output(zlab, tmp_path, capsys):
    """`--no-draft-vocab` loads the drafter without its vocabulary (the bench records which); generate's
    tokens are the expected greedy ones either way."""
    import shutil

    from dflash_torch.bench import machine_info
    from dflash_torch.cli import main
    from dflash_torch.generate import load

    draft = tmp_path / "draft"
    shutil.copytree(zlab / "draft", draft)
    vocab_size = load_drafter(draft).config["vocab_size"]
    (draft / VOCAB_FILE).write_text(json.dumps({"token_ids": list(range(0, vocab_size, 2))}))
    for on in (True, False):
        pipe = load(str(zlab / "target"), draft=str(draft), quiet=True, draft_vocab=on)
        assert (pipe.drafter.draft_vocab is not None) == on
        assert machine_info(pipe)["draft_vocab"] == (vocab_size // 2 if on else None)
    case = json.loads((zlab / "expected.json").read_text())["generate"][0]
    for flag in ("--draft-vocab", "--no-draft-vocab"):
        args = ["generate", "--model", str(zlab / "target"), "--draft", str(draft), "--prompt-ids",
                ",".join(map(str, case["prompt"])), "--max-tokens", "32", "--json", flag, "--no-lookup"]
        assert main(args) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert out["token_ids"] == case["greedy_output"][:32], flag


@pytest.mark.fastpath
def test_greedy_draft_over_the_vocab_rows_is_the_full_rows_argmax(llama_pair):
    """DrafterProposer's greedy shortcut (argmax over the draft vocabulary's own logits, mapped to its
    ids) drafts the tokens of the general path (argmax of the full row, -inf outside the vocabulary),
    ties included: logits rounded coarsely so that rows hold equal maxima."""
    from dflash_torch import kernels
    from dflash_torch.decoding.sampling import Sampler

    target, drafter = llama_pair
    ids = sorted(random.Random(3).sample(range(256), 80))
    drafter.set_draft_vocab(ids)
    try:
        vocab = drafter.draft_vocab
        for seed in range(20):
            hidden = torch.randn(1, 15, 64, generator=torch.Generator().manual_seed(seed))
            full = (drafter.logits(hidden, target.lm_head) * 2).round()  # [1, 15, 256], ties likely
            small = (drafter.logits(hidden, target.lm_head, full=False) * 2).round()
            general, _ = Sampler().draft(full[0])
            assert torch.equal(vocab[kernels.argmax(small[0])], general)
    finally:
        drafter.set_draft_vocab(None)
