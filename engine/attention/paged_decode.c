/* Paged decode attention for CPUs: each sequence's one new query token attends to its K/V read
 * straight from the block pool, once, in fp32 with an online softmax. The torch path gathers the
 * blocks into a buffer first and reads them again in SDPA; here the pool is the only memory traffic.
 *
 * Compiled on first use by engine/attention/native.py (cc -O3 -march=native -fopenmp); loaded with
 * ctypes. The OpenMP runtime is torch's own (same soname, already loaded), so no second thread pool.
 * An AVX-512 path (or on CPUs without it an AVX2 one) serves head sizes 64/128/256; plain C (auto-vectorised)
 * serves everything else.
 *
 * Layout (engine/kv_cache.py): a layer's K and V are two caches [num_blocks, block_size, Hkv, row] (contiguous
 * in the pool; any block stride `block_stride` elements, the same for both, with the rows inside a block
 * contiguous), indexed through int32 block tables as the device kernels are. row = D for a float
 * pool; an int8 pool's row is D int8 values then the row's fp16 scale (row = D + 2 bytes, engine/kv_cache.py):
 * the kernel reads the int8 values and folds the scale into the score (K) and the probability (V).
 */
#include "paged_simd.h"

#define TILE 16   /* tokens scored together; a tile never crosses a block boundary */

INLINE float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, ex = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (ex == 0x1f) u = sign | 0x7f800000u | (man << 13);
    else if (ex) u = sign | ((ex + 112u) << 23) | (man << 13);
    else {   /* zero or subnormal */
        float f = (float)man * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Scale of a cache row: the fp16 after an int8 row's D values, 1 for float rows. */
INLINE float row_scale(const char *row, int64_t d, int ckind) {
    if (ckind != KIND_I8) return 1.0f;
    uint16_t h;
    memcpy(&h, row + d, sizeof h);
    return half_to_float(h);
}

INLINE float load1(const void *p, int64_t i, int kind) {
    if (kind == KIND_F32) return ((const float *)p)[i];
    if (kind == KIND_I8) return (float)((const int8_t *)p)[i];
    if (kind == KIND_BF16) return bf16_to_float(((const uint16_t *)p)[i]);
#ifdef __FLT16_MAX__
    return (float)((const _Float16 *)p)[i];
#else
    return 0.0f;   /* not exported without _Float16 */
#endif
}

INLINE void store1(void *p, int64_t i, float x, int kind) {
    if (kind == KIND_F32) ((float *)p)[i] = x;
    else if (kind == KIND_BF16) ((uint16_t *)p)[i] = float_to_bf16(x);
#ifdef __FLT16_MAX__
    else ((_Float16 *)p)[i] = (_Float16)x;
#endif
}


#define CHUNK 16   /* tiles per softmax update in the vector paths */

/* Per-item work buffer: for each query row, q * scale and acc [D], running max m and sum l, a chunk's scores and
 * rescaling factor (the plain C path uses one tile of them); the V scales of a chunk's int8 rows; one tile of
 * converted rows. */
static size_t work_floats(int64_t heads, int64_t group, int64_t d) {
    int64_t rows = heads * group;
    size_t floats = (size_t)(rows * (2 * d + 3 + CHUNK * TILE) + CHUNK * TILE * rows + TILE * d);
    return floats;
}

/* Softmax update of one query row over a tile of n scores (in place: scores become probabilities).
 * Returns the factor by which the row's accumulator must be scaled first. */
INLINE float softmax_tile(float *sg, int64_t n, float *m, float *l) {
    float mx = *m, sum = 0.0f;
    for (int64_t t = 0; t < n; t++) mx = sg[t] > mx ? sg[t] : mx;
    for (int64_t t = 0; t < n; t++) {
        sg[t] = exp_nonpositive(sg[t] - mx);
        sum += sg[t];
    }
    float corr = mx != *m ? exp_nonpositive(*m - mx) : 1.0f;
    *l = *l * corr + sum;
    *m = mx;
    return corr;
}

/* Tokens of the tile starting at pos: up to TILE, never past the block's end or the context. */
INLINE int64_t tile_len(int64_t pos, int64_t ctx, int64_t bs) {
    int64_t n = TILE, off = pos % bs;
    if (n > bs - off) n = bs - off;
    if (n > ctx - pos) n = ctx - pos;
    return n;
}

/* Element offset of token `pos`'s row (head 0) in a layer's pool view. */
INLINE int64_t tile_base(const int32_t *table, int64_t pos, int64_t bs, int64_t block_stride, int64_t tok_stride) {
    return table[pos / bs] * block_stride + (pos % bs) * tok_stride;
}

/* The tiles of the chunk that starts at *pos (tn[0], tb[0] already set: tokens and element offset of head h0, at
 * `head_offset`), up to CHUNK of them, and the first tile of the chunk after in tn[nt], tb[nt] (0 tokens past the
 * context); moves *pos past the chunk and returns its tile count nt. */
INLINE int next_chunk(int64_t *tn, int64_t *tb, int64_t *pos, int64_t ctx, int64_t bs, const int32_t *table,
                      int64_t block_stride, int64_t tok_stride, int64_t head_offset) {
    int nt = 0;
    while (nt < CHUNK && *pos < ctx) {
        *pos += tn[nt++];
        tn[nt] = *pos < ctx ? tile_len(*pos, ctx, bs) : 0;
        tb[nt] = tn[nt] ? tile_base(table, *pos, bs, block_stride, tok_stride) + head_offset : 0;
    }
    return nt;
}

/* One sequence, KV heads [h0, h1), any head size: plain C. `kind`: q/out dtype, `ckind`: the cache's. */
INLINE void item_generic(int kind, int ckind, const void *q, void *out, const void *k_pool, const void *v_pool,
                         const int32_t *table, int64_t first, int64_t ctx, int64_t h0, int64_t h1, int64_t hkv, int64_t group,
                         int64_t d, int64_t bs, int64_t block_stride, float scale, float *work) {
    int64_t rows = (h1 - h0) * group, hs = head_stride(d, ckind), tok_stride = hkv * hs, es = elem_size(ckind);
    float *qf = work, *acc = qf + rows * d, *m = acc + rows * d, *l = m + rows, *s = l + rows, *row = s + rows * TILE;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < d; i++) qf[r * d + i] = load1(q, (h0 * group + r) * d + i, kind) * scale;
        for (int64_t i = 0; i < d; i++) acc[r * d + i] = 0.0f;
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    for (int64_t pos = first; pos < ctx;) {   /* same order as the AVX-512 path: rows in memory order */
        int64_t n = tile_len(pos, ctx, bs), base = tile_base(table, pos, bs, block_stride, tok_stride);
        const char *kb = (const char *)k_pool + base * es, *vb = (const char *)v_pool + base * es;
        for (int64_t t = 0; t < n; t++)
            for (int64_t h = h0; h < h1; h++) {
                const char *kr = kb + (t * tok_stride + h * hs) * es;
                float ks = row_scale(kr, d, ckind);
                for (int64_t i = 0; i < d; i++) row[i] = load1(kr, i, ckind);
                for (int64_t g = 0; g < group; g++) {
                    const float *qg = qf + ((h - h0) * group + g) * d;
                    float dot = 0.0f;
                    _Pragma("omp simd reduction(+:dot)")
                    for (int64_t i = 0; i < d; i++) dot += qg[i] * row[i];
                    s[((h - h0) * group + g) * TILE + t] = dot * ks;
                }
            }
        for (int64_t r = 0; r < rows; r++) {
            float corr = softmax_tile(s + r * TILE, n, m + r, l + r);
            if (corr != 1.0f)
                for (int64_t i = 0; i < d; i++) acc[r * d + i] *= corr;
        }
        for (int64_t t = 0; t < n; t++)
            for (int64_t h = h0; h < h1; h++) {
                const char *vr = vb + (t * tok_stride + h * hs) * es;
                float vs = row_scale(vr, d, ckind);
                for (int64_t i = 0; i < d; i++) row[i] = load1(vr, i, ckind);
                for (int64_t g = 0; g < group; g++) {
                    int64_t r = (h - h0) * group + g;
                    float p = s[r * TILE + t] * vs, *ar = acc + r * d;
                    for (int64_t i = 0; i < d; i++) ar[i] += p * row[i];
                }
            }
        pos += n;
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < d; i++) store1(out, (h0 * group + r) * d + i, acc[r * d + i] / l[r], kind);
}

#ifdef __AVX512F__
INLINE void prefetch_span(const char *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(p + i, _MM_HINT_T1);
}

/* Lane t of the result = the sum of v[t]'s 16 lanes: a transposed reduction, ~3 instructions a vector where a
 * horizontal sum of each costs ~8. Pairs of vectors fold halves, then quarters, then pairs of lanes; the result
 * comes out 4 x 4 transposed and one permute puts it back in order. */
INLINE __m512 sum16x16(const __m512 v[16]) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++)   /* w[i]: lanes 0-7 sum to v[2i]'s total, lanes 8-15 to v[2i+1]'s */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)   /* x[i]: quarter q sums to v[4i+q]'s total */
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) {   /* y[i]: quarter q, lanes 0-1: v[8i+q]; lanes 2-3: v[8i+4+q] */
        __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
        y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* quarter q, lane j: v[q + 4j] */
    __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z);
}

/* One sequence, KV heads [h0, h1), head size 16 * NV (NV a compile-time constant after inlining, so the
 * per-row vectors stay in registers). The context goes by chunks of up to CHUNK tiles (a tile: up to 16 tokens of
 * one block), each in three passes:
 *   scores   per tile, KV head and query row: one vector of products per token, summed across in one transposed
 *            reduction (a bf16 query over a bf16 cache multiplies raw bf16 pairs, AVX512-BF16's dot product: exact
 *            products summed in fp32, the scale applied to the sums); the next tile's K and this tile's V are
 *            prefetched meanwhile (blocks lie anywhere in the pool, out of the hardware prefetcher's sight)
 *   softmax  per query row over the chunk's scores at once (one rescale of the running sums per chunk, the exps
 *            independent of each other rather than one dependent chain per tile)
 *   values   per KV head, the weighted V rows of the whole chunk into accumulators held in registers, RB query
 *            rows at a time. */
INLINE void item_avx512(int kind, int ckind, const int NV, const void *q, void *out, const void *k_pool,
                        const void *v_pool, const int32_t *table, int64_t first, int64_t ctx, int64_t h0, int64_t h1,
                        int64_t hkv, int64_t group, int64_t bs, int64_t block_stride, float scale, float *work) {
    const int64_t d = 16 * NV;
    const int RB = NV <= 4 ? 4 : NV <= 8 ? 2 : 1;   /* RB rows x NV accumulators + NV V vectors fit 32 registers */
#ifdef __AVX512BF16__
    const int dot_bf16 = kind == KIND_BF16 && ckind == KIND_BF16;
#else
    const int dot_bf16 = 0;
#endif
    int64_t heads = h1 - h0, rows = heads * group, es = elem_size(kind), hs = head_stride(d, ckind);
    int64_t tok_stride = hkv * hs, ces = elem_size(ckind);
    /* qf: the query rows (fp32 x scale, or raw bf16); acc; running max m and sum l; the chunk's scores, then
     * weights, [row][tile][16]; the chunk's rescaling factor per row; int8 rows' V scales [tile][head][16] */
    float *qf = work, *acc = qf + rows * d, *m = acc + rows * d, *l = m + rows, *sc = l + rows;
    float *corr = sc + rows * CHUNK * TILE, *vsc = corr + rows;
    for (int64_t r = 0; r < rows; r++) {
        const char *qr = (const char *)q + (h0 * group + r) * d * es;
        if (dot_bf16) memcpy(qf + r * d, qr, d * 2);
        else
            for (int j = 0; j < NV; j++)
                _mm512_storeu_ps(qf + r * d + 16 * j, _mm512_mul_ps(load16(qr + 16 * j * es, kind), _mm512_set1_ps(scale)));
        for (int j = 0; j < NV; j++) _mm512_storeu_ps(acc + r * d + 16 * j, _mm512_setzero_ps());
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    int64_t tn[CHUNK + 1], tb[CHUNK + 1];   /* tokens and element offset (head h0) of the chunk's tiles + the next */
    int64_t pos = first;
    tn[0] = tile_len(pos, ctx, bs), tb[0] = tile_base(table, pos, bs, block_stride, tok_stride) + h0 * hs;
    while (pos < ctx) {
        const int nt = next_chunk(tn, tb, &pos, ctx, bs, table, block_stride, tok_stride, h0 * hs);
        for (int i = 0; i < nt; i++) {   /* scores */
            const int64_t n = tn[i], next_n = tn[i + 1];
            const __mmask16 live = (__mmask16)((1u << n) - 1u);
            for (int64_t h = 0; h < heads; h++) {
                const char *kh = (const char *)k_pool + (tb[i] + h * hs) * ces;
                const char *vh = (const char *)v_pool + (tb[i] + h * hs) * ces;
                const char *next_kh = (const char *)k_pool + (tb[i + 1] + h * hs) * ces;
                __m512 ksv = _mm512_set1_ps(dot_bf16 ? scale : 1.0f);
                if (ckind == KIND_I8) {   /* the rows' scales */
                    float ks[TILE] = {0}, *vs = vsc + (i * heads + h) * TILE;
                    for (int64_t t = 0; t < TILE; t++) {
                        ks[t] = t < n ? row_scale(kh + t * tok_stride * ces, d, ckind) : 0.0f;
                        vs[t] = t < n ? row_scale(vh + t * tok_stride * ces, d, ckind) : 0.0f;
                    }
                    ksv = _mm512_loadu_ps(ks);
                }
                for (int64_t g = 0; g < group; g++) {
                    const float *qg = qf + (h * group + g) * d;
                    __m512 part[TILE];
#pragma GCC unroll 16   /* part[] must stay in registers */
                    for (int t = 0; t < TILE; t++) {
                        part[t] = _mm512_setzero_ps();
                        if (g == 0) {
                            if (t < next_n) prefetch_span(next_kh + t * tok_stride * ces, hs * ces);
                            if (t < n) prefetch_span(vh + t * tok_stride * ces, hs * ces);
                        }
                        if (t >= n) continue;
                        const char *kr = kh + t * tok_stride * ces;
#ifdef __AVX512BF16__
                        if (dot_bf16) {
                            for (int j = 0; j < NV / 2; j++)
                                part[t] = _mm512_dpbf16_ps(part[t], (__m512bh)_mm512_loadu_si512(qg + 16 * j),
                                                           (__m512bh)_mm512_loadu_si512(kr + 64 * j));
                            continue;
                        }
#endif
                        for (int j = 0; j < NV; j++)
                            part[t] = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * j), load16(kr + 16 * j * ces, ckind), part[t]);
                    }
                    _mm512_storeu_ps(sc + ((h * group + g) * CHUNK + i) * TILE,
                                     _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, _mm512_mul_ps(sum16x16(part), ksv)));
                }
            }
        }
        for (int64_t r = 0; r < rows; r++) {   /* softmax */
            float *sr = sc + r * CHUNK * TILE;
            __m512 vm = _mm512_set1_ps(m[r]);
            for (int i = 0; i < nt; i++) vm = _mm512_max_ps(vm, _mm512_loadu_ps(sr + i * TILE));
            float mx = _mm512_reduce_max_ps(vm);
            __m512 sum = _mm512_setzero_ps(), mv = _mm512_set1_ps(mx);
            for (int i = 0; i < nt; i++) {
                __mmask16 live = (__mmask16)((1u << tn[i]) - 1u);
                __m512 p = _mm512_maskz_mov_ps(live, exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sr + i * TILE), mv)));
                sum = _mm512_add_ps(sum, p);
                if (ckind == KIND_I8) p = _mm512_mul_ps(p, _mm512_loadu_ps(vsc + (i * heads + r / group) * TILE));
                _mm512_storeu_ps(sr + i * TILE, p);
            }
            corr[r] = mx != m[r] ? exp_nonpositive(m[r] - mx) : 1.0f;
            l[r] = l[r] * corr[r] + _mm512_reduce_add_ps(sum);
            m[r] = mx;
        }
        for (int64_t h = 0; h < heads; h++)   /* weighted V, RB rows' accumulators in registers */
            for (int64_t g0 = 0; g0 < group; g0 += RB) {
                const int64_t r0 = h * group + g0;
                __m512 a[4][16];
                for (int gg = 0; gg < RB; gg++) {
                    if (g0 + gg >= group) break;
                    __m512 c = _mm512_set1_ps(corr[r0 + gg]);
                    for (int j = 0; j < NV; j++) a[gg][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r0 + gg) * d + 16 * j), c);
                }
                for (int i = 0; i < nt; i++) {
                    const char *vh = (const char *)v_pool + (tb[i] + h * hs) * ces;
                    for (int64_t t = 0; t < tn[i]; t++) {
                        const char *vr = vh + t * tok_stride * ces;
                        __m512 v[16];
                        for (int j = 0; j < NV; j++) v[j] = load16(vr + 16 * j * ces, ckind);
                        for (int gg = 0; gg < RB; gg++) {
                            if (g0 + gg >= group) break;
                            __m512 pb = _mm512_set1_ps(sc[((r0 + gg) * CHUNK + i) * TILE + t]);
                            for (int j = 0; j < NV; j++) a[gg][j] = _mm512_fmadd_ps(pb, v[j], a[gg][j]);
                        }
                    }
                }
                for (int gg = 0; gg < RB; gg++) {
                    if (g0 + gg >= group) break;
                    for (int j = 0; j < NV; j++) _mm512_storeu_ps(acc + (r0 + gg) * d + 16 * j, a[gg][j]);
                }
            }
        tn[0] = tn[nt], tb[0] = tb[nt];
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < d; i++) store1(out, (h0 * group + r) * d + i, acc[r * d + i] / l[r], kind);
}
#endif

#if defined(PAGED_AVX2) && !defined(__AVX512F__)
/* Token rows [lo, hi) of a tile (element offset tb, head h0) into L1, K and V: each row is `row_bytes` of every head
 * of the item. */
INLINE void prefetch_rows(const char *k_pool, const char *v_pool, int64_t tb, int64_t lo, int64_t hi,
                          int64_t tok_stride, int64_t row_bytes, int64_t ces) {
    for (int64_t t = lo; t < hi; t++) {
        const int64_t row = (tb + t * tok_stride) * ces;
        for (int64_t b = 0; b < row_bytes; b += 64) {
            _mm_prefetch(k_pool + row + b, _MM_HINT_T0);
            _mm_prefetch(v_pool + row + b, _MM_HINT_T0);
        }
    }
}

/* One sequence, KV heads [h0, h1), head size 8 * NV, on CPUs with AVX2 but not AVX-512: item_avx512's loop on 8
 * lanes and 16 registers. The context goes by chunks of up to CHUNK tiles, each in three passes:
 *   scores   per tile, KV head and query row, 8 tokens at a time: a vector of products per token in registers (the
 *            query loaded once per vector), summed across in one transposed reduction; meanwhile the next tile's K
 *            and V rows are prefetched into L1, a few rows between each 8 tokens' scores
 *   softmax  per query row over the chunk's scores at once
 *   values   per KV head, 3 query rows x 4 vectors of accumulators in registers, each V vector loaded once for the
 *            3 rows (12 accumulators, 3 weights and a V vector: the 16 registers); meanwhile the next chunk's first
 *            tile is prefetched the same way.
 * The memory reads so overlap the arithmetic of both passes. Prefetching each whole tile just before scoring it (the
 * previous loop) left them in turn: 1.06-1.10x in fp32, 1.2x int8, 1.6x bf16 at 64 x 2k tokens (docs/benchmarks.md);
 * the whole next tile at once instead measured no better than that, as the AVX-512 path's one-tile-ahead prefetch
 * into L2 did. */
INLINE void item_avx2(int kind, int ckind, const int NV, const void *q, void *out, const void *k_pool,
                      const void *v_pool, const int32_t *table, int64_t first, int64_t ctx, int64_t h0, int64_t h1,
                      int64_t hkv, int64_t group, int64_t bs, int64_t block_stride, float scale, float *work) {
    const int64_t d = 8 * NV;
    enum { RB = 3, VB = 4 };
    int64_t heads = h1 - h0, rows = heads * group, es = elem_size(kind), hs = head_stride(d, ckind);
    int64_t tok_stride = hkv * hs, ces = elem_size(ckind);
    /* qf: the query rows x scale; acc; running max m and sum l; the chunk's scores, then weights, [row][tile][16];
     * the chunk's rescaling factor per row; int8 rows' V scales [tile][head][16] */
    float *qf = work, *acc = qf + rows * d, *m = acc + rows * d, *l = m + rows, *sc = l + rows;
    float *corr = sc + rows * CHUNK * TILE, *vsc = corr + rows;
    for (int64_t r = 0; r < rows; r++) {
        const char *qr = (const char *)q + (h0 * group + r) * d * es;
        for (int j = 0; j < NV; j++) {
            _mm256_storeu_ps(qf + r * d + 8 * j, _mm256_mul_ps(load8(qr + 8 * j * es, kind), _mm256_set1_ps(scale)));
            _mm256_storeu_ps(acc + r * d + 8 * j, _mm256_setzero_ps());
        }
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    int64_t tn[CHUNK + 1], tb[CHUNK + 1];   /* tokens and element offset (head h0) of the chunk's tiles + the next */
    int64_t pos = first;
    tn[0] = tile_len(pos, ctx, bs), tb[0] = tile_base(table, pos, bs, block_stride, tok_stride) + h0 * hs;
    const char *kp = (const char *)k_pool, *vp = (const char *)v_pool;
    const int64_t row_bytes = heads * hs * ces;
    /* rows of the next tile to prefetch per 8 tokens scored, and of the next chunk's first tile per weighted-V block */
    const int64_t score_steps = heads * group * (TILE / 8), pf_score = (TILE + score_steps - 1) / score_steps;
    const int64_t v_steps = heads * ((group + RB - 1) / RB) * ((NV + VB - 1) / VB), pf_v = (TILE + v_steps - 1) / v_steps;
    prefetch_rows(kp, vp, tb[0], 0, tn[0], tok_stride, row_bytes, ces);
    while (pos < ctx) {
        const int nt = next_chunk(tn, tb, &pos, ctx, bs, table, block_stride, tok_stride, h0 * hs);
        for (int i = 0; i < nt; i++) {   /* scores */
            const int64_t n = tn[i], pn = i + 1 < nt ? tn[i + 1] : 0;
            int64_t pf = 0;
            for (int64_t h = 0; h < heads; h++) {
                const char *kh = (const char *)k_pool + (tb[i] + h * hs) * ces;
                const char *vh = (const char *)v_pool + (tb[i] + h * hs) * ces;
                float ks[TILE] = {0};
                if (ckind == KIND_I8) {   /* the rows' scales */
                    float *vs = vsc + (i * heads + h) * TILE;
                    for (int64_t t = 0; t < TILE; t++) {
                        ks[t] = t < n ? row_scale(kh + t * tok_stride * ces, d, ckind) : 0.0f;
                        vs[t] = t < n ? row_scale(vh + t * tok_stride * ces, d, ckind) : 0.0f;
                    }
                }
                for (int64_t g = 0; g < group; g++) {
                    const float *qg = qf + (h * group + g) * d;
                    float *sr = sc + ((h * group + g) * CHUNK + i) * TILE;
                    for (int64_t t0 = 0; t0 < TILE; t0 += 8) {
                        if (pf < pn) {
                            prefetch_rows(kp, vp, tb[i + 1], pf, pf + pf_score < pn ? pf + pf_score : pn, tok_stride,
                                          row_bytes, ces);
                            pf += pf_score;
                        }
                        if (t0 >= n) {
                            _mm256_storeu_ps(sr + t0, _mm256_set1_ps(-INFINITY));
                            continue;
                        }
                        /* tokens past the tile's end score its last row again, then are masked: no branch inside */
                        const char *kr[8];
                        __m256 part[8];
#pragma GCC unroll 8
                        for (int tt = 0; tt < 8; tt++) {
                            kr[tt] = kh + (t0 + tt < n ? t0 + tt : n - 1) * tok_stride * ces;
                            part[tt] = _mm256_setzero_ps();
                        }
                        for (int j = 0; j < NV; j++) {
                            const __m256 qv = _mm256_loadu_ps(qg + 8 * j);
#pragma GCC unroll 8
                            for (int tt = 0; tt < 8; tt++)
                                part[tt] = _mm256_fmadd_ps(qv, load8(kr[tt] + 8 * j * ces, ckind), part[tt]);
                        }
                        __m256 s8 = sum8x8(part);
                        if (ckind == KIND_I8) s8 = _mm256_mul_ps(s8, _mm256_loadu_ps(ks + t0));
                        const __m256 live = _mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps((float)t0)),
                                                          _mm256_set1_ps((float)n), _CMP_LT_OQ);
                        _mm256_storeu_ps(sr + t0, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s8, live));
                    }
                }
            }
        }
        for (int64_t r = 0; r < rows; r++) {   /* softmax */
            float *sr = sc + r * CHUNK * TILE;
            __m256 vm = _mm256_set1_ps(m[r]);
            for (int i = 0; i < nt; i++)
                vm = _mm256_max_ps(vm, _mm256_max_ps(_mm256_loadu_ps(sr + i * TILE), _mm256_loadu_ps(sr + i * TILE + 8)));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float mx = _mm_cvtss_f32(m4);
            __m256 sum = _mm256_setzero_ps(), mv = _mm256_set1_ps(mx);
            for (int i = 0; i < nt; i++)
                for (int64_t t0 = 0; t0 < TILE; t0 += 8) {
                    const __m256 live = _mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps((float)t0)),
                                                      _mm256_set1_ps((float)tn[i]), _CMP_LT_OQ);
                    __m256 p = _mm256_and_ps(live, exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sr + i * TILE + t0), mv)));
                    sum = _mm256_add_ps(sum, p);
                    if (ckind == KIND_I8) p = _mm256_mul_ps(p, _mm256_loadu_ps(vsc + (i * heads + r / group) * TILE + t0));
                    _mm256_storeu_ps(sr + i * TILE + t0, p);
                }
            __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
            s4 = _mm_hadd_ps(s4, s4);
            s4 = _mm_hadd_ps(s4, s4);
            corr[r] = mx != m[r] ? exp_nonpositive(m[r] - mx) : 1.0f;
            l[r] = l[r] * corr[r] + _mm_cvtss_f32(s4);
            m[r] = mx;
        }
        int64_t pf = 0;
        for (int64_t h = 0; h < heads; h++)   /* weighted V */
            for (int64_t g0 = 0; g0 < group; g0 += RB) {
                const int64_t r0 = h * group + g0, nr = group - g0 < RB ? group - g0 : RB;
                for (int jb = 0; jb < NV; jb += VB) {
                    if (pf < tn[nt]) {
                        prefetch_rows(kp, vp, tb[nt], pf, pf + pf_v < tn[nt] ? pf + pf_v : tn[nt], tok_stride, row_bytes,
                                      ces);
                        pf += pf_v;
                    }
                    __m256 a[RB][VB];
#pragma GCC unroll 3
                    for (int gg = 0; gg < RB; gg++) {
                        const __m256 c = _mm256_set1_ps(corr[r0 + (gg < nr ? gg : 0)]);
#pragma GCC unroll 4
                        for (int j = 0; j < VB; j++)
                            a[gg][j] = _mm256_mul_ps(_mm256_loadu_ps(acc + (r0 + (gg < nr ? gg : 0)) * d + 8 * (jb + j)), c);
                    }
                    for (int i = 0; i < nt; i++) {
                        const char *vh = (const char *)v_pool + (tb[i] + h * hs) * ces;
                        const float *w = sc + (r0 * CHUNK + i) * TILE;
                        for (int64_t t = 0; t < tn[i]; t++) {
                            const char *vr = vh + (t * tok_stride + 8 * jb) * ces;
                            __m256 pb[RB];
#pragma GCC unroll 3
                            for (int gg = 0; gg < RB; gg++) pb[gg] = _mm256_set1_ps(w[(gg < nr ? gg : 0) * CHUNK * TILE + t]);
#pragma GCC unroll 4
                            for (int j = 0; j < VB; j++) {
                                const __m256 v = load8(vr + 8 * j * ces, ckind);
#pragma GCC unroll 3
                                for (int gg = 0; gg < RB; gg++) a[gg][j] = _mm256_fmadd_ps(pb[gg], v, a[gg][j]);
                            }
                        }
                    }
#pragma GCC unroll 3
                    for (int gg = 0; gg < RB; gg++) {
                        if (gg >= nr) break;
#pragma GCC unroll 4
                        for (int j = 0; j < VB; j++) _mm256_storeu_ps(acc + (r0 + gg) * d + 8 * (jb + j), a[gg][j]);
                    }
                }
            }
        tn[0] = tn[nt], tb[0] = tb[nt];
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < d; i++) store1(out, (h0 * group + r) * d + i, acc[r * d + i] / l[r], kind);
}
#endif

typedef void (*item_fn)(const void *q, void *out, const void *k_pool, const void *v_pool, const int32_t *table,
                        int64_t first, int64_t ctx, int64_t h0, int64_t h1, int64_t hkv, int64_t group, int64_t d, int64_t bs,
                        int64_t block_stride, float scale, float *work);

/* One compiled item function per (q dtype, cache dtype, head size): the dtypes and the vector count must be
 * constants inside the loops, which an argument passed through the OpenMP region is not. */
#define ITEM_GENERIC(NAME, KIND, CKIND)                                                                        \
    static void NAME(const void *q, void *out, const void *k_pool, const void *v_pool, const int32_t *table,  \
                     int64_t first, int64_t ctx, int64_t h0, int64_t h1, int64_t hkv, int64_t group, int64_t d, int64_t bs,   \
                     int64_t block_stride, float scale, float *work) {                                         \
        item_generic(KIND, CKIND, q, out, k_pool, v_pool, table, first, ctx, h0, h1, hkv, group, d, bs, block_stride, \
                     scale, work);                                                                             \
    }
ITEM_GENERIC(item_f32, KIND_F32, KIND_F32)
ITEM_GENERIC(item_bf16, KIND_BF16, KIND_BF16)
ITEM_GENERIC(item_i8_f32, KIND_F32, KIND_I8)
ITEM_GENERIC(item_i8_bf16, KIND_BF16, KIND_I8)
#ifdef __FLT16_MAX__
ITEM_GENERIC(item_f16, KIND_F16, KIND_F16)
ITEM_GENERIC(item_i8_f16, KIND_F16, KIND_I8)
#endif

/* The vector path of this build: AVX-512 (16 lanes) or, on CPUs without it, AVX2 (8 lanes). */
#if defined(__AVX512F__)
#define VECTOR_ITEM item_avx512
#define LANES 16
#elif defined(PAGED_AVX2)
#define VECTOR_ITEM item_avx2
#define LANES 8
#endif
#ifdef VECTOR_ITEM
#define ITEM_VECTOR(NAME, KIND, CKIND, D)                                                                      \
    static void NAME(const void *q, void *out, const void *k_pool, const void *v_pool, const int32_t *table,  \
                     int64_t first, int64_t ctx, int64_t h0, int64_t h1, int64_t hkv, int64_t group, int64_t d, int64_t bs,   \
                     int64_t block_stride, float scale, float *work) {                                         \
        (void)d;                                                                                               \
        VECTOR_ITEM(KIND, CKIND, (D) / LANES, q, out, k_pool, v_pool, table, first, ctx, h0, h1, hkv, group, bs,    \
                    block_stride, scale, work);                                                                \
    }
ITEM_VECTOR(item_f32_d64, KIND_F32, KIND_F32, 64)
ITEM_VECTOR(item_f32_d128, KIND_F32, KIND_F32, 128)
ITEM_VECTOR(item_f32_d256, KIND_F32, KIND_F32, 256)
ITEM_VECTOR(item_bf16_d64, KIND_BF16, KIND_BF16, 64)
ITEM_VECTOR(item_bf16_d128, KIND_BF16, KIND_BF16, 128)
ITEM_VECTOR(item_bf16_d256, KIND_BF16, KIND_BF16, 256)
ITEM_VECTOR(item_f16_d64, KIND_F16, KIND_F16, 64)
ITEM_VECTOR(item_f16_d128, KIND_F16, KIND_F16, 128)
ITEM_VECTOR(item_f16_d256, KIND_F16, KIND_F16, 256)
ITEM_VECTOR(item_i8_f32_d64, KIND_F32, KIND_I8, 64)
ITEM_VECTOR(item_i8_f32_d128, KIND_F32, KIND_I8, 128)
ITEM_VECTOR(item_i8_f32_d256, KIND_F32, KIND_I8, 256)
ITEM_VECTOR(item_i8_bf16_d64, KIND_BF16, KIND_I8, 64)
ITEM_VECTOR(item_i8_bf16_d128, KIND_BF16, KIND_I8, 128)
ITEM_VECTOR(item_i8_bf16_d256, KIND_BF16, KIND_I8, 256)
ITEM_VECTOR(item_i8_f16_d64, KIND_F16, KIND_I8, 64)
ITEM_VECTOR(item_i8_f16_d128, KIND_F16, KIND_I8, 128)
ITEM_VECTOR(item_i8_f16_d256, KIND_F16, KIND_I8, 256)
#endif

static item_fn pick_item(int kind, int ckind, int64_t d) {
    int i8 = ckind == KIND_I8;
#ifdef VECTOR_ITEM
    static const item_fn fast[2][3][3] = {{{item_f32_d64, item_f32_d128, item_f32_d256},
                                           {item_bf16_d64, item_bf16_d128, item_bf16_d256},
                                           {item_f16_d64, item_f16_d128, item_f16_d256}},
                                          {{item_i8_f32_d64, item_i8_f32_d128, item_i8_f32_d256},
                                           {item_i8_bf16_d64, item_i8_bf16_d128, item_i8_bf16_d256},
                                           {item_i8_f16_d64, item_i8_f16_d128, item_i8_f16_d256}}};
    if (d == 64 || d == 128 || d == 256) return fast[i8][kind][d == 64 ? 0 : d == 128 ? 1 : 2];
#endif
    (void)d;
    if (kind == KIND_F32) return i8 ? item_i8_f32 : item_f32;
    if (kind == KIND_BF16) return i8 ? item_i8_bf16 : item_bf16;
#ifdef __FLT16_MAX__
    return i8 ? item_i8_f16 : item_f16;
#else
    return NULL;
#endif
}

/* q: [batch, hq, d] rows `q_stride` elements apart; out: [batch, hq, d] contiguous; tables: [batch, *] int32
 * block ids, rows `table_stride` apart; context_lens: [batch]; window > 0: each row attends to its last `window`
 * tokens only (sliding-window attention), 0: to all. Returns 0, or -1 if a work buffer could not be
 * allocated, -2 if this dtype was not compiled. */
static int decode(int kind, int ckind, const void *q, int64_t q_stride, void *out, const void *k_pool, const void *v_pool,
                  const int32_t *tables, int64_t table_stride, const int32_t *context_lens, int64_t batch, int64_t hq,
                  int64_t hkv, int64_t d, int64_t bs, int64_t block_stride, float scale, int64_t window,
                  int num_threads) {
    int64_t group = hq / hkv, es = elem_size(kind);
    item_fn item = pick_item(kind, ckind, d);
    if (!item) return -2;
    /* Whole sequences per item when there are enough of them; else split the KV heads too. */
    int64_t heads = hkv;
    while (heads > 1 && batch * ((hkv + heads - 1) / heads) < 4 * (int64_t)num_threads) heads = (heads + 1) / 2;
    int64_t per_seq = (hkv + heads - 1) / heads, items = batch * per_seq;
    size_t floats = work_floats(heads, group, d);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *work = malloc(floats * sizeof(float));
        if (!work) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!work) continue;
            int64_t b = it / per_seq, h0 = (it % per_seq) * heads;
            int64_t h1 = h0 + heads < hkv ? h0 + heads : hkv, ctx = context_lens[b];
            int64_t first = window > 0 && ctx > window ? ctx - window : 0;
            item((const char *)q + b * q_stride * es, (char *)out + b * hq * d * es, k_pool, v_pool,
                 tables + b * table_stride, first, ctx, h0, h1, hkv, group, d, bs, block_stride, scale, work);
        }
        free(work);
    }
    return failed ? -1 : 0;
}

#define EXPORT(NAME, KIND, CKIND)                                                                                   \
    int NAME(const void *q, int64_t q_stride, void *out, const void *k_pool, const void *v_pool,               \
             const int32_t *tables, int64_t table_stride, const int32_t *context_lens, int64_t batch, int64_t hq, \
             int64_t hkv, int64_t d, int64_t bs, int64_t block_stride, float scale, int64_t window,            \
             int num_threads) {                                                                                \
        return decode(KIND, CKIND, q, q_stride, out, k_pool, v_pool, tables, table_stride, context_lens, batch, hq, hkv, d, \
                      bs, block_stride, scale, window, num_threads);                                           \
    }

EXPORT(paged_decode_f32, KIND_F32, KIND_F32)
EXPORT(paged_decode_bf16, KIND_BF16, KIND_BF16)
EXPORT(paged_decode_i8_f32, KIND_F32, KIND_I8)
EXPORT(paged_decode_i8_bf16, KIND_BF16, KIND_I8)
#ifdef __FLT16_MAX__
EXPORT(paged_decode_f16, KIND_F16, KIND_F16)
EXPORT(paged_decode_i8_f16, KIND_F16, KIND_I8)
#endif
