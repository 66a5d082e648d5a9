/* The pushdown over the engine's machines: byte steps, token masks, forced bytes.
 *
 * A configuration is a set of stacks; a stack is frames (machine, state) from the
 * bottom to the top, the top being where the text is, every frame below holding the
 * state its machine returns to. A byte moves the top frame, or calls (the caller waits
 * at the call's return state, the callee starts at its state 0 and takes the byte), or,
 * where the top accepts and a frame is below, returns (pops) and moves the caller;
 * calls and returns chain within one byte, and a machine is pushed at most once in one
 * byte's closure (which cuts left-recursive loops only: JSON values always consume a
 * byte before nesting). After each byte the set is bounded: JSON mode refuses more than
 * max_stacks stacks (an ambiguous schema); CFG mode keeps the max_stacks shortest, and a
 * frame pushed onto an identical idempotent frame is not pushed (L(r) L(r) = L(r)).
 *
 * Inside one call, stacks are items (machine, state, below) with `below` a hash-consed
 * chain of frames, so moving the top copies three ints and equal stacks are equal items.
 * A token is allowed iff stepping its bytes leaves a stack: masks walk the vocabulary's
 * byte trie (token_trie.py), one step per trie node, skipping the subtree of a node whose
 * step leaves nothing; states are expanded on first visit (lazy_dfa.c).
 *
 * Flat configurations (Python's view): [n_stacks, len_0, m, s, ..., len_1, ...], each
 * stack bottom first, stacks sorted by (length, contents): one canonical form per set.
 */
#include <stdlib.h>
#include <string.h>

#include "pushdown.h"

static uint64_t item_hash(Item it) {
    return mix64(((uint64_t)(uint32_t)it.m << 40) ^ ((uint64_t)(uint32_t)it.s << 20) ^ (uint32_t)it.below);
}

int32_t frame_of(Walk *W, int32_t m, int32_t s, int32_t parent) {
    if (W->frames.n * 2 >= W->hcap) {
        int64_t cap = W->hcap ? W->hcap * 2 : 256;
        int32_t *h2 = malloc(sizeof(int32_t) * (size_t)cap);
        if (!h2) { W->err = G_NOMEM; return -1; }
        for (int64_t k = 0; k < cap; k++) h2[k] = -1;
        for (int64_t f = 0; f < W->frames.n; f++) {
            Frame *x = (Frame *)W->frames.p + f;
            Item it = {x->m, x->s, x->parent};
            int64_t j = (int64_t)(item_hash(it) & (uint64_t)(cap - 1));
            while (h2[j] >= 0) j = (j + 1) & (cap - 1);
            h2[j] = (int32_t)f;
        }
        free(W->hv);
        W->hv = h2, W->hcap = cap;
    }
    Item key = {m, s, parent};
    int64_t j = (int64_t)(item_hash(key) & (uint64_t)(W->hcap - 1));
    while (W->hv[j] >= 0) {
        Frame *x = (Frame *)W->frames.p + W->hv[j];
        if (x->m == m && x->s == s && x->parent == parent) return W->hv[j];
        j = (j + 1) & (W->hcap - 1);
    }
    Frame f = {m, s, parent, parent >= 0 ? ((Frame *)W->frames.p)[parent].depth + 1 : 1};
    if (vec_push(&W->frames, &f)) { W->err = G_NOMEM; return -1; }
    W->hv[j] = (int32_t)(W->frames.n - 1);
    return W->hv[j];
}

/* The caller frame (m, r) pushed below a call; CFG mode folds it into an identical
 * idempotent frame right below. */
static int32_t push_frame(Walk *W, int32_t m, int32_t r, int32_t below) {
    if (!W->E->json_mode && below >= 0) {
        Frame *x = (Frame *)W->frames.p + below;
        if (x->m == m && x->s == r && machine_idempotent(W->E, m, r)) return below;
    }
    return frame_of(W, m, r, below);
}

int set_add(Walk *W, ItemSet *S, Item it) {
    if (S->n < LINEAR || !S->h) {
        for (int32_t k = 0; k < S->n; k++)
            if (S->v[k].m == it.m && S->v[k].s == it.s && S->v[k].below == it.below) return 0;
    } else {
        int32_t mask = S->hcap - 1, j = (int32_t)(item_hash(it) & (uint64_t)mask);
        for (; S->h[j] >= 0; j = (j + 1) & mask) {
            Item *x = &S->v[S->h[j]];
            if (x->m == it.m && x->s == it.s && x->below == it.below) return 0;
        }
    }
    if (S->n == S->cap) {
        int32_t cap = S->cap ? S->cap * 2 : 8;
        Item *v = realloc(S->v, sizeof(Item) * (size_t)cap);
        if (!v) { W->err = G_NOMEM; return -1; }
        S->v = v, S->cap = cap;
    }
    S->v[S->n++] = it;
    if (S->n >= LINEAR && (!S->h || S->n * 2 > S->hcap)) { /* (re)build the index */
        int32_t cap = 64;
        while (cap < S->n * 4) cap *= 2;
        int32_t *h = realloc(S->h, sizeof(int32_t) * (size_t)cap);
        if (!h) { W->err = G_NOMEM; return -1; }
        S->h = h, S->hcap = cap;
        for (int32_t k = 0; k < cap; k++) h[k] = -1;
        for (int32_t k = 0; k < S->n; k++) {
            int32_t j = (int32_t)(item_hash(S->v[k]) & (uint64_t)(cap - 1));
            while (h[j] >= 0) j = (j + 1) & (cap - 1);
            h[j] = k;
        }
    } else if (S->h && S->n > LINEAR) {
        int32_t j = (int32_t)(item_hash(it) & (uint64_t)(S->hcap - 1));
        while (S->h[j] >= 0) j = (j + 1) & (S->hcap - 1);
        S->h[j] = S->n - 1;
    }
    return 0;
}

void set_clear(ItemSet *S) {
    S->n = 0;
    if (S->h) { free(S->h); S->h = NULL; S->hcap = 0; }
}

static int in_fresh(const Walk *W, int32_t j) {
    for (int64_t k = 0; k < W->fresh.n; k++)
        if (((int32_t *)W->fresh.p)[k] == j) return 1;
    return 0;
}

void step_item(Walk *W, Item it, uint8_t b, ItemSet *out) {
    Engine *E = W->E;
    for (;;) { /* returns are a loop, not a call: a pop chain is as long as the stack */
        Machine *M = &E->m[it.m];
        int rc = machine_ready(E, M, it.s);
        if (rc != G_OK) { W->err = rc; return; }
        uint8_t f = flags_of(M, it.s);
        int32_t t = row_of(M, it.s)[b];
        if (t >= 0 && set_add(W, out, (Item){it.m, t, it.below})) return;
        if (f & F_CALLS) {
            int32_t off = ((int32_t *)M->call_off.p)[it.s], n = ((int32_t *)M->call_cnt.p)[it.s];
            for (int32_t k = 0; k < n && !W->err; k++) {
                Call c = ((Call *)M->calls.p)[off + k]; /* re-read: expansions may move the array */
                if (in_fresh(W, c.callee)) continue;
                int32_t nb = push_frame(W, it.m, c.ret, it.below);
                if (nb < 0 || vec_push(&W->fresh, &c.callee)) { W->err = W->err ? W->err : G_NOMEM; return; }
                step_item(W, (Item){c.callee, 0, nb}, b, out);
                W->fresh.n--;
            }
        }
        if (it.below < 0 || !(f & F_ACCEPT) || W->err) return;
        if (it.below == W->sentinel) { /* a frame walk: the caller is not known, note where */
            int32_t *e = W->exits.p;
            if ((!W->exits.n || e[W->exits.n - 1] != W->node) && vec_push(&W->exits, &W->node)) W->err = G_NOMEM;
            return;
        }
        Frame fr = ((Frame *)W->frames.p)[it.below];
        it = (Item){fr.m, fr.s, fr.parent};
    }
}

/* Flattens an item's stack bottom first into buf (2 * depth ints); returns the count. */
static int32_t flatten(const Walk *W, Item it, int32_t *buf) {
    int32_t depth = it.below >= 0 ? ((Frame *)W->frames.p)[it.below].depth + 1 : 1;
    int32_t k = 2 * depth;
    buf[--k] = it.s, buf[--k] = it.m;
    for (int32_t f = it.below; f >= 0; f = ((Frame *)W->frames.p)[f].parent)
        buf[--k] = ((Frame *)W->frames.p)[f].s, buf[--k] = ((Frame *)W->frames.p)[f].m;
    return 2 * depth;
}

static __thread const Walk *sort_walk;

static int cmp_items(const void *pa, const void *pb) {
    const Walk *W = sort_walk;
    Item a = *(const Item *)pa, b = *(const Item *)pb;
    int32_t da = a.below >= 0 ? ((Frame *)W->frames.p)[a.below].depth : 0;
    int32_t db = b.below >= 0 ? ((Frame *)W->frames.p)[b.below].depth : 0;
    if (da != db) return da < db ? -1 : 1;
    int32_t *x = malloc(sizeof(int32_t) * (size_t)(2 * da + 2)), *y = malloc(sizeof(int32_t) * (size_t)(2 * db + 2));
    int r = 0;
    if (x && y) {
        int32_t n = flatten(W, a, x);
        flatten(W, b, y);
        for (int32_t k = 0; k < n && !r; k++) r = x[k] < y[k] ? -1 : x[k] > y[k];
    }
    free(x);
    free(y);
    return r;
}

/* out := the bounded set after byte b from `in`; G_TOO_MANY (JSON mode) or an error. */
int step_set(Walk *W, const ItemSet *in, uint8_t b, ItemSet *out) {
    Engine *E = W->E;
    set_clear(out);
    if (in->n == 1) { /* the common case: one stack whose top only moves */
        Item it = in->v[0];
        Machine *M = &E->m[it.m];
        uint8_t f = flags_of(M, it.s);
        if ((f & F_EXPANDED) && !(f & F_CALLS) && (it.below < 0 || !(f & F_ACCEPT))) {
            int32_t t = row_of(M, it.s)[b];
            if (t >= 0) return set_add(W, out, (Item){it.m, t, it.below}) ? W->err : G_OK;
            return G_OK;
        }
    }
    for (int32_t k = 0; k < in->n && !W->err; k++) {
        W->fresh.n = 0;
        step_item(W, in->v[k], b, out);
    }
    if (W->err) return W->err;
    if (out->n > E->max_stacks) {
        if (E->json_mode) return G_TOO_MANY;
        sort_walk = W;
        qsort(out->v, (size_t)out->n, sizeof(Item), cmp_items);
        out->n = E->max_stacks;
        if (out->h) { free(out->h); out->h = NULL; out->hcap = 0; }
    }
    return G_OK;
}

/* Reads a flat configuration into items. */
int read_config(Walk *W, const int32_t *cfg, int64_t n, ItemSet *out) {
    Engine *E = W->E;
    if (n < 1) return G_BAD_CONFIG;
    int64_t ns = cfg[0], i = 1;
    for (int64_t k = 0; k < ns; k++) {
        if (i >= n) return G_BAD_CONFIG;
        int64_t len = cfg[i++];
        if (len < 2 || (len & 1) || i + len > n) return G_BAD_CONFIG;
        int32_t below = -1;
        for (int64_t q = 0; q < len; q += 2) {
            int32_t m = cfg[i + q], s = cfg[i + q + 1];
            if (m < 0 || m >= E->n || s < 0 || s >= E->m[m].n) return G_BAD_CONFIG;
            if (q + 2 < len) {
                below = frame_of(W, m, s, below);
                if (below < 0) return W->err;
            } else if (set_add(W, out, (Item){m, s, below})) {
                return W->err;
            }
        }
        i += len;
    }
    return G_OK;
}

/* Writes `S` in canonical flat form; the int count, or -ERR_BUFFER. */
static int64_t write_config(Walk *W, ItemSet *S, int32_t *out, int64_t cap) {
    sort_walk = W;
    qsort(S->v, (size_t)S->n, sizeof(Item), cmp_items);
    int64_t i = 1;
    if (cap < 1) return -ERR_BUFFER;
    out[0] = S->n;
    for (int32_t k = 0; k < S->n; k++) {
        int32_t depth = S->v[k].below >= 0 ? ((Frame *)W->frames.p)[S->v[k].below].depth + 1 : 1;
        if (i + 1 + 2 * depth > cap) return -ERR_BUFFER;
        out[i++] = 2 * depth;
        i += flatten(W, S->v[k], out + i);
    }
    return i;
}

void walk_free(Walk *W) {
    free(W->frames.p);
    free(W->hv);
    free(W->fresh.p);
    free(W->exits.p);
}

static int can_end_items(const Walk *W, const ItemSet *S) {
    for (int32_t k = 0; k < S->n; k++) {
        Item it = S->v[k];
        int ok = (flags_of(&W->E->m[it.m], it.s) & F_ACCEPT) != 0;
        for (int32_t f = it.below; f >= 0 && ok; f = ((Frame *)W->frames.p)[f].parent) {
            Frame *x = (Frame *)W->frames.p + f;
            ok = (flags_of(&W->E->m[x->m], x->s) & F_ACCEPT) != 0;
        }
        if (ok) return 1;
    }
    return 0;
}


/* ------------------------------------------------------------------ API */

/* Steps `cfg` by `data`; writes the new flat configuration to `out` (cap ints). Returns
 * the ints written, 0 when no stack survives, or -status (-ERR_BUFFER: grow `out`). */
int64_t sgl_gram_step(Engine *E, const int32_t *cfg, int64_t n, const uint8_t *data, int64_t nbytes, int32_t *out,
                      int64_t cap) {
    pthread_mutex_lock(&E->mu);
    Walk W = WALK_INIT(E);
    ItemSet a = {0}, b = {0};
    int64_t rc = read_config(&W, cfg, n, &a);
    for (int64_t k = 0; k < nbytes && rc == G_OK && a.n; k++) {
        rc = step_set(&W, &a, data[k], &b);
        ItemSet t = a;
        a = b, b = t;
    }
    if (rc == G_OK) rc = a.n ? write_config(&W, &a, out, cap) : 0;
    else rc = -rc;
    free(a.v); free(a.h); free(b.v); free(b.h);
    walk_free(&W);
    pthread_mutex_unlock(&E->mu);
    return rc;
}

/* 1 when some stack of `cfg` has every frame accepting (EOS allowed), 0 if not, -status. */
int32_t sgl_gram_can_end(Engine *E, const int32_t *cfg, int64_t n) {
    pthread_mutex_lock(&E->mu);
    Walk W = WALK_INIT(E);
    ItemSet a = {0};
    int rc = read_config(&W, cfg, n, &a);
    int32_t r = rc == G_OK ? can_end_items(&W, &a) : -rc;
    free(a.v); free(a.h);
    walk_free(&W);
    pthread_mutex_unlock(&E->mu);
    return r;
}

/* The bytes every continuation of `cfg` starts with (at most cap): while it cannot end
 * and exactly one byte leaves a stack. Returns the count, or -status. */
int64_t sgl_gram_forced(Engine *E, const int32_t *cfg, int64_t n, uint8_t *out, int64_t cap) {
    pthread_mutex_lock(&E->mu);
    Walk W = WALK_INIT(E);
    ItemSet cur = {0}, tmp = {0}, keep = {0};
    int rc = read_config(&W, cfg, n, &cur);
    int64_t len = 0;
    while (rc == G_OK && len < cap && cur.n && !can_end_items(&W, &cur)) {
        int found = -1, count = 0;
        for (int b = 0; b < 256 && count < 2; b++) {
            int r = step_set(&W, &cur, (uint8_t)b, &tmp);
            if (r == G_TOO_MANY) continue;
            if (r != G_OK) { rc = r; break; }
            if (tmp.n) {
                count++, found = b;
                ItemSet t = keep;
                keep = tmp, tmp = t;
            }
        }
        if (rc != G_OK || count != 1) break;
        out[len++] = (uint8_t)found;
        ItemSet t = cur;
        cur = keep, keep = t;
    }
    free(cur.v); free(cur.h); free(tmp.v); free(tmp.h); free(keep.v); free(keep.h);
    walk_free(&W);
    pthread_mutex_unlock(&E->mu);
    return rc == G_OK ? len : -rc;
}
