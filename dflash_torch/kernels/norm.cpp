// RMSNorm, one row at a time: y = w * (x * (1 / sqrt(mean(x^2) + eps))). PyTorch's CPU rms_norm costs
// ~20 us for one 576-wide row (a chain of generic operators), which is ~10% of a small model's decode
// step; this is one pass. Each row's result depends on that row only, and the AVX2 path and the scalar
// twin perform the same operations: sum of squares in 8 lanes (lane l takes i = l, l + 8, ... by fma),
// reduced ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), then the scalar steps, then per element
// w * (x * r).

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define DFLASH_X86 1
#endif

namespace {

float inv_rms(float sumsq, int64_t n, float eps) { return 1.f / std::sqrt(sumsq / (float)n + eps); }

void row_scalar(const float* x, const float* w, int64_t n, float eps, float* y) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < n; i++) lane[i % 8] = std::fma(x[i], x[i], lane[i % 8]);
  const float ss = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
  const float r = inv_rms(ss, n, eps);
  for (int64_t i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}

#ifdef DFLASH_X86
// R consecutive rows (R = 1, or 4 at once: four independent chains of fmas, since a chain's latency, not
// the work, bounds a row and a 16-row verify pass paid it 16 times in a row); each row the same operations
template <int R>
__attribute__((target("avx2,fma"))) void rows_avx2(const float* x, const float* w, int64_t n, float eps, float* y) {
  __m256 acc[R];
  for (int j = 0; j < R; j++) acc[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8)
    for (int j = 0; j < R; j++) {
      const __m256 v = _mm256_loadu_ps(x + j * n + i);
      acc[j] = _mm256_fmadd_ps(v, v, acc[j]);
    }
  for (int j = 0; j < R; j++) {
    const __m128 lo = _mm_add_ps(_mm256_castps256_ps128(acc[j]), _mm256_extractf128_ps(acc[j], 1));
    const __m128 t = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    const float ss = _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
    const __m256 r = _mm256_set1_ps(inv_rms(ss, n, eps));
    for (int64_t i = 0; i < n; i += 8)
      _mm256_storeu_ps(y + j * n + i,
                       _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + j * n + i), r)));
  }
}
#endif

bool has_avx2() {
#ifdef DFLASH_X86
  static const bool yes = [] {
    const char* cap = std::getenv("ATEN_CPU_CAPABILITY");
    if (cap && std::strcmp(cap, "default") == 0) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return yes;
#else
  return false;
#endif
}

// x [..., n] float32, w [n] -> same shape; isa -1 best, 0 scalar, 1 AVX2
torch::Tensor rms_norm(const torch::Tensor& x_in, const torch::Tensor& w_in, double eps, int64_t isa) {
  TORCH_CHECK(x_in.scalar_type() == torch::kFloat32 && w_in.scalar_type() == torch::kFloat32, "float32 rms_norm");
  const int64_t n = x_in.size(-1);
  TORCH_CHECK(w_in.numel() == n, "rms_norm weight of ", w_in.numel(), " for rows of ", n);
  TORCH_CHECK(isa <= (int64_t)has_avx2(), "this CPU lacks the AVX2 rms_norm path");
  const bool vec = (isa < 0 ? has_avx2() : isa == 1) && n % 8 == 0;
  torch::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  auto y = torch::empty_like(x);
  const int64_t rows = n ? x.numel() / n : 0;
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t r0, int64_t r1) {
    int64_t r = r0;
#ifdef DFLASH_X86
    if (vec)
      for (; r + 4 <= r1; r += 4) rows_avx2<4>(xp + r * n, wp, n, (float)eps, yp + r * n);
#endif
    for (; r < r1; r++) {
#ifdef DFLASH_X86
      if (vec) {
        rows_avx2<1>(xp + r * n, wp, n, (float)eps, yp + r * n);
        continue;
      }
#endif
      row_scalar(xp + r * n, wp, n, (float)eps, yp + r * n);
    }
  });
  return y;
}

}  // namespace

namespace dflash_norm {
// one row exactly as rms_norm(x, w, eps, -1) computes it (rows_avx2<1> and <4> give a row the same bits):
// for kernels that normalize their input rows on the way in (block_mm_norm in blocks.cpp)
void norm_row(const float* x, const float* w, int64_t n, float eps, float* y) {
#ifdef DFLASH_X86
  if (has_avx2() && n % 8 == 0) return rows_avx2<1>(x, w, n, eps, y);
#endif
  row_scalar(x, w, n, eps, y);
}
}  // namespace dflash_norm

TORCH_LIBRARY_FRAGMENT(dflash, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps, int isa=-1) -> Tensor");
  m.impl("rms_norm", torch::kCPU, &rms_norm);
}
