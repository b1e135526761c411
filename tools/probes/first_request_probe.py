"""The first request to a fresh `dflash serve`: how long its chat template takes inside the server and its TTFT as the
client sees it, with the template compiled before the server reports ready (the default) or not (--cold-template:
the engine's warm-up call is skipped, so the first request compiles it). The server runs as a child process with a
timer around `Engine.encode`; the request is the first turn of the first built-in replay conversation, 32 tokens.

    python tools/probes/first_request_probe.py [--cold-template] [--starts 2]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time


def child(port: int, cold: bool) -> None:
    from dflash_torch.cli import main
    from dflash_torch.generate import Pipeline
    from dflash_torch.serve import engine

    encode = engine.Engine.encode

    def timed(self, *a, **k):
        t = time.perf_counter()
        out = encode(self, *a, **k)
        print(f"ENCODE {1e3 * (time.perf_counter() - t):.2f} ms", file=sys.stderr, flush=True)
        return out

    engine.Engine.encode = timed
    if cold:  # the warm-up is the first encode_messages call, made before the server is ready: skip it
        messages, calls = Pipeline.encode_messages, []

        def skip_first(self, *a, **k):
            calls.append(1)
            return [] if len(calls) == 1 else messages(self, *a, **k)

        Pipeline.encode_messages = skip_first
    sys.exit(main(["serve", "--port", str(port)]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cold-template", action="store_true")
    ap.add_argument("--starts", type=int, default=2, help="fresh servers, one first request each")
    ap.add_argument("--port", type=int, default=8938)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.port, args.cold_template)
    from dflash_torch.bench_longctx import sharegpt_multiturn
    from dflash_torch.bench_replay import chat_turn

    first = [next(m for m in sharegpt_multiturn(1)[0]["messages"] if m["role"] == "user")]
    for _ in range(args.starts):
        cmd = [sys.executable, __file__, "--child", "--port", str(args.port)] + (
            ["--cold-template"] if args.cold_template else [])
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        try:
            for line in proc.stderr:
                if "ready on http" in line:
                    break
            got = chat_turn(f"http://127.0.0.1:{args.port}", first, 32, {"temperature": 0.0})
        finally:
            proc.terminate()
            _, rest = proc.communicate(timeout=60)
        encode = next((line.split()[1] for line in rest.splitlines() if line.startswith("ENCODE")), "?")
        print(f"template {'cold' if args.cold_template else 'compiled at start'}: first request's template "
              f"{encode} ms inside the server, TTFT {1e3 * got['ttft_s']:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
