// Throughput of the instructions of the 256-bit VNNI rows' loop, dependency-free, in registers (no data
// matters). Build and run: g++ -O2 -o dpbusd_ports dpbusd_ports.cpp && ./dpbusd_ports (output: dpbusd_ports.txt).
// "ns per instruction" of N independent instructions of one kind is 1 / (their issue rate x the clock); the
// latency line times a chain of dependent dpbusd.
#include <chrono>
#include <cstdio>

template <class F> void timed(const char* name, int per_iter, F body) {
  const long n = 20000000;
  const auto t = std::chrono::steady_clock::now();
  for (long k = 0; k < n; k++) body();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  std::printf("%-40s %.3f ns per instruction\n", name, s / n / per_iter * 1e9);
}

int main() {
  asm volatile("vpxor %%ymm14, %%ymm14, %%ymm14\n\tvpxor %%ymm15, %%ymm15, %%ymm15" ::: "xmm14", "xmm15");
  timed("dependent chain of vpdpbusd ymm (latency)", 4, [] {
    asm volatile(
        "vpdpbusd %%ymm14, %%ymm15, %%ymm0\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm0\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm0\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm0\n\t"
        ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
  });
  timed("12 independent vpdpbusd ymm", 12, [] {
    asm volatile(
        "vpdpbusd %%ymm14, %%ymm15, %%ymm0\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm1\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm2\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm3\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm4\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm5\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm6\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm7\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm8\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm9\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm10\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm11\n\t"
        ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
  });
  timed("12 independent vpdpbusd zmm", 12, [] {
    asm volatile(
        "vpdpbusd %%zmm14, %%zmm15, %%zmm0\n\t"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm1\n\t"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm2\n\t"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm3\n\t"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm4\n\t"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm5\n\t"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm6\n\t"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm7\n\t"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm8\n\t"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm9\n\t"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm10\n\t"
        "vpdpbusd %%zmm14, %%zmm15, %%zmm11\n\t"
        ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
  });
  timed("12 independent vmulps ymm", 12, [] {
    asm volatile(
        "vmulps %%ymm14, %%ymm15, %%ymm0\n\t"
        "vmulps %%ymm14, %%ymm15, %%ymm1\n\t"
        "vmulps %%ymm14, %%ymm15, %%ymm2\n\t"
        "vmulps %%ymm14, %%ymm15, %%ymm3\n\t"
        "vmulps %%ymm14, %%ymm15, %%ymm4\n\t"
        "vmulps %%ymm14, %%ymm15, %%ymm5\n\t"
        "vmulps %%ymm14, %%ymm15, %%ymm6\n\t"
        "vmulps %%ymm14, %%ymm15, %%ymm7\n\t"
        "vmulps %%ymm14, %%ymm15, %%ymm8\n\t"
        "vmulps %%ymm14, %%ymm15, %%ymm9\n\t"
        "vmulps %%ymm14, %%ymm15, %%ymm10\n\t"
        "vmulps %%ymm14, %%ymm15, %%ymm11\n\t"
        ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
  });
  timed("8 vpdpbusd + 4 vmulps", 12, [] {
    asm volatile(
        "vpdpbusd %%ymm14, %%ymm15, %%ymm0\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm1\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm2\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm3\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm4\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm5\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm6\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm7\n\t"
        "vmulps %%ymm14, %%ymm15, %%ymm8\n\t"
        "vmulps %%ymm14, %%ymm15, %%ymm9\n\t"
        "vmulps %%ymm14, %%ymm15, %%ymm10\n\t"
        "vmulps %%ymm14, %%ymm15, %%ymm11\n\t"
        ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
  });
  timed("8 vpdpbusd + 4 vfmadd231ps", 12, [] {
    asm volatile(
        "vpdpbusd %%ymm14, %%ymm15, %%ymm0\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm1\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm2\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm3\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm4\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm5\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm6\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm7\n\t"
        "vfmadd231ps %%ymm14, %%ymm15, %%ymm8\n\t"
        "vfmadd231ps %%ymm14, %%ymm15, %%ymm9\n\t"
        "vfmadd231ps %%ymm14, %%ymm15, %%ymm10\n\t"
        "vfmadd231ps %%ymm14, %%ymm15, %%ymm11\n\t"
        ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
  });
  timed("8 vpdpbusd + 4 vaddps", 12, [] {
    asm volatile(
        "vpdpbusd %%ymm14, %%ymm15, %%ymm0\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm1\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm2\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm3\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm4\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm5\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm6\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm7\n\t"
        "vaddps %%ymm14, %%ymm15, %%ymm8\n\t"
        "vaddps %%ymm14, %%ymm15, %%ymm9\n\t"
        "vaddps %%ymm14, %%ymm15, %%ymm10\n\t"
        "vaddps %%ymm14, %%ymm15, %%ymm11\n\t"
        ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
  });
  timed("8 vpdpbusd + 4 vcvtdq2ps", 12, [] {
    asm volatile(
        "vpdpbusd %%ymm14, %%ymm15, %%ymm0\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm1\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm2\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm3\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm4\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm5\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm6\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm7\n\t"
        "vcvtdq2ps %%ymm14, %%ymm8\n\t"
        "vcvtdq2ps %%ymm14, %%ymm9\n\t"
        "vcvtdq2ps %%ymm14, %%ymm10\n\t"
        "vcvtdq2ps %%ymm14, %%ymm11\n\t"
        ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
  });
  timed("8 vpdpbusd + 4 vpaddd", 12, [] {
    asm volatile(
        "vpdpbusd %%ymm14, %%ymm15, %%ymm0\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm1\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm2\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm3\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm4\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm5\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm6\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm7\n\t"
        "vpaddd %%ymm14, %%ymm15, %%ymm8\n\t"
        "vpaddd %%ymm14, %%ymm15, %%ymm9\n\t"
        "vpaddd %%ymm14, %%ymm15, %%ymm10\n\t"
        "vpaddd %%ymm14, %%ymm15, %%ymm11\n\t"
        ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
  });
  timed("8 vpdpbusd + 4 vpand", 12, [] {
    asm volatile(
        "vpdpbusd %%ymm14, %%ymm15, %%ymm0\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm1\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm2\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm3\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm4\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm5\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm6\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm7\n\t"
        "vpand %%ymm14, %%ymm15, %%ymm8\n\t"
        "vpand %%ymm14, %%ymm15, %%ymm9\n\t"
        "vpand %%ymm14, %%ymm15, %%ymm10\n\t"
        "vpand %%ymm14, %%ymm15, %%ymm11\n\t"
        ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
  });
  timed("8 vpdpbusd + 4 vpsrlw", 12, [] {
    asm volatile(
        "vpdpbusd %%ymm14, %%ymm15, %%ymm0\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm1\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm2\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm3\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm4\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm5\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm6\n\t"
        "vpdpbusd %%ymm14, %%ymm15, %%ymm7\n\t"
        "vpsrlw $4, %%ymm14, %%ymm8\n\t"
        "vpsrlw $4, %%ymm14, %%ymm9\n\t"
        "vpsrlw $4, %%ymm14, %%ymm10\n\t"
        "vpsrlw $4, %%ymm14, %%ymm11\n\t"
        ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
  });
  timed("8 vpdpbusd + 8 vpbroadcastd loads", 16, [] {
    asm volatile(
        "vpbroadcastd (%%rsp), %%ymm13\n\t"
        "vpdpbusd %%ymm14, %%ymm13, %%ymm0\n\t"
        "vpbroadcastd (%%rsp), %%ymm13\n\t"
        "vpdpbusd %%ymm14, %%ymm13, %%ymm1\n\t"
        "vpbroadcastd (%%rsp), %%ymm13\n\t"
        "vpdpbusd %%ymm14, %%ymm13, %%ymm2\n\t"
        "vpbroadcastd (%%rsp), %%ymm13\n\t"
        "vpdpbusd %%ymm14, %%ymm13, %%ymm3\n\t"
        "vpbroadcastd (%%rsp), %%ymm13\n\t"
        "vpdpbusd %%ymm14, %%ymm13, %%ymm4\n\t"
        "vpbroadcastd (%%rsp), %%ymm13\n\t"
        "vpdpbusd %%ymm14, %%ymm13, %%ymm5\n\t"
        "vpbroadcastd (%%rsp), %%ymm13\n\t"
        "vpdpbusd %%ymm14, %%ymm13, %%ymm6\n\t"
        "vpbroadcastd (%%rsp), %%ymm13\n\t"
        "vpdpbusd %%ymm14, %%ymm13, %%ymm7\n\t"
        ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
  });
  timed("8 vpdpbusd, broadcast memory operand", 8, [] {
    asm volatile(
        "vpdpbusd -8(%%rsp)%{1to8%}, %%ymm14, %%ymm0\n\t"
        "vpdpbusd -8(%%rsp)%{1to8%}, %%ymm14, %%ymm1\n\t"
        "vpdpbusd -8(%%rsp)%{1to8%}, %%ymm14, %%ymm2\n\t"
        "vpdpbusd -8(%%rsp)%{1to8%}, %%ymm14, %%ymm3\n\t"
        "vpdpbusd -8(%%rsp)%{1to8%}, %%ymm14, %%ymm4\n\t"
        "vpdpbusd -8(%%rsp)%{1to8%}, %%ymm14, %%ymm5\n\t"
        "vpdpbusd -8(%%rsp)%{1to8%}, %%ymm14, %%ymm6\n\t"
        "vpdpbusd -8(%%rsp)%{1to8%}, %%ymm14, %%ymm7\n\t"
        ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
  });
}
