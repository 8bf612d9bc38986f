/* bfloat16 linear layers: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]).
 *
 * Why it exists: oneDNN's bf16 matmul on a single row reads weights at about 27 GB/s on
 * this project's CPU and rounds a single row differently from two or more, so decode
 * paid for padding rows as well. Here every output is one float32 accumulator that
 * walks k in pairs, in the same order whatever the number of rows, the tile a row
 * lands in, or the thread that runs it: a row's result cannot depend on its batch.
 *
 * The step, per output and pair of inputs, is AVX512-BF16's vdpbf16ps, whose documented
 * semantics the portable path below repeats exactly:
 *     acc = acc + x[2p+1] * w[2p+1];  acc = acc + x[2p] * w[2p]
 * (products of two bfloat16 are exact in float32; each add rounds to nearest even;
 * denormal inputs and sums are zero). The result, plus bias, is rounded once to
 * bfloat16 (nearest even) or stored as float32. mashbox/native_ref.py states the same
 * rule in numpy; the tests check all three agree bit for bit where every product stays
 * in float32's normal range (the hardware handles underflowing and overflowing products
 * in its own way) and up to the sign of a zero.
 *
 * Packed weight layout (mb_bf16_pack): tiles of MB_TILE outputs, each tile
 * [k / 2][MB_TILE][2] bfloat16, so that one tile is one forward stream of
 * 3 x 64 bytes per pair; outputs past n are zero.
 *
 * Threads: work items (a chunk of rows x one tile) are taken in runs (mb_worker) by
 * every thread of the caller's OpenMP pool, entered through the libgomp function the
 * caller passes (the pool torch already runs, so no second set of threads competes for
 * the cores); NULL runs on the calling thread.
 *
 * The file also holds what the CPU decoder calls between its linear layers on bfloat16
 * rows, with the same rounding helpers: RMS norm (mb_bf16_rmsnorm) and rope with the
 * K/V cache write (mb_bf16_rope_kv), the MLP's silu_mul. One call each instead of several
 * torch ops is most of a decode step's non-memory time saved; a prefill chunk's rows are
 * split between the pool's threads (mb_rows), each row's arithmetic unchanged.
 */
#include "mashbox.h"
#include "bf16.h"

#include <math.h>
#include <string.h>

#define MB_NORM_LANES 8 /* partial sums of squares in mb_bf16_rmsnorm */
#define MB_MAX_HEAD_DIM 1024

#define MB_BLOCK 16 /* outputs per float32 vector */
#define MB_VECS 3   /* float32 vectors per tile */
#define MB_TILE (MB_VECS * MB_BLOCK) /* outputs per tile: 48 */
#define MB_MR 8     /* rows per micro-tile: 8 x 3 accumulators + 3 weights + 1 input, so a
                     * decode step of 8 rows reads each tile once */
#define MB_CHUNK 48 /* rows per work item: their inputs stay in L2 while tiles stream */

struct mb_job {
    const uint16_t *x;
    int64_t ldx;
    int32_t m, n, k;
    const uint16_t *packed;
    const float *bias;
    void *y;
    int64_t ldy;
    int32_t y_mode;
    int32_t tiles, chunks;
    int64_t items;
    int64_t next; /* the next work item: atomically advanced */
    int64_t threads;
    void (*run)(const struct mb_job *, int32_t m0, int32_t rows, int32_t tile);
};

size_t mb_bf16_packed_bytes(int32_t n, int32_t k) {
    if (n < 1 || k < 2 || k % 2)
        return 0;
    size_t tiles = ((size_t)n + MB_TILE - 1) / MB_TILE;
    return tiles * (size_t)k * MB_TILE * sizeof(uint16_t);
}

int mb_bf16_pack(const uint16_t *w, int32_t n, int32_t k, uint16_t *packed) {
    if (n < 1 || k < 2 || k % 2)
        return MB_EINVAL;
    int32_t tiles = (n + MB_TILE - 1) / MB_TILE, pairs = k / 2;
    for (int32_t t = 0; t < tiles; t++) {
        uint16_t *dst = packed + (size_t)t * pairs * MB_TILE * 2;
        for (int32_t p = 0; p < pairs; p++)
            for (int32_t j = 0; j < MB_TILE; j++) {
                int32_t row = t * MB_TILE + j;
                uint16_t *d = dst + ((size_t)p * MB_TILE + j) * 2;
                if (row < n) {
                    d[0] = w[(size_t)row * k + 2 * p];
                    d[1] = w[(size_t)row * k + 2 * p + 1];
                } else {
                    d[0] = d[1] = 0;
                }
            }
    }
    return MB_OK;
}

/* ---- portable path: the rule, one output at a time ---- */

static void mb_run_portable(const struct mb_job *j, int32_t m0, int32_t rows, int32_t t) {
    int32_t pairs = j->k / 2;
    const uint16_t *wt = j->packed + (size_t)t * pairs * MB_TILE * 2;
    for (int32_t r = m0; r < m0 + rows; r++) {
        const uint16_t *x = j->x + (size_t)r * j->ldx;
        for (int32_t c = 0; c < MB_TILE && t * MB_TILE + c < j->n; c++) {
            int32_t col = t * MB_TILE + c;
            float acc = 0.0f;
            for (int32_t p = 0; p < pairs; p++) {
                const uint16_t *w = wt + ((size_t)p * MB_TILE + c) * 2;
                float odd = mb_flush(mb_bits_f32((uint32_t)x[2 * p + 1] << 16)) *
                            mb_flush(mb_bits_f32((uint32_t)w[1] << 16));
                acc = mb_flush(acc + odd);
                float even = mb_flush(mb_bits_f32((uint32_t)x[2 * p] << 16)) *
                             mb_flush(mb_bits_f32((uint32_t)w[0] << 16));
                acc = mb_flush(acc + even);
            }
            mb_y_store_at(j->y, j->y_mode, j->ldy, j->bias, r, col, acc);
        }
    }
}

/* ---- AVX512-BF16 path ---- */

#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 10))
#define MB_HAVE_AVX512BF16 1
#include <immintrin.h>

#define MB_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

/* MR rows x one tile; MR is a constant in each instantiation, so acc stays in registers. */
static inline __attribute__((always_inline)) MB_TARGET void
mb_tile_avx512(const struct mb_job *j, int32_t m0, int32_t t, const int MR) {
    int32_t pairs = j->k / 2;
    const uint16_t *wt = j->packed + (size_t)t * pairs * MB_TILE * 2;
    __m512 acc[MB_MR][MB_VECS];
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < MB_VECS; v++)
            acc[r][v] = _mm512_setzero_ps();
    const uint16_t *x = j->x + (size_t)m0 * j->ldx;
    for (int32_t p = 0; p < pairs; p++) {
        const uint16_t *w = wt + (size_t)p * MB_TILE * 2;
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
        __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 32);
        __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64);
        for (int r = 0; r < MR; r++) {
            int32_t pair;
            memcpy(&pair, x + (size_t)r * j->ldx + 2 * p, 4);
            __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xb, w2);
        }
    }
    for (int v = 0; v < MB_VECS; v++) {
        int32_t col = t * MB_TILE + v * MB_BLOCK;
        if (col >= j->n)
            break;
        int32_t lanes = j->n - col < MB_BLOCK ? j->n - col : MB_BLOCK;
        __mmask16 mask = (__mmask16)((1u << lanes) - 1u);
        __m512 b = j->bias ? _mm512_maskz_loadu_ps(mask, j->bias + col) : _mm512_setzero_ps();
        for (int r = 0; r < MR; r++) {
            __m512 out = j->bias ? _mm512_add_ps(acc[r][v], b) : acc[r][v];
            size_t at = (size_t)(m0 + r) * j->ldy + col;
            if (j->y_mode == MB_Y_F32) {
                _mm512_mask_storeu_ps((float *)j->y + at, mask, out);
                continue;
            }
            if (j->y_mode == MB_Y_ADD_BF16) { /* out = y + out: y's bfloat16 widened exactly */
                __m256i old = _mm256_maskz_loadu_epi16(mask, (uint16_t *)j->y + at);
                __m512 widened = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(old), 16));
                out = _mm512_add_ps(widened, out);
            }
            _mm256_mask_storeu_epi16((uint16_t *)j->y + at, mask, (__m256i)_mm512_cvtneps_pbh(out));
        }
    }
}

static MB_TARGET void mb_run_avx512(const struct mb_job *j, int32_t m0, int32_t rows, int32_t t) {
    int32_t r = 0;
    for (; r + MB_MR <= rows; r += MB_MR)
        mb_tile_avx512(j, m0 + r, t, MB_MR);
    switch (rows - r) {
    case 7: mb_tile_avx512(j, m0 + r, t, 7); break;
    case 6: mb_tile_avx512(j, m0 + r, t, 6); break;
    case 5: mb_tile_avx512(j, m0 + r, t, 5); break;
    case 4: mb_tile_avx512(j, m0 + r, t, 4); break;
    case 3: mb_tile_avx512(j, m0 + r, t, 3); break;
    case 2: mb_tile_avx512(j, m0 + r, t, 2); break;
    case 1: mb_tile_avx512(j, m0 + r, t, 1); break;
    default: break;
    }
}

static int mb_has_avx512bf16(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
}
#else
#define MB_HAVE_AVX512BF16 0
#endif

/* ---- AVX2 path: vdpbf16ps emulated ----
 *
 * A packed pair word (w[2p] its low half, w[2p+1] its high half) is two float32 without
 * arithmetic: the odd element is the word with its low half cleared, the even one the
 * word shifted up 16 bits; x's pair likewise. Their products are exact, so a fused
 * multiply-add makes each of the rule's adds with its one rounding, odd first. DAZ and
 * FTZ, set in MXCSR while a tile accumulates (and restored before its stores), read
 * denormal inputs as zero and flush denormal sums as vdpbf16ps does. */
#if defined(__x86_64__) && (defined(__clang__) || defined(__GNUC__))
#define MB_HAVE_AVX2 1
#include <immintrin.h>

#define MB_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define MB_AVX2_VECS (MB_TILE / 8) /* 8 outputs per float32 ymm: 6 a tile */
#define MB_AVX2_MR 2               /* rows per sweep: 12 accumulators of 16 ymm */

/* MR rows x one tile, as mb_tile_avx512; MR a constant in each instantiation. */
static inline __attribute__((always_inline)) MB_TARGET_AVX2 void
mb_tile_avx2(const struct mb_job *j, int32_t m0, int32_t t, const int MR) {
    int32_t pairs = j->k / 2;
    const uint16_t *wt = j->packed + (size_t)t * pairs * MB_TILE * 2;
    const uint16_t *x = j->x + (size_t)m0 * j->ldx;
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    __m256 acc[MB_AVX2_MR][MB_AVX2_VECS];
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < MB_AVX2_VECS; v++)
            acc[r][v] = _mm256_setzero_ps();
    unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | MB_MXCSR_DAZ_FTZ);
    for (int32_t p = 0; p < pairs; p++) {
        const uint16_t *w = wt + (size_t)p * MB_TILE * 2;
        __m256 xo[MB_AVX2_MR], xe[MB_AVX2_MR];
        for (int r = 0; r < MR; r++) {
            int32_t pair;
            memcpy(&pair, x + (size_t)r * j->ldx + 2 * p, 4);
            __m256i xb = _mm256_set1_epi32(pair);
            xo[r] = _mm256_castsi256_ps(_mm256_and_si256(xb, high));
            xe[r] = _mm256_castsi256_ps(_mm256_slli_epi32(xb, 16));
        }
        for (int v = 0; v < MB_AVX2_VECS; v++) {
            __m256i wv = _mm256_loadu_si256((const __m256i *)(w + 16 * v));
            __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(wv, high));
            __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
            for (int r = 0; r < MR; r++) {
                acc[r][v] = _mm256_fmadd_ps(xo[r], wo, acc[r][v]);
                acc[r][v] = _mm256_fmadd_ps(xe[r], we, acc[r][v]);
            }
        }
    }
    _mm_setcsr(csr);
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < MB_AVX2_VECS; v++) {
            float out[8];
            _mm256_storeu_ps(out, acc[r][v]);
            for (int i = 0; i < 8; i++) {
                int32_t col = t * MB_TILE + v * 8 + i;
                if (col < j->n)
                    mb_y_store_at(j->y, j->y_mode, j->ldy, j->bias, m0 + r, col, out[i]);
            }
        }
}

static MB_TARGET_AVX2 void mb_run_avx2(const struct mb_job *j, int32_t m0, int32_t rows, int32_t t) {
    int32_t r = 0;
    for (; r + MB_AVX2_MR <= rows; r += MB_AVX2_MR)
        mb_tile_avx2(j, m0 + r, t, MB_AVX2_MR);
    if (r < rows)
        mb_tile_avx2(j, m0 + r, t, 1);
}

#else
#define MB_HAVE_AVX2 0
#endif

int mb_avx2_supported(void) {
#if MB_HAVE_AVX2
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                 __builtin_cpu_supports("f16c");
    }
    return cached;
#else
    return 0;
#endif
}

int32_t mb_bf16_kernel(void) {
    static int cached = -1; /* a CPU feature: the same answer on every call */
    if (cached < 0) {
        cached = MB_KERNEL_PORTABLE;
#if MB_HAVE_AVX512BF16
        if (mb_has_avx512bf16())
            cached = MB_KERNEL_AVX512BF16;
#endif
#if MB_HAVE_AVX2
        if (cached == MB_KERNEL_PORTABLE && mb_avx2_supported())
            cached = MB_KERNEL_AVX2;
#endif
    }
    return cached;
}

/* Guided handout: each take is a contiguous run of remaining / (2 * threads) items, so a
 * thread streams long runs of neighbouring tiles (one memory stream for the hardware
 * prefetcher) and the runs shrink toward the end, so a thread the OS delays holds up
 * little. Measured on this project's CPU, the default model's 121 decode linears: one
 * item at a time 51 GB/s, guided 60 GB/s, against a 63 GB/s read stream. */
static void mb_worker(void *data) {
    struct mb_job *j = (struct mb_job *)data;
    for (;;) {
        int64_t first, take = mb_take_guided(&j->next, j->items, j->threads, &first);
        if (take == 0)
            return;
        for (int64_t i = first; i < first + take; i++) {
            int32_t c = (int32_t)(i / j->tiles), t = (int32_t)(i % j->tiles);
            int32_t m0 = c * MB_CHUNK;
            int32_t rows = j->m - m0 < MB_CHUNK ? j->m - m0 : MB_CHUNK;
            j->run(j, m0, rows, t);
        }
    }
}

int mb_bf16_linear(const uint16_t *x, int64_t ldx, int32_t m, const uint16_t *packed,
                   int32_t n, int32_t k, const float *bias, void *y, int32_t y_mode,
                   int64_t ldy, int32_t kernel, void *parallel, int32_t threads) {
    if (m < 1 || n < 1 || k < 2 || k % 2 || ldx < k || ldy < n || y_mode < MB_Y_BF16 ||
        y_mode > MB_Y_ADD_BF16)
        return MB_EINVAL;
    struct mb_job j;
    memset(&j, 0, sizeof j);
    j.x = x, j.ldx = ldx, j.m = m, j.n = n, j.k = k, j.packed = packed, j.bias = bias;
    j.y = y, j.ldy = ldy, j.y_mode = y_mode;
    if (kernel == MB_KERNEL_PORTABLE)
        j.run = mb_run_portable;
#if MB_HAVE_AVX512BF16
    else if (kernel == MB_KERNEL_AVX512BF16 && mb_bf16_kernel() == MB_KERNEL_AVX512BF16)
        j.run = mb_run_avx512;
#endif
#if MB_HAVE_AVX2
    else if (kernel == MB_KERNEL_AVX2 && mb_avx2_supported())
        j.run = mb_run_avx2;
#endif
    else
        return MB_EINVAL;
    j.tiles = (n + MB_TILE - 1) / MB_TILE;
    j.chunks = (m + MB_CHUNK - 1) / MB_CHUNK;
    j.items = (int64_t)j.tiles * j.chunks;
    mb_run_guided(mb_worker, &j, &j.threads, j.items, parallel, threads);
    return MB_OK;
}

int mb_bf16_gather_rows(const uint16_t *packed, int32_t n, int32_t k, const int64_t *ids,
                        int32_t count, uint16_t *out) {
    if (n < 1 || k < 2 || k % 2 || count < 0)
        return MB_EINVAL;
    for (int32_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= n)
            return MB_EINVAL;
    int32_t pairs = k / 2;
    for (int32_t i = 0; i < count; i++) {
        int32_t t = (int32_t)(ids[i] / MB_TILE), lane = (int32_t)(ids[i] % MB_TILE);
        const uint16_t *src = packed + ((size_t)t * pairs * MB_TILE + lane) * 2;
        uint16_t *dst = out + (size_t)i * k;
        for (int32_t p = 0; p < pairs; p++) { /* one row's pairs lie MB_TILE pairs apart */
            dst[2 * p] = src[(size_t)p * MB_TILE * 2];
            dst[2 * p + 1] = src[(size_t)p * MB_TILE * 2 + 1];
        }
    }
    return MB_OK;
}

/* Row-wise work on the caller's pool (rmsnorm, rope_kv, silu_mul): runs of MB_ROWS_RUN
 * rows handed out one at a time; a row's arithmetic is the same whichever thread runs
 * it, so its bits are too. A call under MB_ROWS_PARALLEL elements (a decode step's few
 * rows) stays on the calling thread, where waking the pool costs more than the work. */
#define MB_ROWS_RUN 16
#define MB_ROWS_PARALLEL 32768

struct mb_rows_job {
    int32_t m;
    int64_t next; /* the next run: atomically advanced */
    void (*run)(const void *args, int32_t r0, int32_t r1);
    const void *args;
};

static void mb_rows_worker(void *data) {
    struct mb_rows_job *j = (struct mb_rows_job *)data;
    int64_t runs = ((int64_t)j->m + MB_ROWS_RUN - 1) / MB_ROWS_RUN;
    for (;;) {
        int64_t run = mb_take_one(&j->next);
        if (run >= runs)
            return;
        int32_t r0 = (int32_t)(run * MB_ROWS_RUN);
        j->run(j->args, r0, j->m - r0 < MB_ROWS_RUN ? j->m : r0 + MB_ROWS_RUN);
    }
}

static void mb_rows(int32_t m, int64_t elements, void (*run)(const void *, int32_t, int32_t), const void *args,
                    void *parallel, int32_t threads) {
#ifdef MB_ATOMICS
    if (parallel != NULL && threads > 1 && m > MB_ROWS_RUN && elements >= MB_ROWS_PARALLEL) {
        struct mb_rows_job j = {m, 0, run, args};
        ((mb_parallel_fn)parallel)(mb_rows_worker, &j, (unsigned)threads, 0);
        return;
    }
#else
    (void)elements, (void)parallel, (void)threads;
#endif
    run(args, 0, m);
}

struct mb_norm_args {
    const uint16_t *x;
    int64_t ldx;
    int32_t k;
    const uint16_t *w;
    float eps;
    uint16_t *out;
    int64_t ldo;
};

MB_CLONES
static void mb_rmsnorm_rows(const void *args, int32_t r0, int32_t r1) {
    const struct mb_norm_args *a = (const struct mb_norm_args *)args;
    int32_t k = a->k;
    for (int32_t r = r0; r < r1; r++) {
        const uint16_t *xr = a->x + (size_t)r * a->ldx;
        uint16_t *o = a->out + (size_t)r * a->ldo;
        double lane[MB_NORM_LANES] = {0};
        int32_t i = 0;
        for (; i + MB_NORM_LANES <= k; i += MB_NORM_LANES) /* element i into lane i % 8 */
            for (int l = 0; l < MB_NORM_LANES; l++) {
                double v = (double)mb_bf16_f32(xr[i + l]);
                lane[l] += v * v;
            }
        for (; i < k; i++) {
            double v = (double)mb_bf16_f32(xr[i]);
            lane[i % MB_NORM_LANES] += v * v;
        }
        double ss = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
        float rstd = (float)(1.0 / sqrt(ss / (double)k + (double)a->eps));
        for (int32_t i = 0; i < k; i++)
            o[i] = mb_round_bf16((mb_bf16_f32(xr[i]) * rstd) * mb_bf16_f32(a->w[i]));
    }
}

int mb_bf16_rmsnorm(const uint16_t *x, int64_t ldx, int32_t m, int32_t k, const uint16_t *w,
                    float eps, uint16_t *out, int64_t ldo, void *parallel, int32_t threads) {
    if (m < 0 || k < 1 || ldx < k || ldo < k)
        return MB_EINVAL;
    struct mb_norm_args a = {x, ldx, k, w, eps, out, ldo};
    mb_rows(m, (int64_t)m * k, mb_rmsnorm_rows, &a, parallel, threads);
    return MB_OK;
}

struct mb_rope_args {
    uint16_t *qkv;
    int64_t ldq;
    int32_t heads, kv_heads, head_dim;
    const uint16_t *cos, *sin;
    const int64_t *positions, *slots;
    uint16_t *k_cache, *v_cache;
    int32_t capacity;
};

static void mb_rope_kv_rows(const void *args, int32_t r0, int32_t r1) {
    const struct mb_rope_args *a = (const struct mb_rope_args *)args;
    int32_t heads = a->heads, kv_heads = a->kv_heads, head_dim = a->head_dim, half = head_dim / 2;
    size_t head_stride = (size_t)a->capacity * head_dim, slot_stride = (size_t)kv_heads * head_stride;
    for (int32_t i = r0; i < r1; i++) {
        uint16_t *row = a->qkv + (size_t)i * a->ldq;
        const uint16_t *c = a->cos + (size_t)a->positions[i] * head_dim;
        const uint16_t *s = a->sin + (size_t)a->positions[i] * head_dim;
        size_t at = (size_t)a->slots[i] * slot_stride + (size_t)a->positions[i] * head_dim;
        for (int32_t h = 0; h < heads + kv_heads; h++) {
            uint16_t *x = row + (size_t)h * head_dim;
            uint16_t *dst = h < heads ? x : a->k_cache + at + (size_t)(h - heads) * head_stride;
            float rot[MB_MAX_HEAD_DIM];
            for (int32_t d = 0; d < head_dim; d++) {
                float other = mb_bf16_f32(x[d < half ? d + half : d - half]);
                rot[d] = mb_bf16_f32(x[d]) * mb_bf16_f32(c[d]) + other * mb_bf16_f32(s[d]);
            }
            for (int32_t d = 0; d < head_dim; d++)
                dst[d] = mb_round_bf16(rot[d]);
        }
        const uint16_t *v = row + (size_t)(heads + kv_heads) * head_dim;
        for (int32_t h = 0; h < kv_heads; h++)
            memcpy(a->v_cache + at + (size_t)h * head_stride, v + (size_t)h * head_dim,
                   (size_t)head_dim * sizeof(uint16_t));
    }
}

int mb_bf16_rope_kv(uint16_t *qkv, int64_t ldq, int32_t t, int32_t heads, int32_t kv_heads,
                    int32_t head_dim, const uint16_t *cos, const uint16_t *sin,
                    const int64_t *positions, const int64_t *slots, uint16_t *k_cache,
                    uint16_t *v_cache, int32_t n_slots, int32_t capacity, int32_t table_rows,
                    void *parallel, int32_t threads) {
    if (t < 0 || heads < 1 || kv_heads < 1 || head_dim < 2 || head_dim % 2 || head_dim > MB_MAX_HEAD_DIM ||
        ldq < (int64_t)(heads + 2 * kv_heads) * head_dim || n_slots < 1 || capacity < 1)
        return MB_EINVAL;
    for (int32_t i = 0; i < t; i++)
        if (positions[i] < 0 || positions[i] >= capacity || positions[i] >= table_rows ||
            slots[i] < 0 || slots[i] >= n_slots)
            return MB_EINVAL;
    struct mb_rope_args a = {qkv, ldq, heads, kv_heads, head_dim, cos, sin, positions, slots,
                             k_cache, v_cache, capacity};
    /* two rows never write one place: a row's q is its own, and its K/V go to its own
     * (slot, position), which the caller keeps distinct within a call */
    mb_rows(t, (int64_t)t * (heads + 2 * kv_heads) * head_dim, mb_rope_kv_rows, &a, parallel, threads);
    return MB_OK;
}

struct mb_silu_args {
    const uint16_t *x;
    int64_t ldx;
    int32_t n;
    uint16_t *out;
    int64_t ldo;
};

/* silu(gate) * up, rounded once; silu(g) = g / (1 + e^-g) with e = mb_exp(-|g|) so the
 * exponent is never positive: g / (1 + e) for g >= 0, (g * e) / (1 + e) below. */
MB_CLONES
static void mb_silu_mul_rows(const void *args, int32_t r0, int32_t r1) {
    const struct mb_silu_args *a = (const struct mb_silu_args *)args;
    int32_t n = a->n;
    for (int32_t r = r0; r < r1; r++) {
        const uint16_t *gate = a->x + (size_t)r * a->ldx, *up = gate + n;
        uint16_t *o = a->out + (size_t)r * a->ldo;
        for (int32_t i = 0; i < n; i++) {
            float g = mb_bf16_f32(gate[i]);
            float e = mb_exp(-fabsf(g));
            float d = 1.0f + e;
            float s = g >= 0.0f ? g / d : (g * e) / d;
            o[i] = mb_round_bf16(s * mb_bf16_f32(up[i]));
        }
    }
}

#if MB_HAVE_AVX512BF16
/* mb_silu_mul_rows 16 outputs at a time: the same IEEE operations in the same order
 * (mb_exp's as bf16.h writes them, the division exact, mb_round_bf16's bit steps), so
 * the same bits; the scalar clones leave mb_exp unvectorised (a prefill's largest
 * elementwise op: [tokens, intermediate] per layer). */
static MB_TARGET void mb_silu_mul_rows_avx512(const void *args, int32_t r0, int32_t r1) {
    const struct mb_silu_args *a = (const struct mb_silu_args *)args;
    int32_t n = a->n;
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512i expo = _mm512_set1_epi32(0x7f800000), sign = _mm512_set1_epi32((int32_t)0x80000000u);
    const __m512i abs = _mm512_set1_epi32(0x7fffffff);
    for (int32_t r = r0; r < r1; r++) {
        const uint16_t *gate = a->x + (size_t)r * a->ldx, *up = gate + n;
        uint16_t *o = a->out + (size_t)r * a->ldo;
        for (int32_t i = 0; i < n; i += 16) {
            __mmask16 k = n - i >= 16 ? (__mmask16)0xffffu : (__mmask16)((1u << (n - i)) - 1u);
            __m512 g = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, gate + i)), 16));
            __m512 u = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, up + i)), 16));
            __m512 e = mb_exp16(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(g), sign))); /* mb_exp(-|g|) */
            __m512 d = _mm512_add_ps(one, e);
            __mmask16 pos = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ);
            __m512 sv = _mm512_div_ps(_mm512_mask_blend_ps(pos, _mm512_mul_ps(g, e), g), d);
            /* mb_round_bf16 of s * up */
            __m512i b = _mm512_castps_si512(_mm512_mul_ps(sv, u));
            __mmask16 den = _mm512_testn_epi32_mask(b, expo);
            b = _mm512_mask_and_epi32(b, den, b, sign);
            __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, abs), expo);
            __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
            __m512i rn = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), odd), 16);
            __m512i qn = _mm512_or_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40));
            _mm256_mask_storeu_epi16(o + i, k, _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rn, qn)));
        }
    }
}
#endif

int mb_bf16_silu_mul(const uint16_t *x, int64_t ldx, int32_t m, int32_t n, uint16_t *out,
                     int64_t ldo, void *parallel, int32_t threads) {
    if (m < 0 || n < 1 || ldx < 2 * (int64_t)n || ldo < n)
        return MB_EINVAL;
    struct mb_silu_args a = {x, ldx, n, out, ldo};
    void (*run)(const void *, int32_t, int32_t) = mb_silu_mul_rows;
#if MB_HAVE_AVX512BF16
    if (mb_bf16_kernel() == MB_KERNEL_AVX512BF16)
        run = mb_silu_mul_rows_avx512;
#endif
    mb_rows(m, (int64_t)m * n, run, &a, parallel, threads);
    return MB_OK;
}
