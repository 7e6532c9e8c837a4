/* The suffix drafter's speculation (drafters/suffix_speculate.py) in C: one call per corpus and
 * step does the lookup of the context's last token, the match lengths, the continuation tries
 * of every match length and the choice of nodes, where numpy needed ~100 small calls.
 *
 * The Python module is the oracle: this file follows it step by step (same occurrences, same
 * node order, same tie breaks, the score summed left to right), so the drafts are identical;
 * tests/drafters/test_suffix_native.py compares the two on random corpora and streams. Called
 * through ctypes (drafters/suffix_native.py); no Python API, no threads, no globals.
 *
 * The corpus (drafters/suffix_corpus.py): buf[0:n] int32 tokens, -1 after each document, -2
 * for removed ones; order/keys [nkeys]: the positions below n_sorted holding a token (>= 0),
 * sorted by (token, position), and their tokens.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SD_SUFFIX_ABI 1
#define SD_SUFFIX_TOUCHED 32 /* suffix_speculate.TOUCHED: latest occurrences returned */

int sd_suffix_abi(void) { return SD_SUFFIX_ABI; }

static int64_t lower_bound(const int32_t *keys, int64_t m, int32_t key) {
    int64_t lo = 0, hi = m;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (keys[mid] < key) lo = mid + 1; else hi = mid;
    }
    return lo;
}

static int64_t upper_bound(const int32_t *keys, int64_t m, int32_t key) {
    int64_t lo = 0, hi = m;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (keys[mid] <= key) lo = mid + 1; else hi = mid;
    }
    return lo;
}

typedef struct {
    const int32_t *buf;
    int64_t n;
    const int32_t *order, *keys;
    int64_t nkeys, n_sorted, dead;
} Corpus;

/* TokenCorpus.positions(token, cap), then those below `before`: written to out (increasing),
 * count returned. out has room for cap. */
static int64_t positions(const Corpus *c, int32_t token, int64_t cap, int64_t before,
                         int64_t *out) {
    int64_t ntail = 0; /* the tail's latest `cap` occurrences, newest first, then reversed */
    for (int64_t j = c->n - 1; j >= c->n_sorted && ntail < cap; j--)
        if (c->buf[j] == token) out[ntail++] = j;
    int64_t more = 0;
    if (ntail < cap) { /* every tail occurrence is taken: the head's latest come first */
        int64_t lo = lower_bound(c->keys, c->nkeys, token);
        int64_t hi = upper_bound(c->keys, c->nkeys, token);
        int64_t from = hi - (cap - ntail) > lo ? hi - (cap - ntail) : lo;
        more = hi - from;
        memmove(out + more, out, (size_t)ntail * sizeof *out);
        int64_t w = 0;
        for (int64_t i = from; i < hi; i++) /* blanked documents stay in order until a sort */
            if (!c->dead || c->buf[c->order[i]] == token) out[w++] = c->order[i];
        if (w < more) memmove(out + w, out + more, (size_t)ntail * sizeof *out);
        more = w;
    }
    for (int64_t a = more, b = more + ntail - 1; a < b; a++, b--) { /* tail: oldest first */
        int64_t t = out[a]; out[a] = out[b]; out[b] = t;
    }
    int64_t k = 0;
    for (int64_t i = 0; i < more + ntail; i++)
        if (out[i] < before) out[k++] = out[i];
    return k;
}

/* Rows of continuations, compared as TokenCorpus.continuations pads them (-1 sorts first). */
static const int64_t *g_rows; /* qsort has no context argument in C11 */
static int64_t g_depth;

static int cmp_rows(const void *a, const void *b) {
    const int64_t *x = g_rows + *(const int64_t *)a * g_depth;
    const int64_t *y = g_rows + *(const int64_t *)b * g_depth;
    for (int64_t d = 0; d < g_depth; d++)
        if (x[d] != y[d]) return x[d] < y[d] ? -1 : 1;
    return 0;
}

typedef struct {
    int64_t *tok, *par, *cnt; /* [cap] each: the trie's kept nodes, depth by depth */
    double *prob;
    int64_t n;
} Trie;

/* count_trie: the nodes with probability >= min_prob, in the order numpy makes them (depth by
 * depth, rows in lexicographic order), parents as kept indices. A node is a run of sorted rows
 * equal through its depth; its count is the run's length. Scratch: perm, prev [k]; diff [k];
 * made [k * depth] (a node made -> its kept index or -1). */
static void count_trie(const int64_t *rows, int64_t k, int64_t depth, double min_prob,
                       int64_t *perm, int64_t *prev, unsigned char *diff, int64_t *made,
                       Trie *t) {
    for (int64_t i = 0; i < k; i++) perm[i] = i;
    g_rows = rows, g_depth = depth;
    qsort(perm, (size_t)k, sizeof *perm, cmp_rows);
    int64_t all = 0;
    t->n = 0;
    for (int64_t d = 0; d < depth; d++) {
        for (int64_t i = 0; i < k; i++) {
            const int64_t *r = rows + perm[i] * depth, *above = rows + perm[i > 0 ? i - 1 : 0] * depth;
            diff[i] = i == 0 || (d > 0 && diff[i]) || r[d] != above[d]; /* through depth d */
            if (r[d] < 0) continue;
            if (!diff[i]) { prev[i] = prev[i - 1]; continue; } /* the node of the row above */
            int64_t count = 1;
            while (i + count < k && !memcmp(rows + perm[i + count] * depth, r, (size_t)(d + 1) * 8))
                count++;
            double p = (double)count / (double)k;
            made[all] = -1;
            if (p >= min_prob) { /* closed under parents: a child never counts more */
                made[all] = t->n;
                t->tok[t->n] = r[d];
                t->par[t->n] = d > 0 ? made[prev[i]] : -1;
                t->cnt[t->n] = count;
                t->prob[t->n] = p;
                t->n++;
            }
            prev[i] = all++;
        }
    }
}

static const double *g_prob;

static int cmp_best(const void *a, const void *b) { /* probability down, then index up */
    int64_t i = *(const int64_t *)a, j = *(const int64_t *)b;
    if (g_prob[i] != g_prob[j]) return g_prob[i] > g_prob[j] ? -1 : 1;
    return i < j ? -1 : (i > j);
}

static int cmp_index(const void *a, const void *b) {
    int64_t i = *(const int64_t *)a, j = *(const int64_t *)b;
    return i < j ? -1 : (i > j);
}

/* _best_nodes (tree) or _best_path into keep; returns how many. */
static int64_t choose(const Trie *t, int64_t budget, int tree, int64_t *keep) {
    if (tree) {
        for (int64_t i = 0; i < t->n; i++) keep[i] = i;
        g_prob = t->prob;
        qsort(keep, (size_t)t->n, sizeof *keep, cmp_best);
        int64_t m = t->n < budget ? t->n : budget;
        qsort(keep, (size_t)m, sizeof *keep, cmp_index);
        return m;
    }
    int64_t m = 0, cur = -1;
    while (m < budget) {
        int64_t best = -1;
        for (int64_t i = 0; i < t->n; i++)
            if (t->par[i] == cur && (best < 0 || t->cnt[i] > t->cnt[best])) best = i;
        if (best < 0) break;
        keep[m++] = cur = best;
    }
    return m;
}

/* speculate(): the best draft after pattern[0:plen] from the occurrences ending before
 * `before`. Writes up to max_nodes nodes (tokens, parents, path probabilities), the latest
 * SD_SUFFIX_TOUCHED occurrences drafted from (ends, increasing), meta = {match length, number
 * of ends} and the score. Returns the node count; 0: no draft; -1: out of memory. */
int64_t sd_suffix_speculate(const int32_t *buf, int64_t n, const int32_t *order,
                            const int32_t *keys, int64_t nkeys, int64_t n_sorted, int64_t dead,
                            const int32_t *pattern, int64_t plen, int64_t before,
                            int64_t max_nodes, int64_t max_depth, double factor, double offset,
                            double min_prob, int64_t max_candidates, int64_t tree,
                            int64_t *out_tokens, int64_t *out_parents, double *out_probs,
                            int64_t *out_ends, int64_t *out_meta, double *out_score) {
    if (plen <= 0 || max_nodes <= 0) return 0;
    const Corpus c = {buf, n, order, keys, nkeys, n_sorted, dead};
    int64_t cap = max_candidates < n ? max_candidates : n; /* no more occurrences than tokens */
    int64_t *ends = malloc((size_t)(cap + 1) * 2 * sizeof(int64_t));
    if (!ends) return -1;
    int64_t *len = ends + cap + 1;
    int64_t k = positions(&c, pattern[plen - 1], cap, before, ends);
    int64_t maxlen = 0;
    for (int64_t i = 0; i < k; i++) { /* match lengths */
        int64_t m = 1;
        while (m < plen && ends[i] - m >= 0 && buf[ends[i] - m] == pattern[plen - 1 - m]) m++;
        len[i] = m;
        if (m > maxlen) maxlen = m;
    }
    int64_t depth_cap = max_depth < max_nodes ? max_depth : max_nodes;
    size_t cells = (size_t)k * (size_t)depth_cap; /* rows x depth, and the most trie nodes */
    int64_t *rows = malloc(cells * 7 * 8 + (size_t)k * 17 + (size_t)(plen + 1) * 8);
    if (!rows) { free(ends); return -1; }
    Trie t = {rows + cells, rows + 2 * cells, rows + 3 * cells, (double *)(rows + 4 * cells), 0};
    int64_t *made = rows + 5 * cells, *pick = rows + 6 * cells, *perm = rows + 7 * cells;
    int64_t *prev = perm + k, *hist = prev + k;
    unsigned char *diff = (unsigned char *)(hist + plen + 1);
    for (int64_t m = 0; m <= plen; m++) hist[m] = 0;
    for (int64_t i = 0; i < k; i++) hist[len[i]]++;

    int64_t best_n = 0, best_m = 0, best_k = 0;
    double best_score = 0.0;
    for (int64_t m = maxlen; m >= 1; m--) {
        if (!hist[m]) continue; /* only the match lengths that occur */
        double x = (double)m * factor + offset + 1e-6;
        int64_t budget = x >= (double)max_nodes ? max_nodes : (x < 1.0 ? 0 : (int64_t)x);
        if (budget <= 0 || (best_n && best_score >= (double)budget)) break;
        int64_t depth = max_depth < budget ? max_depth : budget, nr = 0;
        for (int64_t i = 0; i < k; i++) {
            if (len[i] < m) continue;
            int64_t *r = rows + nr++ * depth, stop = 0;
            for (int64_t d = 0; d < depth; d++) { /* continuations: -1 from a -1/-2 or n on */
                int64_t at = ends[i] + 1 + d;
                int64_t v = at < n ? buf[at] : -1;
                if (v < 0) stop = 1;
                r[d] = stop ? -1 : v;
            }
        }
        int64_t got = 0;
        double score = 0.0;
        if (nr == 1) { /* one occurrence: its continuation, p = 1 */
            while (got < budget && got < depth && rows[got] >= 0) got++;
            if (got && (!best_n || (double)got > best_score + 1e-9)) {
                for (int64_t i = 0; i < got; i++) {
                    out_tokens[i] = rows[i], out_parents[i] = i - 1, out_probs[i] = 1.0;
                    score += 1.0;
                }
            } else got = 0;
        } else {
            count_trie(rows, nr, depth, min_prob, perm, prev, diff, made, &t);
            int64_t kept = t.n ? choose(&t, budget, (int)tree, pick) : 0;
            for (int64_t i = 0; i < kept; i++) score += t.prob[pick[i]];
            if (kept && (!best_n || score > best_score + 1e-9)) {
                for (int64_t i = 0; i < kept; i++) { /* made: now kept node -> draft index */
                    int64_t j = pick[i];
                    made[j] = i;
                    out_tokens[i] = t.tok[j];
                    out_parents[i] = t.par[j] >= 0 ? made[t.par[j]] : -1;
                    out_probs[i] = t.prob[j];
                }
                got = kept;
            }
        }
        if (got) {
            best_n = got, best_m = m, best_score = score, best_k = nr;
        }
    }
    if (best_n) { /* the latest occurrences the best draft came from */
        int64_t take = best_k < SD_SUFFIX_TOUCHED ? best_k : SD_SUFFIX_TOUCHED, w = take;
        for (int64_t i = k - 1; i >= 0 && w > 0; i--)
            if (len[i] >= best_m) out_ends[--w] = ends[i];
        out_meta[0] = best_m, out_meta[1] = take;
        *out_score = best_score;
    }
    free(rows);
    free(ends);
    return best_n;
}
