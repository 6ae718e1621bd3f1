/* The specification: every result of the SIMD paths equals this one bit for bit (ssd_kernels.h's arithmetic).
 * Compiled with -ffp-contract=off, so the only fused multiply-adds are the fmaf calls written here. */
#include <math.h>
#include "layout.h"

static void quantize(const float *x, int64_t ldx, ssd_act *a) {
    for (int r = 0; r < a->m; r++) {
        const float *xr = x + r * ldx;
        for (int b = 0; b < a->k / SSD_SUB; b++) {
            float amax = 0.0f;
            for (int i = 0; i < SSD_SUB; i++)
                amax = fmaxf(amax, fabsf(xr[b * SSD_SUB + i]));
            float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int sum[2] = {0, 0};
            for (int i = 0; i < SSD_SUB; i++) {
                int q = (int)lrintf(xr[b * SSD_SUB + i] * id);   /* half to even, as cvtps2dq */
                a->q[(int64_t)r * a->k + b * SSD_SUB + i] = (int8_t)q;
                sum[i >> 4] += q;
            }
            int64_t row_blocks = a->k / SSD_SUB;
            a->d[r * row_blocks + b] = d;
            a->ds[r * row_blocks + b] = d * (float)(sum[0] + sum[1]);
            a->ds16[2 * (r * row_blocks + b)] = d * (float)sum[0];
            a->ds16[2 * (r * row_blocks + b) + 1] = d * (float)sum[1];
        }
    }
}

static void matmul_tiles(const ssd_weight *w, const ssd_act *a, float *y, int64_t ldy, int tile_begin, int tile_end) {
    const int kind = w->kind, bits = ssd_code_bits(kind), subs = ssd_kblock(kind) / SSD_SUB;
    const int code_bytes = ssd_code_bytes(bits), kblocks = w->k / ssd_kblock(kind);
    const size_t tile_bytes = ssd_tile_bytes(kind, w->k), kblock_bytes = ssd_kblock_bytes(kind);
    const int64_t row_blocks = a->k / SSD_SUB;
    for (int t = tile_begin; t < tile_end; t++) {
        for (int c = 0; c < SSD_TILE && t * SSD_TILE + c < w->n; c++) {
            for (int r = 0; r < a->m; r++) {
                const int8_t *xq = a->q + (int64_t)r * a->k;
                float acc = 0.0f;
                for (int kb = 0; kb < kblocks; kb++) {
                    const uint8_t *sp = w->tiles + t * tile_bytes + kb * kblock_bytes;
                    for (int j = 0; j < subs; j++) {
                        const uint8_t *codes = sp + ssd_scale_bytes(kind) + j * code_bytes;
                        const int64_t b = (int64_t)kb * subs + j;
                        const float d = a->d[r * row_blocks + b];
                        const int halves = kind == SSD_Q6_K ? 2 : 1, width = SSD_SUB / halves;
                        for (int h = 0; h < halves; h++) {
                            int32_t dot = 0;
                            for (int i = h * width; i < (h + 1) * width; i++)
                                dot += ssd_code_at(bits, codes, c, i) * xq[b * SSD_SUB + i];
                            float s, m;
                            ssd_scale_at(kind, sp, j, h, c, &s, &m);
                            const float dsum = halves == 2 ? a->ds16[2 * (r * row_blocks + b) + h]
                                                           : a->ds[r * row_blocks + b];
                            acc = fmaf((float)dot, s * d, acc);
                            acc = fmaf(m, dsum, acc);
                        }
                    }
                }
                y[r * ldy + t * SSD_TILE + c] = acc;
            }
        }
    }
}

const ssd_isa ssd_isa_scalar = {"scalar", quantize, matmul_tiles};
