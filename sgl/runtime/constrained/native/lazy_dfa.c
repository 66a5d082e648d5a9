/* Machines of the native grammar engine: byte DFAs built lazily from NFAs, table
 * machines, intersection products, and liveness across machines.
 *
 * A DFA state of an NFA machine is the sorted set of live NFA states (SPARSE, MATCH and
 * CALL) an epsilon closure reaches; its row (256 targets), accept flag and calls are
 * computed the first time a walk stands on it (`machine_expand`), so a schema whose
 * full DFA would have 300k states costs the few hundred an instance visits. A call
 * (callee j, return state r) groups the CALL members of one callee: r is the closure of
 * their continuations, exactly the state the old byte route reached after the marker.
 *
 * Liveness (`engine_finalize`): an NFA state is live if it can complete, through bytes
 * and calls of nonempty machines; a machine is nonempty if its start is live. Both are a
 * least fixpoint across machines. Expansions keep live members only, so every DFA state
 * built can still complete and "alive after a byte" means "a completion exists".
 * Table machines (rows from Python, or intersection products) are pruned to the same
 * invariant. A no-empty machine (a CFG callee) starts in a copy of its start state that
 * does not accept, marked by a -1 first member, so calls always consume a byte.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar.h"

/* ------------------------------------------------------------------ state sets */
static uint64_t hash_set(const int32_t *s, int64_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ (uint64_t)n;
    for (int64_t k = 0; k < n; k++) h = mix64(h ^ (uint32_t)s[k]) + 0x9E3779B97F4A7C15ULL;
    return h;
}

static int set_rehash(SetTable *t) {
    int64_t cap = t->hcap ? t->hcap * 2 : 256;
    int64_t *h2 = malloc(sizeof(int64_t) * (size_t)cap);
    if (!h2) return -1;
    for (int64_t k = 0; k < cap; k++) h2[k] = -1;
    for (int64_t d = 0; d < t->off.n; d++) {
        const int32_t *m = (int32_t *)t->pool.p + ((int64_t *)t->off.p)[d];
        int64_t j = (int64_t)(hash_set(m, ((int32_t *)t->len.p)[d]) & (uint64_t)(cap - 1));
        while (h2[j] >= 0) j = (j + 1) & (cap - 1);
        h2[j] = d;
    }
    free(t->htab);
    t->htab = h2;
    t->hcap = cap;
    return 0;
}

/* Id of the member list `s` (interned); *fresh = 1 when new; -1 on memory failure; -2
 * when it is new and longer than `room` (members left in the engine's budget). */
static int64_t set_intern(SetTable *t, const int32_t *s, int64_t n, int *fresh, int64_t room) {
    if (t->off.n * 2 >= t->hcap && set_rehash(t)) return -1;
    int64_t j = (int64_t)(hash_set(s, n) & (uint64_t)(t->hcap - 1));
    while (t->htab[j] >= 0) {
        int64_t d = t->htab[j];
        if (((int32_t *)t->len.p)[d] == n &&
            !memcmp((int32_t *)t->pool.p + ((int64_t *)t->off.p)[d], s, sizeof(int32_t) * (size_t)n)) {
            *fresh = 0;
            return d;
        }
        j = (j + 1) & (t->hcap - 1);
    }
    if (n > room) return -2;
    int64_t d = t->off.n, o = t->pool.n;
    int32_t n32 = (int32_t)n;
    if (vec_reserve(&t->pool, o + n) || vec_push(&t->off, &o) || vec_push(&t->len, &n32)) return -1;
    memcpy((int32_t *)t->pool.p + o, s, sizeof(int32_t) * (size_t)n);
    t->pool.n += n;
    t->htab[j] = d;
    *fresh = 1;
    return d;
}

/* ------------------------------------------------------------------ states */
int64_t machine_new_state(Engine *E, Machine *M) {
    if (E->total_states >= E->max_states) return -G_TOO_LARGE;
    int64_t s = M->n;
    if ((s >> ROW_SHIFT) >= M->blocks.n) {
        int32_t *blk = malloc(sizeof(int32_t) * 256 * ((size_t)1 << ROW_SHIFT));
        if (!blk || vec_push(&M->blocks, &blk)) { free(blk); return -G_NOMEM; }
    }
    uint8_t f = 0;
    int32_t z = 0;
    int8_t u = -1;
    Run none = {{0, 0, 0, 0}, 0, 0, 0, 0};
    void *nofm = NULL;
    if (vec_push(&M->flags, &f) || vec_push(&M->call_off, &z) || vec_push(&M->call_cnt, &z) ||
        vec_push(&M->idem, &u) || vec_push(&M->runs, &none) || vec_push(&M->fmasks, &nofm))
        return -G_NOMEM;
    M->n++;
    E->total_states++;
    return s;
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return x < y ? -1 : x > y;
}

static int scratch(Machine *M) {
    if (M->stamp) return 0;
    int64_t n = M->nfa.states.n + 1;
    M->stamp = calloc((size_t)n, sizeof(uint32_t));
    M->stk = malloc(sizeof(int32_t) * (size_t)n);
    M->out = malloc(sizeof(int32_t) * (size_t)(n + 1));
    return M->stamp && M->stk && M->out ? 0 : -1;
}

/* Epsilon closure of `seeds` into M->out (+1: room for a -1 sentinel in front): the
 * live SPARSE, MATCH and CALL states reached, sorted. Returns the count. */
static int64_t closure(Machine *M, const int32_t *seeds, int64_t nseeds, int sentinel) {
    const NState *st = M->nfa.states.p;
    const Edge *ed = M->nfa.edges.p;
    if (++M->gen == 0) {
        memset(M->stamp, 0, sizeof(uint32_t) * (size_t)(M->nfa.states.n + 1));
        M->gen = 1;
    }
    int32_t *out = M->out + sentinel;
    int64_t sp = 0, no = 0;
    for (int64_t k = 0; k < nseeds; k++) {
        int32_t s = seeds[k];
        if (M->live[s] && M->stamp[s] != M->gen) M->stamp[s] = M->gen, M->stk[sp++] = s;
    }
    while (sp) {
        int32_t s = M->stk[--sp];
        if (st[s].kind == S_UNION) {
            for (int k = st[s].count - 1; k >= 0; k--) {
                int32_t t = ed[st[s].first + k].next;
                if (M->live[t] && M->stamp[t] != M->gen) M->stamp[t] = M->gen, M->stk[sp++] = t;
            }
        } else {
            out[no++] = s;
        }
    }
    qsort(out, (size_t)no, sizeof(int32_t), cmp_i32);
    if (sentinel) M->out[0] = -1;
    return no;
}

/* The DFA state of the closure in M->out[0..n): interned, appended when new. States of
 * huge NFAs can each hold millions of members, so their bytes have a budget of their own
 * besides the state count (one such request would otherwise take GBs). */
static int64_t intern_closure(Engine *E, Machine *M, int64_t n) {
    int fresh = 0;
    int64_t d = set_intern(&M->sets, M->out, n, &fresh, E->max_set_members - E->set_members);
    if (d == -2) return -G_SETS_TOO_LARGE;
    if (d < 0) return -G_NOMEM;
    if (!fresh) return d;
    E->set_members += n;
    int64_t s = machine_new_state(E, M);
    if (s < 0) return s;
    int acc = 0;
    if (M->out[0] >= 0)
        for (int64_t k = 0; k < n; k++)
            if (M->out[k] == M->nfa.match) acc = 1;
    ((uint8_t *)M->flags.p)[s] = acc ? F_ACCEPT : 0;
    return s;
}

static int cmp_call(const void *a, const void *b) {
    const Call *x = a, *y = b;
    return x->callee != y->callee ? (x->callee < y->callee ? -1 : 1) : cmp_i32(&x->ret, &y->ret);
}

int machine_expand(Engine *E, Machine *M, int32_t d) {
    const NState *st = M->nfa.states.p;
    const Edge *ed = M->nfa.edges.p;
    int64_t o = ((int64_t *)M->sets.off.p)[d];
    int32_t len = ((int32_t *)M->sets.len.p)[d];
    int ncls = M->ncls;
    int64_t count[257] = {0}, base[258];
    Vec calls = VEC_OF(Call);
    int status = G_NOMEM;
    /* pass 1: sizes of the per-class target lists, and the calls */
    for (int32_t k = 0; k < len; k++) {
        int32_t q = ((int32_t *)M->sets.pool.p)[o + k];
        if (q < 0) continue;
        if (st[q].kind == S_SPARSE) {
            for (int e = 0; e < st[q].count; e++) {
                const Edge *x = &ed[st[q].first + e];
                if (M->live[x->next])
                    for (int c = M->cls[x->lo]; c <= M->cls[x->hi]; c++) count[c]++;
            }
        } else if (st[q].kind == S_CALL) {
            int32_t nx = ed[st[q].first].next;
            Call c = {st[q].aux, nx};
            if (c.callee < E->n && E->nonempty[c.callee] && M->live[nx] && vec_push(&calls, &c)) goto done;
        }
    }
    base[0] = 0;
    for (int c = 0; c < ncls; c++) base[c + 1] = base[c] + count[c];
    int32_t *targets = malloc(sizeof(int32_t) * (size_t)(base[ncls] + 1));
    if (!targets) goto done;
    memset(count, 0, sizeof(count));
    for (int32_t k = 0; k < len; k++) {
        int32_t q = ((int32_t *)M->sets.pool.p)[o + k];
        if (q < 0 || st[q].kind != S_SPARSE) continue;
        for (int e = 0; e < st[q].count; e++) {
            const Edge *x = &ed[st[q].first + e];
            if (M->live[x->next])
                for (int c = M->cls[x->lo]; c <= M->cls[x->hi]; c++) targets[base[c] + count[c]++] = x->next;
        }
    }
    /* pass 2: one closure per distinct target list (classes often share one: the
     * closure dominates expansion, the compare is cheap) */
    int32_t by_class[256];
    uint64_t th[256];
    int16_t slot[512];
    memset(slot, -1, sizeof(slot));
    for (int c = 0; c < ncls; c++) {
        by_class[c] = -1;
        if (!count[c]) continue;
        const int32_t *tl = targets + base[c];
        th[c] = hash_set(tl, count[c]);
        int j = (int)(th[c] & 511), same = -1;
        for (; slot[j] >= 0; j = (j + 1) & 511) {
            int p = slot[j];
            if (th[p] == th[c] && count[p] == count[c] &&
                !memcmp(targets + base[p], tl, sizeof(int32_t) * (size_t)count[c])) { same = p; break; }
        }
        if (same >= 0) { by_class[c] = by_class[same]; continue; }
        slot[j] = (int16_t)c;
        int64_t n = closure(M, tl, count[c], 0);
        if (!n) continue;
        int64_t t = intern_closure(E, M, n);
        if (t < 0) { status = (int)-t; free(targets); goto done; }
        by_class[c] = (int32_t)t;
    }
    free(targets);
    int32_t *row = row_of(M, d);
    for (int b = 0; b < 256; b++) row[b] = by_class[M->cls[b]];
    /* calls: one per callee, returning to the closure of its continuations */
    Call *cs = calls.p;
    if (calls.n > 1) qsort(cs, (size_t)calls.n, sizeof(Call), cmp_call); /* cs is NULL when there are none */
    int32_t first = (int32_t)M->calls.n, ncalls = 0;
    for (int64_t i = 0; i < calls.n;) {
        int64_t j = i;
        int32_t seeds_buf[64], *seeds = seeds_buf;
        while (j < calls.n && cs[j].callee == cs[i].callee) j++;
        if (j - i > 64 && !(seeds = malloc(sizeof(int32_t) * (size_t)(j - i)))) goto done;
        for (int64_t k = i; k < j; k++) seeds[k - i] = cs[k].ret;
        int64_t n = closure(M, seeds, j - i, 0);
        if (seeds != seeds_buf) free(seeds);
        if (n) {
            int64_t r = intern_closure(E, M, n);
            if (r < 0) { status = (int)-r; goto done; }
            Call c = {cs[i].callee, (int32_t)r};
            if (vec_push(&M->calls, &c)) goto done;
            ncalls++;
        }
        i = j;
    }
    ((int32_t *)M->call_off.p)[d] = first;
    ((int32_t *)M->call_cnt.p)[d] = ncalls;
    ((uint8_t *)M->flags.p)[d] |= F_EXPANDED | (ncalls ? F_CALLS : 0);
    status = G_OK;
done:
    free(calls.p);
    return status;
}

int machine_ready(Engine *E, Machine *M, int32_t s) {
    if (flags_of(M, s) & F_EXPANDED) return G_OK;
    if (E->status != G_OK) return E->status;
    int rc = machine_expand(E, M, s);
    if (rc != G_OK) E->status = rc;
    return rc;
}

/* ------------------------------------------------------------------ NFA liveness */

/* Backward reachability from the match over edges, union targets and the calls of
 * machines `nonempty` marks (NULL: every call counts, for intersection parts). */
static int nfa_live(Machine *M, const uint8_t *nonempty, int32_t nmach) {
    const Nfa *a = &M->nfa;
    int64_t n = a->states.n;
    const NState *st = a->states.p;
    const Edge *ed = a->edges.p;
    int64_t *cnt = calloc((size_t)n + 1, sizeof(int64_t));
    int32_t *pred = NULL, *queue = NULL;
    int64_t *fill = NULL;
    if (!M->live) M->live = calloc((size_t)n + 1, 1);
    if (!cnt || !M->live) goto fail;
    memset(M->live, 0, (size_t)n);
    for (int64_t s = 0; s < n; s++)
        if (st[s].kind != S_MATCH)
            for (int k = 0; k < st[s].count; k++) cnt[ed[st[s].first + k].next + 1]++;
    for (int64_t s = 0; s < n; s++) cnt[s + 1] += cnt[s];
    pred = malloc(sizeof(int32_t) * (size_t)(cnt[n] + 1));
    fill = malloc(sizeof(int64_t) * (size_t)n);
    queue = malloc(sizeof(int32_t) * (size_t)n);
    if (!pred || !fill || !queue) goto fail;
    memcpy(fill, cnt, sizeof(int64_t) * (size_t)n);
    for (int64_t s = 0; s < n; s++)
        if (st[s].kind != S_MATCH)
            for (int k = 0; k < st[s].count; k++) pred[fill[ed[st[s].first + k].next]++] = (int32_t)s;
    int64_t qh = 0, qt = 0;
    M->live[a->match] = 1, queue[qt++] = a->match;
    while (qh < qt) {
        int32_t s = queue[qh++];
        for (int64_t k = cnt[s]; k < cnt[s + 1]; k++) {
            int32_t q = pred[k];
            if (M->live[q]) continue;
            if (st[q].kind == S_CALL && nonempty && (st[q].aux >= nmach || !nonempty[st[q].aux])) continue;
            M->live[q] = 1, queue[qt++] = q;
        }
    }
    free(cnt); free(pred); free(fill); free(queue);
    return 0;
fail:
    free(cnt); free(pred); free(fill); free(queue);
    return -1;
}

/* Does the closure of the start reach something live (a no-empty machine: a live byte
 * edge or call; else any live member)? Needs M->live. */
static int nfa_nonempty(Machine *M, const uint8_t *nonempty, int32_t nmach) {
    if (scratch(M)) return -1;
    int64_t n = closure(M, &M->nfa.start, 1, 0);
    if (!M->no_empty) return n > 0;
    const NState *st = M->nfa.states.p;
    const Edge *ed = M->nfa.edges.p;
    for (int64_t k = 0; k < n; k++) {
        const NState *q = &st[M->out[k]];
        if (q->kind == S_SPARSE) {
            for (int e = 0; e < q->count; e++)
                if (M->live[ed[q->first + e].next]) return 1;
        } else if (q->kind == S_CALL) {
            if (q->aux < nmach && nonempty[q->aux] && M->live[ed[q->first].next]) return 1;
        }
    }
    return 0;
}

/* Byte classes over the live edges, and the start state (id 0). */
static int nfa_start(Engine *E, Machine *M) {
    const NState *st = M->nfa.states.p;
    const Edge *ed = M->nfa.edges.p;
    uint8_t cut[257] = {0};
    for (int64_t s = 0; s < M->nfa.states.n; s++)
        if (st[s].kind == S_SPARSE && M->live[s])
            for (int k = 0; k < st[s].count; k++) cut[ed[st[s].first + k].lo] = 1, cut[ed[st[s].first + k].hi + 1] = 1;
    M->ncls = 0;
    for (int b = 0; b < 256; b++) {
        if (b && cut[b]) M->ncls++;
        M->cls[b] = (uint8_t)M->ncls;
    }
    M->ncls++;
    if (scratch(M)) return G_NOMEM;
    int64_t n = closure(M, &M->nfa.start, 1, M->no_empty);
    int64_t s = intern_closure(E, M, n + M->no_empty);
    return s < 0 ? (int)-s : G_OK;
}

/* ------------------------------------------------------------------ table machines */

/* Productive states of a table machine: backward over rows and calls of nonempty
 * machines. `prod` [M->n]. */
static int table_live(Machine *M, const uint8_t *nonempty, int32_t nmach, uint8_t *prod) {
    int64_t n = M->n;
    if (n <= 0) return 0;
    int64_t *cnt = calloc((size_t)n + 1, sizeof(int64_t)), *fill = NULL;
    int32_t *pred = NULL, *queue = NULL;
    if (!cnt) return -1;
    const Call *cs = M->calls.p;
    const int32_t *coff = M->call_off.p, *ccnt = M->call_cnt.p;
    for (int64_t s = 0; s < n; s++) {
        const int32_t *r = row_of(M, (int32_t)s);
        for (int b = 0; b < 256; b++)
            if (r[b] >= 0) cnt[r[b] + 1]++;
        for (int k = 0; k < ccnt[s]; k++) cnt[cs[coff[s] + k].ret + 1]++;
    }
    for (int64_t s = 0; s < n; s++) cnt[s + 1] += cnt[s];
    pred = malloc(sizeof(int32_t) * (size_t)(cnt[n] + 1));
    fill = malloc(sizeof(int64_t) * (size_t)(n + 1));
    queue = malloc(sizeof(int32_t) * (size_t)(n + 1));
    if (!pred || !fill || !queue) { free(cnt); free(pred); free(fill); free(queue); return -1; }
    memcpy(fill, cnt, sizeof(int64_t) * (size_t)n);
    for (int64_t s = 0; s < n; s++) {
        const int32_t *r = row_of(M, (int32_t)s);
        for (int b = 0; b < 256; b++)
            if (r[b] >= 0) pred[fill[r[b]]++] = (int32_t)s;
        for (int k = 0; k < ccnt[s]; k++) {
            const Call *c = &cs[coff[s] + k];
            /* a call edge only counts when its callee can complete (-1: no edge) */
            pred[fill[c->ret]++] = (c->callee < nmach && nonempty[c->callee]) ? (int32_t)s : -1;
        }
    }
    memset(prod, 0, (size_t)n);
    int64_t qh = 0, qt = 0;
    for (int64_t s = 0; s < n; s++)
        if (flags_of(M, (int32_t)s) & F_ACCEPT) prod[s] = 1, queue[qt++] = (int32_t)s;
    while (qh < qt) {
        int32_t s = queue[qh++];
        for (int64_t k = cnt[s]; k < cnt[s + 1]; k++) {
            int32_t q = pred[k];
            if (q >= 0 && !prod[q]) prod[q] = 1, queue[qt++] = q;
        }
    }
    free(cnt); free(pred); free(fill); free(queue);
    return 0;
}

static void table_prune(Machine *M, const uint8_t *nonempty, int32_t nmach, const uint8_t *prod) {
    Call *cs = M->calls.p;
    int32_t *coff = M->call_off.p, *ccnt = M->call_cnt.p;
    for (int64_t s = 0; s < M->n; s++) {
        int32_t *r = row_of(M, (int32_t)s);
        for (int b = 0; b < 256; b++)
            if (r[b] >= 0 && (!prod[s] || !prod[r[b]])) r[b] = -1;
        int32_t kept = 0;
        for (int k = 0; k < ccnt[s]; k++) {
            Call c = cs[coff[s] + k];
            if (prod[s] && c.callee < nmach && nonempty[c.callee] && prod[c.ret]) cs[coff[s] + kept++] = c;
        }
        ccnt[s] = kept;
        uint8_t *f = &((uint8_t *)M->flags.p)[s];
        *f = (uint8_t)((*f & ~F_CALLS) | (kept ? F_CALLS : 0));
    }
}

/* ------------------------------------------------------------------ intersections */
typedef struct {
    uint64_t *keys; /* (a << 32 | b) + 1, 0 = empty */
    int32_t *vals;
    int64_t cap, n;
} PairMap;

static int64_t pair_get(Engine *E, Machine *P, PairMap *h, Vec *queue, int32_t a, int32_t b) {
    if (h->n * 2 >= h->cap) {
        int64_t cap = h->cap ? h->cap * 2 : 1024;
        uint64_t *k2 = calloc((size_t)cap, sizeof(uint64_t));
        int32_t *v2 = malloc(sizeof(int32_t) * (size_t)cap);
        if (!k2 || !v2) { free(k2); free(v2); return -G_NOMEM; }
        for (int64_t i = 0; i < h->cap; i++) {
            if (!h->keys[i]) continue;
            int64_t j = (int64_t)(mix64(h->keys[i]) & (uint64_t)(cap - 1));
            while (k2[j]) j = (j + 1) & (cap - 1);
            k2[j] = h->keys[i], v2[j] = h->vals[i];
        }
        free(h->keys); free(h->vals);
        h->keys = k2, h->vals = v2, h->cap = cap;
    }
    uint64_t key = ((uint64_t)(uint32_t)a << 32 | (uint32_t)b) + 1;
    int64_t j = (int64_t)(mix64(key) & (uint64_t)(h->cap - 1));
    while (h->keys[j]) {
        if (h->keys[j] == key) return h->vals[j];
        j = (j + 1) & (h->cap - 1);
    }
    int64_t s = machine_new_state(E, P);
    if (s < 0) return s;
    int32_t pr[2] = {a, b};
    if (vec_push(queue, &pr[0]) || vec_push(queue, &pr[1])) return -G_NOMEM;
    h->keys[j] = key, h->vals[j] = (int32_t)s, h->n++;
    return s;
}

/* P := the product of A and B, as a fully expanded table machine (start pair = 0):
 * a byte moves both, a call needs both to call the same machine. */
static int product(Engine *E, Machine *P, Machine *A, Machine *B) {
    PairMap h = {NULL, NULL, 0, 0};
    Vec queue = VEC_OF(int32_t), calls = VEC_OF(Call);
    int rc = G_NOMEM;
    P->kind = M_TABLE;
    if (pair_get(E, P, &h, &queue, 0, 0) < 0) goto done;
    for (int64_t i = 0; i < P->n; i++) {
        int32_t a = ((int32_t *)queue.p)[2 * i], b = ((int32_t *)queue.p)[2 * i + 1];
        if ((rc = machine_ready(E, A, a)) != G_OK || (rc = machine_ready(E, B, b)) != G_OK) goto done;
        rc = G_NOMEM;
        int32_t row[256];
        const int32_t *ra = row_of(A, a), *rb = row_of(B, b);
        for (int x = 0; x < 256; x++) {
            row[x] = -1;
            if (ra[x] >= 0 && rb[x] >= 0) {
                int64_t t = pair_get(E, P, &h, &queue, ra[x], rb[x]);
                if (t < 0) { rc = (int)-t; goto done; }
                row[x] = (int32_t)t;
            }
        }
        memcpy(row_of(P, (int32_t)i), row, sizeof(row));
        const Call *ca = (Call *)A->calls.p + ((int32_t *)A->call_off.p)[a];
        const Call *cb = (Call *)B->calls.p + ((int32_t *)B->call_off.p)[b];
        int32_t na = ((int32_t *)A->call_cnt.p)[a], nb = ((int32_t *)B->call_cnt.p)[b];
        calls.n = 0;
        for (int32_t x = 0; x < na; x++)
            for (int32_t y = 0; y < nb; y++)
                if (ca[x].callee == cb[y].callee) {
                    int64_t r = pair_get(E, P, &h, &queue, ca[x].ret, cb[y].ret);
                    if (r < 0) { rc = (int)-r; goto done; }
                    Call c = {ca[x].callee, (int32_t)r};
                    if (vec_push(&calls, &c)) goto done;
                }
        ((int32_t *)P->call_off.p)[i] = (int32_t)P->calls.n;
        ((int32_t *)P->call_cnt.p)[i] = (int32_t)calls.n;
        for (int64_t k = 0; k < calls.n; k++)
            if (vec_push(&P->calls, (Call *)calls.p + k)) goto done;
        uint8_t acc = (flags_of(A, a) & F_ACCEPT) && (flags_of(B, b) & F_ACCEPT);
        ((uint8_t *)P->flags.p)[i] = (uint8_t)(F_EXPANDED | (acc ? F_ACCEPT : 0) | (calls.n ? F_CALLS : 0));
    }
    rc = G_OK;
done:
    free(h.keys); free(h.vals); free(queue.p); free(calls.p);
    return rc;
}

static void machine_clear(Machine *M) {
    nfa_free(&M->nfa);
    free(M->live);
    free(M->sets.pool.p); free(M->sets.off.p); free(M->sets.len.p); free(M->sets.htab);
    for (int64_t k = 0; k < M->blocks.n; k++) free(((int32_t **)M->blocks.p)[k]);
    free(M->blocks.p); free(M->flags.p); free(M->call_off.p); free(M->call_cnt.p); free(M->calls.p);
    free(M->idem.p); free(M->runs.p); free(M->fmasks.p); free(M->parts);
    free(M->stamp); free(M->stk); free(M->out);
    memset(M, 0, sizeof(*M));
}

static void machine_init_vecs(Machine *M) {
    M->sets.pool = (Vec)VEC_OF(int32_t);
    M->sets.off = (Vec)VEC_OF(int64_t);
    M->sets.len = (Vec)VEC_OF(int32_t);
    M->blocks = (Vec)VEC_OF(int32_t *);
    M->flags = (Vec)VEC_OF(uint8_t);
    M->call_off = (Vec)VEC_OF(int32_t);
    M->call_cnt = (Vec)VEC_OF(int32_t);
    M->calls = (Vec)VEC_OF(Call);
    M->idem = (Vec)VEC_OF(int8_t);
    M->runs = (Vec)VEC_OF(Run);
    M->fmasks = (Vec)VEC_OF(void *);
}

static int build_intersect(Engine *E, Machine *M) {
    Machine acc, tmp;
    int rc = G_OK;
    for (int k = 0; k < M->nparts; k++)
        if (M->parts[k] < 0 || M->parts[k] >= E->n || !E->m[M->parts[k]].hidden) return G_BAD_CONFIG;
    Machine *cur = &E->m[M->parts[0]];
    int owned = 0;
    for (int k = 1; k < M->nparts && rc == G_OK; k++) {
        memset(&tmp, 0, sizeof(tmp));
        machine_init_vecs(&tmp);
        rc = product(E, &tmp, cur, &E->m[M->parts[k]]);
        if (owned) machine_clear(&acc);
        acc = tmp, owned = 1, cur = &acc;
    }
    if (rc != G_OK) { if (owned) machine_clear(&acc); return rc; }
    int32_t *parts = M->parts;
    int nparts = M->nparts, hidden = M->hidden;
    if (owned) {
        *M = acc;
    } else { /* a single part: its expanded DFA as a table (A x A is A on pairs (a, a)) */
        memset(&tmp, 0, sizeof(tmp));
        machine_init_vecs(&tmp);
        rc = product(E, &tmp, cur, cur);
        if (rc != G_OK) { machine_clear(&tmp); return rc; }
        *M = tmp;
    }
    M->parts = parts, M->nparts = nparts, M->hidden = hidden, M->kind = M_TABLE;
    return G_OK;
}

/* ------------------------------------------------------------------ finalize */
int engine_finalize(Engine *E, int32_t root, char *err, int errlen) {
    int rc = G_OK;
    uint8_t **prod = calloc((size_t)E->n, sizeof(uint8_t *));
    if (!prod) return G_NOMEM;
    /* Intersection parts first, with every call counted (their callees' emptiness is
     * the product's business, settled by the fixpoint below). */
    for (int32_t i = 0; i < E->n; i++) {
        Machine *M = &E->m[i];
        if (M->kind == M_NFA && M->hidden) {
            if (nfa_live(M, NULL, E->n) || (rc = nfa_start(E, M)) != G_OK) { rc = rc ? rc : G_NOMEM; goto done; }
        }
    }
    memset(E->nonempty, 1, (size_t)E->n);
    for (int32_t i = 0; i < E->n; i++)
        if (E->m[i].kind == M_INTERSECT && (rc = build_intersect(E, &E->m[i])) != G_OK) goto done;
    memset(E->nonempty, 0, (size_t)E->n);
    for (int32_t i = 0; i < E->n; i++)
        if (E->m[i].kind == M_TABLE && !(prod[i] = malloc((size_t)E->m[i].n + 1))) { rc = G_NOMEM; goto done; }
    for (int changed = 1; changed;) {
        changed = 0;
        for (int32_t i = 0; i < E->n; i++) {
            Machine *M = &E->m[i];
            int ne = 0;
            if (M->hidden) continue;
            if (M->kind == M_NFA) {
                if (nfa_live(M, E->nonempty, E->n)) { rc = G_NOMEM; goto done; }
                ne = nfa_nonempty(M, E->nonempty, E->n);
            } else if (M->kind == M_TABLE) {
                if (table_live(M, E->nonempty, E->n, prod[i])) { rc = G_NOMEM; goto done; }
                ne = M->n > 0 && prod[i][0];
            }
            if (ne < 0) { rc = G_NOMEM; goto done; }
            if (ne && !E->nonempty[i]) E->nonempty[i] = 1, changed = 1;
        }
    }
    if (root < 0 || root >= E->n || !E->nonempty[root]) { rc = G_EMPTY; goto done; }
    for (int32_t i = 0; i < E->n; i++) {
        Machine *M = &E->m[i];
        if (M->hidden) continue;
        if (M->kind == M_TABLE) {
            table_prune(M, E->nonempty, E->n, prod[i]);
        } else if (M->kind == M_NFA && (rc = nfa_start(E, M)) != G_OK) {
            goto done;
        }
        if (M->kind == M_EMPTY || M->n == 0) { /* calls never reach it; state 0 exists, dead */
            int64_t s = machine_new_state(E, M);
            if (s < 0) { rc = (int)-s; goto done; }
            int32_t *r = row_of(M, 0);
            for (int b = 0; b < 256; b++) r[b] = -1;
            ((uint8_t *)M->flags.p)[0] = F_EXPANDED;
            if (M->kind == M_EMPTY) M->kind = M_TABLE;
        }
        if (E->json_mode && i != root && E->nonempty[i] && (flags_of(M, 0) & F_ACCEPT)) {
            if (err && errlen > 0) snprintf(err, (size_t)errlen, "sub-machine %d matches the empty string", i);
            rc = G_EMPTY_SUB;
            goto done;
        }
    }
    E->finalized = 1;
done:
    for (int32_t i = 0; i < E->n; i++) free(prod[i]);
    free(prod);
    return rc;
}

/* ------------------------------------------------------------------ idempotent frames */

/* Every accepting state reachable from s (bytes, call returns) behaves as s does
 * (same row and calls): then L(s) L(s) = L(s) and two such frames in a row are one.
 * Explores at most a few thousand states; past that, "no" (never folding is safe). */
int machine_idempotent(Engine *E, int32_t m, int32_t s) {
    Machine *M = &E->m[m];
    int8_t *memo = &((int8_t *)M->idem.p)[s];
    if (*memo >= 0) return *memo;
    int result = 0;
    if (!(flags_of(M, s) & F_ACCEPT) || machine_ready(E, M, s) != G_OK) goto out;
    Vec seen = VEC_OF(int32_t);
    uint8_t *mark = calloc((size_t)M->n + 4096, 1);
    int64_t cap_mark = M->n + 4096;
    if (!mark || vec_push(&seen, &s)) { free(mark); free(seen.p); goto out; }
    mark[s] = 1;
    result = 1;
    for (int64_t i = 0; i < seen.n && result; i++) {
        int32_t q = ((int32_t *)seen.p)[i];
        if (seen.n > 4000 || machine_ready(E, M, q) != G_OK) { result = 0; break; }
        if (q != s && (flags_of(M, q) & F_ACCEPT)) {
            const int32_t *rq = row_of(M, q), *rs = row_of(M, s);
            int32_t nq = ((int32_t *)M->call_cnt.p)[q], ns = ((int32_t *)M->call_cnt.p)[s];
            if (memcmp(rq, rs, 256 * sizeof(int32_t)) || nq != ns ||
                memcmp((Call *)M->calls.p + ((int32_t *)M->call_off.p)[q],
                       (Call *)M->calls.p + ((int32_t *)M->call_off.p)[s], sizeof(Call) * (size_t)nq)) {
                result = 0;
                break;
            }
        }
        const int32_t *r = row_of(M, q);
        int32_t nc = ((int32_t *)M->call_cnt.p)[q], co = ((int32_t *)M->call_off.p)[q];
        for (int b = 0; b < 256 + nc; b++) {
            int32_t t = b < 256 ? r[b] : ((Call *)M->calls.p)[co + b - 256].ret;
            if (t < 0) continue;
            if (t >= cap_mark) { result = 0; break; }
            if (!mark[t]) {
                mark[t] = 1;
                if (vec_push(&seen, &t)) { result = 0; break; }
            }
        }
    }
    free(mark);
    free(seen.p);
out:
    ((int8_t *)M->idem.p)[s] = (int8_t)result;
    return result;
}

void engine_free(Engine *E) {
    frame_masks_free(E);
    for (int32_t i = 0; i < E->n; i++) machine_clear(&E->m[i]);
    free(E->m);
    free(E->nonempty);
    pthread_mutex_destroy(&E->mu);
    free(E);
}
