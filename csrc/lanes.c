/* Prompt rows of the GGUF linears on vdpbf16ps lanes: y[r, c] = x[r, :k] . dequant(w row
 * c) (+ bias[c]), for the rows of a prefill chunk, on every block type csrc/quant.c and
 * csrc/kquant.c read, on a CPU with AVX512-BF16 but no AMX tiles (csrc/amx.c's place),
 * and on one with AVX2 and FMA only (the AVX2 path below: the same rule and bits).
 *
 * Why it exists: at prefill the decode rows' kernels (quant.c, kquant.c) widen every
 * block to bfloat16 for each few rows and spend most of their time widening; the products
 * are cheap. Here each output's blocks are widened once per MB_LANES_ROWS rows and the
 * outputs lie in the vector lanes, so one vdpbf16ps (with x's pair broadcast from
 * memory) does 16 outputs' multiply-adds of one pair and the widened weights are reused
 * by 8 rows per load.
 *
 * The rule, per output (row r of x, output c), "the lanes rule" (mashbox/native_ref.py's
 * q_linear_lanes states it in numpy). The weight row is cut into sub-blocks s of L
 * elements (L = 32; Q6_K: 16), each w = scale_s * q + min_s with q a small integer, exact
 * in bfloat16, as the tile rule's (csrc/widen.h's widening makes both):
 * acc = 0; for each sub-block in order:
 *     P = dp(x_s, q_s);  acc = fma(P, scale_s, acc)
 *     with a min: S = dp(x_s, 1);  acc = fma(S, min_s, acc)
 * then acc + bias, y as mb_bf16_linear writes it. dp(a, b) is one vdpbf16ps chain from
 * +0: for the pairs p in order, P = (P + a[2p + 1] b[2p + 1]) + a[2p] b[2p] (exact
 * products, each add rounded to nearest even, bfloat16 denormals read as zero and float32
 * denormal sums flushed to zero: the instruction's own order, which the decode kernels'
 * parity tests pin on this hardware). A row's bits depend on its own x row, weight row,
 * bias and y: never on m, the other rows or the threads. The bits differ from the decode
 * kernels' (another order of the same exact products), which is why the decoder sends a
 * row kind to one rule only (mashbox/model/linear.py).
 *
 * How: x is first packed in pair-major blocks of 8 rows (dword [block][pair][8 rows]: a
 * pair step's 8 broadcasts share one 32-byte run; rows straight from x lie k * 2 bytes
 * apart, one L1 set when k is a multiple of 2048), padding rows zero; the S sums of x
 * (formats with a min) are made once per call from it, by the same instruction on 8
 * rows' lanes. A work item is 32 outputs x up to MB_LANES_ROWS rows. Per chunk of
 * MB_WIDE_CHUNK elements its 32 outputs are widened and transposed to [pair][16
 * outputs] (two 8 KB tiles, in L1; Q8_0 where the CPU has VBMI transposed as bytes first,
 * then widened by byte lookups straight into the tiles: mb_lanes_q8_vbmi), the next
 * chunk's blocks prefetched; then per block of 8 rows and sub-block, 16 accumulators (8
 * rows x 2 vectors of 16 outputs) run the sub-block's pairs and are folded into float32
 * accumulators parked [rows][32] with the outputs' scale and min vectors. Threads: the
 * caller's OpenMP pool, guided handout.
 */
#include "mashbox.h"
#include "bf16.h"
#include "ggml_blocks.h"
#include "widen.h"

#include <stdlib.h>
#include <string.h>

#define MB_LANES_R 8       /* rows per register block: 8 rows x 2 output vectors = 16 zmm accumulators */
#define MB_LANES_ROWS 512  /* rows per work item (64 KB of parked accumulators): each output's blocks
                            * widened once for a 512-token prefill chunk */

#if MB_WIDE

int mb_lanes_supported(void) { return mb_bf16_kernel() == MB_KERNEL_AVX512BF16 || mb_avx2_supported(); }

struct mb_lanes_job {
    struct mb_q_call a;
    struct mb_wide_format fmt;
    const uint32_t *xp; /* x packed: dword [m / 8 blocks][k / 2 pairs][8 rows] (AVX-512 path) */
    const float *xf;    /* x as float32 [m / 8 blocks][k][8 rows], denormals zero (AVX2 path) */
    const float *sx;    /* formats with a min: [m / 8 blocks][k / 32][8 rows] S sums, else NULL */
    int32_t groups, chunks;
    int64_t items, next, threads;
    void (*run)(const struct mb_lanes_job *, int32_t, int32_t, int32_t, int32_t); /* the type's instance */
};

/* One sub-block of 8 rows x 32 outputs: xb the rows' pairs [half][8], B0 / B1 the two
 * output vectors' weight pairs [half][16]; park [8 rows][32] += the products times scale,
 * then the min term (sx: the 8 rows' S sums) */
MB_WIDE_INLINE void mb_lanes_block(const uint32_t *xb, const uint32_t *B0, const uint32_t *B1, const int half,
                                   float *park, const float *scale, const float *mins, const float *sx,
                                   const int has_min) {
    __m512 p0[MB_LANES_R], p1[MB_LANES_R];
#pragma GCC unroll 8
    for (int r = 0; r < MB_LANES_R; r++)
        p0[r] = _mm512_setzero_ps(), p1[r] = _mm512_setzero_ps();
    for (int q = 0; q < half; q++) {
        const __m512bh b0 = (__m512bh)_mm512_load_si512(B0 + 16 * q), b1 = (__m512bh)_mm512_load_si512(B1 + 16 * q);
#pragma GCC unroll 8
        for (int r = 0; r < MB_LANES_R; r++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xb[MB_LANES_R * q + r]);
            p0[r] = _mm512_dpbf16_ps(p0[r], xv, b0);
            p1[r] = _mm512_dpbf16_ps(p1[r], xv, b1);
        }
    }
    const __m512 s0 = _mm512_load_ps(scale), s1 = _mm512_load_ps(scale + 16);
    const __m512 m0 = has_min ? _mm512_load_ps(mins) : _mm512_setzero_ps();
    const __m512 m1 = has_min ? _mm512_load_ps(mins + 16) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < MB_LANES_R; r++) {
        float *pk = park + MB_WIDE_OUTS * r;
        __m512 a0 = _mm512_fmadd_ps(p0[r], s0, _mm512_load_ps(pk));
        __m512 a1 = _mm512_fmadd_ps(p1[r], s1, _mm512_load_ps(pk + 16));
        if (has_min) {
            const __m512 sv = _mm512_set1_ps(sx[r]);
            a0 = _mm512_fmadd_ps(sv, m0, a0);
            a1 = _mm512_fmadd_ps(sv, m1, a1);
        }
        _mm512_store_ps(pk, a0);
        _mm512_store_ps(pk + 16, a1);
    }
}

/* Q8_0's block of 16 outputs straight from their bytes to B, where the CPU has
 * AVX512-VBMI: passed down to mb_lanes_item as a constant (inlined there under the
 * instance's wider target, as csrc/quant.c's widenings), NULL for mb_widen's route. */
typedef void (*mb_lanes_q8_fn)(const uint8_t *const blk[16], uint32_t *B);

#define MB_LANES_TARGET_VBMI __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,f16c,avx512vbmi")))

/* One 32-element block of 16 outputs (blk[o]: output o's block) -> B [16 pairs][16
 * outputs] dwords, the words mb_widen and mb_wide_transpose make, without a pass through
 * wide[]: the integers are transposed as bytes first (a 16 x 8 transpose of dwords, each
 * two pairs: P[i] holds outputs i and i + 4 (8 + i and 12 + i), two unpack stages make 4 x 4
 * transposes within 128-bit lanes, a lane shuffle gathers dword d of the 16 outputs),
 * pshufb puts each lane's 4 outputs of pair 2d before those of pair 2d + 1, bf16.h's byte
 * lookups widen the 64 integers and unpacking their low and high bytes gives pairs 2d and
 * 2d + 1 in order. About 16 instructions per 64 weights for the other route's ~26. */
static inline __attribute__((always_inline)) MB_LANES_TARGET_VBMI void mb_lanes_q8_vbmi(const uint8_t *const blk[16],
                                                                                        uint32_t *B) {
    __m512i P[8], T[8];
    for (int i = 0; i < 8; i++) {
        const int o = i < 4 ? i : 4 + i; /* P[i]: outputs o and o + 4 */
        P[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(blk[o] + 2))),
                                  _mm256_loadu_si256((const __m256i *)(blk[o + 4] + 2)), 1);
    }
    for (int g = 0; g < 8; g += 4) { /* T[g + c], lane l: dword c (l even) or 4 + c (l odd) of 4 outputs */
        const __m512i t0 = _mm512_unpacklo_epi32(P[g], P[g + 1]), t1 = _mm512_unpackhi_epi32(P[g], P[g + 1]);
        const __m512i t2 = _mm512_unpacklo_epi32(P[g + 2], P[g + 3]), t3 = _mm512_unpackhi_epi32(P[g + 2], P[g + 3]);
        T[g] = _mm512_unpacklo_epi64(t0, t2), T[g + 1] = _mm512_unpackhi_epi64(t0, t2);
        T[g + 2] = _mm512_unpacklo_epi64(t1, t3), T[g + 3] = _mm512_unpackhi_epi64(t1, t3);
    }
    const __m512i order = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
    for (int d = 0; d < 8; d++) { /* dword d of the 16 outputs: pairs 2d, 2d + 1 */
        const __m512i D = _mm512_shuffle_i32x4(T[d & 3], T[4 + (d & 3)], d < 4 ? 0x88 : 0xdd);
        __m512i lo, hi;
        mb_i8_bf16_bytes(_mm512_shuffle_epi8(D, order), &lo, &hi);
        _mm512_store_si512(B + 16 * (2 * d), _mm512_unpacklo_epi8(lo, hi));
        _mm512_store_si512(B + 16 * (2 * d + 1), _mm512_unpackhi_epi8(lo, hi));
    }
}

/* rows [r0, r0 + rows) (r0 a multiple of 8) x outputs [c0, c0 + outs); q8: Q8_0's route
 * (NULL: mb_widen's) */
MB_WIDE_INLINE void mb_lanes_item(const struct mb_lanes_job *j, int32_t r0, int32_t rows, int32_t c0, int32_t outs,
                                  const int32_t type, const mb_lanes_q8_fn q8) {
    /* from the type (a constant in each instance): the min terms and L fixed at compile time */
    const int has_min = type == MB_GGML_Q4_1 || type == MB_GGML_Q5_1 || type == MB_GGML_Q4_K || type == MB_GGML_Q5_K;
    const int L = type == MB_GGML_Q6_K ? 16 : 32, half = L / 2;
    const int32_t k = j->a.k, pairs = k / 2, subs_row = k / L;
    uint16_t wide[MB_WIDE_OUTS * MB_WIDE_CHUNK] __attribute__((aligned(64)));
    uint32_t B[2][MB_WIDE_CHUNK / 2 * 16] __attribute__((aligned(64)));
    float scale[16 * MB_WIDE_OUTS] __attribute__((aligned(64))), mins[16 * MB_WIDE_OUTS] __attribute__((aligned(64)));
    float park[MB_LANES_ROWS * MB_WIDE_OUTS] __attribute__((aligned(64)));
    const uint8_t *wr[MB_WIDE_OUTS];
    const int32_t b0 = r0 / MB_LANES_R, blocks = (rows + MB_LANES_R - 1) / MB_LANES_R;
    mb_wide_rows(&j->a, c0, outs, wr);
    memset(park, 0, sizeof(float) * (size_t)blocks * MB_LANES_R * MB_WIDE_OUTS);
    for (int32_t e0 = 0; e0 < k; e0 += MB_WIDE_CHUNK) {
        const int32_t elems = k - e0 < MB_WIDE_CHUNK ? k - e0 : MB_WIDE_CHUNK, subs = elems / L;
        if (type == MB_GGML_Q8_0 && q8) {
            for (int32_t s = 0; s < subs; s++) {
                const uint8_t *blk[MB_WIDE_OUTS];
                uint16_t d[MB_WIDE_OUTS] __attribute__((aligned(64)));
                for (int o = 0; o < MB_WIDE_OUTS; o++) {
                    blk[o] = wr[o] + (size_t)(e0 / 32 + s) * 34;
                    memcpy(d + o, blk[o], 2);
                }
                /* the 32 float16 d by vcvtph2ps, 16 at a time (bf16.h's mb_half_f16c's values) */
                _mm512_store_ps(scale + MB_WIDE_OUTS * s, _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)d)));
                _mm512_store_ps(scale + MB_WIDE_OUTS * s + 16,
                                _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(d + 16))));
                q8(blk, B[0] + 16 * 16 * s);
                q8(blk + 16, B[1] + 16 * 16 * s);
            }
        } else {
            for (int o = 0; o < MB_WIDE_OUTS; o++)
                mb_widen(type, wr[o], e0, elems, wide + MB_WIDE_CHUNK * o, scale + o, mins + o);
            mb_wide_transpose(wide, elems / 2, B[0]);
            mb_wide_transpose(wide + 16 * MB_WIDE_CHUNK, elems / 2, B[1]);
        }
        mb_wide_prefetch(&j->a, &j->fmt, wr, e0);
        for (int32_t b = 0; b < blocks; b++) {
            const uint32_t *xb = j->xp + ((size_t)(b0 + b) * pairs + (size_t)(e0 / 2)) * MB_LANES_R;
            const float *sx = has_min ? j->sx + ((size_t)(b0 + b) * subs_row + (size_t)(e0 / L)) * MB_LANES_R : NULL;
            float *pk = park + (size_t)b * MB_LANES_R * MB_WIDE_OUTS;
            for (int32_t s = 0; s < subs; s++)
                mb_lanes_block(xb + (size_t)s * half * MB_LANES_R, B[0] + 16 * half * s, B[1] + 16 * half * s, half,
                               pk, scale + MB_WIDE_OUTS * s, mins + MB_WIDE_OUTS * s,
                               has_min ? sx + (size_t)s * MB_LANES_R : NULL, has_min);
        }
    }
    for (int32_t r = 0; r < rows; r++)
        mb_wide_store(&j->a, r0 + r, c0, outs, park + (size_t)r * MB_WIDE_OUTS);
}

#define MB_LANES_ITEM(j, r0, rows, c0, outs, T) mb_lanes_item(j, r0, rows, c0, outs, T, NULL)
#define MB_LANES_ITEM_VBMI(j, r0, rows, c0, outs, T) mb_lanes_item(j, r0, rows, c0, outs, T, mb_lanes_q8_vbmi)
MB_WIDE_INSTANCES(mb_lanes_run, struct mb_lanes_job, MB_LANES_ITEM, MB_WIDE_TARGET)
MB_WIDE_INSTANCE(mb_lanes_run_q8_0_vbmi, struct mb_lanes_job, MB_LANES_ITEM_VBMI, MB_LANES_TARGET_VBMI, MB_GGML_Q8_0)

/* ---- AVX2 path: the same rule with vdpbf16ps emulated, 8 rows in the lanes ----
 *
 * Without vdpbf16ps a pair step is two fused multiply-adds, odd element first: the
 * products are exact (bfloat16 x by small integers), so each add is rounded once, as the
 * instruction's are; DAZ and FTZ, set in MXCSR while an item runs, read denormal x as
 * zero and flush denormal sums as it does (the fold's fma too, which the rule leaves
 * unflushed: it differs only where acc itself would be denormal, outside the rule's
 * limits). The lanes hold 8 rows instead of 16 outputs: x goes in once per call as
 * float32 [block of 8 rows][k][8], each output's integers are widened to float32 in
 * element order and broadcast, so nothing is transposed. A register block is 12 outputs
 * x 8 rows: 12 accumulators, 24 fmas and 26 loads a pair (8 outputs, where fewer are
 * left: an item's 32 are 12 + 12 + 8); with 8 chains to two FMA pipes of latency 4 a
 * hiccup stalls them, and one Zen 3 thread ran ~9% slower. */
#define MB_LANES2_TARGET __attribute__((target("avx2,fma,f16c")))
#define MB_LANES2_INLINE static inline __attribute__((always_inline)) MB_LANES2_TARGET

/* 32 int8 integers -> float32 (exact), in order */
MB_LANES2_INLINE void mb_lanes2_store32(__m256i q, float *out) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    _mm256_store_ps(out, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)));
    _mm256_store_ps(out + 8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))));
    _mm256_store_ps(out + 16, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)));
    _mm256_store_ps(out + 24, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))));
}

/* 16 where bit e of the 32 bits qh is set, in byte e, else 0 */
MB_LANES2_INLINE __m256i mb_lanes2_fifth(uint32_t qh) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                                            3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), spread); /* qh byte e / 8 */
    const __m256i has = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
    return _mm256_and_si256(has, _mm256_set1_epi8(16));
}

/* One output's elements [e0, e0 + elems) as float32 integers in element order (the
 * values widen.h's mb_widen makes in bfloat16), its sub-blocks' scales and mins at
 * stride MB_WIDE_OUTS */
MB_LANES2_INLINE void mb_lanes2_widen(const int32_t type, const uint8_t *row, int32_t e0, int32_t elems,
                                      float *out, float *scale, float *mins) {
    const __m256i f = _mm256_set1_epi8(15);
    struct mb_wide_format fmt; /* type is a constant in each instance: this folds away */
    mb_wide_format(type, &fmt);
    if (type == MB_GGML_Q4_K || type == MB_GGML_Q5_K) {
        const int q5 = type == MB_GGML_Q5_K;
        const uint8_t *blk = row + (size_t)(e0 / 256) * fmt.bytes, *qs = blk + (q5 ? 48 : 16);
        const float d = mb_half_f16c(blk), dmin = mb_half_f16c(blk + 2);
        uint32_t sc[8], mn[8];
        mb_k_scales(blk + 4, sc, mn);
        const __m256i qh = q5 ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) { /* sub-block j: nibbles j % 2 of bytes 32 (j / 2) .., fifth bit j of qh */
            const __m256i b = _mm256_loadu_si256((const __m256i *)(qs + 32 * (j / 2)));
            __m256i v = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(b, 4) : b, f);
            if (q5) {
                const __m256i bit = _mm256_set1_epi8((char)(1 << j));
                v = _mm256_or_si256(v, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit),
                                                        _mm256_set1_epi8(16)));
            }
            mb_lanes2_store32(v, out + 32 * j);
            scale[MB_WIDE_OUTS * j] = d * (float)sc[j];
            mins[MB_WIDE_OUTS * j] = -(dmin * (float)mn[j]);
        }
        return;
    }
    if (type == MB_GGML_Q6_K) {
        const uint8_t *blk = row + (size_t)(e0 / 256) * fmt.bytes;
        const float d = mb_half_f16c(blk + 208);
        for (int h = 0; h < 2; h++) { /* element 128h + 32g + l: 4 low bits from ql, 2 high from qh */
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            for (int g = 0; g < 4; g++) {
                const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (g & 1)));
                const __m256i low = _mm256_and_si256(g >> 1 ? _mm256_srli_epi16(ql, 4) : ql, f);
                const __m256i top = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), _mm256_set1_epi8(3));
                const __m256i u = _mm256_or_si256(low, _mm256_slli_epi16(top, 4)); /* 0..63 per byte */
                mb_lanes2_store32(_mm256_sub_epi8(u, _mm256_set1_epi8(32)), out + 128 * h + 32 * g);
            }
        }
        for (int s = 0; s < 16; s++)
            scale[MB_WIDE_OUTS * s] = d * (float)(int8_t)blk[192 + s];
        return;
    }
    /* the integers' offset (the tables' of widen.h) and where the nibbles and fifth bits lie */
    const __m256i off = _mm256_set1_epi8(type == MB_GGML_Q4_0 ? 8 : type == MB_GGML_Q5_0 ? 16 : 0);
    const int at = type == MB_GGML_Q4_0 ? 2 : type == MB_GGML_Q4_1 ? 4 : type == MB_GGML_Q5_0 ? 6 : 8;
    for (int32_t b = 0; b < elems / 32; b++) {
        const uint8_t *blk = row + (size_t)(e0 / 32 + b) * fmt.bytes;
        scale[MB_WIDE_OUTS * b] = mb_half_f16c(blk);
        if (type == MB_GGML_Q4_1 || type == MB_GGML_Q5_1)
            mins[MB_WIDE_OUTS * b] = mb_half_f16c(blk + 2);
        if (type == MB_GGML_Q8_0) {
            mb_lanes2_store32(_mm256_loadu_si256((const __m256i *)(blk + 2)), out + 32 * b);
            continue;
        }
        /* byte l: element l (low nibble) and l + 16 (high) */
        const __m128i q = _mm_loadu_si128((const __m128i *)(blk + at)), f4 = _mm_set1_epi8(15);
        __m256i v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), f4), _mm_and_si128(q, f4));
        if (type == MB_GGML_Q5_0 || type == MB_GGML_Q5_1) {
            uint32_t qh;
            memcpy(&qh, blk + at - 4, 4);
            v = _mm256_or_si256(v, mb_lanes2_fifth(qh));
        }
        mb_lanes2_store32(_mm256_sub_epi8(v, off), out + 32 * b);
    }
}

/* One sub-block of 8 rows x O outputs (12 or 8): xb its elements [L][8 rows], W the outputs'
 * widened elements (rows MB_WIDE_CHUNK apart); park [O outputs][8 rows] += the products'
 * sums times scale, then the min term (sx: the 8 rows' S sums) */
MB_LANES2_INLINE void mb_lanes2_block(const float *xb, const float *W, const int half, float *park,
                                      const float *scale, const float *mins, const float *sx, const int has_min,
                                      const int O) {
    __m256 p[12];
#pragma GCC unroll 12
    for (int o = 0; o < O; o++)
        p[o] = _mm256_setzero_ps();
    for (int q = 0; q < half; q++) {
        const __m256 x1 = _mm256_load_ps(xb + 8 * (2 * q + 1)), x0 = _mm256_load_ps(xb + 8 * (2 * q));
#pragma GCC unroll 12
        for (int o = 0; o < O; o++)
            p[o] = _mm256_fmadd_ps(x1, _mm256_broadcast_ss(W + (size_t)MB_WIDE_CHUNK * o + 2 * q + 1), p[o]);
#pragma GCC unroll 12
        for (int o = 0; o < O; o++)
            p[o] = _mm256_fmadd_ps(x0, _mm256_broadcast_ss(W + (size_t)MB_WIDE_CHUNK * o + 2 * q), p[o]);
    }
    const __m256 sv = has_min ? _mm256_load_ps(sx) : _mm256_setzero_ps();
#pragma GCC unroll 12
    for (int o = 0; o < O; o++) {
        __m256 a = _mm256_fmadd_ps(p[o], _mm256_broadcast_ss(scale + o), _mm256_load_ps(park + 8 * o));
        if (has_min)
            a = _mm256_fmadd_ps(sv, _mm256_broadcast_ss(mins + o), a);
        _mm256_store_ps(park + 8 * o, a);
    }
}

/* rows [r0, r0 + rows) (r0 a multiple of 8) x outputs [c0, c0 + outs) */
MB_LANES2_INLINE void mb_lanes2_item(const struct mb_lanes_job *j, int32_t r0, int32_t rows, int32_t c0,
                                     int32_t outs, const int32_t type) {
    const int has_min = type == MB_GGML_Q4_1 || type == MB_GGML_Q5_1 || type == MB_GGML_Q4_K || type == MB_GGML_Q5_K;
    const int L = type == MB_GGML_Q6_K ? 16 : 32, half = L / 2;
    const int32_t k = j->a.k, subs_row = k / L;
    float wide[MB_WIDE_OUTS * MB_WIDE_CHUNK] __attribute__((aligned(32)));
    float scale[16 * MB_WIDE_OUTS] __attribute__((aligned(32))), mins[16 * MB_WIDE_OUTS] __attribute__((aligned(32)));
    float park[MB_LANES_ROWS * MB_WIDE_OUTS] __attribute__((aligned(32))); /* [block][32 outputs][8 rows] */
    const uint8_t *wr[MB_WIDE_OUTS];
    const int32_t b0 = r0 / MB_LANES_R, blocks = (rows + MB_LANES_R - 1) / MB_LANES_R;
    /* the outputs the register blocks read (past outs: repeats of the last) */
    const int32_t widened = outs > 24 ? 32 : outs > 12 ? 24 : 12;
    mb_wide_rows(&j->a, c0, outs, wr);
    memset(park, 0, sizeof(float) * (size_t)blocks * MB_LANES_R * MB_WIDE_OUTS);
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | MB_MXCSR_DAZ_FTZ);
    for (int32_t e0 = 0; e0 < k; e0 += MB_WIDE_CHUNK) {
        const int32_t elems = k - e0 < MB_WIDE_CHUNK ? k - e0 : MB_WIDE_CHUNK, subs = elems / L;
        for (int o = 0; o < widened; o++)
            mb_lanes2_widen(type, wr[o], e0, elems, wide + MB_WIDE_CHUNK * o, scale + o, mins + o);
        if (e0 + MB_WIDE_CHUNK < k) { /* the next chunk's blocks, arriving while this one's products run */
            const size_t at = (size_t)(e0 + MB_WIDE_CHUNK) / j->fmt.block * j->fmt.bytes;
            for (int o = 0; o < widened; o++)
                for (int32_t off = 0; off < MB_WIDE_CHUNK / j->fmt.block * j->fmt.bytes; off += 64)
                    _mm_prefetch((const char *)(wr[o] + at + off), _MM_HINT_T0);
        }
        for (int32_t b = 0; b < blocks; b++) {
            const float *xb = j->xf + ((size_t)(b0 + b) * k + (size_t)e0) * MB_LANES_R;
            const float *sx = has_min ? j->sx + ((size_t)(b0 + b) * subs_row + (size_t)(e0 / L)) * MB_LANES_R : NULL;
            float *pk = park + (size_t)b * MB_WIDE_OUTS * MB_LANES_R;
            for (int32_t o0 = 0; o0 < outs; o0 += 12) {
                const int wide12 = outs - o0 > 8;
                for (int32_t s = 0; s < subs; s++) {
                    const float *xs = xb + (size_t)s * L * MB_LANES_R, *W = wide + MB_WIDE_CHUNK * o0 + L * s;
                    const float *sc = scale + MB_WIDE_OUTS * s + o0, *mn = mins + MB_WIDE_OUTS * s + o0;
                    const float *ss = has_min ? sx + (size_t)s * MB_LANES_R : NULL;
                    if (wide12)
                        mb_lanes2_block(xs, W, half, pk + MB_LANES_R * o0, sc, mn, ss, has_min, 12);
                    else
                        mb_lanes2_block(xs, W, half, pk + MB_LANES_R * o0, sc, mn, ss, has_min, 8);
                }
            }
        }
    }
    _mm_setcsr(csr);
    for (int32_t r = 0; r < rows; r++) {
        const float *pr = park + (size_t)(r / MB_LANES_R) * MB_WIDE_OUTS * MB_LANES_R + r % MB_LANES_R;
        for (int32_t o = 0; o < outs; o++)
            mb_y_store(&j->a, r0 + r, c0 + o, pr[(size_t)o * MB_LANES_R]);
    }
}

MB_WIDE_INSTANCES(mb_lanes2_run, struct mb_lanes_job, mb_lanes2_item, MB_LANES2_TARGET)

/* x [m, k] -> xf [blocks][k][8] float32 (denormals zero, rows past m zero), and for the
 * formats with a min sx [blocks][k / 32][8] = the pair chain of each row's sub-block with
 * ones (S = (S + x[2p + 1]) + x[2p] from +0, flushed as the products' chains) */
static MB_LANES2_TARGET void mb_lanes2_pack(const uint16_t *x, int64_t ldx, int32_t m, int32_t k, int32_t blocks,
                                            float *xf, float *sx) {
    for (int32_t b = 0; b < blocks; b++)
        for (int32_t i = 0; i < MB_LANES_R; i++) {
            const int32_t row = MB_LANES_R * b + i;
            float *dst = xf + (size_t)b * k * MB_LANES_R + i;
            for (int32_t e = 0; e < k; e++)
                dst[(size_t)e * MB_LANES_R] = row < m ? mb_flush(mb_bf16_f32(x[(size_t)row * ldx + e])) : 0.0f;
        }
    if (!sx)
        return;
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | MB_MXCSR_DAZ_FTZ);
    for (int32_t b = 0; b < blocks; b++)
        for (int32_t s = 0; s < k / 32; s++) {
            const float *xb = xf + ((size_t)b * k + (size_t)s * 32) * MB_LANES_R;
            __m256 acc = _mm256_setzero_ps();
            for (int q = 0; q < 16; q++) {
                acc = _mm256_add_ps(acc, _mm256_load_ps(xb + MB_LANES_R * (2 * q + 1)));
                acc = _mm256_add_ps(acc, _mm256_load_ps(xb + MB_LANES_R * (2 * q)));
            }
            _mm256_store_ps(sx + ((size_t)b * (k / 32) + s) * MB_LANES_R, acc);
        }
    _mm_setcsr(csr);
}

static void mb_lanes_worker(void *data) {
    struct mb_lanes_job *j = (struct mb_lanes_job *)data;
    const mb_lanes_run_fn run = j->run;
    for (;;) {
        int64_t first, take = mb_take_guided(&j->next, j->items, j->threads, &first);
        if (take == 0)
            break;
        for (int64_t i = first; i < first + take; i++) {
            int32_t r0, rows, c0, outs;
            mb_wide_item_at(&j->a, i, j->chunks, MB_LANES_ROWS, &r0, &rows, &c0, &outs);
            run(j, r0, rows, c0, outs);
        }
    }
}

/* x [m, k] (rows ldx apart) -> xp dword [blocks][k / 2][8]: pair p of block b's row i at
 * (b * k / 2 + p) * 8 + i, rows past m zero */
static void mb_lanes_pack(const uint16_t *x, int64_t ldx, int32_t m, int32_t k, int32_t blocks, uint32_t *xp) {
    const int32_t pairs = k / 2;
    for (int32_t b = 0; b < blocks; b++)
        for (int32_t i = 0; i < MB_LANES_R; i++) {
            const int32_t row = MB_LANES_R * b + i;
            uint32_t *dst = xp + (size_t)b * pairs * MB_LANES_R + i;
            if (row >= m) {
                for (int32_t p = 0; p < pairs; p++)
                    dst[(size_t)p * MB_LANES_R] = 0;
                continue;
            }
            const uint16_t *xr = x + (size_t)row * ldx;
            for (int32_t p = 0; p < pairs; p++)
                dst[(size_t)p * MB_LANES_R] = (uint32_t)xr[2 * p] | (uint32_t)xr[2 * p + 1] << 16;
        }
}

/* sx [blocks][k / 32][8] = dp(x row's sub-block, ones) for the L = 32 sub-blocks, 8 rows
 * in the lanes of one chain: the same instruction and order as the products' */
static MB_WIDE_TARGET void mb_lanes_xsums(const uint32_t *xp, int32_t k, int32_t blocks, float *sx) {
    const int32_t pairs = k / 2, subs = k / 32;
    const __m256bh ones = (__m256bh)_mm256_set1_epi32(0x3f803f80); /* (1.0, 1.0) in bfloat16 */
    for (int32_t b = 0; b < blocks; b++)
        for (int32_t s = 0; s < subs; s++) {
            const uint32_t *xb = xp + ((size_t)b * pairs + (size_t)s * 16) * MB_LANES_R;
            __m256 acc = _mm256_setzero_ps();
            for (int q = 0; q < 16; q++)
                acc = _mm256_dpbf16_ps(acc, (__m256bh)_mm256_loadu_si256((const __m256i *)(xb + MB_LANES_R * q)), ones);
            _mm256_storeu_ps(sx + ((size_t)b * subs + s) * MB_LANES_R, acc);
        }
}

int mb_q_linear_lanes(int32_t type, const uint8_t *w, int64_t row_bytes, int32_t n, int32_t k,
                      const uint16_t *x, int64_t ldx, int32_t m, const float *bias, void *y,
                      int32_t y_mode, int64_t ldy, int32_t kernel, void *parallel, int32_t threads) {
    struct mb_lanes_job j;
    memset(&j, 0, sizeof j);
    j.a = (struct mb_q_call){type, w, row_bytes, n, k, x, ldx, m, bias, y, y_mode, ldy};
    const int avx512 = kernel == MB_KERNEL_AVX512BF16 || kernel == MB_KERNEL_AVX512BF16_INT32;
    if (!mb_wide_call_ok(&j.a, &j.fmt) ||
        !(avx512 ? mb_bf16_kernel() == MB_KERNEL_AVX512BF16 : kernel == MB_KERNEL_AVX2 && mb_avx2_supported()))
        return MB_EINVAL;
    const int32_t blocks = (m + MB_LANES_R - 1) / MB_LANES_R;
    j.groups = (n + MB_WIDE_OUTS - 1) / MB_WIDE_OUTS;
    j.chunks = (m + MB_LANES_ROWS - 1) / MB_LANES_ROWS;
    j.items = (int64_t)j.groups * j.chunks;
    if (!avx512) {
        float *xf = NULL, *sx = NULL;
        if (posix_memalign((void **)&xf, 64, sizeof(float) * (size_t)blocks * MB_LANES_R * (size_t)k) ||
            (j.fmt.has_min &&
             posix_memalign((void **)&sx, 64, sizeof(float) * (size_t)blocks * MB_LANES_R * (size_t)(k / 32)))) {
            free(xf);
            return MB_ESCRATCH;
        }
        mb_lanes2_pack(x, ldx, m, k, blocks, xf, sx);
        j.xf = xf, j.sx = sx;
        j.run = mb_lanes2_run_pick(type);
        mb_run_guided(mb_lanes_worker, &j, &j.threads, j.items, parallel, threads);
        free(sx);
        free(xf);
        return MB_OK;
    }
    /* Q8_0 through byte lookups where the CPU has VBMI, unless kernel asks for the int32
     * route (mb_q_linear's choice, so that the tests run both here) */
    j.run = type == MB_GGML_Q8_0 && kernel == MB_KERNEL_AVX512BF16 && mb_q_vbmi_widening() == 1
                ? mb_lanes_run_q8_0_vbmi
                : mb_lanes_run_pick(type);
    uint32_t *xp = NULL;
    float *sx = NULL;
    if (posix_memalign((void **)&xp, 64, sizeof(uint32_t) * (size_t)blocks * MB_LANES_R * (size_t)(k / 2)))
        return MB_ESCRATCH;
    mb_lanes_pack(x, ldx, m, k, blocks, xp);
    j.xp = xp;
    if (j.fmt.has_min) {
        if (posix_memalign((void **)&sx, 64, sizeof(float) * (size_t)blocks * MB_LANES_R * (size_t)(k / 32))) {
            free(xp);
            return MB_ESCRATCH;
        }
        mb_lanes_xsums(xp, k, blocks, sx);
        j.sx = sx;
    }
    mb_run_guided(mb_lanes_worker, &j, &j.threads, j.items, parallel, threads);
    free(sx);
    free(xp);
    return MB_OK;
}

#else /* no AVX512-BF16 build */

int mb_lanes_supported(void) { return 0; }

int mb_q_linear_lanes(int32_t type, const uint8_t *w, int64_t row_bytes, int32_t n, int32_t k,
                      const uint16_t *x, int64_t ldx, int32_t m, const float *bias, void *y,
                      int32_t y_mode, int64_t ldy, int32_t kernel, void *parallel, int32_t threads) {
    (void)type, (void)w, (void)row_bytes, (void)n, (void)k, (void)x, (void)ldx, (void)m, (void)bias;
    (void)y, (void)y_mode, (void)ldy, (void)kernel, (void)parallel, (void)threads;
    return MB_EINVAL;
}

#endif
