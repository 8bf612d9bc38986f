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
        for (int32_t base = 0; base < covered; base += 32) {
            uint32_t w = m[base / 32];
            if (w == 0xFFFFFFFFu) continue; /* the common word of a permissive mask */
            int32_t n = covered - base < 32 ? covered - base : 32;
            for (int32_t b = 0; b < n; b++)
                if (!((w >> b) & 1u)) x[base + b] = -INFINITY;
        }
        for (int32_t t = covered; t < vocab; t++) x[t] = -INFINITY; /* beyond the mask: never */
    }
    return MB_OK;
}
