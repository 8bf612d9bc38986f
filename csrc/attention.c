/* Decode attention on bfloat16 K/V caches: each query alone, over its own keys.
 *
 * Why it exists: a decode row's attention is a few thousand multiply-adds per head, and
 * SDPA's CPU kernel spends about 34 us per layer around them (blocks of 512 keys, padded
 * queries, its own buffers): a third of a batch-1 step of the default model, and 4 of a
 * batch-8 step's 13 ms. Here one call serves every decode row of a layer.
 *
 * Arithmetic (mashbox/native_ref.py's bf16_attention states the same rule in numpy; the
 * tests compare bits). Per row r (query q, its slot's keys [lo, end), lo = end - window
 * when a window is set and shorter) and query head g, all in float32 with each operation
 * rounded (no fused multiply-adds):
 *   s_k   = dot(q, k_k) * scale, dot over head_dim in 16 lanes: lane l takes the products
 *           of dims l, l + 16, ... in order, then lanes fold as l + 8, l + 4, l + 2, l + 1;
 *   softmax online over blocks of MB_ATT_BLOCK keys from lo: the first block's max is m;
 *           a later block with a larger max m' scales l and acc by e(m - m') first;
 *           p_k = e(s_k - m), then l = l + p_k and acc = acc + p_k * v_k, key by key;
 *   out   = bfloat16(acc / l), nearest even;
 * e(x) is mb_exp in bf16.h (not libm's, so numpy can repeat it). A query's bits depend
 * on its own vector, its keys and its position only: not on the other rows of the call,
 * the thread that runs it, or how its slot's cache was filled.
 *
 * Paths: portable C (built as clones), AVX-512 (16 keys at a time) and AVX2 (8 keys; its
 * value sums held in registers across a block's keys, the block's values converted once
 * for a group of query heads): the same operations in the same order, so the same bits.
 *
 * Threads: one work item per (row, K/V head), the group of query heads sharing that K/V
 * together, handed out one at a time on the caller's OpenMP pool (as linear.c's); short
 * calls run on the calling thread, where waking the pool would cost more than the work.
 */
#include "mashbox.h"
#include "bf16.h"

#include <math.h>

#define MB_ATT_LANES 16      /* float32 lanes of one dot product */
#define MB_ATT_BLOCK 64      /* keys per online-softmax block */
#define MB_ATT_MAX_GROUP 32  /* query heads per K/V head */
#define MB_ATT_MAX_DIM 256   /* head_dim, a multiple of MB_ATT_LANES */
#define MB_ATT_SERIAL 2048   /* head x keys below which the call stays on one thread */

struct mb_att_job {
    const uint16_t *q;
    int64_t ldq;
    const int64_t *rows, *slots, *ends;
    int32_t heads, kv_heads, head_dim, window;
    float scale;
    const uint16_t *k_cache, *v_cache;
    int32_t capacity;
    uint16_t *out;
    int64_t ldo;
    int64_t items;
    int64_t next; /* the next work item: atomically advanced */
    void (*run)(const struct mb_att_job *, int64_t item);
};

static inline float mb_att_dot(const float *a, const float *b, int32_t dim) {
    float lane[MB_ATT_LANES];
    for (int l = 0; l < MB_ATT_LANES; l++)
        lane[l] = a[l] * b[l];
    for (int32_t i = MB_ATT_LANES; i < dim; i += MB_ATT_LANES)
        for (int l = 0; l < MB_ATT_LANES; l++)
            lane[l] = lane[l] + a[i + l] * b[i + l];
    for (int w = MB_ATT_LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++)
            lane[l] = lane[l] + lane[l + w];
    return lane[0];
}

/* A block's scores s[0 .. n) of one query head against its running max *m: the first
 * block sets *m and *l = 0; a block with a larger max scales *l and acc[0 .. dim) by
 * e(m - max), what the earlier blocks summed, and takes its max. */
static inline void mb_att_rescale(const float *s, int32_t n, int first, float *m, float *l,
                                  float *acc, int32_t dim) {
    float top = s[0];
    for (int32_t i = 1; i < n; i++)
        top = s[i] > top ? s[i] : top;
    if (first) {
        *m = top, *l = 0.0f;
    } else if (top > *m) {
        float c = mb_exp(*m - top);
        *l = *l * c;
        for (int32_t d = 0; d < dim; d++)
            acc[d] = acc[d] * c;
        *m = top;
    }
}

/* A work item's place, the same for every path: row r = item / kv_heads, K/V head h =
 * item % kv_heads, the keys [lo, end) it attends to, its K/V head's cache rows kh, vh and
 * its group of G query heads' vectors qh. */
struct mb_att_place {
    int32_t r, h, G, D;
    int64_t lo, end;
    const uint16_t *kh, *vh, *qh;
};

static inline struct mb_att_place mb_att_place_of(const struct mb_att_job *j, int64_t item) {
    struct mb_att_place at;
    at.r = (int32_t)(item / j->kv_heads), at.h = (int32_t)(item % j->kv_heads);
    at.G = j->heads / j->kv_heads, at.D = j->head_dim;
    at.end = j->ends[at.r];
    at.lo = j->window > 0 && at.end > j->window ? at.end - j->window : 0;
    size_t head = ((size_t)j->slots[at.r] * j->kv_heads + at.h) * (size_t)j->capacity * at.D;
    at.kh = j->k_cache + head, at.vh = j->v_cache + head;
    at.qh = j->q + (size_t)j->rows[at.r] * j->ldq + (size_t)at.h * at.G * at.D;
    return at;
}

/* The item's output: out = bfloat16(acc / l), nearest even, per query head of its group. */
static inline void mb_att_store(const struct mb_att_job *j, const struct mb_att_place *at,
                                float (*acc)[MB_ATT_MAX_DIM], const float *l) {
    uint16_t *o = j->out + (size_t)j->rows[at->r] * j->ldo + (size_t)at->h * at->G * at->D;
    for (int32_t g = 0; g < at->G; g++)
        for (int32_t d = 0; d < at->D; d++)
            o[(size_t)g * at->D + d] = mb_round_bf16(acc[g][d] / l[g]);
}

/* Work item `item`: one row's group of query heads on one K/V head. */
MB_CLONES
static void mb_att_item(const struct mb_att_job *j, int64_t item) {
    const struct mb_att_place at = mb_att_place_of(j, item);
    const int32_t G = at.G, D = at.D;
    const int64_t lo = at.lo, end = at.end;
    const uint16_t *kh = at.kh, *vh = at.vh, *qh = at.qh;
    float qf[MB_ATT_MAX_GROUP][MB_ATT_MAX_DIM], acc[MB_ATT_MAX_GROUP][MB_ATT_MAX_DIM];
    float s[MB_ATT_MAX_GROUP][MB_ATT_BLOCK], m[MB_ATT_MAX_GROUP], l[MB_ATT_MAX_GROUP];
    float kf[MB_ATT_MAX_DIM];
    for (int32_t g = 0; g < G; g++)
        for (int32_t d = 0; d < D; d++) {
            qf[g][d] = mb_bf16_f32(qh[(size_t)g * D + d]);
            acc[g][d] = 0.0f;
        }
    for (int64_t b = lo; b < end; b += MB_ATT_BLOCK) {
        int32_t n = end - b < MB_ATT_BLOCK ? (int32_t)(end - b) : MB_ATT_BLOCK;
        for (int32_t i = 0; i < n; i++) {
            const uint16_t *k = kh + (size_t)(b + i) * D;
            for (int32_t d = 0; d < D; d++)
                kf[d] = mb_bf16_f32(k[d]);
            for (int32_t g = 0; g < G; g++)
                s[g][i] = mb_att_dot(qf[g], kf, D) * j->scale;
        }
        for (int32_t g = 0; g < G; g++) {
            mb_att_rescale(s[g], n, b == lo, &m[g], &l[g], acc[g], D);
            for (int32_t i = 0; i < n; i++)
                s[g][i] = mb_exp(s[g][i] - m[g]);
        }
        for (int32_t i = 0; i < n; i++) {
            const uint16_t *v = vh + (size_t)(b + i) * D;
            for (int32_t d = 0; d < D; d++)
                kf[d] = mb_bf16_f32(v[d]);
            for (int32_t g = 0; g < G; g++) {
                float p = s[g][i];
                l[g] = l[g] + p;
                for (int32_t d = 0; d < D; d++)
                    acc[g][d] = acc[g][d] + p * kf[d];
            }
        }
    }
    mb_att_store(j, &at, acc, l);
}

/* ---- AVX-512 path: the same operations, 16 keys at a time ---- */

#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 10))
#define MB_ATT_HAVE_AVX512 1
#include <immintrin.h>

#define MB_ATT_TARGET __attribute__((target("avx512f")))

static inline MB_ATT_TARGET __m512 mb_att_load_bf16(const uint16_t *p) { /* 16 bfloat16 -> float32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* The lane folds of 16 dot products at once: part[k] holds key k's 16 lane sums; each
 * stage adds lane l to lane l + 8, + 4, + 2, + 1 of the same key (as mb_att_dot), two
 * keys' halves side by side, so the 16 results come out in the order of MB_ATT_ORDER. */
static inline MB_ATT_TARGET __m512 mb_att_fold16(__m512 *part) {
    __m512 r1[8], r2[4], r3[2];
    for (int i = 0; i < 8; i++)
        r1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(part[2 * i], part[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(part[2 * i], part[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; i++)
        r2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r1[2 * i], r1[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(r1[2 * i], r1[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; i++)
        r3[i] = _mm512_add_ps(_mm512_shuffle_ps(r2[2 * i], r2[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(r2[2 * i], r2[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 r4 = _mm512_add_ps(_mm512_shuffle_ps(r3[0], r3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_ps(r3[0], r3[1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* lane i of r4 holds key 0, 4, 8, 12, 1, 5, ...: put key k in lane k */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r4);
}

static MB_ATT_TARGET void mb_att_item_avx512(const struct mb_att_job *j, int64_t item) {
    const struct mb_att_place at = mb_att_place_of(j, item);
    const int32_t G = at.G, D = at.D, V = D / MB_ATT_LANES;
    const int64_t lo = at.lo, end = at.end;
    const uint16_t *kh = at.kh, *vh = at.vh, *qh = at.qh;
    float qf[MB_ATT_MAX_GROUP][MB_ATT_MAX_DIM] __attribute__((aligned(64)));
    float acc[MB_ATT_MAX_GROUP][MB_ATT_MAX_DIM] __attribute__((aligned(64)));
    float s[MB_ATT_MAX_GROUP][MB_ATT_BLOCK] __attribute__((aligned(64)));
    float kf[MB_ATT_LANES][MB_ATT_MAX_DIM] __attribute__((aligned(64)));
    float m[MB_ATT_MAX_GROUP], l[MB_ATT_MAX_GROUP];
    const __m512 scale = _mm512_set1_ps(j->scale);
    for (int32_t g = 0; g < G; g++)
        for (int32_t v = 0; v < V; v++) {
            _mm512_store_ps(qf[g] + 16 * v, mb_att_load_bf16(qh + (size_t)g * D + 16 * v));
            _mm512_store_ps(acc[g] + 16 * v, _mm512_setzero_ps());
        }
    for (int64_t b = lo; b < end; b += MB_ATT_BLOCK) {
        int32_t n = end - b < MB_ATT_BLOCK ? (int32_t)(end - b) : MB_ATT_BLOCK;
        for (int32_t c0 = 0; c0 < n; c0 += MB_ATT_LANES) {
            int32_t nk = n - c0 < MB_ATT_LANES ? n - c0 : MB_ATT_LANES;
            for (int32_t i = 0; i < nk; i++)
                for (int32_t v = 0; v < V; v++)
                    _mm512_store_ps(kf[i] + 16 * v, mb_att_load_bf16(kh + (size_t)(b + c0 + i) * D + 16 * v));
            for (int32_t g = 0; g < G; g++) {
                __m512 part[MB_ATT_LANES];
                for (int32_t i = 0; i < MB_ATT_LANES; i++) {
                    if (i >= nk) { /* past the block's keys: folded, never read */
                        part[i] = _mm512_setzero_ps();
                        continue;
                    }
                    __m512 lane = _mm512_mul_ps(_mm512_load_ps(qf[g]), _mm512_load_ps(kf[i]));
                    for (int32_t v = 1; v < V; v++)
                        lane = _mm512_add_ps(lane, _mm512_mul_ps(_mm512_load_ps(qf[g] + 16 * v),
                                                                 _mm512_load_ps(kf[i] + 16 * v)));
                    part[i] = lane;
                }
                _mm512_store_ps(s[g] + c0, _mm512_mul_ps(mb_att_fold16(part), scale));
            }
        }
        __mmask16 tail = (__mmask16)(n % 16 ? (1u << (n % 16)) - 1u : 0xffffu);
        for (int32_t g = 0; g < G; g++) {
            mb_att_rescale(s[g], n, b == lo, &m[g], &l[g], acc[g], D);
            __m512 mv = _mm512_set1_ps(m[g]);
            for (int32_t i = 0; i < n; i += 16) {
                __mmask16 k = i + 16 <= n ? (__mmask16)0xffffu : tail;
                _mm512_mask_store_ps(s[g] + i, k, mb_exp16(_mm512_sub_ps(_mm512_maskz_load_ps(k, s[g] + i), mv)));
            }
        }
        for (int32_t i = 0; i < n; i++) {
            __m512 vf[MB_ATT_MAX_DIM / MB_ATT_LANES];
            for (int32_t v = 0; v < V; v++)
                vf[v] = mb_att_load_bf16(vh + (size_t)(b + i) * D + 16 * v);
            for (int32_t g = 0; g < G; g++) {
                float p = s[g][i];
                __m512 pv = _mm512_set1_ps(p);
                l[g] = l[g] + p;
                for (int32_t v = 0; v < V; v++)
                    _mm512_store_ps(acc[g] + 16 * v,
                                    _mm512_add_ps(_mm512_load_ps(acc[g] + 16 * v), _mm512_mul_ps(pv, vf[v])));
            }
        }
    }
    mb_att_store(j, &at, acc, l);
}

#endif

/* ---- AVX2 path: the same operations, 8 keys at a time ----
 * A dot's 16 lanes are two ymm (dims 16v .. 16v + 7 and 16v + 8 .. 16v + 15); the folds
 * of 8 keys' dots at once give their scores in one ymm. target avx2 without fma, so
 * every mul and add stays apart as the rule has them. */
#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 10))
#define MB_ATT_HAVE_AVX2 1

#define MB_ATT2_TARGET __attribute__((target("avx2")))
#define MB_ATT2_INLINE static inline __attribute__((always_inline)) MB_ATT2_TARGET

MB_ATT2_INLINE __m256 mb_att2_load_bf16(const uint16_t *p) { /* 8 bfloat16 -> float32 */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* lo[i], hi[i]: lanes 0-7 and 8-15 of key i's 16 lane sums. Each stage adds lane l to
 * lane l + 8, + 4, + 2, + 1 of the same key (as mb_att_dot), two or four keys side by
 * side: the 8 dots, key i in lane i. */
MB_ATT2_INLINE __m256 mb_att2_fold8(const __m256 *lo, const __m256 *hi) {
    __m256 r0[8], r1[4], r2[2];
    for (int i = 0; i < 8; i++)
        r0[i] = _mm256_add_ps(lo[i], hi[i]);
    for (int i = 0; i < 4; i++) /* lanes 0-3 key 2i, 4-7 key 2i + 1 */
        r1[i] = _mm256_add_ps(_mm256_permute2f128_ps(r0[2 * i], r0[2 * i + 1], 0x20),
                              _mm256_permute2f128_ps(r0[2 * i], r0[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++) /* pairs of lanes: keys 4i, 4i + 2, 4i + 1, 4i + 3 */
        r2[i] = _mm256_add_ps(_mm256_shuffle_ps(r1[2 * i], r1[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm256_shuffle_ps(r1[2 * i], r1[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m256 r3 = _mm256_add_ps(_mm256_shuffle_ps(r2[0], r2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm256_shuffle_ps(r2[0], r2[1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* lane i of r3 holds key 0, 2, 4, 6, 1, 3, 5, 7: put key k in lane k */
    return _mm256_permutevar8x32_ps(r3, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* acc[0 .. 8 NV) += p_i * v_i for the block's keys i < n in order, NV ymm of it held in
 * registers across the keys: from the cache's bfloat16 rows vb (stride D) or, where vf
 * is set, their float32 (stride MB_ATT_MAX_DIM). */
MB_ATT2_INLINE void mb_att2_pv(float *acc, const float *p, int32_t n, const uint16_t *vb, const float *vf,
                               int32_t D, const int NV) {
    __m256 a[8];
    for (int v = 0; v < NV; v++)
        a[v] = _mm256_load_ps(acc + 8 * v);
    for (int32_t i = 0; i < n; i++) {
        __m256 pv = _mm256_set1_ps(p[i]);
        for (int v = 0; v < NV; v++) {
            __m256 x = vf ? _mm256_load_ps(vf + (size_t)i * MB_ATT_MAX_DIM + 8 * v)
                          : mb_att2_load_bf16(vb + (size_t)i * D + 8 * v);
            a[v] = _mm256_add_ps(a[v], _mm256_mul_ps(pv, x));
        }
    }
    for (int v = 0; v < NV; v++)
        _mm256_store_ps(acc + 8 * v, a[v]);
}

static MB_ATT2_TARGET void mb_att_item_avx2(const struct mb_att_job *j, int64_t item) {
    const struct mb_att_place at = mb_att_place_of(j, item);
    const int32_t G = at.G, D = at.D, V = D / MB_ATT_LANES, D8 = D / 8;
    const int64_t lo = at.lo, end = at.end;
    const uint16_t *kh = at.kh, *vh = at.vh, *qh = at.qh;
    float qf[MB_ATT_MAX_GROUP][MB_ATT_MAX_DIM] __attribute__((aligned(32)));
    float acc[MB_ATT_MAX_GROUP][MB_ATT_MAX_DIM] __attribute__((aligned(32)));
    float s[MB_ATT_MAX_GROUP][MB_ATT_BLOCK] __attribute__((aligned(32)));
    float kf[8][MB_ATT_MAX_DIM] __attribute__((aligned(32)));
    float vf[MB_ATT_BLOCK][MB_ATT_MAX_DIM] __attribute__((aligned(32))); /* G > 1: a block's values */
    float m[MB_ATT_MAX_GROUP], l[MB_ATT_MAX_GROUP];
    const __m256 scale = _mm256_set1_ps(j->scale);
    for (int32_t g = 0; g < G; g++)
        for (int32_t v = 0; v < D8; v++) {
            _mm256_store_ps(qf[g] + 8 * v, mb_att2_load_bf16(qh + (size_t)g * D + 8 * v));
            _mm256_store_ps(acc[g] + 8 * v, _mm256_setzero_ps());
        }
    for (int64_t b = lo; b < end; b += MB_ATT_BLOCK) {
        int32_t n = end - b < MB_ATT_BLOCK ? (int32_t)(end - b) : MB_ATT_BLOCK;
        for (int32_t c0 = 0; c0 < n; c0 += 8) {
            int32_t nk = n - c0 < 8 ? n - c0 : 8;
            for (int32_t i = 0; i < nk; i++)
                for (int32_t v = 0; v < D8; v++)
                    _mm256_store_ps(kf[i] + 8 * v, mb_att2_load_bf16(kh + (size_t)(b + c0 + i) * D + 8 * v));
            for (int32_t g = 0; g < G; g++) {
                __m256 plo[8], phi[8];
                for (int32_t i = 0; i < 8; i++) {
                    if (i >= nk) { /* past the block's keys: folded, never read */
                        plo[i] = phi[i] = _mm256_setzero_ps();
                        continue;
                    }
                    __m256 a = _mm256_mul_ps(_mm256_load_ps(qf[g]), _mm256_load_ps(kf[i]));
                    __m256 z = _mm256_mul_ps(_mm256_load_ps(qf[g] + 8), _mm256_load_ps(kf[i] + 8));
                    for (int32_t v = 1; v < V; v++) {
                        a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_load_ps(qf[g] + 16 * v),
                                                           _mm256_load_ps(kf[i] + 16 * v)));
                        z = _mm256_add_ps(z, _mm256_mul_ps(_mm256_load_ps(qf[g] + 16 * v + 8),
                                                           _mm256_load_ps(kf[i] + 16 * v + 8)));
                    }
                    plo[i] = a, phi[i] = z;
                }
                /* c0 + 8 <= MB_ATT_BLOCK: the lanes past n are written (zeros), never read */
                _mm256_store_ps(s[g] + c0, _mm256_mul_ps(mb_att2_fold8(plo, phi), scale));
            }
        }
        for (int32_t g = 0; g < G; g++) {
            mb_att_rescale(s[g], n, b == lo, &m[g], &l[g], acc[g], D);
            __m256 mv = _mm256_set1_ps(m[g]);
            for (int32_t i = 0; i < n; i += 8)
                _mm256_store_ps(s[g] + i, mb_exp8(_mm256_sub_ps(_mm256_load_ps(s[g] + i), mv)));
        }
        /* the block's values: float32 once for a group of heads, read from the cache by one */
        const uint16_t *vb = vh + (size_t)b * D;
        if (G > 1)
            for (int32_t i = 0; i < n; i++)
                for (int32_t v = 0; v < D8; v++)
                    _mm256_store_ps(vf[i] + 8 * v, mb_att2_load_bf16(vb + (size_t)i * D + 8 * v));
        for (int32_t g = 0; g < G; g++) {
            for (int32_t i = 0; i < n; i++)
                l[g] = l[g] + s[g][i];
            int32_t d0 = 0;
            for (; d0 + 64 <= D; d0 += 64)
                mb_att2_pv(acc[g] + d0, s[g], n, vb + d0, G > 1 ? vf[0] + d0 : NULL, D, 8);
            if (D - d0 >= 32)
                mb_att2_pv(acc[g] + d0, s[g], n, vb + d0, G > 1 ? vf[0] + d0 : NULL, D, 4), d0 += 32;
            if (D - d0 >= 16)
                mb_att2_pv(acc[g] + d0, s[g], n, vb + d0, G > 1 ? vf[0] + d0 : NULL, D, 2);
        }
    }
    mb_att_store(j, &at, acc, l);
}
#endif

static void mb_att_worker(void *data) {
    struct mb_att_job *j = (struct mb_att_job *)data;
    for (;;) {
        int64_t item = mb_take_one(&j->next);
        if (item >= j->items)
            return;
        j->run(j, item);
    }
}

int mb_bf16_attention(const uint16_t *q, int64_t ldq, int32_t n_q, const int64_t *rows,
                      const int64_t *slots, const int64_t *ends, int32_t t, int32_t heads,
                      int32_t kv_heads, int32_t head_dim, int32_t window, float scale,
                      const uint16_t *k_cache, const uint16_t *v_cache, int32_t n_slots,
                      int32_t capacity, uint16_t *out, int64_t ldo, int32_t kernel,
                      void *parallel, int32_t threads) {
    if (t < 0 || heads < 1 || kv_heads < 1 || heads % kv_heads || heads / kv_heads > MB_ATT_MAX_GROUP ||
        head_dim < MB_ATT_LANES || head_dim % MB_ATT_LANES || head_dim > MB_ATT_MAX_DIM ||
        ldq < (int64_t)heads * head_dim || ldo < (int64_t)heads * head_dim || n_slots < 1 ||
        capacity < 1)
        return MB_EINVAL;
    int64_t work = 0; /* head x keys */
    for (int32_t r = 0; r < t; r++) {
        if (rows[r] < 0 || rows[r] >= n_q || slots[r] < 0 || slots[r] >= n_slots || ends[r] < 1 ||
            ends[r] > capacity)
            return MB_EINVAL;
        work += (window > 0 && ends[r] > window ? window : ends[r]) * (int64_t)heads;
    }
    struct mb_att_job j;
    memset(&j, 0, sizeof j);
    j.q = q, j.ldq = ldq, j.rows = rows, j.slots = slots, j.ends = ends;
    j.heads = heads, j.kv_heads = kv_heads, j.head_dim = head_dim, j.window = window;
    j.scale = scale, j.k_cache = k_cache, j.v_cache = v_cache, j.capacity = capacity;
    j.out = out, j.ldo = ldo, j.items = (int64_t)t * kv_heads;
    if (kernel == MB_KERNEL_PORTABLE)
        j.run = mb_att_item;
#if MB_ATT_HAVE_AVX2
    else if (kernel == MB_KERNEL_AVX2 && mb_avx2_supported())
        j.run = mb_att_item_avx2;
#endif
#if MB_ATT_HAVE_AVX512
    else if (kernel == MB_KERNEL_AVX512BF16 && mb_bf16_kernel() == MB_KERNEL_AVX512BF16)
        j.run = mb_att_item_avx512;
#endif
    else
        return MB_EINVAL;
#ifdef MB_ATOMICS
    if (parallel != NULL && threads > 1 && j.items > 1 && work >= MB_ATT_SERIAL) {
        ((mb_parallel_fn)parallel)(mb_att_worker, &j, (unsigned)threads, 0);
        return MB_OK;
    }
#endif
    mb_att_worker(&j);
    return MB_OK;
}

/* ==== Prefill attention: causal, tiled over queries and keys ====
 *
 * Why it exists: a 20k-token prompt's attention is ~14 TFLOP on the default model; SDPA's
 * CPU kernel runs it on float32 arithmetic over padded key widths. Here a tile is
 * MB_PF_Q consecutive queries of one prompt row and one K/V head (its group of query
 * heads together), walked over its keys in blocks of MB_PF_BLOCK from key 0 with an
 * online softmax, the dot products on AVX512-BF16's vdpbf16ps; a work item walks up to
 * MB_PF_TILES neighbouring tiles together, each block of K/V read once for all of them.
 *
 * Arithmetic (mashbox/native_ref.py's bf16_prefill_attention states the same rule in
 * numpy; the tests compare bits). Per query at position p (keys k with k <= p and, with a
 * window w > 0, k > p - w: the valid keys) and query head, float32, each operation
 * rounded, denormal inputs and sums flushed to zero (vdpbf16ps' rules, as linear.c's):
 *   s_k = dot(q, k_k) * scale2, scale2 = scale * log2(e) (float32 product: the scores
 *         in base 2), dot over head_dim pairs in order from 0:
 *         s = s + q[2i+1] k[2i+1]; s = s + q[2i] k[2i];
 *   blocks of MB_PF_BLOCK keys anchored at key 0; m starts at -inf, l and acc at 0; a
 *         block whose largest valid score top > m scales l and acc by e2(m - top) and
 *         sets m = top; then p_k = bfloat16(e2(s_k - m)) (nearest even) for a valid key,
 *         0 for any other; over the block's key pairs (k even) l = l + p_{k+1}, then
 *         l = l + p_k, and acc = acc + p_{k+1} v_{k+1}, then acc = acc + p_k v_k;
 *   out = bfloat16(acc / l), nearest even.
 * e2(x) = 2^x for x <= 0 to bfloat16's precision (mb_pf_exp2: the probabilities are
 * rounded to bfloat16 before they weigh anything, so libm's exp's last bits would buy
 * nothing): y = max(x, -150) (NaN -> -150), n = y rounded to the nearest integer (ties
 * even), f = y - n, p = (((c4 f + c3) f + c2) f + c1) f + 1 (relative error under 3e-6),
 * e2 = p * 2^n, 0 where that is below 2^-126 (a denormal).
 * Blocks or keys a query has no valid key in add exact zeros, so a query's bits depend on
 * its own vector, its keys and its position only (up to the sign of a zero output): not
 * on the tile it lands in, the chunk it was prefilled in or the other rows of the call.
 * (The decode kernel above keeps its own float32 rule: a generated token's K/V can differ
 * in its last bits from the same token's computed as part of a prompt, as with SDPA.)
 *
 * Layout in a work item (AVX-512): lanes are the tile's queries. The queries as
 * bfloat16 pairs qt [head_dim / 2][group][16]; the scores s [block keys][group][16]; the
 * accumulators acc [group][head_dim][16]; each key's pair broadcast from the cache, each
 * value pair (two keys' value at one dim) from vp [block / 2][head_dim].
 *
 * Threads: work items (row, run of query tiles, K/V head), the last runs of a row (most
 * keys) first, handed out one at a time on the caller's OpenMP pool, as the decode
 * kernel's. */

#define MB_PF_Q 16          /* queries per tile: one float32 lane each */
#define MB_PF_BLOCK 64      /* keys per online-softmax block, anchored at key 0 */
#define MB_PF_MAX_GROUP 16  /* query heads per K/V head */
#define MB_PF_MAX_GD 1024   /* group * head_dim */
#define MB_PF_ITEM_GD 1536  /* tile_run * group * head_dim: a work item's query buffers */
#define MB_PF_KB 8          /* keys per score micro-tile */
#define MB_PF_DB 8          /* dims per value micro-tile */
#define MB_PF_TILES 8       /* query tiles per work item, walked over the keys together (4: 6% slower at 20k keys) */

struct mb_pf_job {
    const uint16_t *q;
    int64_t ldq;
    const int64_t *firsts, *slots, *starts, *lens;
    int32_t t, heads, kv_heads, head_dim, window;
    float scale;
    const uint16_t *k_cache, *v_cache;
    int32_t capacity;
    uint16_t *out;
    int64_t ldo;
    int32_t tile_run; /* query tiles per work item (1 for the portable kernel) */
    int64_t items;
    int64_t next; /* the next work item: atomically advanced */
    void (*run)(const struct mb_pf_job *, int32_t r, int32_t tile, int32_t h);
};

/* Work items of a row of len queries along one K/V head: runs of tile_run tiles. */
static inline int32_t mb_pf_runs(int64_t len, int32_t tile_run) {
    int64_t tiles = (len + MB_PF_Q - 1) / MB_PF_Q;
    return (int32_t)((tiles + tile_run - 1) / tile_run);
}

static inline int mb_pf_valid(int64_t k, int64_t p, int32_t window) {
    return k <= p && (window <= 0 || k > p - window);
}

/* First block (a multiple of MB_PF_BLOCK) holding a valid key of the tile's first query. */
static inline int64_t mb_pf_klo(int64_t p0, int32_t window) {
    int64_t lo = window > 0 && p0 - window + 1 > 0 ? p0 - window + 1 : 0;
    return lo - lo % MB_PF_BLOCK;
}

static inline float mb_pf_in(uint16_t b) { return mb_flush(mb_bf16_f32(b)); }

/* e2's polynomial: a fit of 2^f on [-1/2, 1/2] with p(0) = 1 */
#define MB_PF_C1 0.6931241750717163f
#define MB_PF_C2 0.24024099111557007f
#define MB_PF_C3 0.05590642988681793f
#define MB_PF_C4 0.009582851082086563f
#define MB_PF_LOG2E 1.44269504f

static inline float mb_pf_exp2(float x) { /* e2 of the rule above */
    float y = x > -150.0f ? x : -150.0f;
    float n = (y + 12582912.0f) - 12582912.0f; /* nearest integer, ties even (|y| < 2^22) */
    float f = y - n;
    float p = MB_PF_C4;
    p = p * f + MB_PF_C3;
    p = p * f + MB_PF_C2;
    p = p * f + MB_PF_C1;
    p = p * f + 1.0f;
    return n < -126.0f ? 0.0f : mb_flush(p * mb_bits_f32((uint32_t)((int32_t)n + 127) << 23));
}

MB_CLONES
static void mb_pf_item(const struct mb_pf_job *j, int32_t r, int32_t tile, int32_t h) {
    int32_t G = j->heads / j->kv_heads, D = j->head_dim;
    int64_t start = j->starts[r], len = j->lens[r];
    int32_t i0 = tile * MB_PF_Q, nq = len - i0 < MB_PF_Q ? (int32_t)(len - i0) : MB_PF_Q;
    size_t head = ((size_t)j->slots[r] * j->kv_heads + h) * (size_t)j->capacity * D;
    const uint16_t *kh = j->k_cache + head, *vh = j->v_cache + head;
    int64_t khi = start + i0 + nq, klo = mb_pf_klo(start + i0, j->window);
    float s[MB_PF_BLOCK], p[MB_PF_BLOCK], acc[MB_ATT_MAX_DIM];
    for (int32_t i = 0; i < nq; i++) {
        int64_t pos = start + i0 + i, row = j->firsts[r] + i0 + i;
        for (int32_t g = 0; g < G; g++) {
            const uint16_t *qr = j->q + (size_t)row * j->ldq + (size_t)(h * G + g) * D;
            float m = -INFINITY, l = 0.0f;
            for (int32_t d = 0; d < D; d++)
                acc[d] = 0.0f;
            for (int64_t b = klo; b < khi; b += MB_PF_BLOCK) {
                int32_t nk = khi - b < MB_PF_BLOCK ? (int32_t)(khi - b) : MB_PF_BLOCK;
                float top = -INFINITY;
                for (int32_t k = 0; k < nk; k++) {
                    s[k] = -INFINITY;
                    if (!mb_pf_valid(b + k, pos, j->window))
                        continue;
                    const uint16_t *kr = kh + (size_t)(b + k) * D;
                    float dot = 0.0f;
                    for (int32_t x = 0; x < D; x += 2) {
                        dot = mb_flush(dot + mb_pf_in(qr[x + 1]) * mb_pf_in(kr[x + 1]));
                        dot = mb_flush(dot + mb_pf_in(qr[x]) * mb_pf_in(kr[x]));
                    }
                    s[k] = dot * j->scale;
                    top = s[k] > top ? s[k] : top;
                }
                if (top > m) {
                    float c = mb_pf_exp2(m - top);
                    l = l * c;
                    for (int32_t d = 0; d < D; d++)
                        acc[d] = acc[d] * c;
                    m = top;
                }
                for (int32_t k = 0; k < nk; k++)
                    p[k] = mb_pf_valid(b + k, pos, j->window) ? mb_bf16_f32(mb_round_bf16(mb_pf_exp2(s[k] - m))) : 0.0f;
                for (int32_t k = 0; k < nk; k += 2) {
                    l = l + (k + 1 < nk ? p[k + 1] : 0.0f);
                    l = l + p[k];
                }
                for (int32_t k = 0; k < nk; k += 2) {
                    const uint16_t *v0 = vh + (size_t)(b + k) * D, *v1 = v0 + D;
                    float p1 = k + 1 < nk ? p[k + 1] : 0.0f;
                    for (int32_t d = 0; d < D; d++) {
                        float odd = k + 1 < nk ? p1 * mb_pf_in(v1[d]) : 0.0f;
                        acc[d] = mb_flush(acc[d] + odd);
                        acc[d] = mb_flush(acc[d] + p[k] * mb_pf_in(v0[d]));
                    }
                }
            }
            uint16_t *o = j->out + (size_t)row * j->ldo + (size_t)(h * G + g) * D;
            for (int32_t d = 0; d < D; d++)
                o[d] = mb_round_bf16(acc[d] / l);
        }
    }
}

#if MB_ATT_HAVE_AVX512
#define MB_PF_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

/* The dim that place d of a value pair row holds when 32 dims are interleaved by
 * unpacklo / unpackhi (4 dims of each 128-bit lane at a time). */
static inline int32_t mb_pf_dim(int32_t d) {
    int32_t c = d & ~31, j = d & 31, h = j >= 16, w = j & 15;
    return c + 8 * (w / 4) + 4 * h + w % 4;
}
#undef MB_PF_TARGET
#define MB_PF_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

/* mb_pf_exp2 on 16 lanes, but results below 2^-126 left as scalef makes them (denormals):
 * the probabilities' conversion to bfloat16 flushes them (vcvtne2ps2bf16 takes denormals
 * as zeros), and the rescale factor flushes them itself (mb_pf_exp2_flushed16). */
static inline __attribute__((always_inline)) MB_PF_TARGET __m512 mb_pf_exp2_16(__m512 x) {
    __m512 y = _mm512_max_ps(x, _mm512_set1_ps(-150.0f)); /* a NaN x gives the second operand */
    __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(y, n);
    __m512 p = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(MB_PF_C4), f), _mm512_set1_ps(MB_PF_C3));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(MB_PF_C2));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(MB_PF_C1));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline MB_PF_TARGET __m512 mb_pf_exp2_flushed16(__m512 x) {
    __m512 e = mb_pf_exp2_16(x);
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(e, _mm512_set1_ps(0x1p-126f), _CMP_GE_OQ), e);
}

/* Scores of GB query heads (from g0) x MB_PF_KB keys krow[]: s [keys][group][16]. */
static inline __attribute__((always_inline)) MB_PF_TARGET void
mb_pf_scores(const uint32_t *qt, int32_t G, int32_t g0, const int GB, const uint16_t *const *krow, int32_t P,
             float *s, __m512 scale) {
    __m512 acc[3][MB_PF_KB];
    for (int gg = 0; gg < GB; gg++)
        for (int kk = 0; kk < MB_PF_KB; kk++)
            acc[gg][kk] = _mm512_setzero_ps();
    for (int32_t x = 0; x < P; x++) {
        __m512bh qv[3];
        for (int gg = 0; gg < GB; gg++)
            qv[gg] = (__m512bh)_mm512_load_si512(qt + ((size_t)x * G + g0 + gg) * MB_PF_Q);
        for (int kk = 0; kk < MB_PF_KB; kk++) {
            int32_t pair;
            memcpy(&pair, krow[kk] + 2 * x, 4);
            __m512bh kb = (__m512bh)_mm512_set1_epi32(pair);
            for (int gg = 0; gg < GB; gg++)
                acc[gg][kk] = _mm512_dpbf16_ps(acc[gg][kk], qv[gg], kb);
        }
    }
    for (int gg = 0; gg < GB; gg++)
        for (int kk = 0; kk < MB_PF_KB; kk++)
            _mm512_store_ps(s + ((size_t)kk * G + g0 + gg) * MB_PF_Q, _mm512_mul_ps(acc[gg][kk], scale));
}

/* acc [group][head_dim][16] += the block's p x v for GB query heads (from g0) and
 * MB_PF_DB dims (from d0): pp [pairs][group][16] probability pairs, vp [pairs][head_dim]. */
static inline __attribute__((always_inline)) MB_PF_TARGET void
mb_pf_values(float *acc, const uint32_t *pp, const uint32_t *vp, int32_t G, int32_t D, int32_t g0, const int GB,
             int32_t d0, int32_t pairs) {
    __m512 a[3][MB_PF_DB];
    for (int gg = 0; gg < GB; gg++)
        for (int dd = 0; dd < MB_PF_DB; dd++)
            a[gg][dd] = _mm512_load_ps(acc + ((size_t)(g0 + gg) * D + d0 + dd) * MB_PF_Q);
    for (int32_t x = 0; x < pairs; x++) {
        __m512bh pv[3];
        for (int gg = 0; gg < GB; gg++)
            pv[gg] = (__m512bh)_mm512_load_si512(pp + ((size_t)x * G + g0 + gg) * MB_PF_Q);
        for (int dd = 0; dd < MB_PF_DB; dd++) {
            __m512bh vb = (__m512bh)_mm512_set1_epi32((int32_t)vp[(size_t)x * D + d0 + dd]);
            for (int gg = 0; gg < GB; gg++)
                a[gg][dd] = _mm512_dpbf16_ps(a[gg][dd], pv[gg], vb);
        }
    }
    for (int gg = 0; gg < GB; gg++)
        for (int dd = 0; dd < MB_PF_DB; dd++)
            _mm512_store_ps(acc + ((size_t)(g0 + gg) * D + d0 + dd) * MB_PF_Q, a[gg][dd]);
}

/* One tile's state in a work item: its queries' place, their bfloat16 pairs and sums. */
struct mb_pf_tile {
    int32_t i0, nq;        /* first query of the row, queries (<= MB_PF_Q) */
    int64_t p0, klo, khi;  /* first query's position; keys [klo, khi) in blocks */
    __m512i pos, wlo;      /* lanes' positions (padding lanes the last query's); valid: wlo < k <= pos */
    uint32_t *qt;          /* [head_dim / 2][group][16] */
    float *acc;            /* [group][head_dim][16] */
    __m512 *m, *l;         /* [group] */
};

/* Block b's scores, softmax and values for one tile; vp holds the block's value pairs
 * (for the item's last tile, whose keys reach furthest: a shorter tile's odd key past its
 * khi meets a zero probability). */
static inline __attribute__((always_inline)) MB_PF_TARGET void
mb_pf_tile_block(const struct mb_pf_job *j, struct mb_pf_tile *t, const uint16_t *kh, int64_t b, float *s,
                 uint32_t *pp, const uint32_t *vp) {
    int32_t G = j->heads / j->kv_heads, D = j->head_dim, P = D / 2;
    int32_t nk = t->khi - b < MB_PF_BLOCK ? (int32_t)(t->khi - b) : MB_PF_BLOCK;
    const __m512 scale = _mm512_set1_ps(j->scale), one = _mm512_set1_ps(1.0f), ninf = _mm512_set1_ps(-INFINITY);
    const __m512i ilv = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0); /* word 2i: i, 2i + 1: 16 + i */
    const __m512bh ones = (__m512bh)_mm512_set1_epi32(0x3f803f80); /* bfloat16 1.0 pairs */
    /* scores; keys past khi (at most MB_PF_KB - 1 of them) read key khi - 1 again */
    for (int32_t k0 = 0; k0 < nk; k0 += MB_PF_KB) {
        const uint16_t *krow[MB_PF_KB];
        for (int kk = 0; kk < MB_PF_KB; kk++)
            krow[kk] = kh + (size_t)(b + (k0 + kk < nk ? k0 + kk : nk - 1)) * D;
        int32_t g = 0;
        for (; g + 3 <= G; g += 3)
            mb_pf_scores(t->qt, G, g, 3, krow, P, s + (size_t)k0 * G * MB_PF_Q, scale);
        if (G - g == 2)
            mb_pf_scores(t->qt, G, g, 2, krow, P, s + (size_t)k0 * G * MB_PF_Q, scale);
        else if (G - g == 1)
            mb_pf_scores(t->qt, G, g, 1, krow, P, s + (size_t)k0 * G * MB_PF_Q, scale);
    }
    __mmask16 valid[MB_PF_BLOCK];
    for (int32_t k = 0; k < nk; k++) {
        __m512i kv = _mm512_set1_epi32((int32_t)(b + k));
        __mmask16 v = _mm512_cmp_epi32_mask(kv, t->pos, _MM_CMPINT_LE);
        if (j->window > 0)
            v &= _mm512_cmp_epi32_mask(kv, t->wlo, _MM_CMPINT_NLE);
        valid[k] = v;
    }
    int32_t pairs = (nk + 1) / 2;
    /* every key of the block valid for every query of the tile: no masks to apply */
    int full = b + nk - 1 <= t->p0 && (j->window <= 0 || b > t->khi - 1 - j->window);
    for (int32_t g = 0; g < G; g++) {
        __m512 top = ninf;
        if (full)
            for (int32_t k = 0; k < nk; k++)
                top = _mm512_max_ps(top, _mm512_load_ps(s + ((size_t)k * G + g) * MB_PF_Q));
        else
            for (int32_t k = 0; k < nk; k++) {
                float *sk = s + ((size_t)k * G + g) * MB_PF_Q;
                __m512 sv = _mm512_mask_blend_ps(valid[k], ninf, _mm512_load_ps(sk));
                _mm512_store_ps(sk, sv);
                top = _mm512_max_ps(top, sv);
            }
        __mmask16 up = _mm512_cmp_ps_mask(top, t->m[g], _CMP_GT_OQ);
        if (up) {
            __m512 c = _mm512_mask_blend_ps(up, one, mb_pf_exp2_flushed16(_mm512_sub_ps(t->m[g], top)));
            t->l[g] = _mm512_mul_ps(t->l[g], c);
            float *ag = t->acc + (size_t)g * D * MB_PF_Q;
            for (int32_t d = 0; d < D; d++)
                _mm512_store_ps(ag + (size_t)d * MB_PF_Q, _mm512_mul_ps(_mm512_load_ps(ag + (size_t)d * MB_PF_Q), c));
            t->m[g] = _mm512_mask_blend_ps(up, t->m[g], top);
        }
        __m512 mg = t->m[g], lg = t->l[g];
        for (int32_t x = 0; x < pairs; x++) {
            int32_t k = 2 * x;
            __m512 e0 = mb_pf_exp2_16(_mm512_sub_ps(_mm512_load_ps(s + ((size_t)k * G + g) * MB_PF_Q), mg));
            __m512 e1 = _mm512_setzero_ps();
            if (k + 1 < nk)
                e1 = mb_pf_exp2_16(_mm512_sub_ps(_mm512_load_ps(s + ((size_t)(k + 1) * G + g) * MB_PF_Q), mg));
            if (!full) {
                e0 = _mm512_maskz_mov_ps(valid[k], e0);
                e1 = k + 1 < nk ? _mm512_maskz_mov_ps(valid[k + 1], e1) : e1;
            }
            /* nearest even, as mb_round_bf16 (denormals to zero); key k's in the low half */
            __m512i pair = _mm512_permutexvar_epi16(ilv, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
            _mm512_store_si512(pp + ((size_t)x * G + g) * MB_PF_Q, pair);
            lg = _mm512_dpbf16_ps(lg, (__m512bh)pair, ones); /* l + p_{k+1}, then + p_k */
        }
        t->l[g] = lg;
    }
    for (int32_t d0 = 0; d0 < D; d0 += MB_PF_DB) {
        int32_t g = 0;
        for (; g + 3 <= G; g += 3)
            mb_pf_values(t->acc, pp, vp, G, D, g, 3, d0, pairs);
        if (G - g == 2)
            mb_pf_values(t->acc, pp, vp, G, D, g, 2, d0, pairs);
        else if (G - g == 1)
            mb_pf_values(t->acc, pp, vp, G, D, g, 1, d0, pairs);
    }
}

/* Work item: tiles [tile, tile + j->tile_run) of row r (those the row has) and K/V head h,
 * walked over their keys together, so that each block of K/V comes from memory once for
 * all of them (a 20k-token prompt's K/V of one head is 5 MB: past L2). */
static MB_PF_TARGET void mb_pf_item_avx512(const struct mb_pf_job *j, int32_t r, int32_t tile, int32_t h) {
    int32_t G = j->heads / j->kv_heads, D = j->head_dim, P = D / 2;
    int64_t start = j->starts[r], len = j->lens[r];
    int32_t tiles = (int32_t)((len + MB_PF_Q - 1) / MB_PF_Q);
    int32_t nt = tiles - tile < j->tile_run ? tiles - tile : j->tile_run;
    size_t head = ((size_t)j->slots[r] * j->kv_heads + h) * (size_t)j->capacity * D;
    const uint16_t *kh = j->k_cache + head, *vh = j->v_cache + head;
    /* tile_run * group * head_dim <= MB_PF_ITEM_GD */
    uint32_t qt[MB_PF_ITEM_GD / 2 * MB_PF_Q] __attribute__((aligned(64)));
    float acc[MB_PF_ITEM_GD * MB_PF_Q] __attribute__((aligned(64)));
    float s[MB_PF_BLOCK * MB_PF_MAX_GROUP * MB_PF_Q] __attribute__((aligned(64)));
    uint32_t pp[MB_PF_BLOCK / 2 * MB_PF_MAX_GROUP * MB_PF_Q] __attribute__((aligned(64)));
    uint32_t vp[MB_PF_BLOCK / 2 * MB_ATT_MAX_DIM] __attribute__((aligned(64)));
    __m512 m[MB_PF_MAX_GROUP * MB_PF_TILES], l[MB_PF_MAX_GROUP * MB_PF_TILES];
    struct mb_pf_tile tl[MB_PF_TILES] = {{0}};
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int32_t ti = 0; ti < nt; ti++) {
        struct mb_pf_tile *t = &tl[ti];
        t->i0 = (tile + ti) * MB_PF_Q;
        t->nq = len - t->i0 < MB_PF_Q ? (int32_t)(len - t->i0) : MB_PF_Q;
        t->p0 = start + t->i0, t->khi = t->p0 + t->nq, t->klo = mb_pf_klo(t->p0, j->window);
        t->pos = _mm512_min_epi32(_mm512_add_epi32(_mm512_set1_epi32((int32_t)t->p0), lane),
                                  _mm512_set1_epi32((int32_t)(t->khi - 1)));
        t->wlo = _mm512_sub_epi32(t->pos, _mm512_set1_epi32(j->window));
        t->qt = qt + (size_t)ti * P * G * MB_PF_Q, t->acc = acc + (size_t)ti * G * D * MB_PF_Q;
        t->m = m + ti * G, t->l = l + ti * G;
        /* padding lanes (i >= nq) take the last query's place and vector; never stored */
        for (int32_t i = 0; i < MB_PF_Q; i++) {
            int32_t ii = i < t->nq ? i : t->nq - 1;
            const uint16_t *qr = j->q + (size_t)(j->firsts[r] + t->i0 + ii) * j->ldq + (size_t)h * G * D;
            for (int32_t g = 0; g < G; g++)
                for (int32_t x = 0; x < P; x++) {
                    uint32_t pair;
                    memcpy(&pair, qr + (size_t)g * D + 2 * x, 4);
                    t->qt[((size_t)x * G + g) * MB_PF_Q + i] = pair;
                }
        }
        for (size_t e = 0; e < (size_t)G * D * MB_PF_Q; e += 16)
            _mm512_store_ps(t->acc + e, _mm512_setzero_ps());
        for (int32_t g = 0; g < G; g++)
            t->m[g] = _mm512_set1_ps(-INFINITY), t->l[g] = _mm512_setzero_ps();
    }
    int64_t klo = tl[0].klo, khi = tl[nt - 1].khi;
    for (int64_t b = klo; b < khi; b += MB_PF_BLOCK) {
        int32_t nk = khi - b < MB_PF_BLOCK ? (int32_t)(khi - b) : MB_PF_BLOCK, pairs = (nk + 1) / 2;
        /* value pairs (keys past khi are zeros): with head_dim a multiple of 32, 32 dims
         * at a time in unpack order (mb_pf_dim), else in dim order */
        for (int32_t x = 0; x < pairs; x++) {
            const uint16_t *v0 = vh + (size_t)(b + 2 * x) * D, *v1 = v0 + D;
            int odd = 2 * x + 1 < nk;
            if (D % 32 == 0)
                for (int32_t c = 0; c < D; c += 32) {
                    __m512i a = _mm512_loadu_si512(v0 + c), z = odd ? _mm512_loadu_si512(v1 + c) : _mm512_setzero_si512();
                    _mm512_store_si512(vp + (size_t)x * D + c, _mm512_unpacklo_epi16(a, z));
                    _mm512_store_si512(vp + (size_t)x * D + c + 16, _mm512_unpackhi_epi16(a, z));
                }
            else
                for (int32_t d = 0; d < D; d++)
                    vp[(size_t)x * D + d] = (uint32_t)v0[d] | (odd ? (uint32_t)v1[d] << 16 : 0u);
        }
        for (int32_t ti = 0; ti < nt; ti++)
            if (b >= tl[ti].klo && b < tl[ti].khi)
                mb_pf_tile_block(j, &tl[ti], kh, b, s, pp, vp);
    }
    for (int32_t ti = 0; ti < nt; ti++) {
        struct mb_pf_tile *t = &tl[ti];
        for (int32_t g = 0; g < G; g++) {
            float lv[MB_PF_Q];
            _mm512_storeu_ps(lv, t->l[g]);
            for (int32_t i = 0; i < t->nq; i++) {
                uint16_t *o = j->out + (size_t)(j->firsts[r] + t->i0 + i) * j->ldo + (size_t)(h * G + g) * D;
                for (int32_t d = 0; d < D; d++)
                    o[D % 32 == 0 ? mb_pf_dim(d) : d] = mb_round_bf16(t->acc[((size_t)g * D + d) * MB_PF_Q + i] / lv[i]);
            }
        }
    }
}
#endif

static void mb_pf_worker(void *data) {
    struct mb_pf_job *j = (struct mb_pf_job *)data;
    for (;;) {
        int64_t item = mb_take_one(&j->next);
        if (item >= j->items)
            return;
        int32_t r = 0, runs;
        for (;; r++) { /* rows in order; within a row its last tiles (most keys) first */
            runs = mb_pf_runs(j->lens[r], j->tile_run);
            if (item < (int64_t)runs * j->kv_heads)
                break;
            item -= (int64_t)runs * j->kv_heads;
        }
        j->run(j, r, (runs - 1 - (int32_t)(item / j->kv_heads)) * j->tile_run, (int32_t)(item % j->kv_heads));
    }
}

int mb_bf16_prefill_attention(const uint16_t *q, int64_t ldq, int32_t n_q, const int64_t *firsts,
                              const int64_t *slots, const int64_t *starts, const int64_t *lens, int32_t t,
                              int32_t heads, int32_t kv_heads, int32_t head_dim, int32_t window, float scale,
                              const uint16_t *k_cache, const uint16_t *v_cache, int32_t n_slots,
                              int32_t capacity, uint16_t *out, int64_t ldo, int32_t kernel, void *parallel,
                              int32_t threads) {
    if (t < 0 || heads < 1 || kv_heads < 1 || heads % kv_heads || heads / kv_heads > MB_PF_MAX_GROUP ||
        head_dim < MB_ATT_LANES || head_dim % MB_ATT_LANES || head_dim > MB_ATT_MAX_DIM ||
        (int64_t)(heads / kv_heads) * head_dim > MB_PF_MAX_GD || ldq < (int64_t)heads * head_dim ||
        ldo < (int64_t)heads * head_dim || n_slots < 1 || capacity < 1)
        return MB_EINVAL;
    int64_t items = 0;
    for (int32_t r = 0; r < t; r++) {
        if (lens[r] < 1 || firsts[r] < 0 || firsts[r] > n_q - lens[r] || slots[r] < 0 || slots[r] >= n_slots ||
            starts[r] < 0 || starts[r] > capacity - lens[r])
            return MB_EINVAL;
    }
    struct mb_pf_job j;
    memset(&j, 0, sizeof j);
    j.tile_run = 1;
    j.q = q, j.ldq = ldq, j.firsts = firsts, j.slots = slots, j.starts = starts, j.lens = lens, j.t = t;
    j.heads = heads, j.kv_heads = kv_heads, j.head_dim = head_dim, j.window = window;
    j.scale = scale * MB_PF_LOG2E; /* scale2: the scores in base 2 */
    j.k_cache = k_cache, j.v_cache = v_cache, j.capacity = capacity, j.out = out, j.ldo = ldo;
    if (kernel == MB_KERNEL_PORTABLE || kernel == MB_KERNEL_AVX2) /* no AVX2 path of its own */
        j.run = mb_pf_item;
#if MB_ATT_HAVE_AVX512
    else if (kernel == MB_KERNEL_AVX512BF16 && mb_bf16_kernel() == MB_KERNEL_AVX512BF16) {
        int32_t fit = MB_PF_ITEM_GD / ((heads / kv_heads) * head_dim);
        j.run = mb_pf_item_avx512, j.tile_run = fit < MB_PF_TILES ? fit : MB_PF_TILES;
    }
#endif
    else
        return MB_EINVAL;
    for (int32_t r = 0; r < t; r++)
        items += (int64_t)mb_pf_runs(lens[r], j.tile_run) * kv_heads;
    j.items = items;
#ifdef MB_ATOMICS
    if (parallel != NULL && threads > 1 && items > 1) {
        ((mb_parallel_fn)parallel)(mb_pf_worker, &j, (unsigned)threads, 0);
        return MB_OK;
    }
#endif
    mb_pf_worker(&j);
    return MB_OK;
}
