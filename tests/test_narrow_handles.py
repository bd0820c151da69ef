"""No function below the loop takes the Trainer or the whole Config (read from the source, as
tests/test_import_graph.py reads the imports): components are handed their own handle (an
``Actor``, a ``RolloutService``, a ``Checkpointer``) and their own config section.

Allowed to take the whole Config: the loop and the trainer's construction (``trainer.loop``),
the launch and the CLI, ``trainer.config`` and ``trainer.preflight`` (preflight checks the whole
config by nature). Everything else in the ``trainer`` package may not have a parameter
annotated ``Config`` or ``Trainer`` nor one named ``trainer``.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "trainer"
ALLOWED = ("loop.py", "launch.py", "cli.py", "__main__.py", "config/", "preflight/")
WHOLE = {"Config", "Trainer"}


def _annotation_names(node: ast.expr | None) -> set[str]:
    if node is None:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a string annotation
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return set()
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def violations(source: str, where: str) -> list[str]:
    """``where:line function(param)`` for every parameter taking the Trainer or the Config."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        a = node.args
        for arg in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg]:
            if arg is None:
                continue
            taken = _annotation_names(arg.annotation) & WHOLE
            if arg.arg == "trainer" or taken:
                name = getattr(node, "name", "<lambda>")
                why = f": {sorted(taken)[0]}" if taken else ""
                out.append(f"{where}:{node.lineno} {name}({arg.arg}{why})")
    return out


def test_no_function_below_the_loop_takes_the_trainer_or_the_whole_config():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(ALLOWED):
            continue
        found += violations(path.read_text(), f"trainer/{rel}")
    assert not found, ("functions below the loop that take the Trainer or the whole Config "
                       "(hand them their component or config section):\n  "
                       + "\n  ".join(found))


def test_the_rule_sees_each_form():
    """The check catches a ``trainer`` parameter, a ``Config`` / ``Trainer`` annotation (plain,
    qualified, quoted, inside a union) and leaves a section's annotation alone."""
    src = '''
def a(trainer, x): ...
def b(cfg: Config): ...
def c(*, run: "Trainer"): ...
def d(cfg: config.Config | None = None): ...
class K:
    def e(self, cfg: TrainConfig, ema: EMAConfig): ...
f = lambda trainer: trainer
'''
    got = violations(src, "m.py")
    assert got == ["m.py:2 a(trainer)", "m.py:3 b(cfg: Config)", "m.py:4 c(run: Trainer)",
                   "m.py:5 d(cfg: Config)", "m.py:8 <lambda>(trainer)"], got
