/* Regex text -> byte-level Thompson NFA, the parse half of the native grammar engine.
 *
 * The dialect is what our converters emit and most user regexes use: the common subset
 * of Python `re` and Rust `regex`, with Rust's meaning where they differ (full match, `.`
 * is any scalar value but newline, \d \s \w Unicode-aware from tables Python passes).
 * Code point classes become UTF-8 byte-range sequences whose tails are hash-consed, so
 * a class used a thousand times costs its entry state each time and its tails once.
 * In machine mode (RE_CALLS) a marker code point U+10F000 + i is a CALL of machine
 * i + 1 and classes stop below the marker range. U+10FFFF is never matched (it is the
 * end marker on the outlines-core route, which the two routes must agree with).
 *
 * Anything outside the dialect (look-around, backreferences, \b, \p{..}, inline flags,
 * anchors inside the pattern, nested or set-operation classes) returns G_UNSUPPORTED
 * and the caller keeps its other builder.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar.h"

#define REP_INF -1
#define MAX_DEPTH 2000 /* group nesting: the parser and the compiler recurse per level */

/* ------------------------------------------------------------------ growable arrays */
int vec_reserve(Vec *v, int64_t need) {
    if (need <= v->cap) return 0;
    int64_t cap = v->cap ? v->cap : 64;
    while (cap < need) cap *= 2;
    void *p = realloc(v->p, (size_t)cap * v->sz);
    if (!p) return -1;
    v->p = p;
    v->cap = cap;
    return 0;
}

int vec_push(Vec *v, const void *x) {
    if (vec_reserve(v, v->n + 1)) return -1;
    memcpy((char *)v->p + (size_t)v->n * v->sz, x, v->sz);
    v->n++;
    return 0;
}

uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

/* ------------------------------------------------------------------ AST */
enum { N_EMPTY, N_CLASS, N_CAT, N_ALT, N_REP, N_CALL };
typedef struct { int32_t kind, first, count, min, max; } Node; /* CLASS: ranges; CAT/ALT: kids; CALL: min */
typedef struct { uint32_t lo, hi; } Range;

typedef struct {
    const uint8_t *s;
    int64_t n, i;
    int status, depth;
    Vec nodes, kids, ranges; /* Node, int32 child ids, Range */
    const int32_t *uni;      /* \d \s \w ranges: [nd, ns, nw, then pairs] */
    int flags;               /* RE_CALLS */
    uint32_t top;            /* the highest code point a class may match */
    char *err;
    int errlen;
} Parser;

static int fail(Parser *p, int status, const char *msg) {
    if (p->status == G_OK) {
        p->status = status;
        if (p->err && p->errlen > 0) snprintf(p->err, (size_t)p->errlen, "%s at offset %lld", msg, (long long)p->i);
    }
    return -1;
}

static int new_node(Parser *p, int kind, int first, int count, int min, int max) {
    Node nd = {kind, first, count, min, max};
    if (vec_push(&p->nodes, &nd)) return fail(p, G_NOMEM, "out of memory");
    return (int)p->nodes.n - 1;
}

static int cmp_range(const void *a, const void *b) {
    const Range *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo ? 1 : 0;
}

/* Sort, merge and (optionally) complement ranges [from, ranges.n); surrogates removed. */
static int finish_class(Parser *p, int64_t from, int negate) {
    Range *r = (Range *)p->ranges.p + from;
    int64_t n = p->ranges.n - from, m = 0;
    qsort(r, (size_t)n, sizeof(Range), cmp_range);
    for (int64_t k = 0; k < n; k++) {
        if (m && r[k].lo <= r[m - 1].hi + 1) {
            if (r[k].hi > r[m - 1].hi) r[m - 1].hi = r[k].hi;
        } else {
            r[m++] = r[k];
        }
    }
    p->ranges.n = from + m;
    if (negate) {
        Range *tmp = malloc(sizeof(Range) * (size_t)(m + 1));
        if (!tmp) return fail(p, G_NOMEM, "out of memory");
        int64_t t = 0;
        uint32_t nxt = 0;
        for (int64_t k = 0; k < m; k++) {
            if (r[k].lo > nxt) tmp[t++] = (Range){nxt, r[k].lo - 1};
            nxt = r[k].hi + 1;
        }
        if (nxt <= MAX_CP) tmp[t++] = (Range){nxt, MAX_CP};
        p->ranges.n = from;
        if (vec_reserve(&p->ranges, from + t + 1)) { free(tmp); return fail(p, G_NOMEM, "out of memory"); }
        memcpy((Range *)p->ranges.p + from, tmp, sizeof(Range) * (size_t)t);
        p->ranges.n = from + t;
        free(tmp);
    }
    /* Surrogates are not scalar values: cut 0xD800..0xDFFF out; nothing above `top`
     * (U+10FFFF, or the marker range in machine mode). */
    int64_t cnt = p->ranges.n - from;
    for (int64_t k = 0; k < cnt; k++) {
        Range *q = (Range *)p->ranges.p + from + k;
        if (q->hi > p->top) q->hi = p->top;
        if (q->hi < 0xD800 || q->lo > 0xDFFF) continue;
        Range left = {q->lo, 0xD7FF}, right = {0xE000, q->hi};
        int has_l = q->lo < 0xD800, has_r = q->hi > 0xDFFF;
        if (has_l) {
            *q = left;
            if (has_r && vec_push(&p->ranges, &right)) return fail(p, G_NOMEM, "out of memory");
        } else if (has_r) {
            *q = right;
        } else {
            q->lo = 1, q->hi = 0; /* empty: skipped when compiled */
        }
    }
    return 0;
}

static int add_range(Parser *p, uint32_t lo, uint32_t hi) {
    Range r = {lo, hi};
    if (vec_push(&p->ranges, &r)) return fail(p, G_NOMEM, "out of memory");
    return 0;
}

/* One UTF-8 character of the pattern text; -1 on malformed text. */
static int64_t next_cp(Parser *p) {
    if (p->i >= p->n) return -1;
    uint8_t c = p->s[p->i];
    int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (!len || p->i + len > p->n) return -1;
    uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
    for (int k = 1; k < len; k++) {
        uint8_t d = p->s[p->i + k];
        if ((d & 0xC0) != 0x80) return -1;
        cp = (cp << 6) | (d & 0x3F);
    }
    p->i += len;
    return cp;
}

static int hexval(uint8_t c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Reads `width` hex digits, or {h+} where braces are allowed (Rust's \x{..}). */
static int64_t read_hex(Parser *p, int width) {
    uint32_t v = 0;
    if (p->i < p->n && p->s[p->i] == '{') {
        p->i++;
        int k = 0;
        while (p->i < p->n && p->s[p->i] != '}') {
            int h = hexval(p->s[p->i]);
            if (h < 0 || ++k > 8) return -1;
            v = v * 16 + (uint32_t)h;
            p->i++;
        }
        if (p->i >= p->n || !k) return -1;
        p->i++;
    } else {
        for (int k = 0; k < width; k++) {
            if (p->i >= p->n) return -1;
            int h = hexval(p->s[p->i]);
            if (h < 0) return -1;
            v = v * 16 + (uint32_t)h;
            p->i++;
        }
    }
    if (v > MAX_CP || (v >= 0xD800 && v <= 0xDFFF)) return -1;
    return v;
}

/* Appends a shorthand class (\d \s \w and negations) to the ranges. */
static int add_shorthand(Parser *p, uint8_t c) {
    int which = (c == 'd' || c == 'D') ? 0 : (c == 's' || c == 'S') ? 1 : 2;
    int neg = c == 'D' || c == 'S' || c == 'W';
    if (!p->uni) return fail(p, G_UNSUPPORTED, "shorthand class without tables");
    const int32_t *pairs = p->uni + 3;
    for (int k = 0; k < which; k++) pairs += 2 * p->uni[k];
    int64_t from = p->ranges.n;
    for (int k = 0; k < p->uni[which]; k++)
        if (add_range(p, (uint32_t)pairs[2 * k], (uint32_t)pairs[2 * k + 1])) return -1;
    if (neg) {
        /* Complement just these ranges, then keep them with the rest of the class. */
        return finish_class(p, from, 1);
    }
    return 0;
}

/* An escape after '\\' (already consumed). Returns the code point, or -2 when it added
 * a shorthand class to the ranges (in_class or as its own class), -1 on failure. */
static int64_t parse_escape(Parser *p, int in_class) {
    if (p->i >= p->n) return fail(p, G_UNSUPPORTED, "trailing backslash");
    uint8_t c = p->s[p->i++];
    switch (c) {
    case 'n': return '\n';
    case 't': return '\t';
    case 'r': return '\r';
    case 'f': return '\f';
    case 'v': return '\v';
    case 'a': return 7;
    case 'e': return 27;
    case 'x': { int64_t v = read_hex(p, 2); return v < 0 ? fail(p, G_UNSUPPORTED, "bad \\x escape") : v; }
    case 'u': { int64_t v = read_hex(p, 4); return v < 0 ? fail(p, G_UNSUPPORTED, "bad \\u escape") : v; }
    case 'U': { int64_t v = read_hex(p, 8); return v < 0 ? fail(p, G_UNSUPPORTED, "bad \\U escape") : v; }
    case 'd': case 'D': case 's': case 'S': case 'w': case 'W':
        return add_shorthand(p, c) ? -1 : -2;
    default: break;
    }
    (void)in_class;
    if (c < 0x80 && !((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))) return c;
    return fail(p, G_UNSUPPORTED, "unsupported escape");
}

static int parse_alt(Parser *p);

/* [...] after '[' (consumed). */
static int parse_class(Parser *p) {
    int negate = 0;
    if (p->i < p->n && p->s[p->i] == '^') negate = 1, p->i++;
    int64_t from = p->ranges.n;
    int first = 1;
    for (;;) {
        if (p->i >= p->n) return fail(p, G_UNSUPPORTED, "unclosed class");
        uint8_t c = p->s[p->i];
        if (c == ']' && !first) { p->i++; break; }
        if (c == '[') return fail(p, G_UNSUPPORTED, "nested class");
        if ((c == '&' || c == '~' || c == '-') && p->i + 1 < p->n && p->s[p->i + 1] == c && !first)
            return fail(p, G_UNSUPPORTED, "class set operation");
        first = 0;
        int64_t lo;
        if (c == '\\') {
            p->i++;
            lo = parse_escape(p, 1);
            if (lo == -1) return -1;
            if (lo == -2) continue;
        } else {
            lo = next_cp(p);
            if (lo < 0) return fail(p, G_UNSUPPORTED, "bad UTF-8 in pattern");
        }
        int64_t hi = lo;
        if (p->i + 1 < p->n && p->s[p->i] == '-' && p->s[p->i + 1] != ']') {
            p->i++;
            if (p->s[p->i] == '\\') {
                p->i++;
                hi = parse_escape(p, 1);
                if (hi < 0) return hi == -1 ? -1 : fail(p, G_UNSUPPORTED, "class range to a shorthand");
            } else if (p->s[p->i] == '[') {
                return fail(p, G_UNSUPPORTED, "nested class");
            } else {
                hi = next_cp(p);
                if (hi < 0) return fail(p, G_UNSUPPORTED, "bad UTF-8 in pattern");
            }
            if (hi < lo) return fail(p, G_UNSUPPORTED, "class range out of order");
        }
        if (add_range(p, (uint32_t)lo, (uint32_t)hi)) return -1;
    }
    if (finish_class(p, from, negate)) return -1;
    return new_node(p, N_CLASS, (int)from, (int)(p->ranges.n - from), 0, 0);
}

static int single_cp(Parser *p, uint32_t cp) {
    if ((p->flags & RE_CALLS) && cp >= MARKER_BASE && cp <= MARKER_END)
        return new_node(p, N_CALL, 0, 0, (int)(cp - MARKER_BASE + 1), 0);
    int64_t from = p->ranges.n;
    if (cp > p->top) return new_node(p, N_CLASS, (int)from, 0, 0, 0); /* U+10FFFF: as in classes, nothing */
    if (add_range(p, cp, cp)) return -1;
    return new_node(p, N_CLASS, (int)from, 1, 0, 0);
}

static int parse_atom(Parser *p) {
    uint8_t c = p->s[p->i];
    if (c == '(') {
        if (++p->depth > MAX_DEPTH) return fail(p, G_UNSUPPORTED, "groups nested too deeply");
        p->i++;
        if (p->i < p->n && p->s[p->i] == '?') {
            p->i++;
            if (p->i < p->n && p->s[p->i] == ':') {
                p->i++;
            } else if (p->i < p->n && (p->s[p->i] == 'P' || p->s[p->i] == '<')) {
                if (p->s[p->i] == 'P') p->i++;
                if (p->i >= p->n || p->s[p->i] != '<') return fail(p, G_UNSUPPORTED, "group syntax");
                p->i++;
                int64_t k = p->i;
                while (p->i < p->n && (p->s[p->i] == '_' || (p->s[p->i] >= '0' && p->s[p->i] <= '9') ||
                                       ((p->s[p->i] | 32) >= 'a' && (p->s[p->i] | 32) <= 'z')))
                    p->i++;
                if (p->i == k || p->i >= p->n || p->s[p->i] != '>') return fail(p, G_UNSUPPORTED, "group name");
                p->i++;
            } else {
                return fail(p, G_UNSUPPORTED, "look-around or inline flags");
            }
        }
        int inner = parse_alt(p);
        if (inner < 0) return -1;
        if (p->i >= p->n || p->s[p->i] != ')') return fail(p, G_UNSUPPORTED, "unclosed group");
        p->i++;
        p->depth--;
        return inner;
    }
    if (c == '[') { p->i++; return parse_class(p); }
    if (c == '.') {
        p->i++;
        int64_t from = p->ranges.n;
        if (add_range(p, 0, '\n' - 1) || add_range(p, '\n' + 1, MAX_CP) || finish_class(p, from, 0)) return -1;
        return new_node(p, N_CLASS, (int)from, (int)(p->ranges.n - from), 0, 0);
    }
    if (c == '\\') {
        p->i++;
        int64_t from = p->ranges.n;
        int64_t cp = parse_escape(p, 0);
        if (cp == -1) return -1;
        if (cp == -2) {
            if (finish_class(p, from, 0)) return -1;
            return new_node(p, N_CLASS, (int)from, (int)(p->ranges.n - from), 0, 0);
        }
        return single_cp(p, (uint32_t)cp);
    }
    if (c == '*' || c == '+' || c == '?' || c == '{') return fail(p, G_UNSUPPORTED, "repetition of nothing");
    if (c == '^' || c == '$') return fail(p, G_UNSUPPORTED, "anchor inside the pattern");
    int64_t cp = next_cp(p);
    if (cp < 0 || (cp >= 0xD800 && cp <= 0xDFFF)) return fail(p, G_UNSUPPORTED, "bad UTF-8 in pattern");
    return single_cp(p, (uint32_t)cp);
}

/* {n}, {n,}, {n,m} at p->i (the brace): 0 with lo, hi set, or -1 (not a valid quantifier). */
static int parse_counted(Parser *p, int *lo, int *hi) {
    int64_t i = p->i + 1;
    int64_t a = 0, b = -1, digits = 0;
    while (i < p->n && p->s[i] >= '0' && p->s[i] <= '9') {
        a = a * 10 + (p->s[i++] - '0');
        if (a > 100000) return -1;
        digits++;
    }
    if (!digits) return -1;
    if (i < p->n && p->s[i] == '}') {
        b = a;
    } else if (i < p->n && p->s[i] == ',') {
        i++;
        if (i < p->n && p->s[i] == '}') {
            b = REP_INF;
        } else {
            b = 0, digits = 0;
            while (i < p->n && p->s[i] >= '0' && p->s[i] <= '9') {
                b = b * 10 + (p->s[i++] - '0');
                if (b > 100000) return -1;
                digits++;
            }
            if (!digits || i >= p->n || p->s[i] != '}' || b < a) return -1;
        }
    } else {
        return -1;
    }
    p->i = i + 1;
    *lo = (int)a, *hi = (int)b;
    return 0;
}

static int parse_repeat(Parser *p) {
    int atom = parse_atom(p);
    if (atom < 0) return -1;
    int quantified = 0;
    while (p->i < p->n) {
        uint8_t c = p->s[p->i];
        int lo, hi;
        if (c == '*') lo = 0, hi = REP_INF, p->i++;
        else if (c == '+') lo = 1, hi = REP_INF, p->i++;
        else if (c == '?') lo = 0, hi = 1, p->i++;
        else if (c == '{') {
            if (parse_counted(p, &lo, &hi)) return fail(p, G_UNSUPPORTED, "bad counted repetition");
        } else break;
        if (quantified) return fail(p, G_UNSUPPORTED, "stacked repetition");
        quantified = 1;
        if (p->i < p->n && p->s[p->i] == '?') p->i++; /* lazy: same language */
        else if (p->i < p->n && p->s[p->i] == '+') return fail(p, G_UNSUPPORTED, "possessive repetition");
        int kid = (int)p->kids.n;
        int32_t a = atom;
        if (vec_push(&p->kids, &a)) return fail(p, G_NOMEM, "out of memory");
        atom = new_node(p, N_REP, kid, 1, lo, hi);
        if (atom < 0) return -1;
    }
    return atom;
}

static int parse_cat(Parser *p) {
    Vec items = {0, 0, 0, sizeof(int32_t)};
    while (p->i < p->n && p->s[p->i] != '|' && p->s[p->i] != ')') {
        int32_t it = parse_repeat(p);
        if (it < 0 || vec_push(&items, &it)) { free(items.p); return it < 0 ? -1 : fail(p, G_NOMEM, "oom"); }
    }
    int out;
    if (items.n == 0) out = new_node(p, N_EMPTY, 0, 0, 0, 0);
    else if (items.n == 1) out = ((int32_t *)items.p)[0];
    else {
        int first = (int)p->kids.n;
        for (int64_t k = 0; k < items.n; k++)
            if (vec_push(&p->kids, (int32_t *)items.p + k)) { free(items.p); return fail(p, G_NOMEM, "oom"); }
        out = new_node(p, N_CAT, first, (int)items.n, 0, 0);
    }
    free(items.p);
    return out;
}

static int parse_alt(Parser *p) {
    Vec items = {0, 0, 0, sizeof(int32_t)};
    for (;;) {
        int32_t it = parse_cat(p);
        if (it < 0 || vec_push(&items, &it)) { free(items.p); return it < 0 ? -1 : fail(p, G_NOMEM, "oom"); }
        if (p->i < p->n && p->s[p->i] == '|') { p->i++; continue; }
        break;
    }
    int out;
    if (items.n == 1) out = ((int32_t *)items.p)[0];
    else {
        int first = (int)p->kids.n;
        for (int64_t k = 0; k < items.n; k++)
            if (vec_push(&p->kids, (int32_t *)items.p + k)) { free(items.p); return fail(p, G_NOMEM, "oom"); }
        out = new_node(p, N_ALT, first, (int)items.n, 0, 0);
    }
    free(items.p);
    return out;
}

/* ------------------------------------------------------------------ NFA */
static int nfa_new(Nfa *a, int kind, int first, int count) {
    if (a->states.n >= a->max_states) { a->status = G_TOO_LARGE; return -1; }
    NState s = {kind, first, count, 0};
    if (vec_push(&a->states, &s)) { a->status = G_NOMEM; return -1; }
    return (int)a->states.n - 1;
}

static int nfa_edge(Nfa *a, uint8_t lo, uint8_t hi, int32_t next) {
    Edge e = {lo, hi, next};
    if (vec_push(&a->edges, &e)) { a->status = G_NOMEM; return -1; }
    return 0;
}

/* The state "byte in [lo, hi] then `next`", shared by every class that needs it. */
static int nfa_single(Nfa *a, uint8_t lo, uint8_t hi, int32_t next) {
    uint64_t key = (uint64_t)lo | (uint64_t)hi << 8 | (uint64_t)(uint32_t)next << 16 | 1ULL << 63;
    if (a->hcount * 2 >= a->hcap) {
        int64_t cap = a->hcap ? a->hcap * 2 : 1024;
        uint64_t *k2 = calloc((size_t)cap, sizeof(uint64_t));
        int32_t *v2 = malloc((size_t)cap * sizeof(int32_t));
        if (!k2 || !v2) { free(k2); free(v2); a->status = G_NOMEM; return -1; }
        for (int64_t i = 0; i < a->hcap; i++) {
            if (!a->hkeys[i]) continue;
            int64_t j = (int64_t)(mix64(a->hkeys[i]) & (uint64_t)(cap - 1));
            while (k2[j]) j = (j + 1) & (cap - 1);
            k2[j] = a->hkeys[i], v2[j] = a->hvals[i];
        }
        free(a->hkeys); free(a->hvals);
        a->hkeys = k2, a->hvals = v2, a->hcap = cap;
    }
    int64_t j = (int64_t)(mix64(key) & (uint64_t)(a->hcap - 1));
    while (a->hkeys[j]) {
        if (a->hkeys[j] == key) return a->hvals[j];
        j = (j + 1) & (a->hcap - 1);
    }
    int first = (int)a->edges.n;
    if (nfa_edge(a, lo, hi, next)) return -1;
    int s = nfa_new(a, S_SPARSE, first, 1);
    if (s < 0) return -1;
    a->hkeys[j] = key, a->hvals[j] = s, a->hcount++;
    return s;
}

static void encode_utf8(uint32_t cp, uint8_t *out, int *len) {
    if (cp < 0x80) { out[0] = (uint8_t)cp; *len = 1; }
    else if (cp < 0x800) { out[0] = 0xC0 | (cp >> 6); out[1] = 0x80 | (cp & 0x3F); *len = 2; }
    else if (cp < 0x10000) {
        out[0] = 0xE0 | (cp >> 12); out[1] = 0x80 | ((cp >> 6) & 0x3F); out[2] = 0x80 | (cp & 0x3F); *len = 3;
    } else {
        out[0] = 0xF0 | (cp >> 18); out[1] = 0x80 | ((cp >> 12) & 0x3F);
        out[2] = 0x80 | ((cp >> 6) & 0x3F); out[3] = 0x80 | (cp & 0x3F); *len = 4;
    }
}

/* Byte-range sequences of [lo, hi] (scalar values, one UTF-8 length, aligned so that
 * each byte position is a plain range): the classic split of a code point range. Each
 * sequence is added as edges of `entry` (first byte) into shared tail states. */
static int add_seq(Nfa *a, Vec *entry, uint32_t lo, uint32_t hi, int32_t next) {
    uint8_t bl[4], bh[4];
    int n, n2;
    encode_utf8(lo, bl, &n);
    encode_utf8(hi, bh, &n2);
    int32_t t = next;
    for (int k = n - 1; k >= 1; k--) {
        t = nfa_single(a, bl[k], bh[k], t);
        if (t < 0) return -1;
    }
    Edge e = {bl[0], bh[0], t};
    if (vec_push(entry, &e)) { a->status = G_NOMEM; return -1; }
    return 0;
}

static int split_range(Nfa *a, Vec *entry, uint32_t lo, uint32_t hi, int32_t next) {
    static const uint32_t bounds[3] = {0x7F, 0x7FF, 0xFFFF};
    for (int k = 0; k < 3; k++)
        if (lo <= bounds[k] && hi > bounds[k])
            return split_range(a, entry, lo, bounds[k], next) || split_range(a, entry, bounds[k] + 1, hi, next) ? -1 : 0;
    if (hi < 0x80) return add_seq(a, entry, lo, hi, next);
    for (int i = 1; i < 4; i++) {
        uint32_t m = (1u << (6 * i)) - 1;
        if ((lo & ~m) != (hi & ~m)) {
            if ((lo & m) != 0)
                return split_range(a, entry, lo, lo | m, next) || split_range(a, entry, (lo | m) + 1, hi, next) ? -1 : 0;
            if ((hi & m) != m)
                return split_range(a, entry, lo, (hi & ~m) - 1, next) || split_range(a, entry, hi & ~m, hi, next) ? -1 : 0;
        }
    }
    return add_seq(a, entry, lo, hi, next);
}

static int compile_node(Parser *p, Nfa *a, int node, int32_t next);

static int compile_class(Parser *p, Nfa *a, const Node *nd, int32_t next) {
    Vec entry = {0, 0, 0, sizeof(Edge)};
    const Range *r = (const Range *)p->ranges.p + nd->first;
    for (int k = 0; k < nd->count; k++) {
        if (r[k].lo > r[k].hi) continue;
        if (split_range(a, &entry, r[k].lo, r[k].hi, next)) { free(entry.p); return -1; }
    }
    if (entry.n == 1) { /* a single byte range: share it */
        Edge e = ((Edge *)entry.p)[0];
        free(entry.p);
        return nfa_single(a, e.lo, e.hi, e.next);
    }
    int first = (int)a->edges.n;
    for (int64_t k = 0; k < entry.n; k++) {
        Edge e = ((Edge *)entry.p)[k];
        if (nfa_edge(a, e.lo, e.hi, e.next)) { free(entry.p); return -1; }
    }
    int s = nfa_new(a, S_SPARSE, first, (int)entry.n);
    free(entry.p);
    return s;
}

/* A UNION state with targets x (and y unless y < 0); returns its id. */
static int nfa_union2(Nfa *a, int32_t x, int32_t y) {
    int first = (int)a->edges.n;
    if (nfa_edge(a, 0, 0, x)) return -1;
    if (y >= 0 && nfa_edge(a, 0, 0, y)) return -1;
    return nfa_new(a, S_UNION, first, y >= 0 ? 2 : 1);
}

static int compile_rep(Parser *p, Nfa *a, const Node *nd, int32_t next) {
    int kid = ((int32_t *)p->kids.p)[nd->first];
    int32_t cur = next;
    if (nd->max == REP_INF) {
        /* u: loop back into the body or leave; the body's end returns to u. */
        int u = nfa_union2(a, next, next);
        if (u < 0) return -1;
        int uf = ((NState *)a->states.p)[u].first;
        int body = compile_node(p, a, kid, u);
        if (body < 0) return -1;
        ((Edge *)a->edges.p)[uf].next = body;
        cur = nd->min == 0 ? u : body;
        for (int k = 1; k < nd->min; k++)
            if ((cur = compile_node(p, a, kid, cur)) < 0) return -1;
        return cur;
    }
    for (int k = 0; k < nd->max - nd->min; k++) {
        int body = compile_node(p, a, kid, cur);
        if (body < 0) return -1;
        cur = nfa_union2(a, body, next);
        if (cur < 0) return -1;
    }
    for (int k = 0; k < nd->min; k++)
        if ((cur = compile_node(p, a, kid, cur)) < 0) return -1;
    return cur;
}

static int compile_node(Parser *p, Nfa *a, int node, int32_t next) {
    /* (?:(?:){99999}){99999} makes no states but ~10^10 calls: charge the calls as well. */
    if (++a->work > 4 * a->max_states + 1000000) { a->status = G_TOO_LARGE; return -1; }
    const Node nd = ((Node *)p->nodes.p)[node];
    const int32_t *kids = (const int32_t *)p->kids.p;
    switch (nd.kind) {
    case N_EMPTY: return next;
    case N_CLASS: return compile_class(p, a, &nd, next);
    case N_CAT: {
        int32_t cur = next;
        for (int k = nd.count - 1; k >= 0; k--)
            if ((cur = compile_node(p, a, kids[nd.first + k], cur)) < 0) return -1;
        return cur;
    }
    case N_ALT: {
        int32_t *t = malloc(sizeof(int32_t) * (size_t)nd.count);
        if (!t) { a->status = G_NOMEM; return -1; }
        for (int k = 0; k < nd.count; k++) {
            t[k] = compile_node(p, a, ((int32_t *)p->kids.p)[nd.first + k], next);
            if (t[k] < 0) { free(t); return -1; }
        }
        int first = (int)a->edges.n;
        for (int k = 0; k < nd.count; k++)
            if (nfa_edge(a, 0, 0, t[k])) { free(t); return -1; }
        free(t);
        return nfa_new(a, S_UNION, first, nd.count);
    }
    case N_REP: return compile_rep(p, a, &nd, next);
    case N_CALL: {
        int first = (int)a->edges.n;
        if (nfa_edge(a, 0, 0, next)) return -1;
        int s = nfa_new(a, S_CALL, first, 1);
        if (s >= 0) ((NState *)a->states.p)[s].aux = nd.min;
        return s;
    }
    }
    return -1;
}

/* ------------------------------------------------------------------ API */

void nfa_free(Nfa *a) {
    free(a->states.p);
    free(a->edges.p);
    free(a->hkeys);
    free(a->hvals);
    memset(a, 0, sizeof(*a));
}

int regex_to_nfa(const uint8_t *pattern, int64_t len, const int32_t *uni, int flags, int64_t max_states,
                 Nfa *a, char *err, int errlen) {
    Parser p = {pattern, len, 0, G_OK, 0, VEC_OF(Node), VEC_OF(int32_t), VEC_OF(Range), uni, flags,
                (flags & RE_CALLS) ? MARKER_BASE - 1 : MAX_CP - 1, err, errlen};
    a->states = (Vec)VEC_OF(NState);
    a->edges = (Vec)VEC_OF(Edge);
    a->max_states = max_states;
    a->work = 0;
    a->status = G_OK;
    if (err && errlen > 0) err[0] = 0;
    int status = G_OK;
    /* Anchors at the very ends mean nothing under full-match semantics. */
    if (p.n && p.s[0] == '^') p.i = 1;
    else if (p.n >= 2 && p.s[0] == '\\' && p.s[1] == 'A') p.i = 2;
    if (p.n > p.i && p.s[p.n - 1] == '$') {
        int64_t bs = 0;
        for (int64_t k = p.n - 2; k >= p.i && p.s[k] == '\\'; k--) bs++;
        if (bs % 2 == 0) p.n--;
    } else if (p.n >= p.i + 2 && p.s[p.n - 2] == '\\' && p.s[p.n - 1] == 'z') {
        int64_t bs = 0;
        for (int64_t k = p.n - 2; k >= p.i && p.s[k] == '\\'; k--) bs++;
        if (bs % 2 == 1) p.n -= 2;
    }
    int root = parse_alt(&p);
    if (root >= 0 && p.i < p.n) { fail(&p, G_UNSUPPORTED, "unbalanced parenthesis"); root = -1; }
    if (root < 0) { status = p.status ? p.status : G_UNSUPPORTED; goto done; }
    a->match = nfa_new(a, S_MATCH, 0, 0);
    a->start = a->match < 0 ? -1 : compile_node(&p, a, root, a->match);
    if (a->start < 0) status = a->status ? a->status : G_NOMEM;
done:
    free(p.nodes.p);
    free(p.kids.p);
    free(p.ranges.p);
    if (status != G_OK) nfa_free(a);
    return status;
}
