"""The sub-group matrix built-in of kernels.cpp (``mma``: intel_sub_group_{bf16_bf16,f16_f16}_matrix_mad_k16,
M = 8, N = K = 16, sub-group 16) against the fragment layout of the cl_intel_subgroup_matrix_multiply_accumulate
specification, element by element. On a device without the built-ins (the OpenCL CPU device) this runs the
emulation (KVM_MMA=1); on a device with them (matrix_sg16) the built-in itself (KVM_MMA=2)."""

from __future__ import annotations

import pytest
import torch

S = pytest.importorskip("kvmulti.backends.sycl")
if S.runtime_reasons():
    pytest.skip("; ".join(S.runtime_reasons()), allow_module_level=True)

M, N, K, SG = 8, 16, 16, 16

# The specification's layout, sub-group size 16, 16-bit float sources, fp32 accumulator:
#   matrix element -> (lane, component, bit offset inside the component)
# "a": M components of 16 bits; each work item contributes 16 bits per row: lane k holds A[m][k] in component m.
# "b": int8; each work item contributes one column; K = 16 values of 16 bits packed two per 32-bit
#      component, the lower row in the low half (the coding sample's as_char4(b.s0) order): lane n holds
#      B[k][n] in component k // 2 at bit 16 * (k % 2).
# "acc" and the result: one column per work item: lane n holds C[m][n] in component m.
def a_place(m: int, k: int) -> tuple[int, int, int]:
    return k, m, 0


def b_place(k: int, n: int) -> tuple[int, int, int]:
    return n, k // 2, 16 * (k % 2)


def c_place(m: int, n: int) -> tuple[int, int]:
    return n, m


def _bits16(x: torch.Tensor, bf16: bool) -> torch.Tensor:
    return (x.to(torch.bfloat16 if bf16 else torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF)


def pack(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bf16: bool):
    """Fragments [cases, lane, component] of matrices a [cases, M, K], b [cases, K, N], c [cases, M, N]."""
    cases = a.shape[0]
    fa = torch.zeros(cases, SG, 8, dtype=torch.int64)
    fb = torch.zeros(cases, SG, 8, dtype=torch.int64)
    fc = torch.zeros(cases, SG, 8, dtype=torch.float32)
    abits, bbits = _bits16(a, bf16), _bits16(b, bf16)
    for m in range(M):
        for k in range(K):
            lane, comp, shift = a_place(m, k)
            fa[:, lane, comp] |= abits[:, m, k] << shift
    for k in range(K):
        for n in range(N):
            lane, comp, shift = b_place(k, n)
            fb[:, lane, comp] |= bbits[:, k, n] << shift
    for m in range(M):
        for n in range(N):
            lane, comp = c_place(m, n)
            fc[:, lane, comp] = c[:, m, n]
    fa = torch.where(fa >= 1 << 15, fa - (1 << 16), fa).to(torch.int16)
    fb = torch.where(fb >= 1 << 31, fb - (1 << 32), fb).to(torch.int32)
    return fa, fb, fc


def unpack(fd: torch.Tensor) -> torch.Tensor:
    d = torch.empty(fd.shape[0], M, N)
    for m in range(M):
        for n in range(N):
            lane, comp = c_place(m, n)
            d[:, m, n] = fd[:, lane, comp]
    return d


@pytest.fixture(scope="module")
def probe():
    session = S.default_session()
    mode = 2 if session.device.matrix_sg16 else 1
    opts = ["-DKVM_DTYPE=2", "-DKVM_HEAD_SIZE=16", f"-DKVM_MMA={mode}", "-DKVM_MMA_PROBE=1"]
    return session, session.build(S.kernel_source(), opts, names=("kvm_mma_probe",))


def run(probe, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bf16: bool) -> torch.Tensor:
    session, handle = probe
    fa, fb, fc = pack(a, b, c, bf16)
    cases = a.shape[0]
    ua, ub = S.usm_empty(fa.numel(), torch.int16), S.usm_empty(fb.numel(), torch.int32)
    uc, ud = S.usm_empty(fc.numel(), torch.float32), S.usm_empty(fc.numel(), torch.float32)
    ua.copy_(fa.flatten())
    ub.copy_(fb.flatten())
    uc.copy_(fc.flatten())
    ud.fill_(float("nan"))
    P, I32 = S.runtime.ARG_PTR, S.runtime.ARG_I32
    session.launch(handle, 0, cases * SG, SG, [(P, ua.data_ptr()), (P, ub.data_ptr()), (P, uc.data_ptr()),
                                               (P, ud.data_ptr()), (I32, int(bf16))], wait=True)
    return unpack(ud.view(cases, SG, 8).clone())


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp16"])
def test_every_a_element_meets_its_b_row(probe, bf16):
    """A one-hot at (m, k) times B with distinct exact integers: D is row k of B in row m, zero elsewhere,
    for all 128 positions (so every element of A and of B sits where the specification says)."""
    a = torch.zeros(M * K, M, K)
    for m in range(M):
        for k in range(K):
            a[m * K + k, m, k] = 1.0
    b = (torch.arange(K * N, dtype=torch.float32).view(1, K, N) + 1).expand(M * K, K, N).contiguous()
    d = run(probe, a, b, torch.zeros(M * K, M, N), bf16)
    for m in range(M):
        for k in range(K):
            want = torch.zeros(M, N)
            want[m] = b[0, k]
            assert torch.equal(d[m * K + k], want), (m, k, d[m * K + k])


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp16"])
def test_accumulator_layout_and_a_random_product(probe, bf16):
    """C alone comes back where it went in (every element distinct); random A, B, C give A B + C."""
    torch.manual_seed(0)
    c = torch.arange(M * N, dtype=torch.float32).view(1, M, N) - 50.0
    d = run(probe, torch.zeros(1, M, K), torch.zeros(1, K, N), c, bf16)
    assert torch.equal(d, c)
    dt = torch.bfloat16 if bf16 else torch.float16
    a, b, c = torch.randn(4, M, K).to(dt).float(), torch.randn(4, K, N).to(dt).float(), torch.randn(4, M, N)
    torch.testing.assert_close(run(probe, a, b, c, bf16), a @ b + c, atol=1e-4, rtol=1e-4)
