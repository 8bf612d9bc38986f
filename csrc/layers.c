/* A decode step's decoder layers in one call: the same kernels, in the same order, that
 * mashbox/model/layer_loop.py's PythonLayers calls one by one on csrc's path.
 *
 * Why it exists: a batch-1 decode step of the default model is 30 layers of 10 small
 * calls each; from Python every call costs a few microseconds of its own (tensor
 * allocation, argument conversion, dispatch), which adds up to about a millisecond per
 * step, and the memory stream of the weights stops while Python runs. Here the layers
 * run back to back. Nothing is computed here but by the public functions below, so
 * its references are mashbox/native_ref.py's bf16_decode_layers (the same calls by the
 * numpy twins: tests/test_native_layers.py) and the decoder's Python loop
 * (tests/model/test_decoder_invariance.py): both give the same bits.
 *
 * Per layer, for the t rows of x (the residual stream, updated in place):
 *   h = rmsnorm(x, input_norm); qkv = h . qkv^T (+ bias) (q|k and v as two calls where v
 *   has a weight of its own: mb_layer's v); rope of q, k and the K/V cache
 *   write; attention of every row over its slot; x += attn . o^T (+ bias);
 *   h = rmsnorm(x, post_norm); gu = h . gate_up^T; act = silu(gate) * up; x += act . down^T.
 */
#include "mashbox.h"

/* One of a layer's linears: packed bfloat16 (type 0) or GGUF blocks (mb_q_linear). */
static int mb_layer_linear(const uint16_t *w, int32_t type, int64_t row_bytes, const uint16_t *x,
                           int64_t ldx, int32_t m, int32_t n, int32_t k, const float *bias, void *y,
                           int32_t y_mode, int64_t ldy, int32_t kernel, void *parallel, int32_t threads) {
    if (type)
        return mb_q_linear(type, (const uint8_t *)w, row_bytes, n, k, x, ldx, m, bias, y, y_mode, ldy,
                           kernel, parallel, threads);
    return mb_bf16_linear(x, ldx, m, w, n, k, bias, y, y_mode, ldy, kernel, parallel, threads);
}

int64_t mb_bf16_decode_scratch(int32_t t, int32_t hidden, int32_t heads, int32_t kv_heads,
                               int32_t head_dim, int32_t intermediate) {
    if (t < 1 || hidden < 1 || heads < 1 || kv_heads < 1 || head_dim < 1 || intermediate < 1)
        return 0;
    /* h [t, hidden], qkv [t, qkv_n], attn [t, q_size], gu [t, 2 I], act [t, I] */
    int64_t per_row = (int64_t)hidden + (int64_t)(heads + 2 * kv_heads) * head_dim +
                      (int64_t)heads * head_dim + 3 * (int64_t)intermediate;
    return (int64_t)t * per_row;
}

int mb_bf16_decode_layers(const struct mb_layer *layers, int32_t n_layers, int32_t hidden,
                          int32_t heads, int32_t kv_heads, int32_t head_dim, int32_t intermediate,
                          float eps, uint16_t *x, int32_t t, const int64_t *positions,
                          const int64_t *rows, const int64_t *slots, const int64_t *ends,
                          const uint16_t *cos, const uint16_t *sin, int32_t table_rows,
                          uint16_t *k_cache, uint16_t *v_cache, int64_t layer_stride,
                          int32_t n_slots, int32_t capacity, int32_t window, float scale,
                          uint16_t *scratch, int64_t scratch_len, int32_t kernel, void *parallel,
                          int32_t threads) {
    if (n_layers < 0 || t < 1 || hidden < 2 || heads < 1 || kv_heads < 1 || head_dim < 2 ||
        intermediate < 1 || layer_stride < 1)
        return MB_EINVAL;
    if (scratch_len < mb_bf16_decode_scratch(t, hidden, heads, kv_heads, head_dim, intermediate))
        return MB_ESCRATCH;
    int32_t q_size = heads * head_dim, qkv_n = (heads + 2 * kv_heads) * head_dim;
    int32_t qk_n = (heads + kv_heads) * head_dim, kv_n = kv_heads * head_dim;
    /* scratch, in mb_bf16_decode_scratch's order: h, qkv, attn, gu, act */
    uint16_t *h = scratch, *qkv = h + (size_t)t * hidden, *attn = qkv + (size_t)t * qkv_n;
    uint16_t *gu = attn + (size_t)t * q_size, *act = gu + (size_t)t * 2 * intermediate;
    for (int32_t li = 0; li < n_layers; li++) {
        const struct mb_layer *L = layers + li;
        uint16_t *kc = k_cache + (size_t)li * layer_stride, *vc = v_cache + (size_t)li * layer_stride;
        int rc;
        if ((rc = mb_bf16_rmsnorm(x, hidden, t, hidden, L->input_norm, eps, h, hidden, parallel, threads)) ||
            (rc = mb_layer_linear(L->qkv, L->qkv_type, L->qkv_row_bytes, h, hidden, t, L->v ? qk_n : qkv_n,
                                  hidden, L->qkv_bias, qkv, MB_Y_BF16, qkv_n, kernel, parallel, threads)) ||
            (L->v && (rc = mb_layer_linear(L->v, L->v_type, L->v_row_bytes, h, hidden, t, kv_n, hidden,
                                           L->qkv_bias ? L->qkv_bias + qk_n : NULL, qkv + qk_n, MB_Y_BF16,
                                           qkv_n, kernel, parallel, threads))) ||
            (rc = mb_bf16_rope_kv(qkv, qkv_n, t, heads, kv_heads, head_dim, cos, sin, positions,
                                  slots, kc, vc, n_slots, capacity, table_rows, parallel, threads)) ||
            (rc = mb_bf16_attention(qkv, qkv_n, t, rows, slots, ends, t, heads, kv_heads, head_dim,
                                    window, scale, kc, vc, n_slots, capacity, attn, q_size,
                                    kernel, parallel, threads)) ||
            (rc = mb_layer_linear(L->o, L->o_type, L->o_row_bytes, attn, q_size, t, hidden, q_size,
                                  L->o_bias, x, MB_Y_ADD_BF16, hidden, kernel, parallel, threads)) ||
            (rc = mb_bf16_rmsnorm(x, hidden, t, hidden, L->post_norm, eps, h, hidden, parallel, threads)) ||
            (rc = mb_layer_linear(L->gate_up, L->gate_up_type, L->gate_up_row_bytes, h, hidden, t,
                                  2 * intermediate, hidden, NULL, gu, MB_Y_BF16, 2 * intermediate,
                                  kernel, parallel, threads)) ||
            (rc = mb_bf16_silu_mul(gu, 2 * intermediate, t, intermediate, act, intermediate, parallel,
                                   threads)) ||
            (rc = mb_layer_linear(L->down, L->down_type, L->down_row_bytes, act, intermediate, t, hidden,
                                  intermediate, NULL, x, MB_Y_ADD_BF16, hidden, kernel, parallel,
                                  threads)))
            return rc;
    }
    return MB_OK;
}
