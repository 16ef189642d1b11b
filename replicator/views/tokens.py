"""The tokens of a view's query, as the target's own lexer reads them (a small tokenizer per
dialect, with SQLite's and Spark's rules for comments, quoting and string escapes), and the query
as it is stored and run (definition). Part of the analysis (replicator.views.analysis)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass

from replicator.errors import UserError

_TOKENS = {
    "sqlite": re.compile(r"""
   (?P<ws>\s+)
  |(?P<comment>--[^\n]*|/\*.*?(?:\*/|\Z))
  |(?P<blob>[xX]'[0-9a-fA-F]*')
  |(?P<string>'(?:[^']|'')*')
  |(?P<qident>"(?:[^"]|"")*"|`(?:[^`]|``)*`|\[[^\]]*\])
  |(?P<number>0[xX][0-9a-fA-F]+|(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)
  |(?P<param>\?\d*|[:@$][A-Za-z_][A-Za-z0-9_]*)
  |(?P<word>[A-Za-z_\u0080-\U0010ffff][A-Za-z0-9_$\u0080-\U0010ffff]*)
  |(?P<op>\|\||->>|->|<<|>>|<=|>=|==|!=|<>|[-+*/%<>=~&|(),.;])
""", re.S | re.X),
    # Spark SQL: strings in '...' or "..." with backslash escapes or doubled quotes (and raw r'...'),
    # names only in backquotes, [ ] subscripts, typed number literals (10L, 1.5BD). Comments as
    # Spark's lexer (SqlBaseLexer) reads them: `--` ends at \r or \n but goes on past a
    # backslash-newline; `/* */` nests (read by tokenize, not by this pattern), and a hint
    # `/*+ ... */` is taken for a comment too (a view's text goes to Spark without them).
    # Words are letters, digits and _ only: Spark ends a name at any other character (its
    # spaces include no-break and other Unicode spaces, which \s matches).
    "spark": re.compile(r"""
   (?P<ws>\s+)
  |(?P<comment>--(?:\\\n|[^\r\n])*)
  |(?P<blob>[xX]'[0-9a-fA-F]*')
  |(?P<string>[rR]'[^']*'|[rR]"[^"]*"|'(?:[^'\\]|\\.|'')*'|"(?:[^"\\]|\\.|"")*")
  |(?P<qident>`(?:[^`]|``)*`)
  |(?P<number>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?(?:(?:[bB][dD]|[lLsSyYdDfF])(?![A-Za-z0-9_]))?)
  |(?P<param>\?|:[A-Za-z_][A-Za-z0-9_]*)
  |(?P<word>[^\W\d]\w*)
  |(?P<op>\|\||->|=>|<=>|<<|>>>|>>|<=|>=|==|!=|<>|!<|!>|::|[-+*/%<>=~&|^!(),.;\[\]])
""", re.S | re.X),
}


def _bracketed_comment_end(sql: str, pos: int) -> int:
    """The end of the Spark comment starting with /* at pos: comments nest, as in Spark's
    lexer (a /*+ inside one opens nothing); -1 when it is not closed."""
    depth, i, n = 1, pos + 2, len(sql)
    while i < n:
        if sql.startswith("*/", i):
            depth -= 1
            i += 2
            if not depth:
                return i
        elif sql.startswith("/*", i) and not sql.startswith("/*+", i):
            depth += 1
            i += 2
        else:
            i += 1
    return -1


@dataclass(frozen=True)
class Token:
    kind: str      # word, qident, string, blob, number, param, op
    text: str
    start: int
    end: int

    @property
    def lower(self) -> str:
        return self.text.lower() if self.kind == "word" else ""

    @property
    def ident(self) -> str | None:
        """The identifier this token names (words and quoted identifiers), else None."""
        if self.kind == "word":
            return self.text
        if self.kind == "qident":
            q = self.text[0]
            inner = self.text[1:-1]
            return inner if q == "[" else inner.replace(q * 2, q)
        return None


def tokenize(sql: str, dialect: str = "sqlite") -> list[Token]:
    pattern = _TOKENS[dialect]
    tokens: list[Token] = []
    pos = 0
    while pos < len(sql):
        if dialect == "spark" and sql.startswith("/*", pos):
            end = _bracketed_comment_end(sql, pos)
            if end < 0:
                raise UserError("the view's SQL has an unterminated comment")
            pos = end
            continue
        m = pattern.match(sql, pos)
        if m is None:
            if sql[pos] in "'\"`[":
                raise UserError("the view's SQL has an unterminated string or quoted name")
            raise UserError(f"cannot read the view's SQL at {sql[pos:pos + 20]!r}")
        kind = m.lastgroup or ""
        if kind == "comment" and m.group().startswith("/*") and not m.group().endswith("*/"):
            raise UserError("the view's SQL has an unterminated comment")
        if kind not in ("ws", "comment"):
            tokens.append(Token(kind, m.group(), m.start(), m.end()))
        pos = m.end()
    return tokens


def string_value(t: Token) -> str:
    """A string literal's text, trimmed and lower case (for comparing it with special values)."""
    return t.text.lstrip("rR")[1:-1].strip().lower()


def quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def matching(tokens: Sequence[Token], i: int) -> int:
    """Index of the parenthesis closing the one at i."""
    depth = 0
    for j in range(i, len(tokens)):
        if tokens[j].text == "(":
            depth += 1
        elif tokens[j].text == ")":
            depth -= 1
            if depth == 0:
                return j
    raise UserError("the view's SQL has an unbalanced parenthesis")


def balanced(tokens: Sequence[Token]) -> bool:
    depth = 0
    for t in tokens:
        depth += (t.text == "(") - (t.text == ")")
        if depth < 0:
            return False
    return depth == 0


def count_arguments(args: Sequence[Token]) -> int:
    """How many arguments the tokens between a call's parentheses are."""
    depth, count = 0, int(bool(args))
    for t in args:
        depth += (t.text == "(") - (t.text == ")")
        count += depth == 0 and t.text == ","
    return count


def definition(sql: str, dialect: str = "sqlite") -> str:
    """A view's query as it is stored and run: up to its last token. Trailing semicolons
    and comments go: a target wraps the query in other SQL (`SELECT * FROM (query)`),
    which a `;` breaks and a trailing `-- comment` swallows.

    Spark's is rebuilt from the tokens, without its comments (and hints): Spark is given
    only what the analysis read, so that no reading of a comment other than this
    tokenizer's can turn text it skipped into a statement. The spacing between tokens
    stays (a comment becomes a space, other spaces ASCII ones)."""
    tokens = tokenize(sql, dialect)
    while tokens and tokens[-1].text == ";":
        tokens.pop()
    if not tokens:
        raise UserError("the view's SQL is empty")
    if dialect != "spark":
        return sql[:tokens[-1].end]
    out = [tokens[0].text]
    for before, token in itertools.pairwise(tokens):
        gap = sql[before.end:token.start]
        if gap:
            spaces = "".join(ch if ch in " \t\n" else " " for ch in gap)
            out.append(spaces if gap.isspace() else ("\n" if "\n" in spaces else " "))
        out.append(token.text)
    return "".join(out)
