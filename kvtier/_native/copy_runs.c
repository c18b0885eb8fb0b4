/* GIL-free copies between the engine's KV cache and host slots.
 *
 * Every id, address and length buffer must be a buffer of int64 (its format is
 * checked: an int32 array is refused, never read as half as many int64).
 *
 * copy(dst_addrs, src_addrs, lengths): three int64 buffers of equal length.
 *   Each run i copies lengths[i] bytes from src_addrs[i] to dst_addrs[i]. Any
 *   length is allowed (no vector-width truncation).
 *
 * copy_blocks(segments, block_ids, slot_ids, host_address, slot_bytes, num_blocks,
 *             num_slots, to_host[, slot_pitch[, sums]]): moves block_ids[i] <-> slot_ids[i] with no run
 *   list planned beforehand. segments holds int64 rows (device_address, stride,
 *   slot_offset, nbytes): segment row r of block b is at device_address + b * stride,
 *   and of slot s at host_address + s * slot_pitch + slot_offset (slot_pitch, at least
 *   slot_bytes, defaults to it: slots back to back). Ids are checked
 *   against num_blocks and num_slots, and every segment row against slot_bytes (no
 *   negative length or offset, no run past a slot's end), before any byte moves; runs that continue on
 *   both sides are merged into one memcpy. Returns the bytes copied.
 *   With sums (an int64 buffer of one item per block, or None), the copy also leaves
 *   in sums[i] the xxh3-64 of slot_ids[i]'s bytes (the entry checksum, kvtier.common.entry):
 *   of the bytes it copies, each piece hashed just before its copy, which then reads
 *   it from cache and writes it with stores that bypass the cache (rather than the
 *   I/O process reading every slot again). The segments must then tile the slot, in
 *   order, from offset 0.
 *
 * The caller guarantees that every address is valid for the whole call and that
 * runs do not overlap.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* third_party/xxhash: the same xxh3 as the xxhash package that checks entries. On x86-64 its
 * dispatcher picks the widest vectors the CPU has (AVX2 hashed twice as fast as SSE2 here). */
#define XXH_INLINE_ALL
#include "xxhash.h"
#if defined(__x86_64__) || defined(_M_X64)
#include "xxh_x86dispatch.h"
#include <emmintrin.h>
#endif

/* memcpy whose stores bypass the cache (SSE2 non-temporal stores, in every x86-64): a piece is
 * hashed first, which brings its source into cache, and then written once to memory, where a
 * plain memcpy would first read each destination line in. Measured here on 1 GiB in 64 KiB
 * pieces, one thread: hash then this, 10.8 to 11.5 GB/s; memcpy then hash of the copy, 9.4 to
 * 10.2 GB/s (a plain memcpy of the whole GiB: 12.2 GB/s). The stores are weakly ordered: the
 * caller fences (stream_fence) before anyone may read the destination. */
static void copy_stream(char *dst, const char *src, size_t n) {
#if defined(__x86_64__) || defined(_M_X64)
    size_t head = (size_t)(-(uintptr_t)dst & 15);
    if (head > n) head = n;
    memcpy(dst, src, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i)), b = _mm_loadu_si128((const __m128i *)(src + i + 16)),
                c = _mm_loadu_si128((const __m128i *)(src + i + 32)), d = _mm_loadu_si128((const __m128i *)(src + i + 48));
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

static void stream_fence(void) {
#if defined(__x86_64__) || defined(_M_X64)
    _mm_sfence();
#endif
}

/* A C-contiguous buffer of int64 from obj, or -1 with ValueError naming it. */
static int int64_buffer(PyObject *obj, Py_buffer *view, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (view->itemsize != 8 || !(strcmp(f, "q") == 0 || strcmp(f, "l") == 0)) {
        PyErr_Format(PyExc_ValueError, "%s must be an int64 buffer, not format '%s' of %zd-byte items", what,
                     view->format ? view->format : "B", view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *copy(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj, *len_obj;
    Py_buffer dst = {0}, src = {0}, len = {0};
    if (!PyArg_ParseTuple(args, "OOO", &dst_obj, &src_obj, &len_obj)) return NULL;
    PyObject *result = NULL;
    if (int64_buffer(dst_obj, &dst, "copy: dst") || int64_buffer(src_obj, &src, "copy: src") ||
        int64_buffer(len_obj, &len, "copy: lengths"))
        goto done;
    if (dst.len != src.len || dst.len != len.len) {
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
    if (dst.obj) PyBuffer_Release(&dst);
    if (src.obj) PyBuffer_Release(&src);
    if (len.obj) PyBuffer_Release(&len);
    return result;
}

static PyObject *copy_blocks(PyObject *self, PyObject *args) {
    PyObject *seg_obj, *blk_obj, *slt_obj;
    Py_buffer seg = {0}, blk = {0}, slt = {0};
    PyObject *sum_obj = Py_None;
    Py_buffer sum = {0};
    XXH3_state_t *state = NULL;
    long long host, slot_bytes, num_blocks, num_slots, slot_pitch = -1;
    int to_host;
    if (!PyArg_ParseTuple(args, "OOOLLLLp|LO", &seg_obj, &blk_obj, &slt_obj, &host, &slot_bytes, &num_blocks,
                          &num_slots, &to_host, &slot_pitch, &sum_obj))
        return NULL;
    if (slot_pitch == -1) slot_pitch = slot_bytes;
    PyObject *result = NULL;
    if (int64_buffer(seg_obj, &seg, "copy_blocks: segments") || int64_buffer(blk_obj, &blk, "copy_blocks: block ids") ||
        int64_buffer(slt_obj, &slt, "copy_blocks: slot ids"))
        goto done;
    if (sum_obj != Py_None) {
        if (PyObject_GetBuffer(sum_obj, &sum, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) != 0) goto done;
        const char *f = sum.format ? sum.format : "B";
        if (*f == '<' || *f == '=' || *f == '@') f++;
        if (sum.itemsize != 8 || *f == 0 || !strchr("qlQL", *f) || f[1] != 0 || sum.len != blk.len) {
            PyErr_SetString(PyExc_ValueError, "copy_blocks: sums must be a writable 64-bit buffer of one item per "
                                              "block");
            goto done;
        }
        state = XXH3_createState();
        if (state == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    if (seg.len % 32 != 0 || blk.len != slt.len || slot_bytes <= 0 || slot_pitch < slot_bytes) {
        PyErr_SetString(PyExc_ValueError,
                        "copy_blocks: segments must be int64 rows of 4, block and slot ids of equal length, "
                        "slot_bytes > 0, slot_pitch >= slot_bytes");
        goto done;
    }
    Py_ssize_t n_seg = seg.len / 32, n = blk.len / 8;
    const int64_t *rows = (const int64_t *)seg.buf, *b = (const int64_t *)blk.buf, *s = (const int64_t *)slt.buf;
    for (Py_ssize_t r = 0; r < n_seg; r++) {
        const int64_t stride = rows[4 * r + 1], offset = rows[4 * r + 2], nbytes = rows[4 * r + 3];
        if (stride < 0 || offset < 0 || nbytes < 0 || offset > slot_bytes || nbytes > slot_bytes - offset) {
            PyErr_Format(PyExc_ValueError,
                         "copy_blocks: segment %zd (stride %lld, slot offset %lld, %lld bytes) does not fit a slot "
                         "of %lld bytes", r, (long long)stride, (long long)offset, (long long)nbytes, slot_bytes);
            goto done;
        }
    }
    if (state != NULL) {  /* a checksum covers the whole slot: the segments must write every byte, in order */
        long long end = 0;
        for (Py_ssize_t r = 0; r < n_seg; r++) {
            if (rows[4 * r + 2] != end) break;
            end += rows[4 * r + 3];
        }
        if (end != slot_bytes) {
            PyErr_SetString(PyExc_ValueError, "copy_blocks: sums need segments that tile the slot in order");
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (b[i] < 0 || b[i] >= num_blocks || s[i] < 0 || s[i] >= num_slots) {
            PyErr_Format(PyExc_ValueError, "copy_blocks: block id %lld or slot id %lld out of range [0, %lld) / [0, %lld)",
                         (long long)b[i], (long long)s[i], num_blocks, num_slots);
            goto done;
        }
    }
    long long copied = 0;
    if (state != NULL) {
        int64_t *out = (int64_t *)sum.buf;
        Py_BEGIN_ALLOW_THREADS
        /* Block by block, each slot in order. Each piece is hashed just before it is copied, so the
         * copy reads its source from cache. To the host the hash is of the device's bytes, which
         * the engine does not change while they are stored; were a piece changed between its hash
         * and its copy, the entry's checksum would not match it, and its load would be a miss. */
        for (Py_ssize_t i = 0; i < n; i++) {
            XXH3_64bits_reset(state);
            for (Py_ssize_t r = 0; r < n_seg; r++) {
                const int64_t base = rows[4 * r], stride = rows[4 * r + 1], offset = rows[4 * r + 2];
                const size_t nbytes = (size_t)rows[4 * r + 3];
                char *slot = (char *)(uintptr_t)(host + s[i] * slot_pitch + offset);
                char *device = (char *)(uintptr_t)(base + b[i] * stride);
                if (to_host) {
                    XXH3_64bits_update(state, device, nbytes);
                    copy_stream(slot, device, nbytes);
                } else {
                    XXH3_64bits_update(state, slot, nbytes);
                    copy_stream(device, slot, nbytes);
                }
            }
            out[i] = (int64_t)XXH3_64bits_digest(state);
        }
        stream_fence();  /* every store above is visible before the caller reports the copy done */
        Py_END_ALLOW_THREADS
        copied = slot_bytes * (long long)n;
        result = PyLong_FromLongLong(copied);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    char *run_dst = NULL;
    const char *run_src = NULL;
    size_t run_len = 0;
    for (Py_ssize_t r = 0; r < n_seg; r++) {
        const int64_t base = rows[4 * r], stride = rows[4 * r + 1], offset = rows[4 * r + 2], nbytes = rows[4 * r + 3];
        for (Py_ssize_t i = 0; i < n; i++) {
            char *device = (char *)(uintptr_t)(base + b[i] * stride);
            char *slot = (char *)(uintptr_t)(host + s[i] * slot_pitch + offset);
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
    if (seg.obj) PyBuffer_Release(&seg);
    if (blk.obj) PyBuffer_Release(&blk);
    if (slt.obj) PyBuffer_Release(&slt);
    if (sum.obj) PyBuffer_Release(&sum);
    if (state != NULL) XXH3_freeState(state);
    return result;
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS, "copy(dst_addrs, src_addrs, lengths): memcpy each run, GIL released."},
    {"copy_blocks", copy_blocks, METH_VARARGS,
     "copy_blocks(segments, block_ids, slot_ids, host_address, slot_bytes, num_blocks, num_slots, to_host[, slot_pitch"
     "[, sums]]) -> bytes copied: move blocks <-> host slots, GIL released; sums: each slot's xxh3-64."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "copy_runs", NULL, -1, methods};

PyMODINIT_FUNC PyInit_copy_runs(void) { return PyModule_Create(&module); }
