"""Drafter training: data -> train -> export -> reload -> lossless generation, resume, reference parity."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from dflash_torch import cli, data, loading, train
from dflash_torch.decoding.drafter import load_drafter
from dflash_torch.decoding.speculative import generate_tokens

from .conftest import ROOT, make_hf_model

REF_DIR = ROOT / ".venv" / "dflash-ref"


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """A tiny random llama target and a few replies of it with cached features."""
    base = tmp_path_factory.mktemp("train")
    target = make_hf_model("llama", base / "target", seed=3)
    prompts = base / "prompts.jsonl"
    g = torch.Generator().manual_seed(0)
    prompts.write_text("".join(
        json.dumps({"prompt_ids": torch.randint(3, 250, (int(n),), generator=g).tolist()}) + "\n"
        for n in torch.randint(4, 12, (12,), generator=g)
    ))
    out = base / "data"
    data.generate_dataset(out, data.jsonl_prompts(prompts), str(target), batch=4, shard_size=6,
                          max_new_tokens=24, min_new_tokens=4)
    return target, out


def run_train(argv: list[str]) -> dict:
    args = cli.build_parser().parse_args(["train", *argv])
    return train.train(args)


def test_data_shards(tiny_data):
    target, out = tiny_data
    records, feats, meta = data.load_shards(out)
    assert len(records) >= 8
    assert feats.dtype == torch.bfloat16
    n = sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in records)
    assert feats.shape == (n, len(meta["taps"]) * 64)
    # Resume: a second call finds every prompt done and writes nothing new.
    before = sorted(p.name for p in out.iterdir())
    (out / "shard-09999.jsonl").write_text("")  # a shard interrupted before its first batch
    prompts = [r["prompt_ids"] for r in records]
    data.generate_dataset(out, prompts, str(target), batch=4, shard_size=6, max_new_tokens=24, min_new_tokens=4)
    assert sorted(p.name for p in out.iterdir()) == before


def test_train_export_reload_lossless(tiny_data, tmp_path):
    target_dir, out = tiny_data
    export = tmp_path / "drafter"
    last = run_train(["--data", str(out), "--out", str(tmp_path / "run"), "--steps", "6", "--layers", "1",
                      "--block-size", "8", "--seqs", "2", "--anchors", "4", "--eval-every", "3",
                      "--eval-blocks", "8", "--export", str(export), "--export-dtype", "float32"])
    assert "tf_accept" in last and last["step"] == 6
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert any(r.get("event") == "eval" for r in log)
    drafter = load_drafter(export)
    assert drafter.config["dflash_config"]["target"]["name"]
    target = loading.load_target(target_dir, torch.device("cpu"), torch.float32)
    drafter.check_target(json.loads((target_dir / "config.json").read_text()), target.num_layers, 256)
    for prompt in ([5, 17, 42, 99], [7, 8, 9, 10, 11, 12, 13]):
        plain = list(generate_tokens(target, prompt, max_new_tokens=20))
        spec = list(generate_tokens(target, prompt, max_new_tokens=20, drafter=drafter))
        assert spec == plain


def test_resume_matches_uninterrupted(tiny_data, tmp_path):
    _, out = tiny_data
    common = ["--data", str(out), "--layers", "1", "--block-size", "8", "--seqs", "2", "--anchors", "4",
              "--eval-every", "0", "--log-every", "1", "--save-every", "3", "--steps", "4", "--no-bf16"]
    run_train([*common, "--out", str(tmp_path / "full")])
    # Interrupted: the same run stopped after step 2 (checkpointed there), then resumed to step 4.
    run_train([*common, "--out", str(tmp_path / "part"), "--stop-after", "2"])
    ckpt = torch.load(tmp_path / "part" / "checkpoint.pt", weights_only=False)
    assert ckpt["step"] == 2 and ckpt["optim"]["state"]
    run_train([*common, "--out", str(tmp_path / "part"), "--resume"])

    def losses(run):
        rows = [json.loads(x) for x in (tmp_path / run / "log.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}

    full, part = losses("full"), losses("part")
    assert part[3] == pytest.approx(full[3], abs=1e-6) and part[4] == pytest.approx(full[4], abs=1e-6)
    a = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=False)
    b = torch.load(tmp_path / "part" / "checkpoint.pt", weights_only=False)
    assert b["step"] == a["step"] == 4
    for k, v in a["drafter"].items():
        torch.testing.assert_close(b["drafter"][k], v, rtol=0, atol=1e-6)


def test_reference_implementation_parity(tiny_data, tmp_path):
    """An exported drafter loads in the reference package (dflash 0.1.0) with the same draft logits."""
    if not (REF_DIR / "dflash" / "model.py").is_file():
        pytest.fail(f"the reference implementation is missing at {REF_DIR}: install it with "
                    f"`{ROOT / '.venv/bin/python'} -m pip install --no-deps --target {REF_DIR} dflash==0.1.0` "
                    f"(or `make install`)")
    target_dir, out = tiny_data
    export = tmp_path / "drafter"
    run_train(["--data", str(out), "--out", str(tmp_path / "run"), "--steps", "2", "--layers", "2",
               "--block-size", "8", "--seqs", "2", "--anchors", "4", "--eval-every", "0",
               "--export", str(export), "--export-dtype", "float32"])
    sys.path.insert(0, str(REF_DIR))
    try:
        from dflash.model import DFlashDraftModel
    finally:
        sys.path.remove(str(REF_DIR))
    ref = DFlashDraftModel.from_pretrained(str(export), dtype=torch.float32).eval()
    ours = load_drafter(export, dtype=torch.float32)
    target = loading.load_target(target_dir, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(0)
    n_ctx, bs = 11, ours.block_size
    ctx = torch.randn(1, n_ctx, len(ours.target_layer_ids) * 64, generator=g)
    block = torch.full((1, bs), ours.mask_token_id)
    block[0, 0] = 17
    emb = target.embed_tokens(block)
    with torch.no_grad():
        h_ref = ref(position_ids=torch.arange(n_ctx + bs)[None], noise_embedding=emb, target_hidden=ctx)
        h_ours = ours(emb, ctx, torch.arange(n_ctx, n_ctx + bs), torch.arange(n_ctx))
        l_ref = ref.compute_logits(h_ref[:, 1:], target.lm_head)
        l_ours = ours.logits(h_ours[:, 1:], target.lm_head)
    torch.testing.assert_close(l_ours, l_ref, rtol=1e-5, atol=1e-5)


def _random_drafter(tiny_data, seed: int):
    """The tiny data's records and features, its target, and a random 2-layer drafter (block 8) for it."""
    target_dir, out = tiny_data
    records, feats, meta = data.load_shards(out)
    target = loading.load_target(target_dir, torch.device("cpu"), torch.float32)
    tcfg = json.loads((target_dir / "config.json").read_text())
    cfg = train.drafter_config(tcfg, layers=2, taps=meta["taps"], block_size=8, mask_token_id=255, name="t")
    drafter = train.DFlashDrafter(cfg)
    train.init_random(drafter, target, seed=seed, norm_scale=1.0)
    return records, feats, target, drafter


def test_block_by_block_attention_equals_the_dense_mask(tiny_data):
    """Training passes score each block against its own context only (drafter.Blocks); logits and
    gradients equal those of the dense mask over all blocks of several sequences."""
    records, feats, target, drafter = _random_drafter(tiny_data, seed=2)
    cols = torch.arange(feats.shape[1])
    b = train.make_batch(records, feats, cols, torch.Generator().manual_seed(4), seqs=4, anchors=5, block_size=8,
                         mask_token_id=255)
    assert len(set(b["ctx_start"].tolist())) >= 3  # blocks of several sequences in one pass
    runs = []
    for dense in (True, False):
        drafter.zero_grad()
        logits = train.block_logits(drafter, drafter, target, b, torch.device("cpu"), dense=dense)
        loss, _ = train.block_loss(logits, b["labels"], train.position_weights(8, 7.0))
        loss.backward()
        runs.append((logits.detach(), {k: p.grad.clone() for k, p in drafter.named_parameters()}))
    (want, want_grads), (got, got_grads) = runs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for k in want_grads:
        torch.testing.assert_close(got_grads[k], want_grads[k], rtol=1e-4, atol=1e-6)


def test_training_blocks_equal_inference_drafts(tiny_data):
    """The training objective scores exactly what the speculative loop drafts: the logits of a batch's
    blocks equal `propose` at the same anchors, with the context fed to the drafter's cache in chunks
    as the loop does (prefill, then accepted tokens per cycle)."""
    records, feats, target, drafter = _random_drafter(tiny_data, seed=1)
    drafter.eval()
    rec = max(records, key=lambda r: len(r["response_ids"]))
    g = torch.Generator().manual_seed(0)
    cols = torch.arange(feats.shape[1])
    b = train.make_batch([rec], feats, cols, g, seqs=1, anchors=6, block_size=8, mask_token_id=255)
    with torch.no_grad():
        logits = train.block_logits(drafter, drafter, target, b, torch.device("cpu"))  # [n, 7, V]
    toks = rec["prompt_ids"] + rec["response_ids"]
    f = feats[rec["start"] : rec["start"] + len(toks)].float()
    anchors = b["q_pos"].view(-1, 8)[:, 0].tolist()
    assert len(anchors) >= 3
    for j, a in enumerate(anchors):
        cache = drafter.new_cache(len(toks) + 8)
        cut = len(rec["prompt_ids"])
        if cut < a:  # context up to the prompt first, the rest as a later cycle's accepted tokens
            with torch.no_grad():
                drafter.propose(target, torch.full((1, 8), 255), f[None, :cut], cache)
        else:
            cut = 0
        block = torch.full((1, 8), 255)
        block[0, 0] = toks[a]
        with torch.no_grad():
            ref = drafter.propose(target, block, f[None, cut:a], cache)  # [1, 7, V]
        labels_ok = b["labels"][j] != -100
        torch.testing.assert_close(logits[j][labels_ok], ref[0][labels_ok], rtol=1e-4, atol=1e-4)


def test_teacher_forced_records_label_only_the_targets_own_choices(tiny_data):
    """A teacher-forced record (`target_ids`, tools/teacher_forced_data.py) whose text is the target's own
    choice everywhere gives the batch a generated record gives; where the text leaves the target's choices,
    blocks anchor only on the target's tokens and a block's labels are the target's choices up to and
    including the first position whose text token differs, -100 after it."""
    _, out = tiny_data
    records, feats, _ = data.load_shards(out)
    cols = torch.arange(feats.shape[1])
    args = dict(seqs=3, anchors=5, block_size=8, mask_token_id=255)
    same = [dict(r, target_ids=list(r["response_ids"])) for r in records]
    a = train.make_batch(records, feats, cols, torch.Generator().manual_seed(3), **args)
    b = train.make_batch(same, feats, cols, torch.Generator().manual_seed(3), **args)
    for k in ("block", "q_pos", "labels", "ctx_start", "ctx_len"):
        assert torch.equal(a[k], b[k]), k
    g = torch.Generator().manual_seed(5)
    mixed = []
    for r in records:  # the target's choice differs from the text at random reply positions
        tid = [t if torch.rand((), generator=g) < 0.6 else (t + 1) % 250 for t in r["response_ids"]]
        mixed.append(dict(r, target_ids=tid))
    blocks = 0
    for m in mixed:
        p, tid, resp = len(m["prompt_ids"]), m["target_ids"], m["response_ids"]
        bt = train.make_batch([m], feats, cols, torch.Generator().manual_seed(1), **dict(args, seqs=1))
        for anchor, labels in zip(bt["q_pos"].view(-1, 8)[:, 0].tolist(), bt["labels"].tolist()):
            assert p <= anchor and tid[anchor - p] == resp[anchor - p]  # the target's own token, as a bonus is
            want = []
            for k in range(1, 8):
                if anchor + k - p >= len(resp):
                    break
                want.append(tid[anchor + k - p])
                if resp[anchor + k - p] != tid[anchor + k - p]:
                    break
            assert labels == want + [-100] * (7 - len(want))
            blocks += 1
    assert blocks >= 10


def test_target_ids_of_the_wrong_length_are_a_clear_error(tiny_data, tmp_path):
    """A teacher-forced shard whose target_ids do not cover its reply is refused when loaded, by name."""
    import shutil

    _, out = tiny_data
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    shard = sorted(bad.glob("shard-*.jsonl"))[0]
    recs = data.read_records(shard)
    recs[0]["target_ids"] = recs[0]["response_ids"][:-1]
    shard.write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(ValueError, match="target_ids"):
        train.load_data([str(bad)])


def test_split_keeps_a_conversations_turns_on_one_side():
    """`train.split_records`: a record alone keeps its key's side; records whose prompts share their first 96 tokens
    (later turns of one conversation) all go to one side, so no held-out reply continues a training prompt."""
    g = torch.Generator().manual_seed(0)
    keys = [f"{int(k):016x}" for k in torch.randint(0, 2**62, (400,), generator=g)]
    alone = [{"key": k, "prompt_ids": [i, *range(100)]} for i, k in enumerate(keys[:200])]
    convs = []
    for c in range(50):  # 4 turns each: prompts growing from one 120-token start
        start = torch.randint(3, 250, (120,), generator=g).tolist()
        convs += [{"key": keys[200 + 4 * c + t], "prompt_ids": start + [7] * 30 * t} for t in range(4)]
    train_recs, val_recs = train.split_records(alone + convs, val_every=5)
    by_key = {r["key"]: r in val_recs for r in alone + convs}
    assert all(by_key[r["key"]] == (int(r["key"][:8], 16) % 5 == 0) for r in alone)
    for c in range(50):
        sides = {by_key[r["key"]] for r in convs[4 * c : 4 * c + 4]}
        assert len(sides) == 1
        assert sides.pop() == (int(min(r["key"] for r in convs[4 * c : 4 * c + 4])[:8], 16) % 5 == 0)
    assert 0 < sum(by_key[r["key"]] for r in convs) < len(convs)  # both sides hold conversations
    assert len(train_recs) + len(val_recs) == 400


def test_selector_training_exports_a_dflash2_drafter(tiny_data, tmp_path, monkeypatch, capsys):
    """`dflash train --selector`: the selector's loss falls on its training blocks, the export loads as a
    DFlash2 drafter whose identity convolutions leave the drafter's hidden states as they were, its
    selector is the trained one, and generation with it stays lossless."""
    from safetensors.torch import load_file

    from dflash_torch import train_selector as ts

    target_dir, out = tiny_data
    first = tmp_path / "d1"
    run_train(["--data", str(out), "--out", str(tmp_path / "run"), "--steps", "6", "--layers", "1", "--block-size",
               "8", "--seqs", "2", "--anchors", "4", "--eval-every", "0", "--export", str(first),
               "--export-dtype", "float32"])
    target = loading.load_target(target_dir, torch.device("cpu"), torch.float32)
    d1 = load_drafter(first)
    records, feats, _ = train.load_data([str(out)])
    ex = ts.examples(d1, target, records, feats, torch.arange(feats.shape[1]), torch.device("cpu"), blocks=64,
                     positions=4, top_k=4, seed=0)
    assert ex["hidden"].shape[:2] == ex["cand"].shape[:2] == ex["labels"].shape == (64, 4)
    sel = ts.Selector(d1.config["hidden_size"], target.embed_tokens.weight, 8)
    sel.reset(0)
    weights = train.position_weights(5, 7.0)
    rows = torch.arange(64)
    opt = torch.optim.AdamW(sel.parameters(), lr=1e-2)
    before = ts.loss_of(sel, ex, rows, weights).item()
    for _ in range(30):
        loss = ts.loss_of(sel, ex, rows, weights)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert ts.loss_of(sel, ex, rows, weights).item() < before

    second = tmp_path / "d2"
    args = cli.build_parser().parse_args([
        "train", "--selector", "--init-from", str(first), "--data", str(out), "--out", str(tmp_path / "sel"),
        "--selector-blocks", "64", "--selector-epochs", "2", "--selector-rank", "8", "--loss-positions", "4",
        "--lr", "1e-2", "--export", str(second), "--export-dtype", "float32"])
    result = ts.train_selector(args)
    epochs = [json.loads(x) for x in (tmp_path / "sel" / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in epochs if "epoch" in r] == [1, 2]
    d2 = load_drafter(second)
    assert type(d2).__name__ == "DFlash2Drafter"
    saved = load_file(str(second / "model.safetensors"))
    # the export holds the best epoch's selector: the untrained one (successor codebook zero: argmax drafts)
    # only when no epoch beat it
    trained = bool(saved["candidate_selector.successor_codebook"].abs().sum() > 0)
    assert trained == (result["best_epoch"] > 0)
    assert saved["candidate_selector.predecessor_codebook"].shape == (256, 8)
    assert "candidate_selector.successor_codebook.weight" not in saved  # published layout: no `.weight`
    for k, v in load_file(str(first / "model.safetensors")).items():
        assert torch.equal(saved[k], v)  # the drafter's own weights as they were
    prompt = [5, 17, 42, 99, 3, 8]
    ctx = torch.randn(1, len(prompt), feats.shape[1])
    block = torch.full((1, 8), d1.mask_token_id)
    block[0, 0] = 7
    with torch.no_grad():
        h1 = d1.draft_hidden(target, block, ctx, d1.new_cache(16))
        h2 = d2.draft_hidden(target, block, ctx, d2.new_cache(16))
    torch.testing.assert_close(h2, h1, rtol=1e-6, atol=1e-6)  # identity convolutions: only the path differs
    d2.fuse_context_kv()  # as `generate.load` does: with identity convolutions the flat pass applies, same bits
    assert d2._flat_plan() is not None
    with torch.no_grad():
        flat = d2.draft_hidden(target, block, ctx, d2.new_cache(16))
        d2.flat = False
        modules = d2.draft_hidden(target, block, ctx, d2.new_cache(16))
        d2.flat = True
    assert torch.equal(flat, modules)
    for p in ([5, 17, 42, 99], [7, 8, 9, 10, 11, 12, 13]):
        assert list(generate_tokens(target, p, max_new_tokens=20, drafter=d2)) == list(
            generate_tokens(target, p, max_new_tokens=20))

    # a disk that cannot take the drafter passes: one message, training goes on, no partial file left
    def full(*_args, **_kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ts.torch, "save", full)
    args.out, args.export = str(tmp_path / "sel-full"), None
    assert ts.train_selector(args)["argmax_tf_accept"] == result["argmax_tf_accept"]
    assert "could not keep the drafter passes" in capsys.readouterr().err
    assert not list((tmp_path / "sel-full").glob("examples.pt*"))

    # --selector-ensemble: members from consecutive seeds on the same cached passes, exported as one selector
    args.out, args.export, args.selector_ensemble = str(tmp_path / "sel"), str(tmp_path / "d3"), 2
    result = ts.train_selector(args)
    assert len(result["best_epoch"]) == 2
    saved = load_file(str(tmp_path / "d3" / "model.safetensors"))
    assert saved["candidate_selector.predecessor_codebook"].shape == (256, 16)
    assert saved["candidate_selector.hidden_projection.weight"].shape[0] == 16
    log = [json.loads(x) for x in (tmp_path / "sel" / "log.jsonl").read_text().splitlines()]
    assert {r["seed"] for r in log[-6:] if "epoch" in r} == {args.seed, args.seed + 1}
    assert type(load_drafter(tmp_path / "d3")).__name__ == "DFlash2Drafter"
    args.selector_ensemble = 0
    with pytest.raises(ValueError, match="at least 1"):
        ts.train_selector(args)


def test_training_continues_from_a_dflash2_drafter(tiny_data, tmp_path):
    """A drafter with a selector trained onto it (identity convolutions, as the shipped one): `dflash train
    --init-from` it continues its drafter (exported in the first format, without the selector), `--selector
    --init-from` it trains a new selector in its place, and one whose convolutions are not the identity is a
    clear error for both."""
    from safetensors.torch import load_file, save_file

    from dflash_torch import train_selector as ts

    target_dir, out = tiny_data
    first = tmp_path / "d1"
    run_train(["--data", str(out), "--out", str(tmp_path / "run"), "--steps", "2", "--layers", "1", "--block-size",
               "8", "--seqs", "2", "--anchors", "4", "--eval-every", "0", "--export", str(first),
               "--export-dtype", "float32"])
    target = loading.load_target(target_dir, torch.device("cpu"), torch.float32)
    sel = ts.Selector(target.config.hidden_size, target.embed_tokens.weight, 4)
    sel.reset(3)
    with torch.no_grad():
        sel.successor_projection.weight.normal_()  # a selector that is not the argmax's
    two = ts.export_dflash2(first, sel, tmp_path / "d2", top_k=4, dtype="float32")
    d1, d2 = load_drafter(first), load_drafter(two)
    plain = d2.first_format()
    assert type(plain).__name__ == "DFlashDrafter"
    want = d1.state_dict()
    assert plain.state_dict().keys() == want.keys()
    assert all(torch.equal(v, want[k]) for k, v in plain.state_dict().items())

    # --steps 0: the export is the drafter as it started, in the first format
    run_train(["--data", str(out), "--out", str(tmp_path / "run2"), "--steps", "0", "--init-from", str(two),
               "--export", str(tmp_path / "d3"), "--export-dtype", "float32"])
    config = json.loads((tmp_path / "d3" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert "selector_rank" not in config["dflash_config"] and "conv_kernel_size" not in config["dflash_config"]
    saved = load_file(str(tmp_path / "d3" / "model.safetensors"))
    assert saved.keys() == load_file(str(first / "model.safetensors")).keys()
    assert all(torch.equal(v, want[k]) for k, v in saved.items())

    args = cli.build_parser().parse_args([
        "train", "--selector", "--init-from", str(two), "--data", str(out), "--out", str(tmp_path / "sel"),
        "--selector-blocks", "32", "--selector-epochs", "1", "--selector-rank", "8", "--loss-positions", "4",
        "--export", str(tmp_path / "d4"), "--export-dtype", "float32"])
    ts.train_selector(args)
    books = load_file(str(tmp_path / "d4" / "model.safetensors"))
    assert books["candidate_selector.predecessor_codebook"].shape[1] == 8  # the new selector, not the old rank 4
    assert type(load_drafter(tmp_path / "d4")).__name__ == "DFlash2Drafter"

    state = load_file(str(two / "model.safetensors"))
    state["layers.0.mlp_conv.base_kernel"][0, 1] = 0.5  # the previous position now counts
    bent = tmp_path / "d5"
    bent.mkdir()
    save_file(state, str(bent / "model.safetensors"))
    (bent / "config.json").write_text((two / "config.json").read_text())
    with pytest.raises(ValueError, match="not the identity"):
        run_train(["--data", str(out), "--out", str(tmp_path / "run5"), "--steps", "0", "--init-from", str(bent)])
    args.init_from, args.out = str(bent), str(tmp_path / "sel5")
    with pytest.raises(ValueError, match="not the identity"):
        ts.train_selector(args)


def test_mapped_features_equal_loaded(tiny_data):
    """The memory-mapped shards give exactly the rows of the features read into RAM, in any order, across
    shard boundaries; rows past the end are an error."""
    _, out = tiny_data
    _, files, _ = data.shard_index(out)
    assert len(files) > 1  # the test must cross a shard boundary
    ram, mapped = data.read_features(files), data.read_features(files, mapped=True)
    assert mapped.shape == ram.shape and mapped.dtype == ram.dtype and len(mapped) == len(ram)
    rows = torch.randperm(len(ram), generator=torch.Generator().manual_seed(0))
    assert torch.equal(mapped[rows], ram[rows])
    assert torch.equal(mapped[torch.arange(len(ram))], ram)
    with pytest.raises(IndexError):
        mapped[torch.tensor([len(ram)])]


def test_a_grown_drafter_drafts_what_it_grew_from(tiny_data, tmp_path):
    """`--init-from D --layers N` with N above D's layers: the added layers add nothing until trained, so the
    grown drafter's logits equal D's on the same batch, and the added layers get gradients; fewer is an error."""
    records, feats, target, small = _random_drafter(tiny_data, seed=5)
    small.eval()
    big = train.DFlashDrafter({**small.config, "num_hidden_layers": 4})
    assert "grown from 2 to 4" in train.grow_from(big, small)
    big.eval()
    cols = torch.arange(feats.shape[1])
    b = train.make_batch(records, feats, cols, torch.Generator().manual_seed(6), seqs=2, anchors=4, block_size=8,
                         mask_token_id=255)
    with torch.no_grad():
        want = train.block_logits(small, small, target, b, torch.device("cpu"))
    got = train.block_logits(big, big, target, b, torch.device("cpu"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.float().logsumexp(-1).sum().backward()
    assert big.layers[3].self_attn.o_proj.weight.grad.abs().sum() > 0
    # through the CLI: shrinking is refused with a message naming both counts
    export = tmp_path / "small"
    target_dir, out = tiny_data
    run_train(["--data", str(out), "--out", str(tmp_path / "run"), "--steps", "1", "--layers", "2",
               "--block-size", "8", "--seqs", "2", "--anchors", "4", "--export", str(export)])
    with pytest.raises(ValueError, match="has 2 draft layers"):
        run_train(["--data", str(out), "--out", str(tmp_path / "run2"), "--steps", "1", "--layers", "1",
                   "--init-from", str(export)])
    last = run_train(["--data", str(out), "--out", str(tmp_path / "run3"), "--steps", "1", "--layers", "3",
                      "--seqs", "2", "--anchors", "4", "--init-from", str(export), "--export", str(tmp_path / "big")])
    assert last["step"] == 1 and len(load_drafter(tmp_path / "big").layers) == 3
