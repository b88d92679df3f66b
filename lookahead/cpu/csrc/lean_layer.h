// A Llama-shaped decoder layer (Llama, Mistral, Qwen2, Qwen3) on packed matrices, run from C++.
//
// The layer issues the same ATen operations, in the same order, as transformers' layer, so its
// results are the same bits; what it saves is the Python around ~35 small operations a layer,
// which costs more than their arithmetic when a step feeds a few tokens. The KV cache update
// between the two halves stays in Python for transformers' caches; for the decoder's KV pool,
// LeanStack runs the whole layer loop, cache writes included, here.
#pragma once

#include <array>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "packed_linear.h"

// RMSNorm as transformers computes it: weight * (x * rsqrt(mean(x^2) + eps)).
struct RmsNorm {
  torch::Tensor weight;
  double eps;

  torch::Tensor operator()(const torch::Tensor& x) const;
};

struct PoolStep;

struct LeanLayer {
  PackedMatrix qkv, o, gate_up, down;  // q/k/v and gate/up fused
  RmsNorm input_norm, post_norm;
  std::optional<RmsNorm> query_norm, key_norm;  // Qwen3 normalises each query and key head
  int64_t heads, kv_heads, head_dim, inner;
  double scaling;

  // hidden [B, L, W], cos and sin [B, L, D] -> queries [B, heads, L, D], keys and values
  // [B, kv_heads, L, D]: the new tokens' entries, RoPE applied to queries and keys.
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> before_attention(const torch::Tensor& hidden,
                                                                           const torch::Tensor& cos,
                                                                           const torch::Tensor& sin) const;

  // Attention of `queries` over keys and values (the cache's and the new ones), then the output
  // projection, the MLP and both residuals: the layer's output [B, L, W].
  torch::Tensor after_attention(const torch::Tensor& hidden, const torch::Tensor& queries, const torch::Tensor& keys,
                                const torch::Tensor& values, const std::optional<torch::Tensor>& mask,
                                bool causal) const;

  // Attention alone: queries [B, heads, L, D] over keys and values -> rows [B * L, heads * D].
  torch::Tensor attend(const torch::Tensor& queries, const torch::Tensor& keys, const torch::Tensor& values,
                       const std::optional<torch::Tensor>& mask, bool causal) const;

  // The new entries written into this layer's pool buffers as `step` says, then attention over
  // what each query may read: rows [B * L, heads * D]. A ragged step attends segment by segment,
  // each over its own slot only.
  torch::Tensor attend_pool(const torch::Tensor& queries, const torch::Tensor& keys, const torch::Tensor& values,
                            const torch::Tensor& mask, const torch::Tensor& key_buffer,
                            const torch::Tensor& value_buffer, const PoolStep& step) const;

  // The output projection of attended rows, the MLP and both residuals: the layer's output [B, L, W].
  torch::Tensor finish(const torch::Tensor& hidden, const torch::Tensor& attended) const;
};

// Where one forward writes its new KV entries in the decoder's pool (lookahead/runtime/kv_pool.py)
// and how far attention reads: the C++ twin of Python's PoolStep, with the same write_and_read.
// Ragged (`segments` [S, 3] of (slot, start, width)): one row of tokens, segment s's `width`
// entries go to [start, start + width) of its slot, and it reads its own slot up to there.
// Batched (`slots` and `positions` [B, L]): row b's entries go to [slots, :, positions];
// attention reads slots 0..B-1 up to read_length.
struct PoolStep {
  std::optional<torch::Tensor> segments, slots, positions;
  int64_t read_length;
  // A ragged step's rows may come with which of their segment's own tokens each sees: row r sees
  // columns own_columns[own_offsets[r] .. own_offsets[r + 1]) of its segment (int32, ascending),
  // besides its slot's first `start` entries. FusedStack reads these instead of a mask.
  std::optional<torch::Tensor> own_offsets, own_columns;

  // keys and values [B, kv_heads, L, head_dim] into one layer's buffers [slots, kv_heads, capacity,
  // head_dim]; returns the entries attention reads (a ragged step's segments side by side).
  std::pair<torch::Tensor, torch::Tensor> write_and_read(const torch::Tensor& key_buffer,
                                                         const torch::Tensor& value_buffer,
                                                         const torch::Tensor& keys,
                                                         const torch::Tensor& values) const;

  // A ragged step's segments as (slot, start, width) rows.
  std::vector<std::array<int64_t, 3>> segment_rows() const;
};

// Every decoder layer of a model, for a forward whose KV cache is the decoder's pool: the loop
// and the cache writes and reads run here, not through Python's per-layer cache.update (~15 us a
// layer). Same operations as the layers and the pool in Python, so the same bits.
struct LeanStack {
  std::vector<LeanLayer> layers;

  // keys[i], values[i]: layer i's pool buffers; `step` says where each row of `hidden` writes and reads.
  torch::Tensor forward(torch::Tensor hidden, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& mask, const std::vector<torch::Tensor>& keys,
                        const std::vector<torch::Tensor>& values, const PoolStep& step) const;
};
