"""mkdocs hook: generate the events catalogue page (reference/events.md) from deadpool/events/schema.py.

Each event kind is one msgspec Struct in the schema module; this hook imports the module for the kinds
(in the schema's own order, with their tags and docstrings) and reads its source with ``ast`` for each
field's type, default and trailing comment.  The page is generated at build time and never written to
disk, so it cannot drift from the schema.
"""

from __future__ import annotations

import ast
import enum
import html
import inspect
import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parents[2]
PAGE = "reference/events.md"
SECTION = re.compile(r"^# -- (.+?) -+$")


def _schema() -> Any:
    sys.path.insert(0, str(REPO))
    try:
        from deadpool.events import schema, vocabulary
    finally:
        sys.path.remove(str(REPO))
    return schema, vocabulary


def _fields(source_lines: list[str], node: ast.ClassDef) -> list[tuple[str, str, str, str]]:
    """(name, type, default, comment) of each field the class declares itself."""
    out = []
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            name = item.target.id
            if name.isupper():  # a ClassVar constant, not a field on disk
                continue
            annotation = ast.unparse(item.annotation)
            if annotation.startswith("ClassVar"):
                continue
            default = ast.unparse(item.value) if item.value is not None else ""
            line = source_lines[item.lineno - 1]
            comment = line.split("#", 1)[1].strip() if "#" in line else ""
            out.append((name, annotation, default, comment))
    return out


def _member_comments(path: Path, class_name: str) -> dict[str, str]:
    """The trailing comment of each member of an enum class in `path`, by member name."""
    source = path.read_text()
    lines = source.splitlines()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return {item.targets[0].id: lines[item.lineno - 1].split("#", 1)[1].strip()
                    for item in node.body
                    if isinstance(item, ast.Assign) and isinstance(item.targets[0], ast.Name)
                    and "#" in lines[item.lineno - 1]}
    return {}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _code(text: str) -> str:
    """Inline code for a table cell: a pipe inside backticks would split the cell (or show its escape)."""
    return "<code>" + html.escape(text).replace("|", "&#124;") + "</code>"


def render() -> str:
    schema, vocabulary = _schema()
    path = Path(inspect.getfile(schema))
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    sections = [(i + 1, m.group(1)) for i, line in enumerate(lines) if (m := SECTION.match(line))]
    enums = {name: cls for name, cls in vars(vocabulary).items()
             if isinstance(cls, type) and issubclass(cls, enum.Enum) and cls.__module__ == vocabulary.__name__}

    out = [
        "# Events catalogue",
        "",
        "<!-- Generated at build time by docs/hooks/events_catalogue.py from deadpool/events/schema.py. -->",
        "",
        "Every process of a job appends JSON lines to the events file (`deadpool launch --events FILE`). Each "
        "line is one of the records below: the writer builds the record and checks the line against it before "
        "writing, and every reader (`deadpool events`, the launcher's summaries, the metrics, the simulator's "
        "checks, `--check-determinism`, the benchmarks) validates each line against its kind's record. A line "
        "that does not match is reported with its line number, kind and field; a line of a kind the reader does "
        "not know (a newer writer's) is kept by name. This page is generated from "
        "`deadpool/events/schema.py`, one msgspec Struct per kind.",
        "",
        "## The envelope",
        "",
        "Every line carries these fields besides its kind's own; `event` is the kind's name.",
        "",
        "| field | type | meaning |",
        "|---|---|---|",
    ]
    for name, annotation, _default, comment in _fields(lines, classes["Record"]):
        out.append(f"| `{name}` | {_code(annotation)} | {_cell(comment)} |")
    out.append("")

    kinds = list(schema.EventRecord.__args__)
    current = None
    used_enums: set[str] = set()
    for kind in kinds:
        node = classes[kind.__name__]
        section = next((title for lineno, title in reversed(sections) if lineno < node.lineno), "")
        if section != current:
            current = section
            out += [f"## {section[0].upper() + section[1:]}" if section else "## Other events", ""]
        tag = kind.__struct_config__.tag
        doc = inspect.cleandoc(kind.__doc__ or "")
        out += [f"### `{tag}`", "", doc.replace("\n", " "), ""]
        fields = _fields(lines, node)
        if fields:
            out += ["| field | type | default | meaning |", "|---|---|---|---|"]
            for name, annotation, default, comment in fields:
                for enum_name in enums:
                    if re.search(rf"\b{enum_name}\b", annotation):
                        used_enums.add(enum_name)
                        annotation_md = f"[{_code(annotation)}](#{enum_name.lower()})"
                        break
                else:
                    annotation_md = _code(annotation)
                out.append(f"| `{name}` | {annotation_md} | {_code(default) if default else ''} | "
                           f"{_cell(comment)} |")
            out.append("")
        else:
            out += ["Only the envelope.", ""]

    if used_enums:
        out += ["## Vocabularies", "",
                "Fields with a closed set of values (`deadpool/events/vocabulary.py`); the line holds the value.", ""]
        for enum_name in sorted(used_enums):
            cls = enums[enum_name]
            comments = _member_comments(Path(inspect.getfile(vocabulary)), enum_name)
            out += [f"### {enum_name}", "", inspect.cleandoc(cls.__doc__ or "").replace("\n", " "), "",
                    "| value | meaning |", "|---|---|"]
            out += [f"| `{member.value}` | {_cell(comments.get(member.name, ''))} |" for member in cls]
            out.append("")
    return "\n".join(out)


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, PAGE, content=render()))
    return files
