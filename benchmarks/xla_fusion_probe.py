"""Print the HLO of the fusions an XLA dump names (a sanitizer report names the device function
of a fusion, e.g. ``loop_maximum_fusion``): each instruction of that name in the optimized
modules of ``--xla_dump_to`` and the fused computation it calls, with the instructions that
produce its operands, so the report can be traced to the jax code that made them.

    XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text" python3 PROGRAM ...
    python3 benchmarks/xla_fusion_probe.py DIR loop_maximum_fusion
"""

import pathlib
import re
import sys


def computations(text: str) -> dict[str, str]:
    """The module's computations by name: their text from the header to the closing brace."""
    out, name, lines = {}, None, []
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m and name is None:
            name, lines = m.group(1), [line]
        elif name is not None:
            lines.append(line)
            if line == "}":
                out[name] = "\n".join(lines)
                name = None
    return out


def main():
    folder, fusion = pathlib.Path(sys.argv[1]), sys.argv[2]
    for path in sorted(folder.glob("*after_optimizations.txt")):
        text = path.read_text()
        if f"%{fusion} =" not in text and f" {fusion} =" not in text:
            continue
        comps = computations(text)
        defs = {m.group(1): line.strip() for line in text.splitlines() if (m := re.match(r"^\s+(?:ROOT )?%?([\w.\-]+) = ", line))}
        print(f"=== {path.name}")
        for line in text.splitlines():
            if re.match(rf"^\s+(?:ROOT )?%?{re.escape(fusion)} = ", line):
                print(line.strip()[:1500])
                for op in re.findall(r"%([\w.\-]+(?:#\d+)?)", line.split("=", 1)[1].split("calls=")[0]):
                    chase(op, defs, depth=0)
                called = re.search(r"calls=%?([\w.\-]+)", line)
                if called and called.group(1) in comps:
                    print(comps[called.group(1)][:8000])


def _operands(line: str) -> list[str]:
    """The operand names of an instruction line (``name#k``: element k of a tuple)."""
    args = line.split("=", 1)[1].split("calls=")[0].split("metadata=")[0]
    return re.findall(r"%([\w.\-]+(?:#\d+)?)", args)


def chase(op: str, defs: dict[str, str], depth: int, limit: int = 8):
    """Print the instruction making `op`, then those making its operands, `limit` levels deep
    (through tuples, to the element taken): where a fusion's input comes from."""
    name, _, element = op.partition("#")
    if depth > limit or name not in defs:
        return
    line = defs[name]
    print(f"{'  ' * (depth + 1)}<- {line[:400]}")
    operands = _operands(line)
    if " tuple(" in line and element:
        operands = operands[int(element) : int(element) + 1]
    for o in operands[:4]:
        chase(o, defs, depth + 1, limit)


if __name__ == "__main__":
    main()
