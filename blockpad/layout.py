"""A tensor layout as one immutable value: logical dims -> blocked, padded physical memory.

The value is pure Python so that both sides of blockpad can share it: the code generator feeds
TVM index expressions through the same index maps (``to_physical``, ``to_logical``,
``is_padding``) that the runtime evaluates on numpy index arrays to pack and unpack data.

Notation (oneDNN): a lower-case letter is a whole dim, an upper-case letter is the outer part of
a blocked dim, ``<n><letter>`` is an inner block of ``n`` along that dim. ``nChw16c`` stores
``C`` in blocks of 16; ``OIhw4i16o4i`` splits ``i`` twice (4 x 4 = 16). The logical order of the
dims is always canonical (``n c d h w``, ``g o i d h w``, or ``a b c d e f``), whatever the
physical order, so ``Layout("nhwc", shape=(N, C, H, W))``.

Two kinds of padding live in a layout:

* block padding: a blocked dim is rounded up to a multiple of its block (C=30 -> 32);
* spatial padding (seed 002, Arm Compute Library style): a halo of ``before``/``after``
  elements around a dim, so the first element sits at ``elem_offset`` and the strides grow.

Every element of the physical index space that is not a logical element is padding.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .errors import LayoutError

MAX_RANK = 6

#: Canonical logical orders of the letter families oneDNN tags use.
FAMILIES = ("abcdef", "ncdhw", "goidhw")

#: Element types a layout may hold (ml_dtypes supplies bfloat16).
DTYPES = ("float64", "float32", "float16", "bfloat16",
          "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8")

_TOKEN = re.compile(r"(\d+)([a-z])|([A-Za-z])")


@functools.lru_cache(maxsize=64)
def numpy_dtype(dtype) -> np.dtype:
    """The numpy dtype for a blockpad dtype name (bfloat16 comes from ml_dtypes)."""
    name = dtype_name(dtype)
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


@functools.lru_cache(maxsize=64)
def dtype_name(dtype) -> str:
    """Normalise a dtype given as a name, numpy dtype or scalar type to its canonical name."""
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = str(dtype)
    if name not in DTYPES:
        raise LayoutError(f"dtype: expected one of {', '.join(DTYPES)}; got {dtype!r}")
    return name


def pad_sides(value) -> tuple:
    """A convolution's or pooling's spatial ``pad`` as ``((top, bottom), (left, right))``, from
    one integer (every side), a pair ``[h, w]`` (symmetric per dim) or a pair of ``[before,
    after]`` pairs ``[[top, bottom], [left, right]]`` (per side, the way a layout's
    ``paddings`` are written: ONNX's asymmetric ``pads``). Shared by the spec and the graph."""
    def count(v):
        return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0

    seq = value if isinstance(value, (list, tuple)) else None
    if count(value):
        pairs = ((int(value),) * 2,) * 2
    elif seq is not None and len(seq) == 2 and all(count(v) for v in seq):
        pairs = tuple((int(v), int(v)) for v in seq)
    elif seq is not None and len(seq) == 2 and all(
            isinstance(p, (list, tuple)) and len(p) == 2 and all(count(v) for v in p) for p in seq):
        pairs = tuple((int(a), int(b)) for a, b in seq)
    else:
        raise LayoutError(f"pad: expected an integer >= 0, a pair [h, w] of them or a pair of "
                          f"[before, after] pairs [[top, bottom], [left, right]]; got {value!r}")
    return pairs


def pad_sides_param(pairs) -> list:
    """The recorded form of a ``pad_sides``: ``[h, w]`` when each dim is symmetric (the form
    kernels had before per-side pads, so their names and cache keys stay), else the pairs."""
    if all(a == b for a, b in pairs):
        return [a for a, _ in pairs]
    return [list(p) for p in pairs]


def window_out_size(n, kernel, stride, pad, dilation=1, ceil_mode=False) -> int:
    """Output extent of a sliding window (convolution, pooling) over ``n`` cells padded by
    ``pad = (before, after)``. ``ceil_mode`` rounds up (PyTorch's and ONNX's pooling), but no
    window may start in the ``after`` padding: one that would is dropped, as PyTorch and ONNX
    Runtime do."""
    span = n + pad[0] + pad[1] - dilation * (kernel - 1) - 1
    if not ceil_mode:
        return span // stride + 1
    out = -(-span // stride) + 1
    return out - 1 if (out - 1) * stride >= n + pad[0] else out


@dataclass(frozen=True)
class PhysicalDim:
    """One dim of the physical buffer: the outer part of logical dim ``dim`` or one of its blocks."""

    dim: int        # logical dim it indexes
    letter: str     # its letter in the tag (upper case for an outer part)
    size: int       # extent in the buffer, halo included
    block: int      # 0 for the outer part, else the block size
    divisor: int    # for a block: product of the blocks of the same dim nested inside it


@dataclass(frozen=True)
class Layout:
    """A logical tensor ``shape`` of ``dtype`` laid out in memory as ``tag`` says.

    ``paddings``: spatial halo per logical dim, ``(before, after)`` in elements, given as a
    sequence of pairs (one per dim) or a mapping from dim letter or index to a pair. For a
    blocked dim the halo must be a whole number of blocks.
    ``strides``: physical strides in elements, outer to inner; compact when omitted.
    """

    tag: str
    shape: tuple
    dtype: str = "float32"
    paddings: tuple = None
    strides: tuple = None

    def __post_init__(self):
        if not isinstance(self.tag, str):
            raise LayoutError(f"tag: expected a string such as 'nChw16c'; got {self.tag!r}")
        shape = _int_tuple(self.shape, "shape")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        letters, tokens = _parse_tag(self.tag)
        if len(letters) != len(shape):
            raise LayoutError(
                f"tag {self.tag!r} has {len(letters)} dims ({', '.join(letters)}); "
                f"shape {shape} has {len(shape)}")
        for d, n in enumerate(shape):
            if n <= 0:
                raise LayoutError(f"shape: dim {letters[d]} (index {d}) must be positive; got {n}")
        object.__setattr__(self, "_letters", letters)
        object.__setattr__(self, "_tokens", tokens)
        object.__setattr__(self, "paddings", _normalise_paddings(self.paddings, letters))
        for d, (before, after) in enumerate(self.paddings):
            block = self.block_of(d)
            if before % block or after % block:
                raise LayoutError(
                    f"paddings: dim {letters[d]} is blocked by {block}, so its halo must be a "
                    f"multiple of {block}; got (before={before}, after={after})")
        if self.strides is not None:
            object.__setattr__(self, "strides", _int_tuple(self.strides, "strides"))
        self.validate()

    # ---- construction helpers -------------------------------------------------------------
    @classmethod
    def plain(cls, shape, dtype="float32") -> Layout:
        """Row-major layout with generic letters (``ab``, ``abcd``, ...)."""
        return cls(FAMILIES[0][: len(tuple(shape))], shape, dtype)

    @classmethod
    def from_blocks(cls, shape, dtype="float32", order=None, blocks=()) -> Layout:
        """Build a layout in code: ``order`` is the physical order of logical dims (outermost
        first), ``blocks`` a list of ``(dim, size)`` pairs innermost last."""
        rank = len(tuple(shape))
        order = tuple(range(rank)) if order is None else tuple(order)
        if sorted(order) != list(range(rank)):
            raise LayoutError(f"order: expected a permutation of 0..{rank - 1}; got {order}")
        blocked = {d for d, _ in blocks}
        letters = FAMILIES[0]
        tag = "".join(letters[d].upper() if d in blocked else letters[d] for d in order)
        tag += "".join(f"{int(b)}{letters[d]}" for d, b in blocks)
        return cls(tag, shape, dtype)

    def with_padding(self, **halo) -> Layout:
        """Same layout with a spatial halo, e.g. ``with_padding(h=(1, 1), w=(0, 2))``."""
        pads = dict(enumerate(self.paddings))
        pads.update({self._dim_index(k): v for k, v in halo.items()})
        return Layout(self.tag, self.shape, self.dtype, tuple(pads[d] for d in range(self.rank)),
                      self.strides)

    def acl(self, left=0, right=0, top=0, bottom=0) -> Layout:
        """Arm Compute Library padding: left/right on the innermost logical dim, top/bottom on the
        one before it (W and H for NCHW)."""
        if self.rank < 2:
            raise LayoutError(f"acl padding needs rank >= 2; layout {self.tag!r} has {self.rank}")
        pads = list(self.paddings)
        pads[-1], pads[-2] = (left, right), (top, bottom)
        return Layout(self.tag, self.shape, self.dtype, tuple(pads), self.strides)

    def with_strides(self, strides) -> Layout:
        return Layout(self.tag, self.shape, self.dtype, self.paddings, strides)

    # ---- what the layout knows ------------------------------------------------------------
    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def dims(self) -> str:
        """Logical dim letters in logical order, e.g. ``'nchw'``."""
        return self._letters

    @property
    def itemsize(self) -> int:
        return numpy_dtype(self.dtype).itemsize

    def block_of(self, dim) -> int:
        """Product of the inner blocks of logical dim ``dim`` (1 if not blocked)."""
        d = self._dim_index(dim)
        return math.prod(b for t, b in self._tokens if t == d and b)

    @property
    def blocks(self) -> tuple:
        return tuple(self.block_of(d) for d in range(self.rank))

    @property
    def is_blocked(self) -> bool:
        return any(b > 1 for b in self.blocks)

    @functools.cached_property
    def padded_shape(self) -> tuple:
        """Logical shape rounded up to whole blocks (oneDNN's padded dims)."""
        return tuple(-(-n // b) * b for n, b in zip(self.shape, self.blocks))

    @functools.cached_property
    def physical(self) -> tuple:
        """The physical dims, outermost first."""
        out = []
        for i, (d, b) in enumerate(self._tokens):
            letter = self._letters[d]
            if b:
                inner = math.prod(bb for dd, bb in self._tokens[i + 1:] if dd == d and bb)
                out.append(PhysicalDim(d, letter, b, b, inner))
            else:
                block = self.block_of(d)
                size = (self.padded_shape[d] + sum(self.paddings[d])) // block
                out.append(PhysicalDim(d, letter.upper() if block > 1 else letter, size, 0, block))
        return tuple(out)

    @functools.cached_property
    def physical_shape(self) -> tuple:
        return tuple(p.size for p in self.physical)

    @functools.cached_property
    def physical_strides(self) -> tuple:
        """Strides in elements of the physical dims (the given ones, or compact)."""
        if self.strides is not None:
            return self.strides
        sizes = self.physical_shape
        return tuple(math.prod(sizes[i + 1:]) for i in range(len(sizes)))

    @functools.cached_property
    def elem_offset(self) -> int:
        """Position of logical element 0 in the buffer (non-zero when there is a halo)."""
        return sum(self.paddings[p.dim][0] // p.divisor * s
                   for p, s in zip(self.physical, self.physical_strides) if not p.block)

    @functools.cached_property
    def alloc_len(self) -> int:
        """Exact number of elements the buffer needs: one past the last addressable element."""
        return sum((n - 1) * s for n, s in zip(self.physical_shape, self.physical_strides)) + 1

    @property
    def nbytes(self) -> int:
        return self.alloc_len * self.itemsize

    @functools.cached_property
    def has_padding(self) -> bool:
        return math.prod(self.physical_shape) != math.prod(self.shape)

    @functools.cached_property
    def is_plain(self) -> bool:
        """Row-major over the logical dims with no padding and compact strides: a numpy array
        of the logical shape is already this layout."""
        return (not self.has_padding and self.physical_strides == self.plain(self.shape).physical_strides
                and [p.dim for p in self.physical] == list(range(self.rank)))

    def validate(self) -> Layout:
        """Check the stride rule of seed 002 and the halo; raise LayoutError naming the dim."""
        phys = self.physical
        if self.strides is not None:
            if len(self.strides) != len(phys):
                raise LayoutError(
                    f"strides: layout {self.tag!r} has {len(phys)} physical dims "
                    f"({''.join(p.letter if not p.block else f'{p.block}{p.letter}' for p in phys)}); "
                    f"got {len(self.strides)} strides {self.strides}")
            for i, s in enumerate(self.strides):
                if s <= 0:
                    raise LayoutError(f"strides: physical dim {i} must have a positive stride; got {s}")
            for i in range(1, len(phys)):
                need = self.strides[i] * phys[i].size
                if self.strides[i - 1] < need:
                    raise LayoutError(
                        f"strides: physical dim {i - 1} ({phys[i - 1].letter}) has stride "
                        f"{self.strides[i - 1]}, less than stride {self.strides[i]} x size "
                        f"{phys[i].size} = {need} of the dim inside it; the dims would overlap")
        if self.rank > MAX_RANK:
            raise LayoutError(f"rank: at most {MAX_RANK} dims; got {self.rank}")
        return self

    # ---- index maps -----------------------------------------------------------------------
    # Each works on Python ints, numpy index arrays and TVM PrimExprs alike: ``//`` and ``%``
    # are floor division on all three.
    def to_physical(self, idx: Sequence) -> tuple:
        """Logical index -> physical index (halo offset included)."""
        out = []
        for p in self.physical:
            x = idx[p.dim]
            if p.block:
                out.append((x // p.divisor if p.divisor > 1 else x) % p.block)
            else:
                halo = self.paddings[p.dim][0] // p.divisor
                outer = x // p.divisor if p.divisor > 1 else x
                out.append(outer + halo if halo else outer)
        return tuple(out)

    def to_logical(self, pidx: Sequence) -> tuple:
        """Physical index -> logical index; out of ``[0, shape)`` exactly on padding."""
        terms = [[] for _ in range(self.rank)]
        for p, i in zip(self.physical, pidx):
            if p.block:
                terms[p.dim].append(i * p.divisor if p.divisor > 1 else i)
            else:
                halo = self.paddings[p.dim][0] // p.divisor
                outer = i - halo if halo else i
                terms[p.dim].insert(0, outer * p.divisor if p.divisor > 1 else outer)
        return tuple(functools.reduce(lambda a, b: a + b, t) for t in terms)

    def padding_conditions(self, pidx: Sequence) -> list:
        """Per logical dim that can be padded, the condition 'this physical index is padding
        along that dim'. ``is_padding`` is their disjunction."""
        logical = self.to_logical(pidx)
        conds = []
        for d, x in enumerate(logical):
            if self.paddings[d][0]:
                conds.append(x < 0)
            if self.padded_shape[d] != self.shape[d] or self.paddings[d][1]:
                conds.append(x >= self.shape[d])
        return conds

    def is_padding(self, pidx: Sequence):
        """True where a physical index holds padding rather than a logical element."""
        conds = self.padding_conditions(pidx)
        if not conds:
            return False
        if any(isinstance(c, np.ndarray) for c in conds):
            return functools.reduce(np.logical_or, conds)
        if all(isinstance(c, (bool, np.bool_)) for c in conds):
            return any(conds)
        from tvm import tirx  # a TVM expression: only the code generator gets here

        return tirx.any(*conds)

    def offset(self, pidx: Sequence):
        """Physical index -> element offset in the buffer."""
        return functools.reduce(lambda a, b: a + b,
                                (i * s for i, s in zip(pidx, self.physical_strides)))

    # ---- numpy views of the buffer --------------------------------------------------------
    def logical_offsets(self) -> np.ndarray:
        """Buffer offset of every logical element, an int64 array of the logical shape."""
        return _logical_offsets(self)

    def padding_offsets(self) -> np.ndarray:
        """Buffer offsets of every padding element (sorted, int64)."""
        return _padding_offsets(self)

    def describe(self) -> dict:
        """JSON-able form, the one manifests record; ``Layout.from_dict`` reads it back."""
        d = {"tag": self.tag, "shape": list(self.shape), "dtype": self.dtype}
        if any(any(p) for p in self.paddings):
            d["paddings"] = [list(p) for p in self.paddings]
        if self.strides is not None:
            d["strides"] = list(self.strides)
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> Layout:
        return cls(d["tag"], tuple(d["shape"]), d.get("dtype", "float32"),
                   d.get("paddings"), d.get("strides"))

    def __str__(self):
        extra = ""
        if any(any(p) for p in self.paddings):
            extra += " pad=" + ",".join(f"{self._letters[d]}{b}+{a}" for d, (b, a)
                                         in enumerate(self.paddings) if b or a)
        if self.strides is not None:
            extra += f" strides={self.strides}"
        return f"{self.tag}{list(self.shape)} {self.dtype}{extra}"

    def _dim_index(self, dim) -> int:
        if isinstance(dim, str):
            if dim.lower() not in self._letters:
                raise LayoutError(f"dim {dim!r}: layout {self.tag!r} has dims {', '.join(self._letters)}")
            return self._letters.index(dim.lower())
        if not 0 <= dim < self.rank:
            raise LayoutError(f"dim {dim}: layout {self.tag!r} has dims 0..{self.rank - 1}")
        return dim


def _int_tuple(value, what) -> tuple:
    try:
        out = tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise LayoutError(f"{what}: expected a sequence of integers; got {value!r}") from None
    if any(o != v for o, v in zip(out, value)):
        raise LayoutError(f"{what}: expected integers; got {value!r}")
    return out


@functools.lru_cache(maxsize=512)
def _parse_tag(tag: str):
    """``'nChw16c'`` -> (``'nchw'``, [(0, 0), (1, 0), (2, 0), (3, 0), (1, 16)])."""
    if not tag or _TOKEN.sub("", tag):
        raise LayoutError(f"tag {tag!r}: expected letters and <number><letter> blocks, e.g. 'nChw16c'")
    lower = {m[1] or m[2].lower() for m in _TOKEN.findall(tag)}
    family = next((f for f in FAMILIES if lower <= set(f)), None)
    if family is None:
        raise LayoutError(
            f"tag {tag!r}: letters {''.join(sorted(lower))} mix families; use one of "
            f"{', '.join(FAMILIES)} (abcdef generic, ncdhw activations, goidhw weights)")
    letters = "".join(c for c in family if c in lower)
    if family == FAMILIES[0] and letters != family[: len(letters)]:
        raise LayoutError(f"tag {tag!r}: generic dims must be a, b, c, ... without gaps; got {letters}")
    tokens, seen, blocked_letters = [], set(), set()
    for num, bl, whole in _TOKEN.findall(tag):
        if num:
            if int(num) < 1:
                raise LayoutError(f"tag {tag!r}: block size must be positive; got {num}{bl}")
            tokens.append((letters.index(bl), int(num)))
            blocked_letters.add(bl)
            continue
        low = whole.lower()
        if low in seen:
            raise LayoutError(f"tag {tag!r}: dim {low} appears twice")
        seen.add(low)
        tokens.append((letters.index(low), 0))
    missing = [c for c in letters if c not in seen]
    if missing:
        raise LayoutError(f"tag {tag!r}: dim {', '.join(missing)} is blocked but has no outer "
                          f"part; write it in upper case, e.g. {missing[0].upper()}")
    for _num, _block, whole in _TOKEN.findall(tag):
        if whole and whole.isupper() and whole.lower() not in blocked_letters:
            raise LayoutError(f"tag {tag!r}: {whole} is upper case (blocked) but has no block; "
                              f"add one, e.g. 16{whole.lower()}, or write {whole.lower()}")
        if whole and whole.islower() and whole in blocked_letters:
            raise LayoutError(f"tag {tag!r}: {whole} has blocks, so its outer part is written "
                              f"{whole.upper()}")
    if len(letters) > MAX_RANK:
        raise LayoutError(f"tag {tag!r}: at most {MAX_RANK} dims; got {len(letters)}")
    return letters, tuple(tokens)


def _normalise_paddings(paddings, letters) -> tuple:
    rank = len(letters)
    if paddings is None:
        return ((0, 0),) * rank
    if isinstance(paddings, Mapping):
        out = [(0, 0)] * rank
        for k, v in paddings.items():
            d = letters.index(k.lower()) if isinstance(k, str) and k.lower() in letters else k
            if not isinstance(d, int) or not 0 <= d < rank:
                raise LayoutError(f"paddings: unknown dim {k!r}; dims are {', '.join(letters)}")
            out[d] = v
        paddings = out
    paddings = list(paddings)
    if len(paddings) != rank:
        raise LayoutError(f"paddings: expected {rank} (before, after) pairs; got {len(paddings)}")
    out = []
    for d, p in enumerate(paddings):
        pair = _int_tuple(p, f"paddings[{letters[d]}]")
        if len(pair) != 2 or min(pair) < 0:
            raise LayoutError(f"paddings: dim {letters[d]} needs a (before, after) pair of "
                              f"non-negative integers; got {p!r}")
        out.append(pair)
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _logical_offsets(layout: Layout) -> np.ndarray:
    # offset = sum over dims of a term that depends on that dim's index only: build each term on
    # a 1-D arange and broadcast.
    base = layout.elem_offset
    total = np.full((1,) * layout.rank, base, np.int64)
    for d, n in enumerate(layout.shape):
        idx = [0] * layout.rank
        idx[d] = np.arange(n, dtype=np.int64)
        term = layout.offset(layout.to_physical(idx)) - base
        total = total + np.reshape(term, [n if e == d else 1 for e in range(layout.rank)])
    total.setflags(write=False)
    return total


@functools.lru_cache(maxsize=64)
def _padding_offsets(layout: Layout) -> np.ndarray:
    grid = np.indices(layout.physical_shape, dtype=np.int64, sparse=True)
    mask = np.broadcast_to(layout.is_padding(list(grid)), layout.physical_shape)
    offsets = np.broadcast_to(layout.offset(list(grid)), layout.physical_shape)[mask]
    offsets.sort()
    offsets.setflags(write=False)
    return offsets
