"""The kernel cache (seed 004's primitive cache): a kernel is created once and reused, keyed by a
signature of the op, its parameters, its arguments' layouts/shapes/dtypes and the padding policy.

Where a kernel comes from, in order:

1. the in-memory LRU (bounded; a *hit*);
2. a prebuilt library given to the cache (``blockpad.load``): its manifest says what each
   kernel computes;
3. the on-disk JIT cache, ``$BLOCKPAD_CACHE_DIR/jit/<key>/`` (default
   ``~/.cache/blockpad/jit/<key>/``), one built library per kernel: a second process pays a
   ``dlopen``, never a compile;
4. the JIT compiler, if one was given: it builds the kernel into that directory.

The runtime never imports TVM's compiler, so the compiler is *injected* (``compiler=``; the
top-level ``blockpad`` package registers ``blockpad.jit`` as the default). A deployed process
with a prebuilt library or a populated cache directory runs with the compiler absent.

A kernel is never compiled twice: concurrent threads asking for the same key wait on the one
compile in flight (a future per key), and concurrent processes serialise on a file lock per key
and find the other's result on disk. Failures are remembered too, so a graph that falls back
from a kernel the generator cannot make does not retry the compile on every plan.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass

from blockpad import manifest as mf
from blockpad.errors import BlockpadError
from blockpad.layout import Layout
from blockpad.vocabulary import with_defaults

from .library import Kernel, Library, load

DEFAULT_CAPACITY = 512
KERNEL_NAME = "k"            # the name of the kernel in a JIT library
REQUEST_FILE = "request.json"
FAILED_SUFFIX = ".failed"     # beside a key's directory: the generator could not make it


class _Pending:
    """One resolution in flight, which other threads asking for the same key wait on (a
    minimal future: concurrent.futures costs 20 ms of import)."""

    def __init__(self):
        self._done = threading.Event()
        self._value = self._error = None

    def set_result(self, value):
        self._value = value
        self._done.set()

    def set_exception(self, error):
        self._error = error
        self._done.set()

    def result(self):
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value


class KernelNotFound(BlockpadError, LookupError):
    """No prebuilt, cached or compilable kernel for a request (the graph falls back on it)."""


class _FrozenDict(dict):
    """A dict that can sit in a hashable Request (post-op tables)."""

    def __hash__(self):
        return hash(tuple(sorted(self.items())))


def _norm(value):
    """Canonical, hashable form of a parameter value: sequences become tuples, tables frozen
    dicts, numpy scalars Python numbers. JSON writes them as lists and tables again."""
    if isinstance(value, (list, tuple)):
        return tuple(_norm(v) for v in value)
    if isinstance(value, dict):
        return _FrozenDict((k, _norm(v)) for k, v in sorted(value.items()))
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):   # numpy scalars
        return value.item()
    return value


def canonical_post_ops(chain) -> tuple:
    """A post-op chain with the generator's defaults filled in, values as floats: two spellings
    of the same chain compare equal."""
    out = []
    for p in chain or ():
        full = with_defaults(p)
        out.append(_norm({k: float(v) if isinstance(v, int) and k in ("alpha", "beta", "scale")
                          else v for k, v in full.items()}))
    return tuple(out)


def _layout_entry(layout: Layout) -> dict:
    """A layout as a build-spec table (shape and dtype follow from the entry's shape/dtype)."""
    d = {"tag": layout.tag}
    if any(any(p) for p in layout.paddings):
        d["paddings"] = [list(p) for p in layout.paddings]
    if layout.strides is not None:
        d["strides"] = list(layout.strides)
    return d


@dataclass(frozen=True)
class Request:
    """What a caller wants computed: the op, its tensors in call order with their layouts, its
    parameters, and the padding policy (None for data movement, which is the same under all).

    ``params`` are matched against a prebuilt kernel's recorded parameters; ``implied`` are spec
    fields a kernel's layouts already pin down (binary's ``shape1``), passed to the compiler but
    not matched. ``shape``/``dtype`` are the spec entry's own (default: the first tensor's)."""

    op: str
    tensors: tuple                 # ((name, Layout), ...)
    params: tuple = ()             # ((name, value), ...) sorted
    policy: str | None = None
    shape: tuple | None = None
    dtype: str | None = None
    implied: tuple = ()

    @classmethod
    def make(cls, op, tensors, params=None, policy=None, shape=None, dtype=None, implied=None):
        tensors = tuple(tensors.items()) if isinstance(tensors, dict) else tuple(tensors)
        params = dict(params or {})
        if "post_ops" in params:
            params["post_ops"] = canonical_post_ops(params["post_ops"])
        params = tuple(sorted((k, _norm(v)) for k, v in params.items()))
        implied = tuple(sorted((k, _norm(v)) for k, v in (implied or {}).items()))
        _name, first = tensors[0]
        return cls(op, tensors, params, policy, tuple(shape or first.shape),
                   dtype or first.dtype, implied)

    @property
    def inplace(self) -> bool:
        return bool(dict(self.params).get("inplace"))

    def entry(self, name: str = KERNEL_NAME) -> dict:
        """The build-spec entry that makes this kernel."""
        e = {"op": self.op, "name": name, "shape": list(self.shape), "dtype": self.dtype}
        e.update({t: _layout_entry(l) for t, l in self.tensors})
        e.update(dict(self.implied))
        e.update(dict(self.params))
        if self.policy is not None:
            e["policy"] = self.policy
        return json.loads(json.dumps(e))     # plain lists and tables, as a TOML spec gives

    def describe(self) -> dict:
        return {"op": self.op, "policy": self.policy, "shape": list(self.shape),
                "dtype": self.dtype, "params": dict(self.params), "implied": dict(self.implied),
                "tensors": [[t, l.describe()] for t, l in self.tensors]}

    def key(self, target: str = "host", tvm_version: str = "") -> str:
        text = json.dumps([self.describe(), target, tvm_version], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def matches(self, sig) -> bool:
        """Does a library kernel (its manifest Signature) compute exactly this?"""
        if sig.op != self.op:
            return False
        want = list(self.tensors[:-1] if self.inplace else self.tensors)
        have = [(a.name, a.layout) for a in sig.args]
        if want != have:
            return False
        if self.policy is not None and (sig.padding or {}).get("policy") != self.policy:
            return False
        recorded = {k: _norm(v) for k, v in sig.params.items()}
        if "post_ops" in recorded:
            recorded["post_ops"] = canonical_post_ops(recorded["post_ops"])
        params = dict(self.params)
        if recorded.get("inplace", False) != params.get("inplace", False):
            return False
        # every parameter asked for must be recorded and equal: a kernel whose manifest cannot
        # vouch for a parameter is not taken (it might compute something else)
        return all(k in recorded and recorded[k] == v for k, v in params.items())

    def __str__(self):
        params = ", ".join(f"{k}={v}" for k, v in self.params)
        lays = ", ".join(f"{t}: {l}" for t, l in self.tensors)
        pol = f" [{self.policy}]" if self.policy else ""
        return f"{self.op}({lays}{', ' if params else ''}{params}){pol}"


@dataclass
class CacheStats:
    hits: int = 0            # found in memory
    misses: int = 0          # not in memory: looked up below
    library_hits: int = 0    # ...found in a prebuilt library
    disk_hits: int = 0       # ...found in the on-disk JIT cache (no compile)
    compiles: int = 0        # ...compiled by the JIT compiler
    waits: int = 0           # ...another thread was already resolving it: waited for its result
    failures: int = 0        # ...no kernel could be had (remembered; the caller falls back)
    evictions: int = 0
    stale: int = 0           # disk entries rebuilt because the code generator changed

    def as_dict(self):
        return dict(self.__dict__)

    def __sub__(self, other):
        return CacheStats(**{k: v - getattr(other, k) for k, v in self.__dict__.items()})


def default_cache_dir() -> str:
    base = os.environ.get("BLOCKPAD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "blockpad")
    return base


class KernelCache:
    """Bounded, thread-safe LRU of kernels with a disk-backed JIT behind it.

    ``compiler``: ``compiler(entries, policy, target, out_dir)`` builds the spec ``entries``
    (a list of build-spec kernel tables) into a library at ``out_dir``; its optional attribute
    ``fingerprint()`` names the code generator's version, so disk entries made by another
    version are rebuilt rather than reused (checked only where a compiler is present: a
    deployed process trusts its cache directory). ``None``: no JIT, prebuilt and cached
    kernels only."""

    def __init__(self, libraries=(), compiler=None, capacity=DEFAULT_CAPACITY, cache_dir=None,
                 target="host"):
        self._lock = threading.RLock()
        self._lru: OrderedDict = OrderedDict()
        self._inflight: dict = {}
        self._failed: dict = {}
        self._libraries: list = []
        self._jit_libs: dict = {}      # directory -> Library, so a reload costs nothing
        self.capacity = capacity
        self.compiler = compiler
        self.cache_dir = os.fspath(cache_dir) if cache_dir else default_cache_dir()
        self.target = target
        self._stats = CacheStats()
        self._tvm_version = None
        self._keys: dict = {}
        for lib in libraries:
            self.add_library(lib)

    # ---- configuration ------------------------------------------------------------------------
    def add_library(self, library: Library) -> None:
        """Serve kernels of a prebuilt library (checked against its manifest's descriptions)."""
        with self._lock:
            self._libraries.append(library)
            self._failed.clear()

    @property
    def libraries(self):
        return list(self._libraries)

    def target_features(self) -> tuple:
        """The CPU features of the target this cache's kernels are for: its first prebuilt
        library's (a loaded model's own), else what the compiler says of ``target``, else
        none known. The graph packs weights for the instructions they name (bf16 for
        ``vdpbf16ps``), and a model's load plans as its build did, from the same target."""
        built = self._built_target()
        if built is not None:
            return tuple(built.get("features", ()))
        features = getattr(self.compiler, "target_features", None)
        return tuple(features(self.target)) if callable(features) else ()

    @property
    def target_name(self) -> str:
        """The name of the target this cache's kernels are for, as ``target_features`` finds
        it: the cost models that choose between kernels go by it (``blockpad.winograd``)."""
        built = self._built_target()
        return self.target if built is None else built.get("name", self.target)

    def _built_target(self) -> dict | None:
        """The manifest's target of this cache's first prebuilt library, if it has one."""
        with self._lock:
            libs = list(self._libraries)
        return libs[0].manifest["target"] if libs else None

    @property
    def jit_dir(self) -> str:
        return os.path.join(self.cache_dir, "jit")

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(**self._stats.as_dict())

    def __len__(self):
        return len(self._lru)

    def clear(self) -> None:
        """Forget the in-memory kernels (the disk cache stays)."""
        with self._lock:
            self._lru.clear()
            self._failed.clear()
            self._jit_libs.clear()

    # ---- lookup -------------------------------------------------------------------------------
    def key(self, req: Request) -> str:
        key = self._keys.get(req)
        if key is None:
            if self._tvm_version is None:
                self._tvm_version = mf.tvm_version()
            key = self._keys[req] = req.key(self.target, self._tvm_version)
        return key

    def get(self, req: Request) -> Kernel:
        """The kernel for ``req``; raise KernelNotFound if none can be had."""
        key = self.key(req)
        with self._lock:
            kernel = self._lru.get(key)
            if kernel is not None:
                self._lru.move_to_end(key)
                self._stats.hits += 1
                return kernel
            self._stats.misses += 1
            if key in self._failed:
                raise KernelNotFound(self._failed[key])
            future = self._inflight.get(key)
            owner = future is None
            if owner:
                future = self._inflight[key] = _Pending()
            else:
                self._stats.waits += 1
        if not owner:
            return future.result()
        try:
            kernel = self._resolve(req, key)
        except KernelNotFound as e:
            with self._lock:
                self._failed[key] = str(e)
                self._stats.failures += 1
                self._inflight.pop(key, None)
            future.set_exception(e)
            raise
        except BaseException as e:
            with self._lock:
                self._inflight.pop(key, None)
            future.set_exception(e)
            raise
        with self._lock:
            self._lru[key] = kernel
            while len(self._lru) > self.capacity:
                self._lru.popitem(last=False)
                self._stats.evictions += 1
            self._inflight.pop(key, None)
        future.set_result(kernel)
        return kernel

    def find(self, req: Request):
        """The kernel for ``req``, or None (never raises KernelNotFound)."""
        try:
            return self.get(req)
        except KernelNotFound:
            return None

    def zero_pad_kernel(self, layout: Layout):
        """A generated zero-pad kernel for ``layout``: from any library already loaded (every
        policy-aware kernel's library carries one for each padded layout it touches), else
        through the cache. None if there is none (the runtime then zero-pads with numpy)."""
        with self._lock:
            libs = [*self._libraries, *self._jit_libs.values()]
        for lib in libs:
            k = lib.zero_pad_kernel(layout)
            if k is not None:
                return k
        return self.find(Request.make("zero_pad", [("layout", layout)]))

    # ---- resolution below the LRU -------------------------------------------------------------
    def _resolve(self, req: Request, key: str) -> Kernel:
        for lib in self._libraries:
            for name, sig in lib.kernels.items():
                if req.matches(sig):
                    with self._lock:
                        self._stats.library_hits += 1
                    return lib[name]
        directory = os.path.join(self.jit_dir, key)
        kernel = self._on_disk(req, directory)
        if kernel is not None:
            return kernel
        if self.compiler is None:
            raise KernelNotFound(f"no kernel for {req}: none of the {len(self._libraries)} "
                                 f"prebuilt libraries has it, the JIT cache {directory} does "
                                 f"not hold it, and this cache has no compiler")
        return self._compile(req, directory)

    def _fingerprint(self):
        fp = getattr(self.compiler, "fingerprint", None)
        return fp() if callable(fp) else fp

    def _on_disk(self, req: Request, directory: str):
        """The JIT cache's kernel for ``req`` (counted as a disk hit); None if it has none;
        KernelNotFound if the generator is recorded to have failed on it."""
        kernel = self._from_disk(req, directory)
        if kernel is not None:
            with self._lock:
                self._stats.disk_hits += 1
            return kernel
        failed = self._failed_on_disk(req, directory)
        if failed:
            raise KernelNotFound(failed)
        return None

    def _from_disk(self, req: Request, directory: str):
        try:
            with open(os.path.join(directory, REQUEST_FILE)) as f:
                recorded = json.load(f)
        except (OSError, ValueError):
            return None
        if recorded.get("request") != json.loads(json.dumps(req.describe())):
            return None   # a hash collision or a damaged entry: never serve another kernel
        if self.compiler is not None and recorded.get("fingerprint") != self._fingerprint():
            return None   # made by another version of the code generator: rebuilt below
        try:
            return self._load_jit(req, directory)
        except BlockpadError:
            return None

    def _failed_on_disk(self, req: Request, directory: str):
        """The error recorded when the generator could not make this kernel (by this version
        of it), so that no process tries again; None if there is no such record."""
        try:
            with open(directory + FAILED_SUFFIX) as f:
                recorded = json.load(f)
        except (OSError, ValueError):
            return None
        if recorded.get("request") != json.loads(json.dumps(req.describe())):
            return None
        if self.compiler is not None and recorded.get("fingerprint") != self._fingerprint():
            return None
        return recorded.get("error", f"no kernel for {req}")

    def _load_jit(self, req: Request, directory: str) -> Kernel:
        with self._lock:
            lib = self._jit_libs.get(directory)
        if lib is None:
            lib = load(directory)
            with self._lock:
                self._jit_libs[directory] = lib
        kernel = lib[KERNEL_NAME]
        if not req.matches(kernel.signature):
            raise KernelNotFound(f"the JIT library {directory} does not compute {req}: "
                                 f"it holds {kernel.signature}")
        return kernel

    def _compile(self, req: Request, directory: str) -> Kernel:
        os.makedirs(self.jit_dir, exist_ok=True)
        with _file_lock(directory + ".lock"):
            kernel = self._on_disk(req, directory)   # another process may have made it
            if kernel is not None:
                return kernel
            tmp = tempfile.mkdtemp(prefix=os.path.basename(directory) + ".", dir=self.jit_dir)
            try:
                try:
                    self.compiler([req.entry()], req.policy, self.target, tmp)
                except BlockpadError as e:
                    error = f"no kernel for {req}: the generator cannot make it ({e})"
                    _write_json(directory + FAILED_SUFFIX,
                                {"request": req.describe(), "fingerprint": self._fingerprint(),
                                 "error": error})
                    raise KernelNotFound(error) from e
                with open(os.path.join(tmp, REQUEST_FILE), "w") as f:
                    json.dump({"request": req.describe(), "fingerprint": self._fingerprint(),
                               "target": self.target}, f, indent=1, sort_keys=True)
                with self._lock:
                    self._stats.compiles += 1
                    self._jit_libs.pop(directory, None)
                if os.path.isdir(directory):
                    with self._lock:
                        self._stats.stale += 1
                    shutil.rmtree(directory)          # a stale entry: replaced whole
                os.replace(tmp, directory)           # readers see all of it or nothing
            finally:
                if os.path.isdir(tmp):
                    shutil.rmtree(tmp, ignore_errors=True)
        return self._load_jit(req, directory)


def _write_json(path, doc) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


@contextlib.contextmanager
def _file_lock(path):
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---- the process-wide default cache -----------------------------------------------------------

_default = None
_default_lock = threading.Lock()
_default_compiler = None


def set_default_compiler(compiler) -> None:
    """Register the compiler the default cache uses (``blockpad`` registers ``blockpad.jit``;
    the runtime itself never imports a compiler)."""
    global _default_compiler
    _default_compiler = compiler
    if _default is not None:
        _default.compiler = compiler if _jit_enabled() else None


def _jit_enabled() -> bool:
    return os.environ.get("BLOCKPAD_JIT", "1").lower() not in ("0", "false", "no", "off")


def default_cache() -> KernelCache:
    """The process-wide cache: the default compiler unless ``BLOCKPAD_JIT=0``, the cache
    directory of ``BLOCKPAD_CACHE_DIR``."""
    global _default
    with _default_lock:
        if _default is None:
            _default = KernelCache(compiler=_default_compiler if _jit_enabled() else None,
                                   target=os.environ.get("BLOCKPAD_JIT_TARGET", "host"))
        return _default
