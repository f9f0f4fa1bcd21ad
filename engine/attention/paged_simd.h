/* What the CPU native kernels share (paged_decode.c, paged_prefill.c; the bf16 conversions and exp also the
 * quantized matmuls in engine/quant/ and the kernels in engine/layers/): the dtype kinds of queries and pool rows, bf16 <-> fp32 as torch rounds, and the
 * AVX-512 loads and exp. Static inline: each kernel file compiles its own copy. */
#ifndef PDCLUSTER_PAGED_SIMD_H
#define PDCLUSTER_PAGED_SIMD_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))

enum { KIND_F32, KIND_BF16, KIND_F16, KIND_I8 };
#define SCALE_BYTES 2   /* fp16 scale after each int8 row */

INLINE float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

INLINE uint16_t float_to_bf16(float f) {   /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);   /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* exp(x) for x <= 0 (a score minus the running maximum), Cephes' expf polynomial, ~1 ulp. Below -87.3
 * it returns ~1e-38 instead of 0, which does not change a softmax sum. */
INLINE float exp_nonpositive(float x) {
    x = x < -87.3f ? -87.3f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

INLINE int64_t elem_size(int kind) { return kind == KIND_F32 ? 4 : kind == KIND_I8 ? 1 : 2; }

/* Elements from one KV head's row to the next in the cache. */
INLINE int64_t head_stride(int64_t d, int ckind) { return ckind == KIND_I8 ? d + SCALE_BYTES : d; }

#ifdef __AVX512F__
/* 16 fp32 lanes as bf16, rounded to nearest even as torch does (NaN kept a NaN). */
INLINE __m256i float16_to_bf16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

/* 16 values of `kind` at p, widened to fp32 (int8: the raw values, the row scale applied by the caller). */
INLINE __m512 load16(const char *p, int kind) {
    if (kind == KIND_F32) return _mm512_loadu_ps(p);
    if (kind == KIND_I8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (kind == KIND_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* exp(x) on 16 lanes for x <= 0 (a score minus the running maximum): Cephes' expf polynomial, ~1 ulp. Below
 * -87.3 it returns ~1e-38 instead of 0, which does not change a softmax sum. */
INLINE __m512 exp16_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGED_AVX2 1   /* the 8-lane paths of CPUs without AVX-512 (AMD Zen 2/3, Intel before Skylake-SP) */

/* 8 values of `kind` at p, widened to fp32 (int8: the raw values, the row scale applied by the caller). */
INLINE __m256 load8(const char *p, int kind) {
    if (kind == KIND_F32) return _mm256_loadu_ps((const float *)p);
    if (kind == KIND_I8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (kind == KIND_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* Lane t of the result = the sum of v[t]'s 8 lanes. */
INLINE __m256 sum8x8(const __m256 v[8]) {
    __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
    __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
    a = _mm256_hadd_ps(a, b);   /* per 128-bit half: v0..v3's partial sums */
    c = _mm256_hadd_ps(c, d);   /* v4..v7's */
    return _mm256_add_ps(_mm256_permute2f128_ps(a, c, 0x20), _mm256_permute2f128_ps(a, c, 0x31));
}

/* exp16_nonpositive on 8 lanes. */
INLINE __m256 exp8_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

#endif
