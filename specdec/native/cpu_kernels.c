/* specdec's CPU kernels, one importable extension (called through ctypes; see
 * specdec/native/__init__.py): linear.c (row-invariant linear layers over weight panels),
 * attention.c (row-invariant attention over per-row key lists), layer.c (a whole decoder layer
 * in one call). This file: the ABI version, the CPU feature check and the module stub.
 *
 * Threads: OpenMP (the libgomp torch already loaded).
 */
#include <Python.h>

#include "kernels.h"

int sd_abi_version(void) { return SD_ABI; }

int sd_cpu_features(void) {
    __builtin_cpu_init();
    int f = 0;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) f |= 1;
    if ((f & 1) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        f |= 2;
    return f;
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_kernels",
                                    "specdec's CPU kernels (called through ctypes)", -1, NULL};
PyMODINIT_FUNC PyInit__cpu_kernels(void) { return PyModule_Create(&module); }
