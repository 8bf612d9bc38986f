/* Incremental stop-string matching on UTF-8 bytes (rules: mashbox/native_ref.py).
 *
 * The caller keeps the held-back bytes and passes them again in front of the new ones,
 * so this function keeps no state. The held-back part is shorter than the longest stop,
 * so one call costs O(len * total stop bytes) at worst, with len ~ a token's text.
 * Why byte positions never split a character: a match or a held suffix starts where a
 * stop starts, i.e. on a UTF-8 lead byte, and it ends at the end of buf or of a stop,
 * i.e. after a whole character.
 */
#include "mashbox.h"

#include <string.h>

int mb_stop_scan(const uint8_t *stops, const int32_t *stop_offsets, int32_t n_stops,
                 const uint8_t *buf, int32_t len, int32_t scan_from, int32_t *out_emit,
                 int32_t *out_stop) {
    if (n_stops < 0 || len < 0 || scan_from < 0 || scan_from > len) return MB_EINVAL;
    if (n_stops > 0 && stop_offsets[0] != 0) return MB_EINVAL;
    int32_t longest = 0;
    for (int32_t i = 0; i < n_stops; i++) {
        int32_t n = stop_offsets[i + 1] - stop_offsets[i];
        if (n < 0) return MB_EINVAL;
        if (n > longest) longest = n;
    }
    /* The first end position where some stop ends; there, the earliest start wins,
     * then the lowest index. */
    for (int32_t end = scan_from + 1; end <= len; end++) {
        int32_t best = -1, best_start = 0;
        for (int32_t i = 0; i < n_stops; i++) {
            int32_t n = stop_offsets[i + 1] - stop_offsets[i];
            if (n == 0 || n > end) continue;
            const uint8_t *s = stops + stop_offsets[i];
            if (buf[end - 1] != s[n - 1] || memcmp(buf + end - n, s, (size_t)n) != 0) continue;
            if (best < 0 || end - n < best_start) { best = i; best_start = end - n; }
        }
        if (best >= 0) {
            *out_emit = best_start;
            *out_stop = best;
            return MB_OK;
        }
    }
    /* No match: hold back the longest suffix that is a proper prefix of some stop. */
    int32_t hold = 0;
    for (int32_t h = (len < longest - 1 ? len : longest - 1); h >= 1 && hold == 0; h--) {
        for (int32_t i = 0; i < n_stops; i++) {
            int32_t n = stop_offsets[i + 1] - stop_offsets[i];
            if (n > h && memcmp(buf + len - h, stops + stop_offsets[i], (size_t)h) == 0) {
                hold = h;
                break;
            }
        }
    }
    *out_emit = len - hold;
    *out_stop = -1;
    return MB_OK;
}
