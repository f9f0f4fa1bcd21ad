/* W8A16 matrix-vector products for decode-sized batches: y[m, n] = scale[n] * sum_k x[m, k] * q[n, k].
 *
 * q is the canonical int8 weight [N, K] (row-major, per-output-channel scales), x a few float32 rows [M, K].
 * Decode at small batch reads every weight once per step, so the kernel streams q once, converts each 16 int8
 * weights to float32 in registers and multiplies them into every row of x (M <= INT8_GEMV_MAX_ROWS), float32
 * accumulation; output rows are split across OpenMP threads. torch's _weight_int8pack_mm reached ~20 GB/s where
 * the bf16 GEMM reached ~27 GB/s on the same layers at one row (docs/benchmarks.md): this one reads half the bytes
 * of bf16 at the same rate.
 *
 * Compiled on first use by engine/attention/native.py (cc -O3 -march=native -fopenmp); loaded with ctypes.
 */
#include <stdint.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define INT8_GEMV_MAX_ROWS 8

static void rows_scalar(const float *x, int64_t m, int64_t k, const int8_t *q, float scale, float *acc) {
    for (int64_t r = 0; r < m; r++) {
        float s = 0.0f;
        for (int64_t i = 0; i < k; i++) s += x[r * k + i] * (float)q[i];
        acc[r] = s * scale;
    }
}

#ifdef __AVX512F__
static inline __m512 weights16(const int8_t *q, __mmask16 mask) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, q)));
}

/* One weight row against M input rows, U independent accumulators per row (an FMA's latency would otherwise
 * bound one row at a time); M and U are constants in each instance, so the accumulators live in registers. */
#define GEMV_ROW(M, U)                                                                                        \
    static void row_##M(const float *x, int64_t k, const int8_t *q, float scale, float *out) {               \
        __m512 acc[M][U];                                                                                     \
        _Pragma("GCC unroll 8") for (int r = 0; r < M; r++)                                                  \
            _Pragma("GCC unroll 4") for (int u = 0; u < U; u++) acc[r][u] = _mm512_setzero_ps();             \
        int64_t i = 0;                                                                                        \
        for (; i + 16 * U <= k; i += 16 * U)                                                                  \
            _Pragma("GCC unroll 4") for (int u = 0; u < U; u++) {                                            \
                __m512 w = weights16(q + i + 16 * u, 0xFFFF);                                                 \
                _Pragma("GCC unroll 8") for (int r = 0; r < M; r++)                                          \
                    acc[r][u] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + r * k + i + 16 * u), acc[r][u]);       \
            }                                                                                                 \
        for (; i < k; i += 16) {                                                                              \
            __mmask16 mask = k - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - i)) - 1u);            \
            __m512 w = weights16(q + i, mask);                                                                \
            _Pragma("GCC unroll 8") for (int r = 0; r < M; r++)                                              \
                acc[r][0] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(mask, x + r * k + i), acc[r][0]);        \
        }                                                                                                     \
        _Pragma("GCC unroll 8") for (int r = 0; r < M; r++) {                                                \
            __m512 sum = acc[r][0];                                                                           \
            _Pragma("GCC unroll 4") for (int u = 1; u < U; u++) sum = _mm512_add_ps(sum, acc[r][u]);         \
            out[r] = _mm512_reduce_add_ps(sum) * scale;                                                       \
        }                                                                                                     \
    }
GEMV_ROW(1, 4)
GEMV_ROW(2, 2)
GEMV_ROW(3, 2)
GEMV_ROW(4, 1)
GEMV_ROW(5, 1)
GEMV_ROW(6, 1)
GEMV_ROW(7, 1)
GEMV_ROW(8, 1)

typedef void (*row_fn)(const float *, int64_t, const int8_t *, float, float *);
static const row_fn ROWS[INT8_GEMV_MAX_ROWS + 1] = {0, row_1, row_2, row_3, row_4, row_5, row_6, row_7, row_8};
#endif

/* x [m, k] float32, q [n, k] int8, scales [n] float32 -> y [m, n] float32. Returns -1 for m outside
 * 1..INT8_GEMV_MAX_ROWS. */
int int8_gemv_f32(const float *x, int64_t m, int64_t k, const int8_t *q, const float *scales, int64_t n, float *y,
                  int threads) {
    if (m < 1 || m > INT8_GEMV_MAX_ROWS) return -1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t j = 0; j < n; j++) {
        float out[INT8_GEMV_MAX_ROWS];
#ifdef __AVX512F__
        ROWS[m](x, k, q + j * k, scales[j], out);
#else
        rows_scalar(x, m, k, q + j * k, scales[j], out);
#endif
        for (int64_t r = 0; r < m; r++) y[r * n + j] = out[r];
    }
    return 0;
}

/* the portable path, exported so tests compare it with the vector one on AVX-512 machines */
int int8_gemv_f32_scalar(const float *x, int64_t m, int64_t k, const int8_t *q, const float *scales, int64_t n,
                         float *y, int threads) {
    if (m < 1 || m > INT8_GEMV_MAX_ROWS) return -1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t j = 0; j < n; j++) {
        float out[INT8_GEMV_MAX_ROWS];
        rows_scalar(x, m, k, q + j * k, scales[j], out);
        for (int64_t r = 0; r < m; r++) y[r * n + j] = out[r];
    }
    return 0;
}
