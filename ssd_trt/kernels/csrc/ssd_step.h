/* One decoder step on the CPU: a Llama-family model (Llama, Qwen2 with q/k/v biases, Qwen3 with q/k norms) whose
 * linear layers and head are GGUF tiles (ssd_kernels.h), over the engine's KV cache.
 *
 * The step is the engine interface's (ssd_trt/engines/base.py): B rows each append T new tokens at cache slots
 * lengths[b] .. lengths[b] + T - 1; new token i of a row sees the row's cached slots 0 .. lengths[b] - 1 and the new
 * tokens j whose bit is set in its tree mask (bit j of word j / 32 of mask[b, i]); logits come out for the new
 * tokens logit_indices[b, :] only.
 *
 * Row exactness: every token's arithmetic is the same whatever the step (its M = B T rows, its place among them):
 * the matmuls are row-independent (ssd_kernels.h), the norms, rotary and MLP work row by row, and attention visits a
 * token's visible slots in slot order with one fixed summation order. A token's logits are therefore bit-identical
 * whether it was computed alone (autoregressive), in a verification chain, or in a token tree beside its siblings.
 */
#ifndef SSD_STEP_H
#define SSD_STEP_H

#include "ssd_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    const float *attn_norm, *mlp_norm;                  /* [hidden] */
    const ssd_weight *q, *k, *v, *o, *gate, *up, *down; /* y = x W: W [K, N] tiles */
    const float *q_bias, *k_bias, *v_bias;              /* [heads * head_dim], [kv_heads * head_dim] or NULL */
    const float *q_norm, *k_norm;                       /* Qwen3's per-head RMSNorm weights [head_dim] or NULL */
} ssd_layer;

typedef struct {
    int32_t layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, positions;
    float eps;                  /* RMSNorm: w x / sqrt(mean x^2 + eps) */
    float scale;                /* attention scores q.k * scale */
    const float *cos, *sin;     /* [positions, head_dim / 2] the model's rotary angles (rotate-half form) */
    const ssd_weight *embed;    /* the token embedding as tiles [hidden, vocab] (a token's vector is a column) */
    const ssd_weight *head;     /* the LM head [hidden, vocab] */
    const float *final_norm;    /* [hidden] */
    const ssd_layer *layer;     /* [layers] */
} ssd_model;

typedef struct {
    int32_t batch, tokens, mask_words, logits_per_row, capacity;
    const int64_t *input_ids;       /* [batch, tokens], each in [0, vocab) */
    const int64_t *positions;       /* [batch, tokens], each in [0, positions) */
    const int32_t *mask;            /* [batch, tokens, mask_words] packed visibility of the new tokens */
    const int32_t *lengths;         /* [batch] cached slots per row before the step */
    const int64_t *logit_indices;   /* [batch, logits_per_row] in [0, tokens) */
    float *const *keys;             /* [layers] each [batch, kv_heads, capacity, head_dim] from the step's row 0 */
    float *const *values;
    float *logits;                  /* [batch, logits_per_row, vocab] */
} ssd_step_args;

/* 0 on success; -1 when memory for the step's buffers could not be had (nothing was written then) */
int ssd_step(ssd_pool *pool, const ssd_model *model, const ssd_step_args *args);

/* column n of w dequantized: out [k] (an embedding row of a tiled token embedding) */
void ssd_dequantize_column(const ssd_weight *w, int n, float *out);

#ifdef __cplusplus
}
#endif
#endif
