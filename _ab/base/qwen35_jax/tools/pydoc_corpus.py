"""Build a plain-prose training corpus from the Python documentation's reST sources.

    python -m qwen35_jax.tools.pydoc_corpus OUT_DIR [--deb PATH]

The source is Debian's `python3.11-doc` package (what `python3-doc` depends on), fetched with `apt-get download`
unless --deb names a downloaded .deb. Each `_sources/**/*.rst.txt` file becomes one document, cleaned by
`clean_rst` into prose (code, tables, indexes and markup removed). Documents are split deterministically by a hash
of their path into `train.jsonl` and `heldout.jsonl`; `manifest.json` records the package, its sha256, the counts
and the licence (the package's copyright file is copied beside them), so anyone can rebuild the same corpus.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile

PACKAGE = "python3.11-doc"
SOURCES = "usr/share/doc/python3.11/html/_sources"
COPYRIGHT = "usr/share/doc/python3.11-doc/copyright"
EXCLUDE = {"whatsnew/changelog.rst.txt"}          # bug lists, not prose
MIN_CHARS = 200
HELDOUT_MOD = 20                                  # held out: sha1(path)[0] % 20 == 0, about 5%
LICENSE = ("Python Software Foundation License Version 2 (PSF-2.0); since Python 3.8.6, examples, recipes and other "
           "code in the documentation are dual licensed under the PSF License and the Zero-Clause BSD license "
           "(0BSD). See the 'Terms and conditions' section of license.rst in the sources, and the package's "
           "copyright file.")

# ---------------------------------------------------------------------------------------------------------------
# Block level: a small recursive reST reader that keeps prose paragraphs and drops everything else.
# ---------------------------------------------------------------------------------------------------------------

# Directives whose whole block (arguments, options, body) is code, tables, indexing or build metadata.
DROP = {"code-block", "sourcecode", "code", "doctest", "testcode", "testoutput", "testsetup", "testcleanup",
        "productionlist", "toctree", "index", "highlight", "module", "currentmodule", "sectionauthor",
        "moduleauthor", "codeauthor", "include", "literalinclude", "parsed-literal", "tabularcolumns", "table",
        "list-table", "csv-table", "image", "figure", "raw", "math", "contents", "program", "limited-api-list",
        "miscnews", "audit-event-table", "default-role", "role", "c:namespace", "c:namespace-push",
        "c:namespace-pop", "grammar-snippet"}
# Admonitions: the body is prose, shown after a label as Sphinx renders it.
LABELS = {"note": "Note", "warning": "Warning", "important": "Important", "caution": "Caution", "tip": "Tip",
          "hint": "Hint", "attention": "Attention", "danger": "Danger", "error": "Error", "seealso": "See also",
          "impl-detail": "CPython implementation detail", "availability": "Availability"}
VERSIONS = {"versionadded": "New in version {}", "versionchanged": "Changed in version {}",
            "deprecated": "Deprecated since version {}",
            "deprecated-removed": "Deprecated since version {}, will be removed in version {}"}
# Containers whose argument (if any) is a title and whose body is prose.
CONTAINERS = {"glossary", "hlist", "container", "epigraph", "only", "compound", "highlights", "pull-quote",
              "sidebar", "topic", "admonition", "rubric", "centered"}
# Object descriptions (function, class, C type...) become their signature line(s), then their body; these get
# the word Sphinx shows before the signature.
SIGNATURE_PREFIX = {"class": "class ", "exception": "exception ", "classmethod": "classmethod ",
                    "staticmethod": "static ", "abstractmethod": "abstractmethod ", "coroutinefunction": "coroutine ",
                    "coroutinemethod": "coroutine ", "awaitablefunction": "awaitable ",
                    "awaitablemethod": "awaitable ", "decorator": "@", "decoratormethod": "@"}

DIRECTIVE = re.compile(r"^\.\.\s+([\w:.+-]+)::(?:\s+(.*))?$")
OPTION = re.compile(r"^\s*:[\w-]+:(\s|$)")                        # a directive option such as :noindex:
ADORNMENT = re.compile(r"^([!-/:-@\[-`{-~])\1+\s*$")             # a line of one repeated punctuation character
GRID_TABLE = re.compile(r"^\+[-=+]+\+\s*$")
SIMPLE_TABLE = re.compile(r"^=+( +=+)+\s*$")                     # a border with at least two columns
BULLET = re.compile(r"^([-*+]|#\.|\d+\.|\(?\d+\)|\(?[a-z]\))( +)(\S.*)$")
FIELD = re.compile(r"^:([^:`\s][^:`]*):(?:\s+(.*))?$")            # :Author: name
SUBST_DEF = re.compile(r"^\.\.\s+\|([^|]+)\|\s+(replace|unicode)::\s+(.*)$", re.M)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _dedent(lines: list[str]) -> list[str]:
    """Remove the common indentation of the non-blank lines."""
    n = min((_indent(x) for x in lines if x.strip()), default=0)
    return [x[n:] if x.strip() else "" for x in lines]


def _indented_block(lines: list[str], i: int) -> int:
    """End of the block starting at i made of blank or indented lines (a body, a literal block...); trailing blank
    lines are left out."""
    j = i
    while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > 0):
        j += 1
    while j > i and not lines[j - 1].strip():
        j -= 1
    return j


def _is_underline(title: str, line: str) -> bool:
    return bool(ADORNMENT.match(line)) and (len(line.strip()) >= 4 or len(line.strip()) >= len(title.strip()))


def _prefix(label: str, paragraphs: list[str]) -> list[str]:
    """Put a label such as 'Note:' in front of the first paragraph (alone if there is none)."""
    if not paragraphs:
        return [label + "."]
    return [f"{label}: {paragraphs[0]}"] + paragraphs[1:]


def _directive(name: str, arg: str, rest: list[str], ctx: dict) -> list[str]:
    """Paragraphs of one directive: `arg` is the text after `::` on its first line, `rest` the following lines."""
    name = name.lower()
    if name in DROP or (name == "rubric" and arg == "Footnotes"):     # footnote bodies are dropped too
        return []
    head_len = next((k for k, x in enumerate(rest) if not x.strip()), len(rest))
    head = [x for x in rest[:head_len] if not OPTION.match(x)]      # lines before the first blank, no options
    if name == "audit-event":   # .. audit-event:: name arg1,arg2 target
        event, args = (arg.split() + ["", ""])[:2]
        args = ", ".join(a for a in args.split(",") if a)
        return [f"Raises an auditing event {event} with " + (f"arguments {args}." if args else "no arguments.")]
    # Prose directives: the text may start on the directive's line and run on without a blank line, so the
    # argument, the head and the body are read as one piece of reST.
    content = ([arg] if arg else []) + _dedent(head + rest[head_len:])
    if name in VERSIONS:
        nver = 2 if name == "deprecated-removed" else 1
        words = content[0].split(None, nver) if content else []
        label = VERSIONS[name].format(*(words + ["?"] * nver)[:nver])
        return _prefix(label, _blocks([" ".join(words[nver:])] + content[1:], ctx))
    if name in LABELS:
        return _prefix(LABELS[name], _blocks(content, ctx))
    if name in CONTAINERS:
        title = [_inline(arg, ctx)] if arg and name not in ("only", "hlist", "container") else []
        return title + _blocks(content[1:] if arg else content, ctx)
    # An object description: each signature (the argument and the head) on a line of its own, with backslash
    # continuations joined and \* unescaped, then the body.
    sigs, pending = [], ""
    for s in [arg] + [x.strip() for x in head]:
        pending += s
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip() + " "
        elif pending:
            sigs.append(SIGNATURE_PREFIX.get(name, "") + pending.replace("\\*", "*"))
            pending = ""
    return sigs + _blocks(_dedent(rest[head_len:]), ctx)


def _explicit_markup(block: list[str], ctx: dict) -> list[str]:
    """A `..` block: a directive, or a comment, link target, footnote or substitution definition (dropped)."""
    m = DIRECTIVE.match(block[0])
    if not m:
        return []
    return _directive(m.group(1), (m.group(2) or "").strip(), block[1:], ctx)


def _paragraph(lines: list[str], ctx: dict) -> str:
    return _inline(" ".join(x.strip() for x in lines), ctx)


def _blocks(lines: list[str], ctx: dict) -> list[str]:
    """Paragraphs (each one line of clean text) of a piece of reST whose base indentation is column 0."""
    out: list[str] = []
    literal_next = False          # the previous paragraph ended with '::': the indented block after it is code
    i, n = 0, len(lines)
    while i < n:
        line = lines[i]
        if not line.strip():
            i += 1
            continue
        after_literal, literal_next = literal_next, False
        nxt = lines[i + 1] if i + 1 < n else ""
        if _indent(line) > 0:                                   # literal block after '::', else a block quote
            j = _indented_block(lines, i)
            if not after_literal:
                out += _blocks(_dedent(lines[i:j]), ctx)
            i = j
        elif line.startswith("..") and (len(line) == 2 or line[2] in " \t"):   # directive or comment
            j = _indented_block(lines, i + 1)
            out += _explicit_markup([line] + lines[i + 1:j], ctx)
            i = j
        elif line.startswith("__ "):                            # anonymous link target
            i += 1
        elif GRID_TABLE.match(line):                            # grid table: up to the next blank line
            while i < n and lines[i].strip():
                i += 1
        elif SIMPLE_TABLE.match(line):                          # simple table: up to a border before a blank
            i += 1
            while i < n and not (SIMPLE_TABLE.match(lines[i]) and (i + 1 == n or not lines[i + 1].strip())):
                i += 1
            i += 1
        elif ADORNMENT.match(line) and i + 2 < n and _is_underline(nxt, lines[i + 2]):   # over- and underlined
            out.append(_paragraph([nxt], ctx))
            i += 3
        elif ADORNMENT.match(line) and len(line.strip()) >= 4:  # transition line
            i += 1
        elif nxt.strip() and _is_underline(line, nxt):          # underlined section title
            out.append(_paragraph([line], ctx))
            i += 2
        elif line.startswith(">>>"):                            # doctest block: up to the next blank line
            while i < n and lines[i].strip():
                i += 1
        elif m := (BULLET.match(line) or FIELD.match(line)):    # list item or field: a marker, then a body
            j = _indented_block(lines, i + 1)
            if m.re is BULLET:   # the body is indented to the item's text, a literal block further
                marker, first = "- " if not m.group(1)[0].isdigit() else m.group(1) + " ", m.group(3)
                body = _dedent([" " * (len(m.group(1)) + len(m.group(2))) + first] + lines[i + 1:j])
            else:                # a field's body may be indented less than its first line's text
                marker = m.group(1) + ": "
                body = [m.group(2) or ""] + _dedent(lines[i + 1:j])
            paragraphs = _blocks(body, ctx)
            out += [marker + p for p in paragraphs[:1]] + paragraphs[1:]
            i = j
        elif nxt.strip() and _indent(nxt) > 0:                  # definition list: a term, an indented definition
            j = _indented_block(lines, i + 1)
            out += [_paragraph([line], ctx)] + _blocks(_dedent(lines[i + 1:j]), ctx)
            i = j
        else:                                                   # a paragraph: lines up to a blank line
            j = i
            while j < n and lines[j].strip():
                j += 1
            text = " ".join(x.strip() for x in lines[i:j])
            if text.endswith("::"):
                literal_next = True
                text = text[:-2].rstrip() if text[:-2].endswith((" ", "\t")) or text == "::" else text[:-1]
            if text:
                out.append(_inline(text, ctx))
            i = j
    return [p for p in out if p]


# ---------------------------------------------------------------------------------------------------------------
# Inline markup. Literal and role texts are set aside as placeholders first, so that the '*' or '\' inside them
# are not read as emphasis or escapes by the later steps.
# ---------------------------------------------------------------------------------------------------------------

ROLE = re.compile(r"(?<![\w`])((?::[\w.+-]+)+):`((?:[^`\\]|\\.)+)`")
LITERAL = re.compile(r"``(.+?)``(?!`)")
LINK = re.compile(r"(?<![\w`])`((?:[^`\\]|\\.)+)`(?:__?)?(?![\w`])")     # `text`_, `text <url>`__, `text`
STRONG = re.compile(r"(?<![\w*\\])\*\*(?=\S)(.+?)(?<=\S)\*\*(?![\w*])")
EMPHASIS = re.compile(r"(?<![\w*\\])\*(?=[^\s*])(.+?)(?<=[^\s\\])\*(?![\w*])")
SUBSTITUTION = re.compile(r"(?<![\w|])\|(?=\S)([^|\n]*?)(?<=\S)\|(?:__?)?(?![\w|])")
FOOTNOTE_REF = re.compile(r"\s*\[(?:#[\w-]*|\d+|\*)\]_(?!\w)")
SIMPLE_REF = re.compile(r"(?<![\w-])([A-Za-z][\w-]*[A-Za-z0-9])_(?![\w-])")    # a reference name: PEP-8_
TARGET = re.compile(r"^(.*?\S)\s*<[^<>]+>$", re.S)                     # text <target>
FUNCTION_ROLES = {"func", "meth", "py:func", "py:meth", "c:func"}         # Sphinx adds () after these names
PLACEHOLDER = re.compile("\x00(\\d+)\x00")


def _role_text(role: str, text: str, ctx: dict) -> str:
    """The text Sphinx shows for :role:`text`."""
    role = role.strip(":")
    if m := TARGET.match(text):                  # explicit title: shown as written
        return m.group(1)
    if role == "ref":                            # a section label: its title when known
        return ctx.get("labels", {}).get(text.lower(), text)
    if role in ("pep", "rfc"):
        return f"{role.upper()} {text}"
    if role in ("issue", "gh"):
        return f"{'bpo' if role == 'issue' else 'gh'}-{text}"
    if role in ("samp", "file"):                 # {variable} parts are shown without the braces
        text = re.sub(r"(?<!\\)[{}]", "", text)
    if text.startswith("!"):                     # !x: no link
        text = text[1:]
    if text.startswith("~"):                     # ~a.b.c: only the last component
        text = text[1:].rsplit(".", 1)[-1]
    if role in FUNCTION_ROLES and not text.endswith(")"):
        text += "()"
    return text


def _inline(text: str, ctx: dict) -> str:
    """Clean text of one paragraph: the shown text of roles, literals, links and emphasis; no references."""
    held: list[str] = []

    def hold(s: str) -> str:
        held.append(s)
        return f"\x00{len(held) - 1}\x00"

    subs = ctx.get("substitutions", {})
    text = SUBSTITUTION.sub(lambda m: hold(_inline(subs[m.group(1)], {}) if m.group(1) in subs else ""), text)
    text = LITERAL.sub(lambda m: hold(m.group(1)), text)
    text = ROLE.sub(lambda m: hold(_role_text(m.group(1), re.sub(r"\\(.)", r"\1", m.group(2)), ctx)), text)
    text = LINK.sub(lambda m: hold(TARGET.sub(r"\1", m.group(1))), text)
    text = FOOTNOTE_REF.sub("", text)
    text = STRONG.sub(r"\1", text)
    text = EMPHASIS.sub(r"\1", text)
    text = SIMPLE_REF.sub(r"\1", text)
    text = re.sub(r"\\ ", "", text)               # '\ ' separates markup from a following word
    text = re.sub(r"\\(.)", r"\1", text)          # backslash escapes
    text = text.replace(" --- ", " \u2014 ").replace(" -- ", " \u2013 ")     # dashes, as Sphinx shows them
    while PLACEHOLDER.search(text):
        text = PLACEHOLDER.sub(lambda m: held[int(m.group(1))], text)
    return re.sub(r"\s+", " ", text).strip()


def clean_rst(text: str, substitutions: dict[str, str] | None = None, labels: dict[str, str] | None = None) -> str:
    """Plain prose from one reST document: paragraphs (headings too) on one line each, separated by a blank line.

    `substitutions` gives texts for |name| references defined outside the document (|version|); the document's own
    `.. |name| replace::` definitions are used; any other |name| is dropped. `labels` maps section labels to their
    titles (`section_labels`), shown for :ref:`label`.
    """
    subs = dict(substitutions or {})
    for m in SUBST_DEF.finditer(text):
        subs[m.group(1)] = m.group(3) if m.group(2) == "replace" else " "    # unicode:: 0xA0 and the like
    lines = [x.rstrip() for x in text.expandtabs(8).splitlines()]
    return "\n\n".join(_blocks(lines, {"substitutions": subs, "labels": labels or {}}))


LABEL = re.compile(r"^\.\.\s+_([^:`]+):\s*$")


def section_labels(sources: dict[str, str]) -> dict[str, str]:
    """Label -> clean title of the section it precedes (`.. _label:` lines followed by a title), over all sources."""
    out = {}
    for text in sources.values():
        lines = [x.rstrip() for x in text.expandtabs(8).splitlines()]
        for i, line in enumerate(lines):
            if not (m := LABEL.match(line)):
                continue
            j = i + 1
            while j < len(lines) and (not lines[j].strip() or LABEL.match(lines[j])):
                j += 1
            if j + 1 < len(lines) and ADORNMENT.match(lines[j]) and not ADORNMENT.match(lines[j + 1]):
                j += 1                                            # overlined title
            if j + 1 < len(lines) and lines[j].strip() and _is_underline(lines[j], lines[j + 1]):
                out[m.group(1).strip().lower()] = _inline(lines[j].strip(), {})
    return out


# ---------------------------------------------------------------------------------------------------------------
# The corpus: package, documents, split, files.
# ---------------------------------------------------------------------------------------------------------------

def is_heldout(path: str) -> bool:
    """Deterministic split on the relative path: about 1 in HELDOUT_MOD documents is held out."""
    return hashlib.sha1(path.encode()).digest()[0] % HELDOUT_MOD == 0


def split_documents(docs: list[dict]) -> tuple[list[dict], list[dict]]:
    """(train, heldout), each sorted by path."""
    docs = sorted(docs, key=lambda d: d["path"])
    return [d for d in docs if not is_heldout(d["path"])], [d for d in docs if is_heldout(d["path"])]


def _tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} not found: install {package} (Debian/Ubuntu: apt-get install {package}), "
                           f"or pass --deb PATH to an already downloaded {PACKAGE} .deb (dpkg-deb is still needed)")
    return path


def _run(cmd: list[str], cwd: str | None = None) -> str:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}\n"
                           f"Check that the Debian archive is reachable, or pass --deb PATH to a {PACKAGE} .deb.")
    return r.stdout


def download_deb(dest_dir: str) -> str:
    """`apt-get download python3.11-doc` into dest_dir; the path of the .deb."""
    _run([_tool("apt-get", "apt"), "download", PACKAGE], cwd=dest_dir)
    debs = [f for f in os.listdir(dest_dir) if f.startswith(PACKAGE + "_") and f.endswith(".deb")]
    if len(debs) != 1:
        raise RuntimeError(f"apt-get download left {debs} in {dest_dir}, expected one {PACKAGE} .deb")
    return os.path.join(dest_dir, debs[0])


def read_sources(root: str) -> dict[str, str]:
    """Relative path -> text of every .rst.txt under root."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".rst.txt"):
                full = os.path.join(d, f)
                with open(full, encoding="utf-8") as fh:
                    out[os.path.relpath(full, root).replace(os.sep, "/")] = fh.read()
    return out


def build_documents(sources: dict[str, str], substitutions: dict[str, str]) -> list[dict]:
    """Cleaned documents, without the excluded files and those too short to teach anything."""
    labels = section_labels(sources)
    docs = []
    for path in sorted(sources):
        if path in EXCLUDE:
            continue
        text = clean_rst(sources[path], substitutions, labels)
        if len(text) >= MIN_CHARS:
            docs.append({"path": path, "text": text})
    return docs


def _write_jsonl(path: str, docs: list[dict]):
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")


def build_corpus(out_dir: str, deb: str | None = None) -> dict:
    """Download (or use) the .deb, extract it, write train.jsonl, heldout.jsonl and manifest.json; the manifest."""
    dpkg_deb = _tool("dpkg-deb", "dpkg")
    with tempfile.TemporaryDirectory() as tmp:
        deb = os.path.abspath(deb) if deb else download_deb(tmp)
        version = _run([dpkg_deb, "-f", deb, "Version"]).strip()
        package = _run([dpkg_deb, "-f", deb, "Package"]).strip()
        with open(deb, "rb") as f:
            sha256 = hashlib.sha256(f.read()).hexdigest()
        root = os.path.join(tmp, "x")
        _run([dpkg_deb, "-x", deb, root])
        sources = read_sources(os.path.join(root, SOURCES))
        if not sources:
            raise RuntimeError(f"no .rst.txt files under {SOURCES} in {deb}")
        release = version.split("-")[0]                     # 3.11.2-6+deb12u8 -> 3.11.2
        docs = build_documents(sources, {"release": release, "version": ".".join(release.split(".")[:2])})
        os.makedirs(out_dir, exist_ok=True)
        shutil.copyfile(os.path.join(root, COPYRIGHT), os.path.join(out_dir, "copyright"))   # licence texts
    train, heldout = split_documents(docs)
    _write_jsonl(os.path.join(out_dir, "train.jsonl"), train)
    _write_jsonl(os.path.join(out_dir, "heldout.jsonl"), heldout)
    manifest = {
        "package": package, "version": version, "deb": os.path.basename(deb), "deb_sha256": sha256,
        "source_files": len(sources), "excluded": sorted(EXCLUDE), "min_chars": MIN_CHARS,
        "split": f"heldout if sha1(path).digest()[0] % {HELDOUT_MOD} == 0",
        "train": {"documents": len(train), "characters": sum(len(d["text"]) for d in train)},
        "heldout": {"documents": len(heldout), "characters": sum(len(d["text"]) for d in heldout)},
        "license": LICENSE,
        "license_file": f"copyright (a copy of {COPYRIGHT} from the package: the PSF License Version 2 text and "
                        "the licences of incorporated software)",
    }
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--deb", help=f"an already downloaded {PACKAGE} .deb (default: apt-get download it)")
    args = ap.parse_args()
    m = build_corpus(args.out_dir, args.deb)
    print(f"{m['package']} {m['version']} (sha256 {m['deb_sha256'][:16]}...): {m['source_files']} source files")
    for split in ("train", "heldout"):
        print(f"{split}: {m[split]['documents']} documents, {m[split]['characters']:,} characters")
    print(f"written to {args.out_dir}")


if __name__ == "__main__":
    main()
