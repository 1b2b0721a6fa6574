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
 *
 * In a long-lived host (a notebook, a training loop calling the library) the host
 * may install its own SIGBUS handler after gradaudit's first scan: a Python
 * handler (which returns, so the fault repeats forever), faulthandler.enable()
 * or SIG_DFL (both end the process). So every register() looks at the handler
 * in place, one sigaction call, and when it is not this one installs this one
 * again, chaining to the handler it found. A handler found that way may chain
 * back to this one (faulthandler restores its predecessor, this one, and
 * re-raises), or return without repairing anything (a Python handler), so two
 * rules end a chain in the crash it would have been (after faulthandler's
 * traceback), never in a loop: a SIGBUS that arrives while one is being forwarded
 * takes the default action (SA_NODEFER delivers a re-raise at once, inside the
 * forwarding), and so does a fault outside the ranges at the address just
 * forwarded (the handler returned without repairing it).
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
/* Set while a signal is handed to `previous`. */
static volatile sig_atomic_t forwarding = 0;
/* The address of the last fault outside the ranges handed to `previous`: the same fault
 * again means that handler did not repair it (see the header). */
static uintptr_t last_forwarded = 0;
static uintptr_t page_size = 4096;

static void default_action(int sig) {
    /* The default action: a fault re-executes and kills; a kill() is re-raised. */
    signal(sig, SIG_DFL);
    raise(sig);
}

static void forward(int sig, siginfo_t *info, void *context) {
    if (forwarding) {
        default_action(sig);
        return;
    }
    if (previous.sa_flags & SA_SIGINFO) {
        if (previous.sa_sigaction != NULL) {
            forwarding = 1;
            previous.sa_sigaction(sig, info, context);
            forwarding = 0;
        }
        return;
    }
    if (previous.sa_handler == SIG_IGN) return;
    if (previous.sa_handler == SIG_DFL || previous.sa_handler == NULL) {
        default_action(sig);
        return;
    }
    forwarding = 1;
    previous.sa_handler(sig);
    forwarding = 0;
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
        uintptr_t again = __atomic_exchange_n(&last_forwarded, address, __ATOMIC_ACQ_REL);
        if (again == address) {
            default_action(sig);
            return;
        }
    }
    forward(sig, info, context);
}

/* Make on_sigbus the SIGBUS handler unless it already is, chaining to the one in place.
 * Called at every register(): the host may have replaced it since the last call. */
static int ensure_installed(void) {
    struct sigaction current, action;
    if (sigaction(SIGBUS, NULL, &current) != 0) return -1;
    if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_sigbus) return 0;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_sigbus;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    /* `previous` is written while on_sigbus is not the handler: no fault reads it half-set
     * (a thread still inside an old on_sigbus call forwards to the old or the new one). */
    previous = current;
    return sigaction(SIGBUS, &action, NULL);
}

PyDoc_STRVAR(register_doc,
    "register(address, length) -> slot\n\n"
    "Guard the pages of [address, address + length): a SIGBUS there maps zero pages\n"
    "over the rest of the range and sets its flag instead of killing the process.\n"
    "Installs the SIGBUS handler unless it is in place (the host may have replaced it\n"
    "since the last call); it forwards other faults to the handler it found.");

static PyObject *py_register(PyObject *self, PyObject *args) {
    unsigned long long address, length;
    (void)self;
    if (!PyArg_ParseTuple(args, "KK", &address, &length)) return NULL;
    if (address == 0 || length == 0) {
        PyErr_SetString(PyExc_ValueError, "empty range");
        return NULL;
    }
    /* The GIL serialises register/unregister; the handler only reads. */
    if (ensure_installed() != 0) return PyErr_SetFromErrno(PyExc_OSError);
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
