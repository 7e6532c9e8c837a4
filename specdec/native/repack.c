/* A GGUF matrix's blocks laid out as the kernels' panels, in one pass over the file's bytes.
 *
 * What specdec/models/gguf_blocks.prepare (float activations) and q8_activations.prepare (8-bit
 * ones) make in torch, bitwise (tests/models/gguf/test_repack.py checks every type and layout against
 * them): those stay the reference; this is how a load makes the panels (~2 GB/s a core against
 * the torch layouts' 0.1-0.3, docs/bench/repack_load.py), so no copy of them is kept on disk. Per panel pair (16 output rows; rows past `out` are zero)
 * and block, the 16 rows' values are unpacked into a small array and written out in the
 * format's layout (kernels.h; linear.c, linear_q8.c read them):
 *
 *   type   format (float / q8)      scales                     quants
 *   Q4_0   Q4_1 (or Q4_F)           d, m = -8d (fp16; f32)     q, 4-bit
 *   Q4_1   Q4_1                     d, m (fp16)                q, 4-bit
 *   Q5_0   Q8_0                     d (fp16)                   q - 16, int8
 *   Q5_1   Q5_F                     d, m (f32)                 q, 5-bit a byte
 *   Q8_0   Q8_0                     d (fp16)                   q, int8
 *   Q4_K, Q5_K, Q6_K: their super-block formats (specdec/models/gguf/kquant_blocks.py)
 *
 * Q4_0's m = -8d is exact in float32; in fp16 it overflows for |d| > 8188, so the caller picks
 * Q4_F for such a matrix (gguf_blocks.repack). Threads take the panel pairs a few at a time
 * (the caller gives a matrix one thread per 16 MB of blocks: specdec/models/gguf/repack.py).
 */
#include <omp.h>
#include <string.h>

#include "kernels.h"

/* GCC 12.2 at -O3 (SSE2 only) vectorized a loop gathering uint32 words of 16 rows' bytes into a
 * local array into wrong code (rows 2.. read as 0; tests/models/gguf/test_repack.py caught it): here
 * the vector code is written out in SSE2 intrinsics and the compiler does not vectorize */
#pragma GCC optimize("no-tree-vectorize")

/* the GGUF types read here (specdec/models/gguf/repack.py: KINDS) */
enum { RK_Q4_0, RK_Q4_1, RK_Q5_0, RK_Q5_1, RK_Q8_0, RK_Q4_K, RK_Q5_K, RK_Q6_K, RK_NUM };
static const int64_t kind_bytes[RK_NUM] = {18, 20, 22, 24, 34, 144, 176, 210};

AVX2 static float h2f(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
AVX2 static void put_f16(uint8_t* p, float f) {
    const uint16_t h = _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
    memcpy(p, &h, 2);
}

/* The values of 16 rows of one block of 32 (a K-quant's sub-block) are unpacked either
 * k-major, e[16k + row] (the float layouts read elements e = 16k + row), or row-major,
 * q[row][k] (the q8 layouts read 4 k of a row at a time: one uint32, 4 of them a vector).
 * Where lanes of 16 or 32 bits are shifted, by at most 4, the values are below 64 and each
 * byte is masked after, so no two bytes' bits mix. Padding rows are 0. */
typedef __m128i v16;
#define LOAD(p) _mm_loadu_si128((const v16*)(p))
#define STORE(p, x) _mm_storeu_si128((v16*)(p), (x))
#define BYTES(c) _mm_set1_epi8((char)(c))

/* dst[k * 16 + r] = src[r * sstride + k] for r, k < 16: four rounds of interleaving rows r and
 * r + 8 byte by byte (each round a perfect shuffle of the 256 bytes' index bits) */
static void transpose16(const uint8_t* src, int64_t sstride, uint8_t* dst) {
    v16 x[16], y[16];
    for (int r = 0; r < 16; r++) x[r] = LOAD(src + r * sstride);
    for (int round = 0; round < 4; round++) {
        for (int i = 0; i < 8; i++) {
            y[2 * i] = _mm_unpacklo_epi8(x[i], x[i + 8]);
            y[2 * i + 1] = _mm_unpackhi_epi8(x[i], x[i + 8]);
        }
        memcpy(x, y, sizeof x);
    }
    for (int k = 0; k < 16; k++) STORE(dst + 16 * k, x[k]);
}

/* row-major values of 16 rows (row r at src + r * sstride) -> k-major e[16k + r], k < 32 */
static void to_k_major(const uint8_t* src, int64_t sstride, uint8_t* e) {
    transpose16(src, sstride, e);
    transpose16(src + 16, sstride, e + 256);
}

/* 4 vectors of 4 uint32 each -> their transpose, in place */
static void transpose4(v16* x) {
    const v16 a = _mm_unpacklo_epi32(x[0], x[1]), b = _mm_unpacklo_epi32(x[2], x[3]);
    const v16 c = _mm_unpackhi_epi32(x[0], x[1]), d = _mm_unpackhi_epi32(x[2], x[3]);
    x[0] = _mm_unpacklo_epi64(a, b), x[1] = _mm_unpackhi_epi64(a, b);
    x[2] = _mm_unpacklo_epi64(c, d), x[3] = _mm_unpackhi_epi64(c, d);
}

/* float layouts of the values e[512] (k-major) of a block of 32 */
static void put_float_nibbles(uint8_t* o, const uint8_t* e) { /* byte i: e_2i | e_2i+1 << 4 */
    const v16 low = _mm_set1_epi16(0xFF);
    for (int i = 0; i < 256; i += 16) {
        const v16 a = LOAD(e + 2 * i), b = LOAD(e + 2 * i + 16);
        const v16 pa = _mm_and_si128(_mm_or_si128(a, _mm_srli_epi16(a, 4)), low);
        const v16 pb = _mm_and_si128(_mm_or_si128(b, _mm_srli_epi16(b, 4)), low);
        STORE(o + i, _mm_packus_epi16(pa, pb));
    }
}
static void put_float_low(uint8_t* o, const uint8_t* e) { /* byte i: e_i | e_{256 + i} << 4 */
    const v16 m = BYTES(15);
    for (int i = 0; i < 256; i += 16)
        STORE(o + i, _mm_or_si128(_mm_and_si128(LOAD(e + i), m),
                                  _mm_slli_epi16(_mm_and_si128(LOAD(e + 256 + i), m), 4)));
}
/* byte i of n bits f * bits: bits (4 .. 3 + bits) of e_{n f + i} (Q5_K: 64 bytes of 5th bits,
 * Q6_K: 128 bytes of high 2 bits) */
static void put_float_high(uint8_t* o, const uint8_t* e, int bits) {
    const int n = bits == 1 ? 64 : 128;
    const v16 m = BYTES(bits == 1 ? 1 : 3);
    for (int i = 0; i < n; i += 16) {
        v16 acc = _mm_setzero_si128();
        for (int f = 0; f < 8 / bits; f++) {
            const v16 h = _mm_and_si128(_mm_srli_epi16(LOAD(e + n * f + i), 4), m);
            acc = _mm_or_si128(acc, _mm_sll_epi16(h, _mm_cvtsi32_si128(bits * f)));
        }
        STORE(o + i, acc);
    }
}

/* q8 layouts of the values q[16][32] (row-major) of a block of 32; t = 32p + 4r + j is element
 * (row 8p + r, k = 4c + j) of chunk c, so word c of row r (k = 4c .. 4c + 3) goes whole.
 * w(q, r, h): words 4h .. 4h + 3 of row r */
#define W(q, r, h) LOAD((q)[r] + 16 * (h))

/* 16 rows' 4 words x[r] -> o32[stride * u + r] = word u of row r, u < 4 */
static void put_columns(uint8_t* o, v16* x, int stride) {
    for (int g = 0; g < 16; g += 4) {
        transpose4(x + g);
        for (int u = 0; u < 4; u++) STORE(o + 4 * (stride * u + g), x[g + u]);
    }
}
static void put_q8_nibbles(uint8_t* o, uint8_t q[16][32]) { /* chunk c: rows r, 8 + r */
    v16 x[16]; /* x[r + 8h], r < 8: words 4h .. 4h + 3 of rows r | r + 8 << 4 */
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < 8; r++)
            x[r + 8 * h] = _mm_or_si128(W(q, r, h), _mm_slli_epi32(W(q, r + 8, h), 4));
    for (int h = 0; h < 2; h++)
        for (int g = 0; g < 8; g += 4) {
            transpose4(x + 8 * h + g);
            for (int u = 0; u < 4; u++) STORE(o + 4 * (8 * (4 * h + u) + g), x[8 * h + g + u]);
        }
}
static void put_q8_bytes(uint8_t* o, uint8_t q[16][32]) { /* chunk (c, panel p): byte 4r + j */
    for (int h = 0; h < 2; h++) {
        v16 x[16];
        for (int r = 0; r < 16; r++) x[r] = W(q, r, h);
        put_columns(o + 4 * 16 * 4 * h, x, 16);
    }
}
static void put_q8_low6(uint8_t* o, uint8_t q[16][32]) { /* vector u: chunks u, u + 4 */
    const v16 m = BYTES(15);
    v16 x[16];
    for (int r = 0; r < 16; r++)
        x[r] = _mm_or_si128(_mm_and_si128(W(q, r, 0), m),
                            _mm_slli_epi32(_mm_and_si128(W(q, r, 1), m), 4));
    put_columns(o, x, 16);
}
/* Q5_K's 5th bits (bits 1: byte t bit c, chunk c's) or Q6_K's high 2 bits (bits 2: vector v
 * byte t bits 2f, chunk 2f + v) */
static void put_q8_high(uint8_t* o, uint8_t q[16][32], int bits) {
    const v16 m = BYTES(bits == 1 ? 1 : 3);
    for (int g = 0; g < 16; g += 4) {
        v16 c[8]; /* c[u]: word u of rows g .. g + 3 */
        for (int h = 0; h < 2; h++) {
            for (int i = 0; i < 4; i++) c[4 * h + i] = W(q, g + i, h);
            transpose4(c + 4 * h);
        }
        for (int v = 0; v < bits; v++) {
            v16 acc = _mm_setzero_si128();
            for (int f = 0; f < 8 / bits; f++) {
                const v16 h = _mm_and_si128(_mm_srli_epi32(c[bits * f + v], 4), m);
                acc = _mm_or_si128(acc, _mm_sll_epi32(h, _mm_cvtsi32_si128(bits * f)));
            }
            STORE(o + 4 * (16 * v + g), acc);
        }
    }
}

/* 16 bytes x -> their low nibbles to lo, high ones to hi */
static void split_nibbles(v16 x, uint8_t* lo, uint8_t* hi) {
    const v16 m = BYTES(15);
    STORE(lo, _mm_and_si128(x, m));
    STORE(hi, _mm_and_si128(_mm_srli_epi16(x, 4), m));
}

/* a block of Q4_0 .. Q8_0 -> its 32 values q[k] (nibbles: byte j's low one is weight j, its
 * high one weight 16 + j; 5th bits: bit k of a little-endian uint32; Q5_0's q - 16 as int8) */
static void unpack32(int kind, const uint8_t* b, uint8_t* q) {
    if (kind == RK_Q8_0) {
        memcpy(q, b + 2, 32);
        return;
    }
    const int qs = kind == RK_Q4_0 ? 2 : kind == RK_Q4_1 ? 4 : kind == RK_Q5_0 ? 6 : 8;
    split_nibbles(LOAD(b + qs), q, q + 16);
    if (kind == RK_Q5_0 || kind == RK_Q5_1) {
        uint32_t qh;
        memcpy(&qh, b + (kind == RK_Q5_0 ? 2 : 4), 4);
        for (int k = 0; k < 32; k++) q[k] |= (uint8_t)(((qh >> k) & 1) << 4);
        if (kind == RK_Q5_0)
            for (int k = 0; k < 32; k++) q[k] = (uint8_t)(q[k] - 16);
    }
}

/* one pair's block j of 32 inputs in a per-32 format: 16 rows at `rows` (NULL: padding) */
AVX2 static void pair_block32(int kind, int fmt, const uint8_t* const* rows, int64_t j,
                              uint8_t* o) {
    const int q8 = sd_is_q8(fmt), wide = fmt == SD_Q4_F || fmt == SD_Q4_F_Q8
                                       || fmt == SD_Q5_F || fmt == SD_Q5_F_Q8;
    const int has_m = kind != RK_Q5_0 && kind != RK_Q8_0, size = wide ? 4 : 2;
    const int nibble = kind == RK_Q4_0 || kind == RK_Q4_1;
    uint8_t q[16][32], e[512];
    memset(o, 0, (size_t)(16 * size * (1 + has_m)));
    for (int r = 0; r < 16; r++) {
        if (!rows[r]) {
            memset(q[r], 0, 32);
            continue;
        }
        const uint8_t* b = rows[r] + j * kind_bytes[kind];
        unpack32(kind, b, q[r]);
        uint8_t* d = o + r * size;
        uint8_t* m = o + 16 * size + r * size;
        if (kind == RK_Q4_0) {
            const float df = h2f(b), mf = -8.0f * df;
            if (wide)
                memcpy(d, &df, 4), memcpy(m, &mf, 4);
            else
                memcpy(d, b, 2), put_f16(m, mf);
        } else if (kind == RK_Q5_1) {
            const float df = h2f(b), mf = h2f(b + 2);
            memcpy(d, &df, 4), memcpy(m, &mf, 4);
        } else {
            memcpy(d, b, 2);
            if (has_m) memcpy(m, b + 2, 2);
        }
    }
    uint8_t* quants = o + 16 * size * (1 + has_m);
    if (q8) {
        nibble ? put_q8_nibbles(quants, q) : put_q8_bytes(quants, q);
    } else if (nibble) {
        to_k_major(q[0], 32, e);
        put_float_nibbles(quants, e);
    } else {
        to_k_major(q[0], 32, e);
        memcpy(quants, e, 512);
    }
}

/* Q4_K / Q5_K's 6-bit scale and min of sub-block i (gguf-py's get_scale_min) */
static void k_scale_min(const uint8_t* s, int i, uint8_t* sc, uint8_t* mn) {
    if (i < 4) {
        *sc = s[i] & 63, *mn = s[4 + i] & 63;
    } else {
        *sc = (uint8_t)((s[4 + i] & 15) | ((s[i - 4] >> 2) & 48));
        *mn = (uint8_t)((s[4 + i] >> 4) | ((s[i] >> 2) & 48));
    }
}

/* a row's super-block -> its 256 values v[32s + t] (sub-block s, element t): Q4_K sub-blocks
 * 2i, 2i + 1 are the low, high nibbles of 32 bytes; Q5_K's 5th bit of (s, t) is bit s of byte
 * t; Q6_K's low 4 bits of sub-blocks 4h + 2n, 4h + 2n + 1 are nibble n of 64 bytes, its high 2
 * bits of (4h + f, t) bits 2f of byte 32h + t */
static void unpack_super(int kind, const uint8_t* b, uint8_t* v) {
    if (kind == RK_Q6_K) {
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < 64; t += 16)
                split_nibbles(LOAD(b + 64 * h + t), v + 128 * h + t, v + 128 * h + 64 + t);
        const v16 m = BYTES(0x30);
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < 32; t += 16) {
                const v16 qh = LOAD(b + 128 + 32 * h + t);
                for (int f = 0; f < 4; f++) { /* bits 2f, 2f + 1 -> 4, 5 */
                    const v16 at = f < 3 ? _mm_sll_epi16(qh, _mm_cvtsi32_si128(4 - 2 * f))
                                         : _mm_srli_epi16(qh, 2);
                    uint8_t* dst = v + 128 * h + 32 * f + t;
                    STORE(dst, _mm_or_si128(LOAD(dst), _mm_and_si128(at, m)));
                }
            }
        return;
    }
    const int qs = kind == RK_Q4_K ? 16 : 48;
    for (int i = 0; i < 4; i++)
        for (int t = 0; t < 32; t += 16)
            split_nibbles(LOAD(b + qs + 32 * i + t), v + 64 * i + t, v + 64 * i + 32 + t);
    if (kind == RK_Q5_K) {
        const v16 m = BYTES(0x10);
        for (int t = 0; t < 32; t += 16) {
            const v16 qh = LOAD(b + 16 + t);
            for (int s = 0; s < 8; s++) { /* bit s -> 4 */
                const v16 at = s <= 4 ? _mm_sll_epi16(qh, _mm_cvtsi32_si128(4 - s))
                                      : _mm_srl_epi16(qh, _mm_cvtsi32_si128(s - 4));
                STORE(v + 32 * s + t, _mm_or_si128(LOAD(v + 32 * s + t), _mm_and_si128(at, m)));
            }
        }
    }
}

/* one pair's super-block j in its format (kquant_blocks.prepare) */
static void pair_super(int kind, int q8, const uint8_t* const* rows, int64_t j, uint8_t* o) {
    static const uint8_t zero[210];
    const uint8_t* b[16];
    for (int r = 0; r < 16; r++) b[r] = rows[r] ? rows[r] + j * kind_bytes[kind] : zero;
    int head, sub;
    if (kind == RK_Q6_K) {
        head = SD_Q6_K_HEAD, sub = SD_Q6_K_SUB;
        for (int r = 0; r < 16; r++) {
            memcpy(o + 2 * r, b[r] + 208, 2);
            for (int g = 0; g < 16; g++) o[32 + g * 16 + r] = b[r][192 + g];
        }
    } else {
        head = SD_Q4_K_HEAD, sub = kind == RK_Q4_K ? 256 : SD_Q5_K_SUB;
        for (int r = 0; r < 16; r++) {
            memcpy(o + 2 * r, b[r], 2), memcpy(o + 32 + 2 * r, b[r] + 2, 2);
            for (int s = 0; s < 8; s++) k_scale_min(b[r] + 4, s, o + 64 + s * 16 + r,
                                                    o + 192 + s * 16 + r);
        }
    }
    uint8_t v[16][256];
    for (int r = 0; r < 16; r++) unpack_super(kind, b[r], v[r]);
    uint8_t q[16][32], e[512];
    for (int s = 0; s < 8; s++) {
        uint8_t* dst = o + head + s * sub;
        if (q8) {
            for (int r = 0; r < 16; r++) memcpy(q[r], v[r] + 32 * s, 32);
            if (kind == RK_Q4_K) {
                put_q8_nibbles(dst, q);
            } else if (kind == RK_Q5_K) {
                uint8_t lo[16][32];
                for (int r = 0; r < 16; r++)
                    for (int h = 0; h < 2; h++)
                        STORE(lo[r] + 16 * h, _mm_and_si128(W(q, r, h), BYTES(15)));
                put_q8_nibbles(dst, lo);
                put_q8_high(dst + 256, q, 1);
            } else {
                put_q8_low6(dst, q);
                put_q8_high(dst + 256, q, 2);
            }
        } else {
            to_k_major(v[0] + 32 * s, 256, e);
            if (kind == RK_Q4_K) {
                put_float_nibbles(dst, e);
            } else {
                put_float_low(dst, e);
                put_float_high(dst + 256, e, kind == RK_Q5_K ? 1 : 2);
            }
        }
    }
}

/* bytes of one block of 32 k of a panel pair (a super-block format: an eighth of its
 * super-block's) */
static int64_t pair_bytes(int fmt) {
    switch (fmt) {
    case SD_Q4_1: case SD_Q4_1_Q8: return SD_Q4_1_PAIR_BYTES;
    case SD_Q8_0: case SD_Q8_0_Q8: return SD_Q8_0_PAIR_BYTES;
    case SD_Q4_F: case SD_Q4_F_Q8: return SD_Q4_F_PAIR_BYTES;
    case SD_Q5_F: case SD_Q5_F_Q8: return SD_Q5_F_PAIR_BYTES;
    case SD_Q4_K: case SD_Q4_K_Q8: return SD_Q4_K_PAIR_BYTES / 8;
    case SD_Q5_K: case SD_Q5_K_Q8: return SD_Q5_K_PAIR_BYTES / 8;
    default: return SD_Q6_K_PAIR_BYTES / 8;
    }
}

/* the format a kind is laid out in (-1: not this pair): Q4_0 takes Q4_1 or Q4_F */
static int valid_format(int kind, int fmt) {
    const int q8 = sd_is_q8(fmt);
    switch (kind) {
    case RK_Q4_0:
        return fmt == (q8 ? SD_Q4_1_Q8 : SD_Q4_1) || fmt == (q8 ? SD_Q4_F_Q8 : SD_Q4_F);
    case RK_Q4_1: return fmt == SD_Q4_1 || fmt == SD_Q4_1_Q8;
    case RK_Q5_0: case RK_Q8_0: return fmt == SD_Q8_0 || fmt == SD_Q8_0_Q8;
    case RK_Q5_1: return fmt == SD_Q5_F || fmt == SD_Q5_F_Q8;
    case RK_Q4_K: return fmt == SD_Q4_K || fmt == SD_Q4_K_Q8;
    case RK_Q5_K: return fmt == SD_Q5_K || fmt == SD_Q5_K_Q8;
    case RK_Q6_K: return fmt == SD_Q6_K || fmt == SD_Q6_K_Q8;
    default: return 0;
    }
}

/* The panels of a matrix of `out` rows and K inputs whose blocks of type `kind` (RK_*) start
 * at rows (row r at rows + r * row_stride bytes, K / width * block bytes of them) -> dst, in
 * format `fmt` (kernels.h): [out / 16 rounded up][K / 32 (K / 256 for a super-block format)]
 * pair blocks (PAIR_BYTES). Returns 0, or -1 (nothing written) when this CPU lacks AVX2 / F16C,
 * the kind and format do not go together or the shape does not fit them. The lengths behind
 * the pointers are not known here: the caller checks them (specdec/models/gguf/repack.py). */
int sd_repack(const uint8_t* rows, int64_t row_stride, int64_t out, int64_t K, int kind,
              int fmt, uint8_t* dst, int nthreads) {
    const int super = kind >= RK_Q4_K && kind < RK_NUM;
    const int64_t width = super ? SD_QK : SD_QBLOCK;
    if (!(sd_cpu_features() & 1) || kind < 0 || kind >= RK_NUM || !valid_format(kind, fmt)
        || out < 1 || K < width || K % width || row_stride < K / width * kind_bytes[kind]
        || !rows || !dst || nthreads < 1)
        return -1;
    const int64_t pairs = (out + 15) / 16, nb = K / width;
    const int64_t block_bytes = pair_bytes(fmt) * (super ? SD_QK / SD_QBLOCK : 1);
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 4)
    for (int64_t p = 0; p < pairs; p++) {
        const uint8_t* r16[16];
        for (int r = 0; r < 16; r++)
            r16[r] = 16 * p + r < out ? rows + (16 * p + r) * row_stride : NULL;
        for (int64_t j = 0; j < nb; j++) {
            uint8_t* o = dst + (p * nb + j) * block_bytes;
            if (super)
                pair_super(kind, sd_is_q8(fmt), r16, j, o);
            else
                pair_block32(kind, fmt, r16, j, o);
        }
    }
    return 0;
}
