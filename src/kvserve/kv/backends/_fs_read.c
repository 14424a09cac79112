/* The fs tier's read of a group of chunk files, without the GIL.
 *
 * read_files(paths, headers, outs, past, on_wait) reads, for each path i: the file's first
 * len(headers) / len(paths) bytes into its piece of ``headers``, the next len(outs[i]) into
 * outs[i], and one byte more into ``past`` (a long file fills it). It returns one
 * (count, inode, digest) triple per file: the bytes read (the file's size when it is no longer
 * than the chunk plus one byte) or -errno (a file that cannot be opened or read); the inode of
 * the file read (0 when none was opened), which tells the caller whether the path still names
 * that file after a failed verification; the payload's xxh3-128 (see below) or None.
 *
 * Why native: from the page cache a chunk (0.75 MiB on the ``small`` preset) is read in ~0.2 ms,
 * and the Python read made three syscalls per file (open, a vectored read, close), each of
 * them releasing and taking back the GIL. With two reading threads each of those is a GIL
 * hand-off that waits for the other thread's Python, and the tier read measured 0.66 of a
 * plain read of the same files on a 2-vCPU machine (0.80 with one thread). Here a group of
 * files costs one release. Each payload is hashed (xxh3-128) right after its read, while it
 * is in this core's cache: hashing the group's payloads afterwards, in Python, read them back
 * from memory and was slower than the Python read with one thread. The hash function is the
 * xxhash package's (its extension exports it; use_hash() finds it, the caller checks it
 * against xxhash.xxh3_128_digest); where it is not found the caller hashes. The caller
 * compares the header and the digest.
 *
 * ``on_wait`` (a callable or None): each file is first read with RWF_NOWAIT (what the page cache
 * holds, never waiting on the device); the first file whose read comes up short makes this
 * call ``on_wait()`` (with the GIL, once per call) before it waits for the rest; after that,
 * and without ``on_wait``, files are read plainly. A file system without RWF_NOWAIT reads
 * plainly and calls ``on_wait`` before the first read. An exception from ``on_wait`` stops the
 * read and propagates.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef RWF_NOWAIT
#define RWF_NOWAIT 0x00000008
#endif

typedef struct {
    long long count;
    unsigned long long ino;
    unsigned char digest[16];
    int hashed;
} file_result;

/* xxHash's XXH3_128bits (its x86 dispatching form where exported), resolved by use_hash() from the xxhash package's own extension (the
 * library the Python side hashes with); NULL: the caller hashes. */
typedef struct {
    unsigned long long low64, high64;
} xxh128;
typedef xxh128 (*xxh3_128_fn)(const void *, size_t);
static xxh3_128_fn xxh3_128 = NULL;

static void put_be64(unsigned char *p, unsigned long long v)
{
    for (int i = 7; i >= 0; i--, v >>= 8)
        p[i] = (unsigned char)v;
}

/* The canonical (big-endian, high half first) form, as xxhash.xxh3_128_digest returns it. */
static void digest_of(const void *buf, size_t len, unsigned char out[16])
{
    xxh128 h = xxh3_128(buf, len);
    put_be64(out, h.high64);
    put_be64(out + 8, h.low64);
}

/* Drop the first ``n`` bytes of the vectors ``*iov`` (``iovcnt`` of them) after a partial
 * read: *iov moves past the filled ones; returns how many are left. */
static int advance(struct iovec **iov, int iovcnt, size_t n)
{
    struct iovec *v = *iov;
    while (iovcnt > 0 && n >= v->iov_len) {
        n -= v->iov_len;
        v++;
        iovcnt--;
    }
    if (iovcnt > 0) {
        v->iov_base = (char *)v->iov_base + n;
        v->iov_len -= n;
    }
    *iov = v;
    return iovcnt;
}

/* Bytes read from ``fd`` at ``offset`` into ``iov`` (advanced as it fills) until the vectors
 * are full or the file ends; -errno on an error. */
static long long read_until_full(int fd, struct iovec *iov, int iovcnt, long long offset)
{
    long long total = 0;
    while (iovcnt > 0) {
        ssize_t r = preadv(fd, iov, iovcnt, (off_t)(offset + total));
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (r == 0)
            break;
        total += r;
        iovcnt = advance(&iov, iovcnt, (size_t)r);
    }
    return total;
}

static PyObject *read_files(PyObject *self, PyObject *args)
{
    PyObject *paths_arg, *outs_arg, *on_wait;
    Py_buffer headers, past;
    if (!PyArg_ParseTuple(args, "Ow*Ow*O", &paths_arg, &headers, &outs_arg, &past, &on_wait))
        return NULL;
    PyObject *result = NULL, *paths = NULL, *outs = NULL;
    PyObject **encoded = NULL;
    Py_buffer *bufs = NULL;
    file_result *res = NULL;
    Py_ssize_t n = 0, got_paths = 0, got_bufs = 0;

    paths = PySequence_Fast(paths_arg, "paths must be a sequence");
    outs = paths ? PySequence_Fast(outs_arg, "outs must be a sequence") : NULL;
    if (!outs)
        goto done;
    n = PySequence_Fast_GET_SIZE(paths);
    if (PySequence_Fast_GET_SIZE(outs) != n) {
        PyErr_SetString(PyExc_ValueError, "paths and outs differ in length");
        goto done;
    }
    if (on_wait != Py_None && !PyCallable_Check(on_wait)) {
        PyErr_SetString(PyExc_TypeError, "on_wait must be callable or None");
        goto done;
    }
    if (past.len < 1) {
        PyErr_SetString(PyExc_ValueError, "past must hold at least one byte");
        goto done;
    }
    size_t header_bytes = n ? (size_t)headers.len / (size_t)n : 0;
    if (n && header_bytes == 0) {
        PyErr_SetString(PyExc_ValueError, "headers holds less than a byte per file");
        goto done;
    }
    encoded = PyMem_Calloc(n ? n : 1, sizeof(PyObject *));
    bufs = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    res = PyMem_Calloc(n ? n : 1, sizeof(file_result));
    if (!encoded || !bufs || !res) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got_paths < n; got_paths++)
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(paths, got_paths),
                                   &encoded[got_paths]))
            goto done;
    for (; got_bufs < n; got_bufs++)
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(outs, got_bufs), &bufs[got_bufs],
                               PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;

    int nowait = 1, waited = on_wait == Py_None;
    int failed = 0;
    PyThreadState *ts = PyEval_SaveThread();
    for (Py_ssize_t i = 0; i < n && !failed; i++) {
        int fd = open(PyBytes_AS_STRING(encoded[i]), O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            res[i].count = -errno;
            continue;
        }
        struct iovec iov[3] = {
            {(char *)headers.buf + i * header_bytes, header_bytes},
            {bufs[i].buf, (size_t)bufs[i].len},
            {past.buf, 1},
        };
        long long want = (long long)(header_bytes + (size_t)bufs[i].len);
        long long done = 0;
        struct iovec *rest = iov;
        int restcnt = 3;
        if (!waited && nowait) {
            ssize_t r = preadv2(fd, iov, 3, 0, RWF_NOWAIT);
            if (r < 0) {
                if (errno == EOPNOTSUPP || errno == EINVAL || errno == ENOSYS)
                    nowait = 0; /* not on this file system: every read may wait */
                else if (errno != EAGAIN && errno != EINTR) {
                    res[i].count = -errno;
                    close(fd);
                    continue;
                }
                r = 0;
            }
            done = r;
            restcnt = advance(&rest, restcnt, (size_t)done);
        }
        if (done < want) {
            if (!waited) { /* the rest waits on the device: tell the caller first */
                waited = 1;
                PyEval_RestoreThread(ts);
                PyObject *ok = PyObject_CallNoArgs(on_wait);
                Py_XDECREF(ok);
                failed = ok == NULL;
                ts = PyEval_SaveThread();
            }
            if (!failed) {
                long long more = read_until_full(fd, rest, restcnt, done);
                done = more < 0 ? more : done + more;
            }
        }
        struct stat st;
        res[i].ino = fstat(fd, &st) == 0 ? (unsigned long long)st.st_ino : 0;
        res[i].count = done;
        close(fd);
        if (done == want && xxh3_128) { /* hashed while the chunk is still in this core's cache */
            digest_of(bufs[i].buf, (size_t)bufs[i].len, res[i].digest);
            res[i].hashed = 1;
        }
    }
    PyEval_RestoreThread(ts);
    if (failed)
        goto done;

    result = PyList_New(n);
    for (Py_ssize_t i = 0; result && i < n; i++) {
        PyObject *item;
        if (res[i].hashed)
            item = Py_BuildValue("(LKy#)", res[i].count, res[i].ino, (const char *)res[i].digest,
                                 (Py_ssize_t)16);
        else
            item = Py_BuildValue("(LKO)", res[i].count, res[i].ino, Py_None);
        if (!item) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, i, item);
    }

done:
    for (Py_ssize_t i = 0; i < got_bufs; i++)
        PyBuffer_Release(&bufs[i]);
    for (Py_ssize_t i = 0; i < got_paths; i++)
        Py_XDECREF(encoded[i]);
    PyMem_Free(encoded);
    PyMem_Free(bufs);
    PyMem_Free(res);
    Py_XDECREF(paths);
    Py_XDECREF(outs);
    PyBuffer_Release(&headers);
    PyBuffer_Release(&past);
    return result;
}

static PyObject *use_hash(PyObject *self, PyObject *arg)
{
    PyObject *path;
    if (!PyUnicode_FSConverter(arg, &path))
        return NULL;
    /* Already loaded by the import of xxhash: RTLD_NOLOAD finds it, loads nothing new. */
    void *lib = dlopen(PyBytes_AS_STRING(path), RTLD_NOW | RTLD_NOLOAD);
    Py_DECREF(path);
    xxh3_128 = NULL;
    if (lib) { /* the dispatching entry picks the widest vectors the CPU has, as Python's */
        xxh3_128 = (xxh3_128_fn)dlsym(lib, "XXH3_128bits_dispatch");
        if (!xxh3_128)
            xxh3_128 = (xxh3_128_fn)dlsym(lib, "XXH3_128bits");
    }
    return PyBool_FromLong(xxh3_128 != NULL);
}

static PyObject *no_hash(PyObject *self, PyObject *unused)
{
    xxh3_128 = NULL;
    Py_RETURN_NONE;
}

static PyObject *digest(PyObject *self, PyObject *arg)
{
    Py_buffer b;
    if (!xxh3_128) {
        PyErr_SetString(PyExc_RuntimeError, "no hash: use_hash() found none");
        return NULL;
    }
    if (PyObject_GetBuffer(arg, &b, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    unsigned char out[16];
    digest_of(b.buf, (size_t)b.len, out);
    PyBuffer_Release(&b);
    return PyBytes_FromStringAndSize((const char *)out, 16);
}

static PyMethodDef methods[] = {
    {"read_files", read_files, METH_VARARGS,
     "read_files(paths, headers, outs, past, on_wait) -> [(count or -errno, inode, digest)]: "
     "each chunk file's header, payload and one byte past them, without the GIL; digest is "
     "the payload's xxh3-128 when use_hash() found it and the file has the chunk's size, "
     "else None."},
    {"use_hash", use_hash, METH_O,
     "use_hash(path) -> bool: take XXH3_128bits from the loaded library at path."},
    {"no_hash", no_hash, METH_NOARGS, "no_hash(): stop hashing (the caller hashes)."},
    {"digest", digest, METH_O, "digest(buffer) -> bytes: the canonical xxh3-128 of buffer."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fs_read", "The fs tier's native group read.", -1, methods,
};

PyMODINIT_FUNC PyInit__fs_read(void) { return PyModule_Create(&module); }
