"""docs/formats.md is what testkit/formats_doc.py prints from the code: every record and rendering
on the page is the chat formats' own output, never hand-copied."""
from pathlib import Path

from testkit.formats_doc import page


def test_formats_page_is_current():
    doc = Path(__file__).resolve().parent.parent / "docs" / "formats.md"
    assert doc.read_text(encoding="utf-8") == page(), "regenerate: python -m testkit.formats_doc > docs/formats.md"
