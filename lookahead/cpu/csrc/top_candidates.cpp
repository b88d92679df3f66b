// See top_candidates.h. The first read finds the row's largest value (the softmax's shift); the
// second sums e^(x - max) sixteen lanes at a time and keeps the k best values, looking at a block
// of sixteen one by one only where its largest value beats the k-th best so far.
#include "top_candidates.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "parallel.h"
#include "simd.h"

namespace {

constexpr int64_t kLanes = 16;

void one_row(const float* row, int64_t V, int64_t k, float* values, int64_t* indices, float* lse) {
  const float lowest = -std::numeric_limits<float>::infinity();
  const int64_t full = V / kLanes * kLanes;
  F32x16 best = F32x16::broadcast(lowest);
  for (int64_t i = 0; i < full; i += kLanes) best = F32x16::max(best, F32x16::load(row + i));
  float shift = reduce_max(best);
  for (int64_t i = full; i < V; ++i) shift = std::max(shift, row[i]);
  if (!std::isfinite(shift)) shift = 0.0f;  // a row of -inf (or with +inf or NaN): no shift helps

  std::vector<float> top_values(k, lowest);
  std::vector<int64_t> top_indices(k, -1);
  const auto offer = [&](float value, int64_t index) {
    if (!(value > top_values[k - 1])) return;
    int64_t at = k - 1;
    while (at > 0 && value > top_values[at - 1]) {
      top_values[at] = top_values[at - 1];
      top_indices[at] = top_indices[at - 1];
      --at;
    }
    top_values[at] = value;
    top_indices[at] = index;
  };
  const F32x16 minus_shift = F32x16::broadcast(-shift);
  F32x16 sum = F32x16::zero();
  for (int64_t i = 0; i < full; i += kLanes) {
    const F32x16 block = F32x16::load(row + i);
    sum = F32x16::add(sum, exp(F32x16::add(block, minus_shift)));
    if (reduce_max(block) > top_values[k - 1])
      for (int64_t j = 0; j < kLanes; ++j) offer(row[i + j], i + j);
  }
  float tail = 0.0f;
  for (int64_t i = full; i < V; ++i) {
    tail += std::exp(row[i] - shift);
    offer(row[i], i);
  }
  *lse = shift + std::log(reduce_add(sum) + tail);
  std::copy(top_values.begin(), top_values.end(), values);
  std::copy(top_indices.begin(), top_indices.end(), indices);
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> top_candidates(const torch::Tensor& rows, int64_t k) {
  TORCH_CHECK(rows.dim() == 2 && rows.is_contiguous() && rows.scalar_type() == torch::kFloat32,
              "rows must be a contiguous fp32 [R, V] tensor");
  const int64_t R = rows.size(0), V = rows.size(1);
  TORCH_CHECK(k >= 1 && k <= V, "k must be within 1..", V, ", not ", k);
  auto values = torch::empty({R, k}, rows.options());
  auto indices = torch::empty({R, k}, rows.options().dtype(torch::kInt64));
  auto lse = torch::empty({R}, rows.options());
  const float* data = rows.data_ptr<float>();
  float* value_data = values.data_ptr<float>();
  int64_t* index_data = indices.data_ptr<int64_t>();
  float* lse_data = lse.data_ptr<float>();
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), R)));
#pragma omp parallel num_threads(threads)
  {
    const auto [first, last] = thread_share(R, omp_get_thread_num(), omp_get_num_threads());
    for (int64_t r = first; r < last; ++r)
      one_row(data + r * V, V, k, value_data + r * k, index_data + r * k, lse_data + r);
  }
  return {values, indices, lse};
}
