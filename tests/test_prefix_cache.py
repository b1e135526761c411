"""The prefix cache: a later prompt that starts like an earlier request's prompt + reply reuses that
request's caches, and decodes what a cold run decodes; the same prompt again replays it exactly."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_torch import loading
from dflash_torch.decoding.drafter import load_drafter
from dflash_torch.decoding.prefix_cache import PrefixCache
from dflash_torch.decoding.speculative import Stats, generate_tokens
from dflash_torch.models.quantize import exact_prefill, quantize_int4

from .conftest import make_drafter
from .test_families import GEMMA4, QWEN, _save
from .test_lossless import clear_prefix

CPU = torch.device("cpu")
# Warm and cold runs are compared up to the first near-tie of the cold run (clear_prefix); these floors on
# the tokens so compared keep the checks from passing on almost nothing. Each is about 2/3 of what these
# seeds give (measured as the machine is and under ATEN_CPU_CAPABILITY=avx2): a clear margin for rounding
# that moves a near-tie by a token or two, far above what a filter that skips most of the run would leave.
FLOOR_CONV, FLOOR_LONGER, FLOOR_SINGLE, FLOOR_RANDOM = 250, 280, 200, 200
FLOOR_DISK, FLOOR_SHARED, FLOOR_CHUNKED = 38, 32, 32


@pytest.fixture(scope="module")
def targets(tiny_models, tmp_path_factory) -> list:
    """(name, target, drafter) for tiny Llama / Qwen3 (keys and values only), Qwen3.5 (hybrid: conv and
    recurrent state) and Gemma 4 (sliding and shared layers)."""
    base = tmp_path_factory.mktemp("prefix")
    out = []
    for name in ("llama", "qwen3"):
        path = tiny_models[name]
        out.append((name, loading.load_target(path, CPU, torch.float32),
                    load_drafter(make_drafter(path, base / f"d-{name}", block_size=8))))
    for name, cfg in (("qwen3_5", QWEN), ("gemma4", GEMMA4)):
        _save(name, cfg, base / name, seed=3)
        out.append((name, loading.load_target(base / name, CPU, torch.float32),
                    load_drafter(make_drafter(base / name, base / f"d-{name}", block_size=8))))
    return out


def _gen(target, prompt, n, drafter=None, prefix=None, lookup=False):
    stats = Stats()
    out = list(generate_tokens(target, prompt, max_new_tokens=n, drafter=drafter, stats=stats, prefix=prefix,
                               lookup=lookup))
    return out, stats


@torch.inference_mode()
def test_conversation_turns_reuse_the_cache_and_decode_as_cold(targets):
    """Three-turn conversations: each turn's prompt is the last prompt + its reply + new tokens. With a
    prefix cache every later turn prefills only the new tokens (the reply's last token included), and
    emits what a run without it emits; target-only, with the drafter, and with prompt lookup."""
    rng = random.Random(0)
    checked = tokens = 0
    for name, target, drafter in targets:
        vocab = target.config.vocab_size
        for mode in ("target", "dflash", "lookup"):
            d = drafter if mode == "dflash" else None
            prefix = PrefixCache()
            prompt = [rng.randrange(vocab - 1) for _ in range(rng.randint(3, 12))]
            for turn in range(3):
                n = rng.randint(4, 16)
                cold, _ = _gen(target, prompt, n, d, lookup=mode == "lookup")
                held = prefix.entries[0].ids if prefix.entries else []
                warm, stats = _gen(target, prompt, n, d, prefix, lookup=mode == "lookup")
                k = clear_prefix(target, prompt, cold)  # past a near-tie the two may round apart
                assert warm[:k] == cold[:k] and len(warm) == n, (name, mode, turn)
                tokens += k
                assert bool(held) == (turn > 0), (name, mode, turn)
                if held:  # everything of the last turn but its reply's last token was in the cache
                    assert stats.cached_tokens == len(held), (name, mode, turn)
                    checked += 1
                prompt = prompt + warm + [rng.randrange(vocab - 1) for _ in range(rng.randint(1, 5))]
    # every later turn of 4 targets x 3 modes; FLOOR_CONV of the tokens compared
    assert checked == 24 and tokens >= FLOOR_CONV, tokens


@torch.inference_mode()
def test_same_prompt_again_skips_the_prefill_and_replays_exactly(targets):
    for name, target, drafter in targets:
        prefix = PrefixCache()
        prompt = list(range(5, 25))
        first, s1 = _gen(target, prompt, 12, drafter, prefix)
        again, s2 = _gen(target, prompt, 12, drafter, prefix)
        assert again == first and s1.cached_tokens == 0 and s2.cached_tokens == len(prompt), name
        # and a longer reply to it: the earlier reply's positions are overwritten as it goes
        longer, _ = _gen(target, prompt, 20, drafter, prefix)
        assert longer[:12] == first, name


@torch.inference_mode()
def test_hybrid_state_comes_back_only_where_it_was_saved(targets):
    """Qwen3.5: a prompt that shares the earlier prompt exactly (not its reply) restores the state saved
    after that prefill; one that shares less than that cannot restore its conv/recurrent state and runs cold."""
    _, target, drafter = next(t for t in targets if t[0] == "qwen3_5")
    prefix = PrefixCache()
    prompt = list(range(30, 50))
    reply, _ = _gen(target, prompt, 10, drafter, prefix)
    other = prompt + [7, 8, 9]  # diverges right after the prompt
    cold, _ = _gen(target, other, 10, drafter)
    warm, stats = _gen(target, other, 10, drafter, prefix)
    assert warm == cold and stats.cached_tokens == len(prompt)
    shorter = prompt[:10] + [1, 2, 3]
    cold, _ = _gen(target, shorter, 10, drafter)
    warm, stats = _gen(target, shorter, 10, drafter, prefix)
    assert warm == cold and stats.cached_tokens == 0


@torch.inference_mode()
def test_stopped_early_keeps_what_was_emitted(targets):
    """A consumer that stops reading (a client gone, a stop string) leaves a cache that holds exactly
    the tokens it read: the next turn built on them decodes as a cold run."""
    for name, target, drafter in targets:
        if name == "qwen3_5":  # a hybrid cache may not go back to the last token read; covered above
            continue
        prefix = PrefixCache()
        prompt = list(range(40, 52))
        gen = generate_tokens(target, prompt, max_new_tokens=30, drafter=drafter, prefix=prefix, block_size=8)
        read = [next(gen) for _ in range(7)]
        gen.close()
        assert prefix.entries and prefix.entries[0].ids == (prompt + read)[: len(prefix.entries[0].ids)]
        nxt = prompt + read + [3, 4]
        cold, _ = _gen(target, nxt, 10, drafter)
        warm, stats = _gen(target, nxt, 10, drafter, prefix)
        assert warm == cold and stats.cached_tokens == len(prompt) + len(read) - 1, name


@torch.inference_mode()
def test_a_longer_turn_moves_the_cache_to_a_bigger_one(targets):
    """A turn that needs more positions than the cached one was made for starts from a bigger cache
    with the cached positions (and a hybrid's state) copied in, and decodes as a cold run."""
    ks = []
    for name, target, drafter in targets:
        prefix = PrefixCache()
        prompt = list(range(60, 72))
        reply, _ = _gen(target, prompt, 8, drafter, prefix)
        small = prefix.entries[0].cache.max_len
        nxt = prompt + reply + [5, 6, 7]
        cold, _ = _gen(target, nxt, small, drafter)
        warm, stats = _gen(target, nxt, small, drafter, prefix)
        k = clear_prefix(target, nxt, cold)  # a long reply always meets a near-tie: equal up to the first
        assert warm[:k] == cold[:k], (name, k)
        ks.append(k)
        assert stats.cached_tokens == len(prompt) + len(reply) - 1, name
        assert prefix.entries[0].cache.max_len > small, name
    assert sum(ks) >= FLOOR_LONGER, ks  # of 4 x 256 or more: long replies meet near-ties


@torch.inference_mode()
def test_entries_bytes_and_failures(targets):
    name, target, drafter = targets[0]
    prefix = PrefixCache(max_entries=2)
    for start in (10, 20, 30):
        _gen(target, list(range(start, start + 8)), 4, drafter, prefix)
    assert [e.ids[0] for e in prefix.entries] == [30, 20]  # most recent first, the oldest evicted
    assert prefix.nbytes > 0
    tiny = PrefixCache(max_bytes=1)
    _gen(target, list(range(10, 18)), 4, drafter, tiny)
    assert tiny.entries == []  # over the byte budget: nothing kept
    # a pass that fails mid-way: the cache it used is not given back
    prefix = PrefixCache()
    _gen(target, list(range(10, 18)), 4, drafter, prefix)
    real = target.forward

    def broken(*a, **k):
        raise RuntimeError("boom")

    held = list(prefix.entries[0].ids)
    target.forward = broken
    try:
        with pytest.raises(RuntimeError):  # a shorter prefix: copied out, the entry itself untouched
            _gen(target, list(range(10, 18)) + [1, 2], 4, drafter, prefix)
        assert [e.ids for e in prefix.entries] == [held]
        with pytest.raises(RuntimeError):  # the whole entry, taken: not given back
            _gen(target, held + [1, 2], 4, drafter, prefix)
    finally:
        target.forward = real
    assert prefix.entries == []
    with pytest.raises(ValueError):
        PrefixCache(max_entries=0)


@pytest.mark.fastpath
@torch.inference_mode()
def test_quantized_reuse_is_bit_exact_with_exact_prefill(tiny_models, tmp_path):
    """int4 weights (bfloat16 activations magnify rounding differences into different tokens): with
    prefills attending one query at a time, every later turn decodes exactly as a cold run, no near-tie
    filter. This is what `dflash serve` switches on beside its prefix cache."""
    path = tiny_models["llama"]
    target = quantize_int4(loading.load_target(path, CPU, torch.float32))
    assert exact_prefill(target)
    assert not exact_prefill(loading.load_target(path, CPU, torch.float32))  # float32: nothing to switch
    drafter = load_drafter(make_drafter(path, tmp_path / "d", block_size=8))
    rng = random.Random(5)
    for d in (None, drafter):
        prefix = PrefixCache()
        prompt = [rng.randrange(255) for _ in range(40)]  # longer than a verify block: a real prefill
        for turn in range(4):
            cold, _ = _gen(target, prompt, 20, d)
            warm, stats = _gen(target, prompt, 20, d, prefix)
            assert warm == cold, turn
            assert (stats.cached_tokens > 0) == (turn > 0)
            # the kept keys/values (earlier prefills, decode steps, verify passes) are bit for bit those
            # of one cold prefill over the same tokens
            e = prefix.entries[0]
            n = len(e.ids)
            fresh = target.new_cache(n)
            target(torch.tensor([e.ids]), fresh, logits=None)
            assert torch.equal(fresh.k[:, :, :, :n], e.cache.k[:, :, :, :n]), turn
            assert torch.equal(fresh.v[:, :, :, :n], e.cache.v[:, :, :, :n]), turn
            prompt = prompt + warm + [rng.randrange(255) for _ in range(36)]


@torch.inference_mode()
def test_single_cache_targets(tiny_models, tmp_path):
    """A target that owns one cache (`--cuda-graphs`, here its static-shape passes without graphs on a
    CPU) rewinds it for every new_cache: hits reuse it, and an entry is dropped once anything else has
    been handed the cache (a generation without the prefix cache, a calibration)."""
    from dflash_torch.models.cudagraph import GraphedTarget

    path = tiny_models["llama"]
    plain = loading.load_target(path, CPU, torch.float32)
    target = GraphedTarget(loading.load_target(path, CPU, torch.float32), use_graphs=False)
    drafter = load_drafter(make_drafter(path, tmp_path / "d", block_size=8))
    prefix = PrefixCache()
    rng = random.Random(9)
    prompt = [rng.randrange(255) for _ in range(12)]
    tokens = 0
    for turn in range(3):
        n = 300 if turn == 2 else 10  # the last turn outgrows the cache: a bigger one, positions copied
        cold, _ = _gen(plain, prompt, n, drafter)
        warm, stats = _gen(target, prompt, n, drafter, prefix)
        k = clear_prefix(plain, prompt, cold)
        assert warm[:k] == cold[:k], turn
        tokens += k
        assert (stats.cached_tokens > 0) == (turn > 0) and len(prefix.entries) == 1
        assert prefix.entries[0].cache is target.cache
        prompt = prompt + warm + [rng.randrange(255) for _ in range(3)]
    assert tokens >= FLOOR_SINGLE, tokens
    _gen(target, [1, 2, 3], 4, drafter)  # without the prefix cache: the one cache is rewound for it
    _, stats = _gen(target, prompt, 4, drafter, prefix)
    assert stats.cached_tokens == 0  # so the entry that held it is not used


@torch.inference_mode()
def test_random_request_sequences(targets):
    """Random request streams against one prefix cache (2 entries): prompts that extend, branch off or
    repeat earlier conversations at any point, replies of any length, some read only in part. Every
    reply equals a cold run (up to its first near-tie) and every kept entry describes its cache."""
    rng = random.Random(7)
    tokens = 0
    for name, target, drafter in targets:
        vocab = target.config.vocab_size
        prefix = PrefixCache(max_entries=2)
        history: list[list[int]] = [[rng.randrange(vocab - 1) for _ in range(6)]]
        for step in range(14):
            base = rng.choice(history)
            cut = rng.randint(1, len(base))  # branch off anywhere (the whole of it: extend or repeat)
            prompt = base[:cut] + [rng.randrange(vocab - 1) for _ in range(rng.choice([0, 0, 1, 4]))]
            n = rng.randint(1, 12)
            d = drafter if step % 3 else None
            cold, _ = _gen(target, prompt, n, d)
            gen = generate_tokens(target, prompt, max_new_tokens=n, drafter=d, prefix=prefix, lookup=step % 2 == 0)
            read = rng.randint(1, n) if step % 4 == 3 else n
            got = []
            for token in gen:
                got.append(token)
                if len(got) == read:
                    break
            gen.close()
            k = min(clear_prefix(target, prompt, cold), len(got))
            assert got[:k] == cold[:k] and len(got) == read, (name, step)
            tokens += k
            for e in prefix.entries:
                assert e.cache.length == len(e.ids) and e.prompt_len <= len(e.ids) + 1, (name, step)
                assert e.hidden is None or e.hidden.shape[1] == len(e.ids), (name, step)
            history.append(prompt + got)
    assert tokens >= FLOOR_RANDOM, tokens


@torch.inference_mode()
def test_entries_pushed_out_go_to_disk_and_come_back(targets, tmp_path):
    """With one entry in memory and a disk store: a second conversation pushes the first to a file; the
    first's next turn reads it back (every family, the hybrid's state included) and decodes as cold; the
    same prompt again replays from disk; files over the disk budget are removed."""
    from dflash_torch.decoding.prefix_cache import DiskStore

    tokens = 0
    for name, target, drafter in targets:
        disk = DiskStore(tmp_path / name, max_bytes=1 << 30)
        prefix = PrefixCache(max_entries=1, disk=disk)
        a = list(range(10, 30))
        reply_a, _ = _gen(target, a, 8, drafter, prefix)
        _gen(target, list(range(100, 112)), 8, drafter, prefix)  # conversation B: A goes to disk
        assert [len(s.ids) for s in disk.entries] == [len(a) + 7] and len(list(disk.dir.iterdir())) == 1
        nxt = a + reply_a + [3, 4]
        cold, _ = _gen(target, nxt, 8, drafter)
        warm, stats = _gen(target, nxt, 8, drafter, prefix)
        k = clear_prefix(target, nxt, cold)
        assert warm[:k] == cold[:k], name
        assert stats.cached_tokens == len(a) + 7 and prefix.disk_hits == 1, name
        assert [s.ids[:2] for s in disk.entries] == [[100, 101]]  # B went out when A came back
        # B's prompt again, from its file: the earlier reply exactly (its prefill's logits were kept)
        again, stats = _gen(target, list(range(100, 112)), 8, drafter, prefix)
        first, _ = _gen(target, list(range(100, 112)), 8, drafter)
        j = clear_prefix(target, list(range(100, 112)), first)
        assert stats.cached_tokens == 12 and again[:j] == first[:j], name
        tokens += k + j
    assert tokens >= FLOOR_DISK, tokens  # of 4 x 16
    # a file that cannot be read back: the request runs cold, and the entry is forgotten
    name, target, drafter = targets[0]
    disk = DiskStore(tmp_path / "broken", max_bytes=1 << 30)
    prefix = PrefixCache(max_entries=1, disk=disk)
    a = list(range(10, 30))
    _gen(target, a, 4, drafter, prefix)
    _gen(target, list(range(100, 112)), 4, drafter, prefix)
    disk.entries[0].path.write_bytes(b"not a safetensors file")
    cold, _ = _gen(target, a + [5], 4, drafter)
    warm, stats = _gen(target, a + [5], 4, drafter, prefix)
    assert warm == cold and stats.cached_tokens == 0 and prefix.disk_hits == 0
    assert all(s.ids[0] != 10 for s in disk.entries)  # the broken one is forgotten
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="cannot keep prefix-cache files"):  # a message, not an OSError
        DiskStore(tmp_path / "a-file" / "l2", max_bytes=1 << 20)
    tiny = DiskStore(tmp_path / "tiny", max_bytes=1)
    prefix = PrefixCache(max_entries=1, disk=tiny)
    name, target, drafter = targets[0]
    _gen(target, list(range(10, 20)), 4, drafter, prefix)
    _gen(target, list(range(30, 40)), 4, drafter, prefix)
    assert tiny.entries == [] and list(tiny.dir.iterdir()) == []


@torch.inference_mode()
def test_a_shared_beginning_does_not_cost_the_conversation_its_cache(targets):
    """A new conversation that shares only the beginning of a kept one (a system prompt) gets those
    positions copied into a cache of its own; the kept conversation's next turn still finds all of it."""
    tokens = 0
    for name, target, drafter in targets:
        prefix = PrefixCache(max_entries=4)
        system = list(range(50, 60))
        a = system + [1, 2, 3]
        reply, _ = _gen(target, a, 6, drafter, prefix)
        b = system + [7, 8]
        cold_b, _ = _gen(target, b, 6, drafter)
        warm_b, stats = _gen(target, b, 6, drafter, prefix)
        k = clear_prefix(target, b, cold_b)
        assert warm_b[:k] == cold_b[:k], name
        tokens += k
        assert stats.cached_tokens == (0 if name == "qwen3_5" else len(system)), name  # hybrid: no state there
        nxt = a + reply + [4]
        cold, _ = _gen(target, nxt, 6, drafter)
        warm, stats = _gen(target, nxt, 6, drafter, prefix)
        k = clear_prefix(target, nxt, cold)
        assert warm[:k] == cold[:k], name
        tokens += k
        assert stats.cached_tokens == len(a) + len(reply) - 1, name
    assert tokens >= FLOOR_SHARED, tokens  # of 4 x 12


@pytest.mark.fastpath
@torch.inference_mode()
def test_chunked_prefill(targets, tiny_models):
    """A prompt run in passes of a few tokens (--prefill-step-size) gives the one-pass prefill's logits and
    cache (float32: to rounding; quantized with exact prefill: bit for bit) and the same generations."""
    from dflash_torch.decoding.speculative import _run_prompt

    rng = random.Random(3)
    tokens = 0
    for name, target, drafter in targets:
        prompt = [rng.randrange(target.config.vocab_size - 1) for _ in range(37)]
        one, many = target.new_cache(64), target.new_cache(64)
        taps = drafter.target_layer_ids
        l1, h1 = _run_prompt(target, prompt, one, taps, None, CPU)
        l2, h2 = _run_prompt(target, prompt, many, taps, 5, CPU)
        assert one.length == many.length == 37 and h2.shape == h1.shape
        torch.testing.assert_close(l2, l1, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(h2, h1, atol=1e-4, rtol=1e-4)
        want, _ = _gen(target, prompt, 12, drafter)
        got = list(generate_tokens(target, prompt, max_new_tokens=12, drafter=drafter, prefill_chunk=7))
        k = clear_prefix(target, prompt, want)
        assert got[:k] == want[:k], name
        tokens += k
    assert tokens >= FLOOR_CHUNKED, tokens  # of 4 x 12
    target = quantize_int4(loading.load_target(tiny_models["llama"], CPU, torch.float32))
    exact_prefill(target)
    prompt = [rng.randrange(255) for _ in range(50)]
    one, many = target.new_cache(64), target.new_cache(64)
    assert torch.equal(_run_prompt(target, prompt, one, (), None, CPU)[0],
                       _run_prompt(target, prompt, many, (), 8, CPU)[0])
    assert torch.equal(one.k[:, :, :, :50], many.k[:, :, :, :50])
    with pytest.raises(ValueError, match="step size"):
        list(generate_tokens(target, prompt, max_new_tokens=2, prefill_chunk=0))
