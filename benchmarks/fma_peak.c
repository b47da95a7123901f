// Arithmetic peaks of one core, best of 400 short runs of 12 independent chains.
//   fma_peak          vfmadd231ps ymm: prints "<G 8-lane FMAs per second> ..." (benchmarks/cpu_compute.py)
//   fma_peak fma512   vfmadd231ps zmm (AVX-512F): prints "<G 16-lane FMAs per second> ..." (the fp32 tiles
//                     of the kernel's AVX-512 variants; on cores with 256-bit FMA units about half as many
//                     as the ymm count, on full-width ones about as many)
//   fma_peak bf16dot  vdpbf16ps zmm (AVX-512 BF16): prints "<G vdpbf16ps per second> ..."; each is 32 bf16
//                     products summed in pairs into 16 fp32 lanes, 64 FLOP (benchmarks/attention.py)
// Compiled and run at benchmark time with cc -O2; the zmm modes exit 2 where the CPU lacks their extension.
#include <stdio.h>
#include <string.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
#define CHAIN12(op, r) \
  op " %%" r "14,%%" r "15,%%" r "0\n " op " %%" r "14,%%" r "15,%%" r "1\n " op " %%" r "14,%%" r "15,%%" r "2\n " \
  op " %%" r "14,%%" r "15,%%" r "3\n " op " %%" r "14,%%" r "15,%%" r "4\n " op " %%" r "14,%%" r "15,%%" r "5\n " \
  op " %%" r "14,%%" r "15,%%" r "6\n " op " %%" r "14,%%" r "15,%%" r "7\n " op " %%" r "14,%%" r "15,%%" r "8\n " \
  op " %%" r "14,%%" r "15,%%" r "9\n " op " %%" r "14,%%" r "15,%%" r "10\n " op " %%" r "14,%%" r "15,%%" r "11\n "
#define ZERO12(r) \
  "vpxord %%" r "0,%%" r "0,%%" r "0\n vpxord %%" r "1,%%" r "1,%%" r "1\n vpxord %%" r "2,%%" r "2,%%" r "2\n " \
  "vpxord %%" r "3,%%" r "3,%%" r "3\n vpxord %%" r "4,%%" r "4,%%" r "4\n vpxord %%" r "5,%%" r "5,%%" r "5\n " \
  "vpxord %%" r "6,%%" r "6,%%" r "6\n vpxord %%" r "7,%%" r "7,%%" r "7\n vpxord %%" r "8,%%" r "8,%%" r "8\n " \
  "vpxord %%" r "9,%%" r "9,%%" r "9\n vpxord %%" r "10,%%" r "10,%%" r "10\n vpxord %%" r "11,%%" r "11,%%" r "11\n "
int main(int argc, char** argv){
  const int dot = argc > 1 && strcmp(argv[1], "bf16dot") == 0;
  const int wide = argc > 1 && strcmp(argv[1], "fma512") == 0;
  __builtin_cpu_init();
  if (dot && !__builtin_cpu_supports("avx512bf16")) { fprintf(stderr, "no avx512bf16\n"); return 2; }
  if (wide && !__builtin_cpu_supports("avx512f")) { fprintf(stderr, "no avx512f\n"); return 2; }
  long n=250000; double best=1e9;
  for(int rep=0;rep<400;rep++){
    double t0=now();
    if (dot)
      __asm__ volatile(ZERO12("zmm") "mov %0, %%rcx\n1:\n" CHAIN12("vdpbf16ps", "zmm") "dec %%rcx\n jnz 1b\n"
        : : "r"(n) : "rcx","xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9","xmm10","xmm11","cc");
    else if (wide)
      __asm__ volatile(ZERO12("zmm") "mov %0, %%rcx\n1:\n" CHAIN12("vfmadd231ps", "zmm") "dec %%rcx\n jnz 1b\n"
        : : "r"(n) : "rcx","xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9","xmm10","xmm11","cc");
    else
      __asm__ volatile(
        "vxorps %%ymm0,%%ymm0,%%ymm0\n vxorps %%ymm1,%%ymm1,%%ymm1\n vxorps %%ymm2,%%ymm2,%%ymm2\n vxorps %%ymm3,%%ymm3,%%ymm3\n"
        "vxorps %%ymm4,%%ymm4,%%ymm4\n vxorps %%ymm5,%%ymm5,%%ymm5\n vxorps %%ymm6,%%ymm6,%%ymm6\n vxorps %%ymm7,%%ymm7,%%ymm7\n"
        "vxorps %%ymm8,%%ymm8,%%ymm8\n vxorps %%ymm9,%%ymm9,%%ymm9\n vxorps %%ymm10,%%ymm10,%%ymm10\n vxorps %%ymm11,%%ymm11,%%ymm11\n"
        "mov %0, %%rcx\n1:\n" CHAIN12("vfmadd231ps", "ymm") "dec %%rcx\n jnz 1b\n"
        : : "r"(n) : "rcx","xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9","xmm10","xmm11","cc");
    double t=now()-t0; if(t<best)best=t;
  }
  if (dot) printf("%.3f G vdpbf16ps/s per core (%.1f GFLOP/s)\n", n*12/best/1e9, n*12/best*64/1e9);
  else if (wide) printf("%.3f G 16-lane FMA/s per core (%.1f GFLOP/s)\n", n*12/best/1e9, n*12/best*32/1e9);
  else printf("%.3f G vector-FMA/s per core (%.2f GHz at 2 FMA/cycle)\n", n*12/best/1e9, n*12/best/2e9);
}
