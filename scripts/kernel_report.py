#!/usr/bin/env python3
"""Per-kernel report of a built extension: tensor-core instructions from its SASS and resources from ptxas.

    cuobjdump --dump-sass flash_attn_hopper/_C*.so > sass.txt
    python3 scripts/kernel_report.py --sass sass.txt --ptxas-log build.log --out kernels.txt

--sass: the output of ``cuobjdump --dump-sass``. Per function it counts HGMMA (warpgroup MMA) instructions, split
into SS (A and B from shared-memory descriptors, as for S = Q K^T) and RS (A from registers, as for O += P V),
their shapes, TMA loads/stores (UTMALDG/UTMASTG), register reallocation (USETMAXREG) and local-memory traffic
(LDL/STL: spills or stack arrays).
--ptxas-log: a build log made with ``-Xptxas=-v`` (setup.py's FAH_PTXAS_VERBOSE=1). Per entry function it reads
registers, stack frame, spill stores/loads and static shared memory, and ptxas's "Potential Performance Loss"
notes (wgmma serialized).

Exit status: 0 when every kernel whose name matches --hgmma-regex (and not --exclude-regex) has HGMMA and at least
one such kernel exists; 1 otherwise (also on spills with --fail-on-spill, on serialized wgmma with
--fail-on-serialized); 2 when an input is missing or empty. Spills and serialized wgmma are flagged, not failed, by
default.
"""

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys

_FUNC_RE = re.compile(r"^\s*Function\s*:\s*(\S+)\s*$")
_ARCH_RE = re.compile(r"^\s*code for (sm_\w+)")
_INSN_RE = re.compile(r"^\s*/\*[0-9a-fA-F]+\*/\s+(.*?)\s*;")
_PRED_RE = re.compile(r"^@!?U?P[T0-9]+\s+")

_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_PROPS_RE = re.compile(r"Function properties for (\S+)")
_FRAME_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_RE = re.compile(r"Used (\d+) registers")
_BARRIERS_RE = re.compile(r"used (\d+) barriers")
_SMEM_RE = re.compile(r"(\d+) bytes smem")
_CUMSTACK_RE = re.compile(r"(\d+) bytes cumulative stack size")
_PERFLOSS_RE = re.compile(r"(\(C\d+\) )?Potential Performance Loss: (.*?) in the function '([^']+)'")
_RU_FUNC_RE = re.compile(r"^\s*Function (\S+):\s*$")
_RU_LINE_RE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")

COUNTED = ("UTMALDG", "UTMASTG", "UTMAREDG", "USETMAXREG", "LDL", "STL", "SYNCS", "WARPGROUP", "BAR")


def parse_sass(text):
    """{mangled name: {"arch", "insns", "hgmma", "ss", "rs", "shapes": Counter, "ops": Counter, "copies"}}."""
    funcs = {}
    cur = None
    arch = None
    for line in text.splitlines():
        m = _ARCH_RE.match(line)
        if m:
            arch = m.group(1)
            continue
        m = _FUNC_RE.match(line)
        if m:
            name = m.group(1)
            if name in funcs:  # the same function in several cubins (e.g. one per translation unit)
                funcs[name]["copies"] += 1
                cur = None  # count instructions of the first copy only
            else:
                cur = funcs[name] = {
                    "arch": arch,
                    "insns": 0,
                    "hgmma": 0,
                    "ss": 0,
                    "rs": 0,
                    "shapes": collections.Counter(),
                    "ops": collections.Counter(),
                    "copies": 1,
                }
            continue
        if cur is None:
            continue
        m = _INSN_RE.match(line)
        if not m:
            continue
        insn = _PRED_RE.sub("", m.group(1).strip())
        if not insn:
            continue
        opcode, _, operands = insn.partition(" ")
        base = opcode.split(".")[0]
        cur["insns"] += 1
        if base == "HGMMA":
            cur["hgmma"] += 1
            ops = [o.strip() for o in operands.split(",")]
            kind = "SS" if len(ops) > 1 and ops[1].startswith("gdesc") else "RS"
            cur["ss" if kind == "SS" else "rs"] += 1
            cur["shapes"][f"{'.'.join(opcode.split('.')[1:])} {kind}"] += 1
        elif base in COUNTED:
            cur["ops"][base] += 1
    return funcs


def parse_ptxas(text):
    """{mangled name: {"entry", "arch", "regs", "barriers", "smem", "stack", "spill_st", "spill_ld", ...}}."""
    funcs = {}

    def get(name):
        return funcs.setdefault(
            name,
            {
                "entry": False,
                "arch": None,
                "regs": None,
                "barriers": None,
                "smem": None,
                "stack": None,
                "spill_st": None,
                "spill_ld": None,
                "local": None,
                "notes": set(),
                "seen": 0,
            },
        )

    def put_max(rec, key, value):
        rec[key] = value if rec[key] is None else max(rec[key], value)

    entry = None  # last "Compiling entry function"
    props = None  # last "Function properties for"
    ru_func = None  # resource-usage format (nvcc --resource-usage without -v)
    for line in text.splitlines():
        m = _PERFLOSS_RE.search(line)
        if m:
            get(m.group(3))["notes"].add(((m.group(1) or "").strip() + " " + m.group(2)).strip())
            continue
        m = _ENTRY_RE.search(line)
        if m:
            entry = m.group(1)
            rec = get(entry)
            rec["entry"] = True
            rec["arch"] = m.group(2)
            rec["seen"] += 1
            continue
        m = _PROPS_RE.search(line)
        if m:
            props = m.group(1)
            continue
        m = _FRAME_RE.search(line)
        if m and props:
            rec = get(props)
            put_max(rec, "stack", int(m.group(1)))
            put_max(rec, "spill_st", int(m.group(2)))
            put_max(rec, "spill_ld", int(m.group(3)))
            props = None
            continue
        m = _USED_RE.search(line)
        if m and entry:
            rec = get(entry)
            put_max(rec, "regs", int(m.group(1)))
            for key, rx in (("barriers", _BARRIERS_RE), ("smem", _SMEM_RE)):
                mm = rx.search(line)
                if mm:
                    put_max(rec, key, int(mm.group(1)))
            mm = _CUMSTACK_RE.search(line)
            if mm:
                put_max(rec, "stack", int(mm.group(1)))
            entry = None
            continue
        m = _RU_FUNC_RE.match(line)
        if m:
            ru_func = m.group(1)
            continue
        m = _RU_LINE_RE.search(line)
        if m and ru_func:
            rec = get(ru_func)
            rec["entry"] = True
            put_max(rec, "regs", int(m.group(1)))
            put_max(rec, "stack", int(m.group(2)))
            put_max(rec, "smem", int(m.group(3)))
            put_max(rec, "local", int(m.group(4)))
            ru_func = None
    return funcs


def demangle(names):
    """{mangled: demangled} through cu++filt or c++filt when present; names stay mangled otherwise."""
    names = list(names)
    for tool in ("cu++filt", "c++filt"):
        exe = shutil.which(tool)
        if not exe or not names:
            continue
        try:
            r = subprocess.run([exe], input="\n".join(names) + "\n", capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            continue
        out = r.stdout.splitlines()
        if r.returncode == 0 and len(out) == len(names):
            return dict(zip(names, out))
    return {n: n for n in names}


def shorten(name, depth=3, width=150):
    """Collapses template arguments nested deeper than `depth` to <…> and cuts to `width` characters."""
    out = []
    level = 0
    for ch in name:
        if ch == "<":
            level += 1
            if level == depth + 1:
                out.append("<…>")
            if level > depth:
                continue
        elif ch == ">":
            level -= 1
            if level >= depth:
                continue
        elif level > depth:
            continue
        out.append(ch)
    s = "".join(out)
    s = re.sub(r"\((.*)\)$", lambda m: "(…)" if m.group(1) else "()", s)  # drop the parameter list
    return s if len(s) <= width else s[: width - 1] + "…"


def _dtype_of(demangled):
    found = [
        tag
        for key, tag in (("bfloat16", "bf16"), ("half_t", "fp16"), ("__half", "fp16"), ("float_e4m3", "fp8"))
        if key in demangled
    ]
    return "/".join(dict.fromkeys(found)) or "-"


def _n(x):
    return "-" if x is None else str(x)


def build_report(sass, ptxas, hgmma_rx, exclude_rx, fail_on_spill, fail_on_serialized=False):
    """Returns (report text, verdict, problems, flags). With no SASS the HGMMA check is not run."""
    names = sorted(set(sass) | {n for n, r in ptxas.items() if r["entry"]})
    dem = demangle(names)
    lines = []
    problems = []  # failures
    flags = []  # warnings
    checked = []

    def is_gemm_kernel(n):
        text = n + " " + dem.get(n, n)
        return bool(hgmma_rx.search(text)) and not (exclude_rx and exclude_rx.search(text))

    rows = []
    for i, n in enumerate(names):
        s = sass.get(n)
        p = ptxas.get(n, {})
        must = bool(sass) and is_gemm_kernel(n)
        if must:
            checked.append(n)
            if s is None:
                flags.append(f"K{i}: in the ptxas report but not in the SASS dump (not linked, or no SASS given)")
            elif s["hgmma"] == 0:
                problems.append(f"K{i} has NO HGMMA instruction: {shorten(dem.get(n, n))}")
        spill = (p.get("spill_st") or 0) + (p.get("spill_ld") or 0)
        if spill:
            flags.append(
                f"K{i} spills: {p.get('spill_st')} bytes stores, {p.get('spill_ld')} bytes loads: "
                f"{shorten(dem.get(n, n))}"
            )
        for note in sorted(p.get("notes", ())):
            flags.append(f"K{i} ptxas: {note}")
        rows.append(
            "| K{} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
                i,
                shorten(dem.get(n, n)),
                _dtype_of(dem.get(n, n)),
                "yes" if must else "",
                _n(s and s["hgmma"]),
                _n(s and s["ss"]),
                _n(s and s["rs"]),
                _n(s and s["ops"]["UTMALDG"]),
                _n(s and s["ops"]["USETMAXREG"]),
                _n(s and (s["ops"]["LDL"] + s["ops"]["STL"])),
                _n(p.get("regs")),
                _n(p.get("stack")),
                _n(p.get("spill_st")),
                _n(p.get("spill_ld")),
                _n(p.get("smem")),
            )
        )
    if sass and not checked:
        problems.append(
            f"no kernel matches {hgmma_rx.pattern!r}: the forward kernels are missing or named otherwise "
            "(set FAH_HGMMA_KERNEL_REGEX)"
        )
    if fail_on_spill and any("spills:" in f for f in flags):
        problems.extend(f for f in flags if "spills:" in f)
    if fail_on_serialized:
        problems.extend(f for f in flags if " ptxas: " in f and "serialized" in f)

    header = (
        "| id | kernel | dtype | needs HGMMA | HGMMA | SS | RS | TMA ld | setmaxnreg | LDL+STL | regs | stack | "
        "spill st | spill ld | smem |"
    )
    lines.append(header)
    lines.append("|---" * (header.count("|") - 1) + "|")
    lines.extend(rows)
    lines.append("")
    lines.append(
        "HGMMA: warpgroup MMA instructions in the SASS; SS = both operands from shared memory (S = Q K^T), "
        "RS = A from registers (O += P V); TMA ld = UTMALDG; setmaxnreg = USETMAXREG; LDL+STL = local-memory "
        "instructions; regs/stack/spill (bytes)/smem (static bytes) from ptxas -v; '-' = not in that input."
    )
    shapes = []
    for i, n in enumerate(names):
        s = sass.get(n)
        if s and s["shapes"]:
            shapes.append(f"K{i}: " + ", ".join(f"HGMMA.{k} x{v}" for k, v in sorted(s["shapes"].items())))
    if shapes:
        lines.append("")
        lines.append("HGMMA shapes per kernel:")
        lines.extend("  " + x for x in shapes)
    lines.append("")
    verdict = "FAIL" if problems else "PASS"
    if sass:
        lines.append(
            f"HGMMA check: {verdict} ({len(checked)} kernel(s) matching {hgmma_rx.pattern!r}"
            f"{', excluding ' + repr(exclude_rx.pattern) if exclude_rx else ''})"
        )
    else:
        lines.append(f"HGMMA check: not run (no SASS){' - FAIL' if problems else ''}")
    for x in problems:
        lines.append("  FAIL " + x)
    nspill = sum("spills:" in f for f in flags)
    lines.append(
        f"spills: {'none' if not nspill else f'{nspill} kernel(s) spill'}" + ("" if ptxas else " (no ptxas report)")
    )
    for x in flags:
        lines.append("  FLAG " + x)
    lines.append("")
    lines.append("Kernel names (mangled):")
    for i, n in enumerate(names):
        lines.append(f"  K{i}: {n}")
    return "\n".join(lines) + "\n", verdict, problems, flags


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sass", help="output of cuobjdump --dump-sass")
    ap.add_argument("--ptxas-log", help="build log holding ptxas -v output")
    ap.add_argument(
        "--hgmma-regex",
        default=os.environ.get("FAH_HGMMA_KERNEL_REGEX", r"flash_(fwd|bwd)_sm90_kernel"),
        help="kernels (mangled or demangled name) that must contain HGMMA (default: env FAH_HGMMA_KERNEL_REGEX "
        "or '(?i)fwd')",
    )
    ap.add_argument(
        "--exclude-regex",
        default=os.environ.get("FAH_HGMMA_EXCLUDE_REGEX", r"(?i)combine|preprocess|postprocess|convert"),
        help="kernels exempt from the HGMMA check (default: env FAH_HGMMA_EXCLUDE_REGEX or "
        "'(?i)combine|preprocess|postprocess|convert'; empty for none)",
    )
    ap.add_argument("--fail-on-spill", action="store_true", help="exit 1 when any kernel spills")
    ap.add_argument(
        "--fail-on-serialized",
        action="store_true",
        help="exit 1 when ptxas reports serialized wgmma for any kernel (each WGMMA waits for the previous one)",
    )
    ap.add_argument("--out", help="also write the report here")
    args = ap.parse_args(argv)

    sass, ptxas = {}, {}
    if args.sass:
        if not os.path.isfile(args.sass):
            print(f"kernel_report: {args.sass} not found", file=sys.stderr)
            return 2
        with open(args.sass, errors="replace") as f:
            sass = parse_sass(f.read())
        if not sass:
            print(f"kernel_report: no function found in {args.sass}", file=sys.stderr)
            return 2
    if args.ptxas_log:
        if os.path.isfile(args.ptxas_log):
            with open(args.ptxas_log, errors="replace") as f:
                ptxas = parse_ptxas(f.read())
        else:
            print(f"kernel_report: {args.ptxas_log} not found; no resource report", file=sys.stderr)
    if not sass and not ptxas:
        print("kernel_report: nothing to report (no SASS functions, no ptxas entries)", file=sys.stderr)
        return 2
    hgmma_rx = re.compile(args.hgmma_regex)
    exclude_rx = re.compile(args.exclude_regex) if args.exclude_regex else None
    report, _, problems, _ = build_report(
        sass, ptxas, hgmma_rx, exclude_rx, args.fail_on_spill, args.fail_on_serialized
    )
    sys.stdout.write(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
