"""docs/pipeline.md's flag table against the parser: every flag of ElmoOptions has a row, and every default the
table states as a value is the parser's."""
import argparse
import os
import re

from elmo_pipeline.pipeline.options import ElmoOptions

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "pipeline.md")
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parser_defaults() -> dict:
    p = argparse.ArgumentParser()
    ElmoOptions._add_argparse_args(p)  # noqa: SLF001
    return {next(o for o in a.option_strings if o.startswith("--")): a for a in p._actions  # noqa: SLF001
            if a.option_strings and a.dest != "help"}


def table_defaults() -> dict:
    text = open(DOC, encoding="utf-8").read()
    section = text[text.index("## Flags"):text.index("## Outputs")]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| `--"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            for flag in re.findall(r"`(--[a-z0-9-]+)`", cells[0]):
                rows[flag] = cells[1]
    return rows


def stated(cell: str):
    """The value a default cell states, or ... when it describes one in words (e.g. 'shipped model')."""
    cell = cell.strip()
    if cell in ("required", "none"):
        return None
    if cell == "off":
        return False
    if m := re.fullmatch(r"`([^`]*)`", cell):
        return m.group(1)
    if m := re.fullmatch(r"([\d,]+)(?: (KiB|MiB|GiB))?(?: \(.*\))?", cell):
        return int(m.group(1).replace(",", "")) * UNITS.get(m.group(2), 1)
    return ...


def test_every_flag_has_a_row_and_each_stated_default_is_the_parsers():
    parser, table = parser_defaults(), table_defaults()
    assert sorted(set(parser) - set(table)) == [], "flags without a row in docs/pipeline.md's flag table"
    assert sorted(set(table) - set(parser)) == [], "rows of flags the parser does not have"
    wrong = []
    for flag, cell in table.items():
        want, action = stated(cell), parser[flag]
        have = action.default
        if want is ... or (want is None and have in (None, 0)) or (have is None and want is not None):
            continue            # described in words, or a default resolved at run time (e.g. the model)
        if want != have and str(want) != str(have):
            wrong.append(f"{flag}: the table says {cell!r}, the parser {have!r}")
    assert wrong == []
