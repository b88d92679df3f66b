// The Python module of the fast CPU path (lookahead/cpu/extension.py builds one per variant):
// packed matrices, lean layers, the pool step of the layer stacks, the roofline probes, the top
// candidates of logits, the draft search.
#include <map>
#include <set>
#include <tuple>

#include "draft_search.h"
#include "fused_stack.h"
#include "lean_layer.h"
#include "roofline.h"
#include "simd.h"
#include "top_candidates.h"

namespace {

PackedMatrix packed_matrix(const std::string& form, torch::Tensor weights, std::optional<torch::Tensor> d,
                           std::optional<torch::Tensor> m, std::optional<torch::Tensor> bias, int64_t N,
                           const std::string& activations, std::optional<torch::Tensor> high, int64_t zero_point,
                           std::optional<torch::Tensor> d_super, std::optional<torch::Tensor> m_super) {
  using Form = PackedMatrix::Form;
  const std::map<std::string, Form> forms{{"fp32", Form::kFp32}, {"int8", Form::kInt8}, {"int4", Form::kInt4},
                                          {"int5", Form::kInt5}, {"int6", Form::kInt6}};
  const auto kind = forms.find(form);
  TORCH_CHECK(kind != forms.end(), "unknown packed form ", form);
  TORCH_CHECK(activations == "fp32" || activations == "int8", "activations are fp32 or int8, not ", activations);
  TORCH_CHECK(kind->second == Form::kFp32 || (d && m), "an integer form needs its scales");
  IntegerExtras extras{high.value_or(torch::Tensor()), zero_point, d_super.value_or(torch::Tensor()),
                                     m_super.value_or(torch::Tensor())};
  return PackedMatrix(kind->second, activations == "int8", std::move(weights), d.value_or(torch::Tensor()),
                      m.value_or(torch::Tensor()), bias.value_or(torch::Tensor()), N, std::move(extras));
}

using NormWeights = std::pair<torch::Tensor, double>;  // (weight, eps), as Python passes them

std::optional<RmsNorm> optional_norm(const std::optional<NormWeights>& norm) {
  if (!norm) return std::nullopt;
  return RmsNorm{norm->first, norm->second};
}

// Column `at` of a search view, checked to hold `T`s in the given buffer format.
template <typename T>
const T* column(const pybind11::tuple& view, size_t at, char format, std::vector<pybind11::buffer_info>& held) {
  held.push_back(view[at].cast<pybind11::buffer>().request());
  const pybind11::buffer_info& info = held.back();
  TORCH_CHECK(info.itemsize == sizeof(T) && !info.format.empty() && info.format.back() == format,
              "search view column ", at, " holds format ", info.format, ", expected ", format);
  return static_cast<const T*>(info.ptr);
}

// NGramTrie.search_view(): (token, count, first_child, next_sibling, indexed, index).
TrieColumns trie_columns(const std::optional<pybind11::tuple>& view, std::vector<pybind11::buffer_info>& held) {
  if (!view) return {};
  TORCH_CHECK(view->size() == 6, "a trie's search view has 6 parts, got ", view->size());
  const pybind11::object index = (*view)[5];
  TORCH_CHECK(PyDict_Check(index.ptr()), "a trie's index is a dict");
  return {column<int32_t>(*view, 0, 'i', held), column<float>(*view, 1, 'f', held),
          column<int32_t>(*view, 2, 'i', held), column<int32_t>(*view, 3, 'i', held),
          column<int8_t>(*view, 4, 'b', held),  index.ptr()};
}

// The recycle table's (candidates [V, k] int32, probabilities [V, k] float16), C-contiguous.
RecycledRows recycled_rows(const std::optional<pybind11::tuple>& table, std::vector<pybind11::buffer_info>& held) {
  if (!table) return {};
  TORCH_CHECK(table->size() == 2, "a recycle table is (candidates, probabilities)");
  const int32_t* candidates = column<int32_t>(*table, 0, 'i', held);
  const std::vector<pybind11::ssize_t> shape = held.back().shape, strides = held.back().strides;
  const uint16_t* probs = column<uint16_t>(*table, 1, 'e', held);
  const pybind11::buffer_info& p = held.back();
  TORCH_CHECK(shape.size() == 2 && p.shape == shape && strides[1] == 4 && strides[0] == 4 * shape[1] &&
                  p.strides[1] == 2 && p.strides[0] == 2 * shape[1],
              "recycled candidates and probabilities must be C-contiguous [V, k] arrays of one shape");
  return {candidates, probs, shape[0], shape[1]};
}

pybind11::list search_draft(const std::optional<pybind11::tuple>& local, const std::optional<pybind11::tuple>& shared,
                            const std::optional<CopyDraft>& copy, const std::optional<pybind11::tuple>& recycled,
                            const SearchStart& start, const std::set<int64_t>& stop_tokens) {
  std::vector<pybind11::buffer_info> held;  // keeps every column exported (unresizable) during the search
  held.reserve(12);
  const TrieColumns local_columns = trie_columns(local, held);
  const TrieColumns shared_columns = trie_columns(shared, held);
  const RecycledRows rows = recycled_rows(recycled, held);
  const std::vector<DraftNode> nodes =
      best_first_draft(local_columns, shared_columns, copy ? &*copy : nullptr, rows, start, stop_tokens);
  pybind11::list found(nodes.size());
  for (size_t i = 0; i < nodes.size(); ++i) {
    const DraftNode& n = nodes[i];
    found[i] = pybind11::make_tuple(n.token, n.parent, n.prob, n.local_node, n.shared_node, n.depth, n.copy_index,
                                    n.recycled);
  }
  return found;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  // The calls below touch no Python object: they let other Python threads (the backend's
  // response thread) run while a forward computes. Every class is local to its module, so that
  // several variants of the extension load side by side in one process.
  using ReleaseGil = pybind11::call_guard<pybind11::gil_scoped_release>;
  module.attr("instruction_set") = kInstructionSet;
  module.attr("integer_dot") = kIntegerDot;
  module.def("read_bandwidth", &read_bandwidth, "bytes read per second", ReleaseGil());
  module.def("fma_peak", &fma_peak, "fp32 operations per second", ReleaseGil());
  module.def("int8_dot_peak", &int8_dot_peak, "int8 dot-product operations per second", ReleaseGil());
  module.def("top_candidates", &top_candidates, "rows [R, V], k -> (values [R, k], indices [R, k], log-sum-exp [R])",
             pybind11::arg("rows"), pybind11::arg("k"), ReleaseGil());
  // Reads Python objects (the tries' columns and index): it keeps the GIL.
  module.def(
      "best_first_draft",
      [](std::optional<pybind11::tuple> local, std::optional<pybind11::tuple> shared,
         std::optional<std::tuple<std::vector<int64_t>, int64_t, std::map<int64_t, int64_t>>> copy,
         std::optional<pybind11::tuple> recycled, int64_t root, int64_t local_node, int64_t shared_node,
         int64_t copy_index, int64_t query_len, int64_t budget, int64_t depth_limit, double min_prob,
         std::set<int64_t> stop_tokens) {
        std::optional<CopyDraft> draft;
        if (copy) draft = CopyDraft{std::get<0>(*copy), std::get<1>(*copy), std::get<2>(*copy)};
        const SearchStart start{root, local_node, shared_node, copy_index, query_len, budget, depth_limit, min_prob};
        return search_draft(local, shared, draft, recycled, start, stop_tokens);
      },
      "retrieval._best_first over search views -> the selected nodes' fields, in selection order");
  pybind11::class_<PackedMatrix>(module, "PackedMatrix", pybind11::module_local())
      .def(pybind11::init(&packed_matrix), pybind11::arg("form"), pybind11::arg("weights"), pybind11::arg("d"),
           pybind11::arg("m"), pybind11::arg("bias"), pybind11::arg("N"), pybind11::arg("activations") = "fp32",
           pybind11::arg("high") = pybind11::none(), pybind11::arg("zero_point") = 0,
           pybind11::arg("d_super") = pybind11::none(), pybind11::arg("m_super") = pybind11::none())
      .def("__call__", &PackedMatrix::operator(), "rows [M, K] -> [M, N]", ReleaseGil());
  pybind11::class_<LeanLayer>(module, "LeanLayer", pybind11::module_local())
      .def(pybind11::init([](PackedMatrix qkv, PackedMatrix o, PackedMatrix gate_up, PackedMatrix down,
                             NormWeights input_norm, NormWeights post_norm, std::optional<NormWeights> query_norm,
                             std::optional<NormWeights> key_norm, int64_t heads, int64_t kv_heads, int64_t head_dim,
                             int64_t inner, double scaling) {
             return LeanLayer{qkv, o, gate_up, down,
                              RmsNorm{input_norm.first, input_norm.second},
                              RmsNorm{post_norm.first, post_norm.second},
                              optional_norm(query_norm), optional_norm(key_norm), heads, kv_heads, head_dim,
                              inner, scaling};
           }))
      .def("before_attention", &LeanLayer::before_attention, ReleaseGil())
      .def("after_attention", &LeanLayer::after_attention, ReleaseGil())
      .def("attend_pool", &LeanLayer::attend_pool, ReleaseGil())
      .def("finish", &LeanLayer::finish, ReleaseGil());
  pybind11::class_<PoolStep>(module, "PoolStep", pybind11::module_local())
      .def(pybind11::init([](std::optional<torch::Tensor> segments, std::optional<torch::Tensor> slots,
                             std::optional<torch::Tensor> positions, int64_t read_length,
                             std::optional<torch::Tensor> own_offsets, std::optional<torch::Tensor> own_columns) {
             return PoolStep{segments, slots, positions, read_length, own_offsets, own_columns};
           }),
           pybind11::arg("segments"), pybind11::arg("slots"), pybind11::arg("positions"), pybind11::arg("read_length"),
           pybind11::arg("own_offsets") = pybind11::none(), pybind11::arg("own_columns") = pybind11::none())
      .def("write_and_read", &PoolStep::write_and_read, ReleaseGil());
  pybind11::class_<LeanStack>(module, "LeanStack", pybind11::module_local())
      .def(pybind11::init([](std::vector<LeanLayer> layers) { return LeanStack{std::move(layers)}; }))
      .def("__call__", &LeanStack::forward, ReleaseGil());
  pybind11::class_<FusedStack>(module, "FusedStack", pybind11::module_local())
      .def(pybind11::init([](std::vector<LeanLayer> layers) { return FusedStack(std::move(layers)); }))
      .def(
          "__call__",
          [](const FusedStack& stack, const torch::Tensor& hidden, const torch::Tensor& cos, const torch::Tensor& sin,
             const torch::Tensor& mask, const std::vector<torch::Tensor>& keys,
             const std::vector<torch::Tensor>& values, const PoolStep& step,
             const std::optional<NormWeights>& final_norm) {
            return stack.forward(hidden, cos, sin, mask, keys, values, step, optional_norm(final_norm));
          },
          pybind11::arg("hidden"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("mask"),
          pybind11::arg("keys"), pybind11::arg("values"), pybind11::arg("step"),
          pybind11::arg("final_norm") = pybind11::none(), ReleaseGil())
      .def_readwrite("profiling", &FusedStack::profiling)
      .def("step_times", &FusedStack::step_times)
      .def("reset_step_times", &FusedStack::reset_step_times);
}
