"""The plain-data channel between a sandboxed program and its judge: a codec and length-prefixed frames.

Standard library only: this module is loaded into the executor (``child.py``), where both the judge and
the sandbox use it, and it is importable by the harness for tests.

What crosses is data, never behaviour: ``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``,
``bytes``, ``bytearray``, ``Ellipsis``, and ``list``/``tuple``/``dict``/``set``/``frozenset`` of them.
A few value types of the standard library are rebuilt on the judge's side from plain parts, so that the
judge's own (trusted) class supplies their behaviour: ``range``, ``fractions.Fraction``,
``decimal.Decimal``, ``collections.deque``, dict views, and iterators (generators, ``map``, ``filter``,
``zip``...), which the sandbox drains and the judge receives as an iterator over a list. Anything else —
an instance of a class the program defined, a function, a module — arrives as an :class:`Opaque` token
that equals only itself, whatever ``__eq__`` the program gave it. A subclass of a plain type (an ``int``
subclass whose ``__eq__`` always says yes, ``collections.Counter``, a named tuple) arrives as its plain
base type, so its comparisons are the base type's.

``encode`` runs in the sandbox and may be replaced by the program: the judge trusts nothing it receives.
``decode`` runs in the judge and must survive any bytes: every error is a :class:`ChannelError`, sizes
and nesting are bounded, and nothing the bytes say is ever called.
"""

import struct

MAX_FRAME = 16 << 20  # bytes in one frame; a program that sends more breaks the channel (and fails)
MAX_DEPTH = 64  # nesting; HumanEval's values nest at most 3 deep
MAX_ITEMS = 1 << 22  # items drained from one iterator
MAX_VALUES = 1 << 22  # values in one decoded frame, all levels together (a 16 MiB frame could hold 16 Mi)
MAX_FRACTION_BYTES = 4096  # each of a Fraction's two integers: the judge's gcd on two 7 MB integers takes 38 s
_HEADER = struct.Struct(">I")
_F64 = struct.Struct("<d")
_C128 = struct.Struct("<dd")
_LEN = struct.Struct("<I")


class ChannelError(Exception):
    """The bytes are not a valid frame or value (in the judge: the program broke the channel)."""


class Unsupported(ValueError):
    """A value that cannot cross: too deep, cyclic, or an iterator too long to drain."""


class Opaque:
    """A value of a type that cannot cross; it equals only itself and has no other behaviour."""

    __slots__ = ("type_name",)

    def __init__(self, type_name):
        self.type_name = type_name

    def __repr__(self):
        return f"<opaque {self.type_name} from the sandbox>"


# ---- encoding (the sandbox side; also the judge's arguments) ------------------------------------------

_DICT_VIEWS: tuple[type, ...] = (type({}.keys()), type({}.values()), type({}.items()))


def encode(value):
    out = []
    _encode(value, out, 0, set())
    return b"".join(out)


def _int_bytes(n):
    return n.to_bytes((n + (n < 0)).bit_length() // 8 + 1, "little", signed=True)


def _encode_items(tag, items, out, depth, active, key):
    if key in active:
        raise Unsupported("a value that contains itself cannot cross the channel")
    active.add(key)
    out.append(tag + _LEN.pack(len(items)))
    for item in items:
        _encode(item, out, depth + 1, active)
    active.discard(key)


def _encode(x, out, depth, active):
    if depth > MAX_DEPTH:
        raise Unsupported(f"values nested deeper than {MAX_DEPTH} cannot cross the channel")
    t = type(x)
    if x is None:
        out.append(b"N")
    elif t is bool:
        out.append(b"T" if x else b"F")
    elif t is int:
        b = _int_bytes(x)
        out.append(b"i" + _LEN.pack(len(b)) + b)
    elif t is float:
        out.append(b"f" + _F64.pack(x))
    elif t is str:
        b = x.encode("utf-8", "surrogatepass")
        out.append(b"s" + _LEN.pack(len(b)) + b)
    elif t is list or t is tuple or t is set or t is frozenset:
        tag = {list: b"l", tuple: b"t", set: b"S", frozenset: b"Z"}[t]
        _encode_items(tag, list(x) if t in (set, frozenset) else x, out, depth, active, id(x))
    elif t is dict:
        flat = []
        for k, v in x.items():
            flat.append(k)
            flat.append(v)
        _encode_items(b"d", flat, out, depth, active, id(x))
    elif t is bytes or t is bytearray:
        out.append((b"b" if t is bytes else b"B") + _LEN.pack(len(x)) + bytes(x))
    elif t is complex:
        out.append(b"c" + _C128.pack(x.real, x.imag))
    elif x is Ellipsis:
        out.append(b"E")
    elif t is range:
        for n, tag in ((x.start, b"r"), (x.stop, b""), (x.step, b"")):
            b = _int_bytes(n)
            out.append(tag + _LEN.pack(len(b)) + b)
    elif t in _DICT_VIEWS:
        kind = _DICT_VIEWS.index(t)
        items = list(x)
        if kind == 2:
            items = [tuple(i) for i in items]
        _encode_items(b"KVI"[kind:kind + 1], items, out, depth, active, id(x))
    else:
        _encode_other(x, t, out, depth, active)


def _encode_other(x, t, out, depth, active):
    import sys

    # a subclass of a plain type crosses as its base type (its own __eq__, __hash__... stay behind)
    for base, convert in ((int, int.__index__), (float, float.__float__), (str, str.__str__),
                          (bytes, bytes), (complex, complex), (list, list), (tuple, tuple),
                          (dict, dict), (set, set), (frozenset, frozenset), (bytearray, bytearray)):
        if issubclass(t, base):  # type(x), which a __class__ property cannot fake (isinstance can be)
            _encode(convert(x), out, depth, active)
            return
    fractions, decimal, collections = (sys.modules.get(m) for m in ("fractions", "decimal", "collections"))
    if fractions is not None and issubclass(t, fractions.Fraction):
        _encode_items(b"q", (int(x.numerator), int(x.denominator)), out, depth, active, id(x))
    elif decimal is not None and issubclass(t, decimal.Decimal):
        _encode_items(b"D", (str(decimal.Decimal.__str__(x)),), out, depth, active, id(x))
    elif collections is not None and issubclass(t, collections.deque):
        _encode_items(b"Q", (x.maxlen, list(x)), out, depth, active, id(x))
    elif hasattr(t, "__next__") and hasattr(t, "__iter__"):  # an iterator or generator: drained here
        items = []
        for item in x:
            items.append(item)
            if len(items) > MAX_ITEMS:
                raise Unsupported(f"an iterator of more than {MAX_ITEMS} items cannot cross the channel")
        _encode_items(b"X", items, out, depth, active, id(x))
    else:
        name = f"{getattr(t, '__module__', '?')}.{getattr(t, '__qualname__', '?')}"
        b = str(name)[:200].encode("utf-8", "replace")
        out.append(b"O" + _LEN.pack(len(b)) + b)


# ---- decoding (the judge side: hostile bytes) ------------------------------------------------------------

def decode(data):
    """The value in ``data``; raises ``ChannelError`` on anything malformed (and only that)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ChannelError("not bytes")
    data = bytes(data)
    try:
        value, end = _decode(data, 0, 0, [MAX_VALUES])
    except ChannelError:
        raise
    except (RecursionError, MemoryError) as exc:
        raise ChannelError(f"value too large: {type(exc).__name__}") from None
    except Exception as exc:  # struct errors, unhashable keys, bad utf-8, ...
        raise ChannelError(f"malformed value: {type(exc).__name__}: {exc}"[:300]) from None
    if end != len(data):
        raise ChannelError("trailing bytes after the value")
    return value


def _length(data, pos):
    if pos + 4 > len(data):
        raise ChannelError("truncated length")
    (n,) = _LEN.unpack_from(data, pos)
    return n, pos + 4


def _chunk(data, pos):
    n, pos = _length(data, pos)
    if pos + n > len(data):
        raise ChannelError("truncated chunk")
    return data[pos:pos + n], pos + n


def _items(data, pos, depth, budget):
    n, pos = _length(data, pos)
    if n > len(data) - pos:  # every item takes at least one byte
        raise ChannelError("item count larger than the frame")
    if n > budget[0]:  # refused before any of them is built
        raise ChannelError(f"more than {MAX_VALUES} values in one frame")
    items = []
    for _ in range(n):
        item, pos = _decode(data, pos, depth + 1, budget)
        items.append(item)
    return items, pos


def _dict(keys, values):
    # one insertion per bytecode step, so that the judge's timer can stop a flood of colliding keys
    d = {}
    for k, v in zip(keys, values):
        d[k] = v
    return d


def _set(items):
    s = set()
    for item in items:
        s.add(item)
    return s


_SINGLE = {78: None, 84: True, 70: False, 69: Ellipsis}  # N T F E


def _decode(data, pos, depth, budget):
    if depth > MAX_DEPTH:
        raise ChannelError("nested too deep")
    budget[0] -= 1
    if budget[0] < 0:
        raise ChannelError(f"more than {MAX_VALUES} values in one frame")
    if pos >= len(data):
        raise ChannelError("truncated value")
    tag = data[pos]
    pos += 1
    if tag in _SINGLE:
        return _SINGLE[tag], pos
    if tag == 105:  # i
        b, pos = _chunk(data, pos)
        return int.from_bytes(b, "little", signed=True), pos
    if tag == 102:  # f
        if pos + 8 > len(data):
            raise ChannelError("truncated float")
        return _F64.unpack_from(data, pos)[0], pos + 8
    if tag == 99:  # c
        if pos + 16 > len(data):
            raise ChannelError("truncated complex")
        re_, im = _C128.unpack_from(data, pos)
        return complex(re_, im), pos + 16
    if tag == 115:  # s
        b, pos = _chunk(data, pos)
        return b.decode("utf-8", "surrogatepass"), pos
    if tag == 98:  # b
        b, pos = _chunk(data, pos)
        return bytes(b), pos
    if tag == 66:  # B
        b, pos = _chunk(data, pos)
        return bytearray(b), pos
    if tag in (108, 116):  # l t
        items, pos = _items(data, pos, depth, budget)
        return (items if tag == 108 else tuple(items)), pos
    if tag in (83, 90):  # S Z
        items, pos = _items(data, pos, depth, budget)
        return (_set(items) if tag == 83 else frozenset(_set(items))), pos
    if tag == 100:  # d
        items, pos = _items(data, pos, depth, budget)
        if len(items) % 2:
            raise ChannelError("odd dict")
        return _dict(items[0::2], items[1::2]), pos
    if tag == 114:  # r
        b1, pos = _chunk(data, pos)
        b2, pos = _chunk(data, pos)
        b3, pos = _chunk(data, pos)
        return range(*(int.from_bytes(b, "little", signed=True) for b in (b1, b2, b3))), pos
    if tag in (75, 86, 73):  # K V I
        items, pos = _items(data, pos, depth, budget)
        if tag == 75:
            return _dict(items, [None] * len(items)).keys(), pos
        if tag == 86:
            return dict(enumerate(items)).values(), pos
        if not all(type(i) is tuple and len(i) == 2 for i in items):
            raise ChannelError("bad items view")
        return _dict([i[0] for i in items], [i[1] for i in items]).items(), pos
    if tag == 88:  # X
        items, pos = _items(data, pos, depth, budget)
        return iter(items), pos
    if tag == 113:  # q: two integer chunks, their sizes checked before either is built
        parts = []
        if data[pos:pos + 4] != _LEN.pack(2):
            raise ChannelError("bad fraction")
        pos += 4
        for _ in range(2):
            if data[pos:pos + 1] != b"i":
                raise ChannelError("bad fraction")
            b, pos = _chunk(data, pos + 1)
            if len(b) > MAX_FRACTION_BYTES:
                raise ChannelError(f"a Fraction's integers are limited to {MAX_FRACTION_BYTES} bytes each")
            parts.append(int.from_bytes(b, "little", signed=True))
        items = parts
        if items[1] == 0:
            raise ChannelError("bad fraction")
        import fractions

        return fractions.Fraction(items[0], items[1]), pos
    if tag == 68:  # D
        items, pos = _items(data, pos, depth, budget)
        if len(items) != 1 or type(items[0]) is not str or len(items[0]) > 10000:
            raise ChannelError("bad decimal")
        import decimal

        return decimal.Decimal(items[0]), pos
    if tag == 81:  # Q
        items, pos = _items(data, pos, depth, budget)
        if len(items) != 2 or type(items[1]) is not list or not (items[0] is None or type(items[0]) is int):
            raise ChannelError("bad deque")
        import collections

        return collections.deque(items[1], items[0]), pos
    if tag == 79:  # O
        b, pos = _chunk(data, pos)
        return Opaque(b.decode("utf-8", "replace")), pos
    raise ChannelError(f"unknown tag {tag}")


# ---- frames ---------------------------------------------------------------------------------------------

def frame(payload):
    return _HEADER.pack(len(payload)) + payload


class FrameReader:
    """Reads length-prefixed frames from a socket without trusting the peer (judge side)."""

    def __init__(self, sock, limit=MAX_FRAME):
        self.sock = sock
        self.limit = limit
        self.buffer = bytearray()

    def next_frame(self):
        """A complete frame if one is buffered, else None; raises ChannelError on an oversized header."""
        if len(self.buffer) < 4:
            return None
        (n,) = _HEADER.unpack_from(self.buffer, 0)
        if n > self.limit:
            raise ChannelError(f"frame of {n} bytes is over the {self.limit}-byte limit")
        if len(self.buffer) < 4 + n:
            return None
        payload = bytes(self.buffer[4:4 + n])
        del self.buffer[:4 + n]
        return payload

    def fill(self):
        """Read what is there (the socket is readable); returns False at end of stream."""
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            return False
        self.buffer += chunk
        if len(self.buffer) > self.limit + 4 + (1 << 20):
            raise ChannelError("the peer sent more than a frame's limit without a frame boundary")
        return True
