"""The training corpus of the embedded default model: English prose about Python, read offline.

Sources (all under the PSF licence, all reachable on a fresh machine):
- the Python 3.11 documentation as reStructuredText, from Debian's ``python3.11-doc`` package
  (``/usr/share/doc/python3.11/html/_sources``);
- the docstrings of CPython's standard library (this interpreter's ``Lib/``).

(``pydoc_data.topics`` is left out: it is generated from the language reference, so it would leak
held-out reference pages into training.)

Markup is stripped to plain prose: directives, code and literal blocks, doctest sessions, tables and
section underlines are dropped, inline roles keep their text, and wrapped paragraphs are joined into
one line each. Each file or module is one document. A fixed, hash-chosen 5% of documents is held out
of training (and of tokenizer training) for the bits-per-byte check.
"""

from __future__ import annotations

import ast
import re
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DOCS_DIR = Path("/usr/share/doc/python3.11/html/_sources")
HELD_OUT_EVERY = 20  # one document in 20 is held out
SOURCES = (
    "Python 3.11 documentation (reStructuredText sources, Debian python3.11-doc), PSF License; "
    "CPython 3.11 standard library docstrings, PSF License"
)

# Directives whose body is code or machinery rather than prose.
_CODE_DIRECTIVES = {
    "code-block", "sourcecode", "code", "testcode", "testsetup", "testcleanup", "testoutput", "doctest",
    "literalinclude", "highlight", "toctree", "index", "productionlist", "raw", "only", "csv-table",
    "table", "list-table", "image", "figure", "audit-event", "availability", "impl-detail", "include",
    "sectionauthor", "moduleauthor", "module", "currentmodule", "program", "option", "cmdoption",
    "tabularcolumns", "autoclass", "autofunction", "c:function", "c:macro", "c:type", "c:member",
    "c:var", "c:struct", "opcode", "grammar-snippet",
}  # fmt: skip
_ROLE = re.compile(r":[\w:.+-]+:`(?:~|!)?([^`<]*?)(?:\s*<[^>]*>)?`")
_LITERAL = re.compile(r"``([^`]+)``")
_LINK = re.compile(r"`([^`<]+?)\s*<[^>]*>`_+")
_EMPH = re.compile(r"(?<![\w*])\*{1,2}([^*\s][^*]*?)\*{1,2}(?![\w*])")
_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+_.:])\1{2,}\s*$")
_LIST_ITEM = re.compile(r"^(?:[*\-+]|#\.|\d+\.|\(\w\))\s")
_FIELD = re.compile(r"^:[\w ]+:(?:\s|$)")  # a field list entry (:param x:, :version:), not a role


@dataclass(frozen=True)
class Document:
    name: str
    text: str

    @property
    def held_out(self) -> bool:
        return zlib.crc32(self.name.encode()) % HELD_OUT_EVERY == 0


def inline(text: str) -> str:
    """Inline markup to its plain text."""
    text = _ROLE.sub(lambda m: m.group(1).strip(), text)
    text = _LINK.sub(lambda m: m.group(1), text)
    text = _LITERAL.sub(lambda m: m.group(1), text)
    text = _EMPH.sub(lambda m: m.group(1), text)
    return text.replace("\\ ", "").replace("|", "")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _prose_lines(lines: list[str]) -> Iterator[tuple[int, str]]:
    """(indent, text) of the prose lines, with code, directives and tables skipped."""
    skip_deeper_than: int | None = None
    in_doctest = False
    for line in lines:
        stripped = line.strip()
        indent = _indent(line)
        if in_doctest:
            in_doctest = bool(stripped)  # a doctest session runs to the next blank line
            continue
        if skip_deeper_than is not None:
            if not stripped or indent > skip_deeper_than:
                continue
            skip_deeper_than = None
            yield 0, ""  # what follows a dropped block is a new paragraph
        if not stripped:
            yield 0, ""
            continue
        if stripped.startswith(".. "):
            name = stripped[3:].split("::", 1)[0].strip()
            if "::" not in stripped or name in _CODE_DIRECTIVES or name.startswith("_"):
                skip_deeper_than = indent  # a comment, a target or a code directive: drop its body
            yield 0, ""
            continue
        if stripped.startswith(">>>"):
            in_doctest = True
            continue
        if stripped.endswith("::"):
            skip_deeper_than = indent  # a literal block follows
            stripped = stripped[:-2].rstrip() + (":" if not stripped[:-2].endswith(" ") else "")
            if not stripped.strip(":"):
                continue
        elif (
            _UNDERLINE.match(stripped) or _FIELD.match(stripped) or stripped.startswith(("+--", "+==", "==="))
        ):
            continue
        yield indent, stripped


def reflow(lines: list[str]) -> str:
    """Joins wrapped lines into paragraphs; list items start new lines; blank lines separate."""
    paragraphs: list[str] = []
    current: list[str] = []
    for _indent_level, text in _prose_lines(lines):
        if not text or _LIST_ITEM.match(text):
            if current:
                paragraphs.append(" ".join(current))
            current = [text] if text else []
            continue
        current.append(text)
    if current:
        paragraphs.append(" ".join(current))
    joined = [re.sub(r"\s+", " ", inline(p)).strip() for p in paragraphs]
    return "\n\n".join(p for p in joined if len(p) > 1)


def docs_documents(root: Path = DOCS_DIR) -> Iterator[Document]:
    for path in sorted(root.rglob("*.rst.txt")):
        if path.parts[-2] == "whatsnew" and path.name.startswith("changelog"):
            continue  # an issue-number list, not prose
        text = reflow(path.read_text(encoding="utf-8", errors="replace").splitlines())
        if text:
            yield Document(f"docs/{path.relative_to(root)}", text)


def _docstrings(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) > 40:
                yield doc


def stdlib_documents() -> Iterator[Document]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(lib.rglob("*.py")):
        rel = path.relative_to(lib)
        if rel.parts[0] in ("site-packages", "test", "idlelib", "lib2to3") or "tests" in rel.parts:
            continue
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):
            continue
        texts = [reflow(doc.splitlines()) for doc in _docstrings(tree)]
        text = "\n\n".join(t for t in texts if t)
        if text:
            yield Document(f"stdlib/{rel}", text)


def all_documents() -> list[Document]:
    if not DOCS_DIR.is_dir():
        raise SystemExit(
            f"{DOCS_DIR} is missing: install Debian's python3.11-doc (apt-get install python3.11-doc)"
        )
    return [*docs_documents(), *stdlib_documents()]
