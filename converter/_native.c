/* converter._native: the compiled loops of the converter (optional; see converter/native.py).
 *
 * Built by the package's build hook (hatch_build.py) when a C compiler is present; without
 * it converter/native.py reports why and every caller uses its NumPy twin, which stays the
 * reference the tests compare these loops with, bit for bit:
 *
 *   pack_codes   converter.marlin.layout.pack_b_numpy             uint8 codes -> Marlin B
 *   pack_gptq4   converter.marlin.layout.pack_b_from_gptq4_numpy  GPTQ 4-bit words -> B
 *   unpack_b     converter.marlin.layout.unpack_b_numpy           B -> uint8 codes
 *   unpack_rows  converter.formats.packing.unpack_words (axis 0)   2/4/8-bit words -> codes
 *   unpack_cols  converter.formats.packing.unpack_words (axis 1)   2/4/8-bit words -> codes
 *   diff_rows    converter.formats.packing.first_code_diff_numpy  words vs codes: first difference
 *   gemv8        converter.numerics (its NumPy path)                x @ W from codes, no fp32 W
 *   first_diff   numpy.array_equal on bytes                       first differing byte
 *
 * Every function takes contiguous buffers and sizes the Python wrappers have checked, checks
 * the buffer lengths again (a wrong call raises ValueError instead of reading out of
 * bounds), and releases the GIL for the loop, so two threads run two calls on two cores.
 * The loops are compiled three times on x86-64, for the baseline, AVX2+FMA and AVX-512
 * (whose build only gemv8 uses), and the CPU picks when the module loads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Bumped whenever a signature or a result changes, so that converter/native.py can refuse
 * a stale build left in an editable checkout. */
#define ABI_VERSION 3
/* Rows per block in gemv8.  The block's rows are read as BLOCK_ROWS streams of 64 bytes at
 * a time; measured on 4096 x 14336 (AVX-512): 16 rows 7.3, 32 rows 7.8, 64 rows 5.8 and
 * 128 rows 4.1 G weights/s (more streams than the prefetchers follow). */
#define BLOCK_ROWS 32

#if !defined(__GNUC__)
#error "converter._native needs GCC or Clang (vector extensions); the NumPy code is used instead"
#endif

#define SUFFIX _base
#define KERNEL_ATTR
#define KERNEL_AVX2 0
#define KERNEL_AVX512 0
#define VW 8
#include "_native_kernels.h"
#undef SUFFIX
#undef KERNEL_ATTR
#undef KERNEL_AVX2
#undef KERNEL_AVX512
#undef VW

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_AVX2_BUILD 1
#define SUFFIX _avx2
#define KERNEL_ATTR __attribute__((target("avx2,fma")))
#define KERNEL_AVX2 1
#define KERNEL_AVX512 0
#define VW 8
#include "_native_kernels.h"
#undef SUFFIX
#undef KERNEL_ATTR
#undef KERNEL_AVX512
#undef VW
#define SUFFIX _avx512
#define KERNEL_ATTR __attribute__((target("avx512f,avx2,fma")))
#define KERNEL_AVX512 1
#define VW 16
#include "_native_kernels.h"
#undef SUFFIX
#undef KERNEL_ATTR
#undef KERNEL_AVX2
#undef KERNEL_AVX512
#undef VW
#endif

typedef void (*rows_fn)(const uint32_t *, uint8_t *, Py_ssize_t, int, Py_ssize_t, Py_ssize_t);
typedef Py_ssize_t (*diff_fn)(const uint32_t *, const uint8_t *, Py_ssize_t, int, Py_ssize_t, Py_ssize_t);
typedef void (*gemv_fn)(const float *, const float *, const uint8_t *, Py_ssize_t, Py_ssize_t, Py_ssize_t,
                        const float *, const float *, float, const float *, int, float *, Py_ssize_t, Py_ssize_t);

static struct {
    void (*pack_codes)(const uint8_t *, uint32_t *, Py_ssize_t, Py_ssize_t, Py_ssize_t);
    void (*pack_gptq4)(const uint32_t *, uint32_t *, Py_ssize_t, Py_ssize_t, Py_ssize_t);
    void (*unpack_b)(const uint32_t *, uint8_t *, Py_ssize_t, Py_ssize_t, Py_ssize_t);
    rows_fn unpack_rows;
    rows_fn unpack_cols;
    diff_fn diff_rows;
    gemv_fn gemv8;
    const char *isa;
} K;

static void pick_kernels(void) {
    K.pack_codes = pack_codes_base;
    K.pack_gptq4 = pack_gptq4_base;
    K.unpack_b = unpack_b_base;
    K.unpack_rows = unpack_rows_base;
    K.unpack_cols = unpack_cols_base;
    K.diff_rows = diff_rows_base;
    K.gemv8 = gemv8_base;
    K.isa = "baseline";
#ifdef HAVE_AVX2_BUILD
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        K.pack_codes = pack_codes_avx2;
        K.pack_gptq4 = pack_gptq4_avx2;
        K.unpack_b = unpack_b_avx2;
        K.unpack_rows = unpack_rows_avx2;
        K.unpack_cols = unpack_cols_avx2;
        K.diff_rows = diff_rows_avx2;
        K.gemv8 = gemv8_avx2;
        K.isa = "avx2";
        /* Only the numerics loop is FMA-bound enough to gain from 16 lanes. */
        if (__builtin_cpu_supports("avx512f")) {
            K.gemv8 = gemv8_avx512;
            K.isa = "avx512";
        }
    }
#endif
}

/* -- argument helpers ------------------------------------------------------------------ */

static int need_len(const Py_buffer *buf, Py_ssize_t want, const char *what) {
    if (buf->len != want) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %zd", what, buf->len, want);
        return 0;
    }
    return 1;
}

static int tile_shape(Py_ssize_t size_k, Py_ssize_t size_n) {
    if (size_k < 0 || size_n < 0 || size_k % 16 || size_n % 64) {
        PyErr_Format(PyExc_ValueError, "shape (%zd, %zd): need size_k %% 16 == 0 and size_n %% 64 == 0", size_k,
                     size_n);
        return 0;
    }
    return 1;
}

/* pack_codes(q, out, size_k, size_n): q uint8 [K*N] (codes in [0, 15]), out int32
 * [K/16 * 2N] (written).  ValueError, and out untouched, when a code is above 15. */
static PyObject *py_pack_codes(PyObject *self, PyObject *args) {
    Py_buffer q, out;
    Py_ssize_t size_k, size_n;
    if (!PyArg_ParseTuple(args, "y*w*nn", &q, &out, &size_k, &size_n)) return NULL;
    PyObject *res = NULL;
    if (tile_shape(size_k, size_n) && need_len(&q, size_k * size_n, "codes") &&
        need_len(&out, size_k * size_n / 2, "B")) {
        unsigned high = 0;
        Py_BEGIN_ALLOW_THREADS
        const uint8_t *c = (const uint8_t *)q.buf;
        uint8_t any = 0;
        for (Py_ssize_t i = 0; i < q.len; i++) any |= c[i];
        if (any > 15) {
            for (Py_ssize_t i = 0; i < q.len; i++) high = c[i] > high ? c[i] : high;
        } else {
            K.pack_codes(c, (uint32_t *)out.buf, size_n, 0, size_k / 16);
        }
        Py_END_ALLOW_THREADS
        if (high)
            PyErr_Format(PyExc_ValueError, "codes must be in [0, 15], found %u", high);
        else
            res = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&q);
    PyBuffer_Release(&out);
    return res;
}

/* pack_gptq4(words, out, size_k, size_n): words uint32 [K/8 * N], out int32 [K/16 * 2N]. */
static PyObject *py_pack_gptq4(PyObject *self, PyObject *args) {
    Py_buffer w, out;
    Py_ssize_t size_k, size_n;
    if (!PyArg_ParseTuple(args, "y*w*nn", &w, &out, &size_k, &size_n)) return NULL;
    PyObject *res = NULL;
    if (tile_shape(size_k, size_n) && need_len(&w, size_k / 2 * size_n, "qweight") &&
        need_len(&out, size_k * size_n / 2, "B")) {
        Py_BEGIN_ALLOW_THREADS
        K.pack_gptq4((const uint32_t *)w.buf, (uint32_t *)out.buf, size_n, 0, size_k / 16);
        Py_END_ALLOW_THREADS
        res = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&w);
    PyBuffer_Release(&out);
    return res;
}

/* unpack_b(b, out, size_k, size_n): b int32 [K/16 * 2N], out uint8 [K*N] (written). */
static PyObject *py_unpack_b(PyObject *self, PyObject *args) {
    Py_buffer b, out;
    Py_ssize_t size_k, size_n;
    if (!PyArg_ParseTuple(args, "y*w*nn", &b, &out, &size_k, &size_n)) return NULL;
    PyObject *res = NULL;
    if (tile_shape(size_k, size_n) && need_len(&b, size_k * size_n / 2, "B") &&
        need_len(&out, size_k * size_n, "codes")) {
        Py_BEGIN_ALLOW_THREADS
        K.unpack_b((const uint32_t *)b.buf, (uint8_t *)out.buf, size_n, 0, size_k / 16);
        Py_END_ALLOW_THREADS
        res = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&b);
    PyBuffer_Release(&out);
    return res;
}

/* The checks shared by the word <-> code entry points: bits 2, 4 or 8, sizes >= 0, and
 * buffers of rows * n 32-bit words and rows * n * 32/bits codes.  Sets the Python error
 * and returns 0 when one fails. */
static int words_and_codes(int bits, Py_ssize_t rows, Py_ssize_t n, Py_buffer *w, Py_buffer *q) {
    if (bits != 2 && bits != 4 && bits != 8) {
        PyErr_Format(PyExc_ValueError, "bits must be 2, 4 or 8, got %d", bits);
        return 0;
    }
    if (rows < 0 || n < 0) {
        PyErr_SetString(PyExc_ValueError, "negative size");
        return 0;
    }
    return need_len(w, rows * n * 4, "words") && need_len(q, rows * (32 / bits) * n, "codes");
}

/* unpack_rows and unpack_cols: (words, out, rows, n, bits), n words per row. */
static PyObject *unpack_with(rows_fn fn, PyObject *args) {
    Py_buffer w, out;
    Py_ssize_t rows, n;
    int bits;
    if (!PyArg_ParseTuple(args, "y*w*nni", &w, &out, &rows, &n, &bits)) return NULL;
    PyObject *res = NULL;
    if (words_and_codes(bits, rows, n, &w, &out)) {
        Py_BEGIN_ALLOW_THREADS
        fn((const uint32_t *)w.buf, (uint8_t *)out.buf, n, bits, 0, rows);
        Py_END_ALLOW_THREADS
        res = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&w);
    PyBuffer_Release(&out);
    return res;
}

/* unpack_rows(words, out, rows, size_n, bits): words uint32 [rows * N], out uint8
 * [rows * 32/bits * N]. */
static PyObject *py_unpack_rows(PyObject *self, PyObject *args) { return unpack_with(K.unpack_rows, args); }

/* unpack_cols(words, out, rows, n_words, bits): words uint32 [rows * W], out uint8
 * [rows * W * 32/bits], unpacked along each row. */
static PyObject *py_unpack_cols(PyObject *self, PyObject *args) { return unpack_with(K.unpack_cols, args); }

/* diff_rows(words, codes, rows, size_n, bits) -> the flat index into codes of the first
 * code that differs from unpack_rows(words), or -1: words uint32 [rows * N], codes uint8
 * [rows * 32/bits * N].  marlin-verify compares a source's qweight with the artifact's
 * unpacked codes this way, without unpacking the source. */
static PyObject *py_diff_rows(PyObject *self, PyObject *args) {
    Py_buffer w, q;
    Py_ssize_t rows, size_n;
    int bits;
    if (!PyArg_ParseTuple(args, "y*y*nni", &w, &q, &rows, &size_n, &bits)) return NULL;
    PyObject *res = NULL;
    if (words_and_codes(bits, rows, size_n, &w, &q)) {
        Py_ssize_t at;
        Py_BEGIN_ALLOW_THREADS
        at = K.diff_rows((const uint32_t *)w.buf, (const uint8_t *)q.buf, size_n, bits, 0, rows);
        Py_END_ALLOW_THREADS
        res = PyLong_FromSsize_t(at);
    }
    PyBuffer_Release(&w);
    PyBuffer_Release(&q);
    return res;
}

/* gemv8(xt, q, y, rows, size_n, group, a, c, c0, b, factored, n0, n1):
 *   xt f32 [rows * 8] (x transposed), q uint8 [rows * N], y f32 [8 * N] (accumulated),
 *   a f32 [G * N], c and b f32 [G * N] or None, G = ceil(rows / group); columns [n0, n1),
 *   multiples of 64.  See the kernel for what is computed. */
static PyObject *py_gemv8(PyObject *self, PyObject *args) {
    Py_buffer xt, q, y, a, c = {0}, b = {0};
    PyObject *c_obj, *b_obj;
    Py_ssize_t rows, size_n, group, n0, n1;
    float c0;
    int factored;
    if (!PyArg_ParseTuple(args, "y*y*w*nnny*OfOpnn", &xt, &q, &y, &rows, &size_n, &group, &a, &c_obj, &c0, &b_obj,
                          &factored, &n0, &n1))
        return NULL;
    PyObject *res = NULL;
    int have_c = 0, have_b = 0;
    float *xs = NULL;
    if (c_obj != Py_None) {
        if (PyObject_GetBuffer(c_obj, &c, PyBUF_SIMPLE) < 0) goto done;
        have_c = 1;
    }
    if (b_obj != Py_None) {
        if (PyObject_GetBuffer(b_obj, &b, PyBUF_SIMPLE) < 0) goto done;
        have_b = 1;
    }
    if (rows < 0 || size_n < 0 || group <= 0 || n0 < 0 || n1 > size_n || n0 > n1 || n0 % 64 || n1 % 64) {
        PyErr_SetString(PyExc_ValueError, "gemv8: bad rows, group or column range");
        goto done;
    }
    const Py_ssize_t groups = rows ? (rows + group - 1) / group : 0;
    const Py_ssize_t param = groups * size_n * 4;
    if (!need_len(&xt, rows * 8 * 4, "x") || !need_len(&q, rows * size_n, "codes") ||
        !need_len(&y, 8 * size_n * 4, "y") || !need_len(&a, param, "a") || (have_c && !need_len(&c, param, "c")) ||
        (have_b && !need_len(&b, param, "b")))
        goto done;
    /* Row sums of x per block of at most BLOCK_ROWS rows inside each group, in the
     * kernel's block order. */
    Py_ssize_t blocks = 0;
    for (Py_ssize_t g0 = 0; g0 < rows; g0 += group) {
        const Py_ssize_t len = g0 + group < rows ? group : rows - g0;
        blocks += (len + BLOCK_ROWS - 1) / BLOCK_ROWS;
    }
    xs = (float *)calloc((size_t)(blocks ? blocks : 1) * 8, sizeof(float));
    if (!xs) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS {
        const float *x = (const float *)xt.buf;
        Py_ssize_t blk = 0;
        for (Py_ssize_t g0 = 0; g0 < rows; g0 += group) {
            const Py_ssize_t g1 = g0 + group < rows ? g0 + group : rows;
            for (Py_ssize_t s0 = g0; s0 < g1; s0 += BLOCK_ROWS, blk++) {
                const Py_ssize_t s1 = s0 + BLOCK_ROWS < g1 ? s0 + BLOCK_ROWS : g1;
                for (Py_ssize_t r = s0; r < s1; r++)
                    for (int m = 0; m < 8; m++) xs[8 * blk + m] += x[8 * r + m];
            }
        }
        K.gemv8(x, xs, (const uint8_t *)q.buf, rows, size_n, group, (const float *)a.buf,
                have_c ? (const float *)c.buf : NULL, c0, have_b ? (const float *)b.buf : NULL, factored,
                (float *)y.buf, n0, n1);
    }
    Py_END_ALLOW_THREADS
    res = Py_NewRef(Py_None);
done:
    free(xs);
    PyBuffer_Release(&xt);
    PyBuffer_Release(&q);
    PyBuffer_Release(&y);
    PyBuffer_Release(&a);
    if (have_c) PyBuffer_Release(&c);
    if (have_b) PyBuffer_Release(&b);
    return res;
}

/* first_diff(a, b) -> index of the first differing byte, or -1 (equal lengths required). */
static PyObject *py_first_diff(PyObject *self, PyObject *args) {
    Py_buffer a, b;
    if (!PyArg_ParseTuple(args, "y*y*", &a, &b)) return NULL;
    PyObject *res = NULL;
    if (a.len != b.len) {
        PyErr_Format(PyExc_ValueError, "first_diff: lengths %zd and %zd differ", a.len, b.len);
    } else {
        Py_ssize_t at = -1;
        Py_BEGIN_ALLOW_THREADS {
            const unsigned char *pa = (const unsigned char *)a.buf, *pb = (const unsigned char *)b.buf;
            const Py_ssize_t step = 1 << 16;
            for (Py_ssize_t i = 0; i < a.len && at < 0; i += step) {
                const Py_ssize_t n = a.len - i < step ? a.len - i : step;
                if (memcmp(pa + i, pb + i, (size_t)n)) {
                    for (Py_ssize_t k = i; k < i + n; k++)
                        if (pa[k] != pb[k]) {
                            at = k;
                            break;
                        }
                }
            }
        }
        Py_END_ALLOW_THREADS
        res = PyLong_FromSsize_t(at);
    }
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return res;
}

static PyMethodDef methods[] = {
    {"pack_codes", py_pack_codes, METH_VARARGS, "pack_codes(q, out, size_k, size_n): uint8 codes -> Marlin B"},
    {"pack_gptq4", py_pack_gptq4, METH_VARARGS, "pack_gptq4(words, out, size_k, size_n): GPTQ 4-bit words -> B"},
    {"unpack_b", py_unpack_b, METH_VARARGS, "unpack_b(b, out, size_k, size_n): Marlin B -> uint8 codes"},
    {"unpack_rows", py_unpack_rows, METH_VARARGS, "unpack_rows(words, out, rows, size_n, bits): words -> codes"},
    {"unpack_cols", py_unpack_cols, METH_VARARGS, "unpack_cols(words, out, rows, n_words, bits): words -> codes"},
    {"diff_rows", py_diff_rows, METH_VARARGS,
     "diff_rows(words, codes, rows, size_n, bits): first code differing from unpack_rows(words), or -1"},
    {"gemv8", py_gemv8, METH_VARARGS,
     "gemv8(xt, q, y, rows, size_n, group, a, c, c0, b, factored, n0, n1): y += x @ W from codes"},
    {"first_diff", py_first_diff, METH_VARARGS, "first_diff(a, b): index of the first differing byte, or -1"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "The converter's compiled loops.", -1, methods,
                                   NULL,    NULL,    NULL,                             NULL};

PyMODINIT_FUNC PyInit__native(void) {
    pick_kernels();
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "ABI_VERSION", ABI_VERSION) < 0 ||
        PyModule_AddStringConstant(m, "ISA", K.isa) < 0 || PyModule_AddIntConstant(m, "BLOCK_ROWS", BLOCK_ROWS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
