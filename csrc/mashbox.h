/* mashbox's whole C API: sampling, stop-string matching, prefix-cache block hashes,
 * bfloat16 linear layers.
 *
 * Rules (csrc/ is thin and boring on purpose):
 * - Flat buffers and lengths in, a status code out (MB_OK or a negative MB_E*); the
 *   caller owns all memory, nothing is allocated here, nothing is kept between calls.
 * - Every function has a pure Python reference in mashbox/native_ref.py, which states
 *   the exact rules (RNG, penalties, filters, integer weights, stop matching, hashes);
 *   tests/test_native_*.py check that both give the same bits.
 * - Floating point must follow IEEE double/float exactly: build without -ffast-math and
 *   with -ffp-contract=off (csrc/build.py), so no FMA changes a rounding.
 * - Only mashbox/native.py calls these (the bfloat16 kernels: mashbox/model/csrc.py,
 *   which checks the torch tensors before it hands native.py's pointer-level wrappers
 *   their addresses and lengths).
 */
#ifndef MASHBOX_H
#define MASHBOX_H

#include <stddef.h>
#include <stdint.h>

#define MB_OK 0
#define MB_EINVAL (-1)   /* a length, shape or offset is out of range */
#define MB_ESCRATCH (-2) /* the scratch buffer is smaller than mb_sample_scratch_bytes() */

#define MB_NUM_PARAMS 7 /* temperature, top_p, top_k, min_p, repetition, frequency, presence */
#define MB_MAX_VOCAB (1 << 19) /* integer weights (2**44 each) must sum below 2**63 */

/* splitmix64: the state for a seed, and one raw draw per entry (state advanced). */
uint64_t mb_rng_init(uint64_t seed);
void mb_rng_next(uint64_t *state, int32_t n, uint64_t *out);

/* Bytes of scratch mb_sample needs for this vocab (rows are done one after another, so
 * it does not depend on the number of rows). */
size_t mb_sample_scratch_bytes(int32_t vocab);

/* One token per row.
 * logits:         float[rows * vocab], penalised in place (NaN becomes -inf)
 * params:         float[rows * MB_NUM_PARAMS]
 * rng_state:      uint64[rows], one draw taken per row
 * hist_ids:       int32[n_hist]; row r's history (prompt then generated) is
 *                 hist_ids[hist_offsets[r] .. hist_offsets[r+1]), ids from index
 *                 hist_gen_start[r] of it on are generated ones; ids outside [0, vocab)
 *                 are ignored
 * hist_offsets:   int32[rows + 1], non-decreasing, within [0, n_hist]
 * hist_gen_start: int32[rows]
 * out_ids:        int32[rows]
 * scratch:        at least mb_sample_scratch_bytes(vocab) bytes, 8-byte aligned */
int mb_sample(float *logits, int32_t rows, int32_t vocab, const float *params,
              uint64_t *rng_state, const int32_t *hist_ids, int32_t n_hist,
              const int32_t *hist_offsets,
              const int32_t *hist_gen_start, int32_t *out_ids, void *scratch,
              size_t scratch_bytes);

/* Log probabilities for the API (per row, after mb_sample on the same logits, so they are
 * the penalised logits the sampler saw, before temperature): log-softmax in double.
 * logits:           float[rows * vocab] as mb_sample left them (read only)
 * ids:              int32[rows], the chosen token of each row, in [0, vocab)
 * top_n:            0 .. MB_MAX_TOP_LOGPROBS (and <= vocab)
 * out_logprobs:     float[rows], the chosen token's log probability (-inf: none)
 * out_top_ids:      int32[rows * top_n], the top_n best ids, logit descending, id ascending
 * out_top_logprobs: float[rows * top_n], their log probabilities */
#define MB_MAX_TOP_LOGPROBS 20
int mb_logprobs(const float *logits, int32_t rows, int32_t vocab, const int32_t *ids, int32_t top_n,
                float *out_logprobs, int32_t *out_top_ids, float *out_top_logprobs);

/* Constrained decoding's token bitmask (csrc/mask.c): for each row r with
 * row_mask[r] >= 0, logits[r, t] = -inf unless bit t % 32 of
 * bitmask[row_mask[r] * words + t / 32] is set (ids from words * 32 on: -inf too);
 * rows with row_mask[r] == -1 are untouched.
 * logits:   float[rows * vocab], in place
 * bitmask:  uint32[mask_rows * words]
 * row_mask: int32[rows], each in [-1, mask_rows) */
int mb_apply_token_bitmask(float *logits, int32_t rows, int32_t vocab, const uint32_t *bitmask,
                           int32_t mask_rows, int32_t words, const int32_t *row_mask);

/* Stop matching on UTF-8 bytes. stops: the stop strings' bytes one after another,
 * string i at stops[stop_offsets[i] .. stop_offsets[i+1]) (empty ones never match).
 * buf: held-back bytes then new bytes, len in all; matches ending at or before
 * scan_from were looked for by an earlier call and are not looked for again.
 * On a match: *out_stop = its index, *out_emit = where it starts (emit buf[0..emit)).
 * Otherwise: *out_stop = -1, *out_emit = len minus the longest suffix that is a proper
 * prefix of some stop (hold buf[emit..len) back). emit never splits a UTF-8 sequence
 * when buf and the stops are valid UTF-8. */
int mb_stop_scan(const uint8_t *stops, const int32_t *stop_offsets, int32_t n_stops,
                 const uint8_t *buf, int32_t len, int32_t scan_from, int32_t *out_emit,
                 int32_t *out_stop);

/* Chained hashes of the n / block full blocks of ids: out[i] covers ids[0 .. (i+1)*block). */
int mb_block_hashes(const int32_t *ids, int64_t n, int32_t block, uint64_t *out);

/* The usable slot whose first counts[s] hashes (table row s, uint64[slots * max_blocks])
 * share the longest run with query[0 .. n_query); ties: fewer counts, then lower slot.
 * *out_slot = -1, *out_blocks = 0 when no slot is usable. */
int mb_longest_prefix(const uint64_t *query, int32_t n_query, const uint64_t *table,
                      int32_t slots, int32_t max_blocks, const int32_t *counts,
                      const uint8_t *usable, int32_t *out_slot, int32_t *out_blocks);

/* bfloat16 linear layers (csrc/linear.c states the arithmetic). Kernels: */
#define MB_KERNEL_PORTABLE 1    /* plain C, any CPU: the rule itself, slow */
#define MB_KERNEL_AVX512BF16 2  /* vdpbf16ps; the same bits as the portable kernel */
/* mb_q_linear's legacy types only: AVX512BF16 with Q8_0 widened through int32 and float32,
 * as on CPUs without AVX512-FP16 (where AVX512BF16 is this one); the same bits */
#define MB_KERNEL_AVX512BF16_INT32 3
/* AVX2 and FMA (and F16C): the linears (mb_bf16_linear, mb_q_linear) emulate vdpbf16ps
 * with exact float32 products and fused adds, the same bits as the portable kernel where
 * the rule's limits hold (products and sums in float32's normal range); every other call
 * that takes a kernel runs its portable path for it (mb_q_linear_lanes excepted: it is
 * AVX-512 only and answers MB_EINVAL) */
#define MB_KERNEL_AVX2 4

/* The fastest kernel this CPU runs: AVX512BF16, else AVX2, else PORTABLE. */
int32_t mb_bf16_kernel(void);

/* 1 when MB_KERNEL_AVX2 runs here (AVX2, FMA and F16C; AVX-512 CPUs too), else 0. */
int mb_avx2_supported(void);

/* Bytes of a [n, k] weight's packed form (0 when k is odd or a size is < 1). */
size_t mb_bf16_packed_bytes(int32_t n, int32_t k);

/* Pack w (bfloat16 bits, [n, k] row-major) into packed (mb_bf16_packed_bytes bytes). */
int mb_bf16_pack(const uint16_t *w, int32_t n, int32_t k, uint16_t *packed);

/* Rows ids[0 .. count) of the weight packed by mb_bf16_pack, into out [count, k]: a tied
 * embedding reads its rows from the output head's packed copy instead of keeping its
 * own. MB_EINVAL for an id outside [0, n). */
int mb_bf16_gather_rows(const uint16_t *packed, int32_t n, int32_t k, const int64_t *ids,
                        int32_t count, uint16_t *out);

/* What mb_bf16_linear writes to y: */
#define MB_Y_BF16 0     /* bfloat16(acc + bias) */
#define MB_Y_F32 1      /* float32 acc + bias */
#define MB_Y_ADD_BF16 2 /* bfloat16(y + (acc + bias)): a residual add, rounded once */

/* y[r, c] = x[r, :k] . w[c, :k] (+ bias[c]) for r < m, c < n; x rows ldx apart
 * (bfloat16 bits), y rows ldy apart as y_mode says; bias float32 or NULL. kernel: an
 * MB_KERNEL_*. parallel: libgomp's GOMP_parallel, run with `threads` threads, or NULL
 * for the calling thread alone. Every output's bits depend on its own row, weight row,
 * bias (and y) only. */
int mb_bf16_linear(const uint16_t *x, int64_t ldx, int32_t m, const uint16_t *packed,
                   int32_t n, int32_t k, const float *bias, void *y, int32_t y_mode,
                   int64_t ldy, int32_t kernel, void *parallel, int32_t threads);

/* RMS norm of m rows of k bfloat16 (rows ldx / ldo apart) times w[k], into out:
 * ss = sum of x^2 in float64 over 8 lanes (element i into lane i % 8, in order; lanes
 * summed as ((0+1)+(2+3))+((4+5)+(6+7))), rstd = float(1 / sqrt(ss / k + eps)),
 * out = bfloat16((x * rstd) * w) in float32. parallel, threads: as mb_bf16_linear's (rows
 * split between threads when the call is big enough; a row's bits are the same). */
int mb_bf16_rmsnorm(const uint16_t *x, int64_t ldx, int32_t m, int32_t k, const uint16_t *w,
                    float eps, uint16_t *out, int64_t ldo, void *parallel, int32_t threads);

/* The MLP's activation on m rows of x ([gate | up], n each, rows ldx apart, bfloat16):
 * out = bfloat16(silu(gate) * up) in float32, rows ldo apart; silu(g) = g / (1 + e) for
 * g >= 0, else (g * e) / (1 + e), e = e^-|g| by csrc's own exp (bf16.h). parallel,
 * threads: as mb_bf16_rmsnorm's. */
int mb_bf16_silu_mul(const uint16_t *x, int64_t ldx, int32_t m, int32_t n, uint16_t *out,
                     int64_t ldo, void *parallel, int32_t threads);

/* Rotary embedding and the K/V cache write of t tokens (bfloat16 bits). Row i of qkv
 * (ldq apart) is [heads + 2 * kv_heads, head_dim]: q heads, k heads, v heads. For each
 * q and k head, x' = x * cos[p] + swap(x) * sin[p] in float32 (two products, one add,
 * rounded once to bfloat16), p = positions[i], swap exchanging the two halves of
 * head_dim, sin holding rotate-half's sign (cos, sin: tables [table_rows, head_dim]).
 * q' goes back into qkv; k' and v go to the caches [n_slots, kv_heads, capacity,
 * head_dim] at [slots[i], h, p]. MB_EINVAL for a position (past the cache or the tables) or slot out of range, an odd
 * head_dim or one over 1024. parallel, threads: as mb_bf16_rmsnorm's (the t tokens' (slot,
 * position) pairs must be distinct). */
int mb_bf16_rope_kv(uint16_t *qkv, int64_t ldq, int32_t t, int32_t heads, int32_t kv_heads,
                    int32_t head_dim, const uint16_t *cos, const uint16_t *sin,
                    const int64_t *positions, const int64_t *slots, uint16_t *k_cache,
                    uint16_t *v_cache, int32_t n_slots, int32_t capacity, int32_t table_rows,
                    void *parallel, int32_t threads);

/* Decode attention (csrc/attention.c states the arithmetic): for each of t rows, query
 * heads q[rows[r]] (bfloat16 [heads, head_dim], rows ldq apart, n_q of them) attend over
 * keys [lo, ends[r]) of slot slots[r] in the caches [n_slots, kv_heads, capacity,
 * head_dim], lo = ends[r] - window when window > 0 and shorter; the result goes to
 * out[rows[r]] ([heads, head_dim], rows ldo apart). A row's bits depend on its own
 * query, keys and end only. kernel: MB_KERNEL_PORTABLE, MB_KERNEL_AVX512BF16 for the
 * AVX-512 path where mb_bf16_kernel() offers it, or MB_KERNEL_AVX2 for the AVX2 path where
 * mb_avx2_supported() (the same bits each way). parallel / threads as mb_bf16_linear's. MB_EINVAL for a
 * row, slot or end out of range, heads not a multiple of kv_heads or over 32 per K/V
 * head, head_dim not a multiple of 16 or over 256. */
int mb_bf16_attention(const uint16_t *q, int64_t ldq, int32_t n_q, const int64_t *rows,
                      const int64_t *slots, const int64_t *ends, int32_t t, int32_t heads,
                      int32_t kv_heads, int32_t head_dim, int32_t window, float scale,
                      const uint16_t *k_cache, const uint16_t *v_cache, int32_t n_slots,
                      int32_t capacity, uint16_t *out, int64_t ldo, int32_t kernel,
                      void *parallel, int32_t threads);

/* Linear layers on GGUF's quantized blocks (csrc/quant.c states the arithmetic). Block
 * types, ggml's numbers (gguf.GGMLQuantizationType): */
#define MB_GGML_Q4_0 2
#define MB_GGML_Q4_1 3
#define MB_GGML_Q5_0 6
#define MB_GGML_Q5_1 7
#define MB_GGML_Q8_0 8
#define MB_GGML_Q4_K 12
#define MB_GGML_Q5_K 13
#define MB_GGML_Q6_K 14

/* Bytes of one row of k elements in a legacy block type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0);
 * 0 for another type or k not a multiple of 32. */
int64_t mb_q_row_bytes(int32_t type, int32_t k);

/* 1 when mb_q_linear runs this type (the legacy types here, the K-quants in csrc/kquant.c). */
int mb_q_supported(int32_t type);

/* 1 when mb_q_linear's MB_KERNEL_AVX512BF16 widens Q8_0 through byte lookups (a CPU with
 * AVX512-VBMI and AVX512-BF16), 0 when it does not, -1 when the build has no AVX512 path. */
int mb_q_vbmi_widening(void);

/* y[r, c] = x[r, :k] . dequant(w row c) (+ bias[c]) for r < m, c < n. w: n rows,
 * row_bytes apart, each k / 32 blocks in ggml's own layout (the GGUF file's bytes); x:
 * bfloat16 bits, rows ldx apart (used exactly, never quantized); bias float32 or NULL;
 * y, y_mode, ldy, kernel, parallel, threads as mb_bf16_linear's. Types Q4_K, Q5_K, Q6_K
 * go to mb_kq_linear (csrc/kquant.c) unchanged. Every
 * output's bits depend only on its own x row, w row, bias (and y); the portable and
 * AVX512 kernels give the same bits. */
int mb_q_linear(int32_t type, const uint8_t *w, int64_t row_bytes, int32_t n, int32_t k,
                const uint16_t *x, int64_t ldx, int32_t m, const float *bias, void *y,
                int32_t y_mode, int64_t ldy, int32_t kernel, void *parallel, int32_t threads);

/* 1 when mb_q_linear_tiles runs here: a CPU with AMX-BF16 tiles (and AVX512-BF16) whose
 * OS lets this process use them (csrc/amx.c; asked once). */
int mb_amx_supported(void);

/* mb_q_linear's y on AMX tiles, by the tile rule (csrc/amx.c states it): another fixed
 * order of the same exact products per output, so other bits than mb_q_linear's, and as
 * batch invariant. Every block type mb_q_linear takes; the same arguments less kernel.
 * MB_EINVAL where mb_amx_supported() is 0. */
int mb_q_linear_tiles(int32_t type, const uint8_t *w, int64_t row_bytes, int32_t n, int32_t k,
                      const uint16_t *x, int64_t ldx, int32_t m, const float *bias, void *y,
                      int32_t y_mode, int64_t ldy, void *parallel, int32_t threads);

/* 1 when mb_q_linear_lanes runs here: a CPU with AVX512-BF16, or AVX2 and FMA (csrc/lanes.c). */
int mb_lanes_supported(void);

/* mb_q_linear's y on vdpbf16ps lanes, by the lanes rule (csrc/lanes.c states it): the
 * prompt rows' kernel where AMX tiles are missing; another fixed order of the same exact
 * products per output, so other bits than mb_q_linear's and mb_q_linear_tiles', and as
 * batch invariant. Every block type mb_q_linear takes; the same arguments, kernel
 * MB_KERNEL_AVX512BF16 (Q8_0 widened through byte lookups where mb_q_vbmi_widening() is
 * 1), MB_KERNEL_AVX512BF16_INT32 (through int32, as on AVX512-BF16 CPUs without VBMI) or
 * MB_KERNEL_AVX2 (vdpbf16ps emulated by fused multiply-adds, where mb_avx2_supported());
 * the same bits. MB_EINVAL for a kernel that does not run here, or another kernel. */
int mb_q_linear_lanes(int32_t type, const uint8_t *w, int64_t row_bytes, int32_t n, int32_t k,
                      const uint16_t *x, int64_t ldx, int32_t m, const float *bias, void *y,
                      int32_t y_mode, int64_t ldy, int32_t kernel, void *parallel, int32_t threads);

/* Prefill attention (csrc/attention.c states the arithmetic): for each of t prompt rows,
 * its lens[r] queries q[firsts[r] + i] (bfloat16 [heads, head_dim], rows ldq apart, n_q of
 * them) at positions starts[r] + i attend causally over the keys of slot slots[r] in the
 * caches [n_slots, kv_heads, capacity, head_dim] (those keys already written), keys
 * (p - window, p] when window > 0; results to out[firsts[r] + i] (rows ldo apart). A
 * query's bits depend on its own vector, keys and position only. kernel, parallel and
 * threads as mb_bf16_attention's. MB_EINVAL for a row out of range, heads not a multiple
 * of kv_heads or over 16 per K/V head, head_dim not a multiple of 16 or over 256, or
 * group * head_dim over 1024. */
int mb_bf16_prefill_attention(const uint16_t *q, int64_t ldq, int32_t n_q, const int64_t *firsts,
                              const int64_t *slots, const int64_t *starts, const int64_t *lens, int32_t t,
                              int32_t heads, int32_t kv_heads, int32_t head_dim, int32_t window, float scale,
                              const uint16_t *k_cache, const uint16_t *v_cache, int32_t n_slots,
                              int32_t capacity, uint16_t *out, int64_t ldo, int32_t kernel, void *parallel,
                              int32_t threads);

/* One decoder layer's weights for mb_bf16_decode_layers (addresses in the model's own
 * buffers): RMS norm weights bfloat16 [hidden]; linears packed by mb_bf16_pack or in
 * GGUF blocks (their *_type); biases float32 or NULL. */
struct mb_layer {
    const uint16_t *input_norm;
    const uint16_t *qkv;
    const float *qkv_bias;
    const uint16_t *o;
    const float *o_bias;
    const uint16_t *post_norm;
    const uint16_t *gate_up;
    const uint16_t *down;
    /* 0 (what a zeroed struct says): the four linears above are packed by mb_bf16_pack;
     * else qkv, o, gate_up, down hold GGUF blocks of these MB_GGML_* types for
     * mb_q_linear, rows *_row_bytes apart (csrc/quant.c) */
    int32_t qkv_type, o_type, gate_up_type, down_type;
    int64_t qkv_row_bytes, o_row_bytes, gate_up_row_bytes, down_row_bytes;
    /* NULL: qkv holds q, k and v. Else qkv holds only q|k ((heads + kv_heads) * head_dim
     * rows) and v the kv_heads * head_dim rows of v, of its own v_type (a GGUF that stores
     * v in another block type than q and k: one linear reads one type); qkv_bias stays the
     * whole q|k|v bias. */
    const uint16_t *v;
    int32_t v_type;
    int64_t v_row_bytes;
};

/* bfloat16 elements of scratch mb_bf16_decode_layers needs for t rows:
 * t * (hidden + (heads + 2 kv_heads + heads) * head_dim + 3 * intermediate); 0 for a
 * size < 1. */
int64_t mb_bf16_decode_scratch(int32_t t, int32_t hidden, int32_t heads, int32_t kv_heads,
                               int32_t head_dim, int32_t intermediate);

/* t decode rows (one token each) through n_layers Llama-style layers (csrc/layers.c lists
 * the calls), x [t, hidden] bfloat16 updated in place. positions, slots: each row's;
 * rows = 0 .. t-1 and ends = positions + 1 for the attention (mb_bf16_attention); the
 * caches of layer l start layer_stride elements after layer l - 1's; scratch holds
 * scratch_len bfloat16, MB_ESCRATCH when that is under mb_bf16_decode_scratch(t, ...).
 * The first failing call's status is returned (its checks run before it writes). */
int mb_bf16_decode_layers(const struct mb_layer *layers, int32_t n_layers, int32_t hidden,
                          int32_t heads, int32_t kv_heads, int32_t head_dim, int32_t intermediate,
                          float eps, uint16_t *x, int32_t t, const int64_t *positions,
                          const int64_t *rows, const int64_t *slots, const int64_t *ends,
                          const uint16_t *cos, const uint16_t *sin, int32_t table_rows,
                          uint16_t *k_cache, uint16_t *v_cache, int64_t layer_stride,
                          int32_t n_slots, int32_t capacity, int32_t window, float scale,
                          uint16_t *scratch, int64_t scratch_len, int32_t kernel, void *parallel,
                          int32_t threads);

/* K-quant linear layers (csrc/kquant.c states the arithmetic): y[r, c] = x[r, :k] .
 * dequant(w row c) (+ bias[c]) for r < m, c < n; type MB_GGML_Q4_K, Q5_K or Q6_K; w: n
 * rows row_bytes apart, each k / 256 blocks in ggml's layout (the file's bytes); x, bias,
 * y, y_mode, ldy, kernel, parallel, threads as mb_bf16_linear's. MB_EINVAL for another
 * type, k not a multiple of 256, row_bytes under k / 256 blocks, or a bad size;
 * MB_ESCRATCH when the per-call x scratch (m * k * 2.25 bytes) cannot be allocated. */
int mb_kq_linear(int32_t type, const uint8_t *w, int64_t row_bytes, int32_t n, int32_t k,
                 const uint16_t *x, int64_t ldx, int32_t m, const float *bias, void *y,
                 int32_t y_mode, int64_t ldy, int32_t kernel, void *parallel, int32_t threads);

#endif /* MASHBOX_H */
