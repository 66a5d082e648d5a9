/* The C interface of the CPU kernel library: every exported function, its parameter
 * structs and its return codes. kernels/cpu/binding.py mirrors this file once (ctypes
 * structures, argument types, status names); change the two together.
 *
 * bf16 tensors travel as uint16_t (see simd.h); all are contiguous unless a stride says
 * otherwise. Pointers are borrowed for the duration of a call.
 */
#pragma once

#include <stdint.h>

/* Return codes of the int-returning entry points. */
typedef enum {
    SGL_OK = 0,
    SGL_ERR_CONTEXT_TOO_LONG = 1,      /* decode: a sequence is longer than max_len */
    SGL_ERR_POSITION_OUT_OF_RANGE = 2, /* RoPE: a position outside the cos/sin tables */
    SGL_ERR_UNSUPPORTED = 3,           /* attention: no AVX512-BF16 in this build, or the shape; a weight type */
    SGL_ERR_NO_MEMORY = 4,             /* attention: malloc failed */
} sgl_status;

/* ---- weight types ---------------------------------------------------------------------- */

/* Type tags of a weight matrix: GGML's type ids. SGL_T_BF16 is a plain bf16 matrix; the
 * others are rows of GGUF blocks (quant.c), sgl_quant_row_bytes(type, in) bytes a row. */
enum { SGL_T_Q4_0 = 2, SGL_T_Q4_1 = 3, SGL_T_Q8_0 = 8, SGL_T_Q4_K = 12, SGL_T_Q6_K = 14, SGL_T_BF16 = 30 };

/* ---- decode step (decode.c) ------------------------------------------------------------ */

/* Per-layer weight addresses in `layers`, sgl_decode_fields() int64 per layer, in this
 * order (0 = absent bias), then the type tags (SGL_T_*) of the four matrices. */
enum { SGL_L_LN1, SGL_L_QKV, SGL_L_QKV_B, SGL_L_O, SGL_L_O_B, SGL_L_LN2, SGL_L_GU, SGL_L_DOWN, SGL_L_K, SGL_L_V,
       SGL_L_QKV_T, SGL_L_O_T, SGL_L_GU_T, SGL_L_DOWN_T, SGL_L_FIELDS };

/* A Llama-family model (bf16 activations, norms and biases; bf16 or GGUF-block
 * matrices): fixed for the life of a decoder. */
typedef struct {
    int n_layers;
    const int64_t *layers; /* [n_layers, SGL_L_FIELDS] addresses and type tags */
    const void *embed;     /* [vocab] rows of type embed_t */
    const uint16_t *norm_w;
    const void *head_w;    /* [vocab] rows of type head_t */
    int vocab, hidden, nh, nkv, d, inter;
    float eps;
    const uint16_t *rope_cos, *rope_sin; /* [max_pos, d / 2] */
    int embed_t, head_t;
} sgl_decode_model;

/* One step of `rows` single-token requests, and its scratch. */
typedef struct {
    int rows;       /* at most max_rows */
    const int64_t *input_ids, *positions, *out_loc, *req_rows, *seq_lens; /* [rows] */
    const int64_t *req_to_token;
    int64_t r2t_stride;
    int max_len;    /* longest context `fws` was sized for */
    int max_rows;   /* most rows `fws` was sized for */
    uint16_t *ws;   /* sgl_decode_ws(model, rows) bf16 elements */
    float *fws;     /* sgl_decode_fws(model, max_len, max_rows) floats */
    float *logits;  /* [rows, vocab] */
    int threads;    /* 1, or 2 with team.c's helper */
} sgl_decode_batch;

int sgl_decode_fields(void);
int sgl_decode_simd(void); /* 0: plain C, 1: AVX512-BF16, 2: AVX2 + FMA */
int64_t sgl_decode_ws(const sgl_decode_model *m, int rows);
int64_t sgl_decode_fws(const sgl_decode_model *m, int max_len, int max_rows);
sgl_status sgl_decode_step(const sgl_decode_model *m, const sgl_decode_batch *b);

/* ---- products over GGUF blocks (quant.c) ---------------------------------------------- */

int sgl_quant_simd(void); /* 0: plain C, 2: AVX2 (maddubs), 3: AVX2 with VNNI dot products */
int64_t sgl_quant_row_bytes(int type, int in); /* 0: not a block type here, or `in` not whole blocks */
/* Y[b, o] (float) = W row o . X row b for B bf16 rows X [B, in], W [out] rows of `type`. */
sgl_status sgl_quant_gemv(int type, const void *W, int out, int in, const uint16_t *X, int B, float *Y);
/* W's `rows` rows dequantized into out [rows, in]. */
sgl_status sgl_quant_dequant(int type, const void *W, int rows, int in, float *out);

/* ---- many-row products over GGUF blocks, tiled for int8 dot products (qgemm.c) -------- */

int sgl_qgemm_simd(void); /* 0: plain C, 1: AVX512-VNNI */
/* Bytes of `out` x `in` weights of `type` in tile form; 0: no tile form (Q6_K, bf16, ...). */
int64_t sgl_qgemm_packed_bytes(int type, int out, int in);
/* W ([out] rows of `type` blocks) rewritten into `packed` (sgl_qgemm_packed_bytes bytes). */
sgl_status sgl_qgemm_pack(int type, const void *W, int out, int in, void *packed);
/* Y [rows, out] (bf16) = X [rows, in] (bf16) . W^T (+ bias [out], bf16 or NULL), with
 * `threads` 1 or 2 (the decode step's team). */
sgl_status sgl_qgemm(const void *packed, int type, int out, int in, const uint16_t *X, int rows, const uint16_t *bias,
                     uint16_t *Y, int threads);

/* ---- attention over the KV pool (attention.c) ------------------------------------------ */

typedef struct {
    const uint16_t *q; /* [T, nh, d] with token stride q_stride */
    int64_t q_stride;
    uint16_t *out;     /* [T, nh, d] */
    const uint16_t *k_pool, *v_pool; /* [slots, nkv, d] */
    const int64_t *rows;             /* [nreq, row_stride] pool slots per request */
    int64_t row_stride;
    int nreq;
    const int32_t *q_start, *prefix, *extend; /* [nreq] */
    int shared;        /* leading slots common to every request, packed once */
    int nh, nkv, d;
    float scale;
    void *ws;          /* sgl_attn_ws_bytes(params) bytes */
    int threads;
} sgl_attn_params;

int sgl_attn_simd(void);
int64_t sgl_attn_ws_bytes(const sgl_attn_params *p); /* reads nreq, prefix, extend, shared, nkv, d */
sgl_status sgl_attn_forward(const sgl_attn_params *p);

/* ---- fused row ops (ops.c) ------------------------------------------------------------- */

int sgl_ops_simd(void);
void sgl_ops_rmsnorm(const uint16_t *x, const uint16_t *w, uint16_t *out, int rows, int n, float eps, int threads);
void sgl_ops_add_rmsnorm(uint16_t *x, const uint16_t *y, const uint16_t *w, uint16_t *out, int rows, int n,
                         float eps, int threads);

typedef struct {
    uint16_t *qkv;   /* rows of at least nh * d, row stride `stride` elements */
    int64_t stride;
    int rows, nh, d;
    const uint16_t *cos_t, *sin_t; /* [max_pos, d / 2] */
    const int64_t *positions;      /* [rows] */
    int64_t max_pos;
    int threads;
} sgl_rope_params;

sgl_status sgl_ops_rope(const sgl_rope_params *p);
void sgl_ops_silu_mul(const uint16_t *gu, uint16_t *out, int rows, int n, int threads);

/* ---- KV rows between the pool and the host tier (kv_copy.c) ----------------------------- */

/* `n` token rows: token i is row pos[i] of host page pages[i] and pool slot slots[i]. The
 * host buffer is pages of [n_layers][2 (K, V)][page_size][row_bytes]; the pool is one K
 * and one V tensor per layer, row_bytes per slot. Indices are trusted (checked by the
 * caller). */
typedef struct {
    int to_host;                  /* 1: pool -> host (store); 0: host -> pool (load) */
    char *host;
    void *const *k_pool, *const *v_pool; /* [n_layers] */
    int n_layers, page_size;
    int64_t row_bytes, n;
    const int64_t *pages, *pos, *slots; /* [n] */
    int threads;                        /* 1, or 2 with team.c's helper */
} sgl_kv_copy;

void sgl_kv_copy_run(const sgl_kv_copy *c);
