// The k most likely next tokens of each row of logits, and the row's log-sum-exp, in two reads of
// the row (runtime/recycling.py: the recycle table's candidates and their probabilities).
#pragma once

#include <torch/extension.h>

#include <tuple>

// rows [R, V] fp32 -> (values [R, k] fp32 largest first, indices [R, k] int64, log-sum-exp [R]).
// Among equal values the lower index comes first.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> top_candidates(const torch::Tensor& rows, int64_t k);
