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
 *                 w = d*sc[g] * (u - 32) for the 16 weights of sub-block g (u in 0..63).
 *
 * The arithmetic (mashbox/native_ref.py's kq_linear states it in numpy; the tests compare
 * bits). Each weight goes in as the bfloat16 word W = 128 + u * 2^e, u the stored integer
 * (Q4_K: q, e = 3; Q5_K: q, e = 2; Q6_K: u, e = 1): the bits 0x4300 | u << e, made with a
 * shift and a bit select (vpternlogd), no table and no byte shuffle; exact since
 * u << e < 128. A block's 256 words go in four groups g of two 32-word vectors E and O:
 * a 64-byte load of the packed low bits holds 128 weights, E takes each 16-bit word's
 * low byte, O its high byte (mb_kq_slot says which weight each word is: for Q4_K and
 * Q5_K, E's words 0-15 are the even weights of chunk 4(g/2) + g%2, words 16-31 those of
 * the chunk 2 further; O the odd ones). Lane l of group g sums E's words 2l, 2l+1, then
 * O's, all of one sub-block:
 *     P = (+0 + x W at E[2l+1]) + x W at E[2l];  P = (P + x W at O[2l+1]) + x W at O[2l]
 *                                              (two vdpbf16ps, the first from zero)
 *     A[l] = A[l] + s * P                      (s = float(d) * sc * 2^-e of the lane's
 *                                              sub-block; exact)
 * so a multiply and an add serve 64 weights. x goes in once per call permuted to the
 * words' order. The products are exact (8-bit by 8-bit significands). The 128 and, for
 * Q6_K, the -32 come back through sums of x that depend on x alone, made once per call
 * (in the caller's thread, before the work is handed out): X16[j] = sum16 of
 * x[16j .. 16j+15] (natural order, denormals zero), X32[t] = X16[2t] + X16[2t+1]. Per
 * block:
 *     Q4_K, Q5_K: N[t] = N[t] + ((float(d) * sc[t]) * 2^(7-e) + float(dmin) * mn[t]) * X32[t]
 *     Q6_K:       N[j] = N[j] + ((float(d) * sc[j]) * 96) * X16[j]
 * (the first product exact, one rounding for the add; 96 d*sc exact). Blocks in order,
 * groups in order. Then out = sum16(A) - sum8(N) (Q6_K: sum16(A) - sum16(N)), sum16
 * adding lane l and l+8, then l and l+4, l and l+2, l and l+1 (sum8: l and l+4, ...);
 * then + bias; then y as mb_bf16_linear writes it. Denormal x and dpbf16 sums are zero,
 * as in csrc/linear.c; the rule's limits are linear.c's (products that leave float32's
 * normal range, a zero's sign). Activations are used exactly, never quantized: only the
 * sums' float32 roundings differ from the exact product of x and gguf's dequantized
 * weights, and the 128 offset makes the A and N sums larger than the result (Q4_K's
 * 128 + 8q against 8q: about 3x on random q), so the cancellation costs a bit or two of
 * float32's 24 (tests/test_native_kquant.py checks the result against float64).
 *
 * Speed (AVX-512): the previous rule (q as a word table lookup, one multiply and add per
 * 32 weights) spent its time on vpmovzxbw / vpermw and on the multiplies; this one has no
 * shuffle in the weight decode (Q6_K's and Q5_K's high bits take a broadcast load and two
 * variable shifts) and half the multiplies and adds. The scales go in as one vpermps per
 * group, shared by the group of rows.
 *
 * The order is fixed per output: a row's bits depend on its own x row, weight row, bias
 * and y, never on m, its neighbours or the threads. Rows go in groups of up to
 * MB_KQ_ROWS: the AVX-512 path decodes each block once per group and applies it to all
 * the group's rows, one output (weight row, read front to back, 4 KB prefetched ahead into L2)
 * at a time. Work items (a row group x
 * MB_KQ_TILE outputs, the row groups of a tile next to each other so that its weights
 * are read from memory once) are handed out to the caller's OpenMP pool as csrc/linear.c
 * does.
 */
#include "mashbox.h"
#include "bf16.h"
#include "ggml_blocks.h"

#include <stdlib.h>
#include <string.h>

#define MB_QK 256       /* weights per block */
#define MB_KQ_ROWS 8    /* rows per group: each block is decoded once for all of them */
#define MB_KQ_TILE 32   /* outputs per work item */
#define MB_KQ_PREFETCH 4096 /* bytes ahead in the weight rows, into L2 (prefetcht1): one core
                             * of a Zen 4 then reads a row past the caches at the rate it
                             * computes one in L2 (benchmarks/kquant.py --single --threads 1
                             * on a 16384x8192 matrix); 2 KB into L1 (prefetcht0) left it
                             * ~25% slower, waiting on memory */

struct mb_kq_job {
    struct mb_q_call a;
    int32_t blocks;
    const uint16_t *xp; /* [m, k] x in the words' order (AVX-512 path), or NULL */
    const float *xs;    /* [m, ldxs] X32 (Q4_K, Q5_K) or X16 (Q6_K) */
    const float *xw;    /* [m, k] x as the AVX2 path reads it (mb_kq2_prepare), or NULL */
    int64_t ldxs;
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

/* e of W = 128 + u * 2^e: the integer's shift into the word's 7 mantissa bits */
static int mb_kq_shift(int32_t type) {
    return type == MB_GGML_Q4_K ? 3 : type == MB_GGML_Q5_K ? 2 : 1;
}

/* Q4_K / Q5_K: d*sc[j] and dmin*mn[j] (both exact) */
static void mb_kq_scales(const uint8_t *blk, float dsc[8], float dmn[8]) {
    float d = mb_half(blk), dmin = mb_half(blk + 2);
    uint32_t sc[8], mn[8];
    mb_k_scales(blk + 4, sc, mn);
    for (int j = 0; j < 8; j++) {
        dsc[j] = d * (float)sc[j];
        dmn[j] = dmin * (float)mn[j];
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

/* The block weight (0 .. 255) that word w (0 .. 31) of group g's E (o = 0) or O (o = 1)
 * vector holds (see the top of the file). */
static int mb_kq_slot(int32_t type, int g, int o, int w) {
    int hi = w >= 16, i = 2 * (w % 16) + o;
    if (type == MB_GGML_Q6_K) /* half g / 2, parts 2 (g % 2) + hi */
        return 128 * (g / 2) + 32 * (2 * (g % 2) + hi) + i;
    return 32 * (4 * (g / 2) + 2 * hi + g % 2) + i; /* chunk 4 (g / 2) + 2 hi + g % 2 */
}

/* Row r's sums of x: X32 (Q4_K, Q5_K) or X16 (Q6_K) into xs[0 .. k/32 or k/16) */
static void mb_kq_xsums(const uint16_t *x, int32_t k, int q6, float *xs) {
    for (int32_t g = 0; g < k / 16; g++) {
        float v[16];
        for (int l = 0; l < 16; l++)
            v[l] = mb_flush(mb_bf16_f32(x[16 * g + l]));
        float s = mb_sum16(v);
        if (q6)
            xs[g] = s;
        else if (g % 2)
            xs[g / 2] = xs[g / 2] + s; /* X16[2t] + X16[2t+1] */
        else
            xs[g / 2] = s;
    }
}

/* ---- portable path: the rule, one output at a time ---- */

/* One block's stored integers u[256] in weight order, d*sc per weight dsc[256], and the N
 * coefficients c (8 per sub-block of 32, or Q6_K's 16 per 16). */
static void mb_kq_decode(int32_t type, const uint8_t *blk, int u[MB_QK], float dsc[MB_QK], float c[16]) {
    if (type == MB_GGML_Q6_K) {
        const uint8_t *ql = blk, *qh = blk + 128;
        const int8_t *sc = (const int8_t *)(blk + 192);
        float d = mb_half(blk + 208);
        for (int h = 0; h < 2; h++)
            for (int v = 0; v < 128; v++) { /* v = 32 * part + i */
                int part = v / 32, i = v % 32;
                int lo = (ql[64 * h + 32 * (part & 1) + i] >> (4 * (part >> 1))) & 0xf;
                int hi = (qh[32 * h + i] >> (2 * part)) & 3;
                u[128 * h + v] = lo | (hi << 4);
            }
        for (int g = 0; g < 16; g++) {
            float s = d * (float)sc[g];
            c[g] = s * 96.0f;
            for (int i = 0; i < 16; i++)
                dsc[16 * g + i] = s;
        }
        return;
    }
    float sc[8], dmn[8];
    mb_kq_scales(blk, sc, dmn);
    const float offset = type == MB_GGML_Q5_K ? 32.0f : 16.0f; /* 2^(7-e) */
    const uint8_t *qh = blk + 16, *qs = blk + (type == MB_GGML_Q5_K ? 48 : 16);
    for (int t = 0; t < 8; t++) {
        for (int i = 0; i < 32; i++) {
            int v = (qs[32 * (t / 2) + i] >> (4 * (t % 2))) & 0xf;
            if (type == MB_GGML_Q5_K)
                v |= ((qh[i] >> t) & 1) << 4;
            u[32 * t + i] = v;
            dsc[32 * t + i] = sc[t];
        }
        c[t] = sc[t] * offset + dmn[t];
    }
}

static void mb_kq_run_portable(const struct mb_kq_job *j, int32_t r0, int32_t rows, int32_t c0,
                               int32_t c1) {
    int u[MB_QK];
    float dsc[MB_QK], cf[16];
    const int e = mb_kq_shift(j->a.type), q6 = j->a.type == MB_GGML_Q6_K;
    const float unshift = 1.0f / (float)(1 << e);
    for (int32_t c = c0; c < c1; c++)
        for (int32_t r = r0; r < r0 + rows; r++) {
            const uint16_t *xr = j->a.x + (size_t)r * j->a.ldx;
            const float *xs = j->xs + (size_t)r * j->ldxs;
            float A[16] = {0}, N[16] = {0};
            for (int32_t b = 0; b < j->blocks; b++) {
                const uint8_t *blk = j->a.w + (size_t)c * j->a.row_bytes + (size_t)b * mb_kq_block_bytes(j->a.type);
                const uint16_t *xb = xr + (size_t)b * MB_QK;
                mb_kq_decode(j->a.type, blk, u, dsc, cf);
                for (int g = 0; g < 4; g++)
                    for (int l = 0; l < 16; l++) {
                        float p = 0.0f;
                        for (int o = 0; o < 2; o++) { /* the E word pair, then the O pair */
                            int j1 = mb_kq_slot(j->a.type, g, o, 2 * l + 1), j0 = mb_kq_slot(j->a.type, g, o, 2 * l);
                            float x1 = mb_flush(mb_bf16_f32(xb[j1])), x0 = mb_flush(mb_bf16_f32(xb[j0]));
                            float w1 = (float)(128 + (u[j1] << e)), w0 = (float)(128 + (u[j0] << e));
                            p = mb_flush(mb_flush(p + x1 * w1) + x0 * w0);
                        }
                        A[l] = A[l] + (dsc[mb_kq_slot(j->a.type, g, 0, 2 * l)] * unshift) * p;
                    }
                for (int g = 0; g < (q6 ? 16 : 8); g++)
                    N[g] = N[g] + cf[g] * xs[(size_t)b * (q6 ? 16 : 8) + g];
            }
            float out = mb_sum16(A) - (q6 ? mb_sum16(N) : mb_sum8(N));
            mb_y_store(&j->a, r, c, out);
        }
}

/* ---- vector scales, shared by the AVX512-BF16 and AVX2 paths ---- */

#if defined(__x86_64__) && (defined(__clang__) || defined(__GNUC__))
#include <immintrin.h>

/* Q4_K / Q5_K: a block's d * sc[j] (*dsc) and its N factors d * sc[j] * 2^(7-e) +
 * dmin * mn[j] (*cf), j < 8. The eight 6-bit scales and mins are read as mb_k_scales reads
 * them, 4 bytes at a time; every product is exact and cf takes one rounded add, so the
 * bits are mb_kq_scales'. */
static inline __attribute__((always_inline, target("avx2,f16c"))) void
mb_kq_dsc_cf(const uint8_t *blk, const int32_t type, __m256 *dsc, __m256 *cf) {
    uint32_t u0, u1, u2;
    memcpy(&u0, blk + 4, 4), memcpy(&u1, blk + 8, 4), memcpy(&u2, blk + 12, 4);
    const uint64_t sc8 = (uint64_t)(u0 & 0x3f3f3f3fu) |
                         (uint64_t)((u2 & 0x0f0f0f0fu) | ((u0 >> 2) & 0x30303030u)) << 32;
    const uint64_t mn8 = (uint64_t)(u1 & 0x3f3f3f3fu) |
                         (uint64_t)(((u2 >> 4) & 0x0f0f0f0fu) | ((u1 >> 2) & 0x30303030u)) << 32;
    const __m256 ds = _mm256_mul_ps(_mm256_set1_ps(mb_half_f16c(blk)),
                                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc8))));
    const __m256 dmn = _mm256_mul_ps(_mm256_set1_ps(mb_half_f16c(blk + 2)),
                                     _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn8))));
    *dsc = ds;
    *cf = _mm256_add_ps(_mm256_mul_ps(ds, _mm256_set1_ps(type == MB_GGML_Q5_K ? 32.0f : 16.0f)), dmn);
}
#endif

/* ---- AVX512-BF16 path ---- */

#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 10))
#define MB_KQ_HAVE_AVX512 1
#include <immintrin.h>

#define MB_KQ_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,f16c")))

static inline __attribute__((always_inline)) MB_KQ_TARGET float mb_sum16_avx512(__m512 v) {
    __m256 lo = _mm512_castps512_ps256(v);
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    __m256 a = _mm256_add_ps(lo, hi);                                          /* l + l+8 */
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)); /* + l+4 */
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));                              /* + l+2 */
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));              /* + l+1 */
}

static inline __attribute__((always_inline)) MB_KQ_TARGET float mb_sum8_avx512(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* l + l+4 */
    __m128 c = _mm_add_ps(a, _mm_movehl_ps(a, a));                                  /* + l+2 */
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));                  /* + l+1 */
}

/* 32 bytes in both halves of a register: a load (vbroadcasti64x4), no shuffle */
static inline __attribute__((always_inline)) MB_KQ_TARGET __m512i mb_kq_bcast32(const uint8_t *p) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p));
}

/* words shifted left by a (right by -a where a < 0) in the low half, by b in the high half
 * (AVX512BW variable shifts, no VBMI2 needed; a and b are constants where it is inlined, so
 * one shift does where both go the same way) */
static inline __attribute__((always_inline)) MB_KQ_TARGET __m512i mb_kq_move(__m512i v, int a, int b) {
    if (a >= 0 && b >= 0)
        return _mm512_sllv_epi16(v, _mm512_inserti64x4(_mm512_set1_epi16((short)a), _mm256_set1_epi16((short)b), 1));
    if (a <= 0 && b <= 0)
        return _mm512_srlv_epi16(v, _mm512_inserti64x4(_mm512_set1_epi16((short)-a), _mm256_set1_epi16((short)-b), 1));
    const __m512i left = _mm512_inserti64x4(_mm512_set1_epi16((short)(a > 0 ? a : 0)),
                                            _mm256_set1_epi16((short)(b > 0 ? b : 0)), 1);
    const __m512i right = _mm512_inserti64x4(_mm512_set1_epi16((short)(a < 0 ? -a : 0)),
                                             _mm256_set1_epi16((short)(b < 0 ? -b : 0)), 1);
    return _mm512_srlv_epi16(_mm512_sllv_epi16(v, left), right);
}

/* (v & mask) | bits */
static inline __attribute__((always_inline)) MB_KQ_TARGET __m512i mb_kq_sel(__m512i v, int mask, __m512i bits) {
    return _mm512_ternarylogic_epi32(v, _mm512_set1_epi16((short)mask), bits, 0xea);
}

/* Group g's E and O word vectors of a block (see the top of the file): the stored
 * integers moved to the word's mantissa bits by a shift, the rest masked, 0x4300 set. */
static inline __attribute__((always_inline)) MB_KQ_TARGET void
mb_kq_words(const uint8_t *blk, int g, const int type, __m512bh *E, __m512bh *O) {
    const __m512i b43 = _mm512_set1_epi16(0x4300);
    const int nib = g % 2;
    if (type == MB_GGML_Q4_K) { /* nibbles to bits 3-6 */
        __m512i v = _mm512_loadu_si512(blk + 16 + 64 * (g / 2));
        *E = (__m512bh)mb_kq_sel(nib ? _mm512_srli_epi16(v, 1) : _mm512_slli_epi16(v, 3), 0x78, b43);
        *O = (__m512bh)mb_kq_sel(nib ? _mm512_srli_epi16(v, 9) : _mm512_srli_epi16(v, 5), 0x78, b43);
        return;
    }
    if (type == MB_GGML_Q5_K) { /* nibbles to bits 2-5; the fifth bit (bit c of qh[i]) to 6 */
        __m512i v = _mm512_loadu_si512(blk + 48 + 64 * (g / 2)), h = mb_kq_bcast32(blk + 16);
        int clo = 4 * (g / 2) + nib, chi = clo + 2; /* the halves' chunks */
        __m512i he = mb_kq_sel(mb_kq_move(h, 6 - clo, 6 - chi), 0x40, b43);
        __m512i ho = mb_kq_sel(mb_kq_move(h, -2 - clo, -2 - chi), 0x40, b43);
        *E = (__m512bh)mb_kq_sel(nib ? _mm512_srli_epi16(v, 2) : _mm512_slli_epi16(v, 2), 0x3c, he);
        *O = (__m512bh)mb_kq_sel(nib ? _mm512_srli_epi16(v, 10) : _mm512_srli_epi16(v, 6), 0x3c, ho);
        return;
    }
    /* Q6_K, half g / 2, parts plo = 2 nib, phi = plo + 1: low 4 bits to bits 1-4, the high 2
     * (bits 2p of qh[i]) to 5-6 */
    __m512i v = _mm512_loadu_si512(blk + 64 * (g / 2)), h = mb_kq_bcast32(blk + 128 + 32 * (g / 2));
    int plo = 2 * nib, phi = plo + 1;
    __m512i he = mb_kq_sel(mb_kq_move(h, 5 - 2 * plo, 5 - 2 * phi), 0x60, b43);
    __m512i ho = mb_kq_sel(mb_kq_move(h, -3 - 2 * plo, -3 - 2 * phi), 0x60, b43);
    *E = (__m512bh)mb_kq_sel(nib ? _mm512_srli_epi16(v, 3) : _mm512_slli_epi16(v, 1), 0x1e, he);
    *O = (__m512bh)mb_kq_sel(nib ? _mm512_srli_epi16(v, 11) : _mm512_srli_epi16(v, 7), 0x1e, ho);
}

/* v is made here, in a register, in program order: keeps GCC from computing a block's
 * products ahead of their adds (it spilled them all to the stack) */
#define MB_KQ_PIN(v) __asm__ volatile("" : "+v"(v))

/* A block's four group scale vectors s[g] (d * sc * 2^-e per lane, exact) and its N
 * coefficients cv (Q4_K, Q5_K: 8 lanes; Q6_K: 16) */
static inline __attribute__((always_inline)) MB_KQ_TARGET void
mb_kq_block_scales(const uint8_t *blk, const int type, __m512 s[4], __m512 *cvp) {
    const int q6 = type == MB_GGML_Q6_K;
    const float unshift = type == MB_GGML_Q4_K ? 0.125f : type == MB_GGML_Q5_K ? 0.25f : 0.5f;
    __m512 cv;
    if (q6) { /* d * sc (exact); lanes of group g: sub-blocks 4g + 0, 0, 0, 0, 1, ... 3 */
        __m512 s16 = _mm512_mul_ps(_mm512_set1_ps(mb_half_f16c(blk + 208)),
                                   _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192)))));
        __m512 sh = _mm512_mul_ps(s16, _mm512_set1_ps(unshift));
        const __m512i quads = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
        _Pragma("GCC unroll 4")
        for (int g = 0; g < 4; g++)
            s[g] = _mm512_permutexvar_ps(_mm512_add_epi32(quads, _mm512_set1_epi32(4 * g)), sh);
        cv = _mm512_mul_ps(s16, _mm512_set1_ps(96.0f));
    } else {
        __m256 dsc, cf;
        mb_kq_dsc_cf(blk, type, &dsc, &cf);
        cv = _mm512_castps256_ps512(cf);
        /* lanes of group g: chunk 4 (g / 2) + g % 2 eight times, then that + 2 */
        __m512 sh = _mm512_castps256_ps512(_mm256_mul_ps(dsc, _mm256_set1_ps(unshift)));
        const __m512i halves = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
        _Pragma("GCC unroll 4")
        for (int g = 0; g < 4; g++)
            s[g] = _mm512_permutexvar_ps(_mm512_add_epi32(halves, _mm512_set1_epi32(4 * (g / 2) + g % 2)), sh);
    }
    *cvp = cv;
}

/* Output c for MR rows from r0 (MR and the type constant in each instantiation). */
static inline __attribute__((always_inline)) MB_KQ_TARGET void
mb_kq_out_avx512(const struct mb_kq_job *j, int32_t r0, int32_t c, const int MR, const int type) {
    const int q6 = type == MB_GGML_Q6_K;
    const int64_t bb = type == MB_GGML_Q4_K ? 144 : type == MB_GGML_Q5_K ? 176 : 210;
    __m512 A[MB_KQ_ROWS], N[MB_KQ_ROWS];
    _Pragma("GCC unroll 32")
    for (int i = 0; i < MR; i++)
        A[i] = _mm512_setzero_ps(), N[i] = _mm512_setzero_ps();
    const uint16_t *xp = j->xp + (size_t)r0 * j->a.k;
    const float *xs = j->xs + (size_t)r0 * j->ldxs;
    for (int32_t b = 0; b < j->blocks; b++) {
        const uint8_t *blk = j->a.w + (size_t)c * j->a.row_bytes + (size_t)b * bb;
        _Pragma("GCC unroll 4")
        for (int o = 0; o < bb; o += 64) /* 4 KB ahead (into the next row near the end) */
            _mm_prefetch((const char *)blk + MB_KQ_PREFETCH + o, _MM_HINT_T1);
        __m512 s[4], cv;
        mb_kq_block_scales(blk, type, s, &cv);
        _Pragma("GCC unroll 4")
        for (int g = 0; g < 4; g++) {
            __m512bh E, O;
            mb_kq_words(blk, g, type, &E, &O);
            if (MR > 2)
                { MB_KQ_PIN(E); MB_KQ_PIN(O); }
            _Pragma("GCC unroll 32")
            for (int r = 0; r < MR; r++) {
                const uint16_t *x = xp + (size_t)r * j->a.k + (size_t)b * MB_QK + 64 * g;
                __m512 p = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(x), E);
                p = _mm512_dpbf16_ps(p, (__m512bh)_mm512_loadu_si512(x + 32), O);
                A[r] = _mm512_add_ps(A[r], _mm512_mul_ps(s[g], p));
            }
            if (MR > 2) {
                _Pragma("GCC unroll 32")
                for (int r = 0; r < MR; r++)
                    MB_KQ_PIN(A[r]);
            }
        }
        _Pragma("GCC unroll 32")
        for (int r = 0; r < MR; r++) {
            const float *xr = xs + (size_t)r * j->ldxs;
            if (q6)
                N[r] = _mm512_add_ps(N[r], _mm512_mul_ps(cv, _mm512_loadu_ps(xr + (size_t)b * 16)));
            else
                N[r] = _mm512_castps256_ps512(_mm256_add_ps(_mm512_castps512_ps256(N[r]),
                    _mm256_mul_ps(_mm512_castps512_ps256(cv), _mm256_loadu_ps(xr + (size_t)b * 8))));
        }
    }
    _Pragma("GCC unroll 32")
    for (int r = 0; r < MR; r++) {
        float out = mb_sum16_avx512(A[r]) - (q6 ? mb_sum16_avx512(N[r]) : mb_sum8_avx512(_mm512_castps512_ps256(N[r])));
        mb_y_store(&j->a, r0 + r, c, out);
    }
}

/* Outputs c0 .. c1 for `rows` rows from r0, one output at a time: its weight row is read
 * once, front to back (two or four rows streamed side by side ran at half the speed on
 * matrices past the caches, as did k-tiles that jump between rows). */
static inline __attribute__((always_inline)) MB_KQ_TARGET void
mb_kq_run_avx512(const struct mb_kq_job *j, int32_t r0, int32_t rows, int32_t c0, int32_t c1, const int type) {
    switch (rows) {
#define MB_KQ_ROWS_CASE(R) \
    case R: for (int32_t c = c0; c < c1; c++) mb_kq_out_avx512(j, r0, c, R, type); break;
    MB_KQ_ROWS_CASE(1) MB_KQ_ROWS_CASE(2) MB_KQ_ROWS_CASE(3) MB_KQ_ROWS_CASE(4)
    MB_KQ_ROWS_CASE(5) MB_KQ_ROWS_CASE(6) MB_KQ_ROWS_CASE(7)
#undef MB_KQ_ROWS_CASE
    default:
        for (int32_t c = c0; c < c1; c++)
            mb_kq_out_avx512(j, r0, c, 8, type);
        break;
    }
}

static MB_KQ_TARGET void mb_kq_run_q4k(const struct mb_kq_job *j, int32_t r0, int32_t rows,
                                       int32_t c0, int32_t c1) {
    mb_kq_run_avx512(j, r0, rows, c0, c1, MB_GGML_Q4_K);
}

static MB_KQ_TARGET void mb_kq_run_q5k(const struct mb_kq_job *j, int32_t r0, int32_t rows,
                                       int32_t c0, int32_t c1) {
    mb_kq_run_avx512(j, r0, rows, c0, c1, MB_GGML_Q5_K);
}

static MB_KQ_TARGET void mb_kq_run_q6k(const struct mb_kq_job *j, int32_t r0, int32_t rows,
                                       int32_t c0, int32_t c1) {
    mb_kq_run_avx512(j, r0, rows, c0, c1, MB_GGML_Q6_K);
}

/* mb_kq_xsums, 16 x at a time: the same tree (mb_sum16's adds), so the same bits */
static MB_KQ_TARGET void mb_kq_xsums_avx512(const uint16_t *x, int32_t k, int q6, float *xs) {
    const __m512i expo = _mm512_set1_epi32(0x7f800000), sign = _mm512_set1_epi32((int)0x80000000u);
    for (int32_t g = 0; g < k / 16; g++) {
        __m512i v = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + 16 * g))), 16);
        v = _mm512_mask_and_epi32(v, _mm512_testn_epi32_mask(v, expo), v, sign); /* denormal -> zero */
        float sum = mb_sum16_avx512(_mm512_castsi512_ps(v));
        if (q6)
            xs[g] = sum;
        else if (g % 2)
            xs[g / 2] = xs[g / 2] + sum; /* X16[2t] + X16[2t+1] */
        else
            xs[g / 2] = sum;
    }
}

/* x row in the words' order: per block, group g's E then O vectors, each the even (odd)
 * words of two chunks (Q4_K, Q5_K: 4 (g / 2) + g % 2 and that + 2; Q6_K: 2g and 2g + 1) */
static MB_KQ_TARGET void mb_kq_permute_avx512(const uint16_t *x, int32_t k, int q6, uint16_t *xp) {
    const __m512i even = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32,
                                          30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi16(even, _mm512_set1_epi16(1));
    for (int32_t i = 0; i < k; i += MB_QK)
        for (int g = 0; g < 4; g++) {
            int ca = q6 ? 2 * g : 4 * (g / 2) + g % 2, cb = q6 ? ca + 1 : ca + 2;
            __m512i a = _mm512_loadu_si512(x + i + 32 * ca), b = _mm512_loadu_si512(x + i + 32 * cb);
            _mm512_storeu_si512(xp + i + 64 * g, _mm512_permutex2var_epi16(a, even, b));
            _mm512_storeu_si512(xp + i + 64 * g + 32, _mm512_permutex2var_epi16(a, odd, b));
        }
}
#else
#define MB_KQ_HAVE_AVX512 0
#endif

/* ---- AVX2 path: the rule with vdpbf16ps emulated by fused multiply-adds ----
 *
 * Lane l of group g sums four consecutive weights of one 32-weight chunk: lanes 0-7 the
 * chunk mb_kq_slot gives for words 0-15, lanes 8-15 the one for words 16-31, lane
 * l % 8 the chunk's weights 4 (l % 8) .. +3 in the order +2, +0, +3, +1 (E[2l+1], E[2l],
 * O[2l+1], O[2l]). So one ymm holds a chunk's eight lanes; x goes in once per call as
 * float32 (denormals zero) reordered per chunk to [+2 of each lane, +0, +3, +1], and a
 * chunk's 32 integers, as bytes u << e in weight order, become the four word vectors by
 * one pshufb each (the byte into bits 16-23 of a dword) and an or with 0x43000000: the
 * float32 128 + u * 2^e, the rule's word W exactly. Each product is exact, so an fma is
 * one of the rule's rounded adds; s * P and the A add round as the rule does. The same
 * bits as the portable kernel where the rule's limits hold (the P sums are not flushed
 * where they would be denormal). Two or more rows: mb_kq2_many_rows, below. */
#if defined(__x86_64__) && (defined(__clang__) || defined(__GNUC__))
#define MB_KQ_HAVE_AVX2 1
#include <immintrin.h>

#define MB_KQ2_TARGET __attribute__((target("avx2,fma,f16c")))
#define MB_KQ2_INLINE static inline __attribute__((always_inline)) MB_KQ2_TARGET
/* v in a register here: without it GCC ran a block's (a sweep's chunk's) chains first and
 * spilled them to do the A adds last */
#define MB_KQ2_PIN(v) __asm__ volatile("" : "+x"(v))

static const int mb_kq2_order[4] = {2, 0, 3, 1}; /* a lane's weights, in its chain's order */

/* Row x as the AVX2 path reads it: per 32 x, [x[4i + order[p]] for i < 8] for p < 4. */
static void mb_kq2_prepare(const uint16_t *x, int32_t k, float *xw) {
    for (int32_t c = 0; c < k / 32; c++)
        for (int p = 0; p < 4; p++)
            for (int i = 0; i < 8; i++)
                xw[32 * c + 8 * p + i] = mb_flush(mb_bf16_f32(x[32 * c + 4 * i + mb_kq2_order[p]]));
}

/* Chunk t of block blk: its 32 integers, u << e as bytes in weight order. Made where a
 * chunk is used, from loads that hit L1: eight made ahead of the loop were spilled to the
 * stack (with the picks, the accumulators and x they need 17 ymm). */
MB_KQ2_INLINE __m256i mb_kq2_chunk_bytes(const int32_t type, const uint8_t *blk, const int t) {
    const __m256i low = _mm256_set1_epi8(15);
    if (type == MB_GGML_Q6_K) {
        const uint8_t *ql = blk + 64 * (t / 4), *qh = blk + 128 + 32 * (t / 4);
        const int part = t % 4;
        __m256i lo = _mm256_loadu_si256((const __m256i *)(ql + 32 * (part & 1)));
        lo = _mm256_and_si256(part >> 1 ? _mm256_srli_epi16(lo, 4) : lo, low);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)qh), 2 * part),
                                      _mm256_set1_epi8(3));
        return _mm256_slli_epi16(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), 1); /* e = 1 */
    }
    if (type == MB_GGML_Q4_K) { /* e = 3: each nibble into bits 3-6 of its byte, one shift and one and */
        const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * (t / 2)));
        return _mm256_and_si256(t % 2 ? _mm256_srli_epi16(v, 1) : _mm256_slli_epi16(v, 3), _mm256_set1_epi8(0x78));
    }
    __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 48 + 32 * (t / 2)));
    v = _mm256_and_si256(t % 2 ? _mm256_srli_epi16(v, 4) : v, low);
    __m256i bit = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(blk + 16)), t),
                                   _mm256_set1_epi8(1));
    return _mm256_slli_epi16(_mm256_or_si256(v, _mm256_slli_epi16(bit, 4)), 2); /* Q5_K, e = 2 */
}

/* Block blk's scales in vectors, as the AVX-512 path's mb_kq_block_scales: s[0] the eight
 * d * sc (Q6_K: s[0], s[1] its sixteen) and the N factors cf (groups 0-7, Q6_K's 8-15 in
 * cf[1]; zero for the others). Scalar, their bytes went through the stack and were read
 * back wider, a store-forwarding stall that took a quarter of the one-row loop's cycles on
 * Zen 3. Every product is exact and each cf takes one rounded add, so the bits are the
 * scalar rule's. */
MB_KQ2_INLINE void mb_kq2_block_s(int32_t type, const uint8_t *blk, __m256 s[2], __m256 cf[2]) {
    if (type == MB_GGML_Q6_K) {
        const __m256 d = _mm256_set1_ps(mb_half_f16c(blk + 208));
        const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 192));
        s[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
        s[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
        for (int i = 0; i < 2; i++)
            cf[i] = _mm256_mul_ps(s[i], _mm256_set1_ps(96.0f));
        return;
    }
    mb_kq_dsc_cf(blk, type, &s[0], &cf[0]);
    s[1] = cf[1] = _mm256_setzero_ps();
}

/* Block blk's per-chunk s (sv[t], lanes 0-3 the chunk's first 16 weights' s, 4-7 the
 * second's: one value but for Q6_K's two scales a chunk) and its N factors cf, for the
 * many-row widening. */
MB_KQ2_INLINE void mb_kq2_scales(int32_t type, const uint8_t *blk, __m256 sv[8], __m256 cf[2]) {
    const __m256 unshift = _mm256_set1_ps(1.0f / (float)(1 << mb_kq_shift(type)));
    float sh[16] __attribute__((aligned(32)));
    __m256 s[2];
    mb_kq2_block_s(type, blk, s, cf);
    _mm256_store_ps(sh, _mm256_mul_ps(s[0], unshift));
    if (type == MB_GGML_Q6_K) {
        _mm256_store_ps(sh + 8, _mm256_mul_ps(s[1], unshift));
        for (int t = 0; t < 8; t++)
            sv[t] = _mm256_setr_m128(_mm_broadcast_ss(sh + 2 * t), _mm_broadcast_ss(sh + 2 * t + 1));
        return;
    }
    for (int t = 0; t < 8; t++)
        sv[t] = _mm256_broadcast_ss(sh + t);
}

/* The pshufb masks: dword i of each 128-bit lane takes byte 4i + order[p] into bits 16-23. */
MB_KQ2_INLINE void mb_kq2_picks(__m256i pick[4]) {
    for (int p = 0; p < 4; p++) {
        int o = mb_kq2_order[p];
        pick[p] = _mm256_setr_epi8(-128, -128, (char)o, -128, -128, -128, (char)(4 + o), -128,
                                   -128, -128, (char)(8 + o), -128, -128, -128, (char)(12 + o), -128,
                                   -128, -128, (char)o, -128, -128, -128, (char)(4 + o), -128,
                                   -128, -128, (char)(8 + o), -128, -128, -128, (char)(12 + o), -128);
    }
}

/* The A sum (lanes 0-7 or 8-15 of the rule's 16) chunk ch's weights go to. Each takes its
 * chunks in increasing ch: group g of the rule is chunk pair g / 2 (Q4_K, Q5_K) or the
 * chunks 2g, 2g + 1 (Q6_K). */
static inline int mb_kq2_half(int q6, int ch) { return q6 ? ch % 2 : (ch / 2) % 2; }

/* One row's block terms ahead of its chunks: block blk's N terms added to N (xsb its X32 or
 * X16) and its chunk scales s written to ring (Q4_K, Q5_K: ring[t], broadcast at use; Q6_K:
 * ring[8t .. 8t+7], chunk t's lanes). The loop stages block b + 1 before block b's chunks, so
 * the chunks read s from stores long done: held in registers, a block's eight s pushed the
 * loop past 16 ymm and it spilled its accumulators; read back at once, they waited on the
 * stores. N goes block by block in order, as the rule adds it. */
MB_KQ2_INLINE void mb_kq2_stage(const int32_t type, const uint8_t *blk, const float *xsb, float *ring, __m256 N[2]) {
    const __m256 unshift = _mm256_set1_ps(1.0f / (float)(1 << mb_kq_shift(type)));
    __m256 s[2], cf[2];
    mb_kq2_block_s(type, blk, s, cf);
    for (int i = 0; i < (type == MB_GGML_Q6_K ? 2 : 1); i++)
        N[i] = _mm256_add_ps(N[i], _mm256_mul_ps(cf[i], _mm256_loadu_ps(xsb + 8 * i)));
    if (type != MB_GGML_Q6_K) {
        _mm256_store_ps(ring, _mm256_mul_ps(s[0], unshift));
        return;
    }
    for (int i = 0; i < 2; i++) {
        const __m256 su = _mm256_mul_ps(s[i], unshift);
        for (int t = 0; t < 4; t++) /* lanes 0-3 sub-block 2t's s, 4-7 sub-block 2t + 1's */
            _mm256_store_ps(ring + 32 * i + 8 * t,
                            _mm256_permutevar8x32_ps(su, _mm256_setr_epi32(2 * t, 2 * t, 2 * t, 2 * t, 2 * t + 1,
                                                                           2 * t + 1, 2 * t + 1, 2 * t + 1)));
    }
}

MB_KQ2_INLINE void mb_kq2_one_row(const struct mb_kq_job *j, const int32_t type, int32_t r, int32_t c0, int32_t c1) {
    const int q6 = type == MB_GGML_Q6_K;
    const int64_t bb = mb_kq_block_bytes(type), ldb = q6 ? 16 : 8;
    const __m256i word = _mm256_set1_epi32(0x43000000);
    __m256i pick[4];
    mb_kq2_picks(pick);
    const float *xw = j->xw + (size_t)r * j->a.k;
    const float *xs = j->xs + (size_t)r * j->ldxs;
    float ring[2][64] __attribute__((aligned(32)));
    for (int32_t c = c0; c < c1; c++) {
        const uint8_t *row = j->a.w + (size_t)c * j->a.row_bytes;
        __m256 A[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        __m256 N[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}; /* groups 0-7, 8-15 */
        mb_kq2_stage(type, row, xs, ring[0], N);
        for (int32_t b = 0; b < j->blocks; b++) {
            const uint8_t *blk = row + (size_t)b * bb;
            if (b + 1 < j->blocks)
                mb_kq2_stage(type, blk + bb, xs + (size_t)(b + 1) * ldb, ring[(b + 1) & 1], N);
            const float *sr = ring[b & 1], *xb = xw + (size_t)b * MB_QK;
            _Pragma("GCC unroll 4")
            for (int q = 0; q < 4; q++) {
                /* chunks 2q and 2q + 1 (Q4_K: one byte load), their chains of four dependent fmas
                 * interleaved, so that fewer ops wait in the scheduler on the one before */
                __m256i u[2];
                __m256 P[2];
                _Pragma("GCC unroll 2")
                for (int i = 0; i < 2; i++)
                    u[i] = mb_kq2_chunk_bytes(type, blk, 2 * q + i), P[i] = _mm256_setzero_ps();
                _Pragma("GCC unroll 4")
                for (int p = 0; p < 4; p++)
                    _Pragma("GCC unroll 2")
                    for (int i = 0; i < 2; i++) {
                        __m256 W = _mm256_castsi256_ps(_mm256_or_si256(_mm256_shuffle_epi8(u[i], pick[p]), word));
                        P[i] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 32 * (2 * q + i) + 8 * p), W, P[i]);
                    }
                _Pragma("GCC unroll 2")
                for (int i = 0; i < 2; i++) {
                    const int ch = 2 * q + i, half = mb_kq2_half(q6, ch);
                    MB_KQ2_PIN(P[i]);
                    const __m256 sv = q6 ? _mm256_load_ps(sr + 8 * ch) : _mm256_broadcast_ss(sr + ch);
                    A[half] = _mm256_add_ps(A[half], _mm256_mul_ps(sv, P[i]));
                    MB_KQ2_PIN(A[half]);
                }
            }
        }
        float lanes[16], n[16];
        _mm256_storeu_ps(lanes, A[0]);
        _mm256_storeu_ps(lanes + 8, A[1]);
        _mm256_storeu_ps(n, N[0]);
        _mm256_storeu_ps(n + 8, N[1]);
        mb_y_store(&j->a, r, c, mb_sum16(lanes) - (q6 ? mb_sum16(n) : mb_sum8(n)));
    }
}

/* Two or more rows: an output pair's block widened once (its words as float32, 2 KB, in
 * L1) and applied to every row of the group, MR rows (up to MB_KQ2_MR) x NO outputs at a time:
 * per word vector NO loads and MR x loads feed MR * NO chains (8 at 4 x 2, what two FMA
 * pipes of latency 4 need to stay busy: 11 ymm with the words and x). The A sums stay in
 * memory (L1), each taking its chunk's s * P once the chunk's chains are done; a compiler
 * barrier after each chunk keeps GCC from holding every chunk's P to do the A adds last,
 * which spilled them (4 x 2 ran at half the speed of 3 x 2 with the A sums in registers
 * before it). N as vectors (its lanes are independent: the scalar rule's bits). The same
 * arithmetic in the same order per output as the one-row loop. Each MR x NO sweep is its
 * own function: inlined together into the caller, GCC kept their row addresses on the
 * stack. */
#define MB_KQ2_MR 4 /* rows a sweep at most */

struct mb_kq2_wide {
    __m256 W[2][8][4]; /* [output][chunk][p] */
    __m256 sv[2][8];
    __m256 cf[2][2];   /* N factors: groups 0-7, 8-15 (Q6_K) */
};

MB_KQ2_INLINE void mb_kq2_sweep(const struct mb_kq2_wide *wd, const int q6, const float *xw, int64_t k,
                                const float *xs, int64_t ldxs, int32_t b, __m256 (*__restrict A)[2][2],
                                __m256 (*__restrict N)[2][2], const int MR, const int NO) {
    /* CH chunks at a time, their chains interleaved: two where MR x NO gives fewer than 8 */
    const int CH = MR * NO <= 4 ? 2 : 1;
    _Pragma("GCC unroll 8")
    for (int c0 = 0; c0 < 8; c0 += CH) {
        __m256 P[2][MB_KQ2_MR][2];
        _Pragma("GCC unroll 2")
        for (int c = 0; c < CH; c++)
            _Pragma("GCC unroll 4")
            for (int r = 0; r < MR; r++)
                _Pragma("GCC unroll 2")
                for (int o = 0; o < NO; o++)
                    P[c][r][o] = _mm256_setzero_ps();
        _Pragma("GCC unroll 4")
        for (int p = 0; p < 4; p++)
            _Pragma("GCC unroll 2")
            for (int c = 0; c < CH; c++) {
                const int ch = c0 + c;
                __m256 w[2];
                _Pragma("GCC unroll 2")
                for (int o = 0; o < NO; o++)
                    w[o] = wd->W[o][ch][p];
                _Pragma("GCC unroll 4")
                for (int r = 0; r < MR; r++) {
                    __m256 xv = _mm256_loadu_ps(xw + r * k + (size_t)b * MB_QK + 32 * ch + 8 * p);
                    MB_KQ2_PIN(xv);
                    _Pragma("GCC unroll 2")
                    for (int o = 0; o < NO; o++)
                        P[c][r][o] = _mm256_fmadd_ps(xv, w[o], P[c][r][o]);
                }
            }
        _Pragma("GCC unroll 2")
        for (int c = 0; c < CH; c++) {
            const int ch = c0 + c, half = mb_kq2_half(q6, ch);
            _Pragma("GCC unroll 4")
            for (int r = 0; r < MR; r++)
                _Pragma("GCC unroll 2")
                for (int o = 0; o < NO; o++) {
                    MB_KQ2_PIN(P[c][r][o]);
                    A[r][o][half] = _mm256_add_ps(A[r][o][half], _mm256_mul_ps(wd->sv[o][ch], P[c][r][o]));
                }
        }
        __asm__ volatile("" ::: "memory"); /* these chunks' A adds done here */
    }
    _Pragma("GCC unroll 4")
    for (int r = 0; r < MR; r++)
        _Pragma("GCC unroll 2")
        for (int o = 0; o < NO; o++)
            for (int i = 0; i < (q6 ? 2 : 1); i++) {
                __m256 x8 = _mm256_loadu_ps(xs + r * ldxs + (size_t)b * (q6 ? 16 : 8) + 8 * i);
                N[r][o][i] = _mm256_add_ps(N[r][o][i], _mm256_mul_ps(wd->cf[o][i], x8));
            }
}

#define MB_KQ2_SWEEP_FN(MR, NO) \
    static __attribute__((noinline)) MB_KQ2_TARGET void mb_kq2_sweep_##MR##_##NO( \
        const struct mb_kq2_wide *wd, const int q6, const float *xw, int64_t k, const float *xs, int64_t ldxs, \
        int32_t b, __m256 A[][2][2], __m256 N[][2][2]) { \
        mb_kq2_sweep(wd, q6, xw, k, xs, ldxs, b, A, N, MR, NO); \
    }
MB_KQ2_SWEEP_FN(4, 2) MB_KQ2_SWEEP_FN(3, 2) MB_KQ2_SWEEP_FN(2, 2) MB_KQ2_SWEEP_FN(1, 2)
MB_KQ2_SWEEP_FN(4, 1) MB_KQ2_SWEEP_FN(3, 1) MB_KQ2_SWEEP_FN(2, 1) MB_KQ2_SWEEP_FN(1, 1)
#undef MB_KQ2_SWEEP_FN

MB_KQ2_INLINE void mb_kq2_many_rows(const struct mb_kq_job *j, const int32_t type, int32_t r0, int32_t rows,
                                    int32_t c0, int32_t c1) {
    const int q6 = type == MB_GGML_Q6_K;
    const int64_t bb = mb_kq_block_bytes(type);
    const __m256i word = _mm256_set1_epi32(0x43000000);
    __m256i pick[4];
    mb_kq2_picks(pick);
    const float *xw = j->xw + (size_t)r0 * j->a.k, *xs = j->xs + (size_t)r0 * j->ldxs;
    for (int32_t c = c0; c < c1; c += 2) {
        const int no = c1 - c < 2 ? 1 : 2;
        __m256 A[MB_KQ_ROWS][2][2], N[MB_KQ_ROWS][2][2];
        for (int32_t r = 0; r < rows; r++)
            for (int o = 0; o < 2; o++)
                for (int i = 0; i < 2; i++)
                    A[r][o][i] = N[r][o][i] = _mm256_setzero_ps();
        struct mb_kq2_wide wd __attribute__((aligned(32)));
        for (int32_t b = 0; b < j->blocks; b++) {
            for (int o = 0; o < no; o++) {
                const uint8_t *blk = j->a.w + (size_t)(c + o) * j->a.row_bytes + (size_t)b * bb;
                /* A block's lines, 1 KB (5-7 blocks) ahead in its row: a block's widening waits on its
                 * first load otherwise, since the sweeps between fill the reorder window */
                for (int l = 0; l < 256; l += 64)
                    _mm_prefetch((const char *)blk + 1024 + l, _MM_HINT_T0);
                __m256i u[8]; /* all made before the stores below, which GCC cannot tell from blk */
                for (int ch = 0; ch < 8; ch++)
                    u[ch] = mb_kq2_chunk_bytes(type, blk, ch);
                for (int ch = 0; ch < 8; ch++)
                    for (int p = 0; p < 4; p++)
                        wd.W[o][ch][p] = _mm256_castsi256_ps(_mm256_or_si256(_mm256_shuffle_epi8(u[ch], pick[p]), word));
                mb_kq2_scales(type, blk, wd.sv[o], wd.cf[o]);
            }
            for (int32_t r = 0; r < rows;) {
                const float *xr = xw + (size_t)r * j->a.k, *sr = xs + (size_t)r * j->ldxs;
                const int mr = rows - r >= MB_KQ2_MR ? MB_KQ2_MR : rows - r;
#define MB_KQ2_SWEEP(MR, NO) mb_kq2_sweep_##MR##_##NO(&wd, q6, xr, j->a.k, sr, j->ldxs, b, A + r, N + r)
                if (no == 2)
                    mr == 4   ? MB_KQ2_SWEEP(4, 2)
                    : mr == 3 ? MB_KQ2_SWEEP(3, 2)
                    : mr == 2 ? MB_KQ2_SWEEP(2, 2)
                              : MB_KQ2_SWEEP(1, 2);
                else
                    mr == 4   ? MB_KQ2_SWEEP(4, 1)
                    : mr == 3 ? MB_KQ2_SWEEP(3, 1)
                    : mr == 2 ? MB_KQ2_SWEEP(2, 1)
                              : MB_KQ2_SWEEP(1, 1);
                r += mr;
#undef MB_KQ2_SWEEP
            }
        }
        for (int32_t r = 0; r < rows; r++)
            for (int o = 0; o < no; o++) {
                float lanes[16], n[16];
                _mm256_storeu_ps(lanes, A[r][o][0]);
                _mm256_storeu_ps(lanes + 8, A[r][o][1]);
                _mm256_storeu_ps(n, N[r][o][0]);
                _mm256_storeu_ps(n + 8, N[r][o][1]);
                mb_y_store(&j->a, r0 + r, c + o, mb_sum16(lanes) - (q6 ? mb_sum16(n) : mb_sum8(n)));
            }
    }
}

static MB_KQ2_TARGET void mb_kq_run_avx2(const struct mb_kq_job *j, int32_t r0, int32_t rows, int32_t c0,
                                         int32_t c1) {
    if (rows == 1 && j->a.type == MB_GGML_Q4_K)
        mb_kq2_one_row(j, MB_GGML_Q4_K, r0, c0, c1);
    else if (rows == 1 && j->a.type == MB_GGML_Q5_K)
        mb_kq2_one_row(j, MB_GGML_Q5_K, r0, c0, c1);
    else if (rows == 1)
        mb_kq2_one_row(j, MB_GGML_Q6_K, r0, c0, c1);
    else if (j->a.type == MB_GGML_Q4_K)
        mb_kq2_many_rows(j, MB_GGML_Q4_K, r0, rows, c0, c1);
    else if (j->a.type == MB_GGML_Q5_K)
        mb_kq2_many_rows(j, MB_GGML_Q5_K, r0, rows, c0, c1);
    else
        mb_kq2_many_rows(j, MB_GGML_Q6_K, r0, rows, c0, c1);
}
#else
#define MB_KQ_HAVE_AVX2 0
#endif

/* Guided handout, as csrc/linear.c's mb_worker: runs of remaining / (2 * threads) items;
 * item i is tile i / groups, row group i % groups. */
static void mb_kq_worker(void *data) {
    struct mb_kq_job *j = (struct mb_kq_job *)data;
    for (;;) {
        int64_t first, take = mb_take_guided(&j->next, j->items, j->threads, &first);
        if (take == 0)
            return;
        for (int64_t i = first; i < first + take; i++) {
            int32_t g = (int32_t)(i % j->groups), t = (int32_t)(i / j->groups);
            int32_t r0 = g * MB_KQ_ROWS, c0 = t * MB_KQ_TILE;
            int32_t rows = j->a.m - r0 < MB_KQ_ROWS ? j->a.m - r0 : MB_KQ_ROWS;
            int32_t c1 = j->a.n - c0 < MB_KQ_TILE ? j->a.n : c0 + MB_KQ_TILE;
            j->run(j, r0, rows, c0, c1);
        }
    }
}

int mb_kq_linear(int32_t type, const uint8_t *w, int64_t row_bytes, int32_t n, int32_t k,
                 const uint16_t *x, int64_t ldx, int32_t m, const float *bias, void *y,
                 int32_t y_mode, int64_t ldy, int32_t kernel, void *parallel, int32_t threads) {
    int64_t bb = mb_kq_block_bytes(type);
    const struct mb_q_call a = {type, w, row_bytes, n, k, x, ldx, m, bias, y, y_mode, ldy};
    if (bb == 0 || !mb_q_call_ok(&a, MB_QK) || row_bytes < (int64_t)(k / MB_QK) * bb)
        return MB_EINVAL;
    struct mb_kq_job j;
    memset(&j, 0, sizeof j);
    j.a = a, j.blocks = k / MB_QK;
    int avx = 0;
    if (kernel == MB_KERNEL_PORTABLE)
        j.run = mb_kq_run_portable;
#if MB_KQ_HAVE_AVX512
    else if (kernel == MB_KERNEL_AVX512BF16 && mb_bf16_kernel() == MB_KERNEL_AVX512BF16)
        j.run = type == MB_GGML_Q4_K ? mb_kq_run_q4k : type == MB_GGML_Q5_K ? mb_kq_run_q5k : mb_kq_run_q6k, avx = 1;
#endif
#if MB_KQ_HAVE_AVX2
    else if (kernel == MB_KERNEL_AVX2 && mb_avx2_supported())
        j.run = mb_kq_run_avx2, avx = 2;
#endif
    else
        return MB_EINVAL;
    /* The per-call x work (the sums, the permuted copy): m * (k/16 floats + k words), made
     * here once for all outputs. The caller hands no scratch, so it is allocated per call:
     * a few KB to a few hundred KB against a call that reads megabytes of weights. */
    const int q6 = type == MB_GGML_Q6_K;
    j.ldxs = q6 ? k / 16 : k / 32;
    size_t xs_bytes = (size_t)m * j.ldxs * sizeof(float), xp_bytes = avx == 1 ? (size_t)m * k * 2 : avx == 2 ? (size_t)m * k * 4 : 0;
    void *scratch = malloc(xs_bytes + xp_bytes + 64);
    if (scratch == NULL)
        return MB_ESCRATCH;
    float *xs = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    uint16_t *xp = (uint16_t *)(xs + (size_t)m * j.ldxs);
    for (int32_t r = 0; r < m; r++) {
#if MB_KQ_HAVE_AVX2
        if (avx == 2)
            mb_kq2_prepare(x + (size_t)r * ldx, k, (float *)xp + (size_t)r * k);
#endif
#if MB_KQ_HAVE_AVX512
        if (avx == 1) {
            mb_kq_xsums_avx512(x + (size_t)r * ldx, k, q6, xs + (size_t)r * j.ldxs);
            mb_kq_permute_avx512(x + (size_t)r * ldx, k, q6, xp + (size_t)r * k);
            continue;
        }
#endif
        mb_kq_xsums(x + (size_t)r * ldx, k, q6, xs + (size_t)r * j.ldxs);
    }
    j.xs = xs, j.xp = avx == 1 ? xp : NULL, j.xw = avx == 2 ? (const float *)xp : NULL;
    j.tiles = (n + MB_KQ_TILE - 1) / MB_KQ_TILE;
    j.groups = (m + MB_KQ_ROWS - 1) / MB_KQ_ROWS;
    j.items = (int64_t)j.tiles * j.groups;
    mb_run_guided(mb_kq_worker, &j, &j.threads, j.items, parallel, threads);
    free(scratch);
    return MB_OK;
}
