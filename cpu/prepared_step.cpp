// One step's layer calls with their checks done in C++: the CPU backend's StepMetadata.calls.
//
// A layer call of a prepared step (kvmulti.paged_attention / write_kv with step metadata) is checked
// here against what the step was prepared for: the cache's dtype, sizes and strides exactly the
// layout's, query / out / key / value of the cache's dtype with the step's head counts and sizes and a
// contiguous last dimension, every slot in -1 .. num_slots - 1. A call of that form runs the kernel
// and returns true; any other returns false, without touching anything, and kvmulti/ops.py then takes
// the Python checks, which either raise the error that names the argument or run the call their way.
// Each refusal records the id of the rule it applied (last_refusal): the ids are those of the rule table
// kvmulti/input_rules.py, and tests/test_input_rules.py walks that table through these calls.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "torch_ops.h"

namespace kvmulti_cpu {
namespace {

class PreparedStep {
 public:
  PreparedStep(at::Tensor block_table, at::Tensor query_start_loc, at::Tensor seq_lens,
               at::ScalarType dtype, std::vector<int64_t> cache_sizes, std::vector<int64_t> cache_strides,
               int64_t num_kv_heads, int64_t head_size, int64_t head_size_v, int64_t block_size,
               int64_t num_query_heads, int64_t num_rows, int64_t window, bool causal, int64_t partition_len,
               int64_t isa)
      : block_table_(std::move(block_table)), query_start_loc_(std::move(query_start_loc)),
        seq_lens_(std::move(seq_lens)), dtype_(dtype), cache_sizes_(std::move(cache_sizes)),
        cache_strides_(std::move(cache_strides)), num_kv_heads_(num_kv_heads), head_size_(head_size),
        head_size_v_(head_size_v), block_size_(block_size), num_query_heads_(num_query_heads),
        num_rows_(num_rows), window_(window), causal_(causal), partition_len_(partition_len), isa_(isa) {
    TORCH_CHECK(cache_sizes_.size() == 4 && cache_strides_.size() == 4, "a cache is [blocks, tokens, heads, content]");
    num_slots_ = cache_sizes_[0] * block_size_;
  }

  // out[:num_rows] = attention of query[:num_rows] (with the optional per-query-head sinks and ALiBi
  // slopes, fp32 [num_query_heads]; the caller has checked the step was prepared with them); out's
  // later rows are zeroed.
  bool attend(const at::Tensor& query, const at::Tensor& kv_cache, at::Tensor& out, double scale,
              double softcap, const c10::optional<at::Tensor>& sinks,
              const c10::optional<at::Tensor>& alibi_slopes) {
    if (!std::isfinite(scale)) return refuse("scale.finite");
    if (!(softcap >= 0.0) || !std::isfinite(softcap)) return refuse("softcap");
    if (const char* rule = cache_refusal(kv_cache)) return refuse(rule);
    if (const char* rule = rows_refusal(query, kQuery, num_query_heads_, head_size_)) return refuse(rule);
    if (query.size(0) < num_rows_) return refuse("step.query_rows");
    if (const char* rule = per_head_refusal(sinks, kSinks)) return refuse(rule);
    if (const char* rule = per_head_refusal(alibi_slopes, kAlibi)) return refuse(rule);
    if (alibi_slopes.has_value()) {
      const float* slope = alibi_slopes->data_ptr<float>();
      for (int64_t h = 0; h < num_query_heads_; ++h)
        if (!std::isfinite(slope[h])) return refuse("alibi.finite");
    }
    if (const char* rule = rows_refusal(out, kOut, num_query_heads_, head_size_v_)) return refuse(rule);
    if (out.size(0) != query.size(0)) return refuse("out.shape");
    if (out.size(0) > num_rows_) out.narrow(0, num_rows_, out.size(0) - num_rows_).zero_();
    if (num_rows_ == 0) return true;
    paged_attention(query, kv_cache, out, block_table_, query_start_loc_, seq_lens_, cache_strides_[0],
                    cache_strides_[1], cache_strides_[2], head_size_, head_size_v_, num_kv_heads_, block_size_,
                    scale, window_, softcap, causal_, partition_len_, isa_, c10::nullopt, c10::nullopt, sinks,
                    alibi_slopes);
    return true;
  }

  // Slot tensors whose values this step has checked (tests).
  int64_t checked_slot_tensors() const { return int64_t(checked_slots_.size()); }

  // key / value rows t to slot slot_mapping[t] (-1 skips).
  bool write(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
             const at::Tensor& slot_mapping) {
    if (const char* rule = cache_refusal(kv_cache)) return refuse(rule);
    if (const char* rule = rows_refusal(key, kKey, num_kv_heads_, head_size_)) return refuse(rule);
    if (const char* rule = rows_refusal(value, kValue, num_kv_heads_, head_size_v_)) return refuse(rule);
    if (value.size(0) != key.size(0)) return refuse("value.tokens");
    if (slot_mapping.scalar_type() != at::kLong && slot_mapping.scalar_type() != at::kInt)
      return refuse("slots.dtype");
    if (slot_mapping.dim() != 1) return refuse("slots.dim");
    if (!slot_mapping.device().is_cpu()) return refuse("slots.device");
    if (slot_mapping.size(0) != key.size(0)) return refuse("slots.tokens");
    if (!slot_mapping.is_contiguous()) return refuse("slots.contiguous");
    if (!slots_checked(slot_mapping)) return refuse("slots.range");
    const at::Tensor slots =
        slot_mapping.scalar_type() == at::kLong ? slot_mapping : slot_mapping.to(at::kLong);
    write_kv(key, value, kv_cache, slots, cache_strides_[0], cache_strides_[1], cache_strides_[2], head_size_,
             head_size_v_, block_size_);
    return true;
  }

  // The rule id of the last refused call ("" before any).
  std::string last_refusal() const { return last_refusal_; }

  // Every rule id a call can be refused with.
  static std::vector<std::string> rule_ids() {
    std::vector<std::string> ids = {"scale.finite", "softcap", "cache.layout", "cache.device", "step.query_rows",
                                    "out.shape", "value.tokens", "slots.dtype", "slots.dim", "slots.device",
                                    "slots.tokens", "slots.contiguous", "slots.range"};
    for (const RowRules* rules : {&kQuery, &kOut, &kKey, &kValue})
      for (const char* id : {rules->dtype, rules->dim, rules->heads, rules->size, rules->device, rules->contiguous})
        ids.emplace_back(id);
    for (const HeadRules* rules : {&kSinks, &kAlibi})
      for (const char* id : {rules->dtype, rules->shape, rules->device, rules->contiguous}) ids.emplace_back(id);
    ids.emplace_back("alibi.finite");
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    return ids;
  }

 private:
  // The rule ids of one [tokens, heads, size] argument's checks, in the order they are applied.
  struct RowRules {
    const char *dtype, *dim, *heads, *size, *device, *contiguous;
  };
  static constexpr RowRules kQuery = {"query.dtype", "query.dim", "step.query_heads", "query.head_size",
                                      "query.device", "query.contiguous"};
  static constexpr RowRules kOut = {"out.dtype", "out.shape", "out.shape", "out.shape", "out.device",
                                    "out.contiguous"};
  static constexpr RowRules kKey = {"key.dtype", "key.dim", "key.heads", "key.head_size", "key.device",
                                    "key.contiguous"};
  static constexpr RowRules kValue = {"value.dtype", "value.dim", "value.heads", "value.head_size",
                                      "value.device", "value.contiguous"};

  // The rule ids of an optional fp32 [num_query_heads] argument's checks, in the order they are applied.
  struct HeadRules {
    const char *dtype, *shape, *device, *contiguous;
  };
  static constexpr HeadRules kSinks = {"sinks.dtype", "sinks.shape", "sinks.device", "sinks.contiguous"};
  static constexpr HeadRules kAlibi = {"alibi.dtype", "alibi.shape", "alibi.device", "alibi.contiguous"};

  const char* per_head_refusal(const c10::optional<at::Tensor>& t, const HeadRules& rules) const {
    if (!t.has_value()) return nullptr;
    if (!t->defined() || t->scalar_type() != at::kFloat) return rules.dtype;
    if (t->dim() != 1 || t->size(0) != num_query_heads_) return rules.shape;
    if (!t->device().is_cpu()) return rules.device;
    if (!t->is_contiguous()) return rules.contiguous;
    return nullptr;
  }

  bool refuse(const char* rule) {
    last_refusal_ = rule;
    return false;
  }

  const char* cache_refusal(const at::Tensor& t) const {
    if (!t.defined() || t.scalar_type() != dtype_ || t.sizes() != cache_sizes_ || t.strides() != cache_strides_)
      return "cache.layout";
    if (!t.device().is_cpu()) return "cache.device";
    return nullptr;
  }

  const char* rows_refusal(const at::Tensor& t, const RowRules& rules, int64_t heads, int64_t size) const {
    if (!t.defined() || t.scalar_type() != dtype_) return rules.dtype;
    if (t.dim() != 3) return rules.dim;
    if (t.size(1) != heads) return rules.heads;
    if (t.size(2) != size) return rules.size;
    if (!t.device().is_cpu()) return rules.device;
    if (size > 1 && t.stride(2) != 1) return rules.contiguous;
    return nullptr;
  }

  // Slot values are checked once per step per slot tensor (the layers of a group share it), which is
  // kept so that its identity cannot be reused by another tensor while the step lives.
  bool slots_checked(const at::Tensor& slots) {
    for (const at::Tensor& seen : checked_slots_)
      if (seen.unsafeGetTensorImpl() == slots.unsafeGetTensorImpl()) return true;
    const bool wide = slots.scalar_type() == at::kLong;
    const void* data = slots.data_ptr();
    for (int64_t i = 0; i < slots.size(0); ++i) {
      const int64_t s = wide ? static_cast<const int64_t*>(data)[i] : static_cast<const int32_t*>(data)[i];
      if (s < -1 || s >= num_slots_) return false;
    }
    checked_slots_.push_back(slots);
    return true;
  }

  at::Tensor block_table_, query_start_loc_, seq_lens_;
  at::ScalarType dtype_;
  std::vector<int64_t> cache_sizes_, cache_strides_;
  int64_t num_kv_heads_, head_size_, head_size_v_, block_size_, num_query_heads_, num_rows_, window_;
  bool causal_;
  int64_t partition_len_, isa_, num_slots_ = 0;
  std::vector<at::Tensor> checked_slots_;
  const char* last_refusal_ = "";
};

}  // namespace

void bind_prepared_step(pybind11::module& m) {
  pybind11::class_<PreparedStep>(m, "PreparedStep",
                                 "one step's layer calls, checked in C++ (kvmulti/backends/cpu/backend.py)")
      .def(pybind11::init<at::Tensor, at::Tensor, at::Tensor, at::ScalarType, std::vector<int64_t>,
                          std::vector<int64_t>, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          bool, int64_t, int64_t>())
      .def("attend", &PreparedStep::attend, pybind11::arg("query"), pybind11::arg("kv_cache"), pybind11::arg("out"),
           pybind11::arg("scale"), pybind11::arg("softcap"), pybind11::arg("sinks") = pybind11::none(),
           pybind11::arg("alibi_slopes") = pybind11::none(),
           "query, kv_cache, out, scale, softcap[, sinks, alibi_slopes] -> ran (False: not this step's form)")
      .def("write", &PreparedStep::write, "key, value, kv_cache, slot_mapping -> ran (False: not this step's form)")
      .def_property_readonly("last_refusal", &PreparedStep::last_refusal,
                             "the input rule id (kvmulti/input_rules.py) of the last refused call")
      .def_property_readonly_static("rule_ids", [](pybind11::object) { return PreparedStep::rule_ids(); },
                                    "every input rule id a call can be refused with")
      .def_property_readonly("checked_slot_tensors", &PreparedStep::checked_slot_tensors,
                             "slot tensors whose values this step has checked");
}

}  // namespace kvmulti_cpu
