/* Internal to csrc/: reading the parts of ggml's blocks that every GGUF kernel needs
 * (ggml-common.h's layouts): float16 fields, Q4_K / Q5_K's packed 6-bit scales and
 * mins, and the y modes' store. Not part of the C API in mashbox.h. */
#ifndef MASHBOX_GGML_BLOCKS_H
#define MASHBOX_GGML_BLOCKS_H

#include "mashbox.h"
#include "bf16.h"

#include <stdint.h>

/* One GGUF linear call as mb_q_linear takes it (csrc/mashbox.h): y[m, n] = x[m, k] .
 * dequant(w)[n, k]^T (+ bias), w's rows row_bytes apart in blocks of `type`, y as y_mode
 * says. Every GGUF kernel's job holds one. */
struct mb_q_call {
    int32_t type;
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
};

/* The checks every GGUF kernel makes of its call (each adds its own of type and
 * row_bytes): rows and outputs, k a whole number of `block`-element blocks, x and y rows
 * that hold k and n elements, a y mode. */
static inline int mb_q_call_ok(const struct mb_q_call *c, int32_t block) {
    return c->m >= 1 && c->n >= 1 && c->k >= block && c->k % block == 0 && c->ldx >= c->k && c->ldy >= c->n &&
           c->y_mode >= MB_Y_BF16 && c->y_mode <= MB_Y_ADD_BF16;
}

/* The little-endian IEEE half at p, as float32 (exact). */
static inline float mb_half(const uint8_t *p) {
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

/* Q4_K / Q5_K: the eight sub-blocks' 6-bit scale sc[j] and min mn[j] from the 12 bytes
 * s (sub-blocks 0..3: low 6 bits of bytes j and j + 4; 4..7: 4 bits of byte j + 4 and
 * the top 2 bits of bytes j - 4 and j). */
static inline void mb_k_scales(const uint8_t *s, uint32_t sc[8], uint32_t mn[8]) {
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            sc[j] = s[j] & 63u, mn[j] = s[j + 4] & 63u;
        } else {
            sc[j] = (s[j + 4] & 0xfu) | ((uint32_t)(s[j - 4] >> 6) << 4);
            mn[j] = (uint32_t)(s[j + 4] >> 4) | ((uint32_t)(s[j] >> 6) << 4);
        }
    }
}

/* Output (r, c) of a GGUF linear call: mb_y_store_at on its y, y mode, ldy and bias. */
static inline __attribute__((always_inline)) void mb_y_store(const struct mb_q_call *call, int32_t r, int32_t c,
                                                             float acc) {
    mb_y_store_at(call->y, call->y_mode, call->ldy, call->bias, r, c, acc);
}

#endif
