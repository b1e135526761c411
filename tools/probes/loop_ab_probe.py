"""The decoding loop and the target's flat path of a git revision against the working tree's, on ONE model instance
(two instances of the same weights differ by a few percent in speed, by where their memory lies), in alternation:
short generations, target-only then the loop `dflash serve` runs (drafter, prompt lookup, datastore, adaptive width,
fallback; each side with its own controllers carried from generation to generation), the order swapped every round;
decode seconds per token, the median over rounds of each round's new / old ratio, and every output compared.

The revision's package is exported (`git archive`) under another name into a temporary directory; its
`decoding/` runs on the working tree's model, whose `Model._flat` is swapped for the revision's (same attributes
assumed) while the revision's side runs. `--same` runs the working tree against itself (an A/A run: the harness's
own noise).

    python tools/probes/loop_ab_probe.py c8e5111 --tokens 64 --rounds 40
    python tools/probes/loop_ab_probe.py c8e5111 --same
"""

from __future__ import annotations

import argparse
import importlib
import io
import statistics
import subprocess
import sys
import tarfile
import tempfile
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dflash_torch import kernels  # noqa: E402
from dflash_torch.bench_prompts import collect_prompts, encode  # noqa: E402
from dflash_torch.generate import load  # noqa: E402

OLD = "dflash_rev"


def export(rev: str, into: Path) -> None:
    """The revision's dflash_torch/ as the package OLD under `into`, its imports renamed."""
    data = subprocess.check_output(["git", "archive", rev, "dflash_torch"], cwd=ROOT)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    (into / "dflash_torch").rename(into / OLD)
    for f in (into / OLD).rglob("*.py"):
        f.write_text(f.read_text().replace("dflash_torch", OLD))


def side(pkg: str, p) -> dict:
    mods = {m: importlib.import_module(f"{pkg}.decoding.{m}") for m in ("speculative", "adaptive", "fallback")}
    new_adaptive = importlib.import_module("dflash_torch.decoding.adaptive")
    mods["controller"] = mods["adaptive"].AdaptiveBlockSize(dict(new_adaptive.calibrated(p)), p.drafter.block_size)
    mods["carry"], mods["costs"] = None, importlib.import_module(f"{pkg}.decoding.lookup").VerifyCosts()
    return mods


def run(s: dict, p, ids: list[int], tokens: int, spec: bool) -> tuple[list[int], float]:
    sp = s["speculative"]
    stats = sp.Stats()
    if spec:
        fb = s["fallback"].FallbackController(carried=s["carry"])
        out = list(sp.generate_tokens(p.target, ids, max_new_tokens=tokens, drafter=p.drafter, stop_token_ids=[],
                                      stats=stats, controller=s["adaptive"].WithFallback(fb, s["controller"]),
                                      lookup=True, lookup_costs=s["costs"]))
        s["carry"] = fb.carry()
    else:
        out = list(sp.generate_tokens(p.target, ids, max_new_tokens=tokens, stop_token_ids=[], stats=stats))
    return out, stats.decode_s / (tokens - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--same", action="store_true", help="the working tree on both sides (A/A)")
    a = ap.parse_args()
    if a.tokens < 2 or a.rounds < 3:
        sys.exit("loop_ab_probe: --tokens >= 2 and --rounds >= 3")
    torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    kernels.ensure()
    tmp = Path(tempfile.mkdtemp())
    export(a.rev, tmp)
    sys.path.insert(0, str(tmp))
    importlib.import_module(f"{OLD}.kernels")._state["backend"] = "compiled"  # the working tree's ops serve both
    p = load(draft="auto", quantize="auto", quiet=True)
    t = p.target
    new_flat = t._flat
    old_flat = types.MethodType(importlib.import_module(f"{OLD}.models.llama").Model._flat, t)
    sides = {"new": side("dflash_torch", p), "old": side("dflash_torch" if a.same else OLD, p)}

    def use(name: str) -> None:
        if name == "old" and not a.same:
            t._flat = old_flat
            t.flat_serves = lambda: False  # (the revision's loop calls the target; the new one would call _flat)
        else:
            t._flat = new_flat
            t.__dict__.pop("flat_serves", None)

    prompts = [encode(p, pr) for ps in collect_prompts("all", None, 1).values() for pr in ps[:1]]
    r = {k: [] for k in ("new0", "old0", "new1", "old1")}
    for rnd in range(a.rounds):
        ids = prompts[rnd % len(prompts)]
        for name in ("new", "old") if rnd % 2 else ("old", "new"):
            use(name)
            plain, s0 = run(sides[name], p, ids, a.tokens, False)
            spec, s1 = run(sides[name], p, ids, a.tokens, True)
            if plain != spec:
                sys.exit(f"loop_ab_probe: {name}: speculative output differs from target-only output")
            if rnd >= 2:  # the first two rounds warm the controllers
                r[name + "0"].append(s0)
                r[name + "1"].append(s1)
    use("new")
    ms = {k: statistics.median(v) * 1e3 for k, v in r.items()}
    ratio = {i: statistics.median([x / y for x, y in zip(r[f"new{i}"], r[f"old{i}"])]) for i in (0, 1)}
    print(f"{a.rev}{' (A/A)' if a.same else ''}, {a.tokens} tokens, {a.rounds - 2} rounds, ms per token: target-only "
          f"old {ms['old0']:.3f} new {ms['new0']:.3f} (new/old {ratio[0]:.3f}); DFlash old {ms['old1']:.3f} new "
          f"{ms['new1']:.3f} (new/old {ratio[1]:.3f}); speedup old {ms['old0'] / ms['old1']:.3f} new "
          f"{ms['new0'] / ms['new1']:.3f}; every output equal")


if __name__ == "__main__":
    main()
