/* W8A8 matrix products on CPU: y[m, n] = x_scale[m] * w_scale[n] * sum_k x_q[m, k] * q[n, k] (+ bias[n]), the
 * activations quantized to int8 inside the call, int32 accumulation, any m, n, k.
 *
 * Activations (bit-exact with engine/quant/kernels.py quantize_activations_dynamic / _static):
 *   dynamic: per row, scale = max(max_k |x|, 1e-10) / 127 (fp32), x_q = clamp(round(x / scale), -127, 127);
 *   static:  x_q = clamp(round(x / input_scale) + input_offset, -128, 127), the accumulators less
 *            input_offset * sum_k q[n, k] and the scale input_scale;
 * round() to nearest even (torch.round), x / scale a true fp32 division as torch's. The rescale follows
 * _run_int_mm's order: ((float)acc * x_scale) * w_scale, then + bias, then rounded to bf16 (nearest even) for a bf16
 * x, so the output equals that torch reference exactly.
 *
 * The weight q [n, k] is packed once at load (engine/attention/native.py w8a8_blocks) for vpdpbusd:
 *
 *     w[b][g][c][j] = q[16 b + c][4 g + j]      b < ceil(n / 16), g < ceil(k / 4), c < 16, j < 4; zero padded
 *
 * so one 64-byte vector holds four consecutive inputs of each of a block's 16 channels, one channel per 32-bit lane.
 * vpdpbusd multiplies unsigned by signed bytes: the activations go in as u = x_q + 128 (0..255) and the sums lose
 * (128 + offset) * sum_k q[n, k] (wsum, computed at pack time; offset 0 for dynamic).
 *
 * x is quantized per panel of rows (PANEL_BYTES of u8) into tiles of up to TILE_ROWS rows, each tile input-group
 * major (xp[g * M + r] = the 4 bytes of row r, inputs 4g .. 4g + 3), so that a tile reads one stream and each group
 * is one broadcast. Each thread takes a contiguous range of blocks (OpenMP static) and runs every tile against each
 * of its blocks. Paths: AVX-512 VNNI (vpdpbusd; quantization with AVX-512F), and a portable C one with the same
 * layout and arithmetic (tests compare them).
 *
 * Compiled with the other kernels by engine/attention/native.py (cc -O3 -march=native -fopenmp).
 */
#include "../attention/paged_simd.h"   /* bf16 <-> fp32 as torch rounds (and the system headers) */

enum { X_F32, X_BF16 };
#define BLOCK 16
#define TILE_ROWS 16
#define PANEL_BYTES (256 * 1024)

/* Row i of x quantized into its tile of the panel buffer xp (see above); returns its scale (dynamic) or
 * input_scale (static). row: a k-float scratch. */
static float quantize_row(const void *x, int xtype, int64_t i, int64_t rows, int64_t k, int is_static,
                          float in_scale, int in_offset, int vector, float *row, uint8_t *xp) {
    int64_t k4 = (k + 3) / 4, t = i / TILE_ROWS, r = i % TILE_ROWS;
    int64_t m = rows - t * TILE_ROWS < TILE_ROWS ? rows - t * TILE_ROWS : TILE_ROWS;   /* rows of its tile */
    uint32_t *dst = (uint32_t *)xp + t * TILE_ROWS * k4 + r;   /* dst[g * m]: group g of this row */
    const float *src;
    if (xtype == X_F32) {
        src = (const float *)x + i * k;
    } else {
        const uint16_t *h = (const uint16_t *)x + i * k;
        for (int64_t j = 0; j < k; j++) row[j] = bf16_to_float(h[j]);
        src = row;
    }
    float scale, lo = -127.0f, hi = 127.0f, off = 0.0f;
    if (is_static) {
        scale = in_scale, lo = -128.0f, off = (float)in_offset;
    } else {
        float amax = 0.0f;
        int64_t j = 0;
#ifdef __AVX512F__
        if (vector) {
            __m512 mx = _mm512_setzero_ps();
            for (; j + 16 <= k; j += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(src + j)));
            amax = _mm512_reduce_max_ps(mx);
        }
#endif
        for (; j < k; j++) amax = fmaxf(amax, fabsf(src[j]));
        scale = fmaxf(amax, 1e-10f) / 127.0f;
    }
    int64_t j = 0;
#ifdef __AVX512F__
    if (vector) {
        __m512 s = _mm512_set1_ps(scale), vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(hi), voff = _mm512_set1_ps(off);
        for (; j + 16 <= k; j += 16) {
            __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(src + j), s),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(v, voff), vlo), vhi);
            __m512i u = _mm512_add_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(128));
            uint32_t four[4];
            _mm_storeu_si128((__m128i *)four, _mm512_cvtepi32_epi8(u));
            for (int g = 0; g < 4; g++) dst[(j / 4 + g) * m] = four[g];
        }
    }
#endif
    (void)vector;
    for (; j < 4 * k4; j += 4) {
        uint32_t four = 0;
        for (int b = 0; b < 4; b++) {
            uint32_t u = 128;
            if (j + b < k) {
                float v = nearbyintf(src[j + b] / scale) + off;
                v = v < lo ? lo : v > hi ? hi : v;
                u = (uint32_t)((int32_t)v + 128);
            }
            four |= u << (8 * b);
        }
        dst[(j / 4) * m] = four;
    }
    return scale;
}

/* A tile: M rows of quantized x against one block -> out[r * 16 + c], the int32 sums of u * q. */
typedef void (*tile_fn)(const uint32_t *xp, int64_t k4, const int8_t *w, int32_t *out);

static void tile_portable(const uint32_t *xp, int64_t rows, int64_t k4, const int8_t *w, int32_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        int32_t acc[BLOCK] = {0};
        for (int64_t g = 0; g < k4; g++) {
            uint32_t four = xp[g * rows + r];
            for (int c = 0; c < BLOCK; c++)
                for (int b = 0; b < 4; b++)
                    acc[c] += (int32_t)((four >> (8 * b)) & 0xff) * w[(g * BLOCK + c) * 4 + b];
        }
        for (int c = 0; c < BLOCK; c++) out[r * BLOCK + c] = acc[c];
    }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define HAVE_VNNI 1
/* U accumulators a row over consecutive groups hide vpdpbusd's latency when M is small */
#define TILE_VNNI(M, U)                                                                                         \
    static void tile_vnni_##M(const uint32_t *x, int64_t k4, const int8_t *w, int32_t *out) {                   \
        __m512i acc[M][U];                                                                                      \
        for (int r = 0; r < M; r++)                                                                             \
            for (int u = 0; u < U; u++) acc[r][u] = _mm512_setzero_si512();                                     \
        int64_t g = 0;                                                                                          \
        for (; g + U <= k4; g += U) {                                                                           \
            _Pragma("GCC unroll 4") for (int u = 0; u < U; u++) {                                              \
                __m512i wv = _mm512_loadu_si512((const void *)(w + (g + u) * 4 * BLOCK));                       \
                _Pragma("GCC unroll 16") for (int r = 0; r < M; r++)                                           \
                    acc[r][u] = _mm512_dpbusd_epi32(acc[r][u], _mm512_set1_epi32((int)x[(g + u) * M + r]), wv); \
            }                                                                                                   \
        }                                                                                                       \
        for (; g < k4; g++) {                                                                                   \
            __m512i wv = _mm512_loadu_si512((const void *)(w + g * 4 * BLOCK));                                 \
            for (int r = 0; r < M; r++)                                                                         \
                acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], _mm512_set1_epi32((int)x[g * M + r]), wv);           \
        }                                                                                                       \
        for (int r = 0; r < M; r++) {                                                                           \
            __m512i s = acc[r][0];                                                                              \
            for (int u = 1; u < U; u++) s = _mm512_add_epi32(s, acc[r][u]);                                     \
            _mm512_storeu_si512((void *)(out + r * BLOCK), s);                                                  \
        }                                                                                                       \
    }
#define TILES8(T) T(1, 4) T(2, 4) T(3, 2) T(4, 2) T(5, 2) T(6, 2) T(7, 1) T(8, 1) T(9, 1) T(10, 1) T(11, 1)     \
                  T(12, 1) T(13, 1) T(14, 1) T(15, 1) T(16, 1)
TILES8(TILE_VNNI)
static const tile_fn TILES_VNNI[TILE_ROWS + 1] = {0, tile_vnni_1, tile_vnni_2, tile_vnni_3, tile_vnni_4, tile_vnni_5,
    tile_vnni_6, tile_vnni_7, tile_vnni_8, tile_vnni_9, tile_vnni_10, tile_vnni_11, tile_vnni_12, tile_vnni_13,
    tile_vnni_14, tile_vnni_15, tile_vnni_16};
#endif

/* sums of a tile -> y rows row .. row + rows - 1, columns col .. col + width - 1:
 * ((float)(acc - corr[c]) * xs[r]) * w_scale[c] (+ bias[c]) */
__attribute__((optimize("fp-contract=off")))   /* the reference multiplies, rounds, then adds the bias: no FMA */
static void store_tile(void *y, int xtype, int64_t n, int64_t row, int64_t col, int64_t width, int64_t rows,
                       const int32_t *out, const float *xs, const float *w_scale, const int32_t *wsum,
                       int32_t corr_mul, const float *bias, int vector) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (vector) {
        __mmask16 mask = width == BLOCK ? (__mmask16)0xffff : (__mmask16)((1u << width) - 1);
        __m512 s = _mm512_maskz_loadu_ps(mask, w_scale + col);
        __m512i corr = _mm512_mullo_epi32(_mm512_maskz_loadu_epi32(mask, wsum + col), _mm512_set1_epi32(corr_mul));
        __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
        for (int64_t r = 0; r < rows; r++) {
            __m512i a = _mm512_sub_epi32(_mm512_loadu_si512((const void *)(out + r * BLOCK)), corr);
            __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(xs[r])), s);
            if (bias) v = _mm512_add_ps(v, bv);
            int64_t at = (row + r) * n + col;
            if (xtype == X_F32) {
                _mm512_mask_storeu_ps((float *)y + at, mask, v);
                continue;
            }
            _mm256_mask_storeu_epi16((uint16_t *)y + at, mask, float16_to_bf16(v));
        }
        return;
    }
#endif
    (void)vector;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < width; c++) {
            int32_t a = out[r * BLOCK + c] - corr_mul * wsum[col + c];
            float v = ((float)a * xs[r]) * w_scale[col + c];
            if (bias) v += bias[col + c];
            int64_t at = (row + r) * n + col + c;
            if (xtype == X_F32) ((float *)y)[at] = v;
            else ((uint16_t *)y)[at] = float_to_bf16(v);
        }
}

/* x [m, k] (xtype) times w (w8a8_blocks of q [n, k]) with w_scale [n] fp32, wsum [n] = sum_k q[n, k], bias [n]
 * fp32 or NULL -> y [m, n] (xtype). is_static: per-tensor in_scale / in_offset, else per-row dynamic. portable:
 * the plain C path. Returns 0, or -1 if a work buffer could not be allocated. */
int w8a8_gemm(const void *x, int xtype, int64_t m, int64_t k, const int8_t *w, const float *w_scale,
              const int32_t *wsum, int64_t n, const float *bias, int is_static, float in_scale, int in_offset,
              void *y, int threads, int portable) {
    if (m <= 0 || n <= 0) return 0;
    int64_t nb = (n + BLOCK - 1) / BLOCK, k4 = (k + 3) / 4;
    const tile_fn *tiles = 0;
    int vector = 0;
    (void)portable;
#ifdef HAVE_VNNI
    if (!portable) tiles = TILES_VNNI, vector = 1;
#endif
    int64_t panel = PANEL_BYTES / (k4 * 4) / TILE_ROWS * TILE_ROWS;
    if (panel < TILE_ROWS) panel = TILE_ROWS;
    if (panel > m) panel = m;
    int32_t corr_mul = 128 + (is_static ? in_offset : 0);
    uint8_t *buf = malloc(panel * k4 * 4);
    float *xs = malloc(panel * sizeof(float));
    int fail = !buf || !xs;
    if (fail) {
        free(buf);
        free(xs);
        return -1;
    }
#pragma omp parallel num_threads(threads)
    {
        float *row = xtype == X_BF16 ? malloc(k * sizeof(float)) : 0;
        if (xtype == X_BF16 && !row) {
#pragma omp atomic write
            fail = 1;
        }
#pragma omp barrier
        if (!fail) {
            for (int64_t r0 = 0; r0 < m; r0 += panel) {
                int64_t rows = m - r0 < panel ? m - r0 : panel;
                const char *src = (const char *)x + r0 * k * (xtype == X_F32 ? 4 : 2);
#pragma omp for schedule(static)
                for (int64_t i = 0; i < rows; i++)
                    xs[i] = quantize_row(src, xtype, i, rows, k, is_static, in_scale, in_offset, vector, row, buf);
#pragma omp for schedule(static)
                for (int64_t b = 0; b < nb; b++) {
                    const int8_t *wb = w + b * k4 * 4 * BLOCK;
                    int64_t width = n - b * BLOCK < BLOCK ? n - b * BLOCK : BLOCK;
                    int32_t out[TILE_ROWS * BLOCK];
                    for (int64_t t = 0; t < rows; t += TILE_ROWS) {
                        int64_t tr = rows - t < TILE_ROWS ? rows - t : TILE_ROWS;
                        const uint32_t *xt = (const uint32_t *)buf + t * k4;
                        if (tiles) tiles[tr](xt, k4, wb, out);
                        else tile_portable(xt, tr, k4, wb, out);
                        store_tile(y, xtype, n, r0 + t, b * BLOCK, width, tr, out, xs + t, w_scale, wsum, corr_mul,
                                   bias, vector);
                    }
                }
            }
        }
        free(row);
    }
    free(buf);
    free(xs);
    return fail ? -1 : 0;
}
