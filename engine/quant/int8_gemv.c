/* W8A16 matrix products on CPU: y[m, n] = scale[n] * sum_k x[m, k] * q[n, k], any m, fp32 accumulation.
 *
 * q (int8, per-output-channel fp32 scales) is packed once at load (engine/attention/native.py int8_blocks) into
 * blocks of 16 output channels, input by input:
 *
 *     w[b][i][c] = q[16 b + c][i]      b < ceil(n / 16), i < k rounded up to even, c < 16; zero padded
 *
 * A block is one contiguous stream of 16 k bytes, and each 16 bytes widen to one vector of the 16 channels, which
 * meets a broadcast of x[i]. Why not the row-major [n, k] weight: read 16 bytes of a row at a time against 16
 * floats of x, it streamed from DRAM at about half of what one core reads (one thread, 2048-wide rows: 10-13 GB/s
 * where a plain read ran 20-28 and this layout 20-26). Pairs of inputs interleaved per channel (vdpbf16ps' order,
 * widened with vcvtne2ps2bf16) read DRAM as fast but computed ~15 % slower in cache.
 *
 * Each thread takes a contiguous range of blocks and runs tiles of up to TILE_ROWS rows of x against one block:
 * the block's weights are widened once per tile, then used by every row. Two AVX-512 paths:
 *   - fp32: x in fp32 (bf16 widened exactly), the weights widened to fp32, one FMA per product;
 *   - bf16 activations, two rows or more (AVX512-BF16): inputs 2p and 2p + 1 of the block widened to bf16 pairs
 *     (exact: |q| <= 128) against x's bf16 pairs with vdpbf16ps, two products per fp32 lane. Exact products,
 *     fp32 sums; like every vdpbf16ps, bf16 subnormals count as zero.
 * and a portable C path with the same layout and arithmetic as the fp32 one. x is packed per panel of rows that
 * fits in L2 (PANEL_BYTES; see tile_fn), so prefill-sized m re-reads the weight once a panel, never x per block.
 *
 * Compiled on first use by engine/attention/native.py (cc -O3 -march=native -fopenmp); loaded with ctypes.
 */
#include "../attention/paged_simd.h"   /* bf16 <-> fp32 as torch rounds (and the system headers) */

enum { X_F32, X_BF16 };
#define BLOCK 16          /* output channels per block */
#define TILE_ROWS 16      /* rows of x per tile: one accumulator each */
#define PANEL_BYTES (384 * 1024)
/* software prefetch distance in the weight stream: without it the tiles of several rows ran from DRAM at about
 * half their in-cache speed (one thread, 8 rows: 5.6 against 11.8 GB/s; two threads, 4 rows: 13-20 against 19-27) */
#define PREFETCH_BYTES 4096

static float load_x(const void *x, int xtype, int64_t i) {
    return xtype == X_F32 ? ((const float *)x)[i] : bf16_to_float(((const uint16_t *)x)[i]);
}

static void store_y(void *y, int xtype, int64_t i, float v) {
    if (xtype == X_F32) ((float *)y)[i] = v;
    else ((uint16_t *)y)[i] = float_to_bf16(v);
}

/* A tile: M rows of x against one block of w -> out[row][channel], the unscaled sums. x comes packed per panel
 * so that a tile reads it as one stream whatever k is (rows 2^n bytes apart alias in L1: 16 rows of a 2048-wide
 * bf16 x read in place ran at half speed): fp32 x[k][M] (xp[i * M + r] = x[r][i]), or bf16 pairs
 * xp[p * M + r] = (x[r][2p], x[r][2p + 1]); a zero after an odd k. */
typedef void (*tile_fn)(const void *xp, int64_t k2, const int8_t *w, float *out);

static void tile_portable(const float *xp, int64_t rows, int64_t k2, const int8_t *w, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        float acc[BLOCK] = {0};
        for (int64_t i = 0; i < k2; i++)
            for (int c = 0; c < BLOCK; c++) acc[c] += xp[i * rows + r] * (float)w[i * BLOCK + c];
        for (int c = 0; c < BLOCK; c++) out[r * BLOCK + c] = acc[c];
    }
}

#ifdef __AVX512F__
static inline __m512 widen16(const int8_t *p) {   /* 16 int8 -> fp32 */
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* fp32 tile: acc lane c is channel c; U accumulators per row over consecutive inputs hide the FMA latency when M
 * is small. M and U are constants in each instance, so the accumulators stay in registers. */
#define TILE_F32(M, U)                                                                                          \
    static void tile_f32_##M(const void *xv, int64_t k2, const int8_t *w, float *out) {                        \
        const float *x = xv;                                                                                    \
        __m512 acc[M][U];                                                                                       \
        for (int r = 0; r < M; r++)                                                                             \
            for (int u = 0; u < U; u++) acc[r][u] = _mm512_setzero_ps();                                        \
        int64_t i = 0;                                                                                          \
        for (; i + U <= k2; i += U) {                                                                           \
            _mm_prefetch((const char *)w + i * BLOCK + PREFETCH_BYTES, _MM_HINT_T0);                           \
            _Pragma("GCC unroll 4") for (int u = 0; u < U; u++) {                                              \
                __m512 wv = widen16(w + (i + u) * BLOCK);                                                       \
                _Pragma("GCC unroll 16") for (int r = 0; r < M; r++)                                           \
                    acc[r][u] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[(i + u) * M + r]), acc[r][u]);             \
            }                                                                                                   \
        }                                                                                                       \
        for (; i < k2; i++) {                                                                                   \
            __m512 wv = widen16(w + i * BLOCK);                                                                 \
            for (int r = 0; r < M; r++)                                                                         \
                acc[r][0] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[i * M + r]), acc[r][0]);                       \
        }                                                                                                       \
        for (int r = 0; r < M; r++) {                                                                           \
            __m512 s = acc[r][0];                                                                               \
            for (int u = 1; u < U; u++) s = _mm512_add_ps(s, acc[r][u]);                                        \
            _mm512_storeu_ps(out + r * BLOCK, s);                                                               \
        }                                                                                                       \
    }

/* the instances: M = 1 .. TILE_ROWS rows, U accumulators a row */
#define TILES(T) T(1, 4) T(2, 2) T(3, 2) T(4, 2) T(5, 1) T(6, 1) T(7, 1) T(8, 1) T(9, 1) T(10, 1) T(11, 1)      \
                 T(12, 1) T(13, 1) T(14, 1) T(15, 1) T(16, 1)
#define TABLE(name) {0, name##_1, name##_2, name##_3, name##_4, name##_5, name##_6, name##_7, name##_8, name##_9,   \
                     name##_10, name##_11, name##_12, name##_13, name##_14, name##_15, name##_16}
TILES(TILE_F32)
static const tile_fn TILES_F32[TILE_ROWS + 1] = TABLE(tile_f32);

#ifdef __AVX512BF16__
/* the int8 of inputs 2p and 2p + 1 as bf16 pairs, channel c in lane c: each int8 is exact in bf16, so the fp32
 * widening has zero low halves and the pair is one shift and an or */
static inline __m512bh widen32_bf16(const int8_t *p) {
    __m512i even = _mm512_castps_si512(widen16(p)), odd = _mm512_castps_si512(widen16(p + BLOCK));
    return (__m512bh)_mm512_or_si512(odd, _mm512_srli_epi32(even, 16));
}

static inline __m512bh pair_bf16(uint32_t two) { return (__m512bh)_mm512_set1_epi32((int)two); }

/* bf16 tile: x as bf16 pairs, vdpbf16ps adds both products of a pair into the channel's fp32 lane */
#define TILE_BF16(M, U)                                                                                         \
    static void tile_bf16_##M(const void *xv, int64_t k2, const int8_t *w, float *out) {                       \
        const uint32_t *x = xv;                                                                                 \
        __m512 acc[M][U];                                                                                       \
        for (int r = 0; r < M; r++)                                                                             \
            for (int u = 0; u < U; u++) acc[r][u] = _mm512_setzero_ps();                                        \
        int64_t kp = k2 / 2, p = 0;                                                                             \
        for (; p + U <= kp; p += U) {                                                                           \
            _mm_prefetch((const char *)w + p * 2 * BLOCK + PREFETCH_BYTES, _MM_HINT_T0);                       \
            _Pragma("GCC unroll 4") for (int u = 0; u < U; u++) {                                              \
                __m512bh wv = widen32_bf16(w + (p + u) * 2 * BLOCK);                                            \
                _Pragma("GCC unroll 16") for (int r = 0; r < M; r++)                                           \
                    acc[r][u] = _mm512_dpbf16_ps(acc[r][u], wv, pair_bf16(x[(p + u) * M + r]));                \
            }                                                                                                   \
        }                                                                                                       \
        for (; p < kp; p++) {                                                                                   \
            __m512bh wv = widen32_bf16(w + p * 2 * BLOCK);                                                      \
            for (int r = 0; r < M; r++)                                                                         \
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], wv, pair_bf16(x[p * M + r]));                          \
        }                                                                                                       \
        for (int r = 0; r < M; r++) {                                                                           \
            __m512 s = acc[r][0];                                                                               \
            for (int u = 1; u < U; u++) s = _mm512_add_ps(s, acc[r][u]);                                        \
            _mm512_storeu_ps(out + r * BLOCK, s);                                                               \
        }                                                                                                       \
    }
TILES(TILE_BF16)
static const tile_fn TILES_BF16[TILE_ROWS + 1] = TABLE(tile_bf16);
#endif
#endif

/* Row i of x (xtype, k wide) into its tile of the packed panel (see tile_fn). */
static void pack_row(const void *x, int xtype, int64_t i, int64_t rows, int64_t k, int bf16, void *xp) {
    int64_t k2 = k + k % 2, t = i / TILE_ROWS, r = i % TILE_ROWS;
    int64_t m = rows - t * TILE_ROWS < TILE_ROWS ? rows - t * TILE_ROWS : TILE_ROWS;   /* rows of its tile */
    if (bf16) {
        const uint16_t *src = (const uint16_t *)x + i * k;
        uint16_t *dst = (uint16_t *)xp + t * TILE_ROWS * k2 + 2 * r;
        for (int64_t p = 0; p < k2 / 2; p++) {
            dst[2 * p * m] = src[2 * p];
            dst[2 * p * m + 1] = 2 * p + 1 < k ? src[2 * p + 1] : 0;
        }
        return;
    }
    float *dst = (float *)xp + t * TILE_ROWS * k2 + r;
    for (int64_t j = 0; j < k2; j++) dst[j * m] = j < k ? load_x(x, xtype, i * k + j) : 0.0f;
}

/* rows of out (unscaled sums of one block) times the block's scales into y's columns col .. col + width - 1 */
static void store_tile(void *y, int xtype, int64_t n, int64_t row, int64_t col, int64_t width, int64_t rows,
                       const float *out, const float *scales, int vector) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (vector) {
        __mmask16 mask = width == BLOCK ? (__mmask16)0xffff : (__mmask16)((1u << width) - 1);
        __m512 s = _mm512_maskz_loadu_ps(mask, scales + col);
        for (int64_t r = 0; r < rows; r++) {
            __m512 v = _mm512_mul_ps(_mm512_loadu_ps(out + r * BLOCK), s);
            int64_t at = (row + r) * n + col;
            if (xtype == X_F32) {
                _mm512_mask_storeu_ps((float *)y + at, mask, v);
                continue;
            }
            /* bf16: round to nearest even as torch does; NaN stays NaN */
            _mm256_mask_storeu_epi16((uint16_t *)y + at, mask, float16_to_bf16(v));
        }
        return;
    }
#endif
    (void)vector;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < width; c++)
            store_y(y, xtype, (row + r) * n + col + c, out[r * BLOCK + c] * scales[col + c]);
}

/* x [m, k] (xtype), w the packed weight of q [n, k], scales [n] fp32 -> y [m, n] (xtype). portable: the plain C
 * path (tests compare it with the vector ones). Returns 0, or -1 if a work buffer could not be allocated. */
int int8_gemm(const void *x, int xtype, int64_t m, int64_t k, const int8_t *w, const float *scales, int64_t n,
              void *y, int threads, int portable) {
    if (m <= 0 || n <= 0) return 0;
    int64_t nb = (n + BLOCK - 1) / BLOCK, k2 = k + k % 2;
    const tile_fn *tiles = 0;   /* 0: tile_portable */
    int bf16 = 0;               /* the tiles take x as bf16 pairs, else as fp32 */
    (void)portable;
#ifdef __AVX512F__
    if (!portable) tiles = TILES_F32;
#ifdef __AVX512BF16__
    /* (one row: the fp32 tile; its widening is cheaper than the bf16 pairs and there is one row to convert) */
    if (!portable && xtype == X_BF16 && m > 1) tiles = TILES_BF16, bf16 = 1;
#endif
#endif
    int64_t xsize = bf16 ? 2 : 4;
    int64_t panel = PANEL_BYTES / (k2 * xsize) / TILE_ROWS * TILE_ROWS;
    if (panel < TILE_ROWS) panel = TILE_ROWS;
    if (panel > m) panel = m;
    /* one row of an even k already in the tiles' dtype is its own packed panel */
    int direct = m == 1 && k % 2 == 0 && (bf16 || xtype == X_F32);
    void *buf = 0;
    if (!direct && !(buf = malloc(xsize * panel * k2))) return -1;
#pragma omp parallel num_threads(threads)
    for (int64_t r0 = 0; r0 < m; r0 += panel) {
        int64_t rows = m - r0 < panel ? m - r0 : panel;
        const char *xp = direct ? (const char *)x : (const char *)buf;
        if (!direct) {
            const char *src = (const char *)x + r0 * k * (xtype == X_F32 ? 4 : 2);
#pragma omp for schedule(static)
            for (int64_t i = 0; i < rows; i++) pack_row(src, xtype, i, rows, k, bf16, buf);
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nb; b++) {   /* one contiguous range of blocks per thread */
            const int8_t *wb = w + b * k2 * BLOCK;
            int64_t width = n - b * BLOCK < BLOCK ? n - b * BLOCK : BLOCK;
            float out[TILE_ROWS * BLOCK];
            for (int64_t t = 0; t < rows; t += TILE_ROWS) {
                int64_t tr = rows - t < TILE_ROWS ? rows - t : TILE_ROWS;
                const char *xt = xp + t * k2 * xsize;
                if (tiles) tiles[tr](xt, k2, wb, out);
                else tile_portable((const float *)xt, tr, k2, wb, out);
                store_tile(y, xtype, n, r0 + t, b * BLOCK, width, tr, out, scales, tiles != 0);
            }
        }   /* (its barrier keeps buf until every thread is done with the panel) */
    }
    free(buf);
    return 0;
}
