/* The specification: every result of the SIMD paths equals this one bit for bit (ssd_kernels.h's arithmetic).
 * Compiled with -ffp-contract=off, so the only fused multiply-adds are the fmaf calls written here. */
#include <math.h>
#include "layout.h"

/* d = max |x| / 127 over n values, q = round(x / d): the block quantization of both activation formats;
   returns sum q */
static int quantize_block(const float *x, int n, int8_t *q, float *d_out) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++)
        amax = fmaxf(amax, fabsf(x[i]));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int i = 0; i < n; i++) {
        const int v = (int)lrintf(x[i] * id);   /* half to even, as cvtps2dq */
        q[i] = (int8_t)v;
        sum += v;
    }
    *d_out = d;
    return sum;
}

static void quantize(const float *x, int64_t ldx, ssd_act *a) {
    const int64_t row_blocks = a->k / SSD_SUB;
    for (int r = 0; r < a->m; r++) {
        const float *xr = x + r * ldx;
        for (int b = 0; b < row_blocks; b++) {
            const int64_t at = r * row_blocks + b;
            const int sum = quantize_block(xr + b * SSD_SUB, SSD_SUB, a->q + (int64_t)r * a->k + b * SSD_SUB, &a->d[at]);
            a->ds[at] = a->d[at] * (float)sum;
        }
    }
    ssd_quantize_k(x, ldx, a);
}

/* row r, column c of a 32-weight kind: per scale block, t = sum u q, then the two fmas */
static float dot_blocks(const ssd_weight *w, const uint8_t *tile, const ssd_act *a, int r, int c) {
    const int kind = w->kind, bits = ssd_code_bits(kind);
    const int64_t row_blocks = a->k / SSD_SUB;
    const int8_t *xq = a->q + (int64_t)r * a->k;
    float acc = 0.0f;
    for (int b = 0; b < w->k / SSD_SUB; b++) {
        const uint8_t *sp = tile + b * ssd_kblock_bytes(kind), *codes = sp + ssd_scale_bytes(kind);
        int32_t t = 0;
        for (int i = 0; i < SSD_SUB; i++)
            t += ssd_code_at(bits, codes, c, i) * xq[b * SSD_SUB + i];
        float s, m;
        ssd_scale_at(kind, sp, 0, 0, c, &s, &m);
        acc = fmaf((float)t, s * a->d[r * row_blocks + b], acc);
        acc = fmaf(m, a->ds[r * row_blocks + b], acc);
    }
    return acc;
}

/* row r, column c of a K-quant: per K-block of 256, the exact integer sums T and N, then one or two fmas */
static float dot_kquant(const ssd_weight *w, const uint8_t *tile, const ssd_act *a, int r, int c) {
    const int kind = w->kind, bits = ssd_code_bits(kind), code_bytes = ssd_code_bytes(bits);
    const int width = kind == SSD_Q6_K ? 16 : 32;       /* weights per integer sub-scale */
    const int8_t *xq = a->qk + (int64_t)r * a->k;
    float acc = 0.0f;
    for (int kb = 0; kb < w->k / 256; kb++) {
        const uint8_t *sp = tile + kb * ssd_kblock_bytes(kind);
        int32_t T = 0, N = 0;
        float d = 0.0f, dmin = 0.0f;
        for (int i = 0; i < 256 / width; i++) {
            int sc, mn;
            ssd_kquant_scales(kind, sp, i, c, &sc, &mn, &d, &dmin);
            int32_t dot = 0, sum = 0;
            for (int l = i * width; l < (i + 1) * width; l++) {
                const uint8_t *codes = sp + ssd_scale_bytes(kind) + (l / SSD_SUB) * code_bytes;
                const int q = xq[kb * 256 + l];
                dot += ssd_code_at(bits, codes, c, l % SSD_SUB) * q;
                sum += q;
            }
            if (kind == SSD_Q6_K) {
                T += sc * (dot - 32 * sum);
            } else {
                T += sc * dot;
                N += mn * sum;
            }
        }
        const float dk = a->dk[r * (a->k / 256) + kb];
        acc = fmaf((float)T, d * dk, acc);
        if (kind != SSD_Q6_K)
            acc = fmaf(-(float)N, dmin * dk, acc);
    }
    return acc;
}

static void matmul_tiles(const ssd_weight *w, const ssd_act *a, float *y, int64_t ldy, int tile_begin, int tile_end) {
    const size_t tile_bytes = ssd_tile_bytes(w->kind, w->k);
    for (int t = tile_begin; t < tile_end; t++)
        for (int c = 0; c < SSD_TILE && t * SSD_TILE + c < w->n; c++)
            for (int r = 0; r < a->m; r++)
                y[r * ldy + t * SSD_TILE + c] = ssd_is_kquant(w->kind)
                                                    ? dot_kquant(w, w->tiles + t * tile_bytes, a, r, c)
                                                    : dot_blocks(w, w->tiles + t * tile_bytes, a, r, c);
}

const ssd_isa ssd_isa_scalar = {"scalar", quantize, matmul_tiles};
