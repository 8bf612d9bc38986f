/* Prompt rows of the GGUF linears on AMX tiles: y[r, c] = x[r, :k] . dequant(w row c)
 * (+ bias[c]), for the rows of a prefill chunk, on every block type csrc/quant.c and
 * csrc/kquant.c read (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K).
 *
 * Why it exists: at prefill the vdpbf16ps kernels are compute bound (a few hundred
 * GFLOP/s on two cores, against llama.cpp's int8 dot products on the same file); one
 * TDPBF16PS does 16 x 16 x 32 multiply-adds, 16 times a vdpbf16ps's work per issue.
 * Decode rows stay on the vdpbf16ps kernels: they read the weights once per step, and at
 * one row the widening into tiles alone costs more than the whole vdpbf16ps kernel (the
 * few-rows path below, timed at 1 and 8 rows), while a decode row's rule cannot change
 * with the batch's size without breaking batch invariance.
 *
 * The rule, per output (row r of x, output c), "the tile rule" (mashbox/native_ref.py's
 * q_linear_tiles states it in numpy). The weight row is cut into sub-blocks s of L
 * elements (L = 32; Q6_K: 16), each w = scale_s * q + min_s with q a small integer,
 * exact in bfloat16:
 *   Q8_0 q int8, scale d;  Q4_0 nib - 8, d;  Q5_0 (nib | hbit << 4) - 16, d;
 *   Q4_1, Q5_1 the unsigned integer, d, min m;
 *   Q4_K, Q5_K q, scale d * sc_j, min -(dmin * mn_j) (both exact in float32);
 *   Q6_K u - 32, scale d * sc_g.
 * acc = 0; for each sub-block in order:
 *     P = tdp(x_s, q_s);  acc = fma(P, scale_s, acc)
 *     with a min: S = tdp(x_s, 1);  acc = fma(S, min_s, acc)
 * then acc + bias, y as mb_bf16_linear writes it. tdp(a, b) is one TDPBF16PS from a zero
 * tile: E = +0, E = E + a[2p] b[2p] over the pairs p in order, O the same over the odd
 * elements, P = E + O (exact products; every add rounded to nearest even; bfloat16
 * denormals read as zero and float32 denormal sums flushed to zero). The hardware was
 * probed for that order (tests/test_native_prompt_rules.py compares bits on random inputs). A
 * row's bits depend on its own x row, weight row, bias and y: never on m, the other rows
 * or the threads. The bits differ from the vdpbf16ps rule's (another order of the same
 * exact products), which is why the decoder sends a row kind to one rule only: prompt
 * rows here, decode rows there (mashbox/model/linear.py).
 *
 * How: x is first packed in tile order (each 16-row x tile one contiguous KB: x's own
 * rows, k * 2 bytes apart, all fall in one L1 set when k is a multiple of 2048). A work
 * item is 32 outputs x up to MB_AMX_ROWS rows. Its weights are widened, MB_WIDE_CHUNK
 * elements at a time, into bfloat16 (each output's chunk in element order, by SIMD code
 * per block type), then transposed into the tile B layout (pair p of output o at dword
 * [p][o]; 16 KB, in L1), the next chunk's blocks prefetched meanwhile. Per pair of row
 * tiles and sub-block: two x tiles times two weight tiles, four TDPBF16PS (each tile
 * load used twice: the loads, not the multiply-adds, bound one product at a time), the
 * four 16 x 16 results stored to L1 and folded into float32 accumulators [rows][32]
 * with the outputs' scale vectors. The S sums of x (formats with a min) are made once
 * per call with a tile of ones, in the caller's thread. Threads: the caller's OpenMP
 * pool, each thread loading the tile configuration before its items and releasing it
 * after. Runs of up to MB_AMX_FEW rows (a short turn after a cached prefix) swap the
 * operands instead: see "few rows" below.
 */
#define _GNU_SOURCE /* syscall() */
#include "mashbox.h"
#include "bf16.h"
#include "ggml_blocks.h"
#include "widen.h"

#include <stdlib.h>
#include <string.h>

#define MB_AMX_ROWS 512   /* rows per work item (64 KB of parked accumulators): each output's
                           * blocks widened once for a 512-token prefill chunk */
#define MB_AMX_FEW 16     /* rows up to which x is the B operand and the weights A: short prompt runs */


#if MB_WIDE /* csrc/widen.h's widening: the compilers that know AMX too */
#define MB_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define MB_AMX 0
#endif

#if MB_AMX

#define MB_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,f16c")))
#define MB_AMX_INLINE static inline __attribute__((always_inline)) MB_AMX_TARGET

#define MB_ARCH_REQ_XCOMP_PERM 0x1023
#define MB_XFEATURE_XTILEDATA 18

static int mb_amx_state; /* 0 unknown, 1 usable, -1 not */

int mb_amx_supported(void) {
    int s = __atomic_load_n(&mb_amx_state, __ATOMIC_ACQUIRE);
    if (s == 0) {
        unsigned a, b, c, d;
        int cpu = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1u) && (d >> 24 & 1u) &&
                  (b >> 16 & 1u) && (b >> 30 & 1u); /* AMX-BF16, AMX-TILE, AVX512F, AVX512BW */
        int bf16 = cpu && __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 5 & 1u); /* AVX512-BF16 */
        /* Linux hands out the tile state only to a process that asks (5.16+) */
        s = bf16 && syscall(SYS_arch_prctl, MB_ARCH_REQ_XCOMP_PERM, MB_XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&mb_amx_state, s, __ATOMIC_RELEASE);
    }
    return s == 1;
}

/* The tile configuration (palette 1): tiles 0..3 results C (16 x 16 float32), 4, 5 x
 * tiles A (16 rows x L bfloat16), 6, 7 weight tiles B (L / 2 pair rows x 16 outputs). */
struct mb_amx_cfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

MB_AMX_INLINE void mb_amx_configure(int32_t sub) {
    struct mb_amx_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 4; t++)
        cfg.rows[t] = 16, cfg.colsb[t] = 64;
    for (int t = 4; t < 6; t++)
        cfg.rows[t] = 16, cfg.colsb[t] = (uint16_t)(2 * sub);
    for (int t = 6; t < 8; t++)
        cfg.rows[t] = (uint8_t)(sub / 2), cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

struct mb_amx_job {
    struct mb_q_call a;
    struct mb_wide_format fmt;
    const uint16_t *xp; /* x packed in tile order (mb_amx_pack) */
    const float *sx;    /* [m, k / L] S sums of x (formats with a min), else NULL */
    const uint32_t *xb; /* few rows: x in B pairs, dword [e / 2][m] = (x[r, e], x[r, e + 1]) */
    const float *sb;    /* few rows: [k / 32][16] S sums of x (formats with a min), else NULL */
    int32_t lane_out[16 * MB_AMX_FEW], lane_row[16 * MB_AMX_FEW]; /* few rows: flat o * m + r's parts */
    int32_t groups, chunks;
    int64_t items, next, threads;
};

/* x [m, k] (rows ldx apart) -> xp in tile order: tile t (rows 16t .. 16t + 15, past m
 * zero) and sub-block s (L elements) at ((t * k / L) + s) * 16 * L, its 16 rows L apart:
 * each A tile one contiguous run. Straight from x, a tile's rows are ldx * 2 bytes apart,
 * which for k a multiple of 2048 puts all 16 in one L1 set (4 KB aliasing): every tile
 * load missed L1. tiles: m / 16 rounded up to even (the items take tiles in pairs). */
static void mb_amx_pack(const uint16_t *x, int64_t ldx, int32_t m, int32_t k, int32_t L, int32_t tiles,
                        uint16_t *xp) {
    const int32_t subs = k / L;
    for (int32_t t = 0; t < tiles; t++)
        for (int32_t r = 0; r < 16; r++) {
            const int32_t row = 16 * t + r;
            uint16_t *dst = xp + (size_t)t * subs * 16 * L + (size_t)r * L;
            for (int32_t sb = 0; sb < subs; sb++, dst += 16 * L) {
                if (row < m)
                    memcpy(dst, x + (size_t)row * ldx + (size_t)sb * L, sizeof(uint16_t) * (size_t)L);
                else
                    memset(dst, 0, sizeof(uint16_t) * (size_t)L);
            }
        }
}

/* One sub-block of 32 rows x 32 outputs: the x tiles of rows 0..15 (a0) and 16..31 (a1)
 * times the weight tiles of outputs 0..15 (b0) and 16..31 (b1), each product from a zero
 * tile, stored to cbuf [4][16 x 16] in the order (a0 b0, a0 b1, a1 b0, a1 b1) */
MB_AMX_INLINE void mb_amx_tdp4(const uint16_t *a0, const uint16_t *a1, int64_t lda, const uint32_t *b0,
                               const uint32_t *b1, float *cbuf) {
    _tile_loadd(4, a0, lda);
    _tile_loadd(6, b0, 64);
    _tile_zero(0);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b1, 64);
    _tile_zero(1);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a1, lda);
    _tile_zero(2);
    _tile_dpbf16ps(2, 5, 6);
    _tile_zero(3);
    _tile_dpbf16ps(3, 5, 7);
    _tile_stored(0, cbuf, 64);
    _tile_stored(1, cbuf + 256, 64);
    _tile_stored(2, cbuf + 512, 64);
    _tile_stored(3, cbuf + 768, 64);
}

/* park [32 rows][32 outputs] = fma(P, scale, park), then the min term, for the four
 * products in cbuf; sx: row 0's S of this sub-block, rows ld_sx apart */
MB_AMX_INLINE void mb_amx_fold(float *park, const float *cbuf, const float *scale, const float *mins,
                               const float *sx, int64_t ld_sx, const int has_min) {
    for (int q = 0; q < 4; q++) {
        const int half = q >> 1, grp = q & 1;
        const __m512 sv = _mm512_loadu_ps(scale + 16 * grp);
        const __m512 mv = has_min ? _mm512_loadu_ps(mins + 16 * grp) : _mm512_setzero_ps();
        for (int r = 0; r < 16; r++) {
            float *p = park + (size_t)(16 * half + r) * MB_WIDE_OUTS + 16 * grp;
            __m512 acc = _mm512_fmadd_ps(_mm512_load_ps(cbuf + 256 * q + 16 * r), sv, _mm512_load_ps(p));
            if (has_min)
                acc = _mm512_fmadd_ps(_mm512_set1_ps(sx[(size_t)(16 * half + r) * ld_sx]), mv, acc);
            _mm512_store_ps(p, acc);
        }
    }
}

MB_AMX_INLINE void mb_amx_item(const struct mb_amx_job *j, int32_t r0, int32_t rows, int32_t c0, int32_t outs,
                               const int32_t type) {
    const int has_min = j->fmt.has_min, L = j->fmt.sub;
    const int64_t subs_row = j->a.k / L; /* sx's row stride */
    uint16_t wide[MB_WIDE_OUTS * MB_WIDE_CHUNK] __attribute__((aligned(64)));
    uint32_t B[2][MB_WIDE_CHUNK / 2 * 16] __attribute__((aligned(64)));
    float scale[16 * MB_WIDE_OUTS] __attribute__((aligned(64))), mins[16 * MB_WIDE_OUTS] __attribute__((aligned(64)));
    float cbuf[4 * 256] __attribute__((aligned(64)));
    float park[MB_AMX_ROWS * MB_WIDE_OUTS] __attribute__((aligned(64)));
    const uint8_t *wr[MB_WIDE_OUTS];
    mb_wide_rows(&j->a, c0, outs, wr);
    memset(park, 0, sizeof(float) * (size_t)((rows + 31) / 32 * 32) * MB_WIDE_OUTS);
    for (int32_t e0 = 0; e0 < j->a.k; e0 += MB_WIDE_CHUNK) {
        const int32_t elems = j->a.k - e0 < MB_WIDE_CHUNK ? j->a.k - e0 : MB_WIDE_CHUNK, subs = elems / L;
        for (int o = 0; o < MB_WIDE_OUTS; o++)
            mb_widen(type, wr[o], e0, elems, wide + MB_WIDE_CHUNK * o, scale + o, mins + o);
        mb_wide_transpose(wide, elems / 2, B[0]);
        mb_wide_transpose(wide + 16 * MB_WIDE_CHUNK, elems / 2, B[1]);
        mb_wide_prefetch(&j->a, &j->fmt, wr, e0);
        for (int32_t t = 0; t < rows; t += 32) { /* row tiles in pairs (xp's padding rows are zero) */
            const uint16_t *a0 = j->xp + ((size_t)(r0 + t) / 16 * subs_row + (size_t)(e0 / L)) * 16 * L;
            const uint16_t *a1 = a0 + (size_t)subs_row * 16 * L;
            const int64_t lda = 2 * L;
            const float *sx = has_min ? j->sx + (size_t)(r0 + t) * subs_row + e0 / L : NULL;
            for (int32_t s = 0; s < subs; s++) {
                mb_amx_tdp4(a0 + (size_t)s * 16 * L, a1 + (size_t)s * 16 * L, lda, B[0] + 16 * (s * L / 2),
                            B[1] + 16 * (s * L / 2), cbuf);
                mb_amx_fold(park + (size_t)t * MB_WIDE_OUTS, cbuf, scale + MB_WIDE_OUTS * s, mins + MB_WIDE_OUTS * s,
                            has_min ? sx + s : NULL, subs_row, has_min);
            }
        }
    }
    for (int32_t r = 0; r < rows; r++)
        mb_wide_store(&j->a, r0 + r, c0, outs, park + (size_t)r * MB_WIDE_OUTS);
}

/* ---- few rows (m <= MB_AMX_FEW, a short prompt run): the same rule, the operands swapped ----
 * C[o][r] = tdp(weights of output o, x row r): the weights widened as above are A tiles
 * as they stand (output o's sub-block one 64-byte row; no transpose), x in B pairs. Each
 * element's products and adds are those of C[r][o] above (E over the even elements, O
 * over the odd, then E + O), so the bits are the same whichever way the rows arrive; the
 * tests compare the two paths. Below 16 rows the other path pads its x tiles to 32 rows
 * and transposes every widened chunk; this one pads nothing to the tile but its columns,
 * and skips the transpose. */

/* tiles 0..3 C (16 outputs x m float32), 4, 5 weight tiles A (16 outputs x L bfloat16),
 * 6, 7 x tiles B (L / 2 pair rows x m rows) */
MB_AMX_INLINE void mb_amx_configure_few(int32_t sub, int32_t m) {
    struct mb_amx_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 4; t++)
        cfg.rows[t] = 16, cfg.colsb[t] = (uint16_t)(4 * m);
    for (int t = 4; t < 6; t++)
        cfg.rows[t] = 16, cfg.colsb[t] = (uint16_t)(2 * sub);
    for (int t = 6; t < 8; t++)
        cfg.rows[t] = (uint8_t)(sub / 2), cfg.colsb[t] = (uint16_t)(4 * m);
    _tile_loadconfig(&cfg);
}

/* acc [16 outputs][m] = fma(C, scale, acc), then the min term: C as stored, rows m floats
 * apart (16 m floats, m vectors); sb: this sub-block's S sums [m] */
MB_AMX_INLINE void mb_amx_fold_few(const struct mb_amx_job *j, float *acc, const float *c, const float *scale,
                                   const float *mins, const float *sb, const int has_min) {
    const __m512 sv = _mm512_loadu_ps(scale);
    const __m512 mv = has_min ? _mm512_loadu_ps(mins) : _mm512_setzero_ps();
    const __m512 xs = has_min ? _mm512_load_ps(sb) : _mm512_setzero_ps();
    for (int32_t i = 0; i < j->a.m; i++) {
        const __m512i lo = _mm512_loadu_si512(j->lane_out + 16 * i);
        __m512 a = _mm512_fmadd_ps(_mm512_load_ps(c + 16 * i), _mm512_permutexvar_ps(lo, sv),
                                   _mm512_load_ps(acc + 16 * i));
        if (has_min)
            a = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_loadu_si512(j->lane_row + 16 * i), xs),
                                _mm512_permutexvar_ps(lo, mv), a);
        _mm512_store_ps(acc + 16 * i, a);
    }
}

/* C0, C1 = the weight tiles of outputs 0..15 (a) and 16..31 (a + 16 rows) times x tile B
 * (b), each from a zero tile, through weight tile A (tile numbers must be immediates) */
#define MB_AMX_FEW_PRODUCTS(C0, C1, A, B, a, b, ldb)          \
    do {                                                      \
        _tile_loadd(B, b, ldb);                               \
        _tile_loadd(A, a, 2 * MB_WIDE_CHUNK);                  \
        _tile_zero(C0);                                       \
        _tile_dpbf16ps(C0, A, B);                             \
        _tile_loadd(A, (a) + 16 * MB_WIDE_CHUNK, 2 * MB_WIDE_CHUNK); \
        _tile_zero(C1);                                       \
        _tile_dpbf16ps(C1, A, B);                             \
    } while (0)

MB_AMX_INLINE void mb_amx_item_few(const struct mb_amx_job *j, int32_t c0, int32_t outs, const int32_t type) {
    const int has_min = j->fmt.has_min, L = j->fmt.sub;
    const int32_t m = j->a.m;
    const int64_t ldb = 4 * (int64_t)m, ldc = ldb;
    uint16_t wide[MB_WIDE_OUTS * MB_WIDE_CHUNK] __attribute__((aligned(64)));
    float scale[16 * MB_WIDE_OUTS] __attribute__((aligned(64))), mins[16 * MB_WIDE_OUTS] __attribute__((aligned(64)));
    float cbuf[4 * 16 * MB_AMX_FEW] __attribute__((aligned(64)));
    float acc[MB_WIDE_OUTS * MB_AMX_FEW] __attribute__((aligned(64))); /* [32 outputs][m] */
    float row[MB_WIDE_OUTS] __attribute__((aligned(64)));
    const uint8_t *wr[MB_WIDE_OUTS];
    mb_wide_rows(&j->a, c0, outs, wr);
    memset(acc, 0, sizeof(float) * MB_WIDE_OUTS * (size_t)m);
    for (int32_t e0 = 0; e0 < j->a.k; e0 += MB_WIDE_CHUNK) {
        const int32_t elems = j->a.k - e0 < MB_WIDE_CHUNK ? j->a.k - e0 : MB_WIDE_CHUNK, subs = elems / L, s0 = e0 / L;
        for (int o = 0; o < MB_WIDE_OUTS; o++)
            mb_widen(type, wr[o], e0, elems, wide + MB_WIDE_CHUNK * o, scale + o, mins + o);
        mb_wide_prefetch(&j->a, &j->fmt, wr, e0);
        /* sub-block s's products (C tiles 0, 1 for an even s, 2, 3 for an odd one), then
         * s - 1's stores and fold: a C tile's store waits on its product, so each store
         * runs behind the next sub-block's products instead of before them */
        for (int32_t s = 0; s <= subs; s++) {
            if (s < subs) {
                const uint32_t *b = j->xb + (size_t)(s0 + s) * (size_t)(L / 2) * (size_t)m;
                const uint16_t *a = wide + L * s;
                if (s & 1)
                    MB_AMX_FEW_PRODUCTS(2, 3, 5, 7, a, b, ldb);
                else
                    MB_AMX_FEW_PRODUCTS(0, 1, 4, 6, a, b, ldb);
            }
            if (s == 0)
                continue;
            const int32_t sub = s - 1;
            float *cb = cbuf + 32 * MB_AMX_FEW * (sub & 1);
            if (sub & 1) {
                _tile_stored(2, cb, ldc);
                _tile_stored(3, cb + 16 * MB_AMX_FEW, ldc);
            } else {
                _tile_stored(0, cb, ldc);
                _tile_stored(1, cb + 16 * MB_AMX_FEW, ldc);
            }
            for (int grp = 0; grp < 2; grp++)
                mb_amx_fold_few(j, acc + (size_t)16 * grp * m, cb + 16 * MB_AMX_FEW * grp,
                                scale + MB_WIDE_OUTS * sub + 16 * grp, mins + MB_WIDE_OUTS * sub + 16 * grp,
                                has_min ? j->sb + (size_t)(s0 + sub) * 16 : NULL, has_min);
        }
    }
    for (int32_t r = 0; r < m; r++) {
        for (int o = 0; o < MB_WIDE_OUTS; o++)
            row[o] = acc[(size_t)o * m + r];
        mb_wide_store(&j->a, r, c0, outs, row);
    }
}

MB_AMX_INLINE void mb_amx_item_any(const struct mb_amx_job *j, int32_t r0, int32_t rows, int32_t c0, int32_t outs,
                                  const int32_t type) {
    if (j->xb)
        mb_amx_item_few(j, c0, outs, type);
    else
        mb_amx_item(j, r0, rows, c0, outs, type);
}

MB_WIDE_INSTANCES(mb_amx_run, struct mb_amx_job, mb_amx_item_any, MB_AMX_TARGET)

static MB_AMX_TARGET void mb_amx_worker(void *data) {
    struct mb_amx_job *j = (struct mb_amx_job *)data;
    const mb_amx_run_fn run = mb_amx_run_pick(j->a.type);
    int configured = 0;
    for (;;) {
        int64_t first, take = mb_take_guided(&j->next, j->items, j->threads, &first);
        if (take == 0)
            break;
        if (!configured) {
            if (j->xb)
                mb_amx_configure_few(j->fmt.sub, j->a.m);
            else
                mb_amx_configure(j->fmt.sub);
            configured = 1;
        }
        for (int64_t i = first; i < first + take; i++) {
            int32_t r0, rows, c0, outs;
            mb_wide_item_at(&j->a, i, j->chunks, MB_AMX_ROWS, &r0, &rows, &c0, &outs);
            run(j, r0, rows, c0, outs);
        }
    }
    if (configured)
        _tile_release();
}

/* sx[r, s] = tdp(x row r's sub-block s, ones) for the L = 32 sub-blocks, from xp, in the
 * caller's thread: the min terms' sums, by the same instruction as the products' */
static MB_AMX_TARGET void mb_amx_xsums(const uint16_t *xp, int32_t m, int32_t k, int32_t tiles, float *sx) {
    uint32_t ones[16 * 16] __attribute__((aligned(64)));
    float cbuf[256] __attribute__((aligned(64)));
    const int32_t subs = k / 32;
    for (int i = 0; i < 256; i++)
        ones[i] = 0x3f803f80u; /* (1.0, 1.0) in bfloat16 */
    mb_amx_configure(32);
    _tile_loadd(6, ones, 64);
    for (int32_t t = 0; t < tiles; t++)
        for (int32_t sb = 0; sb < subs; sb++) {
            _tile_zero(0);
            _tile_loadd(4, xp + ((size_t)t * subs + sb) * 16 * 32, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_stored(0, cbuf, 64);
            for (int32_t i = 0; i < 16 && 16 * t + i < m; i++)
                sx[(size_t)(16 * t + i) * subs + sb] = cbuf[16 * i];
        }
    _tile_release();
}

/* The few rows' operands: x in B pairs, the flat o * m + r lanes' parts, and (formats with
 * a min) the S sums as the other path makes them (mb_amx_xsums on x packed in tile order,
 * one tile, into xp and sx), turned into sb[s][r] */
static void mb_amx_few_operands(struct mb_amx_job *j, uint32_t *xb, float *sb, uint16_t *xp, float *sx) {
    const int32_t m = j->a.m, k = j->a.k;
    for (int32_t r = 0; r < m; r++) {
        const uint16_t *xr = j->a.x + (size_t)r * j->a.ldx;
        for (int32_t e = 0; e < k; e += 2)
            xb[(size_t)(e / 2) * m + r] = (uint32_t)xr[e] | (uint32_t)xr[e + 1] << 16;
    }
    for (int32_t f = 0; f < 16 * m; f++)
        j->lane_out[f] = f / m, j->lane_row[f] = f % m;
    j->xb = xb;
    if (sb == NULL)
        return;
    mb_amx_pack(j->a.x, j->a.ldx, m, k, 32, 1, xp);
    mb_amx_xsums(xp, m, k, 1, sx);
    for (int32_t sbk = 0; sbk < k / 32; sbk++)
        for (int32_t r = 0; r < 16; r++)
            sb[(size_t)sbk * 16 + r] = r < m ? sx[(size_t)r * (k / 32) + sbk] : 0.0f;
    j->sb = sb;
}

int mb_q_linear_tiles(int32_t type, const uint8_t *w, int64_t row_bytes, int32_t n, int32_t k,
                      const uint16_t *x, int64_t ldx, int32_t m, const float *bias, void *y,
                      int32_t y_mode, int64_t ldy, void *parallel, int32_t threads) {
    struct mb_amx_job j;
    memset(&j, 0, sizeof j);
    j.a = (struct mb_q_call){type, w, row_bytes, n, k, x, ldx, m, bias, y, y_mode, ldy};
    if (!mb_wide_call_ok(&j.a, &j.fmt) || !mb_amx_supported())
        return MB_EINVAL;
    j.groups = (n + MB_WIDE_OUTS - 1) / MB_WIDE_OUTS;
    if (m <= MB_AMX_FEW) {
        uint32_t *xb = NULL;
        uint16_t *xp = NULL;
        float *sb = NULL, *sx = NULL;
        int ok = !posix_memalign((void **)&xb, 64, sizeof(uint32_t) * (size_t)(k / 2) * (size_t)m);
        if (ok && j.fmt.has_min) /* sb [k / 32][16]; xp, sx: one x tile's, for mb_amx_xsums */
            ok = !posix_memalign((void **)&sb, 64, sizeof(float) * 16 * (size_t)(k / 32)) &&
                 !posix_memalign((void **)&xp, 64, sizeof(uint16_t) * 16 * (size_t)k) &&
                 (sx = (float *)calloc(16 * (size_t)(k / 32), sizeof(float))) != NULL;
        if (ok) {
            mb_amx_few_operands(&j, xb, sb, xp, sx);
            j.chunks = 1, j.items = j.groups;
            mb_run_guided(mb_amx_worker, &j, &j.threads, j.items, parallel, threads);
        }
        free(sx);
        free(xp);
        free(sb);
        free(xb);
        return ok ? MB_OK : MB_ESCRATCH;
    }
    const int32_t tiles = (m + 31) / 32 * 2;
    uint16_t *xp = NULL;
    float *sx = NULL;
    if (posix_memalign((void **)&xp, 64, sizeof(uint16_t) * 16 * (size_t)tiles * (size_t)k))
        return MB_ESCRATCH;
    mb_amx_pack(x, ldx, m, k, j.fmt.sub, tiles, xp);
    j.xp = xp;
    if (j.fmt.has_min) {
        /* 16 * tiles rows: a last tile pair's padding rows read it too */
        sx = (float *)calloc((size_t)(16 * tiles) * (size_t)(k / 32), sizeof(float));
        if (sx == NULL) {
            free(xp);
            return MB_ESCRATCH;
        }
        mb_amx_xsums(xp, m, k, tiles, sx);
        j.sx = sx;
    }
    j.chunks = (m + MB_AMX_ROWS - 1) / MB_AMX_ROWS;
    j.items = (int64_t)j.groups * j.chunks;
    mb_run_guided(mb_amx_worker, &j, &j.threads, j.items, parallel, threads);
    free(sx);
    free(xp);
    return MB_OK;
}

#else /* no AMX build */

int mb_amx_supported(void) { return 0; }

MB_WIDE_REFUSED(mb_q_linear_tiles)

#endif
