"""The layers of docs/ARCHITECTURE.md hold: the package's imports form no cycle, each C++ folder includes only what
its layer may (proxy/ no kernels, ffi, CUDA or XLA; kernels/ no ffi, XLA or Python; kernels/cpu no CUDA), every op
has a handler on every built platform, and the package leaves the tests' extension alone."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "jax_uccl_ep")


def _package_imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name in os.listdir(PACKAGE):
        if not name.endswith(".py"):
            continue
        module = name[:-3]
        with open(os.path.join(PACKAGE, name)) as f:
            tree = ast.parse(f.read())
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    deps.add(node.module.split(".")[0])
                else:
                    deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax_uccl_ep."):
                deps.add(node.module.split(".")[1])
        graph[module] = {d for d in deps if os.path.exists(os.path.join(PACKAGE, d + ".py"))}
    return graph


def test_the_package_has_no_import_cycle():
    graph = _package_imports()
    graph.pop("__init__", None)  # the package's face imports everything; nothing imports it back
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            assert state.get(dep) != 1, "import cycle: " + " -> ".join(path + [dep])
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


FORBIDDEN = {
    "proxy": [r"\.\./kernels/", r"\.\./ffi/", r"cuda", r"xla/", r"nanobind", r"Python\.h"],
    "kernels": [r"\.\./ffi/", r"\.\./\.\./ffi/", r"xla/", r"nanobind", r"Python\.h"],
    "kernels/cpu": [r"cuda", r"\.\./nvl/"],
}


def test_each_folder_includes_only_what_its_layer_may():
    offences = []
    for folder, patterns in FORBIDDEN.items():
        top = os.path.join(ROOT, folder)
        for dirpath, _, files in os.walk(top):
            for name in files:
                if not name.endswith((".hpp", ".cpp", ".cu", ".cuh")):
                    continue
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    includes = re.findall(r'^#include [<"]([^>"]+)[>"]', f.read(), re.M)
                offences += [
                    f"{os.path.relpath(path, ROOT)} includes {inc}"
                    for inc in includes
                    if any(re.search(p, inc) for p in patterns)
                ]
    assert not offences, offences


def test_the_gpu_kernels_meet_at_barriers_that_tolerate_a_split_warp():
    """kernels/nvl's block barriers are sync.cuh's block_sync (sums in shared memory between them): the aligned
    barrier (__syncthreads and its _count/_and/_or forms, bar.sync, bar.red, barrier.*.aligned) lets a warp that
    reaches it split through early, and these kernels leave work to single lanes all over (docs/ARCHITECTURE.md, the
    path of one op)."""
    aligned = re.compile(r"__syncthreads\w*\s*\(|\bbar\.(sync|red|arrive)\b|barrier\.\w+\.aligned|\.aligned\b")
    offences = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "kernels", "nvl")):
        for name in files:
            if not name.endswith((".cu", ".cuh")):
                continue
            path = os.path.join(dirpath, name)
            with open(path) as f:
                for number, line in enumerate(f, 1):
                    code = line.split("//")[0]
                    if aligned.search(code):
                        offences.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
    assert not offences, offences


def test_every_op_has_a_handler_on_every_built_platform():
    from jax_uccl_ep import _uccl_ep

    ops = set()
    for name in os.listdir(PACKAGE):
        if name.endswith(".py"):
            with open(os.path.join(PACKAGE, name)) as f:
                # The op's name is the call's first argument: a literal, or a choice of literals.
                for first in re.findall(r'ep_call\(\s*("\w+"(?:\s+if\s+[^,]*?\s+else\s+"\w+")?)', f.read()):
                    ops |= set(re.findall(r'"(\w+)"', first))
    assert {"layout", "dispatch", "combine", "combine_pairs", "low_latency_dispatch"} <= ops  # the scan finds them
    targets = {"uccl_ep_" + op for op in ops}
    assert targets <= set(_uccl_ep.cpu_registrations()), targets - set(_uccl_ep.cpu_registrations())
    if hasattr(_uccl_ep, "cuda_registrations"):  # a CUDA build: every op on GPUs too
        assert targets <= set(_uccl_ep.cuda_registrations()), targets - set(_uccl_ep.cuda_registrations())


def test_the_extension_stub_names_what_the_extension_has():
    """jax_uccl_ep/_uccl_ep.pyi (the type checker's view of the extension) names every function and class the built
    extension has, and, in a CUDA build, nothing else (CPU builds lack the CUDA ones)."""
    from jax_uccl_ep import _uccl_ep

    with open(os.path.join(PACKAGE, "_uccl_ep.pyi")) as f:
        tree = ast.parse(f.read())
    stub = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    built = {name for name in dir(_uccl_ep) if not name.startswith("_")}
    assert built <= stub, sorted(built - stub)
    if hasattr(_uccl_ep, "cuda_registrations"):
        assert stub <= built, sorted(stub - built)


def test_the_package_never_loads_the_test_hooks():
    """The hooks, microbenchmarks and test modes live in the tests' extension (jax_uccl_ep._uccl_ep_testing): no
    module of the package names it, and importing the package leaves it unloaded."""
    naming = []
    for name in os.listdir(PACKAGE):
        if name.endswith(".py"):
            with open(os.path.join(PACKAGE, name)) as f:
                if "_uccl_ep_testing" in f.read():
                    naming.append(name)
    assert not naming, naming
    probe = "import sys, jax_uccl_ep; print('jax_uccl_ep._uccl_ep_testing' in sys.modules)"
    with tempfile.TemporaryDirectory() as cwd:  # the installed package, not the sources
        out = subprocess.run([sys.executable, "-c", probe], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
