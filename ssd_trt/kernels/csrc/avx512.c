/* AVX-512 with VNNI (vpdpbusd: unsigned weight codes times signed int8 activations, four products summed into
 * each int32 lane). One 512-bit register holds one group of a sub-block: 4 consecutive k for each of the tile's
 * 16 columns, so a row's 4 activations are one broadcast dword and the 16 lanes are the 16 columns. A sub-block's
 * 8 groups are unpacked once and used for every row of the chunk. Built with -mavx512f -mavx512bw -mavx512vl
 * -mavx512vnni -mf16c -mfma; never uses AMX. */
#include <immintrin.h>
#include "layout.h"


static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

static inline void unpack(int bits, const uint8_t *codes, __m512i g[8]) {
    if (bits == 8) {
        for (int i = 0; i < 8; i++)
            g[i] = _mm512_loadu_si512(codes + 64 * i);
        return;
    }
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int p = 0; p < 4; p++) {
        const __m512i v = _mm512_loadu_si512(codes + 64 * p);
        g[2 * p] = _mm512_and_si512(v, low);
        g[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    if (bits == 5) {
        const __m512i fifth = _mm512_set1_epi8(0x10);
        for (int i = 0; i < 8; i++) {
            uint64_t mask;
            memcpy(&mask, codes + 256 + 8 * i, 8);
            g[i] = _mm512_mask_add_epi8(g[i], (__mmask64)mask, g[i], fifth);
        }
    } else if (bits == 6) {
        const __m512i top = _mm512_set1_epi8(0x30);
        for (int p = 0; p < 2; p++) {
            const __m512i h = _mm512_loadu_si512(codes + 256 + 64 * p);
            /* g | (shifted & 0x30): ternary logic A | (B & C) = 0xF8 */
            g[4 * p + 0] = _mm512_ternarylogic_epi32(g[4 * p + 0], _mm512_slli_epi16(h, 4), top, 0xF8);
            g[4 * p + 1] = _mm512_ternarylogic_epi32(g[4 * p + 1], _mm512_slli_epi16(h, 2), top, 0xF8);
            g[4 * p + 2] = _mm512_ternarylogic_epi32(g[4 * p + 2], h, top, 0xF8);
            g[4 * p + 3] = _mm512_ternarylogic_epi32(g[4 * p + 3], _mm512_srli_epi16(h, 2), top, 0xF8);
        }
    }
}

static inline __m512 negate(__m512 v) {     /* -v exactly (sign bit flipped; xor_ps would need AVX512DQ) */
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u)));
}
static inline __m512 f16x16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline __m512 u8x16(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline __m512 i8x16(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

#ifndef PREFETCH
#define PREFETCH 8192        /* bytes ahead of the unpack that the tile stream is prefetched */
#endif

/* one row's int32 dots of a sub-block: t0 over groups 0-3, t1 over groups 4-7 (Q6_K's two scale halves), or
   (other kinds) groups 0, 2, 4, 6 and 1, 3, 5, 7 -- summed after; integer sums, so the split changes nothing */
static inline void row_dots(const int kind, const __m512i *g, const int8_t *xq, __m512i *t0, __m512i *t1) {
    if (kind == SSD_Q6_K) {
        __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), g[0], bcast4(xq));
        __m512i b = _mm512_dpbusd_epi32(_mm512_setzero_si512(), g[4], bcast4(xq + 16));
        for (int i = 1; i < 4; i++) {
            a = _mm512_dpbusd_epi32(a, g[i], bcast4(xq + 4 * i));
            b = _mm512_dpbusd_epi32(b, g[4 + i], bcast4(xq + 16 + 4 * i));
        }
        *t0 = a, *t1 = b;
    } else {
        __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), g[0], bcast4(xq));
        __m512i b = _mm512_dpbusd_epi32(_mm512_setzero_si512(), g[1], bcast4(xq + 4));
        for (int i = 1; i < 4; i++) {
            a = _mm512_dpbusd_epi32(a, g[2 * i], bcast4(xq + 8 * i));
            b = _mm512_dpbusd_epi32(b, g[2 * i + 1], bcast4(xq + 8 * i + 4));
        }
        *t0 = a, *t1 = b;
    }
}

/* the 16 columns' scale s and minimum m of sub-block j of the K-block at sp ([0], and Q6_K's second half [1]) */
static inline __attribute__((always_inline)) void scales(const int kind, const uint8_t *sp, int j, __m512 *sv,
                                                         __m512 *mv) {
    const __m512 d = f16x16(sp);
    switch (kind) {
    case SSD_Q4_0: sv[0] = d; mv[0] = _mm512_mul_ps(d, _mm512_set1_ps(-8.0f)); break;
    case SSD_Q5_0: sv[0] = d; mv[0] = _mm512_mul_ps(d, _mm512_set1_ps(-16.0f)); break;
    case SSD_Q8_0: sv[0] = d; mv[0] = _mm512_mul_ps(d, _mm512_set1_ps(-128.0f)); break;
    case SSD_Q4_1: case SSD_Q5_1: sv[0] = d; mv[0] = f16x16(sp + 32); break;
    case SSD_Q4_K: case SSD_Q5_K:
        sv[0] = _mm512_mul_ps(d, u8x16(sp + 64 + j * 16));
        mv[0] = negate(_mm512_mul_ps(f16x16(sp + 32), u8x16(sp + 64 + 128 + j * 16)));
        break;
    case SSD_Q6_K:
        for (int h = 0; h < 2; h++) {
            sv[h] = _mm512_mul_ps(d, i8x16(sp + 32 + (2 * j + h) * 16));
            mv[h] = _mm512_mul_ps(sv[h], _mm512_set1_ps(-32.0f));
        }
        break;
    default: break;
    }
}

/* acc after sub-block b of row r (ssd_kernels.h's arithmetic) */
static inline __attribute__((always_inline)) __m512 row_step(const int kind, const __m512i *g, const ssd_act *a,
                                                             int r, int64_t b, const __m512 *sv, const __m512 *mv,
                                                             __m512 acc) {
    const int64_t at = r * (int64_t)(a->k / SSD_SUB) + b;
    __m512i t0, t1;
    row_dots(kind, g, a->q + (int64_t)r * a->k + b * SSD_SUB, &t0, &t1);
    const __m512 dx = _mm512_set1_ps(a->d[at]);
    if (kind == SSD_Q6_K) {
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t0), _mm512_mul_ps(sv[0], dx), acc);
        acc = _mm512_fmadd_ps(mv[0], _mm512_set1_ps(a->ds16[2 * at]), acc);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t1), _mm512_mul_ps(sv[1], dx), acc);
        return _mm512_fmadd_ps(mv[1], _mm512_set1_ps(a->ds16[2 * at + 1]), acc);
    }
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(t0, t1)), _mm512_mul_ps(sv[0], dx), acc);
    return _mm512_fmadd_ps(mv[0], _mm512_set1_ps(a->ds[at]), acc);
}

/* rows r0 .. r0 + rows - 1 (at most DIRECT) of one tile: each sub-block unpacked into registers and used at once for
   every row, whose sums stay in registers; rows is a constant where this is inlined. A tile is at most ~120 KB, so
   the next group of rows reads it from L2, not memory. */
#define DIRECT 8
static inline __attribute__((always_inline)) void tile_few_rows(const int kind, const ssd_weight *w,
                                                                const ssd_act *a, const uint8_t *tile, int r0,
                                                                float *y, int64_t ldy, int ncols, const int rows) {
    const int bits = ssd_code_bits(kind), subs = ssd_kblock(kind) / SSD_SUB, code_bytes = ssd_code_bytes(bits);
    const int scale_bytes = ssd_scale_bytes(kind), kblocks = w->k / ssd_kblock(kind);
    const size_t kblock_bytes = ssd_kblock_bytes(kind);
    __m512 acc[DIRECT];     /* in registers: every loop over the rows is unrolled, rows a constant */
#pragma GCC unroll 8
    for (int i = 0; i < DIRECT; i++)
        acc[i] = _mm512_setzero_ps();
    for (int kb = 0; kb < kblocks; kb++) {
        const uint8_t *sp = tile + kb * kblock_bytes;
        for (int j = 0; j < subs; j++) {
            const uint8_t *codes = sp + scale_bytes + j * code_bytes;
            for (int line = 0; line < code_bytes; line += 64)
                _mm_prefetch((const char *)codes + PREFETCH + line, _MM_HINT_T0);
            __m512i g[8];
            __m512 sv[2], mv[2];
            unpack(bits, codes, g);
            scales(kind, sp, j, sv, mv);
#pragma GCC unroll 8
            for (int i = 0; i < DIRECT; i++)
                if (i < rows)
                    acc[i] = row_step(kind, g, a, r0 + i, (int64_t)kb * subs + j, sv, mv, acc[i]);
        }
    }
    const __mmask16 keep = ncols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << ncols) - 1);
#pragma GCC unroll 8
    for (int i = 0; i < DIRECT; i++)
        if (i < rows)
            _mm512_mask_storeu_ps(y + (r0 + i) * ldy, keep, acc[i]);
}

static inline __attribute__((always_inline)) void tiles_of_kind(const int kind, const ssd_weight *w,
                                                                const ssd_act *a, float *y, int64_t ldy, int t0,
                                                                int t1) {
    const size_t tile_bytes = ssd_tile_bytes(kind, w->k);
    for (int t = t0; t < t1; t++) {
        const uint8_t *tile = w->tiles + t * tile_bytes;
        float *yt = y + t * SSD_TILE;
        const int ncols = w->n - t * SSD_TILE;
        for (int r0 = 0; r0 < a->m; r0 += DIRECT) {
            switch (a->m - r0 < DIRECT ? a->m - r0 : DIRECT) {     /* the row count a constant in each */
            case 1: tile_few_rows(kind, w, a, tile, r0, yt, ldy, ncols, 1); break;
            case 2: tile_few_rows(kind, w, a, tile, r0, yt, ldy, ncols, 2); break;
            case 3: tile_few_rows(kind, w, a, tile, r0, yt, ldy, ncols, 3); break;
            case 4: tile_few_rows(kind, w, a, tile, r0, yt, ldy, ncols, 4); break;
            case 5: tile_few_rows(kind, w, a, tile, r0, yt, ldy, ncols, 5); break;
            case 6: tile_few_rows(kind, w, a, tile, r0, yt, ldy, ncols, 6); break;
            case 7: tile_few_rows(kind, w, a, tile, r0, yt, ldy, ncols, 7); break;
            default: tile_few_rows(kind, w, a, tile, r0, yt, ldy, ncols, 8); break;
            }
        }
    }
}

SSD_MATMUL_TILES(tiles_of_kind)

/* the same quantization as scalar.c, 16 lanes at a time: max |x|, d = max / 127, q = cvtps2dq(x * (1 / d)) */
static void quantize(const float *x, int64_t ldx, ssd_act *a) {
    const int64_t row_blocks = a->k / SSD_SUB;
    for (int r = 0; r < a->m; r++) {
        for (int64_t b = 0; b < row_blocks; b++) {
            const float *xb = x + r * ldx + b * SSD_SUB;
            const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
            const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
            int8_t *out = a->q + r * a->k + b * SSD_SUB;
            _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(out + 16), _mm512_cvtepi32_epi8(q1));
            const int s0 = _mm512_reduce_add_epi32(q0), s1 = _mm512_reduce_add_epi32(q1);
            const int64_t at = r * row_blocks + b;
            a->d[at] = d;
            a->ds[at] = d * (float)(s0 + s1);
            a->ds16[2 * at] = d * (float)s0;
            a->ds16[2 * at + 1] = d * (float)s1;
        }
    }
}

const ssd_isa ssd_isa_avx512vnni = {"avx512vnni", quantize, matmul_tiles};
