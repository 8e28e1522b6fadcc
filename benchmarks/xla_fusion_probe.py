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
                for op in re.findall(r"%([\w.\-]+)", line.split("=", 1)[1].split("calls=")[0]):
                    if op in defs:
                        print("  operand:", defs[op][:600])
                called = re.search(r"calls=%?([\w.\-]+)", line)
                if called and called.group(1) in comps:
                    print(comps[called.group(1)][:4000])


if __name__ == "__main__":
    main()
