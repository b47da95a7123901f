// The attention kernel compiled for avx512 (16 fp32 lanes); see attention_kernel.h.
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
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__clang__) && !defined(KV_SKIP_AVX512)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,bmi2")
namespace avx512 {
#define KV_W 16
#include "attention_kernel.h"
#undef KV_W
}  // namespace avx512
#pragma GCC pop_options
RunItemFn run_item_avx512() { return &avx512::run_item; }
WidenFp8Fn widen_fp8_avx512() { return &avx512::widen_fp8; }
int lanes_avx512() { return 16; }
#else
RunItemFn run_item_avx512() { return nullptr; }  // compiled only with GCC on x86, and not with -DKV_SKIP_AVX512
WidenFp8Fn widen_fp8_avx512() { return nullptr; }
int lanes_avx512() { return 16; }
#endif
}  // namespace kvmulti_cpu
