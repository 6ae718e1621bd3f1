/* ssd-trt's CPU kernels: a small-M matmul over GGUF blocks, as the file stores them, repacked into column tiles.
 *
 * y[r, n] = sum_k x[r, k] W[k, n] for M rows r of activations and the N output columns of a weight W [K, N].
 *
 * Weights. Every GGUF block kind carries unsigned integer codes u and, per scale block of 32 (16 for Q6_K)
 * weights along K, a scale s and a minimum m with w = s u + m exactly (ssd_trt/kernels/tiles.py says how each
 * kind's fields give s and m; both are exact in fp32, so the repack changes no value). The repack groups 16
 * output columns into a tile and stores, per K-block of the kind (32 weights, or a K-quant's 256), the file's own
 * scale fields for the 16 columns followed by their codes for every 32 weights ("sub-block") of it:
 *
 *   codes of one sub-block: 8 groups g of 4 consecutive k (4g .. 4g+3); a group's 64 bytes hold column c's four
 *   codes at bytes 4c .. 4c+3 (so one 512-bit register is one group, and one 256-bit register is half a tile).
 *     8-bit codes: the 8 groups one after another (512 bytes).
 *     4-bit codes: 4 chunks of 64 bytes; chunk p's low nibbles are group 2p, its high nibbles group 2p+1.
 *     5-bit codes: the 4-bit chunks, then 8 words of 64 bits: bit j of word g is the 5th bit of group g's byte j.
 *     6-bit codes: the 4-bit chunks, then 2 chunks of 64 bytes: bits 2i, 2i+1 of chunk p's byte j are the top two
 *                  bits of group 4p+i's byte j.
 *
 * Activations are quantized per row and per 32 along K as llama.cpp's Q8_0 does (ggml-quants.c,
 * quantize_row_q8_0: d = max|x| / 127, q = round(x / d)), keeping d in fp32 and rounding half to even, with the
 * block sums of q (as Q8_1 stores them) and, for Q6_K's 16-wide scale blocks, the sums of each half.
 *
 * Arithmetic, the same in every instruction-set path (so all of them give bit-identical results): for each scale
 * block in K order, t = sum u q (exact, int32), then
 *     acc = fma((float) t, s * d, acc);  acc = fma(m, d * (float) sum q, acc)
 * starting from acc = 0; y = acc. A row's result depends on nothing but that row and the weight: not on M, not on
 * the row's place among the others, not on how columns are split between threads.
 */
#ifndef SSD_KERNELS_H
#define SSD_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SSD_TILE 16          /* output columns per tile */
#define SSD_SUB 32           /* weights along K per sub-block (one activation block) */

/* GGML's type ids (ggml.h), the kinds the kernel reads */
enum ssd_kind { SSD_Q4_0 = 2, SSD_Q4_1 = 3, SSD_Q5_0 = 6, SSD_Q5_1 = 7, SSD_Q8_0 = 8,
                SSD_Q4_K = 12, SSD_Q5_K = 13, SSD_Q6_K = 14 };

typedef struct {
    int32_t kind;            /* enum ssd_kind */
    int32_t k;               /* reduction length: a multiple of the kind's K-block */
    int32_t n;               /* output columns (the tiles hold ceil(n / 16) * 16; padding columns are zero) */
    int32_t reserved;
    const uint8_t *tiles;    /* ceil(n / 16) tiles of ssd_tile_bytes(kind, k) bytes each */
} ssd_weight;

typedef struct {
    int32_t m;               /* rows */
    int32_t k;               /* a multiple of 32 */
    int8_t *q;               /* [m, k] */
    float *d;                /* [m, k / 32] the block scales */
    float *ds;               /* [m, k / 32] d * sum q over the block */
    float *ds16;             /* [m, k / 16] d * sum q over each half block (Q6_K's scale blocks) */
} ssd_act;

/* bytes of one 16-column tile of a weight of this kind and K (0: unknown kind or K not a multiple of its block) */
size_t ssd_tile_bytes(int kind, int k);
/* bit 0: avx2 + fma + f16c, bit 1: avx512 f/bw/vl + vnni (each with the OS saving the registers) */
int ssd_cpu_features(void);
/* one function table per instruction set (the files scalar.c, avx2.c, avx512.c) */
typedef struct {
    const char *name;
    /* quantize rows x [m, k] (row stride ldx floats) into a (its buffers sized as above) */
    void (*quantize)(const float *x, int64_t ldx, ssd_act *a);
    /* y[r, n] (row stride ldy) for the columns of tiles [tile_begin, tile_end) of w */
    void (*matmul_tiles)(const ssd_weight *w, const ssd_act *a, float *y, int64_t ldy, int tile_begin, int tile_end);
} ssd_isa;
/* a path by name ("avx512vnni", "avx2", "scalar"; "auto": the best this CPU runs), NULL when this CPU cannot run it
 * (AMX is never used: no path holds an AMX instruction) */
const ssd_isa *ssd_isa_find(const char *name);

/* the weight dequantized: out [k, n] (row stride ldw) -- the reference the tests hold the file's blocks to */
void ssd_dequantize(const ssd_weight *w, float *out, int64_t ldw);

/* a pool of worker threads on one path: the caller's thread plus threads - 1 workers (pinned to cores[1..] when
 * cores is given); spin: microseconds a worker polls for the next job before it sleeps */
typedef struct ssd_pool ssd_pool;
ssd_pool *ssd_pool_create(const ssd_isa *isa, int threads, const int *cores, int spin_us);
void ssd_pool_destroy(ssd_pool *pool);
const char *ssd_pool_path(const ssd_pool *pool);
int ssd_pool_threads(const ssd_pool *pool);
/* quantize x into a (on the calling thread) */
void ssd_quantize(ssd_pool *pool, const float *x, int64_t ldx, ssd_act *a);
/* y[:, col_offset[i] + n] = a w[i] for each of count weights (all of a's k), their tiles split over the pool */
void ssd_matmul(ssd_pool *pool, int count, const ssd_weight *const *w, const ssd_act *a, float *y, int64_t ldy,
                const int64_t *col_offset);
/* count independent products y_i [m, n_i] = x_i [m, k_i] w_i, each x_i quantized into act_i first, in one call
   (what a model's step does between its other ops; the kernel benchmark times a whole model's layers this way) */
void ssd_matmul_each(ssd_pool *pool, int count, const ssd_weight *const *w, const float *const *x, ssd_act *const *act,
                     float *const *y);


extern const ssd_isa ssd_isa_scalar;
extern const ssd_isa ssd_isa_avx2;
extern const ssd_isa ssd_isa_avx512vnni;

/* layout helpers shared by the paths */
static inline int ssd_kblock(int kind) {       /* weights along K of one stored K-block */
    return (kind == SSD_Q4_K || kind == SSD_Q5_K || kind == SSD_Q6_K) ? 256 : 32;
}
static inline int ssd_code_bits(int kind) {
    switch (kind) {
    case SSD_Q4_0: case SSD_Q4_1: case SSD_Q4_K: return 4;
    case SSD_Q5_0: case SSD_Q5_1: case SSD_Q5_K: return 5;
    case SSD_Q6_K: return 6;
    case SSD_Q8_0: return 8;
    default: return 0;
    }
}
/* bytes of one sub-block's codes for 16 columns */
static inline int ssd_code_bytes(int bits) {
    return bits == 8 ? 512 : bits == 4 ? 256 : bits == 5 ? 320 : bits == 6 ? 384 : 0;
}
/* bytes of the scale fields ahead of a K-block's codes, for 16 columns:
 *   Q4_0, Q5_0, Q8_0: d f16[16];  Q4_1, Q5_1: d f16[16], m f16[16];
 *   Q4_K, Q5_K: d f16[16], dmin f16[16], sc u8[8][16], mn u8[8][16];  Q6_K: d f16[16], sc i8[16][16] */
static inline int ssd_scale_bytes(int kind) {
    switch (kind) {
    case SSD_Q4_0: case SSD_Q5_0: case SSD_Q8_0: return 32;
    case SSD_Q4_1: case SSD_Q5_1: return 64;
    case SSD_Q4_K: case SSD_Q5_K: return 64 + 256;
    case SSD_Q6_K: return 32 + 256;
    default: return 0;
    }
}

#ifdef __cplusplus
}
#endif
#endif
