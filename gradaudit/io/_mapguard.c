/*
 * Survive an input file that shrinks while it is memory-mapped.
 *
 * Why this exists: gradaudit reads safetensors data and torch zip checkpoints
 * through memory maps (zero copies, the speed of the page cache). When the file
 * is truncated while it is mapped (a training job rewriting its dump, an NFS
 * hiccup), touching a page past the new end raises SIGBUS, and the default
 * action kills the process with no output at all. The pages are read by the
 * native kernel's threads, torch's own threads (eager ops, copies to a GPU) and
 * zlib: a Python-level handler cannot run in the middle of that C code, and
 * jumping out of torch's code with siglongjmp would leave its locks held.
 *
 * So the handler does the one thing that is safe anywhere: when the faulting
 * address lies in a range gradaudit registered, it maps anonymous zero pages
 * over the rest of that range (MAP_FIXED, a plain system call), sets the
 * range's flag and returns. The faulting instruction is retried, reads zeros,
 * and every reader carries on to the end of its tensor. Before anything from
 * the file is reported, the reader asks whether the flag is set and turns it
 * into an input error for that file; the zeros are never shown to anyone.
 *
 * Faults outside the registered ranges go to the handler that was there before
 * (faulthandler's, or the default action, which kills the process as before).
 * The fast path costs nothing: no system call per read, no copy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* Linux allows 65,530 maps per process by default (vm.max_map_count): a range per map of
 * a run's files fits. (1024 ended a 1,025-shard checkpoint in exit 4.) */
#define MAX_RANGES 65536

typedef struct {
    uintptr_t start; /* 0 when the slot is free */
    uintptr_t end;
    int faulted;
} range_t;

static range_t ranges[MAX_RANGES];
/* Where the search for a free slot starts: registering n ranges stays O(n), not O(n^2). */
static size_t next_free = 0;
static struct sigaction previous;
static int installed = 0;
static uintptr_t page_size = 4096;

static void forward(int sig, siginfo_t *info, void *context) {
    if (previous.sa_flags & SA_SIGINFO) {
        if (previous.sa_sigaction != NULL) previous.sa_sigaction(sig, info, context);
        return;
    }
    if (previous.sa_handler == SIG_IGN) return;
    if (previous.sa_handler == SIG_DFL || previous.sa_handler == NULL) {
        /* The default action: a fault re-executes and kills; a kill() is re-raised. */
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    previous.sa_handler(sig);
}

static void on_sigbus(int sig, siginfo_t *info, void *context) {
    if (info != NULL && info->si_code > 0) { /* raised by the kernel for a fault */
        uintptr_t address = (uintptr_t)info->si_addr;
        for (size_t i = 0; i < MAX_RANGES; i++) {
            uintptr_t start = __atomic_load_n(&ranges[i].start, __ATOMIC_ACQUIRE);
            if (start == 0) continue;
            uintptr_t end = __atomic_load_n(&ranges[i].end, __ATOMIC_ACQUIRE);
            if (address < start || address >= end) continue;
            uintptr_t page = address - address % page_size;
            void *zeros = mmap((void *)page, end - page, PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
            if (zeros != MAP_FAILED) {
                __atomic_store_n(&ranges[i].faulted, 1, __ATOMIC_RELEASE);
                return;
            }
            break;
        }
    }
    forward(sig, info, context);
}

static int install(void) {
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_sigbus;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGBUS, &action, &previous) != 0) return -1;
    installed = 1;
    return 0;
}

PyDoc_STRVAR(register_doc,
    "register(address, length) -> slot\n\n"
    "Guard the pages of [address, address + length): a SIGBUS there maps zero pages\n"
    "over the rest of the range and sets its flag instead of killing the process.\n"
    "Installs the SIGBUS handler on first use (it forwards other faults).");

static PyObject *py_register(PyObject *self, PyObject *args) {
    unsigned long long address, length;
    (void)self;
    if (!PyArg_ParseTuple(args, "KK", &address, &length)) return NULL;
    if (address == 0 || length == 0) {
        PyErr_SetString(PyExc_ValueError, "empty range");
        return NULL;
    }
    /* The GIL serialises register/unregister; the handler only reads. */
    if (!installed && install() != 0) return PyErr_SetFromErrno(PyExc_OSError);
    uintptr_t start = (uintptr_t)address - (uintptr_t)address % page_size;
    uintptr_t end = (uintptr_t)(address + length);
    end = (end + page_size - 1) / page_size * page_size;
    for (size_t k = 0; k < MAX_RANGES; k++) {
        size_t i = (next_free + k) % MAX_RANGES;
        if (__atomic_load_n(&ranges[i].start, __ATOMIC_ACQUIRE) != 0) continue;
        __atomic_store_n(&ranges[i].faulted, 0, __ATOMIC_RELEASE);
        __atomic_store_n(&ranges[i].end, end, __ATOMIC_RELEASE);
        __atomic_store_n(&ranges[i].start, start, __ATOMIC_RELEASE);
        next_free = (i + 1) % MAX_RANGES;
        return PyLong_FromSize_t(i);
    }
    PyErr_SetString(PyExc_RuntimeError, "too many guarded ranges");
    return NULL;
}

static int slot_arg(PyObject *arg, size_t *slot) {
    Py_ssize_t value = PyLong_AsSsize_t(arg);
    if (value == -1 && PyErr_Occurred()) return -1;
    if (value < 0 || value >= MAX_RANGES) {
        PyErr_SetString(PyExc_ValueError, "invalid slot");
        return -1;
    }
    *slot = (size_t)value;
    return 0;
}

PyDoc_STRVAR(faulted_doc, "faulted(slot) -> bool\n\nWhether a page of the range was read past the file's end.");

static PyObject *py_faulted(PyObject *self, PyObject *arg) {
    size_t slot;
    (void)self;
    if (slot_arg(arg, &slot)) return NULL;
    return PyBool_FromLong(__atomic_load_n(&ranges[slot].faulted, __ATOMIC_ACQUIRE));
}

PyDoc_STRVAR(unregister_doc, "unregister(slot)\n\nStop guarding a range (before it is unmapped).");

static PyObject *py_unregister(PyObject *self, PyObject *arg) {
    size_t slot;
    (void)self;
    if (slot_arg(arg, &slot)) return NULL;
    __atomic_store_n(&ranges[slot].start, 0, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"register", py_register, METH_VARARGS, register_doc},
    {"faulted", py_faulted, METH_O, faulted_doc},
    {"unregister", py_unregister, METH_O, unregister_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_mapguard",
    "SIGBUS on truncated memory-mapped inputs becomes a flag (see gradaudit/io/mapguard.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__mapguard(void) {
    long size = sysconf(_SC_PAGESIZE);
    if (size > 0) page_size = (uintptr_t)size;
    return PyModule_Create(&module);
}
