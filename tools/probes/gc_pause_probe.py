"""Full garbage collections inside `dflash serve`, with and without the heap frozen after loading.

A loaded pipeline (torch, transformers, FastAPI, the model's modules) leaves ~190k objects on the heap. A full
(generation 2) collection walks them all (~70-100 ms on a 2-core CPU), and a server allocates enough over its
requests to run one now and then: a pause in the middle of a request's prefill or decode. `dflash serve` therefore
freezes the heap once loaded (`generate.freeze_heap`). This probe starts the server as a child process (with a
`gc.callbacks` hook that logs every full collection, and with `--no-freeze` the freeze switched off), replays the
built-in multi-turn conversations through it (`bench_replay.chat_turn`), and reports the full collections after the
server was ready and their pauses.

    python tools/probes/gc_pause_probe.py [--conversations 2] [--max-tokens 256] [--no-freeze]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time


def child(port: int, freeze: bool) -> None:
    import gc

    started = [0.0]

    def watch(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                print(f"GC2 {1e3 * (time.perf_counter() - started[0]):.1f} ms", file=sys.stderr, flush=True)

    gc.callbacks.append(watch)
    from dflash_torch.cli import main
    from dflash_torch.serve import app

    if not freeze:
        app.freeze_heap = lambda: None
    sys.exit(main(["serve", "--port", str(port)]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--no-freeze", action="store_true")
    ap.add_argument("--port", type=int, default=8937)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.port, not args.no_freeze)
    import httpx

    from dflash_torch.bench_longctx import sharegpt_multiturn
    from dflash_torch.bench_replay import chat_turn

    cmd = [sys.executable, __file__, "--child", "--port", str(args.port)] + (["--no-freeze"] if args.no_freeze else [])
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{args.port}"
    lines: list[str] = []
    try:
        for line in proc.stderr:  # the server's log: wait for "ready", counting the collections before it
            lines.append(line)
            if "ready on http" in line:
                break
        turns = 0
        with httpx.Client(timeout=None) as client:
            for conv in sharegpt_multiturn(args.conversations):
                messages = []
                for m in conv["messages"]:
                    messages.append(m)
                    got = chat_turn(base, messages, args.max_tokens, {"temperature": 0.0}, client)
                    messages.append({"role": "assistant", "content": got["text"]})
                    turns += 1
    finally:
        proc.terminate()
        _, rest = proc.communicate(timeout=60)
    pauses = [float(line.split()[1]) for line in rest.splitlines() if line.startswith("GC2")]  # after "ready"
    print(f"heap {'as loaded' if args.no_freeze else 'frozen'}: {turns} turns served; {len(pauses)} full collections "
          f"after ready, {sum(pauses):.0f} ms in all ({', '.join(f'{p:.0f}' for p in pauses) or '-'} ms)")


if __name__ == "__main__":
    main()
