/* Paged prefill attention for CPUs with AVX-512 or AVX2: the query rows of one prompt chunk (positions c .. c+n-1)
 * attend causally to the chunk's K/V and the context before it, read through the sequence's block table from
 * the pool, in fp32 with an online softmax (flash attention's loop, register-tiled for AVX-512).
 *
 * Why not torch's SDPA: its CPU flash kernel runs small GEMM calls per tile and, without AMX, computes bf16 at
 * fp32 speed anyway; on a 2k-token prompt it spent ~50 % of a prefill step (docs/benchmarks.md, "Prefill
 * attention"). Here, per KV head, the keys are packed once into fp32 K^T [D][L] and V [L][D] (any pool dtype,
 * int8 rows dequantized with their scale), then every query head of the group walks them in 64-key tiles:
 * scores of 4 rows x 64 keys in 16 registers, the weighted V sum of 4 rows (D = 64) in 16 more.
 *
 * With AMX-BF16 (and the kernel's permission for the tiles) the bf16 path computes both products on the tile unit:
 * 16 query rows x 64 keys of scores per step from the same packed pairs (kt2 is AMX's B layout for q K^T, vp2 for
 * p V), the online softmax in AVX-512 between them; 1.2-1.7x torch's flash SDPA, which runs on the tiles too
 * (docs/benchmarks.md "Prefill attention").
 *
 * Layout (engine/kv_cache.py) as in paged_decode.c: a layer's K and V caches [num_blocks, block_size, Hkv, row],
 * blocks `block_stride` elements apart, int32 block table; row = D (float pool) or D int8 values + an fp16 scale.
 * On CPUs with AVX2 but not AVX-512 (AMD Zen 2/3, Intel before Skylake-SP) the same fp32 loop runs on 8 lanes
 * (below, after the AVX-512 code). Compiled with paged_decode.c into one library by engine/attention/native.py;
 * without AVX-512 or AVX2 the functions return -2 and the caller keeps the torch path.
 */
#include "paged_simd.h"

#define MR 16   /* query rows of one work item */
#define KT 64   /* keys of one tile: four 16-lane vectors */

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define PF_AMX 1
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux lets a process use the tile registers only once it asked (5.16+; oneDNN asks too, but may not have yet). */
static int amx_permitted(void) {
    static int state = 0;   /* 0: not asked yet, 1: granted, -1: refused */
    if (state == 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
}

/* Every tile used here is 16 rows x 64 bytes: 16 x 32 bf16 (A: query or p rows; B: 16 pairs of keys or dims, in
 * the pairs layouts pack_head_bf16 writes) or 16 x 16 fp32 (C: scores, or 16 rows of the V sum). Tiles 0-3 hold C,
 * 4 A, 5 B. The configuration is per thread: each work item loads it and releases the tiles at its end. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* A constant in memory, not a stack struct filled before the load: GCC does not see ldtilecfg read its operand
 * and may drop the stores that fill one. */
static const tile_config AMX_CONFIG __attribute__((aligned(64))) = {
    .palette = 1, .colsb = {64, 64, 64, 64, 64, 64}, .rows = {16, 16, 16, 16, 16, 16}};

INLINE void amx_configure(void) { _tile_loadconfig(&AMX_CONFIG); }
#endif

#if defined(__AVX512F__) || defined(PAGED_AVX2)
/* The K and V rows of position `pos`, KV head h, in the pool, and their scales (an int8 row's fp16 scale, else 1). */
INLINE void kv_rows(int ckind, int64_t d, const void *k_pool, const void *v_pool, const int32_t *table, int64_t pos,
                    int64_t h, int64_t hkv, int64_t bs, int64_t block_stride, const char **kr, const char **vr,
                    float *ks, float *vs) {
    const int64_t hs = ckind == KIND_I8 ? d + SCALE_BYTES : d, es = elem_size(ckind);
    const int64_t off = (table[pos / bs] * block_stride + (pos % bs) * hkv * hs + h * hs) * es;
    *kr = (const char *)k_pool + off, *vr = (const char *)v_pool + off;
    *ks = *vs = 1.0f;
    if (ckind == KIND_I8) {
        uint16_t a, b;
        memcpy(&a, *kr + d, 2);
        memcpy(&b, *vr + d, 2);
        *ks = _cvtsh_ss(a), *vs = _cvtsh_ss(b);
    }
}
#endif

#ifdef __AVX512F__
INLINE void store16(char *p, __m512 x, int kind) {
    if (kind == KIND_F32) _mm512_storeu_ps(p, x);
    else if (kind == KIND_F16) _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    else _mm256_storeu_si256((__m256i *)p, float16_to_bf16(x));
}

#define LOG2E 1.44269504088896341f

/* 2^x on 16 lanes for finite x <= ~0: 2^round(x) times a degree-5 polynomial for 2^f, |f| <= 1/2 (fitted for
 * relative error, 2.3e-7 in fp32: about two units in the last place), ~10 instructions where exp16_nonpositive
 * takes ~15; below -126 it goes to subnormals and 0, which a softmax sum does not notice. */
INLINE __m512 exp2_16(__m512 x) {
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.3266970636e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6754599362e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5507425219e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022121727e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314694405e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001192f));
    return _mm512_scalef_ps(p, n);
}


/* Keys kfirst..kend-1 of KV head h into kt [D][lp] and vp [L][D] (fp32; keys from kend to lp are zero). */
INLINE void pack_head(int ckind, const int NV, const void *k_pool, const void *v_pool, const int32_t *table,
                      int64_t kfirst, int64_t kend, int64_t lp, int64_t h, int64_t hkv, int64_t bs,
                      int64_t block_stride, float *kt, float *vp) {
    const int64_t d = 16 * NV, es = elem_size(ckind), len = kend - kfirst;
#pragma omp for schedule(static)
    for (int64_t t0 = 0; t0 < lp; t0 += 16) {
        float tile[16 * 256] __attribute__((aligned(64)));   /* 16 keys x D, then transposed into kt */
        int64_t cnt = len - t0 < 16 ? (len - t0 > 0 ? len - t0 : 0) : 16;
        for (int64_t t = 0; t < 16; t++) {
            if (t >= cnt) {   /* padding keys: zero, so that a masked p (0) times them stays 0 */
                for (int j = 0; j < NV; j++) {
                    _mm512_store_ps(tile + t * d + 16 * j, _mm512_setzero_ps());
                    _mm512_storeu_ps(vp + (t0 + t) * d + 16 * j, _mm512_setzero_ps());
                }
                continue;
            }
            const char *kr, *vr;
            float kscale, vscale;
            kv_rows(ckind, d, k_pool, v_pool, table, kfirst + t0 + t, h, hkv, bs, block_stride, &kr, &vr, &kscale, &vscale);
            const __m512 ks = _mm512_set1_ps(kscale), vs = _mm512_set1_ps(vscale);
            for (int j = 0; j < NV; j++) {
                _mm512_store_ps(tile + t * d + 16 * j, _mm512_mul_ps(load16(kr + 16 * j * es, ckind), ks));
                _mm512_storeu_ps(vp + (t0 + t) * d + 16 * j, _mm512_mul_ps(load16(vr + 16 * j * es, ckind), vs));
            }
        }
        for (int64_t i = 0; i < d; i++) {   /* column i of the 16 x D tile -> kt[i][t0 .. t0+15] */
            __m512i idx = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                                                                  13, 14, 15), _mm512_set1_epi32((int)d)),
                                           _mm512_set1_epi32((int)i));
            _mm512_storeu_ps(kt + i * lp + t0, _mm512_i32gather_ps(idx, tile, 4));
        }
    }
}

#ifdef __AVX512BF16__
/* bf16 pool and queries: the same keys as bf16 pairs, for vdpbf16ps (two products per fp32 lane): kt2 [D/2][lp]
 * words (the pair of dimensions 2e, 2e+1 of each key) and vp2 [lp/2][D] words (dimension e of keys 2t, 2t+1). */
INLINE void pack_head_bf16(const int NV, const void *k_pool, const void *v_pool, const int32_t *table,
                           int64_t kfirst, int64_t kend, int64_t lp, int64_t h, int64_t hkv, int64_t bs,
                           int64_t block_stride, uint32_t *kt2, uint32_t *vp2) {
    const int64_t d = 16 * NV, len = kend - kfirst;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#pragma omp for schedule(static)
    for (int64_t t0 = 0; t0 < lp; t0 += 16) {
        uint32_t tile[16 * 128] __attribute__((aligned(64)));   /* 16 keys x D/2 words */
        for (int64_t t = 0; t < 16; t += 2) {
            const uint16_t *kr[2], *vr[2];
            for (int u = 0; u < 2; u++) {
                int64_t pos = kfirst + t0 + t + u;
                if (t0 + t + u < len) {
                    int64_t off = table[pos / bs] * block_stride + (pos % bs) * hkv * d + h * d;
                    kr[u] = (const uint16_t *)k_pool + off, vr[u] = (const uint16_t *)v_pool + off;
                } else {
                    kr[u] = vr[u] = NULL;
                }
            }
            for (int j = 0; j < NV / 2; j++)
                for (int u = 0; u < 2; u++)
                    _mm512_store_si512(tile + (t + u) * (d / 2) + 16 * j,
                                       kr[u] ? _mm512_loadu_si512(kr[u] + 32 * j) : _mm512_setzero_si512());
            for (int j = 0; j < NV; j++) {   /* interleave keys t, t+1 per dimension */
                __m512i a = vr[0] ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vr[0] + 16 * j)))
                                  : _mm512_setzero_si512();
                __m512i b = vr[1] ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vr[1] + 16 * j)))
                                  : _mm512_setzero_si512();
                _mm512_storeu_si512(vp2 + ((t0 + t) / 2) * d + 16 * j, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
            }
        }
        for (int64_t e = 0; e < d / 2; e++) {
            __m512i idx = _mm512_add_epi32(_mm512_mullo_epi32(lane, _mm512_set1_epi32((int)(d / 2))),
                                           _mm512_set1_epi32((int)e));
            _mm512_storeu_si512(kt2 + e * lp + t0, _mm512_i32gather_epi32(idx, tile, 4));
        }
    }
}
#endif

/* Rows r0 .. r0+rows-1 of the chunk (positions c+r0 ..) for one query head: qf [MR][D] holds q * scale. */
INLINE void rows_item(const int NV, const int BF, const float *qf, const uint32_t *q2, int64_t rows, int64_t p0,
                      int64_t kfirst, int64_t window, const float *kt, const float *vp, const uint32_t *kt2,
                      const uint32_t *vp2, int64_t lp, float scale, float *acc, float *m, float *l) {
    const int64_t d = 16 * NV;
    (void)q2, (void)kt2, (void)vp2, (void)scale;   /* the bf16-pair path's; unused where it is not compiled */
    const int RB = NV <= 4 ? 4 : NV <= 8 ? 2 : 1;   /* rows of one weighted-V pass: 16 accumulators */
    float s[MR * KT] __attribute__((aligned(64)));
    int64_t hi = p0 + rows;   /* keys up to the last row's own position */
    int64_t lo = window > 0 && p0 - window + 1 > kfirst ? p0 - window + 1 : kfirst;
    for (int64_t r = 0; r < MR; r++) m[r] = -INFINITY, l[r] = 0.0f;
    memset(acc, 0, sizeof(float) * MR * d);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t j0 = (lo - kfirst) / KT * KT + kfirst; j0 < hi; j0 += KT) {
        const float *kcol = kt + (j0 - kfirst);
#ifdef PF_AMX
        if (BF == 2) {   /* scores of all 16 rows x 64 keys on the tile unit: q2 (A) against kt2's pairs (B) */
            const uint32_t *kcol2 = kt2 + (j0 - kfirst);
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int64_t e = 0; e < d / 2; e += 16) {   /* 32 dimensions per step */
                _tile_loadd(4, q2 + e, d * 2);
                _tile_loadd(5, kcol2 + e * lp, lp * 4);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(5, kcol2 + e * lp + 16, lp * 4);
                _tile_dpbf16ps(1, 4, 5);
                _tile_loadd(5, kcol2 + e * lp + 32, lp * 4);
                _tile_dpbf16ps(2, 4, 5);
                _tile_loadd(5, kcol2 + e * lp + 48, lp * 4);
                _tile_dpbf16ps(3, 4, 5);
            }
            _tile_stored(0, s, KT * 4); _tile_stored(1, s + 16, KT * 4);
            _tile_stored(2, s + 32, KT * 4); _tile_stored(3, s + 48, KT * 4);   /* unscaled: the softmax scales */
        }
#endif
        /* Scores: 4 rows x 64 keys per pass, summed over D. */
        for (int64_t r = 0; r < (BF == 2 ? 0 : rows); r += 4) {
            __m512 a[4][4];
            for (int i = 0; i < 4; i++)
                for (int v = 0; v < 4; v++) a[i][v] = _mm512_setzero_ps();
#ifdef __AVX512BF16__
            if (BF) {   /* q2: bf16 pairs of the raw q; the scale is applied to the sums */
                const uint32_t *kcol2 = kt2 + (j0 - kfirst);
                for (int64_t e = 0; e < d / 2; e++) {
                    const uint32_t *kr = kcol2 + e * lp;
                    __m512bh k0 = (__m512bh)_mm512_loadu_si512(kr), k1 = (__m512bh)_mm512_loadu_si512(kr + 16),
                             k2 = (__m512bh)_mm512_loadu_si512(kr + 32), k3 = (__m512bh)_mm512_loadu_si512(kr + 48);
                    for (int i = 0; i < 4; i++) {
                        __m512bh qb = (__m512bh)_mm512_set1_epi32((int)q2[(r + i) * (d / 2) + e]);
                        a[i][0] = _mm512_dpbf16_ps(a[i][0], qb, k0);
                        a[i][1] = _mm512_dpbf16_ps(a[i][1], qb, k1);
                        a[i][2] = _mm512_dpbf16_ps(a[i][2], qb, k2);
                        a[i][3] = _mm512_dpbf16_ps(a[i][3], qb, k3);
                    }
                }
                for (int i = 0; i < 4; i++)
                    for (int v = 0; v < 4; v++) a[i][v] = _mm512_mul_ps(a[i][v], _mm512_set1_ps(scale));
            }
#endif
            for (int64_t e = 0; e < (BF ? 0 : d); e++) {
                const float *kr = kcol + e * lp;
                __m512 k0 = _mm512_loadu_ps(kr), k1 = _mm512_loadu_ps(kr + 16), k2 = _mm512_loadu_ps(kr + 32),
                       k3 = _mm512_loadu_ps(kr + 48);
                for (int i = 0; i < 4; i++) {
                    __m512 qb = _mm512_set1_ps(qf[(r + i) * d + e]);
                    a[i][0] = _mm512_fmadd_ps(qb, k0, a[i][0]);
                    a[i][1] = _mm512_fmadd_ps(qb, k1, a[i][1]);
                    a[i][2] = _mm512_fmadd_ps(qb, k2, a[i][2]);
                    a[i][3] = _mm512_fmadd_ps(qb, k3, a[i][3]);
                }
            }
            for (int i = 0; i < 4; i++)
                for (int v = 0; v < 4; v++) _mm512_store_ps(s + (r + i) * KT + 16 * v, a[i][v]);
        }
        /* Online softmax per row over its visible keys of the tile; p replaces s. The AMX scores come unscaled (the
         * scale is positive: the tile's maximum scales with them). Below the diagonal and inside any window every
         * key of the tile is visible to every row: no masks to build. */
        const float sscale = BF == 2 ? scale : 1.0f;
        const int all_visible = j0 + KT - 1 <= p0 && (window <= 0 || j0 >= p0 + rows - window);
        for (int64_t r = 0; r < rows; r++) {
            int64_t pos = p0 + r, first = window > 0 && pos - window + 1 > kfirst ? pos - window + 1 : kfirst;
            __mmask16 vis[4] = {0xffff, 0xffff, 0xffff, 0xffff};
            __m512 mx = _mm512_set1_ps(-INFINITY);
            for (int v = 0; v < 4; v++) {
                if (!all_visible) {
                    __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32((int)(j0 + 16 * v)));
                    vis[v] = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32((int)pos)) &
                             _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32((int)first));
                }
                mx = _mm512_mask_max_ps(mx, vis[v], mx, _mm512_load_ps(s + r * KT + 16 * v));
            }
            float tmax = _mm512_reduce_max_ps(mx);
            if (tmax == -INFINITY) {   /* no visible key in this tile (window rows): p = 0 */
                for (int v = 0; v < 4; v++) _mm512_store_ps(s + r * KT + 16 * v, _mm512_setzero_ps());
                continue;
            }
            tmax *= sscale;
            float mnew = tmax > m[r] ? tmax : m[r];
            /* p = 2^(s * scale * log2(e) - mnew * log2(e)): one fmsub for the exponent */
            __m512 sum = _mm512_setzero_ps(), mb = _mm512_set1_ps(mnew * LOG2E), sb = _mm512_set1_ps(sscale * LOG2E);
            for (int v = 0; v < 4; v++) {
                __m512 p = _mm512_maskz_mov_ps(vis[v], exp2_16(_mm512_fmsub_ps(_mm512_load_ps(s + r * KT + 16 * v), sb, mb)));
                _mm512_store_ps(s + r * KT + 16 * v, p);
                sum = _mm512_add_ps(sum, p);
            }
            float corr = m[r] == -INFINITY ? 0.0f : mnew != m[r] ? exp_nonpositive(m[r] - mnew) : 1.0f;
            l[r] = l[r] * corr + _mm512_reduce_add_ps(sum);
            m[r] = mnew;
            if (corr != 1.0f) {
                __m512 cb = _mm512_set1_ps(corr);
                for (int j = 0; j < NV; j++)
                    _mm512_storeu_ps(acc + r * d + 16 * j, _mm512_mul_ps(_mm512_loadu_ps(acc + r * d + 16 * j), cb));
            }
        }
        /* acc += p @ V: RB rows x D in registers over the tile's keys. */
        int64_t keys = hi - j0 < KT ? hi - j0 : KT;
#ifdef __AVX512BF16__
        if (BF) {   /* p as bf16 pairs of consecutive keys, against vp2's pairs */
            uint32_t p2[MR * KT / 2] __attribute__((aligned(64)));
            for (int64_t r = 0; r < rows; r++)
                for (int v = 0; v < 4; v += 2)
                    _mm512_store_si512(p2 + r * (KT / 2) + 8 * v,
                                       (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(s + r * KT + 16 * v + 16),
                                                                    _mm512_load_ps(s + r * KT + 16 * v)));
            const uint32_t *vcol = vp2 + ((j0 - kfirst) / 2) * d;
#ifdef PF_AMX
            if (BF == 2) {   /* acc (C, 16 rows x 64 dims at a time) += p (A, 32 keys) x vp2's pairs (B) */
                memset(p2 + rows * (KT / 2), 0, sizeof(uint32_t) * (MR - rows) * (KT / 2));   /* padding rows */
                for (int64_t j = 0; j < d; j += 64) {
                    _tile_loadd(0, acc + j, d * 4); _tile_loadd(1, acc + j + 16, d * 4);
                    _tile_loadd(2, acc + j + 32, d * 4); _tile_loadd(3, acc + j + 48, d * 4);
                    for (int kc = 0; kc < KT / 32; kc++) {
                        const uint32_t *vr = vcol + 16 * kc * d + j;
                        _tile_loadd(4, p2 + 16 * kc, KT * 2);
                        _tile_loadd(5, vr, d * 4);
                        _tile_dpbf16ps(0, 4, 5);
                        _tile_loadd(5, vr + 16, d * 4);
                        _tile_dpbf16ps(1, 4, 5);
                        _tile_loadd(5, vr + 32, d * 4);
                        _tile_dpbf16ps(2, 4, 5);
                        _tile_loadd(5, vr + 48, d * 4);
                        _tile_dpbf16ps(3, 4, 5);
                    }
                    _tile_stored(0, acc + j, d * 4); _tile_stored(1, acc + j + 16, d * 4);
                    _tile_stored(2, acc + j + 32, d * 4); _tile_stored(3, acc + j + 48, d * 4);
                }
                continue;
            }
#endif
            for (int64_t r = 0; r < rows; r += RB) {
                __m512 a[4][16];
                for (int i = 0; i < RB; i++)
                    for (int j = 0; j < NV; j++) a[i][j] = _mm512_loadu_ps(acc + (r + i) * d + 16 * j);
                for (int64_t t = 0; t < (keys + 1) / 2; t++) {
                    __m512bh vv[16];
                    for (int j = 0; j < NV; j++) vv[j] = (__m512bh)_mm512_loadu_si512(vcol + t * d + 16 * j);
                    for (int i = 0; i < RB; i++) {
                        __m512bh pb = (__m512bh)_mm512_set1_epi32((int)p2[(r + i) * (KT / 2) + t]);
                        for (int j = 0; j < NV; j++) a[i][j] = _mm512_dpbf16_ps(a[i][j], pb, vv[j]);
                    }
                }
                for (int i = 0; i < RB; i++)
                    for (int j = 0; j < NV; j++) _mm512_storeu_ps(acc + (r + i) * d + 16 * j, a[i][j]);
            }
            continue;
        }
#endif
        for (int64_t r = 0; r < rows; r += RB) {   /* rows is a multiple of 4, so of RB */
            __m512 a[4][16];
            const int nr = RB;
            for (int i = 0; i < nr; i++)
                for (int j = 0; j < NV; j++) a[i][j] = _mm512_loadu_ps(acc + (r + i) * d + 16 * j);
            for (int64_t t = 0; t < keys; t++) {
                const float *vr = vp + (j0 - kfirst + t) * d;
                __m512 vv[16];
                for (int j = 0; j < NV; j++) vv[j] = _mm512_loadu_ps(vr + 16 * j);
                for (int i = 0; i < nr; i++) {
                    __m512 pb = _mm512_set1_ps(s[(r + i) * KT + t]);
                    for (int j = 0; j < NV; j++) a[i][j] = _mm512_fmadd_ps(pb, vv[j], a[i][j]);
                }
            }
            for (int i = 0; i < nr; i++)
                for (int j = 0; j < NV; j++) _mm512_storeu_ps(acc + (r + i) * d + 16 * j, a[i][j]);
        }
    }
}

/* One work item: rows r0 .. r0+rows-1 of query head `head`, from q to out (dtype `kind`); BF: the bf16-pair path
 * (kbuf, vbuf hold kt2, vp2), else fp32 (kt, vp). */
INLINE void item(int kind, const int NV, const int BF, const void *q, int64_t q_stride, void *out, int64_t r0,
                 int64_t rows, int64_t head, int64_t hq, int64_t c, int64_t kfirst, int64_t window, const void *kbuf,
                 const void *vbuf, int64_t lp, float scale) {
    const int64_t d = 16 * NV, es = elem_size(kind);
    float qf[MR * 256] __attribute__((aligned(64))), acc[MR * 256] __attribute__((aligned(64)));
    uint32_t q2[MR * 128] __attribute__((aligned(64)));
    float m[MR], l[MR];
    for (int64_t r = 0; r < MR; r++)
        for (int j = 0; j < NV; j++) {
            const char *qr = (const char *)q + ((r0 + r) * q_stride + head * d + 16 * j) * es;
            if (BF) {
                if (j % 2 == 0)
                    _mm512_store_si512(q2 + r * (d / 2) + 8 * j,
                                       r < rows ? _mm512_loadu_si512(qr) : _mm512_setzero_si512());
                continue;
            }
            __m512 x = r < rows ? load16(qr, kind) : _mm512_setzero_ps();
            _mm512_store_ps(qf + r * d + 16 * j, _mm512_mul_ps(x, _mm512_set1_ps(scale)));
        }
    int64_t padded = (rows + 3) / 4 * 4;   /* whole 4-row passes; the padding rows are never stored */
#ifdef PF_AMX
    if (BF == 2) amx_configure();
#endif
    rows_item(NV, BF, qf, q2, padded < MR ? padded : MR, c + r0, kfirst, window, (const float *)kbuf,
              (const float *)vbuf, (const uint32_t *)kbuf, (const uint32_t *)vbuf, lp, scale, acc, m, l);
#ifdef PF_AMX
    if (BF == 2) _tile_release();
#endif
    for (int64_t r = 0; r < rows; r++) {
        __m512 inv = _mm512_set1_ps(1.0f / l[r]);
        for (int j = 0; j < NV; j++)
            store16((char *)out + (((r0 + r) * hq + head) * d + 16 * j) * es,
                       _mm512_mul_ps(_mm512_loadu_ps(acc + r * d + 16 * j), inv), kind);
    }
}
#elif defined(PAGED_AVX2)
/* CPUs with AVX2 but not AVX-512 (AMD Zen 2/3, Intel before Skylake-SP): the fp32 loop above on 8 lanes and 16
 * registers (any query and pool dtype, widened to fp32 when packed). Scores of 4 rows x 16 keys per pass (8
 * accumulators, two K vectors, a query broadcast); the weighted V sum of 3 rows x 4 vectors (12 accumulators, the
 * 3 rows' weights and one V vector). */
#define LOG2E 1.44269504088896341f

/* exp2_16 on 8 lanes, for x <= 0: clamped at -126, where 2^n still is a normal float. */
INLINE __m256 exp2_8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
    __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.3266970636e-3f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6754599362e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5507425219e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022121727e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314694405e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0000001192f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

INLINE float hmax8(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

INLINE float hsum8(__m256 x) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

/* pack_head above on 8 lanes: keys kfirst..kend-1 of KV head h into kt [D][lp] and vp [L][D] (fp32). */
INLINE void pack_head(int ckind, const int NV, const void *k_pool, const void *v_pool, const int32_t *table,
                      int64_t kfirst, int64_t kend, int64_t lp, int64_t h, int64_t hkv, int64_t bs,
                      int64_t block_stride, float *kt, float *vp) {
    const int64_t d = 16 * NV, es = elem_size(ckind), len = kend - kfirst;
    const __m256i rows8 = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)d));
#pragma omp for schedule(static)
    for (int64_t t0 = 0; t0 < lp; t0 += 16) {
        float tile[16 * 256] __attribute__((aligned(32)));   /* 16 keys x D, then transposed into kt */
        int64_t cnt = len - t0 < 16 ? (len - t0 > 0 ? len - t0 : 0) : 16;
        for (int64_t t = 0; t < 16; t++) {
            if (t >= cnt) {   /* padding keys: zero, so that a masked p (0) times them stays 0 */
                for (int j = 0; j < 2 * NV; j++) {
                    _mm256_store_ps(tile + t * d + 8 * j, _mm256_setzero_ps());
                    _mm256_storeu_ps(vp + (t0 + t) * d + 8 * j, _mm256_setzero_ps());
                }
                continue;
            }
            const char *kr, *vr;
            float kscale, vscale;
            kv_rows(ckind, d, k_pool, v_pool, table, kfirst + t0 + t, h, hkv, bs, block_stride, &kr, &vr, &kscale, &vscale);
            const __m256 ks = _mm256_set1_ps(kscale), vs = _mm256_set1_ps(vscale);
            for (int j = 0; j < 2 * NV; j++) {
                _mm256_store_ps(tile + t * d + 8 * j, _mm256_mul_ps(load8(kr + 8 * j * es, ckind), ks));
                _mm256_storeu_ps(vp + (t0 + t) * d + 8 * j, _mm256_mul_ps(load8(vr + 8 * j * es, ckind), vs));
            }
        }
        for (int64_t i = 0; i < d; i++) {   /* column i of the 16 x D tile -> kt[i][t0 .. t0+15] */
            __m256i idx = _mm256_add_epi32(rows8, _mm256_set1_epi32((int)i));
            _mm256_storeu_ps(kt + i * lp + t0, _mm256_i32gather_ps(tile, idx, 4));
            _mm256_storeu_ps(kt + i * lp + t0 + 8, _mm256_i32gather_ps(tile + 8 * d, idx, 4));
        }
    }
}

/* Scores of NR query rows (qf, already scaled) x the tile's first 16 * groups keys (kcol: kt's column of its
 * first key) into s's rows, 16 keys at a time: 2 NR accumulators, two K vectors and a query broadcast. */
INLINE void scores(const int NR, const int NV, const float *qf, const float *kcol, int64_t lp, int64_t groups,
                   float *s) {
    const int64_t d = 16 * NV;
    for (int64_t g = 0; g < groups; g++) {
        __m256 a[6][2];
        for (int i = 0; i < NR; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
        for (int64_t e = 0; e < d; e++) {
            const float *kr = kcol + e * lp + 16 * g;
            __m256 k0 = _mm256_loadu_ps(kr), k1 = _mm256_loadu_ps(kr + 8);
            __asm__("" : "+x"(k0), "+x"(k1));   /* loaded once for the NR rows (GCC may fold them into each FMA) */
            for (int i = 0; i < NR; i++) {
                __m256 qb = _mm256_broadcast_ss(qf + i * d + e);
                a[i][0] = _mm256_fmadd_ps(qb, k0, a[i][0]);
                a[i][1] = _mm256_fmadd_ps(qb, k1, a[i][1]);
            }
        }
        for (int i = 0; i < NR; i++) {
            _mm256_store_ps(s + i * KT + 16 * g, a[i][0]);
            _mm256_store_ps(s + i * KT + 16 * g + 8, a[i][1]);
        }
    }
}

/* acc's NR rows += their p (rows of s) @ V over `keys` keys of the tile (V rows from vr), 4 vectors of D at a time. */
INLINE void weighted_v(const int NR, const int NV, const float *s, const float *vr, int64_t keys, float *acc) {
    const int64_t d = 16 * NV;
    for (int jb = 0; jb < 2 * NV; jb += 4) {
        __m256 a[3][4];
        for (int i = 0; i < NR; i++)
            for (int j = 0; j < 4; j++) a[i][j] = _mm256_loadu_ps(acc + i * d + 8 * (jb + j));
        for (int64_t t = 0; t < keys; t++) {
            __m256 pb[3];
            for (int i = 0; i < NR; i++) pb[i] = _mm256_broadcast_ss(s + i * KT + t);
            for (int j = 0; j < 4; j++) {
                __m256 vv = _mm256_loadu_ps(vr + t * d + 8 * (jb + j));
                __asm__("" : "+x"(vv));   /* likewise */
                for (int i = 0; i < NR; i++) a[i][j] = _mm256_fmadd_ps(pb[i], vv, a[i][j]);
            }
        }
        for (int i = 0; i < NR; i++)
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(acc + i * d + 8 * (jb + j), a[i][j]);
    }
}

/* Rows of the chunk at positions p0 .. p0+rows-1 for one query head: qf [MR][D] holds q * scale. */
INLINE void rows_item(const int NV, const float *qf, int64_t rows, int64_t p0, int64_t kfirst, int64_t window,
                      const float *kt, const float *vp, int64_t lp, float *acc, float *m, float *l) {
    const int64_t d = 16 * NV;
    float s[MR * KT] __attribute__((aligned(32)));
    int64_t hi = p0 + rows;   /* keys up to the last row's own position */
    int64_t lo = window > 0 && p0 - window + 1 > kfirst ? p0 - window + 1 : kfirst;
    for (int64_t r = 0; r < MR; r++) m[r] = -INFINITY, l[r] = 0.0f;
    memset(acc, 0, sizeof(float) * MR * d);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t j0 = (lo - kfirst) / KT * KT + kfirst; j0 < hi; j0 += KT) {
        const float *kcol = kt + (j0 - kfirst);
        const int64_t keys = hi - j0 < KT ? hi - j0 : KT, groups = (keys + 15) / 16;   /* no row sees a key >= hi */
        /* Scores, 6 rows x 16 keys at a time (rows is a multiple of 4: the last group has 4 or 2) */
        int64_t r6 = 0;
        for (; r6 + 6 <= rows; r6 += 6) scores(6, NV, qf + r6 * d, kcol, lp, groups, s + r6 * KT);
        if (rows - r6 == 4) scores(4, NV, qf + r6 * d, kcol, lp, groups, s + r6 * KT);
        else if (rows - r6 == 2) scores(2, NV, qf + r6 * d, kcol, lp, groups, s + r6 * KT);
        /* Online softmax per row over its visible keys of the scored groups; p replaces s. */
        const int nv = (int)groups * 2;
        const int all_visible = j0 + KT - 1 <= p0 && (window <= 0 || j0 >= p0 + rows - window);
        for (int64_t r = 0; r < rows; r++) {
            int64_t pos = p0 + r, first = window > 0 && pos - window + 1 > kfirst ? pos - window + 1 : kfirst;
            __m256 vis[KT / 8], mx = _mm256_set1_ps(-INFINITY);
            for (int v = 0; v < nv; v++) {
                vis[v] = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
                if (!all_visible) {
                    __m256i key = _mm256_add_epi32(lane, _mm256_set1_epi32((int)(j0 + 8 * v)));
                    __m256i hidden = _mm256_or_si256(_mm256_cmpgt_epi32(key, _mm256_set1_epi32((int)pos)),
                                                     _mm256_cmpgt_epi32(_mm256_set1_epi32((int)first), key));
                    vis[v] = _mm256_castsi256_ps(_mm256_xor_si256(hidden, _mm256_set1_epi32(-1)));
                }
                mx = _mm256_max_ps(mx, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_load_ps(s + r * KT + 8 * v),
                                                        vis[v]));
            }
            float tmax = hmax8(mx);
            if (tmax == -INFINITY) {   /* no visible key in this tile (window rows): p = 0 */
                for (int v = 0; v < nv; v++) _mm256_store_ps(s + r * KT + 8 * v, _mm256_setzero_ps());
                continue;
            }
            float mnew = tmax > m[r] ? tmax : m[r];
            __m256 sum = _mm256_setzero_ps(), mb = _mm256_set1_ps(mnew * LOG2E), sb = _mm256_set1_ps(LOG2E);
            for (int v = 0; v < nv; v++) {
                __m256 p = _mm256_and_ps(vis[v], exp2_8(_mm256_fmsub_ps(_mm256_load_ps(s + r * KT + 8 * v), sb, mb)));
                _mm256_store_ps(s + r * KT + 8 * v, p);
                sum = _mm256_add_ps(sum, p);
            }
            float corr = m[r] == -INFINITY ? 0.0f : mnew != m[r] ? exp_nonpositive(m[r] - mnew) : 1.0f;
            l[r] = l[r] * corr + hsum8(sum);
            m[r] = mnew;
            if (corr != 1.0f) {
                __m256 cb = _mm256_set1_ps(corr);
                for (int j = 0; j < 2 * NV; j++)
                    _mm256_storeu_ps(acc + r * d + 8 * j, _mm256_mul_ps(_mm256_loadu_ps(acc + r * d + 8 * j), cb));
            }
        }
        /* acc += p @ V, 3 rows at a time (rows is a multiple of 4: the last group has 1 or 2) */
        const float *vr = vp + (j0 - kfirst) * d;
        int64_t r = 0;
        for (; r + 3 <= rows; r += 3) weighted_v(3, NV, s + r * KT, vr, keys, acc + r * d);
        if (rows - r == 2) weighted_v(2, NV, s + r * KT, vr, keys, acc + r * d);
        else if (rows - r == 1) weighted_v(1, NV, s + r * KT, vr, keys, acc + r * d);
    }
}

/* One work item: rows r0 .. r0+rows-1 of query head `head`, from q to out (dtype `kind`); BF (the AVX-512 bf16-pair
 * paths) is never set here. */
INLINE void item(int kind, const int NV, const int BF, const void *q, int64_t q_stride, void *out, int64_t r0,
                 int64_t rows, int64_t head, int64_t hq, int64_t c, int64_t kfirst, int64_t window, const void *kbuf,
                 const void *vbuf, int64_t lp, float scale) {
    const int64_t d = 16 * NV, es = elem_size(kind);
    float qf[MR * 256] __attribute__((aligned(32))), acc[MR * 256] __attribute__((aligned(32)));
    float m[MR], l[MR];
    (void)BF;
    for (int64_t r = 0; r < MR; r++)
        for (int j = 0; j < 2 * NV; j++) {
            const char *qr = (const char *)q + ((r0 + r) * q_stride + head * d + 8 * j) * es;
            __m256 x = r < rows ? load8(qr, kind) : _mm256_setzero_ps();
            _mm256_store_ps(qf + r * d + 8 * j, _mm256_mul_ps(x, _mm256_set1_ps(scale)));
        }
    int64_t padded = (rows + 3) / 4 * 4;   /* whole 4-row passes; the padding rows are never stored */
    rows_item(NV, qf, padded < MR ? padded : MR, c + r0, kfirst, window, (const float *)kbuf, (const float *)vbuf, lp,
              acc, m, l);
    for (int64_t r = 0; r < rows; r++) {
        char *o = (char *)out + ((r0 + r) * hq + head) * d * es;
        __m256 inv = _mm256_set1_ps(1.0f / l[r]);
        for (int j = 0; j < 2 * NV; j++) {
            __m256 x = _mm256_mul_ps(_mm256_loadu_ps(acc + r * d + 8 * j), inv);
            if (kind == KIND_F32) _mm256_storeu_ps((float *)o + 8 * j, x);
            else if (kind == KIND_F16)
                _mm_storeu_si128((__m128i *)(o + 16 * j), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
            else {
                float tmp[8];
                _mm256_storeu_ps(tmp, x);
                for (int t = 0; t < 8; t++) ((uint16_t *)o)[8 * j + t] = float_to_bf16(tmp[t]);
            }
        }
    }
}
#endif

#if defined(__AVX512F__) || defined(PAGED_AVX2)
/* One compiled function per (cache dtype, head size) for packing and per (q dtype, head size) for the items:
 * the dtypes and the vector count must be constants inside the loops, which values passed through an OpenMP
 * region are not (its body is outlined once). Index 4 of PACKS / 3 of ITEMS: the bf16-pair path. */
typedef void (*pack_fn)(const void *k_pool, const void *v_pool, const int32_t *table, int64_t kfirst, int64_t kend,
                        int64_t lp, int64_t h, int64_t hkv, int64_t bs, int64_t block_stride, void *kbuf, void *vbuf);
typedef void (*item_fn)(const void *q, int64_t q_stride, void *out, int64_t r0, int64_t rows, int64_t head, int64_t hq,
                        int64_t c, int64_t kfirst, int64_t window, const void *kbuf, const void *vbuf, int64_t lp,
                        float scale);
#define PACK(CK, NV)                                                                                               \
    static void pack_##CK##_##NV(const void *k_pool, const void *v_pool, const int32_t *table, int64_t kfirst,     \
                                 int64_t kend, int64_t lp, int64_t h, int64_t hkv, int64_t bs, int64_t block_stride, \
                                 void *kbuf, void *vbuf) {                                                        \
        pack_head(CK, NV, k_pool, v_pool, table, kfirst, kend, lp, h, hkv, bs, block_stride, kbuf, vbuf);         \
    }
#define ITEM(K, NV)                                                                                                \
    static void item_##K##_##NV(const void *q, int64_t q_stride, void *out, int64_t r0, int64_t rows, int64_t head, \
                                int64_t hq, int64_t c, int64_t kfirst, int64_t window, const void *kbuf,          \
                                const void *vbuf, int64_t lp, float scale) {                                      \
        item(K, NV, 0, q, q_stride, out, r0, rows, head, hq, c, kfirst, window, kbuf, vbuf, lp, scale);             \
    }
#define FOR_NV(X, A) X(A, 4) X(A, 8) X(A, 16)
FOR_NV(PACK, KIND_F32) FOR_NV(PACK, KIND_BF16) FOR_NV(PACK, KIND_F16) FOR_NV(PACK, KIND_I8)
FOR_NV(ITEM, KIND_F32) FOR_NV(ITEM, KIND_BF16) FOR_NV(ITEM, KIND_F16)
#ifdef __AVX512BF16__
#define PACK_PAIRS(X, NV)                                                                                          \
    static void pack_pairs_##NV(const void *k_pool, const void *v_pool, const int32_t *table, int64_t kfirst,     \
                                int64_t kend, int64_t lp, int64_t h, int64_t hkv, int64_t bs, int64_t block_stride, \
                                void *kbuf, void *vbuf) {                                                         \
        pack_head_bf16(NV, k_pool, v_pool, table, kfirst, kend, lp, h, hkv, bs, block_stride, kbuf, vbuf);        \
    }
#define ITEM_PAIRS(X, NV)                                                                                          \
    static void item_pairs_##NV(const void *q, int64_t q_stride, void *out, int64_t r0, int64_t rows, int64_t head, \
                                int64_t hq, int64_t c, int64_t kfirst, int64_t window, const void *kbuf,          \
                                const void *vbuf, int64_t lp, float scale) {                                      \
        item(KIND_BF16, NV, 1, q, q_stride, out, r0, rows, head, hq, c, kfirst, window, kbuf, vbuf, lp, scale);       \
    }
FOR_NV(PACK_PAIRS, _) FOR_NV(ITEM_PAIRS, _)
#define PAIRS(F) {F##_pairs_4, F##_pairs_8, F##_pairs_16}
#else
#define PAIRS(F) {NULL, NULL, NULL}
#endif
#ifdef PF_AMX
#define ITEM_AMX(X, NV)                                                                                            \
    static void item_amx_##NV(const void *q, int64_t q_stride, void *out, int64_t r0, int64_t rows, int64_t head,   \
                              int64_t hq, int64_t c, int64_t kfirst, int64_t window, const void *kbuf,            \
                              const void *vbuf, int64_t lp, float scale) {                                        \
        item(KIND_BF16, NV, 2, q, q_stride, out, r0, rows, head, hq, c, kfirst, window, kbuf, vbuf, lp, scale);       \
    }
FOR_NV(ITEM_AMX, _)
#define AMX_ITEMS {item_amx_4, item_amx_8, item_amx_16}
#else
#define AMX_ITEMS {NULL, NULL, NULL}
#endif
#define BY_NV(F, A) {F##_##A##_4, F##_##A##_8, F##_##A##_16}
static const pack_fn PACKS[5][3] = {BY_NV(pack, KIND_F32), BY_NV(pack, KIND_BF16), BY_NV(pack, KIND_F16), BY_NV(pack, KIND_I8),
                                    PAIRS(pack)};
static const item_fn ITEMS[5][3] = {BY_NV(item, KIND_F32), BY_NV(item, KIND_BF16), BY_NV(item, KIND_F16), PAIRS(item),
                                    AMX_ITEMS};

/* 1 where bf16 prefill runs its products on AMX tiles (built for a CPU with AMX-BF16, and the kernel let this
 * process use them): there it is faster than torch's flash SDPA, which the torch path would otherwise take. */
int paged_prefill_amx(void) {
#ifdef PF_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

/* One prefill chunk, every head. Returns 0, -1 if a buffer could not be allocated. */
static int prefill(int kind, int ckind, int nvi, int64_t d, const void *q, int64_t q_stride, void *out,
                   const void *k_pool, const void *v_pool, const int32_t *table, int64_t c, int64_t n, int64_t hq,
                   int64_t hkv, int64_t bs, int64_t block_stride, float scale, int64_t window, int num_threads) {
    const int pairs = kind == KIND_BF16 && ckind == KIND_BF16 && PACKS[4][nvi] != NULL;
    const int amx = pairs && ITEMS[4][nvi] != NULL && paged_prefill_amx();
    const pack_fn pack = pairs ? PACKS[4][nvi] : PACKS[ckind][nvi];
    const item_fn run = amx ? ITEMS[4][nvi] : pairs ? ITEMS[3][nvi] : ITEMS[kind][nvi];
    const int64_t group = hq / hkv;
    const int64_t kend = c + n, kfirst = window > 0 && c - window + 1 > 0 ? c - window + 1 : 0;
    /* One spare tile (tiles start KT-aligned), and 16 more so that kt's rows are an odd number of cache lines
     * apart: at a multiple of 4 lines (a 64-key multiple) the D rows a tile reads fell into a quarter of the L1
     * sets and evicted each other (an fp32 8k-token context ran slower than torch's SDPA). */
    const int64_t lp = (kend - kfirst + KT - 1) / KT * KT + KT + 16;
    float *kt = aligned_alloc(64, (size_t)(lp * d * 2) * sizeof(float));
    if (!kt) return -1;
    float *vp = kt + lp * d;
    const int64_t items = group * ((n + MR - 1) / MR);
    for (int64_t h = 0; h < hkv; h++) {
#pragma omp parallel num_threads(num_threads)
        {
            pack(k_pool, v_pool, table, kfirst, kend, lp, h, hkv, bs, block_stride, kt, vp);
            /* the implicit barrier of pack's omp for: the packed head is complete */
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = items - 1; it >= 0; it--) {   /* longest rows (the last blocks) first */
                int64_t g = it % group, r0 = (it / group) * MR, rows = n - r0 < MR ? n - r0 : MR;
                run(q, q_stride, out, r0, rows, h * group + g, hq, c, kfirst, window, kt, vp, lp, scale);
            }
        }
    }
    free(kt);
    return 0;
}
#endif

/* q: [n, hq, d] rows `q_stride` elements apart (heads contiguous); out: [n, hq, d] contiguous; table: the
 * sequence's int32 block ids; c: tokens already in the cache before this chunk (the chunk's own K/V are in the
 * pool too: positions c .. c+n-1); window > 0: each row sees its last `window` positions. Returns 0, -1 if a
 * buffer could not be allocated, -2 if this build has no kernel for d (AVX-512 or AVX2, d in 64, 128, 256 only). */
#define PF_EXPORT(NAME, KIND, CKIND)                                                                              \
    int NAME(const void *q, int64_t q_stride, void *out, const void *k_pool, const void *v_pool,                \
             const int32_t *table, int64_t c, int64_t n, int64_t hq, int64_t hkv, int64_t d, int64_t bs,            \
             int64_t block_stride, float scale, int64_t window, int num_threads);                               \
    int NAME(const void *q, int64_t q_stride, void *out, const void *k_pool, const void *v_pool,                \
             const int32_t *table, int64_t c, int64_t n, int64_t hq, int64_t hkv, int64_t d, int64_t bs,            \
             int64_t block_stride, float scale, int64_t window, int num_threads) {                              \
        PF_DISPATCH(KIND, CKIND)                                                                                 \
        return -2;                                                                                               \
    }

#if defined(__AVX512F__) || defined(PAGED_AVX2)
#define PF_DISPATCH(KIND, CKIND)                                                                                 \
    if (hq % hkv == 0 && n > 0) {                                                                              \
        int nvi = d == 64 ? 0 : d == 128 ? 1 : d == 256 ? 2 : -1;                                          \
        if (nvi >= 0) return prefill(KIND, CKIND, nvi, d, q, q_stride, out, k_pool, v_pool, table, c, n, hq, hkv,  \
                                     bs, block_stride, scale, window, num_threads);                            \
    }
#else
#define PF_DISPATCH(KIND, CKIND)                                                                                 \
    (void)q, (void)q_stride, (void)out, (void)k_pool, (void)v_pool, (void)table, (void)c, (void)n, (void)hq,    \
        (void)hkv, (void)d, (void)bs, (void)block_stride, (void)scale, (void)window, (void)num_threads;
#endif

PF_EXPORT(paged_prefill_f32, KIND_F32, KIND_F32)
PF_EXPORT(paged_prefill_bf16, KIND_BF16, KIND_BF16)
PF_EXPORT(paged_prefill_f16, KIND_F16, KIND_F16)
PF_EXPORT(paged_prefill_i8_f32, KIND_F32, KIND_I8)
PF_EXPORT(paged_prefill_i8_bf16, KIND_BF16, KIND_I8)
PF_EXPORT(paged_prefill_i8_f16, KIND_F16, KIND_I8)
