/* Linear layers on GGUF's own quantized blocks: y[m, n] = x[m, k] . dequant(w)[n, k]^T.
 *
 * Why it exists: dequantizing a GGUF to bfloat16 reads 3-4x the bytes per decode step
 * and holds 3-4x the memory. Here the weights stay in ggml's blocks (the file's bytes,
 * untouched, copied once into the weight arena) and each block is widened in registers.
 * Activations are used exactly (bfloat16, never quantized).
 *
 * Formats (ggml-common.h), blocks of 32 elements, d and m float16:
 *   Q8_0  d | qs int8[32]                     w = d * qs[i]
 *   Q4_0  d | qs[16]                          w = d * (nib - 8)
 *   Q4_1  d | m | qs[16]                      w = d * nib + m
 *   Q5_0  d | qh u32 | qs[16]                 w = d * ((nib | hbit << 4) - 16)
 *   Q5_1  d | m | qh u32 | qs[16]             w = d * (nib | hbit << 4) + m
 * nib of element j < 16 is qs[j] & 15, of element j + 16 is qs[j] >> 4; hbit of
 * element e is bit e of qh. Call q[i] the block's small integer (the part d multiplies):
 * it is exact in bfloat16.
 *
 * The rule, per output (row r of x, output c), 16 float32 lanes acc[l] = 0, then for
 * every block b in order (x[i] the block's inputs, bfloat16 denormals read as zero):
 *     t[l] = (x[2l+1] * q[2l+1]) + x[2l] * q[2l]     (vdpbf16ps from zero: exact
 *                                                      products, one rounded add)
 *     acc[l] = fma(t[l], d, acc[l])                   (one rounding)
 *     formats with m: s[l] = x[2l+1] + x[2l];  acc[l] = fma(s[l], m, acc[l])
 * (sums inside t and s that come out denormal are zero, as vdpbf16ps makes them); then
 * the lanes are summed as a tree, lane i + lane i+8, then i + i+4, i + i+2, 0 + 1, and
 * bias added; y as mb_bf16_linear writes it (y modes). mashbox/native_ref.py's q_linear
 * states the same rule in numpy; the portable and AVX512-BF16 kernels give the same bits.
 * A row's result depends on its own x row, w row, bias (and y) only: batch invariant.
 *
 * Work: items of up to MB_Q_ROWS rows x MB_Q_OUTS outputs, handed out as mb_bf16_linear's
 * (guided runs). Inside an item, two outputs at a time pass over all its rows in groups
 * of 8 (eight outputs for one row, four for two: they share each x load and pair sum), so the
 * weights come from memory once per item and the next row group finds them in L1: a
 * decode step of up to MB_Q_ROWS rows streams the weights once. Each tile prefetches the
 * next tile's rows (NO rows on) as it goes, so the misses overlap the widening; for one
 * row the widening, not the bytes, is still the larger cost (README, Quantized weights:
 * benchmarks/quant.py --kernels).
 */
#include "mashbox.h"
#include "bf16.h"

#include <math.h>
#include <string.h>

#define MB_Q_BLOCK 32
#define MB_Q_OUTS 16  /* outputs per work item */
#define MB_Q_ROWS 64  /* rows per work item: their x stays in L2 */
#define MB_Q_MR 8     /* rows per micro-tile */

struct mb_q_format {
    int32_t bytes;  /* per block of 32 */
    int32_t has_m;  /* a min term */
};

static int mb_q_format(int32_t type, struct mb_q_format *f) {
    switch (type) {
    case MB_GGML_Q8_0: f->bytes = 34, f->has_m = 0; return 1;
    case MB_GGML_Q4_0: f->bytes = 18, f->has_m = 0; return 1;
    case MB_GGML_Q4_1: f->bytes = 20, f->has_m = 1; return 1;
    case MB_GGML_Q5_0: f->bytes = 22, f->has_m = 0; return 1;
    case MB_GGML_Q5_1: f->bytes = 24, f->has_m = 1; return 1;
    default: return 0;
    }
}

static float mb_f16_f32(uint16_t h) { /* IEEE half to float, exact */
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        float v = (float)man * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    if (exp == 31)
        return mb_bits_f32(sign | 0x7f800000u | (man << 13));
    return mb_bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

static uint16_t mb_le16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static uint32_t mb_le32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* Block b's small integers q[32], d and m (0 without one). */
static void mb_q_block(int32_t type, const uint8_t *blk, int8_t *q, float *d, float *m) {
    *d = mb_f16_f32(mb_le16(blk));
    *m = 0.0f;
    const uint8_t *qs;
    uint32_t qh = 0;
    int off = 0, high = 0;
    switch (type) {
    case MB_GGML_Q8_0:
        memcpy(q, blk + 2, 32);
        return;
    case MB_GGML_Q4_0: qs = blk + 2, off = 8; break;
    case MB_GGML_Q4_1: *m = mb_f16_f32(mb_le16(blk + 2)), qs = blk + 4; break;
    case MB_GGML_Q5_0: qh = mb_le32(blk + 2), qs = blk + 6, off = 16, high = 1; break;
    default: /* Q5_1 */ *m = mb_f16_f32(mb_le16(blk + 2)), qh = mb_le32(blk + 4), qs = blk + 8, high = 1; break;
    }
    for (int j = 0; j < 16; j++) {
        int lo = qs[j] & 15, hi = qs[j] >> 4;
        if (high) {
            lo |= (int)((qh >> j) & 1u) << 4;
            hi |= (int)((qh >> (j + 16)) & 1u) << 4;
        }
        q[j] = (int8_t)(lo - off);
        q[j + 16] = (int8_t)(hi - off);
    }
}

/* The lanes' tree: i + i+8, i + i+4, i + i+2, 0 + 1. */
static float mb_q_tree(float *a) {
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; i++)
            a[i] = a[i] + a[i + w];
    return a[0];
}

struct mb_q_job {
    int32_t type;
    struct mb_q_format fmt;
    const uint8_t *w;
    int64_t row_bytes;
    int32_t n, k;
    const uint16_t *x;
    int64_t ldx;
    int32_t m;
    const float *bias;
    void *y;
    int32_t y_mode;
    int64_t ldy;
    int32_t groups, chunks; /* output groups of MB_Q_OUTS, row chunks of MB_Q_ROWS */
    int64_t items;
    int64_t next;
    int64_t threads;
    void (*run)(const struct mb_q_job *, int32_t r0, int32_t rows, int32_t c0, int32_t outs);
};

static void mb_q_store(const struct mb_q_job *j, int32_t r, int32_t c, float acc) {
    if (j->bias)
        acc = acc + j->bias[c];
    size_t at = (size_t)r * j->ldy + c;
    if (j->y_mode == MB_Y_F32)
        ((float *)j->y)[at] = acc;
    else if (j->y_mode == MB_Y_ADD_BF16)
        ((uint16_t *)j->y)[at] = mb_round_bf16(mb_bf16_f32(((uint16_t *)j->y)[at]) + acc);
    else
        ((uint16_t *)j->y)[at] = mb_round_bf16(acc);
}

/* ---- portable path: the rule, one output at a time ---- */

static void mb_q_run_portable(const struct mb_q_job *j, int32_t r0, int32_t rows, int32_t c0, int32_t outs) {
    int32_t blocks = j->k / MB_Q_BLOCK;
    for (int32_t c = c0; c < c0 + outs; c++) {
        const uint8_t *wr = j->w + (size_t)c * j->row_bytes;
        for (int32_t r = r0; r < r0 + rows; r++) {
            const uint16_t *x = j->x + (size_t)r * j->ldx;
            float acc[16] = {0};
            for (int32_t b = 0; b < blocks; b++) {
                int8_t q[32];
                float d, m;
                mb_q_block(j->type, wr + (size_t)b * j->fmt.bytes, q, &d, &m);
                const uint16_t *xb = x + (size_t)b * MB_Q_BLOCK;
                for (int l = 0; l < 16; l++) {
                    float x1 = mb_flush(mb_bf16_f32(xb[2 * l + 1])), x0 = mb_flush(mb_bf16_f32(xb[2 * l]));
                    float t = mb_flush(mb_flush(x1 * (float)q[2 * l + 1]) + x0 * (float)q[2 * l]);
                    acc[l] = fmaf(t, d, acc[l]);
                    if (j->fmt.has_m)
                        acc[l] = fmaf(mb_flush(x1 + x0), m, acc[l]);
                }
            }
            mb_q_store(j, r, c, mb_q_tree(acc));
        }
    }
}

/* ---- AVX512-BF16 path ---- */

#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 10))
#define MB_Q_AVX512 1
#include <immintrin.h>

#define MB_Q_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,f16c")))

struct mb_q_tables {
    __m512i lo, hi; /* bfloat16 of each 5-bit index's integer (hi: with bit 4 set) */
};

/* bfloat16 bits of a small integer v (|v| <= 128): exact */
static uint16_t mb_q_bf16_int(int v) { return (uint16_t)(mb_f32_bits((float)v) >> 16); }

static MB_Q_TARGET void mb_q_make_tables(int32_t type, struct mb_q_tables *t) {
    uint16_t lo[32], hi[32];
    int off = type == MB_GGML_Q4_0 ? 8 : type == MB_GGML_Q5_0 ? 16 : 0;
    for (int i = 0; i < 32; i++) { /* the index's bit 4 is not the value's: only its low 4 bits are */
        lo[i] = mb_q_bf16_int((i & 15) - off);
        hi[i] = mb_q_bf16_int((i & 15) + 16 - off);
    }
    t->lo = _mm512_loadu_si512(lo);
    t->hi = _mm512_loadu_si512(hi);
}

/* One block's 32 integers as bfloat16 [32], in element order. */
static inline __attribute__((always_inline)) MB_Q_TARGET __m512bh
mb_q_widen(int32_t type, const uint8_t *blk, const struct mb_q_tables *tb) {
    if (type == MB_GGML_Q8_0) {
        __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2))));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18))));
        return _mm512_cvtne2ps_pbh(hi, lo); /* low half from the second argument */
    }
    int qs_at = type == MB_GGML_Q4_0 ? 2 : type == MB_GGML_Q4_1 ? 4 : type == MB_GGML_Q5_0 ? 6 : 8;
    __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(blk + qs_at)));
    __m512i words = _mm512_cvtepu8_epi16(both); /* bytes 0..15 twice */
    const __m512i shifts = _mm512_set_epi64(0x0004000400040004LL, 0x0004000400040004LL, 0x0004000400040004LL,
                                            0x0004000400040004LL, 0, 0, 0, 0);
    __m512i idx = _mm512_srlv_epi16(words, shifts); /* low 4 bits: element e's nibble */
    __m512i v = _mm512_permutexvar_epi16(idx, tb->lo);
    if (type == MB_GGML_Q5_0 || type == MB_GGML_Q5_1) {
        uint32_t qh;
        memcpy(&qh, blk + (type == MB_GGML_Q5_0 ? 2 : 4), 4);
        v = _mm512_mask_permutexvar_epi16(v, (__mmask32)qh, idx, tb->hi);
    }
    return (__m512bh)v;
}

static inline __attribute__((always_inline)) MB_Q_TARGET float mb_q_tree_avx(__m512 a) {
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
    return _mm_cvtss_f32(s1);
}

/* NO outputs (1, 2, 4 for MR <= 2, 8 for MR 1) x MR rows (1..8); type, NO, MR constants in each instantiation. */
static inline __attribute__((always_inline)) MB_Q_TARGET void
mb_q_tile(const struct mb_q_job *j, const struct mb_q_tables *tb, int32_t r0, int32_t c0, const int32_t type,
          const int NO, const int MR) {
    const int has_m = type == MB_GGML_Q4_1 || type == MB_GGML_Q5_1;
    const int bytes = type == MB_GGML_Q8_0 ? 34 : type == MB_GGML_Q4_0 ? 18 : type == MB_GGML_Q4_1 ? 20
                      : type == MB_GGML_Q5_0 ? 22 : 24;
    int32_t blocks = j->k / MB_Q_BLOCK;
    __m512 acc[8][MB_Q_MR];
    for (int o = 0; o < NO; o++)
        for (int r = 0; r < MR; r++)
            acc[o][r] = _mm512_setzero_ps();
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);
    const uint8_t *w0 = j->w + (size_t)c0 * j->row_bytes;
    const uint16_t *x = j->x + (size_t)r0 * j->ldx;
    /* The next tile's rows (NO rows on) are fetched while this one computes: the hardware
     * prefetcher alone leaves the widening and the misses one after the other (one
     * thread, out of cache: Q4_0 7 -> 10-11 GB/s). One prefetch per 64 bytes or less. */
    const int32_t ahead = c0 + 2 * NO <= j->n;
    const int64_t pf = (int64_t)NO * j->row_bytes;
    const int every = 64 / bytes;
    for (int32_t b = 0; b < blocks; b++) {
        __m512bh wv[8];
        __m512 dv[8], mv[8];
        for (int o = 0; o < NO; o++) {
            const uint8_t *blk = w0 + (size_t)o * j->row_bytes + (size_t)b * bytes;
            if (ahead && b % every == 0)
                _mm_prefetch((const char *)(blk + pf), _MM_HINT_T0);
            wv[o] = mb_q_widen(type, blk, tb);
            if (has_m) { /* d and m side by side: one conversion */
                int32_t dm;
                memcpy(&dm, blk, 4);
                __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
                dv[o] = _mm512_broadcastss_ps(f);
                mv[o] = _mm512_broadcastss_ps(_mm_movehdup_ps(f));
            } else {
                uint16_t h;
                memcpy(&h, blk, 2);
                dv[o] = _mm512_set1_ps(_cvtsh_ss(h));
            }
        }
        for (int r = 0; r < MR; r++) {
            __m512bh xb = (__m512bh)_mm512_loadu_si512(x + (size_t)r * j->ldx + (size_t)b * MB_Q_BLOCK);
            __m512 s = _mm512_setzero_ps();
            if (has_m)
                s = _mm512_dpbf16_ps(_mm512_setzero_ps(), xb, ones);
            for (int o = 0; o < NO; o++) {
                __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), xb, wv[o]);
                acc[o][r] = _mm512_fmadd_ps(t, dv[o], acc[o][r]);
                if (has_m)
                    acc[o][r] = _mm512_fmadd_ps(s, mv[o], acc[o][r]);
            }
        }
    }
    for (int o = 0; o < NO; o++)
        for (int r = 0; r < MR; r++)
            mb_q_store(j, r0 + r, c0 + o, mb_q_tree_avx(acc[o][r]));
}

#define MB_Q_ROWS_CASES(T, NO)                                                  \
    switch (mr) {                                                               \
    case 8: mb_q_tile(j, &tb, r, c, T, NO, 8); break;                           \
    case 7: mb_q_tile(j, &tb, r, c, T, NO, 7); break;                           \
    case 6: mb_q_tile(j, &tb, r, c, T, NO, 6); break;                           \
    case 5: mb_q_tile(j, &tb, r, c, T, NO, 5); break;                           \
    case 4: mb_q_tile(j, &tb, r, c, T, NO, 4); break;                           \
    case 3: mb_q_tile(j, &tb, r, c, T, NO, 3); break;                           \
    case 2: mb_q_tile(j, &tb, r, c, T, NO, 2); break;                           \
    default: mb_q_tile(j, &tb, r, c, T, NO, 1); break;                          \
    }

#define MB_Q_RUN(NAME, T)                                                                        \
    static MB_Q_TARGET void NAME(const struct mb_q_job *j, int32_t r0, int32_t rows, int32_t c0, \
                                 int32_t outs) {                                                 \
        struct mb_q_tables tb;                                                                   \
        mb_q_make_tables(T, &tb);                                                                \
        int32_t c = c0;                                                                          \
        if (rows == 1) /* one row: eight outputs share each x load and keep 8 streams going */  \
            for (; c + 8 <= c0 + outs; c += 8)                                                   \
                mb_q_tile(j, &tb, r0, c, T, 8, 1);                                               \
        if (rows <= 2) /* decode of one or two rows: four outputs share each x load */          \
            for (; c + 4 <= c0 + outs; c += 4) {                                                 \
                if (rows == 2)                                                                   \
                    mb_q_tile(j, &tb, r0, c, T, 4, 2);                                           \
                else                                                                             \
                    mb_q_tile(j, &tb, r0, c, T, 4, 1);                                           \
            }                                                                                    \
        for (; c < c0 + outs; c += 2) {                                                          \
            int two = c + 1 < c0 + outs;                                                         \
            for (int32_t r = r0; r < r0 + rows; r += MB_Q_MR) {                                  \
                int32_t mr = r0 + rows - r < MB_Q_MR ? r0 + rows - r : MB_Q_MR;                  \
                if (two) {                                                                       \
                    MB_Q_ROWS_CASES(T, 2)                                                        \
                } else {                                                                         \
                    MB_Q_ROWS_CASES(T, 1)                                                        \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
    }

MB_Q_RUN(mb_q_run_q8_0, MB_GGML_Q8_0)
MB_Q_RUN(mb_q_run_q4_0, MB_GGML_Q4_0)
MB_Q_RUN(mb_q_run_q4_1, MB_GGML_Q4_1)
MB_Q_RUN(mb_q_run_q5_0, MB_GGML_Q5_0)
MB_Q_RUN(mb_q_run_q5_1, MB_GGML_Q5_1)
#else
#define MB_Q_AVX512 0
#endif

static void mb_q_worker(void *data) {
    struct mb_q_job *j = (struct mb_q_job *)data;
    for (;;) {
        int64_t first, take = mb_take_guided(&j->next, j->items, j->threads, &first);
        if (take == 0)
            return;
        for (int64_t i = first; i < first + take; i++) {
            int32_t ch = (int32_t)(i / j->groups), g = (int32_t)(i % j->groups);
            int32_t r0 = ch * MB_Q_ROWS, c0 = g * MB_Q_OUTS;
            int32_t rows = j->m - r0 < MB_Q_ROWS ? j->m - r0 : MB_Q_ROWS;
            int32_t outs = j->n - c0 < MB_Q_OUTS ? j->n - c0 : MB_Q_OUTS;
            j->run(j, r0, rows, c0, outs);
        }
    }
}

int64_t mb_q_row_bytes(int32_t type, int32_t k) {
    struct mb_q_format f;
    if (k < MB_Q_BLOCK || k % MB_Q_BLOCK || !mb_q_format(type, &f))
        return 0;
    return (int64_t)(k / MB_Q_BLOCK) * f.bytes;
}

int mb_q_supported(int32_t type) {
    struct mb_q_format f;
    if (mb_q_format(type, &f))
        return 1;
    return type == MB_GGML_Q4_K || type == MB_GGML_Q5_K || type == MB_GGML_Q6_K;
}

int mb_q_linear(int32_t type, const uint8_t *w, int64_t row_bytes, int32_t n, int32_t k,
                const uint16_t *x, int64_t ldx, int32_t m, const float *bias, void *y,
                int32_t y_mode, int64_t ldy, int32_t kernel, void *parallel, int32_t threads) {
    if (type == MB_GGML_Q4_K || type == MB_GGML_Q5_K || type == MB_GGML_Q6_K) /* csrc/kquant.c */
        return mb_kq_linear(type, w, row_bytes, n, k, x, ldx, m, bias, y, y_mode, ldy, kernel, parallel,
                            threads);
    struct mb_q_job j;
    memset(&j, 0, sizeof j);
    if (!mb_q_format(type, &j.fmt) || m < 1 || n < 1 || k < MB_Q_BLOCK || k % MB_Q_BLOCK || ldx < k ||
        ldy < n || row_bytes != mb_q_row_bytes(type, k) || y_mode < MB_Y_BF16 || y_mode > MB_Y_ADD_BF16)
        return MB_EINVAL;
    j.type = type, j.w = w, j.row_bytes = row_bytes, j.n = n, j.k = k, j.x = x, j.ldx = ldx, j.m = m;
    j.bias = bias, j.y = y, j.y_mode = y_mode, j.ldy = ldy;
    if (kernel == MB_KERNEL_PORTABLE)
        j.run = mb_q_run_portable;
#if MB_Q_AVX512
    else if (kernel == MB_KERNEL_AVX512BF16 && mb_bf16_kernel() == MB_KERNEL_AVX512BF16)
        j.run = type == MB_GGML_Q8_0 ? mb_q_run_q8_0 : type == MB_GGML_Q4_0 ? mb_q_run_q4_0
                : type == MB_GGML_Q4_1 ? mb_q_run_q4_1 : type == MB_GGML_Q5_0 ? mb_q_run_q5_0 : mb_q_run_q5_1;
#endif
    else
        return MB_EINVAL;
    j.groups = (n + MB_Q_OUTS - 1) / MB_Q_OUTS;
    j.chunks = (m + MB_Q_ROWS - 1) / MB_Q_ROWS;
    j.items = (int64_t)j.groups * j.chunks;
#ifdef MB_ATOMICS
    j.threads = parallel != NULL && threads > 1 && j.items > 1 ? threads : 1;
#else
    j.threads = 1;
#endif
    if (j.threads > 1)
        ((mb_parallel_fn)parallel)(mb_q_worker, &j, (unsigned)threads, 0);
    else
        mb_q_worker(&j);
    return MB_OK;
}
