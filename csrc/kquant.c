/* K-quant linear layers: y[r, c] = x[r, :k] . dequant(w row c) (+ bias[c]) on GGUF's
 * Q4_K, Q5_K and Q6_K blocks as the file holds them (ggml's layout, untouched).
 *
 * Why it exists: a Q4_K_M model dequantized to bfloat16 reads 3.4x the bytes per decode
 * step; reading the blocks themselves is the only way past the bfloat16 bound.
 *
 * Blocks (256 weights each, "super-blocks"; d, dmin float16):
 *   Q4_K (144 B): d, dmin, 12 B of eight 6-bit scales sc and mins mn, 128 B of 4-bit q;
 *                 w = d*sc[j] * q - dmin*mn[j] for the 32 weights of sub-block j.
 *   Q5_K (176 B): as Q4_K plus 32 B holding each q's fifth bit (q in 0..31).
 *   Q6_K (210 B): 128 B low 4 bits, 64 B high 2 bits, sixteen int8 scales, d;
 *                 w = d*sc[j] * (q - 32) for the 16 weights of sub-block j.
 *
 * The arithmetic (mashbox/native_ref.py's kq_linear states it in numpy; the tests compare
 * bits). Each output is 16 float32 lanes; lane l of chunk t (weights 32t .. 32t+31 of a
 * block) takes the pair (2l, 2l+1):
 *     P = (+0 + x[2l+1] * q[2l+1]) + x[2l] * q[2l]           (vdpbf16ps from zero)
 *     A[l] = A[l] + s * P                                   (s = d*sc of the lane's sub-block)
 * q are the block's small integers (q - 32 for Q6_K), exact in bfloat16, so each product
 * is exact; s = float(d) * sc is exact in float32. The mins (Q4_K, Q5_K) take the sum of
 * each sub-block's x, which depends on x alone (made once per work item, not per output):
 *     X[t] = sum16 over lanes of (+0 + x[2l+1]) + x[2l]     (vdpbf16ps against ones)
 *     N[t] = N[t] + (float(dmin) * mn[t]) * X[t]            (8 lanes, one per sub-block)
 * Blocks in order. Then out = sum16(A) - sum8(N) (Q6_K: sum16(A)), sum16 adding lane l
 * and l+8, then l and l+4, l and l+2, l and l+1 (sum8: l and l+4, ...); then + bias; then
 * y as mb_bf16_linear writes it. Denormal inputs and dpbf16 sums are zero, as in
 * csrc/linear.c; the rule's limits are linear.c's (products that leave float32's normal
 * range, a zero's sign). Activations are used exactly, never quantized: only the sums'
 * float32 roundings differ from the exact product of x and gguf's dequantized weights.
 *
 * Speed (AVX-512): a single row is bound by the shuffles that unpack the integers
 * (vpmovzxbw, vpermw) rather than by the bytes read, so the scales go in as memory
 * broadcasts (vmulps {1to16}) that take no shuffle.
 *
 * The order is fixed per output: a row's bits depend on its own x row, weight row, bias
 * and y, never on m, its neighbours or the threads. Rows go in groups of up to
 * MB_KQ_ROWS: the AVX-512 path decodes each block once per group and applies it to all
 * the group's rows. Work items (a row group x MB_KQ_TILE outputs) are handed out to the
 * caller's OpenMP pool as csrc/linear.c does.
 */
#include "mashbox.h"
#include "bf16.h"

#include <string.h>

#define MB_QK 256       /* weights per block */
#define MB_KQ_ROWS 16   /* rows per group: each block is decoded once for all of them */
#define MB_KQ_TILE 32   /* outputs per work item: they share its rows' sub-block sums */
#define MB_KQ_SUM_BLOCKS 64 /* blocks of sub-block sums kept per row (k <= 16384); past
                             * that each output makes its own (the same bits, slower) */

struct mb_kq_job {
    int32_t type;
    const uint8_t *w;
    int64_t row_bytes;
    int32_t n, k, blocks;
    const uint16_t *x;
    int64_t ldx;
    int32_t m;
    const float *bias;
    void *y;
    int32_t y_mode;
    int64_t ldy;
    int32_t tiles, groups;
    int64_t items;
    int64_t next; /* the next work item: atomically advanced */
    int64_t threads;
    void (*run)(const struct mb_kq_job *, int32_t r0, int32_t rows, int32_t c0, int32_t c1);
};

static int64_t mb_kq_block_bytes(int32_t type) {
    switch (type) {
    case MB_GGML_Q4_K: return 144;
    case MB_GGML_Q5_K: return 176;
    case MB_GGML_Q6_K: return 210;
    default: return 0;
    }
}

static float mb_f16_f32(const uint8_t *p) { /* IEEE half (little-endian) -> float, exact */
    uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (e == 0) { /* zero or subnormal: mant * 2^-24 */
        float v = (float)mant * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    if (e == 31)
        return mb_bits_f32(sign | 0x7f800000u | (mant << 13));
    return mb_bits_f32(sign | ((e + 112u) << 23) | (mant << 13));
}

/* Q4_K / Q5_K: d*sc[j] and dmin*mn[j] (both exact) */
static void mb_kq_scales(const uint8_t *blk, float dsc[8], float dmn[8]) {
    float d = mb_f16_f32(blk), dmin = mb_f16_f32(blk + 2);
    const uint8_t *s = blk + 4;
    for (int j = 0; j < 8; j++) {
        uint32_t sc, mn;
        if (j < 4) {
            sc = s[j] & 63u, mn = s[j + 4] & 63u;
        } else {
            sc = (s[j + 4] & 0xfu) | ((uint32_t)(s[j - 4] >> 6) << 4);
            mn = (uint32_t)(s[j + 4] >> 4) | ((uint32_t)(s[j] >> 6) << 4);
        }
        dsc[j] = d * (float)sc;
        dmn[j] = dmin * (float)mn;
    }
}

static float mb_sum16(const float *v) {
    float a[8], b[4];
    for (int i = 0; i < 8; i++)
        a[i] = v[i] + v[i + 8];
    for (int i = 0; i < 4; i++)
        b[i] = a[i] + a[i + 4];
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static float mb_sum8(const float *v) {
    float a[4];
    for (int i = 0; i < 4; i++)
        a[i] = v[i] + v[i + 4];
    return (a[0] + a[2]) + (a[1] + a[3]);
}

/* X[t] of one block's 256 x (see the top of the file) */
static void mb_kq_xsums(const uint16_t *x, float X[8]) {
    for (int t = 0; t < 8; t++) {
        float S[16];
        for (int l = 0; l < 16; l++) {
            float xo = mb_flush(mb_bf16_f32(x[32 * t + 2 * l + 1])), xe = mb_flush(mb_bf16_f32(x[32 * t + 2 * l]));
            S[l] = mb_flush(mb_flush(0.0f + xo) + xe);
        }
        X[t] = mb_sum16(S);
    }
}

static void mb_kq_store(const struct mb_kq_job *j, int32_t r, int32_t c, float acc) {
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

/* One block's integers q[256] in weight order, the lane scales s[chunk][lane], and for
 * Q4_K / Q5_K dmin * mn per sub-block; returns whether mins apply. */
static int mb_kq_decode(int32_t type, const uint8_t *blk, float q[MB_QK], float s[8][16],
                        float dmn[8]) {
    if (type == MB_GGML_Q6_K) {
        const uint8_t *ql = blk, *qh = blk + 128;
        const int8_t *sc = (const int8_t *)(blk + 192);
        float d = mb_f16_f32(blk + 208);
        for (int h = 0; h < 2; h++)
            for (int v = 0; v < 128; v++) { /* v = 32 * part + i */
                int part = v / 32, i = v % 32;
                int lo = (ql[64 * h + 32 * (part & 1) + i] >> (4 * (part >> 1))) & 0xf;
                int hi = (qh[32 * h + i] >> (2 * part)) & 3;
                q[128 * h + v] = (float)((lo | (hi << 4)) - 32);
            }
        for (int t = 0; t < 8; t++)
            for (int l = 0; l < 16; l++)
                s[t][l] = d * (float)sc[2 * t + l / 8];
        return 0;
    }
    float dsc[8];
    mb_kq_scales(blk, dsc, dmn);
    const uint8_t *qh = blk + 16, *qs = blk + (type == MB_GGML_Q5_K ? 48 : 16);
    for (int t = 0; t < 8; t++) {
        for (int i = 0; i < 32; i++) {
            int v = (qs[32 * (t / 2) + i] >> (4 * (t % 2))) & 0xf;
            if (type == MB_GGML_Q5_K)
                v |= ((qh[i] >> t) & 1) << 4;
            q[32 * t + i] = (float)v;
        }
        for (int l = 0; l < 16; l++)
            s[t][l] = dsc[t];
    }
    return 1;
}

static void mb_kq_run_portable(const struct mb_kq_job *j, int32_t r0, int32_t rows, int32_t c0,
                               int32_t c1) {
    float q[MB_QK], s[8][16], dmn[8], X[8];
    for (int32_t c = c0; c < c1; c++)
        for (int32_t r = r0; r < r0 + rows; r++) {
            const uint16_t *xr = j->x + (size_t)r * j->ldx;
            float A[16] = {0}, N[8] = {0};
            int mins = 0;
            for (int32_t b = 0; b < j->blocks; b++) {
                const uint8_t *blk = j->w + (size_t)c * j->row_bytes + (size_t)b * mb_kq_block_bytes(j->type);
                const uint16_t *xb = xr + (size_t)b * MB_QK;
                mins = mb_kq_decode(j->type, blk, q, s, dmn);
                for (int t = 0; t < 8; t++)
                    for (int l = 0; l < 16; l++) {
                        int i = 32 * t + 2 * l;
                        float xo = mb_flush(mb_bf16_f32(xb[i + 1])), xe = mb_flush(mb_bf16_f32(xb[i]));
                        float p = mb_flush(mb_flush(0.0f + xo * q[i + 1]) + xe * q[i]);
                        A[l] = A[l] + s[t][l] * p;
                    }
                if (mins) {
                    mb_kq_xsums(xb, X);
                    for (int t = 0; t < 8; t++)
                        N[t] = N[t] + dmn[t] * X[t];
                }
            }
            float out = mins ? mb_sum16(A) - mb_sum8(N) : mb_sum16(A);
            mb_kq_store(j, r, c, out);
        }
}

/* ---- AVX512-BF16 path ---- */

#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 10))
#define MB_KQ_HAVE_AVX512 1
#include <immintrin.h>

#define MB_KQ_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

/* bfloat16 bits of 0 .. 31 (Q4_K, Q5_K) and of -32 .. 31 (Q6_K), indexed by q */
static const uint16_t mb_kq_small[32] = {
    0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120,
    0x4130, 0x4140, 0x4150, 0x4160, 0x4170, 0x4180, 0x4188, 0x4190, 0x4198, 0x41a0, 0x41a8,
    0x41b0, 0x41b8, 0x41c0, 0x41c8, 0x41d0, 0x41d8, 0x41e0, 0x41e8, 0x41f0, 0x41f8
};
static const uint16_t mb_kq_q6[64] = {
    0xc200, 0xc1f8, 0xc1f0, 0xc1e8, 0xc1e0, 0xc1d8, 0xc1d0, 0xc1c8, 0xc1c0, 0xc1b8, 0xc1b0,
    0xc1a8, 0xc1a0, 0xc198, 0xc190, 0xc188, 0xc180, 0xc170, 0xc160, 0xc150, 0xc140, 0xc130,
    0xc120, 0xc110, 0xc100, 0xc0e0, 0xc0c0, 0xc0a0, 0xc080, 0xc040, 0xc000, 0xbf80, 0x0000,
    0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120, 0x4130,
    0x4140, 0x4150, 0x4160, 0x4170, 0x4180, 0x4188, 0x4190, 0x4198, 0x41a0, 0x41a8, 0x41b0,
    0x41b8, 0x41c0, 0x41c8, 0x41d0, 0x41d8, 0x41e0, 0x41e8, 0x41f0, 0x41f8
};

static inline __attribute__((always_inline)) MB_KQ_TARGET float mb_sum16_avx512(__m512 v) {
    __m256 lo = _mm512_castps512_ps256(v);
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    __m256 a = _mm256_add_ps(lo, hi);                                          /* l + l+8 */
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)); /* + l+4 */
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));                              /* + l+2 */
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));              /* + l+1 */
}

/* p * *s, s broadcast from memory: a load, where _mm512_set1_ps of a value the compiler
 * holds in a register costs shuffles (the port the weights' unpacking needs). */
static inline __attribute__((always_inline)) MB_KQ_TARGET __m512 mb_kq_mul_bcast(__m512 p, const float *s) {
    __m512 out;
    __asm__("vmulps %2%{1to16%}, %1, %0" : "=v"(out) : "v"(p), "m"(*s));
    return out;
}

/* X[0 .. 8) of one block's 256 x: sum16 of each chunk's pair sums, the eight trees run
 * side by side (each add is the one mb_sum16 makes, in lanes of their own). */
static inline __attribute__((always_inline)) MB_KQ_TARGET __m256 mb_kq_xsums_avx512(const uint16_t *x) {
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);
    __m512 S[8], V[4];
    for (int t = 0; t < 8; t++)
        S[t] = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(x + 32 * t), ones);
    for (int i = 0; i < 4; i++) /* [S(2i) lanes 0-7 | S(2i+1) lanes 0-7] + the lanes 8-15 */
        V[i] = _mm512_add_ps(_mm512_shuffle_f32x4(S[2 * i], S[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(S[2 * i], S[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* quarter g: sub-block g (then 4 + g) lanes l + l+4 */
    __m512 W0 = _mm512_add_ps(_mm512_shuffle_f32x4(V[0], V[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(V[0], V[1], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 W1 = _mm512_add_ps(_mm512_shuffle_f32x4(V[2], V[3], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(V[2], V[3], _MM_SHUFFLE(3, 1, 3, 1)));
    /* quarter g: [g: l + l+2 for l = 0, 1 | 4 + g: the same] */
    __m512 X = _mm512_add_ps(_mm512_shuffle_ps(W0, W1, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(W0, W1, _MM_SHUFFLE(3, 2, 3, 2)));
    /* quarter g: [X(g), X(4 + g), ...] */
    __m512 Y = _mm512_add_ps(_mm512_shuffle_ps(X, X, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(X, X, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, Y));
}

static inline __attribute__((always_inline)) MB_KQ_TARGET float mb_sum8_avx512(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* l + l+4 */
    __m128 c = _mm_add_ps(a, _mm_movehl_ps(a, a));                                  /* + l+2 */
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));                  /* + l+1 */
}

/* One output c for MR rows from r0 (MR and the type constant in each instantiation);
 * xs: the rows' X (j->blocks * 8 floats a row), or NULL to make them here. */
static inline __attribute__((always_inline)) MB_KQ_TARGET void
mb_kq_out_avx512(const struct mb_kq_job *j, int32_t r0, int32_t c, const float *xs, const int MR,
                 const int type) {
    const int mins = type != MB_GGML_Q6_K;
    const int64_t bb = type == MB_GGML_Q4_K ? 144 : type == MB_GGML_Q5_K ? 176 : 210;
    __m512 A[MB_KQ_ROWS];
    __m256 N[MB_KQ_ROWS];
    for (int r = 0; r < MR; r++)
        A[r] = _mm512_setzero_ps(), N[r] = _mm256_setzero_ps();
    const __m512i small = _mm512_loadu_si512(mb_kq_small);
    const __m512i small16 = _mm512_inserti64x4(small, _mm512_castsi512_si256(small), 1); /* 0..15 twice */
    const __m512i q6a = _mm512_loadu_si512(mb_kq_q6), q6b = _mm512_loadu_si512(mb_kq_q6 + 32);
    const __m512i low4 = _mm512_set1_epi16(0xf);
    const uint8_t *row = j->w + (size_t)c * j->row_bytes;
    for (int32_t b = 0; b < j->blocks; b++) {
        const uint8_t *blk = row + (size_t)b * bb;
        __m512bh q[8];
        __m512 s[8];
        float dscs[8];
        __m256 dmn = _mm256_setzero_ps();
        if (type == MB_GGML_Q6_K) {
            const uint8_t *ql = blk, *qh = blk + 128;
            for (int h = 0; h < 2; h++) {
                __m512i la = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(ql + 64 * h)));
                __m512i lb = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32)));
                __m512i hw = _mm512_slli_epi16(
                    _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qh + 32 * h))), 4);
                const __m512i m30 = _mm512_set1_epi16(0x30);
                __m512i v0 = _mm512_or_si512(_mm512_and_si512(la, low4), _mm512_and_si512(hw, m30));
                __m512i v1 = _mm512_or_si512(_mm512_and_si512(lb, low4),
                                             _mm512_and_si512(_mm512_srli_epi16(hw, 2), m30));
                __m512i v2 = _mm512_or_si512(_mm512_srli_epi16(la, 4),
                                             _mm512_and_si512(_mm512_srli_epi16(hw, 4), m30));
                __m512i v3 = _mm512_or_si512(_mm512_srli_epi16(lb, 4),
                                             _mm512_and_si512(_mm512_srli_epi16(hw, 6), m30));
                q[4 * h + 0] = (__m512bh)_mm512_permutex2var_epi16(q6a, v0, q6b);
                q[4 * h + 1] = (__m512bh)_mm512_permutex2var_epi16(q6a, v1, q6b);
                q[4 * h + 2] = (__m512bh)_mm512_permutex2var_epi16(q6a, v2, q6b);
                q[4 * h + 3] = (__m512bh)_mm512_permutex2var_epi16(q6a, v3, q6b);
            }
            __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192))));
            sc = _mm512_mul_ps(_mm512_set1_ps(mb_f16_f32(blk + 208)), sc); /* d * sc[i], exact */
            for (int t = 0; t < 8; t++) { /* lanes 0-7: sub-block 2t, lanes 8-15: 2t + 1 */
                __m512i idx = _mm512_inserti64x4(_mm512_set1_epi32(2 * t), _mm256_set1_epi32(2 * t + 1), 1);
                s[t] = _mm512_permutexvar_ps(idx, sc);
            }
        } else {
            /* the eight 6-bit scales and mins, as mb_kq_scales reads them, 4 bytes at a time */
            uint32_t u0, u1, u2;
            memcpy(&u0, blk + 4, 4), memcpy(&u1, blk + 8, 4), memcpy(&u2, blk + 12, 4);
            uint64_t sc8 = (uint64_t)(u0 & 0x3f3f3f3fu) |
                           (uint64_t)((u2 & 0x0f0f0f0fu) | ((u0 >> 2) & 0x30303030u)) << 32;
            uint64_t mn8 = (uint64_t)(u1 & 0x3f3f3f3fu) |
                           (uint64_t)(((u2 >> 4) & 0x0f0f0f0fu) | ((u1 >> 2) & 0x30303030u)) << 32;
            __m256 dsc = _mm256_mul_ps(_mm256_set1_ps(mb_f16_f32(blk)),
                                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc8))));
            dmn = _mm256_mul_ps(_mm256_set1_ps(mb_f16_f32(blk + 2)),
                                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn8))));
            _mm256_storeu_ps(dscs, dsc);
            const uint8_t *qs = blk + (type == MB_GGML_Q5_K ? 48 : 16);
            __m512i hw = _mm512_setzero_si512();
            if (type == MB_GGML_Q5_K) /* bit t of byte i: the fifth bit of q[32t + i] */
                hw = _mm512_slli_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 16))), 4);
            const __m512i bit4 = _mm512_set1_epi16(0x10);
            for (int h = 0; h < 4; h++) {
                __m512i wq = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qs + 32 * h)));
                /* Q4_K: vpermw reads the low 5 bits, and the table repeats 0 .. 15 twice */
                __m512i lo = type == MB_GGML_Q5_K ? _mm512_and_si512(wq, low4) : wq;
                __m512i hi = _mm512_srli_epi16(wq, 4);
                if (type == MB_GGML_Q5_K) {
                    lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_srl_epi16(hw, _mm_cvtsi32_si128(2 * h)), bit4));
                    hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srl_epi16(hw, _mm_cvtsi32_si128(2 * h + 1)), bit4));
                }
                q[2 * h] = (__m512bh)_mm512_permutexvar_epi16(lo, type == MB_GGML_Q5_K ? small : small16);
                q[2 * h + 1] = (__m512bh)_mm512_permutexvar_epi16(hi, small);
            }
        }
        for (int r = 0; r < MR; r++) {
            const uint16_t *x = j->x + (size_t)(r0 + r) * j->ldx + (size_t)b * MB_QK;
            for (int t = 0; t < 8; t++) {
                __m512 p = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(x + 32 * t), q[t]);
                A[r] = _mm512_add_ps(A[r], mins ? mb_kq_mul_bcast(p, dscs + t) : _mm512_mul_ps(s[t], p));
            }
            if (mins) {
                __m256 X = xs ? _mm256_loadu_ps(xs + ((size_t)r * j->blocks + b) * 8) : mb_kq_xsums_avx512(x);
                N[r] = _mm256_add_ps(N[r], _mm256_mul_ps(dmn, X));
            }
        }
    }
    for (int r = 0; r < MR; r++) {
        float out = mins ? mb_sum16_avx512(A[r]) - mb_sum8_avx512(N[r]) : mb_sum16_avx512(A[r]);
        mb_kq_store(j, r0 + r, c, out);
    }
}

#define MB_KQ_ROWS_CASES(TYPE)                                                                  \
    switch (rows) {                                                                             \
    case 1: mb_kq_out_avx512(j, r0, c, xs, 1, TYPE); break;                                         \
    case 2: mb_kq_out_avx512(j, r0, c, xs, 2, TYPE); break;                                         \
    case 3: mb_kq_out_avx512(j, r0, c, xs, 3, TYPE); break;                                         \
    case 4: mb_kq_out_avx512(j, r0, c, xs, 4, TYPE); break;                                         \
    case 5: mb_kq_out_avx512(j, r0, c, xs, 5, TYPE); break;                                         \
    case 6: mb_kq_out_avx512(j, r0, c, xs, 6, TYPE); break;                                         \
    case 7: mb_kq_out_avx512(j, r0, c, xs, 7, TYPE); break;                                         \
    case 8: mb_kq_out_avx512(j, r0, c, xs, 8, TYPE); break;                                         \
    case 9: mb_kq_out_avx512(j, r0, c, xs, 9, TYPE); break;                                         \
    case 10: mb_kq_out_avx512(j, r0, c, xs, 10, TYPE); break;                                       \
    case 11: mb_kq_out_avx512(j, r0, c, xs, 11, TYPE); break;                                       \
    case 12: mb_kq_out_avx512(j, r0, c, xs, 12, TYPE); break;                                       \
    case 13: mb_kq_out_avx512(j, r0, c, xs, 13, TYPE); break;                                       \
    case 14: mb_kq_out_avx512(j, r0, c, xs, 14, TYPE); break;                                       \
    case 15: mb_kq_out_avx512(j, r0, c, xs, 15, TYPE); break;                                       \
    default: mb_kq_out_avx512(j, r0, c, xs, 16, TYPE); break;                                       \
    }

/* Q4_K / Q5_K: the item's rows' X once (when they fit), then each output */
static inline __attribute__((always_inline)) MB_KQ_TARGET void
mb_kq_run_mins(const struct mb_kq_job *j, int32_t r0, int32_t rows, int32_t c0, int32_t c1, const int type) {
    float sums[MB_KQ_ROWS * MB_KQ_SUM_BLOCKS * 8];
    const float *xs = NULL;
    if (j->blocks <= MB_KQ_SUM_BLOCKS) {
        for (int32_t r = 0; r < rows; r++)
            for (int32_t b = 0; b < j->blocks; b++)
                _mm256_storeu_ps(sums + ((size_t)r * j->blocks + b) * 8,
                                 mb_kq_xsums_avx512(j->x + (size_t)(r0 + r) * j->ldx + (size_t)b * MB_QK));
        xs = sums;
    }
    for (int32_t c = c0; c < c1; c++) {
        if (type == MB_GGML_Q4_K)
            MB_KQ_ROWS_CASES(MB_GGML_Q4_K)
        else
            MB_KQ_ROWS_CASES(MB_GGML_Q5_K)
    }
}

static MB_KQ_TARGET void mb_kq_run_q4k(const struct mb_kq_job *j, int32_t r0, int32_t rows,
                                       int32_t c0, int32_t c1) {
    mb_kq_run_mins(j, r0, rows, c0, c1, MB_GGML_Q4_K);
}

static MB_KQ_TARGET void mb_kq_run_q5k(const struct mb_kq_job *j, int32_t r0, int32_t rows,
                                       int32_t c0, int32_t c1) {
    mb_kq_run_mins(j, r0, rows, c0, c1, MB_GGML_Q5_K);
}

static MB_KQ_TARGET void mb_kq_run_q6k(const struct mb_kq_job *j, int32_t r0, int32_t rows,
                                       int32_t c0, int32_t c1) {
    const float *xs = NULL;
    for (int32_t c = c0; c < c1; c++)
        MB_KQ_ROWS_CASES(MB_GGML_Q6_K)
}
#else
#define MB_KQ_HAVE_AVX512 0
#endif

/* Guided handout, as csrc/linear.c's mb_worker: runs of remaining / (2 * threads) items. */
static void mb_kq_worker(void *data) {
    struct mb_kq_job *j = (struct mb_kq_job *)data;
    for (;;) {
        int64_t first, take = mb_take_guided(&j->next, j->items, j->threads, &first);
        if (take == 0)
            return;
        for (int64_t i = first; i < first + take; i++) {
            int32_t g = (int32_t)(i / j->tiles), t = (int32_t)(i % j->tiles);
            int32_t r0 = g * MB_KQ_ROWS, c0 = t * MB_KQ_TILE;
            int32_t rows = j->m - r0 < MB_KQ_ROWS ? j->m - r0 : MB_KQ_ROWS;
            int32_t c1 = j->n - c0 < MB_KQ_TILE ? j->n : c0 + MB_KQ_TILE;
            j->run(j, r0, rows, c0, c1);
        }
    }
}

int mb_kq_linear(int32_t type, const uint8_t *w, int64_t row_bytes, int32_t n, int32_t k,
                 const uint16_t *x, int64_t ldx, int32_t m, const float *bias, void *y,
                 int32_t y_mode, int64_t ldy, int32_t kernel, void *parallel, int32_t threads) {
    int64_t bb = mb_kq_block_bytes(type);
    if (bb == 0 || m < 1 || n < 1 || k < MB_QK || k % MB_QK || ldx < k || ldy < n ||
        row_bytes < (int64_t)(k / MB_QK) * bb || y_mode < MB_Y_BF16 || y_mode > MB_Y_ADD_BF16)
        return MB_EINVAL;
    struct mb_kq_job j;
    memset(&j, 0, sizeof j);
    j.type = type, j.w = w, j.row_bytes = row_bytes, j.n = n, j.k = k, j.blocks = k / MB_QK;
    j.x = x, j.ldx = ldx, j.m = m, j.bias = bias, j.y = y, j.y_mode = y_mode, j.ldy = ldy;
    if (kernel == MB_KERNEL_PORTABLE)
        j.run = mb_kq_run_portable;
#if MB_KQ_HAVE_AVX512
    else if (kernel == MB_KERNEL_AVX512BF16 && mb_bf16_kernel() == MB_KERNEL_AVX512BF16)
        j.run = type == MB_GGML_Q4_K ? mb_kq_run_q4k : type == MB_GGML_Q5_K ? mb_kq_run_q5k : mb_kq_run_q6k;
#endif
    else
        return MB_EINVAL;
    j.tiles = (n + MB_KQ_TILE - 1) / MB_KQ_TILE;
    j.groups = (m + MB_KQ_ROWS - 1) / MB_KQ_ROWS;
    j.items = (int64_t)j.tiles * j.groups;
#ifdef MB_ATOMICS
    j.threads = parallel != NULL && threads > 1 && j.items > 1 ? threads : 1;
#else
    j.threads = 1;
#endif
    if (j.threads > 1)
        ((mb_parallel_fn)parallel)(mb_kq_worker, &j, (unsigned)threads, 0);
    else
        mb_kq_worker(&j);
    return MB_OK;
}
