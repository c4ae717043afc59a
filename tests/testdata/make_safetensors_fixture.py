#!/usr/bin/env python3
# Writes tests/testdata/fixture.safetensors with nothing but the Python standard library (struct,
# json): an independent writer for the project's reader to be checked against. Values are chosen
# to be exact in every dtype used. Regenerate with: python3 tests/testdata/make_safetensors_fixture.py
import json, os, struct

tensors = [  # name, dtype, shape, packed little-endian bytes
    ("a.weight", "F32", [2, 3], struct.pack("<6f", *[i * 0.5 - 1.0 for i in range(6)])),
    ("b.bias", "BF16", [4], b"".join(struct.pack("<I", struct.unpack("<I", struct.pack("<f", v))[0])[2:]
                                   for v in [1.0, -2.5, 0.15625, 65536.0])),
    ("c.half", "F16", [3], struct.pack("<3e", 0.5, -1.25, 2.0 ** -24)),
    ("d.ids", "I64", [2], struct.pack("<2q", 7, -3)),
]
header, data = {"__metadata__": {"format": "pt", "writer": "make_safetensors_fixture.py"}}, b""
for name, dtype, shape, raw in sorted(tensors):
    header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
    data += raw
text = json.dumps(header, separators=(",", ":")).encode()
text += b" " * (-len(text) % 8)
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixture.safetensors")
with open(out, "wb") as f:
    f.write(struct.pack("<Q", len(text)) + text + data)
print(out, os.path.getsize(out), "bytes")
