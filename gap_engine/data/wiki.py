"""Wikipedia articles as documents: the built-in sources ``wiki-sample`` and ``wiki-tables``.

gensim ships bz2 XML dumps of Wikipedia pages. Each main-namespace, non-redirect page is parsed
(``mwparserfromhell``) after comments and references are cut, and cleaned to what a reader reads:

* ``wiki-sample`` (:func:`read_wiki_articles`): one document per article, its plain prose
  paragraphs; templates, tables, media and category links, headings and short fragments (list
  stubs, captions) are dropped, and so is a paragraph with markup left in it;
* ``wiki-tables`` (:func:`read_wiki_sections`): one document per section, cleaned the same way but
  with every table kept as text, one row a line, its cells joined by " | ".
"""

from __future__ import annotations

import bz2
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from gap_engine.core.errors import DataError, first_line

if TYPE_CHECKING:
    from mwparserfromhell.nodes import Node, Tag
    from mwparserfromhell.wikicode import Wikicode


# Wiki cleaning: tags whose contents are not running prose, link prefixes that are
# media or metadata rather than words, and the minimum size of a kept paragraph.
_WIKI_DROP_TAGS = frozenset(
    {
        "ref",
        "references",
        "table",
        "gallery",
        "math",
        "chem",
        "timeline",
        "imagemap",
        "score",
        "syntaxhighlight",
        "source",
        "pre",
        "code",
        "nowiki",
        "div",
        "sup",
        "sub",
        "noinclude",
        "includeonly",
        "poem",
        "graph",
        "categorytree",
        "templatedata",
    }
)
# Cut before parsing: references and comments are never prose, and removing them first
# halves the parse time and keeps citation templates from swallowing nearby sentences.
_WIKI_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
_WIKI_REF_SELF_CLOSING = re.compile(r"<ref\b[^>]*/>", re.IGNORECASE)
_WIKI_REF = re.compile(r"<ref\b[^>]*>.*?</ref\s*>", re.IGNORECASE | re.DOTALL)
_INTERWIKI_LINK = re.compile(r"^\s*:?\s*[a-z][a-z\- ]{0,20}:", re.IGNORECASE)
# Leftover link/template/table/tag syntax, including table rows ("! a !! b", "| a || b").
_MARKUP_LEFTOVER = re.compile(r"\[\[|\]\]|\{\{|\}\}|\{\||\|\}|<ref|</?[a-z]+[ >/]|^[!|]|!!|\|\|", re.IGNORECASE)
_EMPTY_PARENS = re.compile(r"\(\s*[,;]?\s*\)")
_SPACE_BEFORE_PUNCT = re.compile(r"\s+([,.;:])")
_MIN_PARAGRAPH_CHARS = 80
_MIN_PARAGRAPH_WORDS = 12
_MIN_ARTICLE_CHARS = 200


def read_wiki_articles(path: Path) -> list[tuple[str, str]]:
    """(title, plain prose) of every main-namespace, non-redirect page of a bz2 XML dump."""
    articles = []
    for title, wikicode in _wiki_pages(path):
        prose = _wikitext_to_prose(wikicode)
        if len(prose) >= _MIN_ARTICLE_CHARS:
            articles.append((title, prose))
    return articles


def read_wiki_sections(path: Path) -> list[tuple[str, str]]:
    """("title § n heading", text) of every section (each heading starts one) of every page of a
    bz2 XML dump, its prose cleaned as ``_read_wiki_articles`` cleans it and its tables kept as
    text (``_table_rows``); sections with no text left are dropped.

    A section rather than an article is the document of a source of few articles: the five of
    ``wiki-tables`` divided by article put both table-heavy articles (every award and company
    table) in the selection part and left the report part nearly all prose.
    """
    sections = []
    for title, wikicode in _wiki_pages(path):
        for index, section in enumerate(wikicode.get_sections(flat=True, include_lead=True)):
            text = _wikitext_to_prose(section, tables=True)
            if text:
                headings = section.filter_headings(recursive=False)
                heading = str(headings[0].title).strip() if headings else ""
                sections.append((f"{title} § {index} {heading}".rstrip(), text))
    return sections


def _wiki_pages(path: Path) -> Iterator[tuple[str, Wikicode]]:
    """(title, parsed wikitext without comments and references) of every main-namespace,
    non-redirect page of a bz2 XML dump, streamed."""
    import mwparserfromhell  # imported here: only the wiki sources need it

    try:
        with bz2.open(path, "rb") as stream:
            for _, element in ET.iterparse(stream, events=("end",)):
                if _local_tag(element.tag) != "page":
                    continue
                namespace = element.findtext("{*}ns", default="0").strip()
                is_redirect = element.find("{*}redirect") is not None
                title = (element.findtext("{*}title") or "").strip()
                wikitext = element.findtext("{*}revision/{*}text") or ""
                element.clear()  # keep memory flat while streaming
                if namespace != "0" or is_redirect or not title:
                    continue
                if wikitext.lstrip()[:9].upper() == "#REDIRECT":
                    continue
                wikitext = _WIKI_COMMENT.sub("", wikitext)
                wikitext = _WIKI_REF.sub("", _WIKI_REF_SELF_CLOSING.sub("", wikitext))
                yield title, mwparserfromhell.parse(wikitext)
    except (OSError, EOFError, ET.ParseError) as exc:
        raise DataError(f"could not read the Wikipedia sample {path}: {first_line(exc)}") from exc


def _local_tag(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _wikitext_to_prose(wikicode: Wikicode, tables: bool = False) -> str:
    """Plain paragraphs from parsed wikitext: templates, tables, refs, media and category
    links, headings and short fragments (list stubs, captions) are dropped. With ``tables``,
    each top-level table is kept where it stands, as its rows (``_table_rows``)."""
    from mwparserfromhell.nodes import Comment, Heading, Tag, Template, Wikilink

    blocks: list[str] = []  # paragraphs and tables, in the article's order
    pieces: list[str] = []  # the text since the last table

    def walk(nodes: Iterable[Node], out: list[str], in_cell: bool = False) -> None:
        for node in nodes:
            if isinstance(node, (Template, Comment, Heading)):
                continue
            if isinstance(node, Tag):
                tag = str(node.tag).strip().lower()
                if tables and tag == "table" and not in_cell:
                    blocks.extend(_paragraphs("".join(pieces)))
                    pieces.clear()
                    rows = _table_rows(node, cell_text)
                    if rows:
                        blocks.append("\n".join(rows))
                    continue
                if tag in _WIKI_DROP_TAGS:
                    continue
                if tag == "br" and in_cell:  # a line break inside a cell separates words
                    out.append(" ")
                if node.contents is not None:
                    walk(node.contents.nodes, out, in_cell)
                continue
            # File:, Image:, Category: and interlanguage links are not words of the text.
            if isinstance(node, Wikilink) and _INTERWIKI_LINK.match(str(node.title)):
                continue
            stripped = node.__strip__(normalize=True, collapse=True, keep_template_params=False)
            if stripped:
                out.append(str(stripped))

    def cell_text(nodes: Iterable[Node]) -> str:
        words: list[str] = []
        walk(nodes, words, in_cell=True)  # a table inside a cell is dropped, as in prose
        return " ".join("".join(words).split())

    walk(wikicode.nodes, pieces)
    blocks.extend(_paragraphs("".join(pieces)))
    return "\n\n".join(blocks)


def _paragraphs(text: str) -> list[str]:
    """The lines of ``text`` that read as prose paragraphs, spaces and empty parentheses tidied:
    short fragments (list stubs, captions) and lines with markup left in them are dropped."""
    paragraphs = []
    for raw in re.split(r"\n", text):
        paragraph = " ".join(raw.split())
        paragraph = _EMPTY_PARENS.sub("", paragraph)
        paragraph = _SPACE_BEFORE_PUNCT.sub(r"\1", paragraph).strip()
        if len(paragraph) < _MIN_PARAGRAPH_CHARS or len(paragraph.split()) < _MIN_PARAGRAPH_WORDS:
            continue
        if _MARKUP_LEFTOVER.search(paragraph):
            continue
        paragraphs.append(paragraph)
    return paragraphs


def _table_rows(table: Tag, cell_text: Callable[[Iterable[Node]], str]) -> list[str]:
    """One line per row of a parsed wikitext table (its caption first): the text of its cells
    joined by " | ". Attributes (style, width, rowspan) are not text and are dropped, and so are
    empty cells and cells with markup left in them; a cell a rowspan carries down is read only
    in its first row."""
    from mwparserfromhell.nodes import Tag

    def is_cell(node: object) -> bool:
        return isinstance(node, Tag) and node.contents is not None and str(node.tag).strip().lower() in ("td", "th")

    rows: list[list[str]] = []
    loose: list[str] = []  # cells before the first row marker belong to an implicit first row
    for node in table.contents.nodes if table.contents is not None else ():
        if not isinstance(node, Tag) or node.contents is None:
            continue
        tag = str(node.tag).strip().lower()
        if is_cell(node):
            loose.append(cell_text(node.contents.nodes))
        elif tag == "caption":
            rows.append([cell_text(node.contents.nodes)])
        elif tag == "tr":
            if loose:
                rows.append(loose)
                loose = []
            rows.append([cell_text(cell.contents.nodes) for cell in node.contents.nodes if isinstance(cell, Tag) and is_cell(cell)])
    if loose:
        rows.append(loose)
    lines = []
    for row in rows:
        cells = [cell for cell in row if cell and not _MARKUP_LEFTOVER.search(cell)]
        if cells:
            lines.append(" | ".join(cells))
    return lines
