/* AVX2 (no VNNI): a 256-bit register holds one group of half a tile (4 consecutive k for 8 columns). The dot of
 * unsigned codes with signed activations is vpmaddubsw (pairs into int16: at most 2 * 63 * 127 for codes of up to
 * 6 bits, no saturation) then vpmaddwd with ones (pairs into int32). 8-bit codes (Q8_0, u = q + 128) would
 * saturate there, so they take the sign trick on q = u - 128 instead and add back 128 * sum(x): the same int32.
 * Order of the work (it changes no value: each accumulator sees its fmas in K order): a tile is read one span of
 * 256 weights along K at a time, both halves and every row of a chunk of up to 16 rows before the next span, the
 * accumulators parked in L1 between spans. So the tile streams from memory once, in order (reading a half's 32
 * bytes of each line in two passes over the whole tile left the memory stream half idle: 11.5 against 16 GB/s at
 * M = 1 on a Q4_K weight, AMD EPYC 9004 without AVX-512).
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

/* the 8 groups of half `h` of a sub-block's codes */
static inline void unpack(int bits, const uint8_t *codes, int h, __m256i g[8]) {
    const int at = 32 * h;
    if (bits == 8) {
        for (int i = 0; i < 8; i++)
            g[i] = _mm256_loadu_si256((const __m256i *)(codes + 64 * i + at));
        return;
    }
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int p = 0; p < 4; p++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(codes + 64 * p + at));
        g[2 * p] = _mm256_and_si256(v, low);
        g[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    if (bits == 5) {
        /* byte j of the group takes bit j of its 32-bit word: spread the word's bytes (byte j/8 to byte j), keep
           bit j%8, compare */
        const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
        const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
        const __m256i fifth = _mm256_set1_epi8(0x10);
        for (int i = 0; i < 8; i++) {
            int32_t word;
            memcpy(&word, codes + 256 + 8 * i + 4 * h, 4);
            const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(word), spread);
            const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
            g[i] = _mm256_or_si256(g[i], _mm256_and_si256(set, fifth));
        }
    } else if (bits == 6) {
        const __m256i top = _mm256_set1_epi8(0x30);
        for (int p = 0; p < 2; p++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(codes + 256 + 64 * p + at));
            g[4 * p + 0] = _mm256_or_si256(g[4 * p + 0], _mm256_and_si256(_mm256_slli_epi16(v, 4), top));
            g[4 * p + 1] = _mm256_or_si256(g[4 * p + 1], _mm256_and_si256(_mm256_slli_epi16(v, 2), top));
            g[4 * p + 2] = _mm256_or_si256(g[4 * p + 2], _mm256_and_si256(v, top));
            g[4 * p + 3] = _mm256_or_si256(g[4 * p + 3], _mm256_and_si256(_mm256_srli_epi16(v, 2), top));
        }
    }
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

/* sum over groups first .. first + count - 1 (k = 4 first .. 4 (first + count) - 1) of code x activation, per
 * column lane, exact in int32. vpmaddubsw gives int16 pairs of at most 2 * (2^bits - 1) * 127; as many of them as
 * cannot overflow int16 are summed there before one vpmaddwd widens them (8 for 4-bit codes: 8 * 3810 = 30480,
 * 4 for 5-bit: 31496, 2 for 6-bit: 32004; 8-bit codes take dot4's sign trick, one group at a time). The int32 sum
 * is the same whatever the grouping, so every path's t is too. */
static inline __attribute__((always_inline)) __m256i dot_groups(int bits, const __m256i g[8], const int8_t *xq, int first, int count) {
    const int per = bits == 4 ? 8 : bits == 5 ? 4 : bits == 6 ? 2 : 1;
    if (per == 1) {
        __m256i t = dot4(bits, g[first], bcast4(xq + 4 * first));
        for (int i = first + 1; i < first + count; i++)
            t = _mm256_add_epi32(t, dot4(bits, g[i], bcast4(xq + 4 * i)));
        return t;
    }
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i t = _mm256_setzero_si256();
    for (int c = first; c < first + count; c += per) {
        const int n = per < first + count - c ? per : first + count - c;
        __m256i p = _mm256_maddubs_epi16(g[c], bcast4(xq + 4 * c));
        for (int i = c + 1; i < c + n; i++)
            p = _mm256_add_epi16(p, _mm256_maddubs_epi16(g[i], bcast4(xq + 4 * i)));
        t = c == first ? _mm256_madd_epi16(p, ones) : _mm256_add_epi32(t, _mm256_madd_epi16(p, ones));
    }
    return t;
}

static inline __m256 f16x8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline int sum32(const int8_t *q) {
    int s = 0;
    for (int i = 0; i < SSD_SUB; i++)
        s += q[i];
    return s;
}

/* 8 int32 lanes, each its column's int16 value a in both halves (so vpmaddwd against int16 pairs (p, q) gives
   a p + a q), from 8 bytes: unsigned, or (Q6_K's scales) signed */
static inline __m256i same_pair(const uint8_t *p, int is_signed) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)p);
    const __m256i v = is_signed ? _mm256_and_si256(_mm256_cvtepi8_epi32(bytes), _mm256_set1_epi32(0xFFFF))
                                : _mm256_cvtepu8_epi32(bytes);
    return _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
}
/* 8 int32 lanes holding the int16 pair (a_c, b_c) of each column c, from two rows of 8 bytes */
static inline __m256i two_pair(const uint8_t *pa, const uint8_t *pb, int is_signed) {
    const __m128i a = _mm_loadl_epi64((const __m128i *)pa), b = _mm_loadl_epi64((const __m128i *)pb);
    const __m256i lo = is_signed ? _mm256_and_si256(_mm256_cvtepi8_epi32(a), _mm256_set1_epi32(0xFFFF))
                                 : _mm256_cvtepu8_epi32(a);
    const __m256i hi = is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
    return _mm256_or_si256(lo, _mm256_slli_epi32(hi, 16));
}
static inline __m256i bcast_pair(const int16_t *p) {     /* (p[0], p[1]) in every lane */
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* a K-quant (Q4_K, Q5_K, Q6_K): rows r0 .. r0 + rows - 1, columns 8 h .. 8 h + 7 of K-block kb of one tile
 * (ssd_kernels.h's T, N and fmas). The sub-scale multiplies in int16 -> int32: vpmaddwd of the summed vpmaddubsw
 * pairs with the column's scale in both halves (|sc sum| fits: dot_groups' bounds times 2 * 127); no float work
 * until the K-block's end. The accumulators come from acc (row r at acc[16 r + 8 h], zero when kb is 0) and go
 * back there. */
static inline __attribute__((always_inline)) void kquant_rows(const int kind, const ssd_act *a, const uint8_t *tile,
                                                              int h, int r0, const int rows, int kb, float *accbuf) {
    const int bits = ssd_code_bits(kind), code_bytes = ssd_code_bytes(bits), scale_bytes = ssd_scale_bytes(kind);
    const int per = bits == 4 ? 8 : bits == 5 ? 4 : 2;    /* vpmaddubsw results an int16 sum can hold */
    const int c0 = 8 * h, kblocks = a->k / 256;
    const uint8_t *sp = tile + kb * ssd_kblock_bytes(kind);
    __m256i isum[ROWS];
    #pragma GCC unroll 4
    for (int r = 0; r < rows; r++)
        isum[r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        const uint8_t *codes = sp + scale_bytes + j * code_bytes;
        if (h == 0 && r0 == 0)
            for (int line = 0; line < code_bytes; line += 64)
                _mm_prefetch((const char *)codes + PREFETCH + line, _MM_HINT_T0);
        __m256i g[8], sc[2];
        unpack(bits, codes, h, g);
        if (kind == SSD_Q6_K) {      /* scale blocks 2j (groups 0-3) and 2j + 1 (groups 4-7) */
            sc[0] = same_pair(sp + 32 + (2 * j) * 16 + c0, 1);
            sc[1] = same_pair(sp + 32 + (2 * j + 1) * 16 + c0, 1);
        } else {
            sc[0] = sc[1] = same_pair(sp + 64 + j * 16 + c0, 0);
        }
        #pragma GCC unroll 4
        for (int r = 0; r < rows; r++) {
            const int8_t *xq = a->qk + (int64_t)(r0 + r) * a->k + kb * 256 + j * SSD_SUB;
            __m256i t = isum[r];
            for (int c = 0; c < 8; c += per) {
                __m256i p = _mm256_maddubs_epi16(g[c], bcast4(xq + 4 * c));
                for (int i = c + 1; i < c + per; i++)
                    p = _mm256_add_epi16(p, _mm256_maddubs_epi16(g[i], bcast4(xq + 4 * i)));
                t = _mm256_add_epi32(t, _mm256_madd_epi16(p, sc[c >> 2]));
            }
            isum[r] = t;
        }
    }
    const __m256 d = f16x8(sp + 2 * c0);
    __m256i side[ROWS];          /* N (Q4_K, Q5_K) or sum_i sc_i sum qk (Q6_K), by int16 pairs of scale blocks */
    #pragma GCC unroll 4
    for (int r = 0; r < rows; r++)
        side[r] = _mm256_setzero_si256();
    const int pairs = kind == SSD_Q6_K ? 8 : 4;
    for (int i = 0; i < pairs; i++) {
        const __m256i s = kind == SSD_Q6_K ? two_pair(sp + 32 + (2 * i) * 16 + c0, sp + 32 + (2 * i + 1) * 16 + c0, 1)
                                           : two_pair(sp + 192 + (2 * i) * 16 + c0, sp + 192 + (2 * i + 1) * 16 + c0, 0);
        #pragma GCC unroll 4
        for (int r = 0; r < rows; r++) {
            const int16_t *sums = kind == SSD_Q6_K ? a->sk16 + (int64_t)(r0 + r) * (a->k / 16) + kb * 16
                                                   : a->sk32 + (int64_t)(r0 + r) * (a->k / 32) + kb * 8;
            side[r] = _mm256_add_epi32(side[r], _mm256_madd_epi16(s, bcast_pair(sums + 2 * i)));
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < rows; r++) {
        const __m256 dk = _mm256_set1_ps(a->dk[(int64_t)(r0 + r) * kblocks + kb]);
        __m256 acc = kb ? _mm256_loadu_ps(accbuf + 16 * r + c0) : _mm256_setzero_ps();
        if (kind == SSD_Q6_K) {
            const __m256i T = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(side[r], 5));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(T), _mm256_mul_ps(d, dk), acc);
        } else {
            const __m256 dmin = f16x8(sp + 32 + 2 * c0);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, dk), acc);
            acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(side[r]), _mm256_mul_ps(dmin, dk), acc);
        }
        _mm256_storeu_ps(accbuf + 16 * r + c0, acc);
    }
}

/* a 32-weight kind: rows r0 .. r0 + rows - 1, columns 8 h .. 8 h + 7 of one tile, over the K-blocks kb0 .. kb1 - 1:
 * the accumulators come from acc (row r at acc[16 r + 8 h], zero when kb0 is 0) and go back there */
static inline __attribute__((always_inline)) void half_rows(const int kind, const ssd_act *a, const uint8_t *tile,
                                                            int h, int r0, const int rows, int kb0, int kb1,
                                                            float *accbuf) {
    if (ssd_is_kquant(kind)) {
        for (int kb = kb0; kb < kb1; kb++)
            kquant_rows(kind, a, tile, h, r0, rows, kb, accbuf);
        return;
    }
    const int bits = ssd_code_bits(kind), scale_bytes = ssd_scale_bytes(kind);
    const size_t kblock_bytes = ssd_kblock_bytes(kind);
    const int64_t row_blocks = a->k / SSD_SUB;
    const int c0 = 8 * h;
    __m256 acc[ROWS];      /* in registers: every loop over the rows is unrolled, rows a constant */
    #pragma GCC unroll 4
    for (int r = 0; r < rows; r++)
        acc[r] = kb0 ? _mm256_loadu_ps(accbuf + 16 * r + c0) : _mm256_setzero_ps();
    for (int b = kb0; b < kb1; b++) {      /* one K-block is one sub-block of 32 here */
        const uint8_t *sp = tile + b * kblock_bytes, *codes = sp + scale_bytes;
        const __m256 d = f16x8(sp + 2 * c0);
        __m256 mv;
        switch (kind) {
        case SSD_Q4_0: mv = _mm256_mul_ps(d, _mm256_set1_ps(-8.0f)); break;
        case SSD_Q5_0: mv = _mm256_mul_ps(d, _mm256_set1_ps(-16.0f)); break;
        case SSD_Q8_0: mv = _mm256_mul_ps(d, _mm256_set1_ps(-128.0f)); break;
        default: mv = f16x8(sp + 32 + 2 * c0); break;                      /* Q4_1, Q5_1 */
        }
        if (h == 0 && r0 == 0)
            for (int line = 0; line < ssd_code_bytes(bits); line += 64)
                _mm_prefetch((const char *)codes + PREFETCH + line, _MM_HINT_T0);
        __m256i g[8];
        unpack(bits, codes, h, g);
        #pragma GCC unroll 4
        for (int r = 0; r < rows; r++) {
            const int8_t *xq = a->q + (int64_t)(r0 + r) * a->k + b * SSD_SUB;
            __m256i t = dot_groups(bits, g, xq, 0, 8);
            if (bits == 8)       /* back from q = u - 128 to u: + 128 sum(x) */
                t = _mm256_add_epi32(t, _mm256_set1_epi32(128 * sum32(xq)));
            const int64_t at = (r0 + r) * row_blocks + b;
            const __m256 s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(d, _mm256_set1_ps(a->d[at])), acc[r]);
            acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(a->ds[at]), s);
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < rows; r++)
        _mm256_storeu_ps(accbuf + 16 * r + c0, acc[r]);
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
                for (int h = 0; h < halves; h++) {
                    int r = 0;
                    for (; r + ROWS <= chunk; r += ROWS)
                        half_rows(kind, a, tile, h, r0 + r, ROWS, kb0, kb1, accbuf + 16 * r);
                    switch (chunk - r) {
                    case 1: half_rows(kind, a, tile, h, r0 + r, 1, kb0, kb1, accbuf + 16 * r); break;
                    case 2: half_rows(kind, a, tile, h, r0 + r, 2, kb0, kb1, accbuf + 16 * r); break;
                    case 3: half_rows(kind, a, tile, h, r0 + r, 3, kb0, kb1, accbuf + 16 * r); break;
                    default: break;
                    }
                }
            }
            const int width = ncols < SSD_TILE ? ncols : SSD_TILE;
            for (int r = 0; r < chunk; r++)
                memcpy(y + (int64_t)(r0 + r) * ldy + t * SSD_TILE, accbuf + 16 * r, sizeof(float) * width);
        }
    }
}

SSD_MATMUL_TILES(tiles_of_kind)

/* the same per-32 quantization as scalar.c, 8 lanes at a time; the per-256 one is layout.h's */
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
            int sum = 0;
            for (int i = 0; i < 4; i++) {
                int32_t q[8];
                _mm256_storeu_si256((__m256i *)q, _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id))));
                for (int l = 0; l < 8; l++) {
                    out[8 * i + l] = (int8_t)q[l];
                    sum += q[l];
                }
            }
            const int64_t at = r * row_blocks + b;
            a->d[at] = d;
            a->ds[at] = d * (float)sum;
        }
    }
    ssd_quantize_k(x, ldx, a);
}

const ssd_isa ssd_isa_avx2 = {"avx2", quantize, matmul_tiles};
