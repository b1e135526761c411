// Few query positions over a float16 cache, split evenly over the threads, on AVX2: attention_avx512.cpp's
// split (scores by blocks of keys, the softmax per query, output sums by dimensions) with the AVX2 tile's
// operations. The tiles give each thread whole kv heads, so with the default model's 3 kv heads on 2 threads one
// thread runs two while the other waits, and tiles of one position each read a kv head's keys and values again
// for every position (a 2-row verify pass twice). Here each block of keys is widened once for every position's
// queries, each score is its own sum, each query's softmax its own, and each output dimension's chain over the
// keys runs in key order: every number is the one tile_avx2 computes (tests/test_kernels.py holds both to the
// scalar twin, tests/test_exact.py the region to the layer modules).

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "attention.h"

#ifdef DFLASH_X86
namespace dflash_attention {
namespace {

// tasks i0 .. i1 of the scores (task i: kv head i / blocks, keys of block i % blocks) into scores [t h, stride];
// query position p (of t) attends to n + p keys
template <int dv>
DFLASH_AVX2 void split_scores(int64_t i0, int64_t i1, const float* q, const at::Half* k, int64_t ks, int64_t khs,
                              int64_t n, int64_t t, int64_t h, int64_t group, float scale, float* scores,
                              int64_t stride) {
  constexpr int64_t d = 8 * dv;
  const int64_t nmax = n + t - 1, blocks = (nmax + KB - 1) / KB;
  alignas(32) float wide[KB * 8 * dv];
  for (int64_t i = i0; i < i1; i++) {
    const int64_t g = i / blocks, jb = (i % blocks) * KB;
    int64_t bs;
    const float* kb = block_f32<dv>(k + g * khs, ks, jb, std::min(jb + KB, nmax), wide, bs);
    for (int64_t p = 0; p < t; p++) {
      if (jb >= n + p) continue;
      const int64_t lim = std::min(KB, n + p - jb);
      for (int64_t hi = g * group; hi < (g + 1) * group; hi++) {
        __m256 qv[dv];
        for (int64_t c = 0; c < dv; c++) qv[c] = _mm256_loadu_ps(q + (p * h + hi) * d + 8 * c);
        scores_avx2<dv>(qv, kb, bs, 0, lim, scale, scores + (p * h + hi) * stride + jb);
      }
    }
  }
}

// C queries' sums over their n[u] values (8 NV dimensions from vg, rows vs apart) of their softmax weights p[u],
// fma in key order per dimension, each over its z[u], into out[u]
template <int C, int NV>
DFLASH_AVX2 inline void values8(const at::Half* vg, int64_t vs, const int64_t* n, const float* const* p,
                                const float* z, float* const* out) {
  __m256 o[C][NV];
  for (int u = 0; u < C; u++)
    for (int e = 0; e < NV; e++) o[u][e] = _mm256_setzero_ps();
  const int64_t lo = *std::min_element(n, n + C), hi = *std::max_element(n, n + C);
  int64_t j = 0;
  for (; j < lo; j++) {  // keys every query attends to
    prefetch_row(vg + (j + VALUES_AHEAD) * vs, 16 * NV);
    __m256 vv[NV];
    for (int e = 0; e < NV; e++) vv[e] = load8(vg + j * vs + 8 * e);
    for (int u = 0; u < C; u++) {
      const __m256 pu = _mm256_set1_ps(p[u][j]);
      for (int e = 0; e < NV; e++) o[u][e] = _mm256_fmadd_ps(pu, vv[e], o[u][e]);
    }
  }
  for (; j < hi; j++) {  // the later positions' last few
    __m256 vv[NV];
    for (int e = 0; e < NV; e++) vv[e] = load8(vg + j * vs + 8 * e);
    for (int u = 0; u < C; u++) {
      if (j >= n[u]) continue;
      const __m256 pu = _mm256_set1_ps(p[u][j]);
      for (int e = 0; e < NV; e++) o[u][e] = _mm256_fmadd_ps(pu, vv[e], o[u][e]);
    }
  }
  for (int u = 0; u < C; u++) {
    const __m256 zu = _mm256_set1_ps(z[u]);
    for (int e = 0; e < NV; e++) _mm256_storeu_ps(out[u] + 8 * e, _mm256_div_ps(o[u][e], zu));
  }
}

// values8 for count (1 .. SPLIT_BATCH) queries on 16 dimensions: 12 sums, 2 values and a weight in the 16 registers
constexpr int SPLIT_BATCH = 6;
DFLASH_AVX2 void values_batch(const at::Half* vg, int64_t vs, int count, const int64_t* n, const float* const* p,
                              const float* z, float* const* out) {
  switch (count) {
    case 1: values8<1, 2>(vg, vs, n, p, z, out); break;
    case 2: values8<2, 2>(vg, vs, n, p, z, out); break;
    case 3: values8<3, 2>(vg, vs, n, p, z, out); break;
    case 4: values8<4, 2>(vg, vs, n, p, z, out); break;
    case 5: values8<5, 2>(vg, vs, n, p, z, out); break;
    default: values8<6, 2>(vg, vs, n, p, z, out); break;
  }
}

// tasks i0 .. i1 of the output sums (task i: kv head i / w, the dimensions of split_tasks' task: 32 where the head
// size allows, else 16), 16 dimensions at a time, a kv head's queries (t positions x its group) in batches that
// share each value vector widened
template <int dv>
DFLASH_AVX2 void split_values(int64_t i0, int64_t i1, const at::Half* v, int64_t vs, int64_t vhs, int64_t n,
                              int64_t t, int64_t h, int64_t group, const float* scores, int64_t stride, const float* z,
                              float* out) {
  constexpr int64_t d = 8 * dv, per = dv % 4 == 0 ? 32 : 16, w = d / per;
  for (int64_t i = i0; i < i1; i++) {
    const int64_t g = i / w;
    for (int64_t c = (i % w) * per; c < (i % w + 1) * per; c += 16) {
      const at::Half* vg = v + g * vhs + c;
      int64_t ns[SPLIT_BATCH];
      const float* ps[SPLIT_BATCH];
      float zs[SPLIT_BATCH];
      float* os[SPLIT_BATCH];
      int count = 0;
      for (int64_t p = 0; p < t; p++)
        for (int64_t hi = g * group; hi < (g + 1) * group; hi++) {
          const int64_t r = p * h + hi;
          ns[count] = n + p, ps[count] = scores + r * stride, zs[count] = z[r], os[count] = out + r * d + c;
          if (++count == SPLIT_BATCH) {
            values_batch(vg, vs, count, ns, ps, zs, os);
            count = 0;
          }
        }
      if (count) values_batch(vg, vs, count, ns, ps, zs, os);
    }
  }
}

template <int dv>
void split_step(int step, int64_t i0, int64_t i1, const float* q, const at::Half* k, int64_t ks, int64_t khs,
                const at::Half* v, int64_t vs, int64_t vhs, int64_t n, int64_t t, int64_t h, int64_t hkv, float scale,
                float* scores, int64_t stride, float* z, float* out) {
  const int64_t group = h / hkv;
  if (step == 0) split_scores<dv>(i0, i1, q, k, ks, khs, n, t, h, group, scale, scores, stride);
  else if (step == 1)
    for (int64_t r = i0; r < i1; r++) z[r] = softmax_avx2(scores + r * stride, n + r / h);
  else split_values<dv>(i0, i1, v, vs, vhs, n, t, h, group, scores, stride, z, out);
}

}  // namespace

void split_step_avx2(int step, int64_t i0, int64_t i1, const float* q, const at::Half* k, int64_t ks, int64_t khs,
                     const at::Half* v, int64_t vs, int64_t vhs, int64_t n, int64_t t, int64_t h, int64_t hkv,
                     int64_t d, float scale, float* scores, int64_t stride, float* z, float* out) {
  auto run = [&](auto fn) { fn(step, i0, i1, q, k, ks, khs, v, vs, vhs, n, t, h, hkv, scale, scores, stride, z, out); };
  if (d == 64) run(split_step<8>);
  else if (d == 128) run(split_step<16>);
  else if (d == 32) run(split_step<4>);
  else if (d == 16) run(split_step<2>);
  else if (d == 96) run(split_step<12>);
}

bool decode_split_avx2(const float* q, const at::Half* k, int64_t ks, int64_t khs, const at::Half* v, int64_t vs,
                       int64_t vhs, int64_t n, int64_t t, int64_t h, int64_t hkv, int64_t d, float scale, float* out) {
  int64_t tasks[3], stride;
  if (!split_tasks(d, n, t, h, hkv, tasks, stride)) return false;
  thread_local std::vector<float> scores, z;  // the calling thread's, kept between calls and only grown (every
  if ((int64_t)scores.size() < t * h * stride) scores.resize(t * h * stride);  // score a step reads, an earlier wrote)
  if ((int64_t)z.size() < t * h) z.resize(t * h);
  float *sp = scores.data(), *zp = z.data();  // this thread's: the workers' thread_local vectors are others
  for (int step = 0; step < 3; step++)
    at::parallel_for(0, tasks[step], 1, [&](int64_t i0, int64_t i1) {
      split_step_avx2(step, i0, i1, q, k, ks, khs, v, vs, vhs, n, t, h, hkv, d, scale, sp, stride, zp, out);
    });
  return true;
}

}  // namespace dflash_attention
#endif
