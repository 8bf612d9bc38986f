/* Internal to csrc/: bfloat16 <-> float32 helpers and the thread plumbing that
 * linear.c and attention.c share (not part of the C API in mashbox.h). */
#ifndef MASHBOX_BF16_H
#define MASHBOX_BF16_H

#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) || defined(__clang__)
#define MB_ATOMICS 1 /* __atomic builtins: the work handout across threads */
#endif

/* libgomp's GOMP_parallel, passed in by the caller (torch's OpenMP pool) */
typedef void (*mb_parallel_fn)(void (*fn)(void *), void *data, unsigned num_threads,
                               unsigned flags);

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

#endif /* MASHBOX_BF16_H */
