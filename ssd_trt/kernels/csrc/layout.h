/* The tile layout read element by element: what every path computes, spelled out once (ssd_kernels.h says the
 * layout). The scalar path and the dequantization use these; the SIMD paths read the same bytes in registers. */
#ifndef SSD_LAYOUT_H
#define SSD_LAYOUT_H

#include <string.h>
#include "ssd_kernels.h"

static inline float ssd_f16(const uint8_t *p) {   /* IEEE half -> float, exact */
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {                                       /* subnormal: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* the code of column c (0..15), k (0..31) of one sub-block's codes */
static inline int ssd_code_at(int bits, const uint8_t *codes, int c, int k) {
    int g = k >> 2, j = c * 4 + (k & 3);
    if (bits == 8)
        return codes[g * 64 + j];
    int u = (codes[(g >> 1) * 64 + j] >> ((g & 1) * 4)) & 15;
    if (bits == 5)
        u |= ((codes[256 + g * 8 + (j >> 3)] >> (j & 7)) & 1) << 4;
    else if (bits == 6)
        u |= ((codes[256 + (g >> 2) * 64 + j] >> (2 * (g & 3))) & 3) << 4;
    return u;
}

/* scale s and minimum m of column c in sub-block j of the K-block whose scale fields start at sp:
 * w = s u + m for its 32 weights, or (Q6_K) for the half h = 0, 1 of them (half is ignored by other kinds) */
static inline void ssd_scale_at(int kind, const uint8_t *sp, int j, int half, int c, float *s, float *m) {
    float d = ssd_f16(sp + 2 * c);
    switch (kind) {
    case SSD_Q4_0: *s = d; *m = -8.0f * d; break;
    case SSD_Q5_0: *s = d; *m = -16.0f * d; break;
    case SSD_Q8_0: *s = d; *m = -128.0f * d; break;    /* u = q + 128 */
    case SSD_Q4_1: case SSD_Q5_1: *s = d; *m = ssd_f16(sp + 32 + 2 * c); break;
    case SSD_Q4_K: case SSD_Q5_K:
        *s = d * (float)sp[64 + j * 16 + c];
        *m = -(ssd_f16(sp + 32 + 2 * c) * (float)sp[64 + 128 + j * 16 + c]);
        break;
    case SSD_Q6_K:
        *s = d * (float)(int8_t)sp[32 + (2 * j + half) * 16 + c];
        *m = -32.0f * *s;
        break;
    default: *s = 0.0f; *m = 0.0f;
    }
}

/* the centre c of a symmetric kind (w = s (u - c), so m = -c s), 0 for the kinds with a minimum of their own */
static inline int ssd_centre(int kind) {
    switch (kind) {
    case SSD_Q4_0: return 8;
    case SSD_Q5_0: return 16;
    case SSD_Q8_0: return 128;
    case SSD_Q6_K: return 32;
    default: return 0;
    }
}

static inline size_t ssd_kblock_bytes(int kind) {
    return (size_t)ssd_scale_bytes(kind) + (size_t)(ssd_kblock(kind) / SSD_SUB) * ssd_code_bytes(ssd_code_bits(kind));
}

/* a path's matmul_tiles: one function per kind, each its own instance of the path's always-inline
   tiles_of_kind(kind, ...) with the kind a constant, chosen by the weight's kind */
#define SSD_KIND_FN(PATH_FN, K) \
    static void tiles_##K(const ssd_weight *w, const ssd_act *a, float *y, int64_t ldy, int t0, int t1) { \
        PATH_FN(SSD_##K, w, a, y, ldy, t0, t1); \
    }
#define SSD_MATMUL_TILES(PATH_FN) \
    SSD_KIND_FN(PATH_FN, Q4_0) SSD_KIND_FN(PATH_FN, Q4_1) SSD_KIND_FN(PATH_FN, Q5_0) SSD_KIND_FN(PATH_FN, Q5_1) \
    SSD_KIND_FN(PATH_FN, Q8_0) SSD_KIND_FN(PATH_FN, Q4_K) SSD_KIND_FN(PATH_FN, Q5_K) SSD_KIND_FN(PATH_FN, Q6_K) \
    static void matmul_tiles(const ssd_weight *w, const ssd_act *a, float *y, int64_t ldy, int t0, int t1) { \
        switch (w->kind) { \
        case SSD_Q4_0: tiles_Q4_0(w, a, y, ldy, t0, t1); break; \
        case SSD_Q4_1: tiles_Q4_1(w, a, y, ldy, t0, t1); break; \
        case SSD_Q5_0: tiles_Q5_0(w, a, y, ldy, t0, t1); break; \
        case SSD_Q5_1: tiles_Q5_1(w, a, y, ldy, t0, t1); break; \
        case SSD_Q8_0: tiles_Q8_0(w, a, y, ldy, t0, t1); break; \
        case SSD_Q4_K: tiles_Q4_K(w, a, y, ldy, t0, t1); break; \
        case SSD_Q5_K: tiles_Q5_K(w, a, y, ldy, t0, t1); break; \
        case SSD_Q6_K: tiles_Q6_K(w, a, y, ldy, t0, t1); break; \
        default: break; \
        } \
    }

#endif
