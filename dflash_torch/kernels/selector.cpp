// A DFlash2 candidate selector's chances for a tree draft (dflash2.CandidateSelector.transitions): for each block
// position j and each candidate q of the position before it (the block's anchor for j = 0), the softmax over
// position j's k candidates m of
//     log p[j, m] + sum over r of P[prev, r] * (S[cand[j, m], r] * proj[j, r])
// times the drafter's mass at position j (sum over m of p[j, m]). A few thousand multiply-adds, which as a dozen
// torch operators cost a drafter cycle ~0.2 ms of dispatch (docs/performance.md). One thread, plain loops: the sums
// in r order, the softmax with std::exp; kernels/reference.py has the same formula in torch operators (within
// float32 rounding of it, tests/test_kernels.py).

#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// probs [K, k] float32, cand [K, k] int64 token ids, proj [K, r] float32, pred/succ codebooks [V, r] float32 ->
// chances [K, k (prev), k]; position 0's k rows are all the anchor's
torch::Tensor selector_chances(const torch::Tensor& probs_in, const torch::Tensor& cand_in,
                               const torch::Tensor& proj_in, const torch::Tensor& pred_in,
                               const torch::Tensor& succ_in, int64_t anchor) {
  TORCH_CHECK(probs_in.dim() == 2 && cand_in.sizes() == probs_in.sizes() && proj_in.dim() == 2 &&
                  proj_in.size(0) == probs_in.size(0),
              "selector_chances takes probs and cand [K, k], proj [K, r]");
  TORCH_CHECK(pred_in.dim() == 2 && succ_in.sizes() == pred_in.sizes() && pred_in.size(1) == proj_in.size(1),
              "selector_chances takes codebooks [V, r] with proj's rank");
  TORCH_CHECK(probs_in.scalar_type() == torch::kFloat32 && proj_in.scalar_type() == torch::kFloat32 &&
                  pred_in.scalar_type() == torch::kFloat32 && succ_in.scalar_type() == torch::kFloat32 &&
                  cand_in.scalar_type() == torch::kInt64,
              "selector_chances takes float32 probs, proj and codebooks, int64 candidates");
  const int64_t n = probs_in.size(0), k = probs_in.size(1), r = proj_in.size(1), v = pred_in.size(0);
  const torch::Tensor probs = probs_in.contiguous(), cand = cand_in.contiguous(), proj = proj_in.contiguous();
  const torch::Tensor pred = pred_in.contiguous(), succ = succ_in.contiguous();
  const float *pp = probs.data_ptr<float>(), *jp = proj.data_ptr<float>();
  const float *pc = pred.data_ptr<float>(), *sc = succ.data_ptr<float>();
  const int64_t* cp = cand.data_ptr<int64_t>();
  TORCH_CHECK(anchor >= 0 && anchor < v, "anchor ", anchor, " outside the codebooks' ", v, " tokens");
  for (int64_t i = 0; i < n * k; i++) TORCH_CHECK(cp[i] >= 0 && cp[i] < v, "candidate ", cp[i], " outside the codebooks");
  auto out = torch::empty({n, k, k}, torch::kFloat32);
  float* op = out.data_ptr<float>();
  std::vector<float> s_row(r * k), score(k), logp(k);
  for (int64_t j = 0; j < n; j++) {
    float mass = 0.f;
    for (int64_t m = 0; m < k; m++) {
      const float p = pp[j * k + m];
      mass += p;
      logp[m] = std::log(std::max(p, 1e-30f));
      for (int64_t c = 0; c < r; c++) s_row[m * r + c] = sc[cp[j * k + m] * r + c] * jp[j * r + c];  // p_j * S
    }
    for (int64_t q = 0; q < k; q++) {
      const float* prev = pc + (j == 0 ? anchor : cp[(j - 1) * k + q]) * r;
      float top = -INFINITY;
      for (int64_t m = 0; m < k; m++) {
        float dot = 0.f;
        for (int64_t c = 0; c < r; c++) dot += prev[c] * s_row[m * r + c];
        score[m] = logp[m] + dot;
        top = std::max(top, score[m]);
      }
      float z = 0.f;
      for (int64_t m = 0; m < k; m++) z += (score[m] = std::exp(score[m] - top));
      for (int64_t m = 0; m < k; m++) op[(j * k + q) * k + m] = score[m] / z * mass;
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dflash, m) {
  m.def("selector_chances(Tensor probs, Tensor cand, Tensor proj, Tensor pred, Tensor succ, int anchor) -> Tensor");
  m.impl("selector_chances", torch::kCPU, &selector_chances);
}
