/* Row-invariant linear layers over prepared weight panels.
 *
 *   y[t, n] = fma chain over k = 0 .. K-1 in ascending order, from 0 (then + bias, by the caller).
 *
 * Weights are prepared once into panels of 8 output rows ([panels][K][8], an even number of
 * panels: the microkernel takes two at a time), so one weight panel is streamed from memory
 * once for every row of the call (rows are tiled by up to 6 in registers; the tile size does
 * not touch any element's order). K runs in blocks, each reused by every row tile from cache
 * while the next one streams in (with one row tile, a GGUF pair runs over all of K at once).
 * Threads split the panel pairs.
 *
 * Formats: fp32, bf16, fp16 panels (16-bit weights widened exactly in registers), and a GGUF's
 * blocks in the kernel formats (kernels.h; specdec/models/gguf/blocks.py), dequantized exactly
 * as gguf-py does:
 * the fp32 weights, and so every element's fma chain, are those of the dequantized model.
 *
 * A weight in parts (kernels.h: a fused matrix whose row ranges are of different formats) runs
 * each part as a weight of its own, in order, into its own output columns; an element's chain
 * is the one its part's format gives, so each column is bitwise what its part alone gives.
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#ifndef KBLOCK
#define KBLOCK 64 /* k per block: one block of a panel pair is reused by every row tile */
#endif
#ifndef DIST
#define DIST 64 /* prefetch distance in k: the next block */
#endif

/* R rows x[0 .. R-1] (row stride K, already at the block's first k) times the panel pair at
 * w0, w1 (already at the block's first k) over kn steps of k -> y rows. The accumulators start
 * at 0 (the first block of k) or at y (a later one), so every element is still one fma chain
 * over ascending k. The next block of the pair (DIST steps on) is prefetched along: it streams
 * from memory while this block is reused from cache by the other row tiles. 2R accumulators
 * in named registers, R <= 6 (12 + 2 weights + 1 broadcast of the 16 AVX registers). */
#define ROW(r) const __m256 xb##r = _mm256_broadcast_ss(x + r * K + k);                        \
    a##r = _mm256_fmadd_ps(xb##r, v0, a##r);                                                   \
    b##r = _mm256_fmadd_ps(xb##r, v1, b##r);
#define STORE(r) _mm256_storeu_ps(y + r * ldy, a##r);                                          \
    _mm256_storeu_ps(y + r * ldy + PW, b##r);
#define INIT(r) __m256 a##r = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + r * ldy),     \
    b##r = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + r * ldy + PW);
#define MICRO(NAME, LOADW, ES, R, EACH)                                                        \
    AVX2 static void NAME##_r##R(const float* x, int64_t K, const void* w0, const void* w1,   \
                                 int64_t kn, float* y, int64_t ldy, int first) {               \
        EACH(INIT)                                                                             \
        for (int64_t k = 0; k < kn; k++) {                                                     \
            if (ES && (k * PW * ES) % 64 == 0) {                                               \
                _mm_prefetch((const char*)w0 + (k + DIST) * PW * ES, _MM_HINT_T0);             \
                _mm_prefetch((const char*)w1 + (k + DIST) * PW * ES, _MM_HINT_T0);             \
            }                                                                                  \
            const __m256 v0 = LOADW(w0, k * PW), v1 = LOADW(w1, k * PW);                       \
            EACH(ROW)                                                                          \
        }                                                                                      \
        EACH(STORE)                                                                            \
    }
#define EACH1(F) F(0)
#define EACH2(F) F(0) F(1)
#define EACH3(F) F(0) F(1) F(2)
#define EACH4(F) F(0) F(1) F(2) F(3)
#define EACH5(F) F(0) F(1) F(2) F(3) F(4)
#define EACH6(F) F(0) F(1) F(2) F(3) F(4) F(5)
#define EACH7(F) EACH6(F) F(6)
#define EACH8(F) EACH7(F) F(7)
#define MICROS(NAME, LOADW, ES)                                                                \
    MICRO(NAME, LOADW, ES, 1, EACH1) MICRO(NAME, LOADW, ES, 2, EACH2)                          \
    MICRO(NAME, LOADW, ES, 3, EACH3) MICRO(NAME, LOADW, ES, 4, EACH4)                          \
    MICRO(NAME, LOADW, ES, 5, EACH5) MICRO(NAME, LOADW, ES, 6, EACH6)
MICROS(f32, sd_load_f32, 4)
MICROS(bf16, sd_load_bf16, 2)
MICROS(f16, sd_load_f16, 2)
/* an unpacked block in a buffer [k][16] (no prefetch: it is in L1) */
AVX2 static inline __m256 load_buf(const void* w, int64_t i) {
    return _mm256_loadu_ps((const float*)w + 2 * i);
}
MICROS(buf, load_buf, 0)

typedef void (*micro_fn)(const float*, int64_t, const void*, const void*, int64_t, float*,
                         int64_t, int);
#define ROWS6(NAME) {NAME##_r1, NAME##_r2, NAME##_r3, NAME##_r4, NAME##_r5, NAME##_r6}
static const micro_fn MICRO_TABLE[SD_NUM_FLOAT_FORMATS][6] = {ROWS6(f32), ROWS6(bf16),
                                                              ROWS6(f16)};
static const micro_fn BUF_MICRO[6] = ROWS6(buf);
static const int64_t ELEMENT_SIZE[SD_NUM_FLOAT_FORMATS] = {4, 2, 2};

/* GGUF blocks of a panel pair (16 output rows x 32 k), unpacked to fp32 buf [32][16] exactly as
 * gguf-py dequantizes (float32, two roundings: fl(d * q) + m; no fma), so the kernel computes
 * with the very weights transformers loads from the file (kernels.h: the formats):
 *   Q4_1 (320 bytes): d[16] fp16, m[16] fp16, then per k one uint32 per panel (rows 0-7 of the
 *        pair, then rows 8-15): row i's 4-bit q at bits 4i.
 *   Q8_0 (544 bytes): d[16] fp16, then per k 16 int8 q (rows 0-15).
 *   Q4_F (384 bytes): d[16] fp32, m[16] fp32, then the quants as Q4_1's.
 *   Q5_F (640 bytes): d[16] fp32, m[16] fp32, then per k 16 uint8 q.
 *   I8_F16 (640 bytes): d[16] fp32 of k 0-15, d[16] fp32 of k 16-31, then per k 16 int8 q.
 * `next`: the block after the next k-block, prefetched. */
/* a block's scales, one vector per panel: d (I8_F16: of k 0-15) and m (I8_F16: d of k 16-31) */
typedef struct {
    __m256 d0, d1, m0, m1;
} scales;
AVX2 static inline __m256 f16x8(const uint8_t* b) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)b));
}
AVX2 static inline scales q4_1_scales(const uint8_t* b) {
    scales s = {f16x8(b), f16x8(b + 16), f16x8(b + 32), f16x8(b + 48)};
    return s;
}
AVX2 static inline scales q8_0_scales(const uint8_t* b) {
    scales s = {f16x8(b), f16x8(b + 16), _mm256_setzero_ps(), _mm256_setzero_ps()};
    return s;
}
AVX2 static inline scales f32_scales(const uint8_t* b) {
    const float* f = (const float*)b;
    scales s = {_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8), _mm256_loadu_ps(f + 16),
                _mm256_loadu_ps(f + 24)};
    return s;
}
#define q4_f_scales f32_scales
#define q5_f_scales f32_scales
#define i8_f16_scales f32_scales
/* the 16 weights of step kk of a block, dequantized (one vector per panel).
 * EXACT_DQ: where a format adds m (Q4_1, Q4_F, Q5_F, Q4_K, Q5_K), d * q is exact in float32, so
 * fma(d, q, m) rounds once to the very value of fl(d * q) + m (gguf-py's two roundings), one
 * instruction fewer: d is an fp16 (11 significant bits) or a K-quant sub-block scale
 * fl(fp16 d * 6-bit sc) (at most 17 bits: that product is exact too), q has at most 5 bits, so
 * d * q has at most 22 significant bits, and no product can overflow or leave the normal range
 * (fp16 magnitudes times at most 63 * 31). The bitwise tests against the mul-then-add
 * reference (tests/native/test_native*.py, test_kquant_formats.py) hold it. */
AVX2 static inline void nibble_step(const uint8_t* qb, const scales* s, int kk, __m256* w0,
                                    __m256* w1) {
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i low4 = _mm256_set1_epi32(15);
    const int32_t* q = (const int32_t*)qb + 2 * kk;
    const __m256i q0 = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(q[0]), shifts), low4);
    const __m256i q1 = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(q[1]), shifts), low4);
    *w0 = _mm256_fmadd_ps(s->d0, _mm256_cvtepi32_ps(q0), s->m0); /* = fl(d * q) + m: EXACT_DQ */
    *w1 = _mm256_fmadd_ps(s->d1, _mm256_cvtepi32_ps(q1), s->m1);
}
AVX2 static inline void q4_1_step(const uint8_t* b, const scales* s, int kk, __m256* w0,
                                  __m256* w1) {
    nibble_step(b + 64, s, kk, w0, w1);
}
AVX2 static inline void q4_f_step(const uint8_t* b, const scales* s, int kk, __m256* w0,
                                  __m256* w1) {
    nibble_step(b + 128, s, kk, w0, w1);
}
AVX2 static inline __m256 i8x8(const uint8_t* q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)q)));
}
AVX2 static inline __m256 u8x8(const uint8_t* q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)q)));
}
AVX2 static inline void q8_0_step(const uint8_t* b, const scales* s, int kk, __m256* w0,
                                  __m256* w1) {
    const uint8_t* q = b + 32 + 16 * kk;
    *w0 = _mm256_mul_ps(i8x8(q), s->d0);
    *w1 = _mm256_mul_ps(i8x8(q + 8), s->d1);
}
AVX2 static inline void q5_f_step(const uint8_t* b, const scales* s, int kk, __m256* w0,
                                  __m256* w1) {
    const uint8_t* q = b + 128 + 16 * kk;
    *w0 = _mm256_fmadd_ps(s->d0, u8x8(q), s->m0); /* EXACT_DQ */
    *w1 = _mm256_fmadd_ps(s->d1, u8x8(q + 8), s->m1);
}
AVX2 static inline void i8_f16_step(const uint8_t* b, const scales* s, int kk, __m256* w0,
                                    __m256* w1) {
    const uint8_t* q = b + 128 + 16 * kk;
    *w0 = _mm256_mul_ps(i8x8(q), kk < 16 ? s->d0 : s->m0);
    *w1 = _mm256_mul_ps(i8x8(q + 8), kk < 16 ? s->d1 : s->m1);
}

/* the steps kk of a block, in runs: the formats with a scale per 16 k (I8_F16, Q6_K: kk < 16 ?
 * d : m) in two runs of 16, so that the compiler picks a run's scales once, not at every step
 * (Q6_K, one row over two pairs: 1.95 -> 1.87 cycles per 8 weights) */
enum { q4_1_RUN = 32, q8_0_RUN = 32, q4_f_RUN = 32, q5_f_RUN = 32, i8_f16_RUN = 16,
       q4_k_RUN = 32, q6_k_RUN = 16, q5_k_RUN = 32 };
#define KSTEP_LOOP(KIND, kk)                                                                   \
    for (int kh = 0; kh < SD_QBLOCK; kh += KIND##_RUN)                                         \
        for (int kk = kh; kk < kh + KIND##_RUN; kk++)
/* nblk blocks of a pair unpacked to buf [32 * nblk][16], the blocks after them prefetched */
#define UNPACK(KIND, BYTES)                                                                    \
    AVX2 static void unpack_##KIND(const uint8_t* b, int64_t nblk, float* buf) {              \
        for (int64_t j = 0; j < nblk; j++, b += BYTES) {                                       \
            for (int o = 0; o < BYTES; o += 64)                                                \
                _mm_prefetch((const char*)b + nblk * BYTES + o, _MM_HINT_T0);                  \
            const scales s = KIND##_scales(b);                                                 \
            KSTEP_LOOP(KIND, kk) {                                                             \
                __m256 w0, w1;                                                                 \
                KIND##_step(b, &s, kk, &w0, &w1);                                              \
                _mm256_storeu_ps(buf + (j * SD_QBLOCK + kk) * 2 * PW, w0);                     \
                _mm256_storeu_ps(buf + (j * SD_QBLOCK + kk) * 2 * PW + PW, w1);                \
            }                                                                                  \
        }                                                                                      \
    }
/* R (1 to 3) rows straight over nblk blocks (dequantized in registers, no buffer: with so few
 * rows the fma chains alone would wait on their latency); called over the whole of K, so the
 * blocks nblk on, prefetched, are the next pair's */
#define DIRECT(KIND, BYTES, R, EACH)                                                           \
    AVX2 static void KIND##_r##R(const float* x, int64_t K, const uint8_t* b, int64_t nblk,   \
                                 float* y, int64_t ldy, int first) {                           \
        EACH(INIT)                                                                             \
        for (int64_t j = 0; j < nblk; j++, b += BYTES) {                                       \
            for (int o = 0; o < BYTES; o += 64)                                                \
                _mm_prefetch((const char*)b + nblk * BYTES + o, _MM_HINT_T0);                  \
            const scales s = KIND##_scales(b);                                                 \
            KSTEP_LOOP(KIND, kk) {                                                             \
                __m256 v0, v1;                                                                 \
                KIND##_step(b, &s, kk, &v0, &v1);                                              \
                const int64_t k = j * SD_QBLOCK + kk;                                          \
                EACH(ROW)                                                                      \
            }                                                                                  \
        }                                                                                      \
        EACH(STORE)                                                                            \
    }
/* One row over two pairs at once (b and b + stride; columns y .. y + 31), over the whole of K
 * (nblk blocks), from 0. One pair gives a row 2 fma chains, so a k waits on the fma latency:
 * 4 cycles for 16 weights, 2 cycles per 8, where the pipes take a 4-bit step's srlv, and,
 * cvt, dequantizing fma and fma in 1.25 (docs/bench/avx2_float_kernels.py: the port model);
 * two pairs give 4 independent chains and measured 1.53 (Q4_1) and 1.41 (Q8_0) against 2.0,
 * one core, from L2. Each element is still one chain over ascending k from 0. (Two rows: two
 * pairs' 8 accumulators leave no registers for their scales, and the scale loads then bind
 * (vector loads: 2 a cycle); one pair's 4 chains run as fast, 2.04. Three rows: 12 spill.) */
#define INIT2P(r) __m256 a##r = _mm256_setzero_ps(), b##r = _mm256_setzero_ps(),               \
                         c##r = _mm256_setzero_ps(), e##r = _mm256_setzero_ps();
#define ROW2P(r) {                                                                             \
        const __m256 xr = _mm256_broadcast_ss(x + r * K + k);                                  \
        a##r = _mm256_fmadd_ps(xr, v0, a##r);                                                  \
        b##r = _mm256_fmadd_ps(xr, v1, b##r);                                                  \
    }
#define ROW2Q(r) {                                                                             \
        const __m256 xr = _mm256_broadcast_ss(x + r * K + k);                                  \
        c##r = _mm256_fmadd_ps(xr, v0, c##r);                                                  \
        e##r = _mm256_fmadd_ps(xr, v1, e##r);                                                  \
    }
#define STORE2P(r) _mm256_storeu_ps(y + r * ldy, a##r);                                        \
    _mm256_storeu_ps(y + r * ldy + PW, b##r);                                                  \
    _mm256_storeu_ps(y + r * ldy + 2 * PW, c##r);                                              \
    _mm256_storeu_ps(y + r * ldy + 3 * PW, e##r);
/* the next two pairs (2 * stride on: contiguous, so one sequential stream) prefetched over the
 * steps of these two, two blocks a step (b, j blocks on, + j blocks: block 2j of the next two);
 * prefetching each of the two streams being read a little ahead measured 5-20 % slower from
 * DRAM (2 threads, SmolLM2-135M's matrices) */
#define PF_NEXT2(b, stride, j, BYTES)                                                          \
    for (int o = 0; o < 2 * (BYTES); o += 64)                                                  \
        _mm_prefetch((const char*)(b) + 2 * (stride) + (j) * (BYTES) + o, _MM_HINT_T0);
#define DIRECT2P(KIND, BYTES, R, EACH)                                                         \
    AVX2 static void KIND##_p2r##R(const float* x, int64_t K, const uint8_t* b,                \
                                   int64_t stride, int64_t nblk, float* y, int64_t ldy) {      \
        EACH(INIT2P)                                                                           \
        for (int64_t j = 0; j < nblk; j++, b += BYTES) {                                       \
            PF_NEXT2(b, stride, j, BYTES)                                                      \
            const scales s0 = KIND##_scales(b), s1 = KIND##_scales(b + stride);                \
            KSTEP_LOOP(KIND, kk) {                                                             \
                __m256 v0, v1;                                                                 \
                const int64_t k = j * SD_QBLOCK + kk;                                          \
                KIND##_step(b, &s0, kk, &v0, &v1);                                             \
                EACH(ROW2P)                                                                    \
                KIND##_step(b + stride, &s1, kk, &v0, &v1);                                    \
                EACH(ROW2Q)                                                                    \
            }                                                                                  \
        }                                                                                      \
        EACH(STORE2P)                                                                          \
    }
#define GGUF_FORMAT(KIND, BYTES)                                                               \
    UNPACK(KIND, BYTES)                                                                        \
    DIRECT(KIND, BYTES, 1, EACH1) DIRECT(KIND, BYTES, 2, EACH2) DIRECT(KIND, BYTES, 3, EACH3)  \
    DIRECT2P(KIND, BYTES, 1, EACH1)
GGUF_FORMAT(q4_1, SD_Q4_1_PAIR_BYTES)
GGUF_FORMAT(q8_0, SD_Q8_0_PAIR_BYTES)
GGUF_FORMAT(q4_f, SD_Q4_F_PAIR_BYTES)
GGUF_FORMAT(q5_f, SD_Q5_F_PAIR_BYTES)
GGUF_FORMAT(i8_f16, SD_I8_F16_PAIR_BYTES)

/* The super-block formats (SD_Q4_K, SD_Q5_K, SD_Q6_K: kernels.h), per super-block of a pair
 * (16 rows x 256 k): the header, then sub-block j's quants (32 k) at HEAD + j * SUB:
 *   Q4_K (2368 bytes): d[16] fp16, dmin[16] fp16, sc[8][16] uint8 (sub-block j's 16 rows at
 *        64 + 16j), m[8][16] uint8 (at 192 + 16j); per sub-block (256 bytes) Q4_F's quants.
 *   Q5_K (2880 bytes): Q4_K's header; per sub-block (320 bytes) the 512 quants q[k][row]
 *        (element e = 16k + row): 256 bytes of low 4 bits (as Q6_K's), 64 bytes of 5th bits
 *        (byte e % 64, bit e / 64); they are made uint8 q a sub-block at a time (q5_k_bytes),
 *        32 at once, then read as Q5_F's quants.
 *   Q6_K (3360 bytes): d[16] fp16, sc[16][16] int8 (k 16g .. 16g + 15 at 32 + 16g); per
 *        sub-block (384 bytes) the 512 quants q[k][row] (element e = 16k + row): 256 bytes
 *        of low 4 bits (e in the low nibble of byte e % 256 if e < 256, else the high one), 128
 *        of high 2 bits (byte e % 128, bits 2 (e / 128)); they are made int8 q - 32 a
 *        sub-block at a time (q6_k_bytes), 32 at once, then read as I8_F16's quants.
 * A sub-block's scales are made in registers exactly as gguf-py makes them (float32:
 * D = fl(d * sc), M = fl(dmin * m), negated: the add -M), then the sub-block is dequantized as
 * Q4_F's / I8_F16's block: the same weights, bitwise. */
AVX2 static inline scales q4_k_scales(const uint8_t* h, int j) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const uint8_t* sc = h + 64 + 16 * j;
    const uint8_t* m = h + 192 + 16 * j;
    scales s = {_mm256_mul_ps(f16x8(h), u8x8(sc)), _mm256_mul_ps(f16x8(h + 16), u8x8(sc + 8)),
                _mm256_xor_ps(_mm256_mul_ps(f16x8(h + 32), u8x8(m)), sign),
                _mm256_xor_ps(_mm256_mul_ps(f16x8(h + 48), u8x8(m + 8)), sign)};
    return s;
}
AVX2 static inline void q4_k_step(const uint8_t* qb, const scales* s, int kk, __m256* w0,
                                  __m256* w1) {
    nibble_step(qb, s, kk, w0, w1);
}
/* Q6_K: d (of k 0-15) and m (of k 16-31) as I8_F16's */
AVX2 static inline scales q6_k_scales(const uint8_t* h, int j) {
    const uint8_t* sc = h + 32 + 32 * j;
    const __m256 d0 = f16x8(h), d1 = f16x8(h + 16);
    scales s = {_mm256_mul_ps(d0, i8x8(sc)), _mm256_mul_ps(d1, i8x8(sc + 8)),
                _mm256_mul_ps(d0, i8x8(sc + 16)), _mm256_mul_ps(d1, i8x8(sc + 24))};
    return s;
}
/* Q6_K's quants of a sub-block -> q - 32 as int8 [32 k][16 rows] in `out` (I8_F16's quants),
 * 32 bytes at a time: element e = 16k + row has its low 4 bits in byte e % 256 (low nibble for
 * e < 256, else high), its high 2 bits in byte 256 + e % 128 at bits 2 (e / 128) */
AVX2 static inline const uint8_t* q6_k_bytes(const uint8_t* qb, uint8_t* out) {
    const __m256i low = _mm256_set1_epi8(15), bits45 = _mm256_set1_epi8(0x30);
    const __m256i off = _mm256_set1_epi8(32);
    for (int o = 0; o < 128; o += 32) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i*)(qb + o));
        const __m256i l1 = _mm256_loadu_si256((const __m256i*)(qb + 128 + o));
        const __m256i h = _mm256_loadu_si256((const __m256i*)(qb + 256 + o));
        const __m256i lo[4] = {_mm256_and_si256(l0, low), _mm256_and_si256(l1, low),
                               _mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                               _mm256_and_si256(_mm256_srli_epi16(l1, 4), low)};
        /* bits 2p, 2p + 1 of each byte of h to bits 4, 5 of that byte: one 16-bit shift (a
         * byte's bits 4-5 come from its own bits either way) and a mask (21 ops a 128 bytes,
         * were 26: one row over two pairs 2.02 -> 1.95 cycles per 8 weights) */
        const __m256i hi[4] = {_mm256_and_si256(_mm256_slli_epi16(h, 4), bits45),
                               _mm256_and_si256(_mm256_slli_epi16(h, 2), bits45),
                               _mm256_and_si256(h, bits45),
                               _mm256_and_si256(_mm256_srli_epi16(h, 2), bits45)};
        for (int p = 0; p < 4; p++)
            _mm256_storeu_si256((__m256i*)(out + o + 128 * p),
                                _mm256_sub_epi8(_mm256_or_si256(lo[p], hi[p]), off));
    }
    return out;
}
/* the sub-block's quants as its step reads them: Q4_K's as stored, Q5_K's as uint8 and Q6_K's as
 * int8 in `tmp` */
static inline const uint8_t* q4_k_sub(const uint8_t* qb, uint8_t* tmp) {
    (void)tmp;
    return qb;
}
#define q6_k_sub q6_k_bytes
/* Q5_K's quants of a sub-block -> q 0..31 as uint8 [32 k][16 rows] in `out` (Q5_F's quants),
 * 32 bytes at a time: element e = 16k + row has its low 4 bits in byte e % 256 (low nibble for
 * e < 256, else high), its 5th bit in byte 256 + e % 64 at bit e / 64, shifted to bit 4 (16-bit
 * shifts: a byte's bit 4 comes from its own bit e / 64 either way) */
AVX2 static inline const uint8_t* q5_k_bytes(const uint8_t* qb, uint8_t* out) {
    const __m256i low = _mm256_set1_epi8(15), bit4 = _mm256_set1_epi8(16);
    for (int o = 0; o < 256; o += 32) {
        const __m256i l = _mm256_loadu_si256((const __m256i*)(qb + o));
        const __m256i h = _mm256_loadu_si256((const __m256i*)(qb + 256 + o % 64));
        const int c = o / 64; /* the bit of elements o ..; 4 + c: of 256 + o .. */
        const __m256i h0 = _mm256_sll_epi16(h, _mm_cvtsi32_si128(4 - c));
        const __m256i h1 = _mm256_srl_epi16(h, _mm_cvtsi32_si128(c));
        _mm256_storeu_si256((__m256i*)(out + o),
                            _mm256_or_si256(_mm256_and_si256(l, low), _mm256_and_si256(h0, bit4)));
        _mm256_storeu_si256((__m256i*)(out + 256 + o),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l, 4), low),
                                            _mm256_and_si256(h1, bit4)));
    }
    return out;
}
#define q5_k_sub q5_k_bytes
/* Q5_K: Q4_K's scales, Q5_F's step over the sub-block's bytes (EXACT_DQ) */
#define q5_k_scales q4_k_scales
AVX2 static inline void q5_k_step(const uint8_t* q, const scales* s, int kk, __m256* w0,
                                  __m256* w1) {
    *w0 = _mm256_fmadd_ps(s->d0, u8x8(q + 16 * kk), s->m0); /* EXACT_DQ */
    *w1 = _mm256_fmadd_ps(s->d1, u8x8(q + 16 * kk + 8), s->m1);
}
AVX2 static inline void q6_k_step(const uint8_t* q, const scales* s, int kk, __m256* w0,
                                  __m256* w1) {
    *w0 = _mm256_mul_ps(i8x8(q + 16 * kk), kk < 16 ? s->d0 : s->m0);
    *w1 = _mm256_mul_ps(i8x8(q + 16 * kk + 8), kk < 16 ? s->d1 : s->m1);
}
/* a super-block's lines prefetched over its 8 sub-blocks: sub-block j's share */
#define PREFETCH_SHARE(p, BYTES, j)                                                            \
    for (int o = ((BYTES) * (j) / 8) & ~63; o < (BYTES) * ((j) + 1) / 8; o += 64)               \
        _mm_prefetch((const char*)(p) + o, _MM_HINT_T0);
/* the steps of nsb super-blocks of a pair (the ones after them prefetched): at input k, the
 * 16 weights of the step in v0, v1 (one vector per panel), then BODY */
#define KSTEPS(KIND, BYTES, HEAD, SUB, BODY)                                                   \
    uint8_t tmp[SD_QBLOCK * 2 * PW] __attribute__((aligned(32)));                              \
    for (int64_t h = 0; h < nsb; h++, b += BYTES) {                                            \
        for (int j = 0; j < 8; j++) {                                                          \
            PREFETCH_SHARE(b + nsb * BYTES, BYTES, j)                                          \
            const scales s = KIND##_scales(b, j);                                              \
            const uint8_t* qb = KIND##_sub(b + HEAD + SUB * j, tmp);                           \
            KSTEP_LOOP(KIND, kk) {                                                             \
                __m256 v0, v1;                                                                 \
                KIND##_step(qb, &s, kk, &v0, &v1);                                             \
                const int64_t k = (h * 8 + j) * SD_QBLOCK + kk;                                \
                BODY                                                                           \
            }                                                                                  \
        }                                                                                      \
    }
/* nsb super-blocks of a pair unpacked to buf [256 * nsb][16] */
#define KUNPACK(KIND, BYTES, HEAD, SUB)                                                        \
    AVX2 static void unpack_##KIND(const uint8_t* b, int64_t nsb, float* buf) {               \
        KSTEPS(KIND, BYTES, HEAD, SUB, _mm256_storeu_ps(buf + k * 2 * PW, v0);                 \
               _mm256_storeu_ps(buf + k * 2 * PW + PW, v1);)                                   \
    }
#define KDIRECT(KIND, BYTES, HEAD, SUB, R, EACH)                                               \
    AVX2 static void KIND##_r##R(const float* x, int64_t K, const uint8_t* b, int64_t nsb,    \
                                 float* y, int64_t ldy, int first) {                           \
        EACH(INIT)                                                                             \
        KSTEPS(KIND, BYTES, HEAD, SUB, EACH(ROW))                                              \
        EACH(STORE)                                                                            \
    }
/* one row over two pairs at once, as DIRECT2P (nsb super-blocks: the whole of K) */
#define KDIRECT2P(KIND, BYTES, HEAD, SUB, R, EACH)                                             \
    AVX2 static void KIND##_p2r##R(const float* x, int64_t K, const uint8_t* b,                \
                                   int64_t stride, int64_t nsb, float* y, int64_t ldy) {       \
        uint8_t tmp0[SD_QBLOCK * 2 * PW] __attribute__((aligned(32)));                         \
        uint8_t tmp1[SD_QBLOCK * 2 * PW] __attribute__((aligned(32)));                         \
        EACH(INIT2P)                                                                           \
        for (int64_t h = 0; h < nsb; h++, b += BYTES) {                                        \
            for (int j = 0; j < 8; j++) {                                                      \
                PREFETCH_SHARE(b + 2 * stride + h * BYTES, 2 * (BYTES), j)                     \
                const scales s0 = KIND##_scales(b, j), s1 = KIND##_scales(b + stride, j);      \
                const uint8_t* q0 = KIND##_sub(b + HEAD + SUB * j, tmp0);                      \
                const uint8_t* q1 = KIND##_sub(b + stride + HEAD + SUB * j, tmp1);             \
                KSTEP_LOOP(KIND, kk) {                                                         \
                    __m256 v0, v1;                                                             \
                    const int64_t k = (h * 8 + j) * SD_QBLOCK + kk;                            \
                    KIND##_step(q0, &s0, kk, &v0, &v1);                                        \
                    EACH(ROW2P)                                                                \
                    KIND##_step(q1, &s1, kk, &v0, &v1);                                        \
                    EACH(ROW2Q)                                                                \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        EACH(STORE2P)                                                                          \
    }
#define KQUANT_FORMAT(KIND, BYTES, HEAD, SUB)                                                  \
    KUNPACK(KIND, BYTES, HEAD, SUB)                                                            \
    KDIRECT(KIND, BYTES, HEAD, SUB, 1, EACH1) KDIRECT(KIND, BYTES, HEAD, SUB, 2, EACH2)         \
    KDIRECT(KIND, BYTES, HEAD, SUB, 3, EACH3) KDIRECT2P(KIND, BYTES, HEAD, SUB, 1, EACH1)
KQUANT_FORMAT(q4_k, SD_Q4_K_PAIR_BYTES, SD_Q4_K_HEAD, 256)
KQUANT_FORMAT(q6_k, SD_Q6_K_PAIR_BYTES, SD_Q6_K_HEAD, SD_Q6_K_SUB)
KQUANT_FORMAT(q5_k, SD_Q5_K_PAIR_BYTES, SD_Q5_K_HEAD, SD_Q5_K_SUB)

/* AVX-512 (sd_float_isa): one __m512 holds a pair's 16 output rows, so a step dequantizes 16
 * weights with the vector ops AVX2 spends on 8. Every element's operations are AVX2's: the
 * same w = fl(d * q) (+ m, a second rounding), the same fma chain over ascending k from 0 or
 * from y. The 4-bit formats keep the pair's rows interleaved in the lanes (panel 0's row i in
 * lane 2i, panel 1's in lane 2i + 1: one 64-bit broadcast of the two panels' words, one shift,
 * one and make all 16 quants); their scales and accumulators are permuted into those lanes
 * once per block / call and back at the store. The byte formats keep the column order. Every
 * row count runs in tiles of at most TWO_ROWS rows over two pairs at once, dequantizing in
 * registers (see linear_gguf); AVX-512 unpacking into a buffer measured slower (8 rows). */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
typedef struct {
    __m512 d, m; /* a block's scales for the 16 rows: d and m (I8_F16, Q6_K: d of k 0-15, 16-31) */
} scales16;
/* column order <-> the lanes of a format with interleaved lanes (ilv != 0) */
AVX512 static inline __m512 to_lanes(int ilv, __m512 v) {
    return ilv ? _mm512_permutexvar_ps(_mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13,
                                                         6, 14, 7, 15), v)
               : v;
}
AVX512 static inline __m512 from_lanes(int ilv, __m512 v) {
    return ilv ? _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7,
                                                         9, 11, 13, 15), v)
               : v;
}
AVX512 static inline scales16 scales_to_lanes(int ilv, scales16 s) {
    return (scales16){to_lanes(ilv, s.d), to_lanes(ilv, s.m)};
}
AVX512 static inline __m512 f16x16(const uint8_t* b) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)b));
}
AVX512 static inline __m512 i8x16(const uint8_t* q) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q)));
}
AVX512 static inline __m512 u8x16(const uint8_t* q) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q)));
}
AVX512 static inline scales16 q4_1_scales16(const uint8_t* b) {
    return (scales16){f16x16(b), f16x16(b + 32)};
}
AVX512 static inline scales16 q8_0_scales16(const uint8_t* b) {
    return (scales16){f16x16(b), _mm512_setzero_ps()};
}
AVX512 static inline scales16 f32_scales16(const uint8_t* b) {
    const float* f = (const float*)b;
    return (scales16){_mm512_loadu_ps(f), _mm512_loadu_ps(f + 16)};
}
#define q4_f_scales16 f32_scales16
#define q5_f_scales16 f32_scales16
#define i8_f16_scales16 f32_scales16
/* step kk's 16 weights, interleaved: the two panels' uint32 (rows 0-7, rows 8-15) side by side
 * in each 64-bit lane, lane 2i shifted by 4i, lane 2i + 1 too; the float of the low 4 bits is
 * looked up (a permute reads only an index's low 4 bits: no and, no convert; exact) */
AVX512 static inline __m512 nibble_step16(const uint8_t* qb, const scales16* s, int kk) {
    const __m512i shifts = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24,
                                             28, 28);
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i both = _mm512_broadcastq_epi64(_mm_loadl_epi64((const __m128i*)(qb + 8 * kk)));
    const __m512 q = _mm512_permutexvar_ps(_mm512_srlv_epi32(both, shifts), values);
    return _mm512_fmadd_ps(s->d, q, s->m); /* EXACT_DQ */
}
AVX512 static inline __m512 q4_1_step16(const uint8_t* b, const scales16* s, int kk) {
    return nibble_step16(b + 64, s, kk);
}
AVX512 static inline __m512 q4_f_step16(const uint8_t* b, const scales16* s, int kk) {
    return nibble_step16(b + 128, s, kk);
}
AVX512 static inline __m512 q8_0_step16(const uint8_t* b, const scales16* s, int kk) {
    return _mm512_mul_ps(i8x16(b + 32 + 16 * kk), s->d);
}
AVX512 static inline __m512 q5_f_step16(const uint8_t* b, const scales16* s, int kk) {
    return _mm512_fmadd_ps(s->d, u8x16(b + 128 + 16 * kk), s->m); /* EXACT_DQ */
}
AVX512 static inline __m512 i8_f16_step16(const uint8_t* b, const scales16* s, int kk) {
    return _mm512_mul_ps(i8x16(b + 128 + 16 * kk), kk < 16 ? s->d : s->m);
}
/* the super-block formats' sub-block scales and steps, as q4_k_scales / q6_k_scales above */
AVX512 static inline scales16 q4_k_scales16(const uint8_t* h, int j) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    return (scales16){_mm512_mul_ps(f16x16(h), u8x16(h + 64 + 16 * j)),
                      _mm512_xor_ps(_mm512_mul_ps(f16x16(h + 32), u8x16(h + 192 + 16 * j)),
                                    sign)};
}
#define q4_k_step16 nibble_step16
/* the sub-block's quants as the AVX-512 steps read them: q4_k_sub's, q6_k_sub's; Q5_K's made
 * 64 bytes at a time (q5_k_bytes' layout: the 5th bits of elements o .. o + 63 are bit o / 64 of
 * the 64 bytes after the nibbles; one ternary-logic op puts them in) */
#define q4_k_sub16 q4_k_sub
#define q6_k_sub16 q6_k_sub
AVX512 static inline const uint8_t* q5_k_sub16(const uint8_t* qb, uint8_t* out) {
    const __m512i low = _mm512_set1_epi8(15), bit4 = _mm512_set1_epi8(16);
    const __m512i h = _mm512_loadu_si512((const void*)(qb + 256));
    for (int c = 0; c < 4; c++) { /* elements 64c .. (bit c) and 256 + 64c .. (bit 4 + c) */
        const __m512i l = _mm512_loadu_si512((const void*)(qb + 64 * c));
        const __m512i h0 = _mm512_sll_epi16(h, _mm_cvtsi32_si128(4 - c));
        const __m512i h1 = _mm512_srl_epi16(h, _mm_cvtsi32_si128(c));
        _mm512_storeu_si512((void*)(out + 64 * c),
                            _mm512_ternarylogic_epi32(_mm512_and_si512(l, low), h0, bit4, 0xF8));
        _mm512_storeu_si512((void*)(out + 256 + 64 * c),
                            _mm512_ternarylogic_epi32(
                                _mm512_and_si512(_mm512_srli_epi16(l, 4), low), h1, bit4, 0xF8));
    }
    return out;
}
#define q5_k_scales16 q4_k_scales16
AVX512 static inline __m512 q5_k_step16(const uint8_t* q, const scales16* s, int kk) {
    return _mm512_fmadd_ps(s->d, u8x16(q + 16 * kk), s->m); /* EXACT_DQ */
}
AVX512 static inline scales16 q6_k_scales16(const uint8_t* h, int j) {
    const uint8_t* sc = h + 32 + 32 * j;
    const __m512 d = f16x16(h);
    return (scales16){_mm512_mul_ps(d, i8x16(sc)), _mm512_mul_ps(d, i8x16(sc + 16))};
}
AVX512 static inline __m512 q6_k_step16(const uint8_t* q, const scales16* s, int kk) {
    return _mm512_mul_ps(i8x16(q + 16 * kk), kk < 16 ? s->d : s->m);
}
/* interleaved lanes, by format */
enum { q4_1_ILV = 1, q4_f_ILV = 1, q4_k_ILV = 1, q8_0_ILV = 0, q5_f_ILV = 0, i8_f16_ILV = 0,
       q6_k_ILV = 0, q5_k_ILV = 0 };
#define INIT16(r) __m512 c##r = first ? _mm512_setzero_ps()                                    \
                                      : to_lanes(ilv, _mm512_loadu_ps(y + r * ldy));
#define ROW16(r) c##r = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), v, c##r);
#define STORE16(r) _mm512_storeu_ps(y + r * ldy, from_lanes(ilv, c##r));
#define DIRECT16(KIND, BYTES, R, EACH)                                                         \
    AVX512 static void KIND##_z##R(const float* x, int64_t K, const uint8_t* b, int64_t nblk, \
                                   float* y, int64_t ldy, int first) {                         \
        const int ilv = KIND##_ILV;                                                            \
        EACH(INIT16)                                                                           \
        for (int64_t j = 0; j < nblk; j++, b += BYTES) {                                       \
            for (int o = 0; o < BYTES; o += 64)                                                \
                _mm_prefetch((const char*)b + nblk * BYTES + o, _MM_HINT_T0);                  \
            const scales16 s = scales_to_lanes(ilv, KIND##_scales16(b));                       \
            for (int kk = 0; kk < SD_QBLOCK; kk++) {                                           \
                const __m512 v = KIND##_step16(b, &s, kk);                                     \
                const int64_t k = j * SD_QBLOCK + kk;                                          \
                EACH(ROW16)                                                                    \
            }                                                                                  \
        }                                                                                      \
        EACH(STORE16)                                                                          \
    }
/* R (1 to 8) rows over two pairs at once (b and b + stride; columns y and y + 16): twice the
 * independent fma chains (with one or two a step waits on the fma latency), and each step's
 * dequantized weights used by every row */
#define INIT2(r) INIT16(r)                                                                     \
    __m512 e##r = first ? _mm512_setzero_ps()                                                  \
                        : to_lanes(ilv, _mm512_loadu_ps(y + r * ldy + 2 * PW));
#define ROW2(r) {                                                                              \
        const __m512 xr = _mm512_set1_ps(x[r * K + k]);                                        \
        c##r = _mm512_fmadd_ps(xr, v, c##r);                                                   \
        e##r = _mm512_fmadd_ps(xr, u, e##r);                                                   \
    }
#define STORE2(r) STORE16(r) _mm512_storeu_ps(y + r * ldy + 2 * PW, from_lanes(ilv, e##r));
#define DIRECT16_TWO(KIND, BYTES, R, EACH)                                                     \
    AVX512 static void KIND##_two##R(const float* x, int64_t K, const uint8_t* b,             \
                                     int64_t stride, int64_t nblk, float* y, int64_t ldy,      \
                                     int first) {                                              \
        const int ilv = KIND##_ILV;                                                            \
        EACH(INIT2)                                                                            \
        for (int64_t j = 0; j < nblk; j++, b += BYTES) {                                       \
            for (int o = 0; o < BYTES; o += 64) {                                              \
                _mm_prefetch((const char*)b + nblk * BYTES + o, _MM_HINT_T0);                  \
                _mm_prefetch((const char*)b + stride + nblk * BYTES + o, _MM_HINT_T0);         \
            }                                                                                  \
            const scales16 s0 = scales_to_lanes(ilv, KIND##_scales16(b)),                      \
                           s1 = scales_to_lanes(ilv, KIND##_scales16(b + stride));             \
            for (int kk = 0; kk < SD_QBLOCK; kk++) {                                           \
                const __m512 v = KIND##_step16(b, &s0, kk);                                    \
                const __m512 u = KIND##_step16(b + stride, &s1, kk);                           \
                const int64_t k = j * SD_QBLOCK + kk;                                          \
                EACH(ROW2)                                                                     \
            }                                                                                  \
        }                                                                                      \
        EACH(STORE2)                                                                           \
    }
#define GGUF_FORMAT16(KIND, BYTES)                                                             \
    DIRECT16(KIND, BYTES, 1, EACH1) DIRECT16(KIND, BYTES, 2, EACH2)                            \
    DIRECT16(KIND, BYTES, 3, EACH3) DIRECT16(KIND, BYTES, 4, EACH4)                            \
    DIRECT16(KIND, BYTES, 5, EACH5) DIRECT16(KIND, BYTES, 6, EACH6)                            \
    DIRECT16_TWO(KIND, BYTES, 1, EACH1) DIRECT16_TWO(KIND, BYTES, 2, EACH2)                    \
    DIRECT16_TWO(KIND, BYTES, 3, EACH3) DIRECT16_TWO(KIND, BYTES, 4, EACH4)                    \
    DIRECT16_TWO(KIND, BYTES, 5, EACH5) DIRECT16_TWO(KIND, BYTES, 6, EACH6)                    \
    DIRECT16(KIND, BYTES, 7, EACH7) DIRECT16(KIND, BYTES, 8, EACH8)                            \
    DIRECT16_TWO(KIND, BYTES, 7, EACH7) DIRECT16_TWO(KIND, BYTES, 8, EACH8)
GGUF_FORMAT16(q4_1, SD_Q4_1_PAIR_BYTES)
GGUF_FORMAT16(q8_0, SD_Q8_0_PAIR_BYTES)
GGUF_FORMAT16(q4_f, SD_Q4_F_PAIR_BYTES)
GGUF_FORMAT16(q5_f, SD_Q5_F_PAIR_BYTES)
GGUF_FORMAT16(i8_f16, SD_I8_F16_PAIR_BYTES)
#define KDIRECT16(KIND, BYTES, HEAD, SUB, R, EACH)                                             \
    AVX512 static void KIND##_z##R(const float* x, int64_t K, const uint8_t* b, int64_t nsb,  \
                                   float* y, int64_t ldy, int first) {                         \
        const int ilv = KIND##_ILV;                                                            \
        uint8_t tmp[SD_QBLOCK * 2 * PW] __attribute__((aligned(32)));                          \
        EACH(INIT16)                                                                           \
        for (int64_t h = 0; h < nsb; h++, b += BYTES) {                                        \
            for (int j = 0; j < 8; j++) {                                                      \
                PREFETCH_SHARE(b + nsb * BYTES, BYTES, j)                                      \
                const scales16 s = scales_to_lanes(ilv, KIND##_scales16(b, j));                \
                const uint8_t* qb = KIND##_sub16(b + HEAD + SUB * j, tmp);                     \
                for (int kk = 0; kk < SD_QBLOCK; kk++) {                                       \
                    const __m512 v = KIND##_step16(qb, &s, kk);                                \
                    const int64_t k = (h * 8 + j) * SD_QBLOCK + kk;                            \
                    EACH(ROW16)                                                                \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        EACH(STORE16)                                                                          \
    }
#define KDIRECT16_TWO(KIND, BYTES, HEAD, SUB, R, EACH)                                         \
    AVX512 static void KIND##_two##R(const float* x, int64_t K, const uint8_t* b,             \
                                     int64_t stride, int64_t nsb, float* y, int64_t ldy,       \
                                     int first) {                                              \
        const int ilv = KIND##_ILV;                                                            \
        uint8_t tmp0[SD_QBLOCK * 2 * PW] __attribute__((aligned(32)));                         \
        uint8_t tmp1[SD_QBLOCK * 2 * PW] __attribute__((aligned(32)));                         \
        EACH(INIT2)                                                                            \
        for (int64_t h = 0; h < nsb; h++, b += BYTES) {                                        \
            for (int j = 0; j < 8; j++) {                                                      \
                PREFETCH_SHARE(b + nsb * BYTES, BYTES, j)                                      \
                PREFETCH_SHARE(b + stride + nsb * BYTES, BYTES, j)                             \
                const scales16 s0 = scales_to_lanes(ilv, KIND##_scales16(b, j)),               \
                               s1 = scales_to_lanes(ilv, KIND##_scales16(b + stride, j));      \
                const uint8_t* q0 = KIND##_sub16(b + HEAD + SUB * j, tmp0);                    \
                const uint8_t* q1 = KIND##_sub16(b + stride + HEAD + SUB * j, tmp1);           \
                for (int kk = 0; kk < SD_QBLOCK; kk++) {                                       \
                    const __m512 v = KIND##_step16(q0, &s0, kk);                               \
                    const __m512 u = KIND##_step16(q1, &s1, kk);                               \
                    const int64_t k = (h * 8 + j) * SD_QBLOCK + kk;                            \
                    EACH(ROW2)                                                                 \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        EACH(STORE2)                                                                           \
    }
#define KQUANT_FORMAT16(KIND, BYTES, HEAD, SUB)                                                \
    KDIRECT16(KIND, BYTES, HEAD, SUB, 1, EACH1) KDIRECT16(KIND, BYTES, HEAD, SUB, 2, EACH2)     \
    KDIRECT16(KIND, BYTES, HEAD, SUB, 3, EACH3) KDIRECT16(KIND, BYTES, HEAD, SUB, 4, EACH4)     \
    KDIRECT16(KIND, BYTES, HEAD, SUB, 5, EACH5) KDIRECT16(KIND, BYTES, HEAD, SUB, 6, EACH6)     \
    KDIRECT16_TWO(KIND, BYTES, HEAD, SUB, 1, EACH1) KDIRECT16_TWO(KIND, BYTES, HEAD, SUB, 2, EACH2) \
    KDIRECT16_TWO(KIND, BYTES, HEAD, SUB, 3, EACH3) KDIRECT16_TWO(KIND, BYTES, HEAD, SUB, 4, EACH4) \
    KDIRECT16_TWO(KIND, BYTES, HEAD, SUB, 5, EACH5) KDIRECT16_TWO(KIND, BYTES, HEAD, SUB, 6, EACH6) \
    KDIRECT16(KIND, BYTES, HEAD, SUB, 7, EACH7) KDIRECT16(KIND, BYTES, HEAD, SUB, 8, EACH8)     \
    KDIRECT16_TWO(KIND, BYTES, HEAD, SUB, 7, EACH7) KDIRECT16_TWO(KIND, BYTES, HEAD, SUB, 8, EACH8)
KQUANT_FORMAT16(q4_k, SD_Q4_K_PAIR_BYTES, SD_Q4_K_HEAD, 256)
KQUANT_FORMAT16(q6_k, SD_Q6_K_PAIR_BYTES, SD_Q6_K_HEAD, SD_Q6_K_SUB)
KQUANT_FORMAT16(q5_k, SD_Q5_K_PAIR_BYTES, SD_Q5_K_HEAD, SD_Q5_K_SUB)

typedef void (*direct_fn)(const float*, int64_t, const uint8_t*, int64_t, float*, int64_t, int);
#define TWO_ROWS 8    /* most rows of a tile over two pairs at a time (AVX-512) */
#define DIRECT_ROWS 3 /* up to this many rows (6 accumulators + 2 weights + 4 scales + 3) */
/* a format's kernels over units of `width` k (32: a block; 256: a super-block) of `bytes` */
typedef struct {
    int64_t width, bytes;
    void (*unpack)(const uint8_t*, int64_t, float*);
    direct_fn direct[TWO_ROWS]; /* AVX2: 1 to DIRECT_ROWS rows */
    /* 1 to TWO_ROWS rows over two pairs, the second `stride` bytes on (AVX-512; NULL: AVX2) */
    void (*two[TWO_ROWS])(const float*, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t,
                          int);
    /* one row over two pairs, the second `stride` bytes on, all of K (AVX2; NULL: AVX-512) */
    void (*pairs2)(const float*, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
} gguf_kernels;
#define GGUF_KERNELS(KIND, WIDTH, BYTES) {WIDTH, BYTES, unpack_##KIND,                          \
                                          {KIND##_r1, KIND##_r2, KIND##_r3}, {NULL}, KIND##_p2r1}
/* by format code (the float-activation GGUF formats; the others are never looked up here) */
static const gguf_kernels GGUF_TABLE[SD_NUM_FORMATS] = {
    [SD_Q4_1] = GGUF_KERNELS(q4_1, SD_QBLOCK, SD_Q4_1_PAIR_BYTES),
    [SD_Q8_0] = GGUF_KERNELS(q8_0, SD_QBLOCK, SD_Q8_0_PAIR_BYTES),
    [SD_Q4_F] = GGUF_KERNELS(q4_f, SD_QBLOCK, SD_Q4_F_PAIR_BYTES),
    [SD_Q5_F] = GGUF_KERNELS(q5_f, SD_QBLOCK, SD_Q5_F_PAIR_BYTES),
    [SD_I8_F16] = GGUF_KERNELS(i8_f16, SD_QBLOCK, SD_I8_F16_PAIR_BYTES),
    [SD_Q4_K] = GGUF_KERNELS(q4_k, SD_QK, SD_Q4_K_PAIR_BYTES),
    [SD_Q6_K] = GGUF_KERNELS(q6_k, SD_QK, SD_Q6_K_PAIR_BYTES),
    [SD_Q5_K] = GGUF_KERNELS(q5_k, SD_QK, SD_Q5_K_PAIR_BYTES)};
#define GGUF_KERNELS16(KIND, WIDTH, BYTES) {WIDTH, BYTES, unpack_##KIND,                        \
                                            {KIND##_z1, KIND##_z2, KIND##_z3, KIND##_z4,    \
                                             KIND##_z5, KIND##_z6, KIND##_z7, KIND##_z8},   \
                                            {KIND##_two1, KIND##_two2, KIND##_two3,         \
                                             KIND##_two4, KIND##_two5, KIND##_two6,         \
                                             KIND##_two7, KIND##_two8}, NULL}
static const gguf_kernels GGUF_TABLE16[SD_NUM_FORMATS] = {
    [SD_Q4_1] = GGUF_KERNELS16(q4_1, SD_QBLOCK, SD_Q4_1_PAIR_BYTES),
    [SD_Q8_0] = GGUF_KERNELS16(q8_0, SD_QBLOCK, SD_Q8_0_PAIR_BYTES),
    [SD_Q4_F] = GGUF_KERNELS16(q4_f, SD_QBLOCK, SD_Q4_F_PAIR_BYTES),
    [SD_Q5_F] = GGUF_KERNELS16(q5_f, SD_QBLOCK, SD_Q5_F_PAIR_BYTES),
    [SD_I8_F16] = GGUF_KERNELS16(i8_f16, SD_QBLOCK, SD_I8_F16_PAIR_BYTES),
    [SD_Q4_K] = GGUF_KERNELS16(q4_k, SD_QK, SD_Q4_K_PAIR_BYTES),
    [SD_Q6_K] = GGUF_KERNELS16(q6_k, SD_QK, SD_Q6_K_PAIR_BYTES),
    [SD_Q5_K] = GGUF_KERNELS16(q5_k, SD_QK, SD_Q5_K_PAIR_BYTES)};

int sd_float_isa(void) {
    /* decided once per process, as sd_q8_isa: AVX-512 unless the CPU lacks it or the
     * environment caps the instruction set below it */
    static int isa = -1;
    int got = __atomic_load_n(&isa, __ATOMIC_RELAXED);
    if (got < 0) {
        const char* want = getenv("SPECDEC_NATIVE_ISA");
        const int capped = want && (!strcmp(want, "avx2") || !strcmp(want, "avx-vnni"));
        got = !capped && (sd_cpu_features() & 2) ? SD_FLOAT_AVX512 : SD_FLOAT_AVX2;
        __atomic_store_n(&isa, got, __ATOMIC_RELAXED);
    }
    return got;
}

/* the quantized path. AVX-512: the rows in tiles of at most TWO_ROWS (as even as possible),
 * each dequantizing two pairs in registers, a step's blocks read again from L1 by the next tile
 * (one 2048 x 2048 Q4_K matrix, hot, 2 threads: 4 rows 294 -> 152 us, 8 rows 494 -> 234, 64
 * rows 2468 -> 2029 against unpacking once into a buffer). AVX2: 1-3 rows dequantize in
 * registers, a pair (one row: two) over the whole of K at a time; more rows unpack each k-block
 * of a pair once into fp32 (L1) and run every row tile over it. The weights, and so every fma
 * chain, are the same either way. */
static void linear_gguf(const float* x, int64_t T, int64_t K, const sd_weight* w, float* y,
                        int64_t ldy, int64_t tiles, int64_t base, int64_t extra) {
    const gguf_kernels* g =
        &(sd_float_isa() == SD_FLOAT_AVX512 ? GGUF_TABLE16 : GGUF_TABLE)[w->fmt];
    const int64_t pairs = w->panels / 2, width = g->width, bytes = g->bytes;
    /* k per step: KBLOCK, or a whole super-block */
    const int64_t step = width > KBLOCK ? width : KBLOCK;
    float buf[(KBLOCK > SD_QK ? KBLOCK : SD_QK) * 2 * PW] __attribute__((aligned(64)));
    /* AVX-512: pairs two at a time (the last alone when their number is odd), each step's
     * blocks run by every row tile while they are in L1 */
    if (g->two[0]) {
        const int64_t nt = (T + TWO_ROWS - 1) / TWO_ROWS, tb = T / nt, te = T % nt;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < (pairs + 1) / 2; p++) {
            const int64_t q = 2 * p, stride = (K / width) * bytes;
            const uint8_t* pair = (const uint8_t*)w->data + q * stride;
            for (int64_t k0 = 0; k0 < K; k0 += step) {
                const int64_t kn = K - k0 < step ? K - k0 : step;
                const uint8_t* blocks = pair + (k0 / width) * bytes;
                for (int64_t i = 0, t = 0; i < nt; i++) {
                    const int64_t r = tb + (i < te);
                    if (q + 1 < pairs)
                        g->two[r - 1](x + t * K + k0, K, blocks, stride, kn / width,
                                      y + t * ldy + 2 * q * PW, ldy, k0 == 0);
                    else
                        g->direct[r - 1](x + t * K + k0, K, blocks, kn / width,
                                         y + t * ldy + 2 * q * PW, ldy, k0 == 0);
                    t += r;
                }
            }
        }
        return;
    }
    if (T <= DIRECT_ROWS) { /* T == 0 never gets here (sd_linear_for) */
        /* each thread a run of pairs (as even as possible), each pair over the whole of K (one
         * row tile: no block is reused, so no k-blocks; a direct kernel prefetches the next
         * pair as it goes, one sequential stream); one row two pairs at a time (DIRECT2P; two
         * or three rows have 4 or 6 chains in one pair already, and two pairs' 8 or 12
         * accumulators leave too few registers for their scales) */
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t stride = (K / width) * bytes, q1 = pairs * (t + 1) / nt;
        int64_t q = pairs * t / nt;
        const uint8_t* data = (const uint8_t*)w->data;
        if (T == 1)
            for (; q + 1 < q1; q += 2)
                g->pairs2(x, K, data + q * stride, stride, K / width, y + 2 * q * PW, ldy);
        for (; q < q1; q++)
            g->direct[T - 1](x, K, data + q * stride, K / width, y + 2 * q * PW, ldy, 1);
#pragma omp barrier
        return;
    }
#pragma omp for schedule(static)
    for (int64_t q = 0; q < pairs; q++) {
        const uint8_t* pair = (const uint8_t*)w->data + q * (K / width) * bytes;
        for (int64_t k0 = 0; k0 < K; k0 += step) {
            const int64_t kn = K - k0 < step ? K - k0 : step;
            const uint8_t* blocks = pair + (k0 / width) * bytes;
            float* yq = y + 2 * q * PW;
            g->unpack(blocks, kn / width, buf);
            for (int64_t i = 0, t = 0; i < tiles; i++) {
                const int64_t r = base + (i < extra);
                BUF_MICRO[r - 1](x + t * K + k0, K, buf, buf + PW, kn, yq + t * ldy, ldy,
                                 k0 == 0);
                t += r;
            }
        }
    }
}

/* a weight in parts (kernels.h): 0 when valid for K inputs */
static int check_parts(const sd_weight* w, int64_t K) {
    if (w->nparts < 1 || w->nparts > SD_MAX_PARTS || !w->parts || w->data || w->fmt != SD_PARTS
        || w->out < 1 || w->out > PW * w->panels)
        return -1;
    int64_t panels = 0, out = 0;
    const int q8 = sd_is_q8(w->parts[0].fmt);
    for (int64_t i = 0; i < w->nparts; i++) {
        const sd_weight* p = &w->parts[i];
        /* no nesting, no bias of its own, one activation layout, whole pairs but the last */
        if (p->nparts || p->parts || p->bias || sd_check_weight(p, K) || sd_is_q8(p->fmt) != q8
            || (i + 1 < w->nparts && p->out != PW * p->panels))
            return -1;
        panels += p->panels;
        out += p->out;
    }
    return panels == w->panels && out == w->out ? 0 : -1;
}

int sd_check_weight(const sd_weight* w, int64_t K) {
    if (!w) return -1;
    if (w->nparts || w->parts) return K < 1 ? -1 : check_parts(w, K);
    if (!w->data || w->fmt < 0 || w->fmt >= SD_NUM_FORMATS || w->panels < 2 || w->panels % 2 || K < 1
        || w->out > PW * w->panels || w->out < 1)
        return -1;
    if (sd_is_gguf(w->fmt) && K % SD_QBLOCK) return -1;
    if (sd_is_kquant(w->fmt) && K % SD_QK) return -1;
    return 0;
}

void sd_linear_for(const float* x, int64_t T, int64_t K, const sd_weight* w, float* y,
                   int64_t ldy) {
    if (T == 0) { /* nothing to write (and no row tile: the tables start at one row) */
#pragma omp barrier
        return;
    }
    if (w->nparts) { /* each part into its columns, one work-sharing loop (and barrier) each */
        for (int64_t i = 0, col = 0; i < w->nparts; col += PW * w->parts[i].panels, i++)
            sd_linear_for(x, T, K, &w->parts[i], y + col, ldy);
        return;
    }
    /* row tiles of at most 6, as even as possible (8 -> 4 + 4, 16 -> 6 + 5 + 5) */
    const int64_t tiles = (T + 5) / 6, base = tiles ? T / tiles : 0, extra = tiles ? T % tiles : 0;
    if (sd_is_q8(w->fmt)) {
        sd_linear_q8_for(x, T, K, w, y, ldy);
        return;
    }
    if (sd_is_gguf(w->fmt)) {
        linear_gguf(x, T, K, w, y, ldy, tiles, base, extra);
        return;
    }
    const micro_fn* micro = MICRO_TABLE[w->fmt];
    const int64_t es = ELEMENT_SIZE[w->fmt], pairs = w->panels / 2;
#pragma omp for schedule(static)
    for (int64_t q = 0; q < pairs; q++) {
        const char* p0 = (const char*)w->data + 2 * q * K * PW * es;
        const char* p1 = p0 + K * PW * es;
        for (int64_t k0 = 0; k0 < K; k0 += KBLOCK) {
            const int64_t kn = K - k0 < KBLOCK ? K - k0 : KBLOCK;
            for (int64_t i = 0, t = 0; i < tiles; i++) {
                const int64_t r = base + (i < extra);
                micro[r - 1](x + t * K + k0, K, p0 + k0 * PW * es, p1 + k0 * PW * es, kn,
                             y + t * ldy + 2 * q * PW, ldy, k0 == 0);
                t += r;
            }
        }
    }
}

/* y[T, ldy] = x[T, K] @ W.T for W prepared as `panels` panels (an even number) of format `fmt`
 * (0 f32, 1 bf16, 2 f16, 3 Q4_1, 4 Q8_0, 7 Q4_F, 8 Q5_F, 9 I8_F16, 13 Q4_K, 14 Q6_K, 17 Q5_K,
 * and those blocks laid out for 8-bit activations: 5, 6, 10, 11, 12, 15, 16, 18; kernels.h);
 * columns up to 8 * panels are written (ldy >= 8 * panels). T == 0 writes nothing and succeeds. Returns 0,
 * or -1 when this CPU lacks AVX2/FMA or the arguments are invalid (nothing written). The
 * lengths of x, w and y are not known here: the caller checks them (specdec/native/__init__.py).
 */
int sd_linear(const float* x, int64_t T, int64_t K, const void* w, int fmt, int64_t panels,
              float* y, int64_t ldy, int nthreads) {
    const sd_weight weight = {w, fmt, panels, PW * panels, 0};
    if (!(sd_cpu_features() & 1) || sd_check_weight(&weight, K) || T < 0 || ldy < PW * panels
        || nthreads < 1 || (T > 0 && (!x || !y)))
        return -1;
    if (T == 0) return 0;
#pragma omp parallel num_threads(nthreads)
    sd_linear_for(x, T, K, &weight, y, ldy);
    return 0;
}

/* sd_linear for any prepared weight, a weight in parts too (kernels.h: sd_weight; its bias is
 * not added: the caller adds it): y[T, ldy] with ldy >= 8 * w->panels. Returns 0, or -1 when
 * this CPU lacks AVX2/FMA or the arguments are invalid (nothing written). The lengths behind
 * the pointers are not known here: the caller checks them (specdec/native/__init__.py). */
int sd_linear_weight(const float* x, int64_t T, int64_t K, const sd_weight* w, float* y,
                     int64_t ldy, int nthreads) {
    if (!(sd_cpu_features() & 1) || sd_check_weight(w, K) || T < 0 || ldy < PW * w->panels
        || nthreads < 1 || (T > 0 && (!x || !y)))
        return -1;
    if (T == 0) return 0;
#pragma omp parallel num_threads(nthreads)
    sd_linear_for(x, T, K, w, y, ldy);
    return 0;
}
