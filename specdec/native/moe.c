/* A mixture-of-experts MLP (qwen3_moe, mixtral, qwen2_moe) inside sd_layer's OpenMP team,
 * row-invariant: the layer's MLP when sd_layer_args.moe is set (layer.c).
 *
 *   probs   = softmax(router h)                       float32, over all experts
 *   e, w    = the top_k of probs, ties to the lowest expert; w /= sum(w) when norm_topk
 *   out     = sum over the row's k experts, in increasing expert index, of w * down_e(silu(gate_e h) * up_e h)
 *           (+ sigmoid(shared_gate h) * shared(h)   qwen2_moe's shared expert)
 *
 * (specdec/models/decoder/moe.py is the same MLP as torch ops, the framework path, for
 * whatever these kernels do not run; its docstring says what each family computes.)
 *
 * Row invariance: every linear runs through sd_linear_for (row-invariant) over the rows routed
 * to one expert, gathered in increasing row order; each product is written into the row's own
 * slot (t, s), s its rank among its experts; the slots are summed in slot order. Nothing a row
 * computes depends on which or how many rows share its experts.
 *
 * Only the experts some row routes to are streamed: the step's cost is that of the experts it
 * wakes, whose count per layer is written to `woken` (the goodput controller prices trees by it).
 */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "kernels.h"

static int64_t cols(const sd_weight* w) { return PW * w->panels; }

static int64_t most(int64_t a, int64_t b) { return a > b ? a : b; }

/* the widest gate|up and down outputs and intermediate of any expert, the shared one too */
static void widths(const sd_moe* m, int64_t* ldg, int64_t* ldd, int64_t* inter) {
    *ldg = *ldd = 0, *inter = m->inter;
    for (int64_t e = 0; e < m->n_experts; e++)
        *ldg = most(*ldg, cols(&m->gate_up[e])), *ldd = most(*ldd, cols(&m->down[e]));
    if (m->shared_inter)
        *ldg = most(*ldg, cols(&m->shared_gate_up)), *ldd = most(*ldd, cols(&m->shared_down)),
        *inter = most(*inter, m->shared_inter);
}

int64_t sd_moe_scratch(const sd_moe* m, int64_t T, int64_t hidden, int64_t nthreads) {
    int64_t ldg, ldd, inter;
    widths(m, &ldg, &ldd, &inter);
    const int64_t k = m->top_k, sg = m->shared_inter ? cols(&m->shared_gate) : 0;
    /* logits, route weights, slots, shared gate, a thread's rows gathered, gate|up, act and y
     * for each thread; then (64-byte aligned, 16 floats of slack) the ints: route experts
     * [T k], each expert's start [E + 1], entries [T k], two floats' room each */
    return T * (cols(&m->router) + k + k * hidden + sg + nthreads * (hidden + ldg + inter + ldd))
           + 2 * (T * k + m->n_experts + 1 + T * k) + 16;
}

int sd_moe_check(const sd_moe* m, int64_t hidden) {
    if (m->n_experts < 1 || m->top_k < 1 || m->top_k > m->n_experts || m->inter < 1
        || m->router.out != m->n_experts || sd_check_weight(&m->router, hidden)
        || !m->gate_up || !m->down || !m->woken || m->shared_inter < 0)
        return -1;
    for (int64_t e = 0; e < m->n_experts; e++)
        if (m->gate_up[e].out != 2 * m->inter || m->down[e].out != hidden
            || sd_check_weight(&m->gate_up[e], hidden) || sd_check_weight(&m->down[e], m->inter))
            return -1;
    if (m->shared_inter
        && (m->shared_gate_up.out != 2 * m->shared_inter || m->shared_down.out != hidden
            || m->shared_gate.out != 1 || sd_check_weight(&m->shared_gate_up, hidden)
            || sd_check_weight(&m->shared_down, m->shared_inter)
            || sd_check_weight(&m->shared_gate, hidden)))
        return -1;
    return 0;
}

static float silu(float g) { return g / (1.0f + expf(-g)); }

/* one row's routing: its k experts in increasing index (ex) and their weights (w) */
static void route(const float* logits, int64_t E, int64_t k, int64_t norm, float* probs,
                  int64_t* ex, float* w) {
    float mx = logits[0];
    for (int64_t i = 1; i < E; i++) mx = logits[i] > mx ? logits[i] : mx;
    float sum = 0.0f;
    for (int64_t i = 0; i < E; i++) sum += probs[i] = expf(logits[i] - mx);
    for (int64_t i = 0; i < E; i++) probs[i] /= sum;
    /* the k largest in descending order, ties to the lowest index (a strict >) */
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t i = 0; i < E; i++) {
            int taken = 0;
            for (int64_t q = 0; q < j; q++) taken |= ex[q] == i;
            if (!taken && (best < 0 || probs[i] > probs[best])) best = i;
        }
        ex[j] = best, w[j] = probs[best];
    }
    if (norm) {
        float s = 0.0f;
        for (int64_t j = 0; j < k; j++) s += w[j];
        for (int64_t j = 0; j < k; j++) w[j] /= s;
    }
    for (int64_t j = 1; j < k; j++) /* into increasing expert index (distinct: no ties) */
        for (int64_t q = j; q > 0 && ex[q - 1] > ex[q]; q--) {
            const int64_t te = ex[q]; ex[q] = ex[q - 1]; ex[q - 1] = te;
            const float tw = w[q]; w[q] = w[q - 1]; w[q - 1] = tw;
        }
}

/* one expert over its n rows (entries en: t * k + s), each product weighted into its slot:
 * as a work-sharing loop of the calling team (every thread calls it), whatever its size */
static void expert_for(const sd_moe* m, int64_t e, const int64_t* en, int64_t n, const float* h,
                       const float* rw, int64_t Hd, float* xe, float* gu, float* act, float* y,
                       float* slots) {
    const int64_t k = m->top_k, I = m->inter;
    const int64_t lg = cols(&m->gate_up[e]), ld = cols(&m->down[e]);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; i++) memcpy(xe + i * Hd, h + en[i] / k * Hd, Hd * sizeof(float));
    sd_linear_for(xe, n, Hd, &m->gate_up[e], gu, lg);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < I; j++) act[i * I + j] = silu(gu[i * lg + j]) * gu[i * lg + I + j];
    sd_linear_for(act, n, I, &m->down[e], y, ld);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float wt = rw[en[i]];
        float* s = slots + en[i] * Hd;
        for (int64_t j = 0; j < Hd; j++) s[j] = y[i * ld + j] * wt;
    }
}

/* x[T, hidden] += the MLP of h[T, hidden] (the post-attention-normed rows); call it inside an
 * OpenMP parallel region (every thread of the team calls it). scratch: sd_moe_scratch floats
 * for the team's size.
 *
 * Where a step wakes at least two experts a thread, each thread runs whole experts (dynamic
 * schedule; every linear of an expert on that thread alone, in a team of one): it streams its
 * experts back to back, no barrier between them. Fewer woken experts are run one after another,
 * each linear shared by the team (its panels split). Either way an expert's rows get the same
 * bits: a linear's output element is one thread's fixed-order sum, whichever thread. */
void sd_moe_for(const sd_moe* m, const float* h, int64_t T, int64_t Hd, float* x,
                float* scratch) {
    const int64_t E = m->n_experts, k = m->top_k, ldr = cols(&m->router);
    const int64_t nth = omp_get_num_threads();
    int64_t ldg, ldd, inter;
    widths(m, &ldg, &ldd, &inter);
    const int64_t lsg = m->shared_inter ? cols(&m->shared_gate) : 0;
    float* logits = scratch;            /* [T, ldr] router output, then each row's probs */
    float* rw = logits + T * ldr;       /* [T, k] route weights */
    float* slots = rw + T * k;          /* [T, k, Hd] */
    float* sg = slots + T * k * Hd;     /* [T, lsg] the shared expert's gate */
    float* own = sg + T * lsg;          /* per thread: rows [T, Hd], gu [T, ldg], act, y */
    const int64_t per = T * (Hd + ldg + inter + ldd);
    int64_t* rex = (int64_t*)(((uintptr_t)(own + nth * per) + 63) & ~(uintptr_t)63); /* [T, k] */
    int64_t* start = rex + T * k;       /* [E + 1] each expert's entries */
    int64_t* entry = start + E + 1;     /* [T k] t * k + s, by expert, rows increasing */

    sd_linear_for(h, T, Hd, &m->router, logits, ldr);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++)
        route(logits + t * ldr, E, k, m->norm_topk, logits + t * ldr, rex + t * k, rw + t * k);
#pragma omp single
    {
        for (int64_t e = 0; e <= E; e++) start[e] = 0;
        for (int64_t i = 0; i < T * k; i++) start[rex[i] + 1]++;
        int64_t woken = 0;
        for (int64_t e = 0; e < E; e++) woken += start[e + 1] > 0, start[e + 1] += start[e];
        *m->woken = woken;
        for (int64_t e = 0; e < E; e++) { /* rows in increasing order: a row's entries follow */
            int64_t n = start[e];
            for (int64_t i = 0; i < T * k; i++)
                if (rex[i] == e) entry[n++] = i;
        }
    } /* (single's barrier: every thread sees the lists) */
    if (*m->woken >= 2 * nth && nth > 1) {
        float* mine = own + omp_get_thread_num() * per;
#pragma omp for schedule(dynamic, 1)
        for (int64_t e = 0; e < E; e++) {
            const int64_t n = start[e + 1] - start[e];
            if (!n) continue;
#pragma omp parallel num_threads(1)
            expert_for(m, e, entry + start[e], n, h, rw, Hd, mine, mine + T * Hd,
                       mine + T * (Hd + ldg), mine + T * (Hd + ldg + inter), slots);
        }
    } else {
        for (int64_t e = 0; e < E; e++)
            if (start[e + 1] > start[e])
                expert_for(m, e, entry + start[e], start[e + 1] - start[e], h, rw, Hd, own,
                           own + T * Hd, own + T * (Hd + ldg), own + T * (Hd + ldg + inter),
                           slots);
    }
    float* gu = own + T * Hd;
    float* act = gu + T * ldg;
    float* y = act + T * inter;
    if (m->shared_inter) {
        const int64_t SI = m->shared_inter, lg = cols(&m->shared_gate_up);
        const int64_t ld = cols(&m->shared_down);
        sd_linear_for(h, T, Hd, &m->shared_gate, sg, lsg);
        sd_linear_for(h, T, Hd, &m->shared_gate_up, gu, lg);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < SI; j++)
                act[t * SI + j] = silu(gu[t * lg + j]) * gu[t * lg + SI + j];
        sd_linear_for(act, T, SI, &m->shared_down, y, ld);
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float* s = slots + t * k * Hd;
        const float g = m->shared_inter ? 1.0f / (1.0f + expf(-sg[t * lsg])) : 0.0f;
        const int64_t ld = m->shared_inter ? cols(&m->shared_down) : 0;
        for (int64_t j = 0; j < Hd; j++) {
            float o = s[j];
            for (int64_t q = 1; q < k; q++) o += s[q * Hd + j];
            if (m->shared_inter) o += g * y[t * ld + j];
            x[t * Hd + j] += o;
        }
    }
}
