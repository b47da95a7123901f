// The attention kernel compiled for avx2 (8 fp32 lanes); see attention_kernel.h.
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
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__clang__) && !defined(KV_SKIP_AVX2)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")
namespace avx2 {
#define KV_W 8
#include "attention_kernel.h"
#undef KV_W
}  // namespace avx2
#pragma GCC pop_options
RunItemFn run_item_avx2() { return &avx2::run_item; }
WidenFp8Fn widen_fp8_avx2() { return &avx2::widen_fp8; }
int lanes_avx2() { return 8; }
#else
RunItemFn run_item_avx2() { return nullptr; }  // compiled only with GCC on x86, and not with -DKV_SKIP_AVX2
WidenFp8Fn widen_fp8_avx2() { return nullptr; }
int lanes_avx2() { return 8; }
#endif
}  // namespace kvmulti_cpu
