"""HPACK (RFC 7541): the header compression of the EPP's HTTP/2 connections.

Owns decoding header blocks (static and dynamic tables, prefixed integers, Huffman-coded
strings) and encoding the few header blocks the EPP sends: literals without indexing and
without Huffman, which every decoder accepts and which leave the peer's dynamic table alone.
"""

from __future__ import annotations

from collections import deque

STATIC_TABLE: tuple[tuple[bytes, bytes], ...] = tuple(
    (name.encode(), value.encode())
    for name, value in [
        (":authority", ""),
        (":method", "GET"),
        (":method", "POST"),
        (":path", "/"),
        (":path", "/index.html"),
        (":scheme", "http"),
        (":scheme", "https"),
        (":status", "200"),
        (":status", "204"),
        (":status", "206"),
        (":status", "304"),
        (":status", "400"),
        (":status", "404"),
        (":status", "500"),
        ("accept-charset", ""),
        ("accept-encoding", "gzip, deflate"),
        ("accept-language", ""),
        ("accept-ranges", ""),
        ("accept", ""),
        ("access-control-allow-origin", ""),
        ("age", ""),
        ("allow", ""),
        ("authorization", ""),
        ("cache-control", ""),
        ("content-disposition", ""),
        ("content-encoding", ""),
        ("content-language", ""),
        ("content-length", ""),
        ("content-location", ""),
        ("content-range", ""),
        ("content-type", ""),
        ("cookie", ""),
        ("date", ""),
        ("etag", ""),
        ("expect", ""),
        ("expires", ""),
        ("from", ""),
        ("host", ""),
        ("if-match", ""),
        ("if-modified-since", ""),
        ("if-none-match", ""),
        ("if-range", ""),
        ("if-unmodified-since", ""),
        ("last-modified", ""),
        ("link", ""),
        ("location", ""),
        ("max-forwards", ""),
        ("proxy-authenticate", ""),
        ("proxy-authorization", ""),
        ("range", ""),
        ("referer", ""),
        ("refresh", ""),
        ("retry-after", ""),
        ("server", ""),
        ("set-cookie", ""),
        ("strict-transport-security", ""),
        ("transfer-encoding", ""),
        ("user-agent", ""),
        ("vary", ""),
        ("via", ""),
        ("www-authenticate", ""),
    ]
)
_ENTRY_OVERHEAD = 32  # bytes a dynamic table entry counts beyond its name and value

# Code lengths of the 256 octets and EOS in the canonical Huffman code of RFC 7541 Appendix B
# (codes of one length are consecutive, in symbol order: the lengths define the code).
_HUFFMAN_LENGTHS = bytes(
    [13, 23, *[28] * 7, 24, 30, 28, 28, 30, *[28] * 8, 30, *[28] * 9]  # 0-31
    + [6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6]  # ' ' .. '/'
    + [5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12, 10]  # '0' .. '?'
    + [13, 6, *[7] * 22, 8, 7, 8, 13, 19, 13, 14, 6]  # '@' .. '_'
    + [15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6, 6, 5]  # '`' .. 'o'
    + [6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28]  # 'p' .. 127
    + [20, 22, 20, 20, 22, 22, 22, 23, 22, 23, 23, 23, 23, 23, 24, 23]  # 128-143
    + [24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24]  # 144-159
    + [22, 21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23]  # 160-175
    + [21, 21, 22, 21, 23, 22, 23, 23, 20, 22, 22, 22, 23, 22, 22, 23]  # 176-191
    + [26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25]  # 192-207
    + [19, 21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27]  # 208-223
    + [20, 24, 20, 21, 22, 21, 21, 23, 22, 22, 25, 25, 24, 24, 26, 23]  # 224-239
    + [26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26]  # 240-255
    + [30]  # EOS
)
EOS = 256


class HpackError(ValueError):
    """A header block that does not decode (a COMPRESSION_ERROR of the connection)."""


def huffman_codes() -> list[tuple[int, int]]:
    """``(code, length)`` of every symbol, built from the canonical code lengths."""
    order = sorted(range(len(_HUFFMAN_LENGTHS)), key=lambda s: (_HUFFMAN_LENGTHS[s], s))
    codes = [(0, 0)] * len(order)
    code, prev = -1, _HUFFMAN_LENGTHS[order[0]]
    for s in order:
        n = _HUFFMAN_LENGTHS[s]
        code = (code + 1) << (n - prev)
        prev = n
        codes[s] = (code, n)
    return codes


def _build_decoder() -> tuple[list[tuple[int, bytes, bool]], list[bool]]:
    """A nibble-driven state machine over the code tree: for state ``s`` (an inner node)
    and nibble ``x``, ``table[s * 16 + x]`` is (next state, octets emitted, EOS seen);
    ``accepting[s]``: ending there is valid padding (at most 7 bits, all ones)."""
    children: list[list[int]] = [[-1, -1]]  # inner nodes; a leaf is ~symbol
    for sym, (code, n) in enumerate(huffman_codes()):
        node = 0
        for i in range(n - 1, -1, -1):
            bit = (code >> i) & 1
            if i == 0:
                children[node][bit] = ~sym
            else:
                if children[node][bit] == -1:
                    children.append([-1, -1])
                    children[node][bit] = len(children) - 1
                node = children[node][bit]
    accepting = [False] * len(children)
    node, depth = 0, 0
    while node >= 0 and depth <= 7:  # the all-ones path from the root: valid padding
        accepting[node] = True
        node, depth = children[node][1], depth + 1
    table: list[tuple[int, bytes, bool]] = []
    for state in range(len(children)):
        for nibble in range(16):
            node, out, eos = state, bytearray(), False
            for i in (3, 2, 1, 0):
                nxt = children[node][(nibble >> i) & 1]
                if nxt < 0:
                    if ~nxt == EOS:
                        eos = True
                    else:
                        out.append(~nxt)
                    node = 0
                else:
                    node = nxt
            table.append((node, bytes(out), eos))
    return table, accepting


_HUFFMAN_TABLE, _ACCEPTING = _build_decoder()


def huffman_decode(data: bytes) -> bytes:
    table = _HUFFMAN_TABLE
    state = 0
    out = bytearray()
    for byte in data:
        state, emitted, eos = table[(state << 4) | (byte >> 4)]
        if eos:
            raise HpackError("EOS in a Huffman-coded string")
        out += emitted
        state, emitted, eos = table[(state << 4) | (byte & 15)]
        if eos:
            raise HpackError("EOS in a Huffman-coded string")
        out += emitted
    if not _ACCEPTING[state]:
        raise HpackError("bad padding of a Huffman-coded string")
    return bytes(out)


def huffman_encode(data: bytes) -> bytes:
    """(Tests and peers' side only: the EPP sends its literals raw.)"""
    codes = _CODES
    acc, nbits = 0, 0
    for byte in data:
        code, n = codes[byte]
        acc = (acc << n) | code
        nbits += n
    pad = -nbits % 8
    acc = (acc << pad) | ((1 << pad) - 1)
    return acc.to_bytes((nbits + pad) // 8, "big")


_CODES = huffman_codes()
_HUFFMAN_SEEN: dict[bytes, bytes] = {}  # Huffman-coded strings decoded lately


def encode_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """``value`` as an HPACK integer with a ``prefix_bits`` prefix; ``first``: the bits
    above the prefix in the first octet."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append((value & 127) | 128)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_literal(name: bytes, value: bytes) -> bytes:
    """A literal header field without indexing, new name, no Huffman."""
    return b"\x00" + encode_int(len(name), 7) + name + encode_int(len(value), 7) + value


def encode_headers(headers: list[tuple[bytes, bytes]]) -> bytes:
    """A header block: ``:status 200`` from the static table, the rest literals."""
    out = bytearray()
    for name, value in headers:
        if name == b":status" and value == b"200":
            out += b"\x88"
        else:
            out += encode_literal(name, value)
    return bytes(out)


class Decoder:
    """One connection's HPACK decoder (its dynamic table)."""

    def __init__(self, max_table_size: int = 4096) -> None:
        self.limit = max_table_size  # what we announced (SETTINGS_HEADER_TABLE_SIZE)
        self.max_size = max_table_size  # what the encoder set, at most ``limit``
        self.size = 0
        self.table: deque[tuple[bytes, bytes]] = deque()

    def _entry(self, index: int) -> tuple[bytes, bytes]:
        if index <= 0:
            raise HpackError("header index 0")
        if index <= len(STATIC_TABLE):
            return STATIC_TABLE[index - 1]
        index -= len(STATIC_TABLE) + 1
        if index >= len(self.table):
            raise HpackError("header index past the dynamic table")
        return self.table[index]

    def _add(self, name: bytes, value: bytes) -> None:
        size = len(name) + len(value) + _ENTRY_OVERHEAD
        self.table.appendleft((name, value))
        self.size += size
        self._evict()

    def _evict(self) -> None:
        while self.size > self.max_size and self.table:
            name, value = self.table.pop()
            self.size -= len(name) + len(value) + _ENTRY_OVERHEAD

    @staticmethod
    def _int(data: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
        limit = (1 << prefix_bits) - 1
        value = data[pos] & limit
        pos += 1
        if value < limit:
            return value, pos
        shift = 0
        while True:
            if pos >= len(data):
                raise HpackError("truncated integer")
            byte = data[pos]
            pos += 1
            value += (byte & 127) << shift
            shift += 7
            if not byte & 128:
                return value, pos
            if shift > 28:
                raise HpackError("integer too large")

    def _string(self, data: bytes, pos: int) -> tuple[bytes, int]:
        if pos >= len(data):
            raise HpackError("truncated string")
        huffman = data[pos] & 128
        length, pos = self._int(data, pos, 7)
        end = pos + length
        if end > len(data):
            raise HpackError("truncated string")
        raw = data[pos:end]
        if not huffman:
            return raw, end
        value = _HUFFMAN_SEEN.get(raw)
        if value is None:  # (a peer sends the same literals on every stream: ``:path``)
            if len(_HUFFMAN_SEEN) >= 1024:
                _HUFFMAN_SEEN.clear()
            value = _HUFFMAN_SEEN[raw] = huffman_decode(raw)
        return value, end

    def decode(self, data: bytes) -> list[tuple[bytes, bytes]]:
        """The header fields of one complete header block, in order."""
        out: list[tuple[bytes, bytes]] = []
        pos, n = 0, len(data)
        while pos < n:
            byte = data[pos]
            if byte & 128:  # indexed field
                index, pos = self._int(data, pos, 7)
                out.append(self._entry(index))
                continue
            if byte & 0xE0 == 0x20:  # dynamic table size update
                size, pos = self._int(data, pos, 5)
                if size > self.limit:
                    raise HpackError("table size update over the announced limit")
                self.max_size = size
                self._evict()
                continue
            indexing = byte & 0xC0 == 0x40
            index, pos = self._int(data, pos, 6 if indexing else 4)
            if index:
                name = self._entry(index)[0]
            else:
                name, pos = self._string(data, pos)
            value, pos = self._string(data, pos)
            if indexing:
                self._add(name, value)
            out.append((name, value))
        return out
