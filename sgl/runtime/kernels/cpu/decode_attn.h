/* The decode step's attention (decode_attn.c): each new token row's query heads against
 * the K/V of its sequence in the pool, in blocks of keys merged per head, run on the
 * two-thread team by decode.c. */
#pragma once

#include "simd.h"

#include <stdint.h>

/* Keys per block: the unit of work of the first pass, and the span of one partial result. */
#define KEY_BLOCK 128
/* One step's attention: qkv rows [B, (nh + 2 nkv) d] (q first), the layer's K/V pool
 * buffers [slots, nkv, d], each row's table row and sequence length, float scratch of
 * attn_ws_floats(...) (two lanes, then the partial results of up to block_cap blocks per
 * row), `blocks` = the most blocks of any row of this step, output [B, nh, d]. */
typedef struct {
    const bf16 *qkv, *K, *V;
    const int64_t *r2t, *req_rows, *seq_lens;
    int64_t r2t_stride;
    int qkv_n, nh, nkv, d, blocks, block_cap;
    float *fws;
    bf16 *att;
} AttnJob;

/* Floats of scratch for rows of up to max_len keys, at most max_rows rows per step. */
int64_t attn_ws_floats(int max_len, int max_rows, int nh, int d, int group);

/* First pass: chunk c = row * blocks + block (a team_run task). */
void attn_block_chunk(void *arg, int c);
/* Second pass: chunk c = row * nh + query head. */
void attn_merge_chunk(void *arg, int c);
