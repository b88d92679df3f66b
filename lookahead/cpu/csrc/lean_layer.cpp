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

torch::Tensor LeanLayer::attend(const torch::Tensor& queries, const torch::Tensor& keys, const torch::Tensor& values,
                                const std::optional<torch::Tensor>& mask, bool causal) const {
  const int64_t batch = queries.size(0), length = queries.size(2);
  const auto attended = at::scaled_dot_product_attention(queries, keys, values, mask, 0.0, causal, scaling,
                                                         /*enable_gqa=*/true);
  return attended.transpose(1, 2).reshape({batch * length, heads * head_dim});
}

torch::Tensor LeanLayer::finish(const torch::Tensor& hidden, const torch::Tensor& attended) const {
  const int64_t batch = hidden.size(0), length = hidden.size(1), width = hidden.size(2);
  const auto residual = hidden + o(attended).view({batch, length, width});
  const auto projected = gate_up(post_norm(residual).view({batch * length, width}));
  const auto gate = projected.index({Slice(), Slice(0, inner)}), up = projected.index({Slice(), Slice(inner)});
  const auto activated = torch::silu(gate) * up;
  return residual + down(activated).view({batch, length, width});
}

torch::Tensor LeanLayer::after_attention(const torch::Tensor& hidden, const torch::Tensor& queries,
                                         const torch::Tensor& keys, const torch::Tensor& values,
                                         const std::optional<torch::Tensor>& mask, bool causal) const {
  return finish(hidden, attend(queries, keys, values, mask, causal));
}

torch::Tensor LeanLayer::attend_pool(const torch::Tensor& queries, const torch::Tensor& keys,
                                     const torch::Tensor& values, const torch::Tensor& mask,
                                     const torch::Tensor& key_buffer, const torch::Tensor& value_buffer,
                                     const PoolStep& step) const {
  if (!step.segments || step.segments->size(0) == 1) {
    auto [read_keys, read_values] = step.write_and_read(key_buffer, value_buffer, keys, values);
    return attend(queries, read_keys, read_values, mask, /*causal=*/false);
  }
  // Each segment over its own slot: the mask's diagonal block, the slot's entries up to its end.
  std::vector<torch::Tensor> attended;
  int64_t offset = 0, column = 0;
  for (const auto& [slot, start, width] : step.segment_rows()) {
    const int64_t end = start + width;
    auto key_slot = key_buffer.select(0, slot), value_slot = value_buffer.select(0, slot);
    key_slot.narrow(1, start, width).copy_(keys[0].narrow(1, offset, width));
    value_slot.narrow(1, start, width).copy_(values[0].narrow(1, offset, width));
    attended.push_back(attend(queries.narrow(2, offset, width), key_buffer.narrow(0, slot, 1).narrow(2, 0, end),
                              value_buffer.narrow(0, slot, 1).narrow(2, 0, end),
                              mask.narrow(2, offset, width).narrow(3, column, end), /*causal=*/false));
    offset += width;
    column += end;
  }
  return torch::cat(attended, 0);
}

std::vector<std::array<int64_t, 3>> PoolStep::segment_rows() const {
  const auto rows = segments->to(torch::kCPU).contiguous();
  const auto data = rows.accessor<int64_t, 2>();
  std::vector<std::array<int64_t, 3>> result;
  for (int64_t i = 0; i < rows.size(0); ++i) result.push_back({data[i][0], data[i][1], data[i][2]});
  return result;
}

std::pair<torch::Tensor, torch::Tensor> PoolStep::write_and_read(const torch::Tensor& key_buffer,
                                                                  const torch::Tensor& value_buffer,
                                                                  const torch::Tensor& keys,
                                                                  const torch::Tensor& values) const {
  TORCH_CHECK(slots.has_value() == positions.has_value(), "slots and positions come together");
  TORCH_CHECK(segments.has_value() != slots.has_value(), "a step is either ragged or batched");
  if (slots) {
    const int64_t batch = keys.size(0);
    torch::Tensor key_handle = key_buffer, value_handle = value_buffer;  // handles on the same storage
    key_handle.index_put_({*slots, Slice(), *positions}, keys.transpose(1, 2));
    value_handle.index_put_({*slots, Slice(), *positions}, values.transpose(1, 2));
    return {key_buffer.narrow(0, 0, batch).narrow(2, 0, read_length),
            value_buffer.narrow(0, 0, batch).narrow(2, 0, read_length)};
  }
  TORCH_CHECK(keys.size(0) == 1, "a ragged step is one row");
  std::vector<torch::Tensor> read_keys, read_values;
  int64_t offset = 0;
  for (const auto& [slot, start, width] : segment_rows()) {
    key_buffer.select(0, slot).narrow(1, start, width).copy_(keys[0].narrow(1, offset, width));
    value_buffer.select(0, slot).narrow(1, start, width).copy_(values[0].narrow(1, offset, width));
    read_keys.push_back(key_buffer.narrow(0, slot, 1).narrow(2, 0, start + width));
    read_values.push_back(value_buffer.narrow(0, slot, 1).narrow(2, 0, start + width));
    offset += width;
  }
  if (read_keys.size() == 1) return {read_keys[0], read_values[0]};
  return {torch::cat(read_keys, 2), torch::cat(read_values, 2)};
}

torch::Tensor LeanStack::forward(torch::Tensor hidden, const torch::Tensor& cos, const torch::Tensor& sin,
                                 const torch::Tensor& mask, const std::vector<torch::Tensor>& keys,
                                 const std::vector<torch::Tensor>& values, const PoolStep& step) const {
  TORCH_CHECK(keys.size() == layers.size() && values.size() == layers.size(), "one pool buffer per layer");
  TORCH_CHECK(mask.dim() == 4, "the lean stack attends through a [B, 1, L, keys] mask");
  for (size_t i = 0; i < layers.size(); ++i) {
    auto [queries, new_keys, new_values] = layers[i].before_attention(hidden, cos, sin);
    hidden = layers[i].finish(
        hidden, layers[i].attend_pool(queries, new_keys, new_values, mask, keys[i], values[i], step));
  }
  return hidden;
}
