/* Counting exactly N calls of a Python function with callgrind, for bench/instructions.py.
 *
 * run(f, n, name): start instrumentation, zero the counters, call f() n times, dump the counters
 * under `name`, stop instrumentation. Outside valgrind the client requests do nothing. */
#include <Python.h>
#include <valgrind/callgrind.h>

static PyObject *run(PyObject *self, PyObject *args) {
    PyObject *f;
    long n;
    const char *name;
    if (!PyArg_ParseTuple(args, "Ols", &f, &n, &name))
        return NULL;
    CALLGRIND_START_INSTRUMENTATION;
    CALLGRIND_ZERO_STATS;
    for (long i = 0; i < n; i++) {
        PyObject *result = PyObject_CallNoArgs(f);
        if (result == NULL) {
            CALLGRIND_STOP_INSTRUMENTATION;
            return NULL;
        }
        Py_DECREF(result);
    }
    CALLGRIND_DUMP_STATS_AT(name);
    CALLGRIND_STOP_INSTRUMENTATION;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {{"run", run, METH_VARARGS, "call f() n times, counted as `name`"},
                                {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "cgmark", NULL, -1, methods};

PyMODINIT_FUNC PyInit_cgmark(void) { return PyModule_Create(&module); }
