/* tvm_run: call kernels of a TVM-built shared library without TVM's runtime, so that an aarch64
 * library can run under qemu-aarch64 on another machine (blockpad/testing/qemu.py drives it).
 *
 *   tvm_run LIB.so CALLS        CALLS: a file (or "-" for stdin), one call per line:
 *     FUNC TENSOR...            TENSOR = ROLE:CODE:BITS:SHAPE:STRIDES:FILE, e.g.
 *                               in:2:32:2x8x5x7x4:1120x140x28x4x1:/tmp/a.bin (STRIDES "-": compact)
 *
 * Each FILE holds the tensor's whole buffer (data at byte offset 0); it is read into a 64-byte
 * aligned allocation between guard regions, passed as a DLTensor, and written back after the
 * call. After each call the guards must be intact and every ROLE "in" tensor byte-identical
 * to what it was (else the call fails, exit status 3). The .so's runtime hooks are filled
 * here: a parallel loop is launched as $TVM_NUM_THREADS tasks (default 4) on as many threads,
 * as TVM's thread pool does, so the kernels' split of work between tasks runs as it does on a
 * device; workspaces come from aligned_alloc. Each call prints "ok TASKS": the most tasks one
 * of its parallel launches had (0: none). */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <tvm/ffi/c_api.h>

#define MAX_ARGS 16
#define MAX_DIMS 12
#define MAX_TASKS 64
#define GUARD 64            /* bytes before each buffer; after it, up to the next 64 and 64 more */
#define GUARD_BYTE 0xA5     /* neither zero nor NaN / all-ones: what no kernel writes by chance */
typedef int (*Lambda)(int task, void* penv, void* cdata);
typedef struct { void* sync; int32_t num_task; } Env;   /* TVMParallelGroupEnv */
typedef struct { Lambda f; void* cdata; Env* env; int task; int rc; } Job;

static int tasks = 4, most_tasks = 0;

static void* run_job(void* p) { Job* j = p; j->rc = j->f(j->task, j->env, j->cdata); return NULL; }

static int parallel_launch(Lambda f, void* cdata, int n) {   /* n: the kernel's hint, 0: all */
  int k = n > 0 && n < tasks ? n : tasks;
  pthread_barrier_t barrier; pthread_barrier_init(&barrier, NULL, (unsigned)k);
  Env e = {&barrier, k};
  Job jobs[MAX_TASKS]; pthread_t threads[MAX_TASKS];
  for (int i = 0; i < k; i++) jobs[i] = (Job){f, cdata, &e, i, 0};
  for (int i = 1; i < k; i++)
    if (pthread_create(&threads[i], NULL, run_job, &jobs[i])) { fprintf(stderr, "tvm_run: pthread_create failed\n"); exit(2); }
  run_job(&jobs[0]);   /* task 0 on the calling thread, as TVM's pool runs it */
  int rc = jobs[0].rc;
  for (int i = 1; i < k; i++) { pthread_join(threads[i], NULL); if (!rc) rc = jobs[i].rc; }
  pthread_barrier_destroy(&barrier);
  if (k > most_tasks) most_tasks = k;
  return rc;
}
static int parallel_barrier(int task, Env* e) {
  (void)task; pthread_barrier_wait((pthread_barrier_t*)e->sync); return 0;
}
static void* ws_alloc(int dt, int id, uint64_t n, int c, int b) {
  (void)dt; (void)id; (void)c; (void)b; return aligned_alloc(64, (n + 63) / 64 * 64 + 64);
}
static int ws_free(int dt, int id, void* p) { (void)dt; (void)id; free(p); return 0; }
static int fail(const char* what, const char* detail) {
  fprintf(stderr, "tvm_run: %s%s\n", what, detail); return 2;
}
static size_t tail(size_t size) { return (size + 63) / 64 * 64 + 64 - size; }   /* guard after */
static size_t guard_bytes_written(const unsigned char* base, size_t size) {
  size_t n = 0;
  for (size_t i = 0; i < GUARD; i++) n += base[i] != GUARD_BYTE;
  for (size_t i = 0, t = tail(size); i < t; i++) n += base[GUARD + size + i] != GUARD_BYTE;
  return n;
}

static int dims(char* s, int64_t* out) {   /* "2x8x5" -> {2, 8, 5}; returns the count */
  int n = 0;
  for (char* t = strtok(s, "x"); t; t = strtok(NULL, "x")) {
    if (n == MAX_DIMS) return -1;
    out[n++] = strtoll(t, NULL, 10);
  }
  return n;
}

static int call(void* lib, char* line) {
  char* save; char* fname = strtok_r(line, " \t\n", &save);
  if (!fname) return 0;
  char sym[512]; snprintf(sym, sizeof sym, "__tvm_ffi_%s", fname);
  TVMFFISafeCallType fn = (TVMFFISafeCallType)dlsym(lib, sym);
  if (!fn) return fail("no such kernel in the library: ", fname);
  DLTensor t[MAX_ARGS]; TVMFFIAny args[MAX_ARGS];
  int64_t shape[MAX_ARGS][MAX_DIMS], strides[MAX_ARGS][MAX_DIMS];
  char* files[MAX_ARGS]; size_t sizes[MAX_ARGS]; int n = 0, rc = 0;
  unsigned char* bases[MAX_ARGS]; unsigned char* before[MAX_ARGS];   /* inputs' bytes */
  for (char* a; n < MAX_ARGS && (a = strtok_r(NULL, " \t\n", &save)); n++) {
    char *role = strtok(a, ":"), *code = strtok(NULL, ":"), *bits = strtok(NULL, ":");
    char *shp = strtok(NULL, ":"), *str = strtok(NULL, ":"), *file = strtok(NULL, "");
    if (!file || (strcmp(role, "in") && strcmp(role, "out")))
      return fail("bad tensor argument of ", fname);
    FILE* f = fopen(file, "rb");
    if (!f) return fail("cannot read ", file);
    fseek(f, 0, SEEK_END); sizes[n] = (size_t)ftell(f); rewind(f);
    bases[n] = aligned_alloc(64, GUARD + sizes[n] + tail(sizes[n]));
    memset(bases[n], GUARD_BYTE, GUARD + sizes[n] + tail(sizes[n]));
    void* data = bases[n] + GUARD;
    if (fread(data, 1, sizes[n], f) != sizes[n]) return fail("short read of ", file);
    fclose(f);
    before[n] = NULL;
    if (!strcmp(role, "in")) { before[n] = malloc(sizes[n] + 1); memcpy(before[n], data, sizes[n]); }
    char sbuf[256]; snprintf(sbuf, sizeof sbuf, "%s", str);
    int nd = dims(shp, shape[n]);
    int has_strides = strcmp(sbuf, "-") != 0;
    if (nd < 0 || (has_strides && dims(sbuf, strides[n]) != nd))
      return fail("bad shape/strides of ", file);
    t[n] = (DLTensor){data, {kDLCPU, 0}, nd, {(uint8_t)atoi(code), (uint8_t)atoi(bits), 1},
                      shape[n], has_strides ? strides[n] : NULL, 0};
    files[n] = file;
    memset(&args[n], 0, sizeof args[n]);
    args[n].type_index = kTVMFFIDLTensorPtr; args[n].v_ptr = &t[n];
  }
  if (strtok_r(NULL, " \t\n", &save)) return fail("too many tensors for ", fname);
  TVMFFIAny ret; memset(&ret, 0, sizeof ret); ret.type_index = kTVMFFINone;
  if (fn(NULL, args, n, &ret) != 0) {
    TVMFFIObjectHandle err = NULL; TVMFFIErrorMoveFromRaised(&err);
    TVMFFIErrorCell* cell = (TVMFFIErrorCell*)((char*)err + sizeof(TVMFFIObject));
    fprintf(stderr, "tvm_run: %s raised %.*s: %.*s\n", fname, (int)cell->kind.size, cell->kind.data,
            (int)cell->message.size, cell->message.data);
    TVMFFIObjectDecRef(err);
    rc = 1;
  }
  for (int i = 0; i < n; i++) {   /* what the kernel must not have written */
    size_t g = guard_bytes_written(bases[i], sizes[i]);
    if (g) {
      fprintf(stderr, "tvm_run: %s wrote %zu guard bytes around tensor %d (%s)\n", fname, g, i, files[i]);
      rc = 3;
    }
    if (before[i] && memcmp(before[i], t[i].data, sizes[i])) {
      fprintf(stderr, "tvm_run: %s changed its input tensor %d (%s)\n", fname, i, files[i]);
      rc = 3;
    }
    free(before[i]);
  }
  for (int i = 0; i < n; i++) {   /* every tensor back to its file: outputs are read from there */
    FILE* f = fopen(files[i], "wb");
    if (!f || fwrite(t[i].data, 1, sizes[i], f) != sizes[i]) return fail("cannot write ", files[i]);
    fclose(f); free(bases[i]);
  }
  return rc;
}

int main(int argc, char** argv) {
  if (argc != 3) return fail("usage: tvm_run LIB.so CALLS|-", "");
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!lib) return fail("dlopen failed: ", dlerror());
  void** p;
  const char* env = getenv("TVM_NUM_THREADS");
  if (env && atoi(env) > 0) tasks = atoi(env) < MAX_TASKS ? atoi(env) : MAX_TASKS;
  if ((p = dlsym(lib, "__TVMBackendParallelLaunch"))) *p = (void*)parallel_launch;
  if ((p = dlsym(lib, "__TVMBackendParallelBarrier"))) *p = (void*)parallel_barrier;
  if ((p = dlsym(lib, "__TVMBackendAllocWorkspace"))) *p = (void*)ws_alloc;
  if ((p = dlsym(lib, "__TVMBackendFreeWorkspace"))) *p = (void*)ws_free;
  FILE* in = strcmp(argv[2], "-") ? fopen(argv[2], "r") : stdin;
  if (!in) return fail("cannot read ", argv[2]);
  static char line[1 << 16];
  int rc = 0;
  while (fgets(line, sizeof line, in)) {
    most_tasks = 0;
    int r = call(lib, line);
    if (r) { rc = r; break; }
    printf("ok %d\n", most_tasks); fflush(stdout);
  }
  return rc;
}
