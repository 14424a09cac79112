/* One-pass elementwise ops of the Llama-family layers on CPU: RMSNorm (optionally after adding
 * the residual), rotate-half RoPE in place, SiLU(gate) * up.
 *
 * Each replaces a chain of torch ops that makes one pass over memory per op (RMSNorm: cast,
 * square, mean, rsqrt, two multiplies, cast; RoPE: four multiplies, an add, a subtract and two
 * temporaries). Roundings are torch's, op by op: every intermediate that torch stores in the
 * model dtype is rounded to it here too (bf16: to nearest even), fp32 math in between, and no
 * multiply-add is contracted (built with -ffp-contract=off), so RoPE is bit for bit what
 * `apply_rope` computes. RMSNorm sums its squares in another order than torch's reduction
 * (its fp32 result may differ in the last bit before rounding), SiLU uses its own exp (~1 ulp
 * fp32). Rows are split across an OpenMP team of the caller's size (torch's thread count). The
 * row loops get an AVX-512 and an AVX2 clone (GCC's target_clones, picked at load) besides the
 * baseline one. The GIL is released while they run.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h" /* src/kvserve/csrc: bf16_to_f32, f32_to_bf16 */

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__) && __GNUC__ >= 12
#define FO_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FO_CLONES
#endif
#define FO_INLINE static inline __attribute__((always_inline))
#define FO_PAR_MIN (1 << 16) /* elements below which one thread does the whole call */

/* Element i of a row as fp32 (elem 4: fp32, 2: bf16). */
FO_INLINE float ld(const char *row, int64_t i, int elem)
{
    return elem == 4 ? ((const float *)row)[i] : bf16_to_f32(((const uint16_t *)row)[i]);
}

FO_INLINE void st(char *row, int64_t i, float v, int elem)
{
    if (elem == 4)
        ((float *)row)[i] = v;
    else
        ((uint16_t *)row)[i] = f32_to_bf16(v);
}

/* v rounded to the storage type (what storing it and loading it back gives). */
FO_INLINE float rnd(float v, int elem)
{
    return elem == 4 ? v : bf16_to_f32(f32_to_bf16(v));
}

/* e^x, ~1 ulp (Cephes' polynomial, branch-free so that it vectorizes); 0 below -87, +inf
 * above 88.7. */
FO_INLINE float exp_f(float x)
{
    const float big = x > 88.7f, tiny = x < -87.0f;
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float p;
    memcpy(&p, &bits, 4);
    return tiny ? 0.0f : (big ? INFINITY : y * p);
}

/* -- RMSNorm ------------------------------------------------------------------------------ */

typedef struct {
    char *x, *res, *out;
    const char *w;
    int64_t rows, cols, x_st, res_st, out_st;
    float eps;
    int elem;
} norm_args;

/* One row: h = x (+ res, rounded, stored back into x), out = w * rnd(h * rsqrt(mean(h^2) + eps)),
 * each product rounded to the storage type (HF: fp32 norm, cast, then the weight multiply). */
FO_INLINE void norm_body(const norm_args *a, int64_t r0, int64_t r1, const int elem)
{
    for (int64_t r = r0; r < r1; r++) {
        char *x = a->x + r * a->x_st * elem, *out = a->out + r * a->out_st * elem;
        float sum = 0.0f; /* lanes of partial sums (omp simd), then added */
        if (a->res != NULL) {
            char *restrict xs = x;
            const char *restrict res = a->res + r * a->res_st * elem;
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < a->cols; i++) {
                const float h = rnd(ld(xs, i, elem) + ld(res, i, elem), elem);
                st(xs, i, h, elem);
                sum += h * h;
            }
        } else {
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < a->cols; i++) {
                const float h = ld(x, i, elem);
                sum += h * h;
            }
        }
        const float inv = 1.0f / sqrtf(sum / (float)a->cols + a->eps);
        for (int64_t i = 0; i < a->cols; i++) {
            const float y = rnd(ld(x, i, elem) * inv, elem);
            st(out, i, ld(a->w, i, elem) * y, elem);
        }
    }
}

/* -- RoPE --------------------------------------------------------------------------------- */

typedef struct {
    char *x;
    const char *cos, *sin;
    int64_t tokens, heads, d, x_st, x_sh;
    int elem;
} rope_args;

/* [x1, x2] -> [rnd(rnd(x1 c) - rnd(x2 s)), rnd(rnd(x2 c) + rnd(x1 s))] in place, for every
 * head of tokens [t0, t1); cos/sin rows [tokens, d / 2] in the same dtype. */
FO_INLINE void rope_body(const rope_args *a, int64_t t0, int64_t t1, const int elem)
{
    const int64_t half = a->d / 2;
    for (int64_t t = t0; t < t1; t++) {
        const char *c = a->cos + t * half * elem, *s = a->sin + t * half * elem;
        for (int64_t h = 0; h < a->heads; h++) {
            char *x1 = a->x + (t * a->x_st + h * a->x_sh) * elem, *x2 = x1 + half * elem;
            for (int64_t i = 0; i < half; i++) {
                const float u = ld(x1, i, elem), v = ld(x2, i, elem);
                const float ci = ld(c, i, elem), si = ld(s, i, elem);
                const float o1 = rnd(u * ci, elem) - rnd(v * si, elem);
                const float o2 = rnd(v * ci, elem) + rnd(u * si, elem);
                st(x1, i, o1, elem);
                st(x2, i, o2, elem);
            }
        }
    }
}

/* -- SiLU and mul ------------------------------------------------------------------------- */

typedef struct {
    const char *gu; /* [rows, 2 * cols]: gate, then up */
    char *out;      /* [rows, cols] */
    int64_t rows, cols, gu_st, out_st;
    int elem;
} silu_args;

/* out = rnd(rnd(g / (1 + e^-g)) * u), as F.silu(gate).mul_(up) rounds. */
FO_INLINE void silu_body(const silu_args *a, int64_t r0, int64_t r1, const int elem)
{
    for (int64_t r = r0; r < r1; r++) {
        const char *g = a->gu + r * a->gu_st * elem, *u = g + a->cols * elem;
        char *out = a->out + r * a->out_st * elem;
        for (int64_t i = 0; i < a->cols; i++) {
            const float x = ld(g, i, elem);
            st(out, i, rnd(x / (1.0f + exp_f(-x)), elem) * ld(u, i, elem), elem);
        }
    }
}

/* Per-dtype copies of each body (elem a constant: straight-line vector code), each cloned per
 * ISA; `name(a, lo, hi)` calls the one for a->elem. */
#define FO_ROWS(name, body, args_t)                                                           \
    static FO_CLONES void name##_f32(const args_t *a, int64_t lo, int64_t hi)                 \
    {                                                                                         \
        body(a, lo, hi, 4);                                                                   \
    }                                                                                         \
    static FO_CLONES void name##_bf16(const args_t *a, int64_t lo, int64_t hi)                \
    {                                                                                         \
        body(a, lo, hi, 2);                                                                   \
    }                                                                                         \
    static void name(const args_t *a, int64_t lo, int64_t hi)                                \
    {                                                                                         \
        if (a->elem == 4)                                                                     \
            name##_f32(a, lo, hi);                                                            \
        else                                                                                  \
            name##_bf16(a, lo, hi);                                                           \
    }
FO_ROWS(norm_rows, norm_body, norm_args)
FO_ROWS(rope_rows, rope_body, rope_args)
FO_ROWS(silu_rows, silu_body, silu_args)

/* -- Python entry points ------------------------------------------------------------------ */

static int parse(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, int64_t *v,
                 double *f)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "takes %zd arguments", want);
        return -1;
    }
    for (Py_ssize_t i = 0; i < want; i++) {
        if (f != NULL && i == want - 1) {
            *f = PyFloat_AsDouble(args[i]);
            if (*f == -1.0 && PyErr_Occurred())
                return -1;
            continue;
        }
        v[i] = (int64_t)PyLong_AsLongLong(args[i]);
        if (v[i] == -1 && PyErr_Occurred())
            return -1;
    }
    return 0;
}

static int bad_elem(int64_t elem)
{
    if (elem == 4 || elem == 2)
        return 0;
    PyErr_SetString(PyExc_ValueError, "elem must be 4 (fp32) or 2 (bf16)");
    return 1;
}

/* Rows [0, n) split evenly over `threads` (one when the call is small). */
#define FO_PARALLEL(n, work, threads, call)                                                   \
    do {                                                                                      \
        const int team = (work) >= FO_PAR_MIN && (threads) > 1 ? (int)(threads) : 1;         \
        _Pragma("omp parallel for num_threads(team) if (team > 1) schedule(static)")         \
        for (int p = 0; p < team; p++) {                                                      \
            const int64_t lo = (n) * p / team, hi = (n) * (p + 1) / team;                    \
            call;                                                                             \
        }                                                                                     \
    } while (0)

static PyObject *rms_norm(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    int64_t v[11];
    double eps;
    if (parse(args, nargs, 12, v, &eps) < 0 || bad_elem(v[9]))
        return NULL;
    const norm_args a = {
        .x = (char *)(intptr_t)v[0], .x_st = v[1], .res = (char *)(intptr_t)v[2],
        .res_st = v[3], .out = (char *)(intptr_t)v[4], .out_st = v[5],
        .w = (const char *)(intptr_t)v[6], .rows = v[7], .cols = v[8], .elem = (int)v[9],
        .eps = (float)eps,
    };
    if (a.rows < 0 || a.cols <= 0) {
        PyErr_SetString(PyExc_ValueError, "rms_norm: bad shape");
        return NULL;
    }
    const int64_t threads = v[10];
    Py_BEGIN_ALLOW_THREADS
    FO_PARALLEL(a.rows, a.rows * a.cols, threads, norm_rows(&a, lo, hi));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *rope(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    int64_t v[10];
    if (parse(args, nargs, 10, v, NULL) < 0 || bad_elem(v[8]))
        return NULL;
    const rope_args a = {
        .x = (char *)(intptr_t)v[0], .x_st = v[1], .x_sh = v[2],
        .cos = (const char *)(intptr_t)v[3], .sin = (const char *)(intptr_t)v[4],
        .tokens = v[5], .heads = v[6], .d = v[7], .elem = (int)v[8],
    };
    if (a.tokens < 0 || a.heads < 0 || a.d <= 0 || a.d % 2) {
        PyErr_SetString(PyExc_ValueError, "rope: bad shape");
        return NULL;
    }
    const int64_t threads = v[9];
    Py_BEGIN_ALLOW_THREADS
    FO_PARALLEL(a.tokens, a.tokens * a.heads * a.d, threads, rope_rows(&a, lo, hi));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *silu_and_mul(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    int64_t v[8];
    if (parse(args, nargs, 8, v, NULL) < 0 || bad_elem(v[6]))
        return NULL;
    const silu_args a = {
        .gu = (const char *)(intptr_t)v[0], .gu_st = v[1], .out = (char *)(intptr_t)v[2],
        .out_st = v[3], .rows = v[4], .cols = v[5], .elem = (int)v[6],
    };
    if (a.rows < 0 || a.cols <= 0) {
        PyErr_SetString(PyExc_ValueError, "silu_and_mul: bad shape");
        return NULL;
    }
    const int64_t threads = v[7];
    Py_BEGIN_ALLOW_THREADS
    FO_PARALLEL(a.rows, a.rows * a.cols, threads, silu_rows(&a, lo, hi));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rms_norm", (PyCFunction)(void (*)(void))rms_norm, METH_FASTCALL,
     "rms_norm(x, x_st, res, res_st, out, out_st, w, rows, cols, elem, threads, eps): "
     "res (0: none) added into x first; out = RMSNorm(x) * w. Pointers are data_ptr() ints, "
     "row strides in elements; see kvserve.model.fused_ops."},
    {"rope", (PyCFunction)(void (*)(void))rope, METH_FASTCALL,
     "rope(x, x_st, x_sh, cos, sin, tokens, heads, d, elem, threads): rotate-half RoPE in place."},
    {"silu_and_mul", (PyCFunction)(void (*)(void))silu_and_mul, METH_FASTCALL,
     "silu_and_mul(gate_up, gu_st, out, out_st, rows, cols, elem, threads): out = silu(gate) * "
     "up."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_fused_ops",
    .m_doc = "One-pass RMSNorm (+ residual), RoPE and SiLU-and-mul on CPU.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__fused_ops(void) { return PyModule_Create(&module); }
