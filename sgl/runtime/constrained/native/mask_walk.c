/* Token masks: the vocabulary's byte trie walked against a configuration.
 *
 * A walk steps each trie node once from its parent's set (pushdown_walk.c's step_set)
 * and skips the subtree of a node whose step leaves nothing. Two shortcuts carry most
 * of the cost away:
 *
 *  - runs: where a single stack's top only moves, a subtree spelled only with the bytes
 *    of the top state's run (grammar.h) and no deeper than it is allowed whole, so a
 *    string body costs the few subtrees with quotes, escapes or non-ASCII bytes in them;
 *    deeper than a run that dies (a counted string near its bound), only the subtree's
 *    tokens that end within the run, found by depth (token_trie.py's level lists);
 *  - frame masks: for a one-stack configuration the tokens that never return below the
 *    top frame (m, s) do not depend on the frames below. They are walked once per frame
 *    with a sentinel below it, which records the trie nodes where a return happens
 *    ("exits") instead of stepping; the mask of any stack with that top is the cached
 *    set plus, from each exit, the caller stepped by that node's byte and its subtree
 *    walked on. A block machine counting a 32k-character string, or a string machine
 *    called from many places, is walked once, not once per position or caller.
 *
 * Masks are bit-packed (a 49k vocabulary: 6 KB), so a cached frame mask joins a result
 * in 768 word ORs. At most MAX_FRAME_MASKS are kept per engine; past that the cache is
 * dropped and refilled.
 */
#include <stdlib.h>
#include <string.h>

#include "pushdown.h"

#define MAX_FRAME_MASKS 4096

typedef struct {
    uint64_t *bits;  /* tokens allowed without returning below the frame */
    int32_t *exits;  /* trie nodes whose byte is stepped by the caller */
    int32_t n_exits;
    int framed;      /* walked with a sentinel below (exits known), not as a bottom frame */
} FrameMask;

/* A mask walk's level: the set after the bytes of one trie depth, and, for a single
 * stack whose top only moves (no calls, no return possible), that top's row and run. */
typedef struct {
    ItemSet set;
    int ready, simple;
    int sliced; /* the bytes to here are all in the walk's slice set (Walk.slice_k) */
    const int32_t *row;
    Run run;
} Level;

/* The target most bytes of `r` share (the first such in byte order), or -1. Rows are
 * runs of equal entries (byte classes), so targets are counted per segment. */
static int32_t widest_target(const int32_t *r) {
    int32_t tgt[256], cnt[256], nt = 0, best = -1, best_n = 0;
    for (int b = 0; b < 256;) {
        int e = b + 1;
        while (e < 256 && r[e] == r[b]) e++;
        if (r[b] >= 0) {
            int32_t k = 0;
            while (k < nt && tgt[k] != r[b]) k++;
            if (k == nt) tgt[nt] = r[b], cnt[nt++] = 0;
            cnt[k] += e - b;
        }
        b = e;
    }
    for (int32_t k = 0; k < nt; k++)
        if (cnt[k] > best_n) best = tgt[k], best_n = cnt[k];
    return best;
}

/* The run of state s (grammar.h). Expands the states along it. */
static int run_of(Engine *E, Machine *M, int32_t s, Run *out) {
    if (flags_of(M, s) & F_RUN) {
        *out = ((Run *)M->runs.p)[s];
        return G_OK;
    }
    int32_t best = widest_target(row_of(M, s));
    Run run = {{0, 0, 0, 0}, 0, 0, 0, 0};
    if (best >= 0) {
        const int32_t *r = row_of(M, s);
        int lo[128], hi[128], nr = 0; /* K as byte ranges [lo, hi) */
        for (int b = 0; b < 256;) {
            if (r[b] != best) { b++; continue; }
            int e = b + 1;
            while (e < 256 && r[e] == best) e++;
            lo[nr] = b, hi[nr++] = e;
            for (int c = b; c < e; c++) run.k[c >> 6] |= 1ULL << (c & 63);
            b = e;
        }
        int32_t path[64], n = 0, cur = best;
        run.depth = 1;
        while (run.depth < E->max_depth) {
            int cycle = cur == s;
            for (int32_t k = 0; k < n && !cycle; k++) cycle = path[k] == cur;
            if (cycle) {
                run.depth = INT32_MAX;
                break;
            }
            if (n < 64) path[n++] = cur;
            int rc = machine_ready(E, M, cur);
            if (rc != G_OK) return rc;
            uint8_t f = flags_of(M, cur);
            run.acc |= (f & F_ACCEPT) != 0, run.calls |= (f & F_CALLS) != 0;
            const int32_t *next_row = row_of(M, cur);
            int32_t nxt = next_row[lo[0]], same = 1;
            for (int q = 0; q < nr && same; q++) {
                int32_t diff = 0;
                for (int c = lo[q]; c < hi[q]; c++) diff |= next_row[c] ^ nxt;
                same = !diff;
            }
            if (!same) break;
            if (nxt < 0) {
                run.dead = 1;
                break;
            }
            cur = nxt;
            run.depth++;
        }
    }
    ((Run *)M->runs.p)[s] = run; /* by index: expansions above may have moved the array */
    ((uint8_t *)M->flags.p)[s] |= F_RUN;
    *out = run;
    return G_OK;
}

static int level_ready(Walk *W, Level *L) {
    L->ready = 1, L->simple = 0, L->run.depth = 0;
    if (L->set.n != 1) return G_OK;
    Item it = L->set.v[0];
    Machine *M = &W->E->m[it.m];
    int rc = machine_ready(W->E, M, it.s);
    if (rc != G_OK) return rc;
    uint8_t f = flags_of(M, it.s);
    L->simple = !(f & F_CALLS) && (it.below < 0 || !(f & F_ACCEPT));
    L->row = row_of(M, it.s);
    if (L->simple && W->E->sub_bytes) return run_of(W->E, M, it.s, &L->run);
    return G_OK;
}

void mark_tokens(const Engine *E, int32_t from, int32_t to, uint64_t *out) {
    for (int32_t k = E->tok_start[from]; k < E->tok_start[to]; k++) {
        int32_t t = E->tok_ids[k];
        out[t >> 6] |= 1ULL << (t & 63);
    }
}

/* The first k in [lo, hi) with v[k] >= x (v ascending), else hi. */
static int32_t lower_bound(const int32_t *v, int32_t lo, int32_t hi, int32_t x) {
    while (lo < hi) {
        int32_t mid = lo + (hi - lo) / 2;
        if (v[mid] < x) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* Marks the tokens of subtree [i, end) that end at depth `deepest` or above: each
 * depth's token nodes are a sorted list, where the subtree is one range. */
static void mark_shallow(const Engine *E, int32_t i, int32_t end, int32_t deepest, uint64_t *out) {
    int32_t top = (int32_t)((E->node[i] >> 8) & 0xffff);
    if (deepest > top - 1 + E->height[i]) deepest = top - 1 + E->height[i];
    for (int32_t d = top; d <= deepest; d++) {
        int32_t lo = lower_bound(E->level_nodes, E->level_off[d], E->level_off[d + 1], i);
        int32_t hi = lower_bound(E->level_nodes, lo, E->level_off[d + 1], end);
        for (int32_t k = lo; k < hi; k++) mark_tokens(E, E->level_nodes[k], E->level_nodes[k] + 1, out);
    }
}

/* Walks trie nodes [i, end), whose parents' sets are in lv (lv[depth(i) - 1] set by the
 * caller), marking every token a stack survives. */
static int walk_nodes(Walk *W, Level *lv, int32_t i, int32_t end, uint64_t *out) {
    const Engine *E = W->E;
    while (i < end) {
        uint32_t w = E->node[i];
        int d = (int)((w >> 8) & 0xffff);
        Level *P = &lv[d - 1], *L = &lv[d];
        int rc;
        if (!P->ready && (rc = level_ready(W, P)) != G_OK) return rc;
        L->ready = 0;
        if (W->sliced) {
            const uint64_t *sb = E->sub_bytes + 4 * (int64_t)i, *k = W->slice_k;
            int b = (int)(w & 0xff);
            L->sliced = P->sliced && ((k[b >> 6] >> (b & 63)) & 1);
            if (L->sliced && !((sb[0] & ~k[0]) | (sb[1] & ~k[1]) | (sb[2] & ~k[2]) | (sb[3] & ~k[3])) &&
                (d - 1 + E->height[i] <= W->slice_r || W->slice_cut)) {
                i = E->next[i]; /* every token below is in the slice taken, or dies */
                continue;
            }
        }
        if (P->run.depth) {
            const uint64_t *sb = E->sub_bytes + 4 * (int64_t)i, *k = P->run.k;
            if (!((sb[0] & ~k[0]) | (sb[1] & ~k[1]) | (sb[2] & ~k[2]) | (sb[3] & ~k[3]))) {
                if (E->height[i] <= P->run.depth) {
                    mark_tokens(E, i, E->next[i], out); /* the whole subtree */
                    i = E->next[i];
                    continue;
                }
                /* Deeper than a run that dies: the tokens within it, nothing below (no
                 * call or pop on the path could carry a token past its end). */
                if (P->run.dead && !P->run.calls && (!P->run.acc || P->set.v[0].below < 0) && E->level_nodes) {
                    mark_shallow(E, i, E->next[i], d - 1 + P->run.depth, out);
                    i = E->next[i];
                    continue;
                }
            }
        }
        if (P->simple) {
            int32_t t = P->row[w & 0xff];
            if (t < 0) {
                i = E->next[i];
                continue;
            }
            set_clear(&L->set);
            L->set.v[0] = (Item){P->set.v[0].m, t, P->set.v[0].below};
            L->set.n = 1;
        } else {
            W->node = i;
            int r = step_set(W, &P->set, (uint8_t)(w & 0xff), &L->set);
            if (r == G_TOO_MANY) L->set.n = 0; /* the step would refuse it: not allowed */
            else if (r != G_OK) return r;
            if (!L->set.n) {
                i = E->next[i];
                continue;
            }
        }
        if (w & (1u << 24)) mark_tokens(E, i, i + 1, out);
        i++;
    }
    return G_OK;
}

/* Walks the whole trie from lv[0] (set by the caller). A single top whose state has a
 * run takes the run's token slice at once (token_slices.c); subtrees whose tokens are
 * all in it (or, past a run that dies, cannot live) are then not walked. */
static int walk_root(Walk *W, Level *lv, uint64_t *out) {
    Engine *E = W->E;
    Level *P = &lv[0];
    int rc = level_ready(W, P);
    if (rc != G_OK) return rc;
    const Slice *sl = P->run.depth && E->slices ? slice_of(E, P->run.k) : NULL;
    if (sl) {
        W->sliced = 1, P->sliced = 1;
        W->slice_r = P->run.depth < E->max_depth ? P->run.depth : E->max_depth;
        W->slice_cut = P->run.dead && !P->run.calls && (!P->run.acc || P->set.v[0].below < 0);
        memcpy(W->slice_k, P->run.k, sizeof(W->slice_k));
        slice_mark(E, sl, W->slice_r, out);
    }
    rc = walk_nodes(W, lv, 0, E->n_nodes, out);
    W->sliced = 0;
    return rc;
}

static Level *levels_new(const Engine *E) {
    Level *lv = calloc((size_t)E->max_depth + 1, sizeof(Level));
    if (!lv) return NULL;
    for (int32_t d = 0; d <= E->max_depth; d++) { /* room for one item per level */
        lv[d].set.v = malloc(sizeof(Item) * 8);
        lv[d].set.cap = 8;
        if (!lv[d].set.v) {
            for (int32_t k = 0; k <= d; k++) free(lv[k].set.v);
            free(lv);
            return NULL;
        }
    }
    return lv;
}

static void levels_free(const Engine *E, Level *lv) {
    if (!lv) return;
    for (int32_t k = 0; k <= E->max_depth; k++) free(lv[k].set.v), free(lv[k].set.h);
    free(lv);
}

void frame_masks_free(Engine *E) {
    for (int32_t i = 0; i < E->n; i++) {
        Machine *M = &E->m[i];
        for (int64_t s = 0; s < M->fmasks.n; s++) {
            FrameMask *f = ((FrameMask **)M->fmasks.p)[s];
            if (f) free(f->bits), free(f->exits), free(f);
            ((FrameMask **)M->fmasks.p)[s] = NULL;
        }
    }
    E->n_fmasks = 0;
}

/* The frame mask of (m, s), cached: walked with a sentinel frame below when `framed`
 * (a stack with frames below needs the exits), else as a bottom frame, which takes the
 * same tokens (a pop into the sentinel steps nothing) and lets an accepting state keep
 * its run (a regex constraint accepts almost everywhere). */
static int frame_mask(Engine *E, Level *lv, int32_t m, int32_t s, int framed, FrameMask **res) {
    FrameMask **slot = (FrameMask **)E->m[m].fmasks.p + s, *got = *slot;
    if (got && (got->framed || !framed)) {
        *res = got;
        return G_OK;
    }
    if (!got && E->n_fmasks >= MAX_FRAME_MASKS) frame_masks_free(E);
    Walk W = WALK_INIT(E);
    FrameMask *f = calloc(1, sizeof(FrameMask));
    int64_t words = (E->vocab_size + 63) / 64;
    int rc = G_NOMEM;
    if (!f || !(f->bits = calloc((size_t)words, sizeof(uint64_t)))) goto done;
    W.sentinel = framed ? frame_of(&W, -1, -1, -1) : -1;
    set_clear(&lv[0].set);
    lv[0].set.n = 0;
    if ((framed && W.sentinel < 0) || set_add(&W, &lv[0].set, (Item){m, s, W.sentinel})) goto done;
    lv[0].ready = 0;
    if ((rc = walk_root(&W, lv, f->bits)) != G_OK) goto done;
    f->n_exits = (int32_t)W.exits.n;
    f->exits = W.exits.p, W.exits.p = NULL;
    f->framed = framed;
    slot = (FrameMask **)E->m[m].fmasks.p + s; /* the walk's expansions may have moved the array */
    if (*slot) free((*slot)->bits), free((*slot)->exits), free(*slot); /* a bottom frame's, now framed */
    else E->n_fmasks++;
    *slot = f;
    E->frame_walks++;
    *res = f, f = NULL;
    rc = G_OK;
done:
    if (f) free(f->bits), free(f);
    walk_free(&W);
    return rc;
}

/* A one-stack configuration: the top's frame mask, then, with a frame below the top,
 * each exit continued by the caller (with none, a pop has nowhere to go). The caller's
 * set after a byte is the same for every exit node with that byte, so it is stepped
 * once per byte; an exit node without children only asks whether that set is empty. */
static int stack_mask(Walk *W, Level *lv, Item top, uint64_t *out) {
    Engine *E = W->E;
    FrameMask *f;
    int rc = frame_mask(E, lv, top.m, top.s, top.below >= 0, &f);
    if (rc != G_OK) return rc;
    for (int64_t w = 0; w < (E->vocab_size + 63) / 64; w++) out[w] |= f->bits[w];
    if (!f->n_exits || top.below < 0) return G_OK; /* nothing below: a pop ends the stack */
    Frame caller = ((Frame *)W->frames.p)[top.below];
    ItemSet *after = calloc(256, sizeof(ItemSet)); /* the caller's set after byte b */
    uint8_t done[256] = {0};
    if (!after) return G_NOMEM;
    for (int32_t k = 0; k < f->n_exits && rc == G_OK; k++) {
        int32_t j = f->exits[k];
        uint32_t w = E->node[j];
        int b = (int)(w & 0xff), d = (int)((w >> 8) & 0xffff);
        if (!done[b]) {
            done[b] = 1;
            W->fresh.n = 0;
            step_item(W, (Item){caller.m, caller.s, caller.parent}, (uint8_t)b, &after[b]);
            if (W->err) { rc = W->err; break; }
        }
        if (!after[b].n) continue;
        if (w & (1u << 24)) mark_tokens(E, j, j + 1, out);
        if (E->next[j] == j + 1) continue; /* no subtree */
        Level *L = &lv[d];
        set_clear(&L->set);
        for (int32_t q = 0; q < after[b].n && rc == G_OK; q++)
            if (set_add(W, &L->set, after[b].v[q])) rc = W->err;
        L->ready = 0;
        if (rc == G_OK) rc = walk_nodes(W, lv, j + 1, E->next[j], out);
    }
    for (int b = 0; b < 256; b++) free(after[b].v), free(after[b].h);
    free(after);
    return rc;
}

/* Sets bit t of `out` (uint64 words, token t in word t / 64, bit t % 64) for every token
 * some stack of `cfg` can take whole; other bits are left as they were. Returns 0, or
 * -status. */
int64_t sgl_gram_mask(Engine *E, const int32_t *cfg, int64_t n, uint64_t *out) {
    pthread_mutex_lock(&E->mu);
    Walk W = WALK_INIT(E);
    Level *lv = levels_new(E);
    int rc = lv ? read_config(&W, cfg, n, &lv[0].set) : G_NOMEM;
    if (rc == G_OK && lv[0].set.n == 1) { /* one stack: its top's frame mask, cached */
        Item top = lv[0].set.v[0];
        rc = stack_mask(&W, lv, top, out);
    } else if (rc == G_OK) {
        rc = walk_nodes(&W, lv, 0, E->n_nodes, out);
    }
    levels_free(E, lv);
    walk_free(&W);
    pthread_mutex_unlock(&E->mu);
    return -rc;
}

/* out[t] |= bit t of `bits`, for t < n: a packed mask into a bool row. */
void sgl_gram_bits_or(const uint64_t *bits, uint8_t *out, int64_t n) {
    for (int64_t w = 0; w < (n + 63) / 64; w++) {
        uint64_t x = bits[w];
        if (!x) continue;
        int64_t base = w * 64, lim = n - base < 64 ? n - base : 64;
        if (x == ~0ULL && lim == 64) {
            memset(out + base, 1, 64);
            continue;
        }
        for (; x; x &= x - 1) {
            int b = __builtin_ctzll(x);
            if (b < lim) out[base + b] = 1;
        }
    }
}

/* [is (m, s)'s frame mask cached, its exit count] (tests, diagnostics). */
void sgl_gram_frame_info(Engine *E, int32_t m, int32_t s, int64_t *out) {
    pthread_mutex_lock(&E->mu);
    FrameMask *f = m >= 0 && m < E->n && s >= 0 && s < E->m[m].fmasks.n ? ((FrameMask **)E->m[m].fmasks.p)[s] : NULL;
    out[0] = f != NULL;
    out[1] = f ? f->n_exits : 0;
    pthread_mutex_unlock(&E->mu);
}
