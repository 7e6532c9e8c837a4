/* Row-invariant attention over per-row key lists.
 *
 * Per (row, head): scores over the row's visible keys in the order given, max, exp, then sums
 * over keys in that order; dot products over head_dim in 8 fixed lanes summed pairwise. A decode
 * row and a tree row over the same keys reduce in the same order, whatever else is in the call.
 */
#include <math.h>
#include <omp.h>

#include "kernels.h"

/* dot over D (D % 8 == 0): 8 lanes, ascending chunks, lanes summed pairwise.
 *
 * Every result is formed by exactly these operations in this order whatever the loop shape
 * around it, so the kernel below may interleave independent sums (four keys' dot products at
 * once; every V column block's sums over the keys at once) to keep the FMA units busy instead of
 * waiting on one accumulator's latency: bitwise the results of one sum at a time. */
#define VB 8 /* V columns per pass: VB accumulators of 8 lanes (64 floats) in registers */
#define ATTEND(NAME, LOADKV)                                                                   \
    AVX2 static inline float NAME##_dot(const float* a, const void* b, int64_t i, int64_t D) { \
        __m256 acc = _mm256_setzero_ps();                                                      \
        for (int64_t d = 0; d < D; d += 8)                                                     \
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), LOADKV(b, i + d), acc);              \
        return sd_hsum8(acc);                                                                  \
    }                                                                                          \
    /* four keys' dot products, each the one above */                                          \
    AVX2 static inline void NAME##_dot4(const float* a, const void* b, const int64_t* at,      \
                                        int64_t D, float* out) {                               \
        __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;                            \
        for (int64_t d = 0; d < D; d += 8) {                                                   \
            const __m256 x = _mm256_loadu_ps(a + d);                                           \
            c0 = _mm256_fmadd_ps(x, LOADKV(b, at[0] + d), c0);                                 \
            c1 = _mm256_fmadd_ps(x, LOADKV(b, at[1] + d), c1);                                 \
            c2 = _mm256_fmadd_ps(x, LOADKV(b, at[2] + d), c2);                                 \
            c3 = _mm256_fmadd_ps(x, LOADKV(b, at[3] + d), c3);                                 \
        }                                                                                      \
        out[0] = sd_hsum8(c0), out[1] = sd_hsum8(c1), out[2] = sd_hsum8(c2);                   \
        out[3] = sd_hsum8(c3);                                                                 \
    }                                                                                          \
    /* one (row, head): scores over its keys in the given order, max, exp, sums in order */  \
    AVX2 static void NAME##_row(const float* q, const void* kv, int64_t base,                 \
                                int64_t v_offset, const int64_t* keys, int64_t n, int64_t Hkv,\
                                int64_t D, float scale, float* out, float* s) {                \
        float m = -INFINITY;                                                                   \
        int64_t j = 0;                                                                         \
        for (; j + 4 <= n; j += 4) {                                                           \
            const int64_t at[4] = {base + keys[j] * Hkv * D, base + keys[j + 1] * Hkv * D,     \
                                   base + keys[j + 2] * Hkv * D, base + keys[j + 3] * Hkv * D};\
            float dots[4];                                                                     \
            NAME##_dot4(q, kv, at, D, dots);                                                   \
            for (int u = 0; u < 4; u++) {                                                      \
                s[j + u] = scale * dots[u];                                                    \
                m = s[j + u] > m ? s[j + u] : m;                                               \
            }                                                                                  \
        }                                                                                      \
        for (; j < n; j++) {                                                                   \
            s[j] = scale * NAME##_dot(q, kv, base + keys[j] * Hkv * D, D);                     \
            m = s[j] > m ? s[j] : m;                                                           \
        }                                                                                      \
        float l = 0.0f;                                                                        \
        for (j = 0; j < n; j++) {                                                              \
            s[j] = expf(s[j] - m);                                                             \
            l += s[j];                                                                         \
        }                                                                                      \
        const __m256 inv_l = _mm256_set1_ps(l);                                                \
        for (int64_t d0 = 0; d0 < D; d0 += 8 * VB) {                                           \
            const int nb = (int)((D - d0) / 8 < VB ? (D - d0) / 8 : VB);                       \
            __m256 acc[VB];                                                                    \
            for (int c = 0; c < VB; c++) acc[c] = _mm256_setzero_ps();                         \
            for (j = 0; j < n; j++) {                                                          \
                const __m256 w = _mm256_set1_ps(s[j]);                                         \
                const int64_t row = base + (keys[j] + v_offset) * Hkv * D + d0;                \
                if (nb == VB) {                                                                \
                    for (int c = 0; c < VB; c++)                                               \
                        acc[c] = _mm256_fmadd_ps(w, LOADKV(kv, row + 8 * c), acc[c]);          \
                } else {                                                                       \
                    for (int c = 0; c < nb; c++)                                               \
                        acc[c] = _mm256_fmadd_ps(w, LOADKV(kv, row + 8 * c), acc[c]);          \
                }                                                                              \
            }                                                                                  \
            for (int c = 0; c < nb; c++)                                                       \
                _mm256_storeu_ps(out + d0 + 8 * c, _mm256_div_ps(acc[c], inv_l));              \
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
 * caller does (specdec/native/__init__.py). */
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

static int64_t count_set(const uint8_t* m, int64_t n) {
    int64_t k = 0;
    for (int64_t c = 0; c < n; c++) k += m[c] != 0;
    return k;
}

/* index[n ..] = the K rows of keys 0 .. keys - 1 (those set in m, when m != NULL), a page at a
 * time (no division per key); the new n, or -1 past n_cap */
static int64_t row_keys(const int32_t* pages, int64_t page_size, const uint8_t* m, int64_t keys,
                        int64_t* index, int64_t n, int64_t n_cap) {
    for (int64_t c = 0, p = 0; c < keys; p++) {
        const int64_t row = (int64_t)pages[p] * 2 * page_size - c;
        const int64_t end = keys - c < page_size ? keys : c + page_size;
        if (m && n + end - c <= n_cap) { /* room for every key: branchless */
            for (; c < end; c++) {
                index[n] = row + c;
                n += m[c] != 0;
            }
        } else if (m) {
            for (; c < end; c++)
                if (m[c]) {
                    if (n >= n_cap) return -1;
                    index[n++] = row + c;
                }
        } else {
            if (n + end - c > n_cap) return -1;
            for (; c < end; c++) index[n++] = row + c;
        }
    }
    return n;
}

/* The per-row key lists of a step (specdec/attention/torch_backend.py _KeyLists): for request
 * b (qo[b] query rows over kv[b] keys, its pages kv_indices[kv_indptr[b] ..]), query row r
 * sees key c when masks == NULL or masks[b] == NULL and c <= kv[b] - qo[b] + r (causal), else
 * when masks[b][r * kv[b] + c] != 0 (its [qo, kv] tree mask, row-major). First checks that
 * every request's pages lie within kv_indices (n_indices of them; kv_indptr has B + 1 entries):
 * -2 - b for the first request b whose lengths or pages do not (nothing written), -1 for
 * page_size < 1. Then indptr [T + 1] (T = sum qo) gets the rows' list bounds, *max_keys the
 * longest list (1 when T == 0), and, with index != NULL, index (at most n_cap entries) the K
 * cache rows (page * 2 * page_size + offset) row after row, keys ascending. Returns the total
 * count. Call it once with index NULL to size index, then again to fill it. */
int64_t sd_key_lists(int64_t B, const int64_t* qo, const int64_t* kv, const int32_t* kv_indptr,
                     const int32_t* kv_indices, int64_t n_indices, int64_t page_size,
                     const uint8_t* const* masks, int64_t* indptr, int64_t* index,
                     int64_t n_cap, int64_t* max_keys) {
    if (page_size < 1) return -1;
    for (int64_t b = 0; b < B; b++) {
        const int64_t pages = kv[b] > 0 ? (kv[b] + page_size - 1) / page_size : 0;
        if (qo[b] < 0 || kv[b] < 0 || kv_indptr[b] < 0 || kv_indptr[b] + pages > kv_indptr[b + 1]
            || kv_indptr[b + 1] > n_indices)
            return -2 - b;
    }
    int64_t t = 0, n = 0, longest = 0;
    indptr[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        const int32_t* pages = kv_indices + kv_indptr[b];
        const uint8_t* mask = masks ? masks[b] : NULL;
        for (int64_t r = 0; r < qo[b]; r++, t++) {
            const uint8_t* m = mask ? mask + r * kv[b] : NULL;
            const int64_t keys = m ? kv[b] : kv[b] - qo[b] + r + 1, c0 = n; /* 0 .. keys - 1 */
            if (index)
                n = row_keys(pages, page_size, m, keys, index, n, n_cap);
            else if (m)
                n += count_set(m, keys);
            else
                n += keys > 0 ? keys : 0;
            if (n < 0) return -1; /* more than n_cap */
            indptr[t + 1] = n;
            longest = n - c0 > longest ? n - c0 : longest;
        }
    }
    *max_keys = t ? longest : 1;
    return n;
}

/* out [2S] = the cache rows of slots [S] (specdec/attention/kv_rows.py kv_write_index, floor
 * division as torch's): the K rows, then the V rows (page_size later). -1 for page_size < 1. */
int sd_write_index(int64_t S, const int64_t* slots, int64_t page_size, int64_t* out) {
    if (page_size < 1) return -1;
    for (int64_t i = 0; i < S; i++) {
        const int64_t s = slots[i];
        const int64_t page = s >= 0 ? s / page_size : -((-s + page_size - 1) / page_size);
        out[i] = page * 2 * page_size + (s - page * page_size);
        out[S + i] = out[i] + page_size;
    }
    return 0;
}
