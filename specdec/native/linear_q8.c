/* Row-invariant linear layers over a GGUF's blocks with 8-bit activations (llama.cpp's way).
 *
 * Each row of x is rounded, per block of 32 inputs, to int8 with one fp32 scale:
 *   d = max|x| / 127,  q = round-half-even(x * (1 / d)) (0 where d == 0),  s = d * sum(q)
 * and each output element is a sum over blocks b, in ascending order, from 0, per the weight's
 * kernel format (kernels.h; dw, mw its scales):
 *   Q4_1, Q4_F, Q5_F (w = dw * qw + mw):  y += ((dw * d) * isum + mw * s)
 *   Q8_0 (w = dw * qw):                   y += (dw * d) * isum
 *   I8_F16 (dw0 for k 0-15, dw1 16-31):   y += ((dw0 * d) * isum0 + (dw1 * d) * isum1)
 *   Q4_K, Q5_K, Q6_K (super-blocks of 256 k): per sub-block of 32, Q4_F's / Q5_F's / I8_F16's,
 *   with dw, mw made from the super-block's d, dmin and integer sc, m as gguf-py makes them
 *   (below)
 * isum = sum_k qw_k * q_k over the block (I8_F16: isum0, isum1 over its halves), every
 * product and sum rounded as written (no fma), isum exact in int32. A row's result
 * depends only on that row, whatever shares the call (the contract of kernels.h), and a
 * pure-torch reference reproduces it bitwise (specdec/models/gguf/q8_activations.py, which says
 * why the activations of K-quants are blocked by 32 too). A weight in parts (kernels.h) calls
 * this once per part: each call rounds the rows again, to the same q, d and s.
 *
 * Why: the fp32 path (linear.c) is bound by dequantizing in registers at one row and by the
 * fp32 FMAs from 4 rows on (~2 ms of FMA per row of a SmolLM2 forward); here one vpmaddubsw does
 * 32 multiply-adds on 4-bit x 8-bit, so extra rows cost a fraction of that. The numerics are no
 * longer the fp32 model's (an activation's rounding error is <= 1/254 of its block's max).
 *
 * Weight layouts (one block of a panel pair: 16 output rows x 32 k; q8_activations.prepare):
 * the scales (fp16 d[16], m[16] for Q4_1, d[16] for Q8_0; fp32 d[16], m[16] for Q4_F, Q5_F;
 * fp32 d[16] of k 0-15 then d[16] of k 16-31 for I8_F16), then the quants at qoff:
 *   4-bit (Q4_1, Q4_F): 8 chunks c of 32 bytes: byte 4r + j holds q[row r][k = 4c + j] in its
 *        low nibble and q[row 8 + r][4c + j] in its high nibble.
 *   8-bit (Q8_0, I8_F16: int8; Q5_F: 0..31): 16 chunks (c, p) of 32 bytes at qoff + 64c + 32p:
 *        byte 4r + j is q[row 8p + r][4c + j].
 * So one 32-byte load is 8 output rows x 4 k, and a row of x broadcast 4 bytes at a time
 * meets it lane by lane (vpmaddubsw: unsigned weights x signed activations).
 */
#define _GNU_SOURCE /* syscall() under -std=c11 */
#include <cpuid.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define TILE 4 /* rows of x per tile: 2 * TILE accumulators + weights + constants in registers */
#ifndef AHEAD
#define AHEAD 32 /* blocks prefetched ahead of the one in use (the first panel's pass) */
#endif

/* one row of x -> q [K] int8, d and s [K / 32] */
AVX2 static void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* s) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < K / SD_QBLOCK; b++) {
        const float* p = x + b * SD_QBLOCK;
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(p + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
        const float dd = _mm_cvtss_f32(m) / 127.0f;
        const __m256 id = _mm256_set1_ps(dd != 0.0f ? 1.0f / dd : 0.0f);
        __m256i iv[4], sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], id),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            r = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
            iv[i] = _mm256_cvttps_epi32(r);
            sum = _mm256_add_epi32(sum, iv[i]);
        }
        const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]),
                                             _mm256_packs_epi32(iv[2], iv[3]));
        _mm256_storeu_si256((__m256i*)(q + b * SD_QBLOCK), _mm256_permutevar8x32_epi32(w, order));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
        d[b] = dd;
        s[b] = dd * (float)_mm_cvtsi128_si32(t);
    }
}

#define A4(r) _mm256_set1_epi32(*(const int32_t*)(q + (r) * K + k))
#define EACH1(F) F(0)
#define EACH2(F) F(0) F(1)
#define EACH3(F) F(0) F(1) F(2)
#define EACH4(F) F(0) F(1) F(2) F(3)

/* A block's scales, per panel P of the pair (8 rows): fp16 (Q4_1, Q8_0: d[16] then m[16]) or
 * fp32 (Q4_F, Q5_F: d[16] then m[16]; I8_F16: d[16] of k 0-15, then d[16] of k 16-31) */
#define F16_D(b, P) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((b) + 16 * (P))))
#define F16_M(b, P) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((b) + 32 + 16 * (P))))
#define F32_D(b, P) _mm256_loadu_ps((const float*)(b) + 8 * (P))
#define F32_M(b, P) _mm256_loadu_ps((const float*)(b) + 16 + 8 * (P))
#define NO_SCALE(b, P) _mm256_setzero_ps()

/* R rows of quantized x (q: row stride K; d, s: row stride nb) over all nb blocks of one panel
 * (P: 0 or 1) of a pair -> 8 columns of each y row. One panel at a time keeps every row's fp32
 * sum and integer block sum in registers across the blocks (2R + 3 of the 16 ymm; I8_F16 3R).
 *
 * Each kernel exists per instruction set (its name's suffix, its target attribute), chosen at
 * run time (sd_q8_isa). They differ only in how a block's integer sum isum is formed, and isum
 * is exact in all of them, so every instruction set gives bitwise the same y:
 *   avx2: vpmaddubsw adds pairs of products into int16, vpmaddwd widens to int32 (4-bit
 *         quants: once a block; 8-bit ones: every step, since two steps could overflow int16);
 *   vnni: vpdpbusd adds four products into int32 in one instruction (AVX-VNNI): one
 *         instruction per row and step instead of two (4-bit) or three (8-bit);
 *   512:  AVX512-VNNI, both panels of a pair at once, up to 8 rows a tile (below);
 *   amx:  AMX-INT8 tile products, from 9 to 16 rows by format (below; fewer rows and I8_F16
 *         run the 512 kernels). */
#define INIT(r) __m256 f##r = _mm256_setzero_ps();
#define STORE(r) _mm256_storeu_ps(y + (r) * ldy, f##r);
#define IZERO(r) __m256i i##r = _mm256_setzero_si256();
#define DX(r) _mm256_set1_ps(d[(r) * nb + j])
#define SX(r) _mm256_set1_ps(s[(r) * nb + j])
/* the fp32 finish of a block, every operation rounded as written (linear_q8.c's header) */
#define FIN_AFFINE(r, ISUM)                                                                    \
    f##r = _mm256_add_ps(f##r, _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(dw, DX(r)),          \
                                                           _mm256_cvtepi32_ps(ISUM)),          \
                                             _mm256_mul_ps(mw, SX(r))));
#define FIN_SCALE(r)                                                                           \
    f##r = _mm256_add_ps(f##r, _mm256_mul_ps(_mm256_mul_ps(dw, DX(r)), _mm256_cvtepi32_ps(i##r)));
/* I8_F16: the first half's term t (k 0-15, scale dw0), then t + the second half's */
#define HALF_LO(r) t##r = _mm256_mul_ps(_mm256_mul_ps(dw0, DX(r)), _mm256_cvtepi32_ps(i##r));  \
    i##r = _mm256_setzero_si256();
#define FIN_HALVES(r)                                                                          \
    f##r = _mm256_add_ps(f##r, _mm256_add_ps(t##r, _mm256_mul_ps(_mm256_mul_ps(dw, DX(r)),    \
                                                                 _mm256_cvtepi32_ps(i##r))));
#define TDECL(r) __m256 t##r = _mm256_setzero_ps(); (void)t##r;

/* 4-bit quants (Q4_1, Q4_F): per step, a chunk's nibbles of this panel x 4 bytes of a row */
#define NIB_ROW_avx2(r) i##r = _mm256_add_epi16(i##r, _mm256_maddubs_epi16(w, A4(r)));
#define NIB_ISUM_avx2(r) _mm256_madd_epi16(i##r, ones)
#define NIB_ROW_vnni(r) i##r = DPBUSD(i##r, w, A4(r));
#define NIB_ISUM_vnni(r) i##r
#define NIB_FIN_avx2(r) FIN_AFFINE(r, NIB_ISUM_avx2(r))
#define NIB_FIN_vnni(r) FIN_AFFINE(r, NIB_ISUM_vnni(r))
#define NIB_KERNEL(NAME, BYTES, QOFF, LD, LM, R, EACH, ISA, SUF, ATTR)                         \
    ATTR static void NAME##_q8_r##R##SUF(const int8_t* q, const float* d, const float* s,     \
                                         int64_t K, int64_t nb, const uint8_t* b, int P,      \
                                         float* y, int64_t ldy) {                             \
        const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);                 \
        (void)ones;                                                                            \
        EACH(INIT)                                                                             \
        for (int64_t j = 0; j < nb; j++, b += BYTES) {                                         \
            if (P == 0)                                                                        \
                for (int o = 0; o < BYTES; o += 64)                                            \
                    _mm_prefetch((const char*)b + AHEAD * BYTES + o, SD_STREAM_HINT);             \
            EACH(IZERO)                                                                        \
            /* 8 steps of <= 2 * 15 * 127 per int16 lane (avx2): <= 30480, no overflow */      \
            for (int c = 0; c < 8; c++) {                                                      \
                const __m256i raw = _mm256_loadu_si256((const __m256i*)(b + QOFF + 32 * c));   \
                const __m256i w = _mm256_and_si256(P ? _mm256_srli_epi16(raw, 4) : raw, low);  \
                const int64_t k = j * SD_QBLOCK + 4 * c;                                       \
                EACH(NIB_ROW_##ISA)                                                            \
            }                                                                                  \
            const __m256 dw = LD(b, P), mw = LM(b, P);                                         \
            EACH(NIB_FIN_##ISA)                                                                \
        }                                                                                      \
        EACH(STORE)                                                                            \
    }

/* 8-bit quants (Q8_0, I8_F16: signed, as |w| (unsigned) x sign(x, w) (signed); Q5_F: 0..31,
 * unsigned as they are), per step a chunk of this panel's 8 rows x 4 bytes of a row */
#define S8_ROW_avx2(r)                                                                        \
    i##r = _mm256_add_epi32(                                                                   \
        i##r, _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(A4(r), w)), ones));
#define S8_ROW_vnni(r) i##r = DPBUSD(i##r, u, _mm256_sign_epi8(A4(r), w));
#define U8_ROW_avx2(r)                                                                        \
    i##r = _mm256_add_epi32(i##r, _mm256_madd_epi16(_mm256_maddubs_epi16(w, A4(r)), ones));
#define U8_ROW_vnni(r) i##r = DPBUSD(i##r, w, A4(r));
#define NOTHING(r)
#define AFFINE_I(r) FIN_AFFINE(r, i##r)
/* ROW: S8 / U8; LO: what happens after the first half of the steps (I8_F16: HALF_LO, with the
 * scale LD0); FIN: the block's fp32 finish, with the scales LD (dw) and LM (mw) */
#define BYTE_KERNEL(NAME, BYTES, QOFF, LD0, LD, LM, ROW, LO, FIN, R, EACH, ISA, SUF, ATTR)     \
    ATTR static void NAME##_q8_r##R##SUF(const int8_t* q, const float* d, const float* s,     \
                                         int64_t K, int64_t nb, const uint8_t* b, int P,      \
                                         float* y, int64_t ldy) {                             \
        (void)s;                                                                               \
        const __m256i ones = _mm256_set1_epi16(1);                                             \
        (void)ones;                                                                            \
        EACH(INIT)                                                                             \
        for (int64_t j = 0; j < nb; j++, b += BYTES) {                                         \
            if (P == 0)                                                                        \
                for (int o = 0; o < BYTES; o += 64)                                            \
                    _mm_prefetch((const char*)b + AHEAD * BYTES + o, SD_STREAM_HINT);             \
            EACH(IZERO)                                                                        \
            EACH(TDECL)                                                                        \
            const __m256 dw0 = LD0(b, P);                                                      \
            (void)dw0;                                                                         \
            for (int c = 0; c < 8; c++) {                                                      \
                if (c == 4) { EACH(LO) }                                                       \
                const __m256i w = _mm256_loadu_si256((const __m256i*)(b + QOFF + 64 * c + 32 * P)); \
                const __m256i u = _mm256_abs_epi8(w);                                          \
                (void)u;                                                                       \
                const int64_t k = j * SD_QBLOCK + 4 * c;                                       \
                EACH(ROW##_ROW_##ISA)                                                          \
            }                                                                                  \
            const __m256 dw = LD(b, P), mw = LM(b, P);                                         \
            (void)mw;                                                                          \
            EACH(FIN)                                                                          \
        }                                                                                      \
        EACH(STORE)                                                                            \
    }

typedef void (*q8_fn)(const int8_t*, const float*, const float*, int64_t, int64_t,
                      const uint8_t*, int, float*, int64_t);

/* every format at 1..TILE rows for one instruction set */
#define KERNELS(ISA, SUF, ATTR)                                                                \
    NIB_KERNEL(q4_1, SD_Q4_1_PAIR_BYTES, 64, F16_D, F16_M, 1, EACH1, ISA, SUF, ATTR)           \
    NIB_KERNEL(q4_1, SD_Q4_1_PAIR_BYTES, 64, F16_D, F16_M, 2, EACH2, ISA, SUF, ATTR)           \
    NIB_KERNEL(q4_1, SD_Q4_1_PAIR_BYTES, 64, F16_D, F16_M, 3, EACH3, ISA, SUF, ATTR)           \
    NIB_KERNEL(q4_1, SD_Q4_1_PAIR_BYTES, 64, F16_D, F16_M, 4, EACH4, ISA, SUF, ATTR)           \
    NIB_KERNEL(q4_f, SD_Q4_F_PAIR_BYTES, 128, F32_D, F32_M, 1, EACH1, ISA, SUF, ATTR)          \
    NIB_KERNEL(q4_f, SD_Q4_F_PAIR_BYTES, 128, F32_D, F32_M, 2, EACH2, ISA, SUF, ATTR)          \
    NIB_KERNEL(q4_f, SD_Q4_F_PAIR_BYTES, 128, F32_D, F32_M, 3, EACH3, ISA, SUF, ATTR)          \
    NIB_KERNEL(q4_f, SD_Q4_F_PAIR_BYTES, 128, F32_D, F32_M, 4, EACH4, ISA, SUF, ATTR)          \
    Q8_0_K(1, EACH1, ISA, SUF, ATTR) Q8_0_K(2, EACH2, ISA, SUF, ATTR)                          \
    Q8_0_K(3, EACH3, ISA, SUF, ATTR) Q8_0_K(4, EACH4, ISA, SUF, ATTR)                          \
    Q5_F_K(1, EACH1, ISA, SUF, ATTR) Q5_F_K(2, EACH2, ISA, SUF, ATTR)                          \
    Q5_F_K(3, EACH3, ISA, SUF, ATTR) Q5_F_K(4, EACH4, ISA, SUF, ATTR)                          \
    I8_F16_K(1, EACH1, ISA, SUF, ATTR) I8_F16_K(2, EACH2, ISA, SUF, ATTR)                      \
    I8_F16_K(3, EACH3, ISA, SUF, ATTR) I8_F16_K(4, EACH4, ISA, SUF, ATTR)                      \
    Q4_K_KERNEL(1, EACH1, ISA, SUF, ATTR) Q4_K_KERNEL(2, EACH2, ISA, SUF, ATTR)                \
    Q4_K_KERNEL(3, EACH3, ISA, SUF, ATTR) Q4_K_KERNEL(4, EACH4, ISA, SUF, ATTR)                \
    Q6_K_KERNEL(1, EACH1, ISA, SUF, ATTR) Q6_K_KERNEL(2, EACH2, ISA, SUF, ATTR)                \
    Q6_K_KERNEL(3, EACH3, ISA, SUF, ATTR) Q6_K_KERNEL(4, EACH4, ISA, SUF, ATTR)                \
    Q5_K_KERNEL(1, EACH1, ISA, SUF, ATTR) Q5_K_KERNEL(2, EACH2, ISA, SUF, ATTR)                \
    Q5_K_KERNEL(3, EACH3, ISA, SUF, ATTR) Q5_K_KERNEL(4, EACH4, ISA, SUF, ATTR)
#define Q8_0_K(R, EACH, ISA, SUF, ATTR)                                                        \
    BYTE_KERNEL(q8_0, SD_Q8_0_PAIR_BYTES, 32, NO_SCALE, F16_D, NO_SCALE, S8, NOTHING,          \
                FIN_SCALE, R, EACH, ISA, SUF, ATTR)
#define Q5_F_K(R, EACH, ISA, SUF, ATTR)                                                        \
    BYTE_KERNEL(q5_f, SD_Q5_F_PAIR_BYTES, 128, NO_SCALE, F32_D, F32_M, U8, NOTHING,            \
                AFFINE_I, R, EACH, ISA, SUF, ATTR)
#define I8_F16_K(R, EACH, ISA, SUF, ATTR)                                                      \
    BYTE_KERNEL(i8_f16, SD_I8_F16_PAIR_BYTES, 128, F32_D, F32_M, NO_SCALE, S8, HALF_LO,        \
                FIN_HALVES, R, EACH, ISA, SUF, ATTR)

/* The super-block formats (Q4_K, Q5_K, Q6_K; kernels.h), per super-block of a pair: the header
 * (linear.c says where its scales are), then per sub-block j (32 k) the quants:
 *   Q4_K: 256 bytes as Q4_F's (the 4-bit chunks above).
 *   Q5_K: the low 4 bits of q as Q4_K's, then 64 bytes of 5th bits, byte t = 32p + 4r + j
 *         holding at bit c the bit of q[row 8p + r][k = 4c + j] (t: the byte of chunk c's
 *         64-byte vector of both panels, as the 512-bit kernel makes it; the 256-bit kernels
 *         read panel p's 32 bytes): a chunk's 5th bits are one shift and a mask to bit 4 of
 *         every byte, or-ed into the nibbles: q 0..31, one byte each, as Q5_F's.
 *   Q6_K: 384 bytes in chunks of 64 elements (c, p, r, j) = q[row 8p + r][k = 4c + j] (the
 *         order of a 512-bit chunk of I8_F16): 4 vectors of 64 bytes of the low 4 bits,
 *         vector u's byte t holding chunk u's element t (low nibble) and chunk u + 4's (high),
 *         then 2 vectors of 64 bytes of the high 2 bits, vector v's byte t holding chunk
 *         2f + v's element t at bits 2f (f = 0..3). A chunk's int8 q - 32 is then one or two
 *         shifts, two masks, an or and a subtraction (the 256-bit kernels: a panel's half).
 * Each sub-block is a block of Q4_F (Q5_K: of Q5_F; Q6_K: of I8_F16, q - 32 as its int8
 * quants) with its scales made in registers as gguf-py makes them (dw = fl(d * sc), mw = -fl(dmin * m); Q6_K:
 * dw0, dw = fl(d * sc) of its two halves): the same isum and the same fp32 finish, so bitwise
 * the result of the Q4_F / Q5_F / I8_F16 layout of the same file. KAHEAD super-blocks ahead are
 * prefetched, a sub-block's share of one at a time. */
#define KAHEAD 4
#define KPREFETCH(p, BYTES, jj)                                                                \
    for (int o = ((BYTES) * (jj) / 8) & ~63; o < (BYTES) * ((jj) + 1) / 8; o += 64)             \
        _mm_prefetch((const char*)(p) + KAHEAD * (BYTES) + o, SD_STREAM_HINT);
#define KSC_U8(p) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p))))
#define KSC_I8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p))))
/* the 5th bits of chunk c (bit c of each byte of h) at bit 4 of each byte (16-bit shifts: bit 4
 * of a byte comes from its own bit c either way) */
#define FIFTH(h, c, SLL, SRL) ((c) < 4 ? SLL(h, _mm_cvtsi32_si128(4 - (c)))                     \
                                       : SRL(h, _mm_cvtsi32_si128((c) - 4)))
/* Q4_K and Q5_K (FIVE: its 5th bits, chunk c's at bit c of each byte of the sub-block's
 * 5th-bit bytes, or-ed in at bit 4): ROW, FIN the row step and finish of Q4_F's kernel (Q4_K:
 * int16 pair sums) or Q5_F's (Q5_K: 0..31, int32 sums) */
#define KNIB_KERNEL(NAME, BYTES, HEAD, SUB, FIVE, ROW, FIN, R, EACH, ISA, SUF, ATTR)          \
    ATTR static void NAME##_q8_r##R##SUF(const int8_t* q, const float* d, const float* s,     \
                                         int64_t K, int64_t nb, const uint8_t* b, int P,      \
                                         float* y, int64_t ldy) {                             \
        const __m256i low = _mm256_set1_epi8(15), bit4 = _mm256_set1_epi8(16);                 \
        const __m256i ones = _mm256_set1_epi16(1);                                             \
        const __m256 sign = _mm256_set1_ps(-0.0f);                                             \
        (void)ones;                                                                            \
        (void)bit4;                                                                            \
        EACH(INIT)                                                                             \
        for (int64_t h = 0; h < nb / 8; h++, b += BYTES) {                                     \
            const __m256 dd = F16_D(b, P), dm = F16_M(b, P);                                   \
            for (int jj = 0; jj < 8; jj++) {                                                   \
                const int64_t j = 8 * h + jj;                                                  \
                if (P == 0) KPREFETCH(b, BYTES, jj)                                            \
                EACH(IZERO)                                                                    \
                const uint8_t* qb = b + HEAD + SUB * jj;                                       \
                const __m256i hv = FIVE ? _mm256_loadu_si256((const __m256i*)(qb + 256 + 32 * P)) \
                                        : _mm256_setzero_si256();                              \
                (void)hv;                                                                      \
                for (int c = 0; c < 8; c++) {                                                  \
                    const __m256i raw = _mm256_loadu_si256((const __m256i*)(qb + 32 * c));     \
                    __m256i w = _mm256_and_si256(P ? _mm256_srli_epi16(raw, 4) : raw, low);    \
                    if (FIVE)                                                                  \
                        w = _mm256_or_si256(                                                   \
                            w, _mm256_and_si256(FIFTH(hv, c, _mm256_sll_epi16, _mm256_srl_epi16), \
                                                bit4));                                        \
                    const int64_t k = j * SD_QBLOCK + 4 * c;                                   \
                    EACH(ROW##_##ISA)                                                          \
                }                                                                              \
                const __m256 dw = _mm256_mul_ps(dd, KSC_U8(b + 64 + 16 * jj + 8 * P));         \
                const __m256 mw = _mm256_xor_ps(                                               \
                    _mm256_mul_ps(dm, KSC_U8(b + 192 + 16 * jj + 8 * P)), sign);               \
                EACH(FIN##_##ISA)                                                              \
            }                                                                                  \
        }                                                                                      \
        EACH(STORE)                                                                            \
    }
#define AFFINE_I_avx2(r) AFFINE_I(r)
#define AFFINE_I_vnni(r) AFFINE_I(r)
#define Q4_K_KERNEL(R, EACH, ISA, SUF, ATTR)                                                   \
    KNIB_KERNEL(q4_k, SD_Q4_K_PAIR_BYTES, SD_Q4_K_HEAD, 256, 0, NIB_ROW, NIB_FIN, R, EACH,    \
                ISA, SUF, ATTR)
#define Q5_K_KERNEL(R, EACH, ISA, SUF, ATTR)                                                   \
    KNIB_KERNEL(q5_k, SD_Q5_K_PAIR_BYTES, SD_Q5_K_HEAD, SD_Q5_K_SUB, 1, U8_ROW, AFFINE_I, R,  \
                EACH, ISA, SUF, ATTR)
#define Q6_K_KERNEL(R, EACH, ISA, SUF, ATTR)                                                   \
    ATTR static void q6_k_q8_r##R##SUF(const int8_t* q, const float* d, const float* s,       \
                                       int64_t K, int64_t nb, const uint8_t* b, int P,        \
                                       float* y, int64_t ldy) {                               \
        (void)s;                                                                               \
        const __m256i low = _mm256_set1_epi8(15), high = _mm256_set1_epi8(48);                 \
        const __m256i off = _mm256_set1_epi8(32), ones = _mm256_set1_epi16(1);                 \
        (void)ones;                                                                            \
        EACH(INIT)                                                                             \
        for (int64_t h = 0; h < nb / 8; h++, b += SD_Q6_K_PAIR_BYTES) {                        \
            const __m256 dd = F16_D(b, P);                                                     \
            for (int jj = 0; jj < 8; jj++) {                                                   \
                const int64_t j = 8 * h + jj;                                                  \
                if (P == 0) KPREFETCH(b, SD_Q6_K_PAIR_BYTES, jj)                               \
                EACH(IZERO)                                                                    \
                EACH(TDECL)                                                                    \
                const uint8_t* sc = b + 32 + 32 * jj + 8 * P;                                  \
                const __m256 dw0 = _mm256_mul_ps(dd, KSC_I8(sc));                              \
                const __m256 dw = _mm256_mul_ps(dd, KSC_I8(sc + 16));                          \
                const uint8_t* qb = b + SD_Q6_K_HEAD + SD_Q6_K_SUB * jj;                       \
                for (int c = 0; c < 8; c++) {                                                  \
                    if (c == 4) { EACH(HALF_LO) }                                              \
                    const __m256i raw =                                                        \
                        _mm256_loadu_si256((const __m256i*)(qb + 64 * (c & 3) + 32 * P));      \
                    const __m256i hv = _mm256_loadu_si256(                                     \
                        (const __m256i*)(qb + 256 + 64 * (c & 1) + 32 * P));                   \
                    const int f = c >> 1; /* the field: bits 2f .. 2f + 1 to bits 4 .. 5 */    \
                    const __m256i hi = _mm256_and_si256(                                       \
                        f < 3 ? _mm256_sll_epi16(hv, _mm_cvtsi32_si128(4 - 2 * f))             \
                              : _mm256_srli_epi16(hv, 2),                                      \
                        high);                                                                 \
                    const __m256i w = _mm256_sub_epi8(                                         \
                        _mm256_or_si256(_mm256_and_si256(c >= 4 ? _mm256_srli_epi16(raw, 4)    \
                                                                : raw,                         \
                                                         low),                                 \
                                        hi),                                                   \
                        off);                                                                  \
                    const __m256i u = _mm256_abs_epi8(w);                                      \
                    const int64_t k = j * SD_QBLOCK + 4 * c;                                   \
                    EACH(S8_ROW_##ISA)                                                         \
                }                                                                              \
                EACH(FIN_HALVES)                                                               \
            }                                                                                  \
        }                                                                                      \
        EACH(STORE)                                                                            \
    }
#define TABLE_ROWS(NAME, SUF) {NAME##_q8_r1##SUF, NAME##_q8_r2##SUF, NAME##_q8_r3##SUF,        \
                               NAME##_q8_r4##SUF}
/* [format][rows - 1], by format code */
#define TABLE_OF(SUF)                                                                          \
    static const q8_fn TABLE##SUF[SD_NUM_FORMATS][TILE] = {                                    \
        [SD_Q4_1_Q8] = TABLE_ROWS(q4_1, SUF), [SD_Q8_0_Q8] = TABLE_ROWS(q8_0, SUF),            \
        [SD_Q4_F_Q8] = TABLE_ROWS(q4_f, SUF), [SD_Q5_F_Q8] = TABLE_ROWS(q5_f, SUF),            \
        [SD_I8_F16_Q8] = TABLE_ROWS(i8_f16, SUF), [SD_Q4_K_Q8] = TABLE_ROWS(q4_k, SUF),         \
        [SD_Q6_K_Q8] = TABLE_ROWS(q6_k, SUF), [SD_Q5_K_Q8] = TABLE_ROWS(q5_k, SUF)};

KERNELS(avx2, _avx2, AVX2)
TABLE_OF(_avx2)
/* AVX-VNNI needs gcc >= 11 or clang >= 12; an older compiler builds the others only */
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define SD_HAVE_AVXVNNI 1
#define DPBUSD _mm256_dpbusd_avx_epi32
KERNELS(vnni, _avxvnni, __attribute__((target("avx2,fma,f16c,avxvnni"))))
TABLE_OF(_avxvnni)
#undef DPBUSD
#else
#define SD_HAVE_AVXVNNI 0
#define TABLE_avxvnni TABLE_avx2
#endif

/* AVX512-VNNI: both panels of a pair in one 512-bit register (16 output rows x 4 k: panel 0's
 * rows in the low half, panel 1's in the high half), so one vpdpbusd serves 16 columns and y
 * gets 16 adjacent columns (panels 2p and 2p + 1) per row; every element's fp32 operations are
 * those of the 256-bit kernels, in the same order. Signed 8-bit weights (Q8_0, I8_F16) have no
 * 512-bit vpsignb: the rows come as unsigned bytes q + 128 (q ^ 0x80, made once per call) and
 * each block (I8_F16: half-block) subtracts 128 * sum(w) (one vpdpbusd of ones x w per step,
 * shared by the rows): sum (q + 128) w - 128 sum w = isum, exact (|sum (q + 128) w| <= 32 *
 * 255 * 128). One instruction per row and step, as for the unsigned weights (4-bit, Q5_F).
 * Tiles of up to 8 rows: 8 int32 + 8 fp32 accumulators of the 32 zmm, and each weight load
 * serves 8 rows (2026-12-03, Sapphire Rapids: an 8-row head call 1.17 -> 0.74 ms). */
#define INIT16(r) __m512 f##r = _mm512_setzero_ps();
#define STORE16(r) _mm512_storeu_ps(y + (r) * ldy, f##r);
#define IZERO16(r) __m512i i##r = _mm512_setzero_si512();
#define TDECL16(r) __m512 t##r = _mm512_setzero_ps(); (void)t##r;
#define A16(r) _mm512_set1_epi32(*(const int32_t*)(q + (r) * K + k))
#define DX16(r) _mm512_set1_ps(d[(r) * nb + j])
#define SX16(r) _mm512_set1_ps(s[(r) * nb + j])
#define H16_D(b) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(b)))
#define H16_M(b) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((b) + 32)))
#define G32_D(b) _mm512_loadu_ps((const float*)(b))
#define G32_M(b) _mm512_loadu_ps((const float*)(b) + 16)
#define NO_SCALE16(b) _mm512_setzero_ps()
#define U_ROW16(r) i##r = _mm512_dpbusd_epi32(i##r, w, A16(r));
#define S_ROW16(r) i##r = _mm512_dpbusd_epi32(i##r, A16(r), w);
#define FIX16(r) i##r = _mm512_sub_epi32(i##r, ws);
#define AFFINE16(r)                                                                            \
    f##r = _mm512_add_ps(f##r, _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(dw, DX16(r)),        \
                                                           _mm512_cvtepi32_ps(i##r)),          \
                                             _mm512_mul_ps(mw, SX16(r))));
#define SCALE16(r)                                                                             \
    f##r = _mm512_add_ps(f##r, _mm512_mul_ps(_mm512_mul_ps(dw, DX16(r)), _mm512_cvtepi32_ps(i##r)));
#define HALF_LO16(r) t##r = _mm512_mul_ps(_mm512_mul_ps(dw0, DX16(r)), _mm512_cvtepi32_ps(i##r)); \
    i##r = _mm512_setzero_si512();
#define HALVES16(r)                                                                            \
    f##r = _mm512_add_ps(f##r, _mm512_add_ps(t##r, _mm512_mul_ps(_mm512_mul_ps(dw, DX16(r)),  \
                                                                 _mm512_cvtepi32_ps(i##r))));
#define AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
/* 4-bit quants (Q4_1, Q4_F): chunk c's bytes, low nibbles (panel 0) then high ones (panel 1) */
#define NIB_KERNEL16(NAME, BYTES, QOFF, LD, LM, R, EACH)                                       \
    AVX512 static void NAME##_q8_r##R##_512(const int8_t* q, const float* d, const float* s,  \
                                            int64_t K, int64_t nb, const uint8_t* b,          \
                                            float* y, int64_t ldy) {                          \
        const __m512i low = _mm512_set1_epi8(15);                                              \
        EACH(INIT16)                                                                           \
        for (int64_t j = 0; j < nb; j++, b += BYTES) {                                         \
            for (int o = 0; o < BYTES; o += 64)                                                \
                _mm_prefetch((const char*)b + AHEAD * BYTES + o, SD_STREAM_HINT);                 \
            EACH(IZERO16)                                                                      \
            for (int c = 0; c < 8; c++) {                                                      \
                const __m256i raw = _mm256_loadu_si256((const __m256i*)(b + QOFF + 32 * c));   \
                const __m512i w = _mm512_and_si512(                                            \
                    _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1), \
                    low);                                                                      \
                const int64_t k = j * SD_QBLOCK + 4 * c;                                       \
                EACH(U_ROW16)                                                                  \
            }                                                                                  \
            const __m512 dw = LD(b), mw = LM(b);                                               \
            EACH(AFFINE16)                                                                     \
        }                                                                                      \
        EACH(STORE16)                                                                          \
    }
/* 8-bit quants: chunk c's 64 bytes (both panels). SIGNED: the rows are q + 128 and each
 * (half-)block subtracts 128 * sum(w); LO / LD0: I8_F16's first half (as in BYTE_KERNEL) */
#define BYTE_KERNEL16(NAME, BYTES, QOFF, SIGNED, LD0, LD, LM, ROW, LO, FIN, R, EACH)          \
    AVX512 static void NAME##_q8_r##R##_512(const int8_t* q, const float* d, const float* s,  \
                                            int64_t K, int64_t nb, const uint8_t* b,          \
                                            float* y, int64_t ldy) {                          \
        (void)s;                                                                               \
        const __m512i ones = _mm512_set1_epi8(1);                                              \
        EACH(INIT16)                                                                           \
        for (int64_t j = 0; j < nb; j++, b += BYTES) {                                         \
            for (int o = 0; o < BYTES; o += 64)                                                \
                _mm_prefetch((const char*)b + AHEAD * BYTES + o, SD_STREAM_HINT);                 \
            EACH(IZERO16)                                                                      \
            EACH(TDECL16)                                                                      \
            const __m512 dw0 = LD0(b);                                                         \
            (void)dw0;                                                                         \
            __m512i ws = _mm512_setzero_si512();                                               \
            for (int c = 0; c < 8; c++) {                                                      \
                if (c == 4) { LO(EACH) }                                                       \
                const __m512i w = _mm512_loadu_si512((const void*)(b + QOFF + 64 * c));        \
                if (SIGNED) ws = _mm512_dpbusd_epi32(ws, ones, w);                             \
                const int64_t k = j * SD_QBLOCK + 4 * c;                                       \
                EACH(ROW)                                                                      \
            }                                                                                  \
            if (SIGNED) {                                                                      \
                ws = _mm512_slli_epi32(ws, 7);                                                 \
                EACH(FIX16)                                                                    \
            }                                                                                  \
            const __m512 dw = LD(b), mw = LM(b);                                               \
            (void)mw;                                                                          \
            EACH(FIN)                                                                          \
        }                                                                                      \
        EACH(STORE16)                                                                          \
    }
#define NO_LO(EACH)
/* I8_F16 after its first half: fix the sums, their term t, and start the second half */
#define I8_LO(EACH)                                                                            \
    ws = _mm512_slli_epi32(ws, 7);                                                             \
    EACH(FIX16) EACH(HALF_LO16) ws = _mm512_setzero_si512();
typedef void (*q8_pair_fn)(const int8_t*, const float*, const float*, int64_t, int64_t,
                           const uint8_t*, float*, int64_t);
#define EACH5(F) EACH4(F) F(4)
#define EACH6(F) EACH5(F) F(5)
#define EACH7(F) EACH6(F) F(6)
#define EACH8(F) EACH7(F) F(7)
#define TILE512 8 /* rows per tile of the 512 kernels: 2 * 8 accumulators of the 32 zmm */
#define FORMAT16(R, EACH)                                                                      \
    NIB_KERNEL16(q4_1, SD_Q4_1_PAIR_BYTES, 64, H16_D, H16_M, R, EACH)                          \
    NIB_KERNEL16(q4_f, SD_Q4_F_PAIR_BYTES, 128, G32_D, G32_M, R, EACH)                         \
    BYTE_KERNEL16(q8_0, SD_Q8_0_PAIR_BYTES, 32, 1, NO_SCALE16, H16_D, NO_SCALE16, S_ROW16,     \
                  NO_LO, SCALE16, R, EACH)                                                     \
    BYTE_KERNEL16(q5_f, SD_Q5_F_PAIR_BYTES, 128, 0, NO_SCALE16, G32_D, G32_M, U_ROW16, NO_LO,  \
                  AFFINE16, R, EACH)                                                           \
    BYTE_KERNEL16(i8_f16, SD_I8_F16_PAIR_BYTES, 128, 1, G32_D, G32_M, NO_SCALE16, S_ROW16,     \
                  I8_LO, HALVES16, R, EACH)
/* the super-block formats (above), both panels at once: Q4_K as Q4_F's kernel, Q6_K as
 * I8_F16's (signed: the rows q + 128, 128 * sum(w) subtracted per half), their scales made per
 * sub-block as the 256-bit kernels make them */
#define KSC_U8_16(p) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p))))
#define KSC_I8_16(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p))))
#define NEG16(v) _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v),                  \
                                                      _mm512_set1_epi32((int)0x80000000)))
/* Q4_K and Q5_K (FIVE: the chunk's 5th bits or-ed in, one ternary-logic op: lo | (h & 16)) */
#define KNIB_KERNEL16(NAME, BYTES, HEAD, SUB, FIVE, R, EACH)                                   \
    AVX512 static void NAME##_q8_r##R##_512(const int8_t* q, const float* d, const float* s,  \
                                            int64_t K, int64_t nb, const uint8_t* b,          \
                                            float* y, int64_t ldy) {                          \
        const __m512i low = _mm512_set1_epi8(15), bit4 = _mm512_set1_epi8(16);                 \
        (void)bit4;                                                                            \
        EACH(INIT16)                                                                           \
        for (int64_t h = 0; h < nb / 8; h++, b += BYTES) {                                     \
            const __m512 dd = H16_D(b), dm = H16_M(b);                                         \
            for (int jj = 0; jj < 8; jj++) {                                                   \
                const int64_t j = 8 * h + jj;                                                  \
                KPREFETCH(b, BYTES, jj)                                                        \
                EACH(IZERO16)                                                                  \
                const uint8_t* qb = b + HEAD + SUB * jj;                                       \
                const __m512i hv = FIVE ? _mm512_loadu_si512((const void*)(qb + 256))          \
                                        : _mm512_setzero_si512();                              \
                (void)hv;                                                                      \
                for (int c = 0; c < 8; c++) {                                                  \
                    const __m256i raw = _mm256_loadu_si256((const __m256i*)(qb + 32 * c));     \
                    __m512i w = _mm512_and_si512(                                              \
                        _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), \
                                           1),                                                 \
                        low);                                                                  \
                    if (FIVE)                                                                  \
                        w = _mm512_ternarylogic_epi32(                                         \
                            w, FIFTH(hv, c, _mm512_sll_epi16, _mm512_srl_epi16), bit4, 0xF8);  \
                    const int64_t k = j * SD_QBLOCK + 4 * c;                                   \
                    EACH(U_ROW16)                                                              \
                }                                                                              \
                const __m512 dw = _mm512_mul_ps(dd, KSC_U8_16(b + 64 + 16 * jj));              \
                const __m512 mw = NEG16(_mm512_mul_ps(dm, KSC_U8_16(b + 192 + 16 * jj)));      \
                EACH(AFFINE16)                                                                 \
            }                                                                                  \
        }                                                                                      \
        EACH(STORE16)                                                                          \
    }
#define Q4_K_KERNEL16(R, EACH)                                                                 \
    KNIB_KERNEL16(q4_k, SD_Q4_K_PAIR_BYTES, SD_Q4_K_HEAD, 256, 0, R, EACH)
#define Q5_K_KERNEL16(R, EACH)                                                                 \
    KNIB_KERNEL16(q5_k, SD_Q5_K_PAIR_BYTES, SD_Q5_K_HEAD, SD_Q5_K_SUB, 1, R, EACH)
#define Q6_K_KERNEL16(R, EACH)                                                                 \
    AVX512 static void q6_k_q8_r##R##_512(const int8_t* q, const float* d, const float* s,    \
                                          int64_t K, int64_t nb, const uint8_t* b, float* y,  \
                                          int64_t ldy) {                                      \
        (void)s;                                                                               \
        const __m512i ones = _mm512_set1_epi8(1), low = _mm512_set1_epi8(15);                  \
        const __m512i high = _mm512_set1_epi8(48), off = _mm512_set1_epi8(32);                 \
        EACH(INIT16)                                                                           \
        for (int64_t h = 0; h < nb / 8; h++, b += SD_Q6_K_PAIR_BYTES) {                        \
            const __m512 dd = H16_D(b);                                                        \
            for (int jj = 0; jj < 8; jj++) {                                                   \
                const int64_t j = 8 * h + jj;                                                  \
                KPREFETCH(b, SD_Q6_K_PAIR_BYTES, jj)                                           \
                EACH(IZERO16)                                                                  \
                EACH(TDECL16)                                                                  \
                const __m512 dw0 = _mm512_mul_ps(dd, KSC_I8_16(b + 32 + 32 * jj));             \
                const __m512 dw = _mm512_mul_ps(dd, KSC_I8_16(b + 48 + 32 * jj));              \
                __m512i ws = _mm512_setzero_si512();                                           \
                const uint8_t* qb = b + SD_Q6_K_HEAD + SD_Q6_K_SUB * jj;                       \
                for (int c = 0; c < 8; c++) {                                                  \
                    if (c == 4) { I8_LO(EACH) }                                                \
                    const __m512i raw = _mm512_loadu_si512((const void*)(qb + 64 * (c & 3)));  \
                    const __m512i hv =                                                         \
                        _mm512_loadu_si512((const void*)(qb + 256 + 64 * (c & 1)));            \
                    const int f = c >> 1; /* the field: bits 2f .. 2f + 1 to bits 4 .. 5 */    \
                    const __m512i lo =                                                         \
                        _mm512_and_si512(c >= 4 ? _mm512_srli_epi16(raw, 4) : raw, low);      \
                    const __m512i hi = _mm512_and_si512(                                       \
                        f < 3 ? _mm512_sll_epi16(hv, _mm_cvtsi32_si128(4 - 2 * f))             \
                              : _mm512_srli_epi16(hv, 2),                                      \
                        high);                                                                 \
                    const __m512i w = _mm512_sub_epi8(_mm512_or_si512(lo, hi), off);           \
                    ws = _mm512_dpbusd_epi32(ws, ones, w);                                     \
                    const int64_t k = j * SD_QBLOCK + 4 * c;                                   \
                    EACH(S_ROW16)                                                              \
                }                                                                              \
                ws = _mm512_slli_epi32(ws, 7);                                                 \
                EACH(FIX16)                                                                    \
                EACH(HALVES16)                                                                 \
            }                                                                                  \
        }                                                                                      \
        EACH(STORE16)                                                                          \
    }
#define KFORMAT16(R, EACH) Q4_K_KERNEL16(R, EACH) Q6_K_KERNEL16(R, EACH) Q5_K_KERNEL16(R, EACH)
KFORMAT16(1, EACH1) KFORMAT16(2, EACH2) KFORMAT16(3, EACH3) KFORMAT16(4, EACH4)
KFORMAT16(5, EACH5) KFORMAT16(6, EACH6) KFORMAT16(7, EACH7) KFORMAT16(8, EACH8)
FORMAT16(1, EACH1) FORMAT16(2, EACH2) FORMAT16(3, EACH3) FORMAT16(4, EACH4)
FORMAT16(5, EACH5) FORMAT16(6, EACH6) FORMAT16(7, EACH7) FORMAT16(8, EACH8)
#define ROWS8(NAME) {NAME##_q8_r1_512, NAME##_q8_r2_512, NAME##_q8_r3_512, NAME##_q8_r4_512,     \
                     NAME##_q8_r5_512, NAME##_q8_r6_512, NAME##_q8_r7_512, NAME##_q8_r8_512}
static const q8_pair_fn TABLE_512[SD_NUM_FORMATS][TILE512] = {
    [SD_Q4_1_Q8] = ROWS8(q4_1), [SD_Q8_0_Q8] = ROWS8(q8_0), [SD_Q4_F_Q8] = ROWS8(q4_f),
    [SD_Q5_F_Q8] = ROWS8(q5_f), [SD_I8_F16_Q8] = ROWS8(i8_f16), [SD_Q4_K_Q8] = ROWS8(q4_k),
    [SD_Q6_K_Q8] = ROWS8(q6_k), [SD_Q5_K_Q8] = ROWS8(q5_k)};

/* T rows as tiles of at most `most` rows, as even as possible: tile i has
 * base + (i < extra) rows (no tiles for T == 0) */
typedef struct {
    int64_t tiles, base, extra;
} row_tiles;

static row_tiles split_rows(int64_t T, int64_t most) {
    const int64_t tiles = (T + most - 1) / most;
    return (row_tiles){tiles, tiles ? T / tiles : 0, tiles ? T % tiles : 0};
}

/* How AMX gets a block's weights as the bytes of its B tile (VNNI layout, [8][64]: row c =
 * outputs 0..15 x k 4c..4c+3): AMX_STORED: the 8-bit formats' quants as stored (at qoff +
 * 64c); AMX_NIBBLES: Q4_1's / Q4_F's 4-bit chunks to bytes; AMX_Q4_K, AMX_Q5_K, AMX_Q6_K: a
 * sub-block's quants made as the 512 kernels make them. AMX_NONE: no AMX kernel (I8_F16). */
enum { AMX_NONE, AMX_STORED, AMX_NIBBLES, AMX_Q4_K, AMX_Q5_K, AMX_Q6_K };
/* how a block's (sub-block's) fp32 finish goes: AFFINE16, SCALE16, HALVES16 */
enum { FIN_AFFINE16, FIN_SCALE16, FIN_HALVES16 };

/* what the drivers need to know of a format: its pair block's bytes, where its quants start,
 * its weights signed, its scales fp32 (else fp16), its block finish, and for AMX how its
 * weights become bytes and from how many rows AMX runs it (fewer: the 512 kernels) */
typedef struct {
    int64_t bytes, qoff;
    int signed_w, f32, finish, amx, amx_rows;
} q8_format;
static const q8_format Q8_FORMATS[SD_NUM_FORMATS] = {
    /* from 16 rows (issue 31, measured for Q4_1 and Q8_0: where AMX starts to win) */
    [SD_Q4_1_Q8] = {SD_Q4_1_PAIR_BYTES, 64, 0, 0, FIN_AFFINE16, AMX_NIBBLES, 16},
    [SD_Q8_0_Q8] = {SD_Q8_0_PAIR_BYTES, 32, 1, 0, FIN_SCALE16, AMX_STORED, 16},
    [SD_Q4_F_Q8] = {SD_Q4_F_PAIR_BYTES, 128, 0, 1, FIN_AFFINE16, AMX_NIBBLES, 16},
    [SD_Q5_F_Q8] = {SD_Q5_F_PAIR_BYTES, 128, 0, 1, FIN_AFFINE16, AMX_STORED, 16},
    [SD_I8_F16_Q8] = {SD_I8_F16_PAIR_BYTES, 128, 1, 1, FIN_HALVES16, AMX_NONE, 0},
    /* the super-block formats: bytes per block of 32 k on average (a pair's super-block is 8
     * of them, one AMX run); their scales are made per sub-block (amx_scales). From where AMX
     * wins (2026-12-04, Sapphire Rapids, 2 threads, 12 matrices in turn so the weights stream
     * from memory, docs/bench/q8_rows_streamed.py; time AMX / AVX-512, fastest of 10, at 8, 9,
     * 10, 11, 12, 16, 32 rows, 8192x2048 / 2048x8192):
     *   Q4_K 1.18 1.00 0.99 0.95 0.95 0.86 0.83 / 1.19 0.97 1.01 0.97 0.97 0.90 0.81: from 11;
     *   Q5_K 1.14 0.87 0.90 0.89 0.88 0.80 0.76 / 1.15 0.89 0.91 0.91 0.93 0.87 0.75: from 9;
     *   Q6_K 1.21 0.91 0.88 0.87 0.85 0.81 0.72 / 1.12 0.88 0.84 0.87 0.86 0.80 0.74: from 9
     * (from 9 rows the 512 kernels take two tiles, unpacking the weights twice; at 8 one pass
     * of theirs beats the tile products and the sums' trip through memory; Q4_K's unpacking
     * is the cheapest of the three) */
    [SD_Q4_K_Q8] = {SD_Q4_K_PAIR_BYTES / 8, SD_Q4_K_HEAD, 0, 0, FIN_AFFINE16, AMX_Q4_K, 11},
    [SD_Q6_K_Q8] = {SD_Q6_K_PAIR_BYTES / 8, SD_Q6_K_HEAD, 1, 0, FIN_HALVES16, AMX_Q6_K, 9},
    [SD_Q5_K_Q8] = {SD_Q5_K_PAIR_BYTES / 8, SD_Q5_K_HEAD, 0, 0, FIN_AFFINE16, AMX_Q5_K, 9}};

/* AMX-INT8 (Sapphire Rapids and later): a block's integer sums for up to 16 rows and both
 * panels of a pair in one tile multiply. A = the rows' quants of the block [M rows][32 bytes]
 * (row stride K), B = the block's weights as bytes in the VNNI layout (amx_weights), C [M][16]
 * int32 = isum, exact like every other kernel's: TDPBSSD (signed x signed) for signed weights,
 * TDPBSUD (signed x unsigned) for unsigned ones. Q6_K's two scales a sub-block: two products
 * of 16 k each (A [M][16 bytes], B [4][64]), its halves' sums; the 512 kernel's q + 128 rows
 * less 128 * sum(w) are the same integers. Per run of AMX_CHUNK blocks (a super-block of the
 * K formats) the weights become bytes and the scales are made once, for every row tile; the
 * tiles' sums go to memory, then each row's fp32 finish runs over the run's blocks in
 * ascending order with exactly the 512 kernel's operations (AFFINE16 / SCALE16 / HALVES16),
 * accumulated in f (from +0.0, as the 512 kernels' f). */
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define SD_HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#define AMX __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,amx-tile,amx-int8")))
#define AMX_CHUNK 8 /* blocks whose sums are stored before the rows' fp32 finish */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg;

/* k bytes per tile product: 32 (a block), Q6_K 16 (a half) */
static int amx_kbytes(const q8_format* fm) { return fm->amx == AMX_Q6_K ? 16 : 32; }

/* tiles 0..3: C [M][64 bytes]; 4, 5: A [M][kb bytes]; 6, 7: B [kb / 4][64 bytes] */
AMX static void amx_configure(int M, int kb) {
    amx_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 4; i++) c.rows[i] = (uint8_t)M, c.colsb[i] = 64;
    for (int i = 4; i < 6; i++) c.rows[i] = (uint8_t)M, c.colsb[i] = (uint16_t)kb;
    for (int i = 6; i < 8; i++) c.rows[i] = (uint8_t)(kb / 4), c.colsb[i] = 64;
    /* asm with the whole struct as its operand: gcc 12 drops the stores before a bare
     * _tile_loadconfig(&c), which it does not see reading them */
    __asm__ volatile("ldtilecfg %0" : : "m"(c));
}

AMX static void amx_release(void) { _tile_release(); }

/* 4-bit chunks (Q4_1, Q4_F, Q4_K's sub-block: 8 x 32 bytes at p) -> bytes, as NIB_KERNEL16 */
AMX static void amx_nibbles(const uint8_t* p, uint8_t w[8][64]) {
    const __m512i low = _mm512_set1_epi8(15);
    for (int c = 0; c < 8; c++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(p + 32 * c));
        _mm512_store_si512((void*)w[c], _mm512_and_si512(_mm512_inserti64x4(
            _mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1), low));
    }
}

/* Q5_K's sub-block at qb: the nibbles | its 5th bits at bit 4, as Q5_K_KERNEL16 */
AMX static void amx_q5_k(const uint8_t* qb, uint8_t w[8][64]) {
    const __m512i low = _mm512_set1_epi8(15), bit4 = _mm512_set1_epi8(16);
    const __m512i hv = _mm512_loadu_si512((const void*)(qb + 256));
    for (int c = 0; c < 8; c++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(qb + 32 * c));
        const __m512i lo = _mm512_and_si512(
            _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1), low);
        _mm512_store_si512((void*)w[c], _mm512_ternarylogic_epi32(
            lo, FIFTH(hv, c, _mm512_sll_epi16, _mm512_srl_epi16), bit4, 0xF8));
    }
}

/* Q6_K's sub-block at qb: int8 q - 32, as Q6_K_KERNEL16 (chunks 0..3: k 0-15, 4..7: 16-31) */
AMX static void amx_q6_k(const uint8_t* qb, uint8_t w[8][64]) {
    const __m512i low = _mm512_set1_epi8(15), high = _mm512_set1_epi8(48);
    const __m512i off = _mm512_set1_epi8(32);
    for (int c = 0; c < 8; c++) {
        const __m512i raw = _mm512_loadu_si512((const void*)(qb + 64 * (c & 3)));
        const __m512i hv = _mm512_loadu_si512((const void*)(qb + 256 + 64 * (c & 1)));
        const int f = c >> 1; /* the field: bits 2f .. 2f + 1 to bits 4 .. 5 */
        const __m512i lo = _mm512_and_si512(c >= 4 ? _mm512_srli_epi16(raw, 4) : raw, low);
        const __m512i hi = _mm512_and_si512(
            f < 3 ? _mm512_sll_epi16(hv, _mm_cvtsi32_si128(4 - 2 * f)) : _mm512_srli_epi16(hv, 2),
            high);
        _mm512_store_si512((void*)w[c], _mm512_sub_epi8(_mm512_or_si512(lo, hi), off));
    }
}

/* the K formats: sub-block jj's quants in the super-block at run, after its header (qoff) */
static const uint8_t* k_sub_block(const q8_format* fm, const uint8_t* run, int jj) {
    return run + fm->qoff + (8 * fm->bytes - fm->qoff) / 8 * jj;
}

/* block jj of a run (at blk; a sub-block of the super-block at run for the K formats): where
 * its B tile's bytes are (made into w where they are not stored as such) */
AMX static const uint8_t* amx_weights(const q8_format* fm, const uint8_t* run, const uint8_t* blk,
                                      int jj, uint8_t w[8][64]) {
    switch (fm->amx) {
    case AMX_NIBBLES: amx_nibbles(blk + fm->qoff, w); return w[0];
    case AMX_Q4_K: amx_nibbles(k_sub_block(fm, run, jj), w); return w[0];
    case AMX_Q5_K: amx_q5_k(k_sub_block(fm, run, jj), w); return w[0];
    case AMX_Q6_K: amx_q6_k(k_sub_block(fm, run, jj), w); return w[0];
    default: return blk + fm->qoff; /* AMX_STORED */
    }
}

/* block jj's scales (the 512 kernels'): dw, mw (affine), dw0 (Q6_K's first half); the K
 * formats' dw = fl(dd * sc), mw = -fl(dm * m) from the super-block's header at run */
AMX static void amx_scales(const q8_format* fm, const uint8_t* run, const uint8_t* blk, int jj,
                           __m512* dw0, __m512* dw, __m512* mw) {
    *dw0 = *mw = _mm512_setzero_ps();
    switch (fm->amx) {
    case AMX_Q4_K:
    case AMX_Q5_K:
        *dw = _mm512_mul_ps(H16_D(run), KSC_U8_16(run + 64 + 16 * jj));
        *mw = NEG16(_mm512_mul_ps(H16_M(run), KSC_U8_16(run + 192 + 16 * jj)));
        return;
    case AMX_Q6_K:
        *dw0 = _mm512_mul_ps(H16_D(run), KSC_I8_16(run + 32 + 32 * jj));
        *dw = _mm512_mul_ps(H16_D(run), KSC_I8_16(run + 48 + 32 * jj));
        return;
    default:
        *dw = fm->f32 ? G32_D(blk) : H16_D(blk);
        if (fm->finish == FIN_AFFINE16) *mw = fm->f32 ? G32_M(blk) : H16_M(blk);
    }
}

/* one product u of a run: C tile CT = the A tile's rows (a, stride K) x the B tile (bw) ->
 * out [M][16] int32 */
#define AMX_PRODUCT(CT, AT, BT, DP, a, bw, out)                                                \
    _tile_zero(CT);                                                                            \
    _tile_loadd(AT, (a), K);                                                                   \
    _tile_loadd(BT, (bw), 64);                                                                 \
    DP(CT, AT, BT);                                                                            \
    _tile_stored(CT, (out), 64);

/* the run's n * units products for the M configured rows at q (units: products a block, of kb
 * bytes of k each) -> isum[n * units][16][16]; four sums in flight (tiles 0..3), A and B
 * alternating (4, 5 and 6, 7) */
AMX static void amx_products(const q8_format* fm, const int8_t* q, int64_t K, int n, int units,
                             const uint8_t* const* bw, int32_t isum[][16][16]) {
    const int kb = SD_QBLOCK / units;
    for (int i = 0; i < n * units; i++) {
        const int8_t* a = q + i * kb;
        const uint8_t* b = bw[i / units] + (i % units) * kb * 16; /* kb / 4 rows of 64 bytes */
#define AMX_CASE(t, A, B)                                                                      \
    case t:                                                                                    \
        if (!fm->signed_w) {                                                                   \
            AMX_PRODUCT(t, A, B, _tile_dpbsud, a, b, isum[i])                                  \
        } else {                                                                               \
            AMX_PRODUCT(t, A, B, _tile_dpbssd, a, b, isum[i])                                  \
        }                                                                                      \
        break;
        switch (i & 3) {
            AMX_CASE(0, 4, 6) AMX_CASE(1, 5, 7) AMX_CASE(2, 4, 6) AMX_CASE(3, 5, 7)
        }
#undef AMX_CASE
    }
}

/* row r's fp32 finish over a run's n blocks (d, s: the row's at the run's first block; isum
 * from amx_products) into its 16 sums at f: the 512 kernel's operations, in its order */
AMX static void amx_finish(int finish, const float* d, const float* s, int n, int r,
                           int32_t isum[][16][16], const __m512* dw0, const __m512* dw,
                           const __m512* mw, float* f) {
    __m512 acc = _mm512_loadu_ps(f);
#define ISUM(i) _mm512_cvtepi32_ps(_mm512_load_si512(isum[i][r]))
    for (int jj = 0; jj < n; jj++) {
        const __m512 dx = _mm512_set1_ps(d[jj]);
        if (finish == FIN_AFFINE16) /* AFFINE16 */
            acc = _mm512_add_ps(acc, _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(dw[jj], dx),
                                                                 ISUM(jj)),
                                                   _mm512_mul_ps(mw[jj], _mm512_set1_ps(s[jj]))));
        else if (finish == FIN_SCALE16) /* SCALE16 */
            acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_mul_ps(dw[jj], dx), ISUM(jj)));
        else { /* HALF_LO16, then HALVES16 */
            const __m512 t = _mm512_mul_ps(_mm512_mul_ps(dw0[jj], dx), ISUM(2 * jj));
            acc = _mm512_add_ps(acc, _mm512_add_ps(t, _mm512_mul_ps(_mm512_mul_ps(dw[jj], dx),
                                                                    ISUM(2 * jj + 1))));
        }
    }
#undef ISUM
    _mm512_storeu_ps(f, acc);
}

/* tile i's first row (row tiles of rt) */
static int64_t tile_row(row_tiles rt, int64_t i) {
    return i * rt.base + (i < rt.extra ? i : rt.extra);
}

/* All rows (q: the rows of rt and one more, zero; d, s: row stride nb) over all nb blocks of
 * one pair at b -> 16 columns of each y row, in row tiles rt of at most M rows (the configured
 * tile rows; a tile of fewer reads M rows from q, the rows past it padding whose sums are
 * unused). Groups of up to 4 row tiles each make a pass over the blocks (the weights made into
 * bytes once per 64 rows), their rows' sums kept in f on the stack. Measured, 8192x2048 at 16
 * rows: Q8_0 0.95 ms with f here, 1.05 with f in the heap after the rows (we think from
 * meeting the A tiles' rows at the same offsets mod 4 KiB); Q4_K 0.79 ms here, 0.81 with the
 * sums accumulated in y. */
AMX static void q8_amx(const q8_format* fm, const int8_t* q, const float* d, const float* s,
                       int64_t K, int64_t nb, const uint8_t* b, float* y, int64_t ldy,
                       row_tiles rt) {
    int32_t isum[2 * AMX_CHUNK][16][16] __attribute__((aligned(64)));
    uint8_t wb[AMX_CHUNK][8][64] __attribute__((aligned(64))); /* weights made into bytes */
    float f[64][16] __attribute__((aligned(64)));
    const int64_t bytes = fm->bytes;
    const int units = SD_QBLOCK / amx_kbytes(fm);
    for (int64_t i0 = 0; i0 < rt.tiles; i0 += 4) {
        const int64_t i1 = i0 + 4 < rt.tiles ? i0 + 4 : rt.tiles, t0 = tile_row(rt, i0);
        const int64_t rows = tile_row(rt, i1) - t0;
        for (int64_t t = 0; t < rows; t++) _mm512_store_ps(f[t], _mm512_setzero_ps());
        for (int64_t j0 = 0; j0 < nb; j0 += AMX_CHUNK) {
            const int n = nb - j0 < AMX_CHUNK ? (int)(nb - j0) : AMX_CHUNK;
            const uint8_t* run = b + j0 * bytes;
            for (int o = 0; o < n * bytes; o += 64)
                _mm_prefetch((const char*)run + AHEAD * bytes + o, SD_STREAM_HINT);
            const uint8_t* bw[AMX_CHUNK];
            __m512 dw0[AMX_CHUNK], dw[AMX_CHUNK], mw[AMX_CHUNK];
            for (int jj = 0; jj < n; jj++) {
                bw[jj] = amx_weights(fm, run, run + jj * bytes, jj, wb[jj]);
                amx_scales(fm, run, run + jj * bytes, jj, &dw0[jj], &dw[jj], &mw[jj]);
            }
            for (int64_t i = i0; i < i1; i++) {
                const int64_t t = tile_row(rt, i), r = tile_row(rt, i + 1) - t;
                amx_products(fm, q + t * K + j0 * SD_QBLOCK, K, n, units, bw, isum);
                for (int64_t u = 0; u < r; u++)
                    amx_finish(fm->finish, d + (t + u) * nb + j0, s + (t + u) * nb + j0, n,
                               (int)u, isum, dw0, dw, mw, f[t - t0 + u]);
            }
        }
        for (int64_t t = 0; t < rows; t++)
            _mm512_storeu_ps(y + (t0 + t) * ldy, _mm512_load_ps(f[t]));
    }
}

/* Linux: the process asks once for the right to use the tile data (ARCH_REQ_XCOMP_PERM) */
static int amx_usable(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!(d & (1u << 24)) || !(d & (1u << 25))) return 0; /* AMX-TILE, AMX-INT8 */
#ifdef SYS_arch_prctl
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
#else
    return 0;
#endif
}
#else
#define SD_HAVE_AMX 0
#endif

static int pick_q8_isa(void) {
    /* the best this CPU has, at most the one the environment names */
    const char* want = getenv("SPECDEC_NATIVE_ISA");
    const int cap = !want                            ? SD_Q8_AMX
                    : strcmp(want, "avx2") == 0        ? SD_Q8_AVX2
                    : strcmp(want, "avx-vnni") == 0    ? SD_Q8_AVXVNNI
                    : strcmp(want, "avx512-vnni") == 0 ? SD_Q8_AVX512VNNI
                                                       : SD_Q8_AMX;
    __builtin_cpu_init();
    const int avx512 = __builtin_cpu_supports("avx512vnni") &&
                       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
#if SD_HAVE_AMX
    if (cap >= SD_Q8_AMX && avx512 && amx_usable()) return SD_Q8_AMX;
#endif
    if (cap >= SD_Q8_AVX512VNNI && avx512) return SD_Q8_AVX512VNNI;
#if SD_HAVE_AVXVNNI
    if (cap >= SD_Q8_AVXVNNI && __builtin_cpu_supports("avxvnni")) return SD_Q8_AVXVNNI;
#endif
    return SD_Q8_AVX2;
}

int sd_q8_isa(void) {
    /* decided once per process (the environment is read once: a linear call is ~10 us) */
    static int isa = -1;
    int got = __atomic_load_n(&isa, __ATOMIC_RELAXED);
    if (got < 0) {
        got = pick_q8_isa();
        __atomic_store_n(&isa, got, __ATOMIC_RELAXED);
    }
    return got;
}

/* y[T, ldy] = x[T, K] @ W.T for the formats SD_*_Q8, as a work-sharing loop (see
 * sd_linear_for). Every thread rounds all rows itself (T * K work beside the T * K * out of the
 * products), into its own buffer, then the team splits the panel pairs. */
void sd_linear_q8_for(const float* x, int64_t T, int64_t K, const sd_weight* w, float* y,
                      int64_t ldy) {
    const int64_t nb = K / SD_QBLOCK, pairs = w->panels / 2;
    const q8_format* fm = &Q8_FORMATS[w->fmt];
    const int isa = sd_q8_isa();
    const int64_t bytes = fm->bytes;
    /* AMX reads whole tiles of rows: one zero row of padding past the last */
    /* q [T + 1][K], d and s [T][nb], then (AVX512, signed weights) the rows as unsigned bytes
     * [T][K] */
    int8_t* q = malloc((size_t)((T + 1) * K + 2 * T * nb * (int64_t)sizeof(float) + T * K) + 64);
    if (!q) {
        fprintf(stderr, "specdec: sd_linear_q8_for: out of memory for %lld rows\n", (long long)T);
        abort();
    }
    float* d = (float*)(((uintptr_t)(q + (T + 1) * K) + 63) & ~(uintptr_t)63);
    float* s = d + T * nb;
    memset(q + T * K, 0, (size_t)K);
    for (int64_t t = 0; t < T; t++) quantize_row(x + t * K, K, q + t * K, d + t * nb, s + t * nb);
#if SD_HAVE_AMX
    if (isa == SD_Q8_AMX && fm->amx != AMX_NONE && T >= fm->amx_rows) {
        /* row tiles of at most 16, as even as possible; every tile M rows (the largest) */
        const row_tiles rt = split_rows(T, 16);
        amx_configure((int)(rt.base + (rt.extra > 0)), amx_kbytes(fm));
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++)
            q8_amx(fm, q, d, s, K, nb, (const uint8_t*)w->data + p * nb * bytes, y + 2 * p * PW,
                   ldy, rt);
        amx_release();
        free(q);
        return;
    }
#endif
    if (isa >= SD_Q8_AVX512VNNI) {
        /* signed weights: the rows as unsigned bytes q + 128 (= q ^ 0x80), for vpdpbusd
         * against them; the kernel subtracts 128 * sum(w) of the block: the same isum */
        const int8_t* a = q;
        if (fm->signed_w) {
            uint8_t* u = (uint8_t*)s + T * nb * (int64_t)sizeof(float);
            for (int64_t i = 0; i < T * K; i++) u[i] = (uint8_t)q[i] ^ 0x80;
            a = (const int8_t*)u;
        }
        const row_tiles rt = split_rows(T, TILE512);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++) {
            const uint8_t* pair = (const uint8_t*)w->data + p * nb * bytes;
            for (int64_t i = 0, t = 0; i < rt.tiles; i++) {
                const int64_t r = rt.base + (i < rt.extra);
                TABLE_512[w->fmt][r - 1](a + t * K, d + t * nb, s + t * nb, K, nb, pair,
                                         y + t * ldy + 2 * p * PW, ldy);
                t += r;
            }
        }
        free(q);
        return;
    }
    /* row tiles of at most TILE, as even as possible */
    const row_tiles rt = split_rows(T, TILE);
    const q8_fn* table = (isa == SD_Q8_AVXVNNI ? TABLE_avxvnni : TABLE_avx2)[w->fmt];
#pragma omp for schedule(static)
    for (int64_t p = 0; p < pairs; p++) {
        const uint8_t* pair = (const uint8_t*)w->data + p * nb * bytes;
        for (int64_t i = 0, t = 0; i < rt.tiles; i++) {
            const int64_t r = rt.base + (i < rt.extra);
            for (int panel = 0; panel < 2; panel++)
                table[r - 1](q + t * K, d + t * nb, s + t * nb, K, nb, pair, panel,
                             y + t * ldy + (2 * p + panel) * PW, ldy);
            t += r;
        }
    }
    free(q);
}
