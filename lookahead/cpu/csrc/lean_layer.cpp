// See lean_layer.h. Each line mirrors a step of transformers' Llama layer (RMSNorm, q/k/v, RoPE,
// attention, MLP); lookahead/cpu/lean_layers.py's load-time probes compare the bits with the model's own.
#include "lean_layer.h"

using torch::indexing::Slice;

torch::Tensor RmsNorm::operator()(const torch::Tensor& x) const {
  return weight * (x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps));
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> LeanLayer::before_attention(
    const torch::Tensor& hidden, const torch::Tensor& cos, const torch::Tensor& sin) const {
  const int64_t batch = hidden.size(0), length = hidden.size(1), width = hidden.size(2), half = head_dim / 2;
  const auto rows = input_norm(hidden).view({batch * length, width});
  const auto states = qkv(rows).view({batch, length, heads + 2 * kv_heads, head_dim});
  auto rotated = states.index({Slice(), Slice(), Slice(0, heads + kv_heads)});
  auto values = states.index({Slice(), Slice(), Slice(heads + kv_heads)}).transpose(1, 2);
  if (query_norm)
    rotated = torch::cat({(*query_norm)(rotated.index({Slice(), Slice(), Slice(0, heads)})),
                          (*key_norm)(rotated.index({Slice(), Slice(), Slice(heads)}))},
                         2);
  rotated = rotated.transpose(1, 2);
  const auto turned = torch::cat({-rotated.index({"...", Slice(half)}), rotated.index({"...", Slice(0, half)})}, -1);
  rotated = (rotated * cos.unsqueeze(1)) + (turned * sin.unsqueeze(1));
  return {rotated.index({Slice(), Slice(0, heads)}), rotated.index({Slice(), Slice(heads)}), values};
}

torch::Tensor LeanLayer::after_attention(const torch::Tensor& hidden, const torch::Tensor& queries,
                                         const torch::Tensor& keys, const torch::Tensor& values,
                                         const std::optional<torch::Tensor>& mask, bool causal) const {
  const int64_t batch = hidden.size(0), length = hidden.size(1), width = hidden.size(2);
  auto attended = at::scaled_dot_product_attention(queries, keys, values, mask, 0.0, causal, scaling,
                                                   /*enable_gqa=*/true);
  attended = attended.transpose(1, 2).reshape({batch * length, heads * head_dim});
  const auto residual = hidden + o(attended).view({batch, length, width});
  const auto projected = gate_up(post_norm(residual).view({batch * length, width}));
  const auto gate = projected.index({Slice(), Slice(0, inner)}), up = projected.index({Slice(), Slice(inner)});
  const auto activated = torch::silu(gate) * up;
  return residual + down(activated).view({batch, length, width});
}

std::pair<torch::Tensor, torch::Tensor> PoolStep::write_and_read(const torch::Tensor& key_buffer,
                                                                  const torch::Tensor& value_buffer,
                                                                  const torch::Tensor& keys,
                                                                  const torch::Tensor& values) const {
  TORCH_CHECK(slots.has_value() == positions.has_value(), "slots and positions come together");
  const int64_t batch = keys.size(0), length = keys.size(2);
  TORCH_CHECK(slots || batch == 1, "a batch needs slots and positions");
  if (slots) {
    torch::Tensor key_handle = key_buffer, value_handle = value_buffer;  // handles on the same storage
    key_handle.index_put_({*slots, Slice(), *positions}, keys.transpose(1, 2));
    value_handle.index_put_({*slots, Slice(), *positions}, values.transpose(1, 2));
  } else {
    key_buffer.select(0, 0).narrow(1, start, length).copy_(keys[0]);
    value_buffer.select(0, 0).narrow(1, start, length).copy_(values[0]);
  }
  return {key_buffer.narrow(0, 0, batch).narrow(2, 0, read_length),
          value_buffer.narrow(0, 0, batch).narrow(2, 0, read_length)};
}

torch::Tensor LeanStack::forward(torch::Tensor hidden, const torch::Tensor& cos, const torch::Tensor& sin,
                                 const torch::Tensor& mask, const std::vector<torch::Tensor>& keys,
                                 const std::vector<torch::Tensor>& values, const PoolStep& step) const {
  TORCH_CHECK(keys.size() == layers.size() && values.size() == layers.size(), "one pool buffer per layer");
  for (size_t i = 0; i < layers.size(); ++i) {
    auto [queries, new_keys, new_values] = layers[i].before_attention(hidden, cos, sin);
    auto [read_keys, read_values] = step.write_and_read(keys[i], values[i], new_keys, new_values);
    hidden = layers[i].after_attention(hidden, queries, read_keys, read_values, mask, /*causal=*/false);
  }
  return hidden;
}
