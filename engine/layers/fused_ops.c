/* The elementwise work between a decoder layer's GEMMs on CPU, one pass each instead of torch's chain of
 * eager ops (each a fresh tensor and a trip through memory): the residual add + RMSNorm, SiLU(gate) x up, and
 * the rotate-half rotary embedding. In eager mode these were ~30 % of a 2048-token bf16 prefill and ~10 % of
 * a decode step (docs/benchmarks.md "Fused elementwise kernels").
 *
 * Results are torch's eager ones: every intermediate the torch chain rounds to the model dtype is rounded
 * here too, the same way (round to nearest even), so the add and the rotary are bit-identical; the norm's sum
 * of squares (summation order) and SiLU's exp (a polynomial, ~1 ulp in fp32) may differ from torch's by a
 * rounding step of the last bit. No multiply-add contraction: torch rounds the product before the add.
 *
 * Compiled on first use by engine/attention/native.py (cc -O3 -march=native -fopenmp); loaded with ctypes.
 * Rows are split over `threads` OpenMP threads when there are enough of them to pay for the fork. */
#pragma GCC optimize("fp-contract=off")   /* GCC */
#pragma STDC FP_CONTRACT OFF              /* clang (GCC ignores it) */
#include "../attention/paged_simd.h"   /* bf16 <-> fp32 as torch rounds, KIND_* */
#ifdef _OPENMP
#include <omp.h>
#endif

#define PARALLEL_MIN 32768   /* elements below which one thread does the whole call */

/* Value i of a row of `kind` (F32 or BF16) as fp32, and back, rounded as torch rounds a result of that dtype. */
INLINE float get(const void *p, int64_t i, int kind) {
    return kind == KIND_BF16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE void put(void *p, int64_t i, float x, int kind) {
    if (kind == KIND_BF16) ((uint16_t *)p)[i] = float_to_bf16(x);
    else ((float *)p)[i] = x;
}

/* x as stored in `kind` (the rounding a torch op of that dtype applies to its result). */
INLINE float rounded(float x, int kind) { return kind == KIND_BF16 ? bf16_to_float(float_to_bf16(x)) : x; }

static int threads_for(int64_t elements, int threads) { return elements >= PARALLEL_MIN && threads > 1 ? threads : 1; }

static int valid_kind(int kind) { return kind == KIND_F32 || kind == KIND_BF16; }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FUSED_AVX512 1
/* Lanes i .. i + 15 of a row of n values (those past n masked: loaded as 0, not stored). */
INLINE __mmask16 lanes(int64_t i, int64_t n) { return n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1); }

/* fp32 -> bf16, round to nearest even: one instruction with AVX512-BF16 (which flushes fp32 denormals, never
 * an activation's magnitude, to zero), else torch's bit arithmetic. */
INLINE __m256i to_bf16(__m512 x) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(x);
#else
    return float16_to_bf16(x);
#endif
}

INLINE __m512 vget(const void *p, int64_t i, int64_t n, int kind) {
    __mmask16 m = lanes(i, n);
    if (kind == KIND_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
            _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i)), 16));
    return _mm512_maskz_loadu_ps(m, (const float *)p + i);
}

INLINE void vput(void *p, int64_t i, int64_t n, __m512 x, int kind) {
    __mmask16 m = lanes(i, n);
    if (kind == KIND_BF16) _mm256_mask_storeu_epi16((uint16_t *)p + i, m, to_bf16(x));
    else _mm512_mask_storeu_ps((float *)p + i, m, x);
}

INLINE __m512 vrounded(__m512 x, int kind) {
    if (kind != KIND_BF16) return x;
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(x)), 16));
}
#elif defined(PAGED_AVX2)
#define FUSED_AVX2 1   /* 8 lanes on CPUs without AVX-512; a row's last n % 8 values take the plain C code */
/* 8 fp32 lanes as bf16, rounded to nearest even as torch does (NaN kept a NaN). */
INLINE __m128i to_bf16x8(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));   /* (values < 2^16) */
}

INLINE __m256 vget8(const void *p, int64_t i, int kind) { return load8((const char *)p + i * elem_size(kind), kind); }

INLINE void vput8(void *p, int64_t i, __m256 x, int kind) {
    if (kind == KIND_BF16) _mm_storeu_si128((__m128i *)((uint16_t *)p + i), to_bf16x8(x));
    else _mm256_storeu_ps((float *)p + i, x);
}

INLINE __m256 vrounded8(__m256 x, int kind) {
    if (kind != KIND_BF16) return x;
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(to_bf16x8(x)), 16));
}
#endif

/* The plain C rows (the reference the tests compare with; without AVX-512 or AVX2 the library declines these calls,
 * `fused_ops_vectorized`, and the layers keep torch's ops, which are vectorised there). */
static void add_row(const void *x, const void *r, void *out, int64_t n, int kind) {
    for (int64_t i = 0; i < n; i++) put(out, i, get(x, i, kind) + get(r, i, kind), kind);
}

static void norm_row(const void *s, const void *weight, void *y, int64_t n, float eps, int kind) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += get(s, i, kind) * get(s, i, kind);
    float inv = 1.0f / sqrtf(sum / (float)n + eps);
    for (int64_t i = 0; i < n; i++) put(y, i, get(weight, i, kind) * rounded(get(s, i, kind) * inv, kind), kind);
}

/* SiLU(x) = x * sigmoid(x) in fp32, sigmoid through exp(-|x|) <= 1 (no overflow either side). */
INLINE float silu(float x) {
    float e = exp_nonpositive(-fabsf(x));
    return x * (x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e));
}

static void silu_mul_row(const void *g, const void *u, void *o, int64_t n, int kind) {
    for (int64_t i = 0; i < n; i++) put(o, i, rounded(silu(get(g, i, kind)), kind) * get(u, i, kind), kind);
}

static void rotary_head(const char *x, const char *c, const char *s, char *o, int64_t d, int kind) {
    int64_t half = d / 2;
    for (int64_t i = 0; i < d; i++) {
        float rot = i < half ? -get(x, i + half, kind) : get(x, i - half, kind);
        put(o, i, rounded(get(x, i, kind) * get(c, i, kind), kind) + rounded(rot * get(s, i, kind), kind), kind);
    }
}

#ifdef FUSED_AVX512
static void add_row16(const void *x, const void *r, void *out, int64_t n, int kind) {
    for (int64_t i = 0; i < n; i += 16) vput(out, i, n, _mm512_add_ps(vget(x, i, n, kind), vget(r, i, n, kind)), kind);
}

static void norm_row16(const void *s, const void *weight, void *y, int64_t n, float eps, int kind) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        __m512 v = vget(s, i, n, kind);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)n + eps));
    for (int64_t i = 0; i < n; i += 16)
        vput(y, i, n, _mm512_mul_ps(vget(weight, i, n, kind), vrounded(_mm512_mul_ps(vget(s, i, n, kind), inv), kind)),
             kind);
}

static void silu_mul_row16(const void *g, const void *u, void *o, int64_t n, int kind) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < n; i += 16) {
        __m512 v = vget(g, i, n, kind);
        __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(v)));
        __mmask16 positive = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GE_OQ);
        __m512 den = _mm512_add_ps(one, e), inv = _mm512_rcp14_ps(den);               /* 1 / (1 + e): 14 bits, */
        inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.0f)));   /* a Newton step: ~24 */
        __m512 sigmoid = _mm512_mask_blend_ps(positive, _mm512_mul_ps(e, inv), inv);
        vput(o, i, n, _mm512_mul_ps(vrounded(_mm512_mul_ps(v, sigmoid), kind), vget(u, i, n, kind)), kind);
    }
}

static void rotary_head16(const char *x, const char *c, const char *s, char *o, int64_t d, int kind) {
    int64_t half = d / 2, size = kind == KIND_BF16 ? 2 : 4;
    for (int64_t i = 0; i < half; i += 16) {   /* lanes i.. of each half: x1 with -x2, x2 with x1 */
        __m512 x1 = vget(x, i, half, kind), x2 = vget(x + half * size, i, half, kind);
        __m512 c1 = vget(c, i, half, kind), c2 = vget(c + half * size, i, half, kind);
        __m512 s1 = vget(s, i, half, kind), s2 = vget(s + half * size, i, half, kind);
        __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), x2);
        vput(o, i, half, _mm512_add_ps(vrounded(_mm512_mul_ps(x1, c1), kind), vrounded(_mm512_mul_ps(neg, s1), kind)),
             kind);
        vput(o + half * size, i, half,
             _mm512_add_ps(vrounded(_mm512_mul_ps(x2, c2), kind), vrounded(_mm512_mul_ps(x1, s2), kind)), kind);
    }
}
#endif

#ifdef FUSED_AVX2
static void add_row8(const void *x, const void *r, void *out, int64_t n, int kind) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) vput8(out, i, _mm256_add_ps(vget8(x, i, kind), vget8(r, i, kind)), kind);
    for (; i < n; i++) put(out, i, get(x, i, kind) + get(r, i, kind), kind);
}

static void norm_row8(const void *s, const void *weight, void *y, int64_t n, float eps, int kind) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = vget8(s, i, kind);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    float sum = _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
    for (int64_t t = i; t < n; t++) sum += get(s, t, kind) * get(s, t, kind);
    float inv = 1.0f / sqrtf(sum / (float)n + eps);
    __m256 vinv = _mm256_set1_ps(inv);
    for (i = 0; i + 8 <= n; i += 8)
        vput8(y, i, _mm256_mul_ps(vget8(weight, i, kind), vrounded8(_mm256_mul_ps(vget8(s, i, kind), vinv), kind)),
              kind);
    for (; i < n; i++) put(y, i, get(weight, i, kind) * rounded(get(s, i, kind) * inv, kind), kind);
}

static void silu_mul_row8(const void *g, const void *u, void *o, int64_t n, int kind) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = vget8(g, i, kind);
        __m256 e = exp8_nonpositive(_mm256_or_ps(v, sign));   /* exp(-|v|) */
        __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
        __m256 sigmoid = _mm256_blendv_ps(_mm256_mul_ps(e, inv), inv, _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GE_OQ));
        vput8(o, i, _mm256_mul_ps(vrounded8(_mm256_mul_ps(v, sigmoid), kind), vget8(u, i, kind)), kind);
    }
    for (; i < n; i++) put(o, i, rounded(silu(get(g, i, kind)), kind) * get(u, i, kind), kind);
}

static void rotary_head8(const char *x, const char *c, const char *s, char *o, int64_t d, int kind) {
    int64_t half = d / 2, size = elem_size(kind), i = 0;
    for (; i + 8 <= half; i += 8) {   /* lanes i.. of each half: x1 with -x2, x2 with x1 */
        __m256 x1 = vget8(x, i, kind), x2 = vget8(x + half * size, i, kind);
        __m256 c1 = vget8(c, i, kind), c2 = vget8(c + half * size, i, kind);
        __m256 s1 = vget8(s, i, kind), s2 = vget8(s + half * size, i, kind);
        __m256 neg = _mm256_sub_ps(_mm256_setzero_ps(), x2);
        vput8(o, i, _mm256_add_ps(vrounded8(_mm256_mul_ps(x1, c1), kind), vrounded8(_mm256_mul_ps(neg, s1), kind)),
              kind);
        vput8(o + half * size, i,
              _mm256_add_ps(vrounded8(_mm256_mul_ps(x2, c2), kind), vrounded8(_mm256_mul_ps(x1, s2), kind)), kind);
    }
    for (; i < half; i++) {
        float x1 = get(x, i, kind), x2 = get(x, i + half, kind);
        put(o, i, rounded(x1 * get(c, i, kind), kind) + rounded(-x2 * get(s, i, kind), kind), kind);
        put(o, i + half, rounded(x2 * get(c, i + half, kind), kind) + rounded(x1 * get(s, i + half, kind), kind), kind);
    }
}
#endif

/* 1 where the kernels below have a vector path (AVX-512, or AVX2 + FMA); 0: they decline every call not marked
 * `portable`. */
int fused_ops_vectorized(void) {
#if defined(FUSED_AVX512) || defined(FUSED_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* Whether a call goes ahead: a kind it takes, and a vector path (or the plain C path asked for). */
static int takes(int kind, int portable) { return valid_kind(kind) && (portable || fused_ops_vectorized()); }

/* y = weight * norm(s), s = x + residual (or x without one), over `rows` rows of `hidden` values of `kind`;
 * s is written to residual_out when a residual is given. norm(s) = s * rsqrt(mean(s^2) + eps) in fp32, rounded to
 * the dtype before the weight multiplies it, as `weight * F.rms_norm(s.float()).to(dtype)` does. Returns -2 for a
 * call it declines. portable: the plain C path. */
int rms_norm(const void *x, const void *residual, void *residual_out, const void *weight, void *y, int64_t rows,
             int64_t hidden, float eps, int kind, int threads, int portable) {
    if (!takes(kind, portable)) return -2;
    int nt = threads_for(rows * hidden, threads);
    int64_t bytes = hidden * (kind == KIND_BF16 ? 2 : 4);
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const char *src = (const char *)x + r * bytes;
        char *yr = (char *)y + r * bytes;
        if (residual) {
            char *out = (char *)residual_out + r * bytes;
#ifdef FUSED_AVX512
            if (!portable) add_row16(src, (const char *)residual + r * bytes, out, hidden, kind);
            else
#elif defined(FUSED_AVX2)
            if (!portable) add_row8(src, (const char *)residual + r * bytes, out, hidden, kind);
            else
#endif
                add_row(src, (const char *)residual + r * bytes, out, hidden, kind);
            src = out;
        }
#ifdef FUSED_AVX512
        if (!portable) norm_row16(src, weight, yr, hidden, eps, kind);
        else
#elif defined(FUSED_AVX2)
        if (!portable) norm_row8(src, weight, yr, hidden, eps, kind);
        else
#endif
            norm_row(src, weight, yr, hidden, eps, kind);
    }
    return 0;
}

/* out[r, i] = SiLU(gate[r, i]) * up[r, i] over `rows` rows of `n` values, with gate rows `gate_stride` and up
 * rows `up_stride` elements apart (the two halves of one [rows, 2n] tensor, or two tensors); SiLU rounded to the
 * dtype before the product, as `F.silu(gate).mul_(up)` does. */
int silu_and_mul(const void *gate, int64_t gate_stride, const void *up, int64_t up_stride, void *out, int64_t rows,
                 int64_t n, int kind, int threads, int portable) {
    if (!takes(kind, portable)) return -2;
    int nt = threads_for(rows * n, threads);
    int64_t size = kind == KIND_BF16 ? 2 : 4;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const char *g = (const char *)gate + r * gate_stride * size, *u = (const char *)up + r * up_stride * size;
        char *o = (char *)out + r * n * size;
#ifdef FUSED_AVX512
        if (!portable) silu_mul_row16(g, u, o, n, kind);
        else
#elif defined(FUSED_AVX2)
        if (!portable) silu_mul_row8(g, u, o, n, kind);
        else
#endif
            silu_mul_row(g, u, o, n, kind);
    }
    return 0;
}

/* The rotate-half rotary embedding: for each of `rows` token rows of `heads` heads of d values (a token's heads
 * contiguous, rows `row_stride` elements apart), out = x * cos + cat(-x2, x1) * sin with the token's cos / sin
 * rows of d values (`table_stride` apart), each product and the sum rounded to the dtype as torch's three ops
 * do. out is [rows, heads, d] contiguous. */
int rotary(const void *x, int64_t row_stride, const void *cos, const void *sin, int64_t table_stride, void *out,
           int64_t rows, int64_t heads, int64_t d, int kind, int threads, int portable) {
    if (!takes(kind, portable) || d % 2) return -2;
    int nt = threads_for(rows * heads * d, threads);
    int64_t size = kind == KIND_BF16 ? 2 : 4;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const char *c = (const char *)cos + r * table_stride * size, *s = (const char *)sin + r * table_stride * size;
        for (int64_t h = 0; h < heads; h++) {
            const char *xh = (const char *)x + (r * row_stride + h * d) * size;
            char *oh = (char *)out + (r * heads + h) * d * size;
#ifdef FUSED_AVX512
            if (!portable) rotary_head16(xh, c, s, oh, d, kind);
            else
#elif defined(FUSED_AVX2)
            if (!portable) rotary_head8(xh, c, s, oh, d, kind);
            else
#endif
                rotary_head(xh, c, s, oh, d, kind);
        }
    }
    return 0;
}
