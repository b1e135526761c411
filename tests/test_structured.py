"""Structured output: the grammar's masks per verify row, and speculative == target-only under them."""

from __future__ import annotations

import json
import re

import pytest
import torch

from dflash_torch.decoding.sampling import Sampler
from dflash_torch.decoding.speculative import Stats, generate_tokens
from dflash_torch.generate import generate, load

from .server_support import ScriptedDrafter, make_chat_model

GRAMMARS = [
    ("regex", "(ab|cd)+x"),
    ("regex", "[a-f]{3,12}"),
    ("choice", ["apple", "banana", "cherry pie"]),
    # no free whitespace (llguidance's x-guidance option), so a random tiny model cannot pad the object forever:
    # every generation under it ends, and its JSON is checked against the schema
    ("json_schema", {"type": "object", "properties": {"a": {"enum": ["x", "yz"]}, "b": {"type": "boolean"}},
                     "required": ["a", "b"], "additionalProperties": False,
                     "x-guidance": {"whitespace_flexible": False}}),
    ("json_object", None),
]
ENDS = {"regex": True, "choice": True, "json_schema": True, "json_object": False}  # whether every run stops here


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    torch.set_num_threads(1)
    target, draft = make_chat_model(tmp_path_factory.mktemp("structured"))
    return load(str(target), str(draft), device="cpu", dtype="float32")


def _ids(pipe, prompt="Write something"):
    return pipe.encode(prompt)


def _follows(pipe, kind, spec, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    if kind == "choice":
        return text in spec
    value = json.loads(text)
    if kind == "json_object":
        return isinstance(value, dict)
    return set(value) == {"a", "b"} and value["a"] in ("x", "yz") and isinstance(value["b"], bool)


def _json_object_prefix(text: str) -> bool:
    """Whether `text` is the beginning of some JSON object (checked by completing it, with json.loads)."""
    stack, in_str, esc = [], False, False
    for ch in text:
        if in_str:
            esc, in_str = (False, True) if esc else (ch == "\\", ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            stack.append(ch)
        elif ch in "}]":
            if not stack:
                return False
            stack.pop()
    head = text + ("n" if esc else "") + ('"' if in_str else "")
    closers = "".join("}" if c == "{" else "]" for c in reversed(stack))
    fills = ("", "0", ":0", '"k":0', "ue", "e", "rue", "alse", "lse", "se", "ull", "ll", "l", '0:0', ':""')
    for fill in fills:
        try:
            value = json.loads(head + fill + closers)
        except json.JSONDecodeError:
            continue
        return isinstance(value, dict) and text.lstrip().startswith("{")
    return False


def test_json_object_prefix_check():
    for text in ('{"a', '{"a"', '{"a": ', '{"a": [1, tr', '{"a": {"b": "c\\', '{"a":1,', '{', '{"a":"}"'):
        assert _json_object_prefix(text), text
    for text in ('{"a"}', '[1', '{"a": tx', '{"a":1}}', '"a"', '{"a" 1'):
        assert not _json_object_prefix(text), text


def _check_output(pipe, kind, spec, r) -> bool:
    """Assert that generation `r` follows the grammar (a run cut at max tokens: that it is the beginning of
    an output that does); return whether it stopped."""
    if r.finish_reason == "stop":
        assert _follows(pipe, kind, spec, r.text), (kind, r.text)
        return True
    assert not ENDS[kind], (kind, r.text)
    assert _json_object_prefix(r.text), r.text  # json_object: keys and strings can run on
    return False


@pytest.mark.parametrize("kind,spec", GRAMMARS, ids=lambda g: g if isinstance(g, str) else None)
def test_speculative_equals_target_only_under_a_grammar(pipe, kind, spec):
    """The drafter, prompt lookup, and a drafter that proposes target-only's constrained output itself
    (every block kept whole): all give target-only's output, which follows the grammar."""
    for prompt in ("Write something", "Hello there, tell me", "x"):
        ids = _ids(pipe, prompt)
        want = generate(pipe, ids, 60, use_draft=False, grammar=(kind, spec))
        _check_output(pipe, kind, spec, want)
        truth = ids + want.token_ids
        oracle = ScriptedDrafter(pipe.drafter, truth)
        for drafter, bs, lookup in ((pipe.drafter, 4, False), (pipe.drafter, 8, True), (oracle, 8, False)):
            stats = Stats()
            got = list(generate_tokens(pipe.target, ids, max_new_tokens=60, drafter=drafter, block_size=bs,
                                       lookup=lookup, stop_token_ids=pipe.stop_token_ids, stats=stats,
                                       constraint=pipe.constraint(kind, spec)))
            assert got == want.token_ids, (kind, prompt, drafter)
            if drafter is oracle:  # every draft kept whole but the last block, which runs past the output
                assert stats.drafted_tokens - stats.accepted_tokens <= bs - 1, stats.acceptance_lengths


def test_sampled_output_follows_the_grammar(pipe):
    stopped = 0
    for seed in range(6):
        for kind, spec in GRAMMARS:
            r = generate(pipe, _ids(pipe), 60, grammar=(kind, spec), sampler=Sampler(1.0, seed=seed))
            stopped += _check_output(pipe, kind, spec, r)
    assert stopped >= 18  # the regex, choice and schema runs (6 x 3 of the 30) end within 60 tokens


def test_masks_per_row_match_one_token_at_a_time(pipe):
    """mask(drafts) row i = the mask after consuming drafts[:i] on a fresh matcher; rows past a refused
    draft allow everything; the matcher is left as it was."""
    kind, spec = "regex", "(ab|cd)+x"
    tok = pipe.tokenizer.convert_tokens_to_ids
    c = pipe.constraint(kind, spec)
    before = c.mask([], 1)[0]
    drafts = [tok("a"), tok("b"), tok("c"), tok("q"), tok("d")]  # "q" is refused at row 3
    rows = c.mask(drafts, 6)
    for i in range(4):
        ref = pipe.constraint(kind, spec)
        ref.commit(drafts[:i])
        assert torch.equal(rows[i], ref.mask([], 1)[0]), i
    assert rows[4:].all() and not rows[3][tok("q")] and rows[2][tok("c")]
    assert torch.equal(c.mask([], 1)[0], before)  # rolled back
    assert before[tok("a")] and before[tok("c")] and not before[tok("b")]
    stop = pipe.stop_token_ids[0]
    c.commit([tok("a"), tok("b"), tok("x")])  # complete: only a stop token is allowed, and taking it is fine
    assert c.mask([], 1)[0].nonzero()[:, 0].tolist() == [stop]
    c.commit([stop])


def test_bad_grammars_are_value_errors(pipe):
    for kind, spec in (("regex", "(a"), ("lark", "start: nope"), ("json_schema", {"type": "nope"}),
                       ("choice", []), ("json_schema", "x"), ("yaml", "a")):
        with pytest.raises(ValueError):
            pipe.constraint(kind, spec)


def test_generate_command(pipe, capsys):
    from dflash_torch import cli

    base = ["generate", "--model", str(pipe.model_path), "--draft", str(pipe.draft_path), "--device", "cpu",
            "--prompt", "Hello", "--max-tokens", "30", "--json"]
    ids = pipe.encode("Hello")
    for flags, grammar in ((["--regex", "(ab|cd)+x"], ("regex", "(ab|cd)+x")),
                           (["--json-schema", json.dumps(GRAMMARS[3][1])], GRAMMARS[3]),
                           (["--json-object"], ("json_object", None)),
                           (["--lark", 'start: "yes" | "no"'], ("lark", 'start: "yes" | "no"'))):
        assert cli.main(base + flags) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert out["token_ids"] == generate(pipe, ids, 30, use_draft=False, grammar=grammar).token_ids, flags
    for flags in (["--regex", "("], ["--json-schema", "{"], ["--json-schema", "@/nonexistent/x.json"]):
        assert cli.main(base + flags) == 2
        assert "dflash: error:" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one grammar at a time (argparse)
        cli.main(base + ["--regex", "a", "--json-object"])


def test_drafts_are_chosen_under_the_grammar(pipe):
    """constraint.draft: every proposed token up to a stop token is one the grammar allows in sequence
    (so it can be kept), the matcher is left as it was, and sampled drafts come with their q rows."""
    torch.manual_seed(0)
    for kind, spec in GRAMMARS:
        c = pipe.constraint(kind, spec)
        c.commit(pipe.encode("", chat=False))
        before = c.mask([], 1)
        for sampler in (Sampler(), Sampler(1.0, seed=3)):
            logits = torch.randn(7, pipe.target.config.vocab_size) * 5
            tokens, q = c.draft(logits, sampler)
            run = tokens.tolist()
            run = run[: next((i for i, t in enumerate(run) if t in pipe.stop_token_ids), len(run))]
            assert c.matcher.validate_tokens(run) == len(run), (kind, run)
            assert (q is None) == sampler.greedy and (q is None or q.shape == logits.shape)
            if q is not None:  # each draft was drawn from its q, which gives refused tokens nothing
                assert (q.gather(1, tokens[:, None]) > 0).all()
            assert torch.equal(c.mask([], 1), before)


def test_a_draft_vocabulary_the_grammar_never_allows(pipe):
    """The drafter can propose none of the tokens the grammar allows (its draft vocabulary lacks them):
    greedy and sampled generation still follow the grammar, greedy still equals target-only."""
    tok = pipe.tokenizer.convert_tokens_to_ids
    pipe.drafter.set_draft_vocab([tok("q"), tok("z")])
    try:
        ids = _ids(pipe)
        want = generate(pipe, ids, 30, use_draft=False, grammar=("regex", "(ab|cd)+x"))
        assert generate(pipe, ids, 30, grammar=("regex", "(ab|cd)+x"), lookup=False).token_ids == want.token_ids
        for seed in range(3):
            r = generate(pipe, ids, 30, grammar=("regex", "(ab|cd)+x"), lookup=False, sampler=Sampler(1.0, seed=seed))
            _check_output(pipe, "regex", "(ab|cd)+x", r)
    finally:
        pipe.drafter.set_draft_vocab(None)


def test_allowed_prefix(pipe):
    tok = pipe.tokenizer.convert_tokens_to_ids
    c = pipe.constraint("regex", "(ab|cd)+x")
    assert c.allowed_prefix([tok("a"), tok("b"), tok("c"), tok("q"), tok("d")]) == 3
    assert c.allowed_prefix([tok("a"), pipe.stop_token_ids[0], tok("b")]) == 1 and c.allowed_prefix([]) == 0
    assert torch.equal(c.mask([], 1)[0], pipe.constraint("regex", "(ab|cd)+x").mask([], 1)[0])  # state untouched
