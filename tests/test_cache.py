"""The kernel cache (seed 004): keyed by op, parameters, layouts and policy; bounded LRU with
counters; prebuilt libraries, then the disk cache, then the JIT; never the same compile twice,
across threads and across processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import blockpad as bp
from blockpad.jit import compile_kernels, fingerprint
from blockpad.runtime.cache import KernelCache, KernelNotFound, Request

from .conftest import run_in_threads

S = (2, 30, 5, 7)
BLK = bp.Layout("nChw16c", S)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def relu(layout=BLK, alpha=0.0, policy="dst_fused", inplace=False):
    params = {"algorithm": "relu", "alpha": alpha, "beta": 0.0}
    if inplace:
        params["inplace"] = True
    return Request.make("eltwise", [("src", layout), ("dst", layout)], params, policy)


class Counting:
    """The JIT compiler, counting (and optionally slowing) its calls."""

    def __init__(self, delay=0.0, fp=None):
        self.calls, self.delay, self._fp = [], delay, fp
        self._lock = threading.Lock()

    def fingerprint(self):
        return self._fp or fingerprint()

    def __call__(self, entries, policy, target, out_dir):
        with self._lock:
            self.calls.append(entries[0]["op"])
        time.sleep(self.delay)
        compile_kernels(entries, policy, target, out_dir)


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "bp-jit"


def test_hits_misses_lru_and_disk(shared_dir, rng):
    cache = KernelCache(compiler=compile_kernels, cache_dir=shared_dir, capacity=2)
    k = cache.get(relu())
    assert cache.get(relu()) is k
    st = cache.stats()
    assert (st.hits, st.misses) == (1, 1)
    cache.get(relu(alpha=0.5))
    cache.get(relu(policy="tracked"))          # a third kernel: the LRU holds two
    assert cache.stats().evictions == 1 and len(cache) == 2
    compiles = cache.stats().compiles
    again = cache.get(relu())                   # evicted: back from disk, not recompiled
    assert cache.stats().compiles == compiles and cache.stats().disk_hits >= 1
    x = rng.standard_normal(S).astype("float32")
    src, dst = bp.Memory.from_numpy(x, BLK), bp.Memory.empty(BLK)
    again(src, dst)
    assert np.array_equal(dst.to_numpy(), np.maximum(x, 0))
    # a second cache over the same directory (a second process, as far as it knows)
    other = KernelCache(compiler=Counting(), cache_dir=shared_dir)
    other.get(relu())
    assert other.stats().compiles == 0 and other.stats().disk_hits == 1


def test_key_is_the_whole_signature():
    keys = {relu().key(), relu(alpha=0.1).key(), relu(policy="tracked").key(),
            relu(bp.Layout("nChw8c", S)).key(), relu(inplace=True).key(),
            relu(bp.Layout("nChw16c", S, "bfloat16")).key(), relu().key("avx512")}
    assert len(keys) == 7
    assert relu().key() == relu().key()
    # the same post-op chain spelled two ways is one kernel
    a = Request.make("conv2d", [("src", BLK)], {"post_ops": [{"kind": "eltwise"}]})
    b = Request.make("conv2d", [("src", BLK)], {"post_ops": [
        {"kind": "eltwise", "algorithm": "relu", "alpha": 0, "beta": 0.0}]})
    assert a.key() == b.key()


def test_threads_asking_for_one_new_kernel_compile_it_once(tmp_path):
    compiler = Counting(delay=0.5)
    cache = KernelCache(compiler=compiler, cache_dir=tmp_path)
    got = []
    reqs = [relu()] * 6 + [relu(alpha=0.25)] * 2
    run_in_threads(lambda req: got.append((req, cache.get(req))), reqs)
    assert len(compiler.calls) == 2                     # one per distinct kernel
    assert len({id(k) for r, k in got if r == relu()}) == 1
    st = cache.stats()
    assert st.compiles == 2 and st.waits + st.hits == 6


def test_two_processes_compile_a_kernel_once(tmp_path):
    """Concurrent processes serialise on a file lock per key: one compiles, the other finds
    the result on disk."""
    log = tmp_path / "compiles.log"
    script = textwrap.dedent(f"""
        import sys
        import blockpad as bp
        from blockpad.jit import compile_kernels
        from blockpad.runtime.cache import KernelCache, Request

        def counting(entries, policy, target, out_dir):
            with open({str(log)!r}, "a") as f:
                f.write("compile\\n")
            compile_kernels(entries, policy, target, out_dir)
        counting.fingerprint = compile_kernels.fingerprint

        lay = bp.Layout("nChw16c", (1, 19, 4, 4))
        req = Request.make("eltwise", [("src", lay), ("dst", lay)],
                           {{"algorithm": "tanh", "alpha": 0.0, "beta": 0.0}}, "dst_fused")
        cache = KernelCache(compiler=counting, cache_dir={str(tmp_path / "jit")!r})
        cache.get(req)
        st = cache.stats()
        print(st.compiles, st.disk_hits)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    results = sorted(tuple(map(int, o.split())) for o, _ in outs)
    assert results == [(0, 1), (1, 0)]
    assert log.read_text().count("compile") == 1


def test_stale_or_damaged_disk_entries_are_rebuilt(tmp_path):
    v1 = Counting(fp="codegen-v1")
    KernelCache(compiler=v1, cache_dir=tmp_path).get(relu())
    # the code generator changed: the entry is rebuilt, not served
    v2 = Counting(fp="codegen-v2")
    c2 = KernelCache(compiler=v2, cache_dir=tmp_path)
    c2.get(relu())
    assert len(v2.calls) == 1 and c2.stats().stale == 1
    # a deployed process without a compiler trusts what is there
    c3 = KernelCache(compiler=None, cache_dir=tmp_path)
    c3.get(relu())
    assert c3.stats().disk_hits == 1
    # a damaged library (hash mismatch) is rebuilt
    entry = tmp_path / "jit" / c2.key(relu())
    with open(entry / "kernels.so", "ab") as f:
        f.write(b"\0")
    v3 = Counting(fp="codegen-v2")
    KernelCache(compiler=v3, cache_dir=tmp_path).get(relu())
    assert len(v3.calls) == 1
    assert json.loads((entry / "request.json").read_text())["fingerprint"] == "codegen-v2"


def test_fingerprint_covers_the_tuning_records():
    """A new tuning record changes what builds emit, so JIT entries made before it are stale."""
    import blockpad.tuning_logs

    logs = Path(blockpad.tuning_logs.__path__[0]) / "test-fingerprint-target"
    before = fingerprint()
    try:
        logs.mkdir()
        (logs / "database_tuning_record.json").write_text("[]\n")
        fingerprint.cache_clear()
        assert fingerprint() != before
    finally:
        shutil.rmtree(logs, ignore_errors=True)
        fingerprint.cache_clear()
    assert fingerprint() == before


def test_prebuilt_library_kernels_match_exactly(tmp_path):
    from blockpad.codegen.spec import parse_spec

    spec = {"library": {"policy": "tracked"}, "kernel": [
        {"op": "eltwise", "name": "my_relu", "shape": list(S), "src": "nChw16c",
         "dst": "nChw16c"},
        {"op": "reorder", "name": "pack", "shape": list(S), "src": "nchw", "dst": "nChw16c"}]}
    bp.build(parse_spec(spec), "host", tmp_path / "lib", log=lambda m: None)
    lib = bp.load(tmp_path / "lib")
    cache = KernelCache([lib], compiler=None, cache_dir=tmp_path / "empty")
    assert cache.get(relu(policy="tracked")).name == "my_relu"
    assert cache.get(Request.make("reorder", [("src", bp.Layout("nchw", S)),
                                              ("dst", BLK)])).name == "pack"
    assert cache.stats().library_hits == 2
    for other in (relu(policy="dst_fused"), relu(policy="tracked", alpha=0.5),
                  relu(policy="tracked", inplace=True)):
        with pytest.raises(KernelNotFound, match="no compiler"):
            cache.get(other)
    with pytest.raises(KernelNotFound):
        cache.get(relu(policy="dst_fused"))                  # remembered, not looked up again
    assert cache.stats().failures == 3


def test_threads_run_kernels_of_one_library_and_cache_at_once(shared_dir):
    cache = KernelCache(compiler=compile_kernels, cache_dir=shared_dir)
    kinds = [relu(), relu(alpha=0.5)]
    for r in kinds:
        cache.get(r)
    big = bp.Layout("nChw16c", (2, 30, 40, 40))
    cache.get(relu(big))        # large enough for TVM's thread pool to run it in parallel
    before = cache.stats()

    def work(seed):
        rng = np.random.default_rng(seed)
        for i in range(20):
            lay = big if i % 4 == 0 else BLK
            alpha = 0.5 if i % 2 and lay is BLK else 0.0
            k = cache.get(relu(lay, alpha=alpha))
            x = rng.standard_normal(lay.shape).astype("float32")
            src, dst = bp.Memory.from_numpy(x, lay), bp.Memory.empty(lay)
            k(src, dst)
            assert np.array_equal(dst.to_numpy(), np.where(x > 0, x, x * np.float32(alpha)))

    run_in_threads(work, range(6))
    after = cache.stats() - before
    assert after.compiles == after.misses == 0 and after.hits == 120
