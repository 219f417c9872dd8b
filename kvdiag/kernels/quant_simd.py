"""The CPU quantization kernels of :mod:`kvdiag.kernels.quant_cpu`: LLVM vector code for one
block per call (16 groups per token, or one group of tokens across the head_dim per channel),
every value kept in 16-lane vectors from load to store, and the numba loops that walk a tensor
in those blocks.

Why LLVM IR (through numba intrinsics) rather than numba loops: the group minima and maxima per
token are horizontal reductions, and numba's loops reduce each group on its own (four
shuffle-and-min steps per group and per statistic). Here 16 groups are reduced together by a
transposing butterfly (16 + 8 + 4 + 2 + 1 vectors, about three operations per group), which
leaves the statistics of group ``g`` in lane ``g``: the fp16 scales and zeros of 16 groups are
then single vector conversions (``fptrunc``/``fpext``), and each group's codes come from its
broadcast lane. The vectors are LLVM's portable ``<16 x T>``: AVX-512 runs them as one register,
AVX2 as two, NEON as four; the results are the same everywhere.

Arithmetic is the torch reference's, step by step, in fp32 without fused multiply-add (no
fast-math flag is set on any instruction), so codes, scales and zeros are bit-identical
(:class:`_Int`, :class:`_Fp8`). Inputs are assumed free of NaN.

The format (``kind``: 8, 4, 2 integer bits, or -3, -2 for fp8 e4m3, e5m2), the group size and
the head_dim are compile-time constants: the loops are built per combination
(:func:`token_kernels`, :func:`channel_kernels`) and hand them to the blocks as literals.

Long: the vector blocks, the intrinsics that emit them and the loops built per format share
one set of code-generation helpers and constants, and are checked bit for bit as one unit.
"""

from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba import njit
from numba import uint64 as U
from numba.core import cgutils, types
from numba.core.errors import RequireLiteralValue
from numba.extending import intrinsic

from kvdiag.paths import use_numba_cache_dir

use_numba_cache_dir()  # read by numba when each loop below is decorated

# the loops are compiled per format and group size on first use and cached on disk; they live in
# this file so that an edit of the vector code above invalidates the cache (numba keys it on the
# file of the compiled function)
_JIT = dict(cache=True, nogil=True)

LANES = 16
I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F16, F32 = ir.HalfType(), ir.FloatType()


def _vt(t, n: int = LANES) -> ir.VectorType:
    return ir.VectorType(t, n)


def _bytes(t) -> int:
    """Size of one element of type ``t`` (the alignment of its loads and stores)."""
    return {F16: 2, F32: 4}.get(t) or t.width // 8


def _literal(ty) -> int:
    if not isinstance(ty, types.IntegerLiteral):
        raise RequireLiteralValue(f"{ty} must be a literal integer")
    return ty.literal_value


class _Vec:
    """Vector helpers over one llvmlite builder."""

    def __init__(self, context, builder):
        self.ctx, self.b = context, builder

    # ---------------------------------------------------------------- memory
    def data(self, aty, value):
        """Element pointer of a numba array argument."""
        return self.ctx.make_array(aty)(self.ctx, self.b, value).data

    def _ptr(self, base, index, offset: int, vty):
        p = self.b.gep(base, [self.b.add(index, ir.Constant(I64, offset)) if offset else index])
        return self.b.bitcast(p, vty.as_pointer())

    def load(self, base, index, offset: int, t, n: int = LANES):
        """``n`` consecutive elements of type ``t`` at ``base[index + offset]``."""
        return self.b.load(self._ptr(base, index, offset, _vt(t, n)), align=_bytes(t))

    def store(self, value, base, index, offset: int = 0):
        t = value.type.element
        self.b.store(value, self._ptr(base, index, offset, value.type), align=_bytes(t))

    # ---------------------------------------------------------------- lanes
    def splat(self, value, t=I32, n: int = LANES):
        return ir.Constant(_vt(t, n), [value] * n)

    def shuffle(self, a, b, lanes):
        return self.b.shuffle_vector(a, b if b is not None else ir.Constant(a.type, ir.Undefined),
                                     ir.Constant(_vt(I32, len(lanes)), list(lanes)))

    def lane(self, v, g: int):
        """Lane ``g`` of ``v`` in every lane."""
        return self.shuffle(v, None, [g] * LANES)

    # ---------------------------------------------------------------- integer and float ops
    def imax(self, a, c):
        return self.b.select(self.b.icmp_signed(">", a, c), a, c)

    def fmin(self, a, c):
        return self.b.select(self.b.fcmp_ordered("<", a, c), a, c)

    def fmax(self, a, c):
        return self.b.select(self.b.fcmp_ordered(">", a, c), a, c)

    def fclamp(self, v, lo, hi):
        """min(max(v, lo), hi); a -0.0 or anything not above ``lo`` becomes ``lo``."""
        v = self.b.select(self.b.fcmp_ordered(">", v, lo), v, lo)
        return self.b.select(self.b.fcmp_ordered("<", v, hi), v, hi)

    def ftrunc(self, v):
        name = f"llvm.trunc.v{v.type.count}f32"
        fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(v.type, [v.type]), name)
        return self.b.call(fn, [v])

    def as_f32(self, v):
        return self.b.bitcast(v, _vt(F32, v.type.count))

    def as_i32(self, v):
        return self.b.bitcast(v, _vt(I32, v.type.count))

    def to_f16(self, v):
        """(fp16 bits as <16 x i16>, their fp32 value): round to nearest even, as torch's cast."""
        h = self.b.fptrunc(v, _vt(F16, v.type.count))
        return self.b.bitcast(h, _vt(I16, v.type.count)), self.b.fpext(h, v.type)

    def from_f16(self, bits16):
        return self.b.fpext(self.b.bitcast(bits16, _vt(F16, bits16.type.count)), _vt(F32, bits16.type.count))

    def encode_inverse(self, s):
        """1 / scale, with 1 for a zero scale (a constant group encodes as 0)."""
        one = self.splat(1.0, F32, s.type.count)
        safe = self.b.select(self.b.fcmp_ordered(">", s, self.splat(0.0, F32, s.type.count)), s, one)
        return self.b.fdiv(one, safe)

    # ---------------------------------------------------------------- reductions
    def butterfly(self, vs, pick):
        """16 vectors, vector ``g`` holding 16 partial results of group ``g`` -> one vector whose
        lane ``g`` is group ``g``'s reduction by ``pick`` (each step halves the lanes per group
        and the number of vectors)."""
        width = LANES
        while len(vs) > 1:
            half = width // 2
            lo = [s * width + i for s in range(2 * LANES // width) for i in range(half)]
            hi = [s * width + half + i for s in range(2 * LANES // width) for i in range(half)]
            vs = [pick(self.shuffle(vs[i], vs[i + 1], lo), self.shuffle(vs[i], vs[i + 1], hi))
                  for i in range(0, len(vs), 2)]
            width = half
        return vs[0]

    def fold(self, vs, pick):
        """Lane-wise reduction of a list of vectors."""
        acc = vs[0]
        for v in vs[1:]:
            acc = pick(acc, v)
        return acc

    # ---------------------------------------------------------------- packing
    def pack(self, codes, bits: int):
        """Codes (i32 vectors of consecutive values) -> byte vectors, low bits first: adjacent
        fields are merged pairwise (even | odd << w) until they fill a byte."""
        vs, w = codes, bits
        while w < 8:
            pairs = [(vs[i], vs[i + 1]) for i in range(0, len(vs), 2)] if len(vs) > 1 else [(vs[0], None)]
            merged = []
            for a, c in pairs:
                n = a.type.count * (1 if c is None else 2)
                even, odd = self.shuffle(a, c, range(0, n, 2)), self.shuffle(a, c, range(1, n, 2))
                merged.append(self.b.or_(even, self.b.shl(odd, self.splat(w, n=n // 2))))
            vs, w = merged, 2 * w
        return [self.b.trunc(v, _vt(I8, v.type.count)) for v in vs]

    def unpack(self, payload, bits: int):
        """Bytes (<n x i8>) -> codes as i32 vectors of at most 16 consecutive values: each field
        is split into its low and high halves, interleaved, until fields are ``bits`` wide."""
        vs, w = [self.b.zext(payload, _vt(I32, payload.type.count))], 8
        while w > bits:
            w //= 2
            split = []
            for v in vs:
                n = v.type.count
                lo = self.b.and_(v, self.splat((1 << w) - 1, n=n))
                hi = self.b.lshr(v, self.splat(w, n=n))
                both = self.shuffle(lo, hi, [i // 2 + (n if i % 2 else 0) for i in range(2 * n)])
                split += [self.shuffle(both, None, range(i, i + LANES)) for i in range(0, 2 * n, LANES)] \
                    if 2 * n > LANES else [both]
            vs = split
        return vs

    # ---------------------------------------------------------------- fp8
    def fp8_bits(self, y, mant: int, bias: int):
        """fp32 (clamped to the fp8 range) -> fp8 bits in i32 lanes, round to nearest even (c10's
        fp8 casts without their overflow branch; measured faster than rounding with
        :meth:`fp8_round` and reading the bits off an fp16)."""
        c = self.splat
        u = self.as_i32(y)
        sign = self.b.and_(self.b.lshr(u, c(24)), c(0x80))
        u = self.b.and_(u, c(0x7FFFFFFF))
        shift = 23 - mant
        denorm = (127 - bias + 23 - mant + 1) << 23
        rounded = self.b.fadd(self.as_f32(u), self.as_f32(c(denorm)))
        sub = self.b.sub(self.as_i32(rounded), c(denorm))
        odd = self.b.and_(self.b.lshr(u, c(shift)), c(1))
        normal = self.b.add(self.b.add(u, c(((bias - 127) << 23) + (1 << (shift - 1)) - 1)), odd)
        normal = self.b.lshr(normal, c(shift))
        out = self.b.select(self.b.icmp_signed("<", u, c((128 - bias) << 23)), sub, normal)
        return self.b.or_(self.b.and_(out, c(0x7F)), sign)

    def fp8_value(self, code, mant: int, bias: int):
        """fp8 bits (i32 lanes) -> fp32 value (finite codes), exactly, through fp16: e5m2 is the
        upper byte of an fp16; e4m3's bits placed in an fp16 give the value times 2 ** -8
        (subnormals included)."""
        c = self.splat
        if mant == 2:
            h = self.b.shl(code, c(8))
        else:
            h = self.b.or_(self.b.shl(self.b.and_(code, c(0x7F)), c(7)), self.b.shl(self.b.and_(code, c(0x80)), c(8)))
        value = self.from_f16(self.b.trunc(h, _vt(I16)))
        return value if mant == 2 else self.b.fmul(value, self.splat(256.0, F32))

    def fp8_round(self, y, mant: int, bias: int, fmax: float):
        """fp32 -> the nearest fp8 value as fp32 (ties to even), the magnitude clamped to
        ``fmax`` first: adding and subtracting 2 ** (exponent + 23 - mant) rounds to the fp8
        spacing."""
        c = self.splat
        u = self.as_i32(y)
        mag = self.as_i32(self.fmin(self.as_f32(self.b.and_(u, c(0x7FFFFFFF))), self.splat(fmax, F32)))
        e = self.imax(self.b.and_(mag, c(0x7F800000)), c((128 - bias) << 23))
        step = self.as_f32(self.b.add(e, c((23 - mant) << 23)))
        r = self.b.fsub(self.b.fadd(self.as_f32(mag), step), step)
        return self.as_f32(self.b.or_(self.as_i32(r), self.b.and_(u, c(-0x80000000))))


# -------------------------------------------------------------------- the formats


class _Int:
    """Integer codes of ``bits`` bits: zero = fp16(min), scale = fp16((max - min) / qmax),
    code = trunc(clamp((x - zero) * (1 / scale) + 0.5, 0, qmax)), x_hat = code * scale + zero."""

    absmax = False

    def __init__(self, bits: int):
        self.bits, self.qmax = bits, float((1 << bits) - 1)

    def params(self, v: _Vec, lo, hi) -> dict:
        """Per lane (group or channel): fp16 bits to store, and fp32 zero, scale, 1 / scale."""
        z16, zf = v.to_f16(lo)
        s16, sf = v.to_f16(v.b.fdiv(v.b.fsub(hi, lo), v.splat(self.qmax, F32)))
        return {"s16": s16, "z16": z16, "zf": zf, "sf": sf, "inv": v.encode_inverse(sf)}

    def stored(self, v: _Vec, s16, z16) -> dict:
        return {"sf": v.from_f16(s16), "zf": v.from_f16(z16)}

    def _clamped(self, v: _Vec, x, p):
        """(x - zero) * (1 / scale) + 0.5 clamped to [0, qmax]: the code before truncation."""
        c = v.b.fadd(v.b.fmul(v.b.fsub(x, p["zf"]), p["inv"]), v.splat(0.5, F32))
        return v.fclamp(c, v.splat(0.0, F32), v.splat(self.qmax, F32))

    def codes(self, v: _Vec, x, p):
        return v.b.fptosi(self._clamped(v, x, p), _vt(I32))  # truncates, and the value is >= 0

    def x_hat(self, v: _Vec, x, p):
        return self.decode(v, v.ftrunc(self._clamped(v, x, p)), p)

    def decode(self, v: _Vec, code, p):
        """x_hat of codes (i32 lanes, or their fp32 values)."""
        if code.type.element != F32:
            code = v.b.uitofp(code, _vt(F32))
        return v.b.fadd(v.b.fmul(code, p["sf"]), p["zf"])


class _Fp8:
    """fp8 with ``mant`` mantissa bits: scale = fp16(absmax / fp8 max); x * (1 / scale) clamped to
    the fp8 range and rounded to the nearest fp8 value; x_hat = value * scale."""

    absmax = True
    bits = 8

    def __init__(self, mant: int):
        self.mant = mant
        self.bias, self.fmax = {3: (7, 448.0), 2: (15, 57344.0)}[mant]

    def params(self, v: _Vec, _lo, amax) -> dict:
        s16, sf = v.to_f16(v.b.fdiv(amax, v.splat(self.fmax, F32)))
        return {"s16": s16, "sf": sf, "inv": v.encode_inverse(sf)}

    def stored(self, v: _Vec, s16, _z16) -> dict:
        return {"sf": v.from_f16(s16)}

    def codes(self, v: _Vec, x, p):
        y = v.fclamp(v.b.fmul(x, p["inv"]), v.splat(-self.fmax, F32), v.splat(self.fmax, F32))
        return v.fp8_bits(y, self.mant, self.bias)

    def x_hat(self, v: _Vec, x, p):
        return v.b.fmul(v.fp8_round(v.b.fmul(x, p["inv"]), self.mant, self.bias, self.fmax), p["sf"])

    def decode(self, v: _Vec, code, p):
        return v.b.fmul(v.fp8_value(code, self.mant, self.bias), p["sf"])


def _format(kind):
    """``kind`` (a literal): 8, 4, 2 integer bits; -3, -2 fp8 with that many mantissa bits."""
    k = _literal(kind)
    return _Int(k) if k > 0 else _Fp8(-k)


def _per_byte(kind: int) -> int:
    return 8 // kind if kind > 0 else 1


# -------------------------------------------------------------------- per token: 16 groups a call


def _token_stats(v: _Vec, xdata, b, group: int, absmax: bool):
    """Per group of the block at ``x[b:]``: (min, max) as fp32 vectors, lane = group; or
    (None, absolute maximum) when ``absmax`` (on the magnitude bits, which order as the values).
    Minima of -0.0 and 0.0 may come out as either: x_hat is the same (x + -0.0 == x + 0.0)."""
    per = group // LANES
    los, his = [], []
    for g in range(LANES):
        if absmax:
            mags = [v.b.and_(v.load(xdata, b, (g * per + k) * LANES, I32), v.splat(0x7FFFFFFF))
                    for k in range(per)]
            his.append(v.fold(mags, v.imax))
        else:
            xs = [v.load(xdata, b, (g * per + k) * LANES, F32) for k in range(per)]
            los.append(v.fold(xs, v.fmin))
            his.append(v.fold(xs, v.fmax))
    if absmax:
        return None, v.as_f32(v.butterfly(his, v.imax))
    return v.butterfly(los, v.fmin), v.butterfly(his, v.fmax)


def _lanes_of(v: _Vec, p: dict, g: int) -> dict:
    """Group ``g``'s parameters broadcast to every lane."""
    return {name: v.lane(vec, g) for name, vec in p.items() if name in ("zf", "sf", "inv")}


@intrinsic
def token_round_trip(typingctx, x, out, b, kind, group):
    """x_hat of 16 groups of ``group`` values from ``x[b:]`` into ``out[b:]``."""
    fmt, ngroup = _format(kind), _literal(group)

    def codegen(context, builder, sig, args):
        v = _Vec(context, builder)
        xd, od = v.data(sig.args[0], args[0]), v.data(sig.args[1], args[1])
        p = fmt.params(v, *_token_stats(v, xd, args[2], ngroup, fmt.absmax))
        for g in range(LANES):
            pg = _lanes_of(v, p, g)
            for k in range(ngroup // LANES):
                off = g * ngroup + k * LANES
                v.store(fmt.x_hat(v, v.load(xd, args[2], off, F32), pg), od, args[2], off)
        return context.get_dummy_value()

    return types.void(x, out, b, kind, group), codegen


@intrinsic
def token_encode(typingctx, x, b, payload, pb, scale, zero, gi, kind, group):
    """Codes of 16 groups from ``x[b:]`` packed into ``payload[pb:]``; their fp16 scales (and
    zeros: integers) as uint16 bits into ``scale[gi:]`` (``zero[gi:]``)."""
    fmt, ngroup = _format(kind), _literal(group)
    chunk = 8 // fmt.bits  # code vectors packed into 16 bytes

    def codegen(context, builder, sig, args):
        v = _Vec(context, builder)
        xd, pd, sd, zd = (v.data(sig.args[i], args[i]) for i in (0, 2, 4, 5))
        p = fmt.params(v, *_token_stats(v, xd, args[1], ngroup, fmt.absmax))
        v.store(p["s16"], sd, args[6])
        if "z16" in p:
            v.store(p["z16"], zd, args[6])
        codes = []
        for g in range(LANES):
            pg = _lanes_of(v, p, g)
            codes += [fmt.codes(v, v.load(xd, args[1], g * ngroup + k * LANES, F32), pg)
                      for k in range(ngroup // LANES)]
        for i in range(0, len(codes), chunk):
            v.store(v.pack(codes[i:i + chunk], fmt.bits)[0], pd, args[3], i * LANES // chunk)
        return context.get_dummy_value()

    return types.void(x, b, payload, pb, scale, zero, gi, kind, group), codegen


@intrinsic
def token_decode(typingctx, payload, pb, scale, zero, gi, out, b, kind, group):
    """x_hat of 16 groups (payload at ``payload[pb:]``, fp16 bits at ``scale[gi:]``,
    ``zero[gi:]``) into ``out[b:]``."""
    fmt, ngroup = _format(kind), _literal(group)
    chunk = 8 // fmt.bits  # code vectors unpacked from 16 bytes

    def codegen(context, builder, sig, args):
        v = _Vec(context, builder)
        pd, sd, zd, od = (v.data(sig.args[i], args[i]) for i in (0, 2, 3, 5))
        zero16 = v.load(zd, args[4], 0, I16) if not fmt.absmax else None
        p = fmt.stored(v, v.load(sd, args[4], 0, I16), zero16)
        for i in range(0, ngroup, chunk):  # a block holds ``ngroup`` vectors of 16 values
            codes = v.unpack(v.load(pd, args[1], i * LANES // chunk, I8), fmt.bits)
            for k, code in enumerate(codes):
                pg = {name: v.lane(vec, (i + k) * LANES // ngroup) for name, vec in p.items()}
                v.store(fmt.decode(v, code, pg), od, args[6], (i + k) * LANES)
        return context.get_dummy_value()

    return types.void(payload, pb, scale, zero, gi, out, b, kind, group), codegen


# -------------------------------------------------------------------- per channel: a block of rows


def _chunks(vectors: int, per_byte: int):
    """(first vector, count) of the row's code vectors packed together: up to ``per_byte`` (16
    bytes), a power of two each."""
    out, i = [], 0
    while i < vectors:
        n = per_byte
        while n > vectors - i:
            n //= 2
        out.append((i, n))
        i += n
    return out


def _rows(v: _Vec, group: int):
    """A loop over the block's ``group`` rows (an LLVM loop, not unrolled: a group of 128
    tokens would otherwise be 128 copies of the row's code); yields the row index (i64)."""
    return cgutils.for_range(v.b, ir.Constant(I64, group))


def _at(v: _Vec, base, r, stride: int):
    """base + r * stride (i64)."""
    return v.b.add(base, v.b.mul(r, ir.Constant(I64, stride)))


def _channel_stats(v: _Vec, xdata, b, group: int, chans: int, absmax: bool):
    """Per channel of ``group`` rows of ``chans`` channels at ``x[b:]``: lists (one vector per 16
    channels) of (min, max), or (None, absmax)."""
    vecs = chans // LANES
    if absmax:
        accs = [cgutils.alloca_once_value(v.b, v.splat(0)) for _ in range(vecs)]
    else:
        accs = [(cgutils.alloca_once_value(v.b, v.splat(float("inf"), F32)),
                 cgutils.alloca_once_value(v.b, v.splat(float("-inf"), F32))) for _ in range(vecs)]
    with _rows(v, group) as loop:
        row = _at(v, b, loop.index, chans)
        for k, acc in enumerate(accs):
            if absmax:
                mag = v.b.and_(v.load(xdata, row, k * LANES, I32), v.splat(0x7FFFFFFF))
                v.b.store(v.imax(v.b.load(acc), mag), acc)
            else:
                x = v.load(xdata, row, k * LANES, F32)
                v.b.store(v.fmin(v.b.load(acc[0]), x), acc[0])
                v.b.store(v.fmax(v.b.load(acc[1]), x), acc[1])
    if absmax:
        return None, [v.as_f32(v.b.load(acc)) for acc in accs]
    return [v.b.load(lo) for lo, _ in accs], [v.b.load(hi) for _, hi in accs]


@intrinsic
def channel_round_trip(typingctx, x, out, b, kind, group, chans):
    """x_hat of ``group`` rows of ``chans`` channels (the whole head_dim) from ``x[b:]`` into
    ``out[b:]``, one group per channel."""
    fmt, ngroup, nchans = _format(kind), _literal(group), _literal(chans)

    def codegen(context, builder, sig, args):
        v = _Vec(context, builder)
        xd, od = v.data(sig.args[0], args[0]), v.data(sig.args[1], args[1])
        los, his = _channel_stats(v, xd, args[2], ngroup, nchans, fmt.absmax)
        params = [fmt.params(v, lo, hi) for lo, hi in zip(los or his, his)]
        with _rows(v, ngroup) as loop:
            row = _at(v, args[2], loop.index, nchans)
            for k, p in enumerate(params):
                v.store(fmt.x_hat(v, v.load(xd, row, k * LANES, F32), p), od, row, k * LANES)
        return context.get_dummy_value()

    return types.void(x, out, b, kind, group, chans), codegen


@intrinsic
def channel_encode(typingctx, x, b, payload, pb, scale, zero, si, kind, group, chans):
    """Codes of ``group`` rows of ``chans`` channels from ``x[b:]`` packed into ``payload[pb:]``
    (``chans / per_byte`` bytes a row); fp16 scales (and zeros) into ``scale[si:]``
    (``zero[si:]``)."""
    fmt, ngroup, nchans = _format(kind), _literal(group), _literal(chans)
    per_byte = 8 // fmt.bits

    def codegen(context, builder, sig, args):
        v = _Vec(context, builder)
        xd, pd, sd, zd = (v.data(sig.args[i], args[i]) for i in (0, 2, 4, 5))
        los, his = _channel_stats(v, xd, args[1], ngroup, nchans, fmt.absmax)
        params = [fmt.params(v, lo, hi) for lo, hi in zip(los or his, his)]
        for k, p in enumerate(params):
            v.store(p["s16"], sd, args[6], k * LANES)
            if "z16" in p:
                v.store(p["z16"], zd, args[6], k * LANES)
        with _rows(v, ngroup) as loop:
            row, prow = _at(v, args[1], loop.index, nchans), _at(v, args[3], loop.index, nchans // per_byte)
            codes = [fmt.codes(v, v.load(xd, row, k * LANES, F32), p) for k, p in enumerate(params)]
            for i, n in _chunks(len(codes), per_byte):
                v.store(v.pack(codes[i:i + n], fmt.bits)[0], pd, prow, i * LANES // per_byte)
        return context.get_dummy_value()

    return types.void(x, b, payload, pb, scale, zero, si, kind, group, chans), codegen


@intrinsic
def channel_decode(typingctx, payload, pb, scale, zero, si, out, b, kind, group, chans):
    fmt, ngroup, nchans = _format(kind), _literal(group), _literal(chans)
    per_byte = 8 // fmt.bits

    def codegen(context, builder, sig, args):
        v = _Vec(context, builder)
        pd, sd, zd, od = (v.data(sig.args[i], args[i]) for i in (0, 2, 3, 5))
        params = [fmt.stored(v, v.load(sd, args[4], k * LANES, I16),
                             None if fmt.absmax else v.load(zd, args[4], k * LANES, I16))
                  for k in range(nchans // LANES)]
        with _rows(v, ngroup) as loop:
            row, prow = _at(v, args[6], loop.index, nchans), _at(v, args[1], loop.index, nchans // per_byte)
            for i, n in _chunks(nchans // LANES, per_byte):
                raw = v.load(pd, prow, i * LANES // per_byte, I8, n * LANES // per_byte)
                for k, code in enumerate(v.unpack(raw, fmt.bits), start=i):
                    v.store(fmt.decode(v, code, params[k]), od, row, k * LANES)
        return context.get_dummy_value()

    return types.void(payload, pb, scale, zero, si, out, b, kind, group, chans), codegen


# -------------------------------------------------------------------- the loops
#
# Flat arrays: x / out [rows * T * D] fp32, the quantized tokens being the first ``quant`` of each
# row; payload [rows * quant * D // per_byte]. Per token, a row's groups are consecutive
# (``ng`` = quant * D // group of them; scale / zero [rows * ng]) and its last partial block goes
# through zero-filled scratch (a zero group has scale 0 and touches nothing else). Per channel,
# a block is ``group`` consecutive tokens of the whole head_dim; scale / zero
# [rows * (quant // group) * D]. fp8 has no zeros: its ``zero`` array is never read or written.


@functools.cache
def token_kernels(kind: int, group: int):
    """(round_trip, encode, decode) for format ``kind`` (:func:`_format`) in groups of ``group``
    values per token.
    Long: the three kernels are closures over one format's constants, compiled together, so they
    are defined in the one function that binds them."""
    per_byte = _per_byte(kind)
    block = LANES * group

    @njit(**_JIT)
    def round_trip(x, rows, t, d, quant, out):
        ng = quant * d // group
        full = ng - ng % LANES
        sx, so = np.zeros(block, np.float32), np.empty(block, np.float32)
        for r in range(rows):
            base = r * t * d
            for g0 in range(0, full, LANES):
                token_round_trip(x, out, U(base + g0 * group), kind, group)
            n = (ng - full) * group
            if n:
                b = base + full * group
                sx[:n] = x[b:b + n]
                token_round_trip(sx, so, U(0), kind, group)
                out[b:b + n] = so[:n]

    @njit(**_JIT)
    def encode(x, rows, t, d, quant, payload, scale, zero):
        ng = quant * d // group
        full = ng - ng % LANES
        sx, sp = np.zeros(block, np.float32), np.empty(block // per_byte, np.uint8)
        ss, sz = np.empty(LANES, np.uint16), np.empty(LANES, np.uint16)
        for r in range(rows):
            base = r * t * d
            for g0 in range(0, full, LANES):
                gi = r * ng + g0
                token_encode(x, U(base + g0 * group), payload, U(gi * group // per_byte), scale, zero, U(gi),
                             kind, group)
            tail = ng - full
            if tail:
                n, b, gi = tail * group, base + full * group, r * ng + full
                sx[:n] = x[b:b + n]
                token_encode(sx, U(0), sp, U(0), ss, sz, U(0), kind, group)
                pb = gi * group // per_byte
                payload[pb:pb + n // per_byte] = sp[:n // per_byte]
                scale[gi:gi + tail] = ss[:tail]
                if kind > 0:
                    zero[gi:gi + tail] = sz[:tail]

    @njit(**_JIT)
    def decode(payload, scale, zero, rows, t, d, quant, out):
        ng = quant * d // group
        full = ng - ng % LANES
        sp, so = np.zeros(block // per_byte, np.uint8), np.empty(block, np.float32)
        ss, sz = np.zeros(LANES, np.uint16), np.zeros(LANES, np.uint16)
        for r in range(rows):
            base = r * t * d
            for g0 in range(0, full, LANES):
                gi = r * ng + g0
                token_decode(payload, U(gi * group // per_byte), scale, zero, U(gi), out, U(base + g0 * group),
                             kind, group)
            tail = ng - full
            if tail:
                n, b, gi = tail * group, base + full * group, r * ng + full
                pb = gi * group // per_byte
                sp[:n // per_byte] = payload[pb:pb + n // per_byte]
                ss[:tail] = scale[gi:gi + tail]
                if kind > 0:
                    sz[:tail] = zero[gi:gi + tail]
                token_decode(sp, U(0), ss, sz, U(0), so, U(0), kind, group)
                out[b:b + n] = so[:n]

    return round_trip, encode, decode


@functools.cache
def channel_kernels(kind: int, group: int, chans: int):
    """(round_trip, encode, decode) for format ``kind`` in groups of ``group`` tokens per
    channel, head_dim ``chans``."""
    per_byte = _per_byte(kind)

    @njit(**_JIT)
    def round_trip(x, rows, t, d, quant, out):
        for r in range(rows):
            for tg in range(quant // group):
                channel_round_trip(x, out, U(r * t * d + tg * group * d), kind, group, chans)

    @njit(**_JIT)
    def encode(x, rows, t, d, quant, payload, scale, zero):
        blocks = quant // group
        for r in range(rows):
            for tg in range(blocks):
                channel_encode(x, U(r * t * d + tg * group * d), payload, U((r * quant + tg * group) * d // per_byte),
                               scale, zero, U((r * blocks + tg) * d), kind, group, chans)

    @njit(**_JIT)
    def decode(payload, scale, zero, rows, t, d, quant, out):
        blocks = quant // group
        for r in range(rows):
            for tg in range(blocks):
                channel_decode(payload, U((r * quant + tg * group) * d // per_byte), scale, zero,
                               U((r * blocks + tg) * d), out, U(r * t * d + tg * group * d), kind, group, chans)

    return round_trip, encode, decode
