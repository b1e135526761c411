"""`dflash serve`'s worker: the queue, cancellation, live metrics, the fallback to target-only decoding,
the prefix cache, the command line, chat template arguments, the hand-over of events to the client."""

from __future__ import annotations

import argparse
import dataclasses
import json
import threading
import time

import httpx
import pytest

from dflash_torch import cli
from dflash_torch.decoding.fallback import FallbackController
from dflash_torch.decoding.speculative import generate_tokens
from dflash_torch.generate import generate, load
from dflash_torch.serve.server import parse_bytes

from . import server_support
from .server_support import MSGS, ScriptedDrafter, client, metrics_json, serve, solo

# the shared module-scoped fixtures (one_thread: autouse); this module gets its own instances
one_thread, chat_model, pipe = server_support.one_thread, server_support.chat_model, server_support.pipe


def test_queue_full_429_and_disconnect_frees_the_worker(pipe):
    # A drafter that is always wrong and slow, without the fallback: 400 tokens would take ~20 s.
    slow = dataclasses.replace(pipe, drafter=ScriptedDrafter(pipe.drafter, delay=0.05))
    with serve(slow, max_queue=1, fallback=False) as base:
        body = {"prompt": "Once upon a time", "max_tokens": 400, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body) as long:
            lines = long.iter_lines()
            assert next(lines).startswith("data: ")
            assert metrics_json(base)["queue"]["running"] == 1
            short: dict = {}
            waiter = threading.Thread(target=lambda: short.update(r=client(base).completions.create(
                model="t", prompt="Hello", max_tokens=3)))
            waiter.start()
            deadline = time.time() + 10
            while metrics_json(base)["queue"]["waiting"] != 1:
                assert time.time() < deadline
                time.sleep(0.01)
            r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "queue_full"
            t0 = time.time()
        waiter.join(10)  # leaving the `with` closed the stream: the worker drops it within a cycle
        assert time.time() - t0 < 3
        assert short["r"].choices[0].text == solo(pipe, pipe.encode("Hello", chat=False), 3)
        cancelled = metrics_json(base)["recent"][-2]
        assert cancelled["status"] == 499 and cancelled["completion_tokens"] < 100
        # a non-streamed request whose client gives up is dropped as fast
        with pytest.raises(httpx.TimeoutException):
            httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 400}, timeout=0.5)
        t0 = time.time()
        while metrics_json(base)["queue"]["running"]:
            assert time.time() - t0 < 3
            time.sleep(0.01)
        assert metrics_json(base)["recent"][-1]["status"] == 499


def test_live_metrics_while_a_long_request_runs(pipe):
    ids = pipe.encode("Once upon a time", chat=False)
    want = generate(pipe, ids, 300, use_draft=False)
    oracle = ScriptedDrafter(pipe.drafter, script=ids + want.token_ids, delay=0.02)
    with serve(dataclasses.replace(pipe, drafter=oracle), fallback=False) as base:
        done: dict = {}
        t = threading.Thread(target=lambda: done.update(r=client(base).completions.create(
            model="t", prompt="Once upon a time", max_tokens=300)))
        t.start()
        seen = None
        while t.is_alive() and seen is None:
            text = httpx.get(base + "/metrics").text
            values = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and ln[0] != "#"}
            if values["dflash_requests_running"] == 1 and values["dflash_live_tokens_per_second"] > 0:
                seen = values
                current = metrics_json(base)["current"]
            time.sleep(0.01)
        t.join(60)
        assert seen is not None, "never saw the request in flight"
        assert seen["dflash_live_acceptance_rate"] > 0.5 and seen["dflash_live_acceptance_length_mean"] > 2
        assert current is None or current["acceptance_rate"] > 0.5
        assert done["r"].choices[0].text == want.text
        final = httpx.get(base + "/metrics").text
        for name in ("dflash_spec_decode_num_drafts_total", "dflash_spec_decode_num_draft_tokens_total",
                     "dflash_spec_decode_num_accepted_tokens_total",
                     'dflash_spec_decode_num_accepted_tokens_per_pos_total{position="0"}',
                     "dflash_time_to_first_token_seconds_count", "dflash_decode_tokens_per_second_count"):
            assert any(ln.startswith(name + " ") and float(ln.split()[-1]) > 0 for ln in final.splitlines()), name
        widths = {ln.split('"')[1]: float(ln.split()[-1]) for ln in final.splitlines()
                  if ln.startswith("dflash_verify_passes_total{")}  # passes by width, as the loop chose them
        assert sum(v for w, v in widths.items() if int(w) > 1) > 0
        row = httpx.get(base + "/metrics.json").json()["recent"][-1]
        assert row["mode"] == "dflash+lookup" and row["acceptance_length_mean"] > 2 and row["decode_tok_s"] > 0


def test_acceptance_collapse_falls_back_to_target_only(pipe):
    ids = pipe.encode_messages(MSGS)
    want = generate(pipe, ids, 80, use_draft=False)
    assert 0 not in want.token_ids  # so a drafter proposing token 0 ([UNK]) is always wrong
    # a draft pass far slower than any plain step of this tiny model, also when other processes share the cores
    # (with 4 ms a pass, a CI run once timed its plain steps slower than the failing cycles and never fell back)
    wrong = dataclasses.replace(pipe, drafter=ScriptedDrafter(pipe.drafter, wrong=0, delay=0.1))
    with serve(wrong, lookup=False) as base:  # the drafter alone: prompt lookup would keep tokens
        r = client(base).chat.completions.create(model="t", messages=MSGS, max_tokens=80)
        assert r.choices[0].message.content == want.text
        row = metrics_json(base)["recent"][-1]
        assert row["mode"] == "dflash+fallback" and row["acceptance_rate"] == 0 and row["lookup_cycles"] == 0
        assert row["fallback_events"][0]["event"] == "fallback"
        assert 'dflash_fallback_events_total{event="fallback"}' in httpx.get(base + "/metrics").text
        # the next request starts where this one ended: target-only, probing when the probe is due
        carried = row["fallback_events"][-1]
        r = client(base).chat.completions.create(model="t", messages=MSGS, max_tokens=80)
        assert r.choices[0].message.content == want.text
        row = metrics_json(base)["recent"][-1]
        assert row["mode"] == "dflash+fallback" and row["fallback_events"][0]["event"] == "carried"
        if carried["event"] == "fallback":  # no probe since: the gap left is what the last request left
            left = carried["token"] + carried["probe_in_tokens"] - 79  # the controller sees 79 (not the prefill's)
            assert row["fallback_events"][0]["probe_in_tokens"] == left


def test_fallback_controller_policy():
    c = FallbackController(window=4, measure_steps=2, probe_after=10, probe_budget=100)  # gap: probe_after
    assert c.block_size(None) > 1
    for _ in range(5):  # the first cycle is skipped, then a window of slow speculative cycles
        c.observe(8, 1, 0.010)
    assert c.state == "measure" and c.block_size(None) == 1
    for _ in range(2):
        c.observe(1, 1, 0.002)
    assert c.state == "target" and c.events[-1]["event"] == "fallback" and c.events[-1]["probe_in_tokens"] == 10
    while c.state == "target":
        c.observe(1, 1, 0.002)
    assert c.events[-1]["event"] == "probe" and c.block_size(None) > 1
    for _ in range(5):  # the probe is fast this time (its first cycle is not timed): speculation resumes
        c.observe(8, 5, 0.004)
    assert c.state == "speculate" and c.events[-1]["event"] == "resume" and c.fallbacks == 1
    slower = FallbackController(window=4, target_s_per_token=0.002, probe_after=10, probe_budget=0.05)
    for _ in range(5):  # each timed cycle lost 8 ms against 1 token at 2 ms: 32 ms, 5% of it is 320 tokens
        slower.observe(8, 1, 0.010)
    assert slower.state == "target" and slower.events[-1]["probe_in_tokens"] == 320
    carry = slower.carry()
    assert carry == {"probe_in_tokens": 320, "probe_after": 640}
    nxt = FallbackController(carried=carry)
    assert nxt.state == "target" and nxt.block_size(None) == 1 and nxt.fallbacks == 1
    for _ in range(320):
        nxt.observe(1, 1, 0.002)
    assert nxt.state == "speculate" and nxt.events[-1] == {"event": "probe", "token": 320}
    assert FallbackController().carry() is None
    fast = FallbackController(window=4, target_s_per_token=0.002)  # a known baseline: no measuring
    for _ in range(20):
        fast.observe(8, 4, 0.004)
    assert fast.state == "speculate" and not fast.events


def test_fallback_controller_times_plain_steps_again():
    """A baseline timed once in a slow moment (or carried from an earlier request) does not keep a losing
    drafter on: after remeasure_after tokens of speculation the plain steps are timed again, and the gap
    doubles each time speculation still wins."""
    c = FallbackController(window=4, measure_steps=2, remeasure_after=40)
    for _ in range(5):  # the first cycle is skipped; 4 tokens per cycle at 4 ms: 1 ms per token
        c.observe(8, 4, 0.004)
    assert c.state == "measure"
    for _ in range(2):  # the host was busy: plain steps at 10 ms
        c.observe(1, 1, 0.010)
    assert c.state == "speculate" and not c.events
    modes = []
    while c.tokens < 200 and c.state != "target":  # plain steps take 0.5 ms now, speculation 1 ms a token
        size = c.block_size(None)
        modes.append(size > 1)
        c.observe(size, 4 if size > 1 else 1, 0.004 if size > 1 else 0.0005)
    assert c.state == "target" and c.events[-1]["event"] == "fallback" and 40 <= c.events[-1]["token"] < 80
    assert c.events[-1]["target_ms_per_token"] == 0.5
    steady = FallbackController(window=4, measure_steps=2, remeasure_after=40, target_s_per_token=0.002)
    measured_at = []
    while steady.tokens < 1000:  # speculation keeps winning: measured after ~40, 40, 80, 160, 320 more tokens
        size = steady.block_size(None)
        if size == 1 and (not measured_at or steady.tokens - measured_at[-1] > 8):
            measured_at.append(steady.tokens)
        steady.observe(size, 4 if size > 1 else 1, 0.004 if size > 1 else 0.002)
    assert steady.state == "speculate" and not steady.events and len(measured_at) == 5
    gaps = [b - a for a, b in zip(measured_at, measured_at[1:])]
    assert all(g2 > 1.5 * g1 for g1, g2 in zip(gaps, gaps[1:])), measured_at


def test_greedy_output_is_identical_in_every_mode(pipe):
    ids = pipe.encode_messages(MSGS)
    want = generate(pipe, ids, 60, use_draft=False).token_ids

    def run(controller) -> list[int]:
        return list(generate_tokens(pipe.target, ids, max_new_tokens=60, drafter=pipe.drafter,
                                    stop_token_ids=pipe.stop_token_ids, controller=controller))

    assert run(None) == want
    assert run(FallbackController(window=2, measure_steps=1, probe_after=3, margin=-1.0)) == want  # always falls back
    assert run(FallbackController(window=2, target_s_per_token=1.0)) == want  # never does


def test_serve_command_line(chat_model):
    args = cli.build_parser().parse_args(
        ["serve", "--model", "m", "--no-draft", "--host", "0.0.0.0", "--port", "9", "--fastpath-max-tokens", "8",
         "--api-key", "k", "--max-tokens", "5", "--block-size", "4", "--max-queue", "3", "--device", "cpu",
         "--dtype", "float32"])
    assert (args.model, args.no_draft, args.host, args.port, args.fastpath_max_tokens, args.api_key) == (
        "m", True, "0.0.0.0", 9, 8, "k")
    assert (args.max_tokens, args.block_size, args.max_queue, args.device, args.dtype) == (5, 4, 3, "cpu", "float32")
    defaults = cli.build_parser().parse_args(["serve"])
    assert (defaults.host, defaults.port, defaults.model, defaults.draft) == ("127.0.0.1", 8000, None, "auto")
    assert (defaults.prefix_cache_max_entries, defaults.prefix_cache_max_bytes, defaults.no_prefix_cache) == (
        4, 2 << 30, False)
    sized = cli.build_parser().parse_args(["serve", "--prefix-cache-max-bytes", "512MB", "--no-prefix-cache",
                                           "--prefix-cache-l2-dir", "/tmp/x", "--prefix-cache-l2-max-bytes", "1GB"])
    assert sized.prefix_cache_max_bytes == 512 << 20 and sized.no_prefix_cache
    assert (sized.prefix_cache_l2_dir, sized.prefix_cache_l2_max_bytes) == ("/tmp/x", 1 << 30)
    assert defaults.prefix_cache_l2_dir is None and defaults.prefill_step_size is None
    assert cli.build_parser().parse_args(["serve", "--prefill-step-size", "512"]).prefill_step_size == 512
    assert parse_bytes("1.5GiB") == 3 << 29 and parse_bytes("4096") == 4096
    for bad in ("lots", "-1GB", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bytes(bad)
    # a model that cannot be loaded stops the server with exit status 2
    assert cli.main(["serve", "--model", str(chat_model[0].parent / "missing"), "--port", "0"]) == 2


def test_conversation_turns_start_from_the_prefix_cache(pipe, tmp_path):
    """The second and third turns of a chat reuse the earlier turns' caches (usage reports the cached
    prompt tokens, OpenAI's prompt_tokens_details) and answer what a server without the cache answers."""
    turns = ["Write a haiku about rain", "Now one about snow", "And one about wind"]

    def chat(base: str) -> list:
        c, msgs, out = client(base), [MSGS[0]], []
        for text in turns:
            msgs.append({"role": "user", "content": text})
            r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=24)
            msgs.append({"role": "assistant", "content": r.choices[0].message.content})
            out.append((r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens))
        return out

    with serve(pipe) as base:
        warm = chat(base)
        info = metrics_json(base)
        again = httpx.post(base + "/v1/chat/completions",
                           json={"messages": MSGS[:1] + [{"role": "user", "content": turns[0]}], "max_tokens": 24})
        assert again.json()["choices"][0]["message"]["content"] == warm[0][0]  # the same prompt: replayed
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    with serve(pipe, prefix_cache_max_entries=1, prefix_cache_l2_dir=str(tmp_path)) as base:
        # one entry in memory: a second conversation in between pushes the first to a file, and back
        c = client(base)
        first = chat(base)
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Other"}], max_tokens=8)
        msgs = [MSGS[0]] + [m for t, (text, _) in zip(turns, first) for m in (
            {"role": "user", "content": t}, {"role": "assistant", "content": text})]
        r = c.chat.completions.create(model="tiny", messages=msgs + [{"role": "user", "content": "More"}],
                                      max_tokens=8)
        assert r.usage.prompt_tokens_details.cached_tokens > 0
        assert metrics_json(base)["prefix_cache"]["disk"]["hits"] == 1
        assert [t for t, _ in first] == [t for t, _ in warm]
    assert list(tmp_path.iterdir()) == []  # the run's files went with it
    with serve(pipe, prefix_cache_max_entries=0) as base:
        cold = chat(base)
        assert metrics_json(base)["prefix_cache"] is None
    assert [t for t, _ in warm] == [t for t, _ in cold]
    assert warm[0][1] == 0 and all(n > 0 for _, n in warm[1:]) and all(n == 0 for _, n in cold)
    assert info["prefix_cache"]["hits"] == 2 and info["prefix_cache"]["entries"] >= 1
    assert info["metrics"]["prefix_cache_cached_tokens_total"] == warm[1][1] + warm[2][1]
    assert [row["cached_tokens"] for row in info["recent"]] == [n for _, n in warm]


def test_out_of_memory_empties_the_prefix_cache(pipe, monkeypatch):
    from dflash_torch.serve import engine as engine_module

    with serve(pipe) as base:
        r = httpx.post(base + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 8})
        assert r.status_code == 200 and metrics_json(base)["prefix_cache"]["entries"] == 1

        def oom(*a, **k):
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            yield

        monkeypatch.setattr(engine_module, "generate_tokens", oom)
        r = httpx.post(base + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 8})
        assert r.status_code == 500 and metrics_json(base)["prefix_cache"]["entries"] == 0
        monkeypatch.undo()
        r = httpx.post(base + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 8})
        assert r.status_code == 200  # and it serves on


def test_chat_template_args(pipe, chat_model, capsys):
    """--chat-template-args sets chat template variables for every request; a request's
    chat_template_kwargs (vLLM's field) override them; anything but an object is a 400."""
    plain = len(pipe.encode_messages(MSGS))
    assert len(pipe.encode_messages(MSGS, {"preamble": "xyz"})) == plain + 3  # one token per character
    with serve(pipe, chat_template_args={"preamble": "ab"}) as base:
        def tokens(**extra):
            r = httpx.post(base + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, **extra})
            return r.json()["usage"]["prompt_tokens"] if r.status_code == 200 else r
        assert tokens() == plain + 2
        assert tokens(chat_template_kwargs={"preamble": "abcd"}) == plain + 4
        assert tokens(chat_template_kwargs={}) == plain + 2
        bad = tokens(chat_template_kwargs="x")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
    args = cli.build_parser().parse_args(["serve", "--chat-template-args", '{"enable_thinking": false}'])
    assert args.chat_template_args == {"enable_thinking": False}
    for bad_arg in ("[1]", "{oops"):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["serve", "--chat-template-args", bad_arg])
    capsys.readouterr()
    assert cli.main(["generate", "--model", str(chat_model[0]), "--no-draft", "--device", "cpu", "--prompt", "Hi",
                     "--chat-template-args", '{"preamble": "Q"}', "--max-tokens", "2", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stats"]["prompt_tokens"]
    assert got == len(pipe.encode("Hi")) + 1


def test_warns_when_the_model_was_loaded_in_another_thread(pipe, chat_model, caplog):
    """A pipeline loaded in this thread and served from the engine's worker: a warning (OpenMP teams of two
    threads can make every pass several times slower); loaded by the engine's own loader: none."""
    import logging

    with caplog.at_level(logging.WARNING, logger="dflash.server"):
        with serve(pipe) as base:
            assert httpx.get(base + "/health").status_code == 200
        assert any("loaded in another thread" in r.getMessage() for r in caplog.records)
        caplog.clear()
        with serve(loader=lambda: load(str(chat_model[0]), str(chat_model[1]), device="cpu", dtype="float32")) as base:
            deadline = time.time() + 60
            while httpx.get(base + "/health").status_code != 200:
                assert time.time() < deadline, "model did not become ready"
                time.sleep(0.05)
        assert not any("loaded in another thread" in r.getMessage() for r in caplog.records)


def test_events_go_over_in_order_first_text_and_last_at_once(monkeypatch):
    """Job.emit holds events for up to EMIT_INTERVAL_S (one event-loop wake-up per token cost decode speed):
    the first text and the final event go over at once, everything in order, nothing lost."""
    import asyncio

    from dflash_torch.decoding.sampling import Sampler
    from dflash_torch.serve import engine as engine_mod

    def drain(q) -> list:
        out = []
        while not q.empty():
            out.append(q.get_nowait())
        return out

    loop = asyncio.new_event_loop()
    try:
        monkeypatch.setattr(engine_mod, "EMIT_INTERVAL_S", 1e9)
        job = engine_mod.Job("chat", [1], 8, Sampler(), [], loop)
        job.emit("logprobs", ["a"])  # before any text: goes at once (nothing handed over yet)
        job.emit("delta", "x")  # the first text: at once
        for i in range(4):
            job.emit("delta", str(i))  # held
        loop.run_until_complete(asyncio.sleep(0))
        assert drain(job.events) == [("logprobs", ["a"]), ("delta", "x")]
        job.emit("done", {"n": 1})
        loop.run_until_complete(asyncio.sleep(0))
        assert drain(job.events) == [("delta", "0"), ("delta", "1"), ("delta", "2"), ("delta", "3"), ("done", {"n": 1})]
        monkeypatch.setattr(engine_mod, "EMIT_INTERVAL_S", 0.0)  # no holding: each event as it comes
        job = engine_mod.Job("chat", [1], 8, Sampler(), [], loop)
        for i in range(3):
            job.emit("delta", str(i))
            loop.run_until_complete(asyncio.sleep(0))
            assert drain(job.events) == [("delta", str(i))]
    finally:
        loop.close()
