/* Token slices: for a byte set K, the tokens spelled only with bytes of K, by length,
 * as packed masks. A walk standing in a state whose run (grammar.h) takes r bytes of K
 * allows every such token of length <= r at once: one OR of 6 KB instead of marking
 * a JSON string body's ~40k tokens one by one, or, near a counted string's bound,
 * finding its short ones depth by depth.
 *
 * One table per vocabulary trie, shared by every engine over it (token_trie.py owns
 * it through native/binding.py); a slice is built the first time a K is asked for and
 * then never changes or moves, so readers hold no lock. At most MAX_SLICES are kept;
 * past that a new K gets none and the walk goes on without.
 */
#include <stdlib.h>
#include <string.h>

#include "pushdown.h"

#define MAX_SLICES 64

struct Slices {
    pthread_mutex_t mu; /* guards adding; a published slice is read without it */
    int32_t n, words;
    Slice *s[MAX_SLICES];
};

Slices *sgl_gram_slices_new(int32_t vocab_size) {
    Slices *t = calloc(1, sizeof(Slices));
    if (!t) return NULL;
    pthread_mutex_init(&t->mu, NULL);
    t->words = (vocab_size + 63) / 64;
    return t;
}

void sgl_gram_slices_free(Slices *t) {
    if (!t) return;
    for (int32_t i = 0; i < t->n; i++) free(t->s[i]->rows), free(t->s[i]->deep), free(t->s[i]);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

/* Builds K's slice: one pass over the trie in preorder (a node's path is pure when its
 * parent's is and its byte is in K), the deep token nodes then read from the trie's
 * depth-ordered level lists. */
static Slice *build(const Engine *E, int32_t words, const uint64_t k[4]) {
    Slice *s = calloc(1, sizeof(Slice));
    uint8_t *pure = malloc((size_t)E->max_depth + 2), *node_pure = malloc((size_t)E->n_nodes + 1);
    if (s) s->rows = calloc((size_t)(SLICE_ROWS + 1) * (size_t)words, sizeof(uint64_t));
    if (!s || !pure || !node_pure || !s->rows) goto fail;
    memcpy(s->k, k, sizeof(s->k));
    s->words = words;
    pure[0] = 1;
    for (int32_t i = 0; i < E->n_nodes; i++) {
        uint32_t w = E->node[i];
        int32_t b = (int32_t)(w & 0xff), d = (int32_t)((w >> 8) & 0xffff);
        node_pure[i] = pure[d] = pure[d - 1] && ((k[b >> 6] >> (b & 63)) & 1);
        if (pure[d] && (w & TRIE_HAS_TOKENS) && d <= SLICE_ROWS) mark_tokens(E, i, i + 1, s->rows + (int64_t)d * words);
    }
    for (int32_t r = 1; r <= SLICE_ROWS; r++) /* row r: every length up to r */
        for (int32_t q = 0; q < words; q++) s->rows[(int64_t)r * words + q] |= s->rows[(int64_t)(r - 1) * words + q];
    int32_t first = SLICE_ROWS + 1 <= E->max_depth ? E->level_off[SLICE_ROWS + 1] : 0;
    int32_t last = SLICE_ROWS + 1 <= E->max_depth ? E->level_off[E->max_depth + 1] : 0;
    if (!(s->deep = malloc(sizeof(int32_t) * (size_t)(last - first + 1)))) goto fail;
    for (int32_t j = first; j < last; j++)
        if (node_pure[E->level_nodes[j]]) s->deep[s->n_deep++] = E->level_nodes[j];
    free(pure), free(node_pure);
    return s;
fail:
    if (s) free(s->rows), free(s);
    free(pure), free(node_pure);
    return NULL;
}

const Slice *slice_of(const Engine *E, const uint64_t k[4]) {
    Slices *t = E->slices;
    if (!t) return NULL;
    pthread_mutex_lock(&t->mu);
    const Slice *got = NULL;
    for (int32_t i = 0; i < t->n && !got; i++)
        if (!memcmp(t->s[i]->k, k, sizeof(t->s[i]->k))) got = t->s[i];
    if (!got && t->n < MAX_SLICES && (got = build(E, t->words, k))) t->s[t->n++] = (Slice *)got;
    pthread_mutex_unlock(&t->mu);
    return got;
}

void slice_mark(const Engine *E, const Slice *s, int32_t r, uint64_t *out) {
    int32_t words = s->words;
    const uint64_t *row = s->rows + (int64_t)(r < SLICE_ROWS ? r : SLICE_ROWS) * words;
    for (int32_t q = 0; q < words; q++) out[q] |= row[q];
    for (int32_t j = 0; j < s->n_deep && (int32_t)((E->node[s->deep[j]] >> 8) & 0xffff) <= r; j++)
        mark_tokens(E, s->deep[j], s->deep[j] + 1, out);
}
