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
 * rounded to nearest even. On CPUs with AVX512_BF16, bf16 caches skip the widening copy: q.k
 * runs on the rows as stored with `vdpbf16ps` (bf16 pairs, products exact in fp32, fp32 sums;
 * the raw bf16 query, the scale applied to the score; decode scores 16 keys at a time with one
 * transposing reduction); decode rows widen V in registers for fp32 FMAs with the fp32
 * probabilities, prefill tiles round the probabilities to bf16 (as torch's bf16 SDPA does)
 * and run P.V two tokens per `vdpbf16ps` with the rows in the lanes. The per-item code
 * (_paged_attention_vec.h) is compiled four times from one
 * source, without -march: AVX-512 with AVX512_BF16 (GCC >= 10), AVX-512 with 16-lane vectors,
 * AVX2+FMA with 8-lane ones (each with its own register budget: one vector width for all
 * lowered 64-byte vectors to 2-4 AVX2 registers and spilled, 2.6x-14x slower) and the
 * baseline with plain loops only; the
 * widest the CPU supports runs (chosen at import), so one build runs on any x86-64. Head dims
 * 64, 96 and 128 get unrolled vector copies, others plain loops (each copy adds seconds to the
 * build). The GIL is released while the kernel runs.
 */
#define PY_SSIZE_T_CLEAN
#pragma GCC diagnostic ignored "-Wpsabi" /* 64-byte vector helpers are always inlined */
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h" /* src/kvserve/csrc: bf16_to_f32, f32_to_bf16 */
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

/* x86-64 with GCC: AVX-512 and AVX2 copies of the per-item code (`#pragma GCC target`),
 * chosen at import by what the CPU supports; elsewhere, the baseline copy only. */
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__) && !defined(PA_BASELINE_ONLY)
#define PA_X86 1
#else
#define PA_X86 0
#endif
#define PA_X86_BF16 (PA_X86 && __GNUC__ >= 10) /* AVX512_BF16 intrinsics */
#define PA_INLINE static inline __attribute__((always_inline))


#define TILE_ROWS 64 /* query rows (queries x grouped heads) per work item */
#define CHUNK 32     /* context tokens per online-softmax step (prefill tiles) */
#define DECODE_CHUNK 16 /* the same for bf16 decode rows (<= CHUNK) */
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

/* -- the vector paths, per width ---------------------------------------------------------- */

typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

#if PA_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512cd,avx2,fma,bmi,bmi2,lzcnt,f16c")
#define VW 16
#define PA_SFX _512
#include "_paged_attention_vec.h"
#pragma GCC pop_options

#if PA_X86_BF16
/* AVX-512 with AVX512_BF16: the AVX-512 code plus, for bf16 caches, q.k by `vdpbf16ps` on
 * rows as stored (PA_BF16 in the header); fp32 caches run the AVX-512 copy. */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512cd,avx512bf16,avx2,fma,bmi,bmi2,lzcnt,f16c")
#define VW 16
#define PA_SFX _b16
#define PA_BF16 1
#include "_paged_attention_vec.h"
#pragma GCC pop_options
#endif

#pragma GCC push_options
#pragma GCC target("avx2,fma,bmi,bmi2,lzcnt,f16c")
#define VW 8
#define PA_SFX _256
#include "_paged_attention_vec.h"
#pragma GCC pop_options
#endif

/* Baseline: plain loops only (vectorized at the baseline's width). */
#define VW 4
#define PA_SFX _128
#define PA_PLAIN_ONLY 1
#include "_paged_attention_vec.h"

/* The widest path this CPU runs: 3 = AVX-512 with AVX512_BF16, 2 = AVX-512, 1 = AVX2 + FMA,
 * 0 = baseline (set at import; KVSERVE_PAGED_ATTENTION_ISA=avx512|avx2|baseline caps it, e.g.
 * to test every path on one CPU). */
static int pa_level;

/* The widest path the CPU supports. */
static int cpu_level(void)
{
#if PA_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("bmi2"))
#if PA_X86_BF16
        return __builtin_cpu_supports("avx512bf16") ? 3 : 2;
#else
        return 2;
#endif
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("bmi2"))
        return 1;
#endif
    return 0;
}

static void attend_item(const pa_args *a, const pa_item *it, float *ws)
{
#if PA_X86
#if PA_X86_BF16
    if (pa_level == 3 && a->elem == 2) {
        attend_item_b16(a, it, ws);
        return;
    }
#endif
    if (pa_level >= 2) {
        attend_item_512(a, it, ws);
        return;
    }
    if (pa_level == 1) {
        attend_item_256(a, it, ws);
        return;
    }
#endif
    attend_item_128(a, it, ws);
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

static const char *const level_names[] = {"baseline", "avx2", "avx512", "avx512bf16"};

static PyObject *build_info(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(args))
{
#ifdef _OPENMP
    const int openmp = 1;
#else
    const int openmp = 0;
#endif
    return Py_BuildValue("{s:O,s:s,s:s}", "openmp", openmp ? Py_True : Py_False, "isa",
                         level_names[pa_level], "cpu_isa", level_names[cpu_level()]);
}

/* set_isa(name): run the paths of `name` (capped at what the CPU has); returns the name in
 * effect. For tests: every path checked on one machine. */
static PyObject *set_isa(PyObject *Py_UNUSED(module), PyObject *arg)
{
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL)
        return NULL;
    int level = -1;
    for (int i = 0; i < 4; i++)
        if (strcmp(name, level_names[i]) == 0)
            level = i;
    if (level < 0) {
        PyErr_SetString(PyExc_ValueError, "isa must be baseline, avx2, avx512 or avx512bf16");
        return NULL;
    }
    const int cpu = cpu_level();
    pa_level = level < cpu ? level : cpu;
    return PyUnicode_FromString(level_names[pa_level]);
}

static PyMethodDef methods[] = {
    {"attend", (PyCFunction)(void (*)(void))attend, METH_FASTCALL,
     "attend(q, q_st, q_sh, k, k_st, k_sh, v, v_st, v_sh, out, o_st, o_sh, cache, c_blk, "
     "c_kv, c_slot, c_head, num_blocks, slots, num_new, reqs, num_reqs, tables, hq, hkv, d, "
     "block_size, elem_bytes, num_threads, scale): store num_new new K/V rows at slots, then "
     "write paged attention of every request into out. Pointers are data_ptr() ints, strides "
     "in elements; see kvserve.engine.attention.native_backend."},
    {"build_info", build_info, METH_NOARGS,
     "{'openmp': bool, 'isa': str, 'cpu_isa': str}: OpenMP built in, the paths in use "
     "(avx512 | avx2 | baseline), the widest this CPU supports."},
    {"set_isa", set_isa, METH_O, "set_isa(name): use the avx512, avx2 or baseline paths "
     "(capped at the CPU's); returns the name in effect."},
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
    pa_level = cpu_level();
    const char *cap = getenv("KVSERVE_PAGED_ATTENTION_ISA");
    if (cap != NULL && strcmp(cap, "avx512") == 0 && pa_level > 2)
        pa_level = 2;
    else if (cap != NULL && strcmp(cap, "avx2") == 0 && pa_level > 1)
        pa_level = 1;
    else if (cap != NULL && strcmp(cap, "baseline") == 0)
        pa_level = 0;
    return PyModule_Create(&module);
}
