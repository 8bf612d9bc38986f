/* The token bitmask of constrained decoding, applied to the logits before sampling.
 *
 * llguidance writes one bit per token id, 32 to a word: token t of a mask row is allowed
 * when bit (t % 32) of word t / 32 is set. A disallowed token's logit becomes -inf, so
 * the sampler (sample.c) never picks it and logprobs say it had no chance. Rows are
 * independent: a row reads only its own mask row (batch invariance).
 * The rules are native_ref.apply_token_bitmask's.
 */
#include "mashbox.h"

#include <math.h>
#include <string.h>

#define NEG_INF_BITS 0xFF800000u /* -inf as float32 bits */

static const uint32_t BIT[32] = {
    1u << 0,  1u << 1,  1u << 2,  1u << 3,  1u << 4,  1u << 5,  1u << 6,  1u << 7,
    1u << 8,  1u << 9,  1u << 10, 1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15,
    1u << 16, 1u << 17, 1u << 18, 1u << 19, 1u << 20, 1u << 21, 1u << 22, 1u << 23,
    1u << 24, 1u << 25, 1u << 26, 1u << 27, 1u << 28, 1u << 29, 1u << 30, 1u << 31};

int mb_apply_token_bitmask(float *logits, int32_t rows, int32_t vocab, const uint32_t *bitmask,
                           int32_t mask_rows, int32_t words, const int32_t *row_mask) {
    if (rows < 0 || vocab < 1 || mask_rows < 0 || words < 1) return MB_EINVAL;
    for (int32_t r = 0; r < rows; r++)
        if (row_mask[r] < -1 || row_mask[r] >= mask_rows) return MB_EINVAL;
    const int32_t covered = (int64_t)words * 32 < vocab ? words * 32 : vocab;
    for (int32_t r = 0; r < rows; r++) {
        if (row_mask[r] < 0) continue; /* unconstrained: untouched */
        float *x = logits + (int64_t)r * vocab;
        const uint32_t *m = bitmask + (int64_t)row_mask[r] * words;
        const int32_t full = covered / 32; /* whole words: a fixed 32-lane select the compiler vectorises */
        for (int32_t i = 0; i < full; i++) {
            uint32_t w = m[i];
            float *y = x + (int64_t)i * 32;
            if (w == 0xFFFFFFFFu) continue; /* all allowed: the common word of a permissive mask */
            if (w == 0) {                  /* none allowed: the common word of a strict one */
                for (int b = 0; b < 32; b++) y[b] = -INFINITY;
                continue;
            }
            uint32_t v[32]; /* the word's 32 logits as bits: an integer blend, vectorised */
            memcpy(v, y, sizeof v);
            for (int b = 0; b < 32; b++) {
                uint32_t keep = 0u - (uint32_t)((w & BIT[b]) != 0);
                v[b] = (v[b] & keep) | (NEG_INF_BITS & ~keep);
            }
            memcpy(y, v, sizeof v);
        }
        for (int32_t t = full * 32; t < covered; t++) /* the last, partial word */
            if (!((m[full] >> (t % 32)) & 1u)) x[t] = -INFINITY;
        for (int32_t t = covered; t < vocab; t++) x[t] = -INFINITY; /* beyond the mask: never */
    }
    return MB_OK;
}
