// drafter.NativeDraft's pass (`draft_stack`): the drafter's layers after its context features in one call, through
// the operators drafter.FlatDraft calls in the same order (the block kernels through the dispatcher, layers.h), so
// its results are FlatDraft's bit for bit (tests/test_fast_flat.py); the norms, rotations and cache writes of each
// layer's queries, keys and values in plain loops that round as those operators round.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "activation.h"
#include "layers.h"

namespace dflash_norm {
void norm_row(const float* x, const float* w, int64_t n, float eps, float* y);  // norm.cpp
}

namespace {

using at::Tensor;
using dflash_activation::act_mul;
using namespace dflash_layers;

// flat.rotate for full rotary: x * cos + roll(x, D/2) * signed_sin (x [T, N, D], cos/sin [T, 1, D])
Tensor rotate(const Tensor& x, const Tensor& cos, const Tensor& signed_sin) {
  return x * cos + at::roll(x, {x.size(-1) / 2}, {-1}) * signed_sin;
}

// rotate(rms_norm(x, w)) of n rows of `heads` heads of d floats (row r's head j at x + r * xs + j * d) into out +
// r * os + j * ohs: norm.cpp's row function, then x * cos + x rolled by d / 2 * signed_sin with each product and the
// sum rounded as the two operators round them (-ffp-contract=off), cos/ssin row r [d]: the same bits as the
// operators, without their ~20 tensors per draft layer (a q, the block's keys, the context's keys)
void norm_rotate(const float* x, int64_t xs, int64_t n, int64_t heads, int64_t d, const float* w, float eps,
                 const float* cos, const float* ssin, float* out, int64_t os, int64_t ohs) {
  thread_local std::vector<float> y;
  y.resize(d);
  const int64_t half = d / 2;
  for (int64_t r = 0; r < n; r++)
    for (int64_t j = 0; j < heads; j++) {
      dflash_norm::norm_row(x + r * xs + j * d, w, d, eps, y.data());
      const float *c = cos + r * d, *sg = ssin + r * d;
      float* o = out + r * os + j * ohs;
      for (int64_t e = 0; e < half; e++) o[e] = y[e] * c[e] + y[e + half] * sg[e];
      for (int64_t e = half; e < d; e++) o[e] = y[e] * c[e] + y[e - half] * sg[e];
    }
}

// n rows of `heads` heads (row r's head j at x + r * xs + j * d) copied to out + r * os + j * ohs
void copy_heads(const float* x, int64_t xs, int64_t n, int64_t heads, int64_t d, float* out, int64_t os, int64_t ohs) {
  for (int64_t r = 0; r < n; r++)
    for (int64_t j = 0; j < heads; j++) std::memcpy(out + r * os + j * ohs, x + r * xs + j * d, sizeof(float) * d);
}

// drafter.FlatDraft's pass after the context features (block-format layers, fused gate/up, norms on
// norm.cpp, full rotary, float32), the same operators in the same order: x [T, H] the embedded block; kv
// [Tc, 2 L Hkv D] the context's keys and values of every layer (the stacked projection); cos/signed_sin
// [T or Tc, 1, D]; keys/values the drafter's cache [L, 1, Hkv, S, D], the context written at start.., the
// block after it as scratch. Per layer 4 norms (input, post-attention, q, k) and 6 linear layers (q, k, v,
// o, gate_up, down), or 4 with q/k/v as one (their blocks stacked: each output column is computed alike, so
// the bits are the same and two calls fewer). Returns the block's hidden states after the final norm.
Tensor draft_stack(const Tensor& x_in, const Tensor& kv_in, const Tensor& q_cos, const Tensor& q_signed,
                   const Tensor& c_cos, const Tensor& c_signed, int64_t start, Tensor& keys, Tensor& values,
                   at::TensorList norms, at::TensorList packed, at::IntArrayRef codes,
                   const c10::List<std::optional<Tensor>>& biases, const Tensor& final_norm, double eps, int64_t h,
                   int64_t hkv, int64_t dh, double scale, int64_t act) {
  const int64_t layers = keys.size(0), t = x_in.size(0), tc = kv_in.size(0), end = start + tc + t;
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "draft_stack takes float32 x [T, H]");
  const int64_t per = (int64_t)packed.size() == 4 * layers ? 4 : 6;  // 4: q/k/v fused
  TORCH_CHECK((int64_t)norms.size() == 4 * layers && (int64_t)packed.size() == per * layers &&
                  (int64_t)codes.size() == per * layers && (int64_t)biases.size() == per * layers,
              "draft_stack: per layer 4 norms and 6 linear layers (4 with q/k/v fused)");
  TORCH_CHECK(kv_in.size(1) == 2 * layers * hkv * dh, "the context keys/values are not [Tc, 2 L Hkv D]");
  TORCH_CHECK(end <= keys.size(3), "KV cache overflow: position ", end, " > capacity ", keys.size(3));
  TORCH_CHECK(act >= 0 && act <= 2, "unknown activation code ", act);
  const Ops& o = ops();
  std::vector<Tensor> kv = kv_in.chunk(2 * layers, -1);  // k, v per layer
  // a float32 cache, context k/v and rotary tables with rows of D floats (as drafter.NativeDraft gives them): the
  // norms, rotations and cache writes in plain loops; else through the operators
  const bool plain = keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat &&
                     kv_in.scalar_type() == at::kFloat && kv_in.stride(1) == 1 && keys.stride(4) == 1 &&
                     values.stride(4) == 1 && q_cos.is_contiguous() && q_signed.is_contiguous() &&
                     c_cos.is_contiguous() && c_signed.is_contiguous() && q_cos.numel() == t * dh &&
                     q_signed.numel() == t * dh && c_cos.numel() == tc * dh && c_signed.numel() == tc * dh &&
                     q_cos.scalar_type() == at::kFloat && c_cos.scalar_type() == at::kFloat &&
                     q_signed.scalar_type() == at::kFloat && c_signed.scalar_type() == at::kFloat &&
                     norms[2].scalar_type() == at::kFloat && norms[3].scalar_type() == at::kFloat;
  Tensor x = x_in;
  for (int64_t i = 0; i < layers; i++) {
    const int64_t n = per * i, m = n + per - 6;  // m + 3 .. m + 5: o, gate_up, down
    const Tensor& k_norm = norms[4 * i + 3];
    Tensor q_out, k_out, v_out;  // [T, H * D], [T, Hkv * D] x 2
    if (per == 4) {
      Tensor qkv = norm_linear(o, x, norms[4 * i], eps, packed[n], codes[n], biases.get(n));
      q_out = qkv.narrow(1, 0, h * dh);
      k_out = qkv.narrow(1, h * dh, hkv * dh);
      v_out = qkv.narrow(1, (h + hkv) * dh, hkv * dh);
    } else {
      Tensor y = o.norm.call(x, norms[4 * i], eps, -1);
      q_out = linear(o, y, packed[n], codes[n], biases.get(n));
      k_out = linear(o, y, packed[n + 1], codes[n + 1], biases.get(n + 1));
      v_out = linear(o, y, packed[n + 2], codes[n + 2], biases.get(n + 2));
    }
    Tensor layer_k = keys.select(0, i), layer_v = values.select(0, i);  // [1, Hkv, S, D]
    Tensor q;  // [T, H, D]
    if (plain) {  // the operators below in two loops: q, and the keys and values written into the cache
      q = at::empty({t, h, dh}, x.options());
      const float *qw = norms[4 * i + 2].data_ptr<float>(), *kw = k_norm.data_ptr<float>();
      const int64_t ks = kv_in.stride(0);
      float *kc = layer_k.data_ptr<float>(), *vc = layer_v.data_ptr<float>();
      const int64_t khs = layer_k.stride(1), kps = layer_k.stride(2), vhs = layer_v.stride(1), vps = layer_v.stride(2);
      const float *qc = q_cos.data_ptr<float>(), *qs = q_signed.data_ptr<float>();
      const float *cc = c_cos.data_ptr<float>(), *cs = c_signed.data_ptr<float>();
      norm_rotate(q_out.data_ptr<float>(), q_out.stride(0), t, h, dh, qw, (float)eps, qc, qs, q.data_ptr<float>(),
                  h * dh, dh);
      norm_rotate(k_out.data_ptr<float>(), k_out.stride(0), t, hkv, dh, kw, (float)eps, qc, qs,
                  kc + (start + tc) * kps, kps, khs);
      norm_rotate(kv[2 * i].data_ptr<float>(), ks, tc, hkv, dh, kw, (float)eps, cc, cs, kc + start * kps, kps, khs);
      copy_heads(kv[2 * i + 1].data_ptr<float>(), ks, tc, hkv, dh, vc + start * vps, vps, vhs);
      copy_heads(v_out.data_ptr<float>(), v_out.stride(0), t, hkv, dh, vc + (start + tc) * vps, vps, vhs);
    } else {
      q = rotate(o.norm.call(q_out.view({t, h, dh}), norms[4 * i + 2], eps, -1), q_cos, q_signed);
      Tensor k_blk = rotate(o.norm.call(k_out.view({t, hkv, dh}), k_norm, eps, -1), q_cos, q_signed);
      Tensor k_ctx = rotate(o.norm.call(kv[2 * i].view({tc, hkv, dh}), k_norm, eps, -1), c_cos, c_signed);
      layer_k.narrow(2, start, tc).copy_(k_ctx.transpose(0, 1));
      layer_v.narrow(2, start, tc).copy_(kv[2 * i + 1].view({tc, hkv, dh}).transpose(0, 1));
      layer_k.narrow(2, start + tc, t).copy_(k_blk.transpose(0, 1));
      layer_v.narrow(2, start + tc, t).copy_(v_out.view({t, hkv, dh}).transpose(0, 1));
    }
    Tensor attn = o.full_attention.call(q, layer_k[0], layer_v[0], end, scale, -1);  // [T, H * D]
    x = add_linear(o, x, attn, packed[m + 3], codes[m + 3], biases.get(m + 3));
    std::vector<Tensor> gu =
        norm_linear(o, x, norms[4 * i + 1], eps, packed[m + 4], codes[m + 4], biases.get(m + 4)).chunk(2, -1);
    x = add_linear(o, x, act_mul(gu[0], gu[1], act), packed[m + 5], codes[m + 5], biases.get(m + 5));
  }
  return o.norm.call(x, final_norm, eps, -1);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dflash, m) {
  m.def("draft_stack(Tensor x, Tensor kv, Tensor q_cos, Tensor q_signed, Tensor c_cos, Tensor c_signed, int start, "
        "Tensor(a!) keys, Tensor(b!) values, Tensor[] norms, Tensor[] packed, int[] codes, Tensor?[] biases, "
        "Tensor final_norm, float eps, int h, int hkv, int dh, float scale, int act) -> Tensor");
  m.impl("draft_stack", c10::DispatchKey::CPU, &draft_stack);
}
