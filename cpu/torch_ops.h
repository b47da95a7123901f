// kvmulti native CPU attention: the torch-facing entry points of paged_attention.cpp, for the other
// binding units (prepared_step.cpp). Each checks its tensors' bounds itself (see paged_attention.cpp).
#pragma once

#include <torch/extension.h>

namespace kvmulti_cpu {

void paged_attention(const torch::Tensor& query, const torch::Tensor& kv_cache, torch::Tensor& out,
                     const torch::Tensor& block_table, const torch::Tensor& query_start_loc_cpu,
                     const torch::Tensor& seq_lens_cpu, int64_t s_block, int64_t s_token, int64_t s_head,
                     int64_t head_size, int64_t head_size_v, int64_t num_kv_heads, int64_t block_size,
                     double scale, int64_t window, double softcap, bool causal, int64_t partition_len,
                     int64_t isa_req, const c10::optional<torch::Tensor>& k_scale,
                     const c10::optional<torch::Tensor>& v_scale,
                     const c10::optional<torch::Tensor>& sinks = c10::nullopt,
                     const c10::optional<torch::Tensor>& alibi_slopes = c10::nullopt);

void write_kv(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& kv_cache,
              const torch::Tensor& slot_mapping, int64_t s_block, int64_t s_token, int64_t s_head,
              int64_t head_size, int64_t head_size_v, int64_t block_size);

// Registers PreparedStep (prepared_step.cpp) on the extension module.
void bind_prepared_step(pybind11::module& m);

}  // namespace kvmulti_cpu
