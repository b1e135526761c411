"""`dflash bench --suite longctx` and `--replay`: the prompts (deterministic, of the sizes asked), the row
fields they add, and a replay through the server on a tiny chat model (invariants only, no timings)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dflash_torch import bench_longctx, bench_replay
from dflash_torch.bench_longctx import TOLERANCE, quarter_acceptance, quarter_means

from .server_support import make_chat_model
from .test_bench import run_cli


@pytest.fixture(autouse=True)
def one_thread():
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_quarter_acceptance_by_tokens():
    # 20 tokens committed; passes start at tokens 0, 1, 2, 3, 4, 8, 12, 16
    first, last = quarter_acceptance([1, 1, 1, 1, 4, 4, 4, 4])
    assert first == [1, 1, 1, 1, 4]  # starts before token 5 (a quarter of 20)
    assert last == [4]  # starts at or after token 15
    assert quarter_acceptance([]) == ([], [])
    assert quarter_acceptance([3]) == ([3], [])  # one pass starts at 0: the first quarter only
    stats = [SimpleNamespace(acceptance_lengths=[1, 1, 1, 1, 4, 4, 4, 4]), SimpleNamespace(acceptance_lengths=[2, 2])]
    # pooled over generations: (1+1+1+1+4 + 2) / 6 first; last: only the 4 (the second [2] starts at token 2 of 4)
    assert quarter_means(stats) == (round(10 / 6, 4), 4.0)
    assert quarter_means([]) == (None, None)


def test_sharegpt_records_skip_the_broken_tail(tmp_path):
    path = tmp_path / "cut.json"
    path.write_text('[\n {"id": "a_0", "conversations": []},\n {"id": "b_0", "conversations": [{"from": "hu')
    assert [r["id"] for r in bench_longctx.iter_records(path, chunk=7)] == ["a_0"]
    path.write_text('[{"id": "a"}, {"id": "b"}]')
    assert [r["id"] for r in bench_longctx.iter_records(path, chunk=3)] == ["a", "b"]


@pytest.fixture(scope="module")
def default_tokenizer_pipe():
    """The default model's tokenizer in a Pipeline without weights (encode_messages needs only the tokenizer)."""
    from dflash_torch import loading
    from dflash_torch.generate import Pipeline

    path = loading.resolve_model(None)
    return Pipeline(target=None, tokenizer=loading.load_tokenizer(path), stop_token_ids=[], model_path=path,
                    name=loading.DEFAULT_MODEL_NAME)


def test_longctx_prompts_default_tokenizer(default_tokenizer_pipe):
    """Per size a ShareGPT conversation, a source file and HumanEval, within [size - TOLERANCE, size]
    tokens of the default model's tokenizer, the same every time, each ending in its instruction."""
    pipe = default_tokenizer_pipe
    suites = bench_longctx.longctx_suites(pipe)
    assert list(suites) == ["longctx-2k", "longctx-4k", "longctx-7k"]
    for prompts, size in zip(suites.values(), bench_longctx.SIZES.values()):
        assert [p.id.split(":")[0] for p in prompts] == ["sharegpt", "source", "humaneval"]
        for p in prompts:
            assert size - TOLERANCE <= len(p.ids) <= size, (p.id, len(p.ids))
        tails = [pipe.decode(p.ids[-40:]) for p in prompts]
        assert bench_longctx.SUMMARIZE in tails[0] and bench_longctx.EXPLAIN in tails[1]
        assert "generate_integers(10, 14)" in tails[2]  # the problem to complete comes last
    assert len({p.id.split("@")[0] for ps in suites.values() for p in ps if p.id.startswith("sharegpt")}) == 3
    again = bench_longctx.longctx_suites(pipe, limit=2)
    assert {k: [p.ids for p in v] for k, v in again.items()} == {k: [p.ids for p in v[:2]] for k, v in suites.items()}


def test_replay_default_conversations():
    convs = bench_replay.conversations_for("sharegpt", 2)
    assert len(convs) == 2 and convs == bench_replay.conversations_for("sharegpt", 2)
    for c in convs:
        assert len(c["messages"]) == 8 and all(m["role"] == "user" and m["content"] for m in c["messages"])


@pytest.fixture(scope="module")
def long_chat_model(tmp_path_factory):
    """A tiny character-level chat model whose context holds the 7k prompt plus 8 tokens."""
    return make_chat_model(tmp_path_factory.mktemp("longchat"), max_position_embeddings=7168 + 8)


def test_bench_longctx_cli(long_chat_model, capsys):
    target, _draft = long_chat_model
    rc, data, err = run_cli(capsys, [
        "bench", "--model", str(target), "--no-draft", "--lookup", "--suite", "longctx", "--limit", "1",
        "--max-tokens", "4,16", "--repeats", "1", "--ignore-eos", "--json",
    ])
    assert rc == 0, err
    assert data["settings"]["suites"] == ["longctx-2k", "longctx-4k", "longctx-7k"]
    cells = [(r["suite"], r["max_tokens"]) for r in data["runs"]]
    # 7168 prompt tokens + 16 exceed the 7176-token context: that cell is skipped, with the reason logged
    assert cells == [("longctx-2k", 4), ("longctx-2k", 16), ("longctx-4k", 4), ("longctx-4k", 16), ("longctx-7k", 4)]
    assert "skipping longctx-7k/" in err and "exceeds the model's context" in err
    for r in data["runs"]:
        size = {"longctx-2k": 2048, "longctx-4k": 4096, "longctx-7k": 7168}[r["suite"]]
        assert size - TOLERANCE <= r["prompt_tokens_mean"] <= size
        assert r["ttft_s"] > 0 and r["prefill_tok_s"] > 0 and r["baseline_prefill_tok_s"] > 0
        # one prompt, one repeat: prefill tok/s is its prompt over its TTFT (both rounded in the JSON)
        assert r["prefill_tok_s"] == pytest.approx(r["prompt_tokens_mean"] / r["ttft_s"], rel=0.01)
        first, last = r["acceptance_length_first_quarter"], r["acceptance_length_last_quarter"]
        assert first is not None and 1 <= first <= r["max_tokens"]
        assert last is None or 1 <= last <= r["max_tokens"]
        assert r["llamacpp_ttft_s"] is None and r["llamacpp_prefill_tok_s"] is None
        assert r["outputs_match"] is True


def test_replay_through_the_server(tmp_path, capsys):
    target, draft = make_chat_model(tmp_path / "m")
    convs = [{"id": "a", "messages": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Hello there"},
                                      {"role": "assistant", "content": "ignored: the model's reply goes here"},
                                      {"role": "user", "content": "Tell me more"},
                                      {"role": "user", "content": "And then?"}]},
             {"id": "b", "messages": [{"role": "user", "content": "One"}, {"role": "user", "content": "Two"}]}]
    path = tmp_path / "convs.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in convs))
    out = tmp_path / "out"
    rc, data, err = run_cli(capsys, ["bench", "--model", str(target), "--draft", str(draft), "--replay", str(path),
                                     "--max-tokens", "6", "--out", str(out), "--json"])
    assert rc == 0, err
    assert data["schema"] == bench_replay.REPLAY_SCHEMA and json.loads((out / "replay.json").read_text()) == data
    assert "| Conversation |" in (out / "replay.md").read_text()
    assert [c["id"] for c in data["conversations"]] == ["a", "b"]
    for c, turns in zip(data["conversations"], (3, 2)):
        assert [t["turn"] for t in c["turns"]] == list(range(1, turns + 1)) and c["stopped"] is None
        prompts = [t["prompt_tokens"] for t in c["turns"]]
        assert prompts == sorted(set(prompts))  # the context grows turn by turn
        for t in c["turns"]:
            assert t["ttft_s"] > 0 and t["target_only_ttft_s"] > 0 and 1 <= t["completion_tokens"] <= 6
            # the same request's first token from the server without a prefix cache, timed alike
            # (the ratio r of the unrounded times, to 4 places; the times are rounded to 10 us: off by at most
            # half of each, which moves r by (0.5e-5 + r 0.5e-5) / cold)
            hot, cold = t["ttft_s"], t["cold_ttft_s"]
            assert cold > 0 and abs(t["ttft_over_cold"] - hot / cold) <= 0.5e-4 + (1 + hot / cold) * 0.5e-5 / cold
            assert t["output_matches_target_only"] is True  # greedy
        # later turns start with the earlier ones: the prefix cache holds most of their prompt
        assert all(0 < t["cached_tokens"] < t["prompt_tokens"] for t in c["turns"][1:])


def test_replay_errors(tmp_path, capsys):
    rc, _, err = run_cli(capsys, ["bench", "--replay", str(tmp_path / "missing.jsonl")])
    assert rc == 2 and "replay file not found" in err
    (tmp_path / "bad.jsonl").write_text('{"id": "x", "messages": [{"role": "assistant", "content": "hi"}]}\n')
    rc, _, err = run_cli(capsys, ["bench", "--replay", str(tmp_path / "bad.jsonl")])
    assert rc == 2 and "bad.jsonl:1: the conversation has no user message" in err


def test_replay_server_that_cannot_start_is_a_clear_error(tmp_path):
    """A `dflash serve` that exits before it is ready: ModelError (printed by the CLI) with its last words."""
    from dflash_torch.loading import ModelError

    with pytest.raises(ModelError, match="before it was ready"):
        with bench_replay.server_process(["--model", str(tmp_path / "no-such-model")], lambda msg: None):
            pass
