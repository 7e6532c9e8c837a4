/* specdec's CPU kernels: row-invariant linear layers and attention (see specdec/models/native.py).
 *
 * Row invariance is the contract: the output of a row is bitwise the same whatever other rows
 * share the call, because every reduction runs in one fixed order per output element:
 *
 *   linear     y[t, n] = fma chain over k = 0 .. K-1 in ascending order, from 0, then + bias.
 *              Weights are prepared once into panels of 8 output rows ([panels][K][8], an
 *              even number of panels: the microkernel takes two at a time), so
 *              one weight panel is streamed from memory once for every row of the call (rows
 *              are tiled by 4 in registers; the tile size does not touch any element's order).
 *   attention  per (row, head): scores over the row's visible keys in the order given, max,
 *              exp, then sums over keys in that order; dot products over head_dim in 8 fixed
 *              lanes summed pairwise.
 *
 * Vector code is compiled per function for the ISA it needs (target attributes), never with
 * -march=native, and chosen at run time (sd_cpu_features); the Python side falls back to its
 * pure-torch reference path where a function reports no support. Threads: OpenMP (the libgomp
 * torch already loaded), over output panels or (row, head) pairs.
 */
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#define SD_ABI 2
#define PW 8 /* panel width: output rows per weight panel */

int sd_abi_version(void) { return SD_ABI; }

/* bit 0: AVX2 + FMA (+ F16C) */
int sd_cpu_features(void) {
    __builtin_cpu_init();
    int f = 0;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) f |= 1;
    return f;
}

/* ---- linear ------------------------------------------------------------------------------ */

#define AVX2 __attribute__((target("avx2,fma,f16c")))

AVX2 static inline __m256 load_f32(const void* w, int64_t i) {
    return _mm256_loadu_ps((const float*)w + i);
}
AVX2 static inline __m256 load_bf16(const void* w, int64_t i) {
    __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)w + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
AVX2 static inline __m256 load_f16(const void* w, int64_t i) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)w + i)));
}

/* R rows x[0 .. R-1] (row stride K) times the panel pair p0, p0 + 1 -> y rows. The
 * accumulators are named registers (an array of them is kept on the stack by gcc). */
#define ROW(r) const __m256 xb##r = _mm256_broadcast_ss(x + r * K + k);                        \
    a##r = _mm256_fmadd_ps(xb##r, w0, a##r);                                                   \
    b##r = _mm256_fmadd_ps(xb##r, w1, b##r);
#define STORE(r) _mm256_storeu_ps(y + r * ldy + p0 * PW, a##r);                                \
    _mm256_storeu_ps(y + r * ldy + (p0 + 1) * PW, b##r);
#define ZERO(r) __m256 a##r = _mm256_setzero_ps(), b##r = _mm256_setzero_ps();
#define MICRO(NAME, LOADW, R, EACH)                                                            \
    AVX2 static void NAME##_r##R(const float* x, int64_t K, const void* w, int64_t p0,        \
                                 float* y, int64_t ldy) {                                     \
        EACH(ZERO)                                                                             \
        const int64_t o0 = p0 * K * PW, o1 = (p0 + 1) * K * PW;                                \
        for (int64_t k = 0; k < K; k++) {                                                      \
            const __m256 w0 = LOADW(w, o0 + k * PW), w1 = LOADW(w, o1 + k * PW);               \
            EACH(ROW)                                                                          \
        }                                                                                      \
        EACH(STORE)                                                                            \
    }
#define EACH1(F) F(0)
#define EACH2(F) F(0) F(1)
#define EACH3(F) F(0) F(1) F(2)
#define EACH4(F) F(0) F(1) F(2) F(3)

#define MICROS(NAME, LOADW)                                                  \
    MICRO(NAME, LOADW, 1, EACH1) MICRO(NAME, LOADW, 2, EACH2) MICRO(NAME, LOADW, 3, EACH3) \
    MICRO(NAME, LOADW, 4, EACH4)
MICROS(f32, load_f32)
MICROS(bf16, load_bf16)
MICROS(f16, load_f16)

typedef void (*micro_fn)(const float*, int64_t, const void*, int64_t, float*, int64_t);
static const micro_fn MICRO_TABLE[3][4] = {
    {f32_r1, f32_r2, f32_r3, f32_r4},
    {bf16_r1, bf16_r2, bf16_r3, bf16_r4},
    {f16_r1, f16_r2, f16_r3, f16_r4},
};

/* y[T, ldy] = x[T, K] @ W.T for W prepared as `panels` panels (an even number) of format `fmt`
 * (0 f32, 1 bf16, 2 f16); columns up to 8 * panels are written (ldy >= 8 * panels). Returns 0,
 * or -1 when this CPU lacks AVX2/FMA or the arguments are invalid (nothing written). */
int sd_linear(const float* x, int64_t T, int64_t K, const void* w, int fmt, int64_t panels,
              float* y, int64_t ldy, int nthreads) {
    if (!(sd_cpu_features() & 1) || fmt < 0 || fmt > 2 || T < 0 || K < 1 || ldy < PW * panels
        || panels % 2)
        return -1;
    const micro_fn* micro = MICRO_TABLE[fmt];
    const int64_t pairs = panels / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t q = 0; q < pairs; q++) {
        for (int64_t t = 0; t < T; t += 4) {
            const int64_t r = T - t < 4 ? T - t : 4;
            micro[r - 1](x + t * K, K, w, 2 * q, y + t * ldy, ldy);
        }
    }
    return 0;
}

/* ---- attention --------------------------------------------------------------------------- */

AVX2 static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* dot over D (D % 8 == 0): 8 lanes, ascending chunks, lanes summed pairwise */
#define ATTEND(NAME, LOADKV)                                                                   \
    AVX2 static inline float NAME##_dot(const float* a, const void* b, int64_t i, int64_t D) { \
        __m256 acc = _mm256_setzero_ps();                                                      \
        for (int64_t d = 0; d < D; d += 8)                                                     \
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), LOADKV(b, i + d), acc);              \
        return hsum8(acc);                                                                     \
    }                                                                                          \
    /* one (row, head): scores over its keys in the given order, max, exp, sums in order */  \
    AVX2 static void NAME##_row(const float* q, const void* kv, int64_t base,                 \
                                int64_t v_offset, const int64_t* keys, int64_t n, int64_t Hkv,\
                                int64_t D, float scale, float* out, float* s) {                \
        float m = -INFINITY;                                                                   \
        for (int64_t j = 0; j < n; j++) {                                                      \
            s[j] = scale * NAME##_dot(q, kv, base + keys[j] * Hkv * D, D);                     \
            m = s[j] > m ? s[j] : m;                                                           \
        }                                                                                      \
        float l = 0.0f;                                                                        \
        for (int64_t j = 0; j < n; j++) {                                                      \
            s[j] = expf(s[j] - m);                                                             \
            l += s[j];                                                                         \
        }                                                                                      \
        for (int64_t d = 0; d < D; d += 8) {                                                   \
            __m256 acc = _mm256_setzero_ps();                                                  \
            for (int64_t j = 0; j < n; j++) {                                                  \
                const __m256 v = LOADKV(kv, base + (keys[j] + v_offset) * Hkv * D + d);        \
                acc = _mm256_fmadd_ps(_mm256_set1_ps(s[j]), v, acc);                           \
            }                                                                                  \
            _mm256_storeu_ps(out + d, _mm256_div_ps(acc, _mm256_set1_ps(l)));                  \
        }                                                                                      \
    }
ATTEND(att_f32, load_f32)
ATTEND(att_bf16, load_bf16)
ATTEND(att_f16, load_f16)

typedef void (*attend_fn)(const float*, const void*, int64_t, int64_t, const int64_t*, int64_t,
                          int64_t, int64_t, float, float*, float*);
static const attend_fn ATTEND_TABLE[3] = {att_f32_row, att_bf16_row, att_f16_row};

/* out[t, h, :] = softmax(scale * q[t, h] . K[j]) @ V[j] over the keys j of row t:
 * key_index[key_indptr[t] .. key_indptr[t + 1]) are rows of `kv` (K rows; V rows sit at
 * + v_offset rows), in the order the sums run. q [T, H, D] fp32, kv rows [*, Hkv, D] of format
 * kv_fmt (0 f32, 1 bf16, 2 f16), out [T, H, D] fp32; head h reads kv head h / (H / Hkv).
 * scratch: nthreads * max_keys floats. Returns 0, or -1 (nothing written). */
int sd_attention(const float* q, int64_t T, int64_t H, int64_t D, const void* kv, int kv_fmt,
                 int64_t Hkv, int64_t v_offset, const int64_t* key_indptr,
                 const int64_t* key_index, int64_t max_keys, float scale, float* out,
                 float* scratch, int nthreads) {
    if (!(sd_cpu_features() & 1) || D % 8 || H % Hkv || T < 0 || kv_fmt < 0 || kv_fmt > 2)
        return -1;
    const int64_t group = H / Hkv;
    const attend_fn attend = ATTEND_TABLE[kv_fmt];
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t th = 0; th < T * H; th++) {
        const int64_t t = th / H, h = th % H;
        const int64_t a = key_indptr[t], n = key_indptr[t + 1] - a;
        float* s = scratch + (int64_t)omp_get_thread_num() * max_keys;
        attend(q + (t * H + h) * D, kv, (h / group) * D, v_offset, key_index + a, n, Hkv, D,
               scale, out + (t * H + h) * D, s);
    }
    return 0;
}

/* ---- an importable module (the functions above are called through ctypes) --------------- */

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_kernels",
                                    "specdec's CPU kernels (called through ctypes)", -1, NULL};
PyMODINIT_FUNC PyInit__cpu_kernels(void) { return PyModule_Create(&module); }
