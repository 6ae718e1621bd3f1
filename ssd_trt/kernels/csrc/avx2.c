/* AVX2 (no VNNI): a 256-bit register holds one group of half a tile (4 consecutive k for 8 columns). The dot of
 * unsigned codes with signed activations is vpmaddubsw (pairs into int16: at most 2 * 63 * 127 for codes of up to
 * 6 bits, no saturation) then vpmaddwd with ones (pairs into int32). 8-bit codes (Q8_0, u = q + 128) would
 * saturate there, so they take the sign trick on q = u - 128 instead and add back 128 * sum(x): the same int32.
 * Order of the work (it changes no value: each accumulator sees its fmas in K order): a tile is read one span of
 * 256 weights along K at a time, both halves and every row of a chunk of up to 16 rows before the next span, the
 * accumulators parked in L1 between spans. So the tile streams from memory once, in order (reading a half's 32
 * bytes of each line in two passes over the whole tile left the memory stream half idle: 11.5 against 16 GB/s at
 * M = 1 on a Q4_K weight, AMD EPYC 9004 without AVX-512). Within a sub-block each group is unpacked when the rows
 * use it (not all 8 first, which held them across the rows and spilled), and 1-2 rows take both halves in one pass
 * (two fma chains, each activation broadcast once): the target's layers at M = 1 in 0.69x the time, M = 4 0.88x,
 * same machine, values unchanged (research/cpu/ab_kernels.py).
 * Built with -mavx2 -mfma -mf16c. */
#include <immintrin.h>
#include "layout.h"

#define ROWS 4
#define CHUNK 16           /* rows whose accumulators one tile's pass keeps (in L1) */
#define SPAN 256            /* weights along K read for both halves and all rows of a chunk before the next */
#define PREFETCH 8192        /* bytes ahead of the unpack that the tile stream is prefetched (avx512.c) */

static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* group i (k = 4 i .. 4 i + 3) of half `h` of a sub-block's codes, for 8 columns: one register, unpacked when the
 * rows need it (unpacking all 8 groups first held them across the rows and spilled them: 16 ymm registers) */
static inline __attribute__((always_inline)) __m256i group_at(int bits, const uint8_t *codes, int h, int i) {
    const int at = 32 * h;
    if (bits == 8)
        return _mm256_loadu_si256((const __m256i *)(codes + 64 * i + at));
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256((const __m256i *)(codes + 64 * (i >> 1) + at));
    __m256i g = _mm256_and_si256(i & 1 ? _mm256_srli_epi16(v, 4) : v, low);
    if (bits == 5) {
        /* byte j of the group takes bit j of its 32-bit word: spread the word's bytes (byte j/8 to byte j), keep
           bit j%8, compare */
        const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
        const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
        int32_t word;
        memcpy(&word, codes + 256 + 8 * i + 4 * h, 4);
        const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(word), spread);
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
        g = _mm256_or_si256(g, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
    } else if (bits == 6) {  /* the top 2 bits of groups 4 p + q sit at bits 2 q, 2 q + 1 of line p */
        const __m256i v6 = _mm256_loadu_si256((const __m256i *)(codes + 256 + 64 * (i >> 2) + at));
        const int q = i & 3;
        const __m256i moved = q == 0 ? _mm256_slli_epi16(v6, 4) : q == 1 ? _mm256_slli_epi16(v6, 2)
                              : q == 2 ? v6 : _mm256_srli_epi16(v6, 2);
        g = _mm256_or_si256(g, _mm256_and_si256(moved, _mm256_set1_epi8(0x30)));
    }
    return g;
}

/* sum over 4 k of code x activation, per column lane */
static inline __m256i dot4(int bits, __m256i codes, __m256i x) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (bits == 8) {         /* q = u - 128 as int8; |q| x sign(x, q) = q x */
        const __m256i q = _mm256_xor_si256(codes, _mm256_set1_epi8((char)0x80));
        return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q)), ones);
    }
    return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), ones);
}

/* for each of `rows` rows (activations xq[r]) and each of the nh halves h0 .. h0 + nh - 1: the sum over groups
 * first .. first + count - 1 (k = 4 first .. 4 (first + count) - 1) of code x activation, per column lane, exact in
 * int32, into t[half][r]. Group by group, each group unpacked once for all rows and each activation broadcast once
 * for both halves. vpmaddubsw gives int16 pairs of at most 2 * (2^bits - 1) * 127; as many of them as cannot
 * overflow int16 are summed there before one vpmaddwd widens them (8 for 4-bit codes: 8 * 3810 = 30480, 4 for
 * 5-bit: 31496, 2 for 6-bit: 32004; 8-bit codes take dot4's sign trick, one group at a time). The int32 sum is the
 * same whatever the grouping, so every path's t is too. */
static inline __attribute__((always_inline)) void dot_rows(int bits, const uint8_t *codes, int h0, const int nh,
                                                           const int rows, const int8_t *const xq[ROWS], int first,
                                                           int count, __m256i t[2][ROWS]) {
    const int per = bits == 4 ? 8 : bits == 5 ? 4 : bits == 6 ? 2 : 1;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i p[2][ROWS];
    #pragma GCC unroll 8
    for (int i = first; i < first + count; i++) {
        __m256i g[2];
        #pragma GCC unroll 2
        for (int e = 0; e < nh; e++)
            g[e] = group_at(bits, codes, h0 + e, i);
        const int opens = (i - first) % per == 0, closes = (i - first) % per == per - 1 || i == first + count - 1;
        #pragma GCC unroll 4
        for (int r = 0; r < rows; r++) {
            const __m256i x = bcast4(xq[r] + 4 * i);
            #pragma GCC unroll 2
            for (int e = 0; e < nh; e++) {
                if (per == 1) {
                    const __m256i d = dot4(bits, g[e], x);
                    t[e][r] = i == first ? d : _mm256_add_epi32(t[e][r], d);
                    continue;
                }
                const __m256i prod = _mm256_maddubs_epi16(g[e], x);
                p[e][r] = opens ? prod : _mm256_add_epi16(p[e][r], prod);
                __asm__("" : "+x"(p[e][r]));   /* keep the sum in this order: gcc re-associates it into a tree
                                                  that holds every product at once and spills them */
                if (closes) {
                    const __m256i wide = _mm256_madd_epi16(p[e][r], ones);
                    t[e][r] = i - first < per ? wide : _mm256_add_epi32(t[e][r], wide);
                }
            }
        }
    }
}

static inline __m256 f16x8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline __m256 u8x8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline __m256 i8x8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline int sum32(const int8_t *q) {
    int s = 0;
    for (int i = 0; i < SSD_SUB; i++)
        s += q[i];
    return s;
}

/* rows r0 .. r0 + rows - 1, columns 8 h0 .. 8 (h0 + nh) - 1 of one tile (nh = 1 or 2 halves), over the K-blocks
 * kb0 .. kb1 - 1: the accumulators come from accbuf (row r, column c at accbuf[16 r + c], zero when kb0 is 0) and go
 * back there. Few rows take both halves at once: two independent fma chains instead of one, and one broadcast of
 * each activation for both (one row's chain, two fmas per sub-block of 32, was the bound at M = 1). */
static inline __attribute__((always_inline)) void tile_rows(const int kind, const ssd_act *a, const uint8_t *tile,
                                                            int h0, const int nh, int r0, const int rows, int kb0,
                                                            int kb1, float *accbuf) {
    const int bits = ssd_code_bits(kind), subs = ssd_kblock(kind) / SSD_SUB, code_bytes = ssd_code_bytes(bits);
    const int scale_bytes = ssd_scale_bytes(kind);
    const size_t kblock_bytes = ssd_kblock_bytes(kind);
    const int64_t row_blocks = a->k / SSD_SUB;
    __m256 acc[2][ROWS];   /* in registers: every loop over the rows and halves is unrolled, both constants */
    #pragma GCC unroll 2
    for (int e = 0; e < nh; e++) {
        #pragma GCC unroll 4
        for (int r = 0; r < rows; r++)
            acc[e][r] = kb0 ? _mm256_loadu_ps(accbuf + 16 * r + 8 * (h0 + e)) : _mm256_setzero_ps();
    }
    for (int kb = kb0; kb < kb1; kb++) {
        const uint8_t *sp = tile + kb * kblock_bytes;
        __m256 d[2], base_m[2];
        #pragma GCC unroll 2
        for (int e = 0; e < nh; e++) {
            const int c0 = 8 * (h0 + e);
            d[e] = f16x8(sp + 2 * c0);
            base_m[e] = _mm256_setzero_ps();
            switch (kind) {
            case SSD_Q4_0: base_m[e] = _mm256_mul_ps(d[e], _mm256_set1_ps(-8.0f)); break;
            case SSD_Q5_0: base_m[e] = _mm256_mul_ps(d[e], _mm256_set1_ps(-16.0f)); break;
            case SSD_Q8_0: base_m[e] = _mm256_mul_ps(d[e], _mm256_set1_ps(-128.0f)); break;
            case SSD_Q4_1: case SSD_Q5_1: case SSD_Q4_K: case SSD_Q5_K: base_m[e] = f16x8(sp + 32 + 2 * c0); break;
            default: break;
            }
        }
        for (int j = 0; j < subs; j++) {
            const int64_t b = (int64_t)kb * subs + j;
            const uint8_t *codes = sp + scale_bytes + j * code_bytes;
            if (h0 == 0 && r0 == 0)
                for (int line = 0; line < code_bytes; line += 64)
                    _mm_prefetch((const char *)codes + PREFETCH + line, _MM_HINT_T0);
            const int8_t *xq[ROWS];
            #pragma GCC unroll 4
            for (int r = 0; r < rows; r++)
                xq[r] = a->q + (int64_t)(r0 + r) * a->k + b * SSD_SUB;
            __m256i t[2][ROWS];
            if (kind == SSD_Q6_K) {  /* two halves of 16 k, each with its own scale: one half at a time */
                #pragma GCC unroll 2
                for (int part = 0; part < 2; part++) {
                    dot_rows(bits, codes, h0, nh, rows, xq, 4 * part, 4, t);
                    #pragma GCC unroll 2
                    for (int e = 0; e < nh; e++) {
                        const __m256 sh = _mm256_mul_ps(d[e], i8x8(sp + 32 + (2 * j + part) * 16 + 8 * (h0 + e)));
                        const __m256 mh = _mm256_mul_ps(sh, _mm256_set1_ps(-32.0f));
                        #pragma GCC unroll 4
                        for (int r = 0; r < rows; r++) {
                            const int64_t at = (r0 + r) * row_blocks + b;
                            const __m256 s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[e][r]),
                                                             _mm256_mul_ps(sh, _mm256_set1_ps(a->d[at])), acc[e][r]);
                            acc[e][r] = _mm256_fmadd_ps(mh, _mm256_set1_ps(a->ds16[2 * at + part]), s);
                        }
                    }
                }
                continue;
            }
            dot_rows(bits, codes, h0, nh, rows, xq, 0, 8, t);
            #pragma GCC unroll 2
            for (int e = 0; e < nh; e++) {
                const int c0 = 8 * (h0 + e);
                __m256 sv = d[e], mv = base_m[e];
                if (kind == SSD_Q4_K || kind == SSD_Q5_K) {
                    sv = _mm256_mul_ps(d[e], u8x8(sp + 64 + j * 16 + c0));
                    mv = _mm256_xor_ps(_mm256_mul_ps(base_m[e], u8x8(sp + 64 + 128 + j * 16 + c0)),
                                       _mm256_set1_ps(-0.0f));
                }
                #pragma GCC unroll 4
                for (int r = 0; r < rows; r++) {
                    __m256i te = t[e][r];
                    if (bits == 8)       /* back from q = u - 128 to u: + 128 sum(x) */
                        te = _mm256_add_epi32(te, _mm256_set1_epi32(128 * sum32(xq[r])));
                    const int64_t at = (r0 + r) * row_blocks + b;
                    const __m256 s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(te),
                                                     _mm256_mul_ps(sv, _mm256_set1_ps(a->d[at])), acc[e][r]);
                    acc[e][r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(a->ds[at]), s);
                }
            }
        }
    }
    #pragma GCC unroll 2
    for (int e = 0; e < nh; e++) {
        #pragma GCC unroll 4
        for (int r = 0; r < rows; r++)
            _mm256_storeu_ps(accbuf + 16 * r + 8 * (h0 + e), acc[e][r]);
    }
}

static inline __attribute__((always_inline)) void tiles_of_kind(const int kind, const ssd_weight *w,
                                                                const ssd_act *a, float *y, int64_t ldy, int t0,
                                                                int t1) {
    const size_t tile_bytes = ssd_tile_bytes(kind, w->k);
    const int kblocks = w->k / ssd_kblock(kind), span = SPAN / ssd_kblock(kind);
    float accbuf[CHUNK * SSD_TILE] __attribute__((aligned(32)));
    for (int t = t0; t < t1; t++) {
        const uint8_t *tile = w->tiles + t * tile_bytes;
        const int ncols = w->n - t * SSD_TILE, halves = ncols > 8 ? 2 : 1;
        for (int r0 = 0; r0 < a->m; r0 += CHUNK) {
            const int chunk = a->m - r0 < CHUNK ? a->m - r0 : CHUNK;
            /* one span of K at a time for both halves and every row of the chunk: the span's bytes come from
               memory once, in order, and are read again from L1 */
            for (int kb0 = 0; kb0 < kblocks; kb0 += span) {
                const int kb1 = kb0 + span < kblocks ? kb0 + span : kblocks;
                int r = 0;
                for (; r + ROWS <= chunk; r += ROWS)
                    for (int h = 0; h < halves; h++)
                        tile_rows(kind, a, tile, h, 1, r0 + r, ROWS, kb0, kb1, accbuf + 16 * r);
                /* the last 1-3 rows: both halves in one pass where the tile has them */
                switch ((chunk - r) * 2 + (halves - 1)) {
                case 2: tile_rows(kind, a, tile, 0, 1, r0 + r, 1, kb0, kb1, accbuf + 16 * r); break;
                case 3: tile_rows(kind, a, tile, 0, 2, r0 + r, 1, kb0, kb1, accbuf + 16 * r); break;
                case 4: tile_rows(kind, a, tile, 0, 1, r0 + r, 2, kb0, kb1, accbuf + 16 * r); break;
                case 5: tile_rows(kind, a, tile, 0, 2, r0 + r, 2, kb0, kb1, accbuf + 16 * r); break;
                case 6: tile_rows(kind, a, tile, 0, 1, r0 + r, 3, kb0, kb1, accbuf + 16 * r); break;
                case 7:
                    tile_rows(kind, a, tile, 0, 1, r0 + r, 3, kb0, kb1, accbuf + 16 * r);
                    tile_rows(kind, a, tile, 1, 1, r0 + r, 3, kb0, kb1, accbuf + 16 * r);
                    break;
                default: break;
                }
            }
            const int width = ncols < SSD_TILE ? ncols : SSD_TILE;
            for (int r = 0; r < chunk; r++)
                memcpy(y + (int64_t)(r0 + r) * ldy + t * SSD_TILE, accbuf + 16 * r, sizeof(float) * width);
        }
    }
}

SSD_MATMUL_TILES(tiles_of_kind)

/* the same quantization as scalar.c, 8 lanes at a time */
static void quantize(const float *x, int64_t ldx, ssd_act *a) {
    const int64_t row_blocks = a->k / SSD_SUB;
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int r = 0; r < a->m; r++) {
        for (int64_t b = 0; b < row_blocks; b++) {
            const float *xb = x + r * ldx + b * SSD_SUB;
            __m256 v[4], mx = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(xb + 8 * i);
                mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], sign));
            }
            float lanes[8];
            _mm256_storeu_ps(lanes, mx);
            float amax = 0.0f;
            for (int i = 0; i < 8; i++)
                amax = amax > lanes[i] ? amax : lanes[i];
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int8_t *out = a->q + r * a->k + b * SSD_SUB;
            int sums[2] = {0, 0};
            for (int i = 0; i < 4; i++) {
                int32_t q[8];
                _mm256_storeu_si256((__m256i *)q, _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id))));
                for (int l = 0; l < 8; l++) {
                    out[8 * i + l] = (int8_t)q[l];
                    sums[i >> 1] += q[l];
                }
            }
            const int64_t at = r * row_blocks + b;
            a->d[at] = d;
            a->ds[at] = d * (float)(sums[0] + sums[1]);
            a->ds16[2 * at] = d * (float)sums[0];
            a->ds16[2 * at + 1] = d * (float)sums[1];
        }
    }
}

const ssd_isa ssd_isa_avx2 = {"avx2", quantize, matmul_tiles};
