"""Where a compiled program's memory traffic goes: bytes per instruction of an optimized HLO
module's entry computation, grouped by what the model code calls them.

`cost_analysis()` gives one number, "bytes accessed", for a whole program. To say *what*
moves the bytes (an mHC kernel, the XLA code around it, a sub-layer, or the compiler's own
copies), `instruction_bytes` reads the compiled module's text (`compiled.as_text()`) and
prices each instruction of the entry computation the way the total is priced:

    bytes(instr) = size(result) + sum size(operand)        (logical sizes, no tile padding)

except: a Pallas kernel (`tpu_custom_call`) counts the `bytes_accessed` of the cost
estimate it was built with (its block specs' traffic: an operand passed several times but
read in parts is not counted several times); an async copy (`copy-start`) counts its
source read and written; an async slice (`slice-start`) the slice read and written; and
instructions that move nothing (parameters, constants, tuples and their elements,
bitcasts, the `-done` halves of async pairs) count 0. Instructions inside called
computations (fusion bodies, while loops) are not counted separately: a fusion is priced
by its operands and results, a loop body is not visited (as `cost_analysis()` counts a loop
body once, unscanned programs are the ones to read). Logical sizes leave out tile padding,
and the compiler prices some instructions otherwise, so the sum falls short of the
compiler's total (by about a quarter on the train steps `bench mhc_train` compiles, which
records the ratio as `parse_over_cost`): it is for splitting a difference between two
programs into parts, not a replacement for the total.

We parse text because no JAX API returns per-instruction costs of a compiled program.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import NamedTuple

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
               "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}  # fmt: skip
FREE_OPCODES = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast",
                          "copy-done", "slice-done", "after-all", "partition-id"})  # fmt: skip
_SHAPE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([0-9,]*)\]")
_INSTR = re.compile(r"\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9\-]*)\((.*?)\)(?:, |$)")
PARTS = ("mhc_kernels", "mhc_xla", "sublayers", "model_other", "compiler_inserted")


class OpBytes(NamedTuple):
    """One entry-computation instruction: its name, opcode, the model's op_name (metadata;
    "" for instructions the compiler made), custom-call target ("" if none), and bytes."""

    name: str
    opcode: str
    op_name: str
    target: str
    bytes: int


def shape_bytes(text: str) -> int:
    """Logical bytes of every array shape written in `text` (e.g. "(f32[8,128], s32[])")."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        size = 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        total += size * DTYPE_BYTES[dtype]
    return total


def _entry_lines(text: str) -> list[str]:
    lines = text.split("\n")
    start = next((i for i, line in enumerate(lines) if line.startswith("ENTRY")), None)
    if start is None:
        raise ValueError("no ENTRY computation in the HLO text (pass compiled.as_text())")
    body = []
    for line in lines[start + 1 :]:
        if line.startswith("}"):
            break
        body.append(line)
    return body


def instruction_bytes(text: str) -> list[OpBytes]:
    """The entry computation's instructions with their bytes (module docstring)."""
    sizes: dict[str, int] = {}
    out = []
    for line in _entry_lines(text):
        m = _INSTR.match(line)
        if not m:
            continue
        name, result, opcode, args = m.groups()
        sizes[name] = shape_bytes(_result_type(result))
        if opcode in FREE_OPCODES:
            continue
        operands = re.findall(r"%([^\s,)]+)", args)
        op_name = re.search(r'op_name="([^"]*)"', line)
        target = re.search(r'custom_call_target="([^"]*)"', line)
        estimate = re.search(r'"cost_estimate":\{[^}]*"bytes_accessed":"(\d+)"', line)
        if opcode == "custom-call" and estimate:
            b = int(estimate.group(1))
        elif opcode == "copy-start":
            b = 2 * sum(sizes.get(o, 0) for o in operands)
        elif opcode == "slice-start":  # ((source), slice, context): the slice, read + written
            parts = re.match(r"\(\((.*?)\), (.*?), ", result + ", ")
            b = 2 * shape_bytes(parts.group(2)) if parts else shape_bytes(result)
        else:
            b = shape_bytes(_result_type(result)) + sum(sizes.get(o, 0) for o in operands)
        out.append(OpBytes(name, opcode, op_name.group(1) if op_name else "",
                           target.group(1) if target else "", b))  # fmt: skip
    return out


def _result_type(result: str) -> str:
    """The result type without layouts (which may hold memory-space digits like S(1))."""
    return re.sub(r"\{[^}]*\}", "", result)


def part_of(op: OpBytes, mhc_scope: str = "_mix", sublayer_scopes=("/attn/", "/ffn/")) -> str:
    """The part of the model an instruction belongs to, by its op_name: "mhc_kernels" (a
    Pallas kernel under an mHC module), "sublayers" (attention, FFN: their scopes, which sit
    inside the mHC module that wraps them), "mhc_xla" (the rest of an mHC module: its
    coefficients, Sinkhorn, the first sub-layer's statistics), "model_other" (other named
    work: embedding, head, optimizer), "compiler_inserted" (no op_name: copies, async
    prefetches, relayouts)."""
    name = op.op_name
    if not name:
        return "compiler_inserted"
    if any(s in name for s in sublayer_scopes):
        return "sublayers"
    if mhc_scope in name:
        return "mhc_kernels" if op.target == "tpu_custom_call" else "mhc_xla"
    return "model_other"


def bytes_by_part(text: str) -> dict[str, int]:
    """{part: bytes} over `PARTS` (`part_of`) for a compiled module's text."""
    total = Counter({p: 0 for p in PARTS})
    for op in instruction_bytes(text):
        total[part_of(op)] += op.bytes
    return dict(total)
