/*
 * bnbw_c_program.c - a plain C program (no Python module of its own) that calls bnbw_native's
 * C API on raw float32 buffers.
 *
 *     bnbw_c_program PYTHON
 *
 * The C API lives in the installed Python package: its function table is fetched from a capsule
 * by bnbw_import(), so a C program embeds CPython to reach it.  PYTHON is the interpreter of the
 * environment where bnbw_native is installed (a virtual environment's bin/python included):
 * the embedded interpreter is configured as that program, so it finds that environment's
 * site-packages whatever PATH holds.  After bnbw_import() the program releases the GIL: the
 * table's functions never need it.
 *
 * Build and run: python examples/c_program/run.py (compiles with the flags of the running
 * interpreter's sysconfig, as python3-config --embed gives them).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "bnbw_native.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

enum { N = 4, C = 3, H = 5, W = 6, M = N * H * W };

static int fail(const char *what, bnbw_status status)
{
    fprintf(stderr, "%s: %s: %s\n", what, bnbw_api->status_name(status),
            bnbw_api->error_message());
    return 1;
}

/* The training gradient of channel-first (N, C, H, W) float32 data, through the DirectML-style
 * operator; checked against the formula in double precision. */
static int run(void)
{
    static float x[N * C * H * W], dy[N * C * H * W], dx[N * C * H * W];
    float mean[C], var[C], scale[C], dscale[C], dbias[C];
    int64_t sizes[4] = {N, C, H, W}, stat_sizes[4] = {1, C, 1, 1};
    bnbw_tensor_desc big = {BNBW_DATA_TYPE_FLOAT32, 4, sizes, NULL, sizeof x};
    bnbw_tensor_desc stat = {BNBW_DATA_TYPE_FLOAT32, 4, stat_sizes, NULL, sizeof mean};
    bnbw_batch_normalization_grad_desc desc = {&big, &big, &stat, &stat, &stat, &big, &stat,
                                               &stat, 1e-5f};
    bnbw_bindings bind = {x, dy, mean, var, scale, dx, dscale, dbias};
    bnbw_operator *op = NULL;
    bnbw_status status;
    double worst = 0.0, largest = 0.0;
    int n, c, i;

    for (i = 0; i < N * C * H * W; ++i) {           /* deterministic data around 3 */
        x[i] = 3.0f + (float)sin(0.7 * i) * 2.0f;
        dy[i] = (float)cos(1.3 * i);
    }
    for (c = 0; c < C; ++c) {                        /* the batch statistics, as a forward's */
        double s = 0.0, q = 0.0;
        for (n = 0; n < N; ++n)
            for (i = 0; i < H * W; ++i)
                s += x[(n * C + c) * H * W + i];
        for (n = 0; n < N; ++n)
            for (i = 0; i < H * W; ++i) {
                double d = x[(n * C + c) * H * W + i] - s / M;
                q += d * d;
            }
        mean[c] = (float)(s / M);
        var[c] = (float)(q / M);
        scale[c] = 0.5f + 0.25f * (float)c;
    }

    status = bnbw_api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_TRAINING_GRAD, &desc,
                                       &op);
    if (status != BNBW_OK)
        return fail("create_operator", status);
    status = bnbw_api->execute(op, &bind, 0);
    if (status != BNBW_OK)
        return fail("execute", status);

    for (c = 0; c < C; ++c) {                        /* dx = g r (dy - Sdy/M - (x-mu) r^2 Sxdy/M) */
        double sg = 0.0, sxg = 0.0, r = 1.0 / sqrt((double)var[c] + 1e-5f);
        for (n = 0; n < N; ++n)
            for (i = 0; i < H * W; ++i) {
                int k = (n * C + c) * H * W + i;
                sg += dy[k];
                sxg += ((double)x[k] - mean[c]) * dy[k];
            }
        for (n = 0; n < N; ++n)
            for (i = 0; i < H * W; ++i) {
                int k = (n * C + c) * H * W + i;
                double want = scale[c] * r * (dy[k] - sg / M - ((double)x[k] - mean[c]) * r * r
                                              * sxg / M);
                worst = fmax(worst, fabs(dx[k] - want));
                largest = fmax(largest, fabs(want));
            }
    }
    printf("bnbw_native %s, called from a C program: dx max error %.1e (relative to the "
           "largest value)\n", bnbw_api->library_version(), worst / largest);

    desc.epsilon = 0.0f;                             /* a refusal: a status and a message */
    bnbw_api->destroy_operator(op);
    status = bnbw_api->create_operator(BNBW_OPERATOR_BATCH_NORMALIZATION_TRAINING_GRAD, &desc,
                                       &op);
    printf("epsilon 0 refused: %s: %s\n", bnbw_api->status_name(status),
           bnbw_api->error_message());
    return worst / largest < 1e-5 && status == BNBW_ERROR_EPSILON && op == NULL ? 0 : 1;
}

int main(int argc, char **argv)
{
    PyConfig config;
    PyStatus started;
    PyThreadState *gil;
    int rc;

    if (argc != 2) {
        fprintf(stderr, "usage: %s PYTHON (the interpreter of bnbw_native's environment)\n",
                argv[0]);
        return 2;
    }
    PyConfig_InitPythonConfig(&config);
    started = PyConfig_SetBytesString(&config, &config.program_name, argv[1]);
    if (!PyStatus_Exception(started))
        started = Py_InitializeFromConfig(&config);
    PyConfig_Clear(&config);
    if (PyStatus_Exception(started)) {
        fprintf(stderr, "could not start Python: %s\n", started.err_msg ? started.err_msg : "");
        return 1;
    }
    if (bnbw_import() < 0) {                         /* needs the GIL: held after start-up */
        PyErr_Print();
        Py_FinalizeEx();
        return 1;
    }
    gil = PyEval_SaveThread();                       /* the table runs without the GIL */
    rc = run();
    PyEval_RestoreThread(gil);
    if (Py_FinalizeEx() < 0)
        rc = 1;
    return rc;
}
