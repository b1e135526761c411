"""What a 512-bit VNNI loop's other instructions cost beside its dpbusd: the bound under the block kernels'
16-row loop (tools/kernel_ab.py times the loop itself). A dependent chain of scalar adds (one cycle each on
every x86 core) gives the clock; 16 independent vpdpbusd give their throughput; then the same 16 with 4 more
instructions of one kind (independent of everything) give that kind's cost in cycles, over what the 16 take
alone: about 1 where it runs on the ports dpbusd needs, about 0 where it runs beside them. Broadcasts of an
activation from memory are timed as a separate vpbroadcastd before each dpbusd and folded into its operand.

    python tools/probes/zmm_ports_probe.py

Needs g++ and a CPU with AVX-512 VNNI. Best of 9 rounds of each loop.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

DP = "vpdpbusd %zmm{w}, %zmm{u}, %zmm{a}"
# the companions: 4 of each beside 16 dpbusd (zmm24-31 their own registers, so nothing waits on them)
COMPANIONS = {
    "vmulps": "vmulps %zmm16, %zmm17, %zmm{t}",
    "vfmadd231ps": "vfmadd231ps %zmm16, %zmm17, %zmm{t}",
    "vaddps": "vaddps %zmm16, %zmm17, %zmm{t}",
    "vcvtdq2ps": "vcvtdq2ps %zmm16, %zmm{t}",
    "vpaddd": "vpaddd %zmm16, %zmm17, %zmm{t}",
    "vpandd": "vpandd %zmm16, %zmm17, %zmm{t}",
    "vpsrlw": "vpsrlw $4, %zmm16, %zmm{t}",
    "vpxord": "vpxord %zmm16, %zmm17, %zmm{t}",
    "vinserti64x4 (m256)": "vinserti64x4 $1, 64(%rsi), %zmm16, %zmm{t}",
    "vcvtph2ps (ymm)": "vcvtph2ps %ymm16, %zmm{t}",
    "vpbroadcastd (m32)": "vpbroadcastd 4(%rsi), %zmm{t}",
}


def loop(body: list[str]) -> str:
    text = "\\n\\t".join(b.replace("%", "%%").replace("{", "%{").replace("}", "%}") for b in body)
    return f'"1:\\n\\t{text}\\n\\tdec %0\\n\\tjnz 1b"'


def kernels() -> list[tuple[str, str, int]]:
    """(name, asm loop, instructions per iteration) of each timed loop."""
    dps = [DP.format(w=16 + r % 8, u=16 + (r + 3) % 8, a=r) for r in range(16)]
    out = [("dpbusd", loop(dps), 16)]
    for name, ins in COMPANIONS.items():
        body = []
        for r in range(16):
            body.append(dps[r])
            if r % 4 == 3:
                body.append(ins.format(t=24 + r // 4))
        out.append((name, loop(body), 4))
    out.append(("vpbroadcastd (m32) feeding each dpbusd",
                loop(sum(([f"vpbroadcastd {4 * r}(%rsi), %zmm{24 + r % 8}",
                           DP.format(w=24 + r % 8, u=16 + r % 8, a=r)] for r in range(16)), [])), 16))
    out.append(("dpbusd {1to16} (m32) folded",
                loop([f"vpdpbusd {4 * r}(%rsi){{1to16}}, %zmm{16 + r % 8}, %zmm{r}" for r in range(16)]), 16))
    return out


def source() -> str:
    clobbers = ", ".join(f'"xmm{i}"' for i in range(32))
    lines = ["#include <chrono>", "#include <cstdio>", "#include <cstdint>",
             "alignas(64) static int32_t buf[64];",
             "static double now() { return std::chrono::duration<double>("
             "std::chrono::steady_clock::now().time_since_epoch()).count(); }",
             "static double run_clock(long n) { double t = now(); long x = 0;",
             '  asm volatile("1:\\n\\t" ' + '"add $1, %1\\n\\t" ' * 4 + '"dec %0\\n\\tjnz 1b"',
             '    : "+r"(n), "+r"(x)); return now() - t; }']
    ks = kernels()
    for i, (_, asm, _) in enumerate(ks):
        lines.append(f"static double run{i}(long n) {{ double t = now(); const int32_t* x = buf;"
                     f" asm volatile({asm} : \"+r\"(n) : \"S\"(x) : \"memory\", {clobbers}); return now() - t; }}")
    lines.append("int main() {")
    lines.append(f"  const long n = 4000000; double clk = 1e9, t[{len(ks)}];")
    lines.append(f"  for (int i = 0; i < {len(ks)}; i++) t[i] = 1e9;")
    lines.append("  for (int round = 0; round < 9; round++) {")
    lines.append("    double c = run_clock(4 * n) / (16.0 * n); if (c < clk) clk = c;")
    for i in range(len(ks)):
        lines.append(f"    {{ double v = run{i}(n); if (v < t[{i}]) t[{i}] = v; }}")
    lines.append("  }")
    lines.append('  std::printf("clock about %.2f GHz (a dependent chain of scalar adds)\\n", 1e-9 / clk);')
    lines.append('  const double base = t[0] / n / clk;')
    lines.append('  std::printf("16 independent vpdpbusd: %.2f cycles each\\n", base / 16);')
    for i, (name, _, per) in enumerate(ks[1:], start=1):
        if name.startswith("vpbroadcastd (m32) feeding") or name.startswith("dpbusd {1to16}"):
            lines.append(f'  std::printf("16 vpdpbusd, {name}: %.2f cycles each\\n", t[{i}] / n / clk / 16);')
        else:
            lines.append(f'  std::printf("16 vpdpbusd + 4 {name}: %.2f cycles more per {name}\\n",'
                         f" (t[{i}] / n / clk - base) / {per});")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "ports.cpp", Path(tmp) / "ports"
        src.write_text(source())
        try:
            subprocess.run(["g++", "-O2", "-mavx512f", str(src), "-o", str(exe)], check=True)
        except (OSError, subprocess.CalledProcessError) as e:
            sys.exit(f"zmm_ports_probe: could not compile with g++ ({e})")
        result = subprocess.run([str(exe)], capture_output=True, text=True)
        if result.returncode != 0:  # SIGILL: no AVX-512 VNNI here
            sys.exit(f"zmm_ports_probe: the loops did not run (exit {result.returncode}; AVX-512 VNNI needed)")
        print(result.stdout, end="")


if __name__ == "__main__":
    main()
