// kvmulti native CPU attention: the torch-facing entry points of paged_attention.cpp, for the other
// binding units (prepared_step.cpp). Each checks its tensors' bounds itself (see paged_attention.cpp).
#pragma once

// ATen's Tensor and torch's pybind11 casters only: <torch/extension.h> (the whole C++ frontend)
// costs each of the two binding units about four times the parse time.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

namespace kvmulti_cpu {

void paged_attention(const at::Tensor& query, const at::Tensor& kv_cache, at::Tensor& out,
                     const at::Tensor& block_table, const at::Tensor& query_start_loc_cpu,
                     const at::Tensor& seq_lens_cpu, int64_t s_block, int64_t s_token, int64_t s_head,
                     int64_t head_size, int64_t head_size_v, int64_t num_kv_heads, int64_t block_size,
                     double scale, int64_t window, double softcap, bool causal, int64_t partition_len,
                     int64_t isa_req, const c10::optional<at::Tensor>& k_scale,
                     const c10::optional<at::Tensor>& v_scale,
                     const c10::optional<at::Tensor>& sinks = c10::nullopt,
                     const c10::optional<at::Tensor>& alibi_slopes = c10::nullopt);

void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
              const at::Tensor& slot_mapping, int64_t s_block, int64_t s_token, int64_t s_head,
              int64_t head_size, int64_t head_size_v, int64_t block_size);

// Registers PreparedStep (prepared_step.cpp) on the extension module.
void bind_prepared_step(pybind11::module& m);

}  // namespace kvmulti_cpu
