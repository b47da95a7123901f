// One step's layer calls with their checks done in C++: the CPU backend's StepMetadata.calls.
//
// A layer call of a prepared step (kvmulti.paged_attention / write_kv with step metadata) is checked
// here against what the step was prepared for: the cache's dtype, sizes and strides exactly the
// layout's, query / out / key / value of the cache's dtype with the step's head counts and sizes and a
// contiguous last dimension, every slot in -1 .. num_slots - 1. A call of that form runs the kernel
// and returns true; any other returns false, without touching anything, and kvmulti/ops.py then takes
// the Python checks, which either raise the error that names the argument or run the call their way.
#include <torch/extension.h>

#include <cmath>
#include <vector>

#include "torch_ops.h"

namespace kvmulti_cpu {
namespace {

class PreparedStep {
 public:
  PreparedStep(torch::Tensor block_table, torch::Tensor query_start_loc, torch::Tensor seq_lens,
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

  // out[:num_rows] = attention of query[:num_rows]; out's later rows are zeroed.
  bool attend(const torch::Tensor& query, const torch::Tensor& kv_cache, torch::Tensor& out, double scale,
              double softcap) {
    if (!std::isfinite(scale) || !(softcap >= 0.0) || !std::isfinite(softcap) || !is_cache(kv_cache) ||
        !is_rows(query, num_query_heads_, head_size_) || query.size(0) < num_rows_ ||
        !is_rows(out, num_query_heads_, head_size_v_) || out.size(0) != query.size(0))
      return false;
    if (out.size(0) > num_rows_) out.narrow(0, num_rows_, out.size(0) - num_rows_).zero_();
    if (num_rows_ == 0) return true;
    paged_attention(query, kv_cache, out, block_table_, query_start_loc_, seq_lens_, cache_strides_[0],
                    cache_strides_[1], cache_strides_[2], head_size_, head_size_v_, num_kv_heads_, block_size_,
                    scale, window_, softcap, causal_, partition_len_, isa_, c10::nullopt, c10::nullopt);
    return true;
  }

  // Slot tensors whose values this step has checked (tests).
  int64_t checked_slot_tensors() const { return int64_t(checked_slots_.size()); }

  // key / value rows t to slot slot_mapping[t] (-1 skips).
  bool write(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& kv_cache,
             const torch::Tensor& slot_mapping) {
    if (!is_cache(kv_cache) || !is_rows(key, num_kv_heads_, head_size_) ||
        !is_rows(value, num_kv_heads_, head_size_v_) || value.size(0) != key.size(0) ||
        slot_mapping.dim() != 1 || slot_mapping.size(0) != key.size(0) || !slot_mapping.device().is_cpu() ||
        !slot_mapping.is_contiguous() ||
        (slot_mapping.scalar_type() != torch::kInt64 && slot_mapping.scalar_type() != torch::kInt32) ||
        !slots_checked(slot_mapping))
      return false;
    const torch::Tensor slots =
        slot_mapping.scalar_type() == torch::kInt64 ? slot_mapping : slot_mapping.to(torch::kInt64);
    write_kv(key, value, kv_cache, slots, cache_strides_[0], cache_strides_[1], cache_strides_[2], head_size_,
             head_size_v_, block_size_);
    return true;
  }

 private:
  bool is_cache(const torch::Tensor& t) const {
    return t.defined() && t.scalar_type() == dtype_ && t.device().is_cpu() && t.sizes() == cache_sizes_ &&
           t.strides() == cache_strides_;
  }

  bool is_rows(const torch::Tensor& t, int64_t heads, int64_t size) const {
    return t.defined() && t.scalar_type() == dtype_ && t.device().is_cpu() && t.dim() == 3 &&
           t.size(1) == heads && t.size(2) == size && (size <= 1 || t.stride(2) == 1);
  }

  // Slot values are checked once per step per slot tensor (the layers of a group share it), which is
  // kept so that its identity cannot be reused by another tensor while the step lives.
  bool slots_checked(const torch::Tensor& slots) {
    for (const torch::Tensor& seen : checked_slots_)
      if (seen.unsafeGetTensorImpl() == slots.unsafeGetTensorImpl()) return true;
    const bool wide = slots.scalar_type() == torch::kInt64;
    const void* data = slots.data_ptr();
    for (int64_t i = 0; i < slots.size(0); ++i) {
      const int64_t s = wide ? static_cast<const int64_t*>(data)[i] : static_cast<const int32_t*>(data)[i];
      if (s < -1 || s >= num_slots_) return false;
    }
    checked_slots_.push_back(slots);
    return true;
  }

  torch::Tensor block_table_, query_start_loc_, seq_lens_;
  at::ScalarType dtype_;
  std::vector<int64_t> cache_sizes_, cache_strides_;
  int64_t num_kv_heads_, head_size_, head_size_v_, block_size_, num_query_heads_, num_rows_, window_;
  bool causal_;
  int64_t partition_len_, isa_, num_slots_ = 0;
  std::vector<torch::Tensor> checked_slots_;
};

}  // namespace

void bind_prepared_step(pybind11::module& m) {
  pybind11::class_<PreparedStep>(m, "PreparedStep",
                                 "one step's layer calls, checked in C++ (kvmulti/backends/cpu/backend.py)")
      .def(pybind11::init<torch::Tensor, torch::Tensor, torch::Tensor, at::ScalarType, std::vector<int64_t>,
                          std::vector<int64_t>, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          bool, int64_t, int64_t>())
      .def("attend", &PreparedStep::attend, "query, kv_cache, out, scale, softcap -> ran (False: not this step's form)")
      .def("write", &PreparedStep::write, "key, value, kv_cache, slot_mapping -> ran (False: not this step's form)")
      .def_property_readonly("checked_slot_tensors", &PreparedStep::checked_slot_tensors,
                             "slot tensors whose values this step has checked");
}

}  // namespace kvmulti_cpu
