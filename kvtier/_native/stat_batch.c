/* Existence checks off the caller's thread, and without the GIL.
 *
 * Sizes(paths, max_live): starts one detached thread that stat()s each path (a
 *   bytes object) and records its size, -1 where stat() fails (absent, unreadable).
 *   The caller polls done(), then reads sizes(). Neither the thread nor a poll
 *   takes the GIL, so an engine whose Python thread never lets go of it still
 *   gets its answer. The object and its thread share one record, freed by the
 *   last of the two: an object dropped before a slow stat() returns (a hung
 *   network mount) leaves the thread to free it. At most max_live threads run at
 *   once in the process; past that the constructor raises BlockingIOError.
 *
 * live(): the threads running now.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

typedef struct {
    int refs; /* the object and the thread */
    int done;
    Py_ssize_t count;
    char **paths;
    long long *sizes;
} Batch;

static int live_threads = 0;

static void batch_release(Batch *batch) {
    if (__atomic_sub_fetch(&batch->refs, 1, __ATOMIC_ACQ_REL) != 0) return;
    for (Py_ssize_t i = 0; i < batch->count; i++) free(batch->paths[i]);
    free(batch->paths);
    free(batch->sizes);
    free(batch);
}

static void *run(void *arg) {
    Batch *batch = arg;
    for (Py_ssize_t i = 0; i < batch->count; i++) {
        struct stat st;
        batch->sizes[i] = stat(batch->paths[i], &st) == 0 ? (long long)st.st_size : -1;
    }
    /* Release: every size is written before done reads as 1. */
    __atomic_store_n(&batch->done, 1, __ATOMIC_RELEASE);
    __atomic_sub_fetch(&live_threads, 1, __ATOMIC_ACQ_REL);
    batch_release(batch);
    return NULL;
}

typedef struct {
    PyObject_HEAD
    Batch *batch;
} Sizes;

/* A batch holding private copies of the paths (the caller's objects may go away), or NULL. */
static Batch *new_batch(PyObject *seq) {
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    Batch *batch = calloc(1, sizeof(Batch));
    if (batch == NULL) return (Batch *)PyErr_NoMemory();
    batch->refs = 1;
    batch->paths = calloc(count ? count : 1, sizeof(char *));
    batch->sizes = calloc(count ? count : 1, sizeof(long long));
    if (batch->paths == NULL || batch->sizes == NULL) {
        batch_release(batch);
        return (Batch *)PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        char *data;
        Py_ssize_t length;
        if (!PyBytes_Check(item) || PyBytes_AsStringAndSize(item, &data, &length) != 0 ||
            (Py_ssize_t)strlen(data) != length) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "path %zd is not bytes without NUL", i);
            batch_release(batch);
            return NULL;
        }
        batch->paths[i] = malloc(length + 1);
        if (batch->paths[i] == NULL) {
            batch_release(batch);
            return (Batch *)PyErr_NoMemory();
        }
        memcpy(batch->paths[i], data, length + 1);
        batch->count = i + 1; /* what batch_release frees */
    }
    return batch;
}

static PyObject *Sizes_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *paths;
    int max_live;
    static char *names[] = {"paths", "max_live", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Oi", names, &paths, &max_live)) return NULL;
    PyObject *seq = PySequence_Fast(paths, "paths must be a sequence of bytes");
    if (seq == NULL) return NULL;
    Batch *batch = new_batch(seq);
    Py_DECREF(seq);
    if (batch == NULL) return NULL;
    if (__atomic_add_fetch(&live_threads, 1, __ATOMIC_ACQ_REL) > max_live) {
        __atomic_sub_fetch(&live_threads, 1, __ATOMIC_ACQ_REL);
        batch_release(batch);
        PyErr_Format(PyExc_BlockingIOError, "%d existence checks are still running", max_live);
        return NULL;
    }
    Sizes *self = (Sizes *)type->tp_alloc(type, 0);
    if (self == NULL) {
        __atomic_sub_fetch(&live_threads, 1, __ATOMIC_ACQ_REL);
        batch_release(batch);
        return NULL;
    }
    batch->refs = 2;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, PTHREAD_STACK_MIN > 65536 ? PTHREAD_STACK_MIN : 65536);
    /* The thread takes no signal: they stay with the process's own threads. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_t thread;
    int error = pthread_create(&thread, &attr, run, batch);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (error != 0) {
        __atomic_sub_fetch(&live_threads, 1, __ATOMIC_ACQ_REL);
        batch->refs = 1;
        self->batch = batch; /* freed by the object's dealloc */
        Py_DECREF(self);
        errno = error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    self->batch = batch;
    return (PyObject *)self;
}

static void Sizes_dealloc(Sizes *self) {
    if (self->batch != NULL) batch_release(self->batch);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Sizes_done(Sizes *self, PyObject *unused) {
    return PyBool_FromLong(__atomic_load_n(&self->batch->done, __ATOMIC_ACQUIRE));
}

static PyObject *Sizes_sizes(Sizes *self, PyObject *unused) {
    Batch *batch = self->batch;
    if (!__atomic_load_n(&batch->done, __ATOMIC_ACQUIRE)) {
        PyErr_SetString(PyExc_RuntimeError, "the stat() calls are still running");
        return NULL;
    }
    PyObject *list = PyList_New(batch->count);
    if (list == NULL) return NULL;
    for (Py_ssize_t i = 0; i < batch->count; i++) {
        PyObject *size = PyLong_FromLongLong(batch->sizes[i]);
        if (size == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, size);
    }
    return list;
}

static PyMethodDef Sizes_methods[] = {
    {"done", (PyCFunction)Sizes_done, METH_NOARGS, "done(): every stat() has returned."},
    {"sizes", (PyCFunction)Sizes_sizes, METH_NOARGS, "sizes(): each path's size, -1 where stat() failed."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SizesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier._native.stat_batch.Sizes",
    .tp_basicsize = sizeof(Sizes),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Sizes(paths, max_live): stat() each path on a thread of its own, without the GIL.",
    .tp_new = Sizes_new,
    .tp_dealloc = (destructor)Sizes_dealloc,
    .tp_methods = Sizes_methods,
};

static PyObject *live(PyObject *self, PyObject *unused) {
    return PyLong_FromLong(__atomic_load_n(&live_threads, __ATOMIC_ACQUIRE));
}

static PyMethodDef methods[] = {
    {"live", live, METH_NOARGS, "live(): the stat() threads running now."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "stat_batch", NULL, -1, methods};

PyMODINIT_FUNC PyInit_stat_batch(void) {
    if (PyType_Ready(&SizesType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&SizesType);
    if (PyModule_AddObject(m, "Sizes", (PyObject *)&SizesType) < 0) {
        Py_DECREF(&SizesType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
