"""The grader's guard: the first cell of every graded notebook runs `make_guard` before any cell of the student's.

`autograde._install_guard` injects this file's text into that cell (so the guard's state lives in a closure that no
`sys.modules` entry or package attribute reaches) and rewrites each checker cell to call the returned guard.
"""

from typing import Any  # no `from __future__` here: it would change how IPython compiles the student's later cells

__all__ = ["make_guard"]


def make_guard(preload: list[str], mime: str, checks_package: str) -> Any:
    """Import the checks twice (public and private), record what they rely on, and return the `Guard` whose `get`
    hands the checker cells the private checks and whose `begin`/`done` report (as `mime` display data) what changed
    since; a change to what the private copy uses raises CheckingMachineryModified (the cell scores 0)."""
    import builtins
    import importlib
    import sys
    import types

    from IPython import get_ipython
    from IPython.display import publish_display_data

    for name in preload:
        importlib.import_module(name)
    def mine(k):
        return k == checks_package or k.startswith(checks_package + ".")

    public = importlib.import_module(checks_package)
    parent = importlib.import_module(checks_package.rpartition(".")[0])
    shared = {k: sys.modules.pop(k) for k in list(sys.modules) if mine(k)}
    try:
        private = importlib.import_module(checks_package)
    finally:
        own = {k: sys.modules.pop(k) for k in list(sys.modules) if mine(k)}
        sys.modules.update(shared)
        setattr(parent, checks_package.rpartition(".")[2], public)
    checkers = {n: getattr(private, n) for n in private.__all__ if n.startswith("check_")}
    shell = get_ipython()
    unwatched_builtins = {"input", "raw_input", "get_ipython", "exit", "quit", "display", "help", "copyright",
                          "credits", "license", "_", "__", "___"}

    def watched_objects():
        """(label, kind, object): kind 'public' is flagged only, 'used' is flagged and fails the check."""
        out = [(k, "public", m) for k, m in shared.items()] + [(k + " (the grader's copy)", "used", m)
                                                               for k, m in own.items()]
        for k, m in list(sys.modules.items()):
            if m is not None and (k == "fsdp_course" or k.startswith("fsdp_course.")) and not mine(k):
                out.append((k, "used", m))
        for k in ("torch", "torch.distributed", "torch.distributed.distributed_c10d", "torch.nn.functional",
                  "torch.testing", "math", "builtins"):
            if k in sys.modules:
                out.append((k, "used", sys.modules[k]))
        classes = []
        for label, kind, m in list(out):
            classes += [(f"{label}.{n}", kind, c) for n, c in vars(m).items()
                        if isinstance(c, type) and getattr(c, "__module__", None) == m.__name__]
        import torch
        classes += [(f"torch.{c.__name__}", "used", c) for c in (torch.Tensor, torch.nn.Module, torch.nn.Parameter)]
        for obj in (shell, getattr(shell, "kernel", None)):
            if obj is not None:
                classes += [(f"{c.__module__}.{c.__qualname__}", "used", c) for c in type(obj).__mro__
                            if c is not object]
        return out + classes

    def fingerprint(ns, skip=()):
        table = {}
        for k, v in list(ns.items()):
            if k in skip or not (callable(v) or isinstance(v, (types.ModuleType, staticmethod, classmethod,
                                                               property))):
                continue
            code = getattr(v, "__code__", None) if isinstance(v, types.FunctionType) else None
            table[k] = (v, code, getattr(v, "__defaults__", None), getattr(v, "__kwdefaults__", None))
        return table

    def shell_state():
        return {"an IPython custom exception handler (set_custom_exc)": (tuple(shell.custom_exceptions),
                                                                         shell.CustomTB),
                "IPython's input transformers": tuple(shell.input_transformers_cleanup)
                + tuple(shell.input_transformers_post),
                "IPython's AST transformers": tuple(shell.ast_transformers),
                "IPython's event callbacks": tuple((e, tuple(c)) for e, c in shell.events.callbacks.items()),
                "sys.excepthook": sys.excepthook,
                "the IPython shell's methods": methods(shell),
                "the kernel's methods": methods(getattr(shell, "kernel", shell))}

    def methods(obj):
        return tuple(sorted((k, id(v)) for k, v in vars(obj).items()
                            if isinstance(v, types.MethodType | types.FunctionType)))

    watched = watched_objects()
    tables = {label: (kind, obj, fingerprint(vars(obj), unwatched_builtins if obj is builtins else ()))
              for label, kind, obj in watched}
    modules = {label: obj for label, _, obj in watched
               if isinstance(obj, types.ModuleType) and not label.endswith("(the grader's copy)")}
    state = shell_state()
    torch_wraps = {("torch", "manual_seed")}  # importing torch._dynamo (2-3 s) wraps it, keeping it as __wrapped__
    public_names = {n: getattr(public, n) for n in checkers}

    def findings():
        found = []  # (kind, what)
        for label, (kind, obj, table) in tables.items():
            ns = vars(obj)
            for k, (v, code, defaults, kwdefaults) in table.items():
                now = ns.get(k, found)
                if now is found:
                    found.append((kind, f"{label}.{k} was deleted"))
                elif (label, k) in torch_wraps and getattr(now, "__wrapped__", None) is v:
                    continue
                elif now is not v:
                    found.append((kind, f"{label}.{k} was replaced"))
                elif code is not None and (now.__code__ is not code or now.__defaults__ is not defaults
                                           or now.__kwdefaults__ is not kwdefaults):
                    found.append((kind, f"{label}.{k}'s code was replaced"))
        for name, m in modules.items():
            if sys.modules.get(name) is not m:
                found.append(("public" if mine(name) else "used", f"sys.modules[{name!r}] was replaced"))
        for what, value in shell_state().items():
            if value != state[what]:
                found.append(("used", f"{what} changed"))
        user_ns = shell.user_ns
        for n, fn in checkers.items():
            if n in user_ns and user_ns[n] is not fn and user_ns[n] is not public_names[n]:
                found.append(("public", f"the notebook's namespace.{n} was rebound"))
        return found

    def report(grade_id, stage, nonce=None):
        found = findings()
        flags = summary(found)
        publish_display_data({mime: {"grade_id": grade_id, "stage": stage, "nonce": nonce, "flags": flags},
                              "text/plain": f"(grader: {len(flags)} findings)"})
        used = summary([f for f in found if f[0] == "used"])
        if used:
            raise CheckingMachineryModified(
                "this check is not scored: the notebook modified what the checker relies on ("
                + "; ".join(used) + "). Your instructor sees this note.")

    def summary(found):
        """One line per module (or class) and kind of change: 'torch.equal was replaced', or
        '3 names in torch were replaced: allclose, equal, isclose'."""
        groups = {}
        for _, what in found:
            head, sep, tail = what.partition(" was ")
            label, dot, name = head.rpartition(".") if sep and not head.startswith("sys.modules") else ("", "", head)
            groups.setdefault((label, tail) if label else (what, ""), []).append(name)
        lines = []
        for (label, tail), names in sorted(groups.items()):
            names = sorted(set(names))
            if not tail:
                lines.append(label)
            elif len(names) == 1:
                lines.append(f"the notebook's name {names[0]} was {tail}" if label == "the notebook's namespace"
                             else f"{label}.{names[0]} was {tail}")
            else:
                shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
                lines.append(f"{len(names)} names in {label} were {tail}: {shown}")
        return lines

    class CheckingMachineryModified(Exception):
        """A checker cell found the checking machinery modified: the cell scores 0, the note goes to the instructor."""

    class Guard:
        __slots__ = ()

        def begin(self, grade_id):
            report(grade_id, "begin")

        def get(self, *names):
            fns = tuple(checkers.get(n) or getattr(own[checks_package], n) for n in names)
            return fns[0] if len(fns) == 1 else fns

        def done(self, grade_id, nonce):
            report(grade_id, "done", nonce)

    return Guard()
