"""The corpus extraction undoes the SWORD module's markup artefacts (training/corpus.py)."""

from training.corpus import (
    Chapter,
    clean_verse,
    group_chapters,
    parse_verses,
    read_chapters,
    split_heldout,
    write_chapters,
)

# The shapes diatheke -f OSIS prints: a repeated heading before each key, words as <w> elements, a missing
# verse filled with a psalm title, the glossary after the last verse.
OSIS = (
    'Genesis 1:1: <w>In</w> <w>the</w> <w>beginning</w>, <w>God</w><w>created</w> the heavens.<milestone type="line"/>\n'
    'A Psalm by David.  Genesis 1:2: <w>“Let</w> <w>there</w> be light,” he said.<milestone type="line"/>\n'
    '<title canonical="true" type="psalm">A praise psalm by David.</title> <lg sID="x"/>Tobit 6:18: <milestone type="line"/>\n'
    "A praise psalm by David.  Tobit 7:1: They came through the country,shunning all company ofTubias.\n"
    "Esther (Greek) 1:1: [In the second year]\n"
    "Revelation of John 22:21: The grace be with all. Amen.            The following words used in the World "
    "English Bible are not very common.\n"
)


def test_clean_verse_repairs_the_sources_lost_spaces():
    assert clean_verse("<w>God</w><w>created</w>") == "God created"
    assert clean_verse("<w>out</w>,<w>and</w> fled") == "out, and fled"
    assert clean_verse("land ofTubias") == "land of Tubias"
    assert clean_verse("<w>“Yes,”</w> he said, <w>‘no’</w>") == "\"Yes,\" he said, 'no'"
    assert clean_verse("end[of days]") == "end of days"


def test_parse_verses_drops_headings_missing_verses_and_the_glossary():
    verses = parse_verses(OSIS)
    assert [(v.book, v.chapter, v.verse) for v in verses] == [
        ("Genesis", 1, 1),
        ("Genesis", 1, 2),
        ("Tobit", 7, 1),
        ("Esther (Greek)", 1, 1),
        ("Revelation of John", 22, 21),
    ]
    assert verses[0].text == "In the beginning, God created the heavens."
    assert verses[1].text == '"Let there be light," he said.'  # not "A Psalm by David."
    assert verses[2].text == "They came through the country, shunning all company of Tubias."
    assert verses[-1].text == "The grace be with all. Amen."


def test_chapters_round_trip_and_the_heldout_split_takes_whole_trailing_books(tmp_path):
    chapters = group_chapters(parse_verses(OSIS))
    assert [c.heading for c in chapters] == ["Genesis 1", "Tobit 7", "Esther (Greek) 1", "Revelation of John 22"]
    write_chapters(chapters, tmp_path / "c.txt")
    assert read_chapters(tmp_path / "c.txt") == chapters
    books = [Chapter("A", 1, "x" * 90), Chapter("B", 1, "x" * 6), Chapter("B", 2, "x" * 2), Chapter("C", 1, "x" * 2)]
    train, heldout = split_heldout(books, 0.02)
    assert [c.book for c in heldout] == ["C"]  # C alone holds 2 % of the text
    train, heldout = split_heldout(books, 0.05)  # C is too little: B joins, whole
    assert [c.book for c in heldout] == ["B", "B", "C"] and [c.book for c in train] == ["A"]
