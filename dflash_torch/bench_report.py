"""What `dflash bench` writes: the terminal table, summary.md, results.json and the plots."""


from __future__ import annotations

import json
import sys
from pathlib import Path

PEER_FIELDS = {"hf": "hf_tok_s", "hf_prompt_lookup": "hf_prompt_lookup_tok_s", "llamacpp": "llamacpp_tok_s"}


def table_rows(results: dict) -> tuple[list[str], list[list[str]]]:
    """(header, cells) of the summary table, shared by the terminal and summary.md."""
    peers = [k for k in PEER_FIELDS.values() if any(r.get(k) is not None for r in results["runs"])]
    header = ["Suite", "Max tokens", "Prompts", "Baseline tok/s", "DFlash tok/s", "Speedup", "Accept len",
              "Accept rate", "TTFT ms", "Peak MB"]
    lookup = any(r.get("lookup_passes") for r in results["runs"])
    header += ["From lookup"] if lookup else []
    store = any(r.get("datastore_passes") for r in results["runs"])
    header += ["From datastore"] if store else []  # the drafter's stock phrases (decoding/datastore.py)
    prefill = any(r.get("prefill_tok_s") is not None for r in results["runs"])
    header += ["Prefill tok/s"] if prefill else []
    quarters = any(r.get("acceptance_length_first_quarter") is not None for r in results["runs"])
    header += ["Accept len Q1/Q4"] if quarters else []  # the first and the last quarter of the output
    widths = any(r.get("verify_widths") for r in results["runs"])
    header += ["Widths"] if widths else []  # verify passes by width, most used first
    header += [{"hf_tok_s": "HF tok/s", "hf_prompt_lookup_tok_s": "HF PLD tok/s",
                "llamacpp_tok_s": "llama.cpp tok/s"}[k] for k in peers]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    cells = []
    for r in results["runs"]:
        cells.append([
            r["suite"], str(r["max_tokens"]), str(r["prompts"]), fmt(r["baseline_tok_s"], ".1f"),
            fmt(r["dflash_tok_s"], ".1f"), fmt(r["speedup"], ".2f") + ("x" if r["speedup"] is not None else ""),
            fmt(r["acceptance_length_mean"], ".2f"),
            fmt(None if r["acceptance_rate"] is None else 100 * r["acceptance_rate"], ".0f")
            + ("%" if r["acceptance_rate"] is not None else ""),
            fmt(None if r["ttft_s"] is None else 1000 * r["ttft_s"], ".0f"), fmt(r["peak_memory_mb"], ".0f"),
        ] + ([fmt(None if r.get("lookup_accepted_share") is None else 100 * r["lookup_accepted_share"], ".0f")
              + ("%" if r.get("lookup_accepted_share") is not None else "")] if lookup else [])
          + ([fmt(None if r.get("datastore_accepted_share") is None else 100 * r["datastore_accepted_share"], ".0f")
              + ("%" if r.get("datastore_accepted_share") is not None else "")] if store else [])
          + ([fmt(r.get("prefill_tok_s"), ".0f")] if prefill else [])
          + ([f"{fmt(r.get('acceptance_length_first_quarter'), '.2f')}/"
              f"{fmt(r.get('acceptance_length_last_quarter'), '.2f')}"] if quarters else [])
          + ([_widths_cell(r.get("verify_widths") or {})] if widths else [])
          + [fmt(r[k], ".1f") for k in peers])
    return header, cells


def _widths_cell(widths: dict[str, int], top: int = 3) -> str:
    """'1:1786 2:377 4:143 ...': the most used verify widths with their pass counts."""
    ranked = sorted(widths.items(), key=lambda kv: -kv[1])
    cell = " ".join(f"{w}:{n}" for w, n in ranked[:top])
    return (cell + " ...") if len(ranked) > top else (cell or "-")


def _title(results: dict) -> str:
    m, s = results["machine"], results["settings"]
    mode = "greedy" if s["sampling"]["temperature"] == 0 else f"temperature {s['sampling']['temperature']}"
    weights = f", {m['quantize']} weights" if m.get("quantize") else ""
    if m.get("quantize") and m.get("lm_head") != m["quantize"]:
        weights += f", LM head {m.get('lm_head') or 'not quantized'}"
    return (f"{results['model']['name']} on {m['device']} ({m['dtype']}{weights}), {mode}, "
            f"median of {s['repeats']} repeat(s)")


def show_table(results: dict, to_stderr: bool = False) -> None:
    """The results table on the terminal (rich when installed, plain text otherwise)."""
    header, cells = table_rows(results)
    stream = sys.stderr if to_stderr else sys.stdout
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(_title(results), file=stream)
        print(_markdown_table(header, cells), file=stream)
    else:
        table = Table(title=_title(results))
        for i, h in enumerate(header):
            table.add_column(h, justify="left" if i == 0 else "right")
        for c in cells:
            table.add_row(*c)
        # rich falls back to 80 columns off a terminal, which truncates the headers; logs can be wider
        Console(file=stream, width=None if stream.isatty() else 160).print(table)
    if results["note"]:
        print(f"note: {results['note']}", file=stream)


def _markdown_table(header: list[str], cells: list[list[str]]) -> str:
    align = "|" + "|".join("---" if i == 0 else "--:" for i in range(len(header))) + "|"
    lines = ["| " + " | ".join(header) + " |", align]
    return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in cells])


def summary_markdown(results: dict) -> str:
    """summary.md: the table, the command that produced it, and what it ran on."""
    header, cells = table_rows(results)
    m = results["machine"]
    lines = [
        "# dflash bench", "", _title(results), "", "```", results["command"], "```", "",
        f"Model: `{results['model']['path']}`; drafter: `{results['model']['draft'] or 'none'}`.  ",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads), "
        f"device {m['device']}, {m['dtype']}; memory is {m['memory']}.", "",
        _markdown_table(header, cells), "",
        "Decode tok/s excludes the prefill (TTFT is the time to the first token). Acceptance length is the tokens "
        "committed per verify pass, bonus token included.",
    ]
    if results["note"]:
        lines += ["", f"**Note:** {results['note']}."]
    for peer, why in results["settings"]["peers_skipped"].items():
        lines += ["", f"Peer {peer} skipped: {why}."]
    mismatch = [f"{r['suite']} @ {r['max_tokens']}" for r in results["runs"] if r["outputs_match"] is False]
    if mismatch:
        lines += ["", f"**Warning:** DFlash output differed from target-only output for {', '.join(mismatch)}."]
    lines += ["", "![throughput](throughput.png)", "", "![acceptance](acceptance.png)", ""]
    return "\n".join(lines)


def write_json(out_dir: Path, results: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(out_dir / "results.json")


def write_plots(results: dict, out_dir: Path, log) -> None:
    """throughput.png (tok/s and speedup vs generation length) and acceptance.png (by block position)."""
    try:
        import matplotlib
    except ImportError:
        log("matplotlib is not installed, so no plots (pip install 'dflash-torch[bench]')")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    suites = list(dict.fromkeys(r["suite"] for r in runs))
    colors = {s: f"C{i}" for i, s in enumerate(suites)}
    lengths = sorted({r["max_tokens"] for r in runs})

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8), sharex=True)  # shared: the empty panel keeps the ticks
    has_speedup = False
    styles = [("dflash_tok_s", "DFlash", "-", "o"), ("baseline_tok_s", "target-only", "--", "s"),
              ("hf_tok_s", "HF generate", ":", "^"), ("hf_prompt_lookup_tok_s", "HF prompt lookup", ":", "v"),
              ("llamacpp_tok_s", "llama.cpp", "-.", "D")]
    for s in suites:
        rs = sorted((r for r in runs if r["suite"] == s), key=lambda r: r["max_tokens"])
        for key, label, ls, marker in styles:
            pts = [(r["max_tokens"], r[key]) for r in rs if r.get(key) is not None]
            if pts:
                ax1.plot(*zip(*pts), ls, marker=marker, color=colors[s], label=f"{s} {label}")
        pts = [(r["max_tokens"], r["speedup"]) for r in rs if r["speedup"] is not None]
        if pts:
            ax2.plot(*zip(*pts), "-o", color=colors[s], label=s)
            has_speedup = True
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.minorticks_off()
        ax.set_xlabel("max tokens generated")
        ax.grid(alpha=0.3)
    ax1.set_ylabel("decode tokens / s")
    ax1.set_title("Decode throughput")
    ax1.set_ylim(bottom=0)
    ax1.legend(fontsize=8)
    ax2.set_ylabel("speedup over target-only")
    ax2.set_title("DFlash speedup")
    ax2.axhline(1.0, color="grey", lw=1)
    if has_speedup:
        ax2.legend(fontsize=8)
    else:
        ax2.text(0.5, 0.5, results["note"] or "no DFlash runs", ha="center", va="center", transform=ax2.transAxes,
                 wrap=True)
    fig.suptitle(_title(results), fontsize=10)
    fig.tight_layout()
    fig.savefig(out_dir / "throughput.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    plotted = False
    for s in suites:  # pooled over lengths: per-position acceptance hardly depends on the length
        drafted, accepted, passes, committed = [], [], 0, 0.0
        for r in runs:
            if r["suite"] != s or r["acceptance_length_mean"] is None:
                continue
            passes += r["verify_passes"]
            committed += r["acceptance_length_mean"] * r["verify_passes"]
            for k, (rate, d) in enumerate(zip(r["acceptance_per_position"], r["drafted_per_position"])):
                if k == len(drafted):
                    drafted.append(0)
                    accepted.append(0.0)
                drafted[k] += d
                accepted[k] += rate * d
        if drafted:
            rates = [a / d if d else 0.0 for a, d in zip(accepted, drafted)]
            label = f"{s} (mean acceptance length {committed / passes:.2f})" if passes else s
            ax.plot(range(1, len(rates) + 1), rates, "-o", color=colors[s], label=label)
            plotted = True
    ax.set_xlabel("position in the drafted block (1 = first drafted token)")
    ax.set_ylabel("share of blocks accepting this position")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title("Draft acceptance by position", fontsize=11)
    if plotted:
        ax.legend(fontsize=8)
        ax.xaxis.get_major_locator().set_params(integer=True)
    else:
        ax.text(0.5, 0.5, results["note"] or "no drafted tokens", ha="center", va="center", transform=ax.transAxes,
                wrap=True)
        ax.set_xticks([])
    fig.tight_layout()
    fig.savefig(out_dir / "acceptance.png", dpi=110)
    plt.close(fig)


# --- CLI ----------------------------------------------------------------------------------------
