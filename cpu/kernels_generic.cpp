// The attention kernel compiled for generic (4 fp32 lanes); see attention_kernel.h.
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
namespace generic {
#define KV_W 4
#include "attention_kernel.h"
#undef KV_W
}  // namespace generic
RunItemFn run_item_generic() { return &generic::run_item; }
int lanes_generic() { return 4; }
}  // namespace kvmulti_cpu
