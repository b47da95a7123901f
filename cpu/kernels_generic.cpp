// The attention kernel compiled for generic (4 fp32 lanes); see attention_kernel.h.
// KV_GENERIC_LANES=16 (or 8) with KV_PORTABLE_VECTORS builds this variant with the AVX-512 (AVX2)
// lane logic in plain vector extensions, so that logic is tested on any host (tests/test_cpu_native.py).
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
#ifndef KV_GENERIC_LANES
#define KV_GENERIC_LANES 4
#endif
namespace generic {
#define KV_W KV_GENERIC_LANES
#include "attention_kernel.h"
#undef KV_W
}  // namespace generic
RunItemFn run_item_generic() { return &generic::run_item; }
WidenFp8Fn widen_fp8_generic() { return &generic::widen_fp8; }
int lanes_generic() { return KV_GENERIC_LANES; }
}  // namespace kvmulti_cpu
