"""Prompt sets built from Python's standard library sources (the running interpreter's; no network).

- `doc_qa`: a function's or class's documentation (its signature and docstring) and a question
  about it, answered from that documentation: what a user asks a model next to a retrieved page.
- `LONG_MODULES`: long modules whose sources make prompts of thousands of tokens.
- `coding_conversations`: four-turn coding conversations about one real function each. The first
  turn shows the function and asks for an edit; every later turn asks for the whole function
  again with one more edit, so the assistant's earlier answer comes back as prompt and, mostly,
  again as output, as in a coding agent's session. The benchmark sends each turn with the
  earlier turns' actual answers (bench: multi_turn).

Sources are read with `ast`, never imported: the same interpreter version gives the same sets.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from pathlib import Path

# Pure-Python modules with plain, self-contained functions, in a fixed order.
MODULES = (
    "textwrap",
    "shlex",
    "fnmatch",
    "posixpath",
    "ntpath",
    "colorsys",
    "bisect",
    "heapq",
    "calendar",
    "difflib",
    "statistics",
    "string",
    "base64",
    "html",
    "gettext",
    "mimetypes",
    "random",
    "functools",
    "copy",
    "pprint",
    "tokenize",
    "linecache",
    "shutil",
    "filecmp",
    "tempfile",
    "glob",
    "quopri",
    "fractions",
    "ipaddress",
    "urllib.parse",
    "email.utils",
    "json.decoder",
    "csv",
    "argparse",
)
# Long single-file modules, one per long prompt (bench: peer_llama_cpp --prompt-reading).
LONG_MODULES = (
    "argparse",
    "difflib",
    "tarfile",
    "inspect",
    "typing",
    "subprocess",
    "threading",
    "configparser",
    "smtplib",
    "ftplib",
    "pickletools",
    "calendar",
)
DOC_CHARS = (300, 2000)  # docstrings this long make a page worth asking about
CODE_LINES = (8, 40)  # functions this long make a conversation's turns
QUESTIONS = (
    "What does `{name}` do, and what does it return? Answer from the documentation above.",
    "Which parameters does `{name}` take, and what does each one mean? Quote the documentation "
    "where it helps.",
    "Write a short example that uses `{name}` as the documentation above describes, and explain "
    "what it prints.",
    "Summarize the documentation of `{name}` in a few sentences, then list anything a caller must "
    "watch out for.",
)


@dataclass(frozen=True)
class Conversation:
    """A conversation's user turns; the assistant's answers come from the model being measured."""

    name: str  # module.function it is about
    turns: tuple[str, ...]


def _module_tree(module: str) -> ast.Module | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return ast.parse(Path(spec.origin).read_text(encoding="utf-8"))


def _public(node: ast.stmt) -> bool:
    return isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_")


def _documented(module: str, tree: ast.Module) -> list[tuple[str, ast.FunctionDef | ast.ClassDef]]:
    """Public functions and classes, and the public methods of public classes, by qualified name."""
    found = []
    for node in tree.body:
        if not _public(node):
            continue
        found.append((f"{module}.{node.name}", node))
        if isinstance(node, ast.ClassDef):
            found += [(f"{module}.{node.name}.{item.name}", item) for item in node.body if _public(item)]
    return found


def doc_qa_prompts() -> tuple[str, ...]:
    """One prompt per documented public function or class, the questions taking turns."""
    prompts = []
    for module in MODULES:
        tree = _module_tree(module)
        if tree is None:
            continue
        for name, node in _documented(module, tree):
            doc = ast.get_docstring(node)
            if not doc or not DOC_CHARS[0] <= len(doc) <= DOC_CHARS[1]:
                continue
            signature = f"{name}({ast.unparse(node.args)})" if isinstance(node, ast.FunctionDef) else name
            question = QUESTIONS[len(prompts) % len(QUESTIONS)].format(name=name)
            prompts.append(f"Documentation of `{signature}`:\n\n{doc}\n\n{question}")
    return tuple(prompts)


def _assigned_names(function: ast.FunctionDef) -> list[str]:
    """Local names the function assigns, first appearance first."""
    names = [
        node.id
        for node in ast.walk(function)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
    ]
    return list(dict.fromkeys(names))


def _turns(name: str, source: str, function: ast.FunctionDef) -> tuple[str, ...]:
    ask = "Return the whole function, unchanged apart from that, in one Python code block."
    again = "Return the whole function again, with every earlier change kept, in one Python code block."
    variable = (_assigned_names(function) or [argument.arg for argument in function.args.args] or ["result"])[
        0
    ]
    return (
        f"Here is `{name}` from Python's standard library:\n\n```python\n{source}\n```\n\n"
        f"Add type hints to its parameters and its return value. {ask}",
        f"Now rename the variable `{variable}` to `{variable}_value` everywhere in the function. {again}",
        f"Now add a one-line comment above every `if`, `for` and `while` statement saying what it checks "
        f"or does. {again}",
        f"Finally, replace the docstring with a short one that says what the function returns. {again}",
    )


def coding_conversations() -> tuple[Conversation, ...]:
    """One conversation per public top-level function of CODE_LINES lines."""
    conversations = []
    for module in MODULES:
        tree = _module_tree(module)
        if tree is None:
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            source = ast.get_source_segment(source_of(module), node)
            if source is None or not CODE_LINES[0] <= source.count("\n") + 1 <= CODE_LINES[1]:
                continue
            name = f"{module}.{node.name}"
            conversations.append(Conversation(name, _turns(name, source, node)))
    return tuple(conversations)


def source_of(module: str) -> str:
    """A standard-library module's source text, as the running interpreter has it."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).read_text(encoding="utf-8")
