// kvcpu: kvmulti's own small HIP-on-CPU harness.
//
// It lets the UNMODIFIED kvmulti .hip kernel sources compile with g++/clang++ and run on the CPU,
// for verification in CPU-only CI. It is a test harness, not a performance path.
//
// Model
//   * Blocks of a grid run one after another on the calling OS thread.
//   * Every thread of a block is a fiber with its own stack (hand-written x86-64 context switch;
//     ucontext elsewhere). Fibers run cooperatively; they only switch at barriers.
//   * __syncthreads() is a block barrier over ALL threads of the block. A thread that exits while
//     others wait at a barrier, or threads of one warp waiting at different barriers, leave the
//     block without runnable fibers: the harness reports a deadlock ("non-uniform barrier") and the
//     launch fails (hipGetLastError() != hipSuccess, kvcpu_last_error() says why).
//   * __shfl_xor / __shfl / __shfl_down: each lane writes its value into a per-warp exchange slot,
//     warp barrier, reads the source lane's slot. The slots are double-buffered (a lane alternates
//     between two slot sets), so one warp barrier per exchange suffices: a lane can only overwrite a
//     set after every lane has passed the next exchange's barrier, i.e. has read the set. Every lane
//     of the warp must take part (uniform control flow), as on a GPU wavefront.
//   * Matrix builtins (__builtin_amdgcn_mfma_f32_16x16x16f16 / _16x16x16bf16_1k / _16x16x4f32): wave-wide
//     collectives like the shuffles (every lane of a 64-lane wave takes part); each lane publishes its
//     A/B fragment registers, and computes its own D registers with the hardware's lane/register
//     mapping (checked against AMD's register-layout tables by the self-test). kvcpu_mfma_count()
//     counts emulated instructions; kvcpu_set_mfma_enabled(0) makes mfma_enabled() false (the kernels
//     then take their FMA path, so both paths run on the harness).
//   * WMMA builtins (__builtin_amdgcn_wmma_f32_16x16x16_{f16,bf16}_w32 for gfx11, ..._w32_gfx12 for gfx12):
//     the same for one 32-lane wave, in the layout family kvcpu_set_wmma_family selects (11, 12, or 0 for
//     none); kvcpu_wmma_count() counts them. kvcpu_fma_tile_count() counts the key tiles the prefill kernel's
//     FMA tile engine computes (one per wave and tile).
//   * kvcpu::warp_sync(): a warp barrier (what __builtin_amdgcn_wave_barrier + fences / __syncwarp
//     give on a GPU: LDS writes of the wave visible to all its lanes).
//   * __shared__ variables live in one ELF section ("kvcpu_shared"); dynamic shared memory is a
//     per-launch buffer. Both are poisoned (all bytes 0xFF: NaN for floats, -1 for ints) before
//     every block, so a thread that reads shared memory written by another thread without a
//     __syncthreads() in between sees poison or a previous block's data, not the value it wanted.
//   * The emulated device's warp size (32 or 64) is set with kvcpu_set_warp_size() and reported by
//     hipDeviceGetAttribute(hipDeviceAttributeWarpSize) and warpSize.
//   * __half / hip_bfloat16: 16-bit storage types converting through float (round to nearest even).
//
// Include it through hip/cpu_harness/include (which provides <hip/hip_runtime.h>, <hip/hip_fp16.h>,
// <hip/hip_bfloat16.h>) in exactly ONE translation unit of a shared library.
#pragma once

#include <cfloat>
#include <cmath>
#include <math.h>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

// Context switch: hand-written for x86-64 (fast: no signal-mask syscall); ucontext elsewhere, or
// everywhere with -DKVCPU_FORCE_UCONTEXT (the self-test builds both).
#if defined(__x86_64__) && !defined(KVCPU_FORCE_UCONTEXT)
#define KVCPU_ASM_SWITCH 1
#else
#define KVCPU_ASM_SWITCH 0
#endif
#if !KVCPU_ASM_SWITCH
#include <ucontext.h>
#endif
#include <sys/mman.h>
#include <unistd.h>

#define KVMULTI_HIP_CPU_HARNESS 1
#define __HIP_CPU_HARNESS__ 1

// ----------------------------------------------------------------------------------- qualifiers
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
// Static shared memory: one copy per kernel (blocks run one at a time), kept in a dedicated section
// so the harness can poison it before each block.
#define __shared__ static __attribute__((section("kvcpu_shared")))
#define HIP_DYNAMIC_SHARED(type, var) type* var = reinterpret_cast<type*>(::kvcpu::dynamic_shared());
#define HIP_DYNAMIC_SHARED_ATTRIBUTE

extern "C" char __start_kvcpu_shared[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_kvcpu_shared[] __attribute__((weak, visibility("hidden")));

// ----------------------------------------------------------------------------------- runtime types
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 { unsigned int x, y, z; };

typedef void* hipStream_t;
enum hipError_t {
  hipSuccess = 0,
  hipErrorInvalidValue = 1,
  hipErrorOutOfMemory = 2,
  hipErrorInvalidConfiguration = 9,
  hipErrorInvalidDeviceFunction = 98,
  hipErrorLaunchFailure = 719,
};
enum hipDeviceAttribute_t {
  hipDeviceAttributeWarpSize = 1,
  hipDeviceAttributeMultiprocessorCount = 2,
  hipDeviceAttributeMaxThreadsPerBlock = 3,
};

namespace kvcpu {

// ------------------------------------------------------------------------------ context switching
#if KVCPU_ASM_SWITCH
extern "C" void kvcpu_switch(void** save_sp, void* new_sp);
extern "C" void kvcpu_fiber_trampoline();
// Saves callee-saved registers + MXCSR/x87 control word on the current stack, stores the stack
// pointer in *save_sp, switches to new_sp and restores the same from there.
asm(R"(
  .text
  .weak kvcpu_switch
  .hidden kvcpu_switch
  .type kvcpu_switch,@function
kvcpu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size kvcpu_switch, .-kvcpu_switch

  .weak kvcpu_fiber_trampoline
  .hidden kvcpu_fiber_trampoline
  .type kvcpu_fiber_trampoline,@function
kvcpu_fiber_trampoline:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size kvcpu_fiber_trampoline, .-kvcpu_fiber_trampoline
)");
#endif

struct Barrier {
  int count = 0;
  unsigned gen = 0;
};

struct Fiber;
struct BlockState;

struct Fiber {
  uint3 tid{0, 0, 0};
  int linear = 0, lane = 0, warp = 0;
  bool done = false;
  unsigned xround = 0;         // warp collectives this fiber has taken part in (slot-set parity)
  Barrier* waiting = nullptr;  // barrier this fiber is blocked on (nullptr = runnable)
  unsigned wait_gen = 0;
  char* stack = nullptr;
  size_t stack_size = 0;
#if KVCPU_ASM_SWITCH
  void* sp = nullptr;
#else
  ucontext_t ctx;
#endif
};

//: bytes one lane publishes per warp collective
constexpr size_t kSlotBytes = 64, kSlotWords = kSlotBytes / 8;

struct Warp {
  Barrier bar;
  int size = 0;
  uint64_t slot[2][64][kSlotWords];  // [parity][lane][kSlotBytes]: double-buffered exchange slots
};

struct State {
  // per launch
  dim3 grid, block;
  uint3 block_idx{0, 0, 0};
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  Barrier block_bar;
  int nthreads = 0;
  std::vector<unsigned char> dyn_shared;
  std::function<void()> body;
  Fiber* cur = nullptr;
#if KVCPU_ASM_SWITCH
  void* sched_sp = nullptr;
#else
  ucontext_t sched_ctx;
#endif
  // device
  int warp_size = 64;
  int num_cus = 8;
  bool mfma_enabled = true;
  unsigned long long mfma_count = 0;  // emulated matrix instructions (one per wave-wide call)
  int wmma_family = 11;               // WMMA layout emulated: 11 (RDNA3, gfx11), 12 (RDNA4, gfx12), 0 (none)
  unsigned long long wmma_count = 0;  // emulated WMMA instructions (one per wave-wide call)
  unsigned long long fma_tile_count = 0;  // key tiles of the prefill kernel's FMA tile engine (one per wave)
  // errors
  hipError_t last_error = hipSuccess;
  std::string last_message;
  // stacks (reused across launches)
  std::vector<char*> stacks;
  size_t stack_size = 256 * 1024;
  // scheduling order
  std::vector<int> order;
  uint64_t rng = 0x9E3779B97F4A7C15ull;
  uint64_t next_random() {  // xorshift64
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
  }
};

// Namespace-scope (not function-local) on purpose: the build's linker script collects every
// function-local static of the translation unit (= the kernels' __shared__ variables) into the
// poisoned kvcpu_shared section.
inline State g_state;
inline std::mutex g_launch_mutex;
inline State& st() { return g_state; }

inline void* dynamic_shared() { return st().dyn_shared.data(); }
inline int warp_size() { return st().warp_size; }

inline void fail(hipError_t e, const std::string& msg) {
  State& s = st();
  if (s.last_error == hipSuccess) {
    s.last_error = e;
    s.last_message = msg;
  }
}

inline void yield_to_scheduler() {
  State& s = st();
  Fiber* f = s.cur;
#if KVCPU_ASM_SWITCH
  kvcpu_switch(&f->sp, s.sched_sp);
#else
  swapcontext(&f->ctx, &s.sched_ctx);
#endif
}

inline void barrier_wait(Barrier& b, int expected) {
  State& s = st();
  const unsigned gen = b.gen;
  if (++b.count == expected) {  // last to arrive: release everybody, keep running
    b.count = 0;
    ++b.gen;
    return;
  }
  Fiber* f = s.cur;
  f->waiting = &b;
  f->wait_gen = gen;
  while (b.gen == gen) yield_to_scheduler();
  f->waiting = nullptr;
}

inline void syncthreads() { barrier_wait(st().block_bar, st().nthreads); }

inline void fiber_main(Fiber* f) {
  State& s = st();
  s.body();
  f->done = true;
  yield_to_scheduler();
  std::abort();  // never resumed
}

#if !KVCPU_ASM_SWITCH
inline void fiber_entry_ucontext(unsigned lo, unsigned hi) {
  uintptr_t p = (uintptr_t)lo | ((uintptr_t)hi << 32);
  fiber_main(reinterpret_cast<Fiber*>(p));
}
#endif

inline char* get_stack(size_t i) {
  State& s = st();
  while (s.stacks.size() <= i) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    void* m = mmap(nullptr, s.stack_size + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return nullptr;
    mprotect(m, page, PROT_NONE);  // guard page below the stack
    s.stacks.push_back((char*)m + page);
  }
  return s.stacks[i];
}

inline void init_fiber(Fiber& f) {
#if KVCPU_ASM_SWITCH
  uintptr_t top = ((uintptr_t)(f.stack + f.stack_size)) & ~(uintptr_t)15;
  uint64_t* sp = reinterpret_cast<uint64_t*>(top);
  *--sp = (uint64_t)(uintptr_t)&kvcpu_fiber_trampoline;  // return address of kvcpu_switch
  *--sp = 0;                                              // rbp
  *--sp = 0;                                              // rbx
  *--sp = (uint64_t)(uintptr_t)&f;                        // r12 -> first argument
  *--sp = (uint64_t)(uintptr_t)&fiber_main;               // r13 -> function
  *--sp = 0;                                              // r14
  *--sp = 0;                                              // r15
  uint32_t csr[2] = {0x1F80u, 0x037Fu};                   // default MXCSR, x87 control word
  --sp;
  std::memcpy(sp, csr, 8);
  f.sp = sp;
#else
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = f.stack;
  f.ctx.uc_stack.ss_size = f.stack_size;
  f.ctx.uc_link = nullptr;
  uintptr_t p = (uintptr_t)&f;
  makecontext(&f.ctx, (void (*)())fiber_entry_ucontext, 2, (unsigned)(p & 0xffffffffu), (unsigned)(p >> 32));
#endif
}

inline void poison_shared() {
  State& s = st();
  const uintptr_t b = (uintptr_t)&__start_kvcpu_shared[0], e = (uintptr_t)&__stop_kvcpu_shared[0];
  if (b && e > b) std::memset((void*)b, 0xFF, (size_t)(e - b));
  if (!s.dyn_shared.empty()) std::memset(s.dyn_shared.data(), 0xFF, s.dyn_shared.size());
}

// Runs one block to completion. Returns false (and records the error) on a deadlock.
inline bool run_block() {
  State& s = st();
  const int n = s.nthreads;
  s.block_bar = Barrier{};
  for (auto& w : s.warps) w.bar = Barrier{};
  for (int i = 0; i < n; ++i) {
    Fiber& f = s.fibers[i];
    f.done = false;
    f.xround = 0;
    f.waiting = nullptr;
    init_fiber(f);
  }
  poison_shared();
  int alive = n;
  std::vector<int>& order = s.order;
  order.resize(n);
  for (int i = 0; i < n; ++i) order[i] = i;
  while (alive > 0) {
    bool progressed = false;
    // Fibers run in a fresh pseudo-random order on every pass, so a read of another thread's shared
    // memory write without a barrier in between misses it whichever of the two threads is lower.
    for (int i = n - 1; i > 0; --i) std::swap(order[i], order[s.next_random() % (uint64_t)(i + 1)]);
    for (int k = 0; k < n; ++k) {
      Fiber& f = s.fibers[order[k]];
      if (f.done) continue;
      if (f.waiting && f.waiting->gen == f.wait_gen) continue;  // still blocked
      s.cur = &f;
#if KVCPU_ASM_SWITCH
      kvcpu_switch(&s.sched_sp, f.sp);
#else
      swapcontext(&s.sched_ctx, &f.ctx);
#endif
      s.cur = nullptr;
      progressed = true;
      if (f.done) --alive;
    }
    if (!progressed) {
      int at_block = 0, at_warp = 0;
      for (int i = 0; i < n; ++i) {
        const Fiber& f = s.fibers[i];
        if (f.done) continue;
        if (f.waiting == &s.block_bar) ++at_block; else ++at_warp;
      }
      char buf[320];
      std::snprintf(buf, sizeof buf,
                    "kvcpu: deadlock in block (%u,%u,%u): %d threads exited, %d wait at __syncthreads, "
                    "%d wait at a warp shuffle -- barrier or shuffle reached non-uniformly",
                    s.block_idx.x, s.block_idx.y, s.block_idx.z, n - alive, at_block, at_warp);
      fail(hipErrorLaunchFailure, buf);
      return false;
    }
  }
  return true;
}

template <typename... KArgs, typename... Args>
inline void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t shmem, Args&&... args) {
  std::lock_guard<std::mutex> lock(g_launch_mutex);  // one launch at a time (ctypes releases the GIL)
  State& s = st();
  const long long nt = (long long)block.x * block.y * block.z;
  if (nt <= 0 || nt > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0) {
    fail(hipErrorInvalidConfiguration, "kvcpu: invalid launch configuration");
    return;
  }
  if (s.cur) {
    fail(hipErrorInvalidValue, "kvcpu: kernel launch from device code is not supported");
    return;
  }
  s.grid = grid;
  s.block = block;
  s.nthreads = (int)nt;
  s.dyn_shared.assign(shmem ? shmem : 0, 0);
  const int W = s.warp_size;
  const int nwarps = (s.nthreads + W - 1) / W;
  s.warps.assign(nwarps, Warp{});
  for (int w = 0; w < nwarps; ++w) s.warps[w].size = std::min(W, s.nthreads - w * W);
  s.fibers.assign(s.nthreads, Fiber{});
  for (int i = 0; i < s.nthreads; ++i) {
    Fiber& f = s.fibers[i];
    f.linear = i;
    f.tid = uint3{(unsigned)(i % block.x), (unsigned)((i / block.x) % block.y), (unsigned)(i / (block.x * block.y))};
    f.lane = i % W;
    f.warp = i / W;
    f.stack = get_stack(i);
    f.stack_size = s.stack_size;
    if (!f.stack) {
      fail(hipErrorOutOfMemory, "kvcpu: cannot allocate fiber stacks");
      return;
    }
  }
  s.body = [&]() { kernel(args...); };
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        s.block_idx = uint3{x, y, z};
        if (!run_block()) {
          s.body = nullptr;
          return;
        }
      }
  s.body = nullptr;
}

// ------------------------------------------------------------------------------ warp collectives
// Publishes n <= kSlotBytes bytes of this lane into its slot of the current slot set and waits until every
// lane of the warp has published; returns the set (read any lane's slot from it until this lane's next
// collective: a set is rewritten only after every lane has passed the next barrier). One warp barrier.
inline const uint64_t (*publish(const void* p, size_t n))[kSlotWords] {
  State& s = st();
  Fiber* f = s.cur;
  Warp& w = s.warps[f->warp];
  const unsigned parity = f->xround++ & 1u;
  if (n > kSlotBytes) {
    fail(hipErrorLaunchFailure, "kvcpu: a warp collective of more than kSlotBytes bytes per lane");
    n = kSlotBytes;
  }
  std::memcpy(&w.slot[parity][f->lane][0], p, n);
  barrier_wait(w.bar, w.size);
  return w.slot[parity];
}

template <typename T>
inline T exchange(T v, int src) {
  static_assert(sizeof(T) <= 16, "kvcpu: shuffle of a type wider than 16 bytes");
  State& s = st();
  const auto* slots = publish(&v, sizeof(T));
  if (src < 0 || src >= s.warps[s.cur->warp].size) src = s.cur->lane;
  T r;
  std::memcpy(&r, &slots[src][0], sizeof(T));
  return r;
}

// Warp barrier (every lane must call it).
inline void warp_sync() {
  const int dummy = 0;
  (void)publish(&dummy, sizeof dummy);
}

inline int lane_id() { return st().cur->lane; }

}  // namespace kvcpu

// ----------------------------------------------------------------------------- device built-ins
#define threadIdx (::kvcpu::st().cur->tid)
#define blockIdx (::kvcpu::st().block_idx)
#define blockDim (::kvcpu::st().block)
#define gridDim (::kvcpu::st().grid)
#define warpSize (::kvcpu::warp_size())

inline void __syncthreads() { ::kvcpu::syncthreads(); }
inline int __lane_id() { return ::kvcpu::lane_id(); }

template <typename T>
inline T __shfl_xor(T var, int lane_mask, int width = warpSize) {
  const int self = ::kvcpu::lane_id();
  int index = self ^ lane_mask;
  index = index >= ((self + width) & ~(width - 1)) ? self : index;
  return ::kvcpu::exchange(var, index);
}
template <typename T>
inline T __shfl(T var, int src_lane, int width = warpSize) {
  const int self = ::kvcpu::lane_id();
  const int index = (src_lane & (width - 1)) + (self & ~(width - 1));
  return ::kvcpu::exchange(var, index);
}
template <typename T>
inline T __shfl_down(T var, unsigned int delta, int width = warpSize) {
  const int self = ::kvcpu::lane_id();
  int index = self + (int)delta;
  index = (int)((self & (width - 1)) + delta) >= width ? self : index;
  return ::kvcpu::exchange(var, index);
}
template <typename T>
inline T __shfl_up(T var, unsigned int delta, int width = warpSize) {
  const int self = ::kvcpu::lane_id();
  int index = self - (int)delta;
  index = index < (self & ~(width - 1)) ? self : index;
  return ::kvcpu::exchange(var, index);
}

inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
using std::fmaxf;
using std::max;
using std::min;
using std::fminf;

// ------------------------------------------------------------------------------ 16-bit types
namespace kvcpu {
inline uint32_t f2u(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float u2f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline uint16_t float_to_half_bits(float f) {  // IEEE binary16, round to nearest even
  const uint32_t x = f2u(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));  // inf/nan
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // rounds to >= 65520 -> inf
  if (ax < 0x38800000u) {  // result is subnormal or zero: scale so that the rounding happens in float
    const float v = u2f(ax) * 16777216.0f;  // * 2^24 ; subnormal half unit is 2^-24
    const uint32_t m = (uint32_t)std::nearbyint(v);  // current rounding mode: nearest even
    return (uint16_t)(sign | m);
  }
  uint32_t mant = ax & 0x7fffffu;
  uint32_t exp = (ax >> 23) - 127 + 15;
  uint32_t h = (exp << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return (uint16_t)(sign | h);
}
inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    const float v = (float)mant * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  if (exp == 31) return u2f(sign | 0x7f800000u | (mant << 13));
  return u2f(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}
inline uint16_t float_to_bf16_bits(float f) {  // round to nearest even, quiet NaN
  const uint32_t u = f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float bf16_bits_to_float(uint16_t b) { return u2f((uint32_t)b << 16); }

// ------------------------------------------------------------------------------ matrix builtins
// Register types of the emulated builtins: 4 x fp32 (C/D: 4 VGPRs), 4 x 16-bit (A/B: 2 VGPRs; the
// f16 variant's bit patterns are carried in unsigned shorts, g++ has no portable _Float16 vector).
typedef float f32x4 __attribute__((vector_size(16)));
typedef unsigned short f16x4 __attribute__((vector_size(8)));
typedef short bf16x4 __attribute__((vector_size(8)));

// v_mfma_f32_16x16x16{f16,bf16_1k} for one 64-lane wave (CDNA2/CDNA3 layout):
//   A[i][k] is element k%4 of lane i + 16*(k/4)        (element e = VGPR e/2, bits [16*(e%2), +16))
//   B[k][j] is element k%4 of lane j + 16*(k/4)
//   D[i][j] is element i%4 of lane j + 16*(i/4)        (element = VGPR)
// D = A*B + C with fp32 products and accumulation. Every lane must call it (wave-wide collective).
template <float (*TO_FLOAT)(uint16_t), typename V>
inline f32x4 mfma_16x16x16(V a, V b, f32x4 c) {
  State& s = st();
  if (s.warps[s.cur->warp].size != 64) {
    fail(hipErrorLaunchFailure, "kvcpu: 16x16x16 MFMA emulated only for 64-lane waves");
    return c;
  }
  uint16_t ab[8];
  std::memcpy(&ab[0], &a, 8);
  std::memcpy(&ab[4], &b, 8);
  const auto* slots = publish(ab, sizeof ab);
  const int lane = s.cur->lane;
  if (lane == 0) ++s.mfma_count;
  auto element = [&](int src_lane, int which, int e) {  // which 0 = A, 1 = B
    uint16_t v[8];
    std::memcpy(v, &slots[src_lane][0], sizeof v);
    return TO_FLOAT(v[4 * which + e]);
  };
  const int j = lane % 16, i0 = 4 * (lane / 16);
  f32x4 d = c;
  for (int r = 0; r < 4; ++r) {
    float acc = 0.f;
    for (int k = 0; k < 16; ++k) acc += element(i0 + r + 16 * (k / 4), 0, k % 4) *
                                         element(j + 16 * (k / 4), 1, k % 4);
    d[r] += acc;
  }
  return d;
}

inline f32x4 mfma_f32_16x16x16f16(f16x4 a, f16x4 b, f32x4 c, int cbsz, int abid, int blgp) {
  if (cbsz || abid || blgp) fail(hipErrorLaunchFailure, "kvcpu: MFMA broadcast modifiers are not emulated");
  return mfma_16x16x16<half_bits_to_float>(a, b, c);
}
inline f32x4 mfma_f32_16x16x16bf16_1k(bf16x4 a, bf16x4 b, f32x4 c, int cbsz, int abid, int blgp) {
  if (cbsz || abid || blgp) fail(hipErrorLaunchFailure, "kvcpu: MFMA broadcast modifiers are not emulated");
  return mfma_16x16x16<bf16_bits_to_float>(a, b, c);
}
// v_mfma_f32_16x16x4f32 for one 64-lane wave (CDNA2/CDNA3: one block, one VGPR per A / B operand):
//   A[i][k] is lane i + 16k, B[k][j] is lane j + 16k, D[i][j] is element i%4 of lane j + 16*(i/4)
// D = A*B + C with fp32 products summed in fp32 over k = 0..3, then added to C (AMD does not specify the
// hardware's order or internal precision). Every lane must call it (wave-wide collective).
inline f32x4 mfma_f32_16x16x4f32(float a, float b, f32x4 c, int cbsz, int abid, int blgp) {
  if (cbsz || abid || blgp) fail(hipErrorLaunchFailure, "kvcpu: MFMA broadcast modifiers are not emulated");
  State& s = st();
  if (s.warps[s.cur->warp].size != 64) {
    fail(hipErrorLaunchFailure, "kvcpu: 16x16x4 MFMA emulated only for 64-lane waves");
    return c;
  }
  const float ab[2] = {a, b};
  const auto* slots = publish(ab, sizeof ab);
  const int lane = s.cur->lane;
  if (lane == 0) ++s.mfma_count;
  auto element = [&](int src_lane, int which) {  // which 0 = A, 1 = B
    float v[2];
    std::memcpy(v, &slots[src_lane][0], sizeof v);
    return v[which];
  };
  const int j = lane % 16, i0 = 4 * (lane / 16);
  f32x4 d = c;
  for (int r = 0; r < 4; ++r) {
    float acc = 0.f;
    for (int k = 0; k < 4; ++k) acc += element(i0 + r + 16 * k, 0) * element(j + 16 * k, 1);
    d[r] += acc;
  }
  return d;
}
inline bool mfma_enabled() { return st().mfma_enabled; }
// A wave's key tile on the prefill kernel's FMA tile engine (kernels call it from lane 0).
inline void count_fma_tile() { ++st().fma_tile_count; }

// ------------------------------------------------------------------------------ WMMA builtins (wave32)
// Register types: D/C 8 x fp32 (8 VGPRs); gfx11 A/B 16 x 16-bit (8 VGPRs), gfx12 A/B 8 x 16-bit (4 VGPRs).
// Structs, not 32-byte vectors: g++ without AVX warns that returning those changes the ABI.
struct f32x8 {
  float v[8];
  float& operator[](int i) { return v[i]; }
  float operator[](int i) const { return v[i]; }
};
struct f16x16 { uint16_t v[16]; };
struct bf16x16 { uint16_t v[16]; };
struct f16x8 { uint16_t v[8]; };
struct bf16x8 { uint16_t v[8]; };

// v_wmma_f32_16x16x16_{f16,bf16} for one 32-lane wave. Element e of a lane's A / B operand = VGPR e/2, bits
// [16 (e%2), +16); element r of D = VGPR r.
//   gfx11 (RDNA3): A[i][k] is element k of lane i and of lane i + 16 (the halves must hold the same values),
//                  B[k][j] element k of lanes j and j + 16, D[i][j] element i/2 of lane j + 16 (i%2);
//   gfx12 (RDNA4): A[i][k] is element (k%4) + 4 (k/8) of lane i + 16 ((k/4)%2), B[k][j] likewise of lane
//                  j + 16 ((k/4)%2), D[i][j] element i%8 of lane j + 16 (i/8).
// D = A*B + C with fp32 products and accumulation. Every lane must call it (wave-wide collective); the
// builtin's family must be the one the harness emulates (kvcpu_set_wmma_family).
template <int FAMILY, float (*TO_FLOAT)(uint16_t)>
inline f32x8 wmma_16x16x16(const uint16_t* a, const uint16_t* b, f32x8 c) {
  constexpr int NE = FAMILY == 11 ? 16 : 8;  // elements per lane and operand
  State& s = st();
  if (s.warp_size != 32 || s.warps[s.cur->warp].size != 32) {
    fail(hipErrorLaunchFailure, "kvcpu: WMMA emulated only for 32-lane waves (a wave32 device, whole waves)");
    return c;
  }
  if (s.wmma_family != FAMILY) {
    fail(hipErrorLaunchFailure, s.wmma_family ? "kvcpu: a WMMA builtin of the other layout family than the emulated one"
                                              : "kvcpu: a WMMA builtin with WMMA disabled");
    return c;
  }
  uint16_t ab[2 * NE];
  std::memcpy(&ab[0], a, 2 * NE);
  std::memcpy(&ab[NE], b, 2 * NE);
  const auto* slots = publish(ab, sizeof ab);
  const int lane = s.cur->lane;
  if (lane == 0) ++s.wmma_count;
  auto raw = [&](int src_lane, int which, int e) {  // which 0 = A, 1 = B
    uint16_t v;
    std::memcpy(&v, reinterpret_cast<const unsigned char*>(&slots[src_lane][0]) + 2 * (NE * which + e), 2);
    return v;
  };
  if (FAMILY == 11 && lane == 0) {
    for (int l = 0; l < 16; ++l)
      for (int w = 0; w < 2; ++w)
        for (int e = 0; e < 16; ++e)
          if (raw(l, w, e) != raw(l + 16, w, e)) {
            fail(hipErrorLaunchFailure, "kvcpu: gfx11 WMMA operand: lanes 16-31 differ from lanes 0-15");
            return c;
          }
  }
  auto element = [&](int which, int row, int k) {  // A[row][k] (which 0) or B[k][row] (which 1)
    if (FAMILY == 11) return TO_FLOAT(raw(row, which, k));
    return TO_FLOAT(raw(row + 16 * ((k / 4) % 2), which, k % 4 + 4 * (k / 8)));
  };
  const int j = lane % 16;
  f32x8 d = c;
  for (int r = 0; r < 8; ++r) {
    const int i = FAMILY == 11 ? 2 * r + lane / 16 : r + 8 * (lane / 16);
    float acc = 0.f;
    for (int k = 0; k < 16; ++k) acc += element(0, i, k) * element(1, j, k);
    d[r] += acc;
  }
  return d;
}
inline f32x8 wmma_f32_16x16x16_f16_w32(f16x16 a, f16x16 b, f32x8 c) {
  return wmma_16x16x16<11, half_bits_to_float>(a.v, b.v, c);
}
inline f32x8 wmma_f32_16x16x16_bf16_w32(bf16x16 a, bf16x16 b, f32x8 c) {
  return wmma_16x16x16<11, bf16_bits_to_float>(a.v, b.v, c);
}
inline f32x8 wmma_f32_16x16x16_f16_w32_gfx12(f16x8 a, f16x8 b, f32x8 c) {
  return wmma_16x16x16<12, half_bits_to_float>(a.v, b.v, c);
}
inline f32x8 wmma_f32_16x16x16_bf16_w32_gfx12(bf16x8 a, bf16x8 b, f32x8 c) {
  return wmma_16x16x16<12, bf16_bits_to_float>(a.v, b.v, c);
}
// The WMMA layout family the harness emulates (11, 12; 0: no WMMA -- the launcher then runs wave32 prefill
// through the attention kernel, as on targets without WMMA).
inline int wmma_family() { return st().wmma_family; }
}  // namespace kvcpu

#define __builtin_amdgcn_wmma_f32_16x16x16_f16_w32 ::kvcpu::wmma_f32_16x16x16_f16_w32
#define __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32 ::kvcpu::wmma_f32_16x16x16_bf16_w32
#define __builtin_amdgcn_wmma_f32_16x16x16_f16_w32_gfx12 ::kvcpu::wmma_f32_16x16x16_f16_w32_gfx12
#define __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32_gfx12 ::kvcpu::wmma_f32_16x16x16_bf16_w32_gfx12

#define __builtin_amdgcn_mfma_f32_16x16x16f16 ::kvcpu::mfma_f32_16x16x16f16
#define __builtin_amdgcn_mfma_f32_16x16x16bf16_1k ::kvcpu::mfma_f32_16x16x16bf16_1k
#define __builtin_amdgcn_mfma_f32_16x16x4f32 ::kvcpu::mfma_f32_16x16x4f32

struct __half {
  uint16_t x;
  __half() = default;
  __half(float f) : x(::kvcpu::float_to_half_bits(f)) {}
  operator float() const { return ::kvcpu::half_bits_to_float(x); }
};
static_assert(sizeof(__half) == 2, "__half must be 2 bytes");
inline float __half2float(__half h) { return (float)h; }
inline __half __ushort_as_half(unsigned short b) { __half h; h.x = b; return h; }
inline unsigned short __half_as_ushort(__half h) { return h.x; }
inline float __uint_as_float(unsigned int u) { return ::kvcpu::u2f(u); }
inline unsigned int __float_as_uint(float f) { return ::kvcpu::f2u(f); }
inline __half __float2half(float f) { return __half(f); }

struct hip_bfloat16 {
  uint16_t data;
  hip_bfloat16() = default;
  explicit hip_bfloat16(float f) : data(::kvcpu::float_to_bf16_bits(f)) {}
  operator float() const { return ::kvcpu::bf16_bits_to_float(data); }
};
static_assert(sizeof(hip_bfloat16) == 2, "hip_bfloat16 must be 2 bytes");

// ------------------------------------------------------------------------------ host runtime API
#define hipLaunchKernelGGL(kernel, grid, block, shmem, stream, ...) \
  ((void)(stream), ::kvcpu::launch((kernel), dim3(grid), dim3(block), (size_t)(shmem), ##__VA_ARGS__))

inline hipError_t hipGetLastError() {
  hipError_t e = ::kvcpu::st().last_error;
  ::kvcpu::st().last_error = hipSuccess;
  return e;
}
inline hipError_t hipPeekAtLastError() { return ::kvcpu::st().last_error; }
inline const char* hipGetErrorString(hipError_t e) {
  switch (e) {
    case hipSuccess: return "hipSuccess";
    case hipErrorInvalidValue: return "hipErrorInvalidValue";
    case hipErrorOutOfMemory: return "hipErrorOutOfMemory";
    case hipErrorInvalidConfiguration: return "hipErrorInvalidConfiguration";
    case hipErrorInvalidDeviceFunction: return "hipErrorInvalidDeviceFunction";
    case hipErrorLaunchFailure: return "hipErrorLaunchFailure";
  }
  return "hipErrorUnknown";
}
inline hipError_t hipGetDevice(int* d) { *d = 0; return hipSuccess; }
inline hipError_t hipDeviceGetAttribute(int* v, hipDeviceAttribute_t a, int /*device*/) {
  switch (a) {
    case hipDeviceAttributeWarpSize: *v = ::kvcpu::st().warp_size; return hipSuccess;
    case hipDeviceAttributeMultiprocessorCount: *v = ::kvcpu::st().num_cus; return hipSuccess;
    case hipDeviceAttributeMaxThreadsPerBlock: *v = 1024; return hipSuccess;
  }
  return hipErrorInvalidValue;
}
inline hipError_t hipStreamSynchronize(hipStream_t) { return hipSuccess; }
inline hipError_t hipDeviceSynchronize() { return hipSuccess; }

// C ABI of the emulated device, for the Python side (ctypes).
extern "C" __attribute__((visibility("default"), weak)) int kvcpu_set_warp_size(int w) {
  if (w != 32 && w != 64) return (int)hipErrorInvalidValue;
  ::kvcpu::st().warp_size = w;
  return 0;
}
extern "C" __attribute__((visibility("default"), weak)) int kvcpu_set_cu_count(int n) {
  if (n < 1) return (int)hipErrorInvalidValue;
  ::kvcpu::st().num_cus = n;
  return 0;
}
// Bytes of static __shared__ memory found in the kvcpu_shared section (poisoned before each block).
extern "C" __attribute__((visibility("default"), weak)) long long kvcpu_static_shared_bytes() {
  return (long long)((uintptr_t)&__stop_kvcpu_shared[0] - (uintptr_t)&__start_kvcpu_shared[0]);
}
extern "C" __attribute__((visibility("default"), weak)) void kvcpu_set_seed(unsigned long long seed) {
  ::kvcpu::st().rng = seed ? seed : 0x9E3779B97F4A7C15ull;
}
// Emulated matrix instructions since the last reset (one per wave-wide builtin call).
extern "C" __attribute__((visibility("default"), weak)) unsigned long long kvcpu_mfma_count() {
  return ::kvcpu::st().mfma_count;
}
extern "C" __attribute__((visibility("default"), weak)) void kvcpu_reset_mfma_count() { ::kvcpu::st().mfma_count = 0; }
// 0: kernels see mfma_enabled() == false and take their FMA path (the default is 1).
extern "C" __attribute__((visibility("default"), weak)) void kvcpu_set_mfma_enabled(int on) {
  ::kvcpu::st().mfma_enabled = on != 0;
}
// Emulated WMMA instructions since the last reset (one per wave-wide builtin call).
extern "C" __attribute__((visibility("default"), weak)) unsigned long long kvcpu_wmma_count() {
  return ::kvcpu::st().wmma_count;
}
extern "C" __attribute__((visibility("default"), weak)) void kvcpu_reset_wmma_count() { ::kvcpu::st().wmma_count = 0; }
// Key tiles the prefill kernel's FMA tile engine computed since the last reset (one per wave and tile).
extern "C" __attribute__((visibility("default"), weak)) unsigned long long kvcpu_fma_tile_count() {
  return ::kvcpu::st().fma_tile_count;
}
extern "C" __attribute__((visibility("default"), weak)) void kvcpu_reset_fma_tile_count() {
  ::kvcpu::st().fma_tile_count = 0;
}
// The WMMA layout family the emulated wave32 device has: 11 (gfx11, the default), 12 (gfx12), 0 (no WMMA:
// wave32 prefill takes the FMA tile engine, as on NVIDIA). Returns hipErrorInvalidValue for anything else.
extern "C" __attribute__((visibility("default"), weak)) int kvcpu_set_wmma_family(int family) {
  if (family != 0 && family != 11 && family != 12) return (int)hipErrorInvalidValue;
  ::kvcpu::st().wmma_family = family;
  return 0;
}
extern "C" __attribute__((visibility("default"), weak)) int kvcpu_wmma_family() { return ::kvcpu::st().wmma_family; }
extern "C" __attribute__((visibility("default"), weak)) const char* kvcpu_last_error() {
  return ::kvcpu::st().last_message.c_str();
}
extern "C" __attribute__((visibility("default"), weak)) void kvcpu_clear_error() {
  ::kvcpu::st().last_error = hipSuccess;
  ::kvcpu::st().last_message.clear();
}
