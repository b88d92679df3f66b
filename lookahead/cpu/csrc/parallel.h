// Work split between the threads of one OpenMP team (torch's own runtime: the extension links the
// libgomp torch loads, so both share one pool of threads).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

// Units [0, units) in contiguous, even shares: thread `thread` of `threads` takes [first, last).
inline std::pair<int64_t, int64_t> thread_share(int64_t units, int thread, int threads) {
  return {units * thread / threads, units * (thread + 1) / threads};
}

// Units in contiguous shares of about equal cost: `prefix` holds the running sums of the units'
// costs (prefix[u] = the cost of units [0, u), so prefix.size() is one more than the units);
// thread `thread` of `threads` takes [first, last).
inline std::pair<int64_t, int64_t> weighted_share(const std::vector<double>& prefix, int thread, int threads) {
  const int64_t units = static_cast<int64_t>(prefix.size()) - 1;
  const auto bound = [&](int t) -> int64_t {
    if (t <= 0) return 0;
    if (t >= threads) return units;
    const double target = prefix.back() * t / threads;
    return std::lower_bound(prefix.begin(), prefix.end(), target) - prefix.begin();
  };
  return {bound(thread), bound(thread + 1)};
}
