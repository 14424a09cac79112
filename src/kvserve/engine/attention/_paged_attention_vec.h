/* The kernel's per-item code, included by _paged_attention.c once per vector width under the
 * matching `#pragma GCC target`. The includer defines VW (16: AVX-512, 8: AVX2, 4: baseline),
 * PA_SFX (this copy's suffix: attend_item becomes attend_item_512, ...) and optionally
 * PA_BF16 (AVX512_BF16 code for bf16 caches) or PA_PLAIN_ONLY (plain loops only); this header
 * suffixes every name it defines and #undefs all of it, parameters included, at its end.
 * Register budgets per width: V_ND vectors per row (head dim <= 128), V_RMAX(D) rows per
 * group, V_MV row vectors and V_TB keys per transposed-score step. */

#define PA_CAT2(a, b) a##b
#define PA_CAT(a, b) PA_CAT2(a, b)
#define vf PA_CAT(vf, PA_SFX)
#define vf_u PA_CAT(vf_u, PA_SFX)
#define vload PA_CAT(vload, PA_SFX)
#define vstore PA_CAT(vstore, PA_SFX)
#define hsum PA_CAT(hsum, PA_SFX)
#define pv_rows PA_CAT(pv_rows, PA_SFX)
#define scores_tr PA_CAT(scores_tr, PA_SFX)
#define tile_softmax PA_CAT(tile_softmax, PA_SFX)
#define tile_transposed PA_CAT(tile_transposed, PA_SFX)
#define rows_vec PA_CAT(rows_vec, PA_SFX)
#define chunk_rows PA_CAT(chunk_rows, PA_SFX)
#define attend_d PA_CAT(attend_d, PA_SFX)
#define attend_item PA_CAT(attend_item, PA_SFX)

#if VW == 16
#define V_ND 8
#define V_MV 4
#define V_TB 4
#define V_RMAX(D) ((D) <= 64 ? 4 : 2)
#else
#define V_ND 16
#define V_MV 8
#define V_TB 1
#define V_RMAX(D) 1
#endif

/* Head dims that are multiples of VW (up to 128): R rows together, their queries and
 * accumulators held in VW-lane vectors (registers), each K/V row loaded once per group. */
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vf_u __attribute__((vector_size(VW * 4), aligned(4)));

PA_INLINE vf vload(const float *p) { return *(const vf_u *)p; }
PA_INLINE void vstore(float *p, vf v) { *(vf_u *)p = v; }
PA_INLINE float hsum(vf v)
{
#if VW == 16
    vf8 a, b;
    memcpy(&a, &v, 32);
    memcpy(&b, (const char *)&v + 32, 32);
    a += b;
#elif VW == 8
    vf8 a = v;
#endif
#if VW >= 8
    vf4 c, d;
    memcpy(&c, &a, 16);
    memcpy(&d, (const char *)&a + 16, 16);
    c += d;
#else
    vf4 c = v;
#endif
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* acc[r] = acc[r] * alpha[r] + sum_t P(r, t) V[t] for R rows, P(r, t) = P[r * rs + t * ts];
 * the R accumulator rows stay in registers while the V rows stream by. */
PA_INLINE void pv_rows(float *restrict acc, const float *restrict P, int64_t rs, int64_t ts,
                       const float *alpha, const float *const *vp, int64_t n, const int R,
                       const int ND)
{
    const int D = ND * VW;
    vf o[VMAX_ROWS][V_ND];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < ND; j++)
            o[r][j] = vload(acc + r * D + VW * j) * alpha[r];
    for (int64_t t = 0; t < n; t++) {
        vf v[V_ND];
        for (int j = 0; j < ND; j++)
            v[j] = vload(vp[t] + VW * j);
        for (int r = 0; r < R; r++) {
            const float p = P[r * rs + t * ts];
            for (int j = 0; j < ND; j++)
                o[r][j] += p * v[j];
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < ND; j++)
            vstore(acc + r * D + VW * j, o[r][j]);
}

/* Scores of TB keys against all rows of a tile, the rows in the lanes: St[t][m] =
 * sum_i K[t][i] Qt[i][m], one broadcast K element times a row vector of Qt per step (no
 * reduction across lanes). MV: VW-row vectors per tile (1 to TILE_ROWS / VW). */
PA_INLINE void scores_tr(const float *restrict Qt, const float *const *kp, float *restrict St,
                         const int TB, const int MV, const int D)
{
    vf s[4][V_MV];
    for (int tb = 0; tb < TB; tb++)
        for (int v = 0; v < MV; v++)
            s[tb][v] = (vf){0};
    for (int i = 0; i < D; i++) {
        vf q[V_MV];
        for (int v = 0; v < MV; v++)
            q[v] = vload(Qt + i * TILE_ROWS + VW * v);
        for (int tb = 0; tb < TB; tb++) {
            const float k = kp[tb][i];
            for (int v = 0; v < MV; v++)
                s[tb][v] += k * q[v];
        }
    }
    for (int tb = 0; tb < TB; tb++)
        for (int v = 0; v < MV; v++)
            vstore(St + tb * TILE_ROWS + VW * v, s[tb][v]);
}

/* The online-softmax step of a tile's M rows over one chunk's scores St ([n][TILE_ROWS], rows
 * in the lanes; the causal mask applied here): probabilities left in St, each row's rescale
 * factor in alpha. */
PA_INLINE void tile_softmax(float *restrict St, float *mx, float *sum, float *alpha,
                            const int64_t *nv, int64_t M, int64_t n)
{
    for (int64_t m = 0; m < M; m++) /* causal mask: only the diagonal chunk has any */
        for (int64_t u = nv[m] < 0 ? 0 : nv[m]; u < n; u++)
            St[u * TILE_ROWS + m] = -INFINITY;
    /* Whole vectors: lanes up to ML, M rounded up to VW (those past M hold the scores of zero
     * queries, never read), so no scalar remainder of exps. */
    const int64_t ML = (M + VW - 1) / VW * VW;
    float cmax[TILE_ROWS], psum[TILE_ROWS];
#pragma omp simd
    for (int64_t m = 0; m < ML; m++) {
        cmax[m] = mx[m];
        psum[m] = 0.0f;
    }
    for (int64_t u = 0; u < n; u++)
#pragma omp simd
        for (int64_t m = 0; m < ML; m++)
            cmax[m] = St[u * TILE_ROWS + m] > cmax[m] ? St[u * TILE_ROWS + m] : cmax[m];
#pragma omp simd
    for (int64_t m = 0; m < ML; m++) {
        alpha[m] = exp_neg(mx[m] - cmax[m]);
        mx[m] = cmax[m];
    }
    for (int64_t u = 0; u < n; u++) {
        float *restrict row = St + u * TILE_ROWS;
#pragma omp simd
        for (int64_t m = 0; m < ML; m++) {
            const float e = exp_neg(row[m] - cmax[m]);
            row[m] = e;
            psum[m] += e;
        }
    }
#pragma omp simd
    for (int64_t m = 0; m < ML; m++)
        sum[m] = sum[m] * alpha[m] + psum[m];
}

/* A tile of M >= 8 rows of one KV head (prefill) over one chunk: scores with the rows in the
 * vector lanes (Qt: the tile's queries transposed, [D][TILE_ROWS]), online softmax across the
 * lanes, then the accumulator update in row groups as for decodes. */
PA_INLINE void tile_transposed(const float *restrict Qt, float *restrict acc,
                               float *restrict St, float *mx, float *sum,
                               const float *const *kp, const float *const *vp, int64_t n,
                               const int64_t *nv, int64_t M, const int ND)
{
    const int D = ND * VW;
    int64_t t = 0;
    switch ((M + VW - 1) / VW) { /* constant vector count: accumulators in registers */
#define PA_SCORES(mv)                                                                         \
    case mv:                                                                                  \
        for (; t + V_TB <= n; t += V_TB)                                                      \
            scores_tr(Qt, kp + t, St + t * TILE_ROWS, V_TB, mv, D);                           \
        for (; t < n; t++)                                                                    \
            scores_tr(Qt, kp + t, St + t * TILE_ROWS, 1, mv, D);                              \
        break;
        PA_SCORES(1)
        PA_SCORES(2)
        PA_SCORES(3)
        PA_SCORES(4)
#if VW == 8
        PA_SCORES(5)
        PA_SCORES(6)
        PA_SCORES(7)
        PA_SCORES(8)
#endif
#undef PA_SCORES
    }
    float alpha[TILE_ROWS];
    tile_softmax(St, mx, sum, alpha, nv, M, n);
    const int RMAX = V_RMAX(D);
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

/* R rows (a decode's grouped heads) over one chunk, scores as dot products. ``pf``: rows of
 * the next chunk (their K; V is ``pf_kv`` bytes on) prefetched one per key as the scores go,
 * so the loads overlap with the math (fp32 rows are used in place, with no widening loop to
 * hide them in); ``n_pf`` 0: none. */
PA_INLINE void rows_vec(const float *restrict Q, float *restrict acc, float *restrict S,
                        float *mx, float *sum, const float *const *kp, const float *const *vp,
                        int64_t n, const int64_t *nv, const int R, const int ND,
                        const char *const *pf, int64_t n_pf, int64_t pf_kv)
{
    const int D = ND * VW;
    vf q[VMAX_ROWS][V_ND];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < ND; j++)
            q[r][j] = vload(Q + r * D + VW * j);
    int64_t n_any = 0; /* keys any row of the group sees */
    for (int r = 0; r < R; r++)
        n_any = nv[r] > n_any ? nv[r] : n_any;
    if (n_any <= 0)
        return;
    for (int64_t t = 0; t < n_any; t++) {
        if (t < n_pf)
            for (int j = 0; j < ND * VW * 4; j += 64) {
                __builtin_prefetch(pf[t] + j);
                __builtin_prefetch(pf[t] + pf_kv + j);
            }
        vf k[V_ND];
        for (int j = 0; j < ND; j++)
            k[j] = vload(kp[t] + VW * j);
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

/* All rows of a tile over one chunk: groups of up to V_RMAX(D) rows, so that the
 * accumulators stay in registers. */
PA_INLINE void chunk_rows(const float *Q, float *acc, float *S, float *mx, float *sum,
                          const float *const *kp, const float *const *vp, int64_t n,
                          const int64_t *nv, int64_t M, const int64_t D, const int vec,
                          const char *const *pf, int64_t n_pf, int64_t pf_kv)
{
    if (vec) {
        const int ND = (int)(D / VW), RMAX = V_RMAX(D);
        for (int64_t m = 0; m < M; m += RMAX) {
            const int64_t R = M - m < RMAX ? M - m : RMAX;
#define PA_ROWS(r)                                                                            \
    case r:                                                                                   \
        rows_vec(Q + m * D, acc + m * D, S, mx + m, sum + m, kp, vp, n, nv + m, r, ND, pf,   \
                 m == 0 ? n_pf : 0, pf_kv);                                                   \
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

#if PA_BF16
/* bf16 caches on CPUs with AVX512_BF16: K rows are used as stored, q.k by `vdpbf16ps` (pairs
 * of bf16 products, exact in fp32, summed in fp32) against the raw bf16 queries, the softmax
 * scale applied to the scores; V rows are widened in registers (a 16-bit shift) for fp32 FMAs
 * with the fp32 probabilities. No K/V row is copied: the math is the fp32 path's up to the
 * order of the fp32 sums and the point where the scale is applied. */

typedef uint16_t bf_t;

PA_INLINE __m512bh vload_pairs(const void *p) { return (__m512bh)_mm512_loadu_si512(p); }

/* VW bf16 at p, widened to fp32. */
PA_INLINE vf vload_bf(const bf_t *p)
{
    const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
}

/* Lane j of the result: the sum of a[j]'s 16 lanes (16 horizontal sums in 30 shuffles and
 * adds instead of 16 x 8). */
PA_INLINE __m512 hsum16(const __m512 *a)
{
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++) /* 256-bit halves: [a0 lo+hi, a1 lo+hi] */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* 128-bit lane L: a[4i + L]'s 4 partial sums */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
    const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88),
                                   _mm512_shuffle_ps(d[0], d[1], 0xDD));
    /* e's lane 4L + k holds a[4k + L]'s sum */
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(idx, e);
}

/* A 16 x 16 block of 32-bit elements transposed in registers (row i in r[i] before, column i
 * after): 64 shuffles instead of 256 strided scalar loads and stores. */
PA_INLINE void transpose16(__m512 r[16])
{
    __m512 t[16];
    for (int i = 0; i < 8; i++) { /* per 128-bit lane: (a0 b0 a1 b1), (a2 b2 a3 b3) */
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* r[4i + c], 128-bit lane k: column 4k + c of rows 4i.. */
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int c = 0; c < 4; c++) { /* column 4k + c: lane k of r[c], r[4 + c], r[8 + c], ... */
        const __m512 u0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);
        const __m512 u1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);
        const __m512 w0 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
        const __m512 w1 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);
        t[c] = _mm512_shuffle_f32x4(u0, w0, 0x88);
        t[4 + c] = _mm512_shuffle_f32x4(u1, w1, 0x88);
        t[8 + c] = _mm512_shuffle_f32x4(u0, w0, 0xDD);
        t[12 + c] = _mm512_shuffle_f32x4(u1, w1, 0xDD);
    }
    for (int i = 0; i < 16; i++)
        r[i] = t[i];
}

/* s[0:n) (rounded up to 16, within the chunk) = scale * q.k[t] for one raw bf16 query row. */
PA_INLINE void scores_bf(const bf_t *restrict q, const bf_t *const *kp, int64_t n,
                         float *restrict s, const int NB, float scale)
{
    __m512bh qv[V_ND / 2];
    for (int b = 0; b < NB; b++)
        qv[b] = vload_pairs(q + 32 * b);
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
        __m512 a[16];
        for (int u = 0; u < 16; u++) {
            const bf_t *k = kp[t0 + u < n ? t0 + u : t0];
            __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], vload_pairs(k));
            for (int b = 1; b < NB; b++)
                d = _mm512_dpbf16_ps(d, qv[b], vload_pairs(k + 32 * b));
            a[u] = d;
        }
        _mm512_storeu_ps(s + t0, _mm512_mul_ps(hsum16(a), sc));
    }
}

/* pv_rows over bf16 V rows; the first n_pf rows of pf (K, V at pf_kv bytes on) prefetched. */
PA_INLINE void pv_rows_bf(float *restrict acc, const float *restrict P, int64_t rs, int64_t ts,
                          const float *alpha, const bf_t *const *vp, int64_t n, const int R,
                          const int ND, const char *const *pf, int64_t n_pf, int64_t pf_kv)
{
    const int D = ND * VW;
    vf o[VMAX_ROWS][V_ND];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < ND; j++)
            o[r][j] = vload(acc + r * D + VW * j) * alpha[r];
    for (int64_t t = 0; t < n; t++) {
        if (t < n_pf)
            for (int j = 0; j < D * 2; j += 64) {
                __builtin_prefetch(pf[t] + j);
                __builtin_prefetch(pf[t] + pf_kv + j);
            }
        vf v[V_ND];
        for (int j = 0; j < ND; j++)
            v[j] = vload_bf(vp[t] + VW * j);
        for (int r = 0; r < R; r++) {
            const float p = P[r * rs + t * ts];
            for (int j = 0; j < ND; j++)
                o[r][j] += p * v[j];
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < ND; j++)
            vstore(acc + r * D + VW * j, o[r][j]);
}

/* exp_neg on 16 lanes (the same polynomial; lanes below -87, -inf among them, give 0): the
 * power of two applied by `vscalefps` (exact, as the multiply by a built 2^n is). */
PA_INLINE __m512 exp_neg16(__m512 x)
{
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    const __m512 big = _mm512_set1_ps(12582912.0f);
    const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), big),
                                   big); /* round(x / ln 2) */
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                     _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(y, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(keep, y, n);
}

/* softmax_step for n <= 16 scores, in one vector: no scalar tail, tree reductions (the loop
 * version sums its lanes one after the other, a chain of 16 adds per row and chunk). */
PA_INLINE float softmax16(float *restrict s, int64_t nv, float *mx, float *sum)
{
    const int64_t k = nv < 0 ? 0 : nv;
    const __mmask16 valid = (__mmask16)((1u << k) - 1u);
    const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), valid, s);
    float cmax = _mm512_reduce_max_ps(x);
    cmax = cmax > *mx ? cmax : *mx;
    const __m512 e = exp_neg16(_mm512_sub_ps(x, _mm512_set1_ps(cmax)));
    _mm512_storeu_ps(s, e);
    const float alpha = exp_neg(*mx - cmax);
    *mx = cmax;
    *sum = *sum * alpha + _mm512_reduce_add_ps(e);
    return alpha;
}

/* R rows (grouped heads of a decode, or a short prefill tile) over one chunk. */
PA_INLINE void rows_bf(const bf_t *const *qr, float *restrict acc, float *restrict S, float *mx,
                       float *sum, const bf_t *const *kp, const bf_t *const *vp, int64_t n,
                       const int64_t *nv, const int R, const int ND, float scale,
                       const char *const *pf, int64_t n_pf, int64_t pf_kv)
{
    int64_t n_any = 0;
    for (int r = 0; r < R; r++)
        n_any = nv[r] > n_any ? nv[r] : n_any;
    if (n_any <= 0)
        return;
    float alpha[VMAX_ROWS];
    for (int r = 0; r < R; r++) {
        scores_bf(qr[r], kp, n_any, S + r * CHUNK, ND / 2, scale);
        alpha[r] = n_any <= 16 ? softmax16(S + r * CHUNK, nv[r], mx + r, sum + r)
                               : softmax_step(S + r * CHUNK, n_any, nv[r], mx + r, sum + r);
    }
    pv_rows_bf(acc, S, CHUNK, 1, alpha, vp, n_any, R, ND, pf, n_pf, pf_kv);
}

/* Scores of TB keys against a tile's rows in the lanes (Qt2: [D / 2][TILE_ROWS] bf16 pairs of
 * the raw queries), one broadcast pair of K elements per `vdpbf16ps`. */
PA_INLINE void scores_tr_bf(const uint32_t *restrict Qt2, const bf_t *const *kp,
                            float *restrict St, const int TB, const int MV, const int D,
                            float scale)
{
    __m512 s[4][V_MV];
    for (int tb = 0; tb < TB; tb++)
        for (int v = 0; v < MV; v++)
            s[tb][v] = _mm512_setzero_ps();
    for (int i = 0; i < D / 2; i++) {
        __m512bh q[V_MV];
        for (int v = 0; v < MV; v++)
            q[v] = vload_pairs(Qt2 + i * TILE_ROWS + 16 * v);
        for (int tb = 0; tb < TB; tb++) {
            uint32_t kk;
            memcpy(&kk, kp[tb] + 2 * i, 4);
            const __m512bh k = (__m512bh)_mm512_set1_epi32((int)kk);
            for (int v = 0; v < MV; v++)
                s[tb][v] = _mm512_dpbf16_ps(s[tb][v], q[v], k);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int tb = 0; tb < TB; tb++)
        for (int v = 0; v < MV; v++)
            _mm512_storeu_ps(St + tb * TILE_ROWS + 16 * v, _mm512_mul_ps(s[tb][v], sc));
}

/* The online-softmax step of a tile (tile_softmax) for the bf16 tile path, with P's rounding
 * in the same pass: the max over the chunk's scores (St, in L1), then the exps, summed in fp32
 * and written straight as bf16 pairs of consecutive tokens (Pp: [CHUNK / 2][TILE_ROWS], an
 * odd last token paired with zero), what pv_tr_bf multiplies: no fp32 probabilities written
 * back and read again. The 16-row vectors go side by side (independent max and sum chains);
 * the causal mask only where a row sees part of the chunk (the diagonal chunk). Lanes past M
 * (zero queries) are not masked; their results are never read. */
PA_INLINE void tile_softmax_bf(const float *restrict St, float *mx, float *sum, float *alpha,
                               const int64_t *nv, int64_t M, int64_t n, const int MV,
                               uint32_t *restrict Pp)
{
    __m512i vlim[V_MV];
    __m512 old[V_MV], cmax[V_MV], psum[V_MV];
    int full = 1; /* every row sees the whole chunk */
    for (int v = 0; v < MV; v++) {
        int32_t lim[16]; /* keys [0, lim) of each lane's row in this chunk */
        for (int l = 0; l < 16; l++) {
            const int64_t m = 16 * v + l;
            lim[l] = m < M ? (int32_t)(nv[m] < 0 ? 0 : nv[m]) : (int32_t)n;
            full &= lim[l] == n;
        }
        vlim[v] = _mm512_loadu_si512(lim);
        old[v] = cmax[v] = _mm512_loadu_ps(mx + 16 * v);
        psum[v] = _mm512_setzero_ps();
    }
    for (int64_t u = 0; u < n; u++) {
        const __m512i idx = _mm512_set1_epi32((int)u);
        for (int v = 0; v < MV; v++) {
            const __m512 x = _mm512_loadu_ps(St + u * TILE_ROWS + 16 * v);
            cmax[v] = full ? _mm512_max_ps(cmax[v], x)
                           : _mm512_mask_max_ps(cmax[v], _mm512_cmpgt_epi32_mask(vlim[v], idx),
                                                cmax[v], x);
        }
    }
    /* word 2l of a pair vector: token u's P of lane l; word 2l + 1: token u + 1's */
    const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                           1, 16, 0);
    for (int64_t u = 0; u < n; u += 2) {
        const __m512i i0 = _mm512_set1_epi32((int)u), i1 = _mm512_set1_epi32((int)u + 1);
        for (int v = 0; v < MV; v++) {
            const float *x = St + u * TILE_ROWS + 16 * v;
            __m512 e0 = exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(x), cmax[v]));
            __m512 e1 = _mm512_setzero_ps();
            if (u + 1 < n)
                e1 = exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(x + TILE_ROWS), cmax[v]));
            if (!full) {
                e0 = _mm512_maskz_mov_ps(_mm512_cmpgt_epi32_mask(vlim[v], i0), e0);
                e1 = _mm512_maskz_mov_ps(_mm512_cmpgt_epi32_mask(vlim[v], i1), e1);
            }
            psum[v] = _mm512_add_ps(_mm512_add_ps(psum[v], e0), e1);
            _mm512_storeu_si512(Pp + u / 2 * TILE_ROWS + 16 * v,
                                _mm512_permutexvar_epi16(
                                    inter, (__m512i)_mm512_cvtne2ps_pbh(e1, e0)));
        }
    }
    for (int v = 0; v < MV; v++) {
        const __m512 al = exp_neg16(_mm512_sub_ps(old[v], cmax[v]));
        _mm512_storeu_ps(alpha + 16 * v, al);
        _mm512_storeu_ps(mx + 16 * v, cmax[v]);
        _mm512_storeu_ps(sum + 16 * v, _mm512_fmadd_ps(_mm512_loadu_ps(sum + 16 * v), al,
                                                       psum[v]));
    }
}

/* A tile's P.V with its rows in the lanes (accT: [D][TILE_ROWS], rows m in lane m): accT[j] =
 * accT[j] * alpha + sum_t P[t] V[t][j], two tokens per `vdpbf16ps`: P rounded to bf16 (as
 * torch's bf16 SDPA rounds its probabilities before P.V) and paired with the next token's in
 * each lane (Pp, from tile_softmax_bf), V elements paired likewise (Vp, broadcast). An odd
 * last token pairs with zeros. Vp: [CHUNK / 2][D] scratch. */
PA_INLINE void pv_tr_bf(float *restrict accT, const float *alpha, const bf_t *const *vp,
                        int64_t n, const int MV, const int D, const uint32_t *restrict Pp,
                        uint32_t *restrict Vp)
{
    const int64_t np = (n + 1) / 2;
    for (int64_t u = 0; u < np; u++) {
        const int two = 2 * u + 1 < n;
        for (int j = 0; j < D; j += 16) {
            const __m512i lo =
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vp[2 * u] + j)));
            const __m512i hi =
                two ? _mm512_cvtepu16_epi32(
                          _mm256_loadu_si256((const __m256i *)(vp[2 * u + 1] + j)))
                    : _mm512_setzero_si512();
            _mm512_storeu_si512(Vp + u * D + j, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
    __m512 al[V_MV];
    for (int v = 0; v < MV; v++)
        al[v] = _mm512_loadu_ps(alpha + 16 * v);
    for (int j = 0; j < D; j += 4) {
        __m512 o[4][V_MV];
        for (int jj = 0; jj < 4; jj++)
            for (int v = 0; v < MV; v++)
                o[jj][v] =
                    _mm512_mul_ps(_mm512_loadu_ps(accT + (j + jj) * TILE_ROWS + 16 * v), al[v]);
        for (int64_t u = 0; u < np; u++) {
            __m512bh p[V_MV];
            for (int v = 0; v < MV; v++)
                p[v] = vload_pairs(Pp + u * TILE_ROWS + 16 * v);
            for (int jj = 0; jj < 4; jj++) {
                const __m512bh x = (__m512bh)_mm512_set1_epi32((int)Vp[u * D + j + jj]);
                for (int v = 0; v < MV; v++)
                    o[jj][v] = _mm512_dpbf16_ps(o[jj][v], p[v], x);
            }
        }
        for (int jj = 0; jj < 4; jj++)
            for (int v = 0; v < MV; v++)
                _mm512_storeu_ps(accT + (j + jj) * TILE_ROWS + 16 * v, o[jj][v]);
    }
}

/* tile_transposed for bf16 rows. */
PA_INLINE void tile_bf(const uint32_t *restrict Qt2, float *restrict accT, float *restrict St,
                       float *mx, float *sum, const bf_t *const *kp, const bf_t *const *vp,
                       int64_t n, const int64_t *nv, int64_t M, const int ND, float scale,
                       const char *const *pf, int64_t n_pf, int64_t pf_kv, uint32_t *Pp,
                       uint32_t *Vp)
{
    const int D = ND * VW;
    int64_t t = 0;
    switch ((M + VW - 1) / VW) {
#define PA_SCORES(mv)                                                                         \
    case mv:                                                                                  \
        for (; t + V_TB <= n; t += V_TB)                                                      \
            scores_tr_bf(Qt2, kp + t, St + t * TILE_ROWS, V_TB, mv, D, scale);                \
        for (; t < n; t++)                                                                    \
            scores_tr_bf(Qt2, kp + t, St + t * TILE_ROWS, 1, mv, D, scale);                   \
        break;
        PA_SCORES(1)
        PA_SCORES(2)
        PA_SCORES(3)
        PA_SCORES(4)
#undef PA_SCORES
    }
    float alpha[TILE_ROWS];
    for (int64_t t = 0; t < n_pf; t++) /* the next chunk, as the widening loop would */
        for (int j = 0; j < D * 2; j += 64) {
            __builtin_prefetch(pf[t] + j);
            __builtin_prefetch(pf[t] + pf_kv + j);
        }
    switch ((M + VW - 1) / VW) {
#define PA_PV(mv)                                                                             \
    case mv:                                                                                  \
        tile_softmax_bf(St, mx, sum, alpha, nv, M, n, mv, Pp);                                \
        pv_tr_bf(accT, alpha, vp, n, mv, D, Pp, Vp);                                          \
        break;
        PA_PV(1)
        PA_PV(2)
        PA_PV(3)
        PA_PV(4)
#undef PA_PV
    }
}

/* All M rows of one KV head over one chunk in register groups (rows_bf). */
PA_INLINE void chunk_rows_bf(const bf_t *const *qr, float *acc, float *S, float *mx, float *sum,
                             const bf_t *const *kp, const bf_t *const *vp, int64_t n,
                             const int64_t *nv, int64_t M, const int ND, float scale,
                             const char *const *pf, int64_t n_pf, int64_t pf_kv)
{
    const int RMAX = V_RMAX(ND * VW);
    for (int64_t m = 0; m < M; m += RMAX) {
        const int64_t R = M - m < RMAX ? M - m : RMAX;
        const int64_t npf = m == 0 ? n_pf : 0;
        const int64_t D = ND * VW;
#define PA_ROWS(r)                                                                            \
    case r:                                                                                   \
        rows_bf(qr + m, acc + m * D, S, mx + m, sum + m, kp, vp, n, nv + m, r, ND, scale, pf, \
                npf, pf_kv);                                                                  \
        break;
        switch (R) {
            PA_ROWS(1)
            PA_ROWS(2)
            PA_ROWS(3)
            PA_ROWS(4)
        }
#undef PA_ROWS
    }
}
#endif /* PA_BF16 */

/* One work item. D and vec are constants at every call: vec (D a multiple of VW, <= 128)
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

    /* Prefill tiles of 8+ rows: scores with the rows in the lanes (tile_transposed). */
    const int transposed = vec && nh == 1 && M >= 8;
    float *restrict Q = ws;
    float *restrict acc = Q + rows * D;
    float *restrict mx = acc + (transposed ? TILE_ROWS : rows) * D; /* room for tile_bf's accT */
    const int64_t srows = transposed ? TILE_ROWS : rows; /* a tile's softmax runs all lanes */
    float *restrict sum = mx + srows;
    float *restrict S = sum + srows;
    float *restrict Kf = S + CHUNK * TILE_ROWS;
    float *restrict Vf = Kf + CHUNK * D;
    float *restrict Qt = Vf + CHUNK * D;
    const float *kp[CHUNK], *vp[CHUNK];
    int64_t nv[TILE_ROWS];

#if PA_BF16
    const int bfp = vec && elem == 2; /* bf16 rows used as stored (rows_bf, tile_bf) */
#else
    const int bfp = 0;
#endif
    for (int64_t m = 0; m < rows; m++) {
        const int64_t i = m % M, tok = q_start + it->q0 + i / G;
        const int64_t head = (it->h0 + m / M) * G + i % G;
        if (!bfp) /* fp32 queries, scaled (the bf16 paths read them as stored) */
            load_row(Q + m * D, a->q + (tok * a->q_st + head * a->q_sh) * elem, D, elem,
                     a->scale);
        for (int64_t j = 0; j < D; j++)
            acc[m * D + j] = 0.0f;
        mx[m] = -INFINITY; /* the first chunk's alpha is exp(-inf) = 0 */
        sum[m] = 0.0f;
    }
    for (int64_t m = rows; m < srows; m++) { /* a tile's lanes past its rows */
        mx[m] = -INFINITY;
        sum[m] = 0.0f;
    }
#if PA_BF16
    const char *q0 = a->q + (q_start + it->q0) * a->q_st * elem; /* the tile's first query */
#define PA_QROW(m) /* raw bf16 query of row m */                                             \
    ((const bf_t *)(q0 + (((m) % M) / G * a->q_st +                                          \
                          ((it->h0 + (m) / M) * G + (m) % M % G) * a->q_sh) * 2))
    if (transposed && bfp) {
        for (int64_t j = 0; j < D * TILE_ROWS; j++) /* accT (tile_bf) */
            acc[j] = 0.0f;
        /* Qt2[i][m]: pair i of row m's query (zeros past M), 16 x 16 blocks transposed. */
        float *restrict Qt2 = Qt;
        const bf_t *qr[TILE_ROWS];
        for (int64_t qi = 0, m = 0; qi < it->qn; qi++) /* rows: query-major */
            for (int64_t g = 0; g < G; g++)
                qr[m++] = (const bf_t *)(q0 + (qi * a->q_st + (it->h0 * G + g) * a->q_sh) * 2);
        for (int64_t m0 = 0; m0 < TILE_ROWS; m0 += 16)
            for (int64_t i0 = 0; i0 < D / 2; i0 += 16) {
                __m512 r[16];
                for (int64_t l = 0; l < 16; l++)
                    r[l] = m0 + l < M ? _mm512_loadu_ps(qr[m0 + l] + 2 * i0)
                                      : _mm512_setzero_ps();
                transpose16(r);
                for (int64_t l = 0; l < 16; l++)
                    _mm512_storeu_ps(Qt2 + (i0 + l) * TILE_ROWS + m0, r[l]);
            }
    } else
#endif
    if (transposed)
        for (int64_t j = 0; j < D; j++)
            for (int64_t m = 0; m < TILE_ROWS; m++)
                Qt[j * TILE_ROWS + m] = m < M ? Q[m * D + j] : 0.0f;
    const int64_t s_kv = a->c_kv * elem;
    /* bf16 decode rows walk shorter chunks: the next chunk of a head, prefetched while this
     * one is used, stays small in L1 next to the nh - 1 other heads' (decode b32 x 540: 0.75x
     * the time with 16 instead of 32 tokens; fp32 rows, twice the bytes, measured no gain). */
    const int64_t ck = transposed || elem == 4 ? CHUNK : DECODE_CHUNK;
    for (int64_t p0 = 0; p0 < kv_end; p0 += ck) {
        const int64_t n = kv_end - p0 < ck ? kv_end - p0 : ck;
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
        /* The next chunk's slots, prefetched below head by head while this chunk's rows are
         * widened and used: consecutive slots of one head are H_kv * D apart and blocks are
         * anywhere, a pattern the hardware prefetchers follow poorly, and a burst of all of a
         * chunk's prefetches at once stalls on the line fill buffers instead of overlapping
         * with the math. */
        const int64_t n_next = kv_end - p0 - n < ck ? kv_end - p0 - n : ck;
        const char *next[CHUNK];
        for (int64_t t = 0; t < n_next; t++) {
            next[t] = a->cache + (table[blk] * a->c_blk + off * a->c_slot +
                                  it->h0 * a->c_head) * elem;
            if (++off == bs) {
                off = 0;
                blk++;
            }
        }
        /* Causal: the query at position first_pos + i / G sees keys up to itself. */
        for (int64_t qi = 0, i = 0; qi < it->qn; qi++) { /* rows: query-major */
            const int64_t lim = first_pos + qi - p0 + 1;
            for (int64_t g = 0; g < G; g++)
                nv[i++] = lim < n ? lim : n;
        }
        for (int64_t hh = 0; hh < nh; hh++) {
            const int64_t hoff = hh * a->c_head * elem;
#if PA_BF16
            if (bfp) {
                const bf_t *kb[CHUNK], *vb[CHUNK], *qr[TILE_ROWS];
                const char *pf[CHUNK];
                for (int64_t t = 0; t < n; t++) {
                    kb[t] = (const bf_t *)(slot[t] + hoff);
                    vb[t] = (const bf_t *)(slot[t] + hoff + s_kv);
                }
                for (int64_t t = 0; t < n_next; t++)
                    pf[t] = next[t] + hoff;
                const int64_t m0 = hh * M;
                if (transposed) { /* acc holds accT: [D][TILE_ROWS] */
                    tile_bf((const uint32_t *)Qt, acc, S, mx, sum, kb, vb, n, nv, M,
                            (int)(D / VW), a->scale, pf, n_next, s_kv, (uint32_t *)Kf,
                            (uint32_t *)Vf);
                    continue;
                }
                for (int64_t i = 0; i < M; i++)
                    qr[i] = PA_QROW(m0 + i);
                chunk_rows_bf(qr, acc + m0 * D, S, mx + m0, sum + m0, kb, vb, n, nv, M,
                              (int)(D / VW), a->scale, pf, n_next, s_kv);
                continue;
            }
#endif
            /* fp32 decode rows: prefetched inside the score loop (rows_vec). */
            const int pf_in_rows = elem == 4 && vec && !transposed;
            const char *pf[CHUNK];
            for (int64_t t = 0; pf_in_rows && t < n_next; t++)
                pf[t] = next[t] + hoff;
            for (int64_t t = 0; t < n; t++) { /* fp32: rows in place; bf16: widened */
                const char *row = slot[t] + hoff;
                if (t < n_next && !pf_in_rows)
                    for (int64_t b = 0; b < D * elem; b += 64) {
                        __builtin_prefetch(next[t] + hoff + b);
                        __builtin_prefetch(next[t] + hoff + s_kv + b);
                    }
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
                tile_transposed(Qt, acc, S, mx, sum, kp, vp, n, nv, M, (int)(D / VW));
            else
                chunk_rows(Q + m0 * D, acc + m0 * D, S, mx + m0, sum + m0, kp, vp, n, nv, M, D,
                           vec, pf, pf_in_rows ? n_next : 0, s_kv);
        }
    }
#if PA_BF16
    if (transposed && bfp) { /* accT back to rows (through Qt, no longer needed) */
        for (int64_t m0 = 0; m0 < M; m0 += 16)
            for (int64_t j0 = 0; j0 < D; j0 += 16) {
                __m512 r[16];
                for (int64_t l = 0; l < 16; l++)
                    r[l] = _mm512_loadu_ps(acc + (j0 + l) * TILE_ROWS + m0);
                transpose16(r);
                for (int64_t l = 0; l < 16; l++)
                    _mm512_storeu_ps(Qt + (m0 + l) * D + j0, r[l]);
            }
        memcpy(acc, Qt, (size_t)(M * D) * sizeof(float));
    }
#endif
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

#ifdef PA_QROW
#undef PA_QROW
#endif

static void attend_item(const pa_args *a, const pa_item *it, float *ws)
{
#ifdef PA_PLAIN_ONLY
    attend_d(a, it, ws, a->d, 0);
#else
    switch (a->d) { /* constant head dims: unrolled, register-resident rows */
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
#endif
}

#undef V_ND
#undef V_MV
#undef V_TB
#undef V_RMAX
#undef vf
#undef vf_u
#undef vload
#undef vstore
#undef hsum
#undef pv_rows
#undef scores_tr
#undef tile_softmax
#undef tile_transposed
#undef rows_vec
#undef chunk_rows
#undef attend_d
#undef attend_item
#undef PA_CAT
#undef PA_CAT2
#undef VW
#undef PA_SFX
#undef PA_BF16
#undef PA_PLAIN_ONLY
