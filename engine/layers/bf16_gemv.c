/* bf16 matrix products on CPU for few rows (decode): y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]), bf16 in and
 * out, fp32 accumulation, each output rounded to nearest even once, as torch does.
 *
 * The weight is read in place in oneDNN's packed layout (engine/layers/linear.py cpu_packed; BA16a64b2a on
 * AVX512-BF16 CPUs): blocks of BW output channels, input pair by input pair, in vdpbf16ps' order,
 *
 *     w[b][p][c][j] = W[BW b + c][2 p + j]     b < ceil(n / BW), p < kpad / 2, c < BW, j < 2; zero padded
 *
 * so no second copy of the weight is kept: oneDNN still serves the larger row counts. A 16-channel strip of a
 * block is one 64-byte vdpbf16ps operand per input pair, against a broadcast pair of x. Why not oneDNN's own
 * matmul at a few rows: it reads the weight at ~60-70 % of what this loop streams (docs/benchmarks.md, "bf16 GEMV
 * (#27)").
 *
 * Work is split over threads by strips of 16 channels (a contiguous range each, so SmolLM2's 9-block layers
 * balance); a thread runs tiles of up to TILE_ROWS rows of x against up to BW / 16 strips of one block. x is
 * packed as bf16 pairs, tile by tile (xp[p * M + r] = (x[r][2p], x[r][2p + 1]), zeros past k), so a tile reads it
 * as one stream. AVX512-BF16 path (vdpbf16ps: exact products, fp32 sums, bf16 subnormals count as zero) and a
 * portable C path, same layout, fp32 arithmetic.
 *
 * Compiled on first use by engine/attention/native.py (cc -O3 -march=native -fopenmp); loaded with ctypes.
 */
#include "../attention/paged_simd.h"   /* bf16 <-> fp32 as torch rounds (and the system headers) */
#ifdef _OPENMP
#include <omp.h>
#else
#define omp_get_thread_num() 0
#define omp_get_num_threads() 1
#endif

#define STRIP 16          /* output channels per vector */
#define MAX_STRIPS 4      /* strips a tile takes at once: BW <= 64 */
#define TILE_ROWS 4       /* rows of x per tile */
#define PREFETCH_PAIRS 16 /* software prefetch distance in a strip's stream, in input pairs */

/* M rows of packed x (kp pairs) against G strips starting at w (a pair's strips `stride` elements apart) ->
 * out[row][16 g + c], fp32 sums */
typedef void (*tile_fn)(const uint32_t *xp, int64_t kp, const uint16_t *w, int64_t stride, float *out);

static void tile_portable(const uint32_t *xp, int64_t rows, int64_t strips, int64_t kp, const uint16_t *w,
                          int64_t stride, float *out) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < strips * STRIP; c++) {
            float acc = 0.0f;
            for (int64_t p = 0; p < kp; p++) {
                uint32_t two = xp[p * rows + r];
                const uint16_t *wp = w + p * stride + 2 * c;
                acc += bf16_to_float((uint16_t)two) * bf16_to_float(wp[0]) +
                       bf16_to_float((uint16_t)(two >> 16)) * bf16_to_float(wp[1]);
            }
            out[r * MAX_STRIPS * STRIP + c] = acc;
        }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* U accumulators per (row, strip) over consecutive pairs hide vdpbf16ps' latency when M * G is small; M, G and U
 * are constants in each instance, so the accumulators stay in registers. */
#define TILE(M, G, U)                                                                                           \
    static void tile_##M##_##G(const uint32_t *x, int64_t kp, const uint16_t *w, int64_t stride, float *out) { \
        __m512 acc[M][G][U];                                                                                    \
        for (int r = 0; r < M; r++)                                                                             \
            for (int g = 0; g < G; g++)                                                                         \
                for (int u = 0; u < U; u++) acc[r][g][u] = _mm512_setzero_ps();                                 \
        int64_t p = 0;                                                                                          \
        for (; p + U <= kp; p += U) {                                                                           \
            _Pragma("GCC unroll 8") for (int u = 0; u < U; u++)                                                \
                _Pragma("GCC unroll 4") for (int g = 0; g < G; g++) _mm_prefetch(                              \
                    (const char *)(w + (p + u + PREFETCH_PAIRS) * stride + g * 2 * STRIP), _MM_HINT_T0);       \
            _Pragma("GCC unroll 4") for (int u = 0; u < U; u++) {                                              \
                _Pragma("GCC unroll 4") for (int g = 0; g < G; g++) {                                          \
                    __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (p + u) * stride + g * 2 * STRIP);           \
                    _Pragma("GCC unroll 4") for (int r = 0; r < M; r++)                                        \
                        acc[r][g][u] = _mm512_dpbf16_ps(acc[r][g][u], wv,                                       \
                                                        (__m512bh)_mm512_set1_epi32((int)x[(p + u) * M + r])); \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
        for (; p < kp; p++)                                                                                     \
            for (int g = 0; g < G; g++) {                                                                       \
                __m512bh wv = (__m512bh)_mm512_loadu_si512(w + p * stride + g * 2 * STRIP);                     \
                for (int r = 0; r < M; r++)                                                                     \
                    acc[r][g][0] = _mm512_dpbf16_ps(acc[r][g][0], wv,                                           \
                                                    (__m512bh)_mm512_set1_epi32((int)x[p * M + r]));            \
            }                                                                                                   \
        for (int r = 0; r < M; r++)                                                                             \
            for (int g = 0; g < G; g++) {                                                                       \
                __m512 s = acc[r][g][0];                                                                        \
                for (int u = 1; u < U; u++) s = _mm512_add_ps(s, acc[r][g][u]);                                 \
                _mm512_storeu_ps(out + r * MAX_STRIPS * STRIP + g * STRIP, s);                                  \
            }                                                                                                   \
    }
TILE(1, 1, 4) TILE(1, 2, 2) TILE(1, 3, 1) TILE(1, 4, 1)
TILE(2, 1, 4) TILE(2, 2, 2) TILE(2, 3, 2) TILE(2, 4, 1)
TILE(3, 1, 2) TILE(3, 2, 2) TILE(3, 3, 1) TILE(3, 4, 1)
TILE(4, 1, 2) TILE(4, 2, 1) TILE(4, 3, 1) TILE(4, 4, 1)
static const tile_fn TILES[TILE_ROWS + 1][MAX_STRIPS + 1] = {
    {0}, {0, tile_1_1, tile_1_2, tile_1_3, tile_1_4}, {0, tile_2_1, tile_2_2, tile_2_3, tile_2_4},
    {0, tile_3_1, tile_3_2, tile_3_3, tile_3_4}, {0, tile_4_1, tile_4_2, tile_4_3, tile_4_4}};
#endif

/* rows of x (bf16 [m, k]) as the tiles' pairs, kp pairs a row, zeros past k (see the top) */
static void pack_x(const uint16_t *x, int64_t m, int64_t k, int64_t kp, uint16_t *xp) {
    for (int64_t i = 0; i < m; i++) {
        int64_t t = i / TILE_ROWS, r = i % TILE_ROWS;
        int64_t rows = m - t * TILE_ROWS < TILE_ROWS ? m - t * TILE_ROWS : TILE_ROWS;
        uint16_t *dst = xp + t * TILE_ROWS * 2 * kp + 2 * r;
        for (int64_t p = 0; p < kp; p++) {
            dst[2 * p * rows] = 2 * p < k ? x[i * k + 2 * p] : 0;
            dst[2 * p * rows + 1] = 2 * p + 1 < k ? x[i * k + 2 * p + 1] : 0;
        }
    }
}

/* rows of out (a tile's sums) plus bias into y's columns col .. col + width - 1, as bf16 */
static void store_tile(uint16_t *y, int64_t n, int64_t row, int64_t col, int64_t width, int64_t rows,
                       const float *out, const uint16_t *bias, int vector) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (vector) {
        for (int64_t c = 0; c < width; c += STRIP) {
            int64_t w = width - c < STRIP ? width - c : STRIP;
            __mmask16 mask = w == STRIP ? (__mmask16)0xffff : (__mmask16)((1u << w) - 1);
            __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                  _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + col + c)), 16))
                            : _mm512_setzero_ps();
            for (int64_t r = 0; r < rows; r++) {
                __m512 v = _mm512_add_ps(_mm512_loadu_ps(out + r * MAX_STRIPS * STRIP + c), b);
                _mm256_mask_storeu_epi16(y + (row + r) * n + col + c, mask, float16_to_bf16(v));
            }
        }
        return;
    }
#endif
    (void)vector;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < width; c++)
            y[(row + r) * n + col + c] = float_to_bf16(out[r * MAX_STRIPS * STRIP + c] +
                                                      (bias ? bf16_to_float(bias[col + c]) : 0.0f));
}

/* x [m, k] bf16; w the packed W [n, k] (blocks of bw channels, kpad inputs; bw a multiple of 16 up to 64, kpad
 * even and >= k); bias [n] bf16 or null -> y [m, n] bf16. portable: the plain C path (tests compare it with the
 * vector one). Returns 0, -1 if the packed x could not be allocated, -2 for a layout it does not take. */
int bf16_gemm(const uint16_t *x, int64_t m, int64_t k, const uint16_t *w, int64_t bw, int64_t kpad,
              const uint16_t *bias, int64_t n, uint16_t *y, int threads, int portable) {
    if (bw % STRIP || bw > MAX_STRIPS * STRIP || bw <= 0 || kpad % 2 || kpad < k) return -2;
    if (m <= 0 || n <= 0) return 0;
    int64_t kp = kpad / 2, strips = (n + STRIP - 1) / STRIP, per_block = bw / STRIP;
    int vector = 0;
    (void)portable;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    vector = !portable;
#endif
    int direct = m == 1 && k == kpad;   /* one row as wide as the packed weight is its own packed x */
    uint16_t *buf = 0;
    if (!direct) {
        if (!(buf = malloc(sizeof(uint16_t) * 2 * kp * m))) return -1;
        pack_x(x, m, k, kp, buf);
    }
    const uint32_t *xp = direct ? (const uint32_t *)x : (const uint32_t *)buf;
    if (threads < 1) threads = 1;
    if (threads > strips) threads = (int)strips;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t s = strips * t / nt, end = strips * (t + 1) / nt;   /* this thread's strips */
        float out[TILE_ROWS * MAX_STRIPS * STRIP];
        while (s < end) {
            int64_t b = s / per_block, first = s % per_block;
            int64_t g = per_block - first < end - s ? per_block - first : end - s;   /* strips of block b */
            int64_t col = s * STRIP, width = n - col < g * STRIP ? n - col : g * STRIP;
            const uint16_t *wb = w + (b * kp * bw + first * STRIP) * 2;
            for (int64_t r = 0; r < m; r += TILE_ROWS) {
                int64_t rows = m - r < TILE_ROWS ? m - r : TILE_ROWS;
                const uint32_t *xt = xp + r * kp;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
                if (vector) TILES[rows][g](xt, kp, wb, 2 * bw, out);
                else
#endif
                    tile_portable(xt, rows, g, kp, wb, 2 * bw, out);
                store_tile(y, n, r, col, width, rows, out, bias, vector);
            }
            s += g;
        }
    }
    free(buf);
    return 0;
}
