"""Many different requests to one running `dflash serve`: does every one succeed, and does the server's memory settle?

State that grows with use (kept embedding rows, the prefix cache, the datastore's history) only shows its limits after
many requests: a row cache that evicted a row the same lookup still needed failed requests after about 3,600
distinct tokens had been embedded. Start the server, then:

    python -m dflash_torch.cli serve --port 8790 &
    python tools/probes/soak_probe.py http://127.0.0.1:8790 --requests 300 --pid $!

Prompts are ShareGPT training-split first turns (never the held-out ones), sent in turn as a plain chat
completion, a streamed one and an Anthropic message. Prints failures as they happen and, with --pid, the server's
resident memory every 50 requests.
"""

from __future__ import annotations

import argparse
import sys
import time

import httpx

from dflash_torch.data import sharegpt_prompts


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def send(client: httpx.Client, base: str, i: int, msgs: list[dict], max_tokens: int) -> None:
    """One request in the i-th dialect; raises on anything but a complete, successful reply."""
    if i % 3 == 0:
        r = client.post(base + "/v1/chat/completions", json={"messages": msgs, "max_tokens": max_tokens})
        r.raise_for_status()
        assert r.json()["choices"][0]["message"]["content"] is not None
    elif i % 3 == 1:
        body = {"messages": msgs, "max_tokens": max_tokens, "stream": True}
        with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            lines = [line for line in r.iter_lines() if line]
        if lines[-1] != "data: [DONE]" or any('"error"' in line for line in lines):
            raise RuntimeError(f"stream ended with {lines[-1][:200]!r}")
    else:
        body = {"model": "default", "messages": msgs, "max_tokens": max_tokens}
        r = client.post(base + "/v1/messages", json=body)
        r.raise_for_status()
        assert r.json()["type"] == "message"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", help="the server's base URL")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--skip", type=int, default=0, help="training-split prompts to pass over")
    ap.add_argument("--pid", type=int, default=None, help="the server's process id, for its memory")
    args = ap.parse_args()
    prompts = sharegpt_prompts("train", limit=args.skip + args.requests)[args.skip :]
    failed, t0 = 0, time.time()
    with httpx.Client(timeout=300) as client:
        for i, msgs in enumerate(prompts):
            try:
                send(client, args.base, i, msgs, args.max_tokens)
            except Exception as e:  # noqa: BLE001 - every kind of failure is what is counted
                failed += 1
                print(f"request {i}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            if args.pid and (i + 1) % 50 == 0:
                print(f"{i + 1} requests, {failed} failed, server RSS {rss_mb(args.pid):.0f} MB, "
                      f"{time.time() - t0:.0f} s", flush=True)
    print(f"done: {len(prompts)} requests, {failed} failed, {time.time() - t0:.0f} s")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
