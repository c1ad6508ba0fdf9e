"""The code yardstick's syntax figures: whole lines only, complete modules vs valid starts, top-level prompt starts."""

from __future__ import annotations

import pytest

from printpress.corpora import Document
from printpress.eval.bench import draw_prompts
from printpress.eval.python_syntax import (code_lines, parses, python_validity, top_level_starts, valid_prefix,
                                          whole_lines)


def test_a_sample_is_cut_after_its_last_newline():
    assert whole_lines("def f(x):\n", "    return x\n    y = (") == "def f(x):\n    return x\n"
    assert whole_lines("x = 1\n", "y = 2\n") == "x = 1\ny = 2\n"
    assert whole_lines("x = (", "1") == ""  # no whole line at all: the empty module, which parses


@pytest.mark.parametrize(("source", "complete", "start"), [
    ("def f(x):\n    return x\n", True, True),
    ("def f(x):\n    if x:\n", False, True),                   # an open block
    ("def f(x):\n    return (x +\n", False, True),             # an open bracket
    ('def f(x):\n    s = """abc\n', False, True),              # an open string
    ("class A:\n    def g(self):\n        pass\n    def h(self):\n", False, True),
    ("def f(x):\nreturn x\n", False, False),                   # a body that is not indented
    ("x = = 1\n", False, False),
    ("def f(x):\n    y = 1\n  z = 2\n", False, False),         # a dedent to no enclosing level
    ("def f():\n    pass\nelse:\n", False, False),
    ("def f():\n    return 1\nreturn 2\n", False, False),       # parses, but does not compile
    ("def f():\n    return 1\nreturn (2,\n", False, True),      # unfinished: checked when it ends, as in a REPL
    ("x = '\x00'\n", False, False),                           # a NUL: ast raises ValueError, not SyntaxError
    ("x = '\\d'\n", True, True),                               # an invalid escape only warns
])
def test_complete_modules_and_valid_starts(source, complete, start):
    assert parses(source) is complete
    assert valid_prefix(source) is start


def test_shares_over_a_side():
    prompts = ["def f(x):\n"] * 4
    completions = ["    return x\n", "    if x:\n        return (x +\n", "return x\n", "    return x\n    y = ("]
    assert python_validity(prompts, completions) == {"python_parses_share": 0.5, "python_prefix_share": 0.75,
                                                     "python_code_share": 0.25}  # only the second wrote 2 lines
    with pytest.raises(ValueError, match="as many prompts as completions"):
        python_validity(prompts, completions[:3])


def test_comments_are_valid_python_but_not_code():
    prompts = ["def f(x):\n"] * 3
    completions = ["    #\n#\n##\n    # x\n", "    y = x  # one\n    return y\n", "    y = x\n\n    #\n"]
    assert python_validity(prompts, completions) == {"python_parses_share": 2 / 3, "python_prefix_share": 1.0,
                                                     "python_code_share": 1 / 3}
    assert code_lines("a = 1\n  # c\n\n\"\"\"doc\"\"\"\n") == 2


def test_top_level_starts_begin_at_decorators_and_count_lines_as_the_parser_does():
    text = "import os\r\n\r\n@cache\r\n@other(1)\r\ndef f():\r\n    '''x\r\n\r\ny'''\r\n    return 1\r\nclass A:\r\n    pass\r\n"
    assert [text[i:].split("\r\n")[0] for i in top_level_starts(text)] == ["import os", "@cache", "class A:"]
    assert top_level_starts("def f(:\n") is None


def test_prompts_from_python_documents_start_at_top_level_statements():
    body = "".join(f"def f{i}(x):\n    '''Doc.\n\ndef not_a_start():\n    '''\n    return x + {i}\n\n" for i in range(6))
    prompts = draw_prompts([Document("pkg/mod.py", body)], 6, chars=79)
    assert sorted(prompts) == sorted(f"def f{i}(x):\n    '''Doc.\n\ndef not_a_start():\n    '''\n    return x + {i}\n\n"
                                     for i in range(6))
    # The same text under a name that is not a Python file: any line may start a window.
    assert any(p.startswith(("def not_a_start", "    ")) for p in draw_prompts([Document("mod.txt", body)], 12, chars=79))


def test_bare_hash_lines_are_counted_among_non_blank_lines():
    from printpress.eval.python_syntax import bare_hash_line_share, bare_hashes

    assert bare_hashes("  ## ") and bare_hashes("#") and not bare_hashes("# a comment") and not bare_hashes("")
    assert bare_hash_line_share(["x = 1\n#\n\n###\n", "# note\n"]) == 2 / 4
    assert bare_hash_line_share(["\n\n"]) == 0.0
