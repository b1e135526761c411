// What the two layer stacks share (layers.cpp: the target's decoder stack; draft.cpp: the drafter's): the
// library's other kernels looked up once, and the linear steps of drafter.FlatDraft and llama.FlatLayers on them.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>

namespace dflash_layers {

using at::Tensor;

// the other kernels of this library, looked up once (typed handles: an unboxed call, no IValues)
struct Ops {
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t, int64_t, int64_t)> mm;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t, int64_t, const Tensor&, int64_t)> mm_add;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double, int64_t)> norm;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double, const Tensor&, int64_t, int64_t, int64_t)>
      mm_norm;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t,
                                  int64_t, int64_t, double)>
      rope_attention;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t, double, int64_t)> full_attention;
};

const Ops& ops();

// flat.linear for a BLOCK layer: the kernel's float32 output (+ bias)
Tensor linear(const Ops& o, const Tensor& x, const Tensor& packed, int64_t code, const std::optional<Tensor>& bias);
// linear(rms_norm(x, w)): the norm inside the kernel, on each row before its quantization (the same bits)
Tensor norm_linear(const Ops& o, const Tensor& x, const Tensor& w, double eps, const Tensor& packed, int64_t code,
                   const std::optional<Tensor>& bias);
// flat.add_linear: r + linear(x), the add inside the kernel where there is no bias
Tensor add_linear(const Ops& o, const Tensor& r, const Tensor& x, const Tensor& packed, int64_t code,
                  const std::optional<Tensor>& bias);

}  // namespace dflash_layers
