/* Internal to csrc/: the prompt-row kernels' shared widening (csrc/amx.c's tiles and
 * csrc/lanes.c's vdpbf16ps lanes): a GGUF weight row's blocks of any type the linears
 * take, MB_WIDE_CHUNK elements at a time, into bfloat16 small integers q (exact) with
 * each sub-block's scale and min (w = scale * q + min), the 16 x 16 dword transpose into
 * [pair][16 outputs], the next chunk's prefetch, and the y store of 32 outputs from
 * float32 accumulators. Not part of the C API in mashbox.h. */
#ifndef MASHBOX_WIDEN_H
#define MASHBOX_WIDEN_H

#include "mashbox.h"
#include "bf16.h"
#include "ggml_blocks.h"

#include <stdint.h>
#include <string.h>

#define MB_WIDE_OUTS 32    /* outputs per work item: two vectors of 16 (scale / min stride) */
#define MB_WIDE_CHUNK 256  /* weight elements widened at a time: one K-quant block, 8 legacy ones */

struct mb_wide_format {
    int32_t block;  /* elements per block */
    int32_t bytes;  /* bytes per block */
    int32_t sub;    /* L: elements per sub-block (one scale) */
    int32_t has_min;
};

static inline int mb_wide_format(int32_t type, struct mb_wide_format *f) {
    switch (type) {
    case MB_GGML_Q8_0: *f = (struct mb_wide_format){32, 34, 32, 0}; return 1;
    case MB_GGML_Q4_0: *f = (struct mb_wide_format){32, 18, 32, 0}; return 1;
    case MB_GGML_Q4_1: *f = (struct mb_wide_format){32, 20, 32, 1}; return 1;
    case MB_GGML_Q5_0: *f = (struct mb_wide_format){32, 22, 32, 0}; return 1;
    case MB_GGML_Q5_1: *f = (struct mb_wide_format){32, 24, 32, 1}; return 1;
    case MB_GGML_Q4_K: *f = (struct mb_wide_format){256, 144, 32, 1}; return 1;
    case MB_GGML_Q5_K: *f = (struct mb_wide_format){256, 176, 32, 1}; return 1;
    case MB_GGML_Q6_K: *f = (struct mb_wide_format){256, 210, 16, 0}; return 1;
    default: return 0;
    }
}

/* The checks both prompt kernels make of a call: a type they widen (into *f), the
 * arguments mb_q_call_ok takes, and weight rows of whole blocks */
static inline int mb_wide_call_ok(const struct mb_q_call *a, struct mb_wide_format *f) {
    return mb_wide_format(a->type, f) && mb_q_call_ok(a, f->block) &&
           a->row_bytes == (int64_t)(a->k / f->block) * f->bytes;
}

/* Work item i of a call cut into 32-output groups x `chunks` runs of `per` rows (item i:
 * group i / chunks, run i % chunks): its first row and output and how many of each */
static inline void mb_wide_item_at(const struct mb_q_call *a, int64_t i, int32_t chunks, int32_t per, int32_t *r0,
                                   int32_t *rows, int32_t *c0, int32_t *outs) {
    *r0 = (int32_t)(i % chunks) * per, *c0 = (int32_t)(i / chunks) * MB_WIDE_OUTS;
    *rows = a->m - *r0 < per ? a->m - *r0 : per;
    *outs = a->n - *c0 < MB_WIDE_OUTS ? a->n - *c0 : MB_WIDE_OUTS;
}

/* An item's 32 weight rows from output c0: past its outs outputs, its last row again
 * (widened, never stored), so every chunk widens 32 rows */
static inline void mb_wide_rows(const struct mb_q_call *a, int32_t c0, int32_t outs, const uint8_t **wr) {
    for (int o = 0; o < MB_WIDE_OUTS; o++)
        wr[o] = a->w + (size_t)(c0 + (o < outs ? o : outs - 1)) * a->row_bytes;
}

/* A prompt kernel's entry point in a build without the instructions: every call refused */
#define MB_WIDE_REFUSED(NAME)                                                                                \
    int NAME(int32_t type, const uint8_t *w, int64_t row_bytes, int32_t n, int32_t k, const uint16_t *x,      \
             int64_t ldx, int32_t m, const float *bias, void *y, int32_t y_mode, int64_t ldy, void *parallel, \
             int32_t threads) {                                                                              \
        (void)type, (void)w, (void)row_bytes, (void)n, (void)k, (void)x, (void)ldx, (void)m, (void)bias;      \
        (void)y, (void)y_mode, (void)ldy, (void)parallel, (void)threads;                                    \
        return MB_EINVAL;                                                                                    \
    }

#if defined(__x86_64__) && defined(__linux__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 11))
#define MB_WIDE 1
#include <immintrin.h>

#define MB_WIDE_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,f16c")))
#define MB_WIDE_INLINE static inline __attribute__((always_inline)) MB_WIDE_TARGET

/* ---- widening: one output's elements [e0, e0 + 256) (or fewer, a legacy row's end)
 * into bfloat16 in element order, its sub-blocks' scales and mins at stride MB_WIDE_OUTS ---- */

/* bfloat16 bits of the integers -32 .. 31 (exact): the widening's vpermw tables */
static const uint16_t mb_wide_ints[64] __attribute__((aligned(64))) = {
    0xc200, 0xc1f8, 0xc1f0, 0xc1e8, 0xc1e0, 0xc1d8, 0xc1d0, 0xc1c8,
    0xc1c0, 0xc1b8, 0xc1b0, 0xc1a8, 0xc1a0, 0xc198, 0xc190, 0xc188,
    0xc180, 0xc170, 0xc160, 0xc150, 0xc140, 0xc130, 0xc120, 0xc110,
    0xc100, 0xc0e0, 0xc0c0, 0xc0a0, 0xc080, 0xc040, 0xc000, 0xbf80,
    0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0x4180, 0x4188, 0x4190, 0x4198, 0x41a0, 0x41a8, 0x41b0, 0x41b8,
    0x41c0, 0x41c8, 0x41d0, 0x41d8, 0x41e0, 0x41e8, 0x41f0, 0x41f8,
};

/* the table of i - off for i = 0 .. 31 (off 0, 8, 16 or 32) */
MB_WIDE_INLINE __m512i mb_wide_table(int off) { return _mm512_loadu_si512(mb_wide_ints + 32 - off); }

/* Legacy block: 16 bytes of nibbles (elements j and j + 16 in byte j) and, for Q5_*, the
 * fifth bits qh (bit e for element e) -> the 32 integers' table indices, in order */
MB_WIDE_INLINE __m512i mb_wide_nibbles(const uint8_t *qs, uint32_t qh, int high) {
    __m128i b = _mm_loadu_si128((const __m128i *)qs), f = _mm_set1_epi8(15);
    __m256i both = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), f), _mm_and_si128(b, f));
    __m512i idx = _mm512_cvtepu8_epi16(both);
    if (high)
        idx = _mm512_mask_add_epi16(idx, (__mmask32)qh, idx, _mm512_set1_epi16(16));
    return idx;
}

MB_WIDE_INLINE void mb_widen(const int32_t type, const uint8_t *row, int32_t e0, int32_t elems,
                                uint16_t *out, float *scale, float *mins) {
    if (type == MB_GGML_Q4_K || type == MB_GGML_Q5_K) {
        const int q5 = type == MB_GGML_Q5_K;
        const uint8_t *blk = row + (size_t)(e0 / 256) * (q5 ? 176 : 144);
        float d = mb_half(blk), dmin = mb_half(blk + 2);
        uint32_t sc[8], mn[8];
        mb_k_scales(blk + 4, sc, mn);
        const uint8_t *qs = blk + (q5 ? 48 : 16);
        const __m512i tab = mb_wide_table(0);
        const __m256i f = _mm256_set1_epi8(15);
        __m256i qh = q5 ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            __m256i b = _mm256_loadu_si256((const __m256i *)(qs + 32 * (j / 2)));
            b = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(b, 4) : b, f);
            __m512i idx = _mm512_cvtepu8_epi16(b);
            if (q5) /* sub-block j's fifth bits: bit j of qh[l] */
                idx = _mm512_mask_add_epi16(idx, _mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(1 << j))), idx,
                                            _mm512_set1_epi16(16));
            _mm512_storeu_si512(out + 32 * j, _mm512_permutexvar_epi16(idx, tab));
            scale[MB_WIDE_OUTS * j] = d * (float)sc[j];
            mins[MB_WIDE_OUTS * j] = -(dmin * (float)mn[j]);
        }
        return;
    }
    if (type == MB_GGML_Q6_K) {
        const uint8_t *blk = row + (size_t)(e0 / 256) * 210;
        float d = mb_half(blk + 208);
        const int8_t *sc = (const int8_t *)(blk + 192);
        const __m512i lo = mb_wide_table(32), hi = mb_wide_table(0); /* u - 32 for u < 32, u >= 32 */
        const __m256i f = _mm256_set1_epi8(15), three = _mm256_set1_epi8(3);
        for (int h = 0; h < 2; h++) { /* element 128h + 32g + l: 4 low bits from ql, 2 high from qh */
            __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            for (int g = 0; g < 4; g++) {
                __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (g & 1)));
                __m256i low = _mm256_and_si256(g >> 1 ? _mm256_srli_epi16(ql, 4) : ql, f);
                __m256i top = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), three);
                __m256i u = _mm256_or_si256(low, _mm256_slli_epi16(top, 4)); /* 0..63 per byte */
                __m512i w = _mm512_permutex2var_epi16(lo, _mm512_cvtepu8_epi16(u), hi);
                _mm512_storeu_si512(out + 128 * h + 32 * g, w);
            }
        }
        for (int s = 0; s < 16; s++)
            scale[MB_WIDE_OUTS * s] = d * (float)sc[s];
        return;
    }
    const int bytes = type == MB_GGML_Q8_0 ? 34 : type == MB_GGML_Q4_0 ? 18 : type == MB_GGML_Q4_1 ? 20
                      : type == MB_GGML_Q5_0 ? 22 : 24;
    const __m512i tab = mb_wide_table(type == MB_GGML_Q4_0 ? 8 : type == MB_GGML_Q5_0 ? 16 : 0);
    for (int32_t b = 0; b < elems / 32; b++) {
        const uint8_t *blk = row + (size_t)(e0 / 32 + b) * bytes;
        __m512i v;
        scale[MB_WIDE_OUTS * b] = mb_half_f16c(blk);
        if (type == MB_GGML_Q8_0) {
            v = (__m512i)mb_i8_bf16(_mm256_loadu_si256((const __m256i *)(blk + 2)));
        } else if (type == MB_GGML_Q4_0) {
            v = _mm512_permutexvar_epi16(mb_wide_nibbles(blk + 2, 0, 0), tab);
        } else if (type == MB_GGML_Q5_0) {
            uint32_t qh;
            memcpy(&qh, blk + 2, 4);
            v = _mm512_permutexvar_epi16(mb_wide_nibbles(blk + 6, qh, 1), tab);
        } else if (type == MB_GGML_Q4_1) {
            mins[MB_WIDE_OUTS * b] = mb_half_f16c(blk + 2);
            v = _mm512_permutexvar_epi16(mb_wide_nibbles(blk + 4, 0, 0), tab);
        } else { /* Q5_1 */
            uint32_t qh;
            memcpy(&qh, blk + 4, 4);
            mins[MB_WIDE_OUTS * b] = mb_half_f16c(blk + 2);
            v = _mm512_permutexvar_epi16(mb_wide_nibbles(blk + 8, qh, 1), tab);
        }
        _mm512_storeu_si512(out + 32 * b, v);
    }
}

/* wide [16 outputs][256] bfloat16 -> B [pairs][16 outputs] dwords: 16 x 16 dword
 * transposes (two unpack stages within 128-bit lanes, then the 4 x 4 of lanes) */
MB_WIDE_INLINE void mb_wide_transpose(const uint16_t *wide, int32_t pairs, uint32_t *B) {
    for (int32_t p0 = 0; p0 < pairs; p0 += 16) {
        __m512i r[16], t[16];
        for (int o = 0; o < 16; o++)
            r[o] = _mm512_loadu_si512(wide + 256 * o + 2 * p0);
        for (int i = 0; i < 8; i++) {
            t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        for (int i = 0; i < 4; i++) { /* r[4i + j], lane L: column 4L + j of rows 4i .. 4i + 3 */
            r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
            r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
            r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
            r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
        }
        for (int j = 0; j < 4; j++) {
            __m512i a = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), b = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xee);
            __m512i c = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
            __m512i e = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xee);
            _mm512_storeu_si512(B + 16 * (p0 + j), _mm512_shuffle_i32x4(a, c, 0x88));
            _mm512_storeu_si512(B + 16 * (p0 + 4 + j), _mm512_shuffle_i32x4(a, c, 0xdd));
            _mm512_storeu_si512(B + 16 * (p0 + 8 + j), _mm512_shuffle_i32x4(b, e, 0x88));
            _mm512_storeu_si512(B + 16 * (p0 + 12 + j), _mm512_shuffle_i32x4(b, e, 0xdd));
        }
    }
}

/* Row r's outputs [c0, c0 + outs) from acc: + bias, then y as y_mode says (vcvtneps2bf16
 * rounds as mb_round_bf16 does: nearest even, denormals to zero; csrc/linear.c's store) */
MB_WIDE_INLINE void mb_wide_store(const struct mb_q_call *a, int32_t r, int32_t c0, int32_t outs, const float *acc) {
    for (int v = 0; v < 2 && 16 * v < outs; v++) {
        const int32_t col = c0 + 16 * v, lanes = outs - 16 * v < 16 ? outs - 16 * v : 16;
        const __mmask16 mask = (__mmask16)((1u << lanes) - 1u);
        __m512 out = _mm512_load_ps(acc + 16 * v);
        if (a->bias)
            out = _mm512_add_ps(out, _mm512_maskz_loadu_ps(mask, a->bias + col));
        const size_t at = (size_t)r * a->ldy + col;
        if (a->y_mode == MB_Y_F32) {
            _mm512_mask_storeu_ps((float *)a->y + at, mask, out);
            continue;
        }
        if (a->y_mode == MB_Y_ADD_BF16) { /* y + out: y's bfloat16 widened exactly */
            __m256i old = _mm256_maskz_loadu_epi16(mask, (uint16_t *)a->y + at);
            out = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(old), 16)), out);
        }
        _mm256_mask_storeu_epi16((uint16_t *)a->y + at, mask, (__m256i)_mm512_cvtneps_pbh(out));
    }
}

/* The next chunk's blocks after chunk e0 of an item's 32 outputs (wr: their rows, apart
 * in memory): asked for now, they arrive while this chunk's products run */
MB_WIDE_INLINE void mb_wide_prefetch(const struct mb_q_call *a, const struct mb_wide_format *f,
                                     const uint8_t *const *wr, int32_t e0) {
    if (e0 + MB_WIDE_CHUNK >= a->k)
        return;
    const size_t at = (size_t)(e0 + MB_WIDE_CHUNK) / f->block * f->bytes;
    const int32_t bytes = MB_WIDE_CHUNK / f->block * f->bytes;
    for (int o = 0; o < MB_WIDE_OUTS; o++)
        for (int32_t off = 0; off < bytes; off += 64)
            _mm_prefetch((const char *)(wr[o] + at + off), _MM_HINT_T0);
}

/* One instance of ITEM(job, r0, rows, c0, outs, type) (an always-inline function) per block
 * type under TARGET, the type a constant in each so the widening's switches fold away, and
 * NAME_pick(type) choosing among them once per call */
#define MB_WIDE_INSTANCE(NAME, JOB, ITEM, TARGET, T)                                                     \
    static TARGET void NAME(const JOB *j, int32_t r0, int32_t rows, int32_t c0, int32_t outs) {            \
        ITEM(j, r0, rows, c0, outs, T);                                                                    \
    }
#define MB_WIDE_INSTANCES(NAME, JOB, ITEM, TARGET)                                                       \
    MB_WIDE_INSTANCE(NAME##_q8_0, JOB, ITEM, TARGET, MB_GGML_Q8_0)                                         \
    MB_WIDE_INSTANCE(NAME##_q4_0, JOB, ITEM, TARGET, MB_GGML_Q4_0)                                         \
    MB_WIDE_INSTANCE(NAME##_q4_1, JOB, ITEM, TARGET, MB_GGML_Q4_1)                                         \
    MB_WIDE_INSTANCE(NAME##_q5_0, JOB, ITEM, TARGET, MB_GGML_Q5_0)                                         \
    MB_WIDE_INSTANCE(NAME##_q5_1, JOB, ITEM, TARGET, MB_GGML_Q5_1)                                         \
    MB_WIDE_INSTANCE(NAME##_q4_k, JOB, ITEM, TARGET, MB_GGML_Q4_K)                                         \
    MB_WIDE_INSTANCE(NAME##_q5_k, JOB, ITEM, TARGET, MB_GGML_Q5_K)                                         \
    MB_WIDE_INSTANCE(NAME##_q6_k, JOB, ITEM, TARGET, MB_GGML_Q6_K)                                         \
    typedef void (*NAME##_fn)(const JOB *, int32_t, int32_t, int32_t, int32_t);                            \
    static NAME##_fn NAME##_pick(int32_t type) {                                                           \
        switch (type) {                                                                                    \
        case MB_GGML_Q8_0: return NAME##_q8_0;                                                             \
        case MB_GGML_Q4_0: return NAME##_q4_0;                                                             \
        case MB_GGML_Q4_1: return NAME##_q4_1;                                                             \
        case MB_GGML_Q5_0: return NAME##_q5_0;                                                             \
        case MB_GGML_Q5_1: return NAME##_q5_1;                                                             \
        case MB_GGML_Q4_K: return NAME##_q4_k;                                                             \
        case MB_GGML_Q5_K: return NAME##_q5_k;                                                             \
        default: return NAME##_q6_k; /* mb_wide_call_ok let no other type in */                           \
        }                                                                                                  \
    }

#else
#define MB_WIDE 0
#endif

#endif /* MASHBOX_WIDEN_H */
