/* Prefix-cache block hashes and their lookup (rules: mashbox/native_ref.py).
 *
 * One running 64-bit hash over the whole token sequence, sampled at each block end, so
 * hash i covers ids[0 .. (i+1)*block) and equal hashes mean (with overwhelming
 * probability) equal prefixes: a slot's match length is its run of leading equal hashes.
 */
#include "mashbox.h"

#define GOLDEN 0x9E3779B97F4A7C15ULL
#define HASH_SEED 0xCBF29CE484222325ULL

/* splitmix64's output function; must match native_ref._mix64 */
static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

int mb_block_hashes(const int32_t *ids, int64_t n, int32_t block, uint64_t *out) {
    if (n < 0 || block < 1) return MB_EINVAL;
    int64_t blocks = n / block;
    uint64_t h = HASH_SEED;
    for (int64_t b = 0; b < blocks; b++) {
        const int32_t *p = ids + b * block;
        for (int32_t j = 0; j < block; j++) h = mix64(h + GOLDEN + (uint32_t)p[j]);
        out[b] = h;
    }
    return MB_OK;
}

int mb_longest_prefix(const uint64_t *query, int32_t n_query, const uint64_t *table,
                      int32_t slots, int32_t max_blocks, const int32_t *counts,
                      const uint8_t *usable, int32_t *out_slot, int32_t *out_blocks) {
    if (n_query < 0 || slots < 0 || max_blocks < 0) return MB_EINVAL;
    int32_t best = -1, best_blocks = 0, best_count = 0;
    for (int32_t s = 0; s < slots; s++) {
        if (!usable[s]) continue;
        int32_t count = counts[s] < 0 ? 0 : (counts[s] > max_blocks ? max_blocks : counts[s]);
        int32_t limit = count < n_query ? count : n_query;
        const uint64_t *row = table + (size_t)s * (size_t)max_blocks;
        int32_t m = 0;
        while (m < limit && row[m] == query[m]) m++;
        if (best < 0 || m > best_blocks || (m == best_blocks && count < best_count)) {
            best = s;
            best_blocks = m;
            best_count = count;
        }
    }
    *out_slot = best;
    *out_blocks = best_blocks;
    return MB_OK;
}
