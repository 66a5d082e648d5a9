/* The decode step's attention (decode_attn.c): each new token row's query heads against
 * the K/V of its sequence in the pool, one chunk per (row, K/V head), run on the two-thread
 * team by decode.c. */
#pragma once

#include "simd.h"

#include <stdint.h>

/* One step's attention: qkv rows [B, (nh + 2 nkv) d] (q first), the layer's K/V pool
 * buffers [slots, nkv, d], each row's table row and sequence length, float scratch of
 * lane_n floats per team lane, output [B, nh, d]. */
typedef struct {
    const bf16 *qkv, *K, *V;
    const int64_t *r2t, *req_rows, *seq_lens;
    int64_t r2t_stride, lane_n;
    int qkv_n, nh, nkv, d;
    float *fws;
    bf16 *att;
} AttnJob;

/* Floats of one lane's scratch for contexts up to max_len and `group` query heads per K/V head. */
int64_t attn_lane_floats(int max_len, int d, int group);

/* Chunk c = row * nkv + K/V head of an AttnJob (a team_run task). */
void attn_chunk(void *arg, int c);
