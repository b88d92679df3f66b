// Every decoder layer of a Llama-shaped model in one parallel region, for the integer path.
//
// LeanStack (lean_layer.h) issues transformers' own ATen operations, so that its results are the
// model's bits, and pays for it: ~35 dispatched operations and four parallel regions a layer.
// FusedStack computes the same layer with its own loops: RMSNorm, RoPE, attention over the
// decoder's KV pool, SiLU, the residuals, the packed matrices; the threads of one OpenMP team
// share each step's work and meet at a barrier between steps. Its arithmetic is its own (and the
// same on every variant: simd.h), so it is not transformers' to the last bit, but every value of
// a row depends on that row and the entries it attends to alone:
//
// - norms, RoPE, SiLU and quantisation work row by row, in a fixed order;
// - attention visits the keys a row may see (its mask row's zeros, or its lists) in pool order
//   and skips the others, so a draft node sees exactly what the same token sees in plain decoding;
// - the matrices are the packed kernels, whose outputs do not depend on the other rows.
//
// So lookahead and plain decoding on this path give the same tokens, alone or batched.
#pragma once

#include <array>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "lean_layer.h"

struct FusedStack {
  std::vector<LeanLayer> layers;  // the same weights and shapes LeanStack runs

  // With `profiling` on, thread 0 adds the seconds it spends in each step of the layers, and
  // waiting at the barriers after them, to `step_seconds` (lookahead/benchmarks/roofline.py).
  enum Step {
    kNormQuantise, kQkv, kRope, kAttention, kQuantise, kO, kResidualNormQuantise, kGateUp, kSiluQuantise, kDown,
    kResidual, kHandOffs, kSteps
  };
  static const char* const kStepNames[kSteps];
  bool profiling = false;
  mutable std::array<double, kSteps> step_seconds{};
  mutable int64_t profiled_forwards = 0;
  std::map<std::string, double> step_times() const;  // by step name, and "forwards"
  void reset_step_times() const;

  // Checks once that every layer has the shapes the loops handle (a head size and a width that are
  // multiples of 16).
  explicit FusedStack(std::vector<LeanLayer> layers);

  // As LeanStack::forward: hidden [B, L, W], cos and sin [B, L, D], the additive mask the decoder
  // built ([B, 1, L, keys]: 0 where a key is visible), each layer's pool buffers (all fp32, or all
  // fp16: entries stored as IEEE halves and read back as fp32), where the step writes and reads. A
  // ragged step that carries its rows' own columns (PoolStep::own_offsets) needs no mask: `mask`
  // is then not read. Returns the last layer's output [B, L, W], passed through the model's final
  // norm where `final_norm` is given (each thread norms its own rows, so the stack's caller runs
  // no operation of its own between the layers and the output layer).
  torch::Tensor forward(const torch::Tensor& hidden, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& mask, const std::vector<torch::Tensor>& keys,
                        const std::vector<torch::Tensor>& values, const PoolStep& step,
                        const std::optional<RmsNorm>& final_norm = std::nullopt) const;
};
