/* Prompt rows of the GGUF linears on AMX tiles: y[r, c] = x[r, :k] . dequant(w row c)
 * (+ bias[c]), for the rows of a prefill chunk, on every block type csrc/quant.c and
 * csrc/kquant.c read (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K).
 *
 * Why it exists: at prefill the vdpbf16ps kernels are compute bound (a few hundred
 * GFLOP/s on two cores, against llama.cpp's int8 dot products on the same file); one
 * TDPBF16PS does 16 x 16 x 32 multiply-adds, 16 times a vdpbf16ps's work per issue.
 * Decode rows stay on the vdpbf16ps kernels: they read the weights once per step, and at
 * one row the widening into tiles alone costs more than the whole vdpbf16ps kernel (the
 * few-rows path below, timed at 1 and 8 rows), while a decode row's rule cannot change
 * with the batch's size without breaking batch invariance.
 *
 * The rule, per output (row r of x, output c), "the tile rule" (mashbox/native_ref.py's
 * q_linear_tiles states it in numpy). The weight row is cut into sub-blocks s of L
 * elements (L = 32; Q6_K: 16), each w = scale_s * q + min_s with q a small integer,
 * exact in bfloat16:
 *   Q8_0 q int8, scale d;  Q4_0 nib - 8, d;  Q5_0 (nib | hbit << 4) - 16, d;
 *   Q4_1, Q5_1 the unsigned integer, d, min m;
 *   Q4_K, Q5_K q, scale d * sc_j, min -(dmin * mn_j) (both exact in float32);
 *   Q6_K u - 32, scale d * sc_g.
 * acc = 0; for each sub-block in order:
 *     P = tdp(x_s, q_s);  acc = fma(P, scale_s, acc)
 *     with a min: S = tdp(x_s, 1);  acc = fma(S, min_s, acc)
 * then acc + bias, y as mb_bf16_linear writes it. tdp(a, b) is one TDPBF16PS from a zero
 * tile: E = +0, E = E + a[2p] b[2p] over the pairs p in order, O the same over the odd
 * elements, P = E + O (exact products; every add rounded to nearest even; bfloat16
 * denormals read as zero and float32 denormal sums flushed to zero). The hardware was
 * probed for that order (tests/test_native_amx.py compares bits on random inputs). A
 * row's bits depend on its own x row, weight row, bias and y: never on m, the other rows
 * or the threads. The bits differ from the vdpbf16ps rule's (another order of the same
 * exact products), which is why the decoder sends a row kind to one rule only: prompt
 * rows here, decode rows there (mashbox/model/linear.py).
 *
 * How: x is first packed in tile order (each 16-row x tile one contiguous KB: x's own
 * rows, k * 2 bytes apart, all fall in one L1 set when k is a multiple of 2048). A work
 * item is 32 outputs x up to MB_AMX_ROWS rows. Its weights are widened, MB_AMX_CHUNK
 * elements at a time, into bfloat16 (each output's chunk in element order, by SIMD code
 * per block type), then transposed into the tile B layout (pair p of output o at dword
 * [p][o]; 16 KB, in L1), the next chunk's blocks prefetched meanwhile. Per pair of row
 * tiles and sub-block: two x tiles times two weight tiles, four TDPBF16PS (each tile
 * load used twice: the loads, not the multiply-adds, bound one product at a time), the
 * four 16 x 16 results stored to L1 and folded into float32 accumulators [rows][32]
 * with the outputs' scale vectors. The S sums of x (formats with a min) are made once
 * per call with a tile of ones, in the caller's thread. Threads: the caller's OpenMP
 * pool, each thread loading the tile configuration before its items and releasing it
 * after. Runs of up to MB_AMX_FEW rows (a short turn after a cached prefix) swap the
 * operands instead: see "few rows" below.
 */
#define _GNU_SOURCE /* syscall() */
#include "mashbox.h"
#include "bf16.h"
#include "ggml_blocks.h"

#include <stdlib.h>
#include <string.h>

#define MB_AMX_OUTS 32    /* outputs per work item: two B tiles' columns */
#define MB_AMX_ROWS 512   /* rows per work item (64 KB of parked accumulators): each output's
                           * blocks widened once for a 512-token prefill chunk */
#define MB_AMX_CHUNK 256  /* weight elements widened at a time: one K-quant block, 8 legacy ones */
#define MB_AMX_FEW 16     /* rows up to which x is the B operand and the weights A: short prompt runs */


#if defined(__x86_64__) && defined(__linux__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 11))
#define MB_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define MB_AMX 0
#endif

struct mb_amx_format {
    int32_t block;  /* elements per block */
    int32_t bytes;  /* bytes per block */
    int32_t sub;    /* L: elements per sub-block (one scale) */
    int32_t has_min;
};

static int mb_amx_format(int32_t type, struct mb_amx_format *f) {
    switch (type) {
    case MB_GGML_Q8_0: *f = (struct mb_amx_format){32, 34, 32, 0}; return 1;
    case MB_GGML_Q4_0: *f = (struct mb_amx_format){32, 18, 32, 0}; return 1;
    case MB_GGML_Q4_1: *f = (struct mb_amx_format){32, 20, 32, 1}; return 1;
    case MB_GGML_Q5_0: *f = (struct mb_amx_format){32, 22, 32, 0}; return 1;
    case MB_GGML_Q5_1: *f = (struct mb_amx_format){32, 24, 32, 1}; return 1;
    case MB_GGML_Q4_K: *f = (struct mb_amx_format){256, 144, 32, 1}; return 1;
    case MB_GGML_Q5_K: *f = (struct mb_amx_format){256, 176, 32, 1}; return 1;
    case MB_GGML_Q6_K: *f = (struct mb_amx_format){256, 210, 16, 0}; return 1;
    default: return 0;
    }
}

#if MB_AMX

#define MB_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,f16c")))
#define MB_AMX_INLINE static inline __attribute__((always_inline)) MB_AMX_TARGET

#define MB_ARCH_REQ_XCOMP_PERM 0x1023
#define MB_XFEATURE_XTILEDATA 18

static int mb_amx_state; /* 0 unknown, 1 usable, -1 not */

int mb_amx_supported(void) {
    int s = __atomic_load_n(&mb_amx_state, __ATOMIC_ACQUIRE);
    if (s == 0) {
        unsigned a, b, c, d;
        int cpu = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1u) && (d >> 24 & 1u) &&
                  (b >> 16 & 1u) && (b >> 30 & 1u); /* AMX-BF16, AMX-TILE, AVX512F, AVX512BW */
        int bf16 = cpu && __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 5 & 1u); /* AVX512-BF16 */
        /* Linux hands out the tile state only to a process that asks (5.16+) */
        s = bf16 && syscall(SYS_arch_prctl, MB_ARCH_REQ_XCOMP_PERM, MB_XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&mb_amx_state, s, __ATOMIC_RELEASE);
    }
    return s == 1;
}

/* The tile configuration (palette 1): tiles 0..3 results C (16 x 16 float32), 4, 5 x
 * tiles A (16 rows x L bfloat16), 6, 7 weight tiles B (L / 2 pair rows x 16 outputs). */
struct mb_amx_cfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

MB_AMX_INLINE void mb_amx_configure(int32_t sub) {
    struct mb_amx_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 4; t++)
        cfg.rows[t] = 16, cfg.colsb[t] = 64;
    for (int t = 4; t < 6; t++)
        cfg.rows[t] = 16, cfg.colsb[t] = (uint16_t)(2 * sub);
    for (int t = 6; t < 8; t++)
        cfg.rows[t] = (uint8_t)(sub / 2), cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

struct mb_amx_job {
    struct mb_q_call a;
    struct mb_amx_format fmt;
    const uint16_t *xp; /* x packed in tile order (mb_amx_pack) */
    const float *sx;    /* [m, k / L] S sums of x (formats with a min), else NULL */
    const uint32_t *xb; /* few rows: x in B pairs, dword [e / 2][m] = (x[r, e], x[r, e + 1]) */
    const float *sb;    /* few rows: [k / 32][16] S sums of x (formats with a min), else NULL */
    int32_t lane_out[16 * MB_AMX_FEW], lane_row[16 * MB_AMX_FEW]; /* few rows: flat o * m + r's parts */
    int32_t groups, chunks;
    int64_t items, next, threads;
};

/* ---- widening: one output's elements [e0, e0 + 256) (or fewer, a legacy row's end)
 * into bfloat16 in element order, its sub-blocks' scales and mins at stride 16 ---- */

/* bfloat16 bits of the integers -32 .. 31 (exact): the widening's vpermw tables */
static const uint16_t mb_amx_ints[64] __attribute__((aligned(64))) = {
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
MB_AMX_INLINE __m512i mb_amx_table(int off) { return _mm512_loadu_si512(mb_amx_ints + 32 - off); }

/* Legacy block: 16 bytes of nibbles (elements j and j + 16 in byte j) and, for Q5_*, the
 * fifth bits qh (bit e for element e) -> the 32 integers' table indices, in order */
MB_AMX_INLINE __m512i mb_amx_nibbles(const uint8_t *qs, uint32_t qh, int high) {
    __m128i b = _mm_loadu_si128((const __m128i *)qs), f = _mm_set1_epi8(15);
    __m256i both = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), f), _mm_and_si128(b, f));
    __m512i idx = _mm512_cvtepu8_epi16(both);
    if (high)
        idx = _mm512_mask_add_epi16(idx, (__mmask32)qh, idx, _mm512_set1_epi16(16));
    return idx;
}

MB_AMX_INLINE void mb_amx_widen(const int32_t type, const uint8_t *row, int32_t e0, int32_t elems,
                                uint16_t *out, float *scale, float *mins) {
    if (type == MB_GGML_Q4_K || type == MB_GGML_Q5_K) {
        const int q5 = type == MB_GGML_Q5_K;
        const uint8_t *blk = row + (size_t)(e0 / 256) * (q5 ? 176 : 144);
        float d = mb_half(blk), dmin = mb_half(blk + 2);
        uint32_t sc[8], mn[8];
        mb_k_scales(blk + 4, sc, mn);
        const uint8_t *qs = blk + (q5 ? 48 : 16);
        const __m512i tab = mb_amx_table(0);
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
            scale[MB_AMX_OUTS * j] = d * (float)sc[j];
            mins[MB_AMX_OUTS * j] = -(dmin * (float)mn[j]);
        }
        return;
    }
    if (type == MB_GGML_Q6_K) {
        const uint8_t *blk = row + (size_t)(e0 / 256) * 210;
        float d = mb_half(blk + 208);
        const int8_t *sc = (const int8_t *)(blk + 192);
        const __m512i lo = mb_amx_table(32), hi = mb_amx_table(0); /* u - 32 for u < 32, u >= 32 */
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
            scale[MB_AMX_OUTS * s] = d * (float)sc[s];
        return;
    }
    const int bytes = type == MB_GGML_Q8_0 ? 34 : type == MB_GGML_Q4_0 ? 18 : type == MB_GGML_Q4_1 ? 20
                      : type == MB_GGML_Q5_0 ? 22 : 24;
    const __m512i tab = mb_amx_table(type == MB_GGML_Q4_0 ? 8 : type == MB_GGML_Q5_0 ? 16 : 0);
    for (int32_t b = 0; b < elems / 32; b++) {
        const uint8_t *blk = row + (size_t)(e0 / 32 + b) * bytes;
        __m512i v;
        scale[MB_AMX_OUTS * b] = mb_half(blk);
        if (type == MB_GGML_Q8_0) {
            v = (__m512i)mb_i8_bf16(_mm256_loadu_si256((const __m256i *)(blk + 2)));
        } else if (type == MB_GGML_Q4_0) {
            v = _mm512_permutexvar_epi16(mb_amx_nibbles(blk + 2, 0, 0), tab);
        } else if (type == MB_GGML_Q5_0) {
            uint32_t qh;
            memcpy(&qh, blk + 2, 4);
            v = _mm512_permutexvar_epi16(mb_amx_nibbles(blk + 6, qh, 1), tab);
        } else if (type == MB_GGML_Q4_1) {
            mins[MB_AMX_OUTS * b] = mb_half(blk + 2);
            v = _mm512_permutexvar_epi16(mb_amx_nibbles(blk + 4, 0, 0), tab);
        } else { /* Q5_1 */
            uint32_t qh;
            memcpy(&qh, blk + 4, 4);
            mins[MB_AMX_OUTS * b] = mb_half(blk + 2);
            v = _mm512_permutexvar_epi16(mb_amx_nibbles(blk + 8, qh, 1), tab);
        }
        _mm512_storeu_si512(out + 32 * b, v);
    }
}

/* wide [16 outputs][256] bfloat16 -> B [pairs][16 outputs] dwords: 16 x 16 dword
 * transposes (two unpack stages within 128-bit lanes, then the 4 x 4 of lanes) */
MB_AMX_INLINE void mb_amx_transpose(const uint16_t *wide, int32_t pairs, uint32_t *B) {
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

/* x [m, k] (rows ldx apart) -> xp in tile order: tile t (rows 16t .. 16t + 15, past m
 * zero) and sub-block s (L elements) at ((t * k / L) + s) * 16 * L, its 16 rows L apart:
 * each A tile one contiguous run. Straight from x, a tile's rows are ldx * 2 bytes apart,
 * which for k a multiple of 2048 puts all 16 in one L1 set (4 KB aliasing): every tile
 * load missed L1. tiles: m / 16 rounded up to even (the items take tiles in pairs). */
static void mb_amx_pack(const uint16_t *x, int64_t ldx, int32_t m, int32_t k, int32_t L, int32_t tiles,
                        uint16_t *xp) {
    const int32_t subs = k / L;
    for (int32_t t = 0; t < tiles; t++)
        for (int32_t r = 0; r < 16; r++) {
            const int32_t row = 16 * t + r;
            uint16_t *dst = xp + (size_t)t * subs * 16 * L + (size_t)r * L;
            for (int32_t sb = 0; sb < subs; sb++, dst += 16 * L) {
                if (row < m)
                    memcpy(dst, x + (size_t)row * ldx + (size_t)sb * L, sizeof(uint16_t) * (size_t)L);
                else
                    memset(dst, 0, sizeof(uint16_t) * (size_t)L);
            }
        }
}

/* One sub-block of 32 rows x 32 outputs: the x tiles of rows 0..15 (a0) and 16..31 (a1)
 * times the weight tiles of outputs 0..15 (b0) and 16..31 (b1), each product from a zero
 * tile, stored to cbuf [4][16 x 16] in the order (a0 b0, a0 b1, a1 b0, a1 b1) */
MB_AMX_INLINE void mb_amx_tdp4(const uint16_t *a0, const uint16_t *a1, int64_t lda, const uint32_t *b0,
                               const uint32_t *b1, float *cbuf) {
    _tile_loadd(4, a0, lda);
    _tile_loadd(6, b0, 64);
    _tile_zero(0);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b1, 64);
    _tile_zero(1);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a1, lda);
    _tile_zero(2);
    _tile_dpbf16ps(2, 5, 6);
    _tile_zero(3);
    _tile_dpbf16ps(3, 5, 7);
    _tile_stored(0, cbuf, 64);
    _tile_stored(1, cbuf + 256, 64);
    _tile_stored(2, cbuf + 512, 64);
    _tile_stored(3, cbuf + 768, 64);
}

/* park [32 rows][32 outputs] = fma(P, scale, park), then the min term, for the four
 * products in cbuf; sx: row 0's S of this sub-block, rows ld_sx apart */
MB_AMX_INLINE void mb_amx_fold(float *park, const float *cbuf, const float *scale, const float *mins,
                               const float *sx, int64_t ld_sx, const int has_min) {
    for (int q = 0; q < 4; q++) {
        const int half = q >> 1, grp = q & 1;
        const __m512 sv = _mm512_loadu_ps(scale + 16 * grp);
        const __m512 mv = has_min ? _mm512_loadu_ps(mins + 16 * grp) : _mm512_setzero_ps();
        for (int r = 0; r < 16; r++) {
            float *p = park + (size_t)(16 * half + r) * MB_AMX_OUTS + 16 * grp;
            __m512 acc = _mm512_fmadd_ps(_mm512_load_ps(cbuf + 256 * q + 16 * r), sv, _mm512_load_ps(p));
            if (has_min)
                acc = _mm512_fmadd_ps(_mm512_set1_ps(sx[(size_t)(16 * half + r) * ld_sx]), mv, acc);
            _mm512_store_ps(p, acc);
        }
    }
}

/* Row r's outputs [c0, c0 + outs) from acc: + bias, then y as y_mode says (vcvtneps2bf16
 * rounds as mb_round_bf16 does: nearest even, denormals to zero; csrc/linear.c's store) */
MB_AMX_INLINE void mb_amx_store(const struct mb_amx_job *j, int32_t r, int32_t c0, int32_t outs, const float *acc) {
    for (int v = 0; v < 2 && 16 * v < outs; v++) {
        const int32_t col = c0 + 16 * v, lanes = outs - 16 * v < 16 ? outs - 16 * v : 16;
        const __mmask16 mask = (__mmask16)((1u << lanes) - 1u);
        __m512 out = _mm512_load_ps(acc + 16 * v);
        if (j->a.bias)
            out = _mm512_add_ps(out, _mm512_maskz_loadu_ps(mask, j->a.bias + col));
        const size_t at = (size_t)r * j->a.ldy + col;
        if (j->a.y_mode == MB_Y_F32) {
            _mm512_mask_storeu_ps((float *)j->a.y + at, mask, out);
            continue;
        }
        if (j->a.y_mode == MB_Y_ADD_BF16) { /* y + out: y's bfloat16 widened exactly */
            __m256i old = _mm256_maskz_loadu_epi16(mask, (uint16_t *)j->a.y + at);
            out = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(old), 16)), out);
        }
        _mm256_mask_storeu_epi16((uint16_t *)j->a.y + at, mask, (__m256i)_mm512_cvtneps_pbh(out));
    }
}

/* The item's next chunk's blocks after chunk e0 (its 32 outputs' rows apart in memory):
 * asked for now, they arrive while the tiles run this one */
MB_AMX_INLINE void mb_amx_prefetch_next(const struct mb_amx_job *j, const uint8_t *const *wr, int32_t e0) {
    if (e0 + MB_AMX_CHUNK >= j->a.k)
        return;
    const size_t at = (size_t)(e0 + MB_AMX_CHUNK) / j->fmt.block * j->fmt.bytes;
    const int32_t bytes = MB_AMX_CHUNK / j->fmt.block * j->fmt.bytes;
    for (int o = 0; o < MB_AMX_OUTS; o++)
        for (int32_t off = 0; off < bytes; off += 64)
            _mm_prefetch((const char *)(wr[o] + at + off), _MM_HINT_T0);
}

MB_AMX_INLINE void mb_amx_item(const struct mb_amx_job *j, int32_t r0, int32_t rows, int32_t c0, int32_t outs,
                               const int32_t type) {
    const int has_min = j->fmt.has_min, L = j->fmt.sub;
    const int64_t subs_row = j->a.k / L; /* sx's row stride */
    uint16_t wide[MB_AMX_OUTS * MB_AMX_CHUNK] __attribute__((aligned(64)));
    uint32_t B[2][MB_AMX_CHUNK / 2 * 16] __attribute__((aligned(64)));
    float scale[16 * MB_AMX_OUTS] __attribute__((aligned(64))), mins[16 * MB_AMX_OUTS] __attribute__((aligned(64)));
    float cbuf[4 * 256] __attribute__((aligned(64)));
    float park[MB_AMX_ROWS * MB_AMX_OUTS] __attribute__((aligned(64)));
    const uint8_t *wr[MB_AMX_OUTS];
    for (int o = 0; o < MB_AMX_OUTS; o++) /* past the item's outputs, its last row again (never stored) */
        wr[o] = j->a.w + (size_t)(c0 + (o < outs ? o : outs - 1)) * j->a.row_bytes;
    memset(park, 0, sizeof(float) * (size_t)((rows + 31) / 32 * 32) * MB_AMX_OUTS);
    for (int32_t e0 = 0; e0 < j->a.k; e0 += MB_AMX_CHUNK) {
        const int32_t elems = j->a.k - e0 < MB_AMX_CHUNK ? j->a.k - e0 : MB_AMX_CHUNK, subs = elems / L;
        for (int o = 0; o < MB_AMX_OUTS; o++)
            mb_amx_widen(type, wr[o], e0, elems, wide + MB_AMX_CHUNK * o, scale + o, mins + o);
        mb_amx_transpose(wide, elems / 2, B[0]);
        mb_amx_transpose(wide + 16 * MB_AMX_CHUNK, elems / 2, B[1]);
        mb_amx_prefetch_next(j, wr, e0);
        for (int32_t t = 0; t < rows; t += 32) { /* row tiles in pairs (xp's padding rows are zero) */
            const uint16_t *a0 = j->xp + ((size_t)(r0 + t) / 16 * subs_row + (size_t)(e0 / L)) * 16 * L;
            const uint16_t *a1 = a0 + (size_t)subs_row * 16 * L;
            const int64_t lda = 2 * L;
            const float *sx = has_min ? j->sx + (size_t)(r0 + t) * subs_row + e0 / L : NULL;
            for (int32_t s = 0; s < subs; s++) {
                mb_amx_tdp4(a0 + (size_t)s * 16 * L, a1 + (size_t)s * 16 * L, lda, B[0] + 16 * (s * L / 2),
                            B[1] + 16 * (s * L / 2), cbuf);
                mb_amx_fold(park + (size_t)t * MB_AMX_OUTS, cbuf, scale + MB_AMX_OUTS * s, mins + MB_AMX_OUTS * s,
                            has_min ? sx + s : NULL, subs_row, has_min);
            }
        }
    }
    for (int32_t r = 0; r < rows; r++)
        mb_amx_store(j, r0 + r, c0, outs, park + (size_t)r * MB_AMX_OUTS);
}

/* ---- few rows (m <= MB_AMX_FEW, a short prompt run): the same rule, the operands swapped ----
 * C[o][r] = tdp(weights of output o, x row r): the weights widened as above are A tiles
 * as they stand (output o's sub-block one 64-byte row; no transpose), x in B pairs. Each
 * element's products and adds are those of C[r][o] above (E over the even elements, O
 * over the odd, then E + O), so the bits are the same whichever way the rows arrive; the
 * tests compare the two paths. Below 16 rows the other path pads its x tiles to 32 rows
 * and transposes every widened chunk; this one pads nothing to the tile but its columns,
 * and skips the transpose. */

/* tiles 0..3 C (16 outputs x m float32), 4, 5 weight tiles A (16 outputs x L bfloat16),
 * 6, 7 x tiles B (L / 2 pair rows x m rows) */
MB_AMX_INLINE void mb_amx_configure_few(int32_t sub, int32_t m) {
    struct mb_amx_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 4; t++)
        cfg.rows[t] = 16, cfg.colsb[t] = (uint16_t)(4 * m);
    for (int t = 4; t < 6; t++)
        cfg.rows[t] = 16, cfg.colsb[t] = (uint16_t)(2 * sub);
    for (int t = 6; t < 8; t++)
        cfg.rows[t] = (uint8_t)(sub / 2), cfg.colsb[t] = (uint16_t)(4 * m);
    _tile_loadconfig(&cfg);
}

/* acc [16 outputs][m] = fma(C, scale, acc), then the min term: C as stored, rows m floats
 * apart (16 m floats, m vectors); sb: this sub-block's S sums [m] */
MB_AMX_INLINE void mb_amx_fold_few(const struct mb_amx_job *j, float *acc, const float *c, const float *scale,
                                   const float *mins, const float *sb, const int has_min) {
    const __m512 sv = _mm512_loadu_ps(scale);
    const __m512 mv = has_min ? _mm512_loadu_ps(mins) : _mm512_setzero_ps();
    const __m512 xs = has_min ? _mm512_load_ps(sb) : _mm512_setzero_ps();
    for (int32_t i = 0; i < j->a.m; i++) {
        const __m512i lo = _mm512_loadu_si512(j->lane_out + 16 * i);
        __m512 a = _mm512_fmadd_ps(_mm512_load_ps(c + 16 * i), _mm512_permutexvar_ps(lo, sv),
                                   _mm512_load_ps(acc + 16 * i));
        if (has_min)
            a = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_loadu_si512(j->lane_row + 16 * i), xs),
                                _mm512_permutexvar_ps(lo, mv), a);
        _mm512_store_ps(acc + 16 * i, a);
    }
}

/* C0, C1 = the weight tiles of outputs 0..15 (a) and 16..31 (a + 16 rows) times x tile B
 * (b), each from a zero tile, through weight tile A (tile numbers must be immediates) */
#define MB_AMX_FEW_PRODUCTS(C0, C1, A, B, a, b, ldb)          \
    do {                                                      \
        _tile_loadd(B, b, ldb);                               \
        _tile_loadd(A, a, 2 * MB_AMX_CHUNK);                  \
        _tile_zero(C0);                                       \
        _tile_dpbf16ps(C0, A, B);                             \
        _tile_loadd(A, (a) + 16 * MB_AMX_CHUNK, 2 * MB_AMX_CHUNK); \
        _tile_zero(C1);                                       \
        _tile_dpbf16ps(C1, A, B);                             \
    } while (0)

MB_AMX_INLINE void mb_amx_item_few(const struct mb_amx_job *j, int32_t c0, int32_t outs, const int32_t type) {
    const int has_min = j->fmt.has_min, L = j->fmt.sub;
    const int32_t m = j->a.m;
    const int64_t ldb = 4 * (int64_t)m, ldc = ldb;
    uint16_t wide[MB_AMX_OUTS * MB_AMX_CHUNK] __attribute__((aligned(64)));
    float scale[16 * MB_AMX_OUTS] __attribute__((aligned(64))), mins[16 * MB_AMX_OUTS] __attribute__((aligned(64)));
    float cbuf[4 * 16 * MB_AMX_FEW] __attribute__((aligned(64)));
    float acc[MB_AMX_OUTS * MB_AMX_FEW] __attribute__((aligned(64))); /* [32 outputs][m] */
    float row[MB_AMX_OUTS] __attribute__((aligned(64)));
    const uint8_t *wr[MB_AMX_OUTS];
    for (int o = 0; o < MB_AMX_OUTS; o++) /* past the item's outputs, its last row again (never stored) */
        wr[o] = j->a.w + (size_t)(c0 + (o < outs ? o : outs - 1)) * j->a.row_bytes;
    memset(acc, 0, sizeof(float) * MB_AMX_OUTS * (size_t)m);
    for (int32_t e0 = 0; e0 < j->a.k; e0 += MB_AMX_CHUNK) {
        const int32_t elems = j->a.k - e0 < MB_AMX_CHUNK ? j->a.k - e0 : MB_AMX_CHUNK, subs = elems / L, s0 = e0 / L;
        for (int o = 0; o < MB_AMX_OUTS; o++)
            mb_amx_widen(type, wr[o], e0, elems, wide + MB_AMX_CHUNK * o, scale + o, mins + o);
        mb_amx_prefetch_next(j, wr, e0);
        /* sub-block s's products (C tiles 0, 1 for an even s, 2, 3 for an odd one), then
         * s - 1's stores and fold: a C tile's store waits on its product, so each store
         * runs behind the next sub-block's products instead of before them */
        for (int32_t s = 0; s <= subs; s++) {
            if (s < subs) {
                const uint32_t *b = j->xb + (size_t)(s0 + s) * (size_t)(L / 2) * (size_t)m;
                const uint16_t *a = wide + L * s;
                if (s & 1)
                    MB_AMX_FEW_PRODUCTS(2, 3, 5, 7, a, b, ldb);
                else
                    MB_AMX_FEW_PRODUCTS(0, 1, 4, 6, a, b, ldb);
            }
            if (s == 0)
                continue;
            const int32_t sub = s - 1;
            float *cb = cbuf + 32 * MB_AMX_FEW * (sub & 1);
            if (sub & 1) {
                _tile_stored(2, cb, ldc);
                _tile_stored(3, cb + 16 * MB_AMX_FEW, ldc);
            } else {
                _tile_stored(0, cb, ldc);
                _tile_stored(1, cb + 16 * MB_AMX_FEW, ldc);
            }
            for (int grp = 0; grp < 2; grp++)
                mb_amx_fold_few(j, acc + (size_t)16 * grp * m, cb + 16 * MB_AMX_FEW * grp,
                                scale + MB_AMX_OUTS * sub + 16 * grp, mins + MB_AMX_OUTS * sub + 16 * grp,
                                has_min ? j->sb + (size_t)(s0 + sub) * 16 : NULL, has_min);
        }
    }
    for (int32_t r = 0; r < m; r++) {
        for (int o = 0; o < MB_AMX_OUTS; o++)
            row[o] = acc[(size_t)o * m + r];
        mb_amx_store(j, r, c0, outs, row);
    }
}

#define MB_AMX_RUN(NAME, T)                                                                              \
    static MB_AMX_TARGET void NAME(const struct mb_amx_job *j, int32_t r0, int32_t rows, int32_t c0,     \
                                   int32_t outs) {                                                       \
        if (j->xb)                                                                                       \
            mb_amx_item_few(j, c0, outs, T);                                                             \
        else                                                                                             \
            mb_amx_item(j, r0, rows, c0, outs, T);                                                       \
    }

MB_AMX_RUN(mb_amx_run_q8_0, MB_GGML_Q8_0)
MB_AMX_RUN(mb_amx_run_q4_0, MB_GGML_Q4_0)
MB_AMX_RUN(mb_amx_run_q4_1, MB_GGML_Q4_1)
MB_AMX_RUN(mb_amx_run_q5_0, MB_GGML_Q5_0)
MB_AMX_RUN(mb_amx_run_q5_1, MB_GGML_Q5_1)
MB_AMX_RUN(mb_amx_run_q4_k, MB_GGML_Q4_K)
MB_AMX_RUN(mb_amx_run_q5_k, MB_GGML_Q5_K)
MB_AMX_RUN(mb_amx_run_q6_k, MB_GGML_Q6_K)

static MB_AMX_TARGET void mb_amx_worker(void *data) {
    struct mb_amx_job *j = (struct mb_amx_job *)data;
    void (*run)(const struct mb_amx_job *, int32_t, int32_t, int32_t, int32_t) =
        j->a.type == MB_GGML_Q8_0 ? mb_amx_run_q8_0 : j->a.type == MB_GGML_Q4_0 ? mb_amx_run_q4_0
        : j->a.type == MB_GGML_Q4_1 ? mb_amx_run_q4_1 : j->a.type == MB_GGML_Q5_0 ? mb_amx_run_q5_0
        : j->a.type == MB_GGML_Q5_1 ? mb_amx_run_q5_1 : j->a.type == MB_GGML_Q4_K ? mb_amx_run_q4_k
        : j->a.type == MB_GGML_Q5_K ? mb_amx_run_q5_k : mb_amx_run_q6_k;
    int configured = 0;
    for (;;) {
        int64_t first, take = mb_take_guided(&j->next, j->items, j->threads, &first);
        if (take == 0)
            break;
        if (!configured) {
            if (j->xb)
                mb_amx_configure_few(j->fmt.sub, j->a.m);
            else
                mb_amx_configure(j->fmt.sub);
            configured = 1;
        }
        for (int64_t i = first; i < first + take; i++) {
            int32_t g = (int32_t)(i / j->chunks), ch = (int32_t)(i % j->chunks);
            int32_t r0 = ch * MB_AMX_ROWS, c0 = g * MB_AMX_OUTS;
            run(j, r0, j->a.m - r0 < MB_AMX_ROWS ? j->a.m - r0 : MB_AMX_ROWS, c0,
                j->a.n - c0 < MB_AMX_OUTS ? j->a.n - c0 : MB_AMX_OUTS);
        }
    }
    if (configured)
        _tile_release();
}

/* sx[r, s] = tdp(x row r's sub-block s, ones) for the L = 32 sub-blocks, from xp, in the
 * caller's thread: the min terms' sums, by the same instruction as the products' */
static MB_AMX_TARGET void mb_amx_xsums(const uint16_t *xp, int32_t m, int32_t k, int32_t tiles, float *sx) {
    uint32_t ones[16 * 16] __attribute__((aligned(64)));
    float cbuf[256] __attribute__((aligned(64)));
    const int32_t subs = k / 32;
    for (int i = 0; i < 256; i++)
        ones[i] = 0x3f803f80u; /* (1.0, 1.0) in bfloat16 */
    mb_amx_configure(32);
    _tile_loadd(6, ones, 64);
    for (int32_t t = 0; t < tiles; t++)
        for (int32_t sb = 0; sb < subs; sb++) {
            _tile_zero(0);
            _tile_loadd(4, xp + ((size_t)t * subs + sb) * 16 * 32, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_stored(0, cbuf, 64);
            for (int32_t i = 0; i < 16 && 16 * t + i < m; i++)
                sx[(size_t)(16 * t + i) * subs + sb] = cbuf[16 * i];
        }
    _tile_release();
}

/* The few rows' operands: x in B pairs, the flat o * m + r lanes' parts, and (formats with
 * a min) the S sums as the other path makes them (mb_amx_xsums on x packed in tile order,
 * one tile, into xp and sx), turned into sb[s][r] */
static void mb_amx_few_operands(struct mb_amx_job *j, uint32_t *xb, float *sb, uint16_t *xp, float *sx) {
    const int32_t m = j->a.m, k = j->a.k;
    for (int32_t r = 0; r < m; r++) {
        const uint16_t *xr = j->a.x + (size_t)r * j->a.ldx;
        for (int32_t e = 0; e < k; e += 2)
            xb[(size_t)(e / 2) * m + r] = (uint32_t)xr[e] | (uint32_t)xr[e + 1] << 16;
    }
    for (int32_t f = 0; f < 16 * m; f++)
        j->lane_out[f] = f / m, j->lane_row[f] = f % m;
    j->xb = xb;
    if (sb == NULL)
        return;
    mb_amx_pack(j->a.x, j->a.ldx, m, k, 32, 1, xp);
    mb_amx_xsums(xp, m, k, 1, sx);
    for (int32_t sbk = 0; sbk < k / 32; sbk++)
        for (int32_t r = 0; r < 16; r++)
            sb[(size_t)sbk * 16 + r] = r < m ? sx[(size_t)r * (k / 32) + sbk] : 0.0f;
    j->sb = sb;
}

int mb_q_linear_tiles(int32_t type, const uint8_t *w, int64_t row_bytes, int32_t n, int32_t k,
                      const uint16_t *x, int64_t ldx, int32_t m, const float *bias, void *y,
                      int32_t y_mode, int64_t ldy, void *parallel, int32_t threads) {
    struct mb_amx_job j;
    memset(&j, 0, sizeof j);
    j.a = (struct mb_q_call){type, w, row_bytes, n, k, x, ldx, m, bias, y, y_mode, ldy};
    if (!mb_amx_format(type, &j.fmt) || !mb_q_call_ok(&j.a, j.fmt.block) ||
        row_bytes != (int64_t)(k / j.fmt.block) * j.fmt.bytes || !mb_amx_supported())
        return MB_EINVAL;
    j.groups = (n + MB_AMX_OUTS - 1) / MB_AMX_OUTS;
    if (m <= MB_AMX_FEW) {
        uint32_t *xb = NULL;
        uint16_t *xp = NULL;
        float *sb = NULL, *sx = NULL;
        int ok = !posix_memalign((void **)&xb, 64, sizeof(uint32_t) * (size_t)(k / 2) * (size_t)m);
        if (ok && j.fmt.has_min) /* sb [k / 32][16]; xp, sx: one x tile's, for mb_amx_xsums */
            ok = !posix_memalign((void **)&sb, 64, sizeof(float) * 16 * (size_t)(k / 32)) &&
                 !posix_memalign((void **)&xp, 64, sizeof(uint16_t) * 16 * (size_t)k) &&
                 (sx = (float *)calloc(16 * (size_t)(k / 32), sizeof(float))) != NULL;
        if (ok) {
            mb_amx_few_operands(&j, xb, sb, xp, sx);
            j.chunks = 1, j.items = j.groups;
            mb_run_guided(mb_amx_worker, &j, &j.threads, j.items, parallel, threads);
        }
        free(sx);
        free(xp);
        free(sb);
        free(xb);
        return ok ? MB_OK : MB_ESCRATCH;
    }
    const int32_t tiles = (m + 31) / 32 * 2;
    uint16_t *xp = NULL;
    float *sx = NULL;
    if (posix_memalign((void **)&xp, 64, sizeof(uint16_t) * 16 * (size_t)tiles * (size_t)k))
        return MB_ESCRATCH;
    mb_amx_pack(x, ldx, m, k, j.fmt.sub, tiles, xp);
    j.xp = xp;
    if (j.fmt.has_min) {
        /* 16 * tiles rows: a last tile pair's padding rows read it too */
        sx = (float *)calloc((size_t)(16 * tiles) * (size_t)(k / 32), sizeof(float));
        if (sx == NULL) {
            free(xp);
            return MB_ESCRATCH;
        }
        mb_amx_xsums(xp, m, k, tiles, sx);
        j.sx = sx;
    }
    j.chunks = (m + MB_AMX_ROWS - 1) / MB_AMX_ROWS;
    j.items = (int64_t)j.groups * j.chunks;
    mb_run_guided(mb_amx_worker, &j, &j.threads, j.items, parallel, threads);
    free(sx);
    free(xp);
    return MB_OK;
}

#else /* no AMX build */

int mb_amx_supported(void) { return 0; }

int mb_q_linear_tiles(int32_t type, const uint8_t *w, int64_t row_bytes, int32_t n, int32_t k,
                      const uint16_t *x, int64_t ldx, int32_t m, const float *bias, void *y,
                      int32_t y_mode, int64_t ldy, void *parallel, int32_t threads) {
    (void)type, (void)w, (void)row_bytes, (void)n, (void)k, (void)x, (void)ldx, (void)m, (void)bias;
    (void)y, (void)y_mode, (void)ldy, (void)parallel, (void)threads;
    return MB_EINVAL;
}

#endif
