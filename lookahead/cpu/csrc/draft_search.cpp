// See draft_search.h. Each function mirrors its namesake in retrieval.py, with the same floating
// point operations in the same order (the extension builds with -ffp-contract=off), so both
// select the same nodes with the same probabilities.
#include "draft_search.h"

#include <immintrin.h>

#include <algorithm>
#include <queue>

namespace {

constexpr int64_t kNoNode = -1;
constexpr int kChildLimit = 8;     // retrieval.CHILD_LIMIT
constexpr int kRecycledLimit = 4;  // retrieval.RECYCLED_LIMIT

// One child a node may get (retrieval._Continuation).
struct Continuation {
  double conditional;
  int64_t token;
  int64_t local_child;
  int64_t shared_child;
  int64_t copy_next;
  int64_t recycled;
};

struct Listed {
  int64_t token;
  int64_t child;
  double p;
};

// retrieval._conditionals: up to CHILD_LIMIT children of `node` with p_trie, most recent first;
// `capped` when it has more, which `unlisted` prices.
struct Conditionals {
  Listed listed[kChildLimit];
  int size = 0;
  bool capped = false;
  double unlisted = 0.0;

  const Listed* find(int64_t token) const {
    for (int i = 0; i < size; ++i)
      if (listed[i].token == token) return &listed[i];
    return nullptr;
  }
};

Conditionals conditionals(const TrieColumns& trie, int64_t node, int64_t context_len) {
  Conditionals out;
  if (trie.token == nullptr || node == kNoNode) return out;
  int32_t kids[kChildLimit + 1];
  int found = 0;
  for (int32_t child = trie.first_child[node]; child != kNoNode && found < kChildLimit + 1;
       child = trie.next_sibling[child])
    kids[found++] = child;
  out.capped = found > kChildLimit;
  double seen = 0.0;
  if (out.capped) {
    seen = trie.count[node];
  } else {
    for (int i = 0; i < found; ++i) seen += trie.count[kids[i]];
  }
  const double denominator = seen + 1.0 / static_cast<double>(context_len);
  out.size = std::min(found, kChildLimit);
  for (int i = 0; i < out.size; ++i)
    out.listed[i] = {trie.token[kids[i]], kids[i], trie.count[kids[i]] / denominator};
  out.unlisted = denominator;
  return out;
}

// NGramTrie.child.
int64_t child_of(const TrieColumns& trie, int64_t node, int64_t token) {
  if (trie.indexed[node]) {
    PyObject* key = PyLong_FromLongLong(node << 32 | token);
    PyObject* child = PyDict_GetItem(trie.index, key);  // borrowed
    Py_DECREF(key);
    return child != nullptr ? PyLong_AsLongLong(child) : kNoNode;
  }
  int32_t child = trie.first_child[node];
  while (child != kNoNode && trie.token[child] != token) child = trie.next_sibling[child];
  return child;
}

// retrieval._lookup: (child, p_trie) of a child past the enumeration cap, or no evidence.
Listed lookup(const TrieColumns& trie, int64_t node, int64_t token, const Conditionals& listed) {
  if (!listed.capped) return {token, kNoNode, 0.0};
  const int64_t child = child_of(trie, node, token);
  if (child == kNoNode) return {token, kNoNode, 0.0};
  return {token, child, trie.count[child] / listed.unlisted};
}

// spans.Copy.conditional.
double copy_conditional(const CopyDraft& copy, int64_t index) {
  const auto edit = copy.edits.find(index);
  const int64_t seen = edit != copy.edits.end() ? edit->second : copy.matched + index;
  return static_cast<double>(seen + 1) / static_cast<double>(seen + 2);
}

class MergedView {
 public:
  MergedView(const TrieColumns& local, const TrieColumns& shared, const CopyDraft* copy, const RecycledRows& recycled)
      : local_(local), shared_(shared), copy_(copy), recycled_(recycled) {}

  // _MergedView.continuations into `options` (cleared first).
  void continuations(int64_t token, int64_t local_node, int64_t shared_node, int64_t context_len, int64_t copy_index,
                     std::vector<Continuation>& options) const {
    copied(local_node, shared_node, context_len, copy_index, options);
    if (recycled_.candidates == nullptr || token < 0 || token >= recycled_.vocab) return;
    const int32_t* row = recycled_.candidates + token * recycled_.k;
    const uint16_t* probs = recycled_.probs + token * recycled_.k;
    const int64_t limit = std::min<int64_t>(kRecycledLimit, recycled_.k);
    int64_t candidates = 0;
    for (int64_t i = 0; i < limit; ++i) candidates += row[i] >= 0;
    if (candidates == 0) return;
    double claimed = 0.0;
    for (const Continuation& option : options) claimed += option.conditional;
    const double escape = std::max(0.0, 1.0 - claimed);
    const size_t known = options.size();
    int64_t rank = 0;
    for (int64_t i = 0; i < limit; ++i) {
      if (row[i] < 0) continue;
      const int64_t candidate = row[i];
      const double p = _cvtsh_ss(probs[i]);
      size_t at = 0;
      while (at < known && options[at].token != candidate) ++at;
      if (at < known) {  // the model's candidate agrees with the text's evidence
        Continuation& option = options[at];
        option.conditional = std::min(1.0, option.conditional + escape * p);
        option.recycled = rank;
      } else if (escape > 0.0) {
        options.push_back({escape * p, candidate, kNoNode, kNoNode, -1, rank});
      }
      ++rank;
    }
  }

 private:
  // _MergedView._copied.
  void copied(int64_t local_node, int64_t shared_node, int64_t context_len, int64_t copy_index,
              std::vector<Continuation>& options) const {
    options.clear();
    const Conditionals local = conditionals(local_, local_node, context_len);
    const Conditionals shared = conditionals(shared_, shared_node, context_len);
    struct Evidence {
      int64_t token;
      Listed local;
      Listed shared;
    };
    Evidence evidence[2 * kChildLimit];
    int size = 0;
    const auto add = [&](int64_t token) {
      const Listed* in_local = local.find(token);
      const Listed* in_shared = shared.find(token);
      evidence[size++] = {token, in_local ? *in_local : lookup(local_, local_node, token, local),
                          in_shared ? *in_shared : lookup(shared_, shared_node, token, shared)};
    };
    for (int i = 0; i < local.size; ++i) add(local.listed[i].token);
    for (int i = 0; i < shared.size; ++i)
      if (local.find(shared.listed[i].token) == nullptr) add(shared.listed[i].token);
    double claimed = 0.0;
    for (int i = 0; i < size; ++i) claimed += evidence[i].local.p;
    const double escape = std::max(0.0, 1.0 - claimed);
    for (int i = 0; i < size; ++i) {
      const Evidence& e = evidence[i];
      options.push_back(
          {std::min(1.0, e.local.p + escape * e.shared.p), e.token, e.local.child, e.shared.child, -1, -1});
    }
    if (copy_ == nullptr || copy_index < 0 || copy_index >= static_cast<int64_t>(copy_->tokens.size())) return;
    const int64_t copied = copy_->tokens[copy_index];
    const double p_copy = copy_conditional(*copy_, copy_index);
    Continuation on_copy{0.0, copied, kNoNode, kNoNode, -1, -1};
    size_t kept = 0;
    for (const Continuation& option : options) {
      if (option.token == copied) {
        on_copy = option;
      } else {
        options[kept++] = {option.conditional * (1.0 - p_copy), option.token, option.local_child, option.shared_child,
                           -1, -1};
      }
    }
    options.resize(kept);
    options.insert(options.begin(), {p_copy + (1.0 - p_copy) * on_copy.conditional, copied, on_copy.local_child,
                                     on_copy.shared_child, copy_index + 1, -1});
  }

  const TrieColumns& local_;
  const TrieColumns& shared_;
  const CopyDraft* copy_;
  const RecycledRows& recycled_;
};

// A frontier entry: heapq's (-probability, push order, parent index, depth, continuation).
struct Candidate {
  double negative_prob;
  int64_t pushed;
  int64_t parent;
  int64_t depth;
  Continuation option;
};

struct PoppedFirst {
  bool operator()(const Candidate& a, const Candidate& b) const {
    if (a.negative_prob != b.negative_prob) return a.negative_prob > b.negative_prob;
    return a.pushed > b.pushed;
  }
};

}  // namespace

std::vector<DraftNode> best_first_draft(const TrieColumns& local, const TrieColumns& shared, const CopyDraft* copy,
                                        const RecycledRows& recycled, const SearchStart& start,
                                        const std::set<int64_t>& stop_tokens) {
  const MergedView view(local, shared, copy, recycled);
  std::vector<DraftNode> selected;
  selected.reserve(static_cast<size_t>(std::max<int64_t>(start.budget, 1)));
  std::priority_queue<Candidate, std::vector<Candidate>, PoppedFirst> frontier;
  std::vector<Continuation> options;
  frontier.push({-1.0, 0, -1, 0, {}});
  int64_t pushed = 1;
  while (!frontier.empty() && static_cast<int64_t>(selected.size()) < start.budget) {
    const Candidate next = frontier.top();
    frontier.pop();
    const DraftNode node =
        next.pushed == 0
            ? DraftNode{start.root, -1, 1.0, start.local_node, start.shared_node, 0, start.copy_index, -1}
            : DraftNode{next.option.token,        next.parent, -next.negative_prob, next.option.local_child,
                        next.option.shared_child, next.depth,  next.option.copy_next, next.option.recycled};
    const int64_t index = static_cast<int64_t>(selected.size());
    selected.push_back(node);
    const bool ends_request = node.depth > 0 && stop_tokens.count(node.token) > 0;
    if (node.depth == start.depth_limit || index + 1 == start.budget || ends_request) continue;
    view.continuations(node.token, node.local_node, node.shared_node, start.query_len + node.depth, node.copy_index,
                       options);
    for (const Continuation& option : options) {
      const double child_prob = node.prob * option.conditional;
      if (child_prob > 0.0 && child_prob >= start.min_prob)
        frontier.push({-child_prob, pushed++, index, node.depth + 1, option});
    }
  }
  return selected;
}
