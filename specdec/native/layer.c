/* One decoder layer (pre-norm attention + SwiGLU) in one call, row-invariant.
 *
 *   x += o(attention(rope(norm_q(q)), rope(norm_k(k)), v))   q, k, v = qkv(rmsnorm(x)) + bias
 *   x += down(silu(gate) * up)                              gate, up = gate_up(rmsnorm(x))
 *
 * or, given moe (a mixture-of-experts layer), x += moe(rmsnorm(x)) (moe.c: the routed experts
 * and a shared one), gate_up and down unused;
 *
 * or, given qkv_input (an EAGLE head's layer: [embedding; feature] normed by the caller),
 * q, k, v = qkv(qkv_input) + bias, the rest the same (x is then the residual stream only).
 *
 * Activations are fp32 throughout (the residual stream too); weights are prepared panels of
 * any format linear.c takes, or in parts of different formats (kernels.h: a Q4_K_M file's Q4_K
 * q|k beside its Q6_K v; each part's columns are its rows, so q, k, v and gate, up sit where
 * one matrix would put them); K/V are rounded to the cache's format as they are written. Each
 * stage is a work-sharing loop of one OpenMP team (the barriers between them are the loops'
 * own): per-row stages over rows, linear layers over weight panels, attention over (row, head).
 * Every reduction runs in one fixed order per output element (RMSNorm: 8 lanes over ascending
 * chunks, then the tail), so a row's output does not depend on the other rows of the call.
 * This replaces ~25 framework ops per layer (their dispatch cost was ~40 % of a one-row step).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

typedef struct {
    int64_t T, hidden, heads, kv_heads, head_dim, inter;
    float eps, scale;
    sd_weight qkv, o, gate_up, down;
    const float *input_norm, *post_norm, *q_norm, *k_norm; /* fp32; q/k: NULL unless qk_norm */
    float* x;                                             /* [T, hidden], updated in place */
    const float *cos, *sin;                               /* [T, head_dim] */
    void* kv;                          /* the layer's cache rows [*, kv_heads, head_dim] */
    int64_t kv_fmt, page_size;         /* V row = K row + page_size */
    const int64_t* write_index;        /* [2T]: the K rows of this step's rows, then V rows */
    const int64_t *key_indptr, *key_index;
    int64_t max_keys;
    float* scratch; /* sd_layer_scratch(args) floats */
    int64_t nthreads;
    const float* qkv_input; /* [T, qkv_in] or NULL: the qkv projection's input, else rmsnorm(x) */
    int64_t qkv_in;
    const sd_moe* moe; /* NULL: the dense MLP (gate_up, down) */
} sd_layer_args;

/* columns a projection writes (a weight in parts: its parts', whose panels it sums) */
static int64_t out_cols(const sd_weight* w) { return PW * w->panels; }

/* floats of scratch sd_layer needs for these arguments */
int64_t sd_layer_scratch(const sd_layer_args* a) {
    const int64_t q = a->heads * a->head_dim;
    const int64_t y = out_cols(&a->o) > out_cols(&a->down) ? out_cols(&a->o) : out_cols(&a->down);
    return a->T * (a->hidden + out_cols(&a->qkv) + 2 * q + out_cols(&a->gate_up) + a->inter + y)
           + a->nthreads * (a->max_keys > 0 ? a->max_keys : 1)
           + (a->moe ? sd_moe_scratch(a->moe, a->T, a->hidden, a->nthreads) + 16 : 0);
}

AVX2 static void rmsnorm(const float* x, const float* w, int64_t n, float eps, float* out) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = sd_hsum8(acc);
    for (; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

/* HF's rotate-half: out = x * cos + [-x2, x1] * sin, each product rounded, then the sum */
static void rope(const float* x, const float* c, const float* s, int64_t D, float* out) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        const float ac = a * c[i], bs = -b * s[i];
        const float bc = b * c[i + half], as = a * s[i + half];
        out[i] = ac + bs;
        out[i + half] = bc + as;
    }
}

static uint16_t to_bf16(float f) { /* round to nearest even, NaN kept quiet (as torch) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

AVX2 static void store_row(const float* src, void* kv, int64_t fmt, int64_t offset, int64_t n) {
    if (fmt == SD_F32) {
        memcpy((float*)kv + offset, src, n * sizeof(float));
    } else if (fmt == SD_BF16) {
        for (int64_t i = 0; i < n; i++) ((uint16_t*)kv)[offset + i] = to_bf16(src[i]);
    } else {
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i*)((uint16_t*)kv + offset + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
        for (; i < n; i++) ((uint16_t*)kv)[offset + i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
    }
}

AVX2 static float silu(float g) { return g / (1.0f + expf(-g)); }

/* Runs the layer on a->x. T == 0 writes nothing and succeeds. Returns 0, or -1 when this CPU
 * lacks AVX2/FMA or the arguments are invalid (nothing written). The lengths behind the pointers
 * are not known here: the caller checks them (specdec/models/matmul/fused.py). */
int sd_layer(const sd_layer_args* a) {
    const int64_t T = a->T, Hd = a->hidden, D = a->head_dim, H = a->heads, Hkv = a->kv_heads;
    const int64_t qs = H * D, kvs = Hkv * D, I = a->inter;
    const sd_weight* ws[4] = {&a->qkv, &a->o, &a->gate_up, &a->down};
    if (!(sd_cpu_features() & 1) || T < 0 || Hd < 1 || H < 1 || Hkv < 1 || H % Hkv || D < 8
        || D % 8 || D > 512 || I < 1 || a->kv_fmt < 0 || a->kv_fmt >= SD_NUM_FLOAT_FORMATS
        || a->qkv.out != qs + 2 * kvs || a->o.out != Hd
        || (!a->moe && (a->gate_up.out != 2 * I || a->down.out != Hd))
        || (a->moe && (sd_moe_check(a->moe, Hd) || a->moe->inter != I))
        || a->nthreads < 1 || a->max_keys < 0 || a->page_size < 0)
        return -1;
    const int64_t qkv_k = a->qkv_input ? a->qkv_in : Hd;
    for (int i = 0; i < (a->moe ? 2 : 4); i++)
        if (sd_check_weight(ws[i], i == 3 ? I : (i == 1 ? qs : (i == 0 ? qkv_k : Hd)))) return -1;
    if (T == 0) return 0;
    if (!a->x || !a->cos || !a->sin || !a->kv || !a->write_index || !a->key_indptr
        || !a->key_index || !a->scratch || !a->post_norm || (!a->qkv_input && !a->input_norm))
        return -1;
    const int64_t ldq = out_cols(&a->qkv), ldg = out_cols(&a->gate_up);
    const int64_t ldo = out_cols(&a->o), ldd = out_cols(&a->down);
    float* h = a->scratch;                   /* [T, hidden] normed input of a projection */
    float* qkv = h + T * Hd;                 /* [T, ldq] */
    float* q = qkv + T * ldq;                /* [T, H, D] rotated queries */
    float* att = q + T * qs;                 /* [T, H, D] attention output */
    float* gu = att + T * qs;                /* [T, ldg] */
    float* act = gu + T * ldg;               /* [T, I] */
    float* y = act + T * I;                  /* [T, max(ldo, ldd)] */
    float* keys = y + T * (ldo > ldd ? ldo : ldd); /* nthreads * max_keys */
    const int64_t max_keys = a->max_keys > 0 ? a->max_keys : 1;
    /* the mixture of experts' own (64-byte aligned: 16 floats of slack counted) */
    float* moe = (float*)(((uintptr_t)(keys + a->nthreads * max_keys) + 63) & ~(uintptr_t)63);
#pragma omp parallel num_threads((int)a->nthreads)
    {
        if (a->qkv_input) {
            sd_linear_for(a->qkv_input, T, qkv_k, &a->qkv, qkv, ldq);
        } else {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++)
                rmsnorm(a->x + t * Hd, a->input_norm, Hd, a->eps, h + t * Hd);
            sd_linear_for(h, T, Hd, &a->qkv, qkv, ldq);
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            float* r = qkv + t * ldq;
            if (a->qkv.bias)
                for (int64_t i = 0; i < qs + 2 * kvs; i++) r[i] += a->qkv.bias[i];
            if (a->q_norm)
                for (int64_t i = 0; i < H; i++) rmsnorm(r + i * D, a->q_norm, D, a->eps, r + i * D);
            if (a->k_norm)
                for (int64_t i = 0; i < Hkv; i++)
                    rmsnorm(r + qs + i * D, a->k_norm, D, a->eps, r + qs + i * D);
            const float *c = a->cos + t * D, *s = a->sin + t * D;
            for (int64_t i = 0; i < H; i++) rope(r + i * D, c, s, D, q + (t * H + i) * D);
            float k[512];
            const int64_t krow = a->write_index[t] * kvs, vrow = a->write_index[T + t] * kvs;
            for (int64_t i = 0; i < Hkv; i++) {
                rope(r + qs + i * D, c, s, D, k);
                store_row(k, a->kv, a->kv_fmt, krow + i * D, D);
            }
            store_row(r + qs + kvs, a->kv, a->kv_fmt, vrow, kvs);
        }
        sd_attention_for(q, T, H, D, a->kv, (int)a->kv_fmt, Hkv, a->page_size, a->key_indptr,
                         a->key_index, max_keys, a->scale, att, keys);
        sd_linear_for(att, T, qs, &a->o, y, ldo);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            float* x = a->x + t * Hd;
            for (int64_t i = 0; i < Hd; i++) x[i] += y[t * ldo + i];
            rmsnorm(x, a->post_norm, Hd, a->eps, h + t * Hd);
        }
        if (a->moe) {
            sd_moe_for(a->moe, h, T, Hd, a->x, moe);
        } else {
            sd_linear_for(h, T, Hd, &a->gate_up, gu, ldg);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++)
                for (int64_t i = 0; i < I; i++)
                    act[t * I + i] = silu(gu[t * ldg + i]) * gu[t * ldg + I + i];
            sd_linear_for(act, T, I, &a->down, y, ldd);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++)
                for (int64_t i = 0; i < Hd; i++) a->x[t * Hd + i] += y[t * ldd + i];
        }
    }
    return 0;
}

/* One step's arguments shared by every layer of a model (specdec/models/matmul/fused.py): the rows,
 * their key lists, and the layers' caches, one every kv_stride bytes from kv (layer i's at kv +
 * i * kv_stride), each of kv_rows rows [*, kv_heads, head_dim]. n_keys: key_index's length.
 * qkv_input / qkv_in are the first layer's of the call (sd_layer_args). */
typedef struct {
    int64_t T;
    float* x;
    const float *cos, *sin;
    void* kv;
    int64_t kv_stride, kv_rows, kv_fmt, page_size;
    const int64_t *write_index, *key_indptr, *key_index;
    int64_t n_keys, max_keys, nthreads;
    const float* qkv_input;
    int64_t qkv_in;
} sd_step;

static void step_layer(const sd_layer_args* layer, const sd_step* s, int64_t i, float* scratch,
                       sd_layer_args* a) {
    *a = *layer;
    a->T = scratch ? s->T : 0;
    a->x = s->x, a->cos = s->cos, a->sin = s->sin;
    a->kv = (char*)s->kv + i * s->kv_stride;
    a->kv_fmt = s->kv_fmt, a->page_size = s->page_size;
    a->write_index = s->write_index, a->key_indptr = s->key_indptr, a->key_index = s->key_index;
    a->max_keys = s->max_keys, a->nthreads = s->nthreads, a->scratch = scratch;
    a->qkv_input = i == 0 ? s->qkv_input : NULL;
    a->qkv_in = i == 0 ? s->qkv_in : 0;
}

/* 0 when the rows the step writes and the keys it reads lie in the cache: write_index [2T] in
 * 0 .. kv_rows - 1, key_indptr [T + 1] non-decreasing from >= 0 to <= n_keys with at most
 * max_keys keys a row, every key a K row below kv_rows - page_size (its V row exists); else
 * -2 (a write row) or -3 (a key list). */
static int check_rows(const sd_step* s) {
    uint64_t bad = 0;
    for (int64_t i = 0; i < 2 * s->T; i++) bad |= (uint64_t)s->write_index[i] >= (uint64_t)s->kv_rows;
    if (bad) return -2;
    const int64_t* p = s->key_indptr;
    if (p[0] < 0 || p[s->T] > s->n_keys) return -3;
    for (int64_t t = 0; t < s->T; t++)
        if (p[t + 1] < p[t] || p[t + 1] - p[t] > s->max_keys) return -3;
    if (s->kv_rows < s->page_size) return p[s->T] > p[0] ? -3 : 0; /* no K row has its V */
    const uint64_t limit = (uint64_t)(s->kv_rows - s->page_size);
    for (int64_t j = p[0]; j < p[s->T]; j++) bad |= (uint64_t)s->key_index[j] >= limit;
    return bad ? -3 : 0;
}

/* Runs layers[0 .. n) over one step (x updated in place), the step's scratch allocated here.
 * Every layer's arguments are checked (sd_layer's checks, with no rows) and the step's rows
 * (check_rows) before any layer runs: -1 (sd_layer refuses a layer; n < 0), -2 / -3
 * (check_rows), -4 (no memory) write nothing. The lengths of x, cos, sin, qkv_input,
 * write_index and key_indptr and the caches' sizes are not known here: the caller checks them
 * (specdec/models/matmul/fused.py). */
int sd_layers(const sd_layer_args* layers, int64_t n, const sd_step* s) {
    sd_layer_args a;
    int64_t floats = 0;
    if (n < 0 || s->T < 0 || s->max_keys < 0 || s->nthreads < 1) return -1;
    for (int64_t i = 0; i < n; i++) {
        step_layer(layers + i, s, i, NULL, &a);
        if (sd_layer(&a)) return -1;
        a.T = s->T;
        const int64_t need = sd_layer_scratch(&a);
        floats = need > floats ? need : floats;
    }
    if (s->T == 0 || n == 0) return 0;
    if (!s->write_index || !s->key_indptr || !s->key_index) return -1;
    const int rc = check_rows(s);
    if (rc) return rc;
    /* 64-byte aligned, as torch allocates (the scratch was a torch tensor) */
    float* scratch = aligned_alloc(64, ((size_t)floats * sizeof(float) + 63) / 64 * 64);
    if (!scratch) return -4;
    int rc_layer = 0;
    for (int64_t i = 0; i < n && !rc_layer; i++) {
        step_layer(layers + i, s, i, scratch, &a);
        rc_layer = sd_layer(&a); /* checked above: cannot fail */
    }
    free(scratch);
    return rc_layer;
}
