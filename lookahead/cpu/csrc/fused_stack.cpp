// See fused_stack.h. One forward: the threads of one OpenMP team run every layer's steps below,
// each taking its share of rows, of (row, head) pairs or of output blocks, with a barrier wherever
// a step reads what another thread wrote.
#include "fused_stack.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <type_traits>
#include <utility>

#include "parallel.h"
#include "simd.h"

namespace {

constexpr int64_t kLanes = 16;
using Clock = std::chrono::steady_clock;

// Where a row of the forward writes its KV entries and which pool entries it may read: the zeros
// of its mask row over the entries [0, keys) of its slot, or (no mask) the slot's first `start`
// entries and then `own`, the columns of its segment it sees (entry start + column).
struct RowPlan {
  int64_t slot, position;
  const float* mask;  // nullptr: `start` and `own`
  int64_t keys;
  int64_t start = 0;
  const int32_t* own = nullptr;
  int64_t own_count = 0;
};

// A ragged step whose rows come with the lists of their segment's columns they see
// (PoolStep::own_offsets and own_columns), checked here: each row's columns ascend within its
// segment.
std::vector<RowPlan> rows_from_lists(const PoolStep& step, int64_t B, int64_t L) {
  TORCH_CHECK(B == 1, "a ragged step is one row of tokens");
  TORCH_CHECK(step.own_columns.has_value(), "own_offsets comes with own_columns");
  const torch::Tensor &offsets = *step.own_offsets, &columns = *step.own_columns;
  for (const auto* list : {&offsets, &columns})
    TORCH_CHECK(list->dim() == 1 && list->is_contiguous() && list->scalar_type() == torch::kInt32 &&
                    list->device().is_cpu(),
                "own_offsets and own_columns must be contiguous int32 vectors on the CPU");
  TORCH_CHECK(offsets.numel() == L + 1, "own_offsets needs one more entry than the step has tokens");
  const int32_t* bounds = offsets.data_ptr<int32_t>();
  const int32_t* seen = columns.data_ptr<int32_t>();
  TORCH_CHECK(bounds[0] == 0 && bounds[L] == columns.numel(), "own_offsets must span own_columns");
  std::vector<RowPlan> rows;
  int64_t offset = 0;
  for (const auto& [slot, start, width] : step.segment_rows()) {
    TORCH_CHECK(offset + width <= L, "the segments do not cover the step's tokens");
    for (int64_t t = 0; t < width; ++t) {
      const int64_t first = bounds[offset + t], last = bounds[offset + t + 1];
      TORCH_CHECK(first <= last, "own_offsets must not decrease");
      for (int64_t i = first; i < last; ++i)
        TORCH_CHECK(seen[i] >= 0 && seen[i] < width && (i == first || seen[i] > seen[i - 1]),
                    "a row's own columns must ascend within its segment");
      rows.push_back({slot, start + t, nullptr, start + width, start, seen + first, last - first});
    }
    offset += width;
  }
  TORCH_CHECK(offset == L, "the segments do not cover the step's tokens");
  return rows;
}

std::vector<RowPlan> plan_rows(const PoolStep& step, const torch::Tensor& mask, int64_t B, int64_t L) {
  if (step.segments && step.own_offsets) return rows_from_lists(step, B, L);
  TORCH_CHECK(mask.dim() == 4 && mask.is_contiguous() && mask.scalar_type() == torch::kFloat32,
              "the mask must be a contiguous fp32 [B, 1, L, keys] tensor");
  const float* data = mask.data_ptr<float>();
  const int64_t columns = mask.size(3);
  std::vector<RowPlan> rows;
  if (step.segments) {
    TORCH_CHECK(B == 1 && mask.size(0) == 1 && mask.size(2) == L, "a ragged step is one row of tokens");
    int64_t offset = 0, column = 0;
    for (const auto& [slot, start, width] : step.segment_rows()) {
      for (int64_t t = 0; t < width; ++t)
        rows.push_back({slot, start + t, data + (offset + t) * columns + column, start + width});
      offset += width;
      column += start + width;
    }
    TORCH_CHECK(offset == L && column <= columns, "the segments do not cover the step's tokens");
  } else {
    TORCH_CHECK(step.slots && step.positions, "a batched step needs slots and positions");
    TORCH_CHECK(mask.size(0) == B && mask.size(2) == L && columns >= step.read_length, "mask shape");
    const auto slots = step.slots->to(torch::kCPU).contiguous(), positions = step.positions->to(torch::kCPU).contiguous();
    const auto s = slots.accessor<int64_t, 2>(), p = positions.accessor<int64_t, 2>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < L; ++t) rows.push_back({s[b][t], p[b][t], data + (b * L + t) * columns, step.read_length});
  }
  return rows;
}

// weight * (x * (1 / sqrt(mean(x^2) + eps))) over `width` values (a multiple of 16); `out` may be `x`.
void rms_norm(const float* x, const float* weight, float eps, int64_t width, float* out) {
  F32x16 squares = F32x16::zero();
  for (int64_t i = 0; i < width; i += kLanes) {
    const F32x16 v = F32x16::load(x + i);
    squares = F32x16::fmadd(v, v, squares);
  }
  const float mean = reduce_add(squares) / static_cast<float>(width);
  const F32x16 factor = F32x16::broadcast(1.0f / std::sqrt(mean + eps));
  for (int64_t i = 0; i < width; i += kLanes)
    F32x16::mul(F32x16::load(weight + i), F32x16::mul(F32x16::load(x + i), factor)).store(out + i);
}

// RoPE in place on one head of `dim` values: x * cos + rotate_half(x) * sin, as transformers has it
// (a product each, then one addition).
void rotate(float* x, const float* cos, const float* sin, int64_t dim) {
  const int64_t half = dim / 2;
  int64_t i = 0;
  for (; i + kLanes <= half; i += kLanes) {
    const F32x16 a = F32x16::load(x + i), b = F32x16::load(x + half + i);
    const F32x16 first = F32x16::sub(F32x16::mul(a, F32x16::load(cos + i)), F32x16::mul(b, F32x16::load(sin + i)));
    const F32x16 second =
        F32x16::add(F32x16::mul(b, F32x16::load(cos + half + i)), F32x16::mul(a, F32x16::load(sin + half + i)));
    first.store(x + i);
    second.store(x + half + i);
  }
  for (; i < half; ++i) {
    const float a = x[i], b = x[half + i];
    x[i] = a * cos[i] - b * sin[i];
    x[half + i] = b * cos[half + i] + a * sin[half + i];
  }
}

// The pool entries each row of the step sees, found once per forward (every layer and head reads
// them): the zeros of its mask row or the entries its lists name, in pool order, and how many of
// them lead as 0, 1, 2, ... (the committed history its tree shares with the other rows of its
// segment).
struct Visibility {
  std::vector<int32_t> entries;
  int64_t prefix = 0;
};

std::vector<Visibility> visible_entries(const std::vector<RowPlan>& rows) {
  std::vector<Visibility> visible(rows.size());
  for (size_t r = 0; r < rows.size(); ++r) {
    auto& [entries, prefix] = visible[r];
    const RowPlan& row = rows[r];
    if (row.mask == nullptr) {
      entries.resize(row.start + row.own_count);
      std::iota(entries.begin(), entries.begin() + row.start, 0);
      for (int64_t i = 0; i < row.own_count; ++i)
        entries[row.start + i] = static_cast<int32_t>(row.start + row.own[i]);
    } else {
      for (int64_t j = 0; j < row.keys; ++j)
        if (row.mask[j] == 0.0f) entries.push_back(static_cast<int32_t>(j));
    }
    while (prefix < static_cast<int64_t>(entries.size()) && entries[prefix] == prefix) ++prefix;
  }
  return visible;
}

// A query's softmax runs span by span over its list of entries ([0, 1024), [1024, 2048), ... by
// place in the list) and merges the spans in order. A span's scores and values stay in cache while
// every query of its unit reads them, and where spans fall depends on the query's list alone.
constexpr int64_t kSpan = 1024;
constexpr int64_t kScoreStride = kSpan + kLanes;

// Rows of one slot and query heads of one key/value head that attend together: the unit reads
// its entries' keys and values once for all of its queries (a row and a head each), over the
// spans [first_span, end_span) of their lists. A split unit is one of several that share out its
// queries' spans: it leaves each span's part of the softmax for SpanParts to merge.
struct AttentionUnit {
  int64_t first_row, rows, first_head, heads;
  int64_t first_span = 0, end_span = std::numeric_limits<int64_t>::max();
  bool split = false;

  // Where the unit's spans end in a list of `count` entries (the last span runs to its end).
  int64_t end_entry(int64_t count) const { return end_span > count / kSpan ? count : end_span * kSpan; }
};
constexpr int64_t kQueriesPerUnit = 128;

// Where a unit's keys and values outgrow this, reading them once counts for more than an even
// share of the work: a key/value head's whole group of query heads goes in one unit.
constexpr int64_t kCachedHistoryBytes = 512 * 1024;

// As few units as keep every thread busy: rows of a slot in chunks of up to 16 (fewer where the
// key groups hold many heads), halved while there are too few units, then one head a unit if still
// too few. Too few: under two units a thread over histories that stay in cache, under one a thread
// over longer ones.
std::vector<AttentionUnit> attention_units(const std::vector<RowPlan>& rows, const std::vector<Visibility>& visible,
                                           int64_t heads, int64_t kv_heads, int64_t dim, int64_t threads) {
  const int64_t group = heads / kv_heads;
  size_t longest = 0;
  for (const auto& seen : visible) longest = std::max(longest, seen.entries.size());
  const bool long_history = static_cast<int64_t>(longest) * dim * 2 * 4 > kCachedHistoryBytes;
  const int64_t enough = long_history ? threads : 2 * threads;
  int64_t chunk = std::clamp<int64_t>(kQueriesPerUnit / group, 1, 16);
  std::vector<std::pair<int64_t, int64_t>> chunks;
  while (true) {
    chunks.clear();
    for (size_t r = 0; r < rows.size();) {
      size_t end = r + 1;
      while (end < rows.size() && rows[end].slot == rows[r].slot && static_cast<int64_t>(end - r) < chunk) ++end;
      chunks.emplace_back(static_cast<int64_t>(r), static_cast<int64_t>(end - r));
      r = end;
    }
    if (chunk == 1 || static_cast<int64_t>(chunks.size()) * kv_heads >= enough) break;
    chunk = (chunk + 1) / 2;
  }
  const int64_t heads_per_unit =
      static_cast<int64_t>(chunks.size()) * kv_heads >= enough ? std::min(group, kQueriesPerUnit) : 1;
  // Key/value head by key/value head, so that a thread's consecutive units share their entries.
  std::vector<AttentionUnit> units;
  for (int64_t head = 0; head < heads; head += heads_per_unit)
    for (const auto& [first, count] : chunks)
      units.push_back({first, count, head, std::min(heads_per_unit, (head / group + 1) * group - head)});
  if (!long_history || static_cast<int64_t>(units.size()) % threads == 0 ||
      static_cast<int64_t>(units.size()) >= 4 * threads)
    return units;
  // Too few units to share out evenly over a long history (3 key/value heads on 2 threads): each
  // unit's spans of shared history go to `threads` units, the last taking the rest of its lists.
  std::vector<AttentionUnit> split;
  for (const AttentionUnit& unit : units) {
    int64_t shared = std::numeric_limits<int64_t>::max();
    for (int64_t r = unit.first_row; r < unit.first_row + unit.rows; ++r) shared = std::min(shared, visible[r].prefix);
    const int64_t spans = shared / kSpan;
    if (spans < threads) {
      split.push_back(unit);
      continue;
    }
    for (int64_t part = 0; part < threads; ++part) {
      AttentionUnit piece = unit;
      piece.first_span = spans * part / threads;
      piece.end_span = part + 1 < threads ? spans * (part + 1) / threads : std::numeric_limits<int64_t>::max();
      piece.split = true;
      split.push_back(piece);
    }
  }
  return split;
}

// The parts of the softmax that split units leave, span by span, for each (row, head) query:
// after the attention's barrier each thread merges its rows' parts in span order with the same
// operations a unit uses when it holds every span, so the bits do not depend on the split.
struct SpanParts {
  int64_t heads = 0, dim = 0, spans = 0;
  std::vector<char> split;  // [row * heads + head]
  std::vector<float> largest, total, weighted;  // [query][span], weighted: [query][span][dim]

  SpanParts(const std::vector<AttentionUnit>& units, const std::vector<Visibility>& visible, int64_t heads,
            int64_t dim)
      : heads(heads), dim(dim) {
    for (const AttentionUnit& unit : units) {
      if (!unit.split) continue;
      if (split.empty()) {
        size_t longest = 0;
        for (const auto& seen : visible) longest = std::max(longest, seen.entries.size());
        spans = (static_cast<int64_t>(longest) + kSpan - 1) / kSpan;
        const size_t queries = visible.size() * heads;
        split.assign(queries, 0);
        largest.resize(queries * spans);
        total.resize(queries * spans);
        weighted.resize(queries * spans * dim);
      }
      for (int64_t r = unit.first_row; r < unit.first_row + unit.rows; ++r)
        for (int64_t h = unit.first_head; h < unit.first_head + unit.heads; ++h) split[r * heads + h] = 1;
    }
  }

  int64_t at(int64_t row, int64_t head, int64_t span) const { return (row * heads + head) * spans + span; }

  // Row r's split queries: their spans merged in order into `out` (r's heads side by side), divided.
  void merge(int64_t r, int64_t entries, float* out) const {
    if (split.empty()) return;
    const int64_t count = (entries + kSpan - 1) / kSpan, chunks = dim / kLanes;
    for (int64_t h = 0; h < heads; ++h) {
      if (!split[r * heads + h]) continue;
      float* result = out + h * dim;
      const int64_t first = at(r, h, 0);
      float best = largest[first], sum = total[first];
      std::copy(weighted.begin() + first * dim, weighted.begin() + (first + 1) * dim, result);
      for (int64_t s = 1; s < count; ++s) {
        const int64_t i = first + s;
        const float merged = std::max(best, largest[i]);
        const float kept = std::exp(best - merged), taken = std::exp(largest[i] - merged);
        sum = sum * kept + total[i] * taken;
        best = merged;
        for (int64_t c = 0; c < chunks; ++c)
          F32x16::fmadd(F32x16::load(weighted.data() + i * dim + c * kLanes), F32x16::broadcast(taken),
                        F32x16::mul(F32x16::load(result + c * kLanes), F32x16::broadcast(kept)))
              .store(result + c * kLanes);
      }
      const F32x16 divisor = F32x16::broadcast(sum);
      for (int64_t c = 0; c < chunks; ++c)
        F32x16::div(F32x16::load(result + c * kLanes), divisor).store(result + c * kLanes);
    }
  }
};

// The running sums of the units' costs (weighted_share's `prefix`): each query of a unit costs its
// row's visible entries, plus a fixed part for its softmax and output.
std::vector<double> attention_costs(const std::vector<AttentionUnit>& units, const std::vector<Visibility>& visible) {
  std::vector<double> prefix(units.size() + 1, 0.0);
  for (size_t u = 0; u < units.size(); ++u) {
    const AttentionUnit& unit = units[u];
    double entries = 0.0;
    for (int64_t r = unit.first_row; r < unit.first_row + unit.rows; ++r) {
      const int64_t count = static_cast<int64_t>(visible[r].entries.size());
      const int64_t read = unit.end_entry(count) - unit.first_span * kSpan;
      entries += static_cast<double>(std::max<int64_t>(0, read)) + 2 * kLanes;
    }
    prefix[u + 1] = prefix[u] + entries * static_cast<double>(units[u].heads);
  }
  return prefix;
}

// Up to 16 scores of one query against keys[0..n): lane k is the dot product of the query with
// keys[k] (a product per lane, then multiply-adds along the head, then reduce_add's tree), zero
// from lane n on. A score's bits depend on its query and key alone, not on the keys beside it.
// C: the head's 16-lane chunks when known at compile time (0: `chunks` at run time).
template <int C>
F32x16 dots16(const float* query, const float* const* keys, int64_t n, int64_t chunks) {
  if constexpr (C > 0) chunks = C;
  F32x16 partials[kLanes];
#pragma GCC unroll 16
  for (int64_t k = 0; k < kLanes; ++k) {
    if (k >= n) {
      partials[k] = F32x16::zero();
      continue;
    }
    F32x16 acc = F32x16::mul(F32x16::load(query), F32x16::load(keys[k]));
#pragma GCC unroll 8
    for (int64_t c = 1; c < chunks; ++c)
      acc = F32x16::fmadd(F32x16::load(query + c * kLanes), F32x16::load(keys[k] + c * kLanes), acc);
    partials[k] = acc;
  }
  return reduce_add16(partials);
}

// The pool holds fp32 entries or IEEE halves (Entry float or uint16_t); attention reads either as
// fp32. A chunk of 16 lanes of an entry:
inline F32x16 load_entry(const float* p) { return F32x16::load(p); }
inline F32x16 load_entry(const uint16_t* p) { return F32x16::from_half(p); }
inline void store_entry(const float* x, int64_t n, float* p) { std::memcpy(p, x, n * sizeof(float)); }
inline void store_entry(const float* x, int64_t n, uint16_t* p) {
  for (int64_t i = 0; i < n; i += kLanes) F32x16::load(x + i).store_half(p + i);
}

// Where attend reads `n` entries of `dim` lanes: fp32 entries in place; halves converted into
// `scratch` first, once for every query that reads them.
inline const float* entries_as_float(const float* first, int64_t, int64_t, float*) { return first; }
inline const float* entries_as_float(const uint16_t* first, int64_t n, int64_t dim, float* scratch) {
  for (int64_t i = 0; i < n * dim; i += kLanes) F32x16::from_half(first + i).store(scratch + i);
  return scratch;
}

// Chunks [d0, d0 + width) of the values of entries [j0, j1), as attend's multiply-adds read them
// from the first entry's chunk d0: fp32 entries in place (stride dim); halves converted into
// `scratch` (stride width chunks).
inline const float* values_as_float(const float* values, int64_t j0, int64_t, int64_t dim, int64_t d0, int64_t,
                                    float*) {
  return values + j0 * dim + d0 * kLanes;
}
inline const float* values_as_float(const uint16_t* values, int64_t j0, int64_t j1, int64_t dim, int64_t d0,
                                    int64_t width, float* scratch) {
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t c = 0; c < width; ++c)
      F32x16::from_half(values + j * dim + (d0 + c) * kLanes).store(scratch + ((j - j0) * width + c) * kLanes);
  return scratch;
}

// T queries' weighted values over the shared entries [j0, j1): sums[t] += weights[t][j] * value j,
// the value's `width` chunks at once, with the T x width accumulators in registers. `weights`:
// the first query's scores by entry number (kScoreStride apart); value j at values + (j - j0) *
// stride. A query's sums do not depend on which queries share the call.
template <int64_t T, int64_t width>
inline void weigh_values(F32x16 (*sums)[width], const float* weights, int64_t j0, int64_t j1, const float* values,
                         int64_t stride) {
  F32x16 acc[T][width];
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < width; ++c) acc[t][c] = sums[t][c];
  for (int64_t j = j0; j < j1; ++j) {
    const float* value = values + (j - j0) * stride;
#pragma GCC unroll 16
    for (int64_t t = 0; t < T; ++t) {
      const F32x16 p = F32x16::broadcast(weights[t * kScoreStride + j]);
#pragma GCC unroll 8
      for (int64_t c = 0; c < width; ++c) acc[t][c] = F32x16::fmadd(p, F32x16::load(value + c * kLanes), acc[t][c]);
    }
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < width; ++c) sums[t][c] = acc[t][c];
}

// weigh_values for the `count` < T queries left after the groups of T.
template <int64_t T, int64_t width>
inline void weigh_fewer(int64_t count, F32x16 (*sums)[width], const float* weights, int64_t j0, int64_t j1,
                        const float* values, int64_t stride) {
  if constexpr (T > 1) {
    if (count == T - 1) return weigh_values<T - 1, width>(sums, weights, j0, j1, values, stride);
    return weigh_fewer<T - 1, width>(count, sums, weights, j0, j1, values, stride);
  }
}

// What attend converts half entries into: a block of up to 16 keys and a stretch of values.
constexpr int64_t kValueStretchLanes = 256 * kLanes;
int64_t converted_floats(int64_t dim) { return kLanes * dim + kValueStretchLanes; }

// A unit's queries over the entries each sees: softmax(q . k * scaling) . v. The entries every row
// of the unit sees first (the shared history) are read once for all of its queries; each query
// still visits its own entries in list order with the same operations as alone, so its result
// does not depend on which queries share the unit. Entry i of a row's list always takes the same
// lane of its span's sum (i mod 16), so the same token at the same place in its history gets the
// same bits in a tree and in plain decoding. `scores`: kScoreStride floats per query;
// `converted`: converted_floats(dim) floats (half entries). A split unit writes its spans' parts
// to `parts` instead.
template <int C, typename Entry>
void attend(const AttentionUnit& unit, const float* qkv, int64_t qkv_width, const Entry* keys, const Entry* values,
            const std::vector<Visibility>& visible, int64_t dim, float scaling, float* scores, float* converted,
            float* out, int64_t out_stride, SpanParts& parts) {
  const int64_t chunks = C > 0 ? C : dim / kLanes;
  const int64_t Q = unit.rows * unit.heads;
  const Visibility* seen[kQueriesPerUnit];
  const float* query[kQueriesPerUnit];
  float* result[kQueriesPerUnit];  // the running weighted values, divided by the total at the end
  int64_t shared = std::numeric_limits<int64_t>::max(), longest = 0;
  for (int64_t i = 0; i < Q; ++i) {
    const int64_t row = unit.first_row + i / unit.heads, head = unit.first_head + i % unit.heads;
    seen[i] = &visible[row];
    query[i] = qkv + row * qkv_width + head * dim;
    result[i] = out + row * out_stride + head * dim;
    shared = std::min(shared, seen[i]->prefix);
    longest = std::max(longest, static_cast<int64_t>(seen[i]->entries.size()));
  }
  const F32x16 scale = F32x16::broadcast(scaling);
  const float* block[kLanes];
  // Each query's running softmax: its largest score so far, the sum of e^(score - largest), and
  // the factors that carry the weighted values so far (kept) and the span's (taken) over to it.
  float largest[kQueriesPerUnit], total[kQueriesPerUnit], kept[kQueriesPerUnit], taken[kQueriesPerUnit];
  int64_t part[kQueriesPerUnit];  // a split unit's query: where its spans' parts go
  for (int64_t i = 0; i < Q; ++i)
    part[i] = unit.split ? parts.at(unit.first_row + i / unit.heads, unit.first_head + i % unit.heads, 0) : 0;
  for (int64_t e0 = unit.first_span * kSpan, last = unit.end_entry(longest); e0 < last; e0 += kSpan) {
    const int64_t e1 = e0 + kSpan, common = std::clamp(shared, e0, e1);  // [e0, common): entry j is j for all
    for (int64_t j = e0; j < common; j += kLanes) {
      const int64_t n = std::min(kLanes, common - j);
      const float* first = entries_as_float(keys + j * dim, n, dim, converted);
      for (int64_t k = 0; k < n; ++k) block[k] = first + k * dim;
      for (int64_t i = 0; i < Q; ++i)
        F32x16::mul(dots16<C>(query[i], block, n, chunks), scale).store(scores + i * kScoreStride + (j - e0));
    }
    for (int64_t i = 0; i < Q; ++i) {
      const auto& entries = seen[i]->entries;
      const int64_t end = std::min(e1, static_cast<int64_t>(entries.size()));
      if (end <= e0) continue;
      float* row = scores + i * kScoreStride;
      for (int64_t e = common; e < end; e += kLanes) {
        const int64_t n = std::min(kLanes, end - e);
        if constexpr (std::is_same_v<Entry, float>) {
          for (int64_t k = 0; k < n; ++k) block[k] = keys + entries[e + k] * dim;
        } else {
          for (int64_t k = 0; k < n; ++k)
            block[k] = entries_as_float(keys + entries[e + k] * dim, 1, dim, converted + k * dim);
        }
        F32x16::mul(dots16<C>(query[i], block, n, chunks), scale).store(row + (e - e0));
      }
      const int64_t count = end - e0, padded = (count + kLanes - 1) / kLanes * kLanes;
      std::fill(row + count, row + padded, -std::numeric_limits<float>::infinity());
      F32x16 best = F32x16::broadcast(-std::numeric_limits<float>::infinity());
      for (int64_t e = 0; e < padded; e += kLanes) best = F32x16::max(best, F32x16::load(row + e));
      const float span_largest = reduce_max(best);
      const F32x16 shift = F32x16::broadcast(span_largest);
      for (int64_t e = 0; e < padded; e += kLanes) exp(F32x16::sub(F32x16::load(row + e), shift)).store(row + e);
      std::fill(row + count, row + padded, 0.0f);
      F32x16 sum = F32x16::zero();
      for (int64_t e = 0; e < padded; e += kLanes) sum = F32x16::add(sum, F32x16::load(row + e));
      const float span_total = reduce_add(sum);
      if (unit.split) {
        parts.largest[part[i] + e0 / kSpan] = span_largest;
        parts.total[part[i] + e0 / kSpan] = span_total;
        continue;
      }
      if (e0 == 0) {
        largest[i] = span_largest;
        total[i] = span_total;
        continue;
      }
      const float merged = std::max(largest[i], span_largest);
      kept[i] = std::exp(largest[i] - merged);
      taken[i] = std::exp(span_largest - merged);
      total[i] = total[i] * kept[i] + span_total * taken[i];
      largest[i] = merged;
    }
    // The span's weighted values: a multiply-add per entry in list order. Where C is known, T
    // queries and every chunk of the head at once, over stretches of shared entries whose values
    // (16 KB) stay in L1 while every group of queries reads them; else chunk by chunk.
    constexpr int64_t T = C > 0 ? std::max<int64_t>(1, kAttentionAccumulators / C) : 1;
    constexpr int64_t width = C > 0 ? C : 1;
    constexpr int64_t stretch = kValueStretchLanes / kLanes / width;
    F32x16 sums[kQueriesPerUnit][width];
    for (int64_t d0 = 0; d0 < chunks; d0 += width) {
      for (int64_t i = 0; i < Q; ++i)
        for (int64_t c = 0; c < width; ++c) sums[i][c] = F32x16::zero();
      for (int64_t j0 = e0; j0 < common; j0 += stretch) {
        const int64_t j1 = std::min(common, j0 + stretch);
        // The stretch's values of chunks [d0, d0 + width): in place, or converted into `converted`
        // (rows of width chunks).
        const float* stretch_values = values_as_float(values, j0, j1, dim, d0, width, converted + kLanes * dim);
        const int64_t value_stride = std::is_same_v<Entry, float> ? dim : width * kLanes;
        int64_t first = 0;
        for (; first + T <= Q; first += T) {
          const float* weights = scores + first * kScoreStride - e0;
          weigh_values<T, width>(sums + first, weights, j0, j1, stretch_values, value_stride);
        }
        const float* weights = scores + first * kScoreStride - e0;
        weigh_fewer<T, width>(Q - first, sums + first, weights, j0, j1, stretch_values, value_stride);
      }
      for (int64_t i = 0; i < Q; ++i) {
        const auto& entries = seen[i]->entries;
        const int64_t end = std::min(e1, static_cast<int64_t>(entries.size()));
        if (end <= e0) continue;
        const float* weight = scores + i * kScoreStride - e0;
        for (int64_t c = 0; c < width; ++c) {
          F32x16 a = sums[i][c];
          for (int64_t e = common; e < end; ++e)
            a = F32x16::fmadd(F32x16::broadcast(weight[e]), load_entry(values + entries[e] * dim + (d0 + c) * kLanes),
                              a);
          if (unit.split) {
            a.store(parts.weighted.data() + (part[i] + e0 / kSpan) * dim + (d0 + c) * kLanes);
            continue;
          }
          float* running = result[i] + (d0 + c) * kLanes;
          if (e0 > 0)
            a = F32x16::fmadd(a, F32x16::broadcast(taken[i]),
                              F32x16::mul(F32x16::load(running), F32x16::broadcast(kept[i])));
          a.store(running);
        }
      }
    }
  }
  for (int64_t i = 0; i < Q && !unit.split; ++i) {
    const F32x16 divisor = F32x16::broadcast(total[i]);
    for (int64_t c = 0; c < chunks; ++c)
      F32x16::div(F32x16::load(result[i] + c * kLanes), divisor).store(result[i] + c * kLanes);
  }
}

// attend<C> for the head sizes met in practice (64, 128), with the loops along the head unrolled.
template <typename Entry>
void attend_any(const AttentionUnit& unit, const float* qkv, int64_t qkv_width, const Entry* keys,
                const Entry* values, const std::vector<Visibility>& visible, int64_t dim, float scaling,
                float* scores, float* converted, float* out, int64_t out_stride, SpanParts& parts) {
  switch (dim / kLanes) {
    case 4:
      return attend<4>(unit, qkv, qkv_width, keys, values, visible, dim, scaling, scores, converted, out, out_stride,
                       parts);
    case 8:
      return attend<8>(unit, qkv, qkv_width, keys, values, visible, dim, scaling, scores, converted, out, out_stride,
                       parts);
    default:
      return attend<0>(unit, qkv, qkv_width, keys, values, visible, dim, scaling, scores, converted, out, out_stride,
                       parts);
  }
}

// silu(gate) * up = gate / (1 + e^-gate) * up over `width` values.
void silu_times(const float* gate, const float* up, int64_t width, float* out) {
  const F32x16 one = F32x16::broadcast(1.0f);
  for (int64_t i = 0; i < width; i += kLanes) {
    const F32x16 g = F32x16::load(gate + i);
    const F32x16 silu = F32x16::div(g, F32x16::add(one, exp(F32x16::sub(F32x16::zero(), g))));
    F32x16::mul(silu, F32x16::load(up + i)).store(out + i);
  }
}

void add_into(float* x, const float* y, int64_t width) {
  for (int64_t i = 0; i < width; i += kLanes) F32x16::add(F32x16::load(x + i), F32x16::load(y + i)).store(x + i);
}

// The quantised form of a matrix's input rows, where the matrix takes int8 activations.
struct MatrixInput {
  const PackedMatrix* matrix;
  QuantisedRows* quantised;  // nullptr: fp32 activations
};

// y [M, N] = x [M, K] @ W^T + bias, this thread's share of the matrix's units (after a barrier
// behind which the quantised input is complete).
void multiply(const MatrixInput& input, const float* x, int64_t M, float* y, int thread, int threads) {
  const auto [begin, end] = thread_share(input.matrix->units(M), thread, threads);
  input.matrix->run_units(x, input.quantised, M, y, begin, end);
}

void quantise_rows(const MatrixInput& input, const float* x, int64_t begin, int64_t end) {
  if (input.quantised) input.quantised->quantise(x, begin, end);
}

}  // namespace

const char* const FusedStack::kStepNames[FusedStack::kSteps] = {
    "norm+quantise", "qkv",  "rope+kv write", "attention", "quantise", "o",       "residual+norm+quantise",
    "gate_up",       "silu+quantise", "down", "residual", "hand-offs"};

std::map<std::string, double> FusedStack::step_times() const {
  std::map<std::string, double> times;
  for (int step = 0; step < kSteps; ++step) times[kStepNames[step]] = step_seconds[step];
  times["forwards"] = static_cast<double>(profiled_forwards);
  return times;
}

void FusedStack::reset_step_times() const {
  step_seconds.fill(0.0);
  profiled_forwards = 0;
}

FusedStack::FusedStack(std::vector<LeanLayer> layers_) : layers(std::move(layers_)) {
  for (const auto& layer : layers) {
    const int64_t width = layer.input_norm.weight.numel();
    TORCH_CHECK(layer.head_dim % kLanes == 0 && width % kLanes == 0 && layer.inner % kLanes == 0,
                "the fused stack needs head sizes and widths that are multiples of 16");
    TORCH_CHECK(layer.heads % layer.kv_heads == 0, "query heads must be a multiple of the key/value heads");
    for (const auto* norm : {&layer.input_norm, &layer.post_norm})
      TORCH_CHECK(norm->weight.is_contiguous() && norm->weight.scalar_type() == torch::kFloat32, "fp32 norm weights");
  }
}

torch::Tensor FusedStack::forward(const torch::Tensor& hidden, const torch::Tensor& cos_, const torch::Tensor& sin_,
                                  const torch::Tensor& mask, const std::vector<torch::Tensor>& keys,
                                  const std::vector<torch::Tensor>& values, const PoolStep& step,
                                  const std::optional<RmsNorm>& final_norm) const {
  TORCH_CHECK(keys.size() == layers.size() && values.size() == layers.size(), "one pool buffer per layer");
  TORCH_CHECK(hidden.dim() == 3 && hidden.scalar_type() == torch::kFloat32, "hidden must be [B, L, W] fp32");
  const int64_t B = hidden.size(0), L = hidden.size(1), W = hidden.size(2), M = B * L;
  auto output = hidden.contiguous().clone();
  if (M == 0 || layers.empty()) return output;
  const auto cos = cos_.contiguous(), sin = sin_.contiguous();
  const std::vector<RowPlan> rows = plan_rows(step, mask, B, L);
  TORCH_CHECK(static_cast<int64_t>(rows.size()) == M, "one pool position per token");
  const int64_t D = layers[0].head_dim;
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && cos.numel() == M * D && sin.numel() == M * D,
              "cos and sin must be [B, L, head_dim] fp32");
  const float* final_weight = nullptr;
  if (final_norm) {
    TORCH_CHECK(final_norm->weight.is_contiguous() && final_norm->weight.scalar_type() == torch::kFloat32 &&
                    final_norm->weight.numel() == W,
                "the final norm's weight must be a contiguous fp32 vector of the hidden width");
    final_weight = final_norm->weight.data_ptr<float>();
  }
  const bool half_pool = keys[0].scalar_type() == torch::kHalf;
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& layer = layers[i];
    TORCH_CHECK(layer.input_norm.weight.numel() == W && layer.head_dim == D, "layer ", i, " has other shapes");
    for (const auto* buffer : {&keys[i], &values[i]}) {
      TORCH_CHECK(buffer->is_contiguous() && buffer->scalar_type() == keys[0].scalar_type() &&
                      (half_pool || buffer->scalar_type() == torch::kFloat32) && buffer->dim() == 4 &&
                      buffer->size(1) == layer.kv_heads && buffer->size(3) == D,
                  "pool buffers must be contiguous [slots, kv_heads, capacity, head_dim], all fp32 or all fp16");
      for (const auto& row : rows)
        TORCH_CHECK(row.slot >= 0 && row.slot < buffer->size(0) && row.position >= 0 && row.keys <= buffer->size(2) &&
                        row.position < buffer->size(2),
                    "a row writes or reads outside the pool");
    }
  }
  // One quantised buffer per (inputs, group) the matrices need.
  std::map<std::pair<int64_t, int64_t>, QuantisedRows> buffers;
  std::vector<std::array<MatrixInput, 4>> inputs;
  for (const auto& layer : layers) {
    std::array<MatrixInput, 4> layer_inputs;
    const PackedMatrix* matrices[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    for (int j = 0; j < 4; ++j) {
      QuantisedRows* quantised = nullptr;
      if (matrices[j]->integer_activations) {
        const auto key = std::make_pair(matrices[j]->K, matrices[j]->group());
        auto [entry, added] = buffers.try_emplace(key);
        if (added) entry->second.resize(M, key.first, key.second);
        quantised = &entry->second;
      }
      layer_inputs[j] = {matrices[j], quantised};
    }
    inputs.push_back(layer_inputs);
  }
  const int64_t heads = layers[0].heads, kv_heads = layers[0].kv_heads, inner = layers[0].inner;
  const int64_t qkv_width = (heads + 2 * kv_heads) * D;
  for (const auto& layer : layers)
    TORCH_CHECK(layer.heads == heads && layer.kv_heads == kv_heads && layer.inner == inner &&
                    layer.qkv.N == qkv_width && layer.o.N == W && layer.gate_up.N == 2 * inner && layer.down.N == W,
                "every layer must have the same shapes");
  std::vector<float> normed(M * W), qkv(M * qkv_width), attended(M * heads * D), projected(M * W),
      gate_up(M * 2 * inner), activated(M * inner);
  float* h = output.data_ptr<float>();
  const float* cos_data = cos.data_ptr<float>();
  const float* sin_data = sin.data_ptr<float>();
  const int threads = static_cast<int>(std::max<int64_t>(1, at::get_num_threads()));
  const std::vector<Visibility> visible = visible_entries(rows);
  const std::vector<AttentionUnit> units = attention_units(rows, visible, heads, kv_heads, D, threads);
  const std::vector<double> unit_costs = attention_costs(units, visible);
  SpanParts parts(units, visible, heads, D);
  int64_t most_queries = 0;
  for (const AttentionUnit& unit : units) most_queries = std::max(most_queries, unit.rows * unit.heads);

#pragma omp parallel num_threads(threads)
  {
    const int thread = omp_get_thread_num(), team = omp_get_num_threads();
    const auto [row_begin, row_end] = thread_share(M, thread, team);
    const auto [unit_begin, unit_end] = weighted_share(unit_costs, thread, team);
    std::vector<float> scores(most_queries * kScoreStride), converted(half_pool ? converted_floats(D) : 0);
    // Thread 0's time in each step, and at the barriers (waiting for the others).
    const bool timing = profiling && thread == 0;
    auto last = Clock::now();
    const auto lap = [&](Step step) {
      if (!timing) return;
      const auto now = Clock::now();
      step_seconds[step] += std::chrono::duration<double>(now - last).count();
      last = now;
    };
    const auto done = [&](Step step) {
      lap(step);
#pragma omp barrier
      lap(kHandOffs);
    };
    for (size_t i = 0; i < layers.size(); ++i) {
      const LeanLayer& layer = layers[i];
      const auto& [qkv_in, o_in, gate_up_in, down_in] = inputs[i];
      const float eps = static_cast<float>(layer.input_norm.eps);
      for (int64_t r = row_begin; r < row_end; ++r)
        rms_norm(h + r * W, layer.input_norm.weight.data_ptr<float>(), eps, W, normed.data() + r * W);
      quantise_rows(qkv_in, normed.data(), row_begin, row_end);
      done(kNormQuantise);
      multiply(qkv_in, normed.data(), M, qkv.data(), thread, team);
      done(kQkv);
      // The layer's pool buffers: fp32 entries, or halves (stored as uint16_t bits).
      void* const key_pool = keys[i].data_ptr();
      void* const value_pool = values[i].data_ptr();
      const auto pool_at = [&](void* pool, int64_t entry) -> std::pair<float*, uint16_t*> {
        if (half_pool) return {nullptr, static_cast<uint16_t*>(pool) + entry};
        return {static_cast<float*>(pool) + entry, nullptr};
      };
      const int64_t capacity = keys[i].size(2);
      for (int64_t r = row_begin; r < row_end; ++r) {
        float* states = qkv.data() + r * qkv_width;
        for (int64_t head = 0; head < heads + kv_heads; ++head) {
          float* x = states + head * D;
          const auto& norm = head < heads ? layer.query_norm : layer.key_norm;
          if (norm) rms_norm(x, norm->weight.data_ptr<float>(), static_cast<float>(norm->eps), D, x);
          rotate(x, cos_data + r * D, sin_data + r * D, D);
        }
        for (int64_t g = 0; g < kv_heads; ++g) {
          const int64_t entry = ((rows[r].slot * kv_heads + g) * capacity + rows[r].position) * D;
          for (const auto& [pool, state] :
               {std::pair{key_pool, heads + g}, std::pair{value_pool, heads + kv_heads + g}}) {
            const auto [as_float, as_half] = pool_at(pool, entry);
            if (as_half != nullptr)
              store_entry(states + state * D, D, as_half);
            else
              store_entry(states + state * D, D, as_float);
          }
        }
      }
      done(kRope);
      for (int64_t u = unit_begin; u < unit_end; ++u) {
        const AttentionUnit& unit = units[u];
        const int64_t g = unit.first_head / (heads / kv_heads);
        const int64_t slot_start = (rows[unit.first_row].slot * kv_heads + g) * capacity * D;
        const auto [keys_float, keys_half] = pool_at(key_pool, slot_start);
        const auto [values_float, values_half] = pool_at(value_pool, slot_start);
        const float scaling = static_cast<float>(layer.scaling);
        if (half_pool)
          attend_any(unit, qkv.data(), qkv_width, keys_half, values_half, visible, D, scaling, scores.data(),
                     converted.data(), attended.data(), heads * D, parts);
        else
          attend_any(unit, qkv.data(), qkv_width, keys_float, values_float, visible, D, scaling, scores.data(),
                     converted.data(), attended.data(), heads * D, parts);
      }
      done(kAttention);
      for (int64_t r = row_begin; r < row_end; ++r)
        parts.merge(r, static_cast<int64_t>(visible[r].entries.size()), attended.data() + r * heads * D);
      quantise_rows(o_in, attended.data(), row_begin, row_end);
      done(kQuantise);
      multiply(o_in, attended.data(), M, projected.data(), thread, team);
      done(kO);
      for (int64_t r = row_begin; r < row_end; ++r) {
        add_into(h + r * W, projected.data() + r * W, W);
        rms_norm(h + r * W, layer.post_norm.weight.data_ptr<float>(), static_cast<float>(layer.post_norm.eps), W,
                 normed.data() + r * W);
      }
      quantise_rows(gate_up_in, normed.data(), row_begin, row_end);
      done(kResidualNormQuantise);
      multiply(gate_up_in, normed.data(), M, gate_up.data(), thread, team);
      done(kGateUp);
      for (int64_t r = row_begin; r < row_end; ++r)
        silu_times(gate_up.data() + r * 2 * inner, gate_up.data() + r * 2 * inner + inner, inner,
                   activated.data() + r * inner);
      quantise_rows(down_in, activated.data(), row_begin, row_end);
      done(kSiluQuantise);
      multiply(down_in, activated.data(), M, projected.data(), thread, team);
      done(kDown);
      for (int64_t r = row_begin; r < row_end; ++r) add_into(h + r * W, projected.data() + r * W, W);
      lap(kResidual);  // the next layer reads only this thread's rows of h before its next barrier
    }
    if (final_weight != nullptr)
      for (int64_t r = row_begin; r < row_end; ++r)
        rms_norm(h + r * W, final_weight, static_cast<float>(final_norm->eps), W, h + r * W);
  }
  if (profiling) ++profiled_forwards;
  return output;
}
