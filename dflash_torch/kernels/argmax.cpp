// Row-wise reductions of float32 logits. argmax_rows: as torch.argmax(x, -1) defines it, the first index of
// the row's maximum, and where the row holds a NaN, the first NaN's index. Greedy decoding takes one per committed
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
#include <tuple>

#include "attention.h"  // exp_scalar / exp_avx2 and tree8: top_probs's exps and sums, the softmax's

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

// top_probs: a draft's candidates. For each row, its k largest values (ties: the lower index first; a NaN counts
// as -inf) in descending order, and the softmax of the whole row at them: exp(v - m) / z with m the row's max and
// z = sum exp(x - m), the exps of attention.h and 8-lane sums (lane i % 8, in index order; tree8 at the end), so
// the AVX2 path and the scalar twin give the same bits. A tree draft reads these instead of a top-k, a logsumexp
// and the operators between them, each of which cost a drafter cycle tens of microseconds of dispatch.

// insert (v, i) into the descending list vals/idx of `count` (< k or v above its last) entries
inline void top_insert(float* vals, int64_t* idx, int64_t& count, int64_t k, float v, int64_t i) {
  int64_t at = count < k ? count : k - 1;  // (a full list drops its last)
  while (at > 0 && vals[at - 1] < v) {  // strictly less: an equal value found earlier stays ahead
    vals[at] = vals[at - 1], idx[at] = idx[at - 1];
    at--;
  }
  vals[at] = v, idx[at] = i;
  if (count < k) count++;
}

inline float no_nan(float x) { return std::isnan(x) ? -INFINITY : x; }

// row x [0, n): the top k (vals, idx) and the row's max; scalar
float top_scalar(const float* x, int64_t n, int64_t k, float* vals, int64_t* idx) {
  int64_t count = 0;
  float m = -INFINITY;
  for (int64_t i = 0; i < n; i++) {
    const float v = no_nan(x[i]);
    m = v > m ? v : m;
    if (count < k || v > vals[k - 1]) top_insert(vals, idx, count, k, v, i);
  }
  return m;
}

float expsum_scalar(const float* x, int64_t n, float m) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < n; i++) lane[i % 8] += dflash_attention::exp_scalar(no_nan(x[i]) - m);
  return dflash_attention::tree8(lane);
}

#ifdef DFLASH_X86
// the same list: 8 values at a time checked against the list's last, the few above it inserted in index order
__attribute__((target("avx2,fma"))) float top_avx2(const float* x, int64_t n, int64_t k, float* vals, int64_t* idx) {
  int64_t count = 0;
  int64_t i = 0;
  for (; i < n && count < k; i++) top_insert(vals, idx, count, k, no_nan(x[i]), i);  // fill the list first
  __m256 mv = _mm256_set1_ps(-INFINITY);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);  // (a NaN compares false: never above; max_ps passes the other)
    mv = _mm256_max_ps(v, mv);
    if (_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(vals[k - 1]), _CMP_GT_OQ)))
      for (int64_t j = i; j < i + 8; j++)
        if (x[j] > vals[k - 1]) top_insert(vals, idx, count, k, x[j], j);
  }
  for (; i < n; i++)
    if (x[i] > vals[k - 1]) top_insert(vals, idx, count, k, x[i], i);
  float lanes[8];
  _mm256_storeu_ps(lanes, mv);
  float m = vals[0];  // the list holds the first k values and every one above them: its first is their max
  for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
  return m;
}

__attribute__((target("avx2,fma,f16c"))) float expsum_avx2(const float* x, int64_t n, float m) {
  const __m256 mb = _mm256_set1_ps(m), lo = _mm256_set1_ps(-INFINITY);
  __m256 zv = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    v = _mm256_blendv_ps(v, lo, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));  // NaN -> -inf
    zv = _mm256_add_ps(zv, dflash_attention::exp_avx2(_mm256_sub_ps(v, mb)));
  }
  float lane[8];
  _mm256_storeu_ps(lane, zv);
  for (; i < n; i++) lane[i % 8] += dflash_attention::exp_scalar(no_nan(x[i]) - m);  // the tail lane by lane
  return dflash_attention::tree8(lane);
}
#endif

// x [T, V] float32, 1 <= k <= V -> (probs [T, k] float32, indices [T, k] int64)
std::tuple<torch::Tensor, torch::Tensor> top_probs(const torch::Tensor& x_in, int64_t k, int64_t isa) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat32, "top_probs takes float32 x [T, V]");
  TORCH_CHECK(k >= 1 && k <= x_in.size(1), "top_probs needs 1 <= k <= V = ", x_in.size(1), ", got k = ", k);
  const int64_t best = argmax_isa();
  if (isa < 0) isa = best;
  TORCH_CHECK(isa <= best, "this CPU lacks top_probs path ", isa, " (best: ", best, ")");
  const torch::Tensor x = x_in.contiguous();
  const int64_t t = x.size(0), n = x.size(1);
  auto probs = torch::empty({t, k}, torch::kFloat32);
  auto idx = torch::empty({t, k}, torch::kInt64);
  const float* xp = x.data_ptr<float>();
  float* pp = probs.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  at::parallel_for(0, t, std::max<int64_t>(1, (1 << 16) / n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      const float* row = xp + r * n;
      float* vals = pp + r * k;  // the values first, then their probabilities in place
      float m, z;
#ifdef DFLASH_X86
      if (isa == 1) {
        m = top_avx2(row, n, k, vals, ip + r * k);
        z = expsum_avx2(row, n, m);
      } else
#endif
      {
        m = top_scalar(row, n, k, vals, ip + r * k);
        z = expsum_scalar(row, n, m);
      }
      for (int64_t j = 0; j < k; j++) vals[j] = dflash_attention::exp_scalar(vals[j] - m) / z;
    }
  });
  return {probs, idx};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dflash, m) {
  m.def("argmax_rows(Tensor x, int isa=-1) -> Tensor");
  m.impl("argmax_rows", torch::kCPU, &argmax_rows);
  m.def("top_probs(Tensor x, int k, int isa=-1) -> (Tensor, Tensor)");
  m.impl("top_probs", torch::kCPU, &top_probs);
}
