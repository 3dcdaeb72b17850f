"""The scheduler is the one owner of request state (engine/scheduler/transitions.py): no
library module outside engine/scheduler/ assigns, deletes or mutates in place a request's
progress fields. Walks the source (AST), so a new writer anywhere fails here."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = ("engine", "models", "serving", "pallas_kernels")
OWNER = ROOT / "engine" / "scheduler"
# Progress, pages and lifecycle of a Request: written by the scheduler only.
OWNED = {"num_computed", "in_flight", "pending_row", "output_ids", "pages", "page_hashes", "status",
         "finish_reason", "cached_tokens", "error", "finished_at", "first_scheduled", "first_token",
         "last_token", "num_preemptions", "replica"}
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse"}
# Objects of other types whose fields happen to share a name (a client's result, a stream).
NOT_REQUESTS = {("serving/engine_loop.py", "stream"), ("serving/engine_loop.py", "self"),
                ("serving/engine_thread.py", "stream"), ("serving/engine_thread.py", "self"),
                ("serving/bench_load.py", "res"), ("serving/client.py", "self")}


def _base(node: ast.AST) -> str:
    return node.id if isinstance(node, ast.Name) else ast.unparse(node)


def writes(tree: ast.AST, rel: str):
    """(line, 'base.field') for every write to an owned field in one module."""
    found = []

    def owned_attr(node):
        if isinstance(node, ast.Attribute) and node.attr in OWNED and (rel, _base(node.value)) not in NOT_REQUESTS:
            return node
        return None

    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            attr = owned_attr(node.func.value)
            if attr is not None:
                found.append((node.lineno, f"{_base(attr.value)}.{attr.attr}.{node.func.attr}()"))
        for target in targets:
            for sub in ast.walk(target):
                attr = owned_attr(sub) if isinstance(getattr(sub, "ctx", None), (ast.Store, ast.Del)) else None
                if isinstance(sub, ast.Subscript):
                    attr = owned_attr(sub.value)
                if attr is not None:
                    found.append((node.lineno, f"{_base(attr.value)}.{attr.attr}"))
    return found


def request_init_lines(tree: ast.AST) -> set[int]:
    """Lines of Request.__init__ in engine/request.py: where the fields are declared."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "Request":
            init = next(f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
            return set(range(init.lineno, init.end_lineno + 1))
    raise AssertionError("engine/request.py has no Request.__init__")


def library_writers() -> list[str]:
    out = []
    for folder in LIBRARY:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if OWNER in path.parents or "proto" in path.parts:
                continue
            rel = path.relative_to(ROOT).as_posix()
            tree = ast.parse(path.read_text(), rel)
            skip = request_init_lines(tree) if rel == "engine/request.py" else set()
            out += [f"{rel}:{line} {what}" for line, what in writes(tree, rel) if line not in skip]
    return out


def test_only_the_scheduler_writes_request_state():
    assert library_writers() == []


def test_the_walk_finds_each_kind_of_write():
    """The checker itself: every shape of write that main cf0d47f had outside the scheduler."""
    src = "\n".join([
        "req.num_computed = sch.start + sch.num_new",  # assignment
        "req.in_flight -= 1",  # augmented assignment
        "del req.output_ids[num_tokens:]",  # slice deletion
        "req.output_ids.append(token)",  # in-place mutation
        "e.requests[rid].status = 'finished'",  # through a subscript
        "req.pages, req.page_hashes = [], []",  # tuple target
        "stream.cached_tokens = 3",  # a RequestStream in engine_loop: allowed there only
    ])
    found = sorted(what for _, what in writes(ast.parse(src), "engine/engine.py"))
    assert found == sorted(["req.num_computed", "req.in_flight", "req.output_ids", "req.output_ids.append()",
                     "e.requests[rid].status", "req.pages", "req.page_hashes", "stream.cached_tokens"])
    assert writes(ast.parse("stream.cached_tokens = 3"), "serving/engine_loop.py") == []
