/* The CPU matmul for CPUs with AVX2 and no AVX-512 (AMD Zen 2/3, Intel before Skylake-SP), bf16 or fp32 weights:
 * y[m, n] = x[m, k] W[n, k]^T (+ bias[n]), fp32 sums, each output rounded once to y's dtype.
 *
 * bf16: there oneDNN packs no bf16 weight and torch's bf16 matmul runs one GEMV per row: ~8x an fp32 matmul's time
 * at 64 rows, ~10x for a prompt (docs/benchmarks.md, "CPUs with AVX2 only"); here the weight stays bf16 in memory,
 * widened to fp32 in registers (a bf16 is an fp32's upper half). fp32: oneDNN's AVX2 matmul is slower than these
 * tiles for decode batches (same section). Either way the product runs as an fp32 GEMM: register tiles of MR rows x
 * 16 channels, KC inputs a pass so a strip's slice stays in L1 across the row tiles of a work item.
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
#define BIG_WEIGHT (16 << 20)   /* bytes of weight past which the rows are the inner loop (see strips_gemm) */

#ifdef PAGED_AVX2
/* R rows of x (rows ldx apart, kn inputs from x) against a full strip slice w [kn][16] of kind WK -> c [R][16], added
 * to c unless `first`. R and WK are constants after inlining, so the accumulators stay in registers. */
INLINE void tile16(const int R, const int WK, const float *x, int64_t ldx, const char *w, int64_t kn, float *c,
                   int first) {
    const int64_t row = STRIP * elem_size(WK);
    __m256 a[MR][2];
    for (int r = 0; r < R; r++) {
        a[r][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * STRIP);
        a[r][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * STRIP + 8);
    }
    for (int64_t i = 0; i < kn; i++) {
        __m256 w0 = load8(w + i * row, WK), w1 = load8(w + i * row + row / 2, WK);
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

#define TILES(WK)                                                 \
    switch (rows) {                                               \
        case 1: tile16(1, WK, x, ldx, w, kn, c, first); break;    \
        case 2: tile16(2, WK, x, ldx, w, kn, c, first); break;    \
        case 3: tile16(3, WK, x, ldx, w, kn, c, first); break;    \
        case 4: tile16(4, WK, x, ldx, w, kn, c, first); break;    \
        case 5: tile16(5, WK, x, ldx, w, kn, c, first); break;    \
        default: tile16(6, WK, x, ldx, w, kn, c, first); break;   \
    }

static void tile_full(int rows, int wkind, const float *x, int64_t ldx, const char *w, int64_t kn, float *c,
                      int first) {
    if (wkind == KIND_F32) TILES(KIND_F32) else TILES(KIND_BF16)
}
#endif

INLINE float weight_at(const char *w, int64_t index, int wkind) {
    return wkind == KIND_F32 ? ((const float *)w)[index] : bf16_to_float(((const uint16_t *)w)[index]);
}

/* Any strip width, plain C: the last strip, or every strip without AVX2. */
static void tile_portable(int rows, int wkind, const float *x, int64_t ldx, const char *w, int64_t width, int64_t kn,
                          float *c, int first) {
    for (int r = 0; r < rows; r++)
        for (int64_t j = 0; j < width; j++) {
            float acc = first ? 0.0f : c[r * STRIP + j];
            for (int64_t i = 0; i < kn; i++) acc += x[r * ldx + i] * weight_at(w, i * width + j, wkind);
            c[r * STRIP + j] = acc;
        }
}

/* One work item: rows [m0, m1) of x against strip s, into y (+ bias). */
static void strip_item(const float *x, int64_t ldx, int64_t m0, int64_t m1, int64_t k, const char *w, int wkind,
                       int64_t n, int64_t s, const void *bias, void *y, int out_kind, int portable) {
    int64_t width = n - s * STRIP < STRIP ? n - s * STRIP : STRIP, esize = elem_size(wkind);
    const char *ws = w + s * STRIP * k * esize;
    float c[MC * STRIP];
    for (int64_t kc = 0; kc < k; kc += KC) {
        int64_t kn = k - kc < KC ? k - kc : KC;
        for (int64_t r0 = m0; r0 < m1; r0 += MR) {
            int rows = (int)(m1 - r0 < MR ? m1 - r0 : MR);
            float *cr = c + (r0 - m0) * STRIP;
#ifdef PAGED_AVX2
            if (!portable && width == STRIP) {
                tile_full(rows, wkind, x + r0 * ldx + kc, ldx, ws + kc * STRIP * esize, kn, cr, kc == 0);
                continue;
            }
#endif
            tile_portable(rows, wkind, x + r0 * ldx + kc, ldx, ws + kc * width * esize, width, kn, cr, kc == 0);
        }
    }
    for (int64_t r = m0; r < m1; r++)
        for (int64_t j = 0; j < width; j++) {
            int64_t col = s * STRIP + j;
            float b = !bias ? 0.0f : out_kind == KIND_BF16 ? bf16_to_float(((const uint16_t *)bias)[col])
                                                          : ((const float *)bias)[col];
            float v = c[(r - m0) * STRIP + j] + b;
            if (out_kind == KIND_BF16) ((uint16_t *)y)[r * n + s * STRIP + j] = float_to_bf16(v);
            else ((float *)y)[r * n + s * STRIP + j] = v;
        }
}

/* x: [m, k] fp32, rows ldx apart; w: W [n, k] of `wkind` (fp32 or bf16) in the strip layout above; bias: [n] or
 * NULL and y: [m, n] contiguous, both of `out_kind` (fp32 or bf16). `portable`: the plain C path everywhere (tests).
 * Returns 0. */
int strips_gemm(const float *x, int64_t ldx, int64_t m, int64_t k, const void *w, int wkind, int64_t n,
                const void *bias, void *y, int out_kind, int num_threads, int portable) {
    int64_t strips = (n + STRIP - 1) / STRIP, chunks = (m + MC - 1) / MC;
#ifndef PAGED_AVX2
    portable = 1;
#endif
    if (chunks == 1) {   /* decode rows: each thread streams a contiguous run of strips */
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t s = 0; s < strips; s++) strip_item(x, ldx, 0, m, k, w, wkind, n, s, bias, y, out_kind, portable);
        return 0;
    }
    /* Items handed out one at a time, so the threads end together whatever the split of rows into chunks. In
     * row-chunk-major order the threads work through one chunk of x's rows together (it stays in their caches);
     * a weight larger than the caches (an LM head) goes strip-major instead, read from memory once, not per chunk. */
    int strip_major = n * k * elem_size(wkind) > BIG_WEIGHT;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t it = 0; it < chunks * strips; it++) {
        int64_t chunk = strip_major ? it % chunks : it / strips, s = strip_major ? it / chunks : it % strips;
        int64_t m0 = chunk * MC, m1 = m0 + MC < m ? m0 + MC : m;
        strip_item(x, ldx, m0, m1, k, w, wkind, n, s, bias, y, out_kind, portable);
    }
    return 0;
}

/* 0: only plain C in this build; 1: the vector path (AVX2 + FMA); 2: that path on a CPU with AVX-512, where oneDNN's
 * own fp32 matmul is twice as wide (so fp32 weights keep it). */
int strips_vector(void) {
#if defined(PAGED_AVX2) && defined(__AVX512F__)
    return 2;
#elif defined(PAGED_AVX2)
    return 1;
#else
    return 0;
#endif
}
