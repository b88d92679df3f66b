// Work split between the threads of one OpenMP team (torch's own runtime: the extension links the
// libgomp torch loads, so both share one pool of threads).
#pragma once

#include <omp.h>

#include <cstdint>
#include <utility>

// Units [0, units) in contiguous, even shares: thread `thread` of `threads` takes [first, last).
inline std::pair<int64_t, int64_t> thread_share(int64_t units, int thread, int threads) {
  return {units * thread / threads, units * (thread + 1) / threads};
}
