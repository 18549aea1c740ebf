"""The Python-documentation corpus builder: reST cleaning rules, the train/held-out split, document filtering.
No network: the package download is not exercised here."""
import pytest

from qwen35_jax.tools import pydoc_corpus as pc

SAMPLE = """\
.. _intro-label:

*************
Title *Over*
*************

.. highlight:: python3

.. module:: spam
   :synopsis: A module.

.. sectionauthor:: Someone <someone@example.com>

.. index:: single: spam

.. toctree::
   :maxdepth: 2

   other

A first paragraph with :func:`open`, :class:`~collections.abc.Mapping`,
:meth:`!nolink`, :ref:`the title <intro-label>`, :ref:`sub-label`, ``literal *x*``,
*emphasis*, **strong**, `a link <https://example.com>`_, `Named`_, |sub| |rep|,
:pep:`8`, :issue:`12` and a footnote [#]_.

.. |rep| replace:: ``replaced``

.. This is a comment
   with an indented body.

.. _sub-label:

Sub section
===========

Equivalent to::

   def f():
       pass

Text before a spaced marker ::

   code

::

   more code

>>> 1 + 1
2
...

.. code-block:: python

   print("hidden")

.. doctest::

   >>> hidden

.. testcode::

   hidden

+-----+-----+
| a   | b   |
+=====+=====+
| c   | d   |
+-----+-----+

=====  =====
A      B
=====  =====
x      y

z      w
=====  =====

.. productionlist::
   rule: "a" | "b"

.. note::
   A note that starts
   on the next line.

.. warning:: Inline warning text.

.. function:: spam(a, b=1, \\*args)
              spam(a)
   :noindex:

   Return *a* plus *b*.

   .. versionadded:: 3.2

   .. versionchanged:: 3.4
      Accepts *args*.

.. seealso::

   :mod:`os`
      Operating system interfaces.

* Item one
  continued.
* Item two with a literal::

     hidden

1. Numbered.

----------

.. [#] The footnote text.
"""

EXPECTED = """\
Title Over

A first paragraph with open(), Mapping, nolink(), the title, Sub section, literal *x*, emphasis, strong, a link, \
Named, replaced, PEP 8, bpo-12 and a footnote.

Sub section

Equivalent to:

Text before a spaced marker

Note: A note that starts on the next line.

Warning: Inline warning text.

spam(a, b=1, *args)

spam(a)

Return a plus b.

New in version 3.2.

Changed in version 3.4: Accepts args.

See also: os

Operating system interfaces.

- Item one continued.

- Item two with a literal:

1. Numbered."""


def test_clean_rst_sample():
    assert pc.clean_rst(SAMPLE, labels=pc.section_labels({"sample.rst.txt": SAMPLE})) == EXPECTED


@pytest.mark.parametrize("rst, expected", [
    ("x ``a`` y", "x a y"),
    (":c:func:`PyObject_New()` and :data:`sys.path`", "PyObject_New() and sys.path"),
    ("see `text <https://x.org>`__ and `PEP 8`_ here", "see text and PEP 8 here"),
    ("*args* and ``**kwargs``", "args and **kwargs"),
    ("Python |version| is here", "Python 3.11 is here"),
    ("a [1]_ b [#note]_.", "a b."),
    (":samp:`python{x}`", "pythonx"),
    ("Title\n-----\n\nBody.", "Title\n\nBody."),
    ("term\n   The definition\n   goes on.", "term\n\nThe definition goes on."),
    (".. availability:: Unix.", "Availability: Unix."),
    (".. audit-event:: os.open path,mode os.open", "Raises an auditing event os.open with arguments path, mode."),
    (".. deprecated-removed:: 3.4 3.6\n   Use x.",
     "Deprecated since version 3.4, will be removed in version 3.6: Use x."),
    (".. class:: Spam(x)\n\n   A class.", "class Spam(x)\n\nA class."),
    (".. impl-detail::\n\n   Detail.", "CPython implementation detail: Detail."),
    (":Author: Me", "Author: Me"),
    ("Para::\n\n   code\n\nNext.", "Para:\n\nNext."),
])
def test_clean_rst_rules(rst, expected):
    assert pc.clean_rst(rst, {"version": "3.11"}) == expected


def test_split_is_deterministic_and_disjoint():
    docs = [{"path": f"lib/m{i}.rst.txt", "text": "x"} for i in range(2000)]
    train, heldout = pc.split_documents(list(reversed(docs)))
    assert (train, heldout) == pc.split_documents(docs)
    paths_t, paths_h = [d["path"] for d in train], [d["path"] for d in heldout]
    assert paths_t == sorted(paths_t) and paths_h == sorted(paths_h)
    assert not set(paths_t) & set(paths_h) and len(paths_t) + len(paths_h) == len(docs)
    assert 0.03 < len(heldout) / len(docs) < 0.07
    assert all(pc.is_heldout(p) for p in paths_h) and not any(pc.is_heldout(p) for p in paths_t)


def test_build_documents_filters():
    long = "Some prose. " * 30
    docs = pc.build_documents({"a.rst.txt": long, "whatsnew/changelog.rst.txt": long, "short.rst.txt": "Tiny."}, {})
    assert [d["path"] for d in docs] == ["a.rst.txt"] and docs[0]["text"] == long.strip()


def test_missing_tool_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(pc.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="install dpkg.*--deb"):
        pc.build_corpus(str(tmp_path))
