/* GIL-free copies between the engine's KV cache and host slots.
 *
 * copy(dst_addrs, src_addrs, lengths): three int64 buffers of equal length.
 *   Each run i copies lengths[i] bytes from src_addrs[i] to dst_addrs[i]. Any
 *   length is allowed (no vector-width truncation).
 *
 * copy_blocks(segments, block_ids, slot_ids, host_address, slot_bytes, num_blocks,
 *             num_slots, to_host): moves block_ids[i] <-> slot_ids[i] with no run
 *   list planned beforehand. segments holds int64 rows (device_address, stride,
 *   slot_offset, nbytes): segment row r of block b is at device_address + b * stride,
 *   and of slot s at host_address + s * slot_bytes + slot_offset. Ids are checked
 *   against num_blocks and num_slots before any byte moves; runs that continue on
 *   both sides are merged into one memcpy. Returns the bytes copied.
 *
 * The caller guarantees that every address is valid for the whole call and that
 * runs do not overlap.
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

static PyObject *copy_blocks(PyObject *self, PyObject *args) {
    Py_buffer seg, blk, slt;
    long long host, slot_bytes, num_blocks, num_slots;
    int to_host;
    if (!PyArg_ParseTuple(args, "y*y*y*LLLLp", &seg, &blk, &slt, &host, &slot_bytes, &num_blocks, &num_slots,
                          &to_host))
        return NULL;
    PyObject *result = NULL;
    if (seg.len % 32 != 0 || blk.len % 8 != 0 || blk.len != slt.len) {
        PyErr_SetString(PyExc_ValueError,
                        "copy_blocks: segments must be int64 rows of 4, block and slot ids int64 of equal length");
        goto done;
    }
    Py_ssize_t n_seg = seg.len / 32, n = blk.len / 8;
    const int64_t *rows = (const int64_t *)seg.buf, *b = (const int64_t *)blk.buf, *s = (const int64_t *)slt.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (b[i] < 0 || b[i] >= num_blocks || s[i] < 0 || s[i] >= num_slots) {
            PyErr_Format(PyExc_ValueError, "copy_blocks: block id %lld or slot id %lld out of range [0, %lld) / [0, %lld)",
                         (long long)b[i], (long long)s[i], num_blocks, num_slots);
            goto done;
        }
    }
    long long copied = 0;
    Py_BEGIN_ALLOW_THREADS
    char *run_dst = NULL;
    const char *run_src = NULL;
    size_t run_len = 0;
    for (Py_ssize_t r = 0; r < n_seg; r++) {
        const int64_t base = rows[4 * r], stride = rows[4 * r + 1], offset = rows[4 * r + 2], nbytes = rows[4 * r + 3];
        for (Py_ssize_t i = 0; i < n; i++) {
            char *device = (char *)(uintptr_t)(base + b[i] * stride);
            char *slot = (char *)(uintptr_t)(host + s[i] * slot_bytes + offset);
            char *d = to_host ? slot : device;
            const char *src = to_host ? device : slot;
            if (run_len && run_dst + run_len == d && run_src + run_len == src) {
                run_len += (size_t)nbytes;  // continues the pending run on both sides
                continue;
            }
            if (run_len) memcpy(run_dst, run_src, run_len);
            run_dst = d, run_src = src, run_len = (size_t)nbytes;
        }
        copied += (long long)nbytes * n;
    }
    if (run_len) memcpy(run_dst, run_src, run_len);
    Py_END_ALLOW_THREADS
    result = PyLong_FromLongLong(copied);
done:
    PyBuffer_Release(&seg);
    PyBuffer_Release(&blk);
    PyBuffer_Release(&slt);
    return result;
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS, "copy(dst_addrs, src_addrs, lengths): memcpy each run, GIL released."},
    {"copy_blocks", copy_blocks, METH_VARARGS,
     "copy_blocks(segments, block_ids, slot_ids, host_address, slot_bytes, num_blocks, num_slots, to_host) -> bytes "
     "copied: move blocks <-> host slots, GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "copy_runs", NULL, -1, methods};

PyMODINIT_FUNC PyInit_copy_runs(void) { return PyModule_Create(&module); }
