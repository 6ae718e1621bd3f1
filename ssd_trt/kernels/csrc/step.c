/* The decoder step of ssd_step.h. The matmuls run on the pool's path (its threads split the output columns); the
 * rest -- embedding rows, RMSNorm, biases, q/k norms, rotary, the cache writes, attention, SiLU -- runs here on the
 * calling thread, row by row, with AVX2 + FMA (every CPU the native engine is offered on has them: the engine checks
 * that the library's avx2 path runs before it opens).
 *
 * The math is the torch Decoder's (ssd_trt/models/decoder.py): x = embed[id]; per layer
 *   h = RMSNorm(x); q, k, v = h Wq (+ bq), h Wk (+ bk), h Wv (+ bv); [q, k = RMSNorm per head (Qwen3)];
 *   q, k rotated by their position (rotate-half: x cos + rotate_half(x) sin); k, v written to the cache;
 *   a = softmax(q K^T scale over the visible slots) V per head (a kv head shared by heads / kv_heads query heads);
 *   x += a Wo; x += (silu(RMSNorm(x) Wg) * (RMSNorm(x) Wu)) Wd
 * and logits = RMSNorm(x) Whead for the picked tokens. Each float sum below has one fixed order (8 lanes, then the
 * lanes pairwise), so a token's result depends on its own inputs only (ssd_step.h, row exactness). */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "ssd_step.h"

static inline float hsum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* sum a[i] b[i] over n, a multiple of 8 */
static inline float dot(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return hsum8(acc);
}

/* e^x for 8 lanes: x = n ln2 + r with n = round(x / ln2) (ln2 in two parts), e^r by Cephes' expf polynomial
 * (S. L. Moshier, Cephes Math Library, expf.c: relative error ~1 ulp on [-ln2/2, ln2/2]), times 2^n through the
 * exponent bits. x is clamped to [-87.3, 88.3] (so 2^n stays a normal number). Lane-wise and with fixed operations,
 * so every lane's result depends on its own x only. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.3762626647949f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

/* x[i] = e^(x[i] - shift) for i < n (any n: the tail goes through the same 8-lane code) */
static void exp_shifted(float *x, int n, float shift) {
    const __m256 s = _mm256_set1_ps(shift);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(x + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), s)));
    if (i < n) {
        float lanes[8] = {0};
        memcpy(lanes, x + i, sizeof(float) * (n - i));
        _mm256_storeu_ps(lanes, exp8(_mm256_sub_ps(_mm256_loadu_ps(lanes), s)));
        memcpy(x + i, lanes, sizeof(float) * (n - i));
    }
}

/* h = silu(g) u = g / (1 + e^-g) u over n, a multiple of 8 */
static void silu_times(const float *g, const float *u, float *h, int n) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = exp8(_mm256_sub_ps(zero, gv));
        _mm256_storeu_ps(h + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
}

/* y += s x over n, a multiple of 8 */
static inline void axpy(float *y, float s, const float *x, int n) {
    const __m256 sv = _mm256_set1_ps(s);
    for (int i = 0; i < n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(sv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
}

/* out = w x / sqrt(mean x^2 + eps) (out may be x) */
static void rms_norm(const float *x, const float *w, int n, float eps, float *out) {
    const float r = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
    for (int i = 0; i < n; i++)
        out[i] = w[i] * (x[i] * r);
}

/* one head's vector rotated by the angles (cos c, sin s) [half]: (a, b) -> (a c - b s, b c + a s) */
static void rotate(float *x, const float *c, const float *s, int half) {
    for (int i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * c[i] - b * s[i];
        x[i + half] = b * c[i] + a * s[i];
    }
}

/* attention of one token: its queries q [heads, D] over the slots it sees, out [heads, D]; keys / values: the row's
 * cache of this layer [kv_heads, capacity, D]; slots [count] ascending; scores: room for group * count */
static void attend(const ssd_model *m, const float *q, const float *keys, const float *values, int capacity,
                   const int *slots, int count, float *scores, float *out) {
    const int d = m->head_dim, group = m->heads / m->kv_heads;
    const int64_t head_stride = (int64_t)capacity * d;
    memset(out, 0, sizeof(float) * m->heads * d);
    if (count == 0)
        return;
    for (int g = 0; g < m->kv_heads; g++) {
        const float *kh = keys + g * head_stride, *vh = values + g * head_stride, *qg = q + g * group * d;
        float *og = out + g * group * d;
        for (int n = 0; n < count; n++) {
            const float *kp = kh + (int64_t)slots[n] * d;
            for (int i = 0; i < group; i++)
                scores[i * count + n] = dot(qg + i * d, kp, d) * m->scale;
        }
        for (int i = 0; i < group; i++) {           /* softmax: exp(s - max) / sum, the division last */
            float *sc = scores + i * count, top = -INFINITY, sum = 0.0f;
            for (int n = 0; n < count; n++)
                top = fmaxf(top, sc[n]);
            exp_shifted(sc, count, top);
            for (int n = 0; n < count; n++)
                sum += sc[n];
            for (int n = 0; n < count; n++)
                sc[n] /= sum;
        }
        for (int n = 0; n < count; n++) {
            const float *vp = vh + (int64_t)slots[n] * d;
            for (int i = 0; i < group; i++)
                axpy(og + i * d, scores[i * count + n], vp, d);
        }
    }
}

static void matmul(ssd_pool *pool, const ssd_weight *w, ssd_act *act, const float *x, int m, float *y) {
    static const int64_t zero = 0;
    act->m = m;
    act->k = w->k;
    ssd_quantize(pool, x, w->k, act);
    ssd_matmul(pool, 1, &w, act, y, w->n, &zero);
}

static int imax(int a, int b) { return a > b ? a : b; }

int ssd_step(ssd_pool *pool, const ssd_model *m, const ssd_step_args *a) {
    const int batch = a->batch, tokens = a->tokens, rows = batch * tokens, hidden = m->hidden, d = m->head_dim;
    const int qd = m->heads * d, kd = m->kv_heads * d, qkv_width = qd + 2 * kd, inter = m->intermediate;
    const int picked_rows = batch * a->logits_per_row, half = d / 2;
    const int widest = imax(hidden, imax(qd, inter));
    int longest = 0;
    for (int b = 0; b < batch; b++)
        longest = imax(longest, a->lengths[b]);
    const int visible = longest + tokens;
    const int64_t head_stride = (int64_t)a->capacity * d, row_stride = m->kv_heads * head_stride;

    /* the step's buffers, one allocation */
    const size_t floats = (size_t)rows * hidden            /* x, the residual stream */
                          + (size_t)imax(rows, picked_rows) * widest   /* a matmul's input */
                          + (size_t)rows * qkv_width
                          + (size_t)rows * 2 * inter        /* gate | up */
                          + (size_t)rows * hidden           /* o / down outputs */
                          + (size_t)imax(rows, picked_rows) * widest / 32 * 4   /* activation scales */
                          + (size_t)(m->heads / m->kv_heads) * visible + (size_t)visible;
    float *buffer = malloc(floats * sizeof(float) + (size_t)imax(rows, picked_rows) * widest + 64);
    if (!buffer)
        return -1;
    float *x = buffer, *in = x + (size_t)rows * hidden, *qkv = in + (size_t)imax(rows, picked_rows) * widest;
    float *gate_up = qkv + (size_t)rows * qkv_width, *proj = gate_up + (size_t)rows * 2 * inter;
    float *scales = proj + (size_t)rows * hidden;
    const size_t blocks = (size_t)imax(rows, picked_rows) * widest / 32;
    float *scores = scales + 4 * blocks;
    int *slots = (int *)(scores + (size_t)(m->heads / m->kv_heads) * visible);
    int8_t *codes = (int8_t *)(slots + visible);
    ssd_act act = {0, 0, codes, scales, scales + blocks, scales + 2 * blocks};

    for (int r = 0; r < rows; r++)
        ssd_dequantize_column(m->embed, (int)a->input_ids[r], x + (size_t)r * hidden);

    for (int l = 0; l < m->layers; l++) {
        const ssd_layer *layer = &m->layer[l];
        for (int r = 0; r < rows; r++)
            rms_norm(x + (size_t)r * hidden, layer->attn_norm, hidden, m->eps, in + (size_t)r * hidden);
        act.m = rows;
        act.k = hidden;
        ssd_quantize(pool, in, hidden, &act);
        const ssd_weight *qkv_weights[3] = {layer->q, layer->k, layer->v};
        const int64_t offsets[3] = {0, qd, qd + kd};
        ssd_matmul(pool, 3, qkv_weights, &act, qkv, qkv_width, offsets);
        for (int r = 0; r < rows; r++) {
            float *q = qkv + (size_t)r * qkv_width, *k = q + qd, *v = k + kd;
            if (layer->q_bias)
                for (int i = 0; i < qd; i++)
                    q[i] += layer->q_bias[i];
            if (layer->k_bias)
                for (int i = 0; i < kd; i++)
                    k[i] += layer->k_bias[i];
            if (layer->v_bias)
                for (int i = 0; i < kd; i++)
                    v[i] += layer->v_bias[i];
            if (layer->q_norm)
                for (int h = 0; h < m->heads; h++)
                    rms_norm(q + h * d, layer->q_norm, d, m->eps, q + h * d);
            if (layer->k_norm)
                for (int h = 0; h < m->kv_heads; h++)
                    rms_norm(k + h * d, layer->k_norm, d, m->eps, k + h * d);
            const float *c = m->cos + a->positions[r] * half, *s = m->sin + a->positions[r] * half;
            for (int h = 0; h < m->heads; h++)
                rotate(q + h * d, c, s, half);
            for (int h = 0; h < m->kv_heads; h++)
                rotate(k + h * d, c, s, half);
            const int b = r / tokens, slot = a->lengths[b] + r % tokens;
            for (int h = 0; h < m->kv_heads; h++) {
                memcpy(a->keys[l] + b * row_stride + h * head_stride + (int64_t)slot * d, k + h * d, sizeof(float) * d);
                memcpy(a->values[l] + b * row_stride + h * head_stride + (int64_t)slot * d, v + h * d,
                       sizeof(float) * d);
            }
        }
        for (int r = 0; r < rows; r++) {   /* after every row's keys are written: a token may see the step's others */
            const int b = r / tokens, t = r % tokens, prefix = a->lengths[b];
            const int32_t *bits = a->mask + ((size_t)b * tokens + t) * a->mask_words;
            int count = 0;
            for (int s = 0; s < prefix; s++)
                slots[count++] = s;
            for (int j = 0; j < tokens; j++)
                if ((bits[j >> 5] >> (j & 31)) & 1)
                    slots[count++] = prefix + j;
            attend(m, qkv + (size_t)r * qkv_width, a->keys[l] + b * row_stride, a->values[l] + b * row_stride,
                   a->capacity, slots, count, scores, in + (size_t)r * qd);
        }
        matmul(pool, layer->o, &act, in, rows, proj);
        for (size_t i = 0; i < (size_t)rows * hidden; i++)
            x[i] += proj[i];
        for (int r = 0; r < rows; r++)
            rms_norm(x + (size_t)r * hidden, layer->mlp_norm, hidden, m->eps, in + (size_t)r * hidden);
        act.m = rows;
        act.k = hidden;
        ssd_quantize(pool, in, hidden, &act);
        const ssd_weight *gate_up_weights[2] = {layer->gate, layer->up};
        const int64_t gate_up_offsets[2] = {0, inter};
        ssd_matmul(pool, 2, gate_up_weights, &act, gate_up, 2 * inter, gate_up_offsets);
        for (int r = 0; r < rows; r++) {
            const float *g = gate_up + (size_t)r * 2 * inter, *u = g + inter;
            silu_times(g, u, in + (size_t)r * inter, inter);
        }
        matmul(pool, layer->down, &act, in, rows, proj);
        for (size_t i = 0; i < (size_t)rows * hidden; i++)
            x[i] += proj[i];
    }

    for (int b = 0; b < batch; b++)
        for (int i = 0; i < a->logits_per_row; i++) {
            const int r = b * tokens + (int)a->logit_indices[b * a->logits_per_row + i];
            rms_norm(x + (size_t)r * hidden, m->final_norm, hidden, m->eps,
                     in + ((size_t)b * a->logits_per_row + i) * hidden);
        }
    matmul(pool, m->head, &act, in, picked_rows, a->logits);
    free(buffer);
    return 0;
}
