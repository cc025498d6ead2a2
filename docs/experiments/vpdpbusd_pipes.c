// Which of an int8 epilogue's instructions compete with vpdpbusd for the vector pipes: 14
// vpdpbusd on independent accumulators (one register tile's dot-product step), plus four
// independent instructions of one kind an iteration. An instruction that adds time shares
// vpdpbusd's pipes; one that adds none runs beside it. On Zen 4 (zen4, 2026-12-03, ns an
// iteration, two runs): none 3.96-3.98, vmaxps 3.95-3.96, vaddps 3.90-3.98, vmulps 5.07,
// vfmadd 5.11-5.38, vpmaxsd 4.02-4.17, vpaddd 3.90-4.01, vrndscaleps 3.84-4.00, vcvtdq2ps x 2
// 3.86-4.06: the multiplies and FMAs share vpdpbusd's pipes (four of them cost ~1.1 ns, the
// time of ~4 vpdpbusd), the rest run beside it. docs/performance.md ("An int8 epilogue beside
// the next tile's dot products, ...") draws the bound from it.
// Build and run on an AVX-512 VNNI machine:
//   gcc -O2 -mavx512f -mavx512bw -mavx512vl -mavx512vnni vpdpbusd_pipes.c -o p && ./p
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define ITERS 20000000
#define DP14(a, b, w) \
  a##0 = _mm512_dpbusd_epi32(a##0, b, w); a##1 = _mm512_dpbusd_epi32(a##1, b, w); a##2 = _mm512_dpbusd_epi32(a##2, b, w); \
  a##3 = _mm512_dpbusd_epi32(a##3, b, w); a##4 = _mm512_dpbusd_epi32(a##4, b, w); a##5 = _mm512_dpbusd_epi32(a##5, b, w); \
  a##6 = _mm512_dpbusd_epi32(a##6, b, w); a##7 = _mm512_dpbusd_epi32(a##7, b, w); a##8 = _mm512_dpbusd_epi32(a##8, b, w); \
  a##9 = _mm512_dpbusd_epi32(a##9, b, w); a##10 = _mm512_dpbusd_epi32(a##10, b, w); a##11 = _mm512_dpbusd_epi32(a##11, b, w); \
  a##12 = _mm512_dpbusd_epi32(a##12, b, w); a##13 = _mm512_dpbusd_epi32(a##13, b, w);
#define BENCH(NAME, OP) { \
  __m512i a0 = _mm512_set1_epi32(1), a1 = _mm512_set1_epi32(2), a2 = _mm512_set1_epi32(3), a3 = _mm512_set1_epi32(4), a4 = _mm512_set1_epi32(5), a5 = _mm512_set1_epi32(6), a6 = _mm512_set1_epi32(7), a7 = _mm512_set1_epi32(8), a8 = _mm512_set1_epi32(9), a9 = _mm512_set1_epi32(10), a10 = _mm512_set1_epi32(11), a11 = _mm512_set1_epi32(12), a12 = _mm512_set1_epi32(13), a13 = _mm512_set1_epi32(14); \
  __m512i b = _mm512_set1_epi32(3), w = _mm512_set1_epi32(5); \
  __m512 x0 = _mm512_set1_ps(1.0f), x1 = x0, x2 = x0, x3 = x0, c = _mm512_set1_ps(0.5f); \
  __m512i y0 = _mm512_set1_epi32(7), y1 = y0, y2 = y0, y3 = y0, ci = _mm512_set1_epi32(2); \
  double t0 = now(); \
  for (long i = 0; i < ITERS; i++) { DP14(a, b, w) OP(x0, y0) OP(x1, y1) OP(x2, y2) OP(x3, y3) \
    __asm__ volatile("" : "+v"(x0), "+v"(x1), "+v"(x2), "+v"(x3), "+v"(y0), "+v"(y1), "+v"(y2), "+v"(y3)); __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11), "+v"(a12), "+v"(a13)); } \
  double t = now() - t0; \
  __m512i s = _mm512_add_epi32(a0, _mm512_add_epi32(a13, _mm512_castps_si512(_mm512_add_ps(x0, x3)))); s = _mm512_add_epi32(s, y0); \
  printf("%-12s %.3f ns/iter  (%d)\n", NAME, t / ITERS * 1e9, _mm512_reduce_add_epi32(s)); }
#define NONE(x, y)
#define MAXPS(x, y) x = _mm512_max_ps(x, c);
#define ADDPS(x, y) x = _mm512_add_ps(x, c);
#define FMA(x, y) x = _mm512_fmadd_ps(x, c, c);
#define MULPS(x, y) x = _mm512_mul_ps(x, c);
#define CVT(x, y) x = _mm512_cvtepi32_ps(y); y = _mm512_castps_si512(x);
#define PMAXSD(x, y) y = _mm512_max_epi32(y, ci);
#define PADDD(x, y) y = _mm512_add_epi32(y, ci);
#define RNDSCALE(x, y) x = _mm512_roundscale_ps(x, 0);
#define CVTPS2DQ(x, y) y = _mm512_cvtps_epi32(x); x = _mm512_castsi512_ps(y);
int main(void) {
  for (int r = 0; r < 2; r++) {
    BENCH("none", NONE) BENCH("vmaxps", MAXPS) BENCH("vaddps", ADDPS) BENCH("vmulps", MULPS) BENCH("vfmadd", FMA)
    BENCH("vpmaxsd", PMAXSD) BENCH("vpaddd", PADDD) BENCH("vrndscaleps", RNDSCALE) BENCH("cvt pair", CVT)
  }
  return 0;
}
