// Probe: does a joint_matrix (sycl_ext_oneapi_matrix, XMX on Intel GPUs) kernel compiled by the
// runtime's kernel_compiler execute on this device? C[8x16] = A[8x16] * B[16x16] in fp16 -> fp32 by
// one sub-group of 16. tests/test_sycl_backend.py::test_joint_matrix_probe builds and (where the
// kernel exists in the bundle) runs it; sycl/README.md records what the CI device says.
#include <sycl/sycl.hpp>

namespace syclext = sycl::ext::oneapi;
namespace syclexp = sycl::ext::oneapi::experimental;
namespace jm = sycl::ext::oneapi::experimental::matrix;

extern "C" SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<1>))
SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::sub_group_size<16>))
void kvm_joint_matrix_probe(sycl::half *a, sycl::half *b, float *c) {
  auto sg = syclext::this_work_item::get_nd_item<1>().get_sub_group();
  auto global = [](auto *p) {
    return sycl::address_space_cast<sycl::access::address_space::global_space, sycl::access::decorated::no>(p);
  };
  jm::joint_matrix<sycl::sub_group, sycl::half, jm::use::a, 8, 16, jm::layout::row_major> ma;
  jm::joint_matrix<sycl::sub_group, sycl::half, jm::use::b, 16, 16, jm::layout::row_major> mb;
  jm::joint_matrix<sycl::sub_group, float, jm::use::accumulator, 8, 16> mc;
  jm::joint_matrix_fill(sg, mc, 0.f);
  jm::joint_matrix_load(sg, ma, global(a), 16);
  jm::joint_matrix_load(sg, mb, global(b), 16);
  jm::joint_matrix_mad(sg, mc, ma, mb, mc);
  jm::joint_matrix_store(sg, mc, global(c), 16, jm::layout::row_major);
}
