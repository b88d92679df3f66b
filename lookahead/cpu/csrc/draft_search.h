// Best-first selection of a draft tree over the merged tries: lookahead/algorithm/retrieval.py's
// `_best_first`, node for node and bit for bit. Every drafting request runs it at every step, for
// each query length, so the engine thread's host work per step is mostly this search.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <vector>

#include <Python.h>

// One NGramTrie's columns, borrowed for one search (NGramTrie.search_view()); `index` is its dict
// of (parent << 32 | token) -> child for parents with many children. Absent: token == nullptr.
struct TrieColumns {
  const int32_t* token = nullptr;
  const float* count = nullptr;
  const int32_t* first_child = nullptr;
  const int32_t* next_sibling = nullptr;
  const int8_t* indexed = nullptr;
  PyObject* index = nullptr;  // borrowed; the caller holds the GIL for the whole search
};

// The request's copy draft (spans.Copy): its tokens, the agreement it starts from and the
// replayed edits' times seen by token index.
struct CopyDraft {
  std::vector<int64_t> tokens;
  int64_t matched = 0;
  std::map<int64_t, int64_t> edits;
};

// The instance's recycle table (recycling.RecycleTable): [vocab, k] candidates (-1: none) and their
// float16 probabilities. Absent: candidates == nullptr.
struct RecycledRows {
  const int32_t* candidates = nullptr;
  const uint16_t* probs = nullptr;
  int64_t vocab = 0;
  int64_t k = 0;
};

// Where the search starts and what bounds it (retrieval.py's start node and arguments).
struct SearchStart {
  int64_t root;
  int64_t local_node;
  int64_t shared_node;
  int64_t copy_index;  // 0 with a copy, -1 without
  int64_t query_len;
  int64_t budget;
  int64_t depth_limit;
  double min_prob;
};

// retrieval.py's _Node, field for field.
struct DraftNode {
  int64_t token;
  int64_t parent;
  double prob;
  int64_t local_node;
  int64_t shared_node;
  int64_t depth;
  int64_t copy_index;
  int64_t recycled;
};

// The `budget` most probable nodes (root first, in selection order) of the subtree below `start`.
std::vector<DraftNode> best_first_draft(const TrieColumns& local, const TrieColumns& shared, const CopyDraft* copy,
                                        const RecycledRows& recycled, const SearchStart& start,
                                        const std::set<int64_t>& stop_tokens);
