#!/usr/bin/env python3
"""Writes the safetensors fixtures used by tests/io/io_spec.lua and tests/c/test_io.c.

    python3 tests/data/make_fixtures.py        (from the repository root)

Each file is written by the `safetensors` Python package when it is installed
(`pip install safetensors numpy`), and the script checks that an independent pure-Python
writer of the format produces the very same bytes; without the package the pure-Python
writer is used. The values are exactly representable in every dtype, so the specs check
exact bit patterns. The files are tiny (a few hundred bytes each).

  mixed.safetensors        f32, i64, bf16, f16 tensors (incl. 0-dim and empty) + metadata
  plain.safetensors        two f32 tensors, no metadata
  unsupported.safetensors  an f32 tensor and an F64 tensor (fsdp must refuse the F64 one)
"""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))

# (name, dtype, shape, raw little-endian bytes)
def f32(vals): return struct.pack("<%df" % len(vals), *vals)
def i64(vals): return struct.pack("<%dq" % len(vals), *vals)
def u16(bits): return struct.pack("<%dH" % len(bits), *bits)

MIXED = [
    ("weight", "F32", [2, 3], f32([0.5, -1.25, 2.0, 3.75, -0.125, 100.0])),
    ("scalar", "F32", [], f32([3.5])),
    ("empty", "F32", [0, 4], b""),
    ("step", "I64", [], i64([7])),
    ("ids", "I64", [5], i64([0, -1, 2**40 + 3, 2**62 + 1, -2**63])),
    # bf16: 1.0, -2.5, 0.15625, 2^100
    ("bhalf", "BF16", [4], u16([0x3F80, 0xC020, 0x3E20, 0x7180])),
    # f16: 1.0, -0.5, 65504 (max), 2^-24 (smallest subnormal)
    ("half", "F16", [2, 2], u16([0x3C00, 0xB800, 0x7BFF, 0x0001])),
]
# One key only: the Python library keeps metadata in a hash map, so with several keys the order it
# writes them in changes from run to run (fsdp writes them sorted, one of those orders).
MIXED_META = {"note": "caf\u00e9 \"q\"\n\t/"}

PLAIN = [
    ("a.weight", "F32", [2, 2], f32([1.0, 2.0, 3.0, 4.0])),
    ("a.bias", "F32", [2], f32([-1.0, 0.25])),
]

UNSUPPORTED = [
    ("good", "F32", [2], f32([1.0, 2.0])),
    ("bad", "F64", [2], struct.pack("<2d", 1.0, 2.0)),
]

# the Python library orders tensors by dtype (descending in its enum), then by name
DTYPE_RANK = {"F64": 0, "I64": 1, "F32": 2, "BF16": 3, "F16": 4}


def serialize_pure(tensors, metadata):
    """The format written by hand: compact JSON, metadata first, spaces to a multiple of 8."""
    order = sorted(tensors, key=lambda t: (DTYPE_RANK[t[1]], t[0].encode()))
    parts, data, off = [], b"", 0
    if metadata is not None:
        items = ",".join(json.dumps(k, ensure_ascii=False) + ":" + json.dumps(v, ensure_ascii=False)
                         for k, v in sorted(metadata.items()))
        parts.append('"__metadata__":{' + items + "}")
    for name, dt, shape, raw in order:
        parts.append(json.dumps(name, ensure_ascii=False) + ':{"dtype":"%s","shape":[%s],"data_offsets":[%d,%d]}'
                     % (dt, ",".join(str(s) for s in shape), off, off + len(raw)))
        data += raw
        off += len(raw)
    header = ("{" + ",".join(parts) + "}").encode()
    header += b" " * ((8 - len(header) % 8) % 8)
    return struct.pack("<Q", len(header)) + header + data


def serialize_lib(tensors, metadata):
    """The same through the safetensors package (None if it is not installed)."""
    try:
        from safetensors import serialize
        from safetensors.numpy import TensorSpec  # safetensors >= 0.6
    except ImportError:
        return None
    import numpy as np
    names = {"F32": "float32", "I64": "int64", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
    keep, specs = [], {}
    for name, dt, shape, raw in tensors:
        buf = np.frombuffer(raw, dtype=np.uint8).copy() if raw else np.zeros(1, np.uint8)
        keep.append(buf)
        specs[name] = TensorSpec(dtype=names[dt], shape=tuple(shape), data_ptr=buf.ctypes.data, data_len=len(raw))
    return bytes(serialize(specs, metadata=metadata))


def write(fname, tensors, metadata=None):
    pure = serialize_pure(tensors, metadata)
    lib = serialize_lib(tensors, metadata)
    if lib is not None:
        assert lib == pure, "%s: the safetensors package and the pure writer disagree:\n%r\n%r" % (fname, lib, pure)
    with open(os.path.join(HERE, fname), "wb") as f:
        f.write(lib if lib is not None else pure)
    print("wrote %s (%d bytes, %s)" % (fname, len(pure), "safetensors package" if lib is not None else "pure Python"))


if __name__ == "__main__":
    write("mixed.safetensors", MIXED, MIXED_META)
    write("plain.safetensors", PLAIN)
    write("unsupported.safetensors", UNSUPPORTED)
    # independent read-back check with the library's own loader (numpy has no bfloat16: skip it)
    try:
        from safetensors import safe_open
    except ImportError:
        safe_open = None
    if safe_open is not None:
        with safe_open(os.path.join(HERE, "mixed.safetensors"), framework="numpy") as f:
            assert f.metadata() == MIXED_META
            assert f.get_tensor("weight").tolist() == [[0.5, -1.25, 2.0], [3.75, -0.125, 100.0]]
            assert f.get_tensor("ids").tolist() == [0, -1, 2**40 + 3, 2**62 + 1, -2**63]
            assert f.get_tensor("half").view("uint16").tolist() == [[0x3C00, 0xB800], [0x7BFF, 0x0001]]
            assert f.get_tensor("scalar").shape == () and f.get_tensor("empty").shape == (0, 4)
