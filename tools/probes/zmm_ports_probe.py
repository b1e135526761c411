"""How many 512-bit vector instructions this CPU retires per cycle: the bound under the block kernels'
VNNI loop (tools/kernel_ab.py times the loop itself). A dependent chain of vpdpbusd (latency 5 cycles on
Intel cores since Ice Lake) gives the clock; 12 independent vpdpbusd, then 12 independent mixed
instructions (multiplies, dpbusd, integer adds, conversions, ands) give the throughput in cycles per
instruction; broadcasts from memory beside each dpbusd show whether the loads cost vector slots.

    python tools/probes/zmm_ports_probe.py

Needs g++ and a CPU with AVX-512 VNNI. Best of 5 rounds of each loop.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = r"""
#include <chrono>
#include <cstdio>
#include <cstdint>
alignas(64) int32_t buf[64];
#define Z12 "xmm0","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9","xmm10","xmm11","xmm12","xmm13"
static double secs(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}
int main() {
  const long n = 50000000;
  double dep = 1e9, ind = 1e9, mix = 1e9, bc = 1e9;
  for (int round = 0; round < 5; round++) {
    auto t0 = std::chrono::steady_clock::now();
    __asm__ volatile("mov %0, %%rcx\n1:\n"
      "vpdpbusd %%zmm1, %%zmm2, %%zmm0\n vpdpbusd %%zmm1, %%zmm2, %%zmm0\n"
      "vpdpbusd %%zmm1, %%zmm2, %%zmm0\n vpdpbusd %%zmm1, %%zmm2, %%zmm0\n"
      "dec %%rcx\n jnz 1b\n" :: "r"(n / 4) : "rcx", "xmm0");
    auto t1 = std::chrono::steady_clock::now();
    __asm__ volatile("mov %0, %%rcx\n1:\n"
      "vpdpbusd %%zmm1, %%zmm2, %%zmm0\n vpdpbusd %%zmm1, %%zmm2, %%zmm3\n vpdpbusd %%zmm1, %%zmm2, %%zmm4\n"
      "vpdpbusd %%zmm1, %%zmm2, %%zmm5\n vpdpbusd %%zmm1, %%zmm2, %%zmm6\n vpdpbusd %%zmm1, %%zmm2, %%zmm7\n"
      "vpdpbusd %%zmm1, %%zmm2, %%zmm8\n vpdpbusd %%zmm1, %%zmm2, %%zmm9\n vpdpbusd %%zmm1, %%zmm2, %%zmm10\n"
      "vpdpbusd %%zmm1, %%zmm2, %%zmm11\n vpdpbusd %%zmm1, %%zmm2, %%zmm12\n vpdpbusd %%zmm1, %%zmm2, %%zmm13\n"
      "dec %%rcx\n jnz 1b\n" :: "r"(n / 12) : "rcx", Z12);
    auto t2 = std::chrono::steady_clock::now();
    __asm__ volatile("mov %0, %%rcx\n1:\n"
      "vmulps %%zmm1, %%zmm2, %%zmm0\n vmulps %%zmm1, %%zmm2, %%zmm3\n vcvtdq2ps %%zmm1, %%zmm4\n"
      "vaddps %%zmm1, %%zmm2, %%zmm5\n vpdpbusd %%zmm1, %%zmm2, %%zmm6\n vpdpbusd %%zmm1, %%zmm2, %%zmm7\n"
      "vpdpbusd %%zmm1, %%zmm2, %%zmm8\n vpdpbusd %%zmm1, %%zmm2, %%zmm9\n vpaddd %%zmm1, %%zmm2, %%zmm10\n"
      "vpandd %%zmm1, %%zmm2, %%zmm11\n vpsrlw $4, %%zmm1, %%zmm12\n vpandd %%zmm1, %%zmm2, %%zmm13\n"
      "dec %%rcx\n jnz 1b\n" :: "r"(n / 12) : "rcx", Z12);
    auto t3 = std::chrono::steady_clock::now();
    __asm__ volatile("mov %0, %%rcx\n mov %1, %%rdx\n1:\n"
      "vpbroadcastd 0(%%rdx), %%zmm20\n vpdpbusd %%zmm20, %%zmm2, %%zmm0\n"
      "vpbroadcastd 4(%%rdx), %%zmm21\n vpdpbusd %%zmm21, %%zmm2, %%zmm3\n"
      "vpbroadcastd 8(%%rdx), %%zmm22\n vpdpbusd %%zmm22, %%zmm2, %%zmm4\n"
      "vpbroadcastd 12(%%rdx), %%zmm23\n vpdpbusd %%zmm23, %%zmm2, %%zmm5\n"
      "vpbroadcastd 16(%%rdx), %%zmm24\n vpdpbusd %%zmm24, %%zmm2, %%zmm6\n"
      "vpbroadcastd 20(%%rdx), %%zmm25\n vpdpbusd %%zmm25, %%zmm2, %%zmm7\n"
      "vpbroadcastd 24(%%rdx), %%zmm26\n vpdpbusd %%zmm26, %%zmm2, %%zmm8\n"
      "vpbroadcastd 28(%%rdx), %%zmm27\n vpdpbusd %%zmm27, %%zmm2, %%zmm9\n"
      "vpbroadcastd 32(%%rdx), %%zmm28\n vpdpbusd %%zmm28, %%zmm2, %%zmm10\n"
      "vpbroadcastd 36(%%rdx), %%zmm29\n vpdpbusd %%zmm29, %%zmm2, %%zmm11\n"
      "dec %%rcx\n jnz 1b\n" :: "r"(n / 10), "r"(buf)
      : "rcx", "rdx", Z12, "xmm20", "xmm21", "xmm22", "xmm23", "xmm24", "xmm25", "xmm26", "xmm27", "xmm28", "xmm29");
    auto t4 = std::chrono::steady_clock::now();
    dep = secs(t0, t1) < dep ? secs(t0, t1) : dep;
    ind = secs(t1, t2) < ind ? secs(t1, t2) : ind;
    mix = secs(t2, t3) < mix ? secs(t2, t3) : mix;
    bc = secs(t3, t4) < bc ? secs(t3, t4) : bc;
  }
  const double cycle = dep / n / 5.0;  // seconds per cycle, from the chain's 5-cycle latency
  std::printf("clock about %.2f GHz (a dependent vpdpbusd chain, 5 cycles each)\n", 1e-9 / cycle);
  std::printf("12 independent vpdpbusd: %.2f cycles each\n", ind / n / cycle);
  std::printf("12 independent mixed zmm instructions: %.2f cycles each\n", mix / n / cycle);
  std::printf("vpdpbusd with a broadcast load beside each: %.2f cycles per pair\n", bc / n / cycle);
}
"""


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "ports.cpp", Path(tmp) / "ports"
        src.write_text(SOURCE)
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
