"""`dflash chat`: a conversation on stdin, replies on stdout, equal to one-shot generation of the same
conversation; later turns start from the prefix cache."""

from __future__ import annotations

import io

import pytest

from dflash_torch import cli
from dflash_torch.generate import generate, load

from .server_support import make_chat_model


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("chat"))


def test_chat_turns(chat_model, monkeypatch, capsys):
    target, draft = chat_model
    turns = ["Write a haiku about rain", "", "Now one about snow", "/reset", "Write a haiku about rain", "/exit",
             "never read"]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(turns) + "\n"))
    assert cli.main(["chat", "--model", str(target), "--draft", str(draft), "--device", "cpu", "--max-tokens", "24",
                     "--system", "Be brief."]) == 0
    out, err = capsys.readouterr()
    pipe = load(str(target), str(draft), device="cpu", dtype="float32")
    messages, want = [{"role": "system", "content": "Be brief."}], []
    for text in ("Write a haiku about rain", "Now one about snow"):
        messages.append({"role": "user", "content": text})
        r = generate(pipe, pipe.encode_messages(messages), 24, use_draft=False)
        reply = pipe.decode([t for t in r.token_ids if t not in pipe.stop_token_ids])
        messages.append({"role": "assistant", "content": reply})
        want.append(reply)
    assert out.splitlines() == [want[0], want[1], want[0]]  # the third turn: after /reset, as the first
    stats = [line for line in err.splitlines() if line.startswith("dflash: ")]
    assert len(stats) == 3 and "cached" not in stats[0] and "prompt tokens cached" in stats[1]
    assert "forgotten" in err


def test_chat_refuses_what_it_cannot_do(chat_model, zlab, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("x" * 3000 + "\n/exit\n"))
    target, draft = chat_model
    assert cli.main(["chat", "--model", str(target), "--no-draft", "--device", "cpu"]) == 0
    assert "fills the model's context" in capsys.readouterr().err  # too long: said, and the chat goes on
    assert cli.main(["chat", "--model", str(zlab / "target"), "--no-draft", "--device", "cpu"]) == 2
    assert "no tokenizer" in capsys.readouterr().err
    assert cli.main(["chat", "--model", str(target), "--prefill-step-size", "0"]) == 2
    assert "--prefill-step-size must be >= 1" in capsys.readouterr().err


def test_chat_with_a_grammar_and_penalties(chat_model, monkeypatch, capsys):
    """--regex and --presence-penalty hold for every reply, as in one-shot generation."""
    from dflash_torch.decoding.sampling import Sampler

    target, draft = chat_model
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\nAgain\n"))
    assert cli.main(["chat", "--model", str(target), "--draft", str(draft), "--device", "cpu", "--max-tokens", "24",
                     "--regex", "(ab|cd)+x", "--presence-penalty", "0.5"]) == 0
    out = capsys.readouterr().out.splitlines()
    pipe = load(str(target), str(draft), device="cpu", dtype="float32")
    messages, want = [], []
    for text in ("Hello", "Again"):  # each reply: target-only one-shot generation of the conversation so far
        messages.append({"role": "user", "content": text})
        r = generate(pipe, pipe.encode_messages(messages), 24, use_draft=False,
                     grammar=("regex", "(ab|cd)+x"), sampler=Sampler(presence_penalty=0.5))
        want.append(pipe.decode(r.token_ids))
        messages.append({"role": "assistant", "content": want[-1]})
    assert out == want and all(w for w in want)
