/* Row-invariant attention over per-row key lists.
 *
 * Per (row, head): scores over the row's visible keys in the order given, max, exp, then sums
 * over keys in that order; dot products over head_dim in 8 fixed lanes summed pairwise. A decode
 * row and a tree row over the same keys reduce in the same order, whatever else is in the call.
 */
#include <math.h>
#include <omp.h>

#include "kernels.h"

/* dot over D (D % 8 == 0): 8 lanes, ascending chunks, lanes summed pairwise */
#define ATTEND(NAME, LOADKV)                                                                   \
    AVX2 static inline float NAME##_dot(const float* a, const void* b, int64_t i, int64_t D) { \
        __m256 acc = _mm256_setzero_ps();                                                      \
        for (int64_t d = 0; d < D; d += 8)                                                     \
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), LOADKV(b, i + d), acc);              \
        return sd_hsum8(acc);                                                                  \
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
ATTEND(att_f32, sd_load_f32)
ATTEND(att_bf16, sd_load_bf16)
ATTEND(att_f16, sd_load_f16)

typedef void (*attend_fn)(const float*, const void*, int64_t, int64_t, const int64_t*, int64_t,
                          int64_t, int64_t, float, float*, float*);
static const attend_fn ATTEND_TABLE[SD_NUM_FLOAT_FORMATS] = {att_f32_row, att_bf16_row, att_f16_row};

void sd_attention_for(const float* q, int64_t T, int64_t H, int64_t D, const void* kv,
                      int kv_fmt, int64_t Hkv, int64_t v_offset, const int64_t* key_indptr,
                      const int64_t* key_index, int64_t max_keys, float scale, float* out,
                      float* scratch) {
    const int64_t group = H / Hkv;
    const attend_fn attend = ATTEND_TABLE[kv_fmt];
#pragma omp for schedule(static)
    for (int64_t th = 0; th < T * H; th++) {
        const int64_t t = th / H, h = th % H;
        const int64_t a = key_indptr[t], n = key_indptr[t + 1] - a;
        float* s = scratch + (int64_t)omp_get_thread_num() * max_keys;
        attend(q + (t * H + h) * D, kv, (h / group) * D, v_offset, key_index + a, n, Hkv, D,
               scale, out + (t * H + h) * D, s);
    }
}

/* out[t, h, :] = softmax(scale * q[t, h] . K[j]) @ V[j] over the keys j of row t:
 * key_index[key_indptr[t] .. key_indptr[t + 1]) are rows of `kv` (K rows; V rows sit at
 * + v_offset rows), in the order the sums run. q [T, H, D] fp32, kv rows [*, Hkv, D] of format
 * kv_fmt (0 f32, 1 bf16, 2 f16), out [T, H, D] fp32; head h reads kv head h / (H / Hkv).
 * scratch: nthreads * max_keys floats. T == 0 writes nothing and succeeds. Returns 0, or -1
 * (nothing written). The key lists are not checked here (their lengths are not known): the
 * caller does (specdec/models/native.py). */
int sd_attention(const float* q, int64_t T, int64_t H, int64_t D, const void* kv, int kv_fmt,
                 int64_t Hkv, int64_t v_offset, const int64_t* key_indptr,
                 const int64_t* key_index, int64_t max_keys, float scale, float* out,
                 float* scratch, int nthreads) {
    if (!(sd_cpu_features() & 1) || T < 0 || H < 1 || Hkv < 1 || H % Hkv || D < 8 || D % 8
        || kv_fmt < 0 || kv_fmt >= SD_NUM_FLOAT_FORMATS || v_offset < 0 || max_keys < 0
        || nthreads < 1)
        return -1;
    if (T == 0) return 0;
    if (!q || !kv || !key_indptr || !key_index || !out || !scratch) return -1;
#pragma omp parallel num_threads(nthreads)
    sd_attention_for(q, T, H, D, kv, kv_fmt, Hkv, v_offset, key_indptr, key_index, max_keys,
                     scale, out, scratch);
    return 0;
}

/* Whether key lists can be read: -1 when key_indptr [T + 1] is non-decreasing from >= 0 to
 * <= n_index and each row's keys (at most max_keys of them) name K rows in 0 .. rows - 1 (the
 * caller passes the cache's rows less v_offset, so the V rows exist too); else the first row t
 * whose list cannot. O(T + keys): cheap beside the attention over them. */
int64_t sd_check_keys(int64_t T, const int64_t* key_indptr, const int64_t* key_index,
                      int64_t n_index, int64_t max_keys, int64_t rows) {
    if (T > 0 && (key_indptr[0] < 0 || key_indptr[0] > n_index)) return 0;
    for (int64_t t = 0; t < T; t++) {
        const int64_t a = key_indptr[t], b = key_indptr[t + 1];
        if (b < a || b > n_index || b - a > max_keys) return t;
        for (int64_t j = a; j < b; j++)
            if (key_index[j] < 0 || key_index[j] >= rows) return t;
    }
    return -1;
}

/* The per-row key lists of a step (specdec/attention/torch_backend.py _KeyLists): for request
 * b (qo[b] query rows over kv[b] keys, its pages kv_indices[kv_indptr[b] ..]), query row r
 * sees key c when mask_offset[b] < 0 and c <= kv[b] - qo[b] + r (causal), else when
 * masks[mask_offset[b] + r * kv[b] + c] != 0 (its tree mask). counts[t] (T = sum qo) gets each
 * row's count; with index != NULL, index gets the K cache rows (page * 2 * page_size + offset)
 * row after row, keys ascending. Returns the total count. */
int64_t sd_key_lists(int64_t B, const int64_t* qo, const int64_t* kv, const int32_t* kv_indptr,
                     const int32_t* kv_indices, int64_t page_size, const int64_t* mask_offset,
                     const uint8_t* masks, int64_t* counts, int64_t* index) {
    int64_t t = 0, n = 0;
    if (page_size < 1) return -1; /* the caller checks every length (native.py key_lists) */
    for (int64_t b = 0; b < B; b++) {
        const int32_t* pages = kv_indices + kv_indptr[b];
        for (int64_t r = 0; r < qo[b]; r++, t++) {
            const uint8_t* m = mask_offset[b] < 0 ? NULL : masks + mask_offset[b] + r * kv[b];
            const int64_t last = m ? kv[b] - 1 : kv[b] - qo[b] + r;
            int64_t c0 = n;
            for (int64_t c = 0; c <= last; c++) {
                if (m && !m[c]) continue;
                if (index) index[n] = (int64_t)pages[c / page_size] * 2 * page_size + c % page_size;
                n++;
            }
            counts[t] = n - c0;
        }
    }
    return n;
}
