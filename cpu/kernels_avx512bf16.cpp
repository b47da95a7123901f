// The attention kernel compiled for avx512 + avx512bf16 + avx512vbmi (16 fp32 lanes; bf16 dot products;
// fp8 widened through vpermt2b byte tables); see attention_kernel.h.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "kvmulti_cpu.h"

namespace kvmulti_cpu {
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__clang__) && !defined(KV_SKIP_AVX512BF16)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,fma,f16c,bmi2")
namespace avx512bf16 {
#define KV_W 16
#define KV_BF16DOT 1
#define KV_FP8_VBMI 1
#include "attention_kernel.h"
#undef KV_W
#undef KV_BF16DOT
#undef KV_FP8_VBMI
}  // namespace avx512bf16
#pragma GCC pop_options
RunItemFn run_item_avx512bf16() { return &avx512bf16::run_item; }
WidenFp8Fn widen_fp8_avx512bf16() { return &avx512bf16::widen_fp8; }
int lanes_avx512bf16() { return 16; }
#else
RunItemFn run_item_avx512bf16() { return nullptr; }  // compiled only with GCC on x86, and not with -DKV_SKIP_AVX512BF16
WidenFp8Fn widen_fp8_avx512bf16() { return nullptr; }
int lanes_avx512bf16() { return 16; }
#endif
}  // namespace kvmulti_cpu
