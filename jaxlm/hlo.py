"""Reading XLA's HLO text: computations, instructions, shapes, how often each computation runs per
step (loop trip counts), the source line that made an instruction, and the bytes a collective sends.

Used by `jaxlm.roofline` (the compiled GPU program's kernels) and by the HLO benchmarks
(`benchmarks/hlo_audit.py`, `benchmarks/communication.py`). Text, not protos: what `compiled.as_text()`
and `lowered.as_text(dialect="hlo")` print is stable enough across XLA versions for these fields, and
needs no XLA build.
"""

from __future__ import annotations

import linecache
import math
import os
import pathlib
import re
import sys
from collections import defaultdict

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent  # the repository: source lines are reported relative to it

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
               "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
COMMENT = re.compile(r"/\*.*?\*/")
CALLS = re.compile(r"\b(body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
_SHAPE = re.compile(r"^([a-z]+\d*(?:e\dm\d(?:fn|fnuz)?)?)\[([\d,]*)\]")
_ARRAY_LAYOUT = re.compile(r"\b([a-z]+\d*(?:e\dm\d(?:fn|fnuz)?)?)\[([\d,]*)\](\{[^}]*\})?")
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")


def shape_bytes(shape: str, memory_space: int | None = None) -> int:
    """Bytes of an HLO shape (an array or a tuple of arrays): `bf16[8,128]{1,0}` -> 2048. With `memory_space`,
    only its arrays in that memory space, read from their layouts' `S(n)` (none: 0, the device's main memory,
    HBM); XLA:TPU's memory-space assignment puts buffers in the chip's on-chip memory (`S(1)`) and scalars in
    others."""
    total = 0.0
    for dtype, dims, layout in _ARRAY_LAYOUT.findall(shape):
        if memory_space is not None:
            space = _MEMORY_SPACE.search(layout)
            if (int(space.group(1)) if space else 0) != memory_space:
                continue
        total += DTYPE_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
    return int(total)


def dtype_dims(shape: str) -> tuple[str, list[int]]:
    """`bf16[8,128]{1,0}` -> ("bf16", [8, 128]); a tuple or token shape -> (shape, [])."""
    m = _SHAPE.match(shape)
    return (m.group(1), [int(d) for d in m.group(2).split(",") if d]) if m else (shape, [])


def format_shape(dtype: str, dims: list[int]) -> str:
    return f"{dtype}[{','.join(map(str, dims))}]"


def dims_attr(attrs: str, key: str) -> list[int]:
    """An instruction's `key={1,2}` attribute as a list (empty when absent)."""
    m = re.search(rf"\b{key}=\{{([\d,]*)\}}", attrs)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def split_args(text: str) -> tuple[list[str], str]:
    """'a, b), attrs' -> (['a', 'b'], 'attrs'): the operands up to the matching parenthesis."""
    depth, args, start = 0, [], 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                args.append(text[start:i])
                return [a.strip().split()[-1].lstrip("%") for a in args if a.strip()], text[i + 1:]
            depth -= 1
        elif ch == "," and depth == 0:
            args.append(text[start:i])
            start = i + 1
    return [a.strip().split()[-1].lstrip("%") for a in args if a.strip()], ""


def device_groups(line: str, num_devices: int) -> np.ndarray:
    """[groups, group size] device ids of a collective, from its replica_groups in any of XLA's forms."""
    ids = np.arange(num_devices)
    # mesh['a'=8,'b'=8][, device_ids=..] {'b'}
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]([^{]*)\{([^}]*)\}", line)
    if m:
        axes = [(k, int(v)) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
        d = re.search(r"device_ids=\(\[([\d,]+)\]T\(([\d,]+)\)\)", m.group(2))
        if d:
            ids = ids.reshape([int(x) for x in d.group(1).split(",")]).transpose([int(x) for x in d.group(2).split(",")])
        grid = ids.ravel().reshape([size for _, size in axes])
        names = [k for k, _ in axes]
        inner = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3))]
        outer = [i for i in range(len(names)) if i not in inner]
        return grid.transpose(outer + inner).reshape(-1, max(math.prod(grid.shape[i] for i in inner), 1))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)  # iota form
    if m:
        grid = ids.reshape([int(x) for x in m.group(3).split(",")])
        if m.group(4):
            grid = grid.transpose([int(x) for x in m.group(4).split(",")])
        return grid.ravel().reshape(int(m.group(1)), int(m.group(2)))
    m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
    if m and m.group(1) != "{}":
        return np.array([[int(x) for x in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", m.group(1))])
    return ids.reshape(1, -1)


def sent_bytes(op: str, size: float, group: int) -> float:
    """Bytes one device sends for a collective of `size` bytes (its result; a reduce-scatter's operand
    is `group` times that) over `group` devices, with ring algorithms:

        all-reduce       2 (g - 1) / g x size          all-gather      (g - 1) / g x result size
        reduce-scatter   (g - 1) x result size         all-to-all      (g - 1) / g x size
        collective-permute  size
    """
    if op == "all-reduce":
        return 2 * (group - 1) / group * size
    if op == "reduce-scatter":
        return (group - 1) * size
    if op == "collective-permute":
        return size
    return (group - 1) / group * size


def collective_op(op: str) -> str | None:
    """The collective an instruction starts (`all-gather-start` -> `all-gather`), None for anything
    else, including the `-done` halves of async pairs (counted once, at the start)."""
    if op.endswith("-done"):
        return None
    base = op.removesuffix("-start")
    return base if base in COLLECTIVES else None


def _joined_instructions(text: str):
    """The module's lines, an instruction written over several lines joined into one: XLA:TPU prints a Pallas
    kernel's `frontend_attributes={kernel_metadata={...}}` with line breaks inside the braces (whose closing
    line, flush left, would otherwise read as the end of the computation)."""
    pending, depth = "", 0
    for line in text.splitlines():
        if pending:
            pending += line
            depth += line.count("{") - line.count("}")
            if depth <= 0:
                yield pending
                pending = ""
            continue
        depth = line.count("{") - line.count("}")
        if line.startswith(" ") and line.endswith("{") and depth > 0:  # braces that close on a later line
            pending = line
            continue
        yield line
    if pending:
        yield pending


class Module:
    """An HLO module's text: computations, instructions, how often each computation runs per step,
    and the source location table that `debug_info` lowering and compilation keep.

    `trip_counts_from`: "backend_config" for optimized modules (XLA's `known_trip_count`), "condition"
    for lowered ones (the constant a scan's condition compares its counter with)."""

    def __init__(self, text: str, trip_counts_from: str = "backend_config"):
        self.computations: dict[str, list[dict]] = {}
        self.shapes: dict[str, str] = {}
        self.entry = None
        current = None
        for line in _joined_instructions(text):
            if not line.startswith(" "):
                m = COMPUTATION.match(line)
                current = m.group(1) if m and not line.startswith("HloModule") else None
                if current is not None:
                    self.computations[current] = []
                    if line.startswith("ENTRY"):
                        self.entry = current
                continue
            if current is None or not (m := INSTRUCTION.match(COMMENT.sub("", line))):
                continue
            operands, attrs = split_args(m.group(5))
            inst = dict(root=bool(m.group(1)), name=m.group(2), shape=m.group(3).strip(), op=m.group(4),
                        operands=operands, attrs=attrs, computation=current)
            self.computations[current].append(inst)
            self.shapes[inst["name"]] = inst["shape"]
        self.fused = {callee for insts in self.computations.values() for i in insts if i["op"] == "fusion"
                      for kind, callee in CALLS.findall(i["attrs"]) if kind == "calls"}
        self.unknown_trip_counts = 0
        self.runs = self._runs(trip_counts_from)
        self._frames = _stack_frames(text)

    def _trip_count(self, inst: dict, source: str) -> int:
        """Iterations of a while loop: XLA's `known_trip_count` (optimized GPU modules) or, in a lowered
        module, the constant its condition compares the counter with (`i < n`, i from 0: JAX's scans
        and fori_loops); an optimized module without the count (XLA:TPU writes none) the same, less
        the counter's start where that is a constant too."""
        if source == "backend_config":
            if m := TRIP.search(inst["attrs"]):
                return int(m.group(1))
            bound, start, step = self._condition_bound(inst), self._counter_start(inst), self._counter_step(inst)
            if bound is not None and start is not None and step:
                return max(0, -(-(bound - start) // step))
        elif (bound := self._condition_bound(inst)) is not None:
            return bound
        self.unknown_trip_counts += 1
        return 1

    def _constant(self, computation: str, name: str, depth: int = 0) -> int | None:
        """The integer an instruction holds when it is a scalar constant (through copies and bitcasts)."""
        inst = next((i for i in self.computations.get(computation, []) if i["name"] == name), None)
        if inst is None or depth > 4:
            return None
        if inst["op"] in ("copy", "bitcast") and inst["operands"]:
            return self._constant(computation, inst["operands"][0], depth + 1)
        first = inst["operands"][0] if inst["operands"] else ""
        return int(first) if inst["op"] == "constant" and re.fullmatch(r"-?\d+", first) else None

    def _condition(self, inst: dict) -> tuple[int | None, int]:
        """(n, the counter's place in the loop's tuple) of a while loop whose condition is `counter < n`, n a
        constant (None when it is not); the counter is the tuple's element 0 unless the condition reads another
        (XLA:TPU's windowed matmuls: their counter comes after the buffers)."""
        cond = re.search(r"\bcondition=%?([\w.\-]+)", inst["attrs"]).group(1)
        body = {i["name"]: i for i in self.computations.get(cond, [])}
        root = next((i for i in body.values() if i["root"]), None)
        if root and root["op"] == "compare" and "direction=LT" in root["attrs"] and len(root["operands"]) == 2:
            counter = body.get(root["operands"][0])
            index = re.search(r"\bindex=(\d+)", counter["attrs"]) if counter and counter["op"] == "get-tuple-element" \
                else None
            return self._constant(cond, root["operands"][1]), int(index.group(1)) if index else 0
        return None, 0

    def _condition_bound(self, inst: dict) -> int | None:
        return self._condition(inst)[0]

    def _counter_step(self, inst: dict) -> int | None:
        """What a while loop's body adds to its counter (`_condition`) each iteration, when that is a constant
        (XLA:TPU's windowed matmuls: 2, a step in each direction of the ring)."""
        index = self._condition(inst)[1]
        body = re.search(r"\bbody=%?([\w.\-]+)", inst["attrs"]).group(1)
        insts = {i["name"]: i for i in self.computations.get(body, [])}
        root = next((i for i in insts.values() if i["root"]), None)
        if root is None or root["op"] != "tuple" or len(root["operands"]) <= index:
            return None
        add = insts.get(root["operands"][index])
        if add is None or add["op"] != "add" or len(add["operands"]) != 2:
            return None
        for counter, other in (add["operands"], add["operands"][::-1]):
            read = insts.get(counter)
            while read and read["op"] in ("copy", "bitcast") and read["operands"]:  # XLA:TPU copies the counter
                read = insts.get(read["operands"][0])
            if read and read["op"] == "get-tuple-element" and re.search(rf"\bindex={index}\b", read["attrs"]):
                return self._constant(body, other)
        return None

    def _counter_start(self, inst: dict) -> int | None:
        """The counter's first value (`_condition`) in the tuple a while loop starts from, when it is a constant."""
        index = self._condition(inst)[1]
        init = next((i for i in self.computations.get(inst["computation"], []) if inst["operands"]
                     and i["name"] == inst["operands"][0]), None)
        if init is None or init["op"] != "tuple" or len(init["operands"]) <= index:
            return None
        return self._constant(inst["computation"], init["operands"][index])

    def _runs(self, trip_counts_from: str) -> dict[str, int]:
        """Executions of each computation per step: its callers' executions times loop trip counts.

        A conditional runs one branch: counted is the expected one, by jaxlm's convention the true branch
        of a `lax.cond` (the last of an indexed conditional's branches); the others count 0."""
        edges: dict[str, list[tuple[str, int]]] = defaultdict(list)
        for name, insts in self.computations.items():
            for inst in insts:
                calls = CALLS.findall(inst["attrs"])
                trips = self._trip_count(inst, trip_counts_from) if inst["op"] == "while" else 1
                for kind, callee in calls:
                    edges[name].append((callee, 0 if kind == "false_computation" else
                                        trips if kind in ("body", "condition") else 1))
                for group in BRANCHES.findall(inst["attrs"]):
                    branches = [b.strip().lstrip("%") for b in group.split(",") if b.strip()]
                    edges[name] += [(b, int(i == len(branches) - 1)) for i, b in enumerate(branches)]
        # Topological order from the entry (a call graph is acyclic), then push counts down.
        order, seen = [], set()

        def visit(name: str) -> None:
            seen.add(name)
            for callee, _ in edges.get(name, ()):
                if callee in self.computations and callee not in seen:
                    visit(callee)
            order.append(name)

        sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(self.computations) + 100))
        if self.entry is not None:
            visit(self.entry)
        runs: dict[str, int] = defaultdict(int)
        runs[self.entry] = 1
        for name in reversed(order):
            for callee, factor in edges.get(name, ()):
                if callee in self.computations:
                    runs[callee] += runs[name] * factor
        return runs

    def instructions(self):
        for insts in self.computations.values():
            yield from insts

    def host_syncs(self) -> int:
        """Per step, the times an optimized GPU program stops to wait for the host: every execution of
        a conditional (XLA's GPU runtime copies the predicate to the host and waits for the device to
        reach it before it launches a branch) and of a while loop whose trip count XLA does not know
        (the same for its condition, every iteration: counted once here). Conditionals inside branches
        other than the expected one count 0, as their kernels do."""
        return sum(self.runs.get(inst["computation"], 0) for inst in self.instructions()
                   if inst["op"] == "conditional" or (inst["op"] == "while" and not TRIP.search(inst["attrs"])))

    @staticmethod
    def callee(inst: dict, kind: str = "calls") -> str | None:
        """The computation an instruction calls as `kind` (a fusion's body: "calls"), None if none."""
        return next((c for k, c in CALLS.findall(inst["attrs"]) if k == kind), None)

    def source(self, attrs: str) -> str:
        """The innermost frame in this repository's own code (not site-packages) that made an op."""
        m = re.search(r"stack_frame_id=(\d+)", attrs)
        for path, line, function in self._frames(int(m.group(1)) if m else 0):
            if path.startswith(str(ROOT)) and "site-packages" not in path:
                rel = os.path.relpath(path, ROOT)
                text = linecache.getline(path, line).strip()
                return f"{rel}:{line} ({function}) {text[:90]}"
        m = re.search(r'source_file="([^"]+)" source_line=(\d+)', attrs)
        if m and m.group(1).startswith(str(ROOT)) and "site-packages" not in m.group(1):
            return f"{os.path.relpath(m.group(1), ROOT)}:{m.group(2)}"
        return f"{m.group(1)}:{m.group(2)}" if m else ""

    def collectives(self, num_devices: int, per_host: int = 8) -> dict[str, dict[str, float]]:
        """{op: {"count": executions per step, "bytes": bytes one device sends per step,
        "cross_host_bytes": those in groups that span hosts of `per_host` consecutive devices}}."""
        out = {op: {"count": 0, "bytes": 0.0, "cross_host_bytes": 0.0} for op in COLLECTIVES}
        for inst in self.instructions():
            op = collective_op(inst["op"])
            if op is None:
                continue
            runs = self.runs.get(inst["computation"], 0)
            groups = device_groups(inst["attrs"], num_devices)
            sent = sent_bytes(op, collective_result_bytes(inst), groups.shape[1])
            out[op]["count"] += runs
            out[op]["bytes"] += runs * sent
            if any(len(set(group // per_host)) > 1 for group in groups):
                out[op]["cross_host_bytes"] += runs * sent
        return out


def collective_result_bytes(inst: dict) -> int:
    """The bytes a collective produces. An async all-gather, reduce-scatter, all-to-all or
    collective-permute start's shape is (operands, results[, scratch]): its results are the second
    element (XLA:GPU's all-to-all-start: `((bf16[8,8,128]), bf16[8,8,128])`); an all-reduce-start's
    shape is its results. (XLA:CPU's synchronous all-to-all returns a tuple of one array per device of
    the group, together its result.)"""
    shape = inst["shape"]
    if inst["op"] in ("all-gather-start", "reduce-scatter-start", "all-to-all-start", "collective-permute-start") \
            and shape.startswith("("):
        parts = tuple_parts(shape)
        if len(parts) >= 2:
            return shape_bytes(parts[1])
    return shape_bytes(shape)


def tuple_parts(shape: str) -> list[str]:
    """'((a, b), c, u32[])' -> ['(a, b)', 'c', 'u32[]']: the top-level elements of a tuple shape."""
    inner, depth, parts, start = shape.strip()[1:-1], 0, [], 0
    for i, ch in enumerate(inner):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(inner[start:i].strip())
            start = i + 1
    parts.append(inner[start:].strip())
    return [p for p in parts if p]


def _stack_frames(text: str):
    """frame id -> [(file, line, function)] innermost first, from the module's StackFrames tables."""

    def table(name: str) -> dict[int, str]:
        m = re.search(rf"^{name}\n((?:\d+ .*\n)+)", text, re.M)
        return {int(k): v for k, v in re.findall(r"^(\d+) (.*)$", m.group(1), re.M)} if m else {}

    files, functions, locations, frames = (table(t) for t in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"))

    def fields(s: str) -> dict[str, int]:
        return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", s)}

    def chain(frame_id: int) -> list[tuple[str, int, str]]:
        out, seen = [], set()
        while frame_id in frames and frame_id not in seen:  # parent_frame_id is 1-based, 0 = none
            seen.add(frame_id)
            frame = fields(frames[frame_id])
            loc = fields(locations.get(frame.get("file_location_id", 0), ""))
            if loc:
                out.append((files.get(loc["file_name_id"], "").strip('"'), loc.get("line", 0),
                            functions.get(loc.get("function_name_id", 0), "").strip('"')))
            frame_id = frame.get("parent_frame_id", 0) - 1
        return out

    return chain
