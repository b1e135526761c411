// The AVX2 Q4_0 block matmul's inner loops outside the extension (docs/performance.md, "AVX2 only: AMD EPYC
// (Zen 3)"): 16 rows x the gate/up matrix (3072 x 576), one thread, multiply-adds per cycle at the clock a
// chain of dependent adds measures. V0: the 64-row tile the AVX2 path had (each block unpacked once, the rows
// one after another, their float sums in memory); V1 and V2: strips of R rows x C column groups, their block
// sums in registers (V2 is blocks_avx2.cpp's order, a chunk's low then high nibbles). Every variant's output
// is checked against V0's bit for bit.
//   g++ -O3 -ffp-contract=off -o strips strips_standalone.cpp && ./strips 1000
#include <immintrin.h>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <ctime>
#include <vector>
static double now(){timespec a; clock_gettime(CLOCK_MONOTONIC,&a); return a.tv_sec+a.tv_nsec*1e-9;}
static double ghz() {  // 4 dependent adds per iteration: 4 cycles
  const long n = 500000000L; long x = 0; double t = now();
  for (long i = 0; i < n; i++) __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
  return 4.0 * n / (now() - t) / 1e9;
}
static double GHZ = 3.2;
constexpr int QK=32, GROUP=8; constexpr int64_t GB=144;
struct Rows { const int8_t* q; const float* d; const int32_t* s; int64_t k, nb; };

// V0: the current tile body for Q4_0 (acc in memory, 4 rows after each other)
__attribute__((target("avx2,fma,f16c"))) void tile_v0(const uint8_t* w, int64_t nb, const Rows& x, int64_t r0, int64_t r1, float* acc) {
  const __m256i low = _mm256_set1_epi8(0x0f);
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* rec = w + b * GB;
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)rec));
    const uint8_t* qs = rec + 16;
    __m256i wv[8];
    for (int j = 0; j < 4; j++) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * j));
      wv[j] = _mm256_and_si256(v, low);
      wv[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    for (int64_t r = r0; r < r1; r++) {
      const int32_t* x4 = (const int32_t*)(x.q + r * x.k + b * QK);
      __m256i s16 = _mm256_maddubs_epi16(wv[0], _mm256_set1_epi32(x4[0]));
      for (int j = 1; j < 8; j++) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(wv[j], _mm256_set1_epi32(x4[j])));
      __m256i isum = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
      const int64_t at = r * x.nb + b;
      isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(_mm256_castps_si256(_mm256_broadcast_ss((const float*)(x.s + at))), 3));
      float* a = acc + (r - r0) * GROUP;
      const __m256 dd = _mm256_mul_ps(_mm256_broadcast_ss(x.d + at), dw);
      _mm256_storeu_ps(a, _mm256_add_ps(_mm256_loadu_ps(a), _mm256_mul_ps(_mm256_cvtepi32_ps(isum), dd)));
    }
  }
}

// V1: R rows x 2 groups register block; int16 sums in registers per block, float sums in memory
template <int R>
__attribute__((target("avx2,fma,f16c"))) inline void blk_v1(const uint8_t* __restrict w0, const uint8_t* __restrict w1, int64_t nb,
    const int8_t* __restrict xq, const float* __restrict xd, const int32_t* __restrict xs, int64_t k, int64_t xnb, float* __restrict acc /* [R][16] */) {
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* ra = w0 + b * GB; const uint8_t* rb = w1 + b * GB;
    __m256i s[R][2];
    for (int j = 0; j < 4; j++) {
      const __m256i va = _mm256_loadu_si256((const __m256i*)(ra + 16 + 32 * j));
      const __m256i vb = _mm256_loadu_si256((const __m256i*)(rb + 16 + 32 * j));
      const __m256i alo = _mm256_and_si256(va, low), ahi = _mm256_and_si256(_mm256_srli_epi16(va, 4), low);
      const __m256i blo = _mm256_and_si256(vb, low), bhi = _mm256_and_si256(_mm256_srli_epi16(vb, 4), low);
      #pragma GCC unroll 8
      for (int r = 0; r < R; r++) {
        const int32_t* x4 = (const int32_t*)(xq + r * k + b * QK);
        const __m256i xl = _mm256_set1_epi32(x4[j]), xh = _mm256_set1_epi32(x4[j + 4]);
        const __m256i ta = _mm256_add_epi16(_mm256_maddubs_epi16(alo, xl), _mm256_maddubs_epi16(ahi, xh));
        const __m256i tb = _mm256_add_epi16(_mm256_maddubs_epi16(blo, xl), _mm256_maddubs_epi16(bhi, xh));
        s[r][0] = j == 0 ? ta : _mm256_add_epi16(s[r][0], ta);
        s[r][1] = j == 0 ? tb : _mm256_add_epi16(s[r][1], tb);
      }
    }
    const __m256 dwa = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)ra));
    const __m256 dwb = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)rb));
    #pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      const __m256i s8 = _mm256_slli_epi32(_mm256_set1_epi32(xs[r * xnb + b]), 3);
      const __m256 d = _mm256_set1_ps(xd[r * xnb + b]);
      const __m256i ia = _mm256_sub_epi32(_mm256_madd_epi16(s[r][0], ones), s8);
      const __m256i ib = _mm256_sub_epi32(_mm256_madd_epi16(s[r][1], ones), s8);
      float* a = acc + r * 16;
      _mm256_storeu_ps(a, _mm256_add_ps(_mm256_loadu_ps(a), _mm256_mul_ps(_mm256_cvtepi32_ps(ia), _mm256_mul_ps(d, dwa))));
      _mm256_storeu_ps(a + 8, _mm256_add_ps(_mm256_loadu_ps(a + 8), _mm256_mul_ps(_mm256_cvtepi32_ps(ib), _mm256_mul_ps(d, dwb))));
    }
  }
}


template <int R, int C>
__attribute__((target("avx2,fma,f16c"))) inline void blk_v2(const uint8_t* __restrict w, int64_t gstride, int64_t nb,
    const int8_t* __restrict xq, const float* __restrict xd, const int32_t* __restrict xs, int64_t k, int64_t xnb, float* __restrict acc /* [R][C*8] */) {
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; b++) {
    __m256i s[R][C];
    for (int j = 0; j < 4; j++) {
      __m256i wl[C];
      #pragma GCC unroll 8
      for (int c = 0; c < C; c++) wl[c] = _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(w + c * gstride + b * GB + 16 + 32 * j)), low);
      #pragma GCC unroll 8
      for (int r = 0; r < R; r++) {
        const __m256i xl = _mm256_set1_epi32(((const int32_t*)(xq + r * k + b * QK))[j]);
        #pragma GCC unroll 8
        for (int c = 0; c < C; c++) { const __m256i t = _mm256_maddubs_epi16(wl[c], xl); s[r][c] = j == 0 ? t : _mm256_add_epi16(s[r][c], t); }
      }
      #pragma GCC unroll 8
      for (int c = 0; c < C; c++) wl[c] = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i*)(w + c * gstride + b * GB + 16 + 32 * j)), 4), low);
      #pragma GCC unroll 8
      for (int r = 0; r < R; r++) {
        const __m256i xh = _mm256_set1_epi32(((const int32_t*)(xq + r * k + b * QK))[j + 4]);
        #pragma GCC unroll 8
        for (int c = 0; c < C; c++) s[r][c] = _mm256_add_epi16(s[r][c], _mm256_maddubs_epi16(wl[c], xh));
      }
    }
    __m256 dw[C];
    #pragma GCC unroll 8
    for (int c = 0; c < C; c++) dw[c] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w + c * gstride + b * GB)));
    #pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      const __m256i s8 = _mm256_slli_epi32(_mm256_set1_epi32(xs[r * xnb + b]), 3);
      const __m256 d = _mm256_set1_ps(xd[r * xnb + b]);
      #pragma GCC unroll 8
      for (int c = 0; c < C; c++) {
        const __m256i i = _mm256_sub_epi32(_mm256_madd_epi16(s[r][c], ones), s8);
        float* a = acc + r * C * 8 + c * 8;
        _mm256_storeu_ps(a, _mm256_add_ps(_mm256_loadu_ps(a), _mm256_mul_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(d, dw[c]))));
      }
    }
  }
}
template <int R, int C> double run_v2(const std::vector<uint8_t>& w, int64_t groups, int64_t nb, const std::vector<int8_t>& q, const std::vector<float>& d, const std::vector<int32_t>& s, int64_t M, int64_t k, int64_t n, std::vector<float>& y, int iters) {
  float acc[64 * 32]; double best = 1e9;
  for (int rep = 0; rep < 5; rep++) { double t = now();
    for (int it = 0; it < iters; it++)
      for (int64_t g = 0; g + C <= groups; g += C)
        for (int64_t r = 0; r + R <= M; r += R) { memset(acc, 0, sizeof(float) * R * C * 8);
          blk_v2<R, C>(&w[g * nb * GB], nb * GB, nb, q.data() + r * k, d.data() + r * nb, s.data() + r * nb, k, nb, acc);
          for (int rr = 0; rr < R; rr++) memcpy(&y[(r + rr) * n + g * 8], acc + rr * C * 8, 32 * C); }
    best = std::min(best, (now() - t) / iters); }
  return best;
}
int main(int argc, char** argv) {
  const int64_t n = 3072, k = 576, nb = k / QK, M = 16, groups = n / GROUP;
  std::vector<uint8_t> w(groups * nb * GB);
  for (size_t i = 0; i < w.size(); i++) w[i] = rand();
  for (int64_t g = 0; g < groups; g++) for (int64_t b = 0; b < nb; b++) { uint16_t* h = (uint16_t*)&w[(g * nb + b) * GB]; for (int c = 0; c < 8; c++) h[c] = 0x2000 + (rand() & 0x3ff); }
  std::vector<int8_t> q(M * k); for (auto& v : q) v = (rand() % 255) - 127;
  std::vector<float> d(M * nb); for (auto& v : d) v = 0.01f * (1 + rand() % 100);
  std::vector<int32_t> s(M * nb, 0);
  for (int64_t r = 0; r < M; r++) for (int64_t b = 0; b < nb; b++) for (int i = 0; i < 32; i++) s[r * nb + b] += q[r * k + b * 32 + i];
  Rows x{q.data(), d.data(), s.data(), k, nb};
  std::vector<float> y0(M * n), y1(M * n);
  float acc[64 * 16];
  const int iters = argc > 1 ? atoi(argv[1]) : 2000;
  GHZ = ghz();
  printf("clock %.2f GHz\n", GHZ);
  for (int v = 0; v < 2; v++) {
    double best = 1e9;
    for (int rep = 0; rep < 5; rep++) {
      double t = now();
      for (int it = 0; it < iters; it++) {
        if (v == 0) {
          for (int64_t g = 0; g < groups; g++) { memset(acc, 0, sizeof(float) * M * 8); tile_v0(&w[g * nb * GB], nb, x, 0, M, acc);
            for (int64_t r = 0; r < M; r++) memcpy(&y0[r * n + g * 8], acc + r * 8, 32); }
        } else {
          for (int64_t g = 0; g < groups; g += 2) {
            for (int64_t r = 0; r < M; r += 4) { memset(acc, 0, sizeof(float) * 64);
              blk_v1<4>(&w[g * nb * GB], &w[(g + 1) * nb * GB], nb, q.data() + r * k, d.data() + r * nb, s.data() + r * nb, k, nb, acc);
              for (int rr = 0; rr < 4; rr++) memcpy(&y1[(r + rr) * n + g * 8], acc + rr * 16, 64); }
          }
        }
      }
      best = std::min(best, (now() - t) / iters);
    }
    printf("V%d: %.1f us  %.1f MAC/cycle\n", v, best * 1e6, M * n * k / best / (GHZ * 1e9));
  }
  printf("V1 same bits as V0: %s\n", memcmp(y0.data(), y1.data(), y0.size() * 4) == 0 ? "yes" : "NO");
  #define RV(R, C) { std::fill(y1.begin(), y1.end(), 0.f); double t = run_v2<R, C>(w, groups, nb, q, d, s, M, k, n, y1, iters); \
    bool full = (M % R == 0) && (groups % C == 0); double macs = (double)(M / R * R) * (groups / C * C * 8) * k; \
    printf("V2 R%d C%d: %.1f us  %.1f MAC/cycle  same bits %s\n", R, C, t * 1e6, macs / t / (GHZ * 1e9), full ? (memcmp(y0.data(), y1.data(), y0.size() * 4) == 0 ? "yes" : "NO") : "(partial)"); }
  RV(4, 2) RV(2, 4) RV(8, 1) RV(4, 1) RV(2, 2) RV(1, 4) RV(8, 2) RV(3, 2)
}
