/* Which path this CPU runs (read from cpuid and the OS's saved register state), the tile sizes, the reference
 * dequantization, and the matmul split over a pool's threads. */
#include <cpuid.h>
#include <string.h>
#include "layout.h"
#include "ssd_step.h"

size_t ssd_tile_bytes(int kind, int k) {
    if (ssd_code_bits(kind) == 0 || k <= 0 || k % ssd_kblock(kind))
        return 0;
    return (size_t)(k / ssd_kblock(kind)) * ssd_kblock_bytes(kind);
}

static unsigned long long xgetbv0(void) {
    unsigned int lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
}

int ssd_cpu_features(void) {
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return 0;
    const int fma = (c >> 12) & 1, osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, f16c = (c >> 29) & 1;
    if (!osxsave || !avx)
        return 0;
    const unsigned long long xcr0 = xgetbv0();
    if ((xcr0 & 0x6) != 0x6)                  /* the OS saves xmm and ymm */
        return 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d))
        return 0;
    int features = 0;
    if (((b >> 5) & 1) && fma && f16c)
        features |= 1;
    const int avx512 = ((b >> 16) & 1) && ((b >> 30) & 1) && ((b >> 31) & 1), vnni = (c >> 11) & 1;
    if ((features & 1) && avx512 && vnni && (xcr0 & 0xE0) == 0xE0)   /* and opmask, zmm0-15 high, zmm16-31 */
        features |= 2;
    return features;
}

const ssd_isa *ssd_isa_find(const char *name) {
    const int features = ssd_cpu_features();
    if (!strcmp(name, "auto"))
        return (features & 2) ? &ssd_isa_avx512vnni : (features & 1) ? &ssd_isa_avx2 : &ssd_isa_scalar;
    if (!strcmp(name, "avx512vnni"))
        return (features & 2) ? &ssd_isa_avx512vnni : NULL;
    if (!strcmp(name, "avx2"))
        return (features & 1) ? &ssd_isa_avx2 : NULL;
    if (!strcmp(name, "scalar"))
        return &ssd_isa_scalar;
    return NULL;
}

/* weight k of column n */
static float weight_at(const ssd_weight *w, int n, int k) {
    const int kind = w->kind, bits = ssd_code_bits(kind);
    const int t = n / SSD_TILE, c = n % SSD_TILE;
    const int kb = k / ssd_kblock(kind), j = (k % ssd_kblock(kind)) / SSD_SUB, i = k % SSD_SUB;
    const uint8_t *sp = w->tiles + t * ssd_tile_bytes(kind, w->k) + kb * ssd_kblock_bytes(kind);
    const uint8_t *codes = sp + ssd_scale_bytes(kind) + j * ssd_code_bytes(bits);
    float s, m;
    ssd_scale_at(kind, sp, j, i >= 16, c, &s, &m);
    /* as ggml / gguf compute it: d (q - c) for the symmetric kinds (exact, signed zeros included), else
       s u + m: s u is exact in fp32, + m rounds once as ggml's d q + m and (d sc) q - dmin m do */
    const int u = ssd_code_at(bits, codes, c, i), centre = ssd_centre(kind);
    return centre ? s * (float)(u - centre) : s * (float)u + m;
}

void ssd_dequantize(const ssd_weight *w, float *out, int64_t ldw) {
    for (int n = 0; n < w->n; n++)
        for (int k = 0; k < w->k; k++)
            out[k * ldw + n] = weight_at(w, n, k);
}

void ssd_dequantize_column(const ssd_weight *w, int n, float *out) {
    for (int k = 0; k < w->k; k++)
        out[k] = weight_at(w, n, k);
}
