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

/* The continuation of the occurrence ending at e, at depth d (0 = the next token): -1 past
 * the corpus end or at a separator or blank. A row that reached -1 is dropped, so a row still
 * alive at depth d has no -1 before it (TokenCorpus.continuations' padding). */
static inline int64_t next_token(const Corpus *c, int64_t e, int64_t d) {
    int64_t at = e + 1 + d;
    return at < c->n ? c->buf[at] : -1;
}

typedef struct { /* an open-addressing count table over tokens, cleared after each use */
    int64_t *key, *val, *used;
    int64_t mask, nused;
} Table;

static int64_t *table_slot(Table *t, int64_t key) {
    uint64_t h = (uint64_t)key * 0x9E3779B97F4A7C15ull;
    for (int64_t i = (int64_t)(h >> 32) & t->mask;; i = (i + 1) & t->mask) {
        if (t->key[i] == key) return t->val + i;
        if (t->key[i] == -1) {
            t->key[i] = key, t->val[i] = 0, t->used[t->nused++] = i;
            return t->val + i;
        }
    }
}

static void table_clear(Table *t) {
    for (int64_t i = 0; i < t->nused; i++) t->key[t->used[i]] = -1;
    t->nused = 0;
}

typedef struct {
    int64_t *tok, *par, *cnt, *start; /* the trie's kept nodes, depth by depth; start: in idx */
    double *prob;
    int64_t *pick, *where; /* scratch per node: the chosen nodes; a node's index in the draft */
    int64_t n, cap;
} Trie;

static int trie_grow(Trie *t) {
    int64_t cap = t->cap ? 2 * t->cap : 64;
    int64_t **arrays[] = {&t->tok, &t->par, &t->cnt, &t->start, &t->pick, &t->where};
    for (int i = 0; i < 6; i++) {
        int64_t *a = realloc(*arrays[i], (size_t)cap * sizeof(int64_t));
        if (!a) return -1;
        *arrays[i] = a;
    }
    double *p = realloc(t->prob, (size_t)cap * sizeof(double));
    if (!p) return -1;
    t->prob = p, t->cap = cap;
    return 0;
}

static void trie_free(Trie *t) {
    free(t->tok), free(t->par), free(t->cnt), free(t->start), free(t->prob);
    free(t->pick), free(t->where);
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : (x > y);
}

/* count_trie over the occurrences idx[0:k] to `depth`: the nodes with probability
 * count / k >= min_prob, in the order numpy makes them (depth by depth; within a depth in
 * lexicographic order of the path, which is: parents in order, each one's children by token).
 * A node's occurrences are a range of idx, refined in place for its children, so rows whose
 * prefix is already too rare are never looked at again. tmp [k], kids [k]: scratch. */
static int count_trie(const Corpus *c, int64_t *idx, int64_t k, int64_t depth, double min_prob,
                      Table *tab, int64_t *tmp, int64_t *kids, Trie *t) {
    t->n = 0;
    int64_t lo = 0, hi = 1; /* the nodes of the previous depth; -1: the root */
    for (int64_t d = 0; d < depth && lo < hi; d++) {
        for (int64_t p = d ? lo : -1; p < (d ? hi : 0); p++) {
            int64_t from = p < 0 ? 0 : t->start[p], len = p < 0 ? k : t->cnt[p];
            for (int64_t i = 0; i < len; i++) {
                int64_t tok = next_token(c, idx[from + i], d);
                if (tok >= 0) ++*table_slot(tab, tok);
            }
            int64_t nk = 0;
            for (int64_t i = 0; i < tab->nused; i++) {
                int64_t s = tab->used[i];
                if ((double)tab->val[s] / (double)k >= min_prob) kids[nk++] = tab->key[s];
            }
            qsort(kids, (size_t)nk, sizeof *kids, cmp_i64);
            int64_t at = from;
            for (int64_t j = 0; j < nk; j++) { /* the children, by token */
                if (t->n == t->cap && trie_grow(t)) return -1;
                int64_t *count = table_slot(tab, kids[j]);
                t->tok[t->n] = kids[j], t->par[t->n] = p, t->cnt[t->n] = *count;
                t->prob[t->n] = (double)*count / (double)k, t->start[t->n] = at;
                kids[j] = at; /* now: where child j's next row goes */
                at += *count;
                *count = -1 - j; /* now: which child (negative, apart from the counts) */
                t->n++;
            }
            for (int64_t i = 0; i < len; i++) { /* kept children's rows to their ranges */
                int64_t tok = next_token(c, idx[from + i], d);
                if (tok < 0) continue;
                int64_t v = *table_slot(tab, tok);
                if (v < 0) tmp[kids[-1 - v]++ - from] = idx[from + i];
            }
            memcpy(idx + from, tmp, (size_t)(at - from) * sizeof *idx);
            table_clear(tab);
        }
        lo = d ? hi : 0, hi = t->n;
    }
    return 0;
}

static int64_t choose(const Trie *t, int64_t budget, int tree, int64_t *keep) {
    if (tree) { /* the `budget` most probable, the earlier of equals first (no shared state:
                   ctypes lets threads call in at once) */
        int64_t m = 0;
        for (int64_t i = 0; i < t->n; i++) {
            double p = t->prob[i];
            if (m == budget && !(p > t->prob[keep[m - 1]])) continue;
            int64_t at = m < budget ? m++ : m - 1; /* full: the least probable goes */
            while (at > 0 && t->prob[keep[at - 1]] < p) keep[at] = keep[at - 1], at--;
            keep[at] = i;
        }
        qsort(keep, (size_t)m, sizeof *keep, cmp_i64);
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

typedef struct { /* a call's scratch */
    int64_t *ends, *len; /* [cap]: the occurrences and their match lengths */
    int64_t *idx, *tmp, *kids, *hist; /* [k] each, hist [plen + 1] */
    Table tab;
    Trie trie;
} Scratch;

/* The scratch sized by the occurrences found (k); the table at most half full. */
static int scratch_alloc(Scratch *w, int64_t k, int64_t plen) {
    int64_t size = 2;
    while (size < 2 * k) size *= 2;
    int64_t *block = malloc((size_t)(3 * k + plen + 1 + 3 * size) * sizeof(int64_t));
    if (!block) return -1;
    w->idx = block, w->tmp = block + k, w->kids = block + 2 * k;
    w->hist = block + 3 * k, w->tab.key = w->hist + plen + 1, w->tab.val = w->tab.key + size;
    w->tab.used = w->tab.val + size, w->tab.mask = size - 1, w->tab.nused = 0;
    for (int64_t i = 0; i < size; i++) w->tab.key[i] = -1;
    return 0;
}

/* The draft of one match length m from the occurrences idx[0:k] (a copy: it is reordered);
 * returns its size (0: none) and its score; the nodes in w->trie, the chosen in w->trie.pick. */
static int64_t draft_one(const Corpus *c, Scratch *w, int64_t k, int64_t budget, int64_t depth,
                         double min_prob, int tree, double *score) {
    *score = 0.0;
    if (k == 1) { /* one occurrence: its continuation, p = 1 */
        int64_t got = 0;
        while (got < depth && next_token(c, w->idx[0], got) >= 0) got++;
        *score = (double)got;
        return got;
    }
    if (count_trie(c, w->idx, k, depth, min_prob, &w->tab, w->tmp, w->kids, &w->trie)) return -1;
    int64_t kept = w->trie.n ? choose(&w->trie, budget, tree, w->trie.pick) : 0;
    for (int64_t i = 0; i < kept; i++) *score += w->trie.prob[w->trie.pick[i]]; /* in order */
    return kept;
}

/* Writes draft_one's draft (k occurrences) into the outputs. */
static void write_draft(const Corpus *c, Scratch *w, int64_t k, int64_t got, int64_t *tokens,
                        int64_t *parents, double *probs) {
    if (k == 1) {
        for (int64_t i = 0; i < got; i++)
            tokens[i] = next_token(c, w->idx[0], i), parents[i] = i - 1, probs[i] = 1.0;
        return;
    }
    const Trie *t = &w->trie;
    int64_t *where = t->where; /* kept node -> draft index (parents come first) */
    for (int64_t i = 0; i < got; i++) {
        int64_t j = t->pick[i];
        where[j] = i;
        tokens[i] = t->tok[j];
        parents[i] = t->par[j] >= 0 ? where[t->par[j]] : -1;
        probs[i] = t->prob[j];
    }
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
    if (plen <= 0 || max_nodes <= 0 || n <= 0) return 0;
    const Corpus c = {buf, n, order, keys, nkeys, n_sorted, dead};
    int64_t cap = max_candidates < n ? max_candidates : n; /* no more occurrences than tokens */
    Scratch w = {0};
    if (!(w.ends = malloc((size_t)cap * 2 * sizeof(int64_t)))) return -1;
    w.len = w.ends + cap;
    int64_t k = positions(&c, pattern[plen - 1], cap, before, w.ends), maxlen = 0;
    if (!k || scratch_alloc(&w, k, plen)) {
        free(w.ends);
        return k ? -1 : 0;
    }
    for (int64_t i = 0; i < k; i++) { /* match lengths */
        int64_t m = 1;
        while (m < plen && w.ends[i] - m >= 0 && buf[w.ends[i] - m] == pattern[plen - 1 - m])
            m++;
        w.len[i] = m;
        if (m > maxlen) maxlen = m;
    }
    for (int64_t m = 0; m <= plen; m++) w.hist[m] = 0;
    for (int64_t i = 0; i < k; i++) w.hist[w.len[i]]++;

    int64_t best_n = 0, best_m = 0, best_k = 0, rc = 0;
    double best_score = 0.0;
    for (int64_t m = maxlen, nr = 0; m >= 1; m--) {
        if (!w.hist[m]) continue; /* only the match lengths that occur */
        nr += w.hist[m];          /* occurrences matching at least m tokens */
        double x = (double)m * factor + offset + 1e-6;
        int64_t budget = x >= (double)max_nodes ? max_nodes : (x < 1.0 ? 0 : (int64_t)x);
        if (budget <= 0 || (best_n && best_score >= (double)budget)) break;
        int64_t depth = max_depth < budget ? max_depth : budget, r = 0;
        for (int64_t i = 0; i < k; i++)
            if (w.len[i] >= m) w.idx[r++] = w.ends[i];
        double score;
        int64_t got = draft_one(&c, &w, nr, budget, depth, min_prob, (int)tree, &score);
        if (got < 0) { rc = -1; break; }
        if (got && (!best_n || score > best_score + 1e-9)) {
            write_draft(&c, &w, nr, got, out_tokens, out_parents, out_probs);
            best_n = got, best_m = m, best_score = score, best_k = nr;
        }
    }
    if (best_n && !rc) { /* the latest occurrences the best draft came from */
        int64_t take = best_k < SD_SUFFIX_TOUCHED ? best_k : SD_SUFFIX_TOUCHED, at = take;
        for (int64_t i = k - 1; i >= 0 && at > 0; i--)
            if (w.len[i] >= best_m) out_ends[--at] = w.ends[i];
        out_meta[0] = best_m, out_meta[1] = take;
        *out_score = best_score;
    }
    trie_free(&w.trie);
    free(w.idx);
    free(w.ends);
    return rc ? rc : best_n;
}
