/* KV rows between the device pool and the host tier (memory/host_pool.py).
 *
 * The pool keeps one K and one V tensor per layer, a token's row (kv heads x head_dim
 * elements, `row_bytes`) at its slot; the host tier keeps pages as one block
 * [layer][K, V][page_size][row]. A copy names, per token, its host page, its position in
 * the page and its pool slot. Torch's advanced indexing did this as 2 x layers
 * gathers and scatters of tiny rows (~13 ms per 1,024 tokens of the embedded model, 10x
 * a memcpy of the same bytes); here each row is one memcpy, token by token so a page's
 * block is read or written front to back within a layer.
 */
#include <string.h>

#include "sgl_kernels.h"
#include "simd.h"
#include "team.h"

static inline char *host_row(const sgl_kv_copy *c, int64_t i, int layer, int kv) {
    int64_t page_bytes = (int64_t)c->n_layers * 2 * c->page_size * c->row_bytes;
    return c->host + c->pages[i] * page_bytes + (((int64_t)layer * 2 + kv) * c->page_size + c->pos[i]) * c->row_bytes;
}

/* Tokens whose host rows and pool slots both follow on are copied as one run. */
static int64_t run_length(const sgl_kv_copy *c, int64_t i) {
    int64_t j = i + 1;
    while (j < c->n && c->pages[j] == c->pages[i] && c->pos[j] == c->pos[i] + (j - i) &&
           c->slots[j] == c->slots[i] + (j - i))
        j++;
    return j - i;
}

/* Scattered pool rows miss the cache one by one; fetching a few tokens ahead keeps
 * several misses in flight (the host side is read/written in page order). */
enum { AHEAD = 8 };

/* Chunk = one (layer, K or V) buffer: the two threads' rows never overlap. */
static void copy_buffer(void *arg, int chunk) {
    const sgl_kv_copy *c = (const sgl_kv_copy *)arg;
    int layer = chunk / 2, kv = chunk % 2;
    char *pool = (char *)(kv ? c->v_pool[layer] : c->k_pool[layer]);
    for (int64_t i = 0; i < c->n;) {
        if (i + AHEAD < c->n) {
            char *ahead = pool + c->slots[i + AHEAD] * c->row_bytes;
            if (c->to_host)
                prefetch_l1(ahead, c->row_bytes);
            else
                prefetch_write(ahead, c->row_bytes);
        }
        int64_t r = run_length(c, i);
        char *h = host_row(c, i, layer, kv), *d = pool + c->slots[i] * c->row_bytes;
        size_t bytes = (size_t)(r * c->row_bytes);
        if (c->to_host)
            memcpy(h, d, bytes);
        else
            memcpy(d, h, bytes);
        i += r;
    }
}

void sgl_kv_copy_run(const sgl_kv_copy *c) {
    /* Scattered rows are bound by memory latency: a second thread keeps twice the
     * misses in flight. */
    if (c->threads >= 2 && team_acquire()) {
        team_run(copy_buffer, (void *)c, 2 * c->n_layers);
        team_rest(); /* torch's threads run the forward next */
        team_release();
        return;
    }
    for (int chunk = 0; chunk < 2 * c->n_layers; chunk++) copy_buffer((void *)c, chunk);
}
