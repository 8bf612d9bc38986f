/* Token sampling: penalties, greedy, temperature, top_k, top_p, min_p, one seeded draw.
 *
 * The exact rules are written down in mashbox/native_ref.py; this file computes the same
 * bits, faster. The parts that make that possible:
 * - exp() is our own polynomial (weights()), the same float64 operations as the reference;
 * - from the weights on, everything is integer (W = round(exp(d) * 2**44)), so sums are
 *   exact in whatever order they are taken;
 * - top_p needs the tokens in (logit desc, id asc) order only near the cut: a histogram
 *   of the mass by weight bucket finds the one bucket the cut falls in, and only that
 *   bucket's tokens are sorted (W is non-increasing along that order, so the buckets are
 *   contiguous runs of it).
 * Rows are independent and done one after another in one scratch buffer.
 */
#include "mashbox.h"

#include <math.h>
#include <string.h>

#define GOLDEN 0x9E3779B97F4A7C15ULL
#define W_SCALE 17592186044416.0 /* 2**44: the integer weight of the top token */
#define D_MIN (-40.0)
/* top_p buckets: 64 per unit of d over d in [D_MIN, 0] */
#define BUCKETS_PER_UNIT 64.0
#define NUM_BUCKETS 2561
#define SMALL_SORT 32

/* splitmix64's output function; must match native_ref._mix64 */
static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

uint64_t mb_rng_init(uint64_t seed) { return mix64(seed + GOLDEN); }

static uint64_t rng_step(uint64_t *state) {
    *state += GOLDEN;
    return mix64(*state);
}

void mb_rng_next(uint64_t *state, int32_t n, uint64_t *out) {
    for (int32_t i = 0; i < n; i++) out[i] = rng_step(&state[i]);
}

/* On x86-64 Linux with GCC, the weight loop is also built for AVX2 and picked at load
 * time (ifunc); AVX2 without FMA does the very same IEEE operations, only 4 at a time. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && \
    defined(__GLIBC__)
#define MB_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MB_VECTOR_CLONES
#endif

/* Integer weights W = round(exp(d) * 2**44) for d = (x - xmax) * inv_t, 0 where
 * d < D_MIN or d is NaN; and each token's top_p bucket, floor(-d * BUCKETS_PER_UNIT)
 * (monotone in x by construction, whatever exp's last bits do).
 * exp is our own: d = n*ln2 + r, exp(r) by a degree-10 Taylor polynomial, times 2**n;
 * n and the final rounding come from the 1.5*2**52 / 2**52 tricks, so the loop is plain
 * double and 64-bit integer arithmetic that compilers vectorise. The same operations,
 * in the same order, as native_ref._weights. */
MB_VECTOR_CLONES
static void weights(const float *restrict x, int32_t vocab, double xmax, double inv_t,
                    int64_t *restrict w, int32_t *restrict bucket) {
    const double log2e = 1.4426950408889634;
    const double ln2_hi = 0.6931471803691238; /* n * ln2_hi is exact for |n| < 2**11 */
    const double ln2_lo = 1.9082149292705877e-10;
    const double round_magic = 6755399441055744.0; /* 1.5 * 2**52 */
    const double int_magic = 4503599627370496.0;   /* 2**52 */
    for (int32_t i = 0; i < vocab; i++) {
        double d = ((double)x[i] - xmax) * inv_t;
        int keep = d >= D_MIN; /* false for NaN */
        double dd = keep ? d : 0.0;
        double nm = dd * log2e + round_magic; /* low mantissa bits: 2**51 + n */
        double n = nm - round_magic;           /* n in [-58, 0] */
        double r = (dd - n * ln2_hi) - n * ln2_lo;
        double p = 2.755731922398589e-07;
        p = p * r + 2.7557319223985893e-06;
        p = p * r + 2.48015873015873e-05;
        p = p * r + 0.0001984126984126984;
        p = p * r + 0.001388888888888889;
        p = p * r + 0.008333333333333333;
        p = p * r + 0.041666666666666664;
        p = p * r + 0.16666666666666666;
        p = p * r + 0.5;
        p = p * r + 1.0;
        p = p * r + 1.0;
        uint64_t bits, scale_bits;
        double scale;
        memcpy(&bits, &nm, sizeof bits);
        scale_bits = (bits + 1023) << 52; /* (n + 1023) << 52 = 2**n */
        memcpy(&scale, &scale_bits, sizeof scale);
        double v = p * scale * W_SCALE + int_magic; /* rounds to an integer, ties even */
        memcpy(&bits, &v, sizeof bits);
        w[i] = keep ? (int64_t)(bits - 0x4330000000000000ULL) : 0;
        bucket[i] = (int32_t)(dd * -BUCKETS_PER_UNIT);
    }
}

/* Ascending key order = (x descending, id ascending); native_ref._order_keys. */
static uint64_t order_key(float x, int32_t id) {
    union { float f; uint32_t u; } b;
    b.f = x + 0.0f; /* -0.0 -> +0.0 */
    uint32_t ordered = (b.u & 0x80000000u) ? ~b.u : (b.u | 0x80000000u);
    return ((uint64_t)(~ordered) << 32) | (uint32_t)id;
}

/* 64 x 64 -> high 64 bits of the product, portable C. */
static uint64_t mulhi64(uint64_t a, uint64_t b) {
    uint64_t a_lo = (uint32_t)a, a_hi = a >> 32, b_lo = (uint32_t)b, b_hi = b >> 32;
    uint64_t p0 = a_lo * b_lo, p1 = a_lo * b_hi, p2 = a_hi * b_lo, p3 = a_hi * b_hi;
    uint64_t mid = (p0 >> 32) + (uint32_t)p1 + (uint32_t)p2;
    return p3 + (p1 >> 32) + (p2 >> 32) + (mid >> 32);
}

/* Sort n unique keys ascending; tmp has room for n. Insertion sort when small, else
 * LSD radix by bytes, skipping bytes all keys share. */
static void sort_keys(uint64_t *a, uint64_t *tmp, int32_t n) {
    if (n <= SMALL_SORT) {
        for (int32_t i = 1; i < n; i++) {
            uint64_t v = a[i];
            int32_t j = i - 1;
            while (j >= 0 && a[j] > v) { a[j + 1] = a[j]; j--; }
            a[j + 1] = v;
        }
        return;
    }
    uint64_t *src = a, *dst = tmp;
    for (int shift = 0; shift < 64; shift += 8) {
        int32_t count[257];
        memset(count, 0, sizeof(count));
        for (int32_t i = 0; i < n; i++) count[((src[i] >> shift) & 0xFF) + 1]++;
        if (count[((src[0] >> shift) & 0xFF) + 1] == n) continue; /* one value: no-op */
        for (int b = 0; b < 256; b++) count[b + 1] += count[b];
        for (int32_t i = 0; i < n; i++) dst[count[(src[i] >> shift) & 0xFF]++] = src[i];
        uint64_t *t = src; src = dst; dst = t;
    }
    if (src != a) memcpy(a, src, (size_t)n * sizeof(uint64_t));
}

static void sift_down(uint64_t *heap, int32_t n, int32_t i) { /* max-heap */
    uint64_t v = heap[i];
    for (;;) {
        int32_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && heap[c + 1] > heap[c]) c++;
        if (heap[c] <= v) break;
        heap[i] = heap[c];
        i = c;
    }
    heap[i] = v;
}

typedef struct {
    int64_t *w;     /* [vocab] integer weights, 0 = filtered out */
    uint64_t *keys; /* [vocab] top_k heap / top_p bucket keys */
    uint64_t *tmp;  /* [vocab] radix sort buffer */
    int64_t *mass;  /* [NUM_BUCKETS] top_p: weight per bucket */
    int32_t *bucket; /* [vocab] top_p bucket of each token */
    int32_t *marks; /* [vocab] penalty marks and counts; all 0 between calls */
} Scratch;

size_t mb_sample_scratch_bytes(int32_t vocab) {
    if (vocab < 1) vocab = 1;
    size_t v = (size_t)vocab;
    return v * 8 * 3 + (size_t)NUM_BUCKETS * 8 + v * 4 * 2;
}

static Scratch scratch_layout(void *base, int32_t vocab) {
    Scratch s;
    size_t v = (size_t)vocab;
    s.w = (int64_t *)base;
    s.keys = (uint64_t *)(s.w + v);
    s.tmp = s.keys + v;
    s.mass = (int64_t *)(s.tmp + v);
    s.bucket = (int32_t *)(s.mass + NUM_BUCKETS);
    s.marks = s.bucket + v;
    return s;
}

/* HF repetition over every distinct history id, then OpenAI frequency / presence over
 * every distinct generated id with its count. marks is all 0 on entry and on exit. */
static void penalize(float *x, int32_t vocab, const int32_t *hist, int32_t n, int32_t gen_start,
                     float rp, float fp, float pp, int32_t *marks) {
    if (rp != 1.0f) {
        for (int32_t i = 0; i < n; i++) {
            int32_t id = hist[i];
            if (id < 0 || id >= vocab || marks[id]) continue;
            marks[id] = 1;
            float v = x[id];
            x[id] = v > 0 ? v / rp : v * rp;
        }
        for (int32_t i = 0; i < n; i++) {
            int32_t id = hist[i];
            if (id >= 0 && id < vocab) marks[id] = 0;
        }
    }
    if (fp != 0.0f || pp != 0.0f) {
        int32_t g = gen_start < 0 ? 0 : (gen_start > n ? n : gen_start);
        for (int32_t i = g; i < n; i++) {
            int32_t id = hist[i];
            if (id >= 0 && id < vocab) marks[id]++;
        }
        for (int32_t i = g; i < n; i++) {
            int32_t id = hist[i];
            if (id < 0 || id >= vocab || marks[id] == 0) continue;
            x[id] = x[id] - (float)marks[id] * fp - pp;
            marks[id] = 0;
        }
    }
}

/* Keep the k first tokens with w > 0 in key order (k < their number): a max-heap of
 * the k best keys seen; a later token (larger id) beats the worst kept one only with a
 * strictly larger x, so most tokens cost one float compare. */
static void filter_top_k(const float *x, int32_t vocab, int32_t k, Scratch *s) {
    uint64_t *heap = s->keys;
    int32_t n = 0, i = 0;
    for (; i < vocab && n < k; i++)
        if (s->w[i] > 0) heap[n++] = order_key(x[i], i);
    for (int32_t j = n / 2 - 1; j >= 0; j--) sift_down(heap, n, j);
    float worst = x[(uint32_t)heap[0]];
    for (; i < vocab; i++) {
        if (!(x[i] > worst) || s->w[i] == 0) continue;
        heap[0] = order_key(x[i], i);
        sift_down(heap, n, 0);
        worst = x[(uint32_t)heap[0]];
    }
    uint64_t last = heap[0]; /* the k-th key */
    for (int32_t j = 0; j < vocab; j++) {
        if (s->w[j] == 0 || x[j] > worst) continue;
        if (x[j] < worst || order_key(x[j], j) > last) s->w[j] = 0;
    }
}

/* Keep a token iff double(sum of w before it in key order) < top_p * double(sum w). */
static void filter_top_p(const float *x, int32_t vocab, float top_p, Scratch *s) {
    int64_t total = 0;
    memset(s->mass, 0, sizeof(int64_t) * NUM_BUCKETS);
    for (int32_t i = 0; i < vocab; i++) {
        int64_t w = s->w[i];
        if (w > 0) { s->mass[s->bucket[i]] += w; total += w; }
    }
    if (total == 0) return;
    double cut = (double)top_p * (double)total;
    int64_t before = 0; /* exact weight of the buckets ahead of the cut bucket */
    int32_t cut_bucket = -1;
    for (int32_t b = 0; b < NUM_BUCKETS; b++) {
        if ((double)(before + s->mass[b]) >= cut) { cut_bucket = b; break; }
        before += s->mass[b];
    }
    if (cut_bucket < 0) return; /* rounding left the cut past everything: keep all */
    int32_t n = 0;
    for (int32_t i = 0; i < vocab; i++) {
        int64_t w = s->w[i];
        if (w == 0) continue;
        int32_t b = s->bucket[i];
        if (b > cut_bucket) s->w[i] = 0;
        else if (b == cut_bucket) s->keys[n++] = order_key(x[i], i);
    }
    sort_keys(s->keys, s->tmp, n);
    for (int32_t j = 0; j < n; j++) {
        int32_t id = (int32_t)(uint32_t)s->keys[j];
        int64_t w = s->w[id];
        if (!((double)before < cut)) s->w[id] = 0;
        before += w;
    }
}

static int32_t sample_row(float *x, int32_t vocab, const float *p, uint64_t *state,
                          const int32_t *hist, int32_t n_hist, int32_t gen_start, Scratch *s) {
    float temperature = p[0], top_p = p[1], top_k = p[2], min_p = p[3];
    penalize(x, vocab, hist, n_hist, gen_start, p[4], p[5], p[6], s->marks);
    int32_t best = 0;
    float best_x = -INFINITY;
    for (int32_t i = 0; i < vocab; i++) {
        float v = x[i];
        if (v != v) { x[i] = -INFINITY; continue; }
        if (v > best_x) { best_x = v; best = i; }
    }
    uint64_t z = rng_step(state);
    if (!(temperature > 0)) return best;

    weights(x, vocab, (double)best_x, 1.0 / (double)temperature, s->w, s->bucket);
    int32_t positive = 0;
    if (top_k >= 1.0f && top_k < (float)vocab)
        for (int32_t i = 0; i < vocab; i++) positive += s->w[i] > 0;
    if (top_k >= 1.0f && top_k < (float)vocab && (int32_t)top_k < positive)
        filter_top_k(x, vocab, (int32_t)top_k, s);
    if (top_p < 1.0f) filter_top_p(x, vocab, top_p, s);
    if (min_p > 0.0f) {
        double floor_w = (double)min_p * W_SCALE;
        for (int32_t i = 0; i < vocab; i++)
            if ((double)s->w[i] < floor_w) s->w[i] = 0;
    }
    int64_t total = 0;
    for (int32_t i = 0; i < vocab; i++) total += s->w[i];
    if (total == 0) return best;
    uint64_t target = mulhi64(z, (uint64_t)total);
    uint64_t running = 0;
    for (int32_t i = 0; i < vocab; i++) {
        running += (uint64_t)s->w[i];
        if (running > target) return i;
    }
    return best; /* unreachable: running ends at total > target */
}

int mb_sample(float *logits, int32_t rows, int32_t vocab, const float *params,
              uint64_t *rng_state, const int32_t *hist_ids, int32_t n_hist,
              const int32_t *hist_offsets,
              const int32_t *hist_gen_start, int32_t *out_ids, void *scratch,
              size_t scratch_bytes) {
    if (rows < 0 || vocab < 1 || vocab > MB_MAX_VOCAB) return MB_EINVAL;
    if (hist_offsets[0] < 0 || hist_offsets[rows] > n_hist) return MB_EINVAL;
    for (int32_t r = 0; r < rows; r++)
        if (hist_offsets[r + 1] < hist_offsets[r]) return MB_EINVAL;
    if (scratch == NULL || scratch_bytes < mb_sample_scratch_bytes(vocab)) return MB_ESCRATCH;
    Scratch s = scratch_layout(scratch, vocab);
    for (int32_t r = 0; r < rows; r++) {
        int32_t start = hist_offsets[r];
        out_ids[r] = sample_row(logits + (size_t)r * (size_t)vocab, vocab,
                                params + (size_t)r * MB_NUM_PARAMS, &rng_state[r],
                                hist_ids + start, hist_offsets[r + 1] - start,
                                hist_gen_start[r], &s);
    }
    return MB_OK;
}

/* exp(d) by the weights() polynomial for d >= D_MIN, else 0 (also for NaN, -inf). */
static inline double exp_or_zero(double d) {
    const double log2e = 1.4426950408889634;
    const double ln2_hi = 0.6931471803691238;
    const double ln2_lo = 1.9082149292705877e-10;
    const double round_magic = 6755399441055744.0; /* 1.5 * 2**52 */
    int keep = d >= D_MIN; /* false for NaN and -inf */
    double dd = keep ? d : 0.0;
    double nm = dd * log2e + round_magic;
    double n = nm - round_magic;
    double r = (dd - n * ln2_hi) - n * ln2_lo;
    double p = 2.755731922398589e-07;
    p = p * r + 2.7557319223985893e-06;
    p = p * r + 2.48015873015873e-05;
    p = p * r + 0.0001984126984126984;
    p = p * r + 0.001388888888888889;
    p = p * r + 0.008333333333333333;
    p = p * r + 0.041666666666666664;
    p = p * r + 0.16666666666666666;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    uint64_t bits, scale_bits;
    double scale;
    memcpy(&bits, &nm, sizeof bits);
    scale_bits = (bits + 1023) << 52;
    memcpy(&scale, &scale_bits, sizeof scale);
    return keep ? p * scale : 0.0;
}

/* sum of exp(x - xmax) over the row, in double, by the polynomial (libm's exp costs ~20 ns
 * a call: a millisecond a row at vocab 49152); terms with x - xmax < D_MIN count 0, which
 * moves the sum by less than vocab * exp(-40) relative, far below float32's rounding of
 * the logprobs. SUM_LANES partial sums (a fixed order, so the result does not depend on
 * the build), which lets the compiler vectorise without reassociating. */
#define SUM_LANES 8
MB_VECTOR_CLONES
static double sum_exp(const float *restrict x, int32_t vocab, double xmax) {
    double acc[SUM_LANES] = {0};
    int32_t i = 0;
    for (; i + SUM_LANES <= vocab; i += SUM_LANES)
        for (int j = 0; j < SUM_LANES; j++) acc[j] += exp_or_zero((double)x[i + j] - xmax);
    double sum = 0.0;
    for (; i < vocab; i++) sum += exp_or_zero((double)x[i] - xmax);
    for (int j = 0; j < SUM_LANES; j++) sum += acc[j];
    return sum;
}

/* Log probabilities of one row, for the API's logprobs: log-softmax in double of the
 * logits exactly as the sampler left them (penalised, NaN -> -inf, before temperature
 * and the filters): lse = xmax + log(sum exp(x - xmax)) (sum_exp), logprob(i) = float(x[i] - lse);
 * -inf and NaN logits give -inf, and a row with no finite logit gives -inf everywhere.
 * The top_n best tokens in (x descending, id ascending) order, kept in a small sorted
 * list: a later id enters only with a strictly larger x, so ties keep the lower id. */
static void logprobs_row(const float *x, int32_t vocab, int32_t id, int32_t top_n,
                         float *out_lp, int32_t *top_ids, float *top_lp) {
    double xmax = -INFINITY;
    for (int32_t i = 0; i < vocab; i++)
        if (x[i] > xmax) xmax = x[i];
    double lse = -INFINITY;
    if (xmax > -INFINITY) lse = xmax + log(sum_exp(x, vocab, xmax));
    float xi = x[id];
    *out_lp = (xi > -INFINITY && lse > -INFINITY) ? (float)((double)xi - lse) : -INFINITY;
    int32_t n = 0;
    float best[MB_MAX_TOP_LOGPROBS];
    for (int32_t i = 0; i < vocab && top_n > 0; i++) {
        float v = x[i] > -INFINITY ? x[i] : -INFINITY; /* NaN ranks as -inf */
        if (n == top_n && !(v > best[n - 1])) continue;
        int32_t j = n < top_n ? n++ : n - 1; /* the free place, or the worst one's */
        while (j > 0 && best[j - 1] < v) { best[j] = best[j - 1]; top_ids[j] = top_ids[j - 1]; j--; }
        best[j] = v;
        top_ids[j] = i;
    }
    for (int32_t j = 0; j < n; j++)
        top_lp[j] = (best[j] > -INFINITY && lse > -INFINITY) ? (float)((double)best[j] - lse) : -INFINITY;
}

int mb_logprobs(const float *logits, int32_t rows, int32_t vocab, const int32_t *ids, int32_t top_n,
                float *out_logprobs, int32_t *out_top_ids, float *out_top_logprobs) {
    if (rows < 0 || vocab < 1 || vocab > MB_MAX_VOCAB) return MB_EINVAL;
    if (top_n < 0 || top_n > MB_MAX_TOP_LOGPROBS || top_n > vocab) return MB_EINVAL;
    for (int32_t r = 0; r < rows; r++)
        if (ids[r] < 0 || ids[r] >= vocab) return MB_EINVAL;
    for (int32_t r = 0; r < rows; r++)
        logprobs_row(logits + (size_t)r * (size_t)vocab, vocab, ids[r], top_n, &out_logprobs[r],
                     out_top_ids + (size_t)r * (size_t)top_n, out_top_logprobs + (size_t)r * (size_t)top_n);
    return MB_OK;
}
