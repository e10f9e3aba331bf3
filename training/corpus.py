"""The training corpus: the World English Bible (public domain), read out of Debian's SWORD module as text.

    apt-get install sword-text-web diatheke
    python -m training.corpus            # writes training/data/corpus.txt and training/data/heldout.txt

`diatheke -f OSIS` prints one verse per line, but each line starts with the section heading of its verse
(repeated for every verse, and wrong in places of the deuterocanon, where missing verses print a psalm
title), words are `<w>` elements that the source sometimes forgets to separate ("God</w><w>created"), and
the module's glossary trails the last verse. `clean_verse` and `parse_verses` undo exactly those.

The corpus file holds one chapter per paragraph: a heading line ("Genesis 1") and the chapter's verses on
one line, paragraphs separated by a blank line. The held-out split is the trailing whole books that
together hold at least `HELDOUT_FRACTION` of the characters (the end of the New Testament).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SWORD_MODULE = "engWEB2015eb"
# The whole module, canon and deuterocanon, in the module's own order.
FULL_RANGE = "Genesis 1:1-Revelation 22:21"
HELDOUT_FRACTION = 0.05
DATA_DIR = Path(__file__).resolve().parent / "data"
SOURCE_NOTE = (
    "World English Bible with Deuterocanon (SWORD module engWEB2015eb, Debian package "
    "sword-text-web), public domain; extracted with diatheke and cleaned by training/corpus.py"
)

# "Genesis 1:1: ", "I Samuel 3:4: ", "Song of Solomon 2:1: ", "Esther (Greek) 1:1: ", "Revelation of John 22:21: "
VERSE_KEY = re.compile(r"((?:I{1,3} |IV )?[A-Z][a-z]+(?: (?:of )?[A-Z][a-z]+)*(?: \(Greek\))?) (\d+):(\d+): ")
GLOSSARY_START = "The following words used in the World English Bible"
# The module's title for verses it lacks (deuterocanon versification gaps); never verse text.
MISSING_VERSE_TITLE = "A praise psalm by David."
ASCII_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'})


@dataclass(frozen=True)
class Verse:
    book: str
    chapter: int
    verse: int
    text: str


@dataclass(frozen=True)
class Chapter:
    book: str
    number: int
    text: str

    @property
    def heading(self) -> str:
        return f"{self.book} {self.number}"

    def as_paragraph(self) -> str:
        return f"{self.heading}\n{self.text}"


def read_osis(module: str = SWORD_MODULE, key_range: str = FULL_RANGE) -> str:
    """The module's text with its OSIS markup, as diatheke prints it."""
    if shutil.which("diatheke") is None:
        raise SystemExit("diatheke not found: apt-get install diatheke sword-text-web")
    done = subprocess.run(
        ["diatheke", "-b", module, "-f", "OSIS", "-k", key_range], capture_output=True, text=True, check=True
    )
    return done.stdout


def clean_verse(raw: str) -> str:
    """One verse's OSIS text -> plain text with ASCII quotes and single spaces."""
    text = raw.replace("</w><w>", "</w> <w>")  # adjacent words the source left unseparated
    text = re.sub(r"<title[^>]*>.*?</title>", " ", text)
    text = re.sub(r"<(?:milestone|lg|l)\b[^>]*>", " ", text)  # line breaks of poetry
    text = re.sub(r"<[^>]+>", "", text)  # <w> and the rest wrap words: no space of their own
    text = text.replace("[", " ").replace("]", "")  # brackets mark the Greek additions; not speech
    text = text.translate(ASCII_QUOTES)
    text = re.sub(r"([,;:!?])(?=[A-Za-z])", r"\1 ", text)  # "country,shunning": a space lost in the source
    text = re.sub(r"\.(?=[A-Z][a-z])", ". ", text)
    text = re.sub(r"(?<=[a-z]{2})(?=[A-Z][a-z])", " ", text)  # "ofTubias", "atCarnaim": the same loss
    return " ".join(text.split())


def parse_verses(osis: str) -> list[Verse]:
    """Verses in module order. A verse's text runs from its key to the last newline before the next key:
    what follows that newline is the next verse's repeated section heading, not verse text."""
    keys = list(VERSE_KEY.finditer(osis))
    verses = []
    for key, following in zip(keys, keys[1:] + [None]):
        body = osis[key.end() : following.start() if following else len(osis)]
        if following is not None and "\n" in body:
            body = body[: body.rfind("\n")]
        body = body.split(GLOSSARY_START, 1)[0]
        text = clean_verse(body)
        if text and text != MISSING_VERSE_TITLE:
            verses.append(Verse(key.group(1), int(key.group(2)), int(key.group(3)), text))
    return verses


def group_chapters(verses: list[Verse]) -> list[Chapter]:
    chapters: list[Chapter] = []
    current: list[Verse] = []
    for verse in verses + [None]:
        if current and (verse is None or (verse.book, verse.chapter) != (current[0].book, current[0].chapter)):
            chapters.append(Chapter(current[0].book, current[0].chapter, " ".join(v.text for v in current)))
            current = []
        if verse is not None:
            current.append(verse)
    return chapters


def split_heldout(chapters: list[Chapter], fraction: float = HELDOUT_FRACTION) -> tuple[list[Chapter], list[Chapter]]:
    """(train, held out): the held-out part is the trailing whole books holding >= `fraction` of the text."""
    total = sum(len(c.text) for c in chapters)
    cut, held = len(chapters), 0
    while cut > 0 and held < fraction * total:
        book = chapters[cut - 1].book
        while cut > 0 and chapters[cut - 1].book == book:
            cut -= 1
            held += len(chapters[cut].text)
    return chapters[:cut], chapters[cut:]


def write_chapters(chapters: list[Chapter], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(c.as_paragraph() for c in chapters) + "\n", encoding="utf-8")


def read_chapters(path: str | Path) -> list[Chapter]:
    """Chapters of a file written by `write_chapters` (or any text: a paragraph without a "Book N" heading
    becomes one chapter of book "text")."""
    chapters = []
    for paragraph in Path(path).read_text(encoding="utf-8").split("\n\n"):
        paragraph = paragraph.strip()
        if not paragraph:
            continue
        heading, _, body = paragraph.partition("\n")
        match = re.fullmatch(r"(.+) (\d+)", heading)
        if match and body:
            chapters.append(Chapter(match.group(1), int(match.group(2)), body.strip()))
        else:
            chapters.append(Chapter("text", len(chapters) + 1, " ".join(paragraph.split())))
    return chapters


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DATA_DIR / "corpus.txt", help="the whole corpus")
    parser.add_argument(
        "--heldout-out",
        type=Path,
        default=DATA_DIR / "heldout.txt",
        help="a copy of the held-out books alone (for router-gen and the tests)",
    )
    parser.add_argument("--heldout-fraction", type=float, default=HELDOUT_FRACTION)
    args = parser.parse_args(argv)
    chapters = group_chapters(parse_verses(read_osis()))
    train, heldout = split_heldout(chapters, args.heldout_fraction)
    write_chapters(chapters, args.out)
    write_chapters(heldout, args.heldout_out)
    books = list(dict.fromkeys(c.book for c in chapters))
    held_books = list(dict.fromkeys(c.book for c in heldout))
    print(
        f"{args.out}: {len(books)} books, {len(chapters)} chapters, {sum(len(c.text) for c in chapters):,} characters"
    )
    print(
        f"held out ({args.heldout_out}): {len(held_books)} books ({held_books[0]} .. {held_books[-1]}), "
        f"{sum(len(c.text) for c in heldout):,} characters; train: {len(train)} chapters"
    )


if __name__ == "__main__":
    main()
