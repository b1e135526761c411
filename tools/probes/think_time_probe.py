"""A chat with a pause before every turn, as a person types: TTFT per turn through `dflash serve`, with the
worker's idle beat (`serve/engine.py`, IDLE_BEAT_S) and without it (docs/performance.md, "A pass after an idle
gap").

Each arm is a `dflash serve` child process as a user runs it (defaults), fed the first built-in replay
conversations turn by turn (its own replies as the assistant turns), `--pause` seconds of nothing before each
request; the arms alternate `--rounds` times. Prints per turn the prompt and cached tokens and each arm's TTFT
(client side, streamed), then the medians over the turns with a prefix-cache hit, whether both arms wrote the
same replies, and the CPU time the server process used in the `--idle` seconds after its last reply (Linux
/proc: what the beat costs while nobody asks anything).

    python tools/probes/think_time_probe.py [--pause 2] [--rounds 2] [--conversations 1] [--max-tokens 128] [--idle 10]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time


def child(port: int, beat: bool) -> None:
    from dflash_torch.cli import main
    from dflash_torch.serve import engine

    if not beat:
        engine.IDLE_BEAT_FOR_S = 0.0  # the worker sleeps as soon as a request is done
    sys.argv = ["dflash", "serve", "--port", str(port)]
    main()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (Linux)."""
    import os

    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def arm(beat: bool, convs: list[dict], pause: float, max_tokens: int, idle: float) -> tuple[list[dict], float]:
    import httpx

    from dflash_torch.bench_replay import chat_turn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([sys.executable, __file__, "--child", str(port), "--beat" if beat else "--no-beat"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base, rows = f"http://127.0.0.1:{port}", []
    try:
        deadline = time.time() + 600
        while True:
            assert proc.poll() is None and time.time() < deadline, "dflash serve did not start"
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        with httpx.Client(timeout=None) as client:
            for conv in convs:
                messages = []
                for m in conv["messages"]:
                    messages.append(m)
                    if m["role"] != "user":
                        continue
                    time.sleep(pause)
                    got = chat_turn(base, messages, max_tokens, {"temperature": 0.0}, client)
                    rows.append({"conv": conv["id"], "prompt": got["prompt_tokens"], "cached": got["cached_tokens"],
                                 "ttft_ms": 1e3 * got["ttft_s"], "text": got["text"]})
                    messages.append({"role": "assistant", "content": got["text"]})
        t0 = cpu_seconds(proc.pid)
        time.sleep(idle)
        idle_cpu = cpu_seconds(proc.pid) - t0
    finally:
        proc.terminate()
        proc.wait(15)
    return rows, idle_cpu


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return child(int(sys.argv[2]), sys.argv[3] == "--beat")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pause", type=float, default=2.0, help="seconds of nothing before each request")
    ap.add_argument("--rounds", type=int, default=2, help="times each arm runs, alternating")
    ap.add_argument("--conversations", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--idle", type=float, default=10.0, help="seconds after the last reply to read CPU time over")
    a = ap.parse_args()
    from dflash_torch.bench_longctx import sharegpt_multiturn

    convs = sharegpt_multiturn(a.conversations)
    runs, idle_cpu = {True: [], False: []}, {True: [], False: []}
    for r in range(a.rounds):
        for beat in (False, True) if r % 2 == 0 else (True, False):
            rows, cpu = arm(beat, convs, a.pause, a.max_tokens, a.idle)
            runs[beat].append(rows)
            idle_cpu[beat].append(cpu)
    print(f"pause {a.pause} s before each turn, {a.rounds} rounds per arm, TTFT ms (client side)")
    print(f"{'conversation':<18} {'turn':>4} {'prompt':>6} {'cached':>6}  {'no beat':>16}  {'beat':>16}")
    same = all(x["text"] == y["text"] for b in runs.values() for run in b for x, y in zip(run, runs[False][0]))
    later = {True: [], False: []}
    for i, row in enumerate(runs[False][0]):
        cells = {}
        for beat in (False, True):
            ms = [run[i]["ttft_ms"] for run in runs[beat]]
            cells[beat] = " / ".join(f"{x:.0f}" for x in ms)
            if row["cached"]:
                later[beat].extend(ms)
        turn = sum(1 for r in runs[False][0][: i + 1] if r["conv"] == row["conv"])
        print(f"{row['conv']:<18} {turn:>4} {row['prompt']:>6} {row['cached']:>6}  "
              f"{cells[False]:>16}  {cells[True]:>16}")
    for beat in (False, True):
        print(f"{'beat' if beat else 'no beat'}: median TTFT of the turns with a prefix-cache hit "
              f"{statistics.median(later[beat]):.1f} ms over {len(later[beat])}")
    print(f"replies equal across arms and rounds: {same}")
    for beat in (False, True):
        print(f"{'beat' if beat else 'no beat'}: CPU time of the server in the {a.idle:.0f} s after its last reply: "
              + " / ".join(f"{c:.2f} s" for c in idle_cpu[beat]))


if __name__ == "__main__":
    main()
