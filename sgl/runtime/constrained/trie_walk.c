/* Token masks by walking the vocabulary's byte trie against a byte DFA.
 *
 * The trie's nodes are the distinct prefixes of the vocabulary's byte strings in
 * preorder: node i holds its last byte, its depth (1 = a first byte) and `next[i]`, the
 * first node after its subtree. From a DFA state, a node whose byte has no live
 * transition from its parent's state kills its whole subtree (jump to next[i]); a live
 * node allows every token that ends there. Shared prefixes are stepped once, and dead
 * prefixes cost one lookup for all the tokens below them, so a mask costs the live part
 * of the trie, not the vocabulary's total bytes.
 */
#include <stdint.h>

#define SGL_TRIE_HAS_TOKENS (1u << 24)

/* out[t] = 1 for every token t allowed from `state` (out is left as it was elsewhere).
 * trans: int32 [states, 256], -1 = dead. node[i] = byte | depth << 8 | SGL_TRIE_HAS_TOKENS
 * where tokens end there (one word per node: the walk's hot loop reads only it and the
 * DFA). max_depth: the deepest node's depth (< 2^16). Returns the number of tokens set. */
int64_t sgl_trie_walk(const int32_t *trans, int32_t state, const uint32_t *node, const int32_t *next,
                      const int32_t *tok_start, const int32_t *tok_ids, int32_t n_nodes, int32_t max_depth,
                      uint8_t *out) {
    int32_t st[max_depth + 1]; /* st[d]: the DFA state after the first d bytes of the current node */
    st[0] = state;
    int64_t set = 0;
    int32_t i = 0;
    while (i < n_nodes) {
        uint32_t w = node[i];
        int d = (w >> 8) & 0xffff;
        int32_t s = trans[(int64_t)st[d - 1] * 256 + (w & 0xff)];
        if (s < 0) {
            i = next[i];
            continue;
        }
        st[d] = s;
        if (w & SGL_TRIE_HAS_TOKENS) {
            for (int32_t k = tok_start[i]; k < tok_start[i + 1]; k++) out[tok_ids[k]] = 1;
            set += tok_start[i + 1] - tok_start[i];
        }
        i++;
    }
    return set;
}
