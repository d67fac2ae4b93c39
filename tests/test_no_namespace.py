"""Values, not the namespace: below the programs no function takes the argparse namespace. Only the programs
(spo.py, eval.py, offline_values.py and the command-line tools in bench/ and experiments/) read `args`; every other
function is given the values it uses, by name.

    .venv/bin/python -m pytest tests/test_no_namespace.py -q
"""
import ast
import os

from common import ROOT

PROGRAMS = {"spo.py", "eval.py", "offline_values.py", "test_spo.py"}
PROGRAM_FOLDERS = ("bench/", "experiments/", "tests/")


def namespace_parameters(source):
    """The functions of `source` with a parameter named `args` (not *args): (name, line) pairs."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            if any(p.arg == "args" for p in params):
                found.append((node.name, node.lineno))
    return found


def test_no_module_below_the_programs_takes_args():
    offenders = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        for name in files:
            path = os.path.relpath(os.path.join(folder, name), ROOT).replace(os.sep, "/")
            if not name.endswith(".py") or path in PROGRAMS or path.startswith(PROGRAM_FOLDERS):
                continue
            offenders += [f"{path}:{fn} (line {line})" for fn, line in namespace_parameters(open(os.path.join(
                ROOT, path)).read())]
    assert not offenders, f"functions below the programs that take the namespace: {offenders}"


def test_the_check_sees_an_args_parameter_and_not_star_args():
    assert namespace_parameters("def f(x, args):\n    pass\n") == [("f", 1)]
    assert namespace_parameters("def f(*, args=None):\n    pass\n") == [("f", 1)]
    assert namespace_parameters("def f(*args, **kwargs):\n    pass\n") == []
