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
 * Threads: one work item per (row, K/V head), the group of query heads sharing that K/V
 * together, handed out one at a time on the caller's OpenMP pool (as linear.c's); short
 * calls run on the calling thread, where waking the pool would cost more than the work.
 */
#include "mashbox.h"
#include "bf16.h"

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

/* Row r = item / kv_heads, K/V head h = item % kv_heads: its group of query heads. */
MB_CLONES
static void mb_att_item(const struct mb_att_job *j, int64_t item) {
    int32_t r = (int32_t)(item / j->kv_heads), h = (int32_t)(item % j->kv_heads);
    int32_t G = j->heads / j->kv_heads, D = j->head_dim;
    int64_t end = j->ends[r];
    int64_t lo = j->window > 0 && end > j->window ? end - j->window : 0;
    size_t head = ((size_t)j->slots[r] * j->kv_heads + h) * (size_t)j->capacity * D;
    const uint16_t *kh = j->k_cache + head, *vh = j->v_cache + head;
    const uint16_t *qh = j->q + (size_t)j->rows[r] * j->ldq + (size_t)h * G * D;
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
    uint16_t *o = j->out + (size_t)j->rows[r] * j->ldo + (size_t)h * G * D;
    for (int32_t g = 0; g < G; g++)
        for (int32_t d = 0; d < D; d++)
            o[(size_t)g * D + d] = mb_round_bf16(acc[g][d] / l[g]);
}

/* ---- AVX-512 path: the same operations, 16 keys at a time ---- */

#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 10))
#define MB_ATT_HAVE_AVX512 1
#include <immintrin.h>

#define MB_ATT_TARGET __attribute__((target("avx512f")))

static inline MB_ATT_TARGET __m512 mb_att_load_bf16(const uint16_t *p) { /* 16 bfloat16 -> float32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline MB_ATT_TARGET __m512 mb_exp16(__m512 x) { /* mb_exp on 16 lanes */
    const __m512 lim = _mm512_set1_ps(-80.0f), magic = _mm512_set1_ps(12582912.0f);
    __mmask16 low = _mm512_cmp_ps_mask(x, lim, _CMP_LT_OQ);
    __m512 y = _mm512_mask_blend_ps(low, x, lim);
    __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(y, _mm512_set1_ps(1.44269504f)), magic), magic);
    __m512 r = _mm512_sub_ps(_mm512_sub_ps(y, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                             _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mask_blend_ps(low, _mm512_mul_ps(p, _mm512_castsi512_ps(e)), _mm512_setzero_ps());
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
    int32_t r = (int32_t)(item / j->kv_heads), h = (int32_t)(item % j->kv_heads);
    int32_t G = j->heads / j->kv_heads, D = j->head_dim, V = D / MB_ATT_LANES;
    int64_t end = j->ends[r];
    int64_t lo = j->window > 0 && end > j->window ? end - j->window : 0;
    size_t head = ((size_t)j->slots[r] * j->kv_heads + h) * (size_t)j->capacity * D;
    const uint16_t *kh = j->k_cache + head, *vh = j->v_cache + head;
    const uint16_t *qh = j->q + (size_t)j->rows[r] * j->ldq + (size_t)h * G * D;
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
    uint16_t *o = j->out + (size_t)j->rows[r] * j->ldo + (size_t)h * G * D;
    for (int32_t g = 0; g < G; g++)
        for (int32_t d = 0; d < D; d++)
            o[(size_t)g * D + d] = mb_round_bf16(acc[g][d] / l[g]);
}

#endif

static void mb_att_worker(void *data) {
    struct mb_att_job *j = (struct mb_att_job *)data;
    for (;;) {
#ifdef MB_ATOMICS
        int64_t item = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
#else
        int64_t item = j->next++;
#endif
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
