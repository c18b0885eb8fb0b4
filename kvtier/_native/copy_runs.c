/* Copies a batch of byte runs between raw addresses without holding the GIL.
 *
 * copy(dst_addrs, src_addrs, lengths): three int64 buffers of equal length.
 * Each run i copies lengths[i] bytes from src_addrs[i] to dst_addrs[i]. Any
 * length is allowed (no vector-width truncation). The caller guarantees that
 * every address is valid for the whole call and that runs do not overlap.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyObject *copy(PyObject *self, PyObject *args) {
    Py_buffer dst, src, len;
    if (!PyArg_ParseTuple(args, "y*y*y*", &dst, &src, &len)) return NULL;
    PyObject *result = NULL;
    if (dst.len != src.len || dst.len != len.len || dst.len % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "copy: dst, src and lengths must be int64 buffers of equal size");
        goto done;
    }
    Py_ssize_t n = dst.len / 8;
    const int64_t *d = (const int64_t *)dst.buf, *s = (const int64_t *)src.buf, *l = (const int64_t *)len.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (l[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "copy: negative length");
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) memcpy((void *)(uintptr_t)d[i], (const void *)(uintptr_t)s[i], (size_t)l[i]);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&len);
    return result;
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS, "copy(dst_addrs, src_addrs, lengths): memcpy each run, GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "copy_runs", NULL, -1, methods};

PyMODINIT_FUNC PyInit_copy_runs(void) { return PyModule_Create(&module); }
