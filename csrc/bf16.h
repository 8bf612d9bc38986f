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

/* 32 int8 -> 32 bfloat16 (exact: |q| <= 128 has 8 significant bits), in element order,
 * through int32 and float32: Q8_0's integers for csrc/quant.c's kernels (where the CPU
 * lacks AVX512-FP16) and csrc/amx.c's widening. */
static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512bf16"))) __m512bh
mb_i8_bf16(__m256i v) {
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
    return _mm512_cvtne2ps_pbh(hi, lo); /* low half from the second argument */
}
#endif

#endif /* MASHBOX_BF16_H */
