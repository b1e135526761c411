"""Decode tok/s of running `dflash serve` processes, requests sent to them in turn (one busy at a time).

Start the servers to compare first, e.g. two revisions side by side:

    git worktree add /tmp/old REV
    (cd /tmp/old && python -m dflash_torch.cli serve --no-draft --port 8781 &)
    python -m dflash_torch.cli serve --no-draft --port 8782 &
    python tools/probes/serve_rate_probe.py http://127.0.0.1:8781 http://127.0.0.1:8782 --rounds 5

Each round sends every server the same greedy request, plain and then streamed, and reads the request's
decode tok/s from the server's own `/metrics?format=json` (`recent`). Prints each server's rates and median.
"""

from __future__ import annotations

import argparse
import statistics

import httpx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bases", nargs="+", help="server base URLs")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--prompt", default="Write a long story about a robot.")
    args = ap.parse_args()
    body = {"model": "default", "messages": [{"role": "user", "content": args.prompt}],
            "max_tokens": args.max_tokens, "temperature": 0}
    rates: dict[str, list[float]] = {b: [] for b in args.bases}
    with httpx.Client(timeout=None) as client:
        for _ in range(args.rounds):
            for base in args.bases:
                for stream in (False, True):
                    if stream:
                        with client.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True}) as r:
                            for _ in r.iter_lines():
                                pass
                    else:
                        client.post(base + "/v1/chat/completions", json=body).raise_for_status()
                    recent = client.get(base + "/metrics", params={"format": "json"}).json()["recent"]
                    rates[base].append(recent[-1]["decode_tok_s"])
    for base, r in rates.items():
        print(f"{base}: median {statistics.median(r):.1f} tok/s  ({', '.join(f'{x:.1f}' for x in r)})")


if __name__ == "__main__":
    main()
