// Row-wise argmax of float32 logits, as torch.argmax(x, -1) defines it: the first index of the row's
// maximum, and where the row holds a NaN, the first NaN's index. Greedy decoding takes one per committed
// token and a verify pass one per drafted position; PyTorch's CPU argmax reads a 49,152-wide row at about
// 0.5 GB/s (100 us), and 16 rows on two threads took 1.7-7.9 ms, a sixth of a decode step or more.
//
// Two passes over the row: the max (and whether a NaN is there), then the first index equal to it.
// -0.0 and 0.0 compare equal, so a row whose max is zero gets the first zero of either sign, as in torch.
// The AVX2 path and the scalar twin give the same index (tests/test_kernels.py checks both against torch).

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define DFLASH_X86 1
#endif

namespace {

int64_t argmax_scalar(const float* x, int64_t n) {
  float m = -INFINITY;
  for (int64_t i = 0; i < n; i++) {
    if (std::isnan(x[i])) return i;
    if (x[i] > m) m = x[i];
  }
  for (int64_t i = 0; i < n; i++)
    if (x[i] == m) return i;
  return 0;  // n == 0 is refused by the caller
}

#ifdef DFLASH_X86
__attribute__((target("avx2,fma"))) int64_t argmax_avx2(const float* x, int64_t n) {
  __m256 mv = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    mv = _mm256_max_ps(mv, v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, mv);
  float m = -INFINITY;
  for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;  // max is exact: any order
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t j = i; j < n; j++) {
    has_nan = has_nan || std::isnan(x[j]);
    m = x[j] > m ? x[j] : m;
  }
  if (has_nan) {
    for (int64_t j = 0; j < n; j++)
      if (std::isnan(x[j])) return j;
  }
  const __m256 mb = _mm256_set1_ps(m);
  for (i = 0; i + 8 <= n; i += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), mb, _CMP_EQ_OQ));
    if (mask) return i + __builtin_ctz((unsigned)mask);
  }
  for (; i < n; i++)
    if (x[i] == m) return i;
  return 0;
}
#endif

int64_t argmax_isa() {  // 0 scalar, 1 AVX2; ATEN_CPU_CAPABILITY=default caps it as PyTorch's
#ifdef DFLASH_X86
  static const int64_t isa = [] {
    const char* cap = std::getenv("ATEN_CPU_CAPABILITY");
    if (cap && std::strcmp(cap, "default") == 0) return (int64_t)0;
    __builtin_cpu_init();
    return (int64_t)(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0);
  }();
  return isa;
#else
  return 0;
#endif
}

int64_t argmax_row(const float* x, int64_t n, int64_t isa) {
#ifdef DFLASH_X86
  if (isa == 1) return argmax_avx2(x, n);
#endif
  (void)isa;
  return argmax_scalar(x, n);
}

// One wide row on several threads, each taking a contiguous share of the columns: the LM head's kernel
// wrote each share on the thread that now reads it (its threads split the columns alike), where one
// thread alone read the other's half out of that core's cache (38 us for a 49,152-wide row against 9
// warm). The shares' answers combine to the row's: the first share with a NaN gives its first NaN, else
// the first share whose maximum is the row's gives its first index of it.
int64_t argmax_split(const float* x, int64_t n, int64_t isa) {
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), 8);
  int64_t found[8];
  const int64_t per = (n + parts - 1) / parts;
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p++) {
      const int64_t c0 = std::min(n, p * per), c1 = std::min(n, c0 + per);
      found[p] = c0 < c1 ? c0 + argmax_row(x + c0, c1 - c0, isa) : -1;
    }
  });
  int64_t best = -1;
  for (int64_t p = 0; p < parts; p++) {
    const int64_t i = found[p];
    if (i < 0) continue;
    if (std::isnan(x[i])) return i;  // the first share holding a NaN, at its first NaN
    if (best < 0 || x[i] > x[best]) best = i;  // a later share's equal maximum is not earlier
  }
  return best;
}

// x [T, V] float32 -> [T] int64
torch::Tensor argmax_rows(const torch::Tensor& x_in, int64_t isa) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) > 0, "argmax_rows takes x [T, V] with V > 0");
  TORCH_CHECK(x_in.scalar_type() == torch::kFloat32, "argmax_rows takes float32");
  const int64_t best = argmax_isa();
  if (isa < 0) isa = best;
  TORCH_CHECK(isa <= best, "this CPU lacks argmax path ", isa, " (best: ", best, ")");
  const torch::Tensor x = x_in.contiguous();
  const int64_t t = x.size(0), n = x.size(1);
  auto out = torch::empty({t}, torch::kInt64);
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  if (t == 1 && n >= (1 << 15) && at::get_num_threads() > 1 && !at::in_parallel_region()) {
    op[0] = argmax_split(xp, n, isa);
    return out;
  }
  // a second thread pays from about 64k values a task
  at::parallel_for(0, t, std::max<int64_t>(1, (1 << 16) / n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) op[r] = argmax_row(xp + r * n, n, isa);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dflash, m) {
  m.def("argmax_rows(Tensor x, int isa=-1) -> Tensor");
  m.impl("argmax_rows", torch::kCPU, &argmax_rows);
}
