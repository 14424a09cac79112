/* Paged attention on CPU that reads K/V in place through the block table (no gather copy).
 *
 * One call per layer and step (``attend``) does what the torch backend does with index_copy_,
 * index_select and SDPA: it stores this step's K/V at their cache slots, then every query of
 * every request attends to its context [0, seq_len) causally, reading each context token's
 * [D] K and V rows straight from their block. Requests are given as (query start, query len,
 * seq_len, table offset) rows: a decode is a request with one query, a prefill with a cached
 * prefix one whose first query sits at position seq_len - query_len.
 *
 * Work items are (query tile, KV heads): a prefill tile is up to TILE_ROWS query rows, the G
 * grouped query heads of one KV head for consecutive queries, so GQA shares each K/V row
 * between the heads of its group without repeating it; a decode item takes several KV heads
 * of its request when there are enough decodes to keep the threads busy, so that each slot's
 * heads are read as one run (the paged layout's contiguous unit). Items run on an OpenMP team
 * sized by the caller (torch.get_num_threads(): with torch imported first, this module binds
 * to torch's own libgomp, so both use one thread pool), dynamically scheduled, prefill tiles
 * (the largest) first. Each item walks its context in chunks of CHUNK tokens with an online
 * (flash-style) softmax: running max and sum per row, accumulator rescaled per chunk; the
 * next chunk's rows are prefetched (blocks are scattered, hardware prefetchers lose track).
 * Decode rows compute each score as a dot product (G rows share each K row load); prefill
 * tiles put their up to 64 rows in the vector lanes instead (broadcast-FMA over transposed
 * queries), so a tile rereads its context once per 64 rows with no cross-lane reductions.
 *
 * Math is fp32 whatever the storage: bf16 rows are widened with a 16-bit shift, the output is
 * rounded to nearest even. The per-item function is compiled for AVX-512, AVX2+FMA and the
 * baseline (target_clones, resolved once at load), so one build runs on any x86-64; head dims
 * 64, 96 and 128 get unrolled vector copies, others plain loops (each copy adds seconds to
 * the build). The GIL is released while the kernel runs.
 */
#define PY_SSIZE_T_CLEAN
#pragma GCC diagnostic ignored "-Wpsabi" /* 64-byte vector helpers are always inlined */
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__) && !defined(PA_NO_CLONES)
#define PA_HAVE_CLONES 1
#define PA_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PA_HAVE_CLONES 0
#define PA_CLONES
#endif
/* Whether the 16-lane vector paths run: only where they are AVX-512 code (the x86-64-v4 clone,
 * or a build for an AVX-512 target). Elsewhere GCC lowers 64-byte vectors to 2-4 registers
 * each and the register-resident groups spill: built for AVX2 they measured 1.1x (decode) and
 * 2.6x (prefill) the time of the plain loops, which vectorize at any width (and which are
 * themselves slower than the torch backend there: see native_backend.FAST). */
static int pa_vec512;
#define PA_INLINE static inline __attribute__((always_inline))

#define TILE_ROWS 64 /* query rows (queries x grouped heads) per work item */
#define CHUNK 32     /* context tokens per online-softmax step */
#define MAX_HEAD_DIM 512
#define VMAX_ROWS 4 /* rows per register-resident group (vector path) */
#define VMAX_ND 8   /* 16-lane vectors per row: head dim <= 128 (vector path) */

typedef struct {
    char *q, *k, *v, *out, *cache; /* element strides below; D is contiguous everywhere */
    int64_t q_st, q_sh, k_st, k_sh, v_st, v_sh, o_st, o_sh;
    int64_t c_blk, c_kv, c_slot, c_head;
    const int64_t *slots; /* [num_new] cache slots of this step's K/V (block * bs + offset) */
    int64_t num_new;
    const int64_t *reqs; /* [num_reqs, 4]: query start, query len, seq_len, table offset */
    int64_t num_reqs;
    const int64_t *tables; /* flat block tables */
    int64_t num_blocks, hq, hkv, d, bs;
    int elem; /* bytes per element: 4 = fp32, 2 = bf16 */
    float scale;
} pa_args;

typedef struct {
    int64_t req, q0, qn; /* queries [q0, q0 + qn) of request req */
    int64_t h0, nh;      /* KV heads [h0, h0 + nh) */
} pa_item;

/* -- element conversion ----------------------------------------------------------------- */

PA_INLINE float bf16_to_f32(uint16_t x)
{
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

PA_INLINE uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN stays NaN */
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* dst[0:n) = src[0:n) * s as fp32 (src fp32 or bf16). */
PA_INLINE void load_row(float *restrict dst, const char *src, int64_t n, int elem, float s)
{
    if (elem == 4) {
        const float *restrict x = (const float *)src;
        for (int64_t i = 0; i < n; i++)
            dst[i] = x[i] * s;
    } else {
        const uint16_t *restrict x = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++)
            dst[i] = bf16_to_f32(x[i]) * s;
    }
}

/* e^x for x <= 0 (a score minus its row's running max); 0 below -87. Cephes' polynomial,
 * ~1 ulp, written branch-free so it vectorizes (expf does not without -ffast-math). */
PA_INLINE float exp_neg(float x)
{
    const int tiny = x < -87.0f;
    x = tiny ? -87.0f : x;
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round(x / ln 2) */
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float p;
    memcpy(&p, &bits, 4);
    return tiny ? 0.0f : y * p;
}

/* -- one work item ---------------------------------------------------------------------- */

/* Scratch floats one thread needs: per-row state for up to max(TILE_ROWS, Hq) rows (a
 * prefill tile of one head, or a decode over several heads), one chunk's scores, one chunk
 * of K and V widened to fp32 (bf16), a tile's queries transposed. */
static int64_t scratch_floats(int64_t d, int64_t hq)
{
    const int64_t rows = hq > TILE_ROWS ? hq : TILE_ROWS;
    return rows * (2 * d + 2) + CHUNK * TILE_ROWS + 2 * CHUNK * d + TILE_ROWS * d + 64;
}

/* Online-softmax step of one row over scores s[0:n) (entries >= nv masked): returns the
 * factor alpha that rescales the row's accumulator, leaves probabilities in s. */
PA_INLINE float softmax_step(float *restrict s, int64_t n, int64_t nv, float *mx, float *sum)
{
    for (int64_t t = nv < 0 ? 0 : nv; t < n; t++)
        s[t] = -INFINITY;
    float cmax = *mx;
#pragma omp simd reduction(max : cmax)
    for (int64_t t = 0; t < n; t++)
        cmax = s[t] > cmax ? s[t] : cmax;
    const float alpha = exp_neg(*mx - cmax);
    *mx = cmax;
    float psum = 0.0f;
#pragma omp simd reduction(+ : psum)
    for (int64_t t = 0; t < n; t++) {
        const float e = exp_neg(s[t] - cmax);
        s[t] = e;
        psum += e;
    }
    *sum = *sum * alpha + psum;
    return alpha;
}

/* Any head dim: one row at a time, plain loops. */
PA_INLINE void rows_generic(const float *restrict Q, float *restrict acc, float *restrict S,
                            float *mx, float *sum, const float *const *kp,
                            const float *const *vp, int64_t n, const int64_t *nv, int64_t rows,
                            int64_t D)
{
    for (int64_t m = 0; m < rows; m++) {
        if (nv[m] <= 0)
            continue;
        const float *restrict qm = Q + m * D;
        float *restrict s = S + m * CHUNK;
        for (int64_t t = 0; t < nv[m]; t++) {
            const float *restrict k = kp[t];
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < D; i++)
                dot += qm[i] * k[i];
            s[t] = dot;
        }
        const float alpha = softmax_step(s, nv[m], nv[m], mx + m, sum + m);
        float *restrict o = acc + m * D;
        for (int64_t i = 0; i < D; i++)
            o[i] *= alpha;
        for (int64_t t = 0; t < nv[m]; t++) {
            const float pt = s[t];
            const float *restrict vr = vp[t];
            for (int64_t i = 0; i < D; i++)
                o[i] += pt * vr[i];
        }
    }
}

/* Head dims that are multiples of 16 (up to 128): R rows together, their queries and
 * accumulators held in 16-lane vectors (registers on AVX-512), each K/V row loaded once per
 * group. The compiler lowers the vectors to whatever the clone's ISA has. */
typedef float vf __attribute__((vector_size(64)));
typedef float vf_u __attribute__((vector_size(64), aligned(4)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

PA_INLINE vf vload(const float *p) { return *(const vf_u *)p; }
PA_INLINE void vstore(float *p, vf v) { *(vf_u *)p = v; }
PA_INLINE float hsum(vf v)
{
    vf8 a, b;
    memcpy(&a, &v, 32);
    memcpy(&b, (const char *)&v + 32, 32);
    a += b;
    vf4 c, d;
    memcpy(&c, &a, 16);
    memcpy(&d, (const char *)&a + 16, 16);
    c += d;
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* acc[r] = acc[r] * alpha[r] + sum_t P(r, t) V[t] for R rows, P(r, t) = P[r * rs + t * ts];
 * the R accumulator rows stay in registers while the V rows stream by. */
PA_INLINE void pv_rows(float *restrict acc, const float *restrict P, int64_t rs, int64_t ts,
                       const float *alpha, const float *const *vp, int64_t n, const int R,
                       const int ND)
{
    const int D = ND * 16;
    vf o[VMAX_ROWS][VMAX_ND];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < ND; j++)
            o[r][j] = vload(acc + r * D + 16 * j) * alpha[r];
    for (int64_t t = 0; t < n; t++) {
        vf v[VMAX_ND];
        for (int j = 0; j < ND; j++)
            v[j] = vload(vp[t] + 16 * j);
        for (int r = 0; r < R; r++) {
            const float p = P[r * rs + t * ts];
            for (int j = 0; j < ND; j++)
                o[r][j] += p * v[j];
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < ND; j++)
            vstore(acc + r * D + 16 * j, o[r][j]);
}

/* Scores of TB keys against all rows of a tile, the rows in the lanes: St[t][m] =
 * sum_i K[t][i] Qt[i][m], one broadcast K element times a row vector of Qt per step (no
 * reduction across lanes). MV: 16-row vectors per tile (1-4). */
PA_INLINE void scores_tr(const float *restrict Qt, const float *const *kp, float *restrict St,
                         const int TB, const int MV, const int D)
{
    vf s[4][4];
    for (int tb = 0; tb < TB; tb++)
        for (int v = 0; v < MV; v++)
            s[tb][v] = (vf){0};
    for (int i = 0; i < D; i++) {
        vf q[4];
        for (int v = 0; v < MV; v++)
            q[v] = vload(Qt + i * TILE_ROWS + 16 * v);
        for (int tb = 0; tb < TB; tb++) {
            const float k = kp[tb][i];
            for (int v = 0; v < MV; v++)
                s[tb][v] += k * q[v];
        }
    }
    for (int tb = 0; tb < TB; tb++)
        for (int v = 0; v < MV; v++)
            vstore(St + tb * TILE_ROWS + 16 * v, s[tb][v]);
}

/* A tile of M >= 8 rows of one KV head (prefill) over one chunk: scores with the rows in the
 * vector lanes (Qt: the tile's queries transposed, [D][TILE_ROWS]), online softmax across the
 * lanes, then the accumulator update in row groups as for decodes. */
PA_INLINE void tile_transposed(const float *restrict Qt, float *restrict acc,
                               float *restrict St, float *mx, float *sum,
                               const float *const *kp, const float *const *vp, int64_t n,
                               const int64_t *nv, int64_t M, const int ND)
{
    const int D = ND * 16;
    int64_t t = 0;
    switch ((M + 15) / 16) { /* constant vector count: accumulators in registers */
#define PA_SCORES(mv)                                                                         \
    case mv:                                                                                  \
        for (; t + 4 <= n; t += 4)                                                            \
            scores_tr(Qt, kp + t, St + t * TILE_ROWS, 4, mv, D);                              \
        for (; t < n; t++)                                                                    \
            scores_tr(Qt, kp + t, St + t * TILE_ROWS, 1, mv, D);                              \
        break;
        PA_SCORES(1)
        PA_SCORES(2)
        PA_SCORES(3)
        PA_SCORES(4)
#undef PA_SCORES
    }
    for (int64_t m = 0; m < M; m++) /* causal mask: only the diagonal chunk has any */
        for (int64_t u = nv[m] < 0 ? 0 : nv[m]; u < n; u++)
            St[u * TILE_ROWS + m] = -INFINITY;
    float cmax[TILE_ROWS], alpha[TILE_ROWS], psum[TILE_ROWS];
    for (int64_t m = 0; m < M; m++) {
        cmax[m] = mx[m];
        psum[m] = 0.0f;
    }
    for (int64_t u = 0; u < n; u++)
#pragma omp simd
        for (int64_t m = 0; m < M; m++)
            cmax[m] = St[u * TILE_ROWS + m] > cmax[m] ? St[u * TILE_ROWS + m] : cmax[m];
#pragma omp simd
    for (int64_t m = 0; m < M; m++) {
        alpha[m] = exp_neg(mx[m] - cmax[m]);
        mx[m] = cmax[m];
    }
    for (int64_t u = 0; u < n; u++) {
        float *restrict row = St + u * TILE_ROWS;
#pragma omp simd
        for (int64_t m = 0; m < M; m++) {
            const float e = exp_neg(row[m] - cmax[m]);
            row[m] = e;
            psum[m] += e;
        }
    }
    for (int64_t m = 0; m < M; m++)
        sum[m] = sum[m] * alpha[m] + psum[m];
    const int RMAX = D <= 64 ? 4 : 2;
    for (int64_t m = 0; m < M; m += RMAX) {
        const int64_t R = M - m < RMAX ? M - m : RMAX;
        if (R == RMAX) /* constant row count: register-resident accumulators */
            pv_rows(acc + m * D, St + m, 1, TILE_ROWS, alpha + m, vp, n, RMAX, ND);
        else
            for (int64_t r = 0; r < R; r++)
                pv_rows(acc + (m + r) * D, St + m + r, 1, TILE_ROWS, alpha + m + r, vp, n, 1,
                        ND);
    }
}

PA_INLINE void rows_vec(const float *restrict Q, float *restrict acc, float *restrict S,
                        float *mx, float *sum, const float *const *kp, const float *const *vp,
                        int64_t n, const int64_t *nv, const int R, const int ND)
{
    const int D = ND * 16;
    vf q[VMAX_ROWS][VMAX_ND];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < ND; j++)
            q[r][j] = vload(Q + r * D + 16 * j);
    int64_t n_any = 0; /* keys any row of the group sees */
    for (int r = 0; r < R; r++)
        n_any = nv[r] > n_any ? nv[r] : n_any;
    if (n_any <= 0)
        return;
    for (int64_t t = 0; t < n_any; t++) {
        vf k[VMAX_ND];
        for (int j = 0; j < ND; j++)
            k[j] = vload(kp[t] + 16 * j);
        for (int r = 0; r < R; r++) {
            vf d = q[r][0] * k[0];
            for (int j = 1; j < ND; j++)
                d += q[r][j] * k[j];
            S[r * CHUNK + t] = hsum(d);
        }
    }
    float alpha[VMAX_ROWS];
    for (int r = 0; r < R; r++)
        alpha[r] = softmax_step(S + r * CHUNK, n_any, nv[r], mx + r, sum + r);
    pv_rows(acc, S, CHUNK, 1, alpha, vp, n_any, R, ND);
}

/* All rows of a tile over one chunk: groups of up to 4 rows (2 above D = 64, so that the
 * accumulators stay in registers). */
PA_INLINE void chunk_rows(const float *Q, float *acc, float *S, float *mx, float *sum,
                          const float *const *kp, const float *const *vp, int64_t n,
                          const int64_t *nv, int64_t M, const int64_t D, const int vec)
{
    if (vec) {
        const int ND = (int)(D / 16), RMAX = D <= 64 ? 4 : 2;
        for (int64_t m = 0; m < M; m += RMAX) {
            const int64_t R = M - m < RMAX ? M - m : RMAX;
#define PA_ROWS(r)                                                                            \
    case r:                                                                                   \
        rows_vec(Q + m * D, acc + m * D, S, mx + m, sum + m, kp, vp, n, nv + m, r, ND);      \
        break;
            switch (R) {
                PA_ROWS(1)
                PA_ROWS(2)
                PA_ROWS(3)
                PA_ROWS(4)
            }
#undef PA_ROWS
        }
        return;
    }
    for (int64_t m = 0; m < M; m++)
        rows_generic(Q + m * D, acc + m * D, S, mx + m, sum + m, kp, vp, n, nv + m, 1, D);
}

/* One work item. D and vec are constants at every call: vec (D a multiple of 16, <= 128)
 * selects the vector paths, which then compile only for the specialized head dims. */
PA_INLINE void attend_d(const pa_args *a, const pa_item *it, float *ws, const int64_t D,
                        const int vec)
{
    const int64_t *r = a->reqs + 4 * it->req;
    const int64_t q_start = r[0], q_len = r[1], seq_len = r[2];
    const int64_t *table = a->tables + r[3];
    const int64_t G = a->hq / a->hkv, M = it->qn * G, bs = a->bs;
    const int elem = a->elem;
    const int64_t first_pos = seq_len - q_len + it->q0; /* position of the tile's first query */
    const int64_t kv_end = first_pos + it->qn;         /* keys [0, kv_end) */
    const int64_t nh = it->nh, rows = nh * M;            /* rows of head i: [i * M, i * M + M) */

    float *restrict Q = ws;
    float *restrict acc = Q + rows * D;
    float *restrict mx = acc + rows * D;
    float *restrict sum = mx + rows;
    float *restrict S = sum + rows;
    float *restrict Kf = S + CHUNK * TILE_ROWS;
    float *restrict Vf = Kf + CHUNK * D;
    float *restrict Qt = Vf + CHUNK * D;
    const float *kp[CHUNK], *vp[CHUNK];
    int64_t nv[TILE_ROWS];
    /* Prefill tiles of 8+ rows: scores with the rows in the lanes (tile_transposed). */
    const int transposed = vec && nh == 1 && M >= 8;

    for (int64_t m = 0; m < rows; m++) {
        const int64_t i = m % M, tok = q_start + it->q0 + i / G;
        const int64_t head = (it->h0 + m / M) * G + i % G;
        load_row(Q + m * D, a->q + (tok * a->q_st + head * a->q_sh) * elem, D, elem, a->scale);
        for (int64_t j = 0; j < D; j++)
            acc[m * D + j] = 0.0f;
        mx[m] = -INFINITY; /* the first chunk's alpha is exp(-inf) = 0 */
        sum[m] = 0.0f;
    }
    if (transposed)
        for (int64_t j = 0; j < D; j++)
            for (int64_t m = 0; m < TILE_ROWS; m++)
                Qt[j * TILE_ROWS + m] = m < M ? Q[m * D + j] : 0.0f;
    const int64_t s_kv = a->c_kv * elem;
    const int64_t heads_bytes = (nh - 1) * a->c_head * elem + D * elem; /* of one slot */
    for (int64_t p0 = 0; p0 < kv_end; p0 += CHUNK) {
        const int64_t n = kv_end - p0 < CHUNK ? kv_end - p0 : CHUNK;
        /* Slot addresses of this chunk (head h0), block by block. */
        const char *slot[CHUNK];
        int64_t blk = p0 / bs, off = p0 % bs;
        for (int64_t t = 0; t < n; t++) {
            slot[t] = a->cache + (table[blk] * a->c_blk + off * a->c_slot +
                                  it->h0 * a->c_head) * elem;
            if (++off == bs) {
                off = 0;
                blk++;
            }
        }
        /* Prefetch the next chunk's rows: consecutive slots of one head are H_kv * D apart
         * and blocks are anywhere, a pattern the hardware prefetchers follow poorly. */
        const int64_t n_next = kv_end - p0 - n < CHUNK ? kv_end - p0 - n : CHUNK;
        for (int64_t t = 0; t < n_next; t++) {
            const char *row = a->cache + (table[blk] * a->c_blk + off * a->c_slot +
                                          it->h0 * a->c_head) * elem;
            for (int64_t b = 0; b < heads_bytes; b += 64) {
                __builtin_prefetch(row + b);
                __builtin_prefetch(row + s_kv + b);
            }
            if (++off == bs) {
                off = 0;
                blk++;
            }
        }
        /* Causal: the query at position first_pos + i / G sees keys up to itself. */
        for (int64_t i = 0; i < M; i++) {
            const int64_t lim = first_pos + i / G - p0 + 1;
            nv[i] = lim < n ? lim : n;
        }
        for (int64_t hh = 0; hh < nh; hh++) {
            const int64_t hoff = hh * a->c_head * elem;
            for (int64_t t = 0; t < n; t++) { /* fp32: rows in place; bf16: widened */
                const char *row = slot[t] + hoff;
                if (elem == 4) {
                    kp[t] = (const float *)row;
                    vp[t] = (const float *)(row + s_kv);
                } else {
                    load_row(Kf + t * D, row, D, 2, 1.0f);
                    load_row(Vf + t * D, row + s_kv, D, 2, 1.0f);
                    kp[t] = Kf + t * D;
                    vp[t] = Vf + t * D;
                }
            }
            const int64_t m0 = hh * M;
            if (transposed)
                tile_transposed(Qt, acc, S, mx, sum, kp, vp, n, nv, M, (int)(D / 16));
            else
                chunk_rows(Q + m0 * D, acc + m0 * D, S, mx + m0, sum + m0, kp, vp, n, nv, M, D,
                           vec);
        }
    }
    for (int64_t m = 0; m < rows; m++) {
        const int64_t i = m % M, tok = q_start + it->q0 + i / G;
        const int64_t head = (it->h0 + m / M) * G + i % G;
        char *dst = a->out + (tok * a->o_st + head * a->o_sh) * elem;
        const float inv = 1.0f / sum[m];
        const float *restrict o = acc + m * D;
        if (elem == 4) {
            float *restrict y = (float *)dst;
            for (int64_t j = 0; j < D; j++)
                y[j] = o[j] * inv;
        } else {
            uint16_t *restrict y = (uint16_t *)dst;
            for (int64_t j = 0; j < D; j++)
                y[j] = f32_to_bf16(o[j] * inv);
        }
    }
}

PA_CLONES static void attend_item(const pa_args *a, const pa_item *it, float *ws)
{
    switch (pa_vec512 ? a->d : 0) { /* constant head dims: unrolled, register-resident rows */
#define PA_HEAD_DIM(d)                                                                        \
    case d:                                                                                   \
        attend_d(a, it, ws, d, 1);                                                            \
        break;
        PA_HEAD_DIM(64)
        PA_HEAD_DIM(96)
        PA_HEAD_DIM(128)
#undef PA_HEAD_DIM
    default: /* any other head dim: plain loops */
        attend_d(a, it, ws, a->d, 0);
    }
}

/* -- the step: store new K/V, then every (tile, KV head) -------------------------------- */

static void write_new_kv(const pa_args *a)
{
    const int64_t row = a->hkv * a->d * a->elem, hd = a->d * a->elem;
    const int contiguous = a->k_sh == a->d && a->v_sh == a->d && a->c_head == a->d;
    for (int64_t t = 0; t < a->num_new; t++) {
        const int64_t slot = a->slots[t];
        char *dst = a->cache + ((slot / a->bs) * a->c_blk + (slot % a->bs) * a->c_slot) * a->elem;
        const char *k = a->k + t * a->k_st * a->elem, *v = a->v + t * a->v_st * a->elem;
        if (contiguous) {
            memcpy(dst, k, row);
            memcpy(dst + a->c_kv * a->elem, v, row);
            continue;
        }
        for (int64_t h = 0; h < a->hkv; h++) {
            memcpy(dst + h * a->c_head * a->elem, k + h * a->k_sh * a->elem, hd);
            memcpy(dst + (a->c_kv + h * a->c_head) * a->elem, v + h * a->v_sh * a->elem, hd);
        }
    }
}

/* Work items, prefill tiles first (last tiles of a prompt, the costliest, first of all),
 * one KV head each. A decode takes several KV heads of its request when there are enough
 * decodes to keep every thread busy: each slot's heads are then read as one contiguous run. */
static pa_item *make_items(const pa_args *a, int threads, int64_t *count)
{
    const int64_t G = a->hq / a->hkv, per = G >= TILE_ROWS ? 1 : TILE_ROWS / G;
    int64_t n_decode = 0, n_tiles = 0;
    for (int64_t i = 0; i < a->num_reqs; i++) {
        const int64_t ql = a->reqs[4 * i + 1];
        n_decode += ql == 1;
        n_tiles += ql == 1 ? 0 : (ql + per - 1) / per;
    }
    int64_t nh = a->hkv; /* heads per decode item: the most that leaves 2 items per thread */
    while (nh > 1 && (a->hkv % nh || n_decode * (a->hkv / nh) < 2 * threads))
        nh--;
    const int64_t n = n_tiles * a->hkv + n_decode * (a->hkv / nh);
    pa_item *items = malloc((size_t)(n > 0 ? n : 1) * sizeof(pa_item));
    if (items == NULL)
        return NULL;
    int64_t k = 0;
    for (int64_t i = 0; i < a->num_reqs; i++) {
        const int64_t ql = a->reqs[4 * i + 1];
        if (ql == 1)
            continue;
        for (int64_t q0 = ((ql - 1) / per) * per; q0 >= 0; q0 -= per)
            for (int64_t h = 0; h < a->hkv; h++)
                items[k++] = (pa_item){i, q0, ql - q0 < per ? ql - q0 : per, h, 1};
    }
    for (int64_t i = 0; i < a->num_reqs; i++)
        if (a->reqs[4 * i + 1] == 1)
            for (int64_t h = 0; h < a->hkv; h += nh)
                items[k++] = (pa_item){i, 0, 1, h, nh};
    *count = n;
    return items;
}

/* Reject anything that would read or write outside the cache (metadata comes from Python). */
static int validate(const pa_args *a)
{
    if (a->hq <= 0 || a->hkv <= 0 || a->hq % a->hkv || a->d <= 0 || a->d > MAX_HEAD_DIM ||
        a->bs <= 0 || a->num_blocks <= 0 || (a->elem != 4 && a->elem != 2) ||
        a->num_reqs < 0 || a->num_new < 0 || (a->hq / a->hkv > TILE_ROWS)) {
        PyErr_SetString(PyExc_ValueError, "paged attention: bad shapes");
        return -1;
    }
    const int64_t max_slot = a->num_blocks * a->bs;
    for (int64_t t = 0; t < a->num_new; t++) {
        if (a->slots[t] < 0 || a->slots[t] >= max_slot) {
            PyErr_Format(PyExc_IndexError, "slot %lld out of range", (long long)a->slots[t]);
            return -1;
        }
    }
    for (int64_t i = 0; i < a->num_reqs; i++) {
        const int64_t *r = a->reqs + 4 * i;
        if (r[1] <= 0 || r[2] < r[1] || r[0] < 0 || r[3] < 0) {
            PyErr_SetString(PyExc_ValueError, "paged attention: bad request row");
            return -1;
        }
        for (int64_t b = 0; b < (r[2] + a->bs - 1) / a->bs; b++) {
            const int64_t id = a->tables[r[3] + b];
            if (id < 0 || id >= a->num_blocks) {
                PyErr_Format(PyExc_IndexError, "block %lld out of range", (long long)id);
                return -1;
            }
        }
    }
    return 0;
}

enum {
    A_Q, A_QST, A_QSH, A_K, A_KST, A_KSH, A_V, A_VST, A_VSH, A_OUT, A_OST, A_OSH,
    A_CACHE, A_CBLK, A_CKV, A_CSLOT, A_CHEAD, A_NBLOCKS, A_SLOTS, A_NNEW, A_REQS, A_NREQS,
    A_TABLES, A_HQ, A_HKV, A_D, A_BS, A_ELEM, A_THREADS, A_SCALE, A_COUNT
};

static PyObject *attend(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != A_COUNT) {
        PyErr_Format(PyExc_TypeError, "attend() takes %d arguments", A_COUNT);
        return NULL;
    }
    int64_t v[A_SCALE];
    for (int i = 0; i < A_SCALE; i++) {
        v[i] = (int64_t)PyLong_AsLongLong(args[i]);
        if (v[i] == -1 && PyErr_Occurred())
            return NULL;
    }
    const double scale = PyFloat_AsDouble(args[A_SCALE]);
    if (scale == -1.0 && PyErr_Occurred())
        return NULL;
    pa_args a = {
        .q = (char *)(intptr_t)v[A_Q], .k = (char *)(intptr_t)v[A_K],
        .v = (char *)(intptr_t)v[A_V], .out = (char *)(intptr_t)v[A_OUT],
        .cache = (char *)(intptr_t)v[A_CACHE],
        .q_st = v[A_QST], .q_sh = v[A_QSH], .k_st = v[A_KST], .k_sh = v[A_KSH],
        .v_st = v[A_VST], .v_sh = v[A_VSH], .o_st = v[A_OST], .o_sh = v[A_OSH],
        .c_blk = v[A_CBLK], .c_kv = v[A_CKV], .c_slot = v[A_CSLOT], .c_head = v[A_CHEAD],
        .num_blocks = v[A_NBLOCKS], .slots = (const int64_t *)(intptr_t)v[A_SLOTS],
        .num_new = v[A_NNEW], .reqs = (const int64_t *)(intptr_t)v[A_REQS],
        .num_reqs = v[A_NREQS], .tables = (const int64_t *)(intptr_t)v[A_TABLES],
        .hq = v[A_HQ], .hkv = v[A_HKV], .d = v[A_D], .bs = v[A_BS], .elem = (int)v[A_ELEM],
        .scale = (float)scale,
    };
    int threads = v[A_THREADS] > 0 ? (int)v[A_THREADS] : 1;
    if (validate(&a) < 0)
        return NULL;
    int64_t total = 0;
    pa_item *items = make_items(&a, threads, &total);
    if (threads > total)
        threads = total > 0 ? (int)total : 1;
    const int64_t per_thread = scratch_floats(a.d, a.hq);
    float *scratch = aligned_alloc(64, (size_t)(threads * per_thread) * sizeof(float));
    if (items == NULL || scratch == NULL) {
        free(items);
        free(scratch);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    write_new_kv(&a);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(dynamic, 1)
    for (int64_t w = 0; w < total; w++) {
#ifdef _OPENMP
        float *ws = scratch + omp_get_thread_num() * per_thread;
#else
        float *ws = scratch;
#endif
        attend_item(&a, &items[w], ws);
    }
    Py_END_ALLOW_THREADS
    free(items);
    free(scratch);
    Py_RETURN_NONE;
}

static PyObject *build_info(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(args))
{
#ifdef _OPENMP
    const int openmp = 1;
#else
    const int openmp = 0;
#endif
    const char *isa = "baseline"; /* the clone the resolver picks on this CPU */
#if PA_HAVE_CLONES
    if (__builtin_cpu_supports("x86-64-v4"))
        isa = "x86-64-v4 (AVX-512)";
    else if (__builtin_cpu_supports("x86-64-v3"))
        isa = "x86-64-v3 (AVX2, FMA)";
#endif
    return Py_BuildValue("{s:O,s:s,s:O}", "openmp", openmp ? Py_True : Py_False, "isa", isa,
                         "vector_paths", pa_vec512 ? Py_True : Py_False);
}

static PyMethodDef methods[] = {
    {"attend", (PyCFunction)(void (*)(void))attend, METH_FASTCALL,
     "attend(q, q_st, q_sh, k, k_st, k_sh, v, v_st, v_sh, out, o_st, o_sh, cache, c_blk, "
     "c_kv, c_slot, c_head, num_blocks, slots, num_new, reqs, num_reqs, tables, hq, hkv, d, "
     "block_size, elem_bytes, num_threads, scale): store num_new new K/V rows at slots, then "
     "write paged attention of every request into out. Pointers are data_ptr() ints, strides "
     "in elements; see kvserve.engine.attention.native_backend."},
    {"build_info", build_info, METH_NOARGS,
     "{'openmp': bool, 'isa': str, 'vector_paths': bool}: OpenMP built in, the kernel variant "
     "this CPU runs, whether its AVX-512 register-blocked paths run."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_paged_attention",
    .m_doc = "Paged attention over a block-table KV cache, read in place (CPU).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__paged_attention(void)
{
#if PA_HAVE_CLONES
    __builtin_cpu_init();
    pa_vec512 = __builtin_cpu_supports("x86-64-v4");
#elif defined(__AVX512F__)
    pa_vec512 = 1;
#endif
    return PyModule_Create(&module);
}
