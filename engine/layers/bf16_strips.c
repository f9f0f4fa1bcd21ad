/* bf16 weights on CPUs without AVX512-BF16 (AVX2 only: AMD Zen 2/3, Intel before Cooper Lake):
 * y[m, n] = x[m, k] W[n, k]^T (+ bias[n]), fp32 sums, each output rounded once to y's dtype.
 *
 * There oneDNN packs no bf16 weight and torch's bf16 matmul runs one GEMV per row: ~8x an fp32 matmul's time at 64
 * rows, ~10x for a prompt (docs/benchmarks.md, "bf16 on AVX2 CPUs"). Here the weight stays bf16 in memory, widened
 * to fp32 in registers (a bf16 is an fp32's upper half), and multiplied as an fp32 GEMM would: register tiles of MR
 * rows x 16 channels, KC inputs a pass so a strip's slice stays in L1 across the row tiles of a work item.
 *
 * Layout (engine/layers/linear.py `strips_packed`): strips of STRIP output channels, input by input,
 *
 *     w[s][i][c] = W[STRIP s + c][i]     (the last strip as wide as what is left: n - STRIP s channels)
 *
 * the same bytes as W, so packing costs no memory. x is fp32 (the caller widens a bf16 x once).
 *
 * Compiled on first use by engine/attention/native.py (cc -O3 -march=native -fopenmp); loaded with ctypes.
 */
#include "../attention/paged_simd.h"   /* bf16 <-> fp32 as torch rounds, the AVX2 flags (and the system headers) */

#define STRIP 16   /* output channels per strip: two 8-lane vectors */
#define MR 6       /* rows of x per register tile: 12 accumulators */
#define KC 256     /* inputs per pass: a strip's slice is 8 KB */
#define MC 48      /* rows of x per work item */

enum { OUT_F32, OUT_BF16 };

#ifdef PAGED_AVX2
/* R rows of x (rows ldx apart, kn inputs from x) against a full strip slice w [kn][16] -> c [R][16], added to c
 * unless `first`. R is a constant after inlining, so the accumulators stay in registers. */
INLINE void tile16(const int R, const float *x, int64_t ldx, const uint16_t *w, int64_t kn, float *c, int first) {
    __m256 a[MR][2];
    for (int r = 0; r < R; r++) {
        a[r][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * STRIP);
        a[r][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * STRIP + 8);
    }
    for (int64_t i = 0; i < kn; i++) {
        const __m128i *wi = (const __m128i *)(w + i * STRIP);
        __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(wi)), 16));
        __m256 w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(wi + 1)), 16));
        for (int r = 0; r < R; r++) {
            __m256 xb = _mm256_broadcast_ss(x + r * ldx + i);
            a[r][0] = _mm256_fmadd_ps(xb, w0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(xb, w1, a[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(c + r * STRIP, a[r][0]);
        _mm256_storeu_ps(c + r * STRIP + 8, a[r][1]);
    }
}

static void tile_full(int rows, const float *x, int64_t ldx, const uint16_t *w, int64_t kn, float *c, int first) {
    switch (rows) {
        case 1: tile16(1, x, ldx, w, kn, c, first); break;
        case 2: tile16(2, x, ldx, w, kn, c, first); break;
        case 3: tile16(3, x, ldx, w, kn, c, first); break;
        case 4: tile16(4, x, ldx, w, kn, c, first); break;
        case 5: tile16(5, x, ldx, w, kn, c, first); break;
        default: tile16(6, x, ldx, w, kn, c, first); break;
    }
}
#endif

/* Any strip width, plain C: the last strip, or every strip without AVX2. */
static void tile_portable(int rows, const float *x, int64_t ldx, const uint16_t *w, int64_t width, int64_t kn,
                          float *c, int first) {
    for (int r = 0; r < rows; r++)
        for (int64_t j = 0; j < width; j++) {
            float acc = first ? 0.0f : c[r * STRIP + j];
            for (int64_t i = 0; i < kn; i++) acc += x[r * ldx + i] * bf16_to_float(w[i * width + j]);
            c[r * STRIP + j] = acc;
        }
}

/* One work item: rows [m0, m1) of x against strip s, into y (+ bias). */
static void strip_item(const float *x, int64_t ldx, int64_t m0, int64_t m1, int64_t k, const uint16_t *w, int64_t n,
                       int64_t s, const void *bias, void *y, int out_kind, int portable) {
    int64_t width = n - s * STRIP < STRIP ? n - s * STRIP : STRIP;
    const uint16_t *ws = w + s * STRIP * k;
    float c[MC * STRIP];
    for (int64_t kc = 0; kc < k; kc += KC) {
        int64_t kn = k - kc < KC ? k - kc : KC;
        for (int64_t r0 = m0; r0 < m1; r0 += MR) {
            int rows = (int)(m1 - r0 < MR ? m1 - r0 : MR);
            float *cr = c + (r0 - m0) * STRIP;
#ifdef PAGED_AVX2
            if (!portable && width == STRIP) {
                tile_full(rows, x + r0 * ldx + kc, ldx, ws + kc * STRIP, kn, cr, kc == 0);
                continue;
            }
#endif
            tile_portable(rows, x + r0 * ldx + kc, ldx, ws + kc * width, width, kn, cr, kc == 0);
        }
    }
    for (int64_t r = m0; r < m1; r++)
        for (int64_t j = 0; j < width; j++) {
            int64_t col = s * STRIP + j;
            float b = !bias ? 0.0f : out_kind == OUT_BF16 ? bf16_to_float(((const uint16_t *)bias)[col])
                                                          : ((const float *)bias)[col];
            float v = c[(r - m0) * STRIP + j] + b;
            if (out_kind == OUT_BF16) ((uint16_t *)y)[r * n + s * STRIP + j] = float_to_bf16(v);
            else ((float *)y)[r * n + s * STRIP + j] = v;
        }
}

/* x: [m, k] fp32, rows ldx apart; w: W [n, k] bf16 in the strip layout above; bias: [n] or NULL and y: [m, n]
 * contiguous, both of `out_kind` (fp32 or bf16). `portable`: the plain C path everywhere (tests). Returns 0. */
int bf16_strips_gemm(const float *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                     const void *bias, void *y, int out_kind, int num_threads, int portable) {
    int64_t strips = (n + STRIP - 1) / STRIP, chunks = (m + MC - 1) / MC;
#ifndef PAGED_AVX2
    portable = 1;
#endif
    if (chunks == 1) {   /* decode rows: each thread streams a contiguous run of strips */
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t s = 0; s < strips; s++) strip_item(x, ldx, 0, m, k, w, n, s, bias, y, out_kind, portable);
        return 0;
    }
    /* Items in row-chunk-major order handed out one at a time: the threads work through one chunk of x's rows
     * together (it stays in their caches) and end together whatever the split of rows into chunks. */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t it = 0; it < chunks * strips; it++) {
        int64_t m0 = (it / strips) * MC, m1 = m0 + MC < m ? m0 + MC : m;
        strip_item(x, ldx, m0, m1, k, w, n, it % strips, bias, y, out_kind, portable);
    }
    return 0;
}

/* 1 where this build has the vector path (AVX2 + FMA), 0 where only plain C. */
int bf16_strips_vector(void) {
#ifdef PAGED_AVX2
    return 1;
#else
    return 0;
#endif
}
