// The FMA peak of one core: 12 independent 8-lane FMA chains (vfmadd231ps ymm), best of 400 short runs.
// Prints "<G 8-lane FMAs per second> ...". Compiled and run by benchmarks/cpu_compute.py.
#include <stdio.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
int main(void){
  long n=250000; double best=1e9;
  for(int rep=0;rep<400;rep++){
    double t0=now();
    __asm__ volatile(
      "vxorps %%ymm0,%%ymm0,%%ymm0\n vxorps %%ymm1,%%ymm1,%%ymm1\n vxorps %%ymm2,%%ymm2,%%ymm2\n vxorps %%ymm3,%%ymm3,%%ymm3\n"
      "vxorps %%ymm4,%%ymm4,%%ymm4\n vxorps %%ymm5,%%ymm5,%%ymm5\n vxorps %%ymm6,%%ymm6,%%ymm6\n vxorps %%ymm7,%%ymm7,%%ymm7\n"
      "vxorps %%ymm8,%%ymm8,%%ymm8\n vxorps %%ymm9,%%ymm9,%%ymm9\n vxorps %%ymm10,%%ymm10,%%ymm10\n vxorps %%ymm11,%%ymm11,%%ymm11\n"
      "mov %0, %%rcx\n1:\n"
      "vfmadd231ps %%ymm14,%%ymm15,%%ymm0\n vfmadd231ps %%ymm14,%%ymm15,%%ymm1\n vfmadd231ps %%ymm14,%%ymm15,%%ymm2\n vfmadd231ps %%ymm14,%%ymm15,%%ymm3\n"
      "vfmadd231ps %%ymm14,%%ymm15,%%ymm4\n vfmadd231ps %%ymm14,%%ymm15,%%ymm5\n vfmadd231ps %%ymm14,%%ymm15,%%ymm6\n vfmadd231ps %%ymm14,%%ymm15,%%ymm7\n"
      "vfmadd231ps %%ymm14,%%ymm15,%%ymm8\n vfmadd231ps %%ymm14,%%ymm15,%%ymm9\n vfmadd231ps %%ymm14,%%ymm15,%%ymm10\n vfmadd231ps %%ymm14,%%ymm15,%%ymm11\n"
      "dec %%rcx\n jnz 1b\n"
      : : "r"(n) : "rcx","xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9","xmm10","xmm11","cc");
    double t=now()-t0; if(t<best)best=t;
  }
  printf("%.3f G vector-FMA/s per core (%.2f GHz at 2 FMA/cycle)\n", n*12/best/1e9, n*12/best/2e9);
}
