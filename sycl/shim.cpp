// kvmulti SYCL host shim: a small C ABI (called from Python through ctypes) over the SYCL runtime.
//
// Built with plain g++ against the runtime from PyPI (intel-sycl-rt), no SYCL compiler needed:
//   g++ -O2 -shared -fPIC -std=c++17 -DSYCL_DISABLE_FSYCL_SYCLHPP_WARNING -I<env>/include shim.cpp \
//       -L<env>/lib -lsycl -Wl,-rpath,<env>/lib -o libkvmulti_sycl_shim.so
// The device code (sycl/kernels.cpp) is compiled at run time by the oneAPI kernel_compiler
// extension (create_kernel_bundle_from_source + build, i.e. libsycl-jit) for whatever device the
// queue is on: an Intel GPU through Level Zero in production, Intel's OpenCL CPU device in CI.
//
// Every function returns 0 / a non-null handle on success. On failure it returns -1 / null and
// kvm_last_error() holds the message (for a kernel build failure: the exception text followed by
// the compiler's log).

#include <sycl/sycl.hpp>

#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace syclex = sycl::ext::oneapi::experimental;

namespace {

thread_local std::string g_error;

struct Session {
  sycl::queue queue;
  bool owns_queue;  // false: the queue belongs to someone else (torch's XPU stream)
};

struct Bundle {
  sycl::kernel_bundle<sycl::bundle_state::executable> bundle;
  std::vector<std::string> names;
  std::vector<sycl::kernel> kernels;
};

int fail(const std::string &msg) {
  g_error = msg;
  return -1;
}

template <typename F>
int guarded(F &&f) {
  try {
    f();
    return 0;
  } catch (const sycl::exception &e) {
    return fail(std::string("SYCL exception: ") + e.what());
  } catch (const std::exception &e) {
    return fail(e.what());
  } catch (...) {
    return fail("unknown C++ exception");
  }
}

const char *backend_name(sycl::backend b) {
  switch (b) {
    case sycl::backend::opencl: return "opencl";
    case sycl::backend::ext_oneapi_level_zero: return "level_zero";
    case sycl::backend::ext_oneapi_cuda: return "cuda";
    case sycl::backend::ext_oneapi_hip: return "hip";
    default: return "other";
  }
}

const char *type_name(const sycl::device &d) {
  if (d.is_gpu()) return "gpu";
  if (d.is_cpu()) return "cpu";
  if (d.is_accelerator()) return "accelerator";
  return "other";
}

bool can_compile_sycl(sycl::device d) {  // by value: ext_oneapi_can_compile is non-const
  try {
    return d.ext_oneapi_can_compile(syclex::source_language::sycl);
  } catch (...) {
    return false;
  }
}

// The device runs cl_intel_subgroup_matrix_multiply_accumulate at sub-group size 16 (its smallest
// sub-group size is 16, e.g. PVC). DG2 has the matrix unit at sub-group size 8 only: not counted.
bool has_matrix_sg16(const sycl::device &d) {
  try {
    if (!d.is_gpu() || !d.has(sycl::aspect::ext_intel_matrix)) return false;
    const auto sizes = d.get_info<sycl::info::device::sub_group_sizes>();
    size_t smallest = 0;
    for (size_t s : sizes) smallest = smallest == 0 || s < smallest ? s : smallest;
    return smallest == 16;
  } catch (...) {
    return false;
  }
}

std::string describe(const sycl::device &d) {
  std::ostringstream os;
  os << backend_name(d.get_backend()) << '\t' << type_name(d) << '\t'
     << d.get_info<sycl::info::device::name>() << '\t' << d.get_info<sycl::info::device::driver_version>() << '\t'
     << d.get_info<sycl::info::device::max_compute_units>() << '\t'
     << d.get_info<sycl::info::device::max_work_group_size>() << '\t'
     << d.get_info<sycl::info::device::local_mem_size>() << '\t' << (can_compile_sycl(d) ? 1 : 0) << '\t'
     << (d.has(sycl::aspect::fp16) ? 1 : 0) << '\t' << (d.has(sycl::aspect::usm_shared_allocations) ? 1 : 0) << '\t'
     << (d.has(sycl::aspect::usm_system_allocations) ? 1 : 0) << '\t' << (has_matrix_sg16(d) ? 1 : 0);
  return os.str();
}

int copy_out(const std::string &s, char *buf, size_t n) {
  if (n == 0) return static_cast<int>(s.size());
  size_t m = s.size() < n - 1 ? s.size() : n - 1;
  std::memcpy(buf, s.data(), m);
  buf[m] = '\0';
  return static_cast<int>(s.size());
}

}  // namespace

extern "C" {

const char *kvm_last_error() { return g_error.c_str(); }

// One line per SYCL device: backend, type, name, driver, compute units, max work-group size,
// local memory bytes, can compile SYCL source (0/1), fp16 (0/1), USM shared (0/1), system allocations
// usable by kernels (0/1: plain malloc'd host memory, e.g. torch CPU tensors), the sub-group-16 matrix
// built-ins (0/1, has_matrix_sg16); tab separated.
// Returns the full length (call again with a larger buffer if it did not fit), -1 on error.
int kvm_list_devices(char *buf, size_t n) {
  std::string out;
  int rc = guarded([&] {
    for (const auto &p : sycl::platform::get_platforms())
      for (const auto &d : p.get_devices()) out += describe(d) + "\n";
  });
  if (rc) return rc;
  return copy_out(out, buf, n);
}

// A session on a new in-order queue. device_index < 0: the first device that can compile SYCL
// source, GPUs first; otherwise the device_index-th line of kvm_list_devices.
void *kvm_session_create(int device_index) {
  Session *s = nullptr;
  guarded([&] {
    std::vector<sycl::device> all;
    for (const auto &p : sycl::platform::get_platforms())
      for (const auto &d : p.get_devices()) all.push_back(d);
    const sycl::device *chosen = nullptr;
    if (device_index >= 0) {
      if (static_cast<size_t>(device_index) >= all.size())
        throw std::runtime_error("SYCL device index " + std::to_string(device_index) + " out of range (" +
                                 std::to_string(all.size()) + " devices)");
      chosen = &all[device_index];
    } else {
      for (int want_gpu = 1; want_gpu >= 0 && !chosen; --want_gpu)
        for (const auto &d : all)
          if (d.is_gpu() == bool(want_gpu) && can_compile_sycl(d) && d.has(sycl::aspect::usm_shared_allocations)) {
            chosen = &d;
            break;
          }
      if (!chosen) throw std::runtime_error("no SYCL device that can compile SYCL source and allocate USM");
    }
    s = new Session{sycl::queue(*chosen, sycl::property::queue::in_order()), true};
  });
  return s;
}

// A session on an existing sycl::queue (e.g. torch.xpu.current_stream().sycl_queue). The queue
// must outlive the session.
void *kvm_session_from_queue(void *queue) {
  Session *s = nullptr;
  guarded([&] {
    if (!queue) throw std::runtime_error("null sycl::queue pointer");
    s = new Session{*static_cast<sycl::queue *>(queue), false};
  });
  return s;
}

void kvm_session_destroy(void *sess) { delete static_cast<Session *>(sess); }

// Identity of the session's (context, device): kernel bundles built for one session serve every
// session with the same key (e.g. several torch XPU streams of one device). 0 on error.
uint64_t kvm_session_key(void *sess) {
  uint64_t key = 0;
  guarded([&] {
    auto &q = static_cast<Session *>(sess)->queue;
    key = static_cast<uint64_t>(std::hash<sycl::context>{}(q.get_context())) * 1000003u ^
          static_cast<uint64_t>(std::hash<sycl::device>{}(q.get_device()));
  });
  return key;
}

int kvm_session_describe(void *sess, char *buf, size_t n) {
  std::string out;
  int rc = guarded([&] { out = describe(static_cast<Session *>(sess)->queue.get_device()); });
  if (rc) return rc;
  return copy_out(out, buf, n);
}

// Compile SYCL source for the session's device. opts: build options ("-DNAME=value", ...);
// names: the extern "C" kernel names to look up. Returns a bundle handle.
void *kvm_build(void *sess, const char *source, const char **opts, int nopts, const char **names, int nnames) {
  Bundle *out = nullptr;
  guarded([&] {
    auto &q = static_cast<Session *>(sess)->queue;
    if (!can_compile_sycl(q.get_device()))
      throw std::runtime_error("device '" + q.get_device().get_info<sycl::info::device::name>() +
                               "' cannot compile SYCL source (kernel_compiler / libsycl-jit unavailable)");
    std::vector<std::string> options(opts, opts + nopts);
    auto src = syclex::create_kernel_bundle_from_source(q.get_context(), syclex::source_language::sycl,
                                                        std::string(source));
    std::string log;
    sycl::kernel_bundle<sycl::bundle_state::executable> exe = [&] {
      try {
        return syclex::build(src, syclex::properties{syclex::build_options{options}, syclex::save_log{&log}});
      } catch (const sycl::exception &e) {
        throw std::runtime_error(std::string("SYCL kernel build failed: ") + e.what() + "\n--- build log ---\n" +
                                 log);
      }
    }();
    auto b = std::make_unique<Bundle>(Bundle{exe, {}, {}});
    for (int i = 0; i < nnames; ++i) {
      std::string name(names[i]);
      if (!exe.ext_oneapi_has_kernel(name)) throw std::runtime_error("kernel '" + name + "' not found in the bundle");
      b->names.push_back(name);
      b->kernels.push_back(exe.ext_oneapi_get_kernel(name));
    }
    out = b.release();
  });
  return out;
}

void kvm_bundle_destroy(void *bundle) { delete static_cast<Bundle *>(bundle); }

// Kernel argument kinds for kvm_launch.
enum ArgKind : int32_t { ARG_PTR = 0, ARG_I32 = 1, ARG_I64 = 2, ARG_F32 = 3, ARG_LOCAL_F32 = 4, ARG_LOCAL_I32 = 5, ARG_LOCAL_I64 = 6 };

// Launch kernel `index` of `bundle` over nd_range<1>(global, local). Argument i has kind kinds[i]
// and value values[i] (pointer value, integer, float bits; element count for a local accessor).
// wait != 0: block until the kernel finished.
int kvm_launch(void *sess, void *bundle, int index, size_t global, size_t local, int nargs, const int32_t *kinds,
               const int64_t *values, int wait) {
  return guarded([&] {
    auto &q = static_cast<Session *>(sess)->queue;
    auto *b = static_cast<Bundle *>(bundle);
    if (index < 0 || static_cast<size_t>(index) >= b->kernels.size()) throw std::runtime_error("bad kernel index");
    const sycl::kernel &k = b->kernels[index];
    sycl::event ev = q.submit([&](sycl::handler &h) {
      for (int i = 0; i < nargs; ++i) {
        int64_t v = values[i];
        switch (kinds[i]) {
          case ARG_PTR: h.set_arg(i, reinterpret_cast<void *>(static_cast<intptr_t>(v))); break;
          case ARG_I32: h.set_arg(i, static_cast<int32_t>(v)); break;
          case ARG_I64: h.set_arg(i, static_cast<int64_t>(v)); break;
          case ARG_F32: {
            float f;
            uint32_t bits = static_cast<uint32_t>(v);
            std::memcpy(&f, &bits, sizeof f);
            h.set_arg(i, f);
            break;
          }
          case ARG_LOCAL_F32: h.set_arg(i, sycl::local_accessor<float, 1>(sycl::range<1>(v), h)); break;
          case ARG_LOCAL_I32: h.set_arg(i, sycl::local_accessor<int32_t, 1>(sycl::range<1>(v), h)); break;
          case ARG_LOCAL_I64: h.set_arg(i, sycl::local_accessor<int64_t, 1>(sycl::range<1>(v), h)); break;
          default: throw std::runtime_error("bad kernel argument kind " + std::to_string(kinds[i]));
        }
      }
      h.parallel_for(sycl::nd_range<1>(sycl::range<1>(global), sycl::range<1>(local)), k);
    });
    if (wait) ev.wait_and_throw();
  });
}

int kvm_wait(void *sess) {
  return guarded([&] { static_cast<Session *>(sess)->queue.wait_and_throw(); });
}

// kind: 0 shared, 1 device, 2 host.
void *kvm_malloc(void *sess, size_t bytes, int kind) {
  void *p = nullptr;
  guarded([&] {
    auto &q = static_cast<Session *>(sess)->queue;
    size_t n = bytes ? bytes : 1;
    p = kind == 1 ? sycl::malloc_device(n, q) : kind == 2 ? sycl::malloc_host(n, q) : sycl::malloc_shared(n, q);
    if (!p) throw std::runtime_error("USM allocation of " + std::to_string(bytes) + " bytes failed");
  });
  return p;
}

int kvm_free(void *sess, void *ptr) {
  return guarded([&] { sycl::free(ptr, static_cast<Session *>(sess)->queue); });
}

// 0 unknown (not USM of this context), 1 host, 2 device, 3 shared; -1 on error.
int kvm_pointer_type(void *sess, const void *ptr) {
  int t = -1;
  int rc = guarded([&] {
    switch (sycl::get_pointer_type(ptr, static_cast<Session *>(sess)->queue.get_context())) {
      case sycl::usm::alloc::host: t = 1; break;
      case sycl::usm::alloc::device: t = 2; break;
      case sycl::usm::alloc::shared: t = 3; break;
      default: t = 0;
    }
  });
  return rc ? rc : t;
}

int kvm_memcpy(void *sess, void *dst, const void *src, size_t bytes) {
  return guarded([&] { static_cast<Session *>(sess)->queue.memcpy(dst, src, bytes).wait_and_throw(); });
}

}  // extern "C"
