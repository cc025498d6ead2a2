/* tvm_run: call kernels of a TVM-built shared library without TVM's runtime, so that an aarch64
 * library can run under qemu-aarch64 on another machine (blockpad/testing/qemu.py drives it).
 *
 *   tvm_run LIB.so CALLS        CALLS: a file (or "-" for stdin), one call per line:
 *     FUNC TENSOR...            TENSOR = CODE:BITS:SHAPE:STRIDES:FILE, e.g.
 *                               2:32:2x8x5x7x4:1120x140x28x4x1:/tmp/a.bin (STRIDES "-": compact)
 *
 * Each FILE holds the tensor's whole buffer (data at byte offset 0); it is read into a 64-byte
 * aligned allocation, passed as a DLTensor, and written back after the call. The .so's runtime
 * hooks are filled here: parallel loops run serially, workspaces come from aligned_alloc. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <tvm/ffi/c_api.h>

#define MAX_ARGS 16
#define MAX_DIMS 12
typedef int (*Lambda)(int task, void* penv, void* cdata);
typedef struct { void* sync; int32_t num_task; } Env;   /* TVMParallelGroupEnv */

static int parallel_launch(Lambda f, void* cdata, int n) {   /* one task: the whole range */
  Env e = {NULL, 1}; (void)n; return f(0, &e, cdata);
}
static void* ws_alloc(int dt, int id, uint64_t n, int c, int b) {
  (void)dt; (void)id; (void)c; (void)b; return aligned_alloc(64, (n + 63) / 64 * 64 + 64);
}
static int ws_free(int dt, int id, void* p) { (void)dt; (void)id; free(p); return 0; }
static int fail(const char* what, const char* detail) {
  fprintf(stderr, "tvm_run: %s%s\n", what, detail); return 2;
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
  for (char* a; n < MAX_ARGS && (a = strtok_r(NULL, " \t\n", &save)); n++) {
    char *code = strtok(a, ":"), *bits = strtok(NULL, ":"), *shp = strtok(NULL, ":");
    char *str = strtok(NULL, ":"), *file = strtok(NULL, "");
    if (!file) return fail("bad tensor argument of ", fname);
    FILE* f = fopen(file, "rb");
    if (!f) return fail("cannot read ", file);
    fseek(f, 0, SEEK_END); sizes[n] = (size_t)ftell(f); rewind(f);
    void* data = aligned_alloc(64, (sizes[n] + 63) / 64 * 64 + 64);
    if (fread(data, 1, sizes[n], f) != sizes[n]) return fail("short read of ", file);
    fclose(f);
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
  for (int i = 0; i < n; i++) {   /* every tensor back to its file: outputs are read from there */
    FILE* f = fopen(files[i], "wb");
    if (!f || fwrite(t[i].data, 1, sizes[i], f) != sizes[i]) return fail("cannot write ", files[i]);
    fclose(f); free(t[i].data);
  }
  return rc;
}

int main(int argc, char** argv) {
  if (argc != 3) return fail("usage: tvm_run LIB.so CALLS|-", "");
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!lib) return fail("dlopen failed: ", dlerror());
  void** p;
  if ((p = dlsym(lib, "__TVMBackendParallelLaunch"))) *p = (void*)parallel_launch;
  if ((p = dlsym(lib, "__TVMBackendAllocWorkspace"))) *p = (void*)ws_alloc;
  if ((p = dlsym(lib, "__TVMBackendFreeWorkspace"))) *p = (void*)ws_free;
  FILE* in = strcmp(argv[2], "-") ? fopen(argv[2], "r") : stdin;
  if (!in) return fail("cannot read ", argv[2]);
  static char line[1 << 16];
  int rc = 0;
  while (fgets(line, sizeof line, in)) {
    int r = call(lib, line);
    if (r) { rc = r; break; }
    printf("ok\n"); fflush(stdout);
  }
  return rc;
}
