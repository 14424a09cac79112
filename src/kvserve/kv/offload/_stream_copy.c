/* Host-to-host KV block copies with non-temporal stores, and the store lane that runs them.
 *
 * copy_segments(src, dst, segments, nontemporal) copies byte ranges of the buffer ``src`` into
 * the writable buffer ``dst``; ``segments`` is a C-contiguous int64 buffer of (source offset,
 * destination offset, length) triples. Every triple is bounds-checked before anything is
 * copied (a bad one raises IndexError), and the copy runs without the GIL. Threads copying one
 * batch share a ``cursor`` (an int64 counter, initially 0) and claim segments with an atomic
 * increment: they finish together, and none of them needs the GIL between segments (a thread
 * waiting for the GIL can wait a whole switch interval, 5 ms, while another runs numpy code).
 *
 * Why not memcpy: a KV transfer writes tens of MiB that the writer does not read back. glibc's
 * memcpy below its non-temporal threshold (192 MiB on this project's machines, derived from the
 * L3 size) uses ordinary stores, which read each destination line into the cache before
 * overwriting it and evict the forward pass's working set; measured on a 2-core AMD EPYC VM,
 * 40 MiB: memcpy 5.5-6.8 GB/s on one thread, torch's copy on two 8-9 GB/s, streaming stores
 * 8-10 GB/s on one thread and 11-14 GB/s on two. SSE2 streaming stores are part of x86-64's
 * baseline (AVX2 ones measured no faster); other architectures use memcpy.
 *
 * StoreLane is where stores copy: a native thread that takes store jobs and copies each in
 * the gaps between the engine's forward passes. A gate (a small int32 buffer, see GATE_* below)
 * says whether a forward pass runs; the engine thread opens and closes it (gate_forward), and
 * the copy waits on it between pieces, without the GIL, on a futex. Waiting in Python instead
 * does not work: in a gap the engine thread runs pure Python (scheduling, outputs) and holds
 * the GIL, so a store thread woken at the end of a forward pass got the GIL only when the next
 * forward's first torch op released it, and every piece of every store was measured copying
 * during forward passes (16 of 16 at 64 requests, gaps of 1.7 ms unused). Here the wait ends
 * at the futex wake and the piece is copied at once.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#define KV_HAVE_FUTEX 1
#else
#define KV_HAVE_FUTEX 0
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define KV_HAVE_STREAM 1
#else
#define KV_HAVE_STREAM 0
#endif

/* Below this, a segment is copied with memcpy: streaming stores only pay off on lengths
 * well past the cache they bypass would have absorbed. */
#define STREAM_MIN_BYTES (64 * 1024)

static void stream_copy(char *dst, const char *src, size_t n)
{
#if KV_HAVE_STREAM
    size_t head = (size_t)(-(uintptr_t)dst) & 63; /* align the stores to cache lines */
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
#else
    memcpy(dst, src, n);
#endif
}

/* Copy ``n`` bytes, with streaming stores where they pay off; returns whether it used them
 * (the caller fences once, after its last copy: end_copies). */
static int copy_range(char *dst, const char *src, size_t n, int nontemporal)
{
    if (nontemporal && n >= STREAM_MIN_BYTES) {
        stream_copy(dst, src, n);
        return 1;
    }
    memcpy(dst, src, n);
    return 0;
}

/* Streaming stores are weakly ordered: make them visible before the copy is reported done. */
static void end_copies(int streamed)
{
#if KV_HAVE_STREAM
    if (streamed)
        _mm_sfence();
#else
    (void)streamed;
#endif
}

/* The number of (src, dst, length) triples in ``seg``, each within ``src`` and ``dst``; -1 with
 * an exception set when one is not (checked before anything is copied). */
static Py_ssize_t checked_segments(Py_buffer *seg, Py_buffer *src, Py_buffer *dst)
{
    if (seg->len % (3 * (Py_ssize_t)sizeof(int64_t))) {
        PyErr_SetString(PyExc_ValueError, "segments must be int64 (src, dst, length) triples");
        return -1;
    }
    const int64_t *s = (const int64_t *)seg->buf;
    Py_ssize_t n = seg->len / (3 * (Py_ssize_t)sizeof(int64_t));
    for (Py_ssize_t k = 0; k < n; k++) {
        int64_t so = s[3 * k], d = s[3 * k + 1], len = s[3 * k + 2];
        if (so < 0 || d < 0 || len < 0 || so > src->len - len || d > dst->len - len) {
            PyErr_Format(PyExc_IndexError,
                         "segment %zd (%lld -> %lld, %lld bytes) out of range (%zd -> %zd)", k,
                         (long long)so, (long long)d, (long long)len, src->len, dst->len);
            return -1;
        }
    }
    return n;
}

static PyObject *copy_segments(PyObject *Py_UNUSED(module), PyObject *args)
{
    Py_buffer src, dst, seg, cur = {0};
    int nontemporal;
    PyObject *cursor = Py_None;
    if (!PyArg_ParseTuple(args, "y*w*y*p|O", &src, &dst, &seg, &nontemporal, &cursor))
        return NULL;
    PyObject *result = NULL;
    if (cursor != Py_None) {
        if (PyObject_GetBuffer(cursor, &cur, PyBUF_WRITABLE) < 0)
            goto done;
        if (cur.len < (Py_ssize_t)sizeof(int64_t) || (uintptr_t)cur.buf % sizeof(int64_t)) {
            PyErr_SetString(PyExc_ValueError, "cursor must be an aligned, writable int64");
            goto done;
        }
    }
    const int64_t *s = (const int64_t *)seg.buf;
    Py_ssize_t n = checked_segments(&seg, &src, &dst);
    if (n < 0)
        goto done;
    int64_t *next = cur.buf; /* shared by the threads copying one batch: claim, then copy */
    Py_BEGIN_ALLOW_THREADS
    int streamed = 0;
    for (Py_ssize_t i = 0;; i++) {
        Py_ssize_t k = next ? (Py_ssize_t)__atomic_fetch_add(next, 1, __ATOMIC_RELAXED) : i;
        if (k < 0 || k >= n)
            break;
        char *to = (char *)dst.buf + s[3 * k + 1];
        const char *from = (const char *)src.buf + s[3 * k];
        streamed |= copy_range(to, from, (size_t)s[3 * k + 2], nontemporal);
    }
    end_copies(streamed);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&seg);
    if (cur.obj != NULL)
        PyBuffer_Release(&cur);
    return result;
}


/* ---------------------------------------------------------------------------------------------
 * The forward-pass gate: int32 slots of a buffer the Python owner allocates (GATE_SLOTS long).
 * Every change bumps GATE_SEQ and wakes the waiters (a futex on GATE_SEQ), so a waiter that read
 * the sequence before checking the slots cannot miss a change.
 */
enum {
    GATE_SEQ = 0,        /* futex word: bumped on every change */
    GATE_WAITERS = 1,    /* copies waiting on the futex */
    GATE_IN_FORWARD = 2, /* 1 while a forward pass runs */
    GATE_FORWARDS = 3,   /* forward passes begun (wraps; compared by difference) */
    GATE_RELEASE = 4,    /* > 0: copy at once (someone waits for the stores, shutdown, backlog) */
    GATE_YIELD = 5,      /* > 0: wait before the next piece (loads are copying) */
    GATE_SLOTS = 8,
};

static int32_t *gate_of(Py_buffer *buf)
{
    if (buf->len < (Py_ssize_t)(GATE_SLOTS * sizeof(int32_t)) || (uintptr_t)buf->buf % 4) {
        PyErr_SetString(PyExc_ValueError, "gate must be an aligned, writable int32 buffer of 8");
        return NULL;
    }
    return (int32_t *)buf->buf;
}

static void gate_changed(int32_t *g)
{
    __atomic_add_fetch(&g[GATE_SEQ], 1, __ATOMIC_SEQ_CST);
#if KV_HAVE_FUTEX
    if (__atomic_load_n(&g[GATE_WAITERS], __ATOMIC_SEQ_CST))
        syscall(SYS_futex, &g[GATE_SEQ], FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#endif
}

static int64_t now_ns(clockid_t clock)
{
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Sleep until the gate changes from sequence number ``seen`` or ``timeout_ns`` pass. */
static void gate_wait(int32_t *g, int32_t seen, int64_t timeout_ns)
{
#if KV_HAVE_FUTEX
    struct timespec ts = {(time_t)(timeout_ns / 1000000000), (long)(timeout_ns % 1000000000)};
    syscall(SYS_futex, &g[GATE_SEQ], FUTEX_WAIT_PRIVATE, seen, &ts, NULL, 0);
#else
    (void)g;
    (void)seen;
    struct timespec ts = {0, (long)(timeout_ns < 50000 ? timeout_ns : 50000)};
    nanosleep(&ts, NULL);
#endif
}

static PyObject *gate_forward(PyObject *Py_UNUSED(module), PyObject *args)
{
    Py_buffer buf;
    int begins;
    if (!PyArg_ParseTuple(args, "w*p", &buf, &begins))
        return NULL;
    int32_t *g = gate_of(&buf);
    if (g != NULL) {
        if (begins)
            __atomic_add_fetch(&g[GATE_FORWARDS], 1, __ATOMIC_SEQ_CST);
        __atomic_store_n(&g[GATE_IN_FORWARD], begins, __ATOMIC_SEQ_CST);
        gate_changed(g);
    }
    PyBuffer_Release(&buf);
    return g != NULL ? Py_NewRef(Py_None) : NULL;
}

static PyObject *gate_set(PyObject *Py_UNUSED(module), PyObject *args)
{
    Py_buffer buf;
    int slot, value;
    if (!PyArg_ParseTuple(args, "w*ii", &buf, &slot, &value))
        return NULL;
    int32_t *g = gate_of(&buf);
    if (g != NULL && (slot < GATE_IN_FORWARD || slot >= GATE_SLOTS)) {
        PyErr_Format(PyExc_ValueError, "gate slot %d cannot be set", slot);
        g = NULL;
    }
    if (g != NULL) {
        __atomic_store_n(&g[slot], value, __ATOMIC_SEQ_CST);
        gate_changed(g);
    }
    PyBuffer_Release(&buf);
    return g != NULL ? Py_NewRef(Py_None) : NULL;
}

/* Whether a piece may be copied now; 0 wait, 1 copy (in a gap), 2 copy (during a forward),
 * -1 wait (yield: loads are copying). */
static int gate_admits(int32_t *g, int32_t max_forward, int64_t deadline_ns)
{
    if (__atomic_load_n(&g[GATE_YIELD], __ATOMIC_SEQ_CST) > 0)
        return -1;
    if (!__atomic_load_n(&g[GATE_IN_FORWARD], __ATOMIC_SEQ_CST))
        return 1;
    if (__atomic_load_n(&g[GATE_RELEASE], __ATOMIC_SEQ_CST) > 0 ||
        (int32_t)((uint32_t)__atomic_load_n(&g[GATE_FORWARDS], __ATOMIC_SEQ_CST) -
                  (uint32_t)max_forward) > 0 ||
        now_ns(CLOCK_MONOTONIC) >= deadline_ns)
        return 2;
    return 0;
}

/* Copy segments ``s[0..n)``, ``piece`` bytes at a time, each piece when the gate admits it
 * (a set yield slot is waited out like a forward pass); without the GIL. Adds the CPU ns
 * copied during forward passes to ``*in_forward_ns``. */
static void gated_copy(char *dst, const char *src, const int64_t *s, Py_ssize_t n, int32_t *g,
                       int64_t piece, int32_t max_forward, int64_t deadline_ns,
                       int64_t *in_forward_ns)
{
    int64_t off = 0; /* bytes of segment k copied */
    Py_ssize_t k = 0;
    int streamed = 0;
    while (k < n) {
        int admit;
        for (;;) {
            int32_t seen = __atomic_load_n(&g[GATE_SEQ], __ATOMIC_SEQ_CST);
            admit = gate_admits(g, max_forward, deadline_ns);
            if (admit > 0)
                break;
            /* A change after ``seen`` was read bumped GATE_SEQ: the wait returns at once. A
             * yield (loads copying, which requests wait for) has no deadline: loads are short. */
            int64_t left = admit < 0 ? 1000000000 : deadline_ns - now_ns(CLOCK_MONOTONIC);
            __atomic_add_fetch(&g[GATE_WAITERS], 1, __ATOMIC_SEQ_CST);
            gate_wait(g, seen, left < 1 ? 1 : left);
            __atomic_sub_fetch(&g[GATE_WAITERS], 1, __ATOMIC_SEQ_CST);
        }
        int64_t cpu0 = admit == 2 ? now_ns(CLOCK_THREAD_CPUTIME_ID) : 0;
        int64_t budget = piece; /* copy one piece, possibly across segments */
        while (k < n && budget > 0) {
            int64_t len = s[3 * k + 2] - off;
            int64_t take = len < budget ? len : budget;
            streamed |= copy_range(dst + s[3 * k + 1] + off, src + s[3 * k] + off, (size_t)take, 1);
            budget -= take;
            off += take;
            if (take == len) {
                k++;
                off = 0;
            }
        }
        if (admit == 2)
            *in_forward_ns += now_ns(CLOCK_THREAD_CPUTIME_ID) - cpu0;
    }
    end_copies(streamed);
}

/* ---------------------------------------------------------------------------------------------
 * StoreLane: stores from submission to completion without the GIL. One native thread per lane
 * takes jobs (byte segments of the lane's source and destination buffers) in submission order
 * and copies each through the gate (gated_copy); completions wait in a list that the engine
 * thread takes (take_done) when it polls. With a Python transfer thread instead, each store
 * took the GIL twice while the engine ran (to start the copy, then to record it), and a
 * thread that takes the GIL from the engine thread does it at the engine's next torch call,
 * in the middle of a forward pass. The engine thread records the chunks' headers itself, when
 * it takes the completion.
 */
typedef struct LaneJob {
    struct LaneJob *next;
    long long id;
    int64_t *seg; /* 3 * nseg int64: (src offset, dst offset, length) */
    Py_ssize_t nseg;
    int32_t max_forward;
    int64_t deadline_ns;
    int64_t in_forward_ns, cpu_ns, wall_ns;
} LaneJob;

typedef struct {
    PyObject_HEAD
    Py_buffer src, dst, gate; /* held for the lane's lifetime */
    int32_t *g;
    int64_t piece;
    pthread_mutex_t mu;
    pthread_cond_t work; /* a job was queued, or stop */
    pthread_cond_t idle; /* a job ended */
    LaneJob *queue, *queue_tail, *done, *done_tail;
    long long running; /* id of the job being copied, -1 if none */
    int64_t n_done;    /* ended, not taken: read without the lock by take_done's fast path */
    int64_t n_pending; /* queued or running */
    int stop, started, joined;
    pthread_t thread;
    long tid;
} StoreLane;

static void lane_free_jobs(LaneJob *j)
{
    while (j != NULL) {
        LaneJob *next = j->next;
        PyMem_RawFree(j->seg);
        PyMem_RawFree(j);
        j = next;
    }
}

static void *lane_main(void *arg)
{
    StoreLane *L = arg;
#if defined(__linux__)
    __atomic_store_n(&L->tid, (long)syscall(SYS_gettid), __ATOMIC_SEQ_CST);
#endif
    pthread_mutex_lock(&L->mu);
    for (;;) {
        while (L->queue == NULL && !L->stop)
            pthread_cond_wait(&L->work, &L->mu);
        LaneJob *j = L->queue;
        if (j == NULL)
            break; /* stopped, nothing queued */
        L->queue = j->next;
        if (L->queue == NULL)
            L->queue_tail = NULL;
        L->running = j->id;
        pthread_mutex_unlock(&L->mu);
        int64_t t0 = now_ns(CLOCK_MONOTONIC), c0 = now_ns(CLOCK_THREAD_CPUTIME_ID);
        gated_copy(L->dst.buf, L->src.buf, j->seg, j->nseg, L->g, L->piece, j->max_forward,
                   j->deadline_ns, &j->in_forward_ns);
        j->cpu_ns = now_ns(CLOCK_THREAD_CPUTIME_ID) - c0;
        j->wall_ns = now_ns(CLOCK_MONOTONIC) - t0;
        pthread_mutex_lock(&L->mu);
        j->next = NULL;
        if (L->done_tail != NULL)
            L->done_tail->next = j;
        else
            L->done = j;
        L->done_tail = j;
        L->running = -1;
        __atomic_add_fetch(&L->n_done, 1, __ATOMIC_SEQ_CST);
        __atomic_sub_fetch(&L->n_pending, 1, __ATOMIC_SEQ_CST);
        pthread_cond_broadcast(&L->idle);
    }
    pthread_mutex_unlock(&L->mu);
    return NULL;
}

static int lane_init(StoreLane *L, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"src", "dst", "gate", "piece", NULL};
    long long piece;
    if (L->started) {
        PyErr_SetString(PyExc_RuntimeError, "StoreLane is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*w*w*L", kw, &L->src, &L->dst, &L->gate,
                                     &piece))
        return -1;
    L->g = gate_of(&L->gate);
    if (L->g == NULL || piece <= 0) {
        if (L->g != NULL)
            PyErr_SetString(PyExc_ValueError, "piece must be > 0");
        PyBuffer_Release(&L->src);
        PyBuffer_Release(&L->dst);
        PyBuffer_Release(&L->gate);
        return -1;
    }
    L->piece = piece;
    L->running = -1;
    pthread_mutex_init(&L->mu, NULL);
    pthread_cond_init(&L->work, NULL);
    pthread_cond_init(&L->idle, NULL);
    int err = pthread_create(&L->thread, NULL, lane_main, L);
    if (err != 0) {
        PyBuffer_Release(&L->src);
        PyBuffer_Release(&L->dst);
        PyBuffer_Release(&L->gate);
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    L->started = 1;
#if defined(__linux__)
    pthread_setname_np(L->thread, "kv-store-lane");
#endif
    return 0;
}

/* Stop the thread once the queue is empty and join it; the caller released the GIL. */
static void lane_join(StoreLane *L)
{
    pthread_mutex_lock(&L->mu);
    L->stop = 1;
    pthread_cond_signal(&L->work);
    pthread_mutex_unlock(&L->mu);
    pthread_join(L->thread, NULL);
}

static void lane_dealloc(StoreLane *L)
{
    if (L->started) {
        if (!L->joined) {
            /* Copy what is left at once (a gate that stays closed must not hang this). */
            __atomic_store_n(&L->g[GATE_RELEASE], 1, __ATOMIC_SEQ_CST);
            gate_changed(L->g);
            Py_BEGIN_ALLOW_THREADS
            lane_join(L);
            Py_END_ALLOW_THREADS
        }
        lane_free_jobs(L->queue);
        lane_free_jobs(L->done);
        pthread_mutex_destroy(&L->mu);
        pthread_cond_destroy(&L->work);
        pthread_cond_destroy(&L->idle);
        PyBuffer_Release(&L->src);
        PyBuffer_Release(&L->dst);
        PyBuffer_Release(&L->gate);
    }
    Py_TYPE(L)->tp_free((PyObject *)L);
}

static int lane_usable(StoreLane *L)
{
    if (!L->started || L->joined) {
        PyErr_SetString(PyExc_RuntimeError, "StoreLane is not running");
        return 0;
    }
    return 1;
}

static PyObject *lane_submit(StoreLane *L, PyObject *args)
{
    long long id, deadline_ns;
    int max_forward;
    Py_buffer seg;
    if (!lane_usable(L) || !PyArg_ParseTuple(args, "Ly*iL", &id, &seg, &max_forward, &deadline_ns))
        return NULL;
    PyObject *result = NULL;
    LaneJob *j = NULL;
    Py_ssize_t n = checked_segments(&seg, &L->src, &L->dst);
    if (n < 0)
        goto done;
    if (id < 0) {
        PyErr_SetString(PyExc_ValueError, "job id must be >= 0");
        goto done;
    }
    j = PyMem_RawCalloc(1, sizeof(LaneJob));
    if (j == NULL || (n && (j->seg = PyMem_RawMalloc((size_t)seg.len)) == NULL)) {
        PyMem_RawFree(j);
        PyErr_NoMemory();
        goto done;
    }
    if (n)
        memcpy(j->seg, seg.buf, (size_t)seg.len);
    j->id = id;
    j->nseg = n;
    j->max_forward = max_forward;
    j->deadline_ns = deadline_ns;
    __atomic_add_fetch(&L->n_pending, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_lock(&L->mu);
    if (L->queue_tail != NULL)
        L->queue_tail->next = j;
    else
        L->queue = j;
    L->queue_tail = j;
    pthread_cond_signal(&L->work);
    pthread_mutex_unlock(&L->mu);
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&seg);
    return result;
}

static PyObject *lane_take_done(StoreLane *L, PyObject *Py_UNUSED(ignored))
{
    if (__atomic_load_n(&L->n_done, __ATOMIC_SEQ_CST) == 0)
        return PyList_New(0);
    pthread_mutex_lock(&L->mu);
    LaneJob *jobs = L->done;
    L->done = L->done_tail = NULL;
    __atomic_store_n(&L->n_done, 0, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&L->mu);
    PyObject *out = PyList_New(0);
    for (LaneJob *j = jobs; j != NULL && out != NULL; j = j->next) {
        PyObject *t = Py_BuildValue("(LLLL)", j->id, (long long)j->in_forward_ns,
                                    (long long)j->cpu_ns, (long long)j->wall_ns);
        if (t == NULL || PyList_Append(out, t) < 0)
            Py_CLEAR(out);
        Py_XDECREF(t);
    }
    lane_free_jobs(jobs);
    return out;
}

/* Whether job ``id`` is queued or copying; the caller holds the lock. */
static int lane_has(StoreLane *L, long long id)
{
    if (L->running == id)
        return 1;
    for (LaneJob *j = L->queue; j != NULL; j = j->next)
        if (j->id == id)
            return 1;
    return 0;
}

static void deadline_after(struct timespec *ts, double seconds)
{
    clock_gettime(CLOCK_REALTIME, ts); /* pthread_cond_timedwait's default clock */
    int64_t ns = (int64_t)ts->tv_nsec + (int64_t)(seconds * 1e9);
    ts->tv_sec += (time_t)(ns / 1000000000);
    ts->tv_nsec = (long)(ns % 1000000000);
}

static PyObject *lane_wait(StoreLane *L, PyObject *args)
{
    Py_buffer ids;
    double timeout;
    if (!lane_usable(L) || !PyArg_ParseTuple(args, "y*d", &ids, &timeout))
        return NULL;
    if (ids.len % (Py_ssize_t)sizeof(int64_t)) {
        PyBuffer_Release(&ids);
        PyErr_SetString(PyExc_ValueError, "ids must be int64");
        return NULL;
    }
    const int64_t *id = ids.buf;
    Py_ssize_t n = ids.len / (Py_ssize_t)sizeof(int64_t), i = 0;
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS
    struct timespec ts;
    deadline_after(&ts, timeout < 0 ? 0 : timeout);
    pthread_mutex_lock(&L->mu);
    while (i < n && rc == 0) {
        if (!lane_has(L, id[i]))
            i++;
        else
            rc = pthread_cond_timedwait(&L->idle, &L->mu, &ts);
    }
    pthread_mutex_unlock(&L->mu);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&ids);
    return PyBool_FromLong(i >= n);
}

static PyObject *lane_wait_any(StoreLane *L, PyObject *args)
{
    double timeout;
    if (!lane_usable(L) || !PyArg_ParseTuple(args, "d", &timeout))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    struct timespec ts;
    deadline_after(&ts, timeout < 0 ? 0 : timeout);
    pthread_mutex_lock(&L->mu);
    while (L->done == NULL && (L->queue != NULL || L->running >= 0))
        if (pthread_cond_timedwait(&L->idle, &L->mu, &ts) != 0)
            break;
    pthread_mutex_unlock(&L->mu);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *lane_cancel(StoreLane *L, PyObject *args)
{
    Py_buffer ids;
    if (!lane_usable(L) || !PyArg_ParseTuple(args, "y*", &ids))
        return NULL;
    const int64_t *id = ids.buf;
    Py_ssize_t n = ids.len / (Py_ssize_t)sizeof(int64_t);
    LaneJob *dropped = NULL;
    pthread_mutex_lock(&L->mu);
    LaneJob **link = &L->queue, *prev = NULL;
    while (*link != NULL) {
        LaneJob *j = *link;
        int hit = 0;
        for (Py_ssize_t i = 0; i < n && !hit; i++)
            hit = id[i] == j->id;
        if (hit) {
            *link = j->next;
            j->next = dropped;
            dropped = j;
            __atomic_sub_fetch(&L->n_pending, 1, __ATOMIC_SEQ_CST);
        } else {
            prev = j;
            link = &j->next;
        }
    }
    L->queue_tail = prev;
    pthread_mutex_unlock(&L->mu);
    PyBuffer_Release(&ids);
    PyObject *out = PyList_New(0);
    for (LaneJob *j = dropped; j != NULL && out != NULL; j = j->next) {
        PyObject *v = PyLong_FromLongLong(j->id);
        if (v == NULL || PyList_Append(out, v) < 0)
            Py_CLEAR(out);
        Py_XDECREF(v);
    }
    lane_free_jobs(dropped);
    return out;
}

static PyObject *lane_close(StoreLane *L, PyObject *Py_UNUSED(ignored))
{
    if (L->started && !L->joined) {
        Py_BEGIN_ALLOW_THREADS
        lane_join(L);
        Py_END_ALLOW_THREADS
        L->joined = 1;
    }
    Py_RETURN_NONE;
}

static PyObject *lane_pending(StoreLane *L, void *Py_UNUSED(closure))
{
    return PyLong_FromLongLong(__atomic_load_n(&L->n_pending, __ATOMIC_SEQ_CST));
}

static PyObject *lane_has_done(StoreLane *L, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(__atomic_load_n(&L->n_done, __ATOMIC_SEQ_CST) > 0);
}

static PyObject *lane_native_id(StoreLane *L, void *Py_UNUSED(closure))
{
    return PyLong_FromLong(__atomic_load_n(&L->tid, __ATOMIC_SEQ_CST));
}

static PyMethodDef lane_methods[] = {
    {"submit", (PyCFunction)lane_submit, METH_VARARGS,
     "submit(job_id, segments, max_forward, deadline_ns): queue a copy of int64 (src, dst, "
     "length) byte segments (bounds-checked here), copied piece by piece while no forward "
     "pass runs, or once the gate's forward count passes max_forward, the gate is released "
     "or CLOCK_MONOTONIC reaches deadline_ns; waiting while the gate's yield slot is set."},
    {"take_done", (PyCFunction)lane_take_done, METH_NOARGS,
     "take_done() -> [(job_id, in_forward_cpu_ns, cpu_ns, wall_ns)]: jobs ended since the last "
     "call, in the order they ended."},
    {"wait", (PyCFunction)lane_wait, METH_VARARGS,
     "wait(job_ids, timeout_s) -> bool: block, without the GIL, until none of the int64 ids "
     "is queued or copying (True) or the timeout passes (False)."},
    {"wait_any", (PyCFunction)lane_wait_any, METH_VARARGS,
     "wait_any(timeout_s): block until a job has ended and not been taken, nothing is pending, "
     "or the timeout passes."},
    {"cancel", (PyCFunction)lane_cancel, METH_VARARGS,
     "cancel(job_ids) -> [job_id]: drop the queued (not started) jobs among the int64 ids."},
    {"close", (PyCFunction)lane_close, METH_NOARGS,
     "close(): copy what is queued (as the gate admits it), then stop the thread."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef lane_getset[] = {
    {"pending", (getter)lane_pending, NULL, "jobs queued or copying", NULL},
    {"has_done", (getter)lane_has_done, NULL, "a job ended and was not taken", NULL},
    {"native_id", (getter)lane_native_id, NULL, "the lane thread's kernel thread id", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject StoreLaneType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvserve.kv.offload._stream_copy.StoreLane",
    .tp_basicsize = sizeof(StoreLane),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "StoreLane(src, dst, gate, piece): a native thread that copies store jobs "
              "between two byte buffers through a forward-pass gate, without the GIL.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)lane_init,
    .tp_dealloc = (destructor)lane_dealloc,
    .tp_methods = lane_methods,
    .tp_getset = lane_getset,
};

/* ---------------------------------------------------------------------------------------------
 * A store's plan, on the engine thread without numpy's per-call overhead (~20 calls, 0.3-0.5 ms
 * right after a forward pass, when its caches are cold): the byte segments that copy whole
 * chunks (k blocks each) from the primary pool to tier slots, and each chunk's sampled checksum
 * of its source blocks, the same as kv/backends/checksum.py's ``block_checksums``: the sum of
 * the sampled 64-bit words times fixed odd multipliers, mod 2**64.
 */
typedef struct {
    int64_t slot;
    Py_ssize_t chunk;
} SlotOfChunk;

static int by_slot(const void *a, const void *b)
{
    int64_t x = ((const SlotOfChunk *)a)->slot, y = ((const SlotOfChunk *)b)->slot;
    return (x > y) - (x < y);
}

static PyObject *plan_store(PyObject *Py_UNUSED(module), PyObject *args)
{
    Py_buffer pool, src, slots, widx, mult;
    long long block_bytes, k, dst_blocks;
    if (!PyArg_ParseTuple(args, "y*LLLy*y*y*y*", &pool, &block_bytes, &k, &dst_blocks, &src,
                          &slots, &widx, &mult))
        return NULL;
    PyObject *result = NULL, *segments = NULL, *sums = NULL;
    SlotOfChunk *order = NULL;
    int64_t *wblock = NULL;
    Py_ssize_t n_chunks = slots.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t n_words = widx.len / (Py_ssize_t)sizeof(int64_t);
    if (block_bytes <= 0 || block_bytes % 8 || k <= 0 || pool.len % block_bytes ||
        src.len != n_chunks * k * (Py_ssize_t)sizeof(int64_t) ||
        mult.len != n_words * (Py_ssize_t)sizeof(uint64_t)) {
        PyErr_SetString(PyExc_ValueError, "plan_store: inconsistent sizes");
        goto done;
    }
    const int64_t *sid = src.buf, *slot = slots.buf, *wi = widx.buf;
    const uint64_t *m = mult.buf, *words = pool.buf;
    int64_t n_src = pool.len / block_bytes, bw = block_bytes / 8;
    for (Py_ssize_t j = 0; j < n_words; j++)
        if (wi[j] < 0 || wi[j] >= k * bw) {
            PyErr_SetString(PyExc_ValueError, "plan_store: sampled word out of the chunk");
            goto done;
        }
    for (Py_ssize_t i = 0; i < n_chunks * k; i++)
        if (sid[i] < 0 || sid[i] >= n_src) {
            PyErr_Format(PyExc_IndexError, "source block %lld out of range (%lld)",
                         (long long)sid[i], (long long)n_src);
            goto done;
        }
    order = PyMem_Malloc((n_chunks ? n_chunks : 1) * sizeof(SlotOfChunk));
    /* Each sampled word as (block of the chunk, word in the block): no division per chunk. */
    wblock = PyMem_Malloc((n_words ? n_words : 1) * 2 * sizeof(int64_t));
    segments = PyBytes_FromStringAndSize(NULL, n_chunks * k * 3 * (Py_ssize_t)sizeof(int64_t));
    sums = PyList_New(n_chunks);
    if (order == NULL || wblock == NULL || segments == NULL || sums == NULL) {
        if (order == NULL || wblock == NULL)
            PyErr_NoMemory();
        goto done;
    }
    int64_t *woff = wblock + n_words;
    for (Py_ssize_t j = 0; j < n_words; j++) {
        wblock[j] = wi[j] / bw;
        woff[j] = wi[j] % bw;
    }
    /* The sampled lines are cold (written before the last forward pass): ask for all of them
     * first, so that their misses overlap instead of coming one chunk at a time. */
    for (Py_ssize_t c = 0; c < n_chunks; c++) {
        const int64_t *blocks = sid + c * k;
        for (Py_ssize_t j = 0; j < n_words; j += 8)
            __builtin_prefetch(words + blocks[wblock[j]] * bw + woff[j]);
    }
    for (Py_ssize_t c = 0; c < n_chunks; c++) {
        if (slot[c] < 0 || (slot[c] + 1) * k > dst_blocks) {
            PyErr_Format(PyExc_IndexError, "slot %lld out of range", (long long)slot[c]);
            goto done;
        }
        order[c].slot = slot[c];
        order[c].chunk = c;
        uint64_t sum = 0; /* unsigned: wraps mod 2**64 */
        const int64_t *blocks = sid + c * k;
        for (Py_ssize_t j = 0; j < n_words; j++)
            sum += words[blocks[wblock[j]] * bw + woff[j]] * m[j];
        PyObject *v = PyLong_FromUnsignedLongLong(sum);
        if (v == NULL)
            goto done;
        PyList_SET_ITEM(sums, c, v);
    }
    qsort(order, (size_t)n_chunks, sizeof(SlotOfChunk), by_slot); /* destination order */
    int64_t *seg = (int64_t *)PyBytes_AS_STRING(segments);
    Py_ssize_t n_runs = 0;
    for (Py_ssize_t c = 0; c < n_chunks; c++) {
        if (c && order[c].slot == order[c - 1].slot) {
            PyErr_Format(PyExc_ValueError, "slot %lld appears twice", (long long)order[c].slot);
            goto done;
        }
        const int64_t *blocks = sid + order[c].chunk * k;
        for (int64_t j = 0; j < k; j++) {
            int64_t s0 = blocks[j], d0 = order[c].slot * k + j;
            int64_t *last = n_runs ? seg + 3 * (n_runs - 1) : NULL;
            if (last && last[0] + last[2] == s0 && last[1] + last[2] == d0) {
                last[2]++;
            } else {
                seg[3 * n_runs] = s0;
                seg[3 * n_runs + 1] = d0;
                seg[3 * n_runs + 2] = 1;
                n_runs++;
            }
        }
    }
    for (Py_ssize_t r = 0; r < 3 * n_runs; r++)
        seg[r] *= block_bytes;
    if (_PyBytes_Resize(&segments, n_runs * 3 * (Py_ssize_t)sizeof(int64_t)) < 0)
        goto done; /* frees segments */
    result = Py_BuildValue("OO", segments, sums);
done:
    PyMem_Free(order);
    PyMem_Free(wblock);
    Py_XDECREF(segments);
    Py_XDECREF(sums);
    PyBuffer_Release(&pool);
    PyBuffer_Release(&src);
    PyBuffer_Release(&slots);
    PyBuffer_Release(&widx);
    PyBuffer_Release(&mult);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_segments", copy_segments, METH_VARARGS,
     "copy_segments(src, dst, segments, nontemporal, cursor=None): copy int64 (src offset, "
     "dst offset, length) byte segments of buffer src into writable buffer dst, without the "
     "GIL. With cursor (a writable int64, initially 0) shared by several threads, each call "
     "claims segments one at a time until none are left."},
    {"plan_store", plan_store, METH_VARARGS,
     "plan_store(pool, block_bytes, k, dst_blocks, src_ids, slots, word_index, multipliers) -> "
     "(segments, checksums): the int64 (src, dst, length) byte segments, in destination order, "
     "that copy chunk c's k source blocks src_ids[c*k:(c+1)*k] of the pool to tier blocks "
     "slots[c]*k.., merged into runs, and each chunk's sampled checksum of its source."},
    {"gate_forward", gate_forward, METH_VARARGS,
     "gate_forward(gate, begins): mark a forward pass as begun (counted) or ended, and wake "
     "copies waiting on the gate."},
    {"gate_set", gate_set, METH_VARARGS,
     "gate_set(gate, slot, value): set a gate slot (release, yield) and wake waiting copies."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_stream_copy",
    .m_doc = "Host-to-host KV block copies with non-temporal stores.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__stream_copy(void)
{
    if (PyType_Ready(&StoreLaneType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddObjectRef(m, "StoreLane", (PyObject *)&StoreLaneType) < 0)
        Py_CLEAR(m);
    return m;
}
