/* Internal to csrc/: bfloat16 <-> float32 helpers and the thread plumbing that
 * linear.c and attention.c share (not part of the C API in mashbox.h). */
#ifndef MASHBOX_BF16_H
#define MASHBOX_BF16_H

#include "mashbox.h" /* MB_Y_* */

#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) || defined(__clang__)
#define MB_ATOMICS 1 /* __atomic builtins: the work handout across threads */
#endif

/* Functions built for AVX-512 and AVX2 too where GCC can pick clones at load time: the
 * same IEEE operations in every clone (no fused multiply-adds: -ffp-contract=off), so
 * the same bits. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && \
    defined(__GLIBC__)
#define MB_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MB_CLONES
#endif

/* libgomp's GOMP_parallel, passed in by the caller (torch's OpenMP pool) */
typedef void (*mb_parallel_fn)(void (*fn)(void *), void *data, unsigned num_threads,
                               unsigned flags);

/* The guided work handout of the linear kernels (csrc/linear.c says why): the next run
 * of items for the calling thread, remaining / (2 * threads) of them and at least one,
 * starting at *first; 0 when none is left. Without atomics (one thread) it takes all. */
static inline int64_t mb_take_guided(int64_t *next, int64_t items, int64_t threads, int64_t *first) {
    int64_t take;
#ifdef MB_ATOMICS
    int64_t at = __atomic_load_n(next, __ATOMIC_RELAXED);
    do {
        if (at >= items)
            return 0;
        take = (items - at) / (2 * threads);
        take = take < 1 ? 1 : take;
    } while (!__atomic_compare_exchange_n(next, &at, at + take, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    *first = at;
#else
    if (*next >= items)
        return 0;
    *first = *next, take = items - *next, *next = items;
#endif
    return take;
}

/* Runs worker(job) on the caller's pool (parallel, `threads` threads) where there is more
 * than one item and atomics, else on the calling thread; the threads it handed the work
 * to, which the job's mb_take_guided needs, go to *used first. */
static inline void mb_run_guided(void (*worker)(void *), void *job, int64_t *used, int64_t items,
                                 void *parallel, int32_t threads) {
#ifdef MB_ATOMICS
    *used = parallel != NULL && threads > 1 && items > 1 ? threads : 1;
#else
    (void)items, (void)parallel, (void)threads;
    *used = 1; /* no atomics on this compiler: the calling thread alone */
#endif
    if (*used > 1)
        ((mb_parallel_fn)parallel)(worker, job, (unsigned)threads, 0);
    else
        worker(job);
}

/* The next work item of a handout one item at a time: *next before its increment (atomic
 * across the pool's threads where MB_ATOMICS; the caller stops at its item count). */
static inline int64_t mb_take_one(int64_t *next) {
#ifdef MB_ATOMICS
    return __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
#else
    return (*next)++;
#endif
}

static inline float mb_bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t mb_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float mb_flush(float f) { /* denormal -> zero of its sign */
    uint32_t u = mb_f32_bits(f);
    return (u & 0x7f800000u) == 0 ? mb_bits_f32(u & 0x80000000u) : f;
}

static inline uint16_t mb_round_bf16(float f) { /* nearest even; NaN stays NaN (quiet) */
    uint32_t u = mb_f32_bits(f);
    u = (u & 0x7f800000u) == 0 ? u & 0x80000000u : u; /* denormal -> zero */
    uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u;
    return (uint16_t)(nan ? (u >> 16) | 0x40u : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float mb_bf16_f32(uint16_t b) { return mb_bits_f32((uint32_t)b << 16); }

/* Output (r, c) of a linear: acc + bias[c] (bias may be NULL), written as y_mode says
 * (MB_Y_*), y's rows ldy apart: the portable kernels' store. */
static inline __attribute__((always_inline)) void mb_y_store_at(void *y, int32_t y_mode, int64_t ldy,
                                                                const float *bias, int32_t r, int32_t c,
                                                                float acc) {
    if (bias)
        acc = acc + bias[c];
    size_t at = (size_t)r * ldy + c;
    if (y_mode == MB_Y_F32)
        ((float *)y)[at] = acc;
    else if (y_mode == MB_Y_ADD_BF16)
        ((uint16_t *)y)[at] = mb_round_bf16(mb_bf16_f32(((uint16_t *)y)[at]) + acc);
    else
        ((uint16_t *)y)[at] = mb_round_bf16(acc);
}

/* MXCSR's DAZ and FTZ bits: the AVX2 paths that emulate vdpbf16ps by fused multiply-adds
 * (csrc/linear.c, csrc/lanes.c) set them while they accumulate, so that denormal inputs
 * read as zero and denormal sums flush, as the instruction's do. */
#define MB_MXCSR_DAZ_FTZ 0x8040u

/* e^x for x <= 0 (0 below -80): Cody-Waite reduction by ln 2 (the nearest integer by
 * adding and taking away 1.5 * 2^23), Cephes' degree-6 polynomial, times 2^n. */
static inline float mb_exp(float x) {
    float y = x < -80.0f ? -80.0f : x;
    float n = (y * 1.44269504f + 12582912.0f) - 12582912.0f;
    float r = (y - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = (p * (r * r) + r) + 1.0f;
    float two_n = mb_bits_f32((uint32_t)((int32_t)n + 127) << 23);
    return x < -80.0f ? 0.0f : p * two_n;
}

#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 10))
#include <immintrin.h>
/* mb_exp on 16 lanes: the same IEEE operations in the same order, so the same bits
 * (csrc/attention.c's softmax, csrc/linear.c's silu_mul). */
static inline __attribute__((always_inline, target("avx512f"))) __m512 mb_exp16(__m512 x) {
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

/* mb_exp on 8 lanes, as mb_exp16 (csrc/attention.c's AVX2 softmax). target avx2 alone:
 * without fma in the target GCC cannot fuse a mul and its add. */
static inline __attribute__((always_inline, target("avx2"))) __m256 mb_exp8(__m256 x) {
    const __m256 lim = _mm256_set1_ps(-80.0f), magic = _mm256_set1_ps(12582912.0f);
    __m256 low = _mm256_cmp_ps(x, lim, _CMP_LT_OQ);
    __m256 y = _mm256_blendv_ps(x, lim, low);
    __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(y, _mm256_set1_ps(1.44269504f)), magic), magic);
    __m256 r = _mm256_sub_ps(_mm256_sub_ps(y, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                             _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(low, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* the little-endian float16 at p, as float32 (vcvtph2ps: exact, subnormals included, no
 * branch; ggml_blocks.h's mb_half's values for every non-NaN half): csrc/kquant.c's and
 * csrc/widen.h's per-block scales, one per 32 weights, where mb_half's shifts and
 * branches showed in a widening's profile. */
static inline __attribute__((always_inline, target("f16c"))) float mb_half_f16c(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

/* 32 int8 -> 32 bfloat16 (exact: |q| <= 128 has 8 significant bits), in element order,
 * through int32 and float32: Q8_0's integers for csrc/quant.c's and csrc/lanes.c's kernels
 * where the CPU lacks AVX512-VBMI (or the int32 kernel is asked for), and for
 * csrc/widen.h's widening in csrc/amx.c on every CPU. */
static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512bf16"))) __m512bh
mb_i8_bf16(__m256i v) {
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
    return _mm512_cvtne2ps_pbh(hi, lo); /* low half from the second argument */
}

/* 64 int8 q -> the low (lo) and high (hi) bytes of their bfloat16 words (exact), byte i
 * of each q[i]'s, through AVX512-VBMI's vpermt2b: the low byte looked up by |q|
 * (bfloat16(-128) and bfloat16(0) share theirs, 0), the high byte by q's low 7 bits in the
 * table its sign picks. Six instructions; unpacking lo and hi makes the words. */
static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vbmi"))) void
mb_i8_bf16_bytes(__m512i q, __m512i *lo, __m512i *hi) {
    /* tables of 128: the low (lo) and high (hp) bytes of bfloat16(i), and the high byte
     * of bfloat16(i - 128) (hn: a negative q's low 7 bits are q + 128) */
    static const uint8_t mb_q8_lo[128] __attribute__((aligned(64))) = {
        0x00, 0x80, 0x00, 0x40, 0x80, 0xa0, 0xc0, 0xe0, 0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70,
        0x80, 0x88, 0x90, 0x98, 0xa0, 0xa8, 0xb0, 0xb8, 0xc0, 0xc8, 0xd0, 0xd8, 0xe0, 0xe8, 0xf0, 0xf8,
        0x00, 0x04, 0x08, 0x0c, 0x10, 0x14, 0x18, 0x1c, 0x20, 0x24, 0x28, 0x2c, 0x30, 0x34, 0x38, 0x3c,
        0x40, 0x44, 0x48, 0x4c, 0x50, 0x54, 0x58, 0x5c, 0x60, 0x64, 0x68, 0x6c, 0x70, 0x74, 0x78, 0x7c,
        0x80, 0x82, 0x84, 0x86, 0x88, 0x8a, 0x8c, 0x8e, 0x90, 0x92, 0x94, 0x96, 0x98, 0x9a, 0x9c, 0x9e,
        0xa0, 0xa2, 0xa4, 0xa6, 0xa8, 0xaa, 0xac, 0xae, 0xb0, 0xb2, 0xb4, 0xb6, 0xb8, 0xba, 0xbc, 0xbe,
        0xc0, 0xc2, 0xc4, 0xc6, 0xc8, 0xca, 0xcc, 0xce, 0xd0, 0xd2, 0xd4, 0xd6, 0xd8, 0xda, 0xdc, 0xde,
        0xe0, 0xe2, 0xe4, 0xe6, 0xe8, 0xea, 0xec, 0xee, 0xf0, 0xf2, 0xf4, 0xf6, 0xf8, 0xfa, 0xfc, 0xfe,
    };
    static const uint8_t mb_q8_hp[128] __attribute__((aligned(64))) = {
        0x00, 0x3f, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41,
        0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41,
        0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42,
        0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42,
        0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42,
        0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42,
        0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42,
        0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42,
    };
    static const uint8_t mb_q8_hn[128] __attribute__((aligned(64))) = {
        0xc3, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2,
        0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2,
        0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2,
        0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2,
        0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2,
        0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2, 0xc2,
        0xc2, 0xc1, 0xc1, 0xc1, 0xc1, 0xc1, 0xc1, 0xc1, 0xc1, 0xc1, 0xc1, 0xc1, 0xc1, 0xc1, 0xc1, 0xc1,
        0xc1, 0xc1, 0xc1, 0xc1, 0xc1, 0xc1, 0xc1, 0xc1, 0xc1, 0xc0, 0xc0, 0xc0, 0xc0, 0xc0, 0xc0, 0xbf,
    };
    const __m512i lo0 = _mm512_load_si512(mb_q8_lo), lo1 = _mm512_load_si512(mb_q8_lo + 64);
    const __m512i hp0 = _mm512_load_si512(mb_q8_hp), hp1 = _mm512_load_si512(mb_q8_hp + 64);
    const __m512i hn0 = _mm512_load_si512(mb_q8_hn), hn1 = _mm512_load_si512(mb_q8_hn + 64);
    *lo = _mm512_permutex2var_epi8(lo0, _mm512_abs_epi8(q), lo1);
    *hi = _mm512_mask_blend_epi8(_mm512_movepi8_mask(q), _mm512_permutex2var_epi8(hp0, q, hp1),
                                 _mm512_permutex2var_epi8(hn0, q, hn1));
}
#endif

#endif /* MASHBOX_BF16_H */
