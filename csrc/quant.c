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
 * The rule, per output (row r of x, output c): 4 float32 lanes acc[l] = 0, then for
 * every block b in order (x[i] the block's inputs, bfloat16 denormals read as zero), lane
 * l takes the block's pairs p = 4s + l, s = 0..3, as four vdpbf16ps steps from zero:
 *     t = 0;  t = (t + x[2p+1] * q[2p+1]) + x[2p] * q[2p]    (exact products, each add
 *                                                           rounded, denormal sums zero)
 *     acc[l] = fma(t, d, acc[l])                             (one rounding)
 *     formats with m: S = 0;  S = (S + x[2p+1]) + x[2p];  acc[l] = fma(S, m, acc[l])
 * then out = (acc[0] + acc[2]) + (acc[1] + acc[3]), bias added; y as mb_bf16_linear
 * writes it (y modes). mashbox/native_ref.py's q_linear states the same rule in numpy;
 * the portable and AVX512-BF16 kernels give the same bits. A row's result depends on its
 * own x row, w row, bias (and y) only: batch invariant.
 *
 * Why four lanes of four steps: one zmm holds four outputs' lanes, so a block costs four
 * vdpbf16ps and one fma per four outputs and row (the old 16 lanes of one step paid an
 * fma per vdpbf16ps: half the dense kernel's speed at prefill), and the x vector of a
 * step (8 inputs) is one 128-bit broadcast shared by all outputs. The four outputs'
 * blocks are widened side by side (mb_q_widen4); Q8_0's integers become bfloat16 through
 * byte lookups on CPUs with AVX512-VBMI, through int32 and float32 elsewhere
 * (MB_KERNEL_AVX512BF16_INT32 asks for that route here): the same words.
 *
 * Work: items of up to MB_Q_ROWS rows x MB_Q_OUTS outputs, handed out as mb_bf16_linear's
 * (guided runs). One row (a batch-1 decode step) widens each block in registers and uses
 * it at once (mb_q_one_row: the weights streamed once; each item prefetches the next
 * item's rows). Two or more rows (a batched step, prefill): the item widens its 16
 * outputs' blocks, MB_Q_KC at a time, into a per-call stack scratch (L1 sized) and sweeps
 * all its rows over it (mb_q_many_rows: MB_Q_MR rows a sweep, MB_Q_MR_M for formats
 * with m, the rows left over in one sweep of two where there are two and no m, else one
 * at a time), the accumulators parked between chunks in
 * float32 (exact): the same arithmetic, in the same order per output, so the bits do not
 * depend on the path.
 */
#include "mashbox.h"
#include "bf16.h"
#include "ggml_blocks.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MB_Q_BLOCK 32
#define MB_Q_OUTS 16  /* outputs per work item */
#define MB_Q_ROWS 256 /* rows per work item */
#define MB_Q_LANES 4  /* float32 lanes per output */
#define MB_Q_STEPS 4  /* vdpbf16ps steps per lane and block */
#ifndef MB_Q_MR
#define MB_Q_MR 3     /* rows per sweep (rows > 1): 12 accumulators + 12 block sums in registers */
#endif
#ifndef MB_Q_MR_M
#define MB_Q_MR_M 2   /* the same for formats with m (their x sums take registers too) */
#endif
#define MB_Q_MR_MAX 4
#define MB_Q_KC 8     /* blocks per widened chunk (rows > 1): 10-12 KB of scratch, in L1 */

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


static uint32_t mb_le32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* Block b's small integers q[32], d and m (0 without one). */
static void mb_q_block(int32_t type, const uint8_t *blk, int8_t *q, float *d, float *m) {
    *d = mb_half(blk);
    *m = 0.0f;
    const uint8_t *qs;
    uint32_t qh = 0;
    int off = 0, high = 0;
    switch (type) {
    case MB_GGML_Q8_0:
        memcpy(q, blk + 2, 32);
        return;
    case MB_GGML_Q4_0: qs = blk + 2, off = 8; break;
    case MB_GGML_Q4_1: *m = mb_half(blk + 2), qs = blk + 4; break;
    case MB_GGML_Q5_0: qh = mb_le32(blk + 2), qs = blk + 6, off = 16, high = 1; break;
    default: /* Q5_1 */ *m = mb_half(blk + 2), qh = mb_le32(blk + 4), qs = blk + 8, high = 1; break;
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

struct mb_q_job {
    struct mb_q_call a;
    struct mb_q_format fmt;
    int32_t groups, chunks; /* output groups of MB_Q_OUTS, row chunks of MB_Q_ROWS */
    int64_t items;
    int64_t next;
    int64_t threads;
    const float *xw; /* [m, ldxw] x widened for the AVX2 path (mb_q2_prepare), or NULL */
    int64_t ldxw;
    void (*run)(const struct mb_q_job *, int32_t r0, int32_t rows, int32_t c0, int32_t outs);
};

/* ---- portable path: the rule, one output at a time ---- */

static void mb_q_run_portable(const struct mb_q_job *j, int32_t r0, int32_t rows, int32_t c0, int32_t outs) {
    int32_t blocks = j->a.k / MB_Q_BLOCK;
    for (int32_t c = c0; c < c0 + outs; c++) {
        const uint8_t *wr = j->a.w + (size_t)c * j->a.row_bytes;
        for (int32_t r = r0; r < r0 + rows; r++) {
            const uint16_t *x = j->a.x + (size_t)r * j->a.ldx;
            float acc[MB_Q_LANES] = {0};
            for (int32_t b = 0; b < blocks; b++) {
                int8_t q[32];
                float d, m;
                mb_q_block(j->a.type, wr + (size_t)b * j->fmt.bytes, q, &d, &m);
                const uint16_t *xb = x + (size_t)b * MB_Q_BLOCK;
                for (int l = 0; l < MB_Q_LANES; l++) {
                    float t = 0.0f, s = 0.0f;
                    for (int st = 0; st < MB_Q_STEPS; st++) {
                        int p = MB_Q_LANES * st + l;
                        float x1 = mb_flush(mb_bf16_f32(xb[2 * p + 1])), x0 = mb_flush(mb_bf16_f32(xb[2 * p]));
                        t = mb_flush(mb_flush(t + x1 * (float)q[2 * p + 1]) + x0 * (float)q[2 * p]);
                        s = mb_flush(mb_flush(s + x1) + x0);
                    }
                    acc[l] = fmaf(t, d, acc[l]);
                    if (j->fmt.has_m)
                        acc[l] = fmaf(s, m, acc[l]);
                }
            }
            mb_y_store(&j->a, r, c, (acc[0] + acc[2]) + (acc[1] + acc[3]));
        }
    }
}

/* ---- AVX512-BF16 path ---- */

#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 10))
#define MB_Q_AVX512 1
#include <cpuid.h>
#include <immintrin.h>

#define MB_Q_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,f16c")))
#define MB_Q_INLINE static inline __attribute__((always_inline)) MB_Q_TARGET
#define MB_Q_TARGET_VBMI __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,f16c,avx512vbmi")))

/* Four outputs' Q8_0 block b (blk[o]) widened: w[s] holds, in 128-bit lane o, output o's
 * elements 8s .. 8s+7 as bfloat16 (exact). One of two routes, passed down to
 * mb_q_widen4 as a constant (inlined there; a direct call would have to share its caller's
 * target): mb_q_q8_int32 (any AVX512-BF16 CPU) or mb_q_q8_vbmi (AVX512-VBMI); the same
 * words. */
typedef void (*mb_q_q8_widen)(const uint8_t *const blk[4], __m512bh w[4]);

/* The int32 route's input: a 4 x 4 transpose of 8-byte pieces, p[s] the four
 * outputs' elements 8s .. 8s+7 side by side. */
MB_Q_INLINE void mb_q_q8_pieces(const uint8_t *const blk[4], __m256i p[4]) {
    __m256i a = _mm256_loadu_si256((const __m256i *)(blk[0] + 2)), b = _mm256_loadu_si256((const __m256i *)(blk[1] + 2));
    __m256i c = _mm256_loadu_si256((const __m256i *)(blk[2] + 2)), e = _mm256_loadu_si256((const __m256i *)(blk[3] + 2));
    __m256i ab_lo = _mm256_unpacklo_epi64(a, b), ab_hi = _mm256_unpackhi_epi64(a, b); /* [a0 b0 | a2 b2] */
    __m256i ce_lo = _mm256_unpacklo_epi64(c, e), ce_hi = _mm256_unpackhi_epi64(c, e);
    p[0] = _mm256_permute2x128_si256(ab_lo, ce_lo, 0x20); /* [a0 b0 c0 e0] */
    p[1] = _mm256_permute2x128_si256(ab_hi, ce_hi, 0x20);
    p[2] = _mm256_permute2x128_si256(ab_lo, ce_lo, 0x31);
    p[3] = _mm256_permute2x128_si256(ab_hi, ce_hi, 0x31);
}

/* through int32 and float32 (bf16.h's mb_i8_bf16): five instructions per 32 */
MB_Q_INLINE void mb_q_q8_int32(const uint8_t *const blk[4], __m512bh w[4]) {
    __m256i p[4];
    mb_q_q8_pieces(blk, p);
    for (int s = 0; s < 4; s++)
        w[s] = mb_i8_bf16(p[s]);
}

/* through byte lookups (AVX512-VBMI, bf16.h's mb_i8_bf16_bytes): the four outputs' first
 * (second) 16 integers side by side in one zmm, in order; unpacking the low and high bytes
 * gives steps 0, 1 (2, 3). Eight instructions per 64 integers for the int32 route's ten,
 * and two shuffles of four loads for its transpose's eight: the batch-1 Q8_0 step is
 * bound by this widening, not by memory. */
static inline __attribute__((always_inline)) MB_Q_TARGET_VBMI void mb_q_q8_vbmi(const uint8_t *const blk[4],
                                                                                __m512bh w[4]) {
    __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(blk[0] + 2))),
                                    _mm256_loadu_si256((const __m256i *)(blk[1] + 2)), 1);
    __m512i ce = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(blk[2] + 2))),
                                    _mm256_loadu_si256((const __m256i *)(blk[3] + 2)), 1);
    /* ab's 128-bit lanes: a 0-15, a 16-31, b 0-15, b 16-31 */
    const __m512i half[2] = {_mm512_shuffle_i64x2(ab, ce, 0x88), _mm512_shuffle_i64x2(ab, ce, 0xdd)};
    for (int h = 0; h < 2; h++) {
        __m512i lo, hi;
        mb_i8_bf16_bytes(half[h], &lo, &hi);
        w[2 * h] = (__m512bh)_mm512_unpacklo_epi8(lo, hi);
        w[2 * h + 1] = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
    }
}

static int mb_q_has_vbmi(void) {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (c >> 1 & 1u); /* CPUID.7.0:ECX.AVX512_VBMI */
}

/* bfloat16 of each nibble's integer, without (lo) and with (hi) the fifth bit: Q4_0 less
 * 8, Q5_0 less 16 (exact); indices 16..31 unused. */
struct mb_q_tables {
    __m512i lo, hi;
};

static uint16_t mb_q_bf16_int(int v) { return (uint16_t)(mb_f32_bits((float)v) >> 16); }

MB_Q_INLINE void mb_q_make_tables(const int32_t type, struct mb_q_tables *t) {
    uint16_t lo[32], hi[32];
    int off = type == MB_GGML_Q4_0 ? 8 : type == MB_GGML_Q5_0 ? 16 : 0;
    for (int i = 0; i < 32; i++) {
        lo[i] = mb_q_bf16_int((i & 15) - off);
        hi[i] = mb_q_bf16_int((i & 15) + 16 - off);
    }
    t->lo = _mm512_loadu_si512(lo);
    t->hi = _mm512_loadu_si512(hi);
}

/* Four outputs' block b (blk[o]): w[s] holds, in 128-bit lane o, output o's elements
 * 8s .. 8s+7 (lane l of the four: pair 4s + l); d (and m) each output's, four times.
 * Q8_0: the widening cv (mb_q_q8_int32, or mb_q_q8_vbmi where the CPU has VBMI). Nibbles:
 * the four outputs' 16 qs bytes side by side in one zmm; unpacking its low (high) nibbles
 * with zero bytes gives steps 0, 1 (2, 3) as 16-bit indices, and one vpermw each maps
 * them to bfloat16 (a second, masked by qh's bits, adds the fifth bit's 16). */
MB_Q_INLINE void mb_q_widen4(const int32_t type, const mb_q_q8_widen cv, const struct mb_q_tables *tb,
                             const uint8_t *const blk[4], __m512bh w[4], __m512 *d, __m512 *m) {
    if (type == MB_GGML_Q8_0) {
        cv(blk, w);
    } else {
        const int qs_at = type == MB_GGML_Q4_0 ? 2 : type == MB_GGML_Q4_1 ? 4 : type == MB_GGML_Q5_0 ? 6 : 8;
        __m512i z = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(blk[0] + qs_at)));
        z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(blk[1] + qs_at)), 1);
        z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(blk[2] + qs_at)), 2);
        z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(blk[3] + qs_at)), 3);
        const __m512i nib = _mm512_set1_epi8(15), zero = _mm512_setzero_si512();
        __m512i lo = _mm512_and_si512(z, nib), hi = _mm512_and_si512(_mm512_srli_epi16(z, 4), nib);
        __m512i idx[4] = {_mm512_unpacklo_epi8(lo, zero), _mm512_unpackhi_epi8(lo, zero),
                          _mm512_unpacklo_epi8(hi, zero), _mm512_unpackhi_epi8(hi, zero)};
        if (type == MB_GGML_Q5_0 || type == MB_GGML_Q5_1) {
            /* step s's mask: bit 8o + j is bit 8s + j of output o's qh (a 4 x 4 byte transpose) */
            const int qh_at = type == MB_GGML_Q5_0 ? 2 : 4;
            uint32_t qh[4];
            for (int o = 0; o < 4; o++)
                memcpy(&qh[o], blk[o] + qh_at, 4);
            __m128i t = _mm_shuffle_epi8(_mm_setr_epi32((int)qh[0], (int)qh[1], (int)qh[2], (int)qh[3]),
                                         _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
            uint32_t mk[4] = {(uint32_t)_mm_cvtsi128_si32(t), (uint32_t)_mm_extract_epi32(t, 1),
                              (uint32_t)_mm_extract_epi32(t, 2), (uint32_t)_mm_extract_epi32(t, 3)};
            for (int s = 0; s < 4; s++)
                w[s] = (__m512bh)_mm512_mask_permutexvar_epi16(_mm512_permutexvar_epi16(idx[s], tb->lo),
                                                               (__mmask32)mk[s], idx[s], tb->hi);
        } else {
            for (int s = 0; s < 4; s++)
                w[s] = (__m512bh)_mm512_permutexvar_epi16(idx[s], tb->lo);
        }
    }
    const __m512i four = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    if (type == MB_GGML_Q4_1 || type == MB_GGML_Q5_1) { /* d and m side by side: one conversion */
        int32_t dm[4];
        for (int o = 0; o < 4; o++)
            memcpy(&dm[o], blk[o], 4);
        /* from registers, not a store of four and a load (a store-forwarding stall) */
        __m512 f = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_setr_epi32(dm[0], dm[1], dm[2], dm[3])));
        *d = _mm512_permutexvar_ps(_mm512_add_epi32(four, four), f);
        *m = _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_add_epi32(four, four), _mm512_set1_epi32(1)), f);
    } else {
        uint16_t h[4];
        for (int o = 0; o < 4; o++)
            memcpy(&h[o], blk[o], 2);
        /* the four halves packed in a general register, then one move: element inserts
         * would queue on the shuffle port that the widening keeps busy (for d and m side by
         * side above, the same packing measured slower at 8 rows) */
        uint64_t hh = h[0] | (uint64_t)h[1] << 16 | (uint64_t)h[2] << 32 | (uint64_t)h[3] << 48;
        __m512 f = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi64_si128((long long)hh)));
        *d = _mm512_permutexvar_ps(four, f);
        *m = _mm512_setzero_ps();
    }
}

/* The four lanes of each of four outputs: (l0 + l2) + (l1 + l3), stored. */
MB_Q_INLINE void mb_q_store4(const struct mb_q_job *j, int32_t r, int32_t c, int32_t outs, __m512 acc) {
    float a[16];
    _mm512_storeu_ps(a, acc);
    for (int o = 0; o < 4 && o < outs; o++)
        mb_y_store(&j->a, r, c + o, (a[4 * o] + a[4 * o + 2]) + (a[4 * o + 1] + a[4 * o + 3]));
}

/* The item's outputs' row pointers by group of four; past the item's outputs, its last
 * row again (computed, never stored). */
MB_Q_INLINE void mb_q_rows(const struct mb_q_job *j, int32_t c0, int32_t outs, const uint8_t *wr[MB_Q_OUTS]) {
    for (int o = 0; o < MB_Q_OUTS; o++)
        wr[o] = j->a.w + (size_t)(c0 + (o < outs ? o : outs - 1)) * j->a.row_bytes;
}

/* One row, up to 16 outputs: each group's block is widened and used at once; the next
 * item's rows are prefetched as this one goes (the hardware prefetcher alone leaves the
 * widening and the misses one after the other). FULL (a constant): the item has all 16
 * outputs, so output o's block is the first's plus o row strides (addressing modes, no
 * table of 16 pointers to keep in registers); else the rows past outs repeat its last. */
MB_Q_INLINE void mb_q_one_row(const struct mb_q_job *j, const struct mb_q_tables *tb, int32_t r0, int32_t c0,
                              int32_t outs, const int32_t type, const mb_q_q8_widen cv, const int FULL) {
    const int has_m = type == MB_GGML_Q4_1 || type == MB_GGML_Q5_1;
    const int bytes = type == MB_GGML_Q8_0 ? 34 : type == MB_GGML_Q4_0 ? 18 : type == MB_GGML_Q4_1 ? 20
                      : type == MB_GGML_Q5_0 ? 22 : 24;
    if (FULL)
        outs = MB_Q_OUTS;
    const int32_t blocks = j->a.k / MB_Q_BLOCK, groups = (outs + 3) / 4;
    const int64_t rb = j->a.row_bytes;
    const uint8_t *wr[MB_Q_OUTS];
    mb_q_rows(j, c0, outs, wr);
    const int32_t ahead = c0 + 2 * MB_Q_OUTS <= j->a.n;
    const int64_t pf = (int64_t)MB_Q_OUTS * rb;
    const int every = 64 / bytes;
    const uint16_t *x = j->a.x + (size_t)r0 * j->a.ldx;
    const uint8_t *w0 = j->a.w + (size_t)c0 * rb;
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int32_t b = 0; b < blocks; b++) {
        const uint16_t *xb = x + (size_t)b * MB_Q_BLOCK;
        __m512bh xs[4];
        for (int s = 0; s < 4; s++)
            xs[s] = (__m512bh)_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(xb + 8 * s)));
        __m512 sx = _mm512_setzero_ps();
        if (has_m)
            for (int s = 0; s < 4; s++)
                sx = _mm512_dpbf16_ps(sx, xs[s], ones);
        const uint8_t *wb = w0 + (size_t)b * bytes;
        for (int g = 0; g < groups; g++) {
            const uint8_t *blk[4];
            for (int o = 0; o < 4; o++) {
                blk[o] = FULL ? wb + (4 * g + o) * rb : wr[4 * g + o] + (size_t)b * bytes;
                if (ahead && b % every == 0)
                    _mm_prefetch((const char *)(blk[o] + pf), _MM_HINT_T0);
            }
            __m512bh w[4];
            __m512 d, m;
            mb_q_widen4(type, cv, tb, blk, w, &d, &m);
            __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), xs[0], w[0]);
            t = _mm512_dpbf16_ps(t, xs[1], w[1]);
            t = _mm512_dpbf16_ps(t, xs[2], w[2]);
            t = _mm512_dpbf16_ps(t, xs[3], w[3]);
            acc[g] = _mm512_fmadd_ps(t, d, acc[g]);
            if (has_m)
                acc[g] = _mm512_fmadd_ps(sx, m, acc[g]);
        }
    }
    for (int g = 0; g < groups; g++)
        mb_q_store4(j, r0, c0 + 4 * g, outs - 4 * g, acc[g]);
}

/* The scratch of one chunk of MB_Q_KC blocks: per block, the 4 groups' 4 step vectors,
 * then d and m per group. */
struct mb_q_chunk {
    __m512bh w[MB_Q_KC][4][4];
    __m512 d[MB_Q_KC][4], m[MB_Q_KC][4];
};

/* MR rows of x against a widened chunk, all 16 outputs (4 groups); acc parked in park
 * (float32, exact) between chunks. */
MB_Q_INLINE void mb_q_sweep(const struct mb_q_chunk *sc, int32_t kb, const uint16_t *x, int64_t ldx,
                            __m512 *park, int first, const int has_m, const int MR) {
    __m512 acc[MB_Q_MR_MAX][4];
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);
    for (int r = 0; r < MR; r++)
        for (int g = 0; g < 4; g++)
            acc[r][g] = first ? _mm512_setzero_ps() : park[4 * r + g];
    for (int32_t b = 0; b < kb; b++) {
        __m512 t[MB_Q_MR_MAX][4], sx[MB_Q_MR_MAX];
        for (int r = 0; r < MR; r++) {
            sx[r] = _mm512_setzero_ps();
            for (int g = 0; g < 4; g++)
                t[r][g] = _mm512_setzero_ps();
        }
        for (int s = 0; s < 4; s++) {
            __m512bh xs[MB_Q_MR_MAX];
            for (int r = 0; r < MR; r++) {
                xs[r] = (__m512bh)_mm512_broadcast_i32x4(
                    _mm_loadu_si128((const __m128i *)(x + (size_t)r * ldx + (size_t)b * MB_Q_BLOCK + 8 * s)));
                if (has_m)
                    sx[r] = _mm512_dpbf16_ps(sx[r], xs[r], ones);
            }
            for (int g = 0; g < 4; g++) {
                __m512bh w = sc->w[b][g][s];
                for (int r = 0; r < MR; r++)
                    t[r][g] = _mm512_dpbf16_ps(t[r][g], xs[r], w);
            }
        }
        for (int g = 0; g < 4; g++) {
            __m512 d = sc->d[b][g];
            for (int r = 0; r < MR; r++)
                acc[r][g] = _mm512_fmadd_ps(t[r][g], d, acc[r][g]);
            if (has_m) {
                __m512 m = sc->m[b][g];
                for (int r = 0; r < MR; r++)
                    acc[r][g] = _mm512_fmadd_ps(sx[r], m, acc[r][g]);
            }
        }
    }
    for (int r = 0; r < MR; r++)
        for (int g = 0; g < 4; g++)
            park[4 * r + g] = acc[r][g];
}

/* Two or more rows: chunk by chunk of blocks, widen the item's 16 outputs once into the
 * scratch, then sweep every row over it (MR rows at a time). */
MB_Q_INLINE void mb_q_many_rows(const struct mb_q_job *j, const struct mb_q_tables *tb, int32_t r0, int32_t rows,
                                int32_t c0, int32_t outs, const int32_t type, const mb_q_q8_widen cv) {
    const int has_m = type == MB_GGML_Q4_1 || type == MB_GGML_Q5_1;
    const int bytes = type == MB_GGML_Q8_0 ? 34 : type == MB_GGML_Q4_0 ? 18 : type == MB_GGML_Q4_1 ? 20
                      : type == MB_GGML_Q5_0 ? 22 : 24;
    const int MR = has_m ? MB_Q_MR_M : MB_Q_MR;
    const int32_t blocks = j->a.k / MB_Q_BLOCK;
    const uint8_t *wr[MB_Q_OUTS];
    mb_q_rows(j, c0, outs, wr);
    struct mb_q_chunk sc __attribute__((aligned(64)));
    __m512 park[MB_Q_ROWS * 4] __attribute__((aligned(64)));
    for (int32_t b0 = 0; b0 < blocks; b0 += MB_Q_KC) {
        int32_t kb = blocks - b0 < MB_Q_KC ? blocks - b0 : MB_Q_KC;
        for (int32_t b = 0; b < kb; b++)
            for (int g = 0; g < 4; g++) {
                const uint8_t *blk[4];
                for (int o = 0; o < 4; o++)
                    blk[o] = wr[4 * g + o] + (size_t)(b0 + b) * bytes;
                mb_q_widen4(type, cv, tb, blk, sc.w[b][g], &sc.d[b][g], &sc.m[b][g]);
            }
        const uint16_t *x = j->a.x + (size_t)r0 * j->a.ldx + (size_t)b0 * MB_Q_BLOCK;
        int32_t r = 0;
        for (; r + MR <= rows; r += MR) {
            if (has_m)
                mb_q_sweep(&sc, kb, x + (size_t)r * j->a.ldx, j->a.ldx, park + 4 * r, b0 == 0, 1, MB_Q_MR_M);
            else
                mb_q_sweep(&sc, kb, x + (size_t)r * j->a.ldx, j->a.ldx, park + 4 * r, b0 == 0, 0, MB_Q_MR);
        }
        if (!has_m && rows - r == 2) /* two left: one sweep of two, the chunk read once more not twice */
            mb_q_sweep(&sc, kb, x + (size_t)r * j->a.ldx, j->a.ldx, park + 4 * r, b0 == 0, 0, 2), r += 2;
        for (; r < rows; r++)
            mb_q_sweep(&sc, kb, x + (size_t)r * j->a.ldx, j->a.ldx, park + 4 * r, b0 == 0, has_m, 1);
    }
    for (int32_t r = 0; r < rows; r++)
        for (int g = 0; g < 4 && 4 * g < outs; g++)
            mb_q_store4(j, r0 + r, c0 + 4 * g, outs - 4 * g, park[4 * r + g]);
}

/* A block type's kernel, its target (the widening's own, or wider) and Q8_0's widening */
#define MB_Q_RUN(NAME, T, TARGET, CV)                                                       \
    static TARGET void NAME(const struct mb_q_job *j, int32_t r0, int32_t rows, int32_t c0, \
                            int32_t outs) {                                                 \
        struct mb_q_tables tb;                                                              \
        mb_q_make_tables(T, &tb);                                                           \
        if (rows == 1 && outs == MB_Q_OUTS)                                                 \
            mb_q_one_row(j, &tb, r0, c0, outs, T, CV, 1);                                   \
        else if (rows == 1)                                                                 \
            mb_q_one_row(j, &tb, r0, c0, outs, T, CV, 0);                                   \
        else                                                                                \
            mb_q_many_rows(j, &tb, r0, rows, c0, outs, T, CV);                              \
    }

MB_Q_RUN(mb_q_run_q8_0, MB_GGML_Q8_0, MB_Q_TARGET, mb_q_q8_int32)
MB_Q_RUN(mb_q_run_q8_0_vbmi, MB_GGML_Q8_0, MB_Q_TARGET_VBMI, mb_q_q8_vbmi)
MB_Q_RUN(mb_q_run_q4_0, MB_GGML_Q4_0, MB_Q_TARGET, mb_q_q8_int32)
MB_Q_RUN(mb_q_run_q4_1, MB_GGML_Q4_1, MB_Q_TARGET, mb_q_q8_int32)
MB_Q_RUN(mb_q_run_q5_0, MB_GGML_Q5_0, MB_Q_TARGET, mb_q_q8_int32)
MB_Q_RUN(mb_q_run_q5_1, MB_GGML_Q5_1, MB_Q_TARGET, mb_q_q8_int32)

typedef void (*mb_q_run_fn)(const struct mb_q_job *, int32_t, int32_t, int32_t, int32_t);

/* Q8_0's kernel: the byte lookups where the CPU has VBMI, unless kernel asks for the
 * int32 route (the AVX512-BF16 CPUs without VBMI, Cooper Lake; the tests run both here) */
static mb_q_run_fn mb_q_run_q8_0_for(int32_t kernel) {
    return kernel == MB_KERNEL_AVX512BF16 && mb_q_vbmi_widening() == 1 ? mb_q_run_q8_0_vbmi : mb_q_run_q8_0;
}
#else
#define MB_Q_AVX512 0
#endif

/* ---- AVX2 path: the rule with vdpbf16ps emulated by fused multiply-adds ----
 *
 * One ymm holds two outputs' four lanes ([A l0..3 | B l0..3]). x goes in once per call,
 * widened to float32 in the caller's thread (denormals zero) and reordered per block and
 * step s to [x[8s+1], x[8s+3], x[8s+5], x[8s+7] | x[8s], x[8s+2], x[8s+4], x[8s+6]], the
 * odd and even elements of the step's four pairs, each half one 128-bit broadcast; for
 * formats with m the block's four lane sums S (the rule's chain, which depends on x alone)
 * follow the row. A block's integers become bytes (two outputs' 16 of a half-block side
 * by side in one ymm), then one pshufb per step and parity puts four of them, per output,
 * in the top byte of a dword (q * 2^24, exact) and vcvtdq2ps makes them float32; the
 * products with x are exact, so each fma is one of the rule's rounded adds, odd before
 * even. The per-block fma takes d * 2^-24 (exact), so t * d is the rule's product. The
 * same bits as the portable kernel where the rule's limits hold (the sums in float32's
 * normal range: t is held 2^24 larger, so where it would be denormal it is not flushed).
 * Two or more rows: mb_q2_many_rows, below. */
#if defined(__x86_64__) && (defined(__clang__) || defined(__GNUC__))
#define MB_Q_AVX2 1
#include <immintrin.h>

#define MB_Q2_TARGET __attribute__((target("avx2,fma,f16c")))
#define MB_Q2_INLINE static inline __attribute__((always_inline)) MB_Q2_TARGET

/* Row r's x work: k floats in the steps' order, then (formats with m) k / 8 lane sums. */
static int64_t mb_q2_ldxw(int32_t k, int has_m) { return (int64_t)k + (has_m ? k / 8 : 0); }

static void mb_q2_prepare(const uint16_t *x, int32_t k, int has_m, float *xw) {
    float *sums = xw + k;
    for (int32_t b = 0; b < k / MB_Q_BLOCK; b++) {
        const uint16_t *xb = x + (size_t)b * MB_Q_BLOCK;
        float *o = xw + (size_t)b * MB_Q_BLOCK;
        for (int st = 0; st < MB_Q_STEPS; st++)
            for (int l = 0; l < MB_Q_LANES; l++) {
                o[8 * st + l] = mb_flush(mb_bf16_f32(xb[8 * st + 2 * l + 1]));
                o[8 * st + 4 + l] = mb_flush(mb_bf16_f32(xb[8 * st + 2 * l]));
            }
        if (has_m)
            for (int l = 0; l < MB_Q_LANES; l++) {
                float sum = 0.0f;
                for (int st = 0; st < MB_Q_STEPS; st++)
                    sum = mb_flush(mb_flush(sum + o[8 * st + l]) + o[8 * st + 4 + l]);
                sums[4 * b + l] = sum;
            }
    }
}

/* Two outputs' block (a, b) as bytes: h[0] = [a q0..15 | b q0..15], h[1] the q16..31. */
MB_Q2_INLINE void mb_q2_bytes(int32_t type, const uint8_t *a, const uint8_t *b, __m256i h[2]) {
    if (type == MB_GGML_Q8_0) {
        h[0] = _mm256_loadu2_m128i((const __m128i *)(b + 2), (const __m128i *)(a + 2));
        h[1] = _mm256_loadu2_m128i((const __m128i *)(b + 18), (const __m128i *)(a + 18));
        return;
    }
    const int qs = type == MB_GGML_Q4_0 ? 2 : type == MB_GGML_Q4_1 ? 4 : type == MB_GGML_Q5_0 ? 6 : 8;
    const __m256i low = _mm256_set1_epi8(15);
    __m256i v = _mm256_loadu2_m128i((const __m128i *)(b + qs), (const __m128i *)(a + qs));
    h[0] = _mm256_and_si256(v, low);
    h[1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    if (type == MB_GGML_Q5_0 || type == MB_GGML_Q5_1) { /* element e's fifth bit: bit e of qh */
        int qh = type == MB_GGML_Q5_0 ? 2 : 4;
        uint32_t ha, hb;
        memcpy(&ha, a + qh, 4), memcpy(&hb, b + qh, 4);
        __m256i bits = _mm256_setr_epi32((int)ha, 0, 0, 0, (int)hb, 0, 0, 0);
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull), five = _mm256_set1_epi8(16);
        for (int i = 0; i < 2; i++) { /* byte j of h[i] takes qh byte 2i + j / 8 */
            __m256i spread = _mm256_shuffle_epi8(bits, _mm256_setr_epi64x(
                0x0101010101010101ll * (2 * i), 0x0101010101010101ll * (2 * i + 1),
                0x0101010101010101ll * (2 * i), 0x0101010101010101ll * (2 * i + 1)));
            __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
            h[i] = _mm256_or_si256(h[i], _mm256_and_si256(set, five));
        }
    }
    if (type == MB_GGML_Q4_0 || type == MB_GGML_Q5_0) {
        const __m256i off = _mm256_set1_epi8(type == MB_GGML_Q4_0 ? 8 : 16);
        h[0] = _mm256_sub_epi8(h[0], off);
        h[1] = _mm256_sub_epi8(h[1], off);
    }
}

/* NP pairs of outputs (a[i], b[i]; b[i] may be a[i] again) of one row, blocks in order:
 * each pair's lane sums [A l0..3 | B l0..3] into out[i]. The pairs run side by side
 * because each one's t is a chain of eight dependent fmas a block (NP = 4 hides their
 * latency); type, has_m and NP are constants in each instantiation. */
/* The pshufb masks that take step s's four odd (even) integers of each output, as bytes in
 * mb_q2_bytes' half h[s / 2], into the top bytes of four dwords: odd[s % 2], even[s % 2]
 * (dword i: element 8s + 2i + 1, or 8s + 2i). */
struct mb_q2_masks {
    __m256i odd[2], even[2];
};

MB_Q2_INLINE struct mb_q2_masks mb_q2_make_masks(void) {
    const __m256i odd0 = _mm256_set1_epi64x((long long)0x0380808001808080ull),
                  odd0h = _mm256_set1_epi64x((long long)0x0780808005808080ull);
    struct mb_q2_masks mk;
    mk.odd[0] = _mm256_unpacklo_epi64(odd0, odd0h);
    mk.odd[1] = _mm256_add_epi8(mk.odd[0], _mm256_set1_epi32(0x08000000));
    mk.even[0] = _mm256_sub_epi8(mk.odd[0], _mm256_set1_epi32(0x01000000));
    mk.even[1] = _mm256_sub_epi8(mk.odd[1], _mm256_set1_epi32(0x01000000));
    return mk;
}

/* Two outputs' block (a, b) d * 2^-24 as [dA x4 | dB x4] and (formats with m) m likewise. */
MB_Q2_INLINE void mb_q2_dm(const uint8_t *pa, const uint8_t *pb, __m256 *d, __m256 *m) {
    uint16_t ha[2], hb[2];
    memcpy(ha, pa, 4), memcpy(hb, pb, 4);
    __m128 dm = _mm_cvtph_ps(_mm_setr_epi16((short)ha[0], (short)hb[0], (short)ha[1], (short)hb[1], 0, 0, 0, 0));
    __m256 dm8 = _mm256_castps128_ps256(dm);
    *d = _mm256_mul_ps(_mm256_permutevar8x32_ps(dm8, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)), _mm256_set1_ps(0x1p-24f));
    *m = _mm256_permutevar8x32_ps(dm8, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3));
}

/* The NP pairs' block blk d * 2^-24 (and m) as mb_q2_dm makes them, into dv[i] (mv[i]):
 * the eight float16 in one vector, one convert, one permute a pair. The one-row loop makes
 * them a block ahead into a two-block ring: made per pair where used, their scalar inserts
 * and converts sat on the loop's path (the top of its profile on Zen 3). */
MB_Q2_INLINE void mb_q2_stage_dm(const int has_m, const int NP, const uint8_t *const a[4], const uint8_t *const b[4],
                                 int32_t bytes, int32_t blk, __m256 *dv, __m256 *mv) {
    for (int f = 0; f < (has_m ? 2 : 1); f++) {
        uint16_t h[8] = {0};
        for (int i = 0; i < NP; i++) {
            memcpy(&h[2 * i], a[i] + (size_t)blk * bytes + 2 * f, 2);
            memcpy(&h[2 * i + 1], b[i] + (size_t)blk * bytes + 2 * f, 2);
        }
        __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
        if (f == 0)
            v = _mm256_mul_ps(v, _mm256_set1_ps(0x1p-24f));
        for (int i = 0; i < NP; i++)
            (f ? mv : dv)[i] = _mm256_permutevar8x32_ps(
                v, _mm256_setr_epi32(2 * i, 2 * i, 2 * i, 2 * i, 2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1));
    }
}

MB_Q2_INLINE void mb_q2_pairs(const int32_t type, const int has_m, const int NP, const uint8_t *const a[4],
                              const uint8_t *const b[4], int32_t bytes, int32_t blocks, const float *xw,
                              const float *sums, __m256 out[4]) {
    const struct mb_q2_masks mk = mb_q2_make_masks();
    __m256 acc[4], ring[2][2][4] __attribute__((aligned(32)));
    for (int i = 0; i < NP; i++)
        acc[i] = _mm256_setzero_ps();
    mb_q2_stage_dm(has_m, NP, a, b, bytes, 0, ring[0][0], ring[0][1]);
    for (int32_t blk = 0; blk < blocks; blk++) {
        if (blk + 1 < blocks)
            mb_q2_stage_dm(has_m, NP, a, b, bytes, blk + 1, ring[(blk + 1) & 1][0], ring[(blk + 1) & 1][1]);
        const float *xs = xw + (size_t)blk * MB_Q_BLOCK;
        __m256i h[4][2];
        __m256 t[4];
        for (int i = 0; i < NP; i++) {
            mb_q2_bytes(type, a[i] + (size_t)blk * bytes, b[i] + (size_t)blk * bytes, h[i]);
            t[i] = _mm256_setzero_ps();
        }
        for (int st = 0; st < MB_Q_STEPS; st++) {
            __m256 xo = _mm256_broadcast_ps((const __m128 *)(xs + 8 * st));
            __m256 xe = _mm256_broadcast_ps((const __m128 *)(xs + 8 * st + 4));
            for (int i = 0; i < NP; i++)
                t[i] = _mm256_fmadd_ps(xo, _mm256_cvtepi32_ps(_mm256_shuffle_epi8(h[i][st / 2], mk.odd[st % 2])), t[i]);
            for (int i = 0; i < NP; i++)
                t[i] = _mm256_fmadd_ps(xe, _mm256_cvtepi32_ps(_mm256_shuffle_epi8(h[i][st / 2], mk.even[st % 2])), t[i]);
        }
        const __m256 *dv = ring[blk & 1][0], *mv = ring[blk & 1][1];
        for (int i = 0; i < NP; i++) {
            acc[i] = _mm256_fmadd_ps(t[i], dv[i], acc[i]);
            if (has_m)
                acc[i] = _mm256_fmadd_ps(_mm256_broadcast_ps((const __m128 *)(sums + 4 * blk)), mv[i], acc[i]);
        }
    }
    for (int i = 0; i < NP; i++)
        out[i] = acc[i];
}

/* ---- two or more rows: each block widened once per item, all rows swept over it ----
 *
 * The item's 16 outputs, as 8 pairs, widened MB_Q_KC blocks at a time into sc (float32
 * q * 2^24, per block, pair, step and parity: what mb_q2_pairs feeds its fmas; 20 KB, in
 * L1), then MR2 rows x NP2 pairs a sweep: per step and parity NP2 weight loads and MR2 x
 * broadcasts feed MR2 * NP2 independent fma chains (8: the fma latency hidden, 0.75 loads
 * an fma). Each block's t goes into the accumulators parked in float32 (exact) per row and
 * pair: the same adds in the same order as the one-row loop, so the same bits. */
#define MB_Q2_PAIRS (MB_Q_OUTS / 2)
#define MB_Q2_MR 2
#define MB_Q2_NP 4

struct mb_q2_chunk {
    __m256 w[MB_Q_KC][MB_Q2_PAIRS][2 * MB_Q_STEPS]; /* [step * 2 + (0 odd, 1 even)] */
    __m256 d[MB_Q_KC][MB_Q2_PAIRS];                 /* d * 2^-24, [A x4 | B x4] */
    __m256 m[MB_Q_KC][MB_Q2_PAIRS];
};

/* MR rows' (xw rows ldxw apart, b0 the chunk's first block) sweep over pairs p0 .. p0+NP-1
 * of sc's kb blocks; park[r * MB_Q2_PAIRS + p] their accumulators (zero where first). */
MB_Q2_INLINE void mb_q2_sweep(const struct mb_q2_chunk *sc, int32_t kb, int32_t b0, const float *xw, int64_t ldxw,
                              int32_t k, __m256 *park, int first, const int has_m, const int MR, const int NP,
                              int p0) {
    for (int32_t blk = 0; blk < kb; blk++) {
        __m256 t[MB_Q2_MR][MB_Q2_NP];
        for (int r = 0; r < MR; r++)
            for (int i = 0; i < NP; i++)
                t[r][i] = _mm256_setzero_ps();
        for (int sp = 0; sp < 2 * MB_Q_STEPS; sp++) { /* step sp / 2, odd then even */
            __m256 w[MB_Q2_NP];
            for (int i = 0; i < NP; i++)
                w[i] = _mm256_load_ps((const float *)&sc->w[blk][p0 + i][sp]);
            for (int r = 0; r < MR; r++) {
                __m256 xv = _mm256_broadcast_ps((const __m128 *)(xw + r * ldxw + (size_t)(b0 + blk) * MB_Q_BLOCK + 4 * sp));
                for (int i = 0; i < NP; i++)
                    t[r][i] = _mm256_fmadd_ps(xv, w[i], t[r][i]);
            }
        }
        for (int r = 0; r < MR; r++) {
            __m256 s = has_m ? _mm256_broadcast_ps((const __m128 *)(xw + r * ldxw + k + 4 * (size_t)(b0 + blk)))
                             : _mm256_setzero_ps();
            for (int i = 0; i < NP; i++) {
                __m256 *pa = &park[r * MB_Q2_PAIRS + p0 + i];
                __m256 acc = first && blk == 0 ? _mm256_setzero_ps() : *pa;
                acc = _mm256_fmadd_ps(t[r][i], sc->d[blk][p0 + i], acc);
                if (has_m)
                    acc = _mm256_fmadd_ps(s, sc->m[blk][p0 + i], acc);
                *pa = acc;
            }
        }
    }
}

/* The sweeps over one chunk: rows MR2 at a time (one left over alone), pairs NP2 at a
 * time (the rest in one sweep). */
MB_Q2_INLINE void mb_q2_sweeps(const struct mb_q2_chunk *sc, int32_t kb, int32_t b0, const float *xw, int64_t ldxw,
                               int32_t k, __m256 *park, int first, const int has_m, int32_t rows, int pairs) {
    for (int32_t r = 0; r < rows; r += MB_Q2_MR) {
        const int mr = rows - r < MB_Q2_MR ? 1 : MB_Q2_MR;
        const float *xr = xw + (size_t)r * ldxw;
        __m256 *pk = park + (size_t)r * MB_Q2_PAIRS;
        for (int p = 0; p < pairs; p += MB_Q2_NP) {
            int np = pairs - p < MB_Q2_NP ? pairs - p : MB_Q2_NP;
#define MB_Q2_SWEEP(MR, NP) mb_q2_sweep(sc, kb, b0, xr, ldxw, k, pk, first, has_m, MR, NP, p)
            if (mr == 2)
                switch (np) {
                case 4: MB_Q2_SWEEP(2, 4); break;
                case 3: MB_Q2_SWEEP(2, 3); break;
                case 2: MB_Q2_SWEEP(2, 2); break;
                default: MB_Q2_SWEEP(2, 1); break;
                }
            else
                switch (np) {
                case 4: MB_Q2_SWEEP(1, 4); break;
                case 3: MB_Q2_SWEEP(1, 3); break;
                case 2: MB_Q2_SWEEP(1, 2); break;
                default: MB_Q2_SWEEP(1, 1); break;
                }
#undef MB_Q2_SWEEP
        }
    }
}

MB_Q2_INLINE void mb_q2_many_rows(const struct mb_q_job *j, const int32_t type, const int has_m, int32_t r0,
                                  int32_t rows, int32_t c0, int32_t outs) {
    const int32_t bytes = j->fmt.bytes, blocks = j->a.k / MB_Q_BLOCK;
    const int pairs = (outs + 1) / 2;
    const struct mb_q2_masks mk = mb_q2_make_masks();
    const uint8_t *a[MB_Q2_PAIRS], *b[MB_Q2_PAIRS];
    for (int i = 0; i < pairs; i++) {
        a[i] = j->a.w + (size_t)(c0 + 2 * i) * j->a.row_bytes;
        b[i] = 2 * i + 1 < outs ? a[i] + j->a.row_bytes : a[i];
    }
    struct mb_q2_chunk sc __attribute__((aligned(32)));
    __m256 park[MB_Q_ROWS * MB_Q2_PAIRS] __attribute__((aligned(32)));
    const float *xw = j->xw + (size_t)r0 * j->ldxw;
    for (int32_t b0 = 0; b0 < blocks; b0 += MB_Q_KC) {
        int32_t kb = blocks - b0 < MB_Q_KC ? blocks - b0 : MB_Q_KC;
        for (int32_t blk = 0; blk < kb; blk++)
            for (int i = 0; i < pairs; i++) {
                const uint8_t *pa = a[i] + (size_t)(b0 + blk) * bytes, *pb = b[i] + (size_t)(b0 + blk) * bytes;
                __m256i h[2];
                mb_q2_bytes(type, pa, pb, h);
                for (int st = 0; st < MB_Q_STEPS; st++) {
                    sc.w[blk][i][2 * st] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(h[st / 2], mk.odd[st % 2]));
                    sc.w[blk][i][2 * st + 1] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(h[st / 2], mk.even[st % 2]));
                }
                mb_q2_dm(pa, pb, &sc.d[blk][i], &sc.m[blk][i]);
            }
        mb_q2_sweeps(&sc, kb, b0, xw, j->ldxw, j->a.k, park, b0 == 0, has_m, rows, pairs);
    }
    for (int32_t r = 0; r < rows; r++)
        for (int i = 0; i < pairs; i++) {
            float lanes[8];
            _mm256_storeu_ps(lanes, park[r * MB_Q2_PAIRS + i]);
            mb_y_store(&j->a, r0 + r, c0 + 2 * i, (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]));
            if (2 * i + 1 < outs)
                mb_y_store(&j->a, r0 + r, c0 + 2 * i + 1, (lanes[4] + lanes[6]) + (lanes[5] + lanes[7]));
        }
}

/* One row, outputs in runs of up to 8 (4 pairs). */
MB_Q2_INLINE void mb_q2_item(const struct mb_q_job *j, const int32_t type, const int has_m, int32_t r0,
                             int32_t rows, int32_t c0, int32_t outs) {
    const int32_t bytes = j->fmt.bytes, blocks = j->a.k / MB_Q_BLOCK;
    for (int32_t r = r0; r < r0 + rows; r++) {
        const float *xw = j->xw + (size_t)r * j->ldxw;
        for (int32_t c = c0; c < c0 + outs; c += 8) {
            int32_t left = c0 + outs - c < 8 ? c0 + outs - c : 8, np = (left + 1) / 2;
            const uint8_t *a[4], *b[4];
            for (int i = 0; i < np; i++) {
                a[i] = j->a.w + (size_t)(c + 2 * i) * j->a.row_bytes;
                b[i] = 2 * i + 1 < left ? a[i] + j->a.row_bytes : a[i];
            }
            __m256 sums[4];
            const float *xm = xw + j->a.k;
            switch (np) {
            case 4: mb_q2_pairs(type, has_m, 4, a, b, bytes, blocks, xw, xm, sums); break;
            case 3: mb_q2_pairs(type, has_m, 3, a, b, bytes, blocks, xw, xm, sums); break;
            case 2: mb_q2_pairs(type, has_m, 2, a, b, bytes, blocks, xw, xm, sums); break;
            default: mb_q2_pairs(type, has_m, 1, a, b, bytes, blocks, xw, xm, sums); break;
            }
            for (int i = 0; i < np; i++) {
                float lanes[8];
                _mm256_storeu_ps(lanes, sums[i]);
                mb_y_store(&j->a, r, c + 2 * i, (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]));
                if (2 * i + 1 < left)
                    mb_y_store(&j->a, r, c + 2 * i + 1, (lanes[4] + lanes[6]) + (lanes[5] + lanes[7]));
            }
        }
    }
}

#define MB_Q2_RUN(name, TYPE, HAS_M)                                                                     \
    static MB_Q2_TARGET void name(const struct mb_q_job *j, int32_t r0, int32_t rows, int32_t c0,        \
                                  int32_t outs) {                                                        \
        if (rows > 1)                                                                                    \
            mb_q2_many_rows(j, TYPE, HAS_M, r0, rows, c0, outs);                                         \
        else                                                                                             \
            mb_q2_item(j, TYPE, HAS_M, r0, rows, c0, outs);                                              \
    }
MB_Q2_RUN(mb_q_run_avx2_q8_0, MB_GGML_Q8_0, 0)
MB_Q2_RUN(mb_q_run_avx2_q4_0, MB_GGML_Q4_0, 0)
MB_Q2_RUN(mb_q_run_avx2_q4_1, MB_GGML_Q4_1, 1)
MB_Q2_RUN(mb_q_run_avx2_q5_0, MB_GGML_Q5_0, 0)
MB_Q2_RUN(mb_q_run_avx2_q5_1, MB_GGML_Q5_1, 1)
#else
#define MB_Q_AVX2 0
#endif

int mb_q_vbmi_widening(void) {
#if MB_Q_AVX512
    static int vbmi = -1; /* CPUID, read once (a benign race: every thread reads the same) */
    if (vbmi < 0)
        vbmi = mb_bf16_kernel() == MB_KERNEL_AVX512BF16 && mb_q_has_vbmi();
    return vbmi;
#else
    return -1;
#endif
}

static void mb_q_worker(void *data) {
    struct mb_q_job *j = (struct mb_q_job *)data;
    for (;;) {
        int64_t first, take = mb_take_guided(&j->next, j->items, j->threads, &first);
        if (take == 0)
            return;
        for (int64_t i = first; i < first + take; i++) {
            int32_t ch = (int32_t)(i / j->groups), g = (int32_t)(i % j->groups);
            int32_t r0 = ch * MB_Q_ROWS, c0 = g * MB_Q_OUTS;
            int32_t rows = j->a.m - r0 < MB_Q_ROWS ? j->a.m - r0 : MB_Q_ROWS;
            int32_t outs = j->a.n - c0 < MB_Q_OUTS ? j->a.n - c0 : MB_Q_OUTS;
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
    j.a = (struct mb_q_call){type, w, row_bytes, n, k, x, ldx, m, bias, y, y_mode, ldy};
    if (!mb_q_format(type, &j.fmt) || !mb_q_call_ok(&j.a, MB_Q_BLOCK) || row_bytes != mb_q_row_bytes(type, k))
        return MB_EINVAL;
    if (kernel == MB_KERNEL_PORTABLE)
        j.run = mb_q_run_portable;
#if MB_Q_AVX512
    else if ((kernel == MB_KERNEL_AVX512BF16 || kernel == MB_KERNEL_AVX512BF16_INT32) &&
             mb_bf16_kernel() == MB_KERNEL_AVX512BF16)
        j.run = type == MB_GGML_Q8_0 ? mb_q_run_q8_0_for(kernel) : type == MB_GGML_Q4_0 ? mb_q_run_q4_0
                : type == MB_GGML_Q4_1 ? mb_q_run_q4_1 : type == MB_GGML_Q5_0 ? mb_q_run_q5_0 : mb_q_run_q5_1;
#endif
#if MB_Q_AVX2
    else if (kernel == MB_KERNEL_AVX2 && mb_avx2_supported())
        j.run = type == MB_GGML_Q8_0 ? mb_q_run_avx2_q8_0 : type == MB_GGML_Q4_0 ? mb_q_run_avx2_q4_0
                : type == MB_GGML_Q4_1 ? mb_q_run_avx2_q4_1 : type == MB_GGML_Q5_0 ? mb_q_run_avx2_q5_0
                : mb_q_run_avx2_q5_1;
#endif
    else
        return MB_EINVAL;
    j.groups = (n + MB_Q_OUTS - 1) / MB_Q_OUTS;
    j.chunks = (m + MB_Q_ROWS - 1) / MB_Q_ROWS;
    j.items = (int64_t)j.groups * j.chunks;
    void *scratch = NULL;
#if MB_Q_AVX2
    if (kernel == MB_KERNEL_AVX2) {
        /* x widened once per call for all outputs: m * (k + k/8) floats, allocated per call
         * as csrc/kquant.c's x work is (the caller hands no scratch) */
        j.ldxw = mb_q2_ldxw(k, j.fmt.has_m);
        scratch = malloc((size_t)m * j.ldxw * sizeof(float) + 32);
        if (scratch == NULL)
            return MB_ESCRATCH;
        float *xw = (float *)(((uintptr_t)scratch + 31) & ~(uintptr_t)31);
        for (int32_t r = 0; r < m; r++)
            mb_q2_prepare(x + (size_t)r * ldx, k, j.fmt.has_m, xw + (size_t)r * j.ldxw);
        j.xw = xw;
    }
#endif
    mb_run_guided(mb_q_worker, &j, &j.threads, j.items, parallel, threads);
    free(scratch);
    return MB_OK;
}
