/* The native grammar engine: regex machines as lazily determinized byte DFAs with call
 * edges, and the pushdown over them that answers token masks and steps.
 *
 *   regex_nfa.c      regex text -> byte NFA (Thompson; code point classes as UTF-8
 *                    byte sequences; call markers as CALL states in machine mode)
 *   lazy_dfa.c       machines: a DFA state is an epsilon-closed set of live NFA states,
 *                    built the first time a walk reaches it; table machines (rows given
 *                    by Python, or intersection products); liveness across machines
 *   pushdown_walk.c  configurations (sets of stacks of (machine, state)), byte steps,
 *                    token masks by walking the vocabulary's byte trie, forced bytes
 *
 * One engine holds one compiled grammar and is shared by every request that uses it;
 * every entry point takes its mutex, so Python may call from any thread.
 */
#ifndef SGL_GRAMMAR_H
#define SGL_GRAMMAR_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

/* status codes, shared with native/binding.py */
#define G_OK 0
#define G_UNSUPPORTED 1 /* regex syntax the parser leaves to another builder */
#define G_TOO_LARGE 2   /* an automaton passed its bound */
#define G_EMPTY 3       /* the root matches nothing */
#define G_NOMEM 4
#define G_EMPTY_SUB 5   /* a sub-machine matches the empty string (JSON mode) */
#define G_TOO_MANY 6    /* more parallel stacks than allowed (JSON mode) */
#define G_BAD_CONFIG 7  /* a configuration names a machine or state that does not exist */
#define G_SETS_TOO_LARGE 8 /* the DFA states' member sets passed their budget (bytes, not states) */

#define MAX_CP 0x10FFFF
#define MARKER_BASE 0x10F000 /* call markers U+10F000 + callee - 1 (machine mode) */
#define MARKER_END 0x10FFFE

typedef struct Slices Slices;

/* ------------------------------------------------------------------ growable array */
typedef struct {
    void *p;
    int64_t n, cap;
    size_t sz;
} Vec;
#define VEC_OF(T) {NULL, 0, 0, sizeof(T)}
int vec_reserve(Vec *v, int64_t need);
int vec_push(Vec *v, const void *x);
uint64_t mix64(uint64_t x);

/* ------------------------------------------------------------------ NFA */
enum { S_SPARSE = 0, S_UNION = 1, S_MATCH = 2, S_CALL = 3 };
/* SPARSE: edges[first..first+count) are byte ranges; UNION: their `next` are epsilon
 * targets; CALL: callee machine `aux`, then edges[first].next. */
typedef struct {
    int32_t kind, first, count, aux;
} NState;
typedef struct {
    uint8_t lo, hi;
    int32_t next;
} Edge;

typedef struct {
    Vec states, edges; /* NState, Edge */
    int64_t max_states;
    int64_t work; /* compile steps taken: bounded too, as repeats of an empty body make no states */
    int status;
    int32_t start, match;
    uint64_t *hkeys; /* hash-consed single-edge states: (lo, hi, next) -> state */
    int32_t *hvals;
    int64_t hcap, hcount;
} Nfa;

#define RE_CALLS 1 /* machine mode: marker code points are calls, classes stop below them */
/* Parses `pattern` into `out` (zeroed by the caller). `uni`: \d \s \w tables or NULL. */
int regex_to_nfa(const uint8_t *pattern, int64_t len, const int32_t *uni, int flags, int64_t max_states,
                 Nfa *out, char *err, int errlen);
void nfa_free(Nfa *a);

/* ------------------------------------------------------------------ machines */
enum { M_EMPTY = 0, M_NFA = 1, M_TABLE = 2, M_INTERSECT = 3 };
#define F_ACCEPT 1
#define F_EXPANDED 2
#define F_CALLS 4
#define F_RUN 8 /* runs[s] computed */
#define ROW_SHIFT 5 /* states per row block: 32 (rows never move once allocated) */

typedef struct {
    int32_t callee, ret;
} Call;

/* A run of state s: the byte set K that its largest transition class takes to one
 * state, and how many bytes of K in a row stay on such a single path (INT32_MAX on a
 * cycle: a string body looping on itself). `dead`: the path ends because no byte of K
 * lives after `depth` of them (a counted string's last character); `acc` / `calls`: a
 * state on the path after s accepts / calls (a pop or a call could outlive the path). */
typedef struct {
    uint64_t k[4];
    int32_t depth;
    uint8_t dead, acc, calls;
} Run;

typedef struct {
    Vec pool, off, len; /* int32 members (a -1 first member marks a no-empty start); int64; int32 */
    int64_t *htab;
    int64_t hcap;
} SetTable;

typedef struct {
    int kind, hidden, no_empty;
    Nfa nfa;
    uint8_t *live; /* NFA states that can complete (bytes, and calls of nonempty machines) */
    uint8_t cls[256];
    int ncls;
    SetTable sets;
    int64_t n;      /* DFA states */
    Vec blocks;     /* int32_t* rows, 256 states x 256 bytes each */
    Vec flags;      /* uint8 F_* per state */
    Vec call_off;   /* int32 per state: first call in `calls` */
    Vec call_cnt;   /* int32 per state */
    Vec calls;      /* Call */
    int32_t *parts; /* M_INTERSECT: part machines (hidden) */
    int nparts;
    Vec idem;       /* int8 per state: -1 unknown, else L(s) is closed under concatenation */
    Vec runs;       /* Run per state (mask_walk.c) */
    Vec fmasks;     /* FrameMask * per state, or NULL (mask_walk.c) */
    /* closure scratch, sized to the NFA */
    uint32_t *stamp;
    uint32_t gen;
    int32_t *stk, *out;
} Machine;

typedef struct {
    int32_t n;
    Machine *m;
    uint8_t *nonempty;
    int json_mode;  /* 1: refuse > max_stacks; 0 (CFG): fold idempotent frames, keep the shortest */
    int max_stacks;
    int64_t max_states, total_states;
    int64_t max_set_members, set_members; /* NFA members over all interned DFA state sets */
    int status;     /* sticky: a failed expansion poisons the engine */
    int finalized;
    pthread_mutex_t mu;
    int64_t n_fmasks, frame_walks, frame_borrows; /* cached frame masks; walks that made one; alike states that took one */
    struct FrameRep *reps; /* frame-mask states by a cheap signature (mask_walk.c) */
    struct Slices *slices; /* the trie's token slices (token_slices.c), borrowed; or NULL */
    int64_t reps_cap, reps_n;
    /* the vocabulary's byte trie (token_trie.py), borrowed */
    const uint32_t *node;
    const int32_t *next, *tok_start, *tok_ids;
    const uint64_t *sub_bytes; /* uint64[4] per node: the bytes of its subtree, itself included */
    const int32_t *height;     /* per node: its subtree's depth (a leaf: 1) */
    const int32_t *level_nodes, *level_off; /* nodes with tokens by depth (level d: [off[d], off[d + 1])) */
    int32_t n_nodes, max_depth, vocab_size;
} Engine;

static inline int32_t *row_of(Machine *M, int32_t s) {
    return ((int32_t **)M->blocks.p)[s >> ROW_SHIFT] + (int64_t)(s & ((1 << ROW_SHIFT) - 1)) * 256;
}
static inline uint8_t flags_of(const Machine *M, int32_t s) { return ((const uint8_t *)M->flags.p)[s]; }

int machine_expand(Engine *E, Machine *M, int32_t s);
int machine_ready(Engine *E, Machine *M, int32_t s); /* expands when needed; G_OK or an error */
int machine_idempotent(Engine *E, int32_t m, int32_t s);
int engine_finalize(Engine *E, int32_t root, char *err, int errlen);
int64_t machine_new_state(Engine *E, Machine *M); /* appends an unexpanded state row */
void engine_free(Engine *E);
void frame_masks_free(Engine *E); /* mask_walk.c */

#endif
