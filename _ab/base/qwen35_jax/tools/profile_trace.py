"""Read a `jax.profiler` trace back and say where the device time went, per named scope of the model.

What the trace holds (jax 0.11.2, checked on CPU; GPU per XLA's kernel annotations):
- `<dir>/plugins/profile/<session>/<host>.xplane.pb` (read here with `jax.profiler.ProfileData`),
  `<host>.trace.json.gz` (TensorBoard / xprof trace viewer) and, when asked for, `perfetto_trace.json.gz`.
- XLA:CPU runs ops on host threads of the `/host:CPU` plane; each op is an event named after its HLO
  instruction with stats `hlo_op`, `hlo_module`, `program_id`, `run_id` and *no* scope metadata. A `while`
  op is an event that encloses its body's op events.
- XLA:GPU kernels are events on `/device:GPU:N` planes (stream lines) with stats `hlo_op` and `hlo_module`
  taken from the launch annotation (`Thunk:#name=<op_name minus the module prefix>,hlo_op=<instr>#`). While a
  profiler session is active XLA runs command buffers (CUDA graphs) op by op, so every kernel is its own event,
  but those kernels did not carry their own `hlo_op` on the H200 (see below).

So an event is mapped to a scope through its HLO instruction: `hlo_module` + `hlo_op` (or the event name, which
is the instruction name on CPU and the sanitised fusion name on GPU) are looked up in the optimised HLO text of
the executable that ran it (`compiled.as_text()`), whose `metadata={op_name="jit(decode)/while/body/layer3/gdn/
in_proj/dot_general"}` carries the `jax.named_scope` path (`HloIndex` says what it does for ops XLA left without
metadata). Executables may share a module name (the engine's prefill and decode buckets are all `jit__lambda`):
the events of one execution (`hlo_module` + `program_id`) go to the executable of that name that holds their
instruction names (`HloIndex.pick`). Without the HLO text, a scope path in the event's `name`/`tf_op`/
`long_name` stat is used; events that can be mapped neither way are reported as "(unattributed)" under their own
name, never dropped.

On the H200 (jax 0.11.2) kernels launched from command buffers (CUDA graphs) did not carry their own `hlo_op`,
so they are mapped by kernel name, and XLA:GPU gives one kernel to every fusion with the same fused computation
(kernel reuse), named after the first of them: a name alone would put every layer's twin fusions in the first
layer. `Executable.kernel_groups` lists, per shared kernel name, the instructions that may have launched it, in
launch order (`launch_order`: the entry computation with each loop's body spliced in at its loop; twin fusions;
Pallas kernels by the `name` in their backend config; cuBLAS GEMM custom calls for cuBLAS kernel names), and
`resolve` gives the k-th launch of a name in one execution to the k-th of them. Where the number of launches does
not fit the group (e.g. a loop that ran more than once), the events keep the scope the group's members share,
with the layer left open (`AMBIGUOUS_LAYER`), never a guess. Other H200 kernel names: the passes of one op
(`sort_8_1__20`) and XLA's collective kernels, named after the computation their fusion runs
(`psum_458_0_fusion_1`). XLA clones a loop body per call site with the first site's metadata, so a body's ops
take the layer of the loop that runs them. Checked against 9B traces from the H200 at tp 1 and 2.

Time per event is its exclusive time on its line (an op's duration minus ops nested inside it on the same line);
control-flow ops (`while`, `conditional`, `call`) are not counted since their bodies' ops are.
"""
from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
import warnings

CONTROL_FLOW = ("while", "conditional", "call", "async-start", "async-done")
TOP_SCOPES = ("embed", "lm_head", "sampling")
BLOCKS = ("attention", "gdn", "mlp")
LAYER_OTHER = "norm+residual"      # ops inside layerN but outside its mixer / mlp (the two RMSNorms, residual adds)
UNSCOPED = "(unscoped)"           # ops of our executables outside every named scope
UNATTRIBUTED = "(unattributed)"   # device events we cannot map to an HLO instruction or scope path
AMBIGUOUS_LAYER = "layer?"        # a shared kernel whose launches could not be told apart between layers
CUBLAS_KERNEL = re.compile(r"^(nvjet|sm\d+_xmma|cutlass|ampere_|hopper_|gemv|gemmk|gemmSN|.*cublas)", re.I)
DERIVED_LINES = ("XLA Modules", "XLA Ops", "Framework Name Scope", "Framework Ops", "Steps", "Source code",
                 "XLA TraceMe", "Launch Stats", "SparseCore")


# ---------------------------------------------------------------------------------------------------------------
# Where a trace is


def find_session(path: str) -> str:
    """The newest session dir (holding *.xplane.pb) under a trace dir, or `path` itself if it is one."""
    if glob.glob(os.path.join(path, "*.xplane.pb")):
        return path
    sessions = sorted(glob.glob(os.path.join(path, "plugins", "profile", "*")), key=os.path.getmtime)
    sessions = [s for s in sessions if glob.glob(os.path.join(s, "*.xplane.pb"))]
    if not sessions:
        raise FileNotFoundError(f"no plugins/profile/<session>/*.xplane.pb under {path!r}: was a trace written there?")
    return sessions[-1]


def trace_files(session: str) -> dict[str, str]:
    """The viewer files of one session: xplane (xprof / TensorBoard), trace_json (chrome://tracing, xprof), and
    perfetto (ui.perfetto.dev) when it was written."""
    out = {}
    for key, pattern in (("xplane", "*.xplane.pb"), ("trace_json", "*.trace.json.gz"),
                         ("perfetto", "perfetto_trace.json.gz")):
        hits = sorted(glob.glob(os.path.join(session, pattern)))
        if hits:
            out[key] = hits[0]
    return out


# ---------------------------------------------------------------------------------------------------------------
# HLO text -> instruction op_name / opcode


@dataclasses.dataclass(frozen=True)
class Instr:
    op_name: str                # jax.named_scope path from the metadata ("" if none)
    opcode: str
    operands: tuple = ()        # instruction names
    calls: tuple = ()           # called computations (fusions, custom calls)
    kernel: str = ""            # a custom call's kernel name (Pallas: backend_config "name"), "cublas" for GEMMs
    shape_text: str = ""        # the rhs without names and metadata (fusion-body fingerprints)
    runs: tuple = ()            # computations a while / conditional runs (condition, body, branches)


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+) \(.*\{\s*$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"calls=(\{[^}]*\}|%?[\w.\-]+)")
_CONTROL = re.compile(r"\b(?:condition|body|branch_computations)=(\{[^}]*\}|%?[\w.\-]+)")   # while / conditional
_KERNEL_NAME = re.compile(r'(?:\\?"name\\?"\s*:|\bname\s*=)\s*\\?"([\w.\-]+)')   # JSON, or MLIR attrs (H200)
_ATTRIBUTES = re.compile(r",\s*(metadata|backend_config|frontend_attributes|statistics_viz|origin)=")


def _normalise(rhs: str) -> str:
    """An instruction's rhs without instruction names and trailing attributes (metadata, backend config): equal
    for the twin ops of two layers."""
    return re.sub(r"%[\w.\-]+", "%", _ATTRIBUTES.split(rhs, 1)[0])


def _split_rhs(rhs: str) -> tuple[str, str]:
    """(opcode, operand text) of an HLO instruction's right-hand side: the word after the (possibly tuple) shape,
    and what its parentheses enclose."""
    i = 0
    if rhs.startswith("("):              # tuple shape: skip to its matching parenthesis
        depth = 0
        for i, c in enumerate(rhs):
            depth += (c == "(") - (c == ")")
            if depth == 0:
                break
        i += 1
    else:
        i = rhs.find(" ")
    m = re.match(r"\s*([\w\-]+)\(", rhs[i:])
    if not m:
        return "", ""
    j, depth = i + m.end(), 1
    for k in range(j, len(rhs)):
        depth += (rhs[k] == "(") - (rhs[k] == ")")
        if depth == 0:
            return m.group(1), rhs[j:k]
    return m.group(1), rhs[j:]


def parse_hlo(text: str) -> tuple[str, dict[str, Instr], dict[str, tuple[str, list[str]]]]:
    """Optimised HLO text (`compiled.as_text()`) -> (module name, {instruction: Instr},
    {computation: (root instruction, [instructions])}). Instruction names are unique within a module."""
    first = text.lstrip().split("\n", 1)[0]
    m = re.match(r"HloModule ([\w.\-]+)", first)
    if not m:
        raise ValueError("not an HLO module text (no 'HloModule <name>' header)")
    instrs, comps, current, entry = {}, {}, None, ""
    for line in text.splitlines():
        im = _INSTR.match(line)
        if im is None:
            cm = _COMPUTATION.match(line)
            if cm:
                current = comps.setdefault(cm.group(1), ["", []])
                entry = cm.group(1) if line.startswith("ENTRY") else entry
            continue
        name, rhs = im.groups()
        opcode, args = _split_rhs(rhs)
        om, calls = _OP_NAME.search(rhs), _CALLS.search(rhs)
        runs = [x for c in _CONTROL.findall(_ATTRIBUTES.split(rhs, 1)[0]) for x in re.findall(r"[\w.\-]+", c)]
        kernel = ""
        if opcode == "custom-call":
            km = _KERNEL_NAME.search(rhs)
            kernel = km.group(1) if km else ("cublas" if "cublas" in rhs else "")
        instrs[name] = Instr(om.group(1) if om else "", opcode, tuple(re.findall(r"%([\w.\-]+)", args)),
                             tuple(re.findall(r"[\w.\-]+", calls.group(1).replace("%", " "))) if calls else (),
                             kernel, _normalise(rhs), tuple(runs))
        if current is not None:
            current[1].append(name)
            if line.lstrip().startswith("ROOT "):
                current[0] = name
    comps = {k: (v[0], v[1]) for k, v in comps.items()}
    if entry:                     # the entry computation first: launch_order() starts there
        comps = {entry: comps[entry], **{k: v for k, v in comps.items() if k != entry}}
    return m.group(1), instrs, comps


def _common_prefix(paths: list[str]) -> str:
    parts = [p.split("/") for p in paths]
    out = []
    for level in zip(*parts):
        if any(x != level[0] for x in level):
            break
        out.append(level[0])
    return "/".join(out)


class Executable:
    """One executable's instructions, with scope paths resolved on demand. An instruction's path is its own
    op_name; XLA drops the metadata of some ops it creates (layout copies, split dots, some fusions), so failing
    that: the op_name of the root of the computation it calls (a fusion's body), else the longest common path of
    the ops inside that body, else the nearest operand (breadth first, a few hops) that has one."""

    def __init__(self, text: str):
        self.module, self.instrs, self.comps = parse_hlo(text)
        self.sanitised = {re.sub(r"[.\-]", "_", k): k for k in self.instrs}
        # Kernels named after the computation an instruction calls (XLA's collective kernels: "psum_458_0_fusion_1"
        # for the fusion-start calling %fused_psum.458.0.clone).
        self.callers = {re.sub(r"[.\-]", "_", re.sub(r"^fused_|\.clone(\.\d+)?$", "", c)): k
                        for k, ins in self.instrs.items() for c in ins.calls}
        # The while loop / conditional that runs each computation: XLA clones a loop body per call site but keeps
        # the first site's metadata, so the layer of a body's op is that of the loop that runs it.
        self.runner = {c: k for k, ins in self.instrs.items() for c in ins.runs}
        self.home = {n: c for c, (_, members) in self.comps.items() for n in members}
        self._resolved: dict[str, str] = {}
        self.position = {n: i for i, n in enumerate(self.launch_order())}    # instruction -> its launch index
        self.kernel_groups = self._kernel_groups()

    def launch_order(self) -> list[str]:
        """Instructions in the order they launch, one pass: the entry computation in schedule order with the
        computations of its while loops and conditionals spliced in where they run (once each)."""
        out, seen = [], set()

        def walk(comp):
            if comp in seen or comp not in self.comps:
                return
            seen.add(comp)
            for n in self.comps[comp][1]:
                for c in self.instrs[n].runs:
                    walk(c)
                out.append(n)
        for comp in self.comps:           # the entry first (parse_hlo), then anything not reached from it
            walk(comp)
        return out

    def _kernel_groups(self) -> dict[str, list[str]]:
        """Kernel name -> the instructions (launch order) that may launch a kernel of that name, where there is
        more than one: fusions with identical bodies (XLA reuses the first one's kernel and name), custom calls
        of one Pallas kernel, and the cuBLAS GEMMs (key "cublas"). A Pallas kernel called at several shapes is
        one kernel per shape, which XLA names `name`, `name__1`, ... in launch order (the one-row GEMV of the
        GDN in_proj and of the attention qkv: `gemv`, `gemv__1`); each is a group of its own."""
        twins: dict[str, list[str]] = collections.defaultdict(list)
        named: dict[str, list[str]] = collections.defaultdict(list)
        shapes: dict[str, list[str]] = collections.defaultdict(list)     # Pallas kernel -> its shapes, in order
        kernel_of: dict[str, str] = {}                                   # group name -> its Pallas kernel
        for n in self.position:
            ins = self.instrs[n]
            if ins.opcode == "fusion" and ins.calls:
                body = self.comps.get(ins.calls[0], ("", []))[1]
                key = ins.shape_text + "|" + "|".join(self.instrs[m].shape_text for m in body)
                twins[key].append(n)
            elif ins.kernel == "cublas":
                named["cublas"].append(n)
            elif ins.kernel:
                seen = shapes[ins.kernel]
                if ins.shape_text not in seen:
                    seen.append(ins.shape_text)
                i = seen.index(ins.shape_text)
                name = ins.kernel if i == 0 else f"{ins.kernel}__{i}"
                named[name].append(n)
                kernel_of[name] = ins.kernel
        groups = {re.sub(r"[.\-]", "_", g[0]): g for g in twins.values() if len(g) > 1}
        groups.update({k: g for k, g in named.items()
                       if len(g) > 1 or k == "cublas" or len(shapes[kernel_of[k]]) > 1})
        return groups

    def find(self, op: str | None, event_name: str) -> str | None:
        """The instruction name an event ran: its hlo_op stat, else its name (GPU kernels: '.' and '-' -> '_'; an
        op of several kernels adds "__N", e.g. the passes of a sort), else the computation it is named after."""
        base = re.sub(r"__\d+$", "", re.sub(r"[.\-]", "_", event_name))
        for key in (op, event_name, self.sanitised.get(base), self.callers.get(re.sub(r"_fusion(_\d+)?$", "", base))):
            if key and key in self.instrs:
                return key
        return None

    def op_name(self, name: str) -> str:
        if name not in self._resolved:
            path, loop = self._resolve(name), self.runner.get(self.home.get(name))
            if loop is not None:
                layer = re.search(r"(?:^|/)(layer\d+)/", self.op_name(loop))
                if layer:
                    path = re.sub(r"(^|/)layer\d+/", rf"\g<1>{layer.group(1)}/", path, count=1)
            self._resolved[name] = path
        return self._resolved[name]

    def _inside(self, instr: Instr, depth: int = 0) -> str:
        """op_name from the computations an instruction calls: their root's, else the common path of their ops."""
        for comp in instr.calls:
            root, members = self.comps.get(comp, ("", []))
            if root and self.instrs[root].op_name:
                return self.instrs[root].op_name
            names = [self.instrs[n].op_name for n in members if self.instrs[n].op_name]
            if not names and depth < 3:
                names = [p for n in members for p in [self._inside(self.instrs[n], depth + 1)] if p]
            if names:
                return _common_prefix(names) + "/fused"
        return ""

    def _resolve(self, name: str) -> str:
        instr = self.instrs[name]
        found = instr.op_name or self._inside(instr)
        frontier, seen = list(instr.operands), {name}
        for _ in range(4):                        # nearest operand with a scope path
            if found:
                break
            nxt = []
            for n in frontier:
                if n in seen or n not in self.instrs:
                    continue
                seen.add(n)
                found = self.instrs[n].op_name or self._inside(self.instrs[n])
                if found:
                    break
                nxt.extend(self.instrs[n].operands)
            frontier = nxt
        return found


class HloIndex:
    """The executables that ran (`compiled.as_text()` of each). Several may share a module name (the engine's
    prefill and decode buckets are all `jit__lambda`): the events of one execution (same `hlo_module` and
    `program_id`) are matched to the executable of that name holding the most of their instruction names.
    Executables that tie hold the same instructions (e.g. buckets that differ only in shapes) and so the same
    scopes."""

    def __init__(self, texts=()):
        self.executables = [Executable(t) for t in texts]

    def pick(self, module: str, names: list) -> Executable | None:
        """The executable of these events (names: (hlo_op, event name) pairs). Events without a module stat match
        any executable."""
        best, best_hits = None, 0
        for exe in self.executables:
            if module and exe.module != module:
                continue
            hits = sum(exe.find(op, n) is not None or n in exe.kernel_groups
                       or ("cublas" in exe.kernel_groups and CUBLAS_KERNEL.match(n) is not None) for op, n in names)
            if hits > best_hits:
                best, best_hits = exe, hits
        return best


# ---------------------------------------------------------------------------------------------------------------
# op_name -> (scope, block, sub-scope)


def _is_transform(component: str) -> bool:
    """Path components jax adds that are not our scopes: jit(f), vmap(f), while/body/cond, shard_map, ..."""
    return "(" in component or component in ("while", "body", "cond", "branch", "shard_map", "checkpoint",
                                             "remat", "pjit", "scan")


def scope_of(op_name: str) -> tuple[str, str, str]:
    """("layer3", "gdn", "in_proj") for ".../layer3/gdn/in_proj/dot_general"; ("layer3", "gdn", "(other)") for an
    op directly in the gdn block; ("layer3", LAYER_OTHER, "") for the layer's norms / residual adds;
    ("embed" | "lm_head" | "sampling", "", "") for the top-level scopes; (UNSCOPED, "", "") otherwise.
    The last path component is the primitive (dot_general, add, pallas_call, ...), never a scope."""
    parts = op_name.split("/")[:-1]
    for i, c in enumerate(parts):
        if c in TOP_SCOPES:
            return c, "", ""
        if re.fullmatch(r"layer\d+", c):
            rest = [p for p in parts[i + 1:] if not _is_transform(p)]
            if not rest or rest[0] not in BLOCKS:
                return c, LAYER_OTHER, ""
            return c, rest[0], rest[1] if len(rest) > 1 else "(other)"
    return UNSCOPED, "", ""


def _scope_from_stats(stats: dict) -> str | None:
    """A scope path carried by the event itself (GPU kernel annotations, xprof-derived events)."""
    for key in ("name", "tf_op", "long_name"):
        v = stats.get(key)
        if isinstance(v, str) and "/" in v:
            m = _OP_NAME.search(v)
            return m.group(1) if m else v
    return None


# ---------------------------------------------------------------------------------------------------------------
# Events


@dataclasses.dataclass
class OpEvent:
    name: str              # event name (HLO instruction on CPU, kernel on GPU)
    module: str            # hlo_module stat ("" if none)
    hlo_op: str | None     # hlo_op stat
    program_id: str        # program_id stat: which executable ("" if none)
    start_ns: float
    dur_ns: float
    line: str              # plane/line it ran on
    path: str | None       # a scope path carried by the event's own stats, if any
    self_ns: float = 0.0   # exclusive time on its line
    scope: tuple = ()      # set by resolve(): scope_of(...) or (UNATTRIBUTED, name, "")
    opcode: str = ""

    @property
    def end_ns(self) -> float:
        return self.start_ns + self.dur_ns


@dataclasses.dataclass
class Window:
    """A host annotation (TraceAnnotation / StepTraceAnnotation) with the device events that ran inside it."""
    name: str
    step_num: int | None
    start_ns: float
    end_ns: float
    events: list = dataclasses.field(default_factory=list)

    @property
    def host_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6

    @property
    def device_span_ms(self) -> float:
        """First op start to last op end: the step's device latency (gaps between ops included)."""
        if not self.events:
            return 0.0
        return (max(e.end_ns for e in self.events) - min(e.start_ns for e in self.events)) / 1e6

    @property
    def op_ms(self) -> float:
        """Sum of exclusive op times (on CPU summed over worker threads, so it can exceed the span)."""
        return sum(e.self_ns for e in self.events) / 1e6


@dataclasses.dataclass
class Trace:
    session: str
    events: list           # OpEvent: device ops only, not yet resolved to scopes
    annotations: list      # Window: the host annotations asked for (no events yet)
    platform: str          # "gpu" if device planes were found, else "cpu"


def _stats(obj) -> dict:
    return {k: v for k, v in obj.stats}


def load_trace(path: str, annotation_names=(), device: int | None = None) -> Trace:
    """Read the newest session under `path`. Device ops: events on `/device:*` planes if there are any (GPU),
    else events with an `hlo_op` stat on `/host:CPU` thread lines (XLA:CPU). device: keep only this device's ops
    (its local hardware id: the N of `/device:GPU:N`, the `device_ordinal` stat on CPU); None keeps all.
    `annotation_names`: host events (by name) to return as Windows, e.g. the step annotations."""
    with warnings.catch_warnings():     # jaxlib's ProfileData stat iterators warn "has no __module__ attribute"
        warnings.simplefilter("ignore", DeprecationWarning)
        return _load_trace(path, annotation_names, device)


def _load_trace(path: str, annotation_names, device) -> Trace:
    from jax.profiler import ProfileData
    session = find_session(path)
    data = ProfileData.from_file(trace_files(session)["xplane"])
    planes = list(data.planes)
    device_planes = [p for p in planes if p.name.startswith("/device:")]
    if device is not None and device_planes:
        device_planes = [p for p in device_planes if re.fullmatch(rf"/device:\w+:{device}", p.name)]
        if not device_planes:
            raise ValueError(f"no plane of device {device} in {session}")
    host = [p for p in planes if p.name == "/host:CPU"]
    events, windows, wanted = [], [], set(annotation_names)
    for plane in device_planes or host:
        for line in plane.lines:
            if line.name in DERIVED_LINES:
                continue
            line_events = []
            for ev in line.events:
                st = _stats(ev)
                if not device_planes and (st.get("hlo_op") is None or device is not None and
                                          int(st.get("device_ordinal", device)) != device):
                    continue                  # host: only XLA:CPU op events (of this device)
                line_events.append(OpEvent(ev.name, st.get("hlo_module") or "", st.get("hlo_op"),
                                           str(st.get("program_id", "")), ev.start_ns, ev.duration_ns,
                                           f"{plane.name}/{line.name}", _scope_from_stats(st)))
            events.extend(_exclusive(line_events))
    for plane in host:
        for line in plane.lines:
            for ev in line.events:
                if ev.name in wanted:
                    step = _stats(ev).get("step_num")
                    windows.append(Window(ev.name, int(step) if step is not None else None, ev.start_ns, ev.end_ns))
    windows.sort(key=lambda w: w.start_ns)
    return Trace(session, events, windows, "gpu" if device_planes else "cpu")


def _exclusive(line_events: list) -> list:
    """self_ns = duration minus the events nested inside it on the same line."""
    line_events.sort(key=lambda e: (e.start_ns, -e.dur_ns))
    stack: list[OpEvent] = []
    for e in line_events:
        e.self_ns = e.dur_ns
        while stack and stack[-1].end_ns <= e.start_ns:
            stack.pop()
        if stack:
            stack[-1].self_ns -= min(e.dur_ns, stack[-1].end_ns - e.start_ns)
        stack.append(e)
    return line_events


def resolve(events: list, hlo: HloIndex | None = None) -> list:
    """Give each event its scope (through the HLO of its executable, else its own scope path, else UNATTRIBUTED)
    and drop control-flow ops (while / conditional / call): their bodies' ops are events of their own, possibly
    on other threads."""
    groups = collections.defaultdict(list)
    for e in events:
        groups[(e.module, e.program_id)].append(e)
    out = []
    for (module, _), group in groups.items():
        exe = hlo.pick(module, [(e.hlo_op, e.name) for e in group]) if hlo is not None else None
        shared = _shared_kernels(exe, group) if exe is not None else {}
        for e in group:
            name = exe.find(e.hlo_op, e.name) if exe is not None else None
            if id(e) in shared:                   # no instruction of its own: a shared kernel's launch
                e.scope, e.opcode = shared[id(e)]
            elif name is not None:
                e.scope, e.opcode = scope_of(exe.op_name(name)), exe.instrs[name].opcode
            else:
                e.scope = scope_of(e.path + "/op") if e.path else (UNATTRIBUTED, e.name, "")
                e.opcode = (e.hlo_op or e.name).split(".")[0]
            if e.opcode not in CONTROL_FLOW:
                out.append(e)
    out.sort(key=lambda e: e.start_ns)
    return out


def _group_key(exe: Executable, e: OpEvent) -> str | None:
    """Which of exe.kernel_groups an event without a usable hlo_op belongs to (by kernel name)."""
    if e.name in exe.kernel_groups:
        return e.name
    if e.name not in exe.instrs and e.name not in exe.sanitised and CUBLAS_KERNEL.match(e.name):
        return "cublas"
    return None


def _shared_kernels(exe: Executable, events: list) -> dict[int, tuple]:
    """{id(event): (scope, opcode)} for the launches of shared kernels in one executable's events: the k-th launch
    of a name (time order) is the k-th instruction of its group (repeating per execution). Group members whose own
    kernel name appears among the events launched their own kernel, and members that an event names in its hlo_op
    stat, are left out. If the launches of a name are not a whole number of passes over its group, every launch
    gets the scope the members share, with the layer left open. cuBLAS kernels go by `_cublas_launches`."""
    names = {e.name for e in events}
    known = {e.hlo_op for e in events if e.hlo_op in exe.instrs}      # launches that named their instruction
    launches: dict[str, list] = collections.defaultdict(list)
    for e in sorted(events, key=lambda e: e.start_ns):
        if e.hlo_op in exe.instrs:
            continue
        key = _group_key(exe, e)
        if key is not None:
            launches[key].append(e)
    out, placed = {}, {}                  # placed: id(event) -> the instruction it launched, where one is certain
    for key, evs in launches.items():
        if key == "cublas":
            continue
        group = exe.kernel_groups[key]
        members = [m for i, m in enumerate(group) if m not in known and (i == 0 or re.sub(r"[.\-]", "_", m)
                                                                         not in names)]
        if not members:
            continue
        scopes = [scope_of(exe.op_name(m)) for m in members]
        if len(evs) % len(members) == 0:
            for k, e in enumerate(evs):
                m = members[k % len(members)]
                out[id(e)], placed[id(e)] = (scopes[k % len(members)], exe.instrs[m].opcode), m
        else:
            common = _common_scope(scopes)
            for e in evs:
                out[id(e)] = (common if common else (UNATTRIBUTED, e.name, ""), exe.instrs[members[0]].opcode)
    if launches.get("cublas"):
        out.update(_cublas_launches(exe, events, {id(e) for e in launches["cublas"]}, placed))
    return out


def _cublas_launches(exe: Executable, events: list, cublas: set, placed: dict) -> dict[int, tuple]:
    """cuBLAS kernels name no instruction, and one GEMM custom call may launch more than one kernel (the 9B
    prefill on the H200 left 79% of its time unattributed when launches were matched to calls by count). So each
    run of cuBLAS launches between two events whose instruction is known (its hlo_op or name, or a shared
    kernel's place) goes to the cuBLAS calls that the launch order puts between those two instructions: one
    launch per call when the counts agree, all to the call when there is one, else the scope those calls share
    (layer left open) or none. A run whose next anchor comes earlier in the launch order than its previous one
    spans two executions."""
    calls = exe.kernel_groups.get("cublas", [])
    order = exe.position
    cpos = [(order[c], c) for c in calls if c in order]
    out: dict[int, tuple] = {}

    def place(run, lo, hi):
        if hi is None or hi > lo:
            members = [c for p, c in cpos if lo < p and (hi is None or p < hi)]
        else:                                             # the run spans the end of one execution
            members = [c for p, c in cpos if p > lo] + [c for p, c in cpos if p < hi]
        if not members:
            return
        scopes = [scope_of(exe.op_name(m)) for m in members]
        if len(run) == len(members) or len(members) == 1:
            for k, e in enumerate(run):
                m = min(k, len(members) - 1)
                out[id(e)] = (scopes[m], exe.instrs[members[m]].opcode)
            return
        common = _common_scope(scopes)
        for e in run:
            out[id(e)] = (common if common else (UNATTRIBUTED, e.name, ""), exe.instrs[members[0]].opcode)

    run, lo = [], -1
    for e in sorted(events, key=lambda e: e.start_ns):
        if id(e) in cublas:
            run.append(e)
            continue
        name = placed.get(id(e)) or exe.find(e.hlo_op, e.name)
        if name is None or name not in order:
            continue
        place(run, lo, order[name])
        run, lo = [], order[name]
    place(run, lo, None)
    return out


def _common_scope(scopes: list) -> tuple | None:
    """The scope several layers' ops share, with the layer left open; None if they differ beyond the layer."""
    if len({s[1:] for s in scopes}) == 1 and all(s[0].startswith("layer") for s in scopes):
        return (AMBIGUOUS_LAYER if len({s[0] for s in scopes}) > 1 else scopes[0][0],) + scopes[0][1:]
    if len(set(scopes)) == 1:
        return scopes[0]
    return None


def assign(events: list, windows: list) -> list:
    """Put each event into the window its start falls in (windows must not overlap); returns the events that
    fell in none."""
    import bisect
    windows = sorted(windows, key=lambda w: w.start_ns)
    starts = [w.start_ns for w in windows]
    outside = []
    for e in events:
        i = bisect.bisect_right(starts, e.start_ns) - 1
        if i >= 0 and e.start_ns < windows[i].end_ns:
            windows[i].events.append(e)
        else:
            outside.append(e)
    return outside


# ---------------------------------------------------------------------------------------------------------------
# Aggregation


def block_of(scope: tuple) -> str:
    """Block type of a scope: embed / attention / gdn / mlp / norm+residual / lm_head / sampling / (unscoped) /
    (unattributed)."""
    top, block, _ = scope
    return block if top.startswith("layer") else top


def layer_index(scope: tuple) -> int | None:
    top = scope[0]
    return int(top[5:]) if top.startswith("layer") and top != AMBIGUOUS_LAYER else None


def by_block(events) -> dict[str, float]:
    """ms per block type."""
    out = collections.defaultdict(float)
    for e in events:
        out[block_of(e.scope)] += e.self_ns / 1e6
    return dict(out)


def by_scope(events) -> dict[str, float]:
    """ms per "block/sub-scope" summed over layers (e.g. "gdn/in_proj"), plus the top-level scopes."""
    out = collections.defaultdict(float)
    for e in events:
        top, block, sub = e.scope
        key = f"{block}/{sub}" if top.startswith("layer") and sub else block_of(e.scope)
        if top == UNATTRIBUTED:
            key = f"{UNATTRIBUTED} {block}"
        out[key] += e.self_ns / 1e6
    return dict(out)


def by_layer(events) -> dict[int, dict[str, float]]:
    """{layer: {"gdn/in_proj": ms, ..., "mlp/gate_up": ms, "norm+residual": ms}}."""
    out: dict[int, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    for e in events:
        i = layer_index(e.scope)
        if i is None:
            continue
        _, block, sub = e.scope
        out[i][f"{block}/{sub}" if sub else block] += e.self_ns / 1e6
    return {i: dict(v) for i, v in sorted(out.items())}
