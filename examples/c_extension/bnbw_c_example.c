/*
 * bnbw_c_example.c - a Python extension module written in C that calls bnbw_native's C API.
 *
 *     training_grad(x, dy, mean, variance, scale, dx, dscale, dbias, epsilon)
 *
 * x, dy, dx: C-contiguous float32 buffers of shape (N, C, H, W) (NumPy arrays, array.array,
 * anything with the buffer protocol and a shape); mean, variance, scale, dscale, dbias: float32
 * buffers of C elements.  Writes the training gradient into dx, dscale, dbias.
 *
 * Build: python setup.py build_ext --inplace   (in this directory; see run.py)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "bnbw_native.h"

#include <string.h>

/* The buffer of argument `name`: float32, C-contiguous, `ndim` dims (0: any). */
static int get_buffer(PyObject *obj, const char *name, int writable, int ndim, Py_buffer *view)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    if (view->itemsize != 4 || view->format == NULL || strcmp(view->format, "f") != 0) {
        PyErr_Format(PyExc_TypeError, "%s must hold float32 values", name);
    } else if (ndim && view->ndim != ndim) {
        PyErr_Format(PyExc_ValueError, "%s must have %d dims, got %d", name, ndim, view->ndim);
    } else {
        return 0;
    }
    PyBuffer_Release(view);
    return -1;
}

static PyObject *training_grad(PyObject *self, PyObject *args)
{
    static const char *names[8] = {"x", "dy", "mean", "variance", "scale", "dx", "dscale",
                                    "dbias"};
    PyObject *objs[8];
    Py_buffer views[8];
    int held = 0, i;
    float epsilon;
    PyObject *result = NULL;

    if (!PyArg_ParseTuple(args, "OOOOOOOOf:training_grad", &objs[0], &objs[1], &objs[2],
                          &objs[3], &objs[4], &objs[5], &objs[6], &objs[7], &epsilon))
        return NULL;
    /* the table, fetched once; needs the GIL, which we hold here */
    if (bnbw_import() < 0)
        return NULL;
    for (held = 0; held < 8; ++held)
        if (get_buffer(objs[held], names[held], held >= 5, held < 2 || held == 5 ? 4 : 1,
                       &views[held]) < 0)
            goto done;

    {
        int64_t sizes[4], stat_sizes[4] = {1, 0, 1, 1};
        for (i = 0; i < 4; ++i)
            sizes[i] = (int64_t)views[0].shape[i];
        stat_sizes[1] = sizes[1];
        bnbw_tensor_desc big = {BNBW_DATA_TYPE_FLOAT32, 4, sizes, NULL, 0};   /* packed NCHW */
        bnbw_tensor_desc stats = {BNBW_DATA_TYPE_FLOAT32, 4, stat_sizes, NULL, 0};
        bnbw_batch_normalization_grad_desc desc = {&big, &big, &stats, &stats, &stats,
                                                   &big, &stats, &stats, epsilon};
        bnbw_bindings bindings = {views[0].buf, views[1].buf, views[2].buf, views[3].buf,
                                  views[4].buf, views[5].buf, views[6].buf, views[7].buf};
        bnbw_operator *op = NULL;
        uint64_t minimum[2];
        bnbw_status status;

        /* the minimum sizes, to check the buffers; the default total_tensor_size_in_bytes */
        status = bnbw_api->calc_buffer_tensor_size(big.data_type, 4, sizes, NULL, &minimum[0],
                                                   &big.total_tensor_size_in_bytes);
        if (status == BNBW_OK)
            status = bnbw_api->calc_buffer_tensor_size(stats.data_type, 4, stat_sizes, NULL,
                                                       &minimum[1],
                                                       &stats.total_tensor_size_in_bytes);
        for (i = 0; status == BNBW_OK && i < 8; ++i) {
            int is_big = i < 2 || i == 5;
            if (is_big && memcmp(views[i].shape, views[0].shape, 4 * sizeof(Py_ssize_t))) {
                PyErr_Format(PyExc_ValueError, "%s must have the shape of x", names[i]);
                goto done;
            }
            if ((uint64_t)views[i].len < minimum[is_big ? 0 : 1]) {
                PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, %llu needed", names[i],
                             views[i].len, (unsigned long long)minimum[is_big ? 0 : 1]);
                goto done;
            }
        }
        /* the checks and the work never touch Python objects: run them without the GIL */
        Py_BEGIN_ALLOW_THREADS
        if (status == BNBW_OK)
            status = bnbw_api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_TRAINING_GRAD,
                                               &desc, &op);
        if (status == BNBW_OK)
            status = bnbw_api->execute(op, &bindings, 0);   /* 0: the package's default */
        bnbw_api->destroy_operator(op);
        Py_END_ALLOW_THREADS
        if (status != BNBW_OK) {
            PyErr_Format(PyExc_ValueError, "%s: %s", bnbw_api->status_name(status),
                         bnbw_api->error_message());
            goto done;
        }
    }
    result = Py_None;
    Py_INCREF(result);
done:
    for (i = 0; i < held; ++i)
        PyBuffer_Release(&views[i]);
    return result;
}

static PyObject *library_version(PyObject *self, PyObject *unused)
{
    if (bnbw_import() < 0)
        return NULL;
    return PyUnicode_FromString(bnbw_api->library_version());
}

static PyMethodDef methods[] = {
    {"training_grad", training_grad, METH_VARARGS,
     "training_grad(x, dy, mean, variance, scale, dx, dscale, dbias, epsilon): the training "
     "gradient of batch normalization over float32 NCHW buffers, through bnbw_native's C API."},
    {"library_version", library_version, METH_NOARGS, "bnbw_native's version, from C."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "bnbw_c_example",
                                    "bnbw_native's C API called from a C extension module.", -1,
                                    methods};

PyMODINIT_FUNC PyInit_bnbw_c_example(void)
{
    return PyModule_Create(&module);
}
