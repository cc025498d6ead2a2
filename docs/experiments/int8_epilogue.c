// The int8 residual 1x1 convolution of ResNet-50 (64 -> 256 channels at 56x56, uint8 source in
// nChw16c, weights OIhw4i16o4i, a QDQ sum with a uint8 addend, uint8 destination) as blockpad's
// dot-product rule tiles it (7 rows x 2 column vectors of 16 int32 lanes), in four variants:
//   K: the dot products alone (accumulators stored, no epilogue): the vpdpbusd peak
//   A: each tile, then its epilogue (what blockpad generates)
//   S: the previous tile's epilogue after this tile's dot products (pipelined, in sequence)
//   B: the previous tile's epilogue interleaved, one output vector per dot-product step
// S and B must write what A writes ("same 1"). docs/performance.md, "Layer by layer against
// ONNX Runtime, weights a panel ahead, what holds the int8 1x1s", has the figures.
// Build and run on an AVX-512 VNNI machine:
//   gcc -O3 -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mtune=znver3 int8_epilogue.c -o e && ./e 400
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <time.h>
#define P 3136
#define CB 4      // input channel blocks (64)
#define OB 16     // output blocks (256)
#define R 7
static uint8_t *src, *add, *dstA, *dstB, *dstS; static int8_t *w; static float *scale; static int32_t *bias;
static float zlo, zhi, M, Mz, r0, r1, fx, lo2, hi2;
static inline __m512i dp(__m512i a, __m512i b, __m512i c) { return _mm512_dpbusd_epi32(a, b, c); }
// the epilogue of one output vector, as blockpad's kernel computes it: bias, scale, clamp and
// round to the conv's own uint8 (+ its zero point), the QDQ sum with the addend, round, saturate
#define EPI(acc, o, px, dst) do { \
  __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(acc, bv[o])), sv[o]); \
  v = _mm512_min_ps(_mm512_max_ps(v, vlo), vhi); \
  v = _mm512_add_ps(_mm512_add_ps(v, vM), vMz); \
  __m512 b_ = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(add + ((size_t)(pb*2+o)*P + (px))*16)))); \
  __m512 q_ = _mm512_fmadd_ps(b_, vr1, vfx); q_ = _mm512_fmadd_ps(v, vr0, q_); \
  q_ = _mm512_add_ps(_mm512_min_ps(_mm512_max_ps(q_, vlo2), vhi2), vM); \
  _mm_storeu_si128((__m128i*)(dst + ((size_t)(pb*2+o)*P + (px))*16), _mm512_cvtepi32_epi8(_mm512_castps_si512(q_))); \
} while (0)
// a panel of 2 output blocks: their scales, biases and weights
#define PANEL \
  __m512 sv[2]; __m512i bv[2]; \
  for (int o = 0; o < 2; o++) { sv[o] = _mm512_loadu_ps(scale + (pb*2+o)*16); bv[o] = _mm512_loadu_si512(bias + (pb*2+o)*16); } \
  const int8_t *w0 = w + (size_t)(pb*2)*1024, *w1 = w0 + 1024;
#define CONSTS \
  const __m512 vlo = _mm512_set1_ps(zlo), vhi = _mm512_set1_ps(zhi), vM = _mm512_set1_ps(M), vMz = _mm512_set1_ps(Mz); \
  const __m512 vr0 = _mm512_set1_ps(r0), vr1 = _mm512_set1_ps(r1), vfx = _mm512_set1_ps(fx), vlo2 = _mm512_set1_ps(lo2), vhi2 = _mm512_set1_ps(hi2);
__attribute__((noinline)) void runA(void) {
  CONSTS
  for (int pb = 0; pb < OB / 2; pb++) {
    PANEL
    for (int t = 0; t < P / R; t++) {
      __m512i a[R][2];
      for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm512_setzero_si512();
      _Pragma("GCC unroll 16") for (int ks = 0; ks < 16; ks++) {
        __m512i x0 = _mm512_loadu_si512(w0 + ks*64), x1 = _mm512_loadu_si512(w1 + ks*64);
        const uint8_t *s = src + ((size_t)(ks>>2)*P + t*R)*16 + (ks&3)*4;
        for (int r = 0; r < R; r++) { __m512i b = _mm512_set1_epi32(*(const int32_t*)(s + r*16)); a[r][0] = dp(a[r][0], b, x0); a[r][1] = dp(a[r][1], b, x1); }
      }
      for (int r = 0; r < R; r++) for (int o = 0; o < 2; o++) EPI(a[r][o], o, t*R + r, dstA);
    }
  }
}

#define KLOOP_STEP(ks) { __m512i x0 = _mm512_loadu_si512(w0 + (ks)*64), x1 = _mm512_loadu_si512(w1 + (ks)*64); \
  const uint8_t *s = src + ((size_t)((ks)>>2)*P + t*R)*16 + ((ks)&3)*4; \
  _Pragma("GCC unroll 7") for (int r = 0; r < R; r++) { __m512i b = _mm512_set1_epi32(*(const int32_t*)(s + r*16)); a[r][0] = dp(a[r][0], b, x0); a[r][1] = dp(a[r][1], b, x1); } }
__attribute__((noinline)) void runB(void) {
  CONSTS
  __attribute__((aligned(64))) int32_t scr[R*2][16];
  for (int pb = 0; pb < OB / 2; pb++) {
    PANEL
    for (int t = 0; t < P / R; t++) {
      __m512i a[R][2];
      _Pragma("GCC unroll 7") for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm512_setzero_si512();
      if (t == 0) {
        _Pragma("GCC unroll 16") for (int ks = 0; ks < 16; ks++) KLOOP_STEP(ks)
      } else {
        _Pragma("GCC unroll 16") for (int ks = 0; ks < 16; ks++) {
          KLOOP_STEP(ks)
          if (ks < R*2) { __m512i acc = _mm512_load_si512(scr[ks]); EPI(acc, (ks&1), (t-1)*R + (ks>>1), dstB); }
        }
      }
      _Pragma("GCC unroll 7") for (int r = 0; r < R; r++) { _mm512_store_si512(scr[r*2], a[r][0]); _mm512_store_si512(scr[r*2+1], a[r][1]); }
    }
    { int t = P / R; _Pragma("GCC unroll 14") for (int ks = 0; ks < R*2; ks++) { __m512i acc = _mm512_load_si512(scr[ks]); EPI(acc, (ks&1), (t-1)*R + (ks>>1), dstB); } }
  }
}

__attribute__((noinline)) void runK(void) {
  __attribute__((aligned(64))) static int32_t scr[R*2][16];
  for (int pb = 0; pb < OB / 2; pb++) {
    const int8_t *w0 = w + (size_t)(pb*2)*1024, *w1 = w0 + 1024;
    for (int t = 0; t < P / R; t++) {
      __m512i a[R][2];
      _Pragma("GCC unroll 7") for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm512_setzero_si512();
      _Pragma("GCC unroll 16") for (int ks = 0; ks < 16; ks++) KLOOP_STEP(ks)
      _Pragma("GCC unroll 7") for (int r = 0; r < R; r++) { _mm512_store_si512(scr[r*2], a[r][0]); _mm512_store_si512(scr[r*2+1], a[r][1]); }
    }
  }
}

__attribute__((noinline)) void runS(void) {
  CONSTS
  __attribute__((aligned(64))) int32_t scr[R*2][16];
  for (int pb = 0; pb < OB / 2; pb++) {
    PANEL
    for (int t = 0; t <= P / R; t++) {
      __m512i a[R][2];
      _Pragma("GCC unroll 7") for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm512_setzero_si512();
      if (t < P / R) { _Pragma("GCC unroll 16") for (int ks = 0; ks < 16; ks++) KLOOP_STEP(ks) }
      if (t > 0) { _Pragma("GCC unroll 14") for (int ks = 0; ks < R*2; ks++) { __m512i acc = _mm512_load_si512(scr[ks]); EPI(acc, (ks&1), (t-1)*R + (ks>>1), dstS); } }
      _Pragma("GCC unroll 7") for (int r = 0; r < R; r++) { _mm512_store_si512(scr[r*2], a[r][0]); _mm512_store_si512(scr[r*2+1], a[r][1]); }
    }
  }
}
static double now(void) { struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec + ts.tv_nsec * 1e-9; }
static int cmpd(const void *a, const void *b) { double x = *(double*)a, y = *(double*)b; return x < y ? -1 : x > y; }
int main(int argc, char **argv) {
  src = aligned_alloc(64, CB*P*16); add = aligned_alloc(64, OB*P*16); dstA = aligned_alloc(64, OB*P*16); dstB = aligned_alloc(64, OB*P*16); dstS = aligned_alloc(64, OB*P*16);
  w = aligned_alloc(64, OB*1024); scale = aligned_alloc(64, 1024); bias = aligned_alloc(64, 1024);
  srand(1);
  for (int i = 0; i < CB*P*16; i++) src[i] = rand() & 255;
  for (int i = 0; i < OB*P*16; i++) add[i] = rand() & 255;
  for (int i = 0; i < OB*1024; i++) w[i] = (rand() & 127) - 64;
  for (int i = 0; i < 256; i++) { scale[i] = 1e-4f * (1 + (rand() & 15)); bias[i] = (rand() & 1023) - 512; }
  zlo = -99; zhi = 156; M = 12582912.0f; Mz = -12582912.0f + 99; r0 = 0.7f; r1 = 0.4f; fx = -30.f; lo2 = 0; hi2 = 255;
  int n = argc > 1 ? atoi(argv[1]) : 400; double ta[4000], tb[4000];
  for (int i = 0; i < 20; i++) { runA(); runB(); }
  for (int i = 0; i < n; i++) { double t0 = now(); runA(); ta[i] = now() - t0; t0 = now(); runB(); tb[i] = now() - t0; }
  qsort(ta, n, sizeof(double), cmpd); qsort(tb, n, sizeof(double), cmpd);
  double ts_[4000]; for (int i = 0; i < n; i++) { double t0 = now(); runS(); ts_[i] = now() - t0; } qsort(ts_, n, sizeof(double), cmpd); printf("S %.4f ms same %d  ", ts_[n/2]*1e3, memcmp(dstA, dstS, OB*P*16) == 0);
  double tk[4000]; for (int i = 0; i < n; i++) { double t0 = now(); runK(); tk[i] = now() - t0; } qsort(tk, n, sizeof(double), cmpd); printf("K %.4f ms  ", tk[n/2]*1e3);
  printf("A %.4f ms  B %.4f ms  B/A %.3f  same %d\n", ta[n/2]*1e3, tb[n/2]*1e3, tb[n/2]/ta[n/2], memcmp(dstA, dstB, OB*P*16) == 0);
  return 0;
}
