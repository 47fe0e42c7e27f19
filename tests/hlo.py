"""Where instructions sit in a compiled XLA program (``jax.jit(f).lower(...).compile()
.as_text()``): enough structure to tell work that runs at every diffrax step from work
that runs once per save time."""

import re

_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_NAME = re.compile(r"^\s+(?:ROOT )?%?[\w.\-]+ = ")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_CALLED = re.compile(
    r"\b(?:body|condition|to_apply|calls|true_computation|"
    r"false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
# diffrax names its loops with jax.named_call: the step loop "outer-loop", the loop over
# the save times that fall in one step "inner-loop"; equinox may add "checkpointed-*".
_OUTER = re.compile(r"outer-loop(?:/checkpointed-[\w\-]+)?/while$")
_INNER = re.compile(r"inner-loop(?:/checkpointed-[\w\-]+)?/while$")


def _opcode(line):
    """The opcode of an instruction line ``%name = SHAPE opcode(...)``, where SHAPE may be
    a tuple ``(s32[], /*index=5*/f32[4]{0})``; None for other lines."""
    name = _NAME.match(line)
    if name is None:
        return None
    i = name.end()
    if line[i] == "(":
        depth = 0
        for i in range(name.end(), len(line)):
            depth += {"(": 1, ")": -1}.get(line[i], 0)
            if depth == 0:
                break
    else:
        i = line.index(" ", i)
    op = _OPCODE.match(line, i + 1)
    return op.group(1) if op else None


def parse(text):
    """``{computation: [(opcode, op_name, [called computations], while body or None)]}``."""
    comps, current = {}, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = comps.setdefault(header.group(1), [])
            continue
        op = _opcode(line)
        if current is None or op is None:
            continue
        called = _CALLED.findall(line)
        for group in _BRANCHES.findall(line):
            called += [c.strip().lstrip("%") for c in group.split(",")]
        op_name = _OP_NAME.search(line)
        body = _BODY.search(line)
        current.append(
            (op, op_name.group(1) if op_name else "", called, body.group(1) if body else None)
        )
    return comps


def _count(comps, root, opcode, stop):
    """``opcode`` instructions reachable from computation ``root``, not descending into the
    computations called by instructions for which ``stop(opcode, op_name)`` holds."""
    seen, todo, n = set(), [root], 0
    while todo:
        comp = todo.pop()
        if comp in seen or comp not in comps:
            continue
        seen.add(comp)
        for op, op_name, called, _ in comps[comp]:
            n += op == opcode
            if not stop(op, op_name):
                todo += called
    return n


def save_loop_counts(text, opcode="sort"):
    """``(per_step, per_save)``: the ``opcode`` instructions of diffrax's step loops that
    run at every step (reachable from a step loop's body other than through a save loop)
    and those inside a save loop (run once per save time)."""
    comps = parse(text)
    is_save_loop = lambda op, name: op == "while" and bool(_INNER.search(name))  # noqa: E731
    per_step = per_save = 0
    for insts in comps.values():
        for op, op_name, _, body in insts:
            if op != "while":
                continue
            if _OUTER.search(op_name):
                per_step += _count(comps, body, opcode, is_save_loop)
            elif _INNER.search(op_name):
                per_save += _count(comps, body, opcode, lambda op, name: False)
    return per_step, per_save
