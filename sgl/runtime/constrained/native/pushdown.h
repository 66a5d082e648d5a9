/* Internal to the pushdown (pushdown_walk.c: configurations and steps; mask_walk.c:
 * token masks). See pushdown_walk.c for the model. */
#ifndef SGL_PUSHDOWN_H
#define SGL_PUSHDOWN_H

#include "grammar.h"

#define TRIE_HAS_TOKENS (1u << 24)
#define ERR_BUFFER 100 /* flat output did not fit */

typedef struct { int32_t m, s, parent, depth; } Frame;
typedef struct { int32_t m, s, below; } Item;
typedef struct {
    Item *v;
    int32_t n, cap;
    int32_t *h; /* open addressing over v's indexes once n grows past LINEAR */
    int32_t hcap;
} ItemSet;
#define LINEAR 16

typedef struct {
    Engine *E;
    Vec frames; /* Frame */
    int32_t *hv;
    int64_t hcap;
    Vec fresh;  /* machines pushed in the current byte's closure */
    int err;
    /* frame walks (mask_walk.c): a pop into `sentinel` is not stepped; the trie node
     * being stepped goes to `exits` instead */
    int32_t sentinel, node;
    Vec exits;
    /* a walk that took its top's token slice (mask_walk.c's walk_root): the bytes, the
     * longest length taken, and whether longer pure tokens die */
    int sliced, slice_cut;
    uint64_t slice_k[4];
    int32_t slice_r;
} Walk;

#define WALK_INIT(E) {(E), VEC_OF(Frame), NULL, 0, VEC_OF(int32_t), G_OK, -1, 0, VEC_OF(int32_t), 0, 0, {0}, 0}

int32_t frame_of(Walk *W, int32_t m, int32_t s, int32_t parent);
int set_add(Walk *W, ItemSet *S, Item it);
void set_clear(ItemSet *S);
void step_item(Walk *W, Item it, uint8_t b, ItemSet *out);
/* out := the bounded set after byte b from `in`; G_TOO_MANY (JSON mode) or an error. */
int step_set(Walk *W, const ItemSet *in, uint8_t b, ItemSet *out);
int read_config(Walk *W, const int32_t *cfg, int64_t n, ItemSet *out);
void walk_free(Walk *W);
/* Sets the bits of the tokens ending at trie nodes [from, to) (mask_walk.c). */
void mark_tokens(const Engine *E, int32_t from, int32_t to, uint64_t *out);

/* Token slices (token_slices.c): the tokens spelled only with bytes of k, by length. */
#define SLICE_ROWS 24
typedef struct {
    uint64_t k[4];
    uint64_t *rows;  /* (SLICE_ROWS + 1) packed masks: row r, the tokens of length <= r */
    int32_t *deep;   /* token nodes deeper than SLICE_ROWS, by depth */
    int32_t n_deep, words;
} Slice;
const Slice *slice_of(const Engine *E, const uint64_t k[4]); /* NULL: none (table full, no memory) */
void slice_mark(const Engine *E, const Slice *s, int32_t r, uint64_t *out); /* out |= length <= r */

#endif
