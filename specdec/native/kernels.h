/* Shared declarations of specdec's CPU kernels (cpu_kernels.c, linear.c, attention.c, layer.c).
 *
 * Row invariance is the contract of every kernel here: the output of a row is bitwise the same
 * whatever other rows share the call, because every reduction runs in one fixed order per
 * output element (see each file). Vector code is compiled per function for the ISA it needs
 * (target attributes), never with -march=native, and chosen at run time (sd_cpu_features).
 */
#ifndef SD_KERNELS_H
#define SD_KERNELS_H

#include <immintrin.h>
#include <stdint.h>

#define SD_ABI 16

/* the cache level the 8-bit-activation kernels (linear_q8.c) prefetch streamed weights into:
 * L2 (T1), not L1 (T0). A T0 prefetch holds one of L1's few fill buffers until its line arrives
 * from DRAM; T1 holds an L2 queue entry (several times as many), so more lines are in flight and
 * a thread streams nearer the bandwidth. Measured on a 2-core Sapphire Rapids (29.9 GB/s), every
 * matrix of a SmolLM2-1.7B shape at 1 row: Q4_K_M 20.0 -> 26.6 GB/s, Q4_1 21.6 -> 28.8. The float
 * kernels (linear.c) keep T0: there T1 measured 2-6 % slower (they are nearer compute-bound). */
#ifndef SD_STREAM_HINT
#define SD_STREAM_HINT _MM_HINT_T1
#endif
#define PW 8 /* panel width: output rows per weight panel */
#define AVX2 __attribute__((target("avx2,fma,f16c")))

/* weight formats; the first three are also the K/V cache's (SD_NUM_FLOAT_FORMATS). The GGUF
 * block formats (specdec/models/gguf/blocks.py: every GGUF type is repacked into one of them,
 * exactly), per block of 32 k and output row:
 *   SD_Q4_1    fp16 d, m, 4-bit q:          w = fl(d * q) + m
 *   SD_Q8_0    fp16 d, int8 q:              w = fl(d * q)
 *   SD_Q4_F    fp32 d, m, 4-bit q:          w = fl(d * q) + m
 *   SD_Q5_F    fp32 d, m, 5-bit q a byte:   w = fl(d * q) + m
 *   SD_I8_F16  fp32 d per 16 k, int8 q:     w = fl(d * q)
 * and, per super-block of 256 k (the K-quants as the file holds them: the scales are computed
 * in the kernel, as gguf-py computes them, in float32):
 *   SD_Q4_K    fp16 d, dmin per 256, 6-bit sc, m per 32 (a byte each), 4-bit q:
 *              w = fl(D * q) + (-M), D = fl(d * sc), M = fl(dmin * m)
 *   SD_Q6_K    fp16 d per 256, int8 sc per 16, 6-bit q (4 + 2 bits): w = fl(D * (q - 32)),
 *              D = fl(d * sc)
 *   SD_Q5_K    Q4_K's, with 5-bit q (4 bits + a bit plane): w = fl(D * q) + (-M)
 * and each laid out for 8-bit activations (SD_*_Q8: linear_q8.c) */
enum { SD_F32 = 0, SD_BF16 = 1, SD_F16 = 2, SD_NUM_FLOAT_FORMATS = 3, SD_Q4_1 = 3, SD_Q8_0 = 4,
       SD_Q4_1_Q8 = 5, SD_Q8_0_Q8 = 6, SD_Q4_F = 7, SD_Q5_F = 8, SD_I8_F16 = 9,
       SD_Q4_F_Q8 = 10, SD_Q5_F_Q8 = 11, SD_I8_F16_Q8 = 12, SD_Q4_K = 13, SD_Q6_K = 14,
       SD_Q4_K_Q8 = 15, SD_Q6_K_Q8 = 16, SD_Q5_K = 17, SD_Q5_K_Q8 = 18, SD_NUM_FORMATS = 19 };
#define SD_QBLOCK 32 /* weights per GGUF block (along K) */
/* bytes of one block of a panel pair (16 output rows x 32 k): the scales, then the quants */
#define SD_Q4_1_PAIR_BYTES (16 * 2 + 16 * 2 + 32 * 8)
#define SD_Q8_0_PAIR_BYTES (16 * 2 + 32 * 16)
#define SD_Q4_F_PAIR_BYTES (16 * 4 + 16 * 4 + 32 * 8)
#define SD_Q5_F_PAIR_BYTES (16 * 4 + 16 * 4 + 32 * 16)
#define SD_I8_F16_PAIR_BYTES (2 * 16 * 4 + 32 * 16)
#define SD_QK 256 /* weights per K-quant super-block (along K) */
/* bytes of one super-block of a panel pair (16 output rows x 256 k): the header (Q4_K, Q5_K:
 * d[16], dmin[16] fp16, sc[8][16], m[8][16] uint8; Q6_K: d[16] fp16, sc[16][16] int8), then per
 * sub-block of 32 k its quants (Q4_K: 4-bit, 256 bytes; Q5_K: the low 4 bits as Q4_K's, then
 * the 5th bits, 64 bytes; Q6_K: the low 4 bits as Q4_K's, then the high 2 bits, 128 bytes);
 * linear.c and linear_q8.c say how the quants are laid out */
#define SD_Q4_K_HEAD (16 * 2 * 2 + 2 * 8 * 16)
#define SD_Q4_K_PAIR_BYTES (SD_Q4_K_HEAD + 8 * 32 * 8)
#define SD_Q6_K_HEAD (16 * 2 + 16 * 16)
#define SD_Q6_K_SUB (32 * 8 + 32 * 4)
#define SD_Q6_K_PAIR_BYTES (SD_Q6_K_HEAD + 8 * SD_Q6_K_SUB)
#define SD_Q5_K_HEAD SD_Q4_K_HEAD
#define SD_Q5_K_SUB (32 * 8 + 32 * 2)
#define SD_Q5_K_PAIR_BYTES (SD_Q5_K_HEAD + 8 * SD_Q5_K_SUB)

/* the formats laid out for 8-bit activations (linear_q8.c) */
static inline int sd_is_q8(int64_t fmt) {
    return fmt == SD_Q4_1_Q8 || fmt == SD_Q8_0_Q8 || (fmt >= SD_Q4_F_Q8 && fmt <= SD_I8_F16_Q8)
           || fmt == SD_Q4_K_Q8 || fmt == SD_Q6_K_Q8 || fmt == SD_Q5_K_Q8;
}
/* a super-block format (K % 256 == 0) */
static inline int sd_is_kquant(int64_t fmt) { return fmt >= SD_Q4_K && fmt < SD_NUM_FORMATS; }
/* a GGUF block format (K % 32 == 0; the super-block ones K % 256 == 0) */
static inline int sd_is_gguf(int64_t fmt) { return fmt >= SD_Q4_1 && fmt < SD_NUM_FORMATS; }

int sd_cpu_features(void); /* bit 0: AVX2 + FMA + F16C; bit 1: AVX-512 F + BW + VL + DQ */

/* the instruction set of the float-activation GGUF kernels (linear.c): AVX-512 where the CPU
 * has it, unless SPECDEC_NATIVE_ISA is "avx2" or "avx-vnni" (read once per process); both give
 * bitwise the same results */
enum { SD_FLOAT_AVX2 = 0, SD_FLOAT_AVX512 = 1 };
int sd_float_isa(void);

/* the instruction set of the 8-bit-activation kernels (linear_q8.c): the best this CPU has, at
 * most the one SPECDEC_NATIVE_ISA names ("avx2", "avx-vnni", "avx512-vnni"; "amx" or unset: the
 * widest; read once per process): every one
 * gives bitwise the same results */
enum { SD_Q8_AVX2 = 0, SD_Q8_AVXVNNI = 1, SD_Q8_AVX512VNNI = 2, SD_Q8_AMX = 3 };
int sd_q8_isa(void);

/* One prepared weight: `panels` panels (an even number) of 8 output rows in format `fmt`;
 * `out` real output rows (<= 8 * panels); bias [out] fp32 or NULL. Float formats: [panels][K][8].
 * GGUF formats (K % 32 == 0): [panels / 2][K / 32] blocks of a panel pair (see linear.c).
 *
 * Or a weight in parts (nparts > 0, fmt SD_PARTS, data NULL): a fused matrix (q|k|v, gate|up)
 * whose row ranges are of different formats (a Q4_K_M file's Q4_K q|k and Q6_K v), each part a
 * weight of its own format over the same K, computed in order into its own output columns:
 * part i's columns start at 8 * (panels of parts 0 .. i-1) = the rows before it, since every
 * part but the last is whole panel pairs (out == 8 * panels, so out % 16 == 0). `panels` and
 * `out` are the parts' sums, `bias` the whole matrix's (the parts have none); at most
 * SD_MAX_PARTS parts, none in parts itself, all laid out for the same activations (all SD_*_Q8
 * or none). */
#define SD_PARTS (-1)
#define SD_MAX_PARTS 8
typedef struct sd_weight {
    const void* data;
    int64_t fmt, panels, out;
    const float* bias;
    const struct sd_weight* parts;
    int64_t nparts;
} sd_weight;

/* a mixture-of-experts MLP (moe.c): n_experts experts of width `inter`, top_k a row, each
 * expert's gate|up [2 inter, hidden] and down [hidden, inter] (arrays of n_experts); norm_topk:
 * the top_k weights divided by their sum; shared_inter > 0: qwen2_moe's shared expert and its
 * gate [1, hidden]; woken: where the count of distinct experts the rows routed to is written */
typedef struct sd_moe {
    int64_t n_experts, top_k, inter, norm_topk;
    sd_weight router;
    const sd_weight *gate_up, *down;
    int64_t shared_inter;
    sd_weight shared_gate_up, shared_down, shared_gate;
    int64_t* woken;
} sd_moe;

/* 0 when m is a valid MLP for rows of `hidden`, else -1 */
int sd_moe_check(const sd_moe* m, int64_t hidden);
/* floats of scratch sd_moe_for needs for T rows in a team of nthreads */
int64_t sd_moe_scratch(const sd_moe* m, int64_t T, int64_t hidden, int64_t nthreads);
/* x[T, hidden] += the MLP of h[T, hidden], inside an OpenMP parallel region */
void sd_moe_for(const sd_moe* m, const float* h, int64_t T, int64_t hidden, float* x,
                float* scratch);

/* a GGUF matrix's blocks of type `kind` (repack.c: RK_*) -> its panels in format `fmt`, bitwise
 * specdec/models/gguf_blocks.prepare / q8_activations.prepare (0, or -1: invalid arguments) */
int sd_repack(const uint8_t* rows, int64_t row_stride, int64_t out, int64_t K, int kind,
              int fmt, uint8_t* dst, int nthreads);

/* 0 when w is a valid weight of `K` inputs, else -1 */
int sd_check_weight(const sd_weight* w, int64_t K);

/* y[T, ldy] = x[T, K] @ W.T (columns up to 8 * panels written), as an OpenMP work-sharing loop:
 * call it inside a parallel region (every thread of the team calls it; it ends in a barrier).
 * A weight in parts runs one such loop per part, each into its columns. */
void sd_linear_for(const float* x, int64_t T, int64_t K, const sd_weight* w, float* y,
                   int64_t ldy);

/* sd_linear_for for the formats SD_*_Q8 (activations rounded to 8 bits; every call rounds the
 * rows again, so each part of a weight in parts rounds them anew: the same int8 values and
 * scales each time, a row's rounding depending on that row alone) */
void sd_linear_q8_for(const float* x, int64_t T, int64_t K, const sd_weight* w, float* y,
                      int64_t ldy);

/* out[t, h, :] over the keys key_index[key_indptr[t] .. key_indptr[t + 1]) (cache rows of K; V
 * rows v_offset later), as a work-sharing loop over (row, head); scratch: max_keys floats per
 * thread of the team. */
void sd_attention_for(const float* q, int64_t T, int64_t H, int64_t D, const void* kv,
                      int kv_fmt, int64_t Hkv, int64_t v_offset, const int64_t* key_indptr,
                      const int64_t* key_index, int64_t max_keys, float scale, float* out,
                      float* scratch);

AVX2 static inline __m256 sd_load_f32(const void* w, int64_t i) {
    return _mm256_loadu_ps((const float*)w + i);
}
AVX2 static inline __m256 sd_load_bf16(const void* w, int64_t i) {
    __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)w + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
AVX2 static inline __m256 sd_load_f16(const void* w, int64_t i) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)w + i)));
}
AVX2 static inline float sd_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

#endif
