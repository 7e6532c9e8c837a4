/* Row-invariant linear layers over a GGUF's blocks with 8-bit activations (llama.cpp's way).
 *
 * Each row of x is rounded, per block of 32 inputs, to int8 with one fp32 scale:
 *   d = max|x| / 127,  q = round-half-even(x * (1 / d)) (0 where d == 0),  s = d * sum(q)
 * and each output element is a sum over blocks b, in ascending order, from 0:
 *   Q4_1 (w = dw * qw + mw):  y += ((dw * d) * isum + mw * s)      isum = sum_k qw_k * q_k
 *   Q8_0 (w = dw * qw):       y += (dw * d) * isum
 * every product and sum rounded as written (no fma), isum exact in int32. A row's result
 * depends only on that row, whatever shares the call (the contract of kernels.h), and a
 * pure-torch reference reproduces it bitwise (specdec/models/q8_activations.py).
 *
 * Why: the fp32 path (linear.c) is bound by dequantizing in registers at one row and by the
 * fp32 FMAs from 4 rows on (~2 ms of FMA per row of a SmolLM2 forward); here one vpmaddubsw does
 * 32 multiply-adds on 4-bit x 8-bit, so extra rows cost a fraction of that. The numerics are no
 * longer the fp32 model's (an activation's rounding error is <= 1/254 of its block's max).
 *
 * Weight layouts (one block of a panel pair: 16 output rows x 32 k; gguf_weights.prepare):
 *   Q4_1 (320 bytes): d[16] fp16, m[16] fp16, then 8 chunks c of 32 bytes: byte 4r + j holds
 *        q[row r][k = 4c + j] in its low nibble and q[row 8 + r][4c + j] in its high nibble.
 *   Q8_0 (544 bytes): d[16] fp16, then 16 chunks (c, p) of 32 bytes at 32 + 64c + 32p: byte
 *        4r + j is q[row 8p + r][4c + j] (int8).
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

/* R rows of quantized x (q: row stride K; d, s: row stride nb) over all nb blocks of one panel
 * (P: 0 or 1) of a pair -> 8 columns of each y row. One panel at a time keeps every row's fp32
 * sum and integer block sum in registers across the blocks (2R + 3 of the 16 ymm).
 *
 * Each kernel exists per instruction set (its name's suffix, its target attribute), chosen at
 * run time (sd_q8_isa). They differ only in how a block's integer sum isum is formed, and isum
 * is exact in all of them, so every instruction set gives bitwise the same y:
 *   avx2: vpmaddubsw adds pairs of products into int16, vpmaddwd widens to int32 (Q4_1: once
 *         a block; Q8_0: every step, since two steps could overflow int16);
 *   vnni: vpdpbusd adds four products into int32 in one instruction (AVX-VNNI): one
 *         instruction per row and step instead of two (Q4_1) or three (Q8_0);
 *   512:  AVX512-VNNI, both panels of a pair at once, up to 8 rows a tile (below);
 *   amx:  AMX-INT8 tile products, from 16 rows (below; fewer rows run the 512 kernels). */
#define INIT(r) __m256 f##r = _mm256_setzero_ps();
#define STORE(r) _mm256_storeu_ps(y + (r) * ldy, f##r);
#define IZERO(r) __m256i i##r = _mm256_setzero_si256();
#define Q4_ROW_avx2(r) i##r = _mm256_add_epi16(i##r, _mm256_maddubs_epi16(w, A4(r)));
#define Q4_ISUM_avx2(r) _mm256_madd_epi16(i##r, ones)
#define Q4_ROW_vnni(r) i##r = DPBUSD(i##r, w, A4(r));
#define Q4_ISUM_vnni(r) i##r
#define Q4_FINISH(r, ISA)                                                                      \
    {                                                                                          \
        const __m256 t = _mm256_mul_ps(_mm256_mul_ps(dw, _mm256_set1_ps(d[(r) * nb + j])),    \
                                       _mm256_cvtepi32_ps(Q4_ISUM_##ISA(r)));                  \
        f##r = _mm256_add_ps(f##r, _mm256_add_ps(t, _mm256_mul_ps(mw, _mm256_set1_ps(        \
                                                              s[(r) * nb + j]))));             \
    }
#define Q4_FINISH_avx2(r) Q4_FINISH(r, avx2)
#define Q4_FINISH_vnni(r) Q4_FINISH(r, vnni)
#define Q4_KERNEL(R, EACH, ISA, SUF, ATTR)                                                     \
    ATTR static void q4_1_q8_r##R##SUF(const int8_t* q, const float* d, const float* s,       \
                                       int64_t K, int64_t nb, const uint8_t* b, int P,        \
                                       float* y, int64_t ldy) {                               \
        const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);                 \
        (void)ones;                                                                            \
        EACH(INIT)                                                                             \
        for (int64_t j = 0; j < nb; j++, b += SD_Q4_1_PAIR_BYTES) {                            \
            if (P == 0)                                                                        \
                for (int o = 0; o < SD_Q4_1_PAIR_BYTES; o += 64)                               \
                    _mm_prefetch((const char*)b + AHEAD * SD_Q4_1_PAIR_BYTES + o, _MM_HINT_T0);\
            EACH(IZERO)                                                                        \
            /* 8 steps of <= 2 * 15 * 127 per int16 lane (avx2): <= 30480, no overflow */      \
            for (int c = 0; c < 8; c++) {                                                      \
                const __m256i raw = _mm256_loadu_si256((const __m256i*)(b + 64 + 32 * c));     \
                const __m256i w = _mm256_and_si256(P ? _mm256_srli_epi16(raw, 4) : raw, low);  \
                const int64_t k = j * SD_QBLOCK + 4 * c;                                       \
                EACH(Q4_ROW_##ISA)                                                             \
            }                                                                                  \
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(b + 16 * P)));  \
            const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(b + 32 + 16 * P))); \
            EACH(Q4_FINISH_##ISA)                                                              \
        }                                                                                      \
        EACH(STORE)                                                                            \
    }

/* Q8_0: signed x signed, as |w| (unsigned) x sign(x, w) (signed) */
#define Q8_ROW_avx2(r)                                                                        \
    i##r = _mm256_add_epi32(                                                                   \
        i##r, _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(A4(r), w)), ones));
#define Q8_ROW_vnni(r) i##r = DPBUSD(i##r, u, _mm256_sign_epi8(A4(r), w));
#define Q8_FINISH(r)                                                                          \
    f##r = _mm256_add_ps(f##r, _mm256_mul_ps(_mm256_mul_ps(dw, _mm256_set1_ps(d[(r) * nb + j])), \
                                             _mm256_cvtepi32_ps(i##r)));
#define Q8_KERNEL(R, EACH, ISA, SUF, ATTR)                                                     \
    ATTR static void q8_0_q8_r##R##SUF(const int8_t* q, const float* d, const float* s,       \
                                       int64_t K, int64_t nb, const uint8_t* b, int P,        \
                                       float* y, int64_t ldy) {                               \
        (void)s;                                                                               \
        const __m256i ones = _mm256_set1_epi16(1);                                             \
        (void)ones;                                                                            \
        EACH(INIT)                                                                             \
        for (int64_t j = 0; j < nb; j++, b += SD_Q8_0_PAIR_BYTES) {                            \
            if (P == 0)                                                                        \
                for (int o = 0; o < SD_Q8_0_PAIR_BYTES; o += 64)                               \
                    _mm_prefetch((const char*)b + AHEAD * SD_Q8_0_PAIR_BYTES + o, _MM_HINT_T0);\
            EACH(IZERO)                                                                        \
            for (int c = 0; c < 8; c++) {                                                      \
                const __m256i w = _mm256_loadu_si256((const __m256i*)(b + 32 + 64 * c + 32 * P)); \
                const __m256i u = _mm256_abs_epi8(w);                                          \
                const int64_t k = j * SD_QBLOCK + 4 * c;                                       \
                EACH(Q8_ROW_##ISA)                                                             \
            }                                                                                  \
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(b + 16 * P)));  \
            EACH(Q8_FINISH)                                                                    \
        }                                                                                      \
        EACH(STORE)                                                                            \
    }

typedef void (*q8_fn)(const int8_t*, const float*, const float*, int64_t, int64_t,
                      const uint8_t*, int, float*, int64_t);

/* both formats at 1..TILE rows for one instruction set, and their table [format][rows - 1] */
#define KERNELS(ISA, SUF, ATTR)                                                                \
    Q4_KERNEL(1, EACH1, ISA, SUF, ATTR) Q4_KERNEL(2, EACH2, ISA, SUF, ATTR)                    \
    Q4_KERNEL(3, EACH3, ISA, SUF, ATTR) Q4_KERNEL(4, EACH4, ISA, SUF, ATTR)                    \
    Q8_KERNEL(1, EACH1, ISA, SUF, ATTR) Q8_KERNEL(2, EACH2, ISA, SUF, ATTR)                    \
    Q8_KERNEL(3, EACH3, ISA, SUF, ATTR) Q8_KERNEL(4, EACH4, ISA, SUF, ATTR)                    \
    static const q8_fn TABLE##SUF[2][TILE] = {                                                 \
        {q4_1_q8_r1##SUF, q4_1_q8_r2##SUF, q4_1_q8_r3##SUF, q4_1_q8_r4##SUF},                  \
        {q8_0_q8_r1##SUF, q8_0_q8_r2##SUF, q8_0_q8_r3##SUF, q8_0_q8_r4##SUF}};

KERNELS(avx2, _avx2, AVX2)
/* AVX-VNNI needs gcc >= 11 or clang >= 12; an older compiler builds the others only */
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define SD_HAVE_AVXVNNI 1
#define DPBUSD _mm256_dpbusd_avx_epi32
KERNELS(vnni, _avxvnni, __attribute__((target("avx2,fma,f16c,avxvnni"))))
#undef DPBUSD
#else
#define SD_HAVE_AVXVNNI 0
#define TABLE_avxvnni TABLE_avx2
#endif

/* AVX512-VNNI: both panels of a pair in one 512-bit register (16 output rows x 4 k: panel 0's
 * rows in the low half, panel 1's in the high half), so one vpdpbusd serves 16 columns and y
 * gets 16 adjacent columns (panels 2p and 2p + 1) per row; every element's fp32 operations are
 * those of the 256-bit kernels, in the same order. Q8_0 has no 512-bit vpsignb: the rows come
 * as unsigned bytes q + 128 (q ^ 0x80, made once per call) and each block subtracts 128 * sum(w)
 * (one vpdpbusd of ones x w per step, shared by the rows): sum (q + 128) w - 128 sum w = isum,
 * exact (|sum (q + 128) w| <= 32 * 255 * 128). One instruction per row and step, as for Q4_1.
 * Tiles of up to 8 rows: 8 int32 + 8 fp32 accumulators of the 32 zmm, and each weight load
 * serves 8 rows (2026-12-03, Sapphire Rapids: an 8-row head call 1.17 -> 0.74 ms). */
#define INIT16(r) __m512 f##r = _mm512_setzero_ps();
#define STORE16(r) _mm512_storeu_ps(y + (r) * ldy, f##r);
#define IZERO16(r) __m512i i##r = _mm512_setzero_si512();
#define A16(r) _mm512_set1_epi32(*(const int32_t*)(q + (r) * K + k))
#define Q4_ROW16(r) i##r = _mm512_dpbusd_epi32(i##r, w, A16(r));
#define Q4_FINISH16(r)                                                                         \
    {                                                                                          \
        const __m512 t = _mm512_mul_ps(_mm512_mul_ps(dw, _mm512_set1_ps(d[(r) * nb + j])),    \
                                       _mm512_cvtepi32_ps(i##r));                              \
        f##r = _mm512_add_ps(f##r, _mm512_add_ps(t, _mm512_mul_ps(mw, _mm512_set1_ps(        \
                                                              s[(r) * nb + j]))));             \
    }
#define Q8_ROW16(r) i##r = _mm512_dpbusd_epi32(i##r, A16(r), w);
#define Q8_FIX16(r) i##r = _mm512_sub_epi32(i##r, ws);
#define Q8_FINISH16(r)                                                                        \
    f##r = _mm512_add_ps(f##r, _mm512_mul_ps(_mm512_mul_ps(dw, _mm512_set1_ps(d[(r) * nb + j])), \
                                             _mm512_cvtepi32_ps(i##r)));
#define AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define Q4_KERNEL16(R, EACH)                                                                   \
    AVX512 static void q4_1_q8_r##R##_512(const int8_t* q, const float* d, const float* s,    \
                                          int64_t K, int64_t nb, const uint8_t* b, float* y,  \
                                          int64_t ldy) {                                       \
        const __m512i low = _mm512_set1_epi8(15);                                              \
        EACH(INIT16)                                                                           \
        for (int64_t j = 0; j < nb; j++, b += SD_Q4_1_PAIR_BYTES) {                            \
            for (int o = 0; o < SD_Q4_1_PAIR_BYTES; o += 64)                                   \
                _mm_prefetch((const char*)b + AHEAD * SD_Q4_1_PAIR_BYTES + o, _MM_HINT_T0);    \
            EACH(IZERO16)                                                                      \
            for (int c = 0; c < 8; c++) {                                                      \
                const __m256i raw = _mm256_loadu_si256((const __m256i*)(b + 64 + 32 * c));     \
                const __m512i w = _mm512_and_si512(                                            \
                    _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1), \
                    low);                                                                      \
                const int64_t k = j * SD_QBLOCK + 4 * c;                                       \
                EACH(Q4_ROW16)                                                                 \
            }                                                                                  \
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)b));          \
            const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(b + 32)));   \
            EACH(Q4_FINISH16)                                                                  \
        }                                                                                      \
        EACH(STORE16)                                                                          \
    }
#define Q8_KERNEL16(R, EACH)                                                                   \
    AVX512 static void q8_0_q8_r##R##_512(const int8_t* q, const float* d, const float* s,    \
                                          int64_t K, int64_t nb, const uint8_t* b, float* y,  \
                                          int64_t ldy) {                                       \
        (void)s;                                                                               \
        const __m512i ones = _mm512_set1_epi8(1);                                              \
        EACH(INIT16)                                                                           \
        for (int64_t j = 0; j < nb; j++, b += SD_Q8_0_PAIR_BYTES) {                            \
            for (int o = 0; o < SD_Q8_0_PAIR_BYTES; o += 64)                                   \
                _mm_prefetch((const char*)b + AHEAD * SD_Q8_0_PAIR_BYTES + o, _MM_HINT_T0);    \
            EACH(IZERO16)                                                                      \
            __m512i ws = _mm512_setzero_si512();                                               \
            for (int c = 0; c < 8; c++) {                                                      \
                const __m512i w = _mm512_loadu_si512((const void*)(b + 32 + 64 * c));          \
                ws = _mm512_dpbusd_epi32(ws, ones, w);                                         \
                const int64_t k = j * SD_QBLOCK + 4 * c;                                       \
                EACH(Q8_ROW16)                                                                 \
            }                                                                                  \
            ws = _mm512_slli_epi32(ws, 7);                                                     \
            EACH(Q8_FIX16)                                                                     \
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)b));          \
            EACH(Q8_FINISH16)                                                                  \
        }                                                                                      \
        EACH(STORE16)                                                                          \
    }
typedef void (*q8_pair_fn)(const int8_t*, const float*, const float*, int64_t, int64_t,
                           const uint8_t*, float*, int64_t);
#define EACH5(F) EACH4(F) F(4)
#define EACH6(F) EACH5(F) F(5)
#define EACH7(F) EACH6(F) F(6)
#define EACH8(F) EACH7(F) F(7)
#define TILE512 8 /* rows per tile of the 512 kernels: 2 * 8 accumulators of the 32 zmm */
Q4_KERNEL16(1, EACH1) Q4_KERNEL16(2, EACH2) Q4_KERNEL16(3, EACH3) Q4_KERNEL16(4, EACH4)
Q4_KERNEL16(5, EACH5) Q4_KERNEL16(6, EACH6) Q4_KERNEL16(7, EACH7) Q4_KERNEL16(8, EACH8)
Q8_KERNEL16(1, EACH1) Q8_KERNEL16(2, EACH2) Q8_KERNEL16(3, EACH3) Q8_KERNEL16(4, EACH4)
Q8_KERNEL16(5, EACH5) Q8_KERNEL16(6, EACH6) Q8_KERNEL16(7, EACH7) Q8_KERNEL16(8, EACH8)
static const q8_pair_fn TABLE_512[2][TILE512] = {
    {q4_1_q8_r1_512, q4_1_q8_r2_512, q4_1_q8_r3_512, q4_1_q8_r4_512, q4_1_q8_r5_512,
     q4_1_q8_r6_512, q4_1_q8_r7_512, q4_1_q8_r8_512},
    {q8_0_q8_r1_512, q8_0_q8_r2_512, q8_0_q8_r3_512, q8_0_q8_r4_512, q8_0_q8_r5_512,
     q8_0_q8_r6_512, q8_0_q8_r7_512, q8_0_q8_r8_512}};

/* AMX-INT8 (Sapphire Rapids and later): a block's integer sums for up to 16 rows and both
 * panels of a pair in one tile multiply. A = the rows' quants of the block [M rows][32 bytes]
 * (row stride K), B = the block's weights in the VNNI layout [8][64 bytes] (row c: outputs
 * 0..15 x k 4c..4c+3; for Q8_0 that is the pair's layout as stored, at 32 + 64c; Q4_1's nibbles
 * are unpacked to bytes once per block, for all rows), C [M][16] int32 = isum, exact like every
 * other kernel's: TDPBSSD (signed x signed) for Q8_0, TDPBSUD (signed x unsigned) for Q4_1.
 * The tiles' sums of a run of AMX_CHUNK blocks go to memory; then each row's fp32 finish runs
 * over those blocks in ascending order with exactly the 512 kernel's operations (Q8_FINISH16 /
 * Q4_FINISH16), the row's 16 sums kept in memory between runs (f starts at +0.0 in both). */
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define SD_HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#define AMX __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,amx-tile,amx-int8")))
#define AMX_CHUNK 8 /* blocks whose sums are stored before the rows' fp32 finish */
/* fewer rows than this run the 512 kernels (measured: where AMX starts to win) [Q4_1, Q8_0] */
static const int64_t AMX_MIN_ROWS[2] = {16, 16};

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg;

/* tiles 0..3: C [M][64 bytes]; 4, 5: A [M][32 bytes]; 6, 7: B [8][64 bytes] */
AMX static void amx_configure(int M) {
    amx_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 4; i++) c.rows[i] = (uint8_t)M, c.colsb[i] = 64;
    for (int i = 4; i < 6; i++) c.rows[i] = (uint8_t)M, c.colsb[i] = 32;
    for (int i = 6; i < 8; i++) c.rows[i] = 8, c.colsb[i] = 64;
    /* asm with the whole struct as its operand: gcc 12 drops the stores before a bare
     * _tile_loadconfig(&c), which it does not see reading them */
    __asm__ volatile("ldtilecfg %0" : : "m"(c));
}

AMX static void amx_release(void) { _tile_release(); }

/* one block jj of a run: isum [M][16] int32 of A (q at block j) x B */
#define AMX_BLOCK(CT, AT, BT, DP, a, bw, out)                                                  \
    _tile_zero(CT);                                                                            \
    _tile_loadd(AT, (a), K);                                                                   \
    _tile_loadd(BT, (bw), 64);                                                                 \
    DP(CT, AT, BT);                                                                            \
    _tile_stored(CT, (out), 64);

/* R rows (R <= M, the configured tile rows; the A tile reads M rows from q, rows past R are
 * padding whose sums are never used) over all nb blocks of one pair -> 16 columns per row */
AMX static void q8_amx(int q4, const int8_t* q, const float* d, const float* s, int64_t K,
                       int64_t nb, const uint8_t* b, float* y, int64_t ldy, int R, int first) {
    int32_t isum[AMX_CHUNK][16][16] __attribute__((aligned(64)));
    uint8_t wb[AMX_CHUNK][8][64] __attribute__((aligned(64))); /* Q4_1: weights as bytes */
    float f[16][16] __attribute__((aligned(64)));
    const int64_t bytes = q4 ? SD_Q4_1_PAIR_BYTES : SD_Q8_0_PAIR_BYTES;
    const __m512i low = _mm512_set1_epi8(15);
    for (int r = 0; r < R; r++) _mm512_store_ps(f[r], _mm512_setzero_ps());
    for (int64_t j0 = 0; j0 < nb; j0 += AMX_CHUNK) {
        const int n = nb - j0 < AMX_CHUNK ? (int)(nb - j0) : AMX_CHUNK;
        const uint8_t* run = b + j0 * bytes;
        if (first)
            for (int o = 0; o < n * bytes; o += 64)
                _mm_prefetch((const char*)run + AHEAD * bytes + o, _MM_HINT_T0);
        if (q4) /* the run's weights as bytes first: stored before a tile reads them */
            for (int jj = 0; jj < n; jj++)
                for (int c = 0; c < 8; c++) {
                    const __m256i raw =
                        _mm256_loadu_si256((const __m256i*)(run + jj * bytes + 64 + 32 * c));
                    _mm512_store_si512((void*)wb[jj][c], _mm512_and_si512(_mm512_inserti64x4(
                        _mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1), low));
                }
        /* four sums in flight (tiles 0..3), A and B alternating (4, 5 and 6, 7) */
        const int8_t* a = q + j0 * SD_QBLOCK;
        for (int jj = 0; jj < n; jj++, a += SD_QBLOCK) {
            const void* bw = q4 ? (const void*)wb[jj] : (const void*)(run + jj * bytes + 32);
#define AMX_CASE(i, A, B)                                                                      \
    case i:                                                                                    \
        if (q4) {                                                                              \
            AMX_BLOCK(i, A, B, _tile_dpbsud, a, bw, isum[jj])                                  \
        } else {                                                                               \
            AMX_BLOCK(i, A, B, _tile_dpbssd, a, bw, isum[jj])                                  \
        }                                                                                      \
        break;
            switch (jj & 3) {
                AMX_CASE(0, 4, 6) AMX_CASE(1, 5, 7) AMX_CASE(2, 4, 6) AMX_CASE(3, 5, 7)
            }
#undef AMX_CASE
        }
        __m512 dw[AMX_CHUNK], mw[AMX_CHUNK];
        for (int jj = 0; jj < n; jj++) {
            const uint8_t* blk = b + (j0 + jj) * bytes;
            dw[jj] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk));
            mw[jj] = q4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 32)))
                        : _mm512_setzero_ps();
        }
        for (int r = 0; r < R; r++) {
            const float* dr = d + r * nb + j0;
            const float* sr = s + r * nb + j0;
            __m512 acc = _mm512_load_ps(f[r]);
            /* Q4_FINISH16 / Q8_FINISH16 for row r and block j0 + jj */
            if (q4)
                for (int jj = 0; jj < n; jj++) {
                    const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512(isum[jj][r]));
                    const __m512 t =
                        _mm512_mul_ps(_mm512_mul_ps(dw[jj], _mm512_set1_ps(dr[jj])), sum);
                    acc = _mm512_add_ps(
                        acc, _mm512_add_ps(t, _mm512_mul_ps(mw[jj], _mm512_set1_ps(sr[jj]))));
                }
            else
                for (int jj = 0; jj < n; jj++) {
                    const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512(isum[jj][r]));
                    acc = _mm512_add_ps(
                        acc, _mm512_mul_ps(_mm512_mul_ps(dw[jj], _mm512_set1_ps(dr[jj])), sum));
                }
            _mm512_store_ps(f[r], acc);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + r * ldy, _mm512_load_ps(f[r]));
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

/* [SD_Q8_AVX2 / SD_Q8_AVXVNNI] -> that instruction set's table (AVX512-VNNI: TABLE_512) */
static const q8_fn (*const TABLES[])[TILE] = {TABLE_avx2, TABLE_avxvnni};

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

/* T rows as tiles of at most `most` rows, as even as possible: tile i has
 * base + (i < extra) rows (no tiles for T == 0) */
typedef struct {
    int64_t tiles, base, extra;
} row_tiles;

static row_tiles split_rows(int64_t T, int64_t most) {
    const int64_t tiles = (T + most - 1) / most;
    return (row_tiles){tiles, tiles ? T / tiles : 0, tiles ? T % tiles : 0};
}

/* y[T, ldy] = x[T, K] @ W.T for the formats SD_Q4_1_Q8 / SD_Q8_0_Q8, as a work-sharing loop
 * (see sd_linear_for). Every thread rounds all rows itself (T * K work beside the T * K * out
 * of the products), into its own buffer, then the team splits the panel pairs. */
void sd_linear_q8_for(const float* x, int64_t T, int64_t K, const sd_weight* w, float* y,
                      int64_t ldy) {
    const int64_t nb = K / SD_QBLOCK, pairs = w->panels / 2;
    const int q8 = w->fmt == SD_Q8_0_Q8;
    const int isa = sd_q8_isa();
    const int64_t bytes = q8 ? SD_Q8_0_PAIR_BYTES : SD_Q4_1_PAIR_BYTES;
    /* AMX reads whole tiles of rows: one zero row of padding past the last */
    /* q [T + 1][K], d and s [T][nb], then (AVX512, Q8_0) the rows as unsigned bytes [T][K] */
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
    if (isa == SD_Q8_AMX && T >= AMX_MIN_ROWS[q8]) {
        /* row tiles of at most 16, as even as possible; every tile M rows (the largest) */
        const row_tiles rt = split_rows(T, 16);
        amx_configure((int)(rt.base + (rt.extra > 0)));
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++) {
            const uint8_t* pair = (const uint8_t*)w->data + p * nb * bytes;
            for (int64_t i = 0, t = 0; i < rt.tiles; i++) {
                const int64_t r = rt.base + (i < rt.extra);
                q8_amx(!q8, q + t * K, d + t * nb, s + t * nb, K, nb, pair,
                       y + t * ldy + 2 * p * PW, ldy, (int)r, i == 0);
                t += r;
            }
        }
        amx_release();
        free(q);
        return;
    }
#endif
    if (isa >= SD_Q8_AVX512VNNI) {
        /* Q8_0: the rows as unsigned bytes q + 128 (= q ^ 0x80), for vpdpbusd against the
         * signed weights; the kernel subtracts 128 * sum(w) of the block: the same isum */
        const int8_t* a = q;
        if (q8) {
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
                TABLE_512[q8][r - 1](a + t * K, d + t * nb, s + t * nb, K, nb, pair,
                                     y + t * ldy + 2 * p * PW, ldy);
                t += r;
            }
        }
        free(q);
        return;
    }
    /* row tiles of at most TILE, as even as possible */
    const row_tiles rt = split_rows(T, TILE);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < pairs; p++) {
        const uint8_t* pair = (const uint8_t*)w->data + p * nb * bytes;
        for (int64_t i = 0, t = 0; i < rt.tiles; i++) {
            const int64_t r = rt.base + (i < rt.extra);
            for (int panel = 0; panel < 2; panel++)
                TABLES[isa][q8][r - 1](q + t * K, d + t * nb, s + t * nb, K, nb, pair, panel,
                                       y + t * ldy + (2 * p + panel) * PW, ldy);
            t += r;
        }
    }
    free(q);
}
