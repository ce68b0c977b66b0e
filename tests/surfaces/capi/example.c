/*
 * example.c - bnbw_native's DirectML operators called from C through include/bnbw_native.h.
 *
 * tests/surfaces/test_capi.py builds this file as the extension module `bnbw_capi_example` and
 * checks what it returns against the float64 reference.  `demo` is the walk-through: strided tensors
 * in malloc'd memory, both operators, no GIL held while they run.  `run` does the same for any
 * layout the test chooses, `errors` collects the status of refused calls, `concurrent` executes
 * one operator from several threads at once.  `training` runs the training forward on raw
 * memory, `training_errors` collects its refusals.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "bnbw_native.h"

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- the walk-through ------------------------------------------------------------------- */

enum { N = 2, C = 3, H = 4, W = 5 };

static float lcg(uint32_t *state)          /* deterministic values in [-1, 1) */
{
    *state = *state * 1664525u + 1013904223u;
    return (float)(*state >> 8) / (float)(1u << 23) - 1.0f;
}

/* Logical NCHW sizes over NHWC memory (strides in elements), statistics per channel. */
static const int64_t big_sizes[4] = {N, C, H, W};
static const int64_t nhwc_strides[4] = {H * W * C, 1, W * C, C};
static const int64_t stat_sizes[4] = {1, C, 1, 1};

static PyObject *demo(PyObject *self, PyObject *unused)
{
    const bnbw_api_table *api = bnbw_api;
    enum { COUNT = N * C * H * W };
    float *x = malloc(COUNT * sizeof(float)), *dy = malloc(COUNT * sizeof(float));
    float *dx[2] = {malloc(COUNT * sizeof(float)), malloc(COUNT * sizeof(float))};
    float mean[C], variance[C], scale[C], dscale[2][C], dbias[2][C];
    bnbw_operator *op[2] = {NULL, NULL};
    bnbw_status status = BNBW_OK;
    PyObject *result = NULL;
    uint32_t seed = 12345;
    int i;

    if (!x || !dy || !dx[0] || !dx[1]) {
        PyErr_NoMemory();
        goto done;
    }
    for (i = 0; i < COUNT; ++i) {
        x[i] = 2.0f + lcg(&seed);
        dy[i] = lcg(&seed);
    }
    for (i = 0; i < C; ++i) {
        mean[i] = 2.0f + 0.1f * lcg(&seed);
        variance[i] = 0.5f + 0.25f * (lcg(&seed) + 1.0f);
        scale[i] = 1.0f + lcg(&seed);
    }

    /* Descriptors: total_tensor_size_in_bytes from calc_buffer_tensor_size, as
     * DMLCalcBufferTensorSize would give it. */
    bnbw_tensor_desc big = {BNBW_DATA_TYPE_FLOAT32, 4, big_sizes, nhwc_strides, 0};
    bnbw_tensor_desc stats = {BNBW_DATA_TYPE_FLOAT32, 4, stat_sizes, NULL, 0};
    if (api->calc_buffer_tensor_size(big.data_type, big.dimension_count, big.sizes, big.strides,
                                     NULL, &big.total_tensor_size_in_bytes) != BNBW_OK
        || api->calc_buffer_tensor_size(stats.data_type, 4, stat_sizes, NULL, NULL,
                                        &stats.total_tensor_size_in_bytes) != BNBW_OK) {
        PyErr_SetString(PyExc_RuntimeError, api->error_message());
        goto done;
    }
    bnbw_batch_normalization_grad_desc desc = {
        &big, &big, &stats, &stats, &stats,     /* input, input_gradient, mean, variance, scale */
        &big, &stats, &stats,                   /* output_gradient, ..._scale_, ..._bias_ */
        1e-3f};

    /* Create and execute without the GIL: the table never touches Python objects. */
    Py_BEGIN_ALLOW_THREADS
    status = api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD, &desc, &op[0]);
    if (status == BNBW_OK)
        status = api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_TRAINING_GRAD, &desc,
                                      &op[1]);
    for (i = 0; i < 2 && status == BNBW_OK; ++i) {
        bnbw_bindings b = {x, dy, mean, variance, scale, dx[i], dscale[i], dbias[i]};
        status = api->execute(op[i], &b, 0);     /* 0 threads: OpenMP's default */
    }
    Py_END_ALLOW_THREADS
    if (status != BNBW_OK) {
        PyErr_Format(PyExc_RuntimeError, "%s: %s", api->status_name(status),
                     api->error_message());
        goto done;
    }
    /* Raw memory back to Python: NHWC bytes for the big tensors. */
    result = Py_BuildValue(
        "{s:y#,s:y#,s:y#,s:y#,s:y#,s:(y#y#y#),s:(y#y#y#),s:s}",
        "x", (const char *)x, (Py_ssize_t)(COUNT * sizeof(float)),
        "dy", (const char *)dy, (Py_ssize_t)(COUNT * sizeof(float)),
        "mean", (const char *)mean, (Py_ssize_t)sizeof mean,
        "variance", (const char *)variance, (Py_ssize_t)sizeof variance,
        "scale", (const char *)scale, (Py_ssize_t)sizeof scale,
        "grad", (const char *)dx[0], (Py_ssize_t)(COUNT * sizeof(float)),
        (const char *)dscale[0], (Py_ssize_t)sizeof dscale[0],
        (const char *)dbias[0], (Py_ssize_t)sizeof dbias[0],
        "training_grad", (const char *)dx[1], (Py_ssize_t)(COUNT * sizeof(float)),
        (const char *)dscale[1], (Py_ssize_t)sizeof dscale[1],
        (const char *)dbias[1], (Py_ssize_t)sizeof dbias[1],
        "version", api->library_version());
done:
    api->destroy_operator(op[0]);
    api->destroy_operator(op[1]);
    free(x);
    free(dy);
    free(dx[0]);
    free(dx[1]);
    return result;
}

/* ---- any layout ---------------------------------------------------------------------------- */

static int read_int64s(PyObject *seq, int64_t *out, uint32_t *count)
{
    Py_ssize_t n, i;
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of ints");
    if (fast == NULL)
        return -1;
    n = PySequence_Fast_GET_SIZE(fast);
    if (n > BNBW_MAX_DIMENSIONS) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "at most 8 dims");
        return -1;
    }
    for (i = 0; i < n; ++i)
        out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
    Py_DECREF(fast);
    *count = (uint32_t)n;
    return PyErr_Occurred() ? -1 : 0;
}

/* run(op_type, data_type, sizes, strides or None, stats_sizes, x, dy, mean, variance, scale,
 *     epsilon, num_threads, in_place) -> (output_gradient, output_scale_gradient,
 *     output_bias_gradient) as raw bytes.  x, dy: the raw memory of the strided big tensors
 * (each at least the minimum size); statistics packed.  Every buffer is malloc'd here. */
static PyObject *run(PyObject *self, PyObject *args)
{
    const bnbw_api_table *api = bnbw_api;
    int op_type, data_type, num_threads, in_place;
    float epsilon;
    PyObject *sizes_obj, *strides_obj, *stat_sizes_obj, *result = NULL;
    Py_buffer in[5];
    int64_t sizes[8], strides[8], ssizes[8];
    uint32_t ndim, sndim, i;
    uint64_t big_min = 0, stat_min = 0;
    void *mem[8] = {NULL};
    bnbw_operator *op = NULL;
    bnbw_status status;

    if (!PyArg_ParseTuple(args, "iiOOOy*y*y*y*y*fii", &op_type, &data_type, &sizes_obj,
                          &strides_obj, &stat_sizes_obj, &in[0], &in[1], &in[2], &in[3],
                          &in[4], &epsilon, &num_threads, &in_place))
        return NULL;
    if (read_int64s(sizes_obj, sizes, &ndim) < 0
        || (strides_obj != Py_None && read_int64s(strides_obj, strides, &i) < 0)
        || read_int64s(stat_sizes_obj, ssizes, &sndim) < 0)
        goto done;
    bnbw_tensor_desc big = {(bnbw_data_type)data_type, ndim, sizes,
                            strides_obj == Py_None ? NULL : strides, 0};
    bnbw_tensor_desc stats = {(bnbw_data_type)data_type, sndim, ssizes, NULL, 0};
    if ((status = api->calc_buffer_tensor_size(big.data_type, ndim, sizes, big.strides,
                                               &big_min, &big.total_tensor_size_in_bytes))
        || (status = api->calc_buffer_tensor_size(stats.data_type, sndim, ssizes, NULL,
                                                  &stat_min,
                                                  &stats.total_tensor_size_in_bytes))) {
        PyErr_Format(PyExc_ValueError, "%s: %s", api->status_name(status),
                     api->error_message());
        goto done;
    }
    for (i = 0; i < 8; ++i) {
        uint64_t size = (i < 2 || i == 5) ? big_min : stat_min;
        mem[i] = calloc(1, (size_t)size);
        if (mem[i] == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        if (i < 5)
            memcpy(mem[i], in[i].buf,
                   (size_t)in[i].len < (size_t)size ? (size_t)in[i].len : (size_t)size);
    }
    bnbw_batch_normalization_grad_desc desc = {&big, &big, &stats, &stats, &stats,
                                               &big, &stats, &stats, epsilon};
    bnbw_bindings b = {mem[0], mem[1], mem[2], mem[3], mem[4],
                       in_place ? mem[1] : mem[5], mem[6], mem[7]};
    Py_BEGIN_ALLOW_THREADS
    status = api->create_operator((bnbw_operator_type)op_type, &desc, &op);
    if (status == BNBW_OK)
        status = api->execute(op, &b, num_threads);
    Py_END_ALLOW_THREADS
    if (status != BNBW_OK) {
        PyErr_Format(PyExc_ValueError, "%s: %s", api->status_name(status),
                     api->error_message());
        goto done;
    }
    result = Py_BuildValue("(y#y#y#)", (const char *)b.output_gradient, (Py_ssize_t)big_min,
                           (const char *)mem[6], (Py_ssize_t)stat_min,
                           (const char *)mem[7], (Py_ssize_t)stat_min);
done:
    api->destroy_operator(op);
    for (i = 0; i < 8; ++i)
        free(mem[i]);
    for (i = 0; i < 5; ++i)
        PyBuffer_Release(&in[i]);
    return result;
}

/* ---- the training forward ---------------------------------------------------------------- */

/* training(data_type, sizes, strides or None, stats_sizes, x, mean, variance, scale or None,
 *          bias or None, epsilon, momentum, fuse_relu, num_threads, in_place)
 * -> (output, output_running_mean, output_running_variance, output_batch_mean,
 *     output_batch_variance) as raw bytes.  in_place: output over input and the running
 * statistics over mean and variance.  Every buffer is malloc'd here. */
static PyObject *training(PyObject *self, PyObject *args)
{
    const bnbw_api_table *api = bnbw_api;
    int data_type, fuse_relu, num_threads, in_place;
    float epsilon, momentum;
    PyObject *sizes_obj, *strides_obj, *stat_sizes_obj, *opt[2], *result = NULL;
    Py_buffer in[5];
    int held[5] = {0};
    int64_t sizes[8], strides[8], ssizes[8];
    uint32_t ndim, sndim, i;
    uint64_t big_min = 0, stat_min = 0;
    void *mem[10] = {NULL};
    bnbw_operator *op = NULL;
    bnbw_status status;

    if (!PyArg_ParseTuple(args, "iOOOy*y*y*OOffiii", &data_type, &sizes_obj, &strides_obj,
                          &stat_sizes_obj, &in[0], &in[1], &in[2], &opt[0], &opt[1], &epsilon,
                          &momentum, &fuse_relu, &num_threads, &in_place))
        return NULL;
    held[0] = held[1] = held[2] = 1;
    for (i = 0; i < 2; ++i)
        if (opt[i] != Py_None) {
            if (PyObject_GetBuffer(opt[i], &in[3 + i], PyBUF_SIMPLE) < 0)
                goto done;
            held[3 + i] = 1;
        }
    if (read_int64s(sizes_obj, sizes, &ndim) < 0
        || (strides_obj != Py_None && read_int64s(strides_obj, strides, &i) < 0)
        || read_int64s(stat_sizes_obj, ssizes, &sndim) < 0)
        goto done;
    bnbw_tensor_desc big = {(bnbw_data_type)data_type, ndim, sizes,
                            strides_obj == Py_None ? NULL : strides, 0};
    bnbw_tensor_desc stats = {(bnbw_data_type)data_type, sndim, ssizes, NULL, 0};
    if ((status = api->calc_buffer_tensor_size(big.data_type, ndim, sizes, big.strides,
                                               &big_min, &big.total_tensor_size_in_bytes))
        || (status = api->calc_buffer_tensor_size(stats.data_type, sndim, ssizes, NULL,
                                                  &stat_min,
                                                  &stats.total_tensor_size_in_bytes))) {
        PyErr_Format(PyExc_ValueError, "%s: %s", api->status_name(status),
                     api->error_message());
        goto done;
    }
    /* input, mean, variance, scale, bias, then the five outputs */
    for (i = 0; i < 10; ++i) {
        uint64_t size = (i == 0 || i == 5) ? big_min : stat_min;
        if (i < 5 && !held[i])
            continue;
        mem[i] = calloc(1, (size_t)size);
        if (mem[i] == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        if (i < 5)
            memcpy(mem[i], in[i].buf,
                   (size_t)in[i].len < (size_t)size ? (size_t)in[i].len : (size_t)size);
    }
    bnbw_batch_normalization_training_desc desc = {
        &big, &stats, &stats, held[3] ? &stats : NULL, held[4] ? &stats : NULL,
        &big, &stats, &stats, &stats, &stats, epsilon, momentum, fuse_relu};
    bnbw_training_bindings b = {mem[0], mem[1], mem[2], mem[3], mem[4],
                                in_place ? mem[0] : mem[5], in_place ? mem[1] : mem[6],
                                in_place ? mem[2] : mem[7], mem[8], mem[9]};
    Py_BEGIN_ALLOW_THREADS
    status = api->create_training_operator(&desc, &op);
    if (status == BNBW_OK)
        status = api->execute_training(op, &b, num_threads);
    Py_END_ALLOW_THREADS
    if (status != BNBW_OK) {
        PyErr_Format(PyExc_ValueError, "%s: %s", api->status_name(status),
                     api->error_message());
        goto done;
    }
    result = Py_BuildValue("(y#y#y#y#y#)", (const char *)b.output, (Py_ssize_t)big_min,
                           (const char *)b.output_running_mean, (Py_ssize_t)stat_min,
                           (const char *)b.output_running_variance, (Py_ssize_t)stat_min,
                           (const char *)mem[8], (Py_ssize_t)stat_min,
                           (const char *)mem[9], (Py_ssize_t)stat_min);
done:
    api->destroy_operator(op);
    for (i = 0; i < 10; ++i)
        free(mem[i]);
    for (i = 0; i < 5; ++i)
        if (held[i])
            PyBuffer_Release(&in[i]);
    return result;
}

/* ---- refused calls ------------------------------------------------------------------------- */

typedef struct {
    int64_t sizes[4], ssizes[4], strides[4];
    bnbw_tensor_desc big, stats, bad;
    bnbw_batch_normalization_grad_desc desc;
} fixture;

static void fixture_init(fixture *f)
{
    static const int64_t s[4] = {2, 3, 4, 5}, ss[4] = {1, 3, 1, 1};
    memcpy(f->sizes, s, sizeof s);
    memcpy(f->ssizes, ss, sizeof ss);
    f->big = (bnbw_tensor_desc){BNBW_DATA_TYPE_FLOAT32, 4, f->sizes, NULL, 480};
    f->stats = (bnbw_tensor_desc){BNBW_DATA_TYPE_FLOAT32, 4, f->ssizes, NULL, 12};
    f->bad = f->big;
    f->desc = (bnbw_batch_normalization_grad_desc){&f->big, &f->big, &f->stats, &f->stats,
                                                   &f->stats, &f->big, &f->stats, &f->stats,
                                                   1e-5f};
}

static int add_case(PyObject *list, const char *name, bnbw_status status)
{
    PyObject *item = Py_BuildValue("(sis)", name, (int)status, bnbw_api->error_message());
    int rc = item ? PyList_Append(list, item) : -1;
    Py_XDECREF(item);
    return rc;
}

/* One case of a refusal list: its status, and the message of the call (fails the function when
 * the list cannot grow). */
#define CASE(name, expr) do { st = (expr); if (add_case(list, name, st) < 0) goto fail; } while (0)

/* errors() -> [(case, status, message)] for calls that must be refused, plus "ok" cases. */
static PyObject *errors(PyObject *self, PyObject *unused)
{
    const bnbw_api_table *api = bnbw_api;
    PyObject *list = PyList_New(0);
    fixture f;
    bnbw_operator *op = (bnbw_operator *)&f;       /* must be reset to NULL on failure */
    float *mem = calloc(2 * 120 + 64, sizeof(float));
    bnbw_status st;
    if (list == NULL || mem == NULL) {
        Py_XDECREF(list);
        free(mem);
        return PyErr_NoMemory();
    }

    fixture_init(&f);
    CASE("create: desc NULL", api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD, NULL, &op));
    CASE("create: op NULL after refusal", op == NULL ? BNBW_OK : BNBW_ERROR_NULL_POINTER);
    CASE("create: out pointer NULL", api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD, &f.desc, NULL));
    CASE("create: operator type", api->create_operator((bnbw_operator_type)7, &f.desc, &op));
    f.desc.variance = NULL;
    CASE("create: variance NULL", api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD, &f.desc, &op));
    fixture_init(&f);
    f.bad.sizes = NULL;
    f.desc.input_gradient = &f.bad;
    CASE("create: input_gradient sizes NULL", api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD, &f.desc, &op));
    fixture_init(&f);
    f.bad.data_type = (bnbw_data_type)9;
    f.desc.input = &f.bad;
    CASE("create: input data type unknown", api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD, &f.desc, &op));
    fixture_init(&f);
    f.stats.data_type = BNBW_DATA_TYPE_FLOAT16;
    CASE("create: data types differ", api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD, &f.desc, &op));
    fixture_init(&f);
    f.bad.dimension_count = 0;
    f.desc.output_gradient = &f.bad;
    CASE("create: output_gradient dimension count 0", api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD, &f.desc, &op));
    f.bad.dimension_count = 9;
    CASE("create: output_gradient dimension count 9", api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD, &f.desc, &op));
    fixture_init(&f);
    f.ssizes[2] = 3;
    f.stats.total_tensor_size_in_bytes = 36;
    CASE("create: mean size neither 1 nor input's", api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD, &f.desc, &op));
    fixture_init(&f);
    f.sizes[3] = 0;
    CASE("create: size 0", api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD, &f.desc, &op));
    fixture_init(&f);
    f.strides[0] = 60; f.strides[1] = -20; f.strides[2] = 5; f.strides[3] = 1;
    f.bad.strides = f.strides;
    f.desc.input = &f.bad;
    CASE("create: negative stride", api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD, &f.desc, &op));
    f.strides[1] = 0;
    f.desc.input = &f.bad;                  /* broadcast input: fine */
    CASE("ok: broadcast input", api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD, &f.desc, &op));
    api->destroy_operator(op);
    op = NULL;
    f.desc.input = &f.big;
    f.desc.output_gradient = &f.bad;
    CASE("create: output_gradient stride 0", api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD, &f.desc, &op));
    f.strides[0] = 20; f.strides[1] = 5; f.strides[2] = 4; f.strides[3] = 1;
    CASE("create: output_gradient overlapping strides", api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD, &f.desc, &op));
    fixture_init(&f);
    f.stats.total_tensor_size_in_bytes = 11;
    CASE("create: total size below minimum", api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD, &f.desc, &op));
    fixture_init(&f);
    f.sizes[0] = INT64_C(1) << 62;
    CASE("create: byte count overflow", api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD, &f.desc, &op));
    fixture_init(&f);
    f.desc.epsilon = 0.0f;
    CASE("create: epsilon 0", api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_TRAINING_GRAD, &f.desc, &op));
    f.desc.epsilon = -1.0f;
    CASE("create: epsilon negative", api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_TRAINING_GRAD, &f.desc, &op));
    f.desc.epsilon = (float)NAN;
    CASE("create: epsilon NaN", api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_TRAINING_GRAD, &f.desc, &op));
    f.desc.epsilon = (float)INFINITY;
    CASE("create: epsilon inf", api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_TRAINING_GRAD, &f.desc, &op));
    CASE("calc: sizes NULL", api->calc_buffer_tensor_size(BNBW_DATA_TYPE_FLOAT32, 2, NULL, NULL, NULL, NULL));

    /* execute */
    fixture_init(&f);
    CASE("ok: create", api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_TRAINING_GRAD, &f.desc, &op));
    {
        float *x = mem, *dx = mem + 120, *s = mem + 240;      /* s: 5 x 12 bytes of statistics */
        bnbw_bindings ok = {x, x, s, s, s, dx, s + 3 * 3, s + 3 * 4};
        bnbw_bindings b;
        for (int i = 0; i < 120; ++i)
            x[i] = (float)(i % 7);
        for (int i = 0; i < 9; ++i)
            s[i] = 1.0f;
        CASE("execute: op NULL", api->execute(NULL, &ok, 1));
        CASE("execute: bindings NULL", api->execute(op, NULL, 1));
        b = ok; b.mean = NULL;
        CASE("execute: mean NULL", api->execute(op, &b, 1));
        b = ok; b.output_bias_gradient = NULL;
        CASE("execute: output_bias_gradient NULL", api->execute(op, &b, 1));
        b = ok; b.input = (const char *)x + 2;
        CASE("execute: misaligned input", api->execute(op, &b, 1));
        CASE("execute: negative num_threads", api->execute(op, &ok, -1));
        b = ok; b.output_gradient = x + 1;
        CASE("execute: output_gradient overlaps input", api->execute(op, &b, 1));
        b = ok; b.output_scale_gradient = s + 2;
        CASE("execute: output_scale_gradient overlaps mean", api->execute(op, &b, 1));
        b = ok; b.output_bias_gradient = s + 3 * 3 + 1;
        CASE("execute: outputs overlap", api->execute(op, &b, 1));
        CASE("ok: execute", api->execute(op, &ok, 1));
        b = ok; b.output_gradient = x;
        b.input = dx;
        CASE("ok: execute in place", api->execute(op, &b, 2));
    }
    api->destroy_operator(op);
    api->destroy_operator(NULL);
    CASE("status name", BNBW_OK);
    {
        PyObject *name = PyUnicode_FromString(api->status_name(BNBW_ERROR_OVERLAP));
        if (name == NULL || PyList_Append(list, name) < 0) {
            Py_XDECREF(name);
            goto fail;
        }
        Py_DECREF(name);
    }
    free(mem);
    return list;
fail:
    free(mem);
    Py_DECREF(list);
    return NULL;
}

/* training_errors() -> [(case, status, message)] for the training forward's refused calls. */
static PyObject *training_errors(PyObject *self, PyObject *unused)
{
    const bnbw_api_table *api = bnbw_api;
    PyObject *list = PyList_New(0);
    static const int64_t sizes[4] = {2, 3, 4, 5}, ssizes[4] = {1, 3, 1, 1}, wrong[4] = {1, 3, 1, 2};
    bnbw_tensor_desc big = {BNBW_DATA_TYPE_FLOAT32, 4, sizes, NULL, 480};
    bnbw_tensor_desc stats = {BNBW_DATA_TYPE_FLOAT32, 4, ssizes, NULL, 12};
    bnbw_tensor_desc bad = {BNBW_DATA_TYPE_FLOAT32, 4, wrong, NULL, 24};
    bnbw_batch_normalization_training_desc ok = {&big, &stats, &stats, NULL, NULL, &big, &stats,
                                                 &stats, &stats, &stats, 1e-5f, 0.9f, 1};
    bnbw_batch_normalization_training_desc d;
    bnbw_batch_normalization_grad_desc grad = {&big, &big, &stats, &stats, &stats, &big, &stats,
                                               &stats, 1e-5f};
    bnbw_operator *op = NULL, *grad_op = NULL;
    float *mem = calloc(2 * 120 + 64, sizeof(float));
    bnbw_status st;
    if (list == NULL || mem == NULL) {
        Py_XDECREF(list);
        free(mem);
        return PyErr_NoMemory();
    }
    CASE("create: desc NULL", api->create_training_operator(NULL, &op));
    CASE("create: out pointer NULL", api->create_training_operator(&ok, NULL));
    d = ok; d.mean = NULL;
    CASE("create: mean NULL", api->create_training_operator(&d, &op));
    d = ok; d.output_batch_variance = &bad;
    CASE("create: batch variance sizes", api->create_training_operator(&d, &op));
    d = ok; d.momentum = 1.5f;
    CASE("create: momentum above 1", api->create_training_operator(&d, &op));
    d = ok; d.momentum = (float)NAN;
    CASE("create: momentum NaN", api->create_training_operator(&d, &op));
    d = ok; d.epsilon = 0.0f;
    CASE("create: epsilon 0", api->create_training_operator(&d, &op));
    CASE("create: op NULL after refusals", op == NULL ? BNBW_OK : BNBW_ERROR_NULL_POINTER);
    CASE("ok: create", api->create_training_operator(&ok, &op));
    CASE("ok: create gradient",
         api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_GRAD, &grad, &grad_op));
    {
        float *x = mem, *y = mem + 120, *s = mem + 240;     /* s: 6 x 12 bytes of statistics */
        bnbw_training_bindings good = {x, s, s + 3, NULL, NULL, y, s + 6, s + 9, s + 12, s + 15};
        bnbw_training_bindings b;
        bnbw_bindings gb = {x, x, s, s, s, y, s + 6, s + 9};
        for (int i = 0; i < 120; ++i)
            x[i] = (float)(i % 7);
        for (int i = 0; i < 6; ++i)
            s[i] = 1.0f;
        CASE("execute: bindings NULL", api->execute_training(op, NULL, 1));
        b = good; b.scale = s;
        CASE("execute: scale given to an operator made without it",
             api->execute_training(op, &b, 1));
        b = good; b.output_running_mean = s + 3;
        CASE("execute: output_running_mean over variance", api->execute_training(op, &b, 1));
        b = good; b.output = x + 1;
        CASE("execute: output overlaps input", api->execute_training(op, &b, 1));
        CASE("execute: a gradient operator", api->execute_training(grad_op, &good, 1));
        CASE("execute: the training operator through execute", api->execute(op, &gb, 1));
        CASE("ok: execute", api->execute_training(op, &good, 2));
        b = good; b.output = x; b.output_running_mean = s; b.output_running_variance = s + 3;
        CASE("ok: execute in place", api->execute_training(op, &b, 2));
    }
    api->destroy_operator(op);
    api->destroy_operator(grad_op);
    free(mem);
    return list;
fail:
    api->destroy_operator(op);
    api->destroy_operator(grad_op);
    free(mem);
    Py_DECREF(list);
    return NULL;
}
#undef CASE


/* ---- one operator, many threads --------------------------------------------------------- */

typedef struct {
    const bnbw_operator *op;
    bnbw_bindings b;
    int num_threads;
    bnbw_status status;
} job;

static void *work(void *arg)
{
    job *j = arg;
    for (int rep = 0; rep < 4 && j->status == BNBW_OK; ++rep)
        j->status = bnbw_api->execute(j->op, &j->b, j->num_threads);
    return NULL;
}

/* concurrent(n) -> True when n pthreads executing one operator at once (thread counts 1, 2,
 * ...) all get the bits of a single-threaded run. */
static PyObject *concurrent(PyObject *self, PyObject *args)
{
    enum { NB = 8, CB = 16, HB = 32, WB = 32, COUNT = NB * CB * HB * WB, THREADS = 8 };
    static const int64_t sizes[4] = {NB, CB, HB, WB}, ssizes[4] = {1, CB, 1, 1};
    static const int64_t strides[4] = {HB * WB * CB, 1, WB * CB, CB};
    int n, i, same = 1;
    float *x, *dy, *out, stats[3][CB];
    bnbw_operator *op = NULL;
    job jobs[THREADS + 1];
    pthread_t tid[THREADS];
    uint32_t seed = 99;
    if (!PyArg_ParseTuple(args, "i", &n))
        return NULL;
    if (n < 1 || n > THREADS)
        return PyErr_Format(PyExc_ValueError, "1 to %d threads", THREADS);
    x = malloc(COUNT * sizeof(float));
    dy = malloc(COUNT * sizeof(float));
    out = malloc((size_t)(n + 1) * (COUNT + 2 * CB) * sizeof(float));
    if (!x || !dy || !out) {
        free(x); free(dy); free(out);
        return PyErr_NoMemory();
    }
    for (i = 0; i < COUNT; ++i) {
        x[i] = 1.0f + lcg(&seed);
        dy[i] = lcg(&seed);
    }
    for (i = 0; i < CB; ++i) {
        stats[0][i] = 1.0f;
        stats[1][i] = 0.3f;
        stats[2][i] = 0.5f + (float)i;
    }
    bnbw_tensor_desc big = {BNBW_DATA_TYPE_FLOAT32, 4, sizes, strides, COUNT * 4};
    bnbw_tensor_desc st = {BNBW_DATA_TYPE_FLOAT32, 4, ssizes, NULL, CB * 4};
    bnbw_batch_normalization_grad_desc desc = {&big, &big, &st, &st, &st, &big, &st, &st,
                                               1e-5f};
    bnbw_status status;
    Py_BEGIN_ALLOW_THREADS
    status = bnbw_api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_TRAINING_GRAD, &desc,
                                       &op);
    for (i = 0; i <= n && status == BNBW_OK; ++i) {
        float *o = out + (size_t)i * (COUNT + 2 * CB);
        jobs[i] = (job){op, {x, dy, stats[0], stats[1], stats[2], o, o + COUNT,
                             o + COUNT + CB}, i == n ? 1 : 1 + i % 3, BNBW_OK};
    }
    if (status == BNBW_OK) {
        work(&jobs[n]);                                  /* the single-threaded reference */
        for (i = 0; i < n; ++i)
            pthread_create(&tid[i], NULL, work, &jobs[i]);
        for (i = 0; i < n; ++i)
            pthread_join(tid[i], NULL);
        for (i = 0; i <= n; ++i)
            if (jobs[i].status != BNBW_OK)
                status = jobs[i].status;
        for (i = 0; i < n && status == BNBW_OK; ++i)
            same &= memcmp(out + (size_t)i * (COUNT + 2 * CB), out + (size_t)n * (COUNT + 2 * CB),
                           (COUNT + 2 * CB) * sizeof(float)) == 0;
    }
    bnbw_api->destroy_operator(op);
    Py_END_ALLOW_THREADS
    free(x);
    free(dy);
    free(out);
    if (status != BNBW_OK)
        return PyErr_Format(PyExc_RuntimeError, "%s", bnbw_api->status_name(status));
    return PyBool_FromLong(same);
}

static PyMethodDef methods[] = {
    {"demo", demo, METH_NOARGS, "NHWC-strided f32 tensors through both operators."},
    {"run", run, METH_VARARGS, "One operator on raw memory in any layout."},
    {"errors", errors, METH_NOARGS, "Status and message of refused calls."},
    {"concurrent", concurrent, METH_VARARGS, "One operator executed from n threads at once."},
    {"training", training, METH_VARARGS, "The training forward on raw memory in any layout."},
    {"training_errors", training_errors, METH_NOARGS, "Refusals of the training forward."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "bnbw_capi_example", NULL, -1,
                                    methods};

PyMODINIT_FUNC PyInit_bnbw_capi_example(void)
{
    if (bnbw_import() < 0)        /* once per module, with the GIL, like import_array() */
        return NULL;
    return PyModule_Create(&module);
}
