/* Building an engine from Python (native/binding.py): machines from regex text, from
 * tables, as intersections; finalize; the vocabulary trie; export of a whole DFA.
 *
 * Machine ids are Python's: 0 is the root, a call marker U+10F000 + i calls machine
 * i + 1, intersection parts are extra (hidden) machines after the called ones.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar.h"

Engine *sgl_gram_new(int32_t n_machines, int32_t json_mode, int32_t max_stacks, int64_t max_states,
                     int64_t max_set_bytes) {
    Engine *E = calloc(1, sizeof(Engine));
    if (!E) return NULL;
    E->n = n_machines;
    E->m = calloc((size_t)n_machines + 1, sizeof(Machine));
    E->nonempty = calloc((size_t)n_machines + 1, 1);
    if (!E->m || !E->nonempty) {
        free(E->m);
        free(E->nonempty);
        free(E);
        return NULL;
    }
    for (int32_t i = 0; i < n_machines; i++) {
        Machine *M = &E->m[i];
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
    E->json_mode = json_mode;
    E->max_stacks = max_stacks;
    E->max_states = max_states;
    E->max_set_members = max_set_bytes / (int64_t)sizeof(int32_t);
    pthread_mutex_init(&E->mu, NULL);
    return E;
}

void sgl_gram_free(Engine *E) {
    if (E) engine_free(E);
}

static int settable(Engine *E, int32_t m) {
    return !E->finalized && m >= 0 && m < E->n && E->m[m].kind == M_EMPTY;
}

/* Machine m from regex text. flags: RE_CALLS (machine mode). Returns a status; for
 * G_UNSUPPORTED the message is in err and the machine stays unset. */
int32_t sgl_gram_set_regex(Engine *E, int32_t m, const uint8_t *pattern, int64_t len, const int32_t *uni,
                           int32_t flags, int32_t hidden, int32_t no_empty, int64_t max_nfa_states, char *err,
                           int32_t errlen) {
    if (!settable(E, m)) return G_BAD_CONFIG;
    Machine *M = &E->m[m];
    int rc = regex_to_nfa(pattern, len, uni, flags, max_nfa_states, &M->nfa, err, errlen);
    if (rc != G_OK) return rc;
    M->kind = M_NFA;
    M->hidden = hidden;
    M->no_empty = no_empty;
    return G_OK;
}

/* Machine m as a table: trans [n, 256] (-1 dead), accept [n], calls (src, callee, ret)
 * sorted by src. */
int32_t sgl_gram_set_table(Engine *E, int32_t m, const int32_t *trans, const uint8_t *accept, int32_t n,
                           const int32_t *call_src, const int32_t *call_callee, const int32_t *call_ret,
                           int32_t ncalls, int32_t hidden) {
    if (!settable(E, m) || n < 1) return G_BAD_CONFIG;
    Machine *M = &E->m[m];
    /* Everything is checked before the first state is added: a refused table leaves the
     * machine unset (no half-built states whose rows were never written). */
    for (int64_t k = 0; k < (int64_t)n * 256; k++)
        if (trans[k] < -1 || trans[k] >= n) return G_BAD_CONFIG;
    for (int32_t k = 0; k < ncalls; k++) {
        int32_t s = call_src[k];
        if (s < 0 || s >= n || call_ret[k] < 0 || call_ret[k] >= n || call_callee[k] < 0) return G_BAD_CONFIG;
        if (k && call_src[k - 1] > s) return G_BAD_CONFIG;
    }
    if (E->total_states + n > E->max_states) return G_TOO_LARGE;
    for (int32_t s = 0; s < n; s++) {
        int64_t id = machine_new_state(E, M);
        if (id < 0) return (int32_t)-id;
        memcpy(row_of(M, s), trans + (int64_t)s * 256, 256 * sizeof(int32_t));
        ((uint8_t *)M->flags.p)[s] = (uint8_t)(F_EXPANDED | (accept[s] ? F_ACCEPT : 0));
    }
    /* calls grouped by source state, in the order given (sorted by src by the caller) */
    for (int32_t k = 0; k < ncalls; k++) {
        int32_t s = call_src[k];
        int32_t *cnt = &((int32_t *)M->call_cnt.p)[s];
        if (!*cnt) ((int32_t *)M->call_off.p)[s] = (int32_t)M->calls.n;
        Call c = {call_callee[k], call_ret[k]};
        if (vec_push(&M->calls, &c)) return G_NOMEM;
        (*cnt)++;
        ((uint8_t *)M->flags.p)[s] |= F_CALLS;
    }
    M->kind = M_TABLE;
    M->hidden = hidden;
    return G_OK;
}

/* Machine m as the intersection of the hidden machines `parts`. */
int32_t sgl_gram_set_intersect(Engine *E, int32_t m, const int32_t *parts, int32_t nparts) {
    if (!settable(E, m) || nparts < 1) return G_BAD_CONFIG;
    Machine *M = &E->m[m];
    M->parts = malloc(sizeof(int32_t) * (size_t)nparts);
    if (!M->parts) return G_NOMEM;
    memcpy(M->parts, parts, sizeof(int32_t) * (size_t)nparts);
    M->nparts = nparts;
    M->kind = M_INTERSECT;
    return G_OK;
}

int32_t sgl_gram_finalize(Engine *E, int32_t root, char *err, int32_t errlen) {
    pthread_mutex_lock(&E->mu);
    int rc = E->finalized ? G_BAD_CONFIG : engine_finalize(E, root, err, errlen);
    pthread_mutex_unlock(&E->mu);
    return rc;
}

/* The vocabulary's byte trie (token_trie.py); the arrays must outlive the engine. */
void sgl_gram_set_trie(Engine *E, const uint32_t *node, const int32_t *next, const int32_t *tok_start,
                       const int32_t *tok_ids, const uint64_t *sub_bytes, const int32_t *height,
                       const int32_t *level_nodes, const int32_t *level_off, Slices *slices, int32_t n_nodes,
                       int32_t max_depth, int32_t vocab_size) {
    pthread_mutex_lock(&E->mu);
    E->vocab_size = vocab_size;
    E->node = node, E->next = next, E->tok_start = tok_start, E->tok_ids = tok_ids, E->sub_bytes = sub_bytes;
    E->height = height, E->level_nodes = level_nodes, E->level_off = level_off;
    E->slices = slices;
    E->n_nodes = n_nodes, E->max_depth = max_depth;
    pthread_mutex_unlock(&E->mu);
}

/* Expands every state of machine m reachable from state 0 (and its return states);
 * returns the state count, or -status. */
int64_t sgl_gram_expand_all(Engine *E, int32_t m) {
    pthread_mutex_lock(&E->mu);
    int64_t r;
    if (!E->finalized || m < 0 || m >= E->n) {
        r = -G_BAD_CONFIG;
    } else {
        Machine *M = &E->m[m];
        r = 0;
        for (int32_t s = 0; s < M->n && r == 0; s++) r = -(int64_t)machine_ready(E, M, s);
        if (r == 0) r = M->n;
    }
    pthread_mutex_unlock(&E->mu);
    return r;
}

/* Copies machine m's rows and accept flags (after sgl_gram_expand_all). */
int32_t sgl_gram_export(Engine *E, int32_t m, int32_t *trans, uint8_t *accept) {
    pthread_mutex_lock(&E->mu);
    Machine *M = &E->m[m];
    int rc = G_OK;
    for (int32_t s = 0; s < M->n; s++) {
        if (!(flags_of(M, s) & F_EXPANDED)) { rc = G_BAD_CONFIG; break; }
        memcpy(trans + (int64_t)s * 256, row_of(M, s), 256 * sizeof(int32_t));
        accept[s] = (flags_of(M, s) & F_ACCEPT) != 0;
    }
    pthread_mutex_unlock(&E->mu);
    return rc;
}

/* [DFA states built in all, machines, sticky status, frame masks cached, frame walks] */
void sgl_gram_stats(Engine *E, int64_t *out) {
    pthread_mutex_lock(&E->mu);
    out[0] = E->total_states;
    out[1] = E->n;
    out[2] = E->status;
    out[3] = E->n_fmasks;
    out[4] = E->frame_walks;
    pthread_mutex_unlock(&E->mu);
}

/* The state count of machine m so far (states of configurations must be below it). */
int64_t sgl_gram_machine_states(Engine *E, int32_t m) {
    pthread_mutex_lock(&E->mu);
    int64_t r = m >= 0 && m < E->n ? E->m[m].n : -G_BAD_CONFIG;
    pthread_mutex_unlock(&E->mu);
    return r;
}
